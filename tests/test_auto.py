"""`auto` keep probabilities: per-pair probabilities stay unbiased, the choice follows the noise model, near-copies
keep both branches, the trainer logs what it chose, and the measurement is cheap."""

import math
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset

from trl_pruned_dpo import PrunedDPOConfig, PrunedDPOTrainer
from trl_pruned_dpo import auto
from trl_pruned_dpo.method import noise
from trl_pruned_dpo.method.masks import draw_branches, draw_masks, draw_positions

from conftest import build_trainer, preference_rows, tiny_model
from tiny import with_cpu_loss_scaler


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
    # A left-padding collator: chosen rows shifted right by 3 columns of padding, rejected by 1: the same overlap.
    shifts = [3] * pairs + [1] * pairs
    padded = torch.stack([torch.cat([row.new_zeros(k), row, row.new_zeros(3 - k)]) for row, k in zip(ids, shifts)])
    mask = torch.stack([torch.cat([row.new_zeros(k), row, row.new_zeros(3 - k)]) for row, k in zip(completion, shifts)])
    real = torch.stack([torch.cat([torch.zeros(k), torch.ones(ids.size(1)), torch.zeros(3 - k)]) for k in shifts])
    assert torch.equal(auto.pair_overlap(padded, mask, real.long()), overlap)
    assert auto.pair_overlap(padded, mask)[0] < 0.5  # column by column, the near-copy would be pruned


def test_choice_follows_the_noise_model():
    common = dict(r_branch=2.0, r_position=1.0, head=0.2, branch_auto=True, position_auto=True, branch_half_cost=0.75)
    # Far above the noise scale, extra noise is nearly free: prune.
    big = auto.choose(b_simple=4.0, batch=256, **common)
    assert big[0] < 1 and big[2] < 0.9 and big[3].startswith("prune")
    # Below it, extra noise costs steps in proportion: keep everything.
    small = auto.choose(b_simple=400.0, batch=8, **common)
    assert small[:3] == (1.0, 1.0, 1.0) and small[3].startswith("keep everything")
    assert auto.choose(b_simple=math.inf, batch=256, **common)[:2] == (1.0, 1.0)  # not resolved yet
    # A branch draw that saves no work is never worth its noise.
    assert auto.choose(b_simple=4.0, batch=256, **{**common, "branch_half_cost": 1.0, "r_position": 50.0})[0] == 1.0
    expected = auto.relative_step_cost(big[0], 0.75, big[1], 0.2) * auto.steps_factor(
        4.0, auto.extra_noise(2.0, big[0]) + auto.extra_noise(1.0, big[1]), 256) / auto.steps_factor(4.0, 0.0, 256)
    assert big[2] == pytest.approx(expected)


def test_choice_keeps_quality_at_equal_steps():
    """B = 32 against B_simple = 8 and r = 1.3 would prune at 0.5 for a 0.92 time ratio but 23% more steps."""
    choice = auto.choose(b_simple=8.0, batch=32, r_branch=1.3, r_position=0.0, head=0.0, branch_auto=True,
                         position_auto=False)
    r = auto.extra_noise(1.3, choice[0])
    assert auto.steps_factor(8.0, r, 32) / auto.steps_factor(8.0, 0.0, 32) <= 1 + auto.MAX_STEP_INFLATION
    assert choice[0] > 0.5


def test_two_batch_sizes_recover_the_noise_scale_and_r():
    """McCandlish App. A.1 against a naive reference: Gaussian per-pair gradients with known G and Σ; the running
    sums of the per-step estimates (|G_small|² of b pairs, |G_big|² of 4b) find tr Σ, |G|² and, on a noisier
    "pruned" estimator, r; the UPPER_Z bounds lie above the point estimates."""
    gen = torch.Generator().manual_seed(0)
    dim, b, sigma, extra = 256, 4, 1.0, 0.7
    grad = torch.randn(dim, generator=gen, dtype=torch.float64) * 0.1
    truth_b = dim * sigma ** 2 / float(grad @ grad)
    stats = auto.Running()
    for step in range(600):
        for kind, s in (("exact", sigma), ("branch", sigma * math.sqrt(1 + extra))):
            micro = [grad + torch.randn(dim, generator=gen, dtype=torch.float64) * s / math.sqrt(b) for _ in range(4)]
            small2 = sum(float(m @ m) for m in micro) / 4
            big = sum(micro) / 4
            trace, norm2 = auto.trace_and_norm2(small2, float(big @ big), b, 4 * b)
            stats.add(f"trace_{kind}", trace)
            if kind == "exact":
                stats.add("norm2", norm2)
    assert stats.mean("trace_exact") / stats.mean("norm2") == pytest.approx(truth_b, rel=0.35)
    assert stats.mean("trace_branch") / stats.mean("trace_exact") - 1 == pytest.approx(extra, abs=0.25)
    assert stats.mean("trace_exact", auto.UPPER_Z) > stats.mean("trace_exact") > stats.mean("trace_exact", -1)


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


def _train(tokenizer, dataset, tmp_path, record=None, **overrides):
    """An auto run; `record` collects (step, micro, backprop) of every draw."""
    config = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=12, branch_keep_prob="auto",
                  use_cpu=True, learning_rate=1e-4, logging_steps=1)
    trainer = build_trainer(PrunedDPOTrainer, PrunedDPOConfig, tokenizer, dataset, tmp_path, **{**config, **overrides})
    if record is not None:
        forward = trainer.concatenated_forward

        def recording(model, inputs):
            done = forward(model, inputs)
            record.append((*done.step, done.masks.backprop.int().tolist(), done.masks.weights.sum().item()))
            return done

        trainer.concatenated_forward = recording
    return trainer


@pytest.fixture()
def far_dataset():
    rows = preference_rows(64)
    return Dataset.from_list([{**r, "rejected": r["rejected"][::-1] + "xyz"} for r in rows])


@pytest.mark.parametrize("case", [
    dict(),  # gradient accumulation: micro-batch vs accumulated gradient
    dict(per_device_train_batch_size=1, gradient_accumulation_steps=4),  # micro-batch of one pair
    dict(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": True}),
    dict(per_device_train_batch_size=8, gradient_accumulation_steps=1, max_steps=14),  # one process: B / 2B
    dict(max_grad_norm=0.0),  # no clipping: transformers still asks the engine for the norm (at max_norm inf)
], ids=["accumulation", "micro-batch-1", "reentrant-checkpointing", "single", "no-clipping"])
def test_auto_measures_from_the_norms_training_computes(tokenizer, far_dataset, tmp_path, case):
    """The first decision comes within 10 steps (12 on the B / 2B path, whose first pair has no link, Eq. A4), from
    finite estimates; the draws of exact steps keep every branch
    and those of probe steps halve the far pairs; num_tokens and the stock metrics are those of a run without auto."""
    draws = []
    trainer = _train(tokenizer, far_dataset, tmp_path / "auto", record=draws, **case)
    trainer.train()
    probs = trainer.auto_keep_probs
    assert probs.history and probs.history[0]["step"] <= (12 if probs.single else 10), probs.history
    assert math.isfinite(probs.history[0]["b_simple"]) and probs.history[0]["b_simple"] > 0
    assert probs.stats.count("ratio_branch") >= 1.9 and probs.stats.count("trace_exact") >= 1.9
    kinds = {probs.kind(step) for step, *_ in draws}
    assert {"exact", "branch"} <= kinds
    exact = _train(tokenizer, far_dataset, tmp_path / "exact", **{**case, "branch_keep_prob": 1.0})  # TRL's path
    exact.train()
    for a, b in zip(trainer.state.log_history, exact.state.log_history):
        if "loss" in a:
            assert a["num_tokens"] == b["num_tokens"]
            assert {k for k in b if not k.startswith("prune/")} <= set(a)
    if probs.single:  # the B / 2B path holds one gradient-sized buffer, the engine path none
        assert probs._buffer is None  # released at the end of training
    assert all(not torch.is_tensor(v) or v.numel() <= 4 for v in vars(probs).values())


@pytest.mark.parametrize("case", [
    dict(),  # accumulation: the hooks' norms
    dict(per_device_train_batch_size=8, gradient_accumulation_steps=1, max_steps=14),  # B / 2B: the buffer's
], ids=["accumulation", "single"])
def test_auto_measures_a_float64_model(tokenizer, far_dataset, tmp_path, case):
    """Norms in float32 or wider: a float64 model's gradients are measured in float64 (a float32 norm of them was an
    error), and its first decision comes from finite estimates."""
    model = tiny_model(tokenizer).double()
    trainer = _train(tokenizer, far_dataset, tmp_path, model=model, **case)
    trainer.train()
    probs = trainer.auto_keep_probs
    assert probs.history and math.isfinite(probs.history[0]["b_simple"])


def test_an_epochs_last_step_of_one_micro_batch_measures_nothing(tokenizer, tmp_path):
    """Accumulation 2 over 5 micro-batches an epoch: every third step has one micro-batch (its epoch's last), which
    has no smaller batch to compare with its accumulated gradient (Eq. A1: b = B). It adds no sample of tr Σ, and
    training goes on (it divided by zero before)."""
    dataset = Dataset.from_list([{**r, "rejected": r["rejected"][::-1] + "xyz"} for r in preference_rows(10)])
    trainer = _train(tokenizer, dataset, tmp_path, per_device_train_batch_size=2, max_steps=9)
    sent, sampled, flush = _recording_folds(trainer.auto_keep_probs)
    trainer.train()
    flush()
    short = {step for step, values in sent.items() if values[1] == 2}  # the steps of one micro-batch of 2 pairs
    assert short == {2, 5, 8} and not short & sampled
    assert sampled, "the other steps measure"


@pytest.mark.parametrize("case", [
    dict(save_steps=6),  # accumulation: the engine's norms
    dict(save_steps=5, per_device_train_batch_size=8, gradient_accumulation_steps=1),  # B / 2B, between a pair's steps
], ids=["accumulation", "single-odd-step"])
def test_resume_reproduces_the_masks(tokenizer, far_dataset, tmp_path, case):
    """A run resumed from a mid-run checkpoint draws the masks of the uninterrupted run: auto's statistics, loss
    curve and choice are in the checkpoint."""
    full, resumed = [], []
    save = dict(save_strategy="steps", max_steps=12, **case)
    trainer = _train(tokenizer, far_dataset, tmp_path / "full", record=full, **save)
    trainer.train()
    again = _train(tokenizer, far_dataset, tmp_path / "full", record=resumed, **save)
    again.train(resume_from_checkpoint=str(tmp_path / "full" / f"checkpoint-{case['save_steps']}"))
    later = [d for d in full if d[0] >= case["save_steps"]]
    assert [d[:2] for d in resumed] == [d[:2] for d in later]
    for a, b in zip(resumed, later):
        assert a[2] == b[2] and a[3] == pytest.approx(b[3]), a[:2]
    assert again.auto_keep_probs.choice == trainer.auto_keep_probs.choice
    sums = again.auto_keep_probs.stats.sums
    assert sums.keys() == trainer.auto_keep_probs.stats.sums.keys()
    assert all(sums[k] == pytest.approx(v) for k, v in trainer.auto_keep_probs.stats.sums.items())


def test_one_process_reads_the_unclipped_gradients(tokenizer, far_dataset, tmp_path):
    """The B / 2B path reads `.grad` once a step, fused, instead of per-parameter hooks: what it sends is |g_t|² and
    |g_t - g_(t-1)|² (a pair's second step) or the link |g_t - g_(t-2)|² (a first step) of the raw gradients, before
    clipping. Clipping hard here (max_grad_norm 1e-4) makes a read after the clip differ by orders of magnitude."""
    trainer = _train(tokenizer, far_dataset, tmp_path, per_device_train_batch_size=8, gradient_accumulation_steps=1,
                     max_steps=8, max_grad_norm=1e-4)
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    raw, probs = {}, trainer.auto_keep_probs
    def keep(i, grad):  # a parameter's gradient may arrive in pieces: summed, as `.grad` sums them
        parts = raw.setdefault(trainer.state.global_step, {})
        parts[i] = grad.flatten().double() + parts.get(i, 0.0)

    for i, p in enumerate(params):  # the raw gradient of each step, in parameter order
        p.register_hook(lambda g, i=i: keep(i, g))
    sent, _, flush = _recording_folds(probs)
    trainer.train()
    flush()
    grads = {step: torch.cat([parts[i] for i in range(len(params))]) for step, parts in raw.items()}
    checked = 0
    for step, (small2, _, _, diff2, _) in sent.items():
        assert small2 == pytest.approx(float(grads[step] @ grads[step]), rel=1e-4), step
        other = step - 1 if step % 2 else step - 2
        if probs.kind(step) != "choice" and probs.kind(other) == probs.kind(step) and other >= 0:
            delta = grads[step] - grads[other]
            assert diff2 == pytest.approx(float(delta @ delta), rel=1e-3), step
            checked += 1
    assert checked >= 5 and min(v[0] for v in sent.values()) > 1e4 * 1e-4 ** 2  # every step clipped, hard


def _recording_folds(probs):
    """Wrap `probs._fold` to keep, by step, what each step sent to the estimate (`end_step`'s five reduced scalars),
    and the steps that added a sample of tr Σ. Returns (sent, sampled, flush): flush folds the last step's after
    training."""
    sent, sampled, fold = {}, set(), probs._fold

    def recording():
        step = probs._pending[0] if probs._pending is not None else None
        if step is not None:
            sent[step] = probs._pending[1].tolist()
        before = probs.stats.sums.get("trace_exact")
        fold()
        if probs.stats.sums.get("trace_exact") != before:
            sampled.add(step)

    probs._fold = recording
    return sent, sampled, recording


def _peak_bytes(trainer) -> int:
    """Peak of CPU tensor memory during `trainer.train()`, from the profiler's allocation and free events in order."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        trainer.train()
    current = peak = 0
    for event in sorted((e for e in prof.events() if e.self_cpu_memory_usage), key=lambda e: e.time_range.start):
        current += event.self_cpu_memory_usage
        peak = max(peak, current)
    return peak


@pytest.mark.parametrize("accumulation", [2, 1], ids=["engine-norms", "B-2B-buffer"])
def test_extra_memory_is_at_most_one_gradient(tokenizer, far_dataset, tmp_path, accumulation, monkeypatch):
    """Peak CPU tensor memory of an auto run against the same run with its measurement switched off (no hooks, no
    statistics: the same draws, the same kinds of steps while auto keeps everything): no more than a few scalars with the engine's norms, at most one
    gradient-sized buffer on the B / 2B path."""
    common = dict(per_device_train_batch_size=8 // accumulation, gradient_accumulation_steps=accumulation,
                  max_steps=6, logging_steps=100)
    # the first profiled run of a process holds one-time allocations (~200 KB here): profile a throwaway run first
    _peak_bytes(_train(tokenizer, far_dataset, tmp_path / "warm-up", **{**common, "max_steps": 2}))
    peaks = {}
    for name in ("auto", "unmeasured"):
        if name == "unmeasured":
            monkeypatch.setattr(auto.AutoKeepProbs, "_hook", lambda self, params: None)  # the engine path's hooks
            monkeypatch.setattr(auto.AutoKeepProbs, "_read_pair", lambda self, step, scale: None)  # the B / 2B buffer
            monkeypatch.setattr(auto.AutoKeepProbs, "_fold", lambda self: None)  # no statistics: it never decides
        trainer = _train(tokenizer, far_dataset, tmp_path / name, **common)
        peaks[name] = _peak_bytes(trainer)
    gradient = sum(p.numel() * p.element_size() for p in trainer.model.parameters() if p.requires_grad)
    extra = peaks["auto"] - peaks["unmeasured"]
    print(f"peak {peaks}, extra {extra} bytes, one gradient {gradient} bytes")
    assert extra <= (gradient if accumulation == 1 else 0) + 1024, (extra, gradient)  # measured: 52 B; 1 gradient + 4 B


@pytest.mark.parametrize("case, per_block, first", [
    (dict(per_device_train_batch_size=8, gradient_accumulation_steps=1, max_steps=22), 2, 2),  # B / 2B: 2 steps a block
    (dict(max_steps=10), 1, 1),  # accumulation: micro-batch vs accumulated gradient, 1 step a block
], ids=["single", "accumulation"])
def test_first_decision_comes_early(tokenizer, far_dataset, tmp_path, monkeypatch, case, per_block, first):
    """Both families auto: `first` exact blocks (B / 2B: two, as its first pair has no link), then each family's
    probe between two exact blocks, twice; the branch is decided as soon as it is resolved (4 blocks later), the
    position family four blocks after it, and p stays 1 for an unresolved one."""
    monkeypatch.setattr(auto, "head_share", lambda config: 0.3)  # position pruning can save MIN_GAIN
    trainer = _train(tokenizer, far_dataset, tmp_path, position_keep_prob="auto", **case)
    trainer.train()
    probs = trainer.auto_keep_probs
    assert probs.families == ["branch", "position"]
    assert [probs.kind(block * per_block) for block in range(first + 8)] == ["exact"] * first + [
        "branch", "exact", "branch", "exact", "position", "exact", "position", "exact"]
    decided = (first + 4) * per_block, ["branch"]
    assert (probs.history[0]["step"], probs.history[0]["decided"]) == decided, probs.history
    assert probs.history[0]["position_keep_prob"] == 1.0
    both = next(h for h in probs.history if h["decided"] == ["branch", "position"])
    assert both["step"] == (first + 8) * per_block, probs.history  # single: 12 and 20; accumulation: 5 and 9


def _bare(families, single=False, batch=8):
    """An AutoKeepProbs without a trainer: the schedule and the decision from given running sums."""
    probs = object.__new__(auto.AutoKeepProbs)
    probs.families, probs.single, probs.batch, probs.head = families, single, batch, 0.0
    probs.max_steps, probs.floor = 1000, 0.0
    probs.load_state_dict(None)
    return probs


def test_a_family_no_keep_prob_pays_for_is_probed_rarely():
    """Far below the noise scale even the optimistic bounds keep every branch: after the warm-up its probes come
    RARELY times less often (every 64 blocks instead of 16), and at full rate again once pruning might pay."""
    gen = torch.Generator().manual_seed(0)
    for batch, futile in ((8, True), (4096, False)):
        probs = _bare(["branch"], batch=batch)
        for _ in range(40):
            noise = lambda: float(torch.randn((), generator=gen)) * 5  # noqa: E731
            trace, norm2 = 100 + noise(), 1 + noise() / 100
            for name, value in (("trace", trace), ("norm2", norm2), ("cross", trace * norm2)):
                probs.stats.add(f"{name}_exact", value)
            probs.stats.add("ratio_branch", math.log((300 + noise()) / trace))  # r = 2
            probs.stats.add("work_exact", 1.0)
            probs.stats.add("work_branch", 0.75)
        probs._decide(100)
        assert (probs.futile == ["branch"]) is futile, probs.history
        assert (probs.choice[0] < 1.0) is not futile  # B_simple ≈ 100 against 4096 pairs per step: prune
        probes = [b for b in range(4, 260) if probs.kind(b) == "branch"]
        assert probes == ([65, 129, 193, 257] if futile else list(range(17, 260, 16)))
        assert probs.state_dict()["futile"] == probs.futile  # saved: a resume probes on the same steps


def test_ratio_bound_cancels_a_shared_scale():
    """Gradient norms that shrink 100-fold as training goes on, tr Σ and |G|² alike (B_simple = 3 throughout, 20%
    noise on each): the ratio estimator's bounds stay near 3; bounds on the two means apart are much looser."""
    stats, gen = auto.Running(), torch.Generator().manual_seed(0)
    for i in range(30):
        scale = 100 * 0.85 ** i
        trace, norm2 = (scale * (1 + 0.2 * float(torch.randn((), generator=gen))) for _ in range(2))
        for name, value in (("trace", 3 * trace), ("norm2", norm2), ("cross", 3 * trace * norm2)):
            stats.add(f"{name}_exact", value)
    ratio = [stats.ratio("trace_exact", "norm2_exact", "cross_exact", z) for z in (-auto.UPPER_Z, 0, auto.UPPER_Z)]
    assert 2.0 < ratio[0] < ratio[1] < ratio[2] < 4.5, ratio
    apart = stats.mean("trace_exact", auto.UPPER_Z) / stats.mean("norm2_exact", -auto.UPPER_Z)
    assert apart > 1.5 * ratio[2], (apart, ratio)  # measured: 5.9 against 3.2


def test_probe_units_cancel_the_drift():
    """Gradient norms that fall 30% per step while a branch probe adds 80% to tr Σ: each probe's tr Σ is read
    against the exact blocks' on both sides of it, so r comes out near 0.8; against the exact block before it
    alone, it comes out low (measured: 0.57)."""
    probs, gen = _bare(["branch"]), torch.Generator().manual_seed(0)
    micro, b, trace, norm2 = 4, 8, 40.0, 1.0
    for step in range(120):
        scale, extra = 0.7 ** min(step, 40), 0.8 if probs.kind(step) == "branch" else 0.0
        noisy = lambda x: x * (1 + 0.05 * float(torch.randn((), generator=gen)))  # noqa: E731
        small2, big2 = (scale * (norm2 + trace * (1 + extra) / size) for size in (b, micro * b))
        work = 0.75 if extra else 1.0  # a branch draw saves work (else the family is idle: never probed again)
        totals = torch.tensor([micro * noisy(small2), micro * b, work, 0.0, 0.5], dtype=torch.float64)
        probs._pending = (step, totals, micro, torch.tensor(noisy(big2)).sqrt())
        probs._fold()
    (_, r), point = probs._bounds(auto.UPPER_Z, ["branch"]), probs._bounds(0.0, ["branch"])[1]["branch"]
    assert 0.6 < point < 1.0 and point <= r["branch"] < 1.4, (point, r)
    assert probs.stats.count("ratio_branch") >= 8


@pytest.mark.parametrize("drift", [True, False], ids=["drift-subtracted", "drift-ignored"])
def test_one_process_pairs_subtract_the_mean_gradients_drift(monkeypatch, drift):
    """The B / 2B path (one process, no accumulation) reads tr Σ from two consecutive steps, at different parameters:
    b |g_t - g_(t+1)|² / 2 = tr Σ + b |d|² / 2 for a mean gradient moving by d per step. Here that drift is 10 times
    the noise term and a branch probe adds 80% to tr Σ. With the drift read from consecutive pairs (Eq. A4) r comes
    out near 0.8 (each probe ±0.3: the drift estimate is noisy where it dominates) and B_simple near its truth;
    ignoring it (the estimator before), r reads near 0 and B_simple far above its truth."""
    if not drift:
        monkeypatch.setattr(noise, "pair_drift", lambda *_: 0.0)
    probs, gen = _bare(["branch"], single=True, batch=32), torch.Generator().manual_seed(0)
    dim, b, trace, extra = 4096, 32, 32.0, 0.8  # tr Σ per pair; |d|² = 10 (2 tr Σ / b)
    start, step_drift = torch.randn(dim, generator=gen, dtype=torch.float64), torch.randn(dim, generator=gen,
                                                                                        dtype=torch.float64)
    start, step_drift = 30 * start, step_drift * math.sqrt(10 * 2 * trace / b / float(step_drift @ step_drift))
    grads = {}
    for step in range(120):
        variance = trace * (1 + extra if probs.kind(step) == "branch" else 1) / b / dim
        grads[step] = start + step * step_drift + torch.randn(dim, generator=gen, dtype=torch.float64) * variance ** 0.5
        near = grads.get(step - 1 if step % 2 else step - 2)  # odd: the pair's first step; even: the previous pair's
        diff = 0.0 if near is None else float((grads[step] - near) @ (grads[step] - near))
        work = 0.75 if probs.kind(step) == "branch" else 1.0  # a branch draw saves work: the family is not idle
        totals = torch.tensor([float(grads[step] @ grads[step]), b, work, diff, 0.5], dtype=torch.float64)
        probs._pending = (step, totals, 1, None)
        probs._fold()
    r = probs._bounds(0.0, ["branch"])[1]["branch"]
    b_simple = probs.stats.ratio("trace_exact", "norm2_exact", "cross_exact")
    truth = trace / float(grads[60] @ grads[60])
    assert probs.stats.count("ratio_branch") >= 4
    if drift:
        assert 0.5 < r < 1.2 and 0.7 * truth < b_simple < 1.3 * truth, (r, b_simple, truth)  # measured: 1.03
    else:
        assert r < 0.2 and b_simple > 3 * truth, (r, b_simple, truth)


def test_the_pair_after_a_checkpoint_reads_the_drift_before_it():
    """The B / 2B buffer is not saved, so the pair after a checkpoint has no link (Eq. A4): it reads the drift the
    pairs before the checkpoint measured (saved with the state) instead of giving no sample; the first pair of a run
    gives none."""
    paired = noise.PairedSteps()
    out = []
    for step, (small2, diff2) in enumerate([(4.0, 0.0), (4.0, 6.0), (4.0, 9.0), (4.0, 6.0)]):  # even: the link's
        out.append(paired.add(step, "exact", small2, diff2, 8))
    (_, first), (_, second) = out[1], out[3]  # within 6 each, link 9: |d|² = (9 - 6) / 3 = 1, b |d|² / 2 = 4
    assert first is None and second == pytest.approx(4.0)
    resumed = paired.split()
    assert resumed.carried == second and paired.split().carried == second  # idempotent: state_dict may run twice
    resumed.add(4, "exact", 4.0, 0.0, 8)
    assert resumed.add(5, "exact", 4.0, 6.0, 8)[1] == second


def test_a_pair_of_steps_with_different_batch_sizes_gives_no_sample():
    """B / 2B reads a pair's two steps as b and 2b of one batch size: an epoch's short last step (3 pairs after 8)
    gives no sample, and the next pair no link to it (its drift is not measured); the pair after that reads again."""
    paired = noise.PairedSteps()
    for step in range(4):  # two whole pairs of 8: the second has its link
        sizes, drift = paired.add(step, "exact", 4.0, 6.0 if step % 2 else 9.0, 8)
    assert sizes is not None and drift == pytest.approx(4.0)
    paired.add(4, "exact", 4.0, 9.0, 8)
    assert paired.add(5, "exact", 4.0, 6.0, 3) == (None, None)  # the epoch's short last step
    paired.add(6, "exact", 4.0, 9.0, 8)
    assert paired.add(7, "exact", 4.0, 6.0, 8)[1] is None  # linked to nothing: no drift
    paired.add(8, "exact", 4.0, 9.0, 8)
    assert paired.add(9, "exact", 4.0, 6.0, 8)[1] == pytest.approx(4.0)


def test_two_probes_that_agree_by_chance_are_read_as_noisy_as_the_exact_blocks():
    """Heavy-tailed per-pair gradients make one block's tr Σ vary by factors of 2-4 from block to block; two probes
    that happen to agree (here both read r + 1 ≈ 0.8) must not give a narrow bound. The exact blocks' jitter (second
    differences of their log tr Σ, a trend cancels) floors each probe's variance at 1.5 σ²: r's bound stays wide."""
    probs = _bare(["branch"], single=True)
    for level in (7.0, 7.9, 6.8, 8.1, 7.2):  # exact blocks' log tr Σ: σ ≈ 0.9 per block
        probs.probes.add(probs.stats, "exact", level)
    for ratio in (math.log(0.80), math.log(0.82)):
        probs.stats.add("ratio_branch", ratio)
        for name in ("trace_exact", "norm2_exact", "cross_exact"):
            probs.stats.add(name, 1.0)
    assert probs.stats.count("jitter") > 2.9
    r = probs._bounds(auto.UPPER_Z, ["branch"])[1]["branch"]
    assert r > 3.0, r  # from the two probes' own spread alone: 0.00
    assert math.exp(probs.stats.mean("ratio_branch", auto.UPPER_Z)) - 1 < 0.0


def test_unresolved_blocks_prune_at_no_probability():
    """A block whose estimate less the drift is not positive is unresolved (None): a probe read against it counts
    r + 1 = UNRESOLVED (10), which keeps every branch."""
    probs = _bare(["branch"], single=True)
    for kind, level in (("exact", None), ("branch", 5.0), ("exact", 5.0)):
        probs.probes.add(probs.stats, kind, level)
    assert probs.stats.mean("ratio_branch") == pytest.approx(math.log(noise.UNRESOLVED))
    probs.probes.add(probs.stats, "branch", None)  # a probe's own tr Σ unresolved: the same
    probs.probes.add(probs.stats, "exact", 5.0)
    assert probs.stats.mean("ratio_branch") == pytest.approx(math.log(noise.UNRESOLVED))


def test_loss_curve_bounds_what_pruning_gives_up():
    """(A3): no room before LOSS_WINDOW steps, while the loss still falls fast, or while it rises; room once it
    has flattened, more where the loss is near its floor; with the room, the choice prunes where B_simple is far
    above B (the time to a loss only grows), and the work per step is what it minimises."""
    gen = torch.Generator().manual_seed(0)

    def curve(losses):
        c = auto.LossCurve()
        for step, loss in enumerate(losses):
            c.add(step, loss + 0.005 * float(torch.randn((), generator=gen)))
        return c

    flat = [0.7 * math.exp(-step / 2) + 0.05 for step in range(30)]
    assert curve(flat[:7]).room(7, 100, 0.0) == 0.0
    steep = [0.7 - 0.005 * step for step in range(30)]  # far above its floor, falling at its start's rate
    assert curve(steep).room(30, 100, 0.0) < 0.1
    assert curve(list(reversed(steep))).room(30, 100, 0.0) == 0.0  # rising
    flattened = curve(flat)
    room = flattened.room(30, 100, 0.0)
    assert room > 0.5 and flattened.room(30, 40, 0.0) > room  # fewer steps left: less to give up
    assert flattened.room(30, 2000, None) < flattened.room(30, 2000, 0.0)  # the floor bounds what is left to gain
    assert auto.LossCurve(flattened.state_dict()).room(30, 100, 0.0) == room  # a checkpoint's curve
    keep = auto.choose(b_simple=math.inf, r_branch=1.3, r_position=0.0, batch=32, head=0.0, branch_auto=True,
                       position_auto=False, branch_half_cost=0.8)
    assert keep[:2] == (1.0, 1.0)
    pick = auto.choose(b_simple=math.inf, r_branch=1.3, r_position=0.0, batch=32, head=0.0, branch_auto=True,
                       position_auto=False, branch_half_cost=0.8, room=0.6)
    assert pick[0] == 0.5 and pick[2] > 1.0 and "flat loss curve" in pick[3]  # 1 - 1 / 2.3 = 0.57 <= 0.6
    tighter = auto.choose(b_simple=math.inf, r_branch=1.3, r_position=0.0, batch=32, head=0.0, branch_auto=True,
                          position_auto=False, branch_half_cost=0.8, room=0.4)
    assert tighter[0] == 0.75  # 1 - 1 / (1 + 1.3 / 3) = 0.30 <= 0.4 < 0.43 at 0.625


def test_a_branch_family_whose_draw_saves_nothing_is_never_probed_again():
    """Near-copies keep both branches, so a branch probe of near-copy data costs what an exact step costs: a property
    of the data, not of the run's progress. From its first probe block on the family is idle: no more probes (they
    cost accuracy and nothing would be pruned), the warm-up's second probe runs exact, and after the warm-up nothing
    is measured (every step runs the choice: keep everything, said why)."""
    for half, idle in ((1.0, True), (0.8, False)):
        probs = _bare(["branch"], single=True)
        for work in (10.0, 10.2):  # the two steps of a B / 2B block, each
            probs.stats.add("work_exact", work)
            probs.stats.add("work_branch", work * half)
        probs._decide(4)
        assert (noise.branch_idle(probs.stats) == {"branch"}) is idle
        assert probs.kind(8) == ("exact" if idle else "branch")  # the warm-up's second probe
        assert {probs.kind(step) for step in range(12, 600)} == ({"choice"} if idle else {"exact", "branch"})
        for value in (100.0, 110.0):  # two exact blocks: a decision
            for name in ("trace", "norm2", "cross"):
                probs.stats.add(f"{name}_exact", value)
        probs._decide(12)
        assert probs.choice[:2] == (1.0, 1.0)
        assert bool(probs.history) is idle and (not idle or "branch idle" in probs.history[-1]["reason"])


def test_where_nothing_will_be_pruned_only_the_blocks_around_a_probe_are_measured():
    """A family probed RARELY (the optimistic bounds keep p = 1): its probe every RARELY * PROBE_EVERY blocks sits
    between two exact blocks, with one more exact block before them on the B / 2B path (the link, Eq. A4); every other
    block runs the choice (keep everything) and is not measured. While pruning might pay, every block is measured."""
    for single, before in ((True, [63]), (False, [])):
        probs = _bare(["branch"], single=single)
        probs.futile = ["branch"]
        per_block = 2 if single else 1
        kinds = {block: probs.kind(block * per_block) for block in range(6, 200)}
        assert [b for b, k in kinds.items() if k == "branch"] == [65, 129, 193]
        exact = [b for b, k in kinds.items() if k == "exact"]
        assert exact == [b for t in (4, 8, 12) for b in [*[x + 16 * (t - 4) for x in before], 16 * t, 16 * t + 2]]
        assert {k for b, k in kinds.items() if b not in exact and k != "branch"} == {"choice"}
        probs.futile = []
        assert {probs.kind(block * per_block) for block in range(6, 200)} == {"exact", "branch"}


def test_adapter_training_never_probes_branches(tokenizer, far_dataset, tmp_path, monkeypatch, caplog):
    """On adapter (PEFT) training `branch_keep_prob="auto"` keeps every branch at every step, probes included, and
    says so once (the real-model study: branch pruning never paid on a LoRA run; docs/quality.md). The position family
    is still auto."""
    from peft import LoraConfig, get_peft_model

    monkeypatch.setattr(auto, "head_share", lambda config: 0.3)  # position pruning can save MIN_GAIN
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    record = []
    with caplog.at_level("WARNING"):
        trainer = _train(tokenizer, far_dataset, tmp_path, record, model=get_peft_model(tiny_model(tokenizer), lora),
                         ref_model=None, position_keep_prob="auto", per_device_train_batch_size=8,
                         gradient_accumulation_steps=1)
    notes = [r.getMessage() for r in caplog.records if "adapter (PEFT)" in r.getMessage()]
    assert len(notes) == 1, notes
    assert trainer.auto_keep_probs.families == ["position"]
    trainer.train()
    assert len(record) == 12 and all(all(backprop) for *_, backprop, _ in record)
    assert "position" in [trainer.auto_keep_probs.kind(step) for step in range(12)]  # position is still probed


# --- fp16 with a loss scaler -----------------------------------------------------------------------------------------
def _scaled_auto_run(tokenizer, dataset, tmp_path, init_scale, overflow_steps=(), **case):
    """An auto run under fp16 autocast with a real `torch.amp.GradScaler` on CPU (accelerate builds one only on a GPU,
    tests/test_gpu_setups_safety.py), its scale held (no growth); the gradient overflows at `overflow_steps`. Returns
    the trainer, what each step sent to the estimate (`end_step`'s five reduced scalars, by step) and the steps that
    added a sample of tr Σ."""
    trainer = with_cpu_loss_scaler(_train(tokenizer, dataset, tmp_path, fp16=True, **case), init_scale,
                                   overflow_steps, growth_interval=10**6)
    sent, sampled, flush = _recording_folds(trainer.auto_keep_probs)
    trainer.train()
    flush()
    return trainer, sent, sampled


@pytest.mark.parametrize("case", [
    dict(max_steps=10),  # accumulation: the hooks' local gradients
    dict(per_device_train_batch_size=8, gradient_accumulation_steps=1, max_steps=14),  # one process: B / 2B
], ids=["accumulation", "single"])
def test_under_an_fp16_loss_scaler_auto_measures_the_unscaled_gradient(tokenizer, far_dataset, tmp_path, case):
    """fp16's scaler multiplies every backward's gradient by its loss scale; transformers' gradient norm is unscaled.
    At 2^12 auto sends what it sends at scale 1 (fp16 rounding apart), and so estimates the same noise scale. Failed
    before the fix: the hooks' and the B / 2B buffer's norms came 2^24 times too large."""
    runs = {scale: _scaled_auto_run(tokenizer, far_dataset, tmp_path / str(scale), scale, **case)[:2]
            for scale in (1.0, 2.0**12)}
    (plain, at_one), (scaled, at_big) = runs[1.0], runs[2.0**12]
    assert at_one.keys() == at_big.keys() and len(at_one) == case["max_steps"]
    for step in at_one:
        assert at_big[step] == pytest.approx(at_one[step], rel=2e-2, abs=1e-9), step
    a, b = plain.auto_keep_probs, scaled.auto_keep_probs
    assert a.history and b.history
    assert b.history[0]["b_simple"] == pytest.approx(a.history[0]["b_simple"], rel=5e-2)


@pytest.mark.parametrize("case, overflow", [
    (dict(max_steps=8), 2),  # an exact step of the warm-up
    (dict(per_device_train_batch_size=8, gradient_accumulation_steps=1, max_steps=20), 14),  # a pair's first step
], ids=["accumulation", "single"])
def test_a_step_the_fp16_scaler_skipped_measures_nothing(tokenizer, far_dataset, tmp_path, case, overflow):
    """An overflowing step (the scaler skips it and halves its scale) sends non-finite norms: auto drops that step
    (B / 2B: its pair, and the link that reads its gradient) and keeps the others; its statistics stay finite. Failed
    before the fix: NaN in the running sums."""
    trainer, sent, sampled = _scaled_auto_run(tokenizer, far_dataset, tmp_path, 2.0**12, overflow_steps={overflow},
                                              **case)
    probs = trainer.auto_keep_probs
    assert trainer.accelerator.scaler.get_scale() == 2.0**11  # backed off once
    assert not all(math.isfinite(x) for x in sent[overflow])  # the skipped step sent what it saw
    # B / 2B: a pair's sample comes at its second step
    assert not sampled & {overflow, overflow + 1} and len(sampled) >= 2
    assert all(math.isfinite(x) for sums in probs.stats.sums.values() for x in sums)


def test_auto_refuses_deepspeeds_fp16_loss_scaler():
    """DeepSpeed scales fp16 gradients in its own engine, whose scale auto does not read: refused, before training."""
    args = SimpleNamespace(fp16=True, branch_keep_prob="auto", position_keep_prob=1.0)
    with pytest.raises(ValueError, match="DeepSpeed's fp16 loss scaler"):
        auto.AutoKeepProbs(args, SimpleNamespace(), deepspeed=True)
