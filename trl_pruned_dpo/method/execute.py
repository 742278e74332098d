"""The device side of a plan (plan.py): run a group through the model, scatter its outputs to the grid; no decisions,
no host-device syncs. Called under the seam's `compact_lm_head` (TRL's fused head scores labelled positions only). A
packed group runs as one row, its metadata a model kwarg of the packed attention (attention.py); a padded group runs
the batch's own rows under the model's own attention and the collated 2D mask.
"""

import torch

from .attention import PACKING_KWARG, Packing, packed_forward, use_packed
from .plan import HostBatch, PackedGroup, plan_group, row_trees


def _padded_inputs(inputs: dict, group: PackedGroup, skip_keys, device) -> dict:
    """The group's rows of every per-row or per-token model input of the batch, trimmed to its width."""
    index = group.rows.to(device, non_blocking=True)
    total_rows, total_cols = inputs["input_ids"].shape
    kwargs = {}
    for key, value in inputs.items():
        if key not in skip_keys:
            if torch.is_tensor(value) and value.dim() >= 1 and value.size(0) == total_rows:
                per_token = value.dim() >= 2 and value.size(1) == total_cols
                value = value[index, : group.width] if per_token else value[index]
            kwargs[key] = value
    return kwargs


def run_group(model, group: PackedGroup, fields: tuple[str, ...], inputs: dict, skip_keys, **model_kwargs):
    """One forward of a group through TRL's fused LM head.

    Returns ({field: (rows, cols) tensor}, the model outputs): each grid cell holds the output of the position the plan
    routed to it, 0 (False) where none. The outputs stay available for what the caller collects from them (e.g. a MoE
    router's `aux_loss`). `inputs`: the collated batch (a padded group takes its rows from it).
    """
    device = inputs["input_ids"].device
    to = dict(device=device, non_blocking=True)
    if group.rows is None:
        packing = Packing(group.cu_seq_q.to(**to), group.cu_seq_k.to(**to), group.kv_index.to(**to), group.max_q,
                          group.max_k, *group.bounds)
        with packed_forward(packing):
            outputs = model(input_ids=group.input_ids.to(**to), position_ids=group.position_ids.to(**to),
                            shift_labels=group.shift_labels.to(**to), use_cache=False, fused_lm_head=True,
                            **{PACKING_KWARG: packing}, **model_kwargs)
    else:
        outputs = model(**_padded_inputs(inputs, group, skip_keys, device), shift_labels=group.shift_labels.to(**to),
                        use_cache=False, fused_lm_head=True, **model_kwargs)
    source = group.source.to(**to)
    hit = source >= 0
    per_token = {}
    for field in fields:
        flat = getattr(outputs, field).reshape(-1)
        per_token[field] = torch.where(hit, flat[source.clamp(min=0)], torch.zeros((), dtype=flat.dtype, device=device))
    return per_token, outputs


def packed_against_padded(model, packed_models, host: HostBatch, inputs: dict, share: bool, skip_keys,
                          no_grad) -> torch.Tensor:
    """The largest |packed - padded| per-token log-prob of `model` over the batch's first two pairs (NaN reads as
    inf), each forward inside `no_grad()` (the caller's no-grad, compact-head block); `packed_models` are switched to
    each layout in turn. Raises what the packed forward raises."""
    rows = host.input_ids.size(0)
    run = (torch.arange(rows) % (rows // 2)) < min(2, rows // 2)
    scored = host.completion_mask[:, 1:].bool() & run[:, None]
    outputs = []
    for packed in (False, True):
        use_packed(packed_models, packed)
        group = plan_group(host, scored, run, row_trees(host, share), packed)
        with no_grad():
            outputs.append(run_group(model, group, ("log_probs",), inputs, skip_keys)[0]["log_probs"].float())
    return (outputs[1] - outputs[0]).abs().max().nan_to_num(nan=float("inf"))
