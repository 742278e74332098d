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
