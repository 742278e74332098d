"""The host-side plan of a micro-step's forwards: which tokens run, laid out how, with or without grad.

Pure, vectorised functions of CPU tensors and Python ints (no model, no trainer state), so the executor (execute.py)
runs the plan without a host-device sync. One planner, two layouts of the same groups (docs/method.md, "Packed layout"):
- packed (`padding_free`, `share_prompt`): one row of segments from each row's real tokens, no padding. A row alone is
  one segment; a shared pair is [shared: positions 0..s-2 | chosen: s-1.. | rejected: s-1..] (s common leading tokens;
  position s-1 predicts a different token in each branch), each branch keyed on the shared part and itself. The
  attention metadata (cu_seq_q, cu_seq_k, kv_index, max_q, max_k) is what a varlen kernel takes (attention.py).
- padded (the fallback for models a packed row cannot express exactly): the batch's rows that run, trimmed.
Labels are pre-shifted (`shift_labels`): a position carries the token it predicts where some grid cell scores it, so a
row's last token never runs. Grid column c (TRL's shifted coordinates, masks.py) is the output of input position c.
"""

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from .masks import PruneMasks, from_first_real, pair_agreement, positions_needed


@dataclass
class HostBatch:
    """CPU copies of the collated token layout, attached by the collator so the plan never reads device tensors.

    Not a tensor and without `.to`: accelerate and `Trainer._prepare_inputs` pass it through unchanged.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    completion_mask: torch.Tensor


@dataclass
class PackedGroup:
    """One forward. shift_labels: (1, tokens) packed, (len(rows), width) padded; source: (rows, cols), the flat index
    of the output scoring each grid cell (-1: none); tokens executed, positions scored. Packed: input_ids, position_ids
    (1, tokens) and attention.Packing's metadata (host). Padded: the batch rows run, on columns 0..width-1."""

    shift_labels: torch.Tensor
    source: torch.Tensor
    tokens: int
    scored: int
    input_ids: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None
    cu_seq_q: torch.Tensor | None = None
    cu_seq_k: torch.Tensor | None = None
    kv_index: torch.Tensor | None = None
    max_q: int = 0
    max_k: int = 0
    bounds: tuple[list[int], list[int]] | None = None  # cu_seq_q, cu_seq_k as ints (the per-segment attention's)
    rows: torch.Tensor | None = None
    width: int = 0


@dataclass
class ForwardPlan:
    """A micro-step's policy forwards: with grad, and (branch pruning) under no_grad; pairs shared / split."""

    grad: PackedGroup
    frozen: PackedGroup | None
    shared_pairs: int
    split_pairs: int


def work_counts(host: HostBatch, masks: PruneMasks) -> dict[str, int]:
    """The micro-step's counts known from the plan alone (host ints: logging them needs no device sync)."""
    response = host.completion_mask[:, 1:].bool()
    return dict(
        positions_scored=int(masks.scored.sum()),
        grad_positions_scored=int(masks.scored[masks.backprop].sum()),
        tokens_needed=int(masks.executed.sum()),
        response_positions=int(response.sum()),
        chosen_response_positions=int(response.chunk(2)[0].sum()),
        rows=response.size(0),
        grad_rows=int(masks.backprop.sum()),
        full_tokens=host.input_ids.numel(),
    )


def real_tokens(host: HostBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, valid, offset): each row's real tokens moved to column 0 from its first real column `offset`."""
    valid = host.attention_mask.bool()
    offset = valid.long().argmax(dim=1)
    real = torch.arange(valid.size(1)) < valid.sum(dim=1, keepdim=True)
    return from_first_real(host.input_ids, offset), real, offset


def common_tokens(host: HostBatch) -> torch.Tensor:
    """(pairs,) long: how many leading real tokens the chosen and rejected row of each pair have in common."""
    ids, valid, _ = real_tokens(host)
    both = pair_agreement(ids, valid) & valid.chunk(2)[0]
    return both.long().cumprod(dim=1).sum(dim=1)


def _lengths(host: HostBatch, scored: torch.Tensor):
    """(offset, need): per row, its first real column and its positions to run (to its last scored column)."""
    _, _, offset = real_tokens(host)
    last = positions_needed(scored)  # grid column of the last scored cell + 1
    return offset, torch.where(last > 0, last - offset, 0)


def shared_length(common: torch.Tensor, need: torch.Tensor) -> torch.Tensor:
    """(pairs,) the shared segment of each pair: its s - 1 common positions, no longer than either branch needs."""
    chosen, rejected = need.chunk(2)
    return torch.minimum((common - 1).clamp(min=0), torch.maximum(chosen, rejected))


def plan_group(host: HostBatch, scored: torch.Tensor, run: torch.Tensor, share: torch.Tensor,
               packed: bool) -> PackedGroup:
    """One forward of the rows `run` ((rows,) bool), the pairs `share` ((pairs,) bool, both rows run) as shared items.

    Only positions up to each row's last scored column run (prefix pruning cuts branches early); only scored
    positions carry a label (position pruning: only they reach the LM head).
    """
    rows, cols = scored.shape
    pairs = rows // 2
    offset, need = _lengths(host, scored)
    if not bool((run & (need > 0)).any()):  # still run two tokens of row 0, labelling none: every process must run the
        # same modules in the same order (ZeRO-3/FSDP), and a grad group must stay connected to the graph
        run, scored, share = torch.arange(rows) == 0, torch.zeros_like(scored), share & False
        need = torch.where(run, 2 if packed else 1, 0)  # (the padded layout adds the label-only token)
    if not packed:  # the padded fallback: the batch's own rows, trimmed to the longest
        index = torch.nonzero(run & (need > 0)).flatten()
        # the rows' last token (a label only) runs too, as in stock's forward: the same kernels' round-off
        width = int((need + offset)[index].max()) + 1
        keep = F.pad(scored[index], (0, 1))[:, :width]
        labels = torch.where(keep, F.pad(host.input_ids[index, 1:], (0, 1))[:, :width], -100)
        flat = torch.arange(index.numel() * width).view(-1, width)
        source = torch.full(scored.shape, -1, dtype=torch.long)
        source[index, : width - 1] = torch.where(keep, flat, -1)[:, : width - 1]  # width - 1 <= cols
        return PackedGroup(labels, source, index.numel() * width, int(keep.sum()), rows=index, width=width)

    ids, _, _ = real_tokens(host)
    share = share & run[:pairs] & run[pairs:]
    shared = torch.where(share, shared_length(common_tokens(host), need), 0)
    pair = torch.arange(pairs)
    # per pair, three segments: [shared part (chosen's tokens), chosen, rejected]; a row alone is one segment
    seg_row = torch.stack([pair, pair, pair + pairs], dim=1)
    seg_start = torch.stack([torch.zeros_like(shared), shared, shared], dim=1)
    run_c, run_r = run[:pairs], run[pairs:]
    seg_end = torch.stack([shared, torch.where(run_c, need[:pairs].maximum(shared), shared),
                           torch.where(run_r, need[pairs:].maximum(shared), shared)], dim=1)
    seg_partner = torch.stack([torch.where(share, pair + pairs, -1), torch.full_like(pair, -1),
                               torch.full_like(pair, -1)], dim=1)  # a shared position scores for both rows
    length = (seg_end - seg_start).flatten()
    starts = torch.cat([torch.zeros(1, dtype=torch.long), length.cumsum(0)])
    pre_start = starts[:-1].view(pairs, 3)[:, :1].expand(pairs, 3).flatten()  # where the pair's shared part lies
    nonempty = length > 0
    seg_row, seg_start, seg_partner, pre_start, first, length = (
        x.flatten()[nonempty] for x in (seg_row, seg_start, seg_partner, pre_start, starts[:-1], length))

    # tokens: segment after segment
    total = int(length.sum())
    seg_of = torch.repeat_interleave(torch.arange(length.numel()), length)
    position = torch.arange(total) - first[seg_of] + seg_start[seg_of]  # the position id: the real-token index
    row = seg_row[seg_of]
    input_ids = ids[row, position]
    source = torch.full((rows, cols), -1, dtype=torch.long)
    token = torch.arange(total)
    labelled = torch.zeros(total, dtype=torch.bool)
    partner = seg_partner[seg_of]
    for dest, ok in ((row, torch.ones(total, dtype=torch.bool)), (partner.clamp(min=0), partner >= 0)):
        col = position + offset[dest]  # the grid column this position scores for row `dest`
        hit = ok & (col < cols) & scored[dest, col.clamp(max=cols - 1)]
        source[dest[hit], col[hit]] = token[hit]
        labelled |= hit
    shift_labels = torch.where(labelled, ids[row, (position + 1).clamp(max=ids.size(1) - 1)], -100)

    # keys: the pair's shared part (as long as a branch's start), then the segment itself (lower-right causal)
    keys = length + seg_start
    cu_k = torch.cat([torch.zeros(1, dtype=torch.long), keys.cumsum(0)])
    kseg = torch.repeat_interleave(torch.arange(keys.numel()), keys)
    j = torch.arange(int(cu_k[-1])) - cu_k[kseg]
    kv_index = torch.where(j < seg_start[kseg], pre_start[kseg] + j, first[kseg] + j - seg_start[kseg])
    cu_q = torch.cat([torch.zeros(1, dtype=torch.long), length.cumsum(0)])
    return PackedGroup(shift_labels.view(1, -1), source, total, int(labelled.sum()), input_ids.view(1, -1),
                       position.view(1, -1), cu_q.int(), cu_k.int(), kv_index, int(length.max()), int(keys.max()),
                       (cu_q.tolist(), cu_k.tolist()))


def shared_is_cheaper(shared, frozen_tail, grad_cost: float):
    """A pair with one backpropagated branch: shared, grad_cost * (shared + both tails), or split, grad_cost * (shared
    + grad tail) + 1 * (shared + frozen tail) (docs/method.md, "Branch pruning and sharing")? Shared wins iff
    (grad_cost - 1) * frozen_tail < shared. Ints or per-pair tensors."""
    return (grad_cost - 1) * frozen_tail < shared


def plan_policy(host: HostBatch, masks: PruneMasks, *, frozen_group: bool, grad_cost: float, share: bool,
                packed: bool) -> ForwardPlan:
    """The policy forwards; `frozen_group`: branch pruning is on (structural, the same on every process). Shared, a pair
    whose branches are both backpropagated (or both frozen) is one item; a pair with one of each is shared in the grad
    group (its frozen branch gets a zero gradient, Eq. 3) when cheaper than running that branch under no_grad."""
    scored, backprop = masks.scored.cpu(), masks.backprop.cpu()
    pairs = scored.size(0) // 2
    grad_c, grad_r = backprop.chunk(2)
    if share:
        _, need = _lengths(host, scored)
        shared = shared_length(common_tokens(host), need)
        frozen_tail = (torch.where(grad_c, need[pairs:], need[:pairs]) - shared).clamp(min=0)
        mixed = grad_c != grad_r
        share_grad = (grad_c & grad_r) | (mixed & shared_is_cheaper(shared, frozen_tail, grad_cost))
        share_frozen = ~grad_c & ~grad_r
    else:
        share_grad = share_frozen = mixed = torch.zeros(pairs, dtype=torch.bool)
    joined = torch.cat([share_grad, share_grad])
    grad = plan_group(host, scored, backprop | joined, share_grad, packed)
    frozen = plan_group(host, scored, ~backprop & ~joined, share_frozen, packed) if frozen_group else None
    return ForwardPlan(grad, frozen, int((share_grad | share_frozen).sum()), int((mixed & ~share_grad).sum()))


def plan_reference(host: HostBatch, scored: torch.Tensor, share: bool, packed: bool) -> PackedGroup:
    """The reference forward (never backpropagated): with sharing, every pair is one item, which always saves."""
    rows = scored.size(0)
    return plan_group(host, scored.cpu(), torch.ones(rows, dtype=torch.bool), torch.full((rows // 2,), share), packed)
