"""The packed forward (`padding_free`, `share_prompt`) against stock TRL, family by family; the fallbacks; the packed
attention against a naive dense-mask reference built from the tokens' own layout (not from the plan's metadata)."""

import copy
import warnings

import pytest
import torch
import transformers
from datasets import Dataset
from torch.nn import functional as F
from trl import DPOConfig, DPOTrainer

from conftest import build_trainer, first_batch, lora_trainer, loss_and_grads, tiny_model, train_and_compare_histories
from test_share_prompt import edge_rows
from trl_pruned_dpo import PrunedDPOConfig, PrunedDPOTrainer
from trl_pruned_dpo.seam import attention, kernels
from trl_pruned_dpo.method.packing import HostBatch, pair_trees, plan_group

EAGER_ONLY = ("gemma2", "bloom", "mpt", "gpt_neo")  # no sdpa attention in transformers 5.24
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=512)


def family(name, **extra):
    """A tiny model of a transformers family, from its config only."""
    def build(tokenizer, attn=None):
        config_class, model_class, kw = {
            "llama": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=2)),
            "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_key_value_heads=1)),  # GQA 4:1
            "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_key_value_heads=2, head_dim=8)),
            "mistral": ("MistralConfig", "MistralForCausalLM", dict(num_key_value_heads=2)),
            "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {}),  # partial rotary (0.25) by default
            "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(num_key_value_heads=2, head_dim=8)),
            "bloom": ("BloomConfig", "BloomForCausalLM", dict(n_layer=2, n_head=4)),
            "mpt": ("MptConfig", "MptForCausalLM", dict(d_model=32, n_layers=2, n_heads=4, max_seq_len=512)),
            "falcon": ("FalconConfig", "FalconForCausalLM", dict(alibi=True)),
            "opt": ("OPTConfig", "OPTForCausalLM", dict(ffn_dim=64, word_embed_proj_dim=32, dropout=0.0)),
            "gpt_neo": ("GPTNeoConfig", "GPTNeoForCausalLM", dict(num_layers=2, num_heads=4, window_size=8,
                                                                  attention_types=[[["global", "local"], 1]])),
        }[name]
        torch.manual_seed(0)
        config = getattr(transformers, config_class)(
            vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
            bos_token_id=tokenizer.bos_token_id, **{**SMALL, **kw, **extra})
        config._attn_implementation = attn or ("eager" if name in EAGER_ONLY else "sdpa")
        return getattr(transformers, model_class)(config)

    build.__name__ = name + "".join(f"-{k}={v}" for k, v in extra.items())
    return build


EXACT = [family("llama"), family("qwen2"), family("qwen3"), family("mistral", sliding_window=None),
         family("mistral", sliding_window=4096), family("gpt_neox"), family("mistral", sliding_window=8),
         family("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1), family("gemma2"),
         family("opt")]  # every family of tests/test_exactness_matrix.py; here both savings alone, too
FALLBACK = [  # (family, what the one warning must name)
    (family("bloom"), "ALiBi"), (family("mpt"), "ALiBi"), (family("falcon"), "ALiBi"),
    (family("gpt_neo"), "gpt_neo"),
]


# One exact saving alone (both are on by default): the other spelled out off.
ONLY = {"padding_free": dict(padding_free=True, share_prompt=False),
        "share_prompt": dict(share_prompt=True, padding_free=False)}


def assert_exact(stock, pruned, batch_size=8, checkpointing=False):
    """CPU fp32: loss within 1e-5, every parameter's gradient within 1e-4 of its largest entry (+ a round-off floor)."""
    for trainer in (stock, pruned):
        if checkpointing:  # as Trainer.train does
            trainer.model.gradient_checkpointing_enable(trainer.args.gradient_checkpointing_kwargs)
        else:
            trainer.model.gradient_checkpointing_disable()
    loss_s, grads_s = loss_and_grads(stock, first_batch(stock, batch_size))
    loss_p, grads_p = loss_and_grads(pruned, first_batch(pruned, batch_size))
    torch.testing.assert_close(loss_p, loss_s, rtol=1e-5, atol=1e-6)
    assert grads_s.keys() == grads_p.keys()
    # a floor of 1e-7 of the largest gradient: some are 0 in exact arithmetic (a key bias; softmax ignores it)
    floor = 1e-7 * max(float(g.abs().max()) for g in grads_s.values())
    for name in grads_s:
        scale = float(grads_s[name].abs().max())
        assert float((grads_p[name] - grads_s[name]).abs().max()) <= 1e-4 * scale + floor, name


def pair_of_trainers(build, tokenizer, tmp_path, stock_kw=None, rows=None, **pruned_kw):
    data = Dataset.from_list(rows or edge_rows())
    model = build(tokenizer)
    kw = dict(per_device_train_batch_size=8, max_length=48)  # 48: the longest pairs are truncated
    stock = build_trainer(DPOTrainer, DPOConfig, tokenizer, data, tmp_path / "stock", model=copy.deepcopy(model),
                          **kw, **(stock_kw or {}))
    pruned = build_trainer(PrunedDPOTrainer, PrunedDPOConfig, tokenizer, data, tmp_path / "pruned",
                           model=copy.deepcopy(model), **kw, **pruned_kw)
    return stock, pruned


@pytest.mark.parametrize("checkpointing", [False, True], ids=["no-ckpt", "ckpt"])
@pytest.mark.parametrize("setting", ["padding_free", "share_prompt"])
@pytest.mark.parametrize("build", EXACT, ids=lambda b: b.__name__)
def test_family_packed_equals_stock(build, setting, checkpointing, tokenizer, tmp_path):
    stock, pruned = pair_of_trainers(build, tokenizer, tmp_path, **ONLY[setting])
    assert pruned.forward_choice.packed and pruned.forward_choice.share_prompt == (setting == "share_prompt")
    assert_exact(stock, pruned, checkpointing=checkpointing)
    stats = pruned.last_prune_stats
    # no padding: every executed position is a real token that some scored cell needs (shared ones once)
    needed = stats["tokens_needed"] - stats["rows"]  # `tokens_needed` counts each row's last label token too
    if setting == "padding_free":
        assert stats["policy_tokens_executed"] == needed
    else:
        assert stats["policy_tokens_executed"] < needed


def test_checkpointing_recomputes_packed(tokenizer, tmp_path, monkeypatch):
    """Gradient checkpointing replays the layers in the backward, after the forward returned: the replay must run the
    packed attention again (with the user's backend it would attend across the whole packed row)."""
    stock, pruned = pair_of_trainers(family("llama"), tokenizer, tmp_path, **ONLY["padding_free"])
    pruned.model.gradient_checkpointing_enable(pruned.args.gradient_checkpointing_kwargs)
    calls, original = [], kernels._per_segment
    monkeypatch.setattr(kernels, "_per_segment", lambda *a, **k: (calls.append(torch.is_grad_enabled()),
                                                                     original(*a, **k))[1])
    pruned.model.zero_grad(set_to_none=True)
    loss = pruned.compute_loss(pruned.model, first_batch(pruned, 8))
    forward_calls = len(calls)
    loss.backward()
    assert len(calls) > forward_calls  # the grad group's layers ran packed again in the backward
    assert_exact(stock, pruned, checkpointing=True)


def test_default_config_trains_packed_and_matches_stock(tokenizer, dataset, tmp_path):
    """Issue 20: `PrunedDPOConfig()`'s defaults (pruning off, both exact savings on) on a supported model train packed,
    prompts shared, no padding executed, with stock DPOTrainer's loss (1e-5 at step 1) and logged metrics."""
    stock = build_trainer(DPOTrainer, DPOConfig, tokenizer, dataset, tmp_path / "s")
    pruned = build_trainer(PrunedDPOTrainer, PrunedDPOConfig, tokenizer, dataset, tmp_path / "p")
    args = pruned.args
    assert args.share_prompt and args.padding_free and not args.pruning_enabled  # the defaults, nothing passed
    assert pruned.forward_choice.packed and pruned.forward_choice.share_prompt
    (step1_s, step1_p), _ = train_and_compare_histories(stock, pruned)
    assert abs(step1_p["loss"] - step1_s["loss"]) <= 1e-5
    stats = pruned.last_prune_stats  # the last micro-step's counts: every executed token is a needed real one, the
    needed = stats["tokens_needed"] - stats["rows"]  # shared prompt starts once (`tokens_needed` counts each row's
    assert 0 < stats["policy_tokens_executed"] < needed  # last label token too); padding executed: none
    assert stats["shared_pairs"] > 0
    assert 0 < step1_p["prune/tokens_executed"] < 1
    # Nothing sampled: the fractions that would read 1 and the cost model's choice are "debug" keys (docs/metrics.md).
    assert not {"prune/positions_scored", "prune/branches_backpropagated", "prune/pairs_shared"} & set(step1_p)


def test_default_config_falls_back_on_an_unsupported_model(tokenizer, tmp_path):
    """The defaults on a model the packed layout cannot express exactly (Bloom: ALiBi in its own attention module): one
    line naming why, padded rows (with pruning off, TRL's own forward), stock's numbers, and training runs."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stock, pruned = pair_of_trainers(family("bloom"), tokenizer, tmp_path)
    assert pruned.args.share_prompt and pruned.args.padding_free  # the defaults
    messages = [str(w.message) for w in caught if "ignored" in str(w.message)]
    assert len(messages) == 1 and "padding_free and share_prompt ignored" in messages[0], messages
    assert "ALiBi" in messages[0] and "\n" not in messages[0]
    assert not pruned.forward_choice.packed and not pruned.forward_choice.share_prompt
    assert_exact(stock, pruned)
    pruned.train()
    losses = [h["loss"] for h in pruned.state.log_history if "loss" in h]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))


@pytest.mark.parametrize("estimator", [False, True], ids=["exact-only", "with-common-prefix"])
@pytest.mark.parametrize("build, reason", FALLBACK, ids=[b.__name__ for b, _ in FALLBACK])
def test_fallback_one_line_and_exact(build, reason, estimator, tokenizer, tmp_path):
    """Outside the allowlist: one warning naming the property, stock's numbers, no crash. With only the exact savings
    on, TRL's own forward runs; with an estimator on (the common prefix: exact for sigmoid), the plugin's padded rows."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stock, pruned = pair_of_trainers(build, tokenizer, tmp_path, padding_free=True, share_prompt=True,
                                         prune_common_prefix=estimator)
    messages = [str(w.message) for w in caught if "padding_free and share_prompt ignored" in str(w.message)]
    assert len(messages) == 1 and reason in messages[0], messages
    assert not pruned.forward_choice.packed and not pruned.forward_choice.share_prompt
    assert pruned.forward_choice.pruned == estimator
    assert ("TRL's own forward runs" in messages[0]) != estimator
    assert_exact(stock, pruned)


def test_reference_runs_the_policys_attention_path(tokenizer, tmp_path):
    """An sdpa policy with an eager reference: both run the same (packed) attention; stock's numbers."""
    data = Dataset.from_list(edge_rows())
    model = tiny_model(tokenizer)
    reference = copy.deepcopy(model)
    reference.config._attn_implementation = "eager"
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    kw = dict(per_device_train_batch_size=8)
    stock = build_trainer(DPOTrainer, DPOConfig, tokenizer, data, tmp_path / "s", model=copy.deepcopy(model),
                          ref_model=copy.deepcopy(reference), **kw)
    for extra in (ONLY["share_prompt"], ONLY["padding_free"]):
        pruned = build_trainer(PrunedDPOTrainer, PrunedDPOConfig, tokenizer, data, tmp_path / "p",
                               model=copy.deepcopy(model), ref_model=copy.deepcopy(reference), **kw, **extra)
        assert_exact(stock, pruned)
    assert reference.config._attn_implementation == "eager"


def left_padding(collator):
    """A user's own collator that left-pads: every row's tokens moved to the right end."""
    def collate(examples):
        batch = collator(examples)
        pad = (batch["attention_mask"] == 0).sum(dim=1)
        for key in ("input_ids", "attention_mask", "completion_mask"):
            batch[key] = torch.stack([row.roll(int(n)) for row, n in zip(batch[key], pad)])
        return batch

    return collate


@pytest.mark.parametrize("common", [False, True], ids=["", "common-prefix"])
@pytest.mark.parametrize("setting", ["padding_free", "share_prompt"])
def test_left_padded_batches_pack_their_real_tokens(setting, common, tokenizer, tmp_path):
    """A user's left-padding collator: the rows are packed from their real tokens, and the common prefix is found
    from them too (the pair's rows sit at different columns): stock's numbers, the common prefix skipped."""
    rows = edge_rows()[:7] + [{"prompt": "r: ", "chosen": "a common start, x", "rejected": "a common start, then more"}]
    stock, pruned = pair_of_trainers(family("llama"), tokenizer, tmp_path, rows=rows, **ONLY[setting],
                                     prune_common_prefix=common)
    original = pruned.data_collator.collator
    stock.data_collator = left_padding(stock.data_collator)
    pruned.data_collator.collator = left_padding(original)
    batch = first_batch(pruned, 8)
    assert bool((batch["attention_mask"][:, 0] == 0).any())  # really left-padded
    assert_exact(stock, pruned)
    if common:  # found despite the padding: as many cells skipped as in the right-padded batch
        skipped = [int((~pruned.last_micro_step.masks.exact & batch["completion_mask"][:, 1:].bool()).sum())]
        pruned.data_collator.collator = original
        batch = first_batch(pruned, 8)
        loss_and_grads(pruned, batch)
        skipped.append(int((~pruned.last_micro_step.masks.exact & batch["completion_mask"][:, 1:].bool()).sum()))
        assert skipped[0] == skipped[1] > 0, skipped


@pytest.mark.parametrize("precompute", [False, True])
def test_peft_and_precomputed_reference_padding_free(precompute, tokenizer, tmp_path):
    data = Dataset.from_list(edge_rows())

    def make(cls, config, out, **extra):
        return lora_trainer(cls, config, tokenizer, data, tmp_path / out, per_device_train_batch_size=8,
                            precompute_ref_log_probs=precompute, **extra)

    assert_exact(make(DPOTrainer, DPOConfig, "stock"), make(PrunedDPOTrainer, PrunedDPOConfig, "pf",
                                                          **ONLY["padding_free"]), checkpointing=True)


def test_gradient_accumulation_history_equals_stock(tokenizer, tmp_path):
    data = Dataset.from_list(edge_rows())
    kw = {"max_steps": 2, "gradient_accumulation_steps": 2, "per_device_train_batch_size": 2}
    stock = build_trainer(DPOTrainer, DPOConfig, tokenizer, data, tmp_path / "s", **kw)
    pruned = build_trainer(PrunedDPOTrainer, PrunedDPOConfig, tokenizer, data, tmp_path / "p", padding_free=True,
                           share_prompt=True, **kw)
    train_and_compare_histories(stock, pruned)


def _host(lengths_prompt, chosen, rejected, vocab=20, seed=0):
    """A right-padded host batch with the given prompt lengths and response token lists."""
    seqs, starts = [], []
    for responses in (chosen, rejected):
        for p, (n, resp) in enumerate(zip(lengths_prompt, responses)):
            prompt = torch.randint(4, vocab, (n,), generator=torch.Generator().manual_seed(100 + p)).tolist()
            seqs.append(prompt + resp)
            starts.append(n)
    width = max(map(len, seqs))
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    attention_mask, completion = torch.zeros_like(ids), torch.zeros_like(ids)
    for r, (seq, start) in enumerate(zip(seqs, starts)):
        ids[r, : len(seq)] = torch.tensor(seq)
        attention_mask[r, : len(seq)] = 1
        completion[r, start : len(seq)] = 1
    return HostBatch(ids, attention_mask, completion)


def naive_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size, enable_gqa=False):
    """torch's documented varlen_attn semantics, by hand: per segment, causal aligned lower-right (window (-1, 0)),
    query head h reading key/value head h // (H / Hkv)."""
    assert window_size == (-1, 0) and enable_gqa == (q.size(1) != k.size(1))
    out = torch.zeros_like(q)
    group = q.size(1) // k.size(1)
    for s in range(cu_q.numel() - 1):
        q0, q1, k0, k1 = (int(x) for x in (cu_q[s], cu_q[s + 1], cu_k[s], cu_k[s + 1]))
        assert q1 - q0 <= max_q and k1 - k0 <= max_k
        for h in range(q.size(1)):
            scores = q[q0:q1, h] @ k[k0:k1, h // group].T * scale
            i, j = torch.arange(q1 - q0)[:, None], torch.arange(k1 - k0)[None, :]
            scores = scores.masked_fill(j > i + (k1 - k0) - (q1 - q0), float("-inf"))
            out[q0:q1, h] = scores.softmax(-1) @ v[k0:k1, h // group]
    return out


def windowed_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size, enable_gqa=False):
    """`naive_varlen` with a left window (flash-attention's `window_size=(left, 0)`): query i, at the end of its
    segment's keys, sees keys i + keys - queries - left .. i + keys - queries."""
    out, group, left = torch.zeros_like(q), q.size(1) // k.size(1), window_size[0]
    assert window_size[1] == 0 and enable_gqa == (group > 1)
    for s in range(cu_q.numel() - 1):
        q0, q1, k0, k1 = (int(x) for x in (cu_q[s], cu_q[s + 1], cu_k[s], cu_k[s + 1]))
        pos, j = torch.arange(q1 - q0)[:, None] + (k1 - k0) - (q1 - q0), torch.arange(k1 - k0)[None, :]
        hidden = (j > pos) | ((pos - j > left) if left >= 0 else torch.zeros_like(j > pos))
        for h in range(q.size(1)):
            scores = (q[q0:q1, h] @ k[k0:k1, h // group].T * scale).masked_fill(hidden, float("-inf"))
            out[q0:q1, h] = scores.softmax(-1) @ v[k0:k1, h // group]
    return out


@pytest.mark.parametrize("window", [None, 3], ids=["causal", "window-3"])
@pytest.mark.parametrize("kernel", [False, True], ids=["per-segment", "varlen-call"])
@pytest.mark.parametrize("share", [False, True])
def test_packed_attention_equals_a_dense_mask(share, kernel, window, monkeypatch):
    """The packed attention (per-segment SDPA over cu_seq_q/cu_seq_k/kv_index, GQA 4:2) equals SDPA over the whole
    packed row with a dense mask derived from each token's row, position and branch: a token sees the tokens of its
    own row at positions up to its own (a shared token standing for both rows of its pair), and with a sliding window
    only the last `window` positions of them."""
    # every pair shares at least two response tokens, so each segment scores something (below)
    host = _host([5, 2, 7], [[1, 2, 3], [4, 4, 1], [5, 6, 7, 8]], [[1, 2, 9, 9], [4, 4, 6, 7, 8], [5, 6, 1]])
    scored = host.completion_mask[:, 1:].bool()
    group = plan_group(host, scored, torch.ones(6, dtype=torch.bool), pair_trees(torch.full((3,), share)), packed=True)
    total = group.input_ids.size(1)
    # which rows each packed token stands for, and its position
    stands = torch.zeros(total, 6, dtype=torch.bool)
    for row in range(6):
        hits = group.source[row][group.source[row] >= 0]
        stands[hits, row] = True
    # tokens that score nothing (the prompt's) stand for the rows their segment scores for
    segment = torch.repeat_interleave(torch.arange(group.cu_seq_q.numel() - 1), group.cu_seq_q.diff().long())
    for s in segment.unique():
        members = segment == s
        stands[members] |= stands[members].any(dim=0)
    position = group.position_ids[0]
    visible = (stands.float() @ stands.float().T > 0) & (position[None, :] <= position[:, None])
    # a key that stands for a row serves it only if it is at or before the query in the packed row (causal order)
    visible &= torch.arange(total)[None, :] <= torch.arange(total)[:, None]
    if window is not None:  # stock's sliding_window_overlay, in position space
        visible &= position[:, None] - position[None, :] < window
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, total, 8, generator=g) for h in (4, 2, 2))
    packing = attention.Packing(group.cu_seq_q, group.cu_seq_k, group.kv_index, group.max_q, group.max_k,
                                *group.bounds)
    if kernel:  # the CUDA branch's call, made on CPU against the kernel's documented semantics and real signature
        import inspect

        from torch.nn.attention.varlen import varlen_attn

        def fake(*args, window_size, **kwargs):
            inspect.signature(varlen_attn).bind(*args, window_size=window_size, **kwargs)
            assert window_size == (-1 if window is None else window - 1, 0)
            return windowed_varlen(*args, window_size=window_size, **kwargs)

        monkeypatch.setattr(kernels, "varlen_attn", fake)
        monkeypatch.setattr(kernels, "_on_kernel", lambda q: True)
    module = torch.nn.Module()
    out, _ = attention.packed_attention(module, q, k, v, attention.PackedMask(window, packing), scaling=0.5)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=0.5, enable_gqa=True)
    torch.testing.assert_close(out[0], expected[0].transpose(0, 1), rtol=1e-5, atol=1e-6)
    assert group.kv_index.numel() < total * total  # keys gathered per segment, never the square


def test_plan_has_no_padding_and_packs_left_padded_rows():
    host = _host([5, 2], [[1, 2, 3], [4]], [[1, 2, 9, 9], [5, 6]])
    scored = host.completion_mask[:, 1:].bool()
    alone = pair_trees(torch.zeros(2, dtype=torch.bool))
    right = plan_group(host, scored, torch.ones(4, dtype=torch.bool), alone, True)
    # left-pad the same batch: the packed tokens, labels and routed cells are the same tokens
    pad = (host.attention_mask == 0).sum(dim=1)
    rolled = HostBatch(*(torch.stack([r.roll(int(n)) for r, n in zip(t, pad)])
                         for t in (host.input_ids, host.attention_mask, host.completion_mask)))
    left = plan_group(rolled, rolled.completion_mask[:, 1:].bool(), torch.ones(4, dtype=torch.bool), alone, True)
    for name in ("input_ids", "position_ids", "shift_labels", "cu_seq_q", "cu_seq_k", "kv_index"):
        assert torch.equal(getattr(left, name), getattr(right, name)), name
    assert right.tokens == int(scored.long().cumsum(1).argmax(1).add(1).sum())  # each row up to its last label


def test_attention_is_restored_and_delegates_meanwhile(tokenizer, tmp_path):
    """Between a packed forward and the end of its backward the configs name the packed attention (checkpointing
    replays there); a forward without packed metadata then is the user's backend's, mask included (left padding
    here). After the backward, and after evaluation, they name the user's own."""
    stock, pruned = pair_of_trainers(family("qwen2"), tokenizer, tmp_path, **ONLY["share_prompt"])
    loss = pruned.compute_loss(pruned.model, first_batch(pruned, 8))
    assert pruned.model.config._attn_implementation == attention.PACKED
    assert pruned.ref_model.config._attn_implementation == attention.PACKED
    user = copy.deepcopy(pruned.model)
    user.config._attn_implementation = "sdpa"
    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])
    mask = (torch.arange(6) >= torch.tensor([[2], [0]])).long()
    with torch.no_grad():
        torch.testing.assert_close(pruned.model(input_ids=ids, attention_mask=mask).logits,
                                   user(input_ids=ids, attention_mask=mask).logits)
    loss.backward()
    assert pruned.model.config._attn_implementation == pruned.ref_model.config._attn_implementation == "sdpa"
    loss_and_grads(pruned, first_batch(pruned, 8))
    batch = first_batch(pruned, 8)
    pruned.model.eval()
    pruned.compute_loss(pruned.model, batch)  # evaluation: TRL's own path
    assert pruned.model.config._attn_implementation == "sdpa"
    assert pruned.ref_model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("packed", [False, True])
def test_a_group_with_nothing_to_score_still_runs_two_tokens(packed):
    host = _host([3, 2], [[1, 2], [3]], [[1, 4], [5, 6]])
    scored = host.completion_mask[:, 1:].bool()
    group = plan_group(host, scored, torch.zeros(4, dtype=torch.bool), pair_trees(torch.zeros(2, dtype=torch.bool)),
                       packed)
    assert group.tokens == 2 and group.scored == 0
    assert bool((group.shift_labels == -100).all()) and bool((group.source == -1).all())


def test_no_device_reads_in_a_packed_micro_step(tokenizer, tmp_path, monkeypatch):
    """The packed forward (plan, execute, attention) reads no tensor value on the host outside the planner."""
    from test_host_syncs import ACCUMULATION, STEPS, count_reads

    trainer = build_trainer(PrunedDPOTrainer, PrunedDPOConfig, tokenizer, Dataset.from_list(edge_rows() * 2),
                            tmp_path, max_steps=STEPS, gradient_accumulation_steps=ACCUMULATION,
                            per_device_train_batch_size=2, padding_free=True, share_prompt=True, branch_keep_prob=0.5)
    counts = count_reads(monkeypatch, trainer)
    trainer.train()
    assert trainer.forward_choice.packed and counts[("micro-step", "calls")] == STEPS * ACCUMULATION
    assert counts[("micro-step", "read")] == 0 and counts[("micro-step", "collective")] == 0


def test_a_plan_moves_to_the_device_in_one_copy(tokenizer, tmp_path, monkeypatch):
    """Issue 44: the plan's host tensors (masks, the grad, frozen and reference groups' metadata) cross to the device in
    one copy of one byte buffer, each viewed back with its own dtype and shape."""
    from dataclasses import fields

    from trl_pruned_dpo.pruned_forward import _packed_bytes, _unpacked, to_device

    trainer = build_trainer(PrunedDPOTrainer, PrunedDPOConfig, tokenizer, Dataset.from_list(edge_rows() * 2),
                            tmp_path, per_device_train_batch_size=4, branch_keep_prob=0.5, position_keep_prob=0.5)
    plan = trainer.plan(first_batch(trainer))
    assert plan.prunes_branches and plan.reference is not None
    tensors = [getattr(plan.masks, f.name) for f in fields(plan.masks)]
    tensors += [value for group in (plan.policy.grad, plan.policy.frozen, plan.reference) for value in
                (getattr(group, f.name) for f in fields(group)) if torch.is_tensor(value)]
    assert {t.dtype for t in tensors} >= {torch.bool, torch.float32, torch.int64}
    back = _unpacked(*_packed_bytes(tensors))
    assert all(a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b) for a, b in zip(tensors, back))
    copies = []
    original = torch.Tensor.to

    def counting(self, *args, **kwargs):
        copies.append(self.numel())
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", counting)
    (masks,), groups = to_device([plan.masks], [plan.policy.grad, plan.policy.frozen, plan.reference],
                                 torch.device("meta"))
    assert len(copies) == 1 and masks.weights.device.type == "meta" and masks.weights.dtype == torch.float32
    assert all(g.shift_labels.device.type == "meta" for g in groups if g is not None)
