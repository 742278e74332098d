"""Launched by tests/test_multirank_safety.py under `accelerate launch --num_processes 2` (CPU, gloo): failures on one
rank, recorded per rank in OUT/rank<r>.json.

1. `disk_full`: the pruned trainer saves checkpoint-2, then rank 1 alone runs out of disk while writing checkpoint-4
   (its RNG state, as torch.save fails on a full disk). Every rank must end with the same one-line DiskFullError and
   nobody may wait at a barrier for rank 1.
2. `early_error`: inside the CLI's `_OutputGuard` and output lock, rank 1 fails before any checkpoint exists; rank 0
   (still running) records whether its output folder and lock file survived rank 1's failure.
3. `stop_signal`: SIGTERM reaches rank 1 alone; both ranks must stop after the same step, with its checkpoint.
4. `refused_data`: every pair degenerate; the data checks run on rank 0 only and both ranks refuse alike.
"""

import errno
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]
from tiny import QUIET_TRAINING, build_trainer, char_tokenizer, preference_rows  # noqa: E402
from datasets import Dataset  # noqa: E402

from trl_pruned_dpo import PrunedDPOConfig, PrunedDPOTrainer  # noqa: E402
from trl_pruned_dpo.cli import _OutputGuard  # noqa: E402
from trl_pruned_dpo.safety.output_dir import LOCK_NAME, output_lock  # noqa: E402


def disk_full(out: Path, rank: int) -> dict:
    original = torch.save

    def full_on_rank_1(obj, f, *args, **kwargs):
        if rank == 1 and "checkpoint-4" in str(f):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing file "
                               "data/0: file write failed") from OSError(errno.ENOSPC, "No space left on device")
        return original(obj, f, *args, **kwargs)

    torch.save = full_on_rank_1
    trainer = build_trainer(PrunedDPOTrainer, PrunedDPOConfig, char_tokenizer(), Dataset.from_list(preference_rows(16)),
                            out / "disk_full", **{**QUIET_TRAINING, "max_steps": 6, "save_strategy": "steps",
                                                 "save_steps": 2, "per_device_train_batch_size": 2,
                                                 "ddp_backend": "gloo", "branch_keep_prob": 0.5})
    started = time.monotonic()
    try:
        trainer.train()
        return {"raised": None, "step": trainer.state.global_step}
    except Exception as error:  # noqa: BLE001 - recorded for the test
        return {"raised": type(error).__name__, "message": str(error), "seconds": time.monotonic() - started,
                "step": trainer.state.global_step, "traceback": traceback.format_exc()[-2000:]}
    finally:
        torch.save = original


def early_error(out: Path, rank: int) -> dict:
    """Rank 1 builds its guard before the folder exists (so a guard on every rank would think it created it), then
    fails while rank 0 holds the folder and its lock."""
    folder, flags = out / "early" / "run", out / "early"
    flags.mkdir(parents=True, exist_ok=True)

    def wait(name):
        deadline = time.monotonic() + 60
        while not (flags / name).exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        return (flags / name).exists()

    if rank == 1:
        guard = _OutputGuard(str(folder))
        (flags / "rank1-guard").write_text("1")
        wait("rank0-locked")
        try:
            with guard:
                raise ValueError("rank 1 fails before any checkpoint")
        except ValueError as error:
            (flags / "rank1-failed").write_text("1")
            return {"raised": str(error)}
    wait("rank1-guard")
    with _OutputGuard(str(folder)), output_lock(str(folder)):
        (flags / "rank0-locked").write_text("1")
        saw = wait("rank1-failed")
        return {"saw_failure": saw, "folder_kept": folder.is_dir(), "lock_kept": (folder / LOCK_NAME).exists()}


def stop_signal(out: Path, rank: int) -> dict:
    """SIGTERM reaches rank 1 only, during step 3: both ranks stop after the same step, with its checkpoint (the flag
    rides on the guard's one fused read per step: guards.check_step)."""
    import signal

    from transformers import TrainerCallback

    from trl_pruned_dpo.safety.signals import stop_on_signals

    trainer = build_trainer(PrunedDPOTrainer, PrunedDPOConfig, char_tokenizer(), Dataset.from_list(preference_rows(16)),
                            out / "stop", **{**QUIET_TRAINING, "max_steps": 8, "per_device_train_batch_size": 2,
                                             "ddp_backend": "gloo", "branch_keep_prob": 0.5})

    class SignalRank1(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if rank == 1 and state.global_step == 2:
                os.kill(os.getpid(), signal.SIGTERM)

    trainer.add_callback(SignalRank1())
    with stop_on_signals(trainer) as request:
        trainer.train()
    return {"step": trainer.state.global_step, "signalled": request.signal_number is not None,
            "checkpoint": request.checkpoint is not None or (out / "stop" / "checkpoint-3").is_dir()}


def refused_data(out: Path, rank: int) -> dict:
    """Every pair degenerate: checked on rank 0 only (data_checks.py), refused on both ranks with the same error."""
    from trl_pruned_dpo.safety import data_checks

    rows = [{**row, "rejected": row["chosen"]} for row in preference_rows(8)]
    calls, original = [], data_checks.pair_findings
    data_checks.pair_findings = lambda *args: calls.append(1) or original(*args)
    try:
        build_trainer(PrunedDPOTrainer, PrunedDPOConfig, char_tokenizer(), Dataset.from_list(rows), out / "refused",
                      **{**QUIET_TRAINING, "ddp_backend": "gloo", "position_keep_prob": 0.5})
    except ValueError as error:
        return {"raised": type(error).__name__, "message": str(error), "scans": len(calls)}
    finally:
        data_checks.pair_findings = original
    return {"raised": None, "scans": len(calls)}


def main():
    out = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    report = {"early_error": early_error(out, rank)}
    report["disk_full"] = disk_full(out, rank)
    report["stop_signal"] = stop_signal(out, rank)
    report["refused_data"] = refused_data(out, rank)
    (out / f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
