"""Where a training step's memory goes: live bytes at the step's peak, by what allocated them, stock against a setting.

    python -m benchmarks.memory_breakdown --workload ultrafeedback --scale 1 [--setting exact] [--top 25]

One step of each trainer (after a warm-up step that allocates the optimizer state) runs under torch.profiler with
`profile_memory=True`: every CPU allocation and free of the step is recorded with the operators and ranges open when it
happened. The live bytes are replayed in time order; at their maximum (the step's peak above what was already live),
each live allocation is attributed to

- the region of the step: policy forward (with grad / no-grad), reference forward, backward (gradient checkpointing's
  recompute included: it runs inside the backward), optimizer, other (collation, masks, loss, metrics);
- the innermost model module open (ranges pushed by forward hooks: `attn`, `mlp`, `norm`, ...; the fused LM head
  runs in the model's top-level forward after the last layer, so it appears as `model`), or in the backward outside
  a recomputed module the autograd node (e.g. `ChunkedLogProbFunctionBackward`: the head);
- the outermost aten operator that allocated it (e.g. `aten::scaled_dot_product_attention`, `aten::index_select`).

Beside the peak, the bytes saved for backward outside checkpointed layers (a `saved_tensors_hooks` tally, by module;
checkpointed layers save only their inputs) and the state live before the step (weights, reference, optimizer
state). Numbers are allocator bytes (not RSS: `benchmarks/memory.py` measures RSS in a fresh process), in MB (2^20).
Profiles one thread on CPU.
"""

from __future__ import annotations

import argparse
import collections
import copy

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks.step_time import SETTINGS, workload_plan
from benchmarks.workload import StepRunner, build_model, build_trainer, quiet

MB = 2**20
_MODULE_NAMES = {"self_attn": "attn", "mlp": "mlp", "embed_tokens": "embed", "lm_head": "lm_head", "norm": "norm"}


def _label_modules(model) -> list:
    """Forward hooks that open a range `# <module>` around the model's attention, MLP, norms, embedding and itself."""
    handles, stack = [], []

    def enter(name):
        def hook(module, args, kwargs=None):
            rf = record_function(f"# {name}")
            rf.__enter__()
            stack.append(rf)
        return hook

    def leave(module, args, output):  # returns None: a hook's return value would replace the output
        stack.pop().__exit__(None, None, None)

    for qual, module in model.named_modules():
        last = qual.rsplit(".", 1)[-1]
        name = "model" if qual == "" else _MODULE_NAMES.get(last, "norm" if "layernorm" in last else None)
        if name is None:
            continue
        handles.append(module.register_forward_pre_hook(enter(name)))
        handles.append(module.register_forward_hook(leave))
    return handles


def _wrap_forward(model, name):
    original = model.forward

    def forward(*a, **k):
        with record_function(f"## {name} fwd ({'grad' if torch.is_grad_enabled() else 'no-grad'})"):
            return original(*a, **k)

    model.forward = forward


def _attribution(event) -> tuple[str, str, str]:
    """(region, module, op) of an allocation event from its ancestors."""
    region, module, op = "other", "-", "-"
    node = event.parent
    while node is not None:
        name = node.name
        if name.startswith("## "):
            region = region if region not in ("other",) else name[3:]
        elif name.startswith("# ") and module == "-":
            module = name[2:]
        elif name.startswith("autograd::engine::evaluate_function") and region == "other":
            region = "backward"
            if module == "-":  # outside a recomputed module: the autograd node that allocated it
                module = name.split(": ", 1)[-1]
        elif name.startswith("Optimizer.step"):
            region = "optimizer"
        elif name.startswith("aten::"):
            op = name  # the outermost aten op wins (the loop walks outwards)
        node = node.parent
    return region, module, op


def _allocations(prof):
    """Every allocation of the profile: (start ns, end ns or None, bytes, attribution)."""
    events = []

    def walk(e):
        if str(e.tag).endswith("Allocation"):
            events.append(e)
        for c in e.children:
            walk(c)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    events.sort(key=lambda e: e.start_time_ns)
    live, allocs, freed_unknown = {}, [], 0
    for e in events:
        size, ptr = e.extra_fields.alloc_size, e.extra_fields.ptr
        if size > 0:
            live[ptr] = len(allocs)
            allocs.append([e.start_time_ns, None, size, _attribution(e)])
        elif ptr in live:
            allocs[live.pop(ptr)][1] = e.start_time_ns
        else:  # allocated before the profile: a free of pre-step memory
            freed_unknown += -size
    return allocs, freed_unknown


def peak_breakdown(allocs) -> tuple[float, dict]:
    """The maximum of the bytes allocated during the step and still live, and what was live then, by attribution."""
    points = sorted([(a[0], a[2], a[3][0]) for a in allocs] + [(a[1], -a[2], "") for a in allocs if a[1] is not None])
    current, peak, peak_t = 0, 0, None
    region_peaks = collections.Counter()
    for t, delta, region in points:
        current += delta
        if region:
            region_peaks[region] = max(region_peaks[region], current)
        if current > peak:
            peak, peak_t = current, t
    by = collections.Counter()
    for start, end, size, who in allocs:
        if start <= peak_t and (end is None or end > peak_t):
            by[who] += size
    return peak, by, region_peaks


class SavedForBackward:
    """Bytes saved for backward outside checkpointed layers, by the innermost labelled module (each storage once)."""

    def __init__(self, model):
        self.bytes, self.seen, self.stack = collections.Counter(), set(), []
        self.handles = []
        for qual, module in model.named_modules():
            last = qual.rsplit(".", 1)[-1]
            name = "model" if qual == "" else _MODULE_NAMES.get(last)
            if name:
                self.handles.append(module.register_forward_pre_hook(lambda m, a, n=name: self.stack.append(n)))
                self.handles.append(module.register_forward_hook(self._leave))

    def _leave(self, module, args, output):  # returns None: a hook's return value would replace the output
        self.stack.pop()

    def pack(self, t):
        storage = t.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if key not in self.seen and not isinstance(t, torch.nn.Parameter) and storage.nbytes():
            self.seen.add(key)
            self.bytes[self.stack[-1] if self.stack else "outside the model"] += storage.nbytes()
        return t

    def reset(self):
        self.bytes.clear()
        self.seen.clear()


def state_bytes(trainer) -> dict:
    params = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    ref = trainer.ref_model
    ref_bytes = sum(p.numel() * p.element_size() for p in ref.parameters()) if ref is not None else 0
    optim = sum(t.numel() * t.element_size() for s in trainer.optimizer.state.values() for t in s.values()
                if torch.is_tensor(t))
    return {"policy weights": params, "reference weights": ref_bytes, "optimizer state": optim,
            "gradients (after backward)": params}


def profile_side(side: str, setting: str | None, w, base, top: int) -> str:
    trainer = build_trainer(side, w, copy.deepcopy(base), precompute=False, checkpointing=True,
                            pruning=SETTINGS.get(setting))
    runner = StepRunner(trainer)
    for m, name in ((trainer.model, "policy"), (trainer.ref_model, "reference")):
        if m is not None:
            _wrap_forward(m, name)
            _label_modules(m)
    runner.step()  # warm-up: the optimizer state
    saved = SavedForBackward(trainer.model)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, \
            torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
        runner.step()
    allocs, _ = _allocations(prof)
    peak, by, region_peaks = peak_breakdown(allocs)
    stats = getattr(trainer, "last_prune_stats", None) or {}
    tokens = stats.get("policy_tokens_executed", runner.last_batch["input_ids"].numel())
    scored = stats.get("positions_scored", runner.last_batch["input_ids"].numel())
    lines = [f"== {setting or 'stock'}: policy tokens executed {tokens}, positions scored {scored}; "
             f"peak of the step's live allocations "
             f"{peak / MB:.1f} MB"]
    regions = collections.Counter()
    for (region, _, _), size in by.items():
        regions[region] += size
    lines.append("  the largest live total while each region allocates: " + ", ".join(
        f"{r} {b / MB:.1f}" for r, b in region_peaks.most_common()))
    lines.append("  at the peak, by region: " + ", ".join(f"{r} {b / MB:.1f}" for r, b in regions.most_common()))
    lines.append(f"  at the peak, top {top} (region | module | op: MB):")
    for (region, module, op), size in by.most_common(top):
        lines.append(f"    {size / MB:8.1f}  {region} | {module} | {op}")
    lines.append("  saved for backward outside checkpointed layers (MB): " + ", ".join(
        f"{k} {v / MB:.1f}" for k, v in saved.bytes.most_common()))
    state = state_bytes(trainer)
    lines.append("  state before the step (MB): " + ", ".join(f"{k} {v / MB:.1f}" for k, v in state.items()))
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="ultrafeedback", choices=["ultrafeedback", "hh", "multiturn", "short"])
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--setting", default="exact", choices=list(SETTINGS))
    parser.add_argument("--sides", nargs="+", default=["stock", "pruned"], choices=["stock", "pruned"])
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    quiet()
    torch.set_num_threads(1)
    w = workload_plan("quick", [args.workload], args.scale)["groups"][0]["workload"]
    base = build_model(w)
    print(f"memory breakdown: {w.label()}, 8 pairs, checkpointing on, live reference, fp32, CPU allocator bytes")
    for side in args.sides:
        print(profile_side(side, args.setting if side == "pruned" else None, w, base, args.top), flush=True)


if __name__ == "__main__":
    main()
