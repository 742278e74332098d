"""Equal time's step counts (docs/study.md, "Changes", 2026-12-05): each setting's training user CPU per step,
measured once per task, before any cell, interleaved, in one process, on the same batches.

Why: step counts computed from separate runs follow the machine's load (10-25% between runs here) more than the
settings' cost differences (a few percent to ~20%). Here every setting's trainer is built in one process with the same
seed (so the same batches, in the same order: the first steps of the same run) and its `train()` runs in its own
thread, held at each step's start until its turn: only one trainer computes at a time, so the process's user CPU
over a step is that step's. After `WARMUP_STEPS` unmeasured steps each (lazy initialisation), `ROUNDS` rounds run
`STEPS_PER_ROUND` steps of each setting in turn, the order rotated each round, so load drifts reach every setting
alike. A setting's cost is the median of its measured steps; its equal-time step count is
N = round(steps x cost(exact preset) / cost(setting)).

The result is one JSON file next to the store (`study_calibration.json`, one entry per task), committed before any
equal-time cell runs; the equal-time arm refuses to run without it (real_models.py).

`auto`'s cost is that of its first steps, its warm-up probes (exact and position-at-1/2 steps, each measuring gradient
norms): if it later keeps fewer positions, or measures less, its steps get cheaper, so its N may be below what its own
CPU would allow (an error against `auto`); the CPU each equal-time run used is recorded and reported beside it.
"""

import ctypes
import datetime
import fcntl
import hashlib
import json
import os
import resource
import statistics
import tempfile
import threading
from pathlib import Path

from transformers import TrainerCallback

from .real_run import SETTINGS, build_trainer, user_cpu_seconds

CALIBRATION_FILE = "study_calibration.json"
WARMUP_STEPS, ROUNDS, STEPS_PER_ROUND = 1, 3, 4
CALIBRATION_SEED = 100  # not a study seed: nothing measured here is scored


class _Turns:
    """Lets one trainer thread at a time run a given number of steps; the others wait at their next step's start."""

    def __init__(self):
        self.condition = threading.Condition()
        self.turn, self.left = None, 0
        self.waiting, self.finished, self.errors = set(), set(), {}

    def wait(self, name: str):
        with self.condition:
            self.waiting.add(name)
            self.condition.notify_all()
            self.condition.wait_for(lambda: self.turn == name and self.left > 0)
            self.waiting.discard(name)

    def step_done(self):
        with self.condition:
            self.left -= 1
            self.condition.notify_all()

    def end(self, name: str, error: BaseException | None = None):
        with self.condition:
            self.finished.add(name)
            if error is not None:
                self.errors[name] = error
            self.condition.notify_all()

    def parked(self, name: str):
        """Wait until `name` waits at a step's start (or has ended)."""
        with self.condition:
            self.condition.wait_for(lambda: name in self.waiting or name in self.finished)
        if name in self.errors:
            raise RuntimeError(f"calibration of {name} failed") from self.errors[name]

    def run(self, name: str, steps: int):
        """Give `name` `steps` steps and wait until it is parked again (or has ended); then hand the memory its
        steps freed back to the system (`release_free_memory`)."""
        with self.condition:
            self.turn, self.left = name, steps
            self.condition.notify_all()
            self.condition.wait_for(lambda: self.left == 0 and (name in self.waiting or name in self.finished)
                                    or name in self.finished)
        if name in self.errors:
            raise RuntimeError(f"calibration of {name} failed") from self.errors[name]
        release_free_memory()


def release_free_memory():
    """glibc keeps each thread's freed memory in that thread's arena: five trainers' threads would each hold a step's
    peak (~3-4 GB on SmolLM2 at 8 pairs). `malloc_trim(0)` returns every arena's free pages; done between turns,
    while every trainer is parked, it costs no measured step anything."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


class _TimedTurns(TrainerCallback):
    """Holds its trainer at each step's start until its turn, and records the step's user CPU."""

    def __init__(self, turns: _Turns, name: str, total_steps: int):
        self.turns, self.name, self.total = turns, name, total_steps
        self.step_user, self.started = [], None

    def on_step_begin(self, args, state, control, **kwargs):
        import torch

        self.turns.wait(self.name)
        self.threads = torch.get_num_threads()  # this thread's: one, as in the cells
        self.started = user_cpu_seconds()

    def on_step_end(self, args, state, control, **kwargs):
        self.step_user.append(user_cpu_seconds() - self.started)
        if len(self.step_user) >= self.total:
            control.should_training_stop = True
        self.turns.step_done()


def measure(model_path: str, spec, plan, settings, train_rows, eval_rows, log, warmup: int = WARMUP_STEPS,
            rounds: int = ROUNDS, per_round: int = STEPS_PER_ROUND) -> dict:
    """{"step_user": {setting: measured steps' user CPU}, "order": [each round's order]}: see the module doc."""
    turns, callbacks, threads = _Turns(), {}, {}
    total = warmup + rounds * per_round
    with tempfile.TemporaryDirectory(prefix="study_calibration_") as scratch:
        for name in settings:  # one at a time: each parks at its first step's start before the next is built
            trainer = build_trainer(model_path, spec, plan, SETTINGS[name], CALIBRATION_SEED, train_rows, eval_rows,
                                    os.path.join(scratch, name))
            callbacks[name] = _TimedTurns(turns, name, total)
            trainer.add_callback(callbacks[name])

            def train(trainer=trainer, name=name):
                try:
                    trainer.train()
                except BaseException as error:  # noqa: BLE001 - handed to the measuring thread
                    turns.end(name, error)
                else:
                    turns.end(name)

            threads[name] = threading.Thread(target=train, name=f"calibrate-{name}", daemon=True)
            threads[name].start()
            turns.parked(name)
            release_free_memory()
        for name in settings:
            turns.run(name, warmup)
        order = []
        for round_ in range(rounds):
            shift = round_ % len(settings)
            this_round = list(settings[shift:]) + list(settings[:shift])
            order.append(this_round)
            for name in this_round:
                turns.run(name, per_round)
            log(f"  calibration round {round_ + 1} of {rounds}: " + ", ".join(
                f"{name} {statistics.median(callbacks[name].step_user[warmup:]):.2f} s" for name in settings))
        for name in settings:
            threads[name].join()
    return {"step_user": {name: callbacks[name].step_user[warmup:] for name in settings}, "order": order,
            "threads": max(callback.threads for callback in callbacks.values())}


def summarize(measured: dict, steps: int) -> dict:
    """Each setting's median step cost, its ratio to the exact preset's and its equal-time step count."""
    medians = {name: statistics.median(costs) for name, costs in measured["step_user"].items()}
    return {"median_step_user_s": {k: round(v, 4) for k, v in medians.items()},
            "cost_ratio": {k: round(v / medians["exact"], 4) for k, v in medians.items()},
            "equal_time_steps": {k: max(1, round(steps * medians["exact"] / v)) for k, v in medians.items()}}


def calibrate(task: str, model: str, model_path: str, spec, plan, train_rows, eval_rows, provenance: dict,
              data: str, path: Path, log, settings: list[str], **schedule) -> dict:
    """Measure `settings` (the exact preset first), then write this task's entry of the calibration file at `path`
    (other tasks' entries kept)."""
    _refuse_a_second(path, task)
    load = os.getloadavg()[0]
    measured = measure(model_path, spec, plan, settings, train_rows, eval_rows, log, **schedule)
    entry = {"model": model, "steps": plan.steps, "seed": CALIBRATION_SEED,
             "warmup_steps": schedule.get("warmup", WARMUP_STEPS), "rounds": schedule.get("rounds", ROUNDS),
             "steps_per_round": schedule.get("per_round", STEPS_PER_ROUND), **summarize(measured, plan.steps),
             "step_user": {k: [round(x, 4) for x in v] for k, v in measured["step_user"].items()},
             "order": measured["order"], "threads": measured["threads"],
             "max_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20, 2),
             "provenance": provenance, "data": data,
             "load": [round(load, 2), round(os.getloadavg()[0], 2)],
             "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    path.parent.mkdir(parents=True, exist_ok=True)
    name = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]
    lock_path = Path(tempfile.gettempdir()) / f"study_calibration-{name}.lock"
    with open(lock_path, "w") as lock:  # two tasks calibrated at once share the file
        fcntl.flock(lock, fcntl.LOCK_EX)
        _refuse_a_second(path, task)
        entries = json.loads(path.read_text()) if path.is_file() else {}
        entries[task] = entry
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(entries, indent=1, sort_keys=True) + "\n")
        tmp.replace(path)
    return entry


def _refuse_a_second(path: Path, task: str):
    """A task is calibrated once: its N are fixed before any cell (docs/study.md). Another calibration (e.g. for
    settings run later as an extension) goes to another file (`--calibration`)."""
    if path.is_file() and task in json.loads(path.read_text()):
        raise SystemExit(f"{path} already holds the calibration of {task}: it is fixed before any cell; measure other "
                         "settings into another file (--calibration PATH)")


def table(entries: dict) -> str:
    """docs/study.md's table of the calibration: per task and setting, the median step cost, ratio and N."""
    lines = ["| task | setting | median user CPU per step | / exact preset | equal-time steps N |",
             "|---|---|---|---|---|"]
    for task, entry in sorted(entries.items()):
        for name in sorted(entry["median_step_user_s"], key=lambda n: n != "exact"):  # the exact preset first
            lines.append(f"| {task} | {name} | {entry['median_step_user_s'][name]:.2f} s | "
                         f"{entry['cost_ratio'][name]:.3f} | {entry['equal_time_steps'][name]} |")
    return "\n".join(lines)


def equal_time_steps(path: Path, task: str, setting: str, provenance: dict, data: str, bypass: bool) -> int:
    """N of `setting` on `task` from the committed calibration file; refuses a missing, uncommitted, or foreign one
    (another commit or other data: `bypass`, the smoke protocol, skips the commit checks only)."""
    from .study_pin import committed

    if not path.is_file():
        raise SystemExit(f"no calibration at {path}: run --calibrate first (docs/study.md), and commit it")
    entry = json.loads(path.read_text()).get(task)
    if entry is None:
        raise SystemExit(f"{path} has no calibration of {task}: run --calibrate --tasks {task} first")
    if entry["data"] != data:
        raise SystemExit(f"{path}'s calibration of {task} was measured on other data ({entry['data']} != {data})")
    if not bypass:
        if entry["provenance"]["commit"] != provenance["commit"]:
            raise SystemExit(f"{path}'s calibration of {task} was measured at {entry['provenance']['commit']}, not at "
                             f"this checkout's {provenance['commit']}: calibrate at the pinned commit")
        if not committed(path):
            raise SystemExit(f"{path} is not committed: commit it (with its table in docs/study.md) before the "
                             "equal-time arm runs")
    return entry["equal_time_steps"][setting]
