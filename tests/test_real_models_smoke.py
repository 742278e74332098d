"""CI smoke test of the real-model study's harness (evaluation/real_models.py): the tiny built-in model through every
setting (its SFT warm start included), the store resumed, the report written. Asserts nothing about which setting
wins: at 2 steps the numbers are noise. ~15 s of CPU.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _run(tmp_path, *args):
    env = {**os.environ, "TRL_PRUNED_DPO_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    result = subprocess.run([sys.executable, "-m", "evaluation.real_models", "--store", str(tmp_path / "cells.jsonl"),
                             "--work", str(tmp_path / "work"), *args],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


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


def test_prereg_plan_runs_both_arms_resumes_and_reports(tmp_path):
    """docs/study.md's protocol on the tiny model: the equal-steps arm (the exact preset first, then stock and branch),
    then branch's equal-time arm with the exact preset's user CPU as its budget; warm-up then decay; resumed (in this
    process: nothing is built when every cell is stored); analysed. ~20 s."""
    import io

    from evaluation.real_models import PLANS, run_prereg, stored
    from evaluation.study_report import write_study_report

    settings = ["branch", "stock", "exact"]
    assert "4 cell(s) run" in _run(tmp_path, "--plan", "prereg", "--smoke", "--tasks", "docstrings-near",
                                   "--settings", *settings)
    records = stored(tmp_path / "cells.jsonl")
    assert [(r["setting"], r["arm"]) for r in records] == [("exact", "steps"), ("stock", "steps"), ("branch", "steps"),
                                                            ("branch", "time")]
    exact, timed = records[0], records[3]
    assert [p["step"] for p in exact["curve"]] == [0, 2, 4] and exact["eval_pairs"] == 4  # every held-out pair
    rates = exact["learning_rates"]
    assert rates[0] == 0.0 and rates[1] == max(rates) > rates[-1] > 0  # linear warm-up, then linear decay
    assert timed["budget_user_s"] == round(sum(exact["step_user"]), 3) and timed["curve"][-1]["step"] >= 1
    assert all(len(r["step_user"]) == r["steps_done"] and "divergence" in r for r in records)
    resumed = run_prereg(["tiny-study"], ["docstrings-near"], settings, [0], [0], PLANS["prereg-smoke"],
                         tmp_path / "cells.jsonl", tmp_path / "work", "smoke")
    assert resumed == 0  # every cell of both arms is stored
    report = io.StringIO()
    write_study_report(records, report)
    text = report.getvalue()
    assert "| exact + branch 0.5 |" in text and "Equal time" in text and "Stock against the exact preset" in text
    assert "`auto`'s targets: incomplete" in text


def test_the_equal_time_clock_stops_at_its_budget_and_evaluates_there():
    from types import SimpleNamespace

    from evaluation.real_run import _Clock, divergence

    evaluated = []
    clock = _Clock(lambda step: evaluated.append(step) or {"accuracy": 0.5, "margin": 0.0, "pairs": 1}, (10,),
                   lambda message: None, budget_user_s=0.0)
    state, control = SimpleNamespace(global_step=3, max_steps=10), SimpleNamespace(should_training_stop=False)
    clock.on_step_begin(None, state, control)
    clock.on_step_end(None, state, control)
    assert control.should_training_stop and clock.stopped_by_budget and evaluated == [3]
    # docs/study.md's divergence: a non-finite loss, a loss above 10x the first, or held-out accuracy below 0.5
    assert divergence([0.69, 0.5, float("nan")], 0.9).startswith("training loss nan")
    assert "10x" in divergence([0.69, 7.0], 0.9) and "below 0.5" in divergence([0.69, 0.4], 0.49)
    assert divergence([0.69, 6.0, 0.3], 0.5) is None


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
