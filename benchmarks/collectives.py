"""Collective communication per optimizer step on two processes: what the merged step saves under DDP, FSDP2 and
DeepSpeed ZeRO-3, with and without branch pruning (docs/distributed.md, "What a merged step communicates").

    python -m benchmarks.collectives                     # ddp fsdp zero3 (zero3 where deepspeed is installed)
    python -m benchmarks.collectives --engines fsdp      # one engine
    python -m benchmarks.collectives --quick             # the smoke test's: 2 x accumulation 2, tiny lengths

Bench model (workload.py; 4 layers), 8 pairs x accumulation 4 per rank, UltraFeedback-shaped ragged lengths (x0.25),
live reference (a perturbed copy), gradient checkpointing on, fp32 on CPU over gloo, 2 optimizer steps of plain SGD
at learning rate 1 without clipping. The ranks hold different pairs (the sampler shards them), so their micro-batches
differ in length and, merged, would group differently unless the ranks agree (merged_step.py).

Per rank and optimizer step, counted in the worker: calls and bytes of every torch.distributed collective by kind
(all-gather, reduce-scatter, all-reduce, broadcast; DDP's bucket all-reduces, which run in C++, through a
communication hook), passes over the policy (decoder-layer calls / layers: a grad and a frozen forward each count),
and the final weights. Printed per engine and setting: those counts against the same setting unmerged
(`step_token_budget=0`), and the relative distance of the final weights to unmerged's (same masks: round-off only).
TRL's own metric gathers (a few small all-gathers per micro-batch) are counted with the rest, the same on both sides.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "collectives_cpu"
ENGINES = ("ddp", "fsdp", "zero3", "zero3-releasing")
# Each setting is run unmerged and at the default budget; the table's ratios are merged / unmerged.
SETTINGS = {"exact preset": {"prune_common_prefix": True},
            "branch 0.5": {"prune_common_prefix": True, "branch_keep_prob": 0.5}}
BUDGETS = {"unmerged": 0, "default": None}
KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")
COUNTED = tuple(f"{kind}/{origin}" for kind in KINDS for origin in ("engine", "trainer"))


# ------------------------------------------------------------------------------------------------ the worker (a rank)
def count_collectives(counts: dict) -> None:
    """Wrap torch.distributed's collectives (looked up by attribute at each call by FSDP2, DeepSpeed and accelerate)
    so each call adds to counts[kind, origin] = [calls, bytes] (bytes: the first tensor argument, the one this rank
    sends or receives). `origin`: "trainer" for those made inside accelerate's `gather`/`reduce` (TRL's metrics, the
    plugin's metrics and its per-step agreement on passes), "engine" for the others (weights and gradients)."""
    import torch.distributed as dist
    from accelerate import Accelerator

    kinds = {"all_gather_single": "all_gather", "reduce_scatter_single": "reduce_scatter",
             "all_gather_into_tensor": "all_gather", "all_gather": "all_gather", "_all_gather_base": "all_gather",
             "all_gather_object": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
             "reduce_scatter": "reduce_scatter", "_reduce_scatter_base": "reduce_scatter", "all_reduce": "all_reduce",
             "broadcast": "broadcast"}
    inside_trainer = [0]

    def size(value) -> int:
        if hasattr(value, "numel"):
            return value.numel() * value.element_size()
        if isinstance(value, (list, tuple)):
            return sum(size(v) for v in value)
        return 0

    for name, kind in kinds.items():
        original = getattr(dist, name, None)
        if original is None:
            continue

        def counted(*args, _original=original, _kind=kind, **kwargs):
            entry = counts[_kind, "trainer" if inside_trainer[0] else "engine"]
            entry[0] += 1
            # The first tensor argument, positional or keyword (DeepSpeed passes `output_tensor=`, `input_tensor=`).
            entry[1] += size(args[0] if args else next(iter(kwargs.values()), None))
            return _original(*args, **kwargs)

        setattr(dist, name, counted)
    for method in ("gather", "reduce"):
        original = getattr(Accelerator, method)

        def marked(self, *args, _original=original, **kwargs):
            inside_trainer[0] += 1
            try:
                return _original(self, *args, **kwargs)
            finally:
                inside_trainer[0] -= 1

        setattr(Accelerator, method, marked)


def worker(spec: dict, out: Path) -> None:
    """One rank: every (setting, budget) of `spec`, two optimizer steps each, its counts per step to out/rank<r>.json."""
    sys.path[:0] = [str(ROOT / "tests" / "distributed"), str(ROOT)]
    import run_pruned  # the test runner's CPU shims (FSDP on CPU; DeepSpeed without its shared-memory op)

    if os.environ.get("RUN_PRUNED_FSDP_ON_CPU") == "1":
        run_pruned.allow_fsdp_on_cpu()
    if os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true":
        run_pruned.skip_deepspeed_shm_op()
    counts = collections.defaultdict(lambda: [0, 0])
    count_collectives(counts)
    import torch
    from transformers import TrainerCallback

    from benchmarks.workload import Workload, build_model, build_trainer, quiet

    w = Workload(batch_size=spec["pairs"], num_batches=spec["pairs_total"] // spec["pairs"], lengths="ultrafeedback",
                 length_scale=spec["scale"], reference_noise=0.01)

    class PerStep(TrainerCallback):
        """Snapshots the counters when training starts (before the first step's micro-batches are fetched and
        grouped) and at each optimizer step's end: a step's window holds its grouping, its passes and its update."""

        def __init__(self):
            self.marks: list[dict] = []

        def snapshot(self, passes: int) -> None:
            self.marks.append({"passes": passes, **{f"{k}/{o}": list(v) for (k, o), v in counts.items()}})

        def on_train_begin(self, args, state, control, **kwargs):
            self.snapshot(policy_calls[0])

        def on_step_end(self, args, state, control, **kwargs):
            self.snapshot(policy_calls[0])

    quiet()
    rank, results = None, []
    for setting, pruning in SETTINGS.items():
        for budget_name, budget in BUDGETS.items():
            extra = {} if budget is None else {"step_token_budget": budget}
            trainer = build_trainer(
                "pruned", w, build_model(w), precompute=False, checkpointing=True,
                pruning={**pruning, **extra}, output_dir=tempfile.mkdtemp(prefix="collectives-"),
                training=dict(gradient_accumulation_steps=spec["accumulation"], max_steps=spec["steps"],
                              optim="sgd", learning_rate=1.0, max_grad_norm=0.0, lr_scheduler_type="constant",
                              ddp_backend="gloo", use_cpu=os.environ.get("ACCELERATE_USE_DEEPSPEED") != "true"))
            policy_calls = [0]
            for layer in trainer.model.model.layers:
                layer.register_forward_hook(lambda *_: policy_calls.__setitem__(0, policy_calls[0] + 1))
            per_step = PerStep()
            trainer.add_callback(per_step)
            ddp_buckets = [0, 0]

            class DDPBuckets(TrainerCallback):
                def on_train_begin(self, args, state, control, **kwargs):
                    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
                    from torch.nn.parallel import DistributedDataParallel

                    if isinstance(trainer.model_wrapped, DistributedDataParallel):
                        def hook(group, bucket):
                            counts["all_reduce", "engine"][0] += 1
                            counts["all_reduce", "engine"][1] += bucket.buffer().numel() * bucket.buffer().element_size()
                            return allreduce_hook(group, bucket)

                        trainer.model_wrapped.register_comm_hook(None, hook)

            trainer.add_callback(DDPBuckets())
            trainer.train()
            rank = trainer.accelerator.process_index
            layers = len(trainer.model.model.layers) if hasattr(trainer.model, "model") else len(
                trainer.accelerator.unwrap_model(trainer.model).model.layers)
            from run_pruned import trainable_parameters

            weights, _ = trainable_parameters(trainer)
            flat = torch.cat([weights[name].flatten() for name in sorted(weights)])
            torch.save(flat, out / f"weights_{setting.replace(' ', '_')}_{budget_name}_rank{rank}.pt")
            marks = per_step.marks
            steps = []
            for before, after in zip(marks, marks[1:]):
                steps.append({"passes": (after["passes"] - before["passes"]) / layers,
                              **{k: [after.get(k, [0, 0])[i] - before.get(k, [0, 0])[i] for i in (0, 1)]
                                 for k in COUNTED}})
            results.append({"setting": setting, "budget": budget_name, "steps": steps,
                            "merged_said": trainer._merger.why})
            trainer.accelerator.wait_for_everyone()
            del trainer
    (out / f"rank{rank}.json").write_text(json.dumps(results))


# ------------------------------------------------------------------------------------------------------- the driver
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ZeRO-3 as on a model larger than its live-parameter limits (7B+ at accelerate's defaults of 1e9): every parameter
# released after its use and gathered again at the next, none kept whole. On the bench model the defaults keep the whole
# model gathered between uses, so its gathers would not follow the passes (docs/distributed.md).
ZERO3_RELEASING = {"zero_optimization": {"stage": 3, "stage3_max_live_parameters": 0, "stage3_max_reuse_distance": 0,
                                         "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 0},
                   "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                   "gradient_clipping": "auto", "train_batch_size": "auto"}


def engine_config(engine: str, folder: Path) -> Path:
    """The accelerate config of `engine`: the shipped one, or for "zero3-releasing" a ZeRO-3 config whose DeepSpeed
    file releases every parameter after use (`ZERO3_RELEASING`)."""
    if engine != "zero3-releasing":
        return ROOT / "configs" / "accelerate" / f"{engine}.yaml"
    (folder / "ds_config.json").write_text(json.dumps(ZERO3_RELEASING))
    config = folder / "accelerate.yaml"
    config.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\ndeepspeed_config:\n"
                      f"  deepspeed_config_file: {folder / 'ds_config.json'}\n  zero3_init_flag: true\n"
                      "machine_rank: 0\nnum_machines: 1\nnum_processes: 2\nuse_cpu: false\n")
    return config


def launch(engine: str, spec: dict, out: Path, timeout: int) -> None:
    """Two processes under `accelerate launch` with the config of `engine`, on CPU over gloo (the distributed tests'
    settings), killed whole after `timeout` seconds (a hang is a failure, said)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "ACCELERATE_USE_CPU": "0" if engine.startswith("zero") else "1", "DS_ACCELERATOR": "cpu",
           "CUDA_VISIBLE_DEVICES": "", "RUN_PRUNED_FSDP_ON_CPU": "1" if engine == "fsdp" else "0"}
    (out / "spec.json").write_text(json.dumps(spec))
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(engine_config(engine, out)), "--num_processes", "2", "--mixed_precision",
               "no", "--main_process_port", str(free_port()), str(Path(__file__).resolve()), "--worker",
               str(out)]
    try:
        done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as hung:
        raise SystemExit(f"{engine}: hung for {timeout} s\n{(hung.stdout or '')[-3000:]}") from None
    (out / "launch.log").write_text(done.stdout + done.stderr)
    if done.returncode:
        raise SystemExit(f"{engine}: launch failed ({done.returncode})\n{(done.stdout + done.stderr)[-5000:]}")


def table(engine: str, out: Path) -> list[dict]:
    """Per setting and rank: the per-step means of each side, merged / unmerged, the weights' distance."""
    import torch

    rows = []
    for rank in (0, 1):
        results = {(r["setting"], r["budget"]): r for r in json.loads((out / f"rank{rank}.json").read_text())}
        for setting in SETTINGS:
            sides = {}
            for budget in BUDGETS:
                steps = results[setting, budget]["steps"]
                sides[budget] = {"passes": sum(s["passes"] for s in steps) / len(steps),
                                 **{f"{k}_{what}": sum(s[k][i] for s in steps) / len(steps)
                                    for k in COUNTED for i, what in ((0, "calls"), (1, "bytes"))}}
            key = setting.replace(" ", "_")
            unmerged = torch.load(out / f"weights_{key}_unmerged_rank{rank}.pt")
            merged = torch.load(out / f"weights_{key}_default_rank{rank}.pt")
            rows.append({"engine": engine, "rank": rank, "setting": setting, **{
                f"{side}_{name}": value for side, values in sides.items() for name, value in values.items()},
                "fallback": results[setting, "default"]["merged_said"],
                "weights_distance": float((merged - unmerged).norm() / unmerged.norm())})
    return rows


def ratio(a: float, b: float) -> str:
    """a / b as "0.50x"; "-" where b is 0 (nothing to compare: no such collective, or no bytes seen)."""
    return f"{a / b:.2f}x" if b else "-"


def markdown(rows: list[dict]) -> str:
    """Per engine, setting and rank: each count per optimizer step, unmerged -> default budget (ratio)."""
    def cell(r: dict, key: str, bytes_too: bool = False) -> str:
        a, b = r[f"unmerged_{key}_calls" if key != "passes" else "unmerged_passes"], r[
            f"default_{key}_calls" if key != "passes" else "default_passes"]
        text = f"{a:g} -> {b:g} ({ratio(b, a)})"
        if bytes_too:
            text += f", bytes {ratio(r[f'default_{key}_bytes'], r[f'unmerged_{key}_bytes'])}"
        return text

    lines = ["| engine | setting | rank | passes | engine all-gathers | engine reduce-scatters | engine all-reduces | "
             "trainer gathers (metrics, agreement) | update vs unmerged | fallback |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['engine']} | {r['setting']} | {r['rank']} | {cell(r, 'passes')} | "
            f"{cell(r, 'all_gather/engine', True)} | {cell(r, 'reduce_scatter/engine', True)} | "
            f"{cell(r, 'all_reduce/engine', True)} | {cell(r, 'all_gather/trainer')} | "
            f"{r['weights_distance']:.1e} | {r['fallback'] or '-'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.collectives", description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES[:3]))
    parser.add_argument("--quick", action="store_true", help="2 pairs x accumulation 2, x0.05 lengths, 1 step")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where collectives.json and table.md go")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per engine before it counts as a hang")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    cli = parser.parse_args(argv)
    if cli.worker is not None:
        return worker(json.loads((cli.worker / "spec.json").read_text()), cli.worker)
    spec = (dict(pairs=2, accumulation=2, steps=1, scale=0.05) if cli.quick
            else dict(pairs=8, accumulation=4, steps=2, scale=0.25))
    spec["pairs_total"] = spec["pairs"] * spec["accumulation"] * spec["steps"] * 2  # both ranks, no repeats
    rows = []
    # The ranks' reports and final weights (tens of MB per run) stay in a scratch folder; the table and its JSON go
    # to --out.
    with tempfile.TemporaryDirectory(prefix="collectives-") as scratch:
        for engine in cli.engines:
            if engine.startswith("zero") and importlib.util.find_spec("deepspeed") is None:
                print(f"{engine}: skipped (deepspeed is not installed)")
                continue
            out = Path(scratch) / engine
            out.mkdir(parents=True)
            launch(engine, spec, out, cli.timeout)
            rows += table(engine, out)
    cli.out.mkdir(parents=True, exist_ok=True)
    (cli.out / "collectives.json").write_text(json.dumps({"spec": spec, "rows": rows}, indent=1))
    (cli.out / "table.md").write_text(markdown(rows) + "\n")
    print(markdown(rows))


if __name__ == "__main__":
    main()
