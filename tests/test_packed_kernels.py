"""The varlen kernels behind the packed attention: chosen, checked against SDPA before first use, refused loudly
where they disagree (training then stays exact); the transformers names the packed attention relies on; the user's
attention back after `train()`.

There is no GPU here: the CUDA branch is exercised on CPU float32 with stand-in kernels that follow the real ones'
signatures and documented semantics (`naive_varlen`, tests/test_packed.py), one right and one wrong."""

import importlib
import sys
import types
import warnings

import pytest
import torch
import transformers
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from test_packed import assert_exact, family, naive_varlen, pair_of_trainers
from trl_pruned_dpo.seam import attention, kernels


def segment_kernel(visible):
    """A varlen kernel by hand: per segment and head, query i reads key j where visible(i, j, queries, keys)."""
    def kernel(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, **kwargs):
        out, group = torch.zeros_like(q), q.size(1) // k.size(1)
        for s in range(cu_q.numel() - 1):
            q0, q1, k0, k1 = (int(x) for x in (cu_q[s], cu_q[s + 1], cu_k[s], cu_k[s + 1]))
            i, j = torch.arange(q1 - q0)[:, None], torch.arange(k1 - k0)[None, :]
            for h in range(q.size(1)):
                scores = q[q0:q1, h] @ k[k0:k1, h // group].T * scale
                hidden = ~visible(i, j, q1 - q0, k1 - k0)
                out[q0:q1, h] = scores.masked_fill(hidden, float("-inf")).softmax(-1) @ v[k0:k1, h // group]
        return out

    return kernel


top_left_varlen = segment_kernel(lambda i, j, lq, lk: j <= i)  # plausible and wrong: the queries at the keys' start
noncausal_varlen = segment_kernel(lambda i, j, lq, lk: j >= 0)


@pytest.fixture
def on_kernel(monkeypatch):
    """The CUDA half-precision branch taken on CPU float32, with a stand-in for torch's varlen_attn; calls counted."""
    calls = []

    def install(kernel):
        def counted(*args, **kwargs):
            calls.append(args[0].shape)
            return kernel(*args, **kwargs)

        monkeypatch.setattr(kernels, "varlen_attn", counted)
        monkeypatch.setattr(kernels, "_on_kernel", lambda q: True)
        monkeypatch.setattr(kernels, "_VERIFIED", {})
        return calls

    return install


def test_a_kernel_that_agrees_is_used_and_training_is_exact(on_kernel, tokenizer, tmp_path):
    calls = on_kernel(naive_varlen)
    stock, pruned = pair_of_trainers(family("qwen2"), tokenizer, tmp_path, share_prompt=True, padding_free=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*disagrees with SDPA")  # no refusal
        assert_exact(stock, pruned)
    assert list(kernels._VERIFIED.values()) == [True]
    assert len(calls) > 1  # the check, then every layer's packed attention (policy and reference)


def test_a_kernel_that_disagrees_is_refused_once_and_training_stays_exact(on_kernel, tokenizer, tmp_path):
    calls = on_kernel(top_left_varlen)
    stock, pruned = pair_of_trainers(family("llama"), tokenizer, tmp_path, share_prompt=True, padding_free=True)
    with pytest.warns(UserWarning, match=r"torch_varlen disagrees with SDPA .*relative error .*SDPA per segment"):
        assert_exact(stock, pruned)
    assert len(calls) == 1  # the check's call only: the forwards ran per segment
    assert list(kernels._VERIFIED.values()) == [False]


def test_a_kernel_that_fails_is_refused(on_kernel):
    def broken(*args, **kwargs):
        raise RuntimeError("no kernel image for this head dim")

    on_kernel(broken)
    q, k = torch.zeros(3, 4, 8), torch.zeros(5, 2, 8)
    with pytest.warns(UserWarning, match="RuntimeError: no kernel image"):
        assert kernels._kernel(q, k, "sdpa") is None
    assert kernels._kernel(q, k, "sdpa") is None  # decided once per shape: no second warning, no second try


def test_the_check_tells_lower_right_from_top_left_and_noncausal():
    """Direct: the right semantics pass; top-left alignment and a missing causal mask fail, with GQA 4:2."""
    def adapter(kernel):
        return lambda q, k, v, p, scale, variant: kernel(q, k, v, p.cu_seq_q, p.cu_seq_k, p.max_q, p.max_k,
                                                         scale=scale, window_size=(-1, 0),
                                                         enable_gqa=q.size(1) != k.size(1))

    cpu = torch.device("cpu")
    assert kernels._verify(adapter(naive_varlen), 4, 2, 8, cpu, torch.float32)
    for wrong in (top_left_varlen, noncausal_varlen):
        with pytest.warns(UserWarning, match="disagrees with SDPA"):
            assert not kernels._verify(adapter(wrong), 4, 2, 8, cpu, torch.float32)


def test_flash_attn_is_preferred_where_the_user_loaded_it(on_kernel, monkeypatch, tokenizer, tmp_path):
    """flash_attention_2 loaded and flash_attn installed: its varlen function, called with int32 boundaries, the
    keys of each segment gathered, causal (lower-right in flash_attn >= 2.1) and the model's scale."""
    seen = []

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False):
        assert causal and cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32 and dropout_p == 0.0
        seen.append(softmax_scale)
        return naive_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale=softmax_scale,
                            window_size=(-1, 0), enable_gqa=q.size(1) != k.size(1))

    torch_calls = on_kernel(naive_varlen)
    fake = types.ModuleType("flash_attn")
    fake.flash_attn_varlen_func = flash_attn_varlen_func
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    monkeypatch.setattr(kernels, "FLASH_ATTN_INSTALLED", True)
    q, k = torch.randn(6, 4, 8), torch.randn(9, 2, 8)
    assert kernels._kernel(q, k, "flash_attention_2") is kernels._flash_attn_varlen
    assert kernels._kernel(q, k, "sdpa") is kernels._torch_varlen  # the user's backend decides
    assert seen and torch_calls  # each was checked before use


def test_transformers_names_the_packed_attention_relies_on():
    """Pins: the registries' lookups, the per-model eager function, and `config._attn_implementation` (which a model's
    attention layers read at call time, so pointing it at the packed attention and back takes effect at once)."""
    assert {"sdpa", "flash_attention_2"} <= set(ALL_ATTENTION_FUNCTIONS) and "eager" not in ALL_ATTENTION_FUNCTIONS
    assert {"sdpa", "eager", "flash_attention_2"} <= set(ALL_MASK_ATTENTION_FUNCTIONS)
    assert ALL_ATTENTION_FUNCTIONS[attention.PACKED] is attention.packed_attention
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    for model_type in attention.EXACT_FAMILIES:  # `_users_attention`'s eager fallback, in each model's own file
        module = importlib.import_module(getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]).__module__)
        assert callable(module.eager_attention_forward), model_type
    config = transformers.LlamaConfig()
    config._attn_implementation = attention.PACKED
    assert config._attn_implementation == attention.PACKED


def test_train_gives_the_users_attention_back(tokenizer, tmp_path):
    _, pruned = pair_of_trainers(family("qwen2"), tokenizer, tmp_path, share_prompt=True, padding_free=True,
                                 max_steps=1)
    pruned.train()
    assert pruned.forward_choice.packed
    assert pruned.model.config._attn_implementation == "sdpa"
    assert pruned.ref_model.config._attn_implementation == "sdpa"
