"""The real-model study: stock `DPOTrainer` against the plugin's settings on real models and real text, resumable.

    python -m evaluation.real_models                       # every cell not yet stored (stages: see GRID below)
    python -m evaluation.real_models --models smollm2 --tasks python-docs --seeds 0 1 2
    python -m evaluation.real_models --report              # tables + plot from what is stored (docs/img/, stdout)
    python -m evaluation.real_models --smoke               # the tiny built-in model, every setting, < 30 s (CI)
    python -m evaluation.real_models --plan prereg --tasks docstrings-near   # the pre-registered study (docs/study.md)

A cell is (model, task, setting, seed) at the plan's steps; each finished cell is appended to the store (one JSON line,
`evaluation/results/real_models.jsonl`) as it ends, keyed by a fingerprint of everything that determines it, so
re-running skips what is stored and an interrupted study resumes at the next cell. Run it at one torch thread
(`OMP_NUM_THREADS=1`, set here); its clock is this process's CPU time, which other processes on the machine do not
move (run it under `nice` on a shared machine: niceness changes wall time only).

Models (MODELS): SmolLM2-135M-Instruct (an instruct model: DPO from it directly) and Gemma 3 270M (a base model: a
short SFT warm start on the task's chosen answers first, cached once per task), both with LoRA; and SmolLM2 with full
fine-tuning (`smollm2-full`). Tasks (TASKS): the two
real-text built-ins of trl_pruned_dpo/demo/realtext.py. Settings (SETTINGS): stock, the exact preset, the exact preset
plus each of the paper's three estimators at 0.5 and all three, and `auto`.

`--plan prereg` is the pre-registered study of docs/study.md (its design as amended under "Changes", 2026-12-05):
`smollm2-study` (SmolLM2 LoRA r16, 8 pairs per step, learning rate 5e-5, linear warm-up over 10% of the steps, then
linear decay to 0) on `docstrings-near` and `docstrings-far` (evaluation/study_tasks.py), 100 steps, every held-out
pair at steps 5, 10, 15, 25, 50, 75, 100 (each pair's margin kept), the trainer's divergence stop off (every run ends;
divergence is judged afterwards), stored in `evaluation/results/study.jsonl`. Per seed two arms: *equal steps* (every
setting 100 steps; stock on `--stock-seeds` only) and *equal time*: every setting again over its N steps, N from the
per-step costs measured once per task by `--calibrate` (evaluation/study_calibration.py), evaluated at its end. Study
cells run only from a clean checkout of the pinned commit (`--pin`; evaluation/study_pin.py), and each cell's key holds
that commit, the libraries' versions, the data's hash and the rules' hash.
"""

import os

# One torch thread, forced (not defaulted): every clock of the studies is one core's. Set before torch is imported.
os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from dataclasses import replace  # noqa: E402
from pathlib import Path  # noqa: E402

from . import store  # noqa: E402
from .real_run import SETTINGS, ModelSpec, RunPlan, key_fields  # noqa: E402

MODELS = {
    "smollm2": ModelSpec(path="builtin:smollm2-135m-instruct", pairs=4, learning_rate=1e-3),
    # Full fine-tuning (every weight, Adam; the reference a frozen copy): where the paper's branch-pruning limit applies.
    "smollm2-full": ModelSpec(path="builtin:smollm2-135m-instruct", pairs=4, learning_rate=1e-5, lora_r=0),
    "gemma3": ModelSpec(path="builtin:gemma3-270m", pairs=4, learning_rate=1e-3,
                        warm_start={"steps": 60, "batch_size": 4, "learning_rate": 2e-5, "warmup": 5}),
    # The smoke test's: the demo's 2-layer random init, a base model, so the warm-start path runs too.
    "tiny": ModelSpec(path="builtin:tiny-demo", pairs=2, learning_rate=1e-3, max_length=512,
                      lora_targets=("q_proj", "v_proj"), warm_start={"steps": 2, "batch_size": 2,
                                                                      "learning_rate": 1e-3, "warmup": 1}),
    "tiny-full": ModelSpec(path="builtin:tiny-demo", pairs=2, learning_rate=1e-4, max_length=512, lora_r=0),
    # The pre-registered study's (docs/study.md): a DPO-typical LoRA learning rate, warm-up and decay, 8 pairs per step.
    "smollm2-study": ModelSpec(path="builtin:smollm2-135m-instruct", pairs=8, learning_rate=5e-5,
                               lr_scheduler="linear", warmup_ratio=0.1),
    "tiny-study": ModelSpec(path="builtin:tiny-demo", pairs=2, learning_rate=1e-3, max_length=512,
                            lora_targets=("q_proj", "v_proj"), lr_scheduler="linear", warmup_ratio=0.1,
                            warm_start={"steps": 2, "batch_size": 2, "learning_rate": 1e-3, "warmup": 1}),
}
TASKS = {"python-docs": "builtin:python-docs", "python-docstrings": "builtin:python-docstrings",
         # The pre-registered study's: near-copy and dissimilar rejections, otherwise the same pairs (study_tasks.py)
         "docstrings-near": "study:docstrings-near", "docstrings-far": "study:docstrings-far"}
ALL = 10 ** 6  # "every held-out pair" (capped by the split)
PLANS = {"study": RunPlan(steps=20, evals=(10, 20), eval_pairs=224, curve_pairs=64),
         "smoke": RunPlan(steps=2, evals=(1, 2), eval_pairs=4, curve_pairs=2, eval_batch=4),
         "prereg": RunPlan(steps=100, evals=(5, 10, 15, 25, 50, 75, 100), eval_pairs=ALL, curve_pairs=ALL,
                           stop_on_divergence=False, pair_margins=True),
         "prereg-smoke": RunPlan(steps=4, evals=(1, 2, 4), eval_pairs=4, curve_pairs=4, eval_batch=4,
                                 stop_on_divergence=False, train_pairs=64, pair_margins=True)}
# The pre-registered study (docs/study.md, as amended under "Changes"): its settings (seed k runs them in this order
# rotated by k, so that no setting always runs first or last), the settings with an equal-time arm, its model and
# tasks, the seeds stock runs on (one shows stock's accuracy is the exact preset's). Branch 0.5 and all three at 0.5
# were cut to fit the compute (docs/study.md, "Changes", 2026-12-05, 6); `--settings` still runs them, outside the
# study's settings.
PREREG = {"settings": ["exact", "stock", "position", "auto"], "equal_time": ["position", "auto"],
          "models": ["smollm2-study"],
          "tasks": ["docstrings-near", "docstrings-far"], "seeds": [0, 1, 2, 3, 4], "stock_seeds": [0]}
STORE = store.REPO / "evaluation" / "results" / "real_models.jsonl"
STUDY_STORE = store.REPO / "evaluation" / "results" / "study.jsonl"
WORK = store.REPO / "runs" / "real_models"  # warm starts; git-ignored


def _log(message: str):
    print(f"[{datetime.datetime.now():%H:%M:%S}] {message}", flush=True)


# The first study's `auto` rules, for its cells' keys only (kept so its stored cells keep their keys). The
# pre-registered study's keys hold a hash of the rules' source files instead (study_pin.rules_hash), and more.
AUTO_RULES = "adapters keep branches"


def cell_key(model: str, task: str, setting: str, seed: int, spec: ModelSpec, plan: RunPlan,
             pin: dict | None = None) -> str:
    """What determines a cell's result: a change to any of these runs it anew (fields added later, at their
    defaults, are left out: the first study's cells keep their keys). `pin` (the pre-registered study's): the
    commit, dirty flag, libraries' versions and rules' hash (study_pin.Provenance) and the data's hash."""
    if pin is not None:
        return store.fingerprint(model, task, setting, SETTINGS[setting], seed, key_fields(spec), key_fields(plan),
                                 pin)
    rules = (AUTO_RULES,) if setting == "auto" else ()
    return store.fingerprint(model, task, setting, SETTINGS[setting], seed, key_fields(spec), key_fields(plan), *rules)


def load_task(task: str, train_pairs: int | None = None):
    """(train rows, held-out rows) of a task: a builtin, or one of the pre-registered study's (data seed 0)."""
    name = TASKS[task]
    if name.startswith("study:"):
        from .study_tasks import make_study_splits

        splits = make_study_splits(name.split(":", 1)[1], seed=0)
    else:
        from trl_pruned_dpo.demo import load_builtin

        splits = load_builtin(name, seed=0)
    train = splits["train"]
    if train_pairs is not None:
        train = train.select(range(min(train_pairs, len(train))))
    return train, splits["test"]


def stored(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def append(path: Path, record: dict):
    """One line, in one write to a file opened for appending: two processes (one per task) can share a store."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = (json.dumps(record) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        written = os.write(fd, data)
        while written < len(data):  # a regular file takes it whole; only a full disk writes less
            written += os.write(fd, data[written:])
        os.fsync(fd)
    finally:
        os.close(fd)


def _prepare(model: str, task: str, spec: ModelSpec, plan: RunPlan, work: Path, rows=None):
    """(model folder, train rows, held-out rows) of a (model, task): the model's warm start built or read first.
    `rows`: (train rows, held-out rows) already loaded."""
    from trl_pruned_dpo.demo import resolve_model

    from .real_run import warm_start_folder

    if rows is None:
        train_rows, test = load_task(task, plan.train_pairs)
        eval_rows = test.select(range(min(plan.eval_pairs, len(test))))
    else:
        train_rows, eval_rows = rows
    path = resolve_model(spec.path)
    if spec.warm_start:
        work.mkdir(parents=True, exist_ok=True)
        path = warm_start_folder(path, task, train_rows, spec.warm_start, work, log=_log)
    return path, train_rows, eval_rows


def _run_cell(store_path: Path, model: str, task: str, setting: str, seed: int, spec: ModelSpec, plan: RunPlan,
              steps_name: str, prepared, reference: dict, key: str | None = None, **fields) -> dict:
    """Train one cell and append its record to the store; returns the record. `key`: the pre-registered study's
    (with its pin); `fields` go into the record."""
    from .real_run import train_one

    path, train_rows, eval_rows = prepared
    _log(f"{model} x {task} x {setting} x seed {seed}: {plan.steps} steps of {spec.pairs} pairs")
    load = os.getloadavg()[0]  # the machine's 1-minute load average at the start and the end (other jobs move CPU time)
    commit = fields.pop("commit", None) or store.commit()  # read before the cell runs
    result = train_one(path, spec, plan, SETTINGS[setting], seed, train_rows, eval_rows, reference, log=_log)
    if steps_name != "study":  # (the first study's records have no such field)
        fields["load"] = [round(load, 2), round(os.getloadavg()[0], 2)]
    record = {"key": key or cell_key(model, task, setting, seed, spec, plan), "model": model, "task": task,
              "setting": setting, "seed": seed, "plan": steps_name, **fields, "steps": plan.steps,
              "pairs": spec.pairs, "training": f"LoRA r{spec.lora_r}" if spec.lora_r else "full",
              "eval_pairs": len(eval_rows), "reference_cpu": reference.get("cpu"),
              "commit": commit, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                  timespec="seconds"), **result}
    if "provenance" in fields:  # the checkout must still be the code that ran (study_pin.check_unchanged)
        from .study_pin import Provenance, check_unchanged

        check_unchanged(Provenance(**fields["provenance"]))
    append(store_path, record)
    final = result["curve"][-1]
    _log(f"  stored: accuracy {final['accuracy']:.3f}, margin {final['margin']:+.4f}, train CPU "
         f"{final['cpu']:.1f} s" + (f", auto chose {result['auto_choice']}" if "auto_choice" in result else "")
         + (f", DIVERGED: {result['divergence']}" if result.get("divergence") else ""))
    return record


def run_grid(models, tasks, settings, seeds, plan: RunPlan, store_path: Path, work: Path, steps_name: str) -> int:
    done = {r["key"] for r in stored(store_path)}
    ran = 0
    for model in models:
        spec = MODELS[model]
        for task in tasks:
            cells = [(s, seed) for seed in seeds for s in settings
                     if cell_key(model, task, s, seed, spec, plan) not in done]
            if not cells:
                _log(f"{model} x {task}: every cell stored")
                continue
            prepared = _prepare(model, task, spec, plan, work)
            reference = {}  # the reference's held-out log-probabilities, shared by this (model, task)'s cells
            for setting, seed in cells:
                _run_cell(store_path, model, task, setting, seed, spec, plan, steps_name, prepared, reference)
                ran += 1
    return ran


def equal_time_plan(plan: RunPlan, steps: int) -> RunPlan:
    """The equal-time arm's plan of a setting (docs/study.md, "Changes"): its schedule (the same warm-up share and
    decay to 0) over its N steps (from the calibration), evaluated at its end."""
    return replace(plan, steps=steps, evals=(steps,))


def equal_time_settings(settings: list[str]) -> list[str]:
    """The settings with an equal-time arm: the study's (PREREG), and any other pruned one asked for by `--settings`."""
    return [s for s in settings if s in PREREG["equal_time"] or s not in PREREG["settings"] and s != "stock"]


def seed_order(settings: list[str], seed: int) -> list[str]:
    """The settings in the order `seed` runs them: rotated by one per seed (by its number, so a seed run alone keeps
    its order), so that no setting always runs first or last."""
    shift = seed % len(settings) if settings else 0
    return settings[shift:] + settings[:shift]


def _study_pin(store_path: Path, bypass: bool):
    """The pre-registered study's provenance, read once (the code this process imported), after the pin checks."""
    from .study_pin import Provenance, check_runnable

    provenance = Provenance.read()
    check_runnable(provenance, store_path.parent, bypass)
    return provenance


def _task_data(task: str, plan: RunPlan):
    """(train rows, held-out rows as evaluated, their hash)."""
    from .study_pin import data_hash

    train_rows, test = load_task(task, plan.train_pairs)
    eval_rows = test.select(range(min(plan.eval_pairs, len(test))))
    return train_rows, eval_rows, data_hash(train_rows, eval_rows)


def run_prereg(models, tasks, settings, seeds, stock_seeds, plan: RunPlan, store_path: Path, work: Path,
               steps_name: str, calibration: Path, bypass: bool = False) -> int:
    """The pre-registered study (docs/study.md), resumable: per (model, task) and seed, the equal-steps arm, then the
    equal-time arm (N steps each, from `calibration`, which must exist: it refuses otherwise). `bypass` (the smoke
    protocol, `--allow-dirty`): run from a dirty or unpinned checkout and an uncommitted calibration (its records
    carry the dirty flag, and the commit, in their key)."""
    from .study_calibration import equal_time_steps

    provenance = _study_pin(store_path, bypass)
    settings = [s for s in PREREG["settings"] if s in settings] + [s for s in settings if s not in PREREG["settings"]]
    done = {r["key"]: r for r in stored(store_path)}
    ran = 0
    for model in models:
        spec = MODELS[model]
        for task in tasks:
            train_rows, eval_rows, data = _task_data(task, plan)
            pin = {**provenance.key(), "data": data}
            timed = {s: equal_time_steps(calibration, task, s, provenance.key(), data, bypass)
                     for s in settings if s in equal_time_settings(settings)}
            prepared, reference = None, {}

            def run_once(setting: str, seed: int, cell_plan: RunPlan, arm: str, **fields) -> int:
                """One cell of this model and task unless it is stored; 1 if it ran."""
                nonlocal prepared
                key = cell_key(model, task, setting, seed, spec, cell_plan, pin)
                if key in done:
                    return 0
                from .study_pin import check_unchanged

                check_unchanged(provenance)
                prepared = prepared or _prepare(model, task, spec, plan, work, (train_rows, eval_rows))
                done[key] = _run_cell(store_path, model, task, setting, seed, spec, cell_plan, steps_name, prepared,
                                      reference, key=key, arm=arm, provenance=provenance.key(), data=data,
                                      commit=provenance.commit, dirty=provenance.dirty, **fields)
                return 1

            for seed in seeds:
                order = seed_order([s for s in settings if s != "stock" or seed in stock_seeds], seed)
                for setting in order:
                    ran += run_once(setting, seed, plan, "steps", **(
                        {"equal_time_steps": timed[setting]} if setting in timed else {}))
                for setting in (s for s in order if s in timed):
                    if timed[setting] == plan.steps:  # its equal-time run is its equal-steps run (the report reads it)
                        continue
                    ran += run_once(setting, seed, equal_time_plan(plan, timed[setting]), "time",
                                    equal_time_steps=timed[setting])
            if prepared is None:
                _log(f"{model} x {task}: every cell stored")
    return ran


def run_calibration(models, tasks, settings, plan: RunPlan, store_path: Path, work: Path, calibration: Path,
                    bypass: bool, smoke: bool) -> None:
    """`--calibrate`: equal time's per-step costs of the exact preset and every setting of `settings` with an
    equal-time arm, per task (study_calibration.py); writes `calibration` and prints docs/study.md's table."""
    from .study_calibration import calibrate, table

    provenance = _study_pin(store_path, bypass)
    schedule = {"warmup": 1, "rounds": 2, "per_round": 1} if smoke else {}
    for model in models:
        spec = MODELS[model]
        for task in tasks:
            train_rows, eval_rows, data = _task_data(task, plan)
            path, _, _ = _prepare(model, task, spec, plan, work, (train_rows, eval_rows))
            _log(f"{model} x {task}: calibrating equal time's step costs (interleaved, one process)")
            entry = calibrate(task, model, path, spec, plan, train_rows, eval_rows, provenance.key(), data,
                              calibration, _log, ["exact", *equal_time_settings(settings)], **schedule)
            _log(f"  N per setting: {entry['equal_time_steps']} (cost / exact preset: {entry['cost_ratio']})")
    print(table(json.loads(calibration.read_text())))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m evaluation.real_models", description=__doc__.split("\n\n")[0])
    parser.add_argument("--plan", default="study", choices=["study", "prereg"],
                        help="study: the first study (20 steps of 4 pairs); prereg: docs/study.md's")
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS),
                        help="default: smollm2 (study), smollm2-study (prereg)")
    parser.add_argument("--tasks", nargs="+", choices=sorted(TASKS),
                        help="default: python-docs (study), docstrings-near docstrings-far (prereg)")
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), help="default: every setting of the plan")
    parser.add_argument("--seeds", nargs="+", type=int, help="default: 0 1 2 (study), 0 1 2 3 4 (prereg)")
    parser.add_argument("--stock-seeds", nargs="+", type=int, default=PREREG["stock_seeds"],
                        help="prereg: the seeds stock runs on (default: %(default)s)")
    parser.add_argument("--steps", type=int, help="optimizer steps per run (study: evaluations half-way and at the "
                        "end; prereg: at the plan's fractions of the run)")
    parser.add_argument("--store", type=Path, help=f"the JSON-lines result store (default: {STORE} for the study, "
                        f"{STUDY_STORE} for prereg); prereg: its pin (study_pin.txt) and calibration "
                        "(study_calibration.json) sit next to it, so a pinned checkout can write into another's")
    parser.add_argument("--work", type=Path, default=WORK, help="where warm starts are cached (default: %(default)s)")
    parser.add_argument("--report", action="store_true", help="write the tables and the plot from the store "
                        "(prereg: docs/study.md's analysis, printed)")
    parser.add_argument("--docs", type=Path, default=store.REPO / "docs",
                        help="where --report writes img/real_models.png and updates quality.md (prereg: "
                        "img/study_<model>_<task>.png)")
    parser.add_argument("--smoke", action="store_true", help="the tiny built-in model (`--models tiny-full`: full "
                        "fine-tuning), every setting, 2 steps (prereg: 4 steps, calibration if missing, both arms, "
                        "from any checkout)")
    parser.add_argument("--pin", action="store_true", help="prereg: pin this clean checkout's commit as the study's "
                        "(writes study_pin.txt next to the store)")
    parser.add_argument("--calibrate", action="store_true", help="prereg: measure equal time's per-step costs "
                        "(interleaved, one process; evaluation/study_calibration.py) into the calibration file")
    parser.add_argument("--calibration", type=Path, help="prereg: the calibration file (default: "
                        "study_calibration.json next to the store)")
    parser.add_argument("--pin-commit", help="prereg --report: the pin whose cells are tabulated (default: "
                        "study_pin.txt next to the store)")
    parser.add_argument("--allow-dirty", action="store_true", help="prereg: run from a dirty or unpinned checkout "
                        "and an uncommitted calibration (not the study: its cells' keys and records say so)")
    args = parser.parse_args(argv)
    prereg = args.plan == "prereg"
    store_path = args.store or (STUDY_STORE if prereg else STORE)
    import torch

    torch.set_num_threads(1)
    if args.report:
        if prereg:
            from .study_pin import read_pin
            from .study_report import write_study_report

            from .study_calibration import CALIBRATION_FILE

            pinned = args.pin_commit or read_pin(store_path.parent)
            calibration = args.calibration or store_path.parent / CALIBRATION_FILE
            entries = json.loads(calibration.read_text()) if calibration.is_file() else None
            return write_study_report(stored(store_path), sys.stdout, pinned, args.docs / "img", entries)
        from .real_report import write_report

        write_report(stored(store_path), sys.stdout, args.docs)
        return 0
    if args.pin:
        from .study_pin import PIN_FILE, write_pin

        commit = write_pin(store_path.parent)
        print(f"pinned the study at {commit} ({store_path.parent / PIN_FILE}): write it in docs/study.md, commit "
              f"the pin file, and run the study from `git worktree add <dir> {commit}`")
        return 0
    models = args.models or (PREREG["models"] if prereg else ["smollm2"])
    tasks = args.tasks or (PREREG["tasks"] if prereg else ["python-docs"])
    settings = args.settings or (PREREG["settings"] if prereg else list(SETTINGS))
    seeds = args.seeds if args.seeds is not None else (PREREG["seeds"] if prereg else [0, 1, 2])
    if args.smoke:
        tiny = [m for m in models if m.startswith("tiny")] or (["tiny-study"] if prereg else ["tiny"])
        plan, name, models, seeds = PLANS["prereg-smoke" if prereg else "smoke"], "smoke", tiny, seeds[:1]
    else:
        plan, name = PLANS[args.plan], args.plan
        if args.steps and prereg:
            fractions = [s / plan.steps for s in plan.evals]
            plan = replace(plan, steps=args.steps, evals=tuple(sorted({max(1, round(args.steps * f))
                                                                       for f in fractions})))
        elif args.steps:
            plan = replace(plan, steps=args.steps, evals=tuple(sorted({max(1, args.steps // 2), args.steps})))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if prereg:
        from .study_calibration import CALIBRATION_FILE

        calibration = args.calibration or store_path.parent / CALIBRATION_FILE
        bypass = args.smoke or args.allow_dirty
        if args.calibrate:
            run_calibration(models, tasks, settings, plan, store_path, args.work, calibration, bypass, args.smoke)
            return 0
        if args.smoke:  # the smoke protocol calibrates the tasks it has no calibration of
            have = json.loads(calibration.read_text()) if calibration.is_file() else {}
            if [t for t in tasks if t not in have]:
                run_calibration(models, [t for t in tasks if t not in have], settings, plan, store_path, args.work,
                                calibration, bypass, smoke=True)
        ran = run_prereg(models, tasks, settings, seeds, args.stock_seeds, plan, store_path, args.work, name,
                         calibration, bypass)
    else:
        ran = run_grid(models, tasks, settings, seeds, plan, store_path, args.work, name)
    _log(f"done: {ran} cell(s) run, results in {store_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
