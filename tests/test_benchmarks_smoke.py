"""The benchmark harness runs end to end in its tiniest mode and writes the fields the docs rely on.

No timing assertions: the numbers of a 2-layer, 64-wide model mean nothing. The FLOP model is checked against the
worked examples in docs (branch pruning at 0.5: 10 -> 7 forward-units with a live reference and checkpointing, 8 -> 5
with a precomputed reference, 8 -> 6 without checkpointing).
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.flops import Shape, Work, step_flops  # noqa: E402

EXPECTED = {
    "setting", "reference", "checkpointing", "stock_step_s", "pruned_step_s", "speedup", "flop_limit", "efficiency",
    "tokens_executed", "tokens_needed", "head_positions_vs_stock", "positions_scored", "branches_backpropagated",
    "stock_gflop", "pruned_gflop",
}


def _units(grad_rows_share: float, live: bool, ckpt: bool) -> float:
    """Forward-units of a step on 2 rows of 1 token, body only (a head of zero positions)."""
    shape = Shape(hidden=8, layers=1, intermediate=8, heads=1, kv_heads=1, head_dim=8, vocab=8)
    work = Work(
        policy_rows=2, policy_tokens=2.0, policy_positions=0.0, grad_rows=2 * grad_rows_share,
        grad_tokens=2.0 * grad_rows_share, grad_positions=0.0, reference_rows=2 if live else 0,
        reference_tokens=2.0 if live else 0.0,
    )
    return step_flops(shape, work, ckpt)["total"] / shape.body_per_token(1.0)


@pytest.mark.parametrize(
    "live, ckpt, stock, pruned", [(True, True, 10, 7), (False, True, 8, 5), (True, False, 8, 6)]
)
def test_flop_model_worked_examples(live, ckpt, stock, pruned):
    assert _units(1.0, live, ckpt) == pytest.approx(stock)
    assert _units(0.5, live, ckpt) == pytest.approx(pruned)


def test_smoke_run_writes_results(tmp_path):
    out = tmp_path / "bench"
    scratch = tmp_path / "tmp"  # the system temp directory of the run: it must be left empty
    scratch.mkdir()
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "TMPDIR": str(scratch)}
    settings = ["none", "branch", "position", "prefix", "combined", "max", "share"]
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.step_time", "--smoke", "--out", str(out), "--settings", *settings],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "limit" in proc.stdout and "eff" in proc.stdout  # the table is printed

    assert not list(scratch.iterdir()), list(scratch.iterdir())  # no bench_* folders left behind
    data = json.loads((out / "step_time.json").read_text())
    assert {"machine", "settings", "mode"} <= set(data["meta"])
    # on CPU the defaults measure honestly on a shared machine: one thread, CPU-time clock
    assert data["meta"]["machine"]["torch_threads"] == 1 and data["meta"]["clock"] == "cpu"
    rows = data["results"]
    assert {r["setting"] for r in rows} == set(data["meta"]["settings"])
    for row in rows:
        assert EXPECTED <= set(row), EXPECTED - set(row)
        assert row["speedup"] > 0 and row["flop_limit"] > 0
        assert row["efficiency"] == pytest.approx(row["speedup"] / row["flop_limit"])
    by_setting = {r["setting"]: r for r in rows}
    # what the settings must do to the counted work, whatever the timings
    assert by_setting["branch"]["branches_backpropagated"] == pytest.approx(0.5)
    assert by_setting["none"]["branches_backpropagated"] == pytest.approx(1.0)
    assert by_setting["position"]["positions_scored"] < 1.0
    assert by_setting["branch"]["flop_limit"] > by_setting["none"]["flop_limit"]
    assert by_setting["combined"]["memory_ratio"] > 0  # fresh-process memory measured
    assert by_setting["share"]["tokens_executed"] < by_setting["none"]["tokens_executed"]  # prompts ran once
    assert (out / "step_time.csv").read_text().startswith("kind,")
    pytest.importorskip("matplotlib")
    assert (out / "step_time.png").stat().st_size > 0


def test_warns_when_the_machine_is_loaded(monkeypatch, capsys):
    from benchmarks import step_time

    monkeypatch.setattr(step_time.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(step_time.os, "getloadavg", lambda: (5.0, 5.0, 5.0))
    step_time.warn_if_loaded()
    assert "load average 5.0 exceeds the 2 cores" in capsys.readouterr().err
    monkeypatch.setattr(step_time.os, "getloadavg", lambda: (1.0, 1.0, 1.0))
    step_time.warn_if_loaded()
    assert capsys.readouterr().err == ""
