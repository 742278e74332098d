"""The device side of a plan (plan.py): run a packed group through the model, scatter its outputs to the grid.

No decisions and no host-device syncs here: every shape and index was fixed on the host. The caller runs these under
the TRL seam's `compact_lm_head` (seam.py), so that TRL's fused head scores the labelled positions only. The attention mask is built
on the device from the plan's item/segment ids: a token sees the earlier tokens of its own item that are in the shared
segment or in its own segment (docs/method.md, "Packed layout"). How it reaches attention depends on the backend:
a dense (rows, 1, L, L) mask for SDPA and eager (transformers passes a prepared 4D mask through unchanged), a
FlexAttention BlockMask (block-sparse, no L x L tensor) for `attn_implementation="flex_attention"`.
"""

import torch

from .plan import SHARED, PackedGroup

# attention implementations that take a custom 4D mask exactly
DENSE_MASK_BACKENDS = ("sdpa", "eager")
SUPPORTED_BACKENDS = DENSE_MASK_BACKENDS + ("flex_attention",)


def row_multiple(backend: str) -> int:
    """What the packed row length is rounded up to: FlexAttention's block size (it compiles per shape), else 1."""
    return 128 if backend == "flex_attention" else 1


def unsupported_reason(model) -> str | None:
    """Why `model` cannot run packed shared-prompt rows exactly (None if it can). Checked once, before training."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    backend = getattr(model.config, "_attn_implementation", None) or getattr(config, "_attn_implementation", None)
    if backend not in SUPPORTED_BACKENDS:
        return f"attention implementation {backend!r} cannot take a packed 4D mask (use one of {SUPPORTED_BACKENDS})"
    layer_types = set(getattr(config, "layer_types", None) or ())
    if layer_types - {"full_attention"}:
        other = sorted(layer_types - {"full_attention"})
        return f"the model has {other} layers, whose own masks a packed mask would replace"
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True) and not layer_types:
        return f"the model uses a sliding attention window ({window}), which a packed mask would drop"
    return None


def shared_prompt_backend(models, aux_loss_enabled: bool) -> tuple[str | None, str | None]:
    """(the attention backend of the shared-prompt forward, None) or (None, why the packed forward cannot run):
    `models` are the unwrapped policy and reference (their base models under PEFT)."""
    if aux_loss_enabled:  # TRL's fused head computes it with the attention mask, which must then be 2D
        return None, "the MoE router auxiliary loss needs the unpacked (2D) attention mask"
    for model in models:
        reason = unsupported_reason(model)
        if reason:
            return None, reason
    return models[0].config._attn_implementation, None


def _allowed(item_q, seg_q, item_k, seg_k, q_idx, kv_idx):
    """Same item, causal, and the key is shared or in the query's own branch."""
    return (item_q == item_k) & (kv_idx <= q_idx) & ((seg_k == SHARED) | (seg_k == seg_q))


def attention_mask(item: torch.Tensor, segment: torch.Tensor, backend: str):
    """The packed rows' attention mask in the form `backend` takes."""
    rows, width = item.shape
    if backend == "flex_attention":
        from torch.nn.attention.flex_attention import create_block_mask

        def mask_mod(b, h, q_idx, kv_idx):
            return _allowed(item[b, q_idx], segment[b, q_idx], item[b, kv_idx], segment[b, kv_idx], q_idx, kv_idx)

        return create_block_mask(mask_mod, B=rows, H=None, Q_LEN=width, KV_LEN=width, device=item.device)
    idx = torch.arange(width, device=item.device)
    allowed = _allowed(item[:, :, None], segment[:, :, None], item[:, None, :], segment[:, None, :],
                       idx[None, :, None], idx[None, None, :]).unsqueeze(1)
    if backend == "sdpa":
        return allowed
    # eager adds the mask to the scores (in float32: the sum is promoted, and softmax runs in float32 anyway)
    return torch.zeros(allowed.shape, device=item.device).masked_fill(~allowed, torch.finfo(torch.float32).min)


def run_group(model, group: PackedGroup, fields: tuple[str, ...], backend: str, device):
    """One forward of a packed group through TRL's fused LM head.

    Returns ({field: (rows, cols) tensor}, the model outputs): each grid cell holds the output of the packed position
    the plan routed to it, 0 (False) where none. The outputs stay available for what the caller collects from them
    (e.g. a MoE router's `aux_loss`).
    """
    to = dict(device=device, non_blocking=True)
    mask = attention_mask(group.item.to(**to), group.segment.to(**to), backend)
    outputs = model(
        input_ids=group.input_ids.to(**to),
        position_ids=group.position_ids.to(**to),
        attention_mask=mask,
        shift_labels=group.shift_labels.to(**to),
        use_cache=False,
        fused_lm_head=True,
    )
    source = group.source.to(**to)
    hit = source >= 0
    per_token = {}
    for field in fields:
        flat = getattr(outputs, field).reshape(-1)
        per_token[field] = torch.where(hit, flat[source.clamp(min=0)], torch.zeros((), dtype=flat.dtype, device=device))
    return per_token, outputs


def run_rows(model, inputs: dict, rows: torch.Tensor, scored: torch.Tensor, width: int, skip_keys, **model_kwargs):
    """The unshared forward: `rows` of the padded batch, trimmed to `width` columns, labelled on `scored` only.

    `rows` and `scored` live on the host (the plan, `plan.unshared_rows`). Returns the fused-head outputs (per-token
    tensors of shape (len(rows), width - 1)). Per-row and per-token inputs other than `skip_keys` are sliced alike and
    passed to the model. An empty `rows` still runs one row of two tokens, scoring nothing: every process must run the
    same modules in the same order (ZeRO-3/FSDP), and a grad group must stay connected to the graph.
    """
    if rows.numel() == 0:
        rows = rows.new_zeros(1)
        scored = torch.zeros_like(scored)
    device = inputs["input_ids"].device
    index = rows.to(device, non_blocking=True)
    input_ids = inputs["input_ids"][index, :width]
    labels = torch.full_like(input_ids, -100)
    keep = scored[rows, : width - 1].to(device, non_blocking=True)
    labels[:, 1:] = torch.where(keep, input_ids[:, 1:], -100)
    total_rows, total_cols = inputs["input_ids"].shape
    kwargs = {}
    for key, value in inputs.items():
        if key in skip_keys or key == "input_ids":
            continue
        if torch.is_tensor(value) and value.dim() >= 2 and value.shape[:2] == (total_rows, total_cols):
            value = value[index, :width]
        elif torch.is_tensor(value) and value.dim() >= 1 and value.size(0) == total_rows:
            value = value[index]
        kwargs[key] = value
    kwargs.update(model_kwargs)
    return model(input_ids=input_ids, labels=labels, use_cache=False, fused_lm_head=True, **kwargs)


def run_unshared(model, inputs: dict, rows: torch.Tensor, scored: torch.Tensor, width: int, fields: tuple[str, ...],
                 shape: tuple[int, int], skip_keys, with_grad: bool, **model_kwargs):
    """`run_rows`, its outputs scattered onto the (rows, cols) grid (0 / False outside `rows`). Returns
    ({field: grid tensor}, the model outputs). A grad group with no rows stays connected to the graph."""
    device = inputs["input_ids"].device
    per_token = {f: torch.zeros(shape, dtype=torch.bool if f == "is_top1" else torch.float32, device=device)
                 for f in fields}
    outputs = run_rows(model, inputs, rows, scored, width, skip_keys, **model_kwargs)
    if rows.numel() == 0:
        if with_grad:
            per_token["log_probs"] = per_token["log_probs"] + outputs.log_probs.sum() * 0.0
        return per_token, outputs
    index = rows.to(device, non_blocking=True)
    for f in fields:
        value = getattr(outputs, f)[:, -(width - 1) :]
        if f == "log_probs":  # out-of-place so autograd keeps the grad rows' history
            per_token[f] = per_token[f].index_put((index,), torch.nn.functional.pad(
                value.float(), (0, shape[1] - (width - 1))))
        else:
            per_token[f][index, : width - 1] = value.to(per_token[f].dtype)
    return per_token, outputs
