"""The host-side plan of a micro-step's forwards: which tokens run, packed how, with or without grad.

Pure functions of CPU tensors and Python ints, no model and no trainer state: everything here is decided before the
batch reaches the device, so the executor (execute.py) runs it without a single host-device sync.

Shared prompts (docs/method.md, "Packed layout"). Chosen and rejected of a pair start with the same prompt and often
the same response start; `s` tokens in common. Their hidden states at positions 0..s-2 are identical in both rows and
predict the same next token, so they run once: a pair is one packed *item*

    [ shared: positions 0..s-2 | chosen: positions s-1..  | rejected: positions s-1.. ]

with position ids that restart at s-1 for each branch, each branch attending to the shared part and to itself only.
Position s-1 (the last common token) is run once per branch because it predicts a different next token in each.
Labels are pre-shifted (`shift_labels`): a position is labelled with the token it predicts, so the trailing token a row
only needs as a label is never executed. Items are packed first-fit-decreasing into rows no longer than the longest
item (so a dense mask never grows past what the longest pair needs), and padding sits only at the ends of rows.

Columns are TRL's shifted coordinates (masks.py): column c of a (rows, cols) per-token tensor is the log-prob of input
token c + 1, i.e. the output of input position c.
"""

from dataclasses import dataclass

import torch

from .masks import PruneMasks, pair_agreement, positions_needed

SHARED, CHOSEN, REJECTED = 0, 1, 2  # segment ids inside an item; a lone row is one SHARED segment


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
    """One forward: packed rows and where each output lands in the (rows, cols) per-token grid.

    input_ids, position_ids, shift_labels, item, segment: (packed_rows, width) long. `item` numbers the items of a row
    (-1 on padding), `segment` says SHARED/CHOSEN/REJECTED; together they define the attention mask (execute.py).
    source: (rows, cols) long, flat index into the packed outputs of the position scoring each grid cell, -1 if none.
    tokens: real (non-padding) tokens executed; scored: positions through the LM head; width: packed row length.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    shift_labels: torch.Tensor
    item: torch.Tensor
    segment: torch.Tensor
    source: torch.Tensor
    tokens: int
    scored: int
    width: int


@dataclass
class ForwardPlan:
    """The policy forwards of a micro-step: a group run with grad and (with branch pruning) one under no_grad.

    shared_pairs / split_pairs: pairs run as one shared item / as two separate rows (the cost model's choice).
    """

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


def unshared_rows(
    scored: torch.Tensor, executed: torch.Tensor, selected: torch.Tensor
) -> tuple[torch.Tensor, int, int]:
    """The unshared forward of the `selected` rows that execute anything: their indices, the width they are trimmed
    to (the longest executed row) and how many positions they score. An empty group runs 2 tokens (see `pack`)."""
    rows = torch.nonzero((executed > 0) & selected).flatten()
    if rows.numel() == 0:
        return rows, 2, 0
    return rows, int(executed[rows].max()), int(scored[rows].sum())


def common_tokens(host: HostBatch) -> list[int]:
    """Per pair, the number s of leading tokens its chosen and rejected rows have in common (prompt included)."""
    valid = host.attention_mask.bool()
    both = pair_agreement(host.input_ids, valid) & valid.chunk(2)[0]
    return both.long().cumprod(dim=1).sum(dim=1).tolist()


def _item_segments(pair: int, pairs: int, rows: tuple[int, ...], s: int, need: list[int]):
    """(source row, start, end, segment, destination rows) of an item: a shared pair, or a lone row."""
    if len(rows) == 1:
        (row,) = rows
        return [(row, 0, need[row], SHARED, (row,))]
    chosen, rejected = pair, pair + pairs
    shared = min(max(s - 1, 0), max(need[chosen], need[rejected]))
    segments = [(chosen, 0, shared, SHARED, (chosen, rejected))]
    for row, segment in ((chosen, CHOSEN), (rejected, REJECTED)):
        if need[row] > shared:
            segments.append((row, shared, need[row], segment, (row,)))
    return segments


def pack(
    host: HostBatch,
    scored: torch.Tensor,
    items: list[tuple[int, tuple[int, ...]]],
    common: list[int],
    multiple: int = 1,
) -> PackedGroup:
    """Pack `items` ((pair, rows): both rows of a pair shared, or one row alone) into one forward.

    Only positions up to each row's last scored column run (prefix pruning cuts branches early); only scored positions
    carry a label (position pruning: only they reach the LM head). An empty group still runs two tokens of row 0 with
    no label: every process must run the same modules in the same order (ZeRO-3/FSDP), and a grad group must stay
    connected to the graph. `multiple`: round the row length up to it (FlexAttention compiles per shape and works in
    blocks of 128: fewer distinct shapes, no partial block).
    """
    ids = host.input_ids
    pairs, cols = ids.size(0) // 2, scored.size(1)
    need = positions_needed(scored).tolist()
    built = []  # per item: list of segments with their lengths
    for pair, rows in items:
        segments = [seg for seg in _item_segments(pair, pairs, rows, common[pair], need) if seg[2] > seg[1]]
        length = sum(end - start for _, start, end, _, _ in segments)
        if length:
            built.append((length, segments))
    if not built:
        built = [(2, [(0, 0, 2, SHARED, ())])]
    # first-fit decreasing into rows of the longest item's length
    built.sort(key=lambda b: -b[0])
    width = built[0][0]
    packed_rows: list[list] = []
    free: list[int] = []
    for length, segments in built:
        for r, room in enumerate(free):
            if room >= length:
                packed_rows[r].append(segments)
                free[r] -= length
                break
        else:
            packed_rows.append([segments])
            free.append(width - length)

    shape = (len(packed_rows), -(-width // multiple) * multiple)
    input_ids = torch.zeros(shape, dtype=torch.long)
    position_ids = torch.zeros(shape, dtype=torch.long)
    shift_labels = torch.full(shape, -100, dtype=torch.long)
    item = torch.full(shape, -1, dtype=torch.long)
    segment = torch.zeros(shape, dtype=torch.long)
    source = torch.full((ids.size(0), cols), -1, dtype=torch.long)
    tokens = 0
    for r, row_items in enumerate(packed_rows):
        at = 0
        for number, segments in enumerate(row_items):
            for row, start, end, kind, destinations in segments:
                span = slice(at, at + end - start)
                positions = torch.arange(start, end)
                input_ids[r, span] = ids[row, start:end]
                position_ids[r, span] = positions
                item[r, span] = number
                segment[r, span] = kind
                # position c predicts token c + 1 = shifted column c; label it only where some destination scores it
                in_grid = positions < cols
                wanted = torch.zeros(end - start, dtype=torch.bool)
                for dest in destinations:
                    wanted[in_grid] |= scored[dest, positions[in_grid]]
                labels = torch.full((end - start,), -100, dtype=torch.long)
                labels[wanted] = ids[row, positions[wanted] + 1]
                shift_labels[r, span] = labels
                flat = r * shape[1] + at + torch.arange(end - start)
                for dest in destinations:
                    hit = wanted & in_grid
                    hit[in_grid] &= scored[dest, positions[in_grid]]
                    source[dest, positions[hit]] = flat[hit]
                at += end - start
        tokens += at
    # the padding tail of a row repeats its last position id: harmless (it attends only to padding, scores nothing)
    scored_positions = int((shift_labels != -100).sum())
    return PackedGroup(input_ids, position_ids, shift_labels, item, segment, source, tokens, scored_positions, shape[1])


def shared_is_cheaper(shared: int, frozen_tail: int, grad_cost: float) -> bool:
    """A pair with one backpropagated branch: run it as one shared item (all with grad), or split it?

    Shared: grad_cost * (shared + both tails). Split: grad_cost * (shared + grad tail) + 1 * (shared + frozen tail),
    a no-grad forward costing 1 unit per token (docs/method.md, "Branch pruning and sharing"). Shared wins iff
    (grad_cost - 1) * frozen_tail < shared.
    """
    return (grad_cost - 1) * frozen_tail < shared


def plan_policy(
    host: HostBatch, masks: PruneMasks, *, frozen_group: bool, grad_cost: float, common: list[int], multiple: int = 1
) -> ForwardPlan:
    """The shared policy forwards. `frozen_group`: branch pruning is on (structural, the same on every process).

    A pair whose branches are both backpropagated (or both frozen) is one shared item; a pair with one of each is
    shared in the grad group (its frozen branch then runs with grad and gets a zero gradient, Eq. 3) when that is
    cheaper than running the frozen branch separately under no_grad, and split otherwise.
    """
    scored, backprop = masks.scored.cpu(), masks.backprop.cpu().tolist()
    pairs = scored.size(0) // 2
    need = positions_needed(scored).tolist()
    grad_items, frozen_items = [], []
    shared_pairs = split_pairs = 0
    for pair in range(pairs):
        chosen, rejected = pair, pair + pairs
        z = (backprop[chosen], backprop[rejected])
        if z[0] == z[1]:
            (grad_items if z[0] else frozen_items).append((pair, (chosen, rejected)))
            shared_pairs += 1
            continue
        grad_row, frozen_row = (chosen, rejected) if z[0] else (rejected, chosen)
        shared = min(max(common[pair] - 1, 0), max(need[chosen], need[rejected]))
        if shared_is_cheaper(shared, max(need[frozen_row] - shared, 0), grad_cost):
            grad_items.append((pair, (chosen, rejected)))
            shared_pairs += 1
        else:
            grad_items.append((pair, (grad_row,)))
            frozen_items.append((pair, (frozen_row,)))
            split_pairs += 1
    grad = pack(host, scored, grad_items, common, multiple)
    frozen = pack(host, scored, frozen_items, common, multiple) if frozen_group else None
    return ForwardPlan(grad, frozen, shared_pairs, split_pairs)


def plan_reference(host: HostBatch, scored: torch.Tensor, common: list[int], multiple: int = 1) -> PackedGroup:
    """The shared reference forward (never backpropagated): every pair is one item, which always saves."""
    scored = scored.cpu()
    pairs = scored.size(0) // 2
    return pack(host, scored, [(pair, (pair, pair + pairs)) for pair in range(pairs)], common, multiple)
