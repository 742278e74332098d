"""The GPU check's parts that decide whether a lent GPU's few minutes give a table: tested on CPU, in seconds.

- `benchmarks/gpu_check.sh` on a machine like the device one (no trl, datasets, dill or multiprocess): without their
  wheels it says so in one line and exits non-zero; with the committed wheels it installs them, imports everything and
  plans the rows (the 1.5B eager row skipped on an 80 GB card), then stops where a GPU is needed.
- A failing row keeps its whole traceback; a signal stops the run between rows with the table written; a row's record
  is written atomically; user annotations are not GPU work; the compile rows' base is the best exact row.
The full dry run of every row kind is tests/test_benchmarks_smoke.py::test_gpu_check_dry_run.
"""

import json
import os
import re
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import gpu_check  # noqa: E402

HIDDEN = ("trl", "datasets", "dill", "multiprocess")  # what the device machine lacks (PITFALLS.md)


@pytest.fixture(autouse=True)
def loud_logging(monkeypatch):
    """`gpu_check.main` quiets transformers', TRL's and the plugin's loggers for its table (benchmarks/workload.quiet),
    for the rest of the process: in-process here, that would hide later tests' warnings (test_parity's resume note)."""
    monkeypatch.setattr(gpu_check, "quiet", lambda: None)


def python_without(tmp_path, hidden=HIDDEN):
    """A `python3` that lacks `hidden`, as the device machine does: this environment's site-packages folders seen
    through symlinks with those left out (the first folder's entry wins, as on sys.path), run with -S so that the
    real folders are not on the path."""
    shadow = tmp_path / "site-packages"
    shadow.mkdir()
    for site in [p for p in sys.path if p.endswith(("site-packages", "dist-packages")) and os.path.isdir(p)]:
        for entry in os.listdir(site):
            if re.split(r"[-.]", entry)[0].lower() not in hidden and not os.path.lexists(shadow / entry):
                (shadow / entry).symlink_to(os.path.join(site, entry))
    wrapper = tmp_path / "python3"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH="${{PYTHONPATH:+$PYTHONPATH:}}{shadow}" exec {sys.executable} -S "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


def run_sh(tmp_path, *args, **env):
    environment = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "OUT")}
    environment.update(GPU_CHECK_OUT=str(tmp_path / "out"), GPU_CHECK_SITE=str(tmp_path / "installed"), **env)
    return subprocess.run(["bash", "benchmarks/gpu_check.sh", *args], cwd=ROOT, env=environment, capture_output=True,
                          text=True, timeout=240)


def test_without_the_wheels_it_says_so_in_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    python = python_without(tmp_path)
    assert subprocess.run([python, "-c", "import trl"], capture_output=True).returncode != 0  # the simulation holds
    proc = run_sh(tmp_path, "--list", PYTHON=python, WHEELS=str(tmp_path / "empty"))
    assert proc.returncode == 3, proc.stdout + proc.stderr
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert len(lines) == 1 and "lacks the wheels of trl-1.16.0 datasets-5.2.0 dill-0.4.1 multiprocess-0.70.19" in \
        lines[0], lines


def test_with_the_wheels_it_installs_them_and_stops_where_a_gpu_is_needed(tmp_path):
    """The committed wheels installed with --no-deps --target (multiprocess's is py312: rehearsed on this Python with
    `GPU_CHECK_WHEEL_PYTHON`), every import done, the plan printed for an 80 GB card, then no CUDA device: exit 2."""
    python = python_without(tmp_path)
    proc = run_sh(tmp_path, "--gpu-gib", "79.6", PYTHON=python, GPU_CHECK_WHEEL_PYTHON="3.12")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "no CUDA device" in out, out[-3000:]
    assert "installed into" in out and all((tmp_path / "installed" / name).is_dir() for name in HIDDEN), out[-3000:]
    skip = [line for line in out.splitlines() if "noise" in line and "1.5B" in line]
    assert skip and "needs ~82 GiB" in skip[0] and "79.6 GiB" in skip[0], out[-3000:]
    assert (tmp_path / "out" / "gpu_check.log").read_text().strip(), "the output is kept beside the results"


def session(tmp_path, gpu_gib=None, **extra):
    args = SimpleNamespace(dry_run=False, gpu_gib=gpu_gib, budget=1e9, bisect_budget=45.0, compile_budget=60.0,
                           out=str(tmp_path), **extra)
    return gpu_check.Session(args)


def test_the_eager_row_of_1_5b_is_skipped_below_its_memory():
    cell = gpu_check.Cell("1.5B", accum=4)
    h100 = session(None, gpu_gib=79.6)
    assert "needs ~82 GiB" in gpu_check.memory_skip(h100, cell, "noise")
    assert gpu_check.memory_skip(h100, cell, "stock") is None
    assert gpu_check.memory_skip(session(None, gpu_gib=139.8), cell, "noise") is None


def test_a_failing_row_keeps_its_whole_traceback(tmp_path, capsys):
    s = session(tmp_path)

    def deepest_frame():
        raise ValueError("the failing frame")

    s.measure = lambda *a, **k: deepest_frame()
    where = dict(cell="0.5B UF", row="exact")
    record = gpu_check.run_row(s, gpu_check.Cell("0.5B"), "exact", where)
    assert record["status"] == "error" and record["error"] == "ValueError: the failing frame"
    assert "deepest_frame" in record["traceback"] and "<lambda>" in record["traceback"]
    assert "deepest_frame" in capsys.readouterr().out


def test_a_signal_stops_between_rows_and_the_table_is_written(tmp_path, monkeypatch):
    """The first row sets the flag (as SIGINT would): it is kept, the rest listed as skipped, both files written
    whole (no partial file left), exit 130, and the process's own handlers given back."""
    calls = []

    def fake_row(session, cell, kind, where, base_kind=None):
        calls.append(kind)
        session.interrupt._set(signal.SIGINT, None)
        return dict(where, status="ok", step_s=1.0, tokens_per_s=10.0, real_tokens=10.0)

    monkeypatch.setattr(gpu_check, "run_row", fake_row)
    before = signal.getsignal(signal.SIGINT)
    code = gpu_check.main(["--dry-run", "--out", str(tmp_path), "--rows", "^core/0.5B UF 8x4/"])
    assert code == 130 and calls == ["stock"]
    assert signal.getsignal(signal.SIGINT) is before
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [r["status"] for r in data["results"]] == ["ok"] + ["skipped"] * 4
    assert all("interrupted (SIGINT)" in r["error"] for r in data["results"][1:])
    assert data["meta"]["stopped"] and "SKIPPED: interrupted" in (tmp_path / "gpu_check.txt").read_text()
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".partial")]
    flag = gpu_check.InterruptFlag()
    flag._set(signal.SIGTERM, None)
    with pytest.raises(gpu_check.Interrupted):
        flag.check()  # between steps
    with pytest.raises(KeyboardInterrupt):
        flag._set(signal.SIGINT, None)  # a second signal: at once


def test_user_annotations_are_not_gpu_work():
    """A `record_function` range mirrored on the GPU's timeline spans whole forwards: never counted as a kernel,
    whether torch marks it (is_user_annotation, activity type) or only its name matches a CPU-side range."""
    from torch.autograd import DeviceType

    def event(name, device, start, end, kind=None, annotation=False):
        return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end),
                               activity_type=kind, is_user_annotation=annotation)

    cpu, cuda = DeviceType.CPU, DeviceType.CUDA
    events = [event(gpu_check.STEP_MARK, cpu, 0, 100, "user_annotation", True),
              event("trl_pruned_dpo.forward", cpu, 1, 90, "user_annotation", True),
              event("gemm", cuda, 10, 20, "kernel"),
              event("trl_pruned_dpo.forward", cuda, 5, 95, "gpu_user_annotation", True),  # marked
              event("trl_pruned_dpo.forward", cuda, 5, 95)]  # unmarked, older torch: by its name
    counts = gpu_check.count_events(events, 1)
    assert counts["gpu_busy_s"] == pytest.approx(10e-6) and counts["gpu_kernels"] == 1, counts


def test_compile_rows_take_the_best_exact_row():
    cells = {"a": gpu_check.Cell("0.5B", accum=4), "b": gpu_check.Cell("1.5B", accum=4)}

    def row(cell, kind, tokens_per_s, side="pruned", exact=True):
        return dict(cell=cell, row=kind, side=side, exact=exact, status="ok", tokens_per_s=tokens_per_s)

    results = [row("a", "stock", 10, "stock"), row("a", "defaults", 15), row("a", "branch", 40, exact=False),
               row("b", "stock", 10, "stock"), row("b", "exact", 22), row("b", "merge_off", 21)]
    assert gpu_check.best_row(results, cells) == (cells["b"], "exact")


def test_the_kernel_counter_sees_every_packed_attention_call(tokenizer, tmp_path):
    """`recording_kernels` wraps the plugin's kernel chooser (`seam.kernels._choose`, a private it pins here): one
    count per packed attention call, named by kernel and query dtype; the plugin's own name agrees."""
    from datasets import Dataset

    from tiny import build_trainer, first_batch, preference_rows
    from trl_pruned_dpo import PrunedDPOConfig, PrunedDPOTrainer

    trainer = build_trainer(PrunedDPOTrainer, PrunedDPOConfig, tokenizer, Dataset.from_list(preference_rows(8)),
                            tmp_path, per_device_train_batch_size=4)
    trainer.model.train()
    with gpu_check.recording_kernels() as counts:
        trainer.compute_loss(trainer.model, first_batch(trainer)).backward()
    layers = len(trainer.model.model.layers)
    assert set(counts) == {"sdpa_per_segment float32"} and counts["sdpa_per_segment float32"] >= 2 * layers
    assert gpu_check.logged_kernel(trainer) == "SDPA per segment"
