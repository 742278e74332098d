"""CI smoke test of the quality study (evaluation/): the quick mode at its smallest sizes, every stage, end to end.

It checks that the documented command runs and that what it writes is well formed. It asserts nothing about which
setting wins: at these sizes the numbers are noise.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_quality_quick_smoke(tmp_path):
    out, docs = tmp_path / "out", tmp_path / "docs"
    env = {**os.environ, "TRL_PRUNED_DPO_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    result = subprocess.run(
        [sys.executable, "-m", "evaluation.quality", "--smoke", "--out", str(out), "--docs", str(docs)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    # Training runs: one JSON per setting and seed, each with an exact evaluation curve.
    runs = sorted((out / "runs").glob("*.json"))
    assert {p.stem for p in runs} == {"stock-s0", "stock-s1", "branch_cp-s0", "branch_cp-s1"}
    digests = {}
    for path in runs:
        record = json.loads(path.read_text())
        assert record["curve"], path
        for point in record["curve"]:
            assert 0.0 <= point["pref_acc"] <= 1.0 and point["time"] >= 0.0
        assert any("gen_acc" in p for p in record["curve"])
        assert record["max_steps"] == record["curve"][-1]["step"]
        digests.setdefault(record["seed"], set()).add(record["data_digest"])
    assert all(len(d) == 1 for d in digests.values()), "settings of one seed saw different data orders"

    # Timing and gradient diagnostics.
    timing = json.loads((out / "timing.json").read_text())["timing"]
    assert timing["stock"]["ratio"] == 1.0 and timing["branch_cp"]["step_s"] > 0
    grads = json.loads((out / "gradients.json").read_text())
    for state in ("start", "trained"):
        for name in ("branch_cp", "position_cp_shared"):
            entry = grads[state][name]
            assert -1.0 <= entry["cos"] <= 1.0 and entry["rel_mse"] >= 0.0 and entry["cost"] > 0.0

    # The report: markdown with the headline table and the plots it links, all real PNGs.
    text = (docs / "quality.md").read_text()
    assert "## Headline" in text and "| stock TRL DPOTrainer |" in text and "| branch 0.5 + common prefix |" in text
    assert "python -m evaluation.quality --quick" in text
    for name in ("steps", "time", "margin_gen", "gradients"):
        png = docs / "img" / f"quality_{name}.png"
        assert f"img/quality_{name}.png" in text
        assert png.read_bytes()[:8] == PNG_MAGIC
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) >= {"stock", "branch_cp"}
