"""Estimator variants measured by the study but not (yet) in the trainer: proposals, with their evidence in
docs/quality.md. They subclass or drive `PrunedDPOTrainer` from outside and do not touch its code.

1. Pair-shared masks (mask law "pair"): common random numbers across a pair. The position mask is drawn
   once per pair over response offsets and applied to both the chosen and the rejected row, and the prefix cut uses
   the same coin and the same uniform for both rows. Each row's masks keep exactly the marginal law of
   `masks.draw_masks` (Bernoulli(p_pos) per position, the same prefix inclusion probabilities q_t), so each D^_b is
   still unbiased with the same weights; what changes is the *joint* law. Within a pair the responses start at the
   same column, so a token of the common prefix is kept in both rows or in neither (its terms cancel in
   D^_w - D^_l, as they do in D_w - D_l), and after the planted mistake the aligned tokens of the near-copy, whose
   log-ratios and gradients nearly agree, are kept together too. Variance of the difference falls; the cost is the
   same (docs/method.md "Exact savings", derived in the project's METHOD: "drawing the same mask for both branches on their common prefix has the same
   effect", here extended past the prefix). The trainer adopted it for position masks in e6821e9, and draws one prefix
   cut per micro-batch since 6e59660 (shared within pairs too). Mask law "row" keeps the trainer's original law (every
   row on its own) so the comparison stays reproducible.

2. Balanced branch sampling (`balanced=True`): paired branch sampling at p = 1/2 backpropagates one branch per
   pair, the chosen one or the rejected one by a fair coin per pair. Balanced draws a random half of the pairs of
   the micro-batch to backpropagate their chosen branch and the other half their rejected branch (an odd pair out
   gets a coin): every branch keeps inclusion probability 1/2, so the estimator stays unbiased, but the signs are
   no longer independent. With v_i the single-branch error of pair i (for sigmoid DPO v_i is c_i (grad D_w +
   grad D_l), the "make both answers likelier" direction, which near-copy pairs share), the noise of the batch
   gradient is sum_i s_i v_i with s_i = +-1; independent coins give sum_i |v_i|^2, a balanced split removes the
   component the pairs have in common: about sum_i |v_i - mean v|^2. For p > 1/2 the branch that is always kept
   is balanced the same way. Same cost as paired.

3. Keep-probability annealing (`AnnealKeepProbs`, a callback): the keep probabilities ramp linearly to 1 (and the
   prefix-prune probability to 0) over the last `fraction` of a planned horizon, then stay there, so the last
   steps are exact. The ramp costs the full price of those steps.

Within one pair, branch pruning has no analogue of (1): its noise on a near-copy pair is the aligned part of the two
branches' *parameter* gradients, and no joint law of one pair's masks recovers grad D_w - grad D_l from one backward
pass; (2) works across pairs instead.
"""

import math

import torch
from transformers import TrainerCallback

from trl_pruned_dpo import PrunedDPOTrainer
from trl_pruned_dpo.method.masks import (
    PruneMasks,
    common_prefix,
    draw_branches,
    prefix_inclusion_prob,
    response_index,
    shortest_prefix,
)


def draw_shared_masks(input_ids: torch.Tensor, completion_mask: torch.Tensor, **kwargs) -> PruneMasks:
    """`masks.draw_masks` with one position mask and one prefix draw per pair (rows are [chosen; rejected])."""
    return draw_law_masks(input_ids, completion_mask, law="pair", **kwargs)


def draw_law_masks(
    input_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    law: str,
    position_keep_prob: float,
    prefix_prune_prob: float,
    prefix_min_ratio: float,
    branch_keep_prob: float,
    branch_sampling: str,
    drop_common_prefix: bool,
    generator: torch.Generator,
) -> PruneMasks:
    """The masks of `masks.draw_masks` under a fixed joint law, implemented here so that it does not move when the
    trainer's does: ``"pair"``, one position draw per pair and column and one prefix coin and uniform per pair;
    ``"row"``, every row on its own (the trainer's law before commits 6e59660 and e6821e9). Every row has the same
    marginal law under both."""
    if law not in ("pair", "row"):
        raise ValueError(f"unknown mask law {law!r}")
    response = completion_mask[:, 1:].bool()
    rows, cols = response.shape
    pairs, device = rows // 2, response.device
    exact = response & ~common_prefix(input_ids, response) if drop_common_prefix else response
    keep = exact.clone()
    q = torch.ones(response.shape, dtype=torch.float64, device=device)
    if prefix_prune_prob > 0:
        t = response_index(response).cpu()
        lengths = response.sum(dim=1).cpu().long()
        k0 = shortest_prefix(lengths, prefix_min_ratio)
        draws = pairs if law == "pair" else rows
        cut = torch.rand(draws, generator=generator) < prefix_prune_prob
        u = torch.rand(draws, generator=generator)
        if law == "pair":
            cut, u = cut.repeat(2), u.repeat(2)
        uniform_k = k0 + torch.floor(u * (lengths - k0 + 1).double()).long().minimum(lengths - k0)
        k = torch.where(cut, uniform_k, lengths)
        keep &= ((t > 0) & (t <= k.unsqueeze(1))).to(device)
        q = prefix_inclusion_prob(response, prefix_prune_prob, prefix_min_ratio)
    if position_keep_prob < 1:
        draws = torch.rand((pairs if law == "pair" else rows, cols), generator=generator) < position_keep_prob
        keep &= (draws.repeat(2, 1) if law == "pair" else draws).to(device) & response
    inclusion = q * position_keep_prob
    weights = torch.where(keep, 1.0 / inclusion.clamp(min=1e-12), torch.zeros_like(inclusion)).float()
    index = torch.arange(1, cols + 1, device=device)
    executed = (keep.long() * (index + 1)).amax(dim=1) if keep.numel() else torch.zeros(rows, dtype=torch.long)
    if branch_keep_prob < 1:
        backprop = draw_branches(pairs, branch_keep_prob, branch_sampling, generator).to(device)
    else:
        backprop = torch.ones(rows, dtype=torch.bool, device=device)
    return PruneMasks(keep, weights, executed, backprop, backprop.float() / branch_keep_prob, exact)


def draw_balanced_branches(num_pairs: int, keep_prob: float, generator: torch.Generator) -> torch.Tensor:
    """Like `masks.draw_branches(..., "paired")`, but the branch of each pair that is kept first is the chosen one
    for a random half of the pairs and the rejected one for the other half (an odd pair out: a fair coin). Every
    branch still has inclusion probability `keep_prob`."""
    order = torch.randperm(num_pairs, generator=generator)
    first_is_chosen = torch.zeros(num_pairs, dtype=torch.bool)
    first_is_chosen[order[: num_pairs // 2]] = True
    if num_pairs % 2:
        first_is_chosen[order[-1]] = bool(torch.rand(1, generator=generator) < 0.5)
    u = torch.rand(num_pairs, generator=generator)
    if keep_prob >= 0.5:
        first, second = torch.ones(num_pairs, dtype=torch.bool), u < 2 * keep_prob - 1
    else:
        first, second = u < 2 * keep_prob, torch.zeros(num_pairs, dtype=torch.bool)
    chosen = torch.where(first_is_chosen, first, second)
    rejected = torch.where(first_is_chosen, second, first)
    return torch.cat([chosen, rejected])


class PrototypePrunedDPOTrainer(PrunedDPOTrainer):
    """`PrunedDPOTrainer` with the prototype mask laws of this module: `mask_law` "pair" (1) or "row" (the trainer's
    original law, kept for comparison), or "trainer" (whatever masks.draw_masks does now); and `balanced` (2)."""

    mask_law = "trainer"
    balanced = False

    def draw_masks(self, host, options: dict, generator: torch.Generator) -> PruneMasks:
        """The trainer's public draw hook: the trainer's own draw, or a prototype law (and balanced branches)."""
        args = self.args
        if self.mask_law == "trainer":
            masks = super().draw_masks(host, options, generator)
        else:
            masks = draw_law_masks(host.input_ids, host.completion_mask, law=self.mask_law, **options,
                                   generator=generator)
        if self.balanced and args.branch_keep_prob < 1:
            if args.branch_sampling != "paired":
                raise ValueError("balanced branch sampling is a variant of branch_sampling='paired'")
            device = masks.backprop.device
            backprop = draw_balanced_branches(masks.backprop.numel() // 2, args.branch_keep_prob, generator)
            masks.backprop = backprop.to(device)
            masks.branch_scale = masks.backprop.float() / args.branch_keep_prob
        return masks


def prototype_class(mask_law: str, balanced: bool, base=PrototypePrunedDPOTrainer):
    """A `base` subclass with the given prototype options."""
    return type(f"{base.__name__}_{mask_law}_{int(balanced)}", (base,), {"mask_law": mask_law, "balanced": balanced})


def annealed(base: dict, fraction: float, horizon: int, step: int) -> dict:
    """The pruning probabilities at `step`: `base` until (1 - fraction) * horizon, then linearly to exact at
    `horizon`, exact after it."""
    start = (1.0 - fraction) * horizon
    ramp = min(1.0, max(0.0, (step - start) / max(horizon - start, 1e-9))) if fraction > 0 else 0.0
    return {
        "branch_keep_prob": base["branch_keep_prob"] + ramp * (1.0 - base["branch_keep_prob"]),
        "position_keep_prob": base["position_keep_prob"] + ramp * (1.0 - base["position_keep_prob"]),
        "prefix_prune_prob": base["prefix_prune_prob"] * (1.0 - ramp),
    }


class AnnealKeepProbs(TrainerCallback):
    """Sets the trainer's keep probabilities before every step from `annealed` (the trainer reads them per draw)."""

    FIELDS = ("branch_keep_prob", "position_keep_prob", "prefix_prune_prob")

    def __init__(self, fraction: float, horizon: int):
        self.fraction, self.horizon, self.base = fraction, horizon, None

    def on_train_begin(self, args, state, control, **kwargs):
        self.base = {f: getattr(args, f) for f in self.FIELDS}

    def on_step_begin(self, args, state, control, **kwargs):
        for name, value in annealed(self.base, self.fraction, self.horizon, state.global_step).items():
            # Exactly 1 (not 1 - 1e-16) once the ramp ends, so the trainer takes its exact path.
            setattr(args, name, 1.0 if name != "prefix_prune_prob" and math.isclose(value, 1.0) else value)
