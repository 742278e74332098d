"""The packed attention, registered with transformers for the plugin's packed forwards (policy and reference); its
kernels, their metadata (`Packing`, `SharedKeys`) and which of them runs are seam/kernels.py's.

`packed_attention` gathers each segment's keys (`kv_index`: its pair's shared part then itself; branch pruning's kept
keys first, `SharedKeys`) and runs the kernel `kernels._choose` picks, or SDPA per segment. The first packed forward of
each model says its kernel (`kernel_of`). The metadata is a model kwarg (moved to each layer's device), so gradient
checkpointing's replay of a layer sees it. `use_packed` arms the configs; an armed config names `PACKED` only during a
packed forward (`packed_forward`) and until the backward of one that needs a gradient has ended
(`keep_until_backward`: the replay runs in the backward and reads the config then), the user's own implementation
otherwise: a generation or evaluation callback runs the user's attention, whatever it is. A call without the metadata
inside that window gets the user's own attention and mask, under the user's name.
Windows, soft-capping, sinks (docs/method.md, "Windows, soft-capping, sinks, families"): inside a packed forward the
mask builders return a `PackedMask` (the layer's sliding window, as stock's mask would apply it, and the metadata), so
each layer type gets its own window; `softcap` and `s_aux` arrive as the model passes them. Which models pack:
`packed_verdict` (the tested table `EXACT_FAMILIES`, properties of the config and the model file; any other family is
checked by the trainer on its first batch).
The kernels' functions are read through their module (`kernels._choose`, ...), so a test patches each in one place.
Relies on transformers' `config._attn_implementation`, the mask builders' `local_size` and their call of
`find_packed_sequence_indices` by its module name (skipped inside a packed forward: no device read), each model
file's `eager_attention_forward`, and autograd's end-of-backward callback (pinned by tests/test_packed_kernels.py,
tests/test_gpu_setups_attention.py and the exactness matrix).
"""

import inspect
import sys
import warnings
from contextlib import contextmanager

import torch
from transformers import AttentionInterface, masking_utils
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import logging

from . import kernels
from .kernels import FULL, HALF, SharedKeys  # noqa: F401  (public here as before)
from .kernels import KERNEL_NAMES, PER_SEGMENT, SAID, Packing, Variant

PACKED = "trl_pruned_dpo_packed"
PACKING_KWARG = "pruned_dpo_packing"

logger = logging.get_logger(__name__)

_users_backend: dict[int, tuple[object, str]] = {}  # id(config) -> (config, the implementation the user loaded)
_packings: list = []  # the packed forwards running (innermost last): their masks are never built
_held = [0]  # packed forwards whose backward has not ended: checkpointing replays their layers there


class PackedMask:
    """What transformers' mask builders return inside a packed forward, in place of a mask: the layer's sliding window
    (`local_size`, which `create_sliding_window_causal_mask` passes), None for a causal layer, and the forward's
    packing. The model hands it to its attention as `attention_mask`, per layer type, so each layer gets the window
    stock's own mask would have; gradient checkpointing saves it with the layer's inputs, so a replay gets it too."""

    def __init__(self, window: int | None, packing=None):
        self.window, self.packing = window, packing


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
    dtype = kernels._compute_dtype(q, module, backend)
    if dtype != q.dtype:  # float32 queries where stock computes in half precision (`_compute_dtype`); cast back below
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    kernel, why = kernels._choose(q, k, backend, variant, v.size(-1))
    if config is not None:  # the per-segment path on CUDA is the slow one: said, unless `_verify` has said it
        slow = kernel is None and kernels._on_kernel_device(q) and not why.endswith(SAID)
        _note(config, kernel, why, query.dtype, dtype, slow)
    if kernel is None:
        out = kernels._per_segment(q, k, v, packing, scaling, variant, sinks)
    else:
        out = kernels._run_kernel(kernel, q, k, v, packing, scaling, variant)
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


def _unrunnable_layers(config) -> str | None:
    """Why the model's layers cannot run packed (recurrent families; `layer_types` the packed path does not know, such
    as chunked, indexed or compressed attention), or None."""
    other = sorted(set(getattr(config, "layer_types", None) or ()) - ATTENTION_LAYERS)
    if config.model_type in RECURRENT_FAMILIES:
        return f"its layers keep a recurrent or convolutional state ({config.model_type}{': ' if other else ''}" \
               f"{', '.join(other)})"
    if other:
        return f"its layer types include {', '.join(other)} ({config.model_type}), which the packed attention does " \
               "not run"
    return None


def _model_files(model) -> list[str]:
    """The source of the files of the model's classes (FSDP2 subclasses the model's class in a torch module), those
    that can be read."""
    from transformers import PreTrainedModel

    sources = []
    for cls in type(model).__mro__:
        if not issubclass(cls, PreTrainedModel) or cls is PreTrainedModel:  # its own file names the interface
            continue
        try:
            sources.append(inspect.getsource(sys.modules[cls.__module__]))
        except (OSError, TypeError, KeyError):
            continue
    return sources


def _routes_attention(model) -> bool:
    """Whether the model file calls transformers' attention interface (where the packed attention plugs in); none
    readable: the first-batch check decides."""
    sources = _model_files(model)
    return not sources or any("ALL_ATTENTION_FUNCTIONS" in s or "AttentionInterface" in s for s in sources)


# What a model file that switches its attention on `config.is_decoder` builds when it is False: a mask over every
# token (GPT-NeoX also has the attribute, and is causal either way).
BIDIRECTIONAL_MASKS = ("create_bidirectional_mask", "_prepare_4d_attention_mask", "get_extended_attention_mask")


def bidirectional(model) -> str | None:
    """Why `model`'s attention is not causal, or None: an encoder family loaded as a causal LM without
    `is_decoder=True` (BERT, RoBERTa, ...: transformers' `is_decoder` switch), where every token sees the ones after it.
    Packing and any cut of a row (positions past the last scored one, a response prefix, the common prefix) are exact
    only where a token sees none of the tokens after it."""
    c = model.config
    if getattr(c, "is_decoder", True) is not False or getattr(c, "is_encoder_decoder", False):
        return None
    if not any(mask in source for source in _model_files(model) for mask in BIDIRECTIONAL_MASKS):
        return None
    return f"its attention is bidirectional ({c.model_type} with is_decoder=False: each token sees the tokens after it)"


def packed_verdict(model) -> str | None:
    """None: `model` runs packed (its family is proven exact); `CHECK`: runs packed once the trainer's first-batch
    check agrees; otherwise why it cannot run packed, from its config and its model file (one line)."""
    c = model.config
    kind = getattr(c, "model_type", None)
    layers = _unrunnable_layers(c)
    both_ways = bidirectional(model)
    checks = [
        (both_ways, both_ways),
        (layers, layers),
        (getattr(c, "alibi", False) or kind in ALIBI_FAMILIES, "its attention scores carry ALiBi biases, computed in "
                                                               "its own attention module (no packed metadata there)"),
        (getattr(c, "attention_chunk_size", None), "its attention is chunked (attention_chunk_size)"),
        (getattr(c, "attention_dropout", 0.0) or getattr(c, "attn_pdrop", 0.0), "it uses attention dropout"),
        (not _routes_attention(model), f"its attention ({kind}) does not go through transformers' attention "
                                       "interface, where the packed attention plugs in"),
    ]
    reason = next((why for bad, why in checks if bad), None)
    return reason if reason else None if kind in EXACT_FAMILIES else CHECK
