"""Aggregation over seeds, the PNG curves and the markdown tables of the quality study.

Intervals are 95% Student-t intervals over seeds (n - 1 degrees of freedom). Differences to stock are *paired* by
seed (same starting policy, data order and evaluation pairs), which removes the seed-to-seed variation the two share.

Equal wall-clock: a setting whose training step takes r times stock's (r from the round-robin timing in
gradients.py) has done N / r steps when stock has done N, so its curve is read there (linear interpolation between
evaluation points). Annealed settings pay stock's price on their ramp, which the step count accounts for. A setting
that would need more steps than it ran is read at its last step and marked ">=" (a lower bound when accuracy still
rises). The measured-time reading (each seed's curve against its own measured training time, at stock's measured
time for N steps) is reported beside it: it is the literal comparison, but on a shared machine its noise is large.
"""

import math
import statistics
from pathlib import Path

from .prototypes import annealed
from .settings import SETTINGS

# 0.975 quantiles of Student's t, by degrees of freedom.
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
         11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
         20: 2.086, 25: 2.060, 30: 2.042}


def write_section(path: Path, start: str, end: str, text: str, title: str = "# Quality: pruned DPO against stock DPO"):
    """Put `text` (which starts with `start` and ends with `end`) in the file at `path`: in place of the section between
    the two markers, or at the end. The hand-written parts of the page around the generated sections stay."""
    old = path.read_text() if path.is_file() else f"{title}\n"
    if start in old and end in old:
        new = old[: old.index(start)] + text.strip("\n") + old[old.index(end) + len(end):]
    else:
        new = old.rstrip("\n") + "\n\n" + text.strip("\n") + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(new)


def t975(df: int) -> float:
    if df <= 0:
        return float("nan")
    return _T975.get(df) or _T975[max(k for k in _T975 if k <= df)]


def mean_ci(values) -> tuple[float, float]:
    """(mean, half-width of the 95% t-interval); half-width nan for a single value."""
    values = [v for v in values if v is not None and not math.isnan(v)]
    if not values:
        return float("nan"), float("nan")
    m = statistics.mean(values)
    if len(values) < 2:
        return m, float("nan")
    return m, t975(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))


def interp(xs, ys, x) -> float:
    """Linear interpolation of (xs, ys) at x, clamped to the ends."""
    if x <= xs[0]:
        return ys[0]
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 > x0 else y1
    return ys[-1]


def window(xs, ys, end, width, points=3) -> float:
    """Mean of the curve at `points` evenly spaced positions over [end - width, end] (interpolated): the level of a
    curve around `end`, less noisy than one evaluation of a model that moves from step to step."""
    if points < 2 or width <= 0:
        return interp(xs, ys, end)
    return statistics.mean(interp(xs, ys, end - width * (1 - i / (points - 1))) for i in range(points))


def curve(run, key, x="step"):
    points = [(r[x], r[key]) for r in run["curve"] if key in r]
    return [p[0] for p in points], [p[1] for p in points]


def step_cost(name: str, ratio: float, steps: int, k: int) -> float:
    """Time of training step k of a setting relative to a stock step: its round-robin ratio, or for an annealed
    setting that ratio moved towards 1 as far as its keep probabilities have ramped (horizon `steps`)."""
    setting = SETTINGS[name]
    if not setting.anneal:
        return ratio
    base = {"branch_keep_prob": 1.0, "position_keep_prob": 1.0, "prefix_prune_prob": 0.0, **setting.pruning}
    probs = annealed(base, setting.anneal, steps, k)
    # Progress of the ramp, 0 (base) .. 1 (exact), read from the first annealed probability that moves.
    if base["branch_keep_prob"] < 1:
        done = (probs["branch_keep_prob"] - base["branch_keep_prob"]) / (1 - base["branch_keep_prob"])
    elif base["position_keep_prob"] < 1:
        done = (probs["position_keep_prob"] - base["position_keep_prob"]) / (1 - base["position_keep_prob"])
    else:
        done = 1 - probs["prefix_prune_prob"] / base["prefix_prune_prob"] if base["prefix_prune_prob"] else 1
    return ratio + done * (1 - ratio)


def equal_time_steps(name: str, ratio: float, steps: int) -> float:
    """Steps a setting does in the time stock does `steps`: solves sum_k step_cost(k) = steps."""
    if not SETTINGS[name].anneal:
        return steps / ratio
    budget, k = float(steps), 0
    while k < 100 * steps:
        cost = step_cost(name, ratio, steps, k)
        if budget < cost:
            return k + budget / cost
        budget -= cost
        k += 1
    return float(k)


def with_timed_axis(run, timing: dict, steps: int):
    """The run with `rr_time` on every curve point: seconds of training at the round-robin step time of its
    setting (stock's median step time x the setting's ratio, per step), free of the load the run itself met."""
    stock_s = timing["stock"]["step_s"]
    ratio = timing.get(run["setting"], {}).get("ratio", 1.0)
    curve_points, elapsed, k = [], 0.0, 0
    for point in run["curve"]:
        while k < point["step"]:
            elapsed += stock_s * step_cost(run["setting"], ratio, steps, k)
            k += 1
        curve_points.append({**point, "rr_time": elapsed})
    return {**run, "curve": curve_points}


def summarize(runs: dict, timing: dict, steps: int, width: float = 0.0) -> dict:
    """Per setting: metrics at equal steps and equal wall-clock, mean and CI over seeds, paired deltas to stock.

    Accuracies are read as `window` means over the last `width` steps before the reading point (0: the point).
    """
    stock_runs = {r["seed"]: r for r in runs.get("stock", [])}
    out, seeds_of = {}, {}
    order = sorted(runs, key=lambda n: n != "stock")  # stock first: the deltas need its per-seed values
    for name in order:
        seed_runs = runs[name]
        ratio = timing.get(name, {}).get("ratio", 1.0) if timing else 1.0
        eq_steps = equal_time_steps(name, ratio, steps)
        row = {"n": len(seed_runs), "ratio": ratio, "eq_steps": eq_steps, "lower_bound": False}
        per_seed = {}
        for run in seed_runs:
            xs, acc = curve(run, "pref_acc")
            _, margin = curve(run, "margin")
            gx, gen = curve(run, "gen_acc")
            tx, tacc = curve(run, "pref_acc", x="time")
            reach = min(eq_steps, run["max_steps"])
            row["lower_bound"] |= eq_steps > run["max_steps"] + 1e-9
            seed = run["seed"]
            stock = stock_runs.get(seed)
            stock_time = interp(*curve(stock, "time"), steps) if stock else float("nan")
            time_width = width * stock_time / steps if stock else 0.0
            per_seed[seed] = {
                "acc_steps": window(xs, acc, steps, width),
                "acc_time": window(xs, acc, reach, width),
                "acc_mtime": window(tx, tacc, stock_time, time_width) if stock and tx[-1] >= stock_time
                else float("nan"),
                "acc_final": acc[-1],
                # Learning speed: mean accuracy over the evaluations up to N (an area under the curve).
                "acc_auc": statistics.mean(a for x, a in zip(xs, acc) if x <= steps),
                "margin_steps": interp(xs, margin, steps),
                "gen_steps": interp(gx, gen, steps) if gx else float("nan"),
                "gen_prefix_steps": interp(*curve(run, "gen_prefix_acc"), steps) if gx else float("nan"),
                "step_s": run["train_time"] / run["max_steps"],
                "cost_per_step": run["cost_units"] / run["max_steps"],
                "clip": run["clip_fraction"],
                "grad_norm": statistics.median(h["grad_norm"] for h in run["train_log"] if "grad_norm" in h),
            }
        seeds_of[name] = per_seed
        stock_seeds = seeds_of.get("stock", {})
        for key in next(iter(per_seed.values())):
            row[key] = mean_ci([v[key] for v in per_seed.values()])
            if key.startswith("acc_") and stock_seeds:
                # At equal time stock is read at N steps: that is stock's own time for N steps, by definition.
                ref = "acc_steps" if key in ("acc_time", "acc_mtime") else key
                deltas = [v[key] - stock_seeds[s][ref] for s, v in per_seed.items() if s in stock_seeds]
                row["d_" + key] = mean_ci(deltas)
        out[name] = row
    return {name: out[name] for name in runs}


def fmt(mean_half, pct=True, signed=False, digits=1, scale=None):
    mean, half = mean_half
    if mean is None or math.isnan(mean):
        return "n/a"
    scale = scale or (100 if pct else 1)
    sign = "+" if signed else ""
    body = f"{mean * scale:{sign}.{digits}f}"
    return body if math.isnan(half) else f"{body} ± {half * scale:.{digits}f}"


# ---------------------------------------------------------------------------------------------------------- plots

FAMILIES = [
    ("Branch pruning", ["stock", "branch", "branch_cp", "branch_ind_cp", "branch75_cp", "branch75_ind_cp",
                        "branch_cp_anneal"]),
    ("Position pruning", ["stock", "position_rows", "position_cp_rows", "position_cp_shared"]),
    ("Prefix and combined", ["stock", "prefix_rows", "prefix", "prefix_cp_shared", "posprefix_cp_shared",
                             "combined_cp_shared"]),
]


def _band(ax, runs, key, x, grid, label, color):
    """Mean over seeds with a 95% t band, each seed's curve interpolated on `grid` (within its range)."""
    means, lows, highs, xs = [], [], [], []
    for g in grid:
        values = []
        for run in runs:
            rx, ry = curve(run, key, x=x)
            if rx and rx[0] <= g <= rx[-1] + 1e-9:
                values.append(interp(rx, ry, g))
        if len(values) == len(runs):
            m, h = mean_ci(values)
            h = 0.0 if math.isnan(h) else h
            xs.append(g), means.append(m), lows.append(m - h), highs.append(m + h)
    if xs:
        ax.plot(xs, means, label=label, color=color, lw=1.6 if label.startswith("stock") else 1.2)
        ax.fill_between(xs, lows, highs, color=color, alpha=0.15, lw=0)


def plot_curves(runs: dict, start: dict, path_steps: str, path_time: str, path_extra: str, steps: int,
                timing: dict | None = None, path_measured: str | None = None):
    """Preference accuracy against steps, against the round-robin-timed wall-clock (`path_time`, when `timing`),
    and against each run's measured wall-clock (`path_measured`); margin and generation metrics against steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = plt.get_cmap("tab10")
    panels = [(path_steps, "step", "training step")]
    if timing:
        runs = {n: [with_timed_axis(r, timing, steps) for r in rs] for n, rs in runs.items()}
        panels.append((path_time, "rr_time", "training wall-clock (s): steps x round-robin step time of the setting"))
    if path_measured:
        panels.append((path_measured, "time", "training wall-clock (s) as measured in each run (machine load varied)"))
    for path, x, xlabel in panels:
        fig, axes = plt.subplots(1, len(FAMILIES), figsize=(5.2 * len(FAMILIES), 4.2), sharey=True)
        for ax, (title, names) in zip(axes, FAMILIES):
            for i, name in enumerate(n for n in names if n in runs):
                seed_runs = [_with_start(r, start) for r in runs[name]]
                end = max(r["curve"][-1][x] for r in seed_runs)
                first = min(r["curve"][1][x] for r in seed_runs) if start else 0.0
                grid = [0.0] + [first + (end - first) * j / 60 for j in range(61)]
                _band(ax, seed_runs, "pref_acc", x, grid, SETTINGS[name].label, colors(i))
            if x == "step":
                ax.axvline(steps, color="grey", ls=":", lw=1)
            elif x == "rr_time":
                ax.axvline(steps * timing["stock"]["step_s"], color="grey", ls=":", lw=1)
            ax.set_ylim(bottom=0.5, top=1.0)  # step 0 (all ties: 0) is off the bottom; the comparison is above it
            ax.set_title(title)
            ax.set_xlabel(xlabel)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, loc="lower right")
        axes[0].set_ylabel("held-out preference accuracy (implicit reward)")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.4))
    for i, name in enumerate(runs):
        seed_runs = [_with_start(r, start) for r in runs[name]]
        end = max(r["max_steps"] for r in seed_runs)
        grid = [end * j / 40 for j in range(41)]
        color = colors(i % 10)
        style = "-" if i < 10 else "--"
        for ax, key in zip(axes, ("margin", "gen_acc", "gen_prefix_acc")):
            means = []
            xs = []
            for g in grid:
                vals = []
                for r in seed_runs:
                    rx, ry = curve(r, key)
                    if rx and rx[0] <= g <= rx[-1]:
                        vals.append(interp(rx, ry, g))
                if len(vals) == len(seed_runs):
                    xs.append(g), means.append(statistics.mean(vals))
            ax.plot(xs, means, style, color=color, label=SETTINGS[name].label, lw=1.1)
    axes[0].set_ylabel("held-out reward margin")
    axes[1].set_ylabel("held-out greedy generation accuracy")
    axes[2].set_ylabel("generation starts with the right answer")
    for ax in axes:
        ax.set_xlabel("training step")
        ax.axvline(steps, color="grey", ls=":", lw=1)
        ax.grid(alpha=0.3)
    axes[2].legend(fontsize=6, loc="best")
    fig.tight_layout()
    fig.savefig(path_extra, dpi=110)
    plt.close(fig)


def _with_start(run, start):
    """The run's curve with the shared step-0 evaluation (the starting policy) in front."""
    if not start or (run["curve"] and run["curve"][0]["step"] == 0):
        return run
    return {**run, "curve": [{"step": 0, "time": 0.0, "rr_time": 0.0, "cost": 0, **start}] + run["curve"]}


def plot_gradients(grads: dict, path: str, names: list[str]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    states = [s for s in ("start", "trained", "far") if s in grads]
    fig, axes = plt.subplots(1, 2, figsize=(14, 0.32 * len(names) + 1.6), sharey=True)
    ys = list(range(len(names)))
    width = 0.8 / max(len(states), 1)
    for j, state in enumerate(states):
        offset = [y + (j - (len(states) - 1) / 2) * width for y in ys]
        cos = [grads[state].get(n, {}).get("cos", float("nan")) for n in names]
        # Exact settings have noise ~1e-13 (round-off): drawn at the left edge instead of stretching the log axis.
        noise = [max(grads[state].get(n, {}).get("noise_vs_sgd", float("nan")), 0.02) for n in names]
        axes[0].barh(offset, cos, height=width, label=f"policy: {state}")
        axes[1].barh(offset, noise, height=width, label=f"policy: {state}")
    axes[0].set_yticks(ys, [SETTINGS[n].label for n in names], fontsize=7)
    axes[0].invert_yaxis()
    axes[0].set_xlabel("mean cosine with the full gradient, same batch")
    axes[1].set_xlabel("pruning noise / stock's minibatch noise (log)")
    axes[1].set_xscale("log")
    axes[1].set_xlim(0.02, 300)
    axes[1].axvline(1.0, color="grey", ls=":", lw=1)
    for ax in axes:
        ax.grid(alpha=0.3, axis="x")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.subplots_adjust(left=0.3)  # room for the longest setting labels
    fig.savefig(path, dpi=110)
    plt.close(fig)
