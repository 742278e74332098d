"""Run-safety with two processes (CPU, gloo, `accelerate launch`): a failure on one rank ends every rank with the same
one-line error, without a hang; only the main process deletes (issue 22, item 4). The runner is
tests/distributed/run_failure.py; single-process marker writing is in tests/test_failures.py."""

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from trl_pruned_dpo.safety import checkpoints

ROOT = Path(__file__).resolve().parents[1]
RUNNER = ROOT / "tests" / "distributed" / "run_failure.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    out = tmp_path_factory.mktemp("multirank")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "ACCELERATE_USE_CPU": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(ROOT / "configs" / "accelerate" / "ddp.yaml"), "--num_processes", "2", "--mixed_precision", "no",
               "--main_process_port", str(free_port()), str(RUNNER), str(out)]
    proc = subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:  # the failure mode under test: a rank waiting for one that died
        # torch's elastic agent starts each worker in a session of its own: kill them by descent, then the group
        for child in psutil.Process(proc.pid).children(recursive=True):
            child.kill()
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"two-process run hung:\n{log[-6000:]}")
    assert proc.returncode == 0, log[-6000:]
    return out, {rank: json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)}


@pytest.mark.slow
def test_disk_full_on_rank_1_ends_every_rank_with_the_same_one_line_error(launched):
    out, reports = launched
    results = [reports[rank]["disk_full"] for rank in (0, 1)]
    assert [r["raised"] for r in results] == ["DiskFullError", "DiskFullError"], results
    assert results[0]["message"] == results[1]["message"] and "\n" not in results[0]["message"]
    assert "disk full while writing checkpoint-4" in results[0]["message"] and "checkpoint-2" in results[0]["message"]
    assert all(r["step"] == 4 for r in results) and all(r["seconds"] < 120 for r in results)
    run = out / "disk_full"
    assert not (run / "checkpoint-4").exists()  # removed by the main process
    assert checkpoints.last_complete(run).name == "checkpoint-2"
    assert not list(run.rglob("*.tmp"))  # no marker temporary left behind


@pytest.mark.slow
def test_only_the_main_process_removes_the_output_folder(launched):
    _, reports = launched
    assert reports[1]["early_error"] == {"raised": "rank 1 fails before any checkpoint"}
    assert reports[0]["early_error"] == {"saw_failure": True, "folder_kept": True, "lock_kept": True}


@pytest.mark.slow
def test_a_signal_on_one_rank_stops_both_after_the_same_step_with_a_checkpoint(launched):
    out, reports = launched
    results = [reports[rank]["stop_signal"] for rank in (0, 1)]
    assert [r["signalled"] for r in results] == [False, True]
    assert results[0]["step"] == results[1]["step"] == 3, results
    assert checkpoints.incomplete_reason(out / "stop" / "checkpoint-3") is None


@pytest.mark.slow
def test_data_checked_on_rank_0_refuse_on_both(launched):
    _, reports = launched
    results = [reports[rank]["refused_data"] for rank in (0, 1)]
    assert [r.pop("scans") for r in results] == [1, 0]  # scanned once, by the main process
    assert results[0] == results[1] and results[0]["raised"] == "ValueError"
    assert "Every training pair is degenerate" in results[0]["message"]
