"""The packed attention, registered with transformers for the plugin's packed forwards (policy and reference).

A packed group (plan.py) is one row of segments: a segment's queries are its tokens, its keys (`kv_index`) its pair's
shared part then itself, causal aligned lower-right. CUDA bf16/fp16: a varlen kernel (flash_attn's where the user
loaded `flash_attention_2` and it is installed, else `torch.nn.attention.varlen.varlen_attn`, also for FA3, hub-kernel
and flex users; GQA without repeating K/V; values narrower than keys padded), each used once a check on random
segments finds it agrees with SDPA (`_verify`); float32 queries cast where stock computes in half precision
(`_compute_dtype`); elsewhere, or where a kernel disagrees, SDPA per segment over the same metadata: cost Σ queries ×
keys, never (length)². The first packed forward of each model says its kernel (`kernel_of`). The metadata is a model
kwarg (moved to each layer's device), so gradient checkpointing's replay of a layer sees it. `use_packed` arms the
configs; an armed config names `PACKED` only during a packed forward (`packed_forward`) and until the backward of one
that needs a gradient has ended (`keep_until_backward`: the replay runs in the backward and reads the config then),
the user's own implementation otherwise: a generation or evaluation callback runs the user's attention, whatever it
is. A call without the metadata inside that window gets the user's own attention and mask, under the user's name.
Windows, soft-capping, sinks (docs/method.md, "Windows, soft-capping, sinks, families"): inside a packed forward the
mask builders return a `PackedMask` (the layer's sliding window, as stock's mask would apply it, and the metadata), so
each layer type gets its own window; `softcap` and `s_aux` arrive as the model passes them. The kernel check is keyed
per variant. Which models pack: `packed_verdict` (the tested table `EXACT_FAMILIES`, properties of the config and the
model file; any other family is checked by the trainer on its first batch).
Branch pruning (plan.plan_split): the grad forward keeps, detached, the keys and values (after rotary and QK-norm, as
the attention receives them) of the tokens its frozen group reads; the frozen forward puts them before its own keys
(`SharedKeys`), so a dropped branch never runs its prompt again.
Relies on transformers' `config._attn_implementation`, the mask builders' `local_size` and their call of
`find_packed_sequence_indices` by its module name (skipped inside a packed forward: no device read), each model
file's `eager_attention_forward`, the flash wrapper's `get_target_dtype`, and autograd's end-of-backward callback
(pinned by tests/test_packed_kernels.py, tests/test_gpu_setups_attention.py and the exactness matrix).
"""

import dataclasses
import importlib.util
import inspect
import sys
import warnings
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface, masking_utils
from transformers.integrations.flash_attention import get_target_dtype
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import logging
from transformers.utils.generic import is_flash_attention_requested

PACKED = "trl_pruned_dpo_packed"
PACKING_KWARG = "pruned_dpo_packing"

logger = logging.get_logger(__name__)

_users_backend: dict[int, tuple[object, str]] = {}  # id(config) -> (config, the implementation the user loaded)
_packings: list = []  # the packed forwards running (innermost last): their masks are never built
_held = [0]  # packed forwards whose backward has not ended: checkpointing replays their layers there


class SharedKeys:
    """The keys and values the frozen forward of branch pruning reads from the grad forward (plan.plan_split).

    The grad forward keeps, at each attention call, its tokens `index` of the keys and values, detached (the frozen
    rows get no gradient), in call order; once it has returned (`close`) a call is gradient checkpointing's replay in
    the backward and keeps nothing. The frozen forward's i-th call reads the i-th kept pair, of the same module (call
    order, not a dict by module: a module called twice per forward reads its two calls), then `release` frees them."""

    def __init__(self):
        self.index: torch.Tensor | None = None
        self.kept: list[tuple[torch.nn.Module, torch.Tensor, torch.Tensor]] = []
        self.keeping, self.read = False, 0

    def open(self, index: torch.Tensor) -> "SharedKeys":
        self.index, self.kept = index, []
        self.keeping, self.read = True, 0
        return self

    def close(self) -> None:
        self.keeping = False

    def release(self) -> None:
        self.kept, self.index = [], None

    def keep(self, module, key: torch.Tensor, value: torch.Tensor) -> None:
        """key, value: (T, Hkv, D) of the grad forward's row, on their layer's device (`device_map`)."""
        if self.keeping:
            index = self.index.to(key.device)
            self.kept.append((module, key.detach().index_select(0, index), value.detach().index_select(0, index)))

    def prepend(self, module, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The kept keys and values of this call, then the frozen forward's own (T, Hkv, D)."""
        if self.read >= len(self.kept) or self.kept[self.read][0] is not module:
            raise RuntimeError(f"the frozen forward's attention call {self.read} ({type(module).__name__}) is not the "
                               "grad forward's: the keys kept for it do not belong to it")
        _, k, v = self.kept[self.read]
        self.read += 1
        return torch.cat([k.to(key.dtype), key]), torch.cat([v.to(value.dtype), value])


@dataclass
class Packing:
    """One packed group's metadata on the device: cu_seq_q/cu_seq_k (segments + 1,) int32 boundaries of the queries in
    the row and of their keys in kv_index (keys,) long; max_q, max_k ints; host_q/host_k: cu_seq_q/k as ints. Branch
    pruning: `keeps`, the grad forward's keys kept for the frozen one; `reads`, those the frozen forward's kv_index
    counts before its own tokens."""

    cu_seq_q: torch.Tensor
    cu_seq_k: torch.Tensor
    kv_index: torch.Tensor
    max_q: int
    max_k: int
    host_q: list[int]
    host_k: list[int]
    keeps: SharedKeys | None = None
    reads: SharedKeys | None = None
    _copies: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

    def to(self, device, non_blocking: bool = False) -> "Packing":
        """This metadata on `device`, copied once per device: under `device_map` a layer on another device reads its
        own copy (accelerate's hooks move a layer's kwargs with `.to`; the packed attention moves what they did not)."""
        device = torch.device(device)
        if self.cu_seq_q.device == device:
            return self
        if device not in self._copies:
            moved = {name: None if t is None else t.to(device, non_blocking=non_blocking)
                     for name, t in (("cu_seq_q", self.cu_seq_q), ("cu_seq_k", self.cu_seq_k),
                                     ("kv_index", self.kv_index))}
            self._copies[device] = dataclasses.replace(self, **moved)
        return self._copies[device]


try:
    from torch.nn.attention.varlen import varlen_attn
    _PARAMS = inspect.signature(varlen_attn).parameters  # causal lower-right; GQA where the kernel takes it
    _CAUSAL = {"window_size": (-1, 0)} if "window_size" in _PARAMS else {"is_causal": True}
except ImportError:  # torch < 2.10: the per-segment path everywhere
    varlen_attn = None


@dataclass(frozen=True)
class Variant:
    """What a layer's scores carry beyond q·k and the causal order, as the model passes it to its attention: a sliding
    `window` (query at position p sees keys at positions p - window + 1 .. p, stock's `sliding_window_overlay`),
    tanh soft-capping of the scores (`softcap`, Gemma 2), a learned per-head sink logit (`sinks`, GPT-OSS's `s_aux`)."""

    window: int | None = None
    softcap: float | None = None
    sinks: bool = False


FULL = Variant()


class PackedMask:
    """What transformers' mask builders return inside a packed forward, in place of a mask: the layer's sliding window
    (`local_size`, which `create_sliding_window_causal_mask` passes), None for a causal layer, and the forward's
    packing. The model hands it to its attention as `attention_mask`, per layer type, so each layer gets the window
    stock's own mask would have; gradient checkpointing saves it with the layer's inputs, so a replay gets it too."""

    def __init__(self, window: int | None, packing=None):
        self.window, self.packing = window, packing


def _per_segment(query, key, value, packing: Packing, scaling, variant: Variant = FULL, sinks=None):
    """SDPA segment by segment: queries (T, H, D), gathered keys/values (K, Hkv, D); lower-right causal, banded to the
    variant's window in position space; soft-capped or with sinks: the eager formula of the model files.

    SDPA gets batched 4D inputs (1, H, L, D): only then does it take its fused kernels (on CPU the flash kernel, which
    keeps a logsumexp per query for the backward); 3D ones run the math path, which keeps lq x lk scores and
    probabilities per head (docs/benchmarks.md, "Where a step's memory goes").

    Each input is split once and the outputs concatenated once: a slice per segment would make the backward build a
    zero gradient of the whole row per segment, quadratic in the row's length (a merged step's pass is long)."""
    outs = []
    gqa = query.size(1) != key.size(1)
    q0s, k0s = packing.host_q, packing.host_k
    queries = query.split([q1 - q0 for q0, q1 in zip(q0s, q0s[1:])])
    keys, values = (x.split([k1 - k0 for k0, k1 in zip(k0s, k0s[1:])]) for x in (key, value))
    for q, k, v in zip(queries, keys, values):
        lq, lk = q.size(0), k.size(0)
        q, k, v = (x.transpose(0, 1) for x in (q, k, v))
        banded = variant.window is not None and variant.window < lk
        # no mask where it would outweigh a row's q and output (lk floats against 2·H·D) and the padded rows cost at
        # most half the segment's own scores ((lk - lq)²/2 against lq·lk): long branches behind a moderate prompt
        unmasked = lq == lk or (lk >= 2 * q.size(0) * q.size(2) and (lk - lq) ** 2 <= lq * lk)
        if variant.softcap is None and sinks is None and not banded and unmasked:
            if lq < lk:  # lower-right causal = the last lq rows of plain causal over lk rows: the rows before them (zero
                # queries, outputs dropped) cost S²/2 scores but no lq x lk mask, which SDPA would keep for backward
                q = torch.cat([q.new_zeros(q.size(0), lk - lq, q.size(2)), q], dim=1)
            o = _sdpa(q, k, v, scaling, gqa, is_causal=True)[:, lk - lq:]
        else:  # this segment's own lq x lk mask (SDPA keeps it, as floats, for the backward: one per segment, not head)
            visible = torch.ones(lq, lk, dtype=torch.bool, device=query.device).tril(lk - lq)
            if banded:  # key j sits at position j, query i at lk - lq + i (the branch's keys start at its position 0)
                visible &= ~torch.ones_like(visible).tril(lk - lq - variant.window)
            if variant.softcap is None and sinks is None:
                o = _sdpa(q, k, v, scaling, gqa, attn_mask=visible)
            else:
                o = _eager(q, k, v, visible, scaling, variant.softcap, sinks)
        outs.append(o.transpose(0, 1).to(query.dtype))
    return torch.cat(outs)


def _sdpa(q, k, v, scaling, gqa, **mask):
    """SDPA on one segment's (H|Hkv, l, D) inputs, batched to 4D (its fused kernels; see `_per_segment`)."""
    return F.scaled_dot_product_attention(q[None], k[None], v[None], scale=scaling, enable_gqa=gqa, **mask)[0]


def _eager(q, k, v, visible, scaling, softcap, sinks):
    """(H, lq, D) from (H|Hkv, l, D): the model files' eager attention: tanh-capped scores (Gemma 2), a sink logit per
    head joining the softmax and dropped after it (GPT-OSS)."""
    group = q.size(0) // k.size(0)
    k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
    scores = q @ k.transpose(1, 2) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is None:  # softmax in float32, as Gemma 2's eager attention
        return scores.softmax(-1, dtype=torch.float32).to(v.dtype) @ v
    logits = torch.cat([scores, sinks.reshape(-1, 1, 1).expand(-1, scores.size(1), 1).to(scores.dtype)], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    return logits.softmax(-1, dtype=torch.float32)[..., :-1].to(v.dtype) @ v


def _left(variant: Variant) -> int:  # the varlen kernels' left window: keys up to window - 1 positions back
    return -1 if variant.window is None else variant.window - 1


def _torch_varlen(q, k, v, packing: Packing, scaling, variant: Variant = FULL):
    gqa = q.size(1) // k.size(1)
    if gqa > 1 and "enable_gqa" not in _PARAMS:
        k, v = k.repeat_interleave(gqa, dim=1), v.repeat_interleave(gqa, dim=1)
    causal = {"window_size": (_left(variant), 0)} if "window_size" in _PARAMS else _CAUSAL
    return varlen_attn(q.contiguous(), k, v, packing.cu_seq_q, packing.cu_seq_k, packing.max_q, packing.max_k,
                       scale=scaling, **causal, **({"enable_gqa": gqa > 1} if "enable_gqa" in _PARAMS else {}))


def _flash_attn_varlen(q, k, v, packing: Packing, scaling, variant: Variant = FULL):
    """flash_attn >= 2.1: causal is lower-right, GQA native; window_size (2.3) and softcap (2.6) only when asked."""
    from flash_attn import flash_attn_varlen_func

    extra = {"window_size": (_left(variant), 0)} if variant.window is not None else {}
    if variant.softcap is not None:
        extra["softcap"] = variant.softcap
    return flash_attn_varlen_func(q.contiguous(), k, v, packing.cu_seq_q, packing.cu_seq_k, packing.max_q,
                                  packing.max_k, softmax_scale=scaling, causal=True, **extra)


FLASH_ATTN_INSTALLED = importlib.util.find_spec("flash_attn") is not None  # once: `_kernel` runs in every layer
# (kernel, device, dtype, heads, kv heads, (key head size, value head size), variant) -> agrees with the reference
_VERIFIED: dict[tuple, bool] = {}
HALF = (torch.bfloat16, torch.float16)  # what the varlen kernels take
PER_SEGMENT = "SDPA per segment"
SAID = " (said above)"  # a reason `_verify` has already warned about: the kernel line does not warn again
KERNEL_NAMES = {_torch_varlen: "torch varlen_attn", _flash_attn_varlen: "flash_attn varlen"}  # as the kernel line says


def _on_kernel_device(q) -> bool:  # the varlen kernels are CUDA-only
    return q.is_cuda


def _on_kernel(q) -> bool:
    return _on_kernel_device(q) and q.dtype in HALF


def _expresses(kernel, variant: Variant) -> bool:
    """Whether the kernel takes the variant at all: sinks neither; soft-capping flash_attn's only; a window where the
    kernel has `window_size` (torch's varlen_attn with it, flash_attn's)."""
    if variant.sinks or (variant.softcap is not None and kernel is not _flash_attn_varlen):
        return False
    return variant.window is None or kernel is _flash_attn_varlen or "window_size" in _PARAMS


def _asked(variant: Variant) -> str:
    return ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(variant).items() if v not in (None, False))


def _compute_dtype(q, module, backend: str) -> torch.dtype:
    """The dtype the packed attention computes in: q's own, except float32 queries on the kernels' device where stock's
    own attention computes in half precision too (under autocast, whose lower-precision list has SDPA and eager's
    matmuls; or with a flash backend): then the dtype transformers' flash path casts them to (`get_target_dtype`: the
    autocast dtype, else a quantized model's dtype, else its linear layers'). Float32 otherwise, as stock computes."""
    if q.dtype != torch.float32 or not _on_kernel_device(q):
        return q.dtype
    if not (torch.is_autocast_enabled(q.device.type)
            or is_flash_attention_requested(requested_attention_implementation=backend)):
        return q.dtype
    try:
        target = get_target_dtype(q, module)
    except (AttributeError, StopIteration):  # a module without a config or a linear layer: nothing to cast to
        return q.dtype
    return target if target in HALF else q.dtype


def _choose(q, k, backend: str, variant: Variant = FULL, value_size: int | None = None):
    """(the varlen kernel for this forward, None), or (None, why SDPA per segment): flash_attn's where the user loaded
    flash_attention_2 and it is installed, else torch's; each used only once `_verify` has found it exact for this
    variant (window, soft-cap) and shape (heads, kv heads: GQA; key and value head sizes), so a kernel wrong on one
    variant serves the others."""
    if not _on_kernel(q):
        if not _on_kernel_device(q):
            return None, f"on {q.device.type}: the varlen kernels run on CUDA only"
        return None, (f"queries in {q.dtype} without autocast, as stock's {backend} computes them: the varlen kernels "
                      "take bfloat16/float16 (bf16=True or fp16=True, or a half-precision model, runs them)")
    flash = backend == "flash_attention_2" and FLASH_ATTN_INSTALLED
    kernel = _flash_attn_varlen if flash else _torch_varlen if varlen_attn is not None else None
    if kernel is None:
        return None, f"torch {torch.__version__} has no varlen_attn (2.10+) and flash_attn is not installed"
    if not _expresses(kernel, variant):
        return None, f"{KERNEL_NAMES[kernel]} cannot take {_asked(variant)}"
    sizes = (q.size(2), value_size or q.size(2))
    key = (kernel, q.device, q.dtype, q.size(1), k.size(1), sizes, variant)
    if key not in _VERIFIED:
        _VERIFIED[key] = _verify(kernel, q.size(1), k.size(1), q.size(2), q.device, q.dtype, variant, sizes[1])
    return (kernel, None) if _VERIFIED[key] else (None, f"{KERNEL_NAMES[kernel]} disagreed with SDPA here{SAID}")


def _kernel(q, k, backend: str, variant: Variant = FULL, value_size: int | None = None):
    """The varlen kernel for this forward, or None (SDPA per segment): `_choose`'s kernel."""
    return _choose(q, k, backend, variant, value_size)[0]


def _run_kernel(kernel, q, k, v, packing: Packing, scaling, variant: Variant = FULL):
    """The kernel over one head size, as the varlen kernels need: values narrower than the keys (multi-head latent
    attention: 128 against 192) padded with zeros, as transformers' flash path pads them, keys narrower than the values
    likewise (zeros add nothing to a score); the output cut back to the values' size (the padding's columns are 0)."""
    size, value_size = q.size(-1), v.size(-1)
    scaling = size ** -0.5 if scaling is None else scaling  # the keys' own size, not the padded one
    if value_size < size:
        v = F.pad(v, [0, size - value_size])
    elif value_size > size:
        q, k = F.pad(q, [0, value_size - size]), F.pad(k, [0, value_size - size])
    return kernel(q, k, v, packing, scaling, variant)[..., :value_size]


def _verify(kernel, heads: int, kv_heads: int, dim: int, device, dtype, variant: Variant = FULL,
            value_size: int | None = None) -> bool:
    """The kernel (as `_run_kernel` calls it) against SDPA per segment on random segments (shared keys before the
    queries, and none), forward and backward, once per shape and variant: exact if its error from the fp32 reference is
    at most twice SDPA's own in `dtype` plus 4 ulp (flash-attention's own test rule; 1e-5 in float32). A kernel that
    disagrees or fails is not used for that variant, said in one line."""
    value_size = value_size or dim
    q_lens, k_lens = [1, 17, 64, 5, 30], [40, 17, 100, 5, 31]  # a query block aligned at the end of its keys
    host_q, host_k = [0, *torch.tensor(q_lens).cumsum(0).tolist()], [0, *torch.tensor(k_lens).cumsum(0).tolist()]
    to = dict(device=device, dtype=torch.int32)
    packing = Packing(torch.tensor(host_q, **to), torch.tensor(host_k, **to), None, max(q_lens), max(k_lens),
                      host_q, host_k)
    g = torch.Generator().manual_seed(0)
    fp32 = [torch.randn(n, h, d, generator=g) for n, h, d in (
        (host_q[-1], heads, dim), (host_k[-1], kv_heads, dim), (host_k[-1], kv_heads, value_size),
        (host_q[-1], heads, value_size))]

    def run(fn, precision):  # output and input gradients, as float32 on the host
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t), \
                torch.autocast(device.type, enabled=False):  # outside any checkpointing or autocast of the caller
            q, k, v = (x.to(device, precision).requires_grad_() for x in fp32[:3])
            out = fn(q, k, v, packing, dim ** -0.5, variant)
            grads = torch.autograd.grad(out, (q, k, v), fp32[3].to(device, precision))
        return [x.detach().float().cpu() for x in (out, *grads)]

    def error(result):
        return max(float((x - r).abs().max() / r.abs().max().clamp(min=1e-12)) for x, r in zip(result, reference))

    def checked(*args):
        return _run_kernel(kernel, *args)

    with sdpa_kernel(SDPBackend.MATH):  # the reference is the textbook formula (exact zeros where the math has them)
        reference = run(_per_segment, torch.float32)
    try:
        ulp = max(4 * torch.finfo(dtype).eps, 1e-5)
        with sdpa_kernel(SDPBackend.MATH):
            own = error(run(_per_segment, dtype))
        found, bound = error(run(checked, dtype)), 2 * own + ulp
    except Exception as failure:  # noqa: BLE001 - any failure of the kernel means: not this kernel
        found, bound = failure, None
    if bound is not None and found <= bound:
        return True
    why = f"relative error {found:.2g} > {bound:.2g}" if bound is not None else f"{type(found).__name__}: {found}"
    asked = _asked(variant) + (f", value size {value_size}" if value_size != dim else "")
    warnings.warn(f"{kernel.__name__.strip('_')} disagrees with SDPA on {device} {dtype} ({heads} heads, {kv_heads} kv "
                  f"heads, dim {dim}{', ' + asked if asked else ''}; {why}): the packed attention runs SDPA per segment "
                  "there (exact, slower).", stacklevel=2)
    return False


def packed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention interface: query (1, H, T, D), key/value (1, Hkv, T, D | Dv) -> ((1, T, H, Dv), None)."""
    packing = kwargs.pop(PACKING_KWARG, None)
    if packing is None and isinstance(attention_mask, PackedMask):  # a layer that passes on its mask, not its kwargs
        packing = attention_mask.packing
    if packing is None and _packings:  # a model that drops both: never run packed and wrong
        raise RuntimeError(f"{type(module).__name__} did not pass the packed metadata to its attention")
    if packing is None:  # not a packed forward: the user's own attention, unchanged
        return _users_call(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    packing = packing.to(query.device)  # a layer on another device than the forward's inputs (`device_map`)
    sinks = kwargs.get("s_aux")
    window = attention_mask.window if isinstance(attention_mask, PackedMask) else None
    if window is not None and window >= packing.max_k:  # wider than every segment: plain causal (the same kernel)
        window = None
    variant = Variant(window, kwargs.get("softcap"), sinks is not None)
    q, k, v = query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1)
    if packing.keeps is not None:
        packing.keeps.keep(module, k, v)
    if packing.reads is not None:
        k, v = packing.reads.prepend(module, k, v)
    k, v = k.index_select(0, packing.kv_index), v.index_select(0, packing.kv_index)
    config = getattr(module, "config", None)
    backend = _users(config)
    dtype = _compute_dtype(q, module, backend)
    if dtype != q.dtype:  # float32 queries where stock computes in half precision (`_compute_dtype`); cast back below
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    kernel, why = _choose(q, k, backend, variant, v.size(-1))
    if config is not None:  # the per-segment path on CUDA is the slow one: said, unless `_verify` has said it
        slow = kernel is None and _on_kernel_device(q) and not why.endswith(SAID)
        _note(config, kernel, why, query.dtype, dtype, slow)
    if kernel is None:
        out = _per_segment(q, k, v, packing, scaling, variant, sinks)
    else:
        out = _run_kernel(kernel, q, k, v, packing, scaling, variant)
    return out.to(query.dtype).unsqueeze(0), None


def _users(config) -> str:
    """The implementation the user loaded `config`'s model with ("sdpa" where none is known)."""
    entry = _users_backend.get(id(config))
    if entry is not None and entry[0] is config:
        return entry[1] or "sdpa"
    name = getattr(config, "_attn_implementation", None)
    return name if name and name != PACKED else "sdpa"


def _users_call(module, *args, **kwargs):
    """The user's own attention (eager: each model file's own function) for a forward without packed metadata while
    the config names the packed attention (a backward pending), under the user's own name: transformers' flash wrapper
    reads `module.config._attn_implementation` for the kernel to load (FA2, FA3, a hub kernel)."""
    config, name = module.config, _users(module.config)
    function = ALL_ATTENTION_FUNCTIONS.get(name) or sys.modules[type(module).__module__].eager_attention_forward
    if config._attn_implementation != PACKED:
        return function(module, *args, **kwargs)
    config._attn_implementation = name
    try:
        return function(module, *args, **kwargs)
    finally:
        config._attn_implementation = PACKED


def _packed_mask(*args, **kwargs):
    """No mask inside a packed forward (the metadata is the mask; the sliding window, if any, rides along as a
    `PackedMask`); the user's backend's mask otherwise (none for a backend without a mask entry, as stock's)."""
    if _packings:
        return PackedMask(kwargs.get("local_size"), _packings[-1])
    name = _users(kwargs.get("config"))
    return ALL_MASK_ATTENTION_FUNCTIONS[name](*args, **kwargs) if name in ALL_MASK_ATTENTION_FUNCTIONS else None


def _packed_sequence_indices(position_ids):
    """transformers' packed-sequence detection, which its mask builders run on `position_ids` passed without a mask
    (the packed forward's), reading a device value on the host (a sync) per builder: skipped inside a packed forward,
    whose metadata is the mask (`_packed_mask` ignores what detection finds); transformers' own elsewhere."""
    return None if _packings else _packed_sequence_indices.__wrapped__(position_ids)


_packed_sequence_indices.__wrapped__ = getattr(masking_utils.find_packed_sequence_indices, "__wrapped__",
                                               masking_utils.find_packed_sequence_indices)
masking_utils.find_packed_sequence_indices = _packed_sequence_indices  # `_preprocess_mask_arguments` calls it by name
AttentionInterface.register(PACKED, packed_attention)
AttentionMaskInterface.register(PACKED, _packed_mask)


# --------------------------------------------------------------------------------------------------- say the kernel
# id(config) -> [config, {kernel name: (how or why, the slow path where a kernel could run)}, said]
_used: dict[int, list] = {}


def _note(config, kernel, why: str | None, given: torch.dtype, dtype: torch.dtype, slow: bool) -> None:
    """Records the kernel a layer of `config`'s model ran (per layer call: a dict lookup, no device read); `slow`: the
    per-segment path where a kernel could have run (CUDA), not yet said."""
    entry = _used.get(id(config))
    if entry is None or entry[0] is not config:
        entry = _used[id(config)] = [config, {}, False]
    name = KERNEL_NAMES.get(kernel, getattr(kernel, "__name__", "a varlen kernel")) if kernel else PER_SEGMENT
    if name not in entry[1]:
        how = why if kernel is None else f"{given} queries cast to {dtype}" if given != dtype else None
        entry[1][name] = (how, slow)


def kernel_of(model) -> str | None:
    """The kernel(s) the packed attention ran for `model`, named at its first packed forward: "torch varlen_attn",
    "flash_attn varlen" or "SDPA per segment", joined by " + " where its layers differ (a sliding or soft-capped layer a
    kernel cannot take); None before any packed forward of it."""
    entry = _used.get(id(model.config))
    return " + ".join(entry[1]) if entry is not None and entry[0] is model.config else None


def _kernel_line(config, used: dict[str, tuple[str | None, bool]]) -> str:
    backend = _users(config)
    parts = "; ".join(f"{name} ({how})" if how else name for name, (how, _) in used.items())
    own = "flash_attn varlen" not in used and backend not in ("sdpa", "eager")
    note = f"; its own {backend} runs outside packed forwards only (evaluation, generation)" if own else ""
    return f"Packed attention of {getattr(config, 'model_type', 'the model')} (loaded with {backend}): {parts}{note}."


def _say_kernels() -> None:
    """Once per model, at the end of its first packed forward: the kernel line (a warning where a CUDA run takes the
    per-segment path: the slow one)."""
    for entry in _used.values():
        if not entry[2]:
            entry[2] = True
            line = _kernel_line(entry[0], entry[1])
            if any(slow for _, slow in entry[1].values()):
                warnings.warn(line + " The per-segment path is exact and slower.", stacklevel=2)
            else:
                logger.info(line)


# ------------------------------------------------------------------------------- where the configs name the attention
def _point(packed: bool) -> None:
    """Every armed config (`use_packed`) names the packed attention, or the user's own."""
    for config, users in _users_backend.values():
        config._attn_implementation = PACKED if packed else users


def use_packed(models, packed: bool = True) -> None:
    """Arm the models' configs for the packed attention, or (`packed=False`) disarm them and give each its own back;
    idempotent. An armed config names `PACKED` only while a packed forward runs and until the backward of one whose
    outputs need a gradient has ended (`packed_forward`, `keep_until_backward`); otherwise the user's own, so a
    generation or evaluation callback, or a user's forward between steps, runs the user's attention, whatever it is."""
    for config in (model.config for model in models):
        entry = _users_backend.get(id(config))
        armed = entry is not None and entry[0] is config
        if packed and not armed and config._attn_implementation != PACKED:
            _users_backend[id(config)] = (config, config._attn_implementation)
        elif not packed and armed:
            config._attn_implementation = _users_backend.pop(id(config))[1]
    if not _users_backend:
        _held[0] = 0


@contextmanager
def packed_forward(packing: Packing | None = None):
    """Marks a packed forward: the armed configs name the packed attention; its attention mask is never built (its
    mask builders return `PackedMask`s carrying `packing`, for models whose layers pass the mask but not their kwargs
    on to the attention) and transformers' packed-sequence detection is skipped. Once the outermost ends, the configs
    name the users' own again, unless a backward is pending (`keep_until_backward`); the first one says the kernel."""
    # A new grad forward: a pending backward of an earlier one was abandoned (its forward never backpropagated), or it
    # runs with this one's and re-points the configs itself (`keep_until_backward`'s hook) when it starts.
    if not _packings and torch.is_grad_enabled():
        _held[0] = 0
    _packings.append(packing)
    _point(True)
    try:
        yield
    finally:
        _packings.pop()
        if not _packings:
            _say_kernels()
            if not _held[0]:
                _point(False)


def keep_until_backward(tensors) -> None:
    """Inside `packed_forward`: the armed configs go on naming the packed attention until the backward through
    `tensors` (those that need a gradient; none: nothing is kept) has ended, and again during any later backward
    through them: gradient checkpointing replays the layers there, and they read the config at call time. The end of
    the backward is autograd's queued callback (as DDP's and FSDP's reducers use it; pinned by a test)."""
    tensors = [t for t in tensors if torch.is_tensor(t) and t.requires_grad]
    if not tensors:
        return
    _held[0] += 1
    pending = [True]

    def release() -> None:
        if pending[0]:
            pending[0] = False
            _held[0] = max(0, _held[0] - 1)
        if not _held[0] and not _packings:
            _point(False)

    def during_backward(grad):
        _point(True)
        torch.autograd.Variable._execution_engine.queue_callback(release)

    for tensor in tensors:
        tensor.register_hook(during_backward)


# The families tests/test_exactness_matrix.py proves exact packed against stock DPOTrainer (every setting it runs: share
# and padding-free, with and without the common prefix, checkpointing on and off); what makes each one more than Llama
# is named, since that is what the test covers. Another family with attention through transformers' interface runs
# packed only after the trainer's first-batch check (`needs_check`).
EXACT_FAMILIES: dict[str, str] = {
    "llama": "rotary", "qwen2": "GQA; sliding layers (layer_types)", "qwen3": "QK-norm",
    "mistral": "a sliding window of any width", "ministral": "sliding window", "mixtral": "MoE",
    "qwen2_moe": "MoE with a shared expert; sliding layers by mask only", "qwen3_moe": "MoE; QK-norm",
    "deepseek_v3": "MoE; multi-head latent attention", "gpt_oss": "MoE; attention sinks (s_aux); sliding layers",
    "olmoe": "MoE; QK-norm", "jetmoe": "MoE attention and MLP", "gemma": "scaled embeddings",
    "gemma2": "soft-capped scores (eager) and logits; sliding layers", "gemma3_text": "sliding layers; QK-norm",
    "vaultgemma": "soft-capping; sliding layers", "cohere": "parallel block; logit scale",
    "cohere2": "sliding layers; NoPE full layers", "olmo": "clipped QKV", "olmo2": "QK-norm",
    "olmo3": "sliding layers; QK-norm", "granite": "residual / attention / logit multipliers",
    "smollm3": "NoPE layers", "stablelm": "partial rotary", "phi": "partial rotary; parallel block",
    "phi3": "sliding window", "persimmon": "partial rotary; QK layer-norm", "starcoder2": "sliding window",
    "nemotron": "partial rotary", "exaone4": "sliding layers; QK-norm", "gpt2": "learned absolute positions",
    "gptj": "partial interleaved rotary", "codegen": "partial rotary; fused QKV", "biogpt": "learned positions",
    "gpt_bigcode": "multi-query attention; learned positions", "opt": "positions from the mask in stock",
    "gpt_neox": "partial rotary", "glm": "partial interleaved rotary", "glm4": "partial rotary; post-norms",
    "helium": "rotary", "seed_oss": "attention biases", "arcee": "ReLU² MLP", "hunyuan_v1_dense": "QK-norm",
    "ernie4_5": "interleaved rotary", "bitnet": "ternary linear layers", "diffllama": "differential attention",
    "phimoe": "MoE (sparsemixer); sliding window by mask only", "granitemoe": "MoE; multipliers",
    "granitemoeshared": "MoE with a shared expert",
}

# Layers that carry a recurrent or convolutional state across positions: a packed row would carry it from one segment
# into the next, so these never run packed (and are not checked).
RECURRENT_FAMILIES = frozenset({
    "mamba", "mamba2", "falcon_mamba", "falcon_h1", "jamba", "bamba", "zamba", "zamba2", "nemotron_h", "lfm2",
    "lfm2_moe", "recurrent_gemma", "qwen3_next", "granitemoehybrid", "minimax", "rwkv", "xlstm", "kimi_linear",
    "olmo_hybrid", "bailing_hybrid", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text",
})
ATTENTION_LAYERS = frozenset({"full_attention", "sliding_attention"})  # `layer_types` entries the packed path can run
ALIBI_FAMILIES = frozenset({"bloom", "mpt"})  # ALiBi always (Falcon: where `config.alibi`)
CHECK = "check"  # `packed_verdict`: run packed only after the first-batch check


def _recurrent(config) -> str | None:
    other = sorted(set(getattr(config, "layer_types", None) or ()) - ATTENTION_LAYERS)
    if config.model_type in RECURRENT_FAMILIES or other:
        return f"its layers keep a recurrent or convolutional state ({config.model_type}{': ' if other else ''}" \
               f"{', '.join(other)})"
    return None


def _routes_attention(model) -> bool:
    """Whether the model file calls transformers' attention interface (where the packed attention plugs in): the files
    of the model's classes (FSDP2 subclasses the model's class in a torch module); none readable: the first-batch
    check decides."""
    from transformers import PreTrainedModel

    read = False
    for cls in type(model).__mro__:
        if not issubclass(cls, PreTrainedModel) or cls is PreTrainedModel:  # its own file names the interface
            continue
        try:
            source = inspect.getsource(sys.modules[cls.__module__])
        except (OSError, TypeError, KeyError):
            continue
        read = True
        if "ALL_ATTENTION_FUNCTIONS" in source or "AttentionInterface" in source:
            return True
    return not read


def packed_verdict(model) -> str | None:
    """None: `model` runs packed (its family is proven exact); `CHECK`: runs packed once the trainer's first-batch
    check agrees; otherwise why it cannot run packed, from its config and its model file (one line)."""
    c = model.config
    kind = getattr(c, "model_type", None)
    recurrent = _recurrent(c)
    checks = [
        (recurrent, recurrent),
        (getattr(c, "alibi", False) or kind in ALIBI_FAMILIES, "its attention scores carry ALiBi biases, computed in "
                                                               "its own attention module (no packed metadata there)"),
        (getattr(c, "attention_chunk_size", None), "its attention is chunked (attention_chunk_size)"),
        (getattr(c, "attention_dropout", 0.0) or getattr(c, "attn_pdrop", 0.0), "it uses attention dropout"),
        (not _routes_attention(model), f"its attention ({kind}) does not go through transformers' attention "
                                       "interface, where the packed attention plugs in"),
    ]
    reason = next((why for bad, why in checks if bad), None)
    return reason if reason else None if kind in EXACT_FAMILIES else CHECK
