"""The device side of a pass: micro-steps' plans (method/plan.py) run through the models, and the estimates made.

`run_pass` takes a `ForwardContext` (what it needs of the trainer, built once) and the `MicroStepPlan`s of a pass
(built on the host from token ids: one micro-step unmerged, several in a merged step) and returns one
`MicroStepRecord` each: the policy's per-token terms, inverse-probability weighted so that their row sums are unbiased
for the full sums (Eqs. 1-2, with the straight-through branch scaling of Eq. 3 on the log-probs), the reference's
per-branch sums under the same masks, the backpropagated rows' MoE router loss and the plan's counts. The
backpropagated forward runs first, then every no-grad forward (frozen branches, reference) in one block, so gradient
checkpointing is toggled at most once per pass. No decisions and no host-device syncs here:
a packed group runs as one row whose metadata is a model kwarg of the packed attention (seam/attention.py); a padded
group runs the batch's own rows under the model's own attention.
"""

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from .method.estimators import horvitz_thompson, scale_branch_gradient
from .method.masks import PruneMasks
from .method.packing import PackedGroup, concat_groups, split_grid
from .method.plan import Layout, MicroStepPlan, WorkCounts
from .reference import NON_MODEL_KEYS, REF_TOKEN_KEY
from .seam import compact_lm_head, no_grad_block, reference_context
from .seam.attention import PACKING_KWARG, Packing, SharedKeys, keep_until_backward, packed_forward

# TRL's per-token outputs the loss and its metrics read; `log_sum_sq_probs` only with `use_weighting`.
FIELDS = ("log_probs", "entropy", "mean_logits", "is_top1")


@dataclass(frozen=True)
class ForwardContext:
    """What a micro-step's forward needs of the trainer, built once per trainer (again if TRL re-wraps the policy).

    `policy`: the trainer's model (TRL's `self.model`: outside a DDP wrapper, whatever wraps it for the backward),
    whose gradient checkpointing is toggled and which runs a PEFT reference with its adapter disabled;
    `unwrapped_policy`: the same without its engine wrapper; `reference`: TRL's reference model (None: the policy
    without its adapter, or a precomputed reference); `reference_sums(per_token, batch)`: TRL's own per-branch sums
    (`compute_ref_log_probs`, with `ld_alpha`)."""

    policy: torch.nn.Module
    unwrapped_policy: torch.nn.Module
    reference: torch.nn.Module | None
    accelerator: Any
    checkpointing_kwargs: dict | None
    precomputed_reference: bool
    prune_reference: bool
    prune_common_prefix: bool
    use_weighting: bool
    aux_loss_enabled: bool
    reference_sums: Callable[[torch.Tensor, dict], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class MicroStepRecord:
    """What one training micro-step computed: TRL's loss and the metrics (metrics.py) take it, auto.py its counts.

    From its plan (not the plan itself, whose host tensors go with the micro-step): `step`, `options`, `layout`,
    `counts`, `means` and `prunes_branches` (method/plan.MicroStepPlan). Computed: `per_token`, the policy's estimated
    per-token terms by TRL's field names; `reference`, the reference's (chosen, rejected) sums under the same masks;
    `masks`, the plan's masks on the device; `aux_loss`, the backpropagated rows' MoE router loss (None without
    one)."""

    step: tuple[int, int]
    options: dict
    layout: Layout
    counts: WorkCounts
    means: tuple[tuple[str, float, float], ...]
    prunes_branches: bool
    per_token: dict[str, torch.Tensor]
    reference: tuple[torch.Tensor, torch.Tensor]
    masks: PruneMasks
    aux_loss: torch.Tensor | None = None


def _packed_bytes(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[tuple[int, torch.dtype, torch.Size]]]:
    """The host tensors as one byte buffer (each part aligned to 8 bytes, so it can be viewed back as its dtype) and
    where each lies: (offset, dtype, shape)."""
    parts = [t.contiguous().view(-1).view(torch.uint8) for t in tensors]
    offsets, total = [], 0
    for part in parts:
        offsets.append(total)
        total += (part.numel() + 7) // 8 * 8
    buffer = torch.empty(total, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    for part, offset in zip(parts, offsets):
        buffer[offset: offset + part.numel()] = part
    return buffer, [(offset, t.dtype, t.shape) for t, offset in zip(tensors, offsets)]


def _unpacked(buffer: torch.Tensor, layout: list[tuple[int, torch.dtype, torch.Size]]) -> list[torch.Tensor]:
    """The tensors `_packed_bytes` laid out in `buffer`, as views of it."""
    out = []
    for offset, dtype, shape in layout:
        size = shape.numel() * torch.empty((), dtype=dtype).element_size()
        out.append(buffer[offset: offset + size].view(dtype).view(shape))
    return out


def upload(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Host tensors on `device` in ONE host-to-device copy (a pinned byte buffer on CUDA), as views of it: a plan's
    metadata costs one copy per micro-step instead of one per tensor. On the host device: the tensors themselves."""
    if device.type == "cpu" or not tensors:
        return tensors
    buffer, layout = _packed_bytes(tensors)
    return _unpacked(buffer.to(device, non_blocking=True), layout)


def to_device(masks: list[PruneMasks], groups: list[PackedGroup | None],
              device: torch.device) -> tuple[list[PruneMasks], list[PackedGroup | None]]:
    """`masks` and `groups` (None where absent) with every host tensor on `device`, all in one copy (`upload`). A
    group planned once for two forwards is moved once."""
    distinct = list({id(g): g for g in groups if g is not None}.values())
    mask_names = [f.name for f in fields(PruneMasks)]
    tensors = [getattr(m, name) for m in masks for name in mask_names]
    group_names = [[f.name for f in fields(g) if torch.is_tensor(getattr(g, f.name))] for g in distinct]
    for group, names in zip(distinct, group_names):
        tensors += [getattr(group, name) for name in names]
    moved = iter(upload(tensors, device))
    on_device_masks = [PruneMasks(**{name: next(moved) for name in mask_names}) for _ in masks]
    on_device = {id(g): replace(g, **{name: next(moved) for name in names}) for g, names in zip(distinct, group_names)}
    return on_device_masks, [on_device[id(g)] if g is not None else None for g in groups]


def _padded_inputs(inputs: dict, group: PackedGroup, device: torch.device) -> dict:
    """The group's rows of every per-row or per-token model input of the batch, trimmed to its width."""
    index = group.rows.to(device, non_blocking=True)
    total_rows, total_cols = inputs["input_ids"].shape
    kwargs = {}
    for key, value in inputs.items():
        if key in NON_MODEL_KEYS:
            continue
        if torch.is_tensor(value) and value.dim() >= 1 and value.size(0) == total_rows:
            per_token = value.dim() >= 2 and value.size(1) == total_cols
            value = value[index, : group.width] if per_token else value[index]
        kwargs[key] = value
    return kwargs


def run_group(model: torch.nn.Module, group: PackedGroup, wanted: tuple[str, ...], inputs: dict,
              shared: SharedKeys | None = None, **model_kwargs: Any) -> tuple[dict[str, torch.Tensor], Any]:
    """One forward of a group through TRL's fused LM head (called under the seam's `compact_lm_head`).

    Returns ({field: (rows, cols) tensor}, the model outputs): each grid cell holds the output of the position the plan
    routed to it, 0 (False) where none. `inputs`: the collated batch (a padded group takes its rows from it). `shared`:
    branch pruning's keys passed from the grad group to the frozen one (packing.plan_split): the same object for both."""
    device = inputs["input_ids"].device
    to = dict(device=device, non_blocking=True)
    if group.rows is None:
        keeps = shared.open(group.keeps.to(**to)) if group.keeps is not None else None
        packing = Packing(group.cu_seq_q.to(**to), group.cu_seq_k.to(**to), group.kv_index.to(**to), group.max_q,
                          group.max_k, *group.bounds, keeps, shared if group.reads else None)
        try:
            with packed_forward(packing):
                outputs = model(input_ids=group.input_ids.to(**to), position_ids=group.position_ids.to(**to),
                                shift_labels=group.shift_labels.to(**to), use_cache=False, fused_lm_head=True,
                                **{PACKING_KWARG: packing}, **model_kwargs)
                # The configs name the packed attention until this forward's backward (checkpointing replays there).
                keep_until_backward(outputs.values())
        finally:  # kept once per forward (checkpointing's replay keeps nothing), freed once read
            if keeps is not None:
                keeps.close()
            if group.reads:
                shared.release()
    else:
        outputs = model(**_padded_inputs(inputs, group, device), shift_labels=group.shift_labels.to(**to),
                        use_cache=False, fused_lm_head=True, **model_kwargs)
    source = group.source.to(**to)
    routes, per_token = {}, {}
    for name in wanted:
        flat = getattr(outputs, name).reshape(-1)
        # Under `device_map` the head may sit on another device than the inputs: gather there, hand back here.
        if flat.device not in routes:
            at = source.to(flat.device)
            routes[flat.device] = (at >= 0, at.clamp(min=0))
        hit, index = routes[flat.device]
        picked = torch.where(hit, flat[index], torch.zeros((), dtype=flat.dtype, device=flat.device))
        per_token[name] = picked.to(device, non_blocking=True)
    return per_token, outputs


def _reference_model(context: ForwardContext) -> torch.nn.Module:
    """The model the reference runs through: TRL's reference model, else the policy (its adapter disabled) as TRL runs
    it, the trainer's model outside DDP's wrapper. A no-grad forward through DDP all-reduces nothing, but it broadcasts
    the module buffers after a synced backward: a collective that ranks running different passes would meet in
    different places (issue 48's hang). Outside it, DDP sees the same grad forwards and backwards as before."""
    return context.reference if context.reference is not None else context.policy


def _wanted(context: ForwardContext) -> tuple[str, ...]:
    """The per-token fields the policy's forward returns: TRL's, and the WPO weights' with `use_weighting`."""
    return FIELDS + (("log_sum_sq_probs",) if context.use_weighting else ())


def reference_log_probs(context: ForwardContext, model: torch.nn.Module, group: PackedGroup,
                        inputs: dict) -> torch.Tensor:
    """Per-token reference log-probs (rows, cols) of the `group`'s scored positions, 0 elsewhere; never
    backpropagated (the policy's adapter disabled for a PEFT reference)."""
    with reference_context(context.policy, context.unwrapped_policy, context.reference,
                           context.checkpointing_kwargs), compact_lm_head():
        outputs, _ = run_group(model, group, ("log_probs",), inputs)
    return outputs["log_probs"].float()


def reference_estimate(context: ForwardContext, group: PackedGroup | None, masks: PruneMasks, inputs: dict,
                       per_token: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's (chosen, rejected) sums under the policy's masks (`prune_reference`), or exact sums over every
    kept position: its per-token log-probs run now as `group` plans them (live), already run by a merged pass
    (`per_token`, `run_pass`) or stored (precomputed), or the stored sums where nothing on the reference is pruned.
    Called in the micro-step's no-grad block: TRL's summing toggles gradient checkpointing otherwise."""
    weights = masks.weights if context.prune_reference else masks.exact.float()
    if per_token is None and not context.precomputed_reference:
        per_token = reference_log_probs(context, _reference_model(context), group, inputs)
    elif per_token is None and (context.prune_reference or context.prune_common_prefix):
        per_token = inputs[REF_TOKEN_KEY].to(weights.device)
    elif per_token is None:
        return inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]
    return context.reference_sums(horvitz_thompson(per_token, weights), inputs)


def _record(plan: MicroStepPlan, masks: PruneMasks, per_token: dict[str, torch.Tensor],
            frozen: dict[str, torch.Tensor] | None, reference: tuple[torch.Tensor, torch.Tensor],
            aux_loss: torch.Tensor | None) -> MicroStepRecord:
    """A micro-step's record from its forwards' grids: the grad and frozen groups combined, the policy's estimates
    (Eqs. 1-3) made under its masks (on the device)."""
    # The groups fill disjoint cells (zero elsewhere); combined outside no_grad.
    if frozen is not None:
        for name in per_token:
            per_token[name] = per_token[name] | frozen[name] if name == "is_top1" else per_token[name] + frozen[name]
    # The policy's estimates (Eqs. 1-3).
    for name in per_token:
        if name != "is_top1":
            per_token[name] = horvitz_thompson(per_token[name].float(), masks.weights)
    per_token["is_top1"] = per_token["is_top1"].bool() & masks.scored
    if plan.prunes_branches:
        per_token["log_probs"] = scale_branch_gradient(per_token["log_probs"], masks.branch_scale)
    return MicroStepRecord(plan.step, plan.options, plan.layout, plan.counts, plan.means, plan.prunes_branches,
                           per_token, reference, masks, aux_loss)


def run_pass(context: ForwardContext, model: torch.nn.Module, batches: list[dict],
             plans: list[MicroStepPlan]) -> list[MicroStepRecord]:
    """The pruned forward of a pass: one micro-step (unmerged) or several of one optimizer step (the merged step,
    docs/method.md), each with its own plan, run as ONE policy forward with grad (plus, pruning branches, one no-grad
    forward of the frozen rows, which read their shared part's keys and values from it: packing.plan_split) and one
    reference forward. Several micro-steps' groups are laid end to end (`concat_groups`) and each grid cut back out
    (`split_grid`); then each micro-step's reference estimate and policy estimates (Eqs. 1-3) are made under its own
    masks, so its record, and TRL's loss over its own batch, are what it would be alone. A padded micro-step or one
    with a MoE router loss runs alone (the trainer never merges them); a pass's micro-steps all prune branches or
    none (structural: the same on every micro-step of a run that merges)."""
    alone_only = context.aux_loss_enabled or any(not plan.layout.packed for plan in plans)
    if len(plans) > 1 and (alone_only or len({plan.prunes_branches for plan in plans}) > 1):
        raise ValueError("run_pass merges packed micro-steps without a router loss, all pruning branches or none.")
    wanted = _wanted(context)
    inputs = batches[-1]  # a padded group takes its rows from it (alone only)
    live = not context.precomputed_reference
    branches = plans[0].prunes_branches

    def joined(groups: list[PackedGroup]) -> PackedGroup:
        return groups[0] if len(groups) == 1 else concat_groups(groups)

    # Every micro-step's masks and the pass's groups on the device in one copy.
    groups = [joined([plan.policy.grad for plan in plans]),
              joined([plan.policy.frozen for plan in plans]) if branches else None,
              joined([plan.reference for plan in plans]) if live else None]
    masks, (grad, frozen_group, reference_group) = to_device([plan.masks for plan in plans], groups,
                                                             inputs["input_ids"].device)
    # MoE (padded, alone): the router aux loss is the grad rows' own, over their executed columns (docs/parity.md).
    router = {"output_router_logits": True} if context.aux_loss_enabled else {}
    shared = SharedKeys()
    with compact_lm_head():
        policy, outputs = run_group(model, grad, wanted, inputs, shared, **router)
        aux_loss = outputs.aux_loss * (1.0 if grad.scored else 0.0) if router else None
        # The frozen rows and every micro-step's reference in one no-grad block: checkpointing toggled once per pass.
        with no_grad_block(context.policy, context.checkpointing_kwargs):
            # No grad: outside DDP's wrapper (a forward through it may broadcast buffers: `_reference_model`).
            frozen = run_group(context.policy, frozen_group, wanted, inputs, shared)[0] if branches else None
            stored = [None] * len(plans)
            if live:
                per_token = reference_log_probs(context, _reference_model(context), reference_group, inputs)
                stored = split_grid(per_token, [tuple(plan.reference.source.shape) for plan in plans])
            references = [reference_estimate(context, plan.reference, mask, batch, per_token)
                          for plan, mask, batch, per_token in zip(plans, masks, batches, stored)]
    policy = {name: split_grid(policy[name], [tuple(p.policy.grad.source.shape) for p in plans]) for name in wanted}
    if branches:
        frozen = {name: split_grid(frozen[name], [tuple(p.policy.frozen.source.shape) for p in plans])
                  for name in wanted}
    return [_record(plan, mask, {name: policy[name][i] for name in wanted},
                    {name: frozen[name][i] for name in wanted} if branches else None, reference, aux_loss)
            for i, (plan, mask, reference) in enumerate(zip(plans, masks, references))]
