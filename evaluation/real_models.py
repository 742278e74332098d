"""The real-model study: stock `DPOTrainer` against the plugin's settings on real models and real text, resumable.

    python -m evaluation.real_models                       # every cell not yet stored (stages: see GRID below)
    python -m evaluation.real_models --models smollm2 --tasks python-docs --seeds 0 1 2
    python -m evaluation.real_models --report              # tables + plot from what is stored (docs/img/, stdout)
    python -m evaluation.real_models --smoke               # the tiny built-in model, every setting, < 30 s (CI)

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
"""

import argparse
import datetime
import json
import os
import sys
from dataclasses import asdict, replace
from pathlib import Path

from . import store
from .real_run import SETTINGS, ModelSpec, RunPlan

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
}
TASKS = {"python-docs": "builtin:python-docs", "python-docstrings": "builtin:python-docstrings"}
PLANS = {"study": RunPlan(steps=20, evals=(10, 20), eval_pairs=224, curve_pairs=64),
         "smoke": RunPlan(steps=2, evals=(1, 2), eval_pairs=4, curve_pairs=2, eval_batch=4)}
STORE = store.REPO / "evaluation" / "results" / "real_models.jsonl"
WORK = store.REPO / "runs" / "real_models"  # warm starts; git-ignored


def _log(message: str):
    print(f"[{datetime.datetime.now():%H:%M:%S}] {message}", flush=True)


# `auto`'s rules, for its cells' keys: a rule change runs them anew (the report keeps a cell's latest record).
# "adapters keep branches": on LoRA runs branch_keep_prob="auto" neither probes nor prunes branches (auto.py).
AUTO_RULES = "adapters keep branches"


def cell_key(model: str, task: str, setting: str, seed: int, spec: ModelSpec, plan: RunPlan) -> str:
    """What determines a cell's result: a change to any of these runs it anew."""
    rules = (AUTO_RULES,) if setting == "auto" else ()
    return store.fingerprint(model, task, setting, SETTINGS[setting], seed, asdict(spec), asdict(plan), *rules)


def stored(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def append(path: Path, record: dict):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as out:
        out.write(json.dumps(record) + "\n")
        out.flush()
        os.fsync(out.fileno())


def run_grid(models, tasks, settings, seeds, plan: RunPlan, store_path: Path, work: Path, steps_name: str) -> int:
    from trl_pruned_dpo.demo import load_builtin, resolve_model

    from .real_run import train_one, warm_start_folder

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
            splits = load_builtin(TASKS[task], seed=0)
            train_rows, eval_rows = splits["train"], splits["test"].select(range(min(plan.eval_pairs,
                                                                                   len(splits["test"]))))
            path = resolve_model(spec.path)
            if spec.warm_start:
                work.mkdir(parents=True, exist_ok=True)
                path = warm_start_folder(path, task, train_rows, spec.warm_start, work, log=_log)
            reference = {}  # the reference's held-out log-probabilities, shared by this (model, task)'s cells
            for setting, seed in cells:
                _log(f"{model} x {task} x {setting} x seed {seed}: {plan.steps} steps of {spec.pairs} pairs")
                result = train_one(path, spec, plan, SETTINGS[setting], seed, train_rows, eval_rows, reference,
                                   log=_log)
                record = {"key": cell_key(model, task, setting, seed, spec, plan), "model": model, "task": task,
                          "setting": setting, "seed": seed, "plan": steps_name, "steps": plan.steps,
                          "pairs": spec.pairs, "training": f"LoRA r{spec.lora_r}" if spec.lora_r else "full",
                          "eval_pairs": len(eval_rows), "reference_cpu": reference.get("cpu"),
                          "commit": store.commit(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                              timespec="seconds"), **result}
                append(store_path, record)
                ran += 1
                final = result["curve"][-1]
                _log(f"  stored: accuracy {final['accuracy']:.3f}, margin {final['margin']:+.4f}, train CPU "
                     f"{final['cpu']:.1f} s" + (f", auto chose {result['auto_choice']}" if "auto_choice" in result
                                                else ""))
    return ran


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m evaluation.real_models", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["smollm2"], choices=sorted(MODELS))
    parser.add_argument("--tasks", nargs="+", default=["python-docs"], choices=sorted(TASKS))
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, help="optimizer steps per run (evaluations half-way and at the end)")
    parser.add_argument("--store", type=Path, default=STORE, help="the JSON-lines result store (default: %(default)s)")
    parser.add_argument("--work", type=Path, default=WORK, help="where warm starts are cached (default: %(default)s)")
    parser.add_argument("--report", action="store_true", help="write the tables and the plot from the store")
    parser.add_argument("--docs", type=Path, default=store.REPO / "docs",
                        help="where --report writes img/real_models.png and updates quality.md")
    parser.add_argument("--smoke", action="store_true", help="the tiny built-in model (`--models tiny-full`: full "
                        "fine-tuning), every setting, 2 steps")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    if args.report:
        from .real_report import write_report

        write_report(stored(args.store), sys.stdout, args.docs)
        return 0
    if args.smoke:
        models = [m for m in args.models if m.startswith("tiny")] or ["tiny"]
        plan, name, tasks, seeds = PLANS["smoke"], "smoke", args.tasks, args.seeds[:1]
    else:
        plan, name, models, tasks, seeds = PLANS["study"], "study", args.models, args.tasks, args.seeds
        if args.steps:
            plan = replace(plan, steps=args.steps, evals=tuple(sorted({max(1, args.steps // 2), args.steps})))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    ran = run_grid(models, tasks, args.settings, seeds, plan, args.store, args.work, name)
    _log(f"done: {ran} cell(s) run, results in {args.store}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
