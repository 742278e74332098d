"""The trainer end to end: edge cases, the features it must work with, evaluation, save/resume."""

import copy
import math

import pytest
import torch
from datasets import Dataset
from trl import DPOConfig, DPOTrainer

from tiny import build_trainer, first_batch, loss_and_grads, preference_rows, tiny_model
from trl_pruned_dpo import PrunedDPOConfig, PrunedDPOTrainer

ALL_ON = dict(position_keep_prob=0.5, prefix_prune_prob=0.5, branch_keep_prob=0.5)


def train(trainer):
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses and all(math.isfinite(x) for x in losses)
    return trainer.state.log_history


def recorded_masks(trainer):
    """Every micro-step's masks, keyed by (global step, micro-step), from its record (what `merged_forward` returns
    for each micro-batch of a pass; `concatenated_forward` is a pass of one)."""
    record = {}
    original = trainer.merged_forward

    def forward(model, batches):
        records = original(model, batches)
        for done in records:
            record[done.step] = (done.masks.scored.clone(), done.masks.backprop.clone())
        return records

    trainer.merged_forward = forward
    return record


def pruned(tokenizer, data, tmp_path, **kw):
    return build_trainer(PrunedDPOTrainer, PrunedDPOConfig, tokenizer, data, tmp_path, **kw)


EDGE_ROWS = {
    "response of length 1": [{"prompt": "2+2=", "chosen": "", "rejected": "5"}] * 4,  # chosen is EOS only
    "very unequal lengths": [{"prompt": "say: ", "chosen": "a", "rejected": "b" * 300}] * 2
    + [{"prompt": "x" * 200 + ": ", "chosen": "y", "rejected": "z"}] * 2,
    # Mixed with a normal pair: a dataset of identical pairs only is refused (tests/test_data_checks.py).
    "identical responses": [{"prompt": "p: ", "chosen": "same answer", "rejected": "same answer"}] * 3
    + [{"prompt": "p: ", "chosen": "right answer", "rejected": "wrong answer"}],
}


@pytest.mark.parametrize("case", EDGE_ROWS, ids=list(EDGE_ROWS))
@pytest.mark.parametrize("common", [False, True])
def test_edge_cases_train(tokenizer, tmp_path, case, common):
    train(pruned(tokenizer, Dataset.from_list(EDGE_ROWS[case]), tmp_path, prune_common_prefix=common, **ALL_ON))


def test_truncation_and_prompt_filling_max_length(tokenizer, tmp_path):
    """TRL drops rows whose prompt fills max_length; the rest are cut to a few (or one) response tokens."""
    rows = preference_rows(6) + [{"prompt": "q" * 40, "chosen": "a", "rejected": "b"}]
    trainer = pruned(tokenizer, Dataset.from_list(rows), tmp_path, max_length=14, **ALL_ON)
    assert len(trainer.train_dataset) == 6
    train(trainer)


def test_batch_of_one_pair(tokenizer, dataset, tmp_path):
    train(pruned(tokenizer, dataset, tmp_path, per_device_train_batch_size=1, max_steps=3, **ALL_ON))


@pytest.mark.parametrize("sampling", ["paired", "independent"])
def test_rows_with_nothing_scored_and_empty_branch_groups(tokenizer, dataset, tmp_path, sampling):
    """At tiny keep probabilities whole rows (even whole groups) are unscored: still a finite, connected loss."""
    trainer = pruned(tokenizer, dataset, tmp_path, position_keep_prob=0.02, branch_keep_prob=0.1,
                     branch_sampling=sampling, per_device_train_batch_size=1)
    batch = first_batch(trainer, 1)
    for _ in range(10):
        loss, grads = loss_and_grads(trainer, batch)
        assert torch.isfinite(loss) and grads  # backward ran
        assert all(torch.isfinite(g).all() for g in grads.values())


@pytest.mark.parametrize(
    "options",
    [
        dict(gradient_checkpointing=False),
        dict(gradient_accumulation_steps=2, per_device_train_batch_size=2),
        dict(precompute_ref_log_probs=True),
        dict(precompute_ref_log_probs=True, prune_reference=False),
        dict(prune_reference=False),
        dict(loss_type=["ipo"], ld_alpha=0.5),
        dict(use_weighting=True),
        dict(prune_common_prefix=True),
        dict(branch_sampling="independent", branch_keep_prob=0.7),
    ],
    ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()),
)
def test_features_train_with_pruning(tokenizer, dataset, tmp_path, options):
    history = train(pruned(tokenizer, dataset, tmp_path, **{**ALL_ON, **options}))
    logged = [h for h in history if "loss" in h][0]
    for key in ("prune/positions_scored", "prune/tokens_executed", "prune/branches_backpropagated",
                "prune/tokens_backpropagated"):
        assert 0.0 <= logged[key] <= 1.0
    assert logged["prune/positions_scored"] < 1.0


def test_bf16(tokenizer, dataset, tmp_path):
    train(pruned(tokenizer, dataset, tmp_path, bf16=True, use_cpu=True, **ALL_ON))


def test_gradient_accumulation_draws_fresh_masks_per_micro_step(tokenizer, dataset, tmp_path):
    trainer = pruned(tokenizer, dataset, tmp_path, gradient_accumulation_steps=2, per_device_train_batch_size=2,
                     max_steps=2, **ALL_ON)
    record = recorded_masks(trainer)
    trainer.train()
    assert sorted(record) == [(0, 0), (0, 1), (1, 0), (1, 1)]  # (global step, micro-step)


def test_conversational_dataset(tokenizer, tmp_path):
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}{{ eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}a:{% endif %}"
    )
    rows = [
        {"prompt": [{"role": "user", "content": r["prompt"]}],
         "chosen": [{"role": "assistant", "content": r["chosen"]}],
         "rejected": [{"role": "assistant", "content": r["rejected"]}]}
        for r in preference_rows()
    ]
    train(pruned(tokenizer, Dataset.from_list(rows), tmp_path, **ALL_ON))


def test_evaluation_is_exact(tokenizer, dataset, tmp_path):
    """Evaluation never prunes: eval metrics equal stock TRL's on the same model."""
    kw = dict(per_device_eval_batch_size=4)
    stock = build_trainer(DPOTrainer, DPOConfig, tokenizer, dataset, tmp_path / "s", **kw)
    ours = build_trainer(PrunedDPOTrainer, PrunedDPOConfig, tokenizer, dataset, tmp_path / "p", **ALL_ON, **kw)
    metrics_s, metrics_p = stock.evaluate(dataset), ours.evaluate(dataset)
    for key, value in metrics_s.items():
        if "runtime" in key or "per_second" in key:
            continue
        assert metrics_p[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def test_evaluation_is_exact_with_precomputed_reference(tokenizer, dataset, tmp_path):
    kw = dict(precompute_ref_log_probs=True)
    stock = build_trainer(DPOTrainer, DPOConfig, tokenizer, dataset, tmp_path / "s", **kw)
    stock_metrics = stock.evaluate(dataset)
    ours = build_trainer(PrunedDPOTrainer, PrunedDPOConfig, tokenizer, dataset, tmp_path / "p", **ALL_ON, **kw)
    ours_metrics = ours.evaluate(dataset)
    assert ours_metrics["eval_loss"] == pytest.approx(stock_metrics["eval_loss"], rel=1e-5)


def test_resume_from_checkpoint_draws_the_same_masks(tokenizer, dataset, tmp_path):
    kw = dict(max_steps=4, per_device_train_batch_size=2, save_strategy="steps", save_steps=2, **ALL_ON)
    full = pruned(tokenizer, dataset, tmp_path / "full", **kw)
    full_masks = recorded_masks(full)
    full.train()
    resumed = pruned(tokenizer, dataset, tmp_path / "resumed", **kw)
    resumed.train()  # the same run, then resumed from its step-2 checkpoint in a fresh trainer
    again = pruned(tokenizer, dataset, tmp_path / "resumed", **kw)
    again_masks = recorded_masks(again)
    again.train(resume_from_checkpoint=str(tmp_path / "resumed" / "checkpoint-2"))
    assert sorted(again_masks) == [(2, 0), (3, 0)]
    for key, (scored, backprop) in again_masks.items():
        assert torch.equal(scored, full_masks[key][0]) and torch.equal(backprop, full_masks[key][1])
    for (name, p_full), p_again in zip(full.model.named_parameters(), again.model.parameters()):
        torch.testing.assert_close(p_again, p_full, rtol=1e-5, atol=1e-6, msg=name)


def test_saved_model_reloads(tokenizer, dataset, tmp_path):
    trainer = pruned(tokenizer, dataset, tmp_path, **ALL_ON)
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    reloaded = type(trainer.model).from_pretrained(str(tmp_path / "final"))
    for (name, a), b in zip(trainer.model.named_parameters(), reloaded.parameters()):
        torch.testing.assert_close(a, b, msg=name)


def test_peft_reference_is_the_disabled_adapter(tokenizer, dataset, tmp_path):
    from peft import LoraConfig

    args = PrunedDPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=2, report_to="none",
                           bf16=False, learning_rate=1e-2, logging_steps=1, **ALL_ON)
    trainer = PrunedDPOTrainer(model=tiny_model(tokenizer), args=args, train_dataset=dataset,
                               processing_class=tokenizer,
                               peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    assert trainer.ref_model is None
    train(trainer)
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora" in n for n in trainable)


def test_qlora_4bit_on_cpu(tokenizer, dataset, tmp_path):
    pytest.importorskip("bitsandbytes")
    from peft import LoraConfig
    from transformers import BitsAndBytesConfig

    tiny_model(tokenizer).save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    args = PrunedDPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=1,
                           report_to="none", bf16=False, logging_steps=1, **ALL_ON)
    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32)
    trainer = PrunedDPOTrainer(model=str(tmp_path / "base"), args=args, train_dataset=dataset,
                               processing_class=tokenizer, quantization_config=quantization,
                               peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    assert getattr(trainer.model, "is_loaded_in_4bit", False)
    train(trainer)


def _qlora_trainer(trainer_cls, config_cls, base, data, tokenizer, output_dir, compute_dtype):
    """A real bitsandbytes 4-bit (nf4) model from `base` with LoRA on q/v and no `ref_model` (the reference is the
    adapter switched off), as QLoRA users run it; every adapter weight set from one seed (LoRA's B starts at zero,
    which would leave A without a gradient)."""
    from peft import LoraConfig
    from transformers import BitsAndBytesConfig

    args = config_cls(output_dir=str(output_dir), per_device_train_batch_size=len(data), max_length=48,
                      report_to="none", bf16=False)
    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute_dtype)
    trainer = trainer_cls(model=str(base), args=args, train_dataset=data, processing_class=tokenizer,
                          quantization_config=quantization,
                          peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in sorted(trainer.model.named_parameters()):
            if "lora_" in name:
                parameter.copy_(0.1 * torch.randn(parameter.shape, generator=generator))
    return trainer


def _largest_relative(grads, reference):
    return max(float((grads[n] - reference[n]).abs().max()) / float(reference[n].abs().max()) for n in reference)


@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16], ids=["fp32-compute", "bf16-compute"])
def test_qlora_4bit_packed_is_as_close_to_stock_as_stock_is_to_itself(compute_dtype, tokenizer, tmp_path):
    """A real bitsandbytes 4-bit model on CPU (docs/setups.md), packed with the shared prompt, against stock
    DPOTrainer on the same 8 ragged pairs: the same loss (1e-5), and every LoRA gradient within twice the distance
    between stock's own gradient on the 8 pairs and the mean of its gradients on two halves of 4. Through the 4-bit
    layers the LoRA gradients move with the batch's layout in steps of bfloat16 size, whatever the compute dtype
    (measured: stock against itself that way 6.8e-3 relative, the plugin against stock 3.4e-3 with float32 compute,
    5.1e-3 with bfloat16), so 1e-4 is not what any layout holds here; a layout error moves gradients by their size."""
    pytest.importorskip("bitsandbytes")
    from test_share_prompt import edge_rows

    tiny_model(tokenizer, hidden=64).save_pretrained(tmp_path / "base")
    data = Dataset.from_list(edge_rows())
    stock = _qlora_trainer(DPOTrainer, DPOConfig, tmp_path / "base", data, tokenizer, tmp_path / "s", compute_dtype)
    pruned = _qlora_trainer(PrunedDPOTrainer, PrunedDPOConfig, tmp_path / "base", data, tokenizer, tmp_path / "p",
                            compute_dtype)
    assert pruned.forward_choice.packed and pruned.forward_choice.share_prompt
    assert getattr(pruned.model, "is_loaded_in_4bit", False)

    def on(trainer, rows):
        return loss_and_grads(trainer, first_batch(trainer, rows=rows))

    loss, grads = on(stock, range(8))
    halves = [on(stock, rows)[1] for rows in (range(4), range(4, 8))]
    floor = _largest_relative({n: (halves[0][n] + halves[1][n]) / 2 for n in grads}, grads)
    pruned_loss, pruned_grads = on(pruned, range(8))
    assert pruned.last_prune_stats["shared_pairs"] == 8
    torch.testing.assert_close(pruned_loss, loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == pruned_grads.keys() and all("lora_" in n for n in grads)
    assert _largest_relative(pruned_grads, grads) <= 2 * max(floor, 1e-4), (floor, _largest_relative(pruned_grads, grads))
