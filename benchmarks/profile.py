"""Where a step's time goes: torch.profiler over a few steps of stock and one pruned setting, side by side.

    python -m benchmarks.profile --setting branch --reference live --checkpointing on [--steps 3] [--threads 1]

Prints, per side, the self time of the top operators and a breakdown by kind (matmuls, attention, element-wise and
reductions, copies/indexing/allocation, autograd/checkpoint bookkeeping, Python outside ops), and the time spent in
each region of the step (policy forward, reference forward, backward, optimizer) from record_function ranges, so a
pruned step's time can be set against the work it skips. Writes the tables to `<out>/profile_<setting>.txt`.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks.step_time import MAIN, SETTINGS
from benchmarks.workload import StepRunner, build_model, build_trainer, quiet

KINDS = [
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "aten::addmm_", "aten::baddbmm",
                "aten::_mkl", "mkldnn")),
    ("attention", ("scaled_dot_product", "_flash_attention", "_efficient_attention", "aten::_softmax")),
    ("copy/index/alloc", ("aten::copy_", "aten::index", "aten::masked", "aten::empty", "aten::zeros", "aten::fill_",
                          "aten::clone", "aten::cat", "aten::to", "aten::_to_copy", "aten::contiguous", "aten::gather",
                          "aten::scatter", "aten::pad", "aten::constant_pad", "aten::nonzero", "aten::where",
                          "aten::new_zeros", "aten::zero_", "aten::slice", "aten::select", "aten::view",
                          "aten::reshape", "aten::as_strided", "aten::expand", "aten::unsqueeze", "aten::t",
                          "aten::transpose", "aten::permute", "aten::narrow", "aten::split", "aten::chunk",
                          "aten::_index_put", "aten::index_put", "aten::embedding", "aten::resize_", "aten::set_")),
    ("elementwise/reduce", ("aten::",)),
]


def kind_of(name: str) -> str:
    for kind, prefixes in KINDS:
        if any(name.startswith(p) or p in name for p in prefixes):
            return kind
    return "other"


def profile_side(runner: StepRunner, steps: int):
    """Profile `steps` steps; return (wall s/step, {op: self s/step}, {region: s/step}).

    Regions: the forwards (ranges added by `_regions`), the backward (autograd's evaluate_function ranges, which
    include checkpointing's recompute), the optimizer step, and "other": the rest of the step -- data loading and
    collation, mask drawing, loss and metrics, gradient clipping -- everything that is neither model compute nor
    the optimizer.
    """
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            with record_function("## step"):
                runner.step()
        wall = (time.perf_counter() - start) / steps
    ops = collections.defaultdict(float)
    regions = collections.defaultdict(float)
    for evt in prof.key_averages():
        key, total = evt.key, evt.cpu_time_total / 1e6 / steps
        if key.startswith("##"):
            regions[key[3:]] += total
        elif key.startswith("autograd::engine::evaluate_function"):
            regions["backward"] += total
        elif key.startswith("Optimizer.step"):
            regions["optimizer"] += total
        if not key.startswith("##") and not key.startswith("ProfilerStep"):
            ops[key] += evt.self_cpu_time_total / 1e6 / steps
    step = regions.pop("step", wall)
    regions["other"] = step - sum(regions.values())
    regions["step"] = step
    return wall, dict(ops), dict(regions)


def _regions(trainer):
    """Wrap the model and reference forwards and the backward in named ranges (instrumentation only)."""
    model, ref = trainer.model, getattr(trainer, "ref_model", None)
    hooks = []

    def wrap(module, name):
        original = module.forward

        def forward(*a, **k):
            label = f"## {name} fwd ({'grad' if torch.is_grad_enabled() else 'no-grad'})"
            with record_function(label):
                return original(*a, **k)

        module.forward = forward
        hooks.append((module, original))

    wrap(model, "policy")
    if ref is not None:
        wrap(ref, "reference")
    return hooks


def report(name: str, wall: float, ops: dict, regions: dict, top: int) -> str:
    lines = [f"== {name}: {wall:.3f} s/step (profiled wall)"]
    by_kind = collections.defaultdict(float)
    for op, t in ops.items():
        by_kind[kind_of(op)] += t
    total = sum(ops.values())
    lines.append("  by kind: " + ", ".join(f"{k} {v:.3f}s ({v / total:.0%})" for k, v in
                                          sorted(by_kind.items(), key=lambda kv: -kv[1])))
    lines.append("  regions: " + ", ".join(f"{k} {v:.3f}s" for k, v in regions.items()))
    lines.append(f"  top {top} ops by self time:")
    for op, t in sorted(ops.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"    {t * 1e3:9.1f} ms  {t / total:5.1%}  {op}")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--setting", choices=list(SETTINGS), default="branch")
    parser.add_argument("--reference", choices=["live", "precomputed"], default="live")
    parser.add_argument("--checkpointing", choices=["on", "off"], default="on")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--vocab", type=int, default=MAIN.vocab_size)
    parser.add_argument("--response-len", type=int, default=MAIN.response_len)
    parser.add_argument("--batch", type=int, default=MAIN.batch_size)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "profile"))
    args = parser.parse_args(argv)
    quiet()
    if args.threads:
        torch.set_num_threads(args.threads)
    from dataclasses import replace

    w = replace(MAIN, vocab_size=args.vocab, response_len=args.response_len, batch_size=args.batch)
    base = build_model(w)
    precompute, ckpt = args.reference == "precomputed", args.checkpointing == "on"
    runners = {}
    for side, setting in (("stock", None), ("pruned", args.setting)):
        trainer = build_trainer(side, w, copy.deepcopy(base), precompute=precompute, checkpointing=ckpt,
                                pruning=SETTINGS.get(setting))
        runners[setting or "stock"] = StepRunner(trainer)
        _regions(trainer)
    for _ in range(args.warmup):  # alternate, like the benchmark
        for r in runners.values():
            r.step()
    text = [f"profile: {w.label()} reference={args.reference} checkpointing={args.checkpointing} "
            f"threads={torch.get_num_threads()} steps={args.steps}"]
    for name, runner in runners.items():
        with contextlib.redirect_stdout(sys.stderr):
            wall, ops, regions = profile_side(runner, args.steps)
        text.append(report(name, wall, ops, regions, args.top))
    out = "\n\n".join(text)
    print(out)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"profile_{args.setting}_{args.reference}_ckpt{args.checkpointing}.txt")
    with open(path, "w") as f:
        f.write(out + "\n")
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
