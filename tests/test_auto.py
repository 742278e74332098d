"""`auto` keep probabilities: per-pair probabilities stay unbiased, the choice follows the noise model, near-copies
keep both branches, the trainer logs what it chose, and the measurement is cheap."""

import math

import pytest
import torch
from datasets import Dataset

from trl_pruned_dpo import PrunedDPOConfig, PrunedDPOTrainer
from trl_pruned_dpo import auto
from trl_pruned_dpo.method.masks import draw_branches, draw_masks, draw_positions

from conftest import build_trainer, first_batch, preference_rows


def _batch(pairs=6, cols=14, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 60, (2 * pairs, cols), generator=g)
    completion = torch.zeros(2 * pairs, cols, dtype=torch.long)
    for row in range(2 * pairs):
        start = 3 + row % 2
        completion[row, start : cols - (row % 3)] = 1
    return ids, completion


def test_per_pair_probabilities_are_unbiased():
    """E[weight] = 1 on every response position and E[branch scale x weight] = 1 (the factor on each token's gradient),
    with a different keep probability for every pair, over many draws: every position's z-score is small."""
    ids, completion = _batch()
    p_branch = torch.tensor([0.3, 0.5, 0.6, 0.8, 1.0, 0.45], dtype=torch.float64)
    p_pos = torch.tensor([0.25, 0.5, 0.75, 1.0, 0.6, 0.9], dtype=torch.float64)
    response = completion[:, 1:].bool()
    draws = 2000
    for sampling in ("paired", "independent"):
        g = torch.Generator().manual_seed(1)
        values = {"weight": [], "grad": []}
        for _ in range(draws):
            m = draw_masks(ids, completion, position_keep_prob=p_pos, prefix_prune_prob=0.5, prefix_min_ratio=0.5,
                           branch_keep_prob=p_branch, branch_sampling=sampling, drop_common_prefix=False, generator=g)
            w = m.weights.double()
            values["weight"].append(w[response])
            values["grad"].append((w * m.branch_scale.double().unsqueeze(1))[response])
        for name, samples in values.items():
            x = torch.stack(samples)
            z = (x.mean(0) - 1) / (x.std(0).clamp(min=1e-12) / math.sqrt(draws))
            assert z.abs().max() < 4.5, (sampling, name, float(z.abs().max()))
            assert abs(float(z.mean())) < 4.5 / math.sqrt(z.numel()) * 2, (sampling, name)


def test_constant_tensor_draws_what_its_float_draws():
    ids, completion = _batch()
    pairs = ids.size(0) // 2
    for p in (0.3, 0.5, 0.75):
        a = draw_branches(pairs, p, "paired", torch.Generator().manual_seed(3))
        b = draw_branches(pairs, torch.full((pairs,), p), "paired", torch.Generator().manual_seed(3))
        assert torch.equal(a, b)
        response = completion[:, 1:]
        a = draw_positions(response, p, torch.Generator().manual_seed(4))
        b = draw_positions(response, torch.full((pairs,), p), torch.Generator().manual_seed(4))
        assert torch.equal(a, b)


def test_per_pair_probability_of_wrong_shape_is_an_error():
    with pytest.raises(ValueError, match="per-pair keep probability"):
        draw_branches(4, torch.full((3,), 0.5), "paired", torch.Generator())


def test_overlap_separates_near_copies_from_different_answers():
    ids, completion = _batch(pairs=3)
    pairs = 3
    ids[pairs:] = ids[:pairs]  # rejected = chosen ...
    ids[pairs, 8] += 1  # ... with one planted mistake in pair 0
    ids[pairs + 1] = torch.randint(60, 90, (ids.size(1),))  # pair 1: an unrelated answer
    ids[pairs + 1, :4] = ids[1, :4]  # same prompt
    completion[pairs:] = completion[:pairs]
    overlap = auto.pair_overlap(ids, completion)
    assert overlap[0] > 0.8 and overlap[2] == 1.0 and overlap[1] < 0.1
    probs = auto.per_pair_branch_probs(overlap, 0.5)
    assert probs.tolist() == [1.0, 0.5, 1.0]  # near-copies keep both branches


def test_choice_follows_the_noise_model():
    common = dict(r_branch=2.0, r_position=1.0, near_copy_fraction=0.0, head=0.2, branch_auto=True,
                  position_auto=True, branch_half_cost=0.75)
    # Far above the noise scale, extra noise is nearly free: prune.
    big = auto.choose(b_simple=4.0, batch=256, **common)
    assert big.branch_keep_prob < 1 and big.time_ratio < 0.9 and big.reason.startswith("prune")
    # Below it, extra noise costs steps in proportion: keep everything.
    small = auto.choose(b_simple=400.0, batch=8, **common)
    assert (small.branch_keep_prob, small.position_keep_prob, small.time_ratio) == (1.0, 1.0, 1.0)
    assert small.reason.startswith("keep everything")
    # No usable measurement: keep everything.
    unknown = auto.choose(b_simple=math.inf, batch=256, **common)
    assert (unknown.branch_keep_prob, unknown.position_keep_prob) == (1.0, 1.0)
    # A branch draw that saves no work (every pair a near-copy, or nothing to freeze) is never worth its noise.
    near = auto.choose(b_simple=4.0, batch=256, **{**common, "branch_half_cost": 1.0, "r_position": 50.0})
    assert near.branch_keep_prob == 1.0
    # The expected time of the choice is the model's (A1) ratio.
    expected = auto.relative_step_cost(big.branch_keep_prob, 0.75, big.position_keep_prob, 0.2) * auto.steps_factor(
        4.0, auto.extra_noise(2.0, big.branch_keep_prob) + auto.extra_noise(1.0, big.position_keep_prob), 256
    ) / auto.steps_factor(4.0, 0.0, 256)
    assert big.time_ratio == pytest.approx(expected)


def test_choice_keeps_quality_at_equal_steps():
    """Where the cheapest setting by time would cost more than MAX_STEP_INFLATION extra steps, a gentler one (or none)
    is chosen: B = 32 against B_simple = 8 and r = 1.3 (the dissimilar pairs of docs/quality.md) would prune at 0.5
    for a 0.92 time ratio but 23% more steps."""
    args = dict(r_branch=1.3, r_position=0.0, near_copy_fraction=0.0, head=0.0, branch_auto=True,
                position_auto=False, branch_half_cost=0.75)
    choice = auto.choose(b_simple=8.0, batch=32, **args)
    r = auto.extra_noise(1.3, choice.branch_keep_prob)
    assert auto.steps_factor(8.0, r, 32) / auto.steps_factor(8.0, 0.0, 32) <= 1 + auto.MAX_STEP_INFLATION
    assert choice.branch_keep_prob > 0.5
    # The user's fixed families' noise counts too: with it, nothing more is pruned.
    loaded = auto.choose(b_simple=8.0, batch=32, r_fixed=0.6, **args)
    assert loaded.branch_keep_prob >= choice.branch_keep_prob


def test_extra_steps_bound_covers_the_truth():
    """(A2) from k groups: the point estimate is unbiased enough to centre on the truth, and the UPPER_Z jackknife
    bound lies above it in about the nominal share of measurements (Gaussian groups with known G, Σ and extra)."""
    gen = torch.Generator().manual_seed(0)
    dim, k, n, batch, sigma, tau = 64, auto.GROUPS, 4, 64, 1.0, 1.5
    grad = torch.randn(dim, generator=gen, dtype=torch.float64) * 0.3
    truth = dim * tau ** 2 / (batch * float(grad @ grad) + dim * sigma ** 2)
    points, covered, trials = [], 0, 300
    for _ in range(trials):
        exact = [grad + torch.randn(dim, generator=gen, dtype=torch.float64) * sigma / math.sqrt(n) for _ in range(k)]
        extra = [n * float((torch.randn(dim, generator=gen, dtype=torch.float64) * tau / math.sqrt(n)).pow(2).sum())
                 for _ in range(k)]
        point, upper = auto.extra_steps_bound(auto.gram_matrix(exact), extra, n, batch)
        assert upper >= point
        points.append(point)
        covered += upper >= truth
    assert abs(sum(points) / trials / truth - 1) < 0.05
    nominal = 1 - 0.5 * math.erfc(auto.UPPER_Z / math.sqrt(2))
    assert nominal - 0.07 <= covered / trials <= nominal + 0.07


def test_extra_steps_bound_agrees_with_the_noise_model():
    """Its point estimate is B_simple r / (B + B_simple), the extra steps of (A1), from the same estimators."""
    gen = torch.Generator().manual_seed(1)
    exact = [torch.randn(32, generator=gen, dtype=torch.float64) + 1.0 for _ in range(auto.GROUPS)]
    extra = [3.0 + i for i in range(auto.GROUPS)]
    n, batch = 4, 32
    noise = auto.NoiseEstimates(small=n, big=n * auto.GROUPS)
    noise.update("small2", sum(float(g.pow(2).sum()) for g in exact) / auto.GROUPS)
    noise.update("big2", float((sum(exact) / auto.GROUPS).pow(2).sum()))
    noise.update("branch", sum(extra) / auto.GROUPS)
    b, r = noise.b_simple(), noise.ratio("branch")
    point, _ = auto.extra_steps_bound(auto.gram_matrix(exact), extra, n, batch)
    assert point == pytest.approx(b * r / (batch + b), rel=1e-9)
    assert auto.steps_factor(b, r, batch) / auto.steps_factor(b, 0.0, batch) == pytest.approx(1 + point, rel=1e-9)


def test_extra_steps_bound_is_infinite_when_the_groups_cannot_resolve_the_gradient():
    exact = [torch.tensor([1.0, 0.0]) * (-1) ** i for i in range(auto.GROUPS)]  # mean 0: no signal at all
    point, upper = auto.extra_steps_bound(auto.gram_matrix(exact), [1.0] * auto.GROUPS, 1, 8)
    assert upper == math.inf


def test_config_accepts_auto(tmp_path):
    args = PrunedDPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, bf16=False,
                           branch_keep_prob="auto", position_keep_prob="0.5")
    assert args.branch_keep_prob == "auto" and args.position_keep_prob == 0.5 and args.pruning_enabled
    with pytest.raises(TypeError, match="branch_keep_prob.*or 'auto'"):
        PrunedDPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, bf16=False, branch_keep_prob="fast")
    from trl import TrlParser

    config = tmp_path / "c.yaml"
    config.write_text(f"output_dir: {tmp_path}\nbranch_keep_prob: auto\nposition_keep_prob: 0.75\nreport_to: none\n"
                      "use_cpu: true\nbf16: false\n")
    parsed = TrlParser((PrunedDPOConfig,)).parse_args_and_config(["--config", str(config)])[0]
    assert (parsed.branch_keep_prob, parsed.position_keep_prob) == ("auto", 0.75)
    parsed = TrlParser((PrunedDPOConfig,)).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--position_keep_prob", "auto", "--report_to", "none", "--use_cpu",
         "--bf16", "false"])[0]
    assert parsed.position_keep_prob == "auto"


@pytest.fixture()
def mixed_dataset():
    rows = preference_rows(16)
    far = [{**r, "rejected": r["rejected"][::-1] + "xyz"} for r in rows[:8]]  # different answers
    return Dataset.from_list(rows[8:] + far)


def test_trainer_logs_its_choice_and_measures_cheaply(tokenizer, mixed_dataset, tmp_path):
    trainer = build_trainer(PrunedDPOTrainer, PrunedDPOConfig, tokenizer, mixed_dataset, tmp_path,
                            per_device_train_batch_size=16, max_steps=2, branch_keep_prob="auto",
                            position_keep_prob="auto", use_cpu=True)
    rows = []
    hook = trainer.model.register_forward_hook(lambda m, a, k, out: rows.append(k["input_ids"].size(0)),
                                               with_kwargs=True)
    trainer.train()
    hook.remove()
    history = trainer._auto_probs.history
    assert len(history) == 1 and history[0]["step"] == 0  # measured once, at step 0
    logged = [h for h in trainer.state.log_history if "prune/branch_keep_prob" in h]
    assert len(logged) == 2
    assert all(0 < h["prune/branch_keep_prob"] <= 1 and 0 < h["prune/position_keep_prob"] <= 1 for h in logged)
    assert "B_simple" in trainer._auto_probs.choice.reason
    # Measurement work: policy rows it ran, over MEASURE_EVERY steps of 32 policy rows (+ the one-row empty groups).
    step_rows = 2 * 16
    measured = sum(rows) - 2 * step_rows - 2  # 2 training steps (each may add one empty-group row)
    m = min(auto.MEASURE_PAIRS, 16)
    # exact groups, one branch draw and one position draw, each over m pairs in GROUPS passes (+ one empty-group row each)
    assert 0 < measured <= 3 * 2 * m + 3 * 2 * auto.GROUPS
    assert measured / (auto.MEASURE_EVERY * step_rows) <= 0.03
    # Metrics of the measurement passes were dropped: one training loss per logged step.
    assert [h["step"] for h in trainer.state.log_history if "loss" in h] == [1, 2]


def test_measurement_counts_the_work_saved_and_the_users_fixed_pruning(tokenizer, mixed_dataset, tmp_path):
    """The branch draw's work is measured through the forward the run uses, and a fixed prefix pruning the user chose
    adds its own noise to every choice. Unshared, freezing half the far pairs' rows saves backward work; with each
    prompt executed once, these short responses leave little to save (the frozen branch needs its own pass), and then
    branch pruning is not chosen."""
    records = {}
    for share_prompt in (False, True):
        trainer = build_trainer(PrunedDPOTrainer, PrunedDPOConfig, tokenizer, mixed_dataset,
                                tmp_path / str(share_prompt), per_device_train_batch_size=16, max_steps=1,
                                branch_keep_prob="auto", prefix_prune_prob=0.5, share_prompt=share_prompt,
                                use_cpu=True)
        trainer.train()
        records[share_prompt] = record = trainer._auto_probs.history[0]
        assert record["r_fixed"] > 0 and math.isfinite(record["r_fixed"])
        assert record["reason"].startswith(("prune", "keep everything"))
    assert 0.5 < records[False]["branch_half_cost"] < records[True]["branch_half_cost"] < 1.0
    assert records[True]["branch_keep_prob"] == 1.0


@pytest.mark.parametrize("head", [0.0, 0.5])
def test_families_that_cannot_pay_are_not_measured(tokenizer, tmp_path, head):
    """All near-copies: no branch draw (nothing would be frozen). An LM head too small a share of the work for
    position pruning to save MIN_GAIN: no position draw, and position stays at 1."""
    trainer = build_trainer(PrunedDPOTrainer, PrunedDPOConfig, tokenizer, Dataset.from_list(preference_rows(16)),
                            tmp_path, per_device_train_batch_size=16, max_steps=1, branch_keep_prob="auto",
                            position_keep_prob="auto", use_cpu=True)
    trainer._auto_probs.head = head
    rows = []
    hook = trainer.model.register_forward_hook(lambda m, a, k, out: rows.append(k["input_ids"].size(0)),
                                               with_kwargs=True)
    trainer.train()
    hook.remove()
    record = trainer._auto_probs.history[0]
    assert record["near_copy_fraction"] == 1.0 and record["r_branch"] == 0.0 and record["branch_half_cost"] == 1.0
    draws = (sum(rows) - 2 * 16) // (2 * 16)  # passes over the 16 measured pairs beyond the exact groups and the step
    if head == 0.0:
        assert "not measured" in record["reason"] and record["position_keep_prob"] == 1.0 and record["r_position"] == 0
        assert draws == 1  # the exact groups only
    else:
        assert record["r_position"] > 0 and draws == 2  # the exact groups and one position draw


def test_measurement_does_not_move_the_draws(tokenizer, mixed_dataset, tmp_path):
    """With the choice fixed, the step's masks are the same whether or not a measurement ran first."""
    trainer = build_trainer(PrunedDPOTrainer, PrunedDPOConfig, tokenizer, mixed_dataset, tmp_path,
                            per_device_train_batch_size=16, branch_keep_prob="auto", use_cpu=True)
    batch = first_batch(trainer, 16)
    probs = trainer._auto_probs
    trainer.state.global_step = 0
    trainer._draw_masks(batch)  # measures at step 0 and chooses
    probs._measured_step = 0
    trainer._mask_step = (-1, 0)
    again = trainer._draw_masks(batch)  # no measurement this time
    probs._measured_step = -1
    trainer._mask_step = (-1, 0)
    trainer.state.global_step = 0
    measured = trainer._draw_masks(batch)
    assert torch.equal(again.backprop, measured.backprop) and torch.equal(again.weights, measured.weights)


def test_measurement_halves_carry_their_own_host_layout(tokenizer, mixed_dataset, tmp_path):
    """auto's half-batch measurements run through the plan, which reads the collator's host copy: it must describe the
    same rows as the device tensors (else the packed layout would index the full batch)."""
    from trl_pruned_dpo.method.plan import HostBatch
    from trl_pruned_dpo.reference import HOST_KEY

    trainer = build_trainer(PrunedDPOTrainer, PrunedDPOConfig, tokenizer, mixed_dataset, tmp_path,
                            per_device_train_batch_size=16, max_steps=2, branch_keep_prob="auto", share_prompt=True,
                            use_cpu=True)
    batch = next(iter(trainer.get_train_dataloader()))
    assert isinstance(batch[HOST_KEY], HostBatch)
    from trl_pruned_dpo.reference import select_pairs

    half = select_pairs(batch, torch.tensor([3, 5]), 16)
    for name in ("input_ids", "attention_mask", "completion_mask"):
        assert torch.equal(getattr(half[HOST_KEY], name), half[name].cpu())
    trainer.train()  # measures at step 0 on the shared-prompt forward, then trains
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
