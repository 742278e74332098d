"""The packed attention, registered with transformers for the plugin's packed forwards (policy and reference).

A packed group (plan.py) is one row of segments: a segment's queries are its tokens, its keys (`kv_index`) its pair's
shared part then itself, causal aligned lower-right. CUDA bf16/fp16: a varlen kernel (flash_attn's where the user
loaded `flash_attention_2` and it is installed, else `torch.nn.attention.varlen.varlen_attn`; GQA without repeating
K/V), each used once a check on random segments finds it agrees with SDPA (`_verify`); elsewhere, or where a kernel
disagrees, SDPA per segment over the same metadata: cost Σ queries × keys, never (length)². The metadata is a model
kwarg, so gradient checkpointing's replay of a layer sees it. `use_packed` names `PACKED` in the configs until undone
(at the trainer's next stock forward, or the end of `train()`): the replay runs in the backward and reads the config
then; meanwhile a call without the metadata (generation, a callback) gets the user's own attention and mask.
Relies on transformers' `config._attn_implementation` and each model file's `eager_attention_forward` (pinned by
tests/test_packed_kernels.py).
"""

import importlib.util
import inspect
import sys
import warnings
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.nn import functional as F
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

PACKED = "trl_pruned_dpo_packed"
PACKING_KWARG = "pruned_dpo_packing"

_users_backend: dict[int, tuple[object, str]] = {}  # id(config) -> (config, the implementation the user loaded)
_packing_depth = 0  # > 0 inside a packed forward: its mask is never built


@dataclass
class Packing:
    """One packed group's metadata on the device: cu_seq_q/cu_seq_k (segments + 1,) int32 boundaries of the queries in
    the row and of their keys in kv_index (keys,) long; max_q, max_k ints; host_q/host_k: cu_seq_q/k as ints."""

    cu_seq_q: torch.Tensor
    cu_seq_k: torch.Tensor
    kv_index: torch.Tensor
    max_q: int
    max_k: int
    host_q: list[int]
    host_k: list[int]


try:
    from torch.nn.attention.varlen import varlen_attn
    _PARAMS = inspect.signature(varlen_attn).parameters  # causal lower-right; GQA where the kernel takes it
    _CAUSAL = {"window_size": (-1, 0)} if "window_size" in _PARAMS else {"is_causal": True}
except ImportError:  # torch < 2.10: the per-segment path everywhere
    varlen_attn = None


def _per_segment(query, key, value, packing: Packing, scaling):
    """SDPA segment by segment: queries (T, H, D), gathered keys/values (K, Hkv, D); lower-right causal.

    Batched 4D inputs (1, H, L, D): SDPA takes its fused kernels (on CPU the flash kernel, which keeps only a
    logsumexp per query for the backward) only for 4D inputs; 3D ones run the math path, which keeps lq x lk scores
    and probabilities per head (docs/benchmarks.md, "Where a step's memory goes")."""
    out = torch.empty_like(query)
    gqa = query.size(1) != key.size(1)
    q0s, k0s = packing.host_q, packing.host_k
    for s in range(len(q0s) - 1):
        q0, q1, k0, k1 = q0s[s], q0s[s + 1], k0s[s], k0s[s + 1]
        lq, lk = q1 - q0, k1 - k0
        q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (query[q0:q1], key[k0:k1], value[k0:k1]))
        if lq == lk:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=gqa)
        else:  # this segment's own lq x lk mask (SDPA keeps it, as floats, for the backward: one per segment, not head)
            visible = torch.ones(lq, lk, dtype=torch.bool, device=query.device).tril(lk - lq)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scaling, enable_gqa=gqa)
        out[q0:q1] = o[0].transpose(0, 1)
    return out


def _torch_varlen(q, k, v, packing: Packing, scaling):
    gqa = q.size(1) // k.size(1)
    if gqa > 1 and "enable_gqa" not in _PARAMS:
        k, v = k.repeat_interleave(gqa, dim=1), v.repeat_interleave(gqa, dim=1)
    return varlen_attn(q.contiguous(), k, v, packing.cu_seq_q, packing.cu_seq_k, packing.max_q, packing.max_k,
                       scale=scaling, **_CAUSAL, **({"enable_gqa": gqa > 1} if "enable_gqa" in _PARAMS else {}))


def _flash_attn_varlen(q, k, v, packing: Packing, scaling):  # flash_attn >= 2.1: causal is lower-right, GQA native
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func(q.contiguous(), k, v, packing.cu_seq_q, packing.cu_seq_k, packing.max_q,
                                  packing.max_k, softmax_scale=scaling, causal=True)


FLASH_ATTN_INSTALLED = importlib.util.find_spec("flash_attn") is not None  # once: `_kernel` runs in every layer
_VERIFIED: dict[tuple, bool] = {}  # (kernel, device, dtype, heads, kv heads, head dim) -> agrees with the reference


def _on_kernel(q) -> bool:
    return q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)


def _kernel(q, k, backend: str):
    """The varlen kernel for this forward, or None (SDPA per segment): flash_attn's where the user loaded
    flash_attention_2 and it is installed, else torch's; each used only once `_verify` has found it exact."""
    if not _on_kernel(q):
        return None
    flash = backend == "flash_attention_2" and FLASH_ATTN_INSTALLED
    kernel = _flash_attn_varlen if flash else _torch_varlen if varlen_attn is not None else None
    key = (kernel, q.device, q.dtype, q.size(1), k.size(1), q.size(2))
    if kernel is not None and key not in _VERIFIED:
        _VERIFIED[key] = _verify(kernel, q.size(1), k.size(1), q.size(2), q.device, q.dtype)
    return kernel if _VERIFIED.get(key) else None


def _verify(kernel, heads: int, kv_heads: int, dim: int, device, dtype) -> bool:
    """The kernel against SDPA per segment on random segments (shared keys before the queries, and none), forward and
    backward, once per shape: exact if its error from the fp32 reference is at most twice SDPA's own in `dtype` plus
    4 ulp (flash-attention's own test rule; 1e-5 in float32). A kernel that disagrees or fails is not used, said in
    one line."""
    q_lens, k_lens = [1, 17, 64, 5, 30], [40, 17, 100, 5, 31]  # a query block aligned at the end of its keys
    host_q, host_k = [0, *torch.tensor(q_lens).cumsum(0).tolist()], [0, *torch.tensor(k_lens).cumsum(0).tolist()]
    to = dict(device=device, dtype=torch.int32)
    packing = Packing(torch.tensor(host_q, **to), torch.tensor(host_k, **to), None, max(q_lens), max(k_lens),
                      host_q, host_k)
    g = torch.Generator().manual_seed(0)
    fp32 = [torch.randn(n, h, dim, generator=g) for n, h in ((host_q[-1], heads), (host_k[-1], kv_heads),
                                                              (host_k[-1], kv_heads), (host_q[-1], heads))]

    def run(fn, precision):  # output and input gradients, as float32 on the host
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t), \
                torch.autocast(device.type, enabled=False):  # outside any checkpointing or autocast of the caller
            q, k, v = (x.to(device, precision).requires_grad_() for x in fp32[:3])
            out = fn(q, k, v, packing, dim ** -0.5)
            grads = torch.autograd.grad(out, (q, k, v), fp32[3].to(device, precision))
        return [x.float().cpu() for x in (out, *grads)]

    def error(result):
        return max(float((x - r).abs().max() / r.abs().max().clamp(min=1e-12)) for x, r in zip(result, reference))

    reference = run(_per_segment, torch.float32)
    try:
        ulp = max(4 * torch.finfo(dtype).eps, 1e-5)
        found, bound = error(run(kernel, dtype)), 2 * error(run(_per_segment, dtype)) + ulp
    except Exception as failure:  # noqa: BLE001 - any failure of the kernel means: not this kernel
        found, bound = failure, None
    if bound is not None and found <= bound:
        return True
    why = f"relative error {found:.2g} > {bound:.2g}" if bound is not None else f"{type(found).__name__}: {found}"
    warnings.warn(f"{kernel.__name__.strip('_')} disagrees with SDPA on {device} {dtype} ({heads} heads, {kv_heads} kv "
                  f"heads, dim {dim}; {why}): the packed attention runs SDPA per segment (exact, slower).",
                  stacklevel=2)
    return False


def packed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention interface: query (1, H, T, D), key/value (1, Hkv, T, D) -> ((1, T, H, D), None)."""
    packing = kwargs.pop(PACKING_KWARG, None)
    if packing is None and _packing_depth:  # a model that drops its kwargs: never run packed and wrong
        raise RuntimeError(f"{type(module).__name__} did not pass the packed metadata to its attention")
    if packing is None:  # not a packed forward: the user's own backend, unchanged
        return _users_attention(module)(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                        **kwargs)
    q, k, v = query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1)
    k, v = k.index_select(0, packing.kv_index), v.index_select(0, packing.kv_index)
    kernel = _kernel(q, k, _users(getattr(module, "config", None))) or _per_segment
    return kernel(q, k, v, packing, scaling).unsqueeze(0), None


def _users(config) -> str:
    return _users_backend.get(id(config), (None, "sdpa"))[1] or "sdpa"


def _users_attention(module):  # eager: each model file's own function
    name = _users(module.config)
    return ALL_ATTENTION_FUNCTIONS.get(name) or sys.modules[type(module).__module__].eager_attention_forward


def _packed_mask(*args, **kwargs):
    """No mask inside a packed forward (the metadata is the mask); the user's backend's mask otherwise."""
    return None if _packing_depth else ALL_MASK_ATTENTION_FUNCTIONS[_users(kwargs.get("config"))](
        *args, **kwargs)


AttentionInterface.register(PACKED, packed_attention)
AttentionMaskInterface.register(PACKED, _packed_mask)


def use_packed(models, packed: bool = True) -> None:
    """Point the models' configs at the packed attention, or (`packed=False`) back at their own; idempotent."""
    for config in (model.config for model in models):
        if packed and config._attn_implementation != PACKED:
            _users_backend[id(config)] = (config, config._attn_implementation)
            config._attn_implementation = PACKED
        elif not packed and config._attn_implementation == PACKED:
            config._attn_implementation = _users_backend.pop(id(config))[1]


@contextmanager
def packed_forward():
    """Marks a packed forward: its attention mask is never built."""
    global _packing_depth
    _packing_depth += 1
    try:
        yield
    finally:
        _packing_depth -= 1


EXACT_FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gpt_neox")  # each proven exact by tests/test_packed.py


def unsupported_reason(model, max_length: int | None) -> str | None:
    """Why `model`'s attention cannot run packed exactly (None if it can), from its config: the property that forbids
    it, named, else whether its family is one a test proves exact (the allowlist)."""
    c = model.config
    kind, window = getattr(c, "model_type", None), getattr(c, "sliding_window", None)
    other = sorted(set(getattr(c, "layer_types", None) or ()) - {"full_attention"})
    capped = [f"{n}={getattr(c, n)}" for n in ("attn_logit_softcapping", "final_logit_softcapping")
              if getattr(c, n, None) is not None]
    checks = [
        (getattr(c, "alibi", False) or kind in ("bloom", "mpt"), "its attention scores carry ALiBi biases"),
        (capped, f"its scores are soft-capped ({', '.join(capped)})"),
        (other, f"it has {other} layers"),
        (window is not None and getattr(c, "use_sliding_window", True) and (max_length is None or window < max_length),
         f"its sliding attention window ({window}) is shorter than a row (max_length={max_length})"),
        (kind == "opt", "its positions are derived from the attention mask"),
        (getattr(c, "attention_dropout", 0.0) or getattr(c, "attn_pdrop", 0.0), "it uses attention dropout"),
        (kind not in EXACT_FAMILIES, f"its architecture ({kind}) is not one a test proves exact packed "
                                     f"({', '.join(EXACT_FAMILIES)})"),
    ]
    return next((why for bad, why in checks if bad), None)
