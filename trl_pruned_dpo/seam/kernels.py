"""The packed attention's kernels and the metadata they run over (seam/attention.py calls them; this module imports
nothing of it).

A packed group (method/packing.py) is one row of segments: a segment's queries are its tokens, its keys
(`kv_index`) its pair's shared part then itself, causal aligned lower-right; `Packing` is its metadata on the device,
carrying branch pruning's `SharedKeys` (packing.plan_split: the grad forward keeps, detached, the keys and values,
after rotary and QK-norm, of the tokens its frozen group reads; the frozen forward puts them before its own keys, so a dropped branch never runs its
prompt again). CUDA bf16/fp16: a varlen kernel (flash_attn's where the user loaded `flash_attention_2` and it is
installed, else `torch.nn.attention.varlen.varlen_attn`, also for FA3, hub-kernel and flex users; GQA without
repeating K/V; values narrower than keys padded), each used once a check on random segments finds it agrees with SDPA
(`_verify`, keyed per `Variant`: window, soft-capping, sinks); float32 queries cast where stock computes in half
precision (`_compute_dtype`); elsewhere, or where a kernel disagrees, SDPA per segment over the same metadata
(`_per_segment`): cost Σ queries × keys, never (length)². `_choose` says which runs, or why the per-segment path does.
Relies on `varlen_attn`'s signature, flash_attn's `flash_attn_varlen_func` and the flash wrapper's `get_target_dtype`
(pinned by tests/test_packed_kernels.py, tests/test_gpu_setups_attention.py and the exactness matrix).
"""

import dataclasses
import importlib.util
import inspect
import warnings
from dataclasses import dataclass

import torch
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers.integrations.flash_attention import get_target_dtype
from transformers.utils.generic import is_flash_attention_requested


class SharedKeys:
    """The keys and values the frozen forward of branch pruning reads from the grad forward (packing.plan_split).

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
