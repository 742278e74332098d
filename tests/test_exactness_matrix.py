"""The exactness matrix: every family `attention.EXACT_FAMILIES` names, as a tiny random-init model (hidden 32, 2
layers), trains packed (`share_prompt` + `padding_free`) with stock DPOTrainer's loss (1e-5) and every parameter's
gradient (1e-4 relative) on a batch of 8 pairs and one prompt group of 3 pairs, with and without `prune_common_prefix`, gradient checkpointing off and on; windows are
shorter than a row, so the sliding layers really slide. Then the families outside the table (checked on the first
batch), the ones that fall back (one line), and the kernel check's keying per variant.

Each family's row is one test (both checkpointing settings on the same pair of trainers); the whole matrix takes about
a minute on one core (tests/README or the final report of issue 30 gives the measured time)."""

import copy
import warnings

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from trl import DPOConfig, DPOTrainer

from conftest import build_trainer, first_batch, loss_and_grads
from test_packed import assert_exact, naive_varlen, windowed_varlen
from test_share_prompt import edge_rows
from trl_pruned_dpo import PrunedDPOConfig, PrunedDPOTrainer
from trl_pruned_dpo import forward_choice
from trl_pruned_dpo.seam import attention, kernels

SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=512, head_dim=8)
MOE = dict(num_experts_per_tok=2, router_aux_loss_coef=0.0)  # the router aux loss off: packed (it on: below)
# name -> (model_type, what differs from SMALL): what makes the family more than Llama is in its own config
CONFIGS = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "qwen2-sliding-layers": ("qwen2", dict(use_sliding_window=True, sliding_window=5, max_window_layers=1)),
    "qwen3": ("qwen3", {}),
    "mistral": ("mistral", dict(sliding_window=None)),
    "mistral-window-7": ("mistral", dict(sliding_window=7)),
    "ministral": ("ministral", dict(sliding_window=6)),
    "mixtral": ("mixtral", dict(num_local_experts=4, sliding_window=None, **MOE)),
    "qwen2_moe": ("qwen2_moe", dict(num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                                    **MOE)),
    "qwen3_moe": ("qwen3_moe", dict(num_experts=4, moe_intermediate_size=32, **MOE)),
    "deepseek_v3": ("deepseek_v3", dict(n_routed_experts=4, moe_intermediate_size=32, n_group=1, topk_group=1,
                                        kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4,
                                        v_head_dim=8, first_k_dense_replace=1, head_dim=4, num_key_value_heads=4, **MOE)),
    "gpt_oss": ("gpt_oss", dict(num_local_experts=4, sliding_window=4, rope_parameters=None, **MOE)),  # sinks
    "olmoe": ("olmoe", dict(num_experts=4, **MOE)),
    "gemma": ("gemma", {}),
    "gemma2": ("gemma2", dict(sliding_window=6)),  # soft-capped scores and logits, eager
    "gemma3_text": ("gemma3_text", dict(sliding_window=6)),
    "vaultgemma": ("vaultgemma", dict(sliding_window=6)),
    "cohere": ("cohere", {}),
    "cohere2": ("cohere2", dict(sliding_window=6)),
    "olmo": ("olmo", {}),
    "olmo2": ("olmo2", {}),  # QK-norm
    "olmo3": ("olmo3", dict(sliding_window=6)),
    "granite": ("granite", {}),
    "smollm3": ("smollm3", {}),  # NoPE layers
    "stablelm": ("stablelm", {}),  # partial rotary
    "phi": ("phi", {}),
    "phi3": ("phi3", dict(sliding_window=7)),
    "persimmon": ("persimmon", {}),
    "starcoder2": ("starcoder2", dict(sliding_window=7)),
    "nemotron": ("nemotron", {}),
    "exaone4": ("exaone4", dict(sliding_window=6, sliding_window_pattern=2)),
    "gpt2": ("gpt2", {}),  # learned absolute positions
    "gptj": ("gptj", dict(rotary_dim=4)),
    "codegen": ("codegen", dict(rotary_dim=4)),
    "biogpt": ("biogpt", {}),
    "gpt_bigcode": ("gpt_bigcode", {}),
    "opt": ("opt", dict(ffn_dim=64, word_embed_proj_dim=32)),  # positions from the mask in stock
    "gpt_neox": ("gpt_neox", {}),
    "glm": ("glm", {}),
    "glm4": ("glm4", {}),
    "helium": ("helium", {}),
    "seed_oss": ("seed_oss", {}),
    "arcee": ("arcee", {}),
    "hunyuan_v1_dense": ("hunyuan_v1_dense", {}),
    "ernie4_5": ("ernie4_5", {}),
    "bitnet": ("bitnet", {}),
    "diffllama": ("diffllama", {}),
    "jetmoe": ("jetmoe", dict(num_local_experts=4, kv_channels=8, **MOE)),
    "phimoe": ("phimoe", dict(num_local_experts=4, sliding_window=None, **MOE)),  # router jitter off (random)
    "granitemoe": ("granitemoe", dict(num_local_experts=4, **MOE)),
    "granitemoeshared": ("granitemoeshared", dict(num_local_experts=4, shared_intermediate_size=32, **MOE)),
}


def _seeded_without_dropout(config):
    """The model of `config` from seed 0 with every dropout and router jitter off (stock and packed draw no masks)."""
    for key, value in list(vars(config).items()):
        if ("dropout" in key or "pdrop" in key or "jitter" in key) and isinstance(value, float):
            setattr(config, key, 0.0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config)


def tiny_family(name, tokenizer, **extra):
    """A tiny random-init model of a family from its config alone; dropout off (stock and packed draw no masks)."""
    model_type, overrides = CONFIGS[name]
    config = CONFIG_MAPPING[model_type](**{**SMALL, **overrides, **extra}, vocab_size=len(tokenizer),
                                        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                                        bos_token_id=tokenizer.bos_token_id)
    return _seeded_without_dropout(config)


# edge_rows' 8 pairs, then a prompt group (three responses, all three pairs: the prompt once, each response once)
ROWS = edge_rows() + [{"prompt": "g: ", "chosen": a, "rejected": b}
                      for a, b in (("abcdef", "abcxyz"), ("abcdef", "q"), ("abcxyz", "q"))]
BATCH = len(ROWS)


def exact(stock, pruned, **kw):
    assert_exact(stock, pruned, batch_size=BATCH, **kw)


def trainers(model, tokenizer, tmp_path, **pruned_kw):
    data = Dataset.from_list(ROWS)
    kw = dict(per_device_train_batch_size=BATCH, max_length=48)  # 48: the longest pairs are truncated; windows <= 7
    stock = build_trainer(DPOTrainer, DPOConfig, tokenizer, data, tmp_path / "stock", model=copy.deepcopy(model), **kw)
    pruned = build_trainer(PrunedDPOTrainer, PrunedDPOConfig, tokenizer, data, tmp_path / "pruned",
                           model=copy.deepcopy(model), share_prompt=True, padding_free=True, **kw, **pruned_kw)
    return stock, pruned


def test_every_tested_family_is_in_the_matrix():
    assert set(attention.EXACT_FAMILIES) == {model_type for model_type, _ in CONFIGS.values()}


@pytest.mark.parametrize("common_prefix", [False, True], ids=["", "common-prefix"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_family_packed_equals_stock(name, common_prefix, tokenizer, tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stock, pruned = trainers(tiny_family(name, tokenizer), tokenizer, tmp_path, prune_common_prefix=common_prefix)
    assert not [str(w.message) for w in caught if "ignored" in str(w.message)]
    # Packed, unchecked.
    choice = pruned.forward_choice
    assert choice.packed and choice.share_prompt and not choice.unproven
    for checkpointing in (False, True) if pruned.model.supports_gradient_checkpointing else (False,):
        exact(stock, pruned, checkpointing=checkpointing)
    assert pruned.forward_choice.packed and pruned.last_prune_stats["shared_pairs"] == BATCH


# ------------------------------------------------------------------------------------- outside the tested table
def test_an_unknown_family_is_checked_once_then_packed(tokenizer, tmp_path, monkeypatch):
    """A family outside the table (Llama taken out of it): the first batch compares packed and padded log-probs (two
    forwards of a few pairs each, no grad), agrees, and the run is packed with stock's numbers; no second check."""
    monkeypatch.delitem(attention.EXACT_FAMILIES, "llama")
    stock, pruned = trainers(tiny_family("llama", tokenizer), tokenizer, tmp_path)
    assert pruned.forward_choice.packed and pruned.forward_choice.unproven
    checks = []
    original = forward_choice.check_first_batch

    def counted(*args):
        checks.append(1)
        return original(*args)

    monkeypatch.setattr(forward_choice, "check_first_batch", counted)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*ignored")
        exact(stock, pruned)
        loss_and_grads(pruned, first_batch(pruned, BATCH))
    assert checks == [1] and pruned.forward_choice.packed and not pruned.forward_choice.unproven


@pytest.mark.parametrize("common_prefix", [False, True], ids=["stock-forward", "padded-rows"])
def test_an_unknown_family_that_packs_wrong_falls_back_on_its_first_batch(common_prefix, tokenizer, tmp_path,
                                                                          monkeypatch):
    """The same check with the packed attention made wrong (the sliding window dropped, as a model that applied its
    window some other way would see it): one line naming the difference, then stock's numbers from that batch on."""
    monkeypatch.delitem(attention.EXACT_FAMILIES, "mistral")
    monkeypatch.setattr(attention.PackedMask, "__init__", lambda self, window: setattr(self, "window", None))
    stock, pruned = trainers(tiny_family("mistral-window-7", tokenizer), tokenizer, tmp_path,
                             prune_common_prefix=common_prefix)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exact(stock, pruned)
    lines = [str(w.message) for w in caught if "ignored" in str(w.message)]
    assert len(lines) == 1 and "mistral" in lines[0] and "first batch" in lines[0] and "\n" not in lines[0], lines
    assert not pruned.forward_choice.packed and pruned.forward_choice.pruned == common_prefix
    exact(stock, pruned)  # and after it


@pytest.mark.parametrize("model_type, overrides", [
    ("mamba", dict(state_size=4)), ("lfm2", {}), ("jamba", dict(num_experts=2, attn_layer_period=2, attn_layer_offset=1)),
    ("recurrent_gemma", dict(lru_width=32, attention_window_size=8, block_types=["recurrent", "attention"])),
    ("qwen3_next", dict(num_experts=4, moe_intermediate_size=32, layer_types=["linear_attention", "full_attention"],
                        **MOE)),
], ids=lambda x: x if isinstance(x, str) else "")
def test_recurrent_families_fall_back_without_a_check(model_type, overrides, tokenizer, tmp_path, monkeypatch):
    monkeypatch.setitem(CONFIGS, model_type, (model_type, overrides))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stock, pruned = trainers(tiny_family(model_type, tokenizer), tokenizer, tmp_path)
    lines = [str(w.message) for w in caught if "ignored" in str(w.message)]
    assert len(lines) == 1 and "recurrent or convolutional state" in lines[0], lines
    assert not pruned.forward_choice.packed and not pruned.forward_choice.unproven
    exact(stock, pruned)


CUTS = (dict(prune_common_prefix=True), dict(position_keep_prob=0.5), dict(prefix_prune_prob=0.5),
        dict(position_keep_prob="auto"))


def test_a_bidirectional_model_never_packs_and_refuses_cut_rows(tokenizer, tmp_path):
    """BERT loaded as a causal LM without `is_decoder=True` (transformers warns, and trains it): each token sees the
    tokens after it. The exact savings fall back to stock's forward in one line, without a first-batch check; an
    estimator that runs fewer tokens of a row than it holds is refused when the trainer is built (tests/family_survey.py
    found `prune_common_prefix` on padded rows differing from stock there). As a decoder it is checked, then packs."""
    config = CONFIG_MAPPING["bert"](**SMALL, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    model = _seeded_without_dropout(config)
    assert "is_decoder=False" in attention.packed_verdict(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stock, pruned = trainers(model, tokenizer, tmp_path)
    lines = [str(w.message) for w in caught if "ignored" in str(w.message)]
    assert len(lines) == 1 and "bidirectional" in lines[0] and not pruned.forward_choice.pruned
    exact(stock, pruned)
    for cut in CUTS:
        with pytest.raises(ValueError, match=f"{next(iter(cut))} run fewer tokens .* is_decoder=False.*is_decoder=True"):
            trainers(model, tokenizer, tmp_path / "cut", **cut)
    config.is_decoder = True  # at construction: BERT's attention modules read it there
    model = _seeded_without_dropout(config)
    assert attention.packed_verdict(model) == attention.CHECK
    stock, pruned = trainers(model, tokenizer, tmp_path / "decoder", prune_common_prefix=True)
    exact(stock, pruned)
    assert pruned.forward_choice.packed


def test_an_unknown_layer_type_falls_back_naming_it(tokenizer):
    """A `layer_types` entry the packed path does not know (transformers 5.25 has chunked, indexed and compressed
    attention layers) falls back without a check, and the line names the type instead of calling it recurrent."""
    model = tiny_family("llama", tokenizer)
    model.config.layer_types = ["indexed_attention", "full_attention"]
    verdict = attention.packed_verdict(model)
    assert "layer types include indexed_attention (llama)" in verdict and "recurrent" not in verdict


@pytest.mark.parametrize("build, reason", [
    (lambda tok: tiny_family("llama", tok), None),
    (lambda tok: _other("bloom", tok, n_layer=2, n_head=4), "ALiBi"),
    (lambda tok: _other("mpt", tok, d_model=32, n_layers=2, n_heads=4, max_seq_len=512), "ALiBi"),
    (lambda tok: _other("falcon", tok, alibi=True), "ALiBi"),
    (lambda tok: _other("falcon", tok), "does not go through transformers' attention interface"),
    (lambda tok: _other("gpt_neo", tok, num_layers=2, num_heads=4, window_size=6,
                        attention_types=[[["global", "local"], 1]]), "does not go through"),
    (lambda tok: _other("xglm", tok, d_model=32, ffn_dim=64, num_layers=2, attention_heads=4), "does not go through"),
], ids=["control", "bloom", "mpt", "falcon-alibi", "falcon", "gpt_neo", "xglm"])
def test_modules_outside_the_attention_interface_fall_back_with_one_line(build, reason, tokenizer, tmp_path):
    """A family whose attention module bypasses the interface falls back in one line. A model file can move onto the
    interface in a transformers release (Falcon's rotary attention did in 5.25): then it is no longer refused but
    checked on its first batch, and must come out exact against stock either way."""
    model = build(tokenizer)
    if reason and "does not go through" in reason and attention._routes_attention(model):
        reason = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stock, pruned = trainers(model, tokenizer, tmp_path)
    lines = [str(w.message) for w in caught if "ignored" in str(w.message)]
    if reason is None:
        assert not lines and pruned.forward_choice.packed
    else:
        assert len(lines) == 1 and reason in lines[0], lines
        assert not pruned.forward_choice.packed
    exact(stock, pruned)


def _other(model_type, tokenizer, **kw):
    config = CONFIG_MAPPING[model_type](hidden_size=32, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
                                        **{"num_hidden_layers": 2, "num_attention_heads": 4, **kw}
                                        if model_type == "falcon" else kw)
    return _seeded_without_dropout(config)


def test_moe_router_aux_loss_with_the_common_prefix_is_refused_in_one_line(tokenizer, tmp_path):
    """Stock's router loss counts every token of every row; the common prefix does not run them all: refused."""
    model = tiny_family("qwen3_moe", tokenizer, router_aux_loss_coef=0.01, output_router_logits=True)
    with pytest.raises(ValueError, match=r"^prune_common_prefix cannot be exact with the MoE router auxiliary loss"):
        trainers(model, tokenizer, tmp_path, prune_common_prefix=True)


# ------------------------------------------------------------------------------------- the kernel check, per variant
def _ignoring_window(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size, enable_gqa=False):
    """A plausible varlen kernel that takes `window_size` and applies only its causal part: right on full layers,
    wrong on sliding ones."""
    return naive_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=(-1, 0), enable_gqa=enable_gqa)


def test_a_kernel_wrong_on_windows_is_refused_for_windows_only(monkeypatch):
    monkeypatch.setattr(kernels, "varlen_attn", _ignoring_window)
    monkeypatch.setattr(kernels, "_on_kernel", lambda q: True)
    monkeypatch.setattr(kernels, "_VERIFIED", {})
    q, k = torch.randn(6, 4, 8), torch.randn(9, 2, 8)
    assert kernels._kernel(q, k, "sdpa") is kernels._torch_varlen  # full causal: agrees
    with pytest.warns(UserWarning, match=r"torch_varlen disagrees with SDPA .*window=8.*SDPA per segment there"):
        assert kernels._kernel(q, k, "sdpa", kernels.Variant(window=8)) is None
    assert kernels._kernel(q, k, "sdpa", kernels.Variant(window=8)) is None  # decided once: no second warning
    assert kernels._kernel(q, k, "sdpa") is kernels._torch_varlen  # still used where it is right
    assert kernels._kernel(torch.randn(6, 4, 8), torch.randn(9, 4, 8), "sdpa") is kernels._torch_varlen  # no GQA
    assert sorted(str(key[-1]) for key in kernels._VERIFIED) == sorted(
        [str(kernels.FULL), str(kernels.FULL), str(kernels.Variant(window=8))])
    # soft-capping and sinks: torch's varlen_attn cannot take them, so they never reach it (no check, per segment)
    assert kernels._kernel(q, k, "sdpa", kernels.Variant(softcap=50.0)) is None
    assert kernels._kernel(q, k, "sdpa", kernels.Variant(sinks=True)) is None
    assert len(kernels._VERIFIED) == 3


def test_the_window_reaches_the_kernel_in_position_space(monkeypatch):
    """The check passes the window as (window - 1, 0) on a kernel that honours it: each query sees its last `window`
    positions of its own branch, shared keys included."""
    monkeypatch.setattr(kernels, "varlen_attn", windowed_varlen)
    cpu = torch.device("cpu")
    for window in (1, 3, 16, 200):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert kernels._verify(kernels._torch_varlen, 4, 2, 8, cpu, torch.float32, kernels.Variant(window))


def test_flash_attn_wrong_on_softcap_is_refused_for_softcap_only(monkeypatch):
    """flash_attn's varlen function takes `softcap` (Gemma 2) and `window_size`: a build that ignores the cap is
    refused for soft-capped layers and still used for the others; each variant reaches it as the model asked."""
    import sys
    import types

    seen = []

    def flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=None, causal=False,
                               window_size=(-1, -1), softcap=0.0):
        assert causal
        seen.append((window_size, softcap))
        return windowed_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale=softmax_scale, window_size=(window_size[0], 0),
                               enable_gqa=q.size(1) != k.size(1))  # the cap ignored

    fake = types.ModuleType("flash_attn")
    fake.flash_attn_varlen_func = flash_attn_varlen_func
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    monkeypatch.setattr(kernels, "FLASH_ATTN_INSTALLED", True)
    monkeypatch.setattr(kernels, "_on_kernel", lambda q: True)
    monkeypatch.setattr(kernels, "_VERIFIED", {})
    q, k = torch.randn(6, 4, 8), torch.randn(9, 2, 8)
    flash = kernels._flash_attn_varlen
    assert kernels._kernel(q, k, "flash_attention_2", kernels.Variant(window=5)) is flash
    with pytest.warns(UserWarning, match=r"flash_attn_varlen disagrees .*softcap=5.0"):
        assert kernels._kernel(q, k, "flash_attention_2", kernels.Variant(softcap=5.0)) is None
    assert kernels._kernel(q, k, "flash_attention_2") is flash
    assert ((4, 0), 0.0) in seen and ((-1, -1), 5.0) in seen  # window (left = window - 1) and the cap, as asked


def test_an_unknown_family_whose_packed_forward_fails_falls_back_in_one_line(tokenizer, tmp_path, monkeypatch):
    """A packed forward that raises on the first batch (as a model whose layers drop both the mask and the kwargs
    does): one line naming the error, stock's numbers, no crash."""
    monkeypatch.delitem(attention.EXACT_FAMILIES, "qwen3")

    def dropped(*args, **kwargs):
        raise RuntimeError("Qwen3Attention did not pass the packed metadata to its attention")

    monkeypatch.setattr(kernels, "_per_segment", dropped)
    stock, pruned = trainers(tiny_family("qwen3", tokenizer), tokenizer, tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exact(stock, pruned)
    lines = [str(w.message) for w in caught if "ignored" in str(w.message)]
    assert len(lines) == 1 and "packed forward failed (RuntimeError: Qwen3Attention did not pass" in lines[0], lines
    assert not pruned.forward_choice.packed and not pruned.forward_choice.pruned


def test_the_verdict_reads_the_model_file_through_a_wrapper_subclass(tokenizer):
    """FSDP2 swaps a model's class for a subclass defined in a torch module: the verdict still reads the model's own
    file (Llama: packed), and a family whose file never calls the interface still falls back (Bloom)."""
    for model, packs in ((tiny_family("llama", tokenizer), True), (_other("bloom", tokenizer, n_layer=2, n_head=4),
                                                                     False)):
        wrapped = type("FSDP" + type(model).__name__, (type(model),), {"__module__": "torch.distributed.fsdp"})
        model.__class__ = wrapped
        assert attention._routes_attention(model) == packs
        assert (attention.packed_verdict(model) is None) == packs


def test_the_family_survey_runs_a_family_through_every_setting(tokenizer, monkeypatch):
    """tests/family_survey.py (the families outside the table, run by hand) on Llama taken out of the table: checked
    on its first batch, then packed and exact in all four settings."""
    import family_survey

    monkeypatch.delitem(attention.EXACT_FAMILIES, "llama")
    record = family_survey.survey_family("llama", tokenizer)
    assert record["verdict"] == attention.CHECK and record["outcome"] == "packed"
    assert [(s["common_prefix"], s["checkpointing"], s["outcome"]) for s in record["settings"]] == [
        (False, False, "packed"), (False, True, "packed"), (True, False, "packed"), (True, True, "packed")]


@pytest.mark.parametrize("cut", CUTS[:3], ids=["common-prefix", "position", "prefix"])
def test_a_model_that_sees_later_tokens_by_its_own_switch_is_stopped_on_its_first_batch(cut, tokenizer, tmp_path):
    """XLM with `causal=False` (its default) attends both ways without transformers' `is_decoder` switch, and its
    attention module is its own (stock's forward, or padded rows, run): an estimator that cuts rows short is stopped
    on the first batch, before any gradient, by the padded log-probs of rows whole and cut (tests/family_survey.py
    found `prune_common_prefix` differing from stock there). The exact savings alone fall back to stock's forward."""
    import family_survey

    model = _seeded_without_dropout(family_survey.tiny_config("xlm", tokenizer))
    assert attention.bidirectional(model) is None and attention.packed_verdict(model) not in (None, attention.CHECK)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        stock, pruned = trainers(model, tokenizer, tmp_path, **cut)
    assert pruned.forward_choice.causal_unproven
    with pytest.raises(ValueError, match=f"{next(iter(cut))} run fewer tokens .* xlm changed by .* sees later tokens"):
        loss_and_grads(pruned, first_batch(pruned, BATCH))


def test_a_causal_family_outside_the_table_passes_the_causality_check_once(tokenizer, tmp_path, monkeypatch):
    """Llama taken out of the table, with `prune_common_prefix`: the causality check runs on the first batch, agrees,
    and is not run again; training is stock's (the cut rows are exact on a causal model)."""
    monkeypatch.delitem(attention.EXACT_FAMILIES, "llama")
    stock, pruned = trainers(tiny_family("llama", tokenizer), tokenizer, tmp_path, prune_common_prefix=True)
    assert pruned.forward_choice.causal_unproven
    checks = []
    original = forward_choice.check_causal
    monkeypatch.setattr(forward_choice, "check_causal", lambda *args: checks.append(1) or original(*args))
    exact(stock, pruned)
    loss_and_grads(pruned, first_batch(pruned, BATCH))
    assert checks == [1] and not pruned.forward_choice.causal_unproven and pruned.forward_choice.packed
