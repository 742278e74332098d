"""The fixes of the drop-in issue with pruning ON: default config, plugin-only refusals, MoE aux loss, metric names,
precomputed references (bf16, sharded gather), what the decoder and the LM head really see, and the replay seam."""

import copy

import pytest
import torch
from accelerate.parallelism_config import ParallelismConfig
from trl import DPOConfig, DPOTrainer

import trl_pruned_dpo.trainer as trainer_module
from tiny import SAVINGS_OFF, build_trainer, first_batch, loss_and_grads, preference_rows, tiny_model, tiny_moe_model
from trl_pruned_dpo import PrunedDPOConfig, PrunedDPOTrainer
from trl_pruned_dpo.seam import _HeadRows, head_rows_scored
from trl_pruned_dpo.method.masks import mask_generator
from trl_pruned_dpo.method.plan import Layout, plan_micro_step
from trl_pruned_dpo.pruned_forward import reference_estimate
from trl_pruned_dpo.reference import host_batch
from trl_pruned_dpo.reference import REF_TOKEN_COLUMNS


def pruned(tokenizer, dataset, tmp_path, **kw):
    return build_trainer(PrunedDPOTrainer, PrunedDPOConfig, tokenizer, dataset, tmp_path, **kw)


# ------------------------------------------------------------------------------------------------------ construction
def test_args_none_builds_stocks_default_config_with_pruning_off(tokenizer, dataset, tmp_path, monkeypatch):
    import transformers.training_args as training_args

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(training_args, "is_torch_bf16_gpu_available", lambda: True)  # stock's default asks for bf16
    model = tiny_model(tokenizer)
    model.config._name_or_path = "org/tiny-llama"
    stock = DPOTrainer(model=copy.deepcopy(model), ref_model=copy.deepcopy(model), args=None, train_dataset=dataset,
                       processing_class=tokenizer)
    trainer = PrunedDPOTrainer(model=model, ref_model=copy.deepcopy(model), args=None, train_dataset=dataset,
                               processing_class=tokenizer)
    assert type(trainer.args) is PrunedDPOConfig and not trainer.args.pruning_enabled
    assert trainer.args.output_dir == stock.args.output_dir == "tiny-llama-DPO"
    assert {"trl", "dpo", "trl-pruned-dpo"} <= set(model.model_tags)


def test_signature_columns_are_added_once(tokenizer, dataset, tmp_path):
    trainer = pruned(tokenizer, dataset, tmp_path, position_keep_prob=0.5, precompute_ref_log_probs=True)
    trainer._set_signature_columns_if_needed()
    trainer._set_signature_columns_if_needed()
    columns = trainer._signature_columns
    assert len(columns) == len(set(columns)) and set(REF_TOKEN_COLUMNS) <= set(columns)


@pytest.mark.parametrize("field", ["tp_size", "cp_size", "sp_size"])
def test_tensor_context_sequence_parallelism_is_refused_before_any_work(tokenizer, dataset, tmp_path, field,
                                                                          monkeypatch):
    args = PrunedDPOConfig(output_dir=str(tmp_path), bf16=False, report_to="none", position_keep_prob=0.5,
                           precompute_ref_log_probs=True)
    args.parallelism_config = ParallelismConfig(**{field: 2})
    monkeypatch.setattr(PrunedDPOTrainer, "_precompute_ref_logps", lambda *a: pytest.fail("work before the check"))
    with pytest.raises(ValueError, match="tensor/context/sequence parallelism.*draw different masks"):
        PrunedDPOTrainer(model=tiny_model(tokenizer), args=args, train_dataset=dataset, processing_class=tokenizer)


def test_compact_head_check_counts_rows_by_behaviour():
    assert head_rows_scored(labels_kept=3) == 3  # not the 7 positions an uncompacted head would score


# -------------------------------------------------------------------------------------------------------------- MoE
def test_moe_aux_loss_is_the_grad_rows_own_and_logged_under_its_stock_name(tokenizer, dataset, tmp_path):
    """Issue 22: `aux_loss` keeps its stock name with pruning on (the aux loss this run adds, as `loss` is the loss at
    the estimate); TRL's own MoE tests read it from the log."""
    model = tiny_moe_model(tokenizer, "qwen3_moe")
    trainer = pruned(tokenizer, dataset, tmp_path, model=model, branch_keep_prob=0.5, position_keep_prob=0.7)
    assert trainer.aux_loss_enabled
    batch = first_batch(trainer)
    trainer.compute_loss(trainer.model, batch).backward()
    metrics = trainer._metrics["train"]
    assert "prune/aux_loss_grad_rows" not in metrics and len(metrics["aux_loss"]) == 1
    # the model's own load-balancing loss on the rows that ran with grad, over their executed columns
    masks = trainer.last_micro_step.masks
    rows = torch.nonzero((masks.executed > 0) & masks.backprop).flatten()
    width = int(masks.executed[rows].max())
    with torch.no_grad():
        expected = model(input_ids=batch["input_ids"][rows, :width],
                         attention_mask=batch["attention_mask"][rows, :width], output_router_logits=True,
                         use_cache=False).aux_loss
    assert metrics["aux_loss"][0] == pytest.approx(float(expected), rel=1e-5)


# ------------------------------------------------------------------------------------------------ metric semantics
STOCK_ESTIMATED = ("entropy", "logits/chosen", "logits/rejected", "mean_token_accuracy", "rewards/chosen",
                   "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")


def test_stock_named_metrics_are_unbiased_under_random_pruning(tokenizer, dataset, tmp_path):
    """Monte-Carlo mean of every stock-named metric over mask draws vs stock's value on the same batch."""
    stock = build_trainer(DPOTrainer, DPOConfig, tokenizer, dataset, tmp_path / "s")
    trainer = pruned(tokenizer, dataset, tmp_path / "p", position_keep_prob=0.5, prefix_prune_prob=0.5)
    batch = first_batch(trainer)
    with torch.no_grad():
        stock.compute_loss(stock.model, first_batch(stock))
        draws = 150
        for step in range(draws):
            trainer.state.global_step = step  # a fresh mask per draw
            trainer.compute_loss(trainer.model, batch)
    metrics = trainer._metrics["train"]
    assert "rewards/accuracies" not in metrics and len(metrics["prune/rewards/accuracies_of_estimate"]) == draws
    for name in STOCK_ESTIMATED:
        values = torch.tensor(metrics[name], dtype=torch.float64)
        target = stock._metrics["train"][name][0]
        se = float(values.std()) / draws**0.5
        assert abs(float(values.mean()) - target) < 4.5 * se + 1e-6, (name, float(values.mean()), target, se)


def test_common_prefix_metrics_move_to_names_that_say_what_they_cover(tokenizer, tmp_path):
    from datasets import Dataset

    rows = [{"prompt": r["prompt"], "chosen": r["chosen"] + "xyz", "rejected": r["chosen"] + "abc"}
            for r in preference_rows(4)]  # a long shared start: the common prefix is most of the response
    trainer = pruned(tokenizer, Dataset.from_list(rows), tmp_path, prune_common_prefix=True)
    batch = first_batch(trainer)
    with torch.no_grad():
        trainer.compute_loss(trainer.model, batch)
        metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
        exact = trainer.last_micro_step.masks.exact
        labels = torch.full_like(batch["input_ids"], -100)
        labels[:, 1:] = torch.where(exact, batch["input_ids"][:, 1:], -100)
        out = trainer.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels,
                            use_cache=False, fused_lm_head=True)
    for name in STOCK_ESTIMATED[:4] + ("logps/chosen", "logps/rejected", "rewards/chosen", "rewards/rejected"):
        assert name not in metrics and f"prune/{name}_after_common_prefix" in metrics
    assert "rewards/margins" in metrics and "rewards/accuracies" in metrics  # the difference is exact
    entropy = float(out.entropy[:, -exact.size(1):][exact].mean())
    assert metrics["prune/entropy_after_common_prefix"] == pytest.approx(entropy, rel=1e-4)
    half = exact.size(0) // 2
    logits_w = float(out.mean_logits[:half, -exact.size(1):][exact[:half]].mean())
    assert metrics["prune/logits/chosen_after_common_prefix"] == pytest.approx(logits_w, rel=1e-4, abs=1e-6)


# ---------------------------------------------------------------------------------------- precomputed references
def test_precomputed_reference_bf16_matches_stock_and_the_live_reference(tokenizer, dataset, tmp_path):
    # no ref_model: the precompute runs the policy before Trainer prepares it (and wraps it in autocast), so only
    # an explicit `accelerator.autocast()` makes it bf16, as stock's
    kw = dict(bf16=True, use_cpu=True, precompute_ref_log_probs=True, ref_model=None)
    stock = build_trainer(DPOTrainer, DPOConfig, tokenizer, dataset, tmp_path / "s", **kw)
    pre = pruned(tokenizer, dataset, tmp_path / "p", position_keep_prob=0.5, **kw)
    live = pruned(tokenizer, dataset, tmp_path / "l", position_keep_prob=0.5, bf16=True, use_cpu=True,
                  ref_model=tiny_model(tokenizer))  # the same weights as `pre`'s reference (its untrained policy)
    for column in ("ref_chosen_logps", "ref_rejected_logps"):  # autocast: what stock stores, not an fp32 value
        torch.testing.assert_close(torch.tensor(pre.train_dataset[column]), torch.tensor(stock.train_dataset[column]),
                                   rtol=1e-6, atol=1e-5)
    stored = pre.train_dataset.with_format("torch")[:]
    for branch in ("chosen", "rejected"):  # the per-token values add up to the stored sums
        sums = torch.stack([row.sum() for row in stored[f"ref_{branch}_token_logps"]])
        torch.testing.assert_close(sums, stored[f"ref_{branch}_logps"], rtol=1e-5, atol=1e-4)
    # the same masks on the stored and on the live reference (the live one runs under the trainer's autocast)
    batch_pre, batch_live = first_batch(pre), first_batch(live)
    # On the host, which is also the device here; padded rows on both sides.
    masks = pre.draw_masks(host_batch(batch_pre), pre.args.mask_options(), mask_generator(0, 0, 0, 0))

    def estimate(trainer, batch):
        plan = plan_micro_step((0, 0), {}, host_batch(batch), masks, Layout(False, False), prunes_branches=False,
                               reference_scored=None if trainer.precompute_ref_logps else masks.scored)
        with torch.no_grad(), trainer.autocast_smart_context_manager():
            return reference_estimate(trainer.forward_context(), plan.reference, masks, batch)

    from_store, from_live = estimate(pre, batch_pre), estimate(live, batch_live)
    for a, b in zip(from_store, from_live):
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-3, atol=2e-2)


# ------------------------------------------------------------------------ what the decoder and the head really see
def test_decoder_and_head_see_only_the_kept_rows_and_columns(tokenizer, dataset, tmp_path):
    """The padded layout (the exact savings off): each group's rows trimmed to its longest executed row."""
    trainer = pruned(tokenizer, dataset, tmp_path, position_keep_prob=0.5, prefix_prune_prob=0.5,
                     branch_keep_prob=0.5, prune_reference=True, **SAVINGS_OFF)
    batch = first_batch(trainer)
    seen = []
    hook = trainer.model.model.layers[0].register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(tuple((args[0] if args else kwargs["hidden_states"]).shape[:2])),
        with_kwargs=True)
    counter = _HeadRows(len(tokenizer))
    try:
        with counter:
            trainer.compute_loss(trainer.model, batch)
    finally:
        hook.remove()
    masks = trainer.last_micro_step.masks
    needed = masks.executed > 0
    expected = []
    for rows in (needed & masks.backprop, needed & ~masks.backprop):
        if rows.any():
            expected.append((int(rows.sum()), int(masks.executed[rows].max())))
    assert seen == expected  # the policy's decoder: each group trimmed to its longest executed row
    policy_and_reference = 2 * int(masks.scored.sum())
    assert counter.rows == policy_and_reference  # the head: kept positions only, for the policy and the reference


# ---------------------------------------------------------------------------------------------- the replay seam
def test_seam_private_attributes_exist(tokenizer, dataset, tmp_path):
    """The TRL and transformers privates seam.py reads directly, each with the meaning it relies on: TRL's cached
    DeepSpeed engine of its precompute (None until one is needed), the run's output folder, and TRL's train metrics
    (the lists its `log` averages)."""
    from trl_pruned_dpo.seam import run_output_dir, train_metrics

    trainer = pruned(tokenizer, dataset, tmp_path, position_keep_prob=0.5)
    assert trainer._precompute_engine is None
    assert run_output_dir(trainer) == trainer.args.output_dir == str(tmp_path)
    loss_and_grads(trainer, first_batch(trainer))
    logged = train_metrics(trainer)
    assert logged is trainer._metrics["train"] and logged["prune/positions_scored"]


def test_replay_seam_assumptions(tokenizer, dataset, tmp_path, monkeypatch):
    """`_Replay` stands in for the model in TRL's `_compute_loss`: called once, only per-token fields read, the
    reference read from the batch (never a model call), each TRL metric appended exactly once per call."""
    trainer = pruned(tokenizer, dataset, tmp_path, position_keep_prob=0.5, use_weighting=True)
    calls, reads = [], set()

    class Recording(trainer_module.Replay):
        def __call__(self, *args, **kwargs):
            calls.append(sorted(kwargs))
            outputs = super().__call__(*args, **kwargs)

            class Spy:
                def __getattr__(_, name):
                    reads.add(name)
                    return getattr(outputs, name)
            return Spy()

    monkeypatch.setattr(trainer_module, "Replay", Recording)
    compute = trainer._compute_loss
    before = {}

    def checked(model, inputs, return_outputs):
        calls.clear()  # earlier replays: the reference sums (TRL's compute_ref_log_probs), read in `reads` too
        reads.clear()
        before.update({k: len(v) for k, v in trainer._metrics["train"].items()})
        forward = trainer.ref_model.forward
        trainer.ref_model.forward = lambda *a, **k: pytest.fail("the reference must come from the batch")
        try:
            return compute(model, inputs, return_outputs)
        finally:
            trainer.ref_model.forward = forward
            after.update({k: len(v) for k, v in trainer._metrics["train"].items()})
            window.extend(calls)

    after, window = {}, []
    trainer._compute_loss = checked
    trainer.compute_loss(trainer.model, first_batch(trainer))
    assert len(window) == 1 and "labels" in window[0]
    assert reads == {"log_probs", "entropy", "mean_logits", "is_top1", "log_sum_sq_probs"}
    appended = {k for k in after if after[k] != before.get(k, 0)}
    assert all(after[k] - before.get(k, 0) == 1 for k in appended)
    assert {"mean_token_accuracy", "rewards/accuracies", "logps/chosen"} <= appended


def test_moe_with_peft_trains_with_pruning_on(tokenizer, dataset, tmp_path):
    from peft import LoraConfig

    args = PrunedDPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=1, report_to="none",
                           bf16=False, position_keep_prob=0.5, branch_keep_prob=0.5, logging_steps=1)
    trainer = PrunedDPOTrainer(model=tiny_moe_model(tokenizer, "mixtral"), args=args, train_dataset=dataset,
                               processing_class=tokenizer,
                               peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    trainer.train()
    logged = trainer.state.log_history[0]
    assert torch.isfinite(torch.tensor(logged["loss"])) and "aux_loss" in logged
