"""The host-side layout of one forward: which of a micro-batch's tokens run, packed or padded, with or without grad,
and which output scores each grid cell (`PackedGroup`). The micro-step's plan built from these groups is plan.py.

Pure, vectorised functions of CPU tensors and Python ints (no model, no trainer state), so the executor
(pruned_forward.py) runs the plan without a host-device sync. One planner, two layouts of the same groups
(docs/method.md, "Packed layout"):
- packed (`padding_free`, `share_prompt`): one row of segments from each row's real tokens, no padding. A row alone is
  one segment; a shared pair is [shared: positions 0..s-2 | chosen: s-1.. | rejected: s-1..] (s common leading tokens;
  position s-1 predicts a different token in each branch), each branch keyed on the shared part and itself. The
  attention metadata (cu_seq_q, cu_seq_k, kv_index, max_q, max_k) is what a varlen kernel takes (seam/attention.py).
- padded (the fallback for models a packed row cannot express exactly): the batch's rows that run, trimmed.
Branch pruning, packed: the backpropagated rows' forward (with grad) and the others' (no_grad) run the nodes of one
forest, so a frozen row runs only what no backpropagated row runs; its shared part (prompt, common response start) it
reads as the grad forward's keys and values (`plan_split`; kernels.SharedKeys).
Labels are pre-shifted (`shift_labels`): a position carries the token it predicts where some grid cell scores it, so a
row's last token never runs. Grid column c (TRL's shifted coordinates, masks.py) is the output of input position c.
The merged step lays several micro-batches' packed groups end to end (`concat_groups`) and cuts each one's grid back
out (`split_grid`).
"""

from dataclasses import dataclass, field

import torch
from torch.nn import functional as F

from .masks import from_first_real, pair_agreement, positions_needed
from .tree import Forest, build_forest, locate


@dataclass
class HostBatch:
    """CPU copies of the collated token layout, attached by the collator so the plan never reads device tensors.

    Not a tensor and without `.to`: accelerate and `Trainer._prepare_inputs` pass it through unchanged.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    completion_mask: torch.Tensor
    # what the plan derives from the token ids alone, once per batch (several plans read it: policy, reference)
    derived: dict = field(default_factory=dict, init=False, repr=False, compare=False)


@dataclass
class PackedGroup:
    """One forward. shift_labels: (1, tokens) packed, (len(rows), width) padded; source: (rows, cols), the flat index
    of the output scoring each grid cell (-1: none); tokens executed, positions scored. Packed: input_ids, position_ids
    (1, tokens) and kernels.Packing's metadata (host). Padded: the batch rows run, on columns 0..width-1."""

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
    # Branch pruning (`plan_split`): the grad group's tokens whose keys and values the frozen group reads, and in the
    # frozen group how many such keys come before its own (its kv_index counts into [kept ; its own tokens]).
    keeps: torch.Tensor | None = None
    reads: int = 0



def real_tokens(host: HostBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, valid, offset): each row's real tokens moved to column 0 from its first real column `offset`."""
    if "real" not in host.derived:
        valid = host.attention_mask.bool()
        offset = valid.long().argmax(dim=1)
        real = torch.arange(valid.size(1)) < valid.sum(dim=1, keepdim=True)
        host.derived["real"] = from_first_real(host.input_ids, offset), real, offset
    return host.derived["real"]


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


def prompt_groups(host: HostBatch) -> torch.Tensor:
    """(pairs,) long: each pair's prompt group, the first pair of the micro-batch whose chosen row has the same prompt
    tokens (its real tokens before the completion). Pairs of one group share their prompt in the packed layout."""
    ids, valid, offset = real_tokens(host)
    completion = from_first_real(host.completion_mask, offset).bool() & valid
    prompt = valid & (completion.long().cumsum(dim=1) == 0)
    pairs = ids.size(0) // 2
    width = max(int(prompt[:pairs].sum(dim=1).max()), 1)
    key = torch.where(prompt[:pairs, :width], ids[:pairs, :width], -1)
    _, inverse = torch.unique(key, dim=0, return_inverse=True)
    first = torch.full((pairs,), pairs, dtype=torch.long).scatter_reduce(0, inverse, torch.arange(pairs), "amin")
    return first[inverse]


def pair_trees(share: torch.Tensor) -> torch.Tensor:
    """(rows,) tree ids (tree.py) when only the two rows of a pair may share (`share`: (pairs,) bool): a shared pair's
    rows are one tree, every other row its own (ordered pair by pair, as rows were packed before prompt groups)."""
    pairs = share.numel()
    pair = torch.arange(2 * pairs) % pairs
    side = torch.arange(2 * pairs) // pairs
    return 2 * pair + torch.where(share[pair], 0, side)


def row_trees(host: HostBatch, share: bool) -> torch.Tensor:
    """(rows,) tree ids: with sharing, every row of a prompt group is one tree (its prompt once, each distinct
    response once); without, each row its own."""
    pairs = host.input_ids.size(0) // 2
    if not share:
        return pair_trees(torch.zeros(pairs, dtype=torch.bool))
    if "trees" not in host.derived:
        host.derived["trees"] = 2 * prompt_groups(host).repeat(2)
    return host.derived["trees"]


def plan_group(host: HostBatch, scored: torch.Tensor, run: torch.Tensor, trees: torch.Tensor,
               packed: bool) -> PackedGroup:
    """One forward of the rows `run` ((rows,) bool); rows of equal `trees` id ((rows,) long, `row_trees`) share their
    common leading tokens (packed only: the radix tree of their sequences, tree.py).

    Only positions up to each row's last scored column run (prefix pruning cuts branches early); only scored
    positions carry a label (position pruning: only they reach the LM head). The same group asked twice of one batch
    (the reference's plan is the policy's when nothing is pruned) is planned once.
    """
    asked = (scored, run, trees, packed)
    done = host.derived.get("group")
    if done is not None and done[0][3] == packed and all(torch.equal(a, b) for a, b in zip(asked[:3], done[0][:3])):
        return done[1]
    group = _plan_group(host, scored, run, trees, packed)
    host.derived["group"] = (asked, group)
    return group


def _plan_group(host: HostBatch, scored: torch.Tensor, run: torch.Tensor, trees: torch.Tensor,
                packed: bool) -> PackedGroup:
    rows, cols = scored.shape
    offset, need = _lengths(host, scored)
    if not bool((run & (need > 0)).any()):  # still run two tokens of row 0, labelling none: every process must run the
        # same modules in the same order (ZeRO-3/FSDP), and a grad group must stay connected to the graph
        run, scored = torch.arange(rows) == 0, torch.zeros_like(scored)
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
    forest = _forest(host, torch.where(run & (need > 0), need + 1, 0), trees)
    every = torch.ones(forest.start.numel(), dtype=torch.bool)
    return _pack(host, forest, every, scored, offset, _firsts(forest, every))


def _forest(host: HostBatch, length: torch.Tensor, trees: torch.Tensor) -> Forest | None:
    """The forest of the rows' sequences ids[r, :length[r]] (tree.py), built once per batch for the same lengths and
    trees: the policy's forest under branch pruning is the reference's (same masks)."""
    done = host.derived.get("forest")
    if done is not None and torch.equal(done[0][0], length) and torch.equal(done[0][1], trees):
        return done[1]
    ids, _, _ = real_tokens(host)
    forest = build_forest(ids, length, trees)
    host.derived["forest"] = ((length, trees), forest)
    return forest


def _firsts(forest: Forest, runs: torch.Tensor) -> torch.Tensor:
    """(nodes,) where each node of `runs` ((nodes,) bool) starts among their tokens laid out in the forest's order."""
    length = torch.where(runs, forest.end - forest.start, 0)
    return length.cumsum(0) - length


def _pack(host: HostBatch, forest: Forest, runs: torch.Tensor, scored: torch.Tensor, offset: torch.Tensor,
          key_at: torch.Tensor) -> PackedGroup:
    """One packed row: the forest's nodes `runs` ((nodes,) bool) in its order (each tree's preorder), each a segment
    keyed on its ancestors' tokens then itself (positions 0 .. end - 1; lower-right causal). `key_at`: (nodes,) where
    each key node's tokens start among the keys the attention gathers from (the row's own tokens, after those kept from
    another forward when it reads some). Each scored cell whose node the row runs reads that node's output."""
    ids, _, _ = real_tokens(host)
    rows, cols = scored.shape
    first = _firsts(forest, runs)
    nodes = torch.nonzero(runs).flatten()
    length = forest.end[nodes] - forest.start[nodes]
    total = int(length.sum())
    node_of = torch.repeat_interleave(nodes, length)
    position = torch.arange(total) - first[node_of] + forest.start[node_of]  # the position id
    reader = forest.reader[node_of]
    input_ids = ids[reader, position]

    # each scored cell reads the output of the node on its row's path that runs its position, where this row runs it
    row, col = torch.nonzero(scored & (forest.distinct >= 0)[:, None], as_tuple=True)
    at = col - offset[row]
    node = locate(forest.row_key, forest.row_node, forest.distinct[row], at)
    mine = runs[node]
    row, col = row[mine], col[mine]
    node, at = node[mine], at[mine]
    token = first[node] + at - forest.start[node]
    source = torch.full((rows, cols), -1, dtype=torch.long)
    source[row, col] = token
    labelled = torch.zeros(total, dtype=torch.bool)
    labelled[token] = True
    shift_labels = torch.where(labelled, ids[reader, (position + 1).clamp(max=ids.size(1) - 1)], -100)

    # keys: each record of `key_nodes` (node by node, root first) lays its node's tokens next
    records = runs[forest.key_owner]
    key_nodes = forest.key_nodes[records]
    keys = forest.end[nodes]
    cu_k = torch.cat([torch.zeros(1, dtype=torch.long), keys.cumsum(0)])
    held = forest.end[key_nodes] - forest.start[key_nodes]
    before = torch.cat([torch.zeros(1, dtype=torch.long), held.cumsum(0)[:-1]])
    kv_index = torch.repeat_interleave(key_at[key_nodes] - before, held) + torch.arange(int(cu_k[-1]))
    cu_q = torch.cat([torch.zeros(1, dtype=torch.long), length.cumsum(0)])
    return PackedGroup(shift_labels.view(1, -1), source, total, int(labelled.sum()), input_ids.view(1, -1),
                       position.view(1, -1), cu_q.int(), cu_k.int(), kv_index, int(length.max()), int(keys.max()),
                       (cu_q.tolist(), cu_k.tolist()))


def plan_split(host: HostBatch, scored: torch.Tensor, backprop: torch.Tensor,
               trees: torch.Tensor) -> tuple[PackedGroup, PackedGroup]:
    """Branch pruning, packed: the grad and the frozen group as the nodes of one forest of every row that runs.

    A node on a backpropagated row's path runs in the grad group (with grad; it runs positions that row needs, so the
    grad group is the backpropagated rows' own forest), every other node in the frozen group (no_grad). A frozen
    node's keys are its ancestors' tokens then its own: ancestors of the grad group (the prompt, a response start
    shared with a backpropagated row) are read from the grad forward's keys and values, kept detached for the tokens
    the frozen group reads (`keeps`, kernels.SharedKeys), never run again. The two groups run each node once: the
    tokens of the unpruned forward, whatever the draw. A scored cell of a frozen row in a grad node reads the grad
    group's output: its gradient is scaled by z = 0 (Eq. 3), as when a frozen row ran in the grad forward.
    When one group has no node, the other runs every row and the empty one its two tokens (`_plan_group`)."""
    offset, need = _lengths(host, scored)
    forest = _forest(host, torch.where(need > 0, need + 1, 0), trees)
    if forest is None:
        grad = torch.zeros(0, dtype=torch.bool)
    else:
        grad = forest.path_nodes(forest.distinct[backprop & (need > 0)])
    if not bool(grad.any()) or bool(grad.all()):
        runs_all = torch.full_like(backprop, bool(grad.any()))
        return plan_group(host, scored, runs_all, trees, True), plan_group(host, scored, ~runs_all, trees, True)
    frozen = ~grad
    # the grad nodes whose tokens a frozen node reads as keys (its grad ancestors), kept in the forest's order
    kept = torch.zeros_like(grad)
    kept[forest.key_nodes[frozen[forest.key_owner] & grad[forest.key_nodes]]] = True
    grad_first, kept_first = _firsts(forest, grad), _firsts(forest, kept)
    reads = int((forest.end - forest.start)[kept].sum())
    grad_group = _pack(host, forest, grad, scored, offset, grad_first)
    if reads:  # (rows of their own trees share nothing: padding_free without share_prompt)
        nodes = torch.nonzero(kept).flatten()
        held = forest.end[nodes] - forest.start[nodes]
        grad_group.keeps = torch.repeat_interleave(grad_first[nodes] - kept_first[nodes], held) + torch.arange(reads)
    frozen_group = _pack(host, forest, frozen, scored, offset,
                         torch.where(frozen, reads + _firsts(forest, frozen), kept_first))
    frozen_group.reads = reads
    return grad_group, frozen_group

def concat_groups(groups: list[PackedGroup]) -> PackedGroup:
    """One packed forward of several micro-batches' packed groups, laid end to end (the merged step): token ids,
    positions and labels concatenated; each segment keeps its own keys, its indices shifted by the tokens (and its key
    offsets by the keys) of the groups before it. `source` stacks the groups' grids, each below the previous one and
    padded with -1 to the widest, its cells shifted by the tokens before it: `split_grid` cuts each grid back out.

    Branch pruning's split groups (`plan_split`) concatenate too, the grad groups and the frozen groups each: the
    merged grad group keeps every micro-batch's kept tokens in order (`keeps`, shifted by its tokens before), so the
    merged frozen group reads [every micro-batch's kept keys ; every micro-batch's own tokens], and each frozen index is
    moved to its micro-batch's place in that order (`reads` is the kept keys of all of them)."""
    if any(group.rows is not None for group in groups):
        raise ValueError("concat_groups takes packed groups only (the padded layout runs each micro-batch alone).")
    starts = torch.tensor([0] + [group.tokens for group in groups]).cumsum(0)
    key_starts = torch.tensor([0] + [int(group.cu_seq_k[-1]) for group in groups]).cumsum(0)
    read_starts = torch.tensor([0] + [group.reads for group in groups]).cumsum(0)
    reads = int(read_starts[-1])
    cols = max(group.source.size(1) for group in groups)
    sources = [torch.where(g.source >= 0, g.source + start, -1) for g, start in zip(groups, starts.tolist())]
    source = torch.cat([F.pad(s, (0, cols - s.size(1)), value=-1) for s in sources])
    zero = torch.zeros(1, dtype=groups[0].cu_seq_q.dtype)
    cu_q = torch.cat([zero] + [g.cu_seq_q[1:] + start for g, start in zip(groups, starts.tolist())])
    cu_k = torch.cat([zero] + [g.cu_seq_k[1:] + start for g, start in zip(groups, key_starts.tolist())])
    # A frozen index below its group's `reads` is a kept key (now after the earlier groups' kept keys), any other one
    # of its own tokens (now after every kept key and the earlier groups' tokens).
    kv_index = torch.cat([
        torch.where(g.kv_index < g.reads, g.kv_index + kept_before, g.kv_index - g.reads + reads + start)
        for g, start, kept_before in zip(groups, starts.tolist(), read_starts.tolist())])
    kept = [g.keeps + start for g, start in zip(groups, starts.tolist()) if g.keeps is not None]
    return PackedGroup(torch.cat([g.shift_labels for g in groups], dim=1), source, int(starts[-1]),
                       sum(g.scored for g in groups), torch.cat([g.input_ids for g in groups], dim=1),
                       torch.cat([g.position_ids for g in groups], dim=1), cu_q, cu_k, kv_index,
                       max(g.max_q for g in groups), max(g.max_k for g in groups), (cu_q.tolist(), cu_k.tolist()),
                       keeps=torch.cat(kept) if kept else None, reads=reads)


def split_grid(grid: torch.Tensor, shapes: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Each micro-batch's (rows, cols) grid back out of a merged forward's stacked grid (`concat_groups`'s `source`
    gathered): its rows in order, its own columns."""
    pieces = grid.split([rows for rows, _ in shapes])
    return [piece[:, :cols] for piece, (_, cols) in zip(pieces, shapes)]
