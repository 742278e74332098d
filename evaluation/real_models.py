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

`--plan prereg` is the pre-registered study of docs/study.md: `smollm2-study` (SmolLM2 LoRA r16, 8 pairs per step,
learning rate 5e-5, linear warm-up over 10% of the steps, then linear decay to 0) on `docstrings-near` and
`docstrings-far` (evaluation/study_tasks.py), 100 steps, every held-out pair at steps 25/50/75/100, the trainer's
divergence stop off (every run ends; divergence is judged afterwards, docs/study.md), stored in
`evaluation/results/study.jsonl`. Per seed two arms: *equal steps* (every setting 100 steps; stock on `--stock-seeds`
only) and then *equal time*: every setting but the exact preset again, with the exact preset's training user CPU for
its 100 steps as its budget, its schedule laid over the steps it is expected to fit in the budget (100 x budget / its
own user CPU for 100 steps), stopped after the step in which the budget runs out and evaluated there. The exact
preset's equal-time reading is its step 100.
"""

import argparse
import datetime
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

from . import store
from .real_run import SETTINGS, ModelSpec, RunPlan, key_fields

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
         "prereg": RunPlan(steps=100, evals=(25, 50, 75, 100), eval_pairs=ALL, curve_pairs=ALL,
                           stop_on_divergence=False),
         "prereg-smoke": RunPlan(steps=4, evals=(2, 4), eval_pairs=4, curve_pairs=4, eval_batch=4,
                                 stop_on_divergence=False, train_pairs=64)}
# The pre-registered study: its settings in the order each seed runs them (the exact preset first: its time is the
# equal-time arm's budget), its model and tasks, the seeds stock runs on (one shows stock's accuracy is the exact
# preset's).
PREREG = {"settings": ["exact", "stock", "branch", "position", "all", "auto"], "models": ["smollm2-study"],
          "tasks": ["docstrings-near", "docstrings-far"], "seeds": [0, 1, 2, 3, 4], "stock_seeds": [0]}
STORE = store.REPO / "evaluation" / "results" / "real_models.jsonl"
STUDY_STORE = store.REPO / "evaluation" / "results" / "study.jsonl"
WORK = store.REPO / "runs" / "real_models"  # warm starts; git-ignored


def _log(message: str):
    print(f"[{datetime.datetime.now():%H:%M:%S}] {message}", flush=True)


# `auto`'s rules, for its cells' keys: a rule change runs them anew (the report keeps a cell's latest record).
# "adapters keep branches": on LoRA runs branch_keep_prob="auto" neither probes nor prunes branches (auto.py).
AUTO_RULES = "adapters keep branches"


def cell_key(model: str, task: str, setting: str, seed: int, spec: ModelSpec, plan: RunPlan) -> str:
    """What determines a cell's result: a change to any of these runs it anew (fields added later, at their
    defaults, are left out: the first study's cells keep their keys)."""
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


def _prepare(model: str, task: str, spec: ModelSpec, plan: RunPlan, work: Path):
    """(model folder, train rows, held-out rows) of a (model, task): the model's warm start built or read first."""
    from trl_pruned_dpo.demo import resolve_model

    from .real_run import warm_start_folder

    train_rows, test = load_task(task, plan.train_pairs)
    eval_rows = test.select(range(min(plan.eval_pairs, len(test))))
    path = resolve_model(spec.path)
    if spec.warm_start:
        work.mkdir(parents=True, exist_ok=True)
        path = warm_start_folder(path, task, train_rows, spec.warm_start, work, log=_log)
    return path, train_rows, eval_rows


def _run_cell(store_path: Path, model: str, task: str, setting: str, seed: int, spec: ModelSpec, plan: RunPlan,
              steps_name: str, prepared, reference: dict, **fields) -> dict:
    """Train one cell and append its record to the store; returns the record."""
    from .real_run import train_one

    path, train_rows, eval_rows = prepared
    budget = f", user-CPU budget {plan.budget_user_s:.1f} s" if plan.budget_user_s is not None else ""
    _log(f"{model} x {task} x {setting} x seed {seed}: {plan.steps} steps of {spec.pairs} pairs{budget}")
    load = os.getloadavg()[0]  # the machine's 1-minute load average at the start and the end (other jobs move CPU time)
    result = train_one(path, spec, plan, SETTINGS[setting], seed, train_rows, eval_rows, reference, log=_log)
    if steps_name != "study":  # (the first study's records have no such field)
        fields["load"] = [round(load, 2), round(os.getloadavg()[0], 2)]
    record = {"key": cell_key(model, task, setting, seed, spec, plan), "model": model, "task": task,
              "setting": setting, "seed": seed, "plan": steps_name, **fields, "steps": plan.steps,
              "pairs": spec.pairs, "training": f"LoRA r{spec.lora_r}" if spec.lora_r else "full",
              "eval_pairs": len(eval_rows), "reference_cpu": reference.get("cpu"),
              "commit": store.commit(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                  timespec="seconds"), **result}
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


def equal_time_plan(plan: RunPlan, exact: dict, own: dict) -> RunPlan:
    """The equal-time arm's plan of a setting (docs/study.md): the budget is the exact preset's training user CPU for
    the plan's steps (the same seed's); the schedule is laid over the steps the setting is expected to fit in it, from
    its own user CPU for the plan's steps; the run stops after the step in which the budget runs out."""
    budget = sum(exact["step_user"])
    steps = max(1, round(plan.steps * budget / sum(own["step_user"])))
    return replace(plan, steps=steps, evals=(steps,), budget_user_s=round(budget, 3))


def run_prereg(models, tasks, settings, seeds, stock_seeds, plan: RunPlan, store_path: Path, work: Path,
               steps_name: str) -> int:
    """The pre-registered study (docs/study.md), resumable: per (model, task) and seed, the equal-steps arm (the exact
    preset first), then the equal-time arm of every setting but the exact preset and stock."""
    settings = [s for s in PREREG["settings"] if s in settings] + [s for s in settings if s not in PREREG["settings"]]
    done = {r["key"]: r for r in stored(store_path)}
    ran = 0
    for model in models:
        spec = MODELS[model]
        for task in tasks:
            prepared, reference = None, {}

            def run_once(setting: str, seed: int, cell_plan: RunPlan, arm: str) -> int:
                """One cell of this model and task unless it is stored; 1 if it ran."""
                nonlocal prepared
                key = cell_key(model, task, setting, seed, spec, cell_plan)
                if key in done:
                    return 0
                prepared = prepared or _prepare(model, task, spec, plan, work)
                done[key] = _run_cell(store_path, model, task, setting, seed, spec, cell_plan, steps_name, prepared,
                                      reference, arm=arm)
                return 1

            for seed in seeds:
                first = [s for s in settings if s != "stock" or seed in stock_seeds]
                for setting in first:
                    ran += run_once(setting, seed, plan, "steps")
                exact = done.get(cell_key(model, task, "exact", seed, spec, plan))
                if exact is None:
                    _log(f"{model} x {task} x seed {seed}: no exact-preset cell, so no equal-time arm")
                    continue
                for setting in (s for s in first if s not in ("exact", "stock")):
                    timed = equal_time_plan(plan, exact, done[cell_key(model, task, setting, seed, spec, plan)])
                    ran += run_once(setting, seed, timed, "time")
            if prepared is None:
                _log(f"{model} x {task}: every cell stored")
    return ran


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
                        "end; prereg: at each quarter)")
    parser.add_argument("--store", type=Path, help=f"the JSON-lines result store (default: {STORE} for the study, "
                        f"{STUDY_STORE} for prereg)")
    parser.add_argument("--work", type=Path, default=WORK, help="where warm starts are cached (default: %(default)s)")
    parser.add_argument("--report", action="store_true", help="write the tables and the plot from the store "
                        "(prereg: docs/study.md's analysis, printed)")
    parser.add_argument("--docs", type=Path, default=store.REPO / "docs",
                        help="where --report writes img/real_models.png and updates quality.md")
    parser.add_argument("--smoke", action="store_true", help="the tiny built-in model (`--models tiny-full`: full "
                        "fine-tuning), every setting, 2 steps (prereg: 4 steps, both arms)")
    args = parser.parse_args(argv)
    prereg = args.plan == "prereg"
    store_path = args.store or (STUDY_STORE if prereg else STORE)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    if args.report:
        if prereg:
            from .study_report import write_study_report

            write_study_report(stored(store_path), sys.stdout)
            return 0
        from .real_report import write_report

        write_report(stored(store_path), sys.stdout, args.docs)
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
            plan = replace(plan, steps=args.steps, evals=tuple(sorted({max(1, args.steps * k // 4)
                                                                       for k in (1, 2, 3, 4)})))
        elif args.steps:
            plan = replace(plan, steps=args.steps, evals=tuple(sorted({max(1, args.steps // 2), args.steps})))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if prereg:
        ran = run_prereg(models, tasks, settings, seeds, args.stock_seeds, plan, store_path, args.work, name)
    else:
        ran = run_grid(models, tasks, settings, seeds, plan, store_path, args.work, name)
    _log(f"done: {ran} cell(s) run, results in {store_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
