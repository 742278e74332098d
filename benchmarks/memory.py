"""Peak working memory of one trainer, each measured in a fresh process.

`MemoryServer` starts one helper process that imports torch/TRL once and then forks a child per measurement (a fresh
address space every time, without paying the imports again; the helper itself never runs a torch op, so the child
starts with clean thread pools and, on GPU, an uninitialised CUDA context). The child builds the trainer, runs the
warm-up steps (which allocate the optimizer state), then measures the training steps:

- CPU: RSS after warm-up is the baseline (weights, reference, optimizer state, runtime); the peak is VmHWM over the
  measured steps (reset through /proc/self/clear_refs); working memory = peak - baseline. The helper runs with a fixed
  glibc mmap threshold, so freed tensors go back to the OS and RSS tracks the live tensors instead of malloc's cache.
- CUDA: `torch.cuda.memory_allocated()` after warm-up is the baseline, `torch.cuda.max_memory_allocated()` the peak.

A spec's `cap_mb` stops the child as soon as its RSS exceeds the RSS it started with by that much (a thread polling
/proc every 10 ms): a point over a memory budget is reported as such instead of taking the shared machine's memory.

`python -m benchmarks.memory` (see `sweep`) is the memory-against-length benchmark: peak memory of one training step
for stock and the exact preset as the sequence length doubles, and the longest length each fits in a budget.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import re
import subprocess
import sys
import threading
import time

MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{key}:\s+(\d+) kB", f.read(), re.M).group(1))


def _trim():
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def _watch(cap_mb: float, rss_start: float, abort):
    """Call `abort(result)` from a daemon thread once RSS exceeds `rss_start + cap_mb` (MiB)."""

    def run():
        while True:
            rss = _status_kb("VmRSS") / 1024
            if rss - rss_start > cap_mb:
                abort({"ok": False, "over_cap": True, "rss_start_mb": rss_start, "stopped_at_mb": rss,
                       "error": f"stopped: {rss - rss_start:.0f} MiB over the start exceeds the cap {cap_mb:.0f}"})
            time.sleep(0.01)

    threading.Thread(target=run, daemon=True).start()


def measure(spec: dict, abort=None) -> dict:
    """Build the trainer described by `spec` and return its baseline and peak memory (MiB). With `spec["cap_mb"]`,
    `abort` is called (and must not return) when the process grows past it."""
    import torch

    from benchmarks.workload import StepRunner, Workload, build_model, build_trainer, quiet

    quiet()
    torch.set_num_threads(spec.get("threads") or torch.get_num_threads())
    w = Workload(**spec["workload"])
    device = spec.get("device", "cpu")
    dtype = torch.bfloat16 if spec.get("bf16") else torch.float32
    rss_start = _status_kb("VmRSS") / 1024 if device == "cpu" else 0.0
    started = time.process_time()
    if spec.get("cap_mb") and device == "cpu" and abort is not None:
        _watch(spec["cap_mb"], rss_start, abort)
    trainer = build_trainer(
        spec["side"], w, build_model(w, dtype),
        precompute=spec["precompute"], checkpointing=spec["checkpointing"], pruning=spec.get("pruning"),
        device=device, bf16=spec.get("bf16", False), lora_r=spec.get("lora_r", 0),
    )
    runner = StepRunner(trainer)
    if spec.get("warmup") == "optimizer":
        # The optimizer's state without a warm-up step's compute: one optimizer step on zero gradients allocates
        # Adam's moments, as a first real step would (the sweep's long steps would otherwise cost twice).
        for param in trainer.model.parameters():
            if param.requires_grad:
                param.grad = torch.zeros_like(param)
        runner.optimizer.step()
        runner.model.zero_grad(set_to_none=True)
    else:
        for _ in range(spec.get("warmup", 1)):
            runner.step()
    peaks, draws = [], []
    if device == "cpu":
        _trim()
        baseline = _status_kb("VmRSS") / 1024
        for _ in range(spec.get("steps", 2)):
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current RSS
            runner.step()
            peaks.append(_status_kb("VmHWM") / 1024)
            draws.append(_draw(trainer))
            _trim()
    else:
        torch.cuda.synchronize()
        baseline = torch.cuda.memory_allocated() / 2**20
        for _ in range(spec.get("steps", 2)):
            torch.cuda.reset_peak_memory_stats()
            runner.step()
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated() / 2**20)
            draws.append(_draw(trainer))
    params = sum(p.numel() * p.element_size() for p in trainer.model.parameters()) / 2**20
    trainable = sum(p.numel() * p.element_size() for p in trainer.model.parameters() if p.requires_grad) / 2**20
    return {
        "rss_start_mb": rss_start,
        "baseline_mb": baseline,
        "build_mb": baseline - rss_start if device == "cpu" else baseline,
        "peak_mb": max(peaks),
        "working_mb": max(peaks) - baseline,
        "working_mb_steps": [p - baseline for p in peaks],
        # The draw of each measured step: the plugin's work fractions of that step (empty for stock).
        "draws": draws,
        "max_step": peaks.index(max(peaks)),
        "params_mb": params,
        "trainable_mb": trainable,
        "cpu_s": time.process_time() - started,
    }


# The plugin's work fractions of a step (metrics.py), read back after each measured step: which draw it was.
DRAW_KEYS = ("prune/tokens_executed", "prune/tokens_backpropagated", "prune/positions_scored",
             "prune/branches_backpropagated")


def _draw(trainer) -> dict:
    """This step's work fractions from TRL's metric lists (outside `train()` the plugin resolves them at once), then
    the lists emptied (the next step's values are its own)."""
    metrics = getattr(trainer, "_metrics", {}).get("train", {})
    draw = {key.removeprefix("prune/"): float(metrics[key][-1]) for key in DRAW_KEYS
            if metrics.get(key) and isinstance(metrics[key][-1], (int, float))}
    for values in metrics.values():
        values.clear()
    return draw


def _serve():
    """Helper process: read one JSON spec per line, fork a child to measure it, write one JSON result per line."""
    import torch  # noqa: F401  (imports paid once, before forking)
    import trl  # noqa: F401
    import transformers  # noqa: F401
    import datasets  # noqa: F401

    try:
        import trl_pruned_dpo  # noqa: F401
    except ImportError:
        pass
    from benchmarks.workload import quiet, scratch_root

    quiet()
    scratch_root()  # created here, so the children (which exit without cleanup) write inside what this one removes
    out = sys.stdout
    sys.stdout = sys.stderr  # anything the libraries print must not corrupt the protocol
    for line in sys.stdin:
        if not line.strip():
            continue
        spec = json.loads(line)
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # child: measure, report, exit without running the parent's cleanup
            os.close(read_fd)

            def report(result):
                os.write(write_fd, json.dumps(result).encode())
                os.close(write_fd)
                os._exit(0)

            try:
                result = {"ok": True, **measure(spec, abort=report)}
            except Exception as e:  # reported to the caller, which decides
                result = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            report(result)
        os.close(write_fd)
        chunks = []
        while chunk := os.read(read_fd, 65536):
            chunks.append(chunk)
        os.close(read_fd)
        os.waitpid(pid, 0)
        out.write((b"".join(chunks).decode() or json.dumps({"ok": False, "error": "child died"})) + "\n")
        out.flush()


class MemoryServer:
    """Client side of the helper process (a context manager)."""

    def __init__(self):
        env = {**os.environ, **MALLOC_ENV}
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.memory", "--serve"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True, cwd=root,
        )

    def measure(self, spec: dict) -> dict:
        self.proc.stdin.write(json.dumps(spec) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("memory helper exited")
        return json.loads(line)

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ------------------------------------------------------------------------------------------ memory against length
EXACT = dict(padding_free=True, share_prompt=True, prune_common_prefix=True)
# `--settings`: stock, the exact preset, and on top of it each estimator at 0.5 (`PrunedDPOConfig` fields).
SETTINGS = {
    "stock": None,
    "exact": EXACT,
    "position": dict(EXACT, position_keep_prob=0.5),
    "prefix": dict(EXACT, prefix_prune_prob=0.5),
    "branch": dict(EXACT, branch_keep_prob=0.5, branch_sampling="paired"),
}
SETTING_LABELS = {"stock": "stock", "exact": "exact preset", "position": "+ position 0.5", "prefix": "+ prefix 0.5",
                  "branch": "+ branch 0.5"}
# The settings whose work is drawn at random each step: their points are measured over `--steps` steps.
RANDOM_SETTINGS = ("position", "prefix", "branch")
SIDES = {side: SETTINGS[side] for side in ("stock", "exact")}  # the default sweep
PROMPT_SHARE = 0.3  # UltraFeedback's median prompt / (prompt + response): 108 / (108 + 258) (workload.LENGTH_MODELS)


def length_workload(length: int, model: str, pairs: int, vocab: int = 8192, shape: str = "uniform"):
    """`pairs` pairs at `length` tokens per sequence. `uniform`: every sequence exactly `length` tokens, a prompt of
    PROMPT_SHARE of it shared by the pair and two independent responses (no padding for stock to lose; the exact preset
    saves the prompt's second copy only). A workload length model (`ultrafeedback`, `hh`): its ragged lengths scaled so
    that its truncation length is `length` (stock pads each batch to its longest row, as it would at max_length)."""
    from benchmarks.workload import MODEL_SHAPE, LENGTH_MODELS, Workload

    common = dict(vocab_size=vocab, batch_size=pairs, num_batches=1, name=f"L{length}", reference_noise=0.01,
                  model_shape=dict(MODEL_SHAPE), model=model)
    if shape != "uniform":
        return Workload(lengths=shape, length_scale=length / LENGTH_MODELS[shape].max_total, **common)
    prompt = max(round(length * PROMPT_SHARE), 2)
    return Workload(lengths=f"uniform:{prompt}+{length - prompt}", **common)


def predict(points: dict[int, float], length: int) -> float | None:
    """Peak at `length` from the measured (length -> MiB) points: the least-squares quadratic through three or more,
    the line through the last two, None from fewer."""
    import numpy as np

    xs = sorted(points)
    if len(xs) < 2:
        return None
    if len(xs) == 2:
        (x0, y0), (x1, y1) = ((x, points[x]) for x in xs)
        return y1 + (y1 - y0) / (x1 - x0) * (length - x1)
    return float(np.polyval(np.polyfit(xs, [points[x] for x in xs], 2), length))


def crossing(points: dict[int, float], budget_mb: float) -> float | None:
    """Where `predict`'s curve through the measured points reaches the budget beyond the longest point (a fit, not a
    measurement; None when it never does or there are fewer than two points)."""
    xs = sorted(points)
    if len(xs) < 2:
        return None
    length = xs[-1]
    while length < 2**20 and predict(points, length) <= budget_mb:
        length = int(length * 1.01) + 1
    return length if length < 2**20 else None


def sweep(server, *, model: str, lengths: list[int], budget_mb: float, pairs: int, bisect: int, log,
          save=lambda rows: None, shape: str = "uniform", lora_r: int = 0, settings=tuple(SIDES), steps: int = 1,
          checkpointing: bool = True) -> list[dict]:
    """Per setting (names of SETTINGS): each length in turn (a point predicted over the budget is skipped, and every
    longer one), then `bisect` halvings between the longest length that fit and the shortest that did not (multiples
    of 64).

    Memory is the trainer's peak RSS over its first training step, after one optimizer step on zero gradients (which
    allocates Adam's moments, as a warm-up step would, at none of its compute), minus the process's RSS before the
    trainer was built: weights, reference, optimizer state and the step. The estimators (RANDOM_SETTINGS) draw their
    work each step: their points are the maximum over `steps` measured steps (each step's memory and draw kept).
    """
    rows = []
    for side in settings:
        pruning = SETTINGS[side]
        n_steps = steps if side in RANDOM_SETTINGS else 1
        fits, over, points = [], [], {}

        def run(length, phase):
            pred = predict(points, length)
            row = dict(side=side, length=length, phase=phase, predicted_mb=pred, budget_mb=budget_mb, pairs=pairs)
            if pred is not None and pred > budget_mb:
                row.update(status="over budget (predicted)")
                over.append(length)
            else:
                w = length_workload(length, model, pairs, shape=shape)
                from dataclasses import asdict

                spec = dict(workload=asdict(w), side="stock" if pruning is None else "pruned", pruning=pruning,
                            precompute=False, checkpointing=checkpointing, device="cpu", warmup="optimizer",
                            steps=n_steps, threads=1, lora_r=lora_r, cap_mb=budget_mb)
                started = time.time()
                result = server.measure(spec)
                row.update(wall_s=time.time() - started)
                if result.get("ok"):
                    peak = result["peak_mb"] - result["rss_start_mb"]
                    row.update(status="fits" if peak <= budget_mb else "over budget", peak_mb=peak,
                               working_mb=result["working_mb"], build_mb=result["build_mb"], cpu_s=result["cpu_s"],
                               params_mb=result["params_mb"], trainable_mb=result["trainable_mb"], steps=n_steps,
                               working_mb_steps=result.get("working_mb_steps"), draws=result.get("draws"),
                               max_step=result.get("max_step"))
                    points[length] = peak
                    (fits if peak <= budget_mb else over).append(length)
                elif result.get("over_cap"):
                    row.update(status="over budget (stopped)", stopped_at_mb=result["stopped_at_mb"]
                               - result["rss_start_mb"])
                    over.append(length)
                else:
                    row.update(status="failed", error=result.get("error"))
            rows.append(row)
            save(rows)  # a long sweep that is stopped keeps its points
            log(f"  {side:8s} L={length:5d} {row['status']:24s} peak {row.get('peak_mb', float('nan')):7.0f} MiB "
                f"(working {row.get('working_mb', float('nan')):6.0f}; predicted "
                f"{'-' if pred is None else f'{pred:.0f}'}) {row.get('wall_s', 0):5.0f} s"
                + (f"; steps {[round(m) for m in row['working_mb_steps']]}" if len(row.get("working_mb_steps") or [])
                   > 1 else ""))
            return row

        for length in sorted(lengths):
            if over:
                rows.append(dict(side=side, length=length, phase="grid", status="over budget (longer than a point "
                                 "over it)", budget_mb=budget_mb, pairs=pairs))
                log(f"  {side:8s} L={length:5d} over budget (a shorter length was)")
                continue
            run(length, "grid")
        for _ in range(bisect):
            lo, hi = max(fits, default=0), min(over, default=None)
            if hi is None or not lo:
                break
            mid = (lo + hi) // 2 // 64 * 64
            if mid <= lo:
                break
            run(mid, "bisect")
        lo, hi = max(fits, default=None), min(over, default=None)
        fitted = crossing(points, budget_mb) if hi is None else None
        how = next((r["status"] for r in rows if r["side"] == side and r.get("length") == hi), None)
        rows.append(dict(side=side, phase="longest", longest_fit=lo, shortest_over=hi, shortest_over_how=how,
                         budget_mb=budget_mb, fitted_limit=fitted))
        log(f"  {side}: longest length that fits {budget_mb / 1024:g} GiB: {lo} (shortest over: {hi}"
            + (f"; the fit through the points reaches the budget at ~{fitted})" if fitted else ")"))
    return rows


def length_table(rows: list[dict]) -> str:
    """Markdown: one line per length, stock and the exact preset side by side, then the longest fit per side."""
    grid = sorted({r["length"] for r in rows if r.get("phase") in ("grid", "bisect")})
    by = {(r["side"], r["length"]): r for r in rows if r.get("phase") in ("grid", "bisect")}

    def cell(r):
        if r is None:
            return "–"
        if "peak_mb" in r:
            return f"{r['peak_mb']:.0f} MiB (step {r['working_mb']:.0f})" + ("" if r["status"] == "fits" else " over")
        if "stopped_at_mb" in r:
            return f"over (stopped at {r['stopped_at_mb']:.0f} MiB)"
        if r.get("predicted_mb") is not None:
            return f"over (predicted {r['predicted_mb']:.0f} MiB)"
        return r["status"]

    lines = ["| tokens per sequence | stock: peak (of which the step) | exact preset | exact / stock |", "|---|---|---|---|"]
    for length in grid:
        s, e = by.get(("stock", length)), by.get(("exact", length))
        ratio = (f"{e['peak_mb'] / s['peak_mb']:.2f} (step {e['working_mb'] / s['working_mb']:.2f})"
                 if s and e and "peak_mb" in s and "peak_mb" in e else "–")
        lines.append(f"| {length} | {cell(s)} | {cell(e)} | {ratio} |")
    longest = {r["side"]: r for r in rows if r.get("phase") == "longest"}
    if longest:  # (a stopped sweep has none)
        budget = next(iter(longest.values()))["budget_mb"] / 1024
        parts = []
        for side, r in longest.items():
            points = {p["length"]: p["peak_mb"] for p in rows if p["side"] == side and "peak_mb" in p}
            r = dict(r, fitted_limit=crossing(points, r["budget_mb"]) if not r["shortest_over"] else None)
            how = r.get("shortest_over_how") or next((p.get("status") for p in rows if p["side"] == side and r[
                "shortest_over"] and p.get("length") == r["shortest_over"]), "")
            hi = (f" (shortest over: {r['shortest_over']}, {how})" if r["shortest_over"] else
                  f" (all fit; a quadratic fit through the points reaches the budget at ~{r['fitted_limit']}, "
                  "not measured)" if r.get("fitted_limit") else " (all fit)")
            parts.append(f"{side} {r['longest_fit']}{hi}")
        lines += ["", f"Longest length measured to fit {budget:g} GiB: " + "; ".join(parts) + "."]
    return "\n".join(lines)


def _draw_text(draw: dict) -> str:
    """A step's draw in words: the fractions of stock's tokens executed and backpropagated, of the response positions
    scored, of the rows backpropagated."""
    names = dict(tokens_executed="executed", tokens_backpropagated="backprop", positions_scored="scored",
                 branches_backpropagated="rows bp")
    return ", ".join(f"{names[k]} {v:.2f}" for k, v in draw.items() if k in names)


def settings_table(rows: list[dict]) -> str:
    """Markdown: one line per length, a column per setting: the step's working memory (MiB) and its ratio to the exact
    preset's of the same run; then the process's peak; then, for the estimators measured over several steps, each
    step's memory and draw. Rows read from several runs carry `run` (`--table`): a setting measured in more than one
    run gets a column per run, named by it."""
    measured = [r for r in rows if r.get("phase") in ("grid", "bisect")]
    columns = list(dict.fromkeys((r["side"], r.get("run")) for r in measured))
    repeated = {side for side, _ in columns if sum(s == side for s, _ in columns) > 1}
    grid = sorted({r["length"] for r in measured})
    by = {(r["side"], r.get("run"), r["length"]): r for r in measured}

    def label(side, run):
        return SETTING_LABELS.get(side, side) + (f" ({run})" if side in repeated and run else "")

    def cell(r, exact):
        if r is None:
            return "–"
        if "working_mb" in r:
            ratio = (f" ({r['working_mb'] / exact['working_mb']:.2f})" if exact and "working_mb" in exact
                     and exact["working_mb"] > 0 else "")
            return f"{r['working_mb']:.0f}{ratio}" + ("" if r["status"] == "fits" else " over")
        if "stopped_at_mb" in r:
            return f"over (stopped at {r['stopped_at_mb']:.0f} MiB of peak)"
        if r.get("predicted_mb") is not None:
            return f"over (peak predicted {r['predicted_mb']:.0f} MiB)"
        return r["status"]

    head = ["| tokens per sequence | " + " | ".join(label(*c) for c in columns) + " |",
            "|---" * (len(columns) + 1) + "|"]
    lines = list(head)
    for length in grid:
        cells = [cell(by.get((side, run, length)), by.get(("exact", run, length))) for side, run in columns]
        lines.append(f"| {length} | " + " | ".join(cells) + " |")
    lines += ["", "Working memory of the step (MiB above the RSS just before it; in brackets: / the exact preset's of "
              "the same run).", ""] + head
    for length in grid:
        cells = [f"{r['peak_mb']:.0f}" if r and "peak_mb" in r else "–"
                 for r in (by.get((side, run, length)) for side, run in columns)]
        lines.append(f"| {length} | " + " | ".join(cells) + " |")
    lines += ["", "Peak of the process (MiB above its RSS before the trainer was built: weights, reference, optimizer "
              "state and the step)."]
    drawn = [r for r in measured if len(r.get("working_mb_steps") or []) > 1]
    if drawn:
        lines += ["", "| setting | tokens per sequence | step: working MiB (draw) | max at |", "|---|---|---|---|"]
        for r in drawn:
            draws = r.get("draws") or [{}] * len(r["working_mb_steps"])
            steps = "; ".join(f"{i + 1}: {m:.0f} ({_draw_text(d)})"
                              for i, (m, d) in enumerate(zip(r["working_mb_steps"], draws)))
            lines.append(f"| {label(r['side'], r.get('run'))} | {r['length']} | {steps} | step {r['max_step'] + 1} |")
        lines += ["", "Each measured step of the estimators: its working memory and its draw (fractions of stock's "
                  "tokens executed and backpropagated, of the response positions scored, of the rows backpropagated)."]
    return "\n".join(lines)


def plot_settings(rows: list[dict], meta: dict, path: str):
    """Working memory of the step against length, one line per setting (an estimator's point: its largest measured
    step; dashed, its smallest where that is lower)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"stock": "tab:gray", "exact": "tab:blue", "position": "tab:orange", "prefix": "tab:green",
              "branch": "tab:purple"}
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for side in dict.fromkeys(r["side"] for r in rows):
        pts = sorted((r["length"], r["working_mb"]) for r in rows if r["side"] == side and "working_mb" in r)
        if pts:
            ax.plot(*zip(*pts), "o-", color=colors.get(side), label=SETTING_LABELS.get(side, side))
        least = sorted((r["length"], min(r["working_mb_steps"])) for r in rows
                       if r["side"] == side and len(r.get("working_mb_steps") or []) > 1)
        if least and any(m < w - 0.02 * w for (_, m), (_, w) in zip(least, pts)):
            ax.plot(*zip(*least), "o--", color=colors.get(side), mfc="none", lw=1,
                    label=f"{SETTING_LABELS.get(side, side)}: its smallest step")
        stops = [(r["length"], r["stopped_at_mb"]) for r in rows if r["side"] == side and "stopped_at_mb" in r]
        if stops:
            ax.plot(*zip(*stops), "^", color=colors.get(side), mfc="none", label=f"{side}: stopped over the cap "
                    "(process peak)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ticks = sorted({r["length"] for r in rows if r.get("phase") == "grid"})
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.set_xlabel(f"tokens per sequence ({meta['shape']}; {meta['pairs']} pairs per step)")
    ax.set_ylabel("working memory of a step (MiB, CPU RSS)")
    ax.set_title(f"{meta['model_label']}{', LoRA r' + str(meta['lora_r']) if meta.get('lora_r') else ''}: "
                 f"checkpointing {'on' if meta['checkpointing'] else 'off'}; estimators: max over "
                 f"{meta.get('steps', 1)} steps", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_lengths(rows: list[dict], meta: dict, path: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    colors = {"stock": "tab:gray", "exact": "tab:blue"}
    budget = None
    for side in SIDES:
        pts = sorted((r["length"], r["peak_mb"] / 1024) for r in rows if r["side"] == side and "peak_mb" in r)
        if pts:
            ax.plot(*zip(*pts), "o-", color=colors[side], label=f"{side}: measured")
        stops = [(r["length"], r["stopped_at_mb"] / 1024) for r in rows if r["side"] == side and "stopped_at_mb" in r]
        if stops:
            ax.plot(*zip(*stops), "^", color=colors[side], mfc="none", label=f"{side}: stopped over the budget")
        pred = [(r["length"], r["predicted_mb"] / 1024) for r in rows if r["side"] == side
                and r.get("status") == "over budget (predicted)"]
        if pred:
            ax.plot(*zip(*pred), "x", color=colors[side], label=f"{side}: predicted over (not run)")
        budget = budget or next((r["budget_mb"] for r in rows if r.get("budget_mb")), None)
    if budget:
        ax.axhline(budget / 1024, color="tab:red", ls="--", lw=1, label=f"budget {budget / 1024:g} GiB")
    ax.set_xscale("log", base=2)
    ticks = sorted({r["length"] for r in rows if r.get("phase") == "grid"})
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.set_xlabel("tokens per sequence (prompt 30%, 2 responses per pair)")
    ax.set_ylabel("peak memory of a training step (GiB)")
    ax.set_title(f"Memory against length: {meta['model_label']}, {meta['pairs']} pairs, checkpointing "
                 f"{'on' if meta.get('checkpointing', True) else 'off'} (CPU RSS)",
                 fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _commit() -> str | None:
    """The checkout's commit (with "+dirty" when files differ from it), for the record."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True)
    except OSError:
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "") if head.returncode == 0 else None


def main(argv=None):
    parser = argparse.ArgumentParser(description="Peak memory of one training step against sequence length: stock "
                                     "TRL DPOTrainer and the exact preset, and the longest length each fits a budget.")
    parser.add_argument("--model", default="", help="a local HF folder or builtin: name (default: the bench model)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    parser.add_argument("--budget-gib", type=float, help="default: 4 on the bench model, 8 with --model")
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--shape", default="uniform", choices=["uniform", "ultrafeedback", "hh"],
                        help="uniform rows (30%% prompt, no padding), or a workload's ragged lengths truncated at L")
    parser.add_argument("--bisect", type=int, default=3, help="halvings toward the longest length that fits")
    parser.add_argument("--lora", type=int, default=0, metavar="R",
                        help="train a LoRA adapter of rank R (the reference: the adapter off) instead of every weight")
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SIDES),
                        help="stock, exact (the exact preset), and on top of it each estimator at 0.5: position "
                        "(position_keep_prob), prefix (prefix_prune_prob), branch (branch_keep_prob, paired); the "
                        "table then gives each setting's working memory and its ratio to the exact preset's")
    parser.add_argument("--steps", type=int, default=1,
                        help="measured steps per point of the estimators (their work is drawn each step; the point "
                        "is the maximum, each step's memory and draw kept); stock and exact measure one")
    parser.add_argument("--no-checkpointing", dest="checkpointing", action="store_false",
                        help="gradient checkpointing off (TRL's default is on)")
    parser.add_argument("--out", help="output folder (default benchmarks/results/memory_length_<model>_cpu)")
    args = parser.parse_args(argv)
    several = set(args.settings) != set(SIDES)
    from benchmarks.workload import machine_info

    budget_mb = (args.budget_gib or (8.0 if args.model else 4.0)) * 1024
    label = os.path.basename(args.model.rstrip("/")).replace("builtin:", "") if args.model else "bench"
    suffix = (("" if args.shape == "uniform" else f"_{args.shape}") + (f"_lora{args.lora}" if args.lora else "")
              + ("_settings" if several else "") + ("" if args.checkpointing else "_nockpt"))
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   f"memory_length_{label}{suffix}_cpu")

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    started = time.time()
    meta = dict(model=args.model or "bench model (workload.MODEL_SHAPE, vocab 8192)", model_label=label,
                pairs=args.pairs, lengths=args.lengths, budget_mb=budget_mb, prompt_share=PROMPT_SHARE,
                shape=args.shape, settings=args.settings, settings_fields={k: SETTINGS[k] for k in args.settings},
                steps=args.steps, commit=_commit(),
                checkpointing=args.checkpointing, reference="the adapter off" if args.lora else "live",
                lora_r=args.lora, threads=1,
                started=time.strftime("%Y-%m-%d %H:%M"),
                machine=machine_info("cpu", 1))
    os.makedirs(out, exist_ok=True)

    def save(rows):
        meta["elapsed_s"] = time.time() - started
        with open(os.path.join(out, "memory_length.json"), "w") as f:
            json.dump(dict(meta=meta, results=rows), f, indent=1)

    with MemoryServer() as server:
        rows = sweep(server, model=args.model, lengths=args.lengths, budget_mb=budget_mb, pairs=args.pairs,
                     bisect=args.bisect, log=log, save=save, shape=args.shape, lora_r=args.lora,
                     settings=args.settings, steps=args.steps, checkpointing=args.checkpointing)
    save(rows)
    print(settings_table(rows) if several else length_table(rows))
    try:
        (plot_settings if several else plot_lengths)(rows, meta, os.path.join(out, "memory_length.png"))
    except ImportError as e:  # matplotlib is a dev extra
        log(f"(no plot: {e})")
    print(f"\nwrote {out}/memory_length.{{json,png}} in {meta['elapsed_s']:.0f}s")
    return rows


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        _serve()
    elif sys.argv[1:2] == ["--table"]:
        # Re-print a results file's table (python -m benchmarks.memory --table FILE...): several files' rows in one
        # table (the settings of runs made apart, e.g. at two commits), each file's settings taken from it.
        results, paths = [], sys.argv[2:]
        for path in paths:
            with open(path) as f:
                data = json.load(f)
            run = data["meta"].get("commit") or os.path.basename(os.path.dirname(os.path.abspath(path)))
            results += [dict(r, run=run) if len(paths) > 1 else r for r in data["results"]]
        print(settings_table(results) if {r["side"] for r in results} - set(SIDES) else length_table(results))
    else:
        main()
