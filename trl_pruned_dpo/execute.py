"""The device side of a plan (plan.py): run a packed group through the model, scatter its outputs to the grid.

No decisions and no host-device syncs here: every shape and index was fixed on the host. The attention mask is built
on the device from the plan's item/segment ids: a token sees the earlier tokens of its own item that are in the shared
segment or in its own segment (docs/method.md, "Packed layout"). How it reaches attention depends on the backend:
a dense (rows, 1, L, L) mask for SDPA and eager (transformers passes a prepared 4D mask through unchanged), a
FlexAttention BlockMask (block-sparse, no L x L tensor) for `attn_implementation="flex_attention"`.
"""

import torch

from ._trl import compact_lm_head
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
    """One forward of a packed group through TRL's fused LM head (scoring only the labelled positions).

    Returns ({field: (rows, cols) tensor}, the model outputs): each grid cell holds the output of the packed position
    the plan routed to it, 0 (False) where none. The outputs stay available for what the caller collects from them
    (e.g. a MoE router's `aux_loss`).
    """
    to = dict(device=device, non_blocking=True)
    mask = attention_mask(group.item.to(**to), group.segment.to(**to), backend)
    with compact_lm_head():
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
