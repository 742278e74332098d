"""The host-side plan of a micro-step: its forwards (the policy's with grad and, pruning branches, without; the
reference's), their layout and the work they do, planned from token ids before anything runs on the device.

Pure functions of CPU tensors and Python ints (no model, no trainer state), built from the groups of packing.py (the
layout of one forward's tokens): `plan_micro_step` plans a micro-step from the collator's host copy of the batch and
the masks drawn from it, its policy forwards (`plan_policy`), its reference forward (`plan_reference`) and its work
counts (`WorkCounts`, host ints). The merged step sizes its passes by each micro-batch's unpruned tokens
(`unpruned_tokens`, `group_passes`).
"""

from dataclasses import asdict, dataclass
from typing import NamedTuple

import torch

from .masks import PruneMasks
from .packing import HostBatch, PackedGroup, plan_group, plan_split, row_trees


@dataclass
class ForwardPlan:
    """A micro-step's policy forwards: with grad, and (branch pruning) under no_grad; pairs whose prompt runs once /
    twice (none since the frozen rows read their shared part's keys: kept for the `prune/pairs_shared` metric)."""

    grad: PackedGroup
    frozen: PackedGroup | None
    shared_pairs: int
    split_pairs: int


def unpruned_tokens(host: HostBatch, share: bool) -> int:
    """The tokens a packed forward of the whole micro-batch runs with nothing pruned (the exact savings only). Pruning
    only removes tokens, so it bounds the micro-batch's policy forward under any masks, and it is known from the token
    ids alone, before the masks are drawn (the merged step groups micro-batches by it: `group_passes`)."""
    scored = host.completion_mask[:, 1:].bool()
    run = torch.ones(scored.size(0), dtype=torch.bool)
    return plan_group(host, scored, run, row_trees(host, share), True).tokens


def group_passes(tokens: list[int], budget: int) -> list[int]:
    """How many consecutive micro-batches each pass holds, in order: as many as fit in `budget` tokens (`tokens`: each
    micro-batch's), a micro-batch over the budget alone. In order because a pass runs in its last micro-batch's
    training step; greedy, which for consecutive runs under one capacity gives the fewest passes."""
    sizes, held = [], 0
    for count in tokens:
        if sizes and held + count <= budget:
            sizes[-1] += 1
            held += count
        else:
            sizes.append(1)
            held = count
    return sizes


def plan_policy(host: HostBatch, masks: PruneMasks, *, frozen_group: bool, share: bool, packed: bool) -> ForwardPlan:
    """The policy forwards; `frozen_group`: branch pruning is on (structural, the same on every process): the
    backpropagated rows run with grad, the others under no_grad. Packed, the two are one forest's nodes
    (`plan_split`): a frozen row runs only what no backpropagated row runs, so pruning branches never runs more
    tokens than the same rows unpruned, and every prompt runs once."""
    scored, backprop = masks.scored.cpu(), masks.backprop.cpu()
    trees = row_trees(host, share)
    if not frozen_group:
        grad, frozen = plan_group(host, scored, backprop, trees, packed), None
    elif packed:
        grad, frozen = plan_split(host, scored, backprop, trees)
    else:
        grad, frozen = (plan_group(host, scored, rows, trees, False) for rows in (backprop, ~backprop))
    return ForwardPlan(grad, frozen, scored.size(0) // 2 if share else 0, 0)


def plan_reference(host: HostBatch, scored: torch.Tensor, share: bool, packed: bool) -> PackedGroup:
    """The reference forward (never backpropagated): with sharing, each prompt group is one tree, which always saves."""
    rows = scored.size(0)
    return plan_group(host, scored.cpu(), torch.ones(rows, dtype=torch.bool), row_trees(host, share), packed)


class Layout(NamedTuple):
    """How a micro-step's rows run: `packed` (one row of segments, no padding), `share` (with each prompt once)."""

    packed: bool
    share: bool


@dataclass(frozen=True)
class WorkCounts:
    """What a micro-step executes and scores, known from its plan alone (host ints: logging them reads no device).

    Tokens and positions of the stacked [chosen; rejected] batch: `full_tokens` is stock's padded batch; the
    reference's are 0 where it does not run (precomputed); `shared_pairs` and `split_pairs` (pairs whose branches
    ran in one tree, or in the grad and the frozen forward) are None without prompt sharing."""

    positions_scored: int
    grad_positions_scored: int
    tokens_needed: int
    response_positions: int
    chosen_response_positions: int
    rows: int
    grad_rows: int
    full_tokens: int
    policy_tokens_executed: int
    grad_tokens_executed: int
    reference_tokens_executed: int = 0
    reference_positions_scored: int = 0
    shared_pairs: int | None = None
    split_pairs: int | None = None

    def as_dict(self) -> dict[str, int]:
        """The counts that apply, by name."""
        return {name: value for name, value in asdict(self).items() if value is not None}


@dataclass(frozen=True)
class MicroStepPlan:
    """One training micro-step, planned on the host from token ids before anything runs on the device.

    `step`: (global step, micro-step) of the draw; `options`: the draw's sampling keywords (`masks.draw_masks`'s, with
    "auto" probabilities chosen); `masks`: the host copy of the draw; `policy`: the grad (and, pruning branches, the
    frozen) forward; `reference`: the reference forward, None where the reference is precomputed; `means`: (name,
    total, count) of the run's means this draw adds to (what "auto" chose)."""

    step: tuple[int, int]
    options: dict
    host: HostBatch
    masks: PruneMasks
    layout: Layout
    policy: ForwardPlan
    reference: PackedGroup | None
    counts: WorkCounts
    means: tuple[tuple[str, float, float], ...] = ()

    @property
    def prunes_branches(self) -> bool:
        """Whether a frozen (no-grad) forward runs: branch pruning is on this step (the same on every process)."""
        return self.policy.frozen is not None


def plan_micro_step(step: tuple[int, int], options: dict, host: HostBatch, masks: PruneMasks, layout: Layout, *,
                    prunes_branches: bool, reference_scored: torch.Tensor | None,
                    means: tuple = ()) -> MicroStepPlan:
    """The whole host side of a micro-step: its policy forwards, its reference forward on `reference_scored` (None:
    precomputed, nothing runs) and its work counts, from the batch's host copy and the masks drawn from it."""
    policy = plan_policy(host, masks, frozen_group=prunes_branches, share=layout.share, packed=layout.packed)
    reference = None
    if reference_scored is not None:
        reference = plan_reference(host, reference_scored, layout.share, layout.packed)
    response = host.completion_mask[:, 1:].bool()
    frozen_tokens = policy.frozen.tokens if policy.frozen is not None else 0
    # The mask sums in one read (host tensors: no device sync, one dispatch instead of six).
    sums = torch.stack([masks.scored.sum(), masks.scored[masks.backprop].sum(), masks.executed.sum(), response.sum(),
                        response.chunk(2)[0].sum(), masks.backprop.sum()]).tolist()
    counts = WorkCounts(
        positions_scored=sums[0],
        grad_positions_scored=sums[1],
        tokens_needed=sums[2],
        response_positions=sums[3],
        chosen_response_positions=sums[4],
        rows=response.size(0),
        grad_rows=sums[5],
        full_tokens=host.input_ids.numel(),
        policy_tokens_executed=policy.grad.tokens + frozen_tokens,
        grad_tokens_executed=policy.grad.tokens,
        reference_tokens_executed=reference.tokens if reference is not None else 0,
        reference_positions_scored=reference.scored if reference is not None else 0,
        shared_pairs=policy.shared_pairs if layout.share else None,
        split_pairs=policy.split_pairs if layout.share else None,
    )
    return MicroStepPlan(step, options, host, masks, layout, policy, reference, counts, tuple(means))
