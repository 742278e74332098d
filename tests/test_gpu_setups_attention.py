"""What GPU users' attention setups do to the packed attention (issue 48), each cell on CPU.

There is no GPU here. A GPU-only cell runs with a stand-in, and its docstring says which:
- `flash_standin`: transformers' own flash wrapper (`flash_attention_forward`, unchanged) over fake flash functions
  (SDPA / `naive_varlen`) in place of the flash-attn package or a hub kernel: `_lazy_imports` answers for the names
  a user can load (`flash_attention_2`, `kernels-community/flash-attn`) and defers to transformers for any other
  name, which raises as on a GPU for `trl_pruned_dpo_packed`;
- `kernel_device`: the CUDA branch taken on CPU (`_on_kernel_device` patched), with a stand-in varlen kernel that
  takes only what the real ones take (one head size, half precision where asked);
- `meta` as the second device of a `device_map` run: an op that mixes it with CPU tensors is caught by a torch function
  mode (meta kernels mix devices silently, real ones raise).
"""

import sys

import pytest
import torch
import transformers
import transformers.modeling_flash_attention_utils as flash_utils
from datasets import Dataset
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree
from transformers import TrainerCallback
from transformers.integrations.flash_attention import flash_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from conftest import build_trainer, first_batch, loss_and_grads, tiny_model
from test_packed import ONLY, assert_exact, edge_rows, family, naive_varlen, pair_of_trainers, _host
from trl_pruned_dpo import PrunedDPOConfig, PrunedDPOTrainer
from trl_pruned_dpo.method.packing import pair_trees, plan_group
from trl_pruned_dpo.seam import attention, kernels

HUB = "kernels-community/flash-attn"
FLASH_NAMES = ("flash_attention_2", HUB)
IDS = torch.tensor([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])  # row 0 left-padded: a generation-style batch
MASK = (torch.arange(6) >= torch.tensor([[2], [0]])).long()


def _flash_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                deterministic=False):
    """flash_attn_func's documented semantics on (batch, length, heads, dim), by SDPA."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=softmax_scale,
                                         is_causal=causal, enable_gqa=q.size(2) != k.size(2))
    return out.transpose(1, 2)


def _flash_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                       softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, deterministic=False):
    assert causal
    return naive_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale=softmax_scale,
                        window_size=(-1, 0), enable_gqa=q.size(1) != k.size(1))


@pytest.fixture
def flash_standin(monkeypatch):
    """transformers' flash path with fake flash functions for FA2 and a hub kernel (module docstring); the hub name
    registered as transformers registers a loaded kernel (its wrapper, flash_attention_2's mask). Returns the names of
    the implementations each flash call asked for."""
    loaded, real, load = [], flash_utils._lazy_imports, flash_utils.lazy_import_flash_attention

    def lazy_imports(implementation, *args, **kwargs):
        if implementation in FLASH_NAMES:
            return _flash_func, _flash_varlen_func, None, flash_utils._pad_input, flash_utils._unpad_input
        return real(implementation, *args, **kwargs)

    def lazy_import_flash_attention(implementation, *args, **kwargs):
        loaded.append(implementation)
        return load(implementation, *args, **kwargs)

    monkeypatch.setattr(flash_utils, "_lazy_imports", lazy_imports)
    monkeypatch.setattr(flash_utils, "lazy_import_flash_attention", lazy_import_flash_attention)
    monkeypatch.setattr(flash_utils, "_loaded_implementation", None)
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, HUB, flash_attention_forward)
    monkeypatch.setitem(ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, HUB,
                        ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"])
    return loaded


def _loaded_with(trainer, name):
    """The trainer's models as a user loads them with `attn_implementation=name` (set after construction: on CPU
    transformers refuses to load a flash one)."""
    for model in (trainer.model, trainer.ref_model):
        model.config._attn_implementation = name


def _logits(model):
    """`model`'s logits on the generation-style batch, no grad."""
    with torch.no_grad():
        return model(input_ids=IDS, attention_mask=MASK).logits


# ------------------------------------------------------------------------- item 1: forwards without packed metadata
@pytest.mark.parametrize("name", FLASH_NAMES)
def test_a_forward_without_metadata_gets_the_users_flash_attention(name, flash_standin, tokenizer, tmp_path):
    """Stand-in: `flash_standin`. FA2 or a hub kernel loaded, gradient checkpointing on: training is exact (the replay
    in the backward runs packed), and after the backward the configs name the user's implementation again; a forward
    without the metadata between the forward and its backward (the configs still naming the packed attention) runs
    the user's flash path too, under the user's name (the wrapper loads the kernel it reads from the config)."""
    stock, pruned = pair_of_trainers(family("qwen2"), tokenizer, tmp_path, **ONLY["padding_free"])
    _loaded_with(stock, name)
    _loaded_with(pruned, name)
    expected = _logits(stock.model)  # the same weights, only ever the user's attention
    assert_exact(stock, pruned, checkpointing=True)
    assert pruned.model.config._attn_implementation == name and pruned.ref_model.config._attn_implementation == name
    torch.testing.assert_close(_logits(pruned.model), expected)
    loss = pruned.compute_loss(pruned.model, first_batch(pruned, 8))
    assert pruned.model.config._attn_implementation == attention.PACKED  # the backward replays the packed layers
    flash_standin.clear()
    torch.testing.assert_close(_logits(pruned.model), expected)
    assert set(flash_standin) == {name}
    loss.backward()
    assert pruned.model.config._attn_implementation == name


@pytest.mark.parametrize("name", ["sdpa", "eager"])
def test_sdpa_and_eager_users_get_their_attention_back_after_each_backward(name, tokenizer, tmp_path):
    """sdpa or eager loaded, gradient checkpointing on: exact against stock with the same attention, and after each
    backward the configs name the user's own again; a forward then is the user's (left padding)."""
    stock, pruned = pair_of_trainers(family("llama"), tokenizer, tmp_path, **ONLY["share_prompt"])
    _loaded_with(stock, name)
    _loaded_with(pruned, name)
    expected = _logits(stock.model)
    assert_exact(stock, pruned, checkpointing=True)
    assert pruned.model.config._attn_implementation == pruned.ref_model.config._attn_implementation == name
    pruned.model.eval()
    torch.testing.assert_close(_logits(pruned.model), expected)


def test_a_generation_callback_between_steps_runs_the_users_attention(flash_standin, tokenizer, tmp_path):
    """Stand-in: `flash_standin` (FA2). A callback that generates at every step end, gradient checkpointing and
    gradient accumulation on: each call sees the user's implementation named and its flash path runs."""
    seen = []

    class Generate(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            seen.append(model.config._attn_implementation)
            with torch.no_grad():
                model.generate(input_ids=IDS, attention_mask=MASK, max_new_tokens=2, do_sample=False)

    trainer = build_trainer(PrunedDPOTrainer, PrunedDPOConfig, tokenizer, Dataset.from_list(edge_rows()), tmp_path,
                            model=family("llama")(tokenizer), max_steps=2, per_device_train_batch_size=2,
                            gradient_accumulation_steps=2, gradient_checkpointing=True)
    _loaded_with(trainer, "flash_attention_2")
    trainer.add_callback(Generate())
    flash_standin.clear()
    trainer.train()
    assert trainer.forward_choice.packed and seen == ["flash_attention_2"] * 2
    assert set(flash_standin) == {"flash_attention_2"}


def test_flex_attention_user_trains_packed_and_keeps_flex_outside(tokenizer, tmp_path, monkeypatch):
    """flex_attention loaded (its registry entry a counting stand-in: CPU flex compiles for minutes and has no
    backward). Packed forwards never call it (the packed attention computes the same math as stock's: exact against
    stock with SDPA); a forward between steps does, with its own mask; the kernel line says flex runs outside packed
    forwards only."""
    calls = []
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "flex_attention",
                        lambda *args, **kwargs: (calls.append(1), sdpa(*args, **kwargs))[1])
    monkeypatch.setitem(ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, "flex_attention",
                        ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    said = []
    monkeypatch.setattr(attention.logger, "info", said.append)
    monkeypatch.setattr(attention, "_used", {})
    stock, pruned = pair_of_trainers(family("qwen2"), tokenizer, tmp_path, **ONLY["share_prompt"])
    _loaded_with(pruned, "flex_attention")
    expected = _logits(stock.model)  # the same weights, only ever SDPA
    assert_exact(stock, pruned, checkpointing=True)
    assert not calls and pruned.model.config._attn_implementation == "flex_attention"
    pruned.model.eval()  # an evaluation callback's forward
    torch.testing.assert_close(_logits(pruned.model), expected)
    assert len(calls) == 2  # one per layer
    assert any("its own flex_attention runs outside packed forwards only" in line for line in said), said


# ---------------------------------------------------------------------------------- item 2: float32 queries on CUDA
class _Layer(torch.nn.Module):
    """An attention layer as transformers' `get_target_dtype` reads it: a config, and linear weights."""

    def __init__(self, name, weights=torch.float32):
        super().__init__()
        self.config = transformers.LlamaConfig()
        self.config._attn_implementation = name
        self.proj = torch.nn.Linear(8, 8, dtype=weights)


def _packed_inputs(heads=4, kv_heads=2, dim=8, value_dim=None, share=True):
    """A packed group's metadata (3 pairs, shared prompts) and random q, k, v in the interface's (1, H, T, D)."""
    host = _host([5, 2, 7], [[1, 2, 3], [4, 4, 1], [5, 6, 7, 8]], [[1, 2, 9, 9], [4, 4, 6, 7, 8], [5, 6, 1]])
    group = plan_group(host, host.completion_mask[:, 1:].bool(), torch.ones(6, dtype=torch.bool),
                       pair_trees(torch.full((3,), share)), packed=True)
    total = group.input_ids.size(1)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, total, d, generator=g)
               for h, d in ((heads, dim), (kv_heads, dim), (kv_heads, value_dim or dim)))
    packing = attention.Packing(group.cu_seq_q, group.cu_seq_k, group.kv_index, group.max_q, group.max_k,
                                *group.bounds)
    return q, k, v, packing


@pytest.fixture
def kernel_device(monkeypatch):
    """The CUDA branch on CPU: `_on_kernel_device` true, a stand-in varlen_attn that, as the real one, takes half
    precision only and one head size; the dtypes it was called with are returned."""
    dtypes = []

    def varlen(q, k, v, *args, **kwargs):
        assert q.dtype in attention.HALF and q.dtype == k.dtype == v.dtype, q.dtype
        assert q.size(-1) == k.size(-1) == v.size(-1), "one head size"
        dtypes.append(q.dtype)
        return naive_varlen(q, k, v, *args, **kwargs)

    monkeypatch.setattr(kernels, "varlen_attn", varlen)
    monkeypatch.setattr(kernels, "_on_kernel_device", lambda q: True)
    monkeypatch.setattr(kernels, "_VERIFIED", {})
    monkeypatch.setattr(attention, "_used", {})
    return dtypes


@pytest.mark.parametrize("cell", ["autocast-bf16", "autocast-fp16", "flash-bf16-weights"])
def test_float32_queries_reach_the_kernel_cast_as_transformers_flash_path_casts(cell, kernel_device):
    """Stand-in: `kernel_device`. float32 q (QLoRA's fp32 norms, fp32 master weights under autocast): under autocast
    the autocast dtype, with a flash backend the weights' dtype (transformers' `get_target_dtype`); the kernel runs in
    it and the output comes back in float32, equal to SDPA per segment in that dtype."""
    dtype = torch.float16 if cell == "autocast-fp16" else torch.bfloat16
    layer = _Layer("flash_attention_2", torch.bfloat16) if cell.startswith("flash") else _Layer("sdpa")
    q, k, v, packing = _packed_inputs()
    autocast = torch.autocast("cpu", dtype=dtype, enabled=cell.startswith("autocast"))
    with autocast:
        out, _ = attention.packed_attention(layer, q, k, v, attention.PackedMask(None, packing), scaling=0.3)
    assert out.dtype == torch.float32 and set(kernel_device) == {dtype}
    half = [x[0].transpose(0, 1).to(dtype) for x in (q, k, v)]
    half[1:] = [x.index_select(0, packing.kv_index) for x in half[1:]]
    expected = kernels._per_segment(*half, packing, 0.3).float()
    torch.testing.assert_close(out[0], expected, rtol=2e-2, atol=2e-2)
    assert attention._kernel_line(layer.config, attention._used[id(layer.config)][1]).count("queries cast to") == 1


@pytest.mark.parametrize("loaded", [torch.bfloat16, torch.float32], ids=["bf16-model", "fp32-model"])
def test_a_real_4bit_model_casts_float32_queries_to_its_config_dtype(loaded, kernel_device, tokenizer, tmp_path):
    """Stand-in: `kernel_device`. A real bitsandbytes 4-bit model (QLoRA's fp32 norms make float32 queries): with a
    flash backend the packed attention computes in the dtype transformers' flash path casts them to, which for a
    quantized model is its config's dtype (`get_target_dtype`'s quantized branch), not its linear layers' (uint8);
    a model loaded in float32 keeps float32 (no varlen kernel takes it: SDPA per segment, as said)."""
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    tiny_model(tokenizer).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=loaded, quantization_config=BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16))
    layer = model.model.layers[0].self_attn
    assert getattr(model, "is_loaded_in_4bit", False) and layer.q_proj.weight.dtype == torch.uint8
    assert kernels._compute_dtype(torch.zeros(1, 2, 8), layer, "flash_attention_2") == loaded
    assert kernels._compute_dtype(torch.zeros(1, 2, 8), layer, "sdpa") == torch.float32  # stock's SDPA: float32


def test_float32_without_autocast_runs_per_segment_and_says_why(kernel_device, tokenizer, tmp_path):
    """Stand-in: `kernel_device`. An fp32 model with SDPA and no autocast: stock computes in float32, so the packed
    attention does too (per segment, exact); one warning at the first packed forward says so and what to set, and the
    kernel is named on the forward choice."""
    trainer = build_trainer(PrunedDPOTrainer, PrunedDPOConfig, tokenizer, Dataset.from_list(edge_rows()), tmp_path,
                            per_device_train_batch_size=4)
    assert trainer.forward_choice.kernel is None  # nothing ran packed yet
    with pytest.warns(UserWarning, match=r"Packed attention of llama \(loaded with sdpa\): SDPA per segment \(queries "
                                         r"in torch.float32 without autocast.*bf16=True") as caught:
        loss_and_grads(trainer, first_batch(trainer, 4))
        loss_and_grads(trainer, first_batch(trainer, 4))
    assert len([w for w in caught if "Packed attention of" in str(w.message)]) == 2  # once per model, not per step
    assert not kernel_device and trainer.forward_choice.kernel == "SDPA per segment"


# -------------------------------------------------------------------------------------------- item 3: say the kernel
def test_the_first_packed_forward_names_the_kernel(tokenizer, tmp_path, monkeypatch):
    """On CPU: one info line per model at its first packed forward (not per layer or step), naming SDPA per segment
    and why; `forward_choice.kernel` names it. With the CUDA branch's stand-in (`_on_kernel` true, a varlen_attn that
    agrees) the same run names torch's varlen_attn."""
    said = []
    monkeypatch.setattr(attention.logger, "info", said.append)
    monkeypatch.setattr(attention, "_used", {})
    trainer = build_trainer(PrunedDPOTrainer, PrunedDPOConfig, tokenizer, Dataset.from_list(edge_rows()), tmp_path,
                            per_device_train_batch_size=4)
    for _ in range(2):
        loss_and_grads(trainer, first_batch(trainer, 4))
    assert said == ["Packed attention of llama (loaded with sdpa): SDPA per segment (on cpu: the varlen kernels run "
                    "on CUDA only)."] * 2  # the policy's and the reference's
    assert trainer.forward_choice.kernel == "SDPA per segment"
    monkeypatch.setattr(kernels, "varlen_attn", naive_varlen)
    monkeypatch.setattr(kernels, "_on_kernel", lambda q: True)
    monkeypatch.setattr(kernels, "_VERIFIED", {})
    other = build_trainer(PrunedDPOTrainer, PrunedDPOConfig, tokenizer, Dataset.from_list(edge_rows()),
                          tmp_path / "kernel", per_device_train_batch_size=4)
    loss_and_grads(other, first_batch(other, 4))
    assert other.forward_choice.kernel == "torch varlen_attn"
    assert said[-1] == "Packed attention of llama (loaded with sdpa): torch varlen_attn."


def test_the_kernel_line_says_a_hub_kernel_is_not_used_packed(flash_standin, tokenizer, tmp_path, monkeypatch):
    """Stand-in: `flash_standin`. A hub kernel the user chose runs outside packed forwards only: the line says so."""
    said = []
    monkeypatch.setattr(attention.logger, "info", said.append)
    monkeypatch.setattr(attention, "_used", {})
    trainer = build_trainer(PrunedDPOTrainer, PrunedDPOConfig, tokenizer, Dataset.from_list(edge_rows()), tmp_path,
                            per_device_train_batch_size=4)
    _loaded_with(trainer, HUB)
    loss_and_grads(trainer, first_batch(trainer, 4))
    assert said[0] == (f"Packed attention of llama (loaded with {HUB}): SDPA per segment (on cpu: the varlen kernels "
                       f"run on CUDA only); its own {HUB} runs outside packed forwards only (evaluation, generation).")


# ---------------------------------------------------------------------------------- item 4: device_map across devices
class _SameDevice(TorchFunctionMode):
    """Records every op (copies aside) whose tensor arguments sit on more than one device; a copy from meta (the
    stand-in second device) back to the host gives zeros."""

    def __init__(self):
        super().__init__()
        self.mixed = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in _pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if func in (torch.Tensor.to, torch.Tensor.copy_):
            if func is torch.Tensor.to and args[0].is_meta and "cpu" in str((args[1:], kwargs)):
                return torch.zeros(args[0].shape, dtype=args[0].dtype)
        elif len({t.device for t in tensors}) > 1:
            self.mixed.append(getattr(func, "__name__", str(func)))
        return func(*args, **kwargs)


@pytest.mark.parametrize("path", ["per-segment", "kernel"])
def test_packing_follows_the_layers_device(path, monkeypatch):
    """Stand-in: 'meta' is the second device, the metadata on the first (CPU). A layer on 'meta' reads a copy of the
    metadata there (kv_index gather, the varlen call's boundaries, branch pruning's kept keys), made once per device;
    accelerate's hooks (`send_to_device`, which moves a layer's kwargs) use the same copy."""
    from accelerate.utils import send_to_device

    if path == "kernel":
        seen = []

        def varlen(q, k, v, cu_q, cu_k, *args, **kwargs):
            seen.append({t.device.type for t in (q, k, v, cu_q, cu_k)})
            return torch.empty_like(q)

        monkeypatch.setattr(kernels, "varlen_attn", varlen)
        monkeypatch.setattr(kernels, "_on_kernel", lambda q: True)
        # the kernel's check cannot run on meta (it reads values): taken as passed
        monkeypatch.setattr(kernels, "_verify", lambda *args, **kwargs: True)
        monkeypatch.setattr(kernels, "_VERIFIED", {})
    q, k, v, packing = _packed_inputs()
    shared = attention.SharedKeys().open(torch.arange(3))
    packing.keeps = shared
    module = torch.nn.Module()
    with _SameDevice() as mode:
        out, _ = attention.packed_attention(module, *(x.to("meta") for x in (q, k, v)), None,
                                            scaling=0.3, **{attention.PACKING_KWARG: packing})
    assert out.is_meta and out.shape == (1, q.size(2), 4, 8) and not mode.mixed, mode.mixed
    assert shared.kept[0][1].is_meta
    assert packing.to("meta") is packing.to(torch.device("meta")) is send_to_device(packing, "meta")
    assert packing.to("cpu") is packing
    if path == "kernel":
        assert seen == [{"meta"}]


def test_run_group_gathers_on_the_heads_device():
    """Stand-in: a model whose outputs come back on 'meta' (the last layer's device under `device_map`) while the
    inputs sit on the host: the gather runs on the outputs' device, the per-token grid comes back to the inputs'."""
    from types import SimpleNamespace

    from trl_pruned_dpo.pruned_forward import run_group

    host = _host([5, 2], [[1, 2, 3], [4]], [[1, 2, 9, 9], [5, 6]])
    group = plan_group(host, host.completion_mask[:, 1:].bool(), torch.ones(4, dtype=torch.bool),
                       pair_trees(torch.zeros(2, dtype=torch.bool)), packed=True)

    def model(input_ids, **kwargs):
        return SimpleNamespace(log_probs=torch.zeros(input_ids.shape, device="meta"), values=lambda: ())

    with _SameDevice() as mode:
        per_token, _ = run_group(model, group, ("log_probs",), {"input_ids": host.input_ids})
    assert not mode.mixed, mode.mixed
    assert per_token["log_probs"].device.type == "cpu" and per_token["log_probs"].shape == group.source.shape


# ----------------------------------------------------------------------------- item 5: key and value sizes differ
def test_unequal_key_and_value_head_sizes_run_the_kernel_padded(kernel_device):
    """Stand-in: `kernel_device` (its varlen_attn takes one head size, as the real ones). DeepSeek-V3-style heads
    (keys 12 wide, values 8): the values are padded for the kernel and the output cut back, equal to SDPA per segment
    on the unpadded heads; the kernel's check is keyed by both sizes."""
    q, k, v, packing = _packed_inputs(dim=12, value_dim=8)
    layer = _Layer("sdpa")
    half = [x.to(torch.bfloat16) for x in (q, k, v)]
    out, _ = attention.packed_attention(layer, *half, attention.PackedMask(None, packing), scaling=0.3)
    assert out.shape == (1, q.size(2), 4, 8) and kernel_device
    gathered = [x[0].transpose(0, 1) for x in (q, k, v)]
    gathered[1:] = [x.index_select(0, packing.kv_index) for x in gathered[1:]]
    torch.testing.assert_close(out[0].float(), kernels._per_segment(*gathered, packing, 0.3), rtol=3e-2, atol=3e-2)
    assert [key[5] for key in kernels._VERIFIED] == [(12, 8)] and all(kernels._VERIFIED.values())
    attention.packed_attention(layer, *(x.to(torch.bfloat16) for x in _packed_inputs(dim=12)[:3]),
                               attention.PackedMask(None, packing), scaling=0.3)
    assert sorted(key[5] for key in kernels._VERIFIED) == [(12, 8), (12, 12)]  # checked per value size


# ------------------------------------------------------------------------- item 6: transformers' packing detection
@pytest.mark.parametrize("estimator", [False, True], ids=["exact", "branch-pruning"])
def test_no_device_read_from_packing_detection(estimator, tokenizer, tmp_path, monkeypatch):
    """transformers' mask builders read a device value (`find_packed_sequence_indices`'s `if`: a sync) per builder
    when a forward passes position ids without a mask, as the packed forward does. Counted over the micro-steps of a
    run with sliding layers (two builders per forward) and a live reference (and a frozen forward with branch
    pruning): none. The same count sees the reads of a stock forward with position ids (the count works, and the
    packed path is what skips them)."""
    from test_host_syncs import ACCUMULATION, STEPS

    reads, phase = [], ["outside"]
    original = torch.Tensor.__bool__

    def counting(self):
        if sys._getframe(1).f_code.co_filename.endswith("masking_utils.py"):
            reads.append(phase[-1])
        return original(self)

    monkeypatch.setattr(torch.Tensor, "__bool__", counting)
    build = family("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1)
    trainer = build_trainer(PrunedDPOTrainer, PrunedDPOConfig, tokenizer, Dataset.from_list(edge_rows() * 2),
                            tmp_path, model=build(tokenizer), max_steps=STEPS, per_device_train_batch_size=2,
                            gradient_accumulation_steps=ACCUMULATION,
                            **(dict(branch_keep_prob=0.5) if estimator else {}))
    step = trainer.training_step

    def in_micro_step(*args, **kwargs):
        phase.append("micro-step")
        try:
            return step(*args, **kwargs)
        finally:
            phase.pop()

    monkeypatch.setattr(trainer, "training_step", in_micro_step)
    trainer.merge_safe_overrides = True  # the wrapper only observes: the step still merges
    trainer.train()
    assert trainer.forward_choice.packed and reads.count("micro-step") == 0, reads
    with torch.no_grad():
        trainer.model(input_ids=IDS, position_ids=torch.arange(6).repeat(2, 1))
    assert reads.count("outside") >= 2  # a stock forward with position ids: one per builder (full and sliding)


def test_transformers_names_the_gpu_paths_rely_on():
    """Pins what these fixes lean on: the mask builders call `find_packed_sequence_indices` by its module name (the
    packed forward's skip is installed there); transformers' flash wrapper takes the kernel's name from
    `module.config._attn_implementation` and the target dtype from `get_target_dtype`; autograd's queued callback runs
    at the end of the backward (where the configs get the users' names back)."""
    import inspect

    from transformers import masking_utils
    from transformers.integrations import flash_attention

    assert "find_packed_sequence_indices(position_ids)" in inspect.getsource(masking_utils._preprocess_mask_arguments)
    assert masking_utils.find_packed_sequence_indices is attention._packed_sequence_indices
    source = inspect.getsource(flash_attention.flash_attention_forward)
    assert "attn_implementation=module.config._attn_implementation" in source and "get_target_dtype(" in source
    order = []
    x = torch.ones(2, requires_grad=True)
    y = (x * 2).sum()
    y.register_hook(lambda g: torch.autograd.Variable._execution_engine.queue_callback(lambda: order.append("end")))
    x.register_hook(lambda g: order.append("leaf"))
    y.backward()
    assert order == ["leaf", "end"]


def test_latent_attention_heads_train_exact_through_the_kernel(tokenizer, tmp_path, monkeypatch):
    """Stand-in: the CUDA branch on CPU float32 (`_on_kernel` true) with a varlen_attn that, as the real ones, takes
    one head size. DeepSeek-V3 with values 4 wide against keys 8: every packed attention call runs the kernel (values
    padded), and training is exact against stock."""
    from test_exactness_matrix import tiny_family

    calls = []

    def varlen(q, k, v, *args, **kwargs):
        assert q.size(-1) == k.size(-1) == v.size(-1), "one head size"
        calls.append(q.size(-1))
        return naive_varlen(q, k, v, *args, **kwargs)

    monkeypatch.setattr(kernels, "varlen_attn", varlen)
    monkeypatch.setattr(kernels, "_on_kernel", lambda q: True)
    monkeypatch.setattr(kernels, "_VERIFIED", {})
    stock, pruned = pair_of_trainers(lambda tok: tiny_family("deepseek_v3", tok, v_head_dim=4), tokenizer, tmp_path,
                                     **ONLY["share_prompt"])
    assert_exact(stock, pruned)
    assert len(calls) > 2 and set(calls) == {8} and pruned.forward_choice.kernel == "torch varlen_attn"


def test_the_run_records_its_kernel_in_each_checkpoint(tokenizer, tmp_path):
    """The kernel the packed rows ran is part of the run's record: each checkpoint's run state holds it
    (safety/checkpoints.py), beside `forward_choice.kernel` and the CLI summary's line."""
    from trl_pruned_dpo.safety.checkpoints import read_run_state

    trainer = build_trainer(PrunedDPOTrainer, PrunedDPOConfig, tokenizer, Dataset.from_list(edge_rows()), tmp_path,
                            per_device_train_batch_size=4, max_steps=1, save_strategy="steps", save_steps=1)
    trainer.train()
    assert read_run_state(tmp_path / "checkpoint-1", 0)["attention_kernel"] == "SDPA per segment"


def test_a_forward_never_backpropagated_does_not_hold_the_packed_attention(tokenizer, tmp_path):
    """A packed grad forward whose outputs are dropped without a backward (a user's probe, a test) leaves nothing
    pending: the next packed grad forward starts afresh, and after its backward the configs name the user's own."""
    trainer = build_trainer(PrunedDPOTrainer, PrunedDPOConfig, tokenizer, Dataset.from_list(edge_rows()), tmp_path,
                            per_device_train_batch_size=4)
    trainer.model.train()
    batch = first_batch(trainer, 4)
    trainer.concatenated_forward(trainer.model, batch)  # dropped: no backward
    trainer.compute_loss(trainer.model, batch).backward()
    assert trainer.model.config._attn_implementation == "sdpa"
