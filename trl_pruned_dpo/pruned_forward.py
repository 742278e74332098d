"""One micro-step's pruned forward of the [chosen; rejected] batch, from masks drawn on the host (docs/method.md).

Plan on the host (method/plan.py lays out the rows of the masks' layout), execute on the device (method/execute.py:
the backpropagated rows with grad, the others under `torch.no_grad()`, scoring only kept positions through TRL's own
fused LM head), and return inverse-probability-weighted per-token terms (method/estimators.py) for the policy, and the
reference's sums under the same masks. The trainer decides (the masks, the layout); this module runs them and counts
the work into `counts`. `trainer` supplies TRL's public fields (args, the models, the accelerator, the precompute flag,
`use_weighting`, `aux_loss_enabled`) and TRL's `compute_ref_log_probs`.
"""

import dataclasses

import torch

from .method.estimators import horvitz_thompson, scale_branch_gradient
from .method.execute import run_group
from .method.masks import PruneMasks
from .method.plan import plan_policy, plan_reference, work_counts
from .reference import NON_MODEL_KEYS, REF_TOKEN_KEY, host_batch
from .seam import DPOTrainer, Replay, compact_lm_head, no_grad_block, reference_context


@dataclasses.dataclass
class Forward:
    """The policy's estimated per-token terms, the reference's sums (chosen, rejected), the masks on the device, the
    work counts and the backpropagated rows' MoE router loss (None without one)."""

    per_token: dict
    reference: tuple
    masks: PruneMasks
    counts: dict
    aux_loss: torch.Tensor | None = None


def masks_to(masks: PruneMasks, device) -> PruneMasks:
    """The masks on `device` (a copy; a no-op for tensors already there)."""
    return PruneMasks(**{f.name: getattr(masks, f.name).to(device, non_blocking=True)
                         for f in dataclasses.fields(masks)})


def _count(counts: dict, name: str, value) -> None:
    counts[name] = counts.get(name, 0) + int(value)


def reference_log_probs(trainer, model, inputs, scored: torch.Tensor, layout: tuple[bool, bool], counts: dict):
    """Per-token reference log-probs (rows, cols) on the `scored` positions, 0 elsewhere; never backpropagated."""
    packed, share = layout
    group = plan_reference(host_batch(inputs), scored.cpu(), share, packed)
    with reference_context(trainer.model, trainer.accelerator.unwrap_model(trainer.model), trainer.ref_model,
                           trainer.args.gradient_checkpointing_kwargs), compact_lm_head():
        outputs, _ = run_group(model, group, ("log_probs",), inputs, NON_MODEL_KEYS)
    _count(counts, "reference_tokens_executed", group.tokens)
    _count(counts, "reference_positions_scored", group.scored)
    return outputs["log_probs"].float()


def reference_sums(trainer, inputs, per_token: torch.Tensor):
    """Per-branch reference sums from per-token values, through TRL's own `compute_ref_log_probs` (ld_alpha)."""
    return DPOTrainer.compute_ref_log_probs(trainer, Replay(log_probs=per_token), inputs)


def pruned_reference(trainer, inputs, masks: PruneMasks, on_device: PruneMasks, layout, counts: dict):
    """Reference sums under the policy's masks (`prune_reference`), or exact sums over every kept position; `masks`
    are the host copy (the plan reads them), `on_device` the same masks where the estimate is made."""
    args = trainer.args
    prune = args.prune_reference
    weights, exact = on_device.weights, on_device.exact
    if trainer.precompute_ref_logps:
        if not prune and not args.prune_common_prefix:
            return inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]
        stored = inputs[REF_TOKEN_KEY].to(weights.device)
        return reference_sums(trainer, inputs, horvitz_thompson(stored, weights if prune else exact.float()))
    reference_model = trainer.ref_model if trainer.ref_model is not None else trainer.model
    scored = masks.scored if prune else masks.exact
    per_token = reference_log_probs(trainer, reference_model, inputs, scored, layout, counts)
    return reference_sums(trainer, inputs, horvitz_thompson(per_token, weights) if prune else per_token * exact)


def _policy_forwards(trainer, model, inputs, masks: PruneMasks, fields, layout, frozen_group: bool, counts: dict):
    """The policy forwards of the plan: per-token outputs of the grad group on the grid, a function running the
    frozen group (in the micro-step's one no-grad block) that returns its outputs on the grid or None, and the grad
    rows' MoE router loss (None without one)."""
    packed, share = layout
    # Forward + backward (+ recompute), docs/method.md's cost model.
    grad_cost = 4.0 if trainer.args.gradient_checkpointing else 3.0
    plan = plan_policy(host_batch(inputs), masks, frozen_group=frozen_group, grad_cost=grad_cost, share=share,
                       packed=packed)
    # MoE (padded only): the router aux loss is the grad rows' own, over their executed columns (docs/parity.md).
    router = {"output_router_logits": True} if trainer.aux_loss_enabled else {}
    per_token, outputs = run_group(model, plan.grad, fields, inputs, NON_MODEL_KEYS, **router)
    aux_loss = outputs.aux_loss * (1.0 if plan.grad.scored else 0.0) if router else None
    _count(counts, "policy_tokens_executed", plan.grad.tokens)
    _count(counts, "grad_tokens_executed", plan.grad.tokens)
    if share:
        _count(counts, "shared_pairs", plan.shared_pairs)
        _count(counts, "split_pairs", plan.split_pairs)

    def run_frozen():
        if plan.frozen is None:
            return None
        _count(counts, "policy_tokens_executed", plan.frozen.tokens)
        return run_group(model, plan.frozen, fields, inputs, NON_MODEL_KEYS)[0]

    return per_token, run_frozen, aux_loss


def pruned_forward(trainer, model, inputs, masks: PruneMasks, layout: tuple[bool, bool], prunes_branches: bool):
    """The pruned forward of the [chosen; rejected] batch under `masks` (the host copy) in `layout` (packed, share).

    The policy's per-token outputs (log-probs and TRL's metric fields) come back as inverse-probability-weighted
    terms whose row sums are unbiased for the full sums (Eqs. 1-2), with the straight-through branch scaling applied
    to the log-probs (Eq. 3) where `prunes_branches`, and the reference's per-branch sums under the same masks.
    The backpropagated forward runs first, then every no-grad forward (frozen branches, reference) in one block, so
    gradient checkpointing is toggled at most once per micro-step."""
    counts = {}
    response = inputs["completion_mask"][:, 1:].bool()
    fields = ("log_probs", "entropy", "mean_logits", "is_top1") + (("log_sum_sq_probs",) if trainer.use_weighting
                                                                    else ())
    with compact_lm_head():
        per_token, run_frozen, aux_loss = _policy_forwards(trainer, model, inputs, masks, fields, layout,
                                                           prunes_branches, counts)
        # Once: the reference estimate and the policy's.
        on_device = masks_to(masks, response.device)
        with no_grad_block(trainer.model, trainer.args.gradient_checkpointing_kwargs):
            frozen = run_frozen()
            reference = pruned_reference(trainer, inputs, masks, on_device, layout, counts)
    # The groups fill disjoint cells (zero elsewhere); combined outside no_grad.
    if frozen is not None:
        for f in fields:
            per_token[f] = per_token[f] | frozen[f] if f == "is_top1" else per_token[f] + frozen[f]
    for f in fields:
        if f != "is_top1":
            per_token[f] = horvitz_thompson(per_token[f].float(), on_device.weights)
    per_token["is_top1"] = per_token["is_top1"].bool() & on_device.scored
    if prunes_branches:
        per_token["log_probs"] = scale_branch_gradient(per_token["log_probs"], on_device.branch_scale)
    for name, value in work_counts(host_batch(inputs), masks).items():
        _count(counts, name, value)
    return Forward(per_token, reference, on_device, counts, aux_loss)
