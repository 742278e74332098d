"""CI smoke test of the real-model studies' harness (evaluation/real_models.py): the tiny built-in model through every
setting (its SFT warm start included), the store resumed, the report written; the pre-registered study's calibration,
pin checks, per-pair margins, divergence and report (its verdict on synthetic records). Asserts nothing about which
setting wins: at 2-4 steps the numbers are noise. ~1-2 min of CPU.
"""

import io
import json

import pytest

from tiny import run_module

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _run(tmp_path, *args):
    env = {"TRL_PRUNED_DPO_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    return run_module("evaluation.real_models", "--store", str(tmp_path / "cells.jsonl"), "--work",
                      str(tmp_path / "work"), *args, env=env)


def test_real_models_smoke_every_setting_resumes_and_reports(tmp_path):
    from evaluation.real_models import SETTINGS

    first = _run(tmp_path, "--smoke")
    assert "7 cell(s) run" in first
    records = [json.loads(line) for line in (tmp_path / "cells.jsonl").read_text().splitlines()]
    assert [r["setting"] for r in records] == list(SETTINGS)
    for record in records:
        steps = [p["step"] for p in record["curve"]]
        assert steps == [0, 1, 2] and record["curve"][0]["accuracy"] == 0.5
        assert all(0.0 <= p["accuracy"] <= 1.0 and p["cpu"] >= 0.0 for p in record["curve"])
        assert len(record["step_cpu"]) == 2 and record["tokens_executed"] > 0
    by = {r["setting"]: r for r in records}
    assert "auto_choice" in by["auto"] and "auto_choice" not in by["exact"]
    # The exact preset executes fewer policy tokens than stock's padded rows; branch pruning executes no more than it.
    assert by["exact"]["tokens_executed"] < by["stock"]["tokens_executed"]
    assert len(list((tmp_path / "work").glob("sft-*/model.safetensors"))) == 1  # one warm start, shared

    assert "0 cell(s) run" in _run(tmp_path, "--smoke")  # resumed: every cell is stored

    # Full fine-tuning (`tiny-full`): every weight trains against TRL's frozen copy; branch pruning and auto run there.
    assert "3 cell(s) run" in _run(tmp_path, "--smoke", "--models", "tiny-full", "--settings", "stock", "branch",
                                   "auto")
    full = [json.loads(line) for line in (tmp_path / "cells.jsonl").read_text().splitlines()][len(records):]
    assert [(r["model"], r["training"]) for r in full] == [("tiny-full", "full")] * 3
    assert all(r["training"] == "LoRA r16" for r in records)
    assert all(p["margin"] != 0.0 for r in full for p in r["curve"][1:])  # the policy moved off its reference

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "quality.md").write_text("# head\n<!-- real_models:begin (generated: python -m evaluation."
                                              "real_models --report) -->\nold\n<!-- real_models:end -->\ntail\n")
    report = _run(tmp_path, "--report", "--docs", str(docs))
    assert "| exact + auto" in report and "speed-up vs stock" in report
    assert "**tiny-full x python-docs**: 2 steps of 2 pairs, full fine-tuning" in report
    headline = (docs / "quality.md").read_text()
    assert "old" not in headline and "| stock DPOTrainer |" in headline and headline.endswith("tail\n")
    assert (docs / "img" / "real_models.png").read_bytes()[:8] == PNG_MAGIC


def test_prereg_plan_calibrates_runs_both_arms_resumes_and_reports(tmp_path):
    """docs/study.md's protocol (as amended under "Changes", 2026-12-05) on the tiny model: the calibration
    (interleaved, one process), then the equal-steps arm and the equal-time arm over each setting's N steps read from
    the calibration file (a setting whose N is the plan's steps reads its equal-steps run), every pair's margin kept,
    the pin in every key and record, resumed, analysed. The pin checks are bypassed by --smoke. ~40 s."""
    import re

    from evaluation.real_models import PLANS, run_calibration, run_prereg, seed_order, stored
    from evaluation.real_run import held_out_readouts
    from evaluation.study_report import write_study_report

    assert seed_order(["a", "b", "c"], 0) == ["a", "b", "c"] and seed_order(["a", "b", "c"], 4) == ["b", "c", "a"]

    calibration_path = tmp_path / "study_calibration.json"
    _run(tmp_path, "--plan", "prereg", "--smoke", "--calibrate", "--tasks", "docstrings-near")
    calibration = json.loads(calibration_path.read_text())["docstrings-near"]
    assert set(calibration["equal_time_steps"]) == {"exact", "position", "auto"} and calibration["threads"] == 1
    assert calibration["order"][0] != calibration["order"][1]  # round-robin, rotated each round
    assert all(len(v) == 2 for v in calibration["step_user"].values())  # 2 rounds x 1 step after the warm-up
    assert calibration["equal_time_steps"]["exact"] == 4
    # N as if position were dearer and auto cheaper than the exact preset (at 4 tiny steps, measured N are noise)
    calibration["equal_time_steps"].update(position=3, auto=5)
    calibration_path.write_text(json.dumps({"docstrings-near": calibration}))
    with pytest.raises(SystemExit, match="already holds the calibration"):  # a task is calibrated once
        run_calibration(["tiny-study"], ["docstrings-near"], ["exact"], PLANS["prereg-smoke"], tmp_path / "cells.jsonl",
                        tmp_path / "work", calibration_path, bypass=True, smoke=True)

    settings = ["auto", "position", "stock", "exact"]
    assert "6 cell(s) run" in _run(tmp_path, "--plan", "prereg", "--smoke", "--tasks", "docstrings-near",
                                   "--settings", *settings)
    records = stored(tmp_path / "cells.jsonl")
    assert [(r["setting"], r["arm"], r["steps"]) for r in records] == [
        ("exact", "steps", 4), ("stock", "steps", 4), ("position", "steps", 4), ("auto", "steps", 4),
        ("position", "time", 3), ("auto", "time", 5)]
    exact, timed = records[0], records[4]
    assert [p["step"] for p in exact["curve"]] == [0, 1, 2, 4] and [p["step"] for p in timed["curve"]] == [0, 3]
    for record in records:
        assert record["provenance"]["versions"]["trl"] and len(record["provenance"]["rules"]) == 16
        assert record["data"] == exact["data"] and isinstance(record["dirty"], bool)
        assert record["commit"] == record["provenance"]["commit"]
        assert re.fullmatch(r"[0-9a-f]{40}|unknown", record["commit"])
        for point in record["curve"][1:]:  # every evaluated pair's margin, and the readouts they give
            assert len(point["margins"]) == record["eval_pairs"] == 4
            again = held_out_readouts(point["margins"])
            assert abs(again["loss"] - point["loss"]) < 1e-4 and again["accuracy"] == point["accuracy"]
        assert record["nonfinite_losses"] == 0 and len(record["step_user"]) == record["steps_done"]
    assert len({r["key"] for r in records}) == len(records)
    rates = exact["learning_rates"]
    assert rates[0] == 0.0 and rates[1] == max(rates) > rates[-1] > 0  # linear warm-up, then linear decay
    auto = records[3]
    assert len(auto["auto_keep_probs_steps"]) == 4 and "auto_keep_probs_steps" not in exact
    assert auto["equal_time_steps"] == 5 and records[2]["equal_time_steps"] == 3

    resumed = run_prereg(["tiny-study"], ["docstrings-near"], settings, [0], [0], PLANS["prereg-smoke"],
                         tmp_path / "cells.jsonl", tmp_path / "work", "smoke", calibration_path, bypass=True)
    assert resumed == 0  # every cell of both arms is stored
    report = io.StringIO()
    assert write_study_report(records, report) == 0
    text = report.getvalue()
    assert "Equal steps, held-out loss (primary" in text and "Equal steps, held-out accuracy (secondary" in text
    assert "| exact + position 0.5 |" in text and "Equal time" in text
    assert re.search(r"Stock against the exact preset, seed 0: (HOLDS|FAILS)", text)
    assert "**experimental**" in text and "`auto`'s choices over its runs: branch 1 / position 1" in text


def test_study_cells_refuse_a_dirty_or_unpinned_checkout_and_a_missing_calibration(tmp_path):
    from evaluation.real_models import PLANS, run_prereg
    from evaluation.study_calibration import equal_time_steps
    from evaluation.study_pin import Provenance, check_runnable

    with pytest.raises(SystemExit, match="dirty checkout|pin the study's commit first"):
        run_prereg(["tiny-study"], ["docstrings-near"], ["exact"], [0], [0], PLANS["prereg-smoke"],
                   tmp_path / "cells.jsonl", tmp_path / "work", "smoke", tmp_path / "none.json")
    (tmp_path / "study_pin.txt").write_text("0" * 40 + "\n")
    with pytest.raises(SystemExit, match="pinned at 0000"):
        check_runnable(Provenance("1" * 40, False, {}, "r"), tmp_path, bypass=False)
    with pytest.raises(SystemExit, match="no calibration"):
        equal_time_steps(tmp_path / "none.json", "docstrings-near", "auto", {"commit": "c"}, "d", bypass=True)
    (tmp_path / "cal.json").write_text(json.dumps({"docstrings-near": {
        "data": "d", "provenance": {"commit": "a"}, "equal_time_steps": {"auto": 97}}}))
    assert equal_time_steps(tmp_path / "cal.json", "docstrings-near", "auto", {"commit": "b"}, "d", bypass=True) == 97
    with pytest.raises(SystemExit, match="measured at a"):
        equal_time_steps(tmp_path / "cal.json", "docstrings-near", "auto", {"commit": "b"}, "d", bypass=False)
    with pytest.raises(SystemExit, match="not committed"):
        equal_time_steps(tmp_path / "cal.json", "docstrings-near", "auto", {"commit": "a"}, "d", bypass=False)
    with pytest.raises(SystemExit, match="other data"):
        equal_time_steps(tmp_path / "cal.json", "docstrings-near", "auto", {"commit": "a"}, "e", bypass=True)


def test_a_run_past_one_epoch_reshuffles_as_transformers_does(tmp_path, monkeypatch):
    """The equal-time arm of a cheap setting runs past one epoch (878 pairs = 110 steps of 8): its second epoch is the
    same pairs in another order, as HF's loop draws it (not truncated, not repeated). 8 pairs, 2 per step."""
    from dataclasses import replace

    from evaluation.real_models import MODELS, PLANS, _prepare
    from evaluation.real_run import SETTINGS, build_trainer

    monkeypatch.setenv("TRL_PRUNED_DPO_CACHE", str(tmp_path / "cache"))
    spec, plan = MODELS["tiny-study"], replace(PLANS["prereg-smoke"], steps=8, evals=(8,), train_pairs=8)
    path, train, test = _prepare("tiny-study", "docstrings-near", spec, plan, tmp_path / "work")
    trainer = build_trainer(path, spec, plan, SETTINGS["exact"], 0, train, test, str(tmp_path / "out"))
    seen, compute_loss = [], trainer.compute_loss

    def counted(model, inputs, *args, **kwargs):
        seen.append(int(inputs["input_ids"].sum()))
        return compute_loss(model, inputs, *args, **kwargs)

    trainer.compute_loss = counted
    trainer.train()
    assert len(seen) == 8 and sum(seen[:4]) == sum(seen[4:]) and seen[:4] != seen[4:]  # (token sums per batch)


def _record(setting, seed, margins_by_step, arm="steps", commit="a" * 40, **fields):
    """A synthetic study record: its curve from per-pair margins at each step."""
    from evaluation.real_run import held_out_readouts

    curve = [{"step": 0, "accuracy": 0.5, "margin": 0.0, "loss": 0.6931}] + [
        {"step": step, **held_out_readouts(m), "margins": m} for step, m in margins_by_step.items()]
    last = max(margins_by_step)
    provenance = {"commit": commit, "dirty": False, "versions": {"trl": "1.16.0"}, "rules": "r"}
    return {"key": f"{setting}-{arm}-{seed}-{commit}", "model": "m", "task": "t", "setting": setting, "seed": seed,
            "arm": arm, "plan": "prereg", "steps": last, "pairs": 8, "training": "LoRA r16", "eval_pairs": 4,
            "curve": curve, "step_user": [1.0] * last, "provenance": provenance, "commit": commit, "data": "d",
            "divergence": None, **fields}


def test_the_study_report_judges_auto_by_non_inferiority_and_keeps_pins_apart(tmp_path):
    """`auto`'s verdict (docs/study.md, "Changes"): non-inferior to the exact preset at equal time on the held-out DPO
    loss (upper bound below +0.02) and the mean margin (lower bound above -0.05), 5 seeds; fewer: experimental;
    identical differences: no interval, not a pass. Cells of two pins are never mixed."""
    from evaluation.study_report import auto_verdict, cells_by_task, paired, wording, write_study_report

    base = [0.5, 0.6, 0.4, 0.7]

    def study(auto_shift, seeds=5, jitter=0.01):
        records = []
        for seed in range(seeds):
            exact = [m + 0.01 * seed for m in base]
            records.append(_record("exact", seed, {50: exact, 100: exact}))
            mine = [m + auto_shift + jitter * (seed % 2) for m in exact]
            records.append(_record("auto", seed, {97: mine}, arm="time", equal_time_steps=97,
                                   auto_keep_probs_steps=[[1.0, 0.5]] * 97))
        return cells_by_task(records)[0][("m", "t")]

    assert auto_verdict(study(+0.02), 100)[0] == "met"
    worse, better = paired([0.10, 0.11, 0.12]), paired([-0.10, -0.11, -0.12])  # loss up / margin down: costs
    assert wording(worse, better) == "costs quality" and wording(better, worse) == "gains"
    assert wording(paired([-0.1, 0.1, 0.0]), paired([0.1, -0.1, 0.0])) == "no difference measured"
    verdict, why = auto_verdict(study(-0.3), 100)  # a lower margin, a higher loss: worse than the margins allow
    assert verdict == "missed" and "NOT below +0.02" in why and "NOT above -0.05" in why
    assert auto_verdict(study(+0.02, seeds=4), 100)[0] == "experimental"
    verdict, why = auto_verdict(study(+0.02, jitter=0.0), 100)
    assert verdict == "missed" and "identical" in why  # a zero-width interval is no pass

    # Stock judged, divergence counted, and two pins never mixed: refused without a pin, the other one superseded.
    one = [_record("exact", 0, {100: [0.5, 0.6, 0.4, 0.7]}),
           _record("stock", 0, {100: [0.5, -0.6, -0.4, 0.7]}),
           _record("auto", 0, {100: [float("nan"), 0.6, 0.4, 0.7]}, losses=[0.69, float("nan")],
                   divergence="training loss nan at step 2", nonfinite_losses=1, nonfinite_margins=1)]
    other = [_record("exact", 0, {100: [0.1, 0.1, 0.1, 0.1]}, commit="b" * 40)]
    out = io.StringIO()
    assert write_study_report(one + other, out) == 2 and "refusing to mix" in out.getvalue()
    out = io.StringIO()
    assert write_study_report(one + other, out, pinned="a" * 12, images=tmp_path) == 0
    text = out.getvalue()
    assert (tmp_path / "study_m_t.png").read_bytes()[:8] == PNG_MAGIC
    assert "Superseded cells, kept in the store, in no table: bbbbbbbbbbbb" in text
    assert "seed 0: FAILS" in text and "step 100 2" in text
    assert "exact + auto (steps) 1 of 1, 1 non-finite losses, 1 non-finite margins" in text


def test_divergence_and_non_finite_margins_count_against_the_setting():
    import math

    from evaluation.real_run import divergence, held_out_readouts

    # docs/study.md's divergence: a non-finite loss, a loss above 10x the first, a non-finite held-out margin, or
    # held-out accuracy below 0.5
    assert divergence([0.69, 0.5, float("nan")], 0.9).startswith("training loss nan")
    assert "10x" in divergence([0.69, 7.0], 0.9) and "below 0.5" in divergence([0.69, 0.4], 0.49)
    assert "non-finite held-out margin" in divergence([0.69, 0.3], 0.9, nonfinite_margins=1)
    assert divergence([0.69, 6.0, 0.3], 0.5) is None
    # A +inf or NaN margin is never a win: a miss, and the evaluation's lowest finite margin (or 0) in loss and margin
    readouts = held_out_readouts([float("inf"), float("nan"), 1.0, -0.5])
    assert readouts["accuracy"] == 0.25 and readouts["nonfinite"] == 2
    assert math.isclose(readouts["margin"], (-0.5 - 0.5 + 1.0 - 0.5) / 4)
    assert held_out_readouts([float("inf"), 2.0])["margin"] == 1.0  # the inf pair counts as 0, not as a win
    assert math.isclose(held_out_readouts([0.0])["loss"], math.log(2)) and held_out_readouts([0.0])["accuracy"] == 0.5


def test_the_study_tasks_differ_only_in_the_rejection():
    """docs/study.md's two tasks: the same prompts and chosen answers, pair for pair; `docstrings-near` rejects with
    the chosen answer one sentence changed (its other sentences kept: a shared start or end), `docstrings-far` with
    another topic's answer (nothing shared, but for sibling functions' docstrings: 2 of 878 train pairs)."""
    import os
    import statistics

    from evaluation.study_tasks import make_study_splits

    def shared(chosen, rejected):  # the share of the chosen answer in a common start and a common end
        a, b = chosen[0]["content"], rejected[0]["content"]
        return (len(os.path.commonprefix([a, b])) + len(os.path.commonprefix([a[::-1], b[::-1]]))) / len(a)

    near, far = make_study_splits("docstrings-near"), make_study_splits("docstrings-far")
    for split in ("train", "test"):
        assert near[split]["prompt"] == far[split]["prompt"] and near[split]["chosen"] == far[split]["chosen"]
        close = [shared(c, r) for c, r in zip(near[split]["chosen"], near[split]["rejected"])]
        other = [shared(c, r) for c, r in zip(far[split]["chosen"], far[split]["rejected"])]
        assert min(close) > 0.1 and statistics.median(close) > 0.4 and statistics.median(other) < 0.05
        assert sum(c > o for c, o in zip(close, other)) >= 0.99 * len(close)
    assert len(near["train"]) > 800 and len(near["test"]) > 150  # 100 steps of 8 pairs in under one epoch
