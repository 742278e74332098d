"""Contract: with every keep probability at 1, no prefix pruning and the exact savings off (`SAVINGS_OFF`:
`share_prompt=False, padding_free=False`), PrunedDPOTrainer is stock TRL DPOTrainer —
same loss, same gradients, same logged metrics, up to float round-off.

With pruning off, training takes TRL's own path (by construction; tests/test_parity.py checks the trainer end to
end). The step-level tests here also run the pruned machinery itself (`AtIdentity`: masks, trimmed forwards,
compact head, estimators, replay into TRL's loss) at the identity probabilities, where it must reproduce stock."""

import pytest
import torch
from trl import DPOConfig, DPOTrainer

from tiny import SAVINGS_OFF, build_trainer, first_batch, lora_trainer, loss_and_grads, train_and_compare_histories
from trl_pruned_dpo import PrunedDPOConfig, PrunedDPOTrainer

LOSS_CASES = [
    {"loss_type": ["sigmoid"]},
    {"loss_type": ["ipo"]},
    {"loss_type": ["hinge"]},
    {"loss_type": ["bco_pair"]},
    {"loss_type": ["sppo_hard"]},
    {"loss_type": ["nca_pair"]},
    {"loss_type": ["aot"]},
    {"loss_type": ["apo_zero"]},
    {"loss_type": ["apo_down"]},
    {"loss_type": ["aot_unpaired"]},
    {"loss_type": ["robust"], "label_smoothing": 0.1},
    {"loss_type": ["discopop"]},
    {"loss_type": ["sigmoid_norm"]},
    {"loss_type": ["exo_pair"], "label_smoothing": 1e-3},
    {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.5]},
    {"loss_type": ["sigmoid"], "ld_alpha": 0.5},
    {"loss_type": ["sigmoid"], "use_weighting": True},
    {"loss_type": ["sigmoid"], "f_divergence_type": "js_divergence"},
]


class AtIdentity(PrunedDPOTrainer):
    """The plugin's own forward with every pruning and saving off (its public hook, as the benchmarks' `none` row)."""

    always_pruned_forward = True


def assert_same_step(stock, pruned, batch_size=4, machinery=True):
    """One step of each; `machinery`: the pruned trainer runs its pruned path at identity (`AtIdentity`, or a saving
    on), not TRL's delegated one."""
    assert pruned.forward_choice.pruned == machinery
    batch_stock, batch_pruned = first_batch(stock, batch_size), first_batch(pruned, batch_size)
    loss_s, grads_s = loss_and_grads(stock, batch_stock)
    loss_p, grads_p = loss_and_grads(pruned, batch_pruned)
    torch.testing.assert_close(loss_p, loss_s, rtol=1e-5, atol=1e-6)
    assert grads_s.keys() == grads_p.keys()
    for name in grads_s:
        # Round-off is relative to the tensor's magnitude: packed and padded sums in another order differ by up to
        # 1.8e-5 of it (a Qwen2 bias gradient, measured on a Xeon with AVX512); a wrong mask differs by O(1).
        scale = float(grads_s[name].abs().max()) + 1e-12
        torch.testing.assert_close(grads_p[name], grads_s[name], rtol=1e-4, atol=5e-5 * scale, msg=name)
    metrics_s = {k: v[-1] for k, v in stock._metrics["train"].items()}
    metrics_p = {k: v[-1] for k, v in pruned._metrics["train"].items()}
    for key, value in metrics_s.items():
        assert metrics_p[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    if machinery:
        # At identity nothing is sampled: the fractions that would read 1 are diagnostics ("debug", docs/metrics.md),
        # and every token executed is backpropagated.
        assert "prune/positions_scored" not in metrics_p and "prune/branches_backpropagated" not in metrics_p
        assert metrics_p["prune/tokens_backpropagated"] == metrics_p["prune/tokens_executed"] > 0
    else:
        assert metrics_p.keys() == metrics_s.keys()


@pytest.mark.parametrize("case", LOSS_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_loss_gradients_and_metrics_equal_stock(case, tokenizer, dataset, tmp_path):
    stock = build_trainer(DPOTrainer, DPOConfig, tokenizer, dataset, tmp_path / "s", **case)
    pruned = build_trainer(AtIdentity, PrunedDPOConfig, tokenizer, dataset, tmp_path / "p", **case, **SAVINGS_OFF)
    assert_same_step(stock, pruned)


def test_equal_stock_with_precomputed_reference(tokenizer, dataset, tmp_path):
    kw = {"precompute_ref_log_probs": True, "ld_alpha": 0.7}
    stock = build_trainer(DPOTrainer, DPOConfig, tokenizer, dataset, tmp_path / "s", **kw)
    pruned = build_trainer(PrunedDPOTrainer, PrunedDPOConfig, tokenizer, dataset, tmp_path / "p", **kw,
                           **SAVINGS_OFF)
    # the stored sums agree with TRL's
    for column in ("ref_chosen_logps", "ref_rejected_logps"):
        torch.testing.assert_close(torch.tensor(pruned.train_dataset[column]), torch.tensor(stock.train_dataset[column]),
                                   rtol=1e-5, atol=1e-5)
    assert_same_step(stock, pruned, machinery=False)  # pruning off precomputes as TRL (sums only, cached)


@pytest.mark.parametrize("precompute", [False, True])
def test_equal_stock_with_peft(tokenizer, dataset, tmp_path, precompute):
    def make(trainer_cls, config_cls, out, **extra):
        return lora_trainer(trainer_cls, config_cls, tokenizer, dataset, out, per_device_train_batch_size=4,
                            precompute_ref_log_probs=precompute, **extra)

    pruned_cls = PrunedDPOTrainer if precompute else AtIdentity
    assert_same_step(make(DPOTrainer, DPOConfig, tmp_path / "s"),
                     make(pruned_cls, PrunedDPOConfig, tmp_path / "p", **SAVINGS_OFF), machinery=not precompute)


def test_training_run_logs_the_same_history(tokenizer, dataset, tmp_path):
    """Two optimizer steps through Trainer.train(): every TRL metric logged at every step matches."""
    kw = {"max_steps": 2, "gradient_accumulation_steps": 2, "per_device_train_batch_size": 2}
    stock = build_trainer(DPOTrainer, DPOConfig, tokenizer, dataset, tmp_path / "s", **kw)
    pruned = build_trainer(PrunedDPOTrainer, PrunedDPOConfig, tokenizer, dataset, tmp_path / "p", **kw, **SAVINGS_OFF)
    for hs, hp in train_and_compare_histories(stock, pruned):
        assert hp.keys() == hs.keys()  # pruning off logs exactly stock's metrics
