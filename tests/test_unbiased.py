"""Contract: every estimator is unbiased. Monte-Carlo over many mask draws through the trainer's own forward: the
mean estimate matches the exact value within a few standard errors; a negative control shows a wrong weight fails.
"""

import contextlib

import pytest
import torch

import trl_pruned_dpo.pruned_forward as pruned_forward_module
import trl_pruned_dpo.trainer as trainer_module
from tiny import SAVINGS_OFF, build_trainer, first_batch
from trl_pruned_dpo import PrunedDPOConfig, PrunedDPOTrainer

IDENTITY = dict(position_keep_prob=1.0, prefix_prune_prob=0.0, branch_keep_prob=1.0, prune_common_prefix=False)
Z_LIMIT = 4.5  # per row; 8 rows per test
DRAWS, GRADIENT_DRAWS = 600, 400


def log_ratio_sums(trainer, batch):
    """D^_b per row ([chosen; rejected]) from one draw of the trainer's pruned forward."""
    with torch.no_grad():
        record = trainer.concatenated_forward(trainer.model, batch)
    return record.per_token["log_probs"].sum(1) - torch.cat(record.reference)


@contextlib.contextmanager
def unpruned(trainer):
    """Temporarily the identity configuration (set in place: rebuilding TrainingArguments resets accelerate)."""
    saved = {name: getattr(trainer.args, name) for name in IDENTITY}
    for name, value in IDENTITY.items():
        setattr(trainer.args, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(trainer.args, name, value)


def exact_sums(trainer, batch):
    with unpruned(trainer):
        return log_ratio_sums(trainer, batch)


def max_z(samples, exact):
    mean, se = samples.mean(0), samples.std(0) / samples.size(0) ** 0.5
    varying = se > 1e-7
    assert torch.allclose(mean[~varying], exact[~varying], atol=1e-4), "a deterministic row differs from exact"
    z = ((mean - exact)[varying].abs() / se[varying]).max().item() if varying.any() else 0.0
    print(f"max |z| = {z:.2f}")
    return z


@pytest.fixture()
def make(tokenizer, dataset, tmp_path):
    def make(**pruning):
        # the padded layout (the exact savings, on by default, off) unless asked: the packed layout gives the same
        # estimate under the same masks (test_share_prompt.py); the branch gradient is checked on both
        trainer = build_trainer(PrunedDPOTrainer, PrunedDPOConfig, tokenizer, dataset, tmp_path,
                                **{**SAVINGS_OFF, **pruning})
        return trainer, first_batch(trainer)

    return make


SETTINGS = {
    "position": dict(position_keep_prob=0.3),
    "prefix": dict(prefix_prune_prob=0.7, prefix_min_ratio=0.3),
    "combined": dict(position_keep_prob=0.5, prefix_prune_prob=0.5, branch_keep_prob=0.5),
    "combined-exact-reference": dict(position_keep_prob=0.5, prefix_prune_prob=0.5, prune_reference=False),
}


@pytest.mark.parametrize("setting", SETTINGS, ids=list(SETTINGS))
def test_log_ratio_sums_are_unbiased(make, setting):
    trainer, batch = make(**SETTINGS[setting])
    exact = exact_sums(trainer, batch)
    assert exact.abs().min() > 1e-3  # the policy differs from the reference: a real test
    samples = torch.stack([log_ratio_sums(trainer, batch) for _ in range(DRAWS)])
    assert max_z(samples, exact) < Z_LIMIT


def test_negative_control_catches_a_missing_prefix_correction(make, monkeypatch):
    """Weighting prefix-pruned tokens by 1/p_pos only (forgetting 1/q_t) must be caught by the same test."""
    trainer, batch = make(position_keep_prob=0.5, prefix_prune_prob=0.7, prefix_min_ratio=0.3)
    exact = exact_sums(trainer, batch)
    real_draw = trainer_module.draw_masks

    def wrong_weights(*args, **kwargs):
        masks = real_draw(*args, **kwargs)
        masks.weights = masks.scored.float() / kwargs["position_keep_prob"]
        return masks

    monkeypatch.setattr(trainer_module, "draw_masks", wrong_weights)
    samples = torch.stack([log_ratio_sums(trainer, batch) for _ in range(DRAWS)])
    assert max_z(samples, exact) > Z_LIMIT  # the check that passes for the right weight fails here


def test_common_prefix_changes_no_margin(make):
    """Dropping the shared start of chosen and rejected is exact: D_w - D_l is unchanged, draw after draw."""
    trainer, batch = make(prune_common_prefix=True)
    exact = exact_sums(trainer, batch).chunk(2)
    for _ in range(3):
        chosen, rejected = log_ratio_sums(trainer, batch).chunk(2)
        torch.testing.assert_close(chosen - rejected, exact[0] - exact[1], rtol=1e-5, atol=1e-5)
    assert trainer.last_prune_stats["positions_scored"] < trainer.last_prune_stats["response_positions"]


def flat_gradient(trainer, batch):
    trainer.model.zero_grad(set_to_none=True)
    trainer.compute_loss(trainer.model, batch).backward()
    return torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])


def gradient_z(trainer, batch, draws):
    with unpruned(trainer):
        exact = flat_gradient(trainer, batch)
    samples = torch.stack([flat_gradient(trainer, batch) for _ in range(draws)])
    top = exact.abs().topk(300).indices  # the coordinates that carry the gradient
    return max_z(samples[:, top], exact[top])


PACKED = dict(share_prompt=True, padding_free=True)


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("sampling", ["paired", "independent"])
def test_branch_gradient_is_unbiased(make, sampling, layout):
    """Packed, a dropped branch runs under no_grad only what the kept one does not, reading the shared prompt's keys
    from the grad forward (packing.plan_split); its cells in the shared part read the grad forward's outputs."""
    trainer, batch = make(branch_keep_prob=0.5, branch_sampling=sampling, **(PACKED if layout == "packed" else {}))
    assert trainer.forward_choice.packed == (layout == "packed")
    assert gradient_z(trainer, batch, GRADIENT_DRAWS) < 5.0  # 300 coordinates


def test_negative_control_catches_a_missing_branch_scale(make, monkeypatch):
    trainer, batch = make(branch_keep_prob=0.5)
    monkeypatch.setattr(pruned_forward_module, "scale_branch_gradient", lambda values, scale: values)
    assert gradient_z(trainer, batch, GRADIENT_DRAWS) > 5.0  # the same check fails


def merged_gradient(trainer, batches):
    """The gradient of one merged pass (merged_step.py) over `batches`: each micro-batch planned (its own masks) and
    its TRL loss made as unmerged, all run in one grad and one frozen forward (pruned_forward.run_pass)."""
    trainer.model.zero_grad(set_to_none=True)
    records = trainer.merged_forward(trainer.model, batches)
    torch.stack([trainer._micro_step_loss(r, b) for r, b in zip(records, batches)]).sum().backward()
    return torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])


def test_merged_branch_gradient_is_unbiased(make):
    """Branch pruning in a merged pass: two micro-batches' grad rows in one forward, their frozen rows in one no-grad
    forward reading each micro-batch's kept prompt keys from it (packing.concat_groups); the mean gradient is the exact
    one's."""
    trainer, _ = make(branch_keep_prob=0.5, **PACKED)
    batches = [trainer._prepare_inputs(b) for b, _ in zip(trainer.get_train_dataloader(), range(2))]
    with unpruned(trainer):
        exact = merged_gradient(trainer, batches)
    samples = torch.stack([merged_gradient(trainer, batches) for _ in range(GRADIENT_DRAWS // 2)])
    assert trainer.last_micro_step.prunes_branches
    top = exact.abs().topk(300).indices
    assert max_z(samples[:, top], exact[top]) < 5.0  # 300 coordinates
