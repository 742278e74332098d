"""`share_prompt=True` is exact: the packed [shared | chosen | rejected] forward gives the unshared forward's (and stock
TRL's) loss, gradients and metrics; stacked with the prunings it gives the unshared pruned estimate under the same
masks. Plus the plan's layout, branch pruning's two groups (a dropped branch reads its shared part's keys), the
fallback, and the micro-step's syncs and toggles."""

import copy
import warnings

import pytest
import torch
from datasets import Dataset
from transformers import Qwen2Config, Qwen2ForCausalLM
from trl import DPOConfig, DPOTrainer

from conftest import (
    SAVINGS_OFF, build_trainer, first_batch, lora_trainer, loss_and_grads, preference_rows, tiny_model,
    train_and_compare_histories,
)
from test_off_means_stock import assert_same_step
from trl_pruned_dpo import PrunedDPOConfig, PrunedDPOTrainer
from trl_pruned_dpo.method.masks import PruneMasks
from trl_pruned_dpo.seam.attention import PACKED
from trl_pruned_dpo.method.packing import HostBatch, common_tokens, pair_trees, plan_group
from trl_pruned_dpo.method.plan import plan_policy

# `share_prompt` alone (`padding_free`, also on by default, off); "unshared" below is `SAVINGS_OFF`, both off.
SHARED = dict(share_prompt=True, padding_free=False)


def edge_rows():
    """Ragged prompts and responses, identical responses, responses differing only in the last token."""
    rows = preference_rows(5, seed=3)
    rows += [
        {"prompt": "long prompt " * 3, "chosen": "same answer", "rejected": "same answer"},
        {"prompt": "p: ", "chosen": "abcdefgh", "rejected": "abcdefgX"},
        {"prompt": "q", "chosen": "x", "rejected": "a much longer rejected answer"},
    ]
    return rows


def tiny_qwen2(tokenizer, attn="sdpa", **extra):
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         pad_token_id=tokenizer.pad_token_id, attn_implementation=attn, **extra)
    return Qwen2ForCausalLM(config)


def llama(tokenizer, attn="sdpa"):
    model = tiny_model(tokenizer)
    model.config._attn_implementation = attn
    return model


def assert_same_loss_and_grads(unshared, shared, batch_size=8):
    loss_u, grads_u = loss_and_grads(unshared, first_batch(unshared, batch_size))
    loss_s, grads_s = loss_and_grads(shared, first_batch(shared, batch_size))
    torch.testing.assert_close(loss_s, loss_u, rtol=1e-5, atol=1e-6)
    assert grads_u.keys() == grads_s.keys()
    for name in grads_u:
        scale = float(grads_u[name].abs().max()) + 1e-12
        torch.testing.assert_close(grads_s[name], grads_u[name], rtol=1e-4, atol=5e-5 * scale, msg=name)


CASES = [  # (model builder, attention, config overrides)
    (llama, "sdpa", {"loss_type": ["sigmoid"]}),
    (llama, "sdpa", {"loss_type": ["sppo_hard"]}),
    (llama, "eager", {"loss_type": ["ipo"], "gradient_checkpointing": False}),
    (llama, "sdpa", {"loss_type": ["bco_pair"], "max_length": 40}),  # truncation
    (llama, "sdpa", {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.5], "ld_alpha": 0.5}),
    (tiny_qwen2, "sdpa", {"loss_type": ["apo_zero"], "use_weighting": True}),
    (tiny_qwen2, "eager", {"loss_type": ["robust"], "label_smoothing": 0.1, "f_divergence_type": "js_divergence"}),
]


@pytest.mark.parametrize("build, attn, case", CASES, ids=lambda c: getattr(c, "__name__", str(c)))
def test_shared_equals_unshared_and_stock(build, attn, case, tokenizer, tmp_path):
    data = Dataset.from_list(edge_rows())
    model = build(tokenizer, attn)
    kw = dict(per_device_train_batch_size=8, **case)

    def make(cls, config, name, **extra):
        return build_trainer(cls, config, tokenizer, data, tmp_path / name, model=copy.deepcopy(model), **kw, **extra)

    shared = make(PrunedDPOTrainer, PrunedDPOConfig, "shared", **SHARED)
    assert shared.forward_choice.share_prompt and shared.forward_choice.packed
    assert_same_step(make(DPOTrainer, DPOConfig, "stock"), shared, batch_size=8)
    unshared = make(PrunedDPOTrainer, PrunedDPOConfig, "unshared", **SAVINGS_OFF)
    assert_same_loss_and_grads(unshared, shared)
    stats = shared.last_prune_stats
    assert stats["policy_tokens_executed"] < stats["full_tokens"]  # the prompts ran once
    assert stats["shared_pairs"] == 8


PRUNINGS = {
    "position+prefix": dict(position_keep_prob=0.5, prefix_prune_prob=0.5),
    "branch-paired": dict(branch_keep_prob=0.5),
    "all-independent": dict(branch_keep_prob=0.6, branch_sampling="independent", position_keep_prob=0.7,
                            prefix_prune_prob=0.5, prefix_min_ratio=0.3),
    "common-prefix": dict(prune_common_prefix=True, branch_keep_prob=0.5, prune_reference=False),
}


@pytest.mark.parametrize("checkpointing", [True, False])
@pytest.mark.parametrize("pruning", PRUNINGS, ids=list(PRUNINGS))
def test_stacked_with_pruning_same_estimate(pruning, checkpointing, tokenizer, tmp_path):
    """Same seed, same masks: the shared execution gives the unshared pruned estimate exactly (loss and gradient)."""
    assert_shared_estimate_is_unshared(edge_rows(), 8, PRUNINGS[pruning], checkpointing, tokenizer, tmp_path, SHARED)


def assert_shared_estimate_is_unshared(rows, batch, pruning, checkpointing, tokenizer, tmp_path, savings=None):
    """Over three micro-steps (three draws), the shared execution (the defaults, or `savings`) gives the unshared
    estimate's loss and gradients, executing fewer policy tokens."""
    data = Dataset.from_list(rows)
    kw = dict(per_device_train_batch_size=batch, gradient_checkpointing=checkpointing, **pruning)
    unshared = build_trainer(PrunedDPOTrainer, PrunedDPOConfig, tokenizer, data, tmp_path / "u", **kw, **SAVINGS_OFF)
    shared = build_trainer(PrunedDPOTrainer, PrunedDPOConfig, tokenizer, data, tmp_path / "s", **(savings or {}), **kw)
    for _ in range(3):
        assert_same_loss_and_grads(unshared, shared, batch_size=batch)
        assert shared.last_prune_stats["policy_tokens_executed"] < unshared.last_prune_stats["policy_tokens_executed"]


@pytest.mark.parametrize("precompute", [False, True])
def test_peft_and_precomputed_reference(precompute, tokenizer, tmp_path):
    data = Dataset.from_list(edge_rows())

    def make(cls, config, out, **extra):
        return lora_trainer(cls, config, tokenizer, data, tmp_path / out, per_device_train_batch_size=8,
                            precompute_ref_log_probs=precompute, **extra)

    shared = make(PrunedDPOTrainer, PrunedDPOConfig, "s", **SHARED)
    assert_same_step(make(DPOTrainer, DPOConfig, "stock"), shared, batch_size=8)
    # with branch pruning the frozen branches run under no_grad with the adapter on (the policy, not the reference)
    kw = dict(SHARED, branch_keep_prob=0.5)
    a = make(PrunedDPOTrainer, PrunedDPOConfig, "a", **kw)
    b = make(PrunedDPOTrainer, PrunedDPOConfig, "b", branch_keep_prob=0.5, **SAVINGS_OFF)
    b.model.load_state_dict(a.model.state_dict())
    assert_same_loss_and_grads(b, a)


def test_gradient_accumulation_history_equals_stock(tokenizer, tmp_path):
    data = Dataset.from_list(edge_rows())
    kw = {"max_steps": 2, "gradient_accumulation_steps": 2, "per_device_train_batch_size": 2}
    stock = build_trainer(DPOTrainer, DPOConfig, tokenizer, data, tmp_path / "s", **kw)
    shared = build_trainer(PrunedDPOTrainer, PrunedDPOConfig, tokenizer, data, tmp_path / "p", **SHARED, **kw,
                           prune_log_level="debug")
    for _, hp in train_and_compare_histories(stock, shared):
        assert hp["prune/pairs_shared"] == 1.0


def _host(rows, tokenizer):
    """A collated batch's host layout from (prompt, chosen, rejected) strings, right-padded like TRL."""
    seqs, starts = [], []
    for side in (1, 2):
        for row in rows:
            prompt = tokenizer(row[0])["input_ids"]
            seqs.append(prompt + tokenizer(row[side])["input_ids"])
            starts.append(len(prompt))
    width = max(map(len, seqs))
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    attention, completion = torch.zeros_like(ids), torch.zeros_like(ids)
    for r, (seq, start) in enumerate(zip(seqs, starts)):
        ids[r, : len(seq)] = torch.tensor(seq)
        attention[r, : len(seq)] = 1
        completion[r, start : len(seq)] = 1
    return HostBatch(ids, attention, completion)


def test_plan_layout(tokenizer):
    """Token counts of the packed layout, worked by hand. Pair 0: prompt 4 + responses 'abc'/'abd' (s = 6); pair 1:
    prompt 4 + identical 'xy' (s = 6, the whole row); pair 2: prompt 2, responses 'a'/'bcdef' (s = 2)."""
    host = _host([("wxyz", "abc", "abd"), ("wxyz", "xy", "xy"), ("pq", "a", "bcdef")], tokenizer)
    assert common_tokens(host).tolist() == [6, 6, 2]
    scored = host.completion_mask[:, 1:].bool()
    group = plan_group(host, scored, torch.ones(6, dtype=torch.bool), pair_trees(torch.ones(3, dtype=torch.bool)),
                       packed=True)
    # pair 0: 5 shared positions (0..4) + 1 per branch (position 5 predicts the diverging token): 7
    # pair 1: 5 shared positions, nothing after; pair 2: 1 shared + 1 ('a' row: position 1) + 5 ('bcdef'): 7
    assert group.tokens == 7 + 5 + 7
    # every scored cell is routed, nothing else
    assert torch.equal(group.source >= 0, scored)
    # one row, no padding; segments [shared | chosen | rejected] per pair, empty ones dropped
    assert group.input_ids.shape == (1, 19)
    assert group.cu_seq_q.tolist() == [0, 5, 6, 7, 12, 13, 14, 19]
    # a branch's keys: its pair's shared part, then itself (lower-right causal in attention.py)
    assert group.cu_seq_k.tolist() == [0, 5, 11, 17, 22, 23, 25, 31]
    assert group.kv_index[5:11].tolist() == [0, 1, 2, 3, 4, 5] and group.kv_index[11:17].tolist() == [0, 1, 2, 3, 4, 6]
    assert group.kv_index[25:31].tolist() == [12, 14, 15, 16, 17, 18]
    # the rejected branch restarts its position ids where the chosen one did
    assert group.position_ids[0, 5:7].tolist() == [5, 5] and group.position_ids[0, 14:19].tolist() == [1, 2, 3, 4, 5]
    assert (group.max_q, group.max_k) == (5, 6)


def test_a_frozen_branch_reads_its_shared_part(tokenizer):
    """Branch pruning, worked by hand: pair 0 ('wxyz' + 'abc' / 'abd', s = 6) backpropagates its chosen row, pair 1
    ('pq' + 'a' / 'bcdef', s = 2) its rejected one. The grad group runs each pair's shared part and its backpropagated
    branch; the frozen group runs only the other branch's tail, its keys the shared part's, kept from the grad forward
    (never run again): the tokens of the unpruned forward, 14."""
    host = _host([("wxyz", "abc", "abd"), ("pq", "a", "bcdef")], tokenizer)
    scored = host.completion_mask[:, 1:].bool()
    backprop = torch.tensor([True, False, False, True])  # rows [chosen 0, chosen 1, rejected 0, rejected 1]
    masks = PruneMasks(scored, scored.float(), torch.zeros(4, dtype=torch.long), backprop, 2.0 * backprop, scored)
    plan = plan_policy(host, masks, frozen_group=True, share=True, packed=True)
    grad, frozen = plan.grad, plan.frozen
    whole = plan_group(host, scored, torch.ones(4, dtype=torch.bool), pair_trees(torch.ones(2, dtype=torch.bool)),
                       packed=True)
    assert (grad.tokens, frozen.tokens, whole.tokens) == (6 + 6, 1 + 1, 14)
    # grad row: pair 0 shared [0..4] + chosen [5]; pair 1 shared [0] + rejected [1..5]
    assert grad.position_ids[0].tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5]
    assert grad.keeps.tolist() == [0, 1, 2, 3, 4, 6]  # the shared parts, which the frozen branches read
    # frozen row: pair 0's rejected position 5, pair 1's chosen position 1; keys [kept (6) ; own (2)]
    assert frozen.position_ids[0].tolist() == [5, 1] and frozen.reads == 6
    assert frozen.cu_seq_q.tolist() == [0, 1, 2] and frozen.cu_seq_k.tolist() == [0, 6, 8]
    assert frozen.kv_index.tolist() == [0, 1, 2, 3, 4, 6, 5, 7]
    assert (frozen.max_q, frozen.max_k) == (1, 6)
    # every scored cell is routed once: a frozen row's response start, shared with its backpropagated partner, reads the
    # grad group's output (its gradient is scaled by z = 0, Eq. 3), the rest of it the frozen group's
    assert not bool(((grad.source >= 0) & (frozen.source >= 0)).any())
    assert torch.equal((grad.source >= 0) | (frozen.source >= 0), scored)
    assert grad.source[2, 3:5].tolist() == [3, 4] and frozen.source[2, 5] == 0 and frozen.source[1, 1] == 1
    assert (plan.shared_pairs, plan.split_pairs) == (2, 0)


def test_unsupported_model_falls_back_with_one_warning(tokenizer, dataset, tmp_path):
    model = tiny_qwen2(tokenizer, attention_dropout=0.1)  # (sliding layers pack since issue 30)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = build_trainer(PrunedDPOTrainer, PrunedDPOConfig, tokenizer, dataset, tmp_path, model=model,
                                **SHARED)
    messages = [str(w.message) for w in caught if "share_prompt" in str(w.message)]
    assert len(messages) == 1 and "attention dropout" in messages[0]
    assert not trainer.forward_choice.share_prompt and not trainer.forward_choice.packed
    loss, _ = loss_and_grads(trainer, first_batch(trainer))
    assert torch.isfinite(loss) and "shared_pairs" not in trainer.last_prune_stats


@pytest.mark.parametrize("pruning", ["off", "on"])
def test_moe_router_aux_loss_falls_back_with_one_warning(pruning, tokenizer, dataset, tmp_path):
    """TRL's fused head computes the router aux loss with the attention mask, which a packed row replaces by a 4D one:
    MoE models with the aux loss on run unshared (exact), with the reason said once. With pruning on, the plugin's
    padded forward (the grad rows' own aux loss); with only the exact saving on, TRL's own forward."""
    from tiny import tiny_moe_model

    prune = {"position_keep_prob": 0.5} if pruning == "on" else {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = build_trainer(PrunedDPOTrainer, PrunedDPOConfig, tokenizer, dataset, tmp_path,
                                model=tiny_moe_model(tokenizer), **SHARED, **prune)
    messages = [str(w.message) for w in caught if "share_prompt" in str(w.message)]
    assert len(messages) == 1 and "router auxiliary loss" in messages[0]
    assert not trainer.forward_choice.share_prompt and not trainer.forward_choice.packed
    loss, _ = loss_and_grads(trainer, first_batch(trainer))
    assert torch.isfinite(loss)
    if pruning == "on":
        assert trainer.forward_choice.pruned and trainer.last_micro_step.aux_loss is not None
    else:
        assert not trainer.forward_choice.pruned and "TRL's own forward" in messages[0]


def test_config_rejects_non_bool(tmp_path):
    with pytest.raises(TypeError, match="share_prompt"):
        PrunedDPOConfig(output_dir=str(tmp_path), share_prompt="yes", bf16=False)


SYNC_METHODS = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__")


@pytest.mark.parametrize("share", [False, True])
def test_one_sync_and_one_checkpointing_toggle_per_micro_step(share, tokenizer, dataset, tmp_path, monkeypatch):
    """Device-side code (trainer.py, pruned_forward.py) converts a tensor to Python at most once per micro-step (the logged
    counts); the plan (plan.py, packing.py, masks.py) reads host tensors only. Gradient checkpointing is toggled at most once."""
    trainer = build_trainer(PrunedDPOTrainer, PrunedDPOConfig, tokenizer, dataset, tmp_path, share_prompt=share,
                            padding_free=False, branch_keep_prob=0.5, position_keep_prob=0.5, prefix_prune_prob=0.5)
    batch = first_batch(trainer)
    assert isinstance(batch["host_batch"], HostBatch) and batch["host_batch"].input_ids.device.type == "cpu"
    calls = []
    for name in SYNC_METHODS:
        original = getattr(torch.Tensor, name)

        def counting(self, *args, _original=original, _name=name, **kwargs):
            import sys

            caller = sys._getframe(1).f_code.co_filename
            if caller.endswith(("trl_pruned_dpo/trainer.py", "trl_pruned_dpo/pruned_forward.py",
                                "trl_pruned_dpo/forward_choice.py", "trl_pruned_dpo/seam/attention.py",
                                "trl_pruned_dpo/seam/kernels.py", "trl_pruned_dpo/metrics.py",
                                "trl_pruned_dpo/reference.py", "trl_pruned_dpo/seam/__init__.py")):
                calls.append((_name, sys._getframe(1).f_lineno))
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counting)
    toggles = []
    disable = trainer.model.gradient_checkpointing_disable
    monkeypatch.setattr(trainer.model, "gradient_checkpointing_disable", lambda: (toggles.append(1), disable())[1])
    trainer.model.gradient_checkpointing_enable(trainer.args.gradient_checkpointing_kwargs)  # as Trainer.train does
    for micro_step in range(3):
        calls.clear(), toggles.clear()
        loss_and_grads(trainer, batch)
        assert len(calls) == 1, calls  # the gathered counts of metrics.log_pruned_metrics; the counter does see it
        assert len(toggles) == 1
