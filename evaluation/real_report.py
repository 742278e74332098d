"""The real-model study's tables and plot, from its stored cells (`python -m evaluation.real_models --report`).

Per (model, task), one row per setting, each number the median over seeds with its [min, max]:
- held-out reward accuracy and margin after the plan's steps (equal steps; every held-out pair);
- held-out reward accuracy at equal CPU time: every setting read at the same training CPU time, the fastest setting's
  median time for the plan's steps (each seed's curve interpolated between its evaluations, step 0 at 0.5; the
  curve's pairs, the first `curve_pairs` held-out pairs, are what every evaluation scores);
- the training CPU time to reach stock's final accuracy on the curve's pairs (the same seed's), where the curve gets
  there;
- training CPU time per step, and its speed-up over stock and over the exact preset (per-seed ratios: median [min, max]);
- policy tokens executed per step (stock: the padded chosen and rejected rows);
- what `auto` chose (its last decision: branch and position keep probabilities, and its reason).

Only measured numbers: a setting with no stored cell is left out, a reading a curve does not reach says so.
"""

import statistics
from pathlib import Path

from .report import interp  # the toy study's linear interpolation between evaluation points
from .store import REPO

DOCS = REPO / "docs"
BEGIN, END = "<!-- real_models:begin (generated: python -m evaluation.real_models --report) -->", \
    "<!-- real_models:end -->"


def _groups(records):
    """{(model, task): {setting: [records by seed]}} in the study's orders, the latest record of a cell kept."""
    from .real_run import SETTINGS

    cells = {}
    for record in records:
        cells[(record["model"], record["task"], record["setting"], record["seed"], record["steps"])] = record
    groups = {}
    for (model, task, setting, _, _), record in cells.items():
        groups.setdefault((model, task), {}).setdefault(setting, []).append(record)
    return {key: {s: sorted(groups[key][s], key=lambda r: r["seed"]) for s in SETTINGS if s in groups[key]}
            for key in sorted(groups)}


def _curve(record, x):
    """(x, accuracy on the curve's pairs) at every evaluation, step 0 (0.5) included."""
    return [p[x] for p in record["curve"]], [p["curve_accuracy"] for p in record["curve"]]


def spread(values, fmt="{:.3f}") -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "n/a"
    body = fmt.format(statistics.median(values))
    low, high = fmt.format(min(values)), fmt.format(max(values))
    return body if low == high else f"{body} [{low}, {high}]"


def reach_time(record, target: float):
    """The training CPU time at which the record's accuracy curve first reaches `target` (linear between
    evaluations), or None."""
    xs, ys = _curve(record, "cpu")
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if y1 >= target:
            return x0 + (x1 - x0) * (target - y0) / (y1 - y0) if y1 > y0 and y0 < target else x1
    return None


def summarize(runs: dict) -> tuple[dict, float]:
    """Per setting of one (model, task): the per-seed readings; and the equal-CPU-time budget read at."""
    final_cpu = {s: statistics.median(r["curve"][-1]["cpu"] for r in rs) for s, rs in runs.items()}
    budget = min(final_cpu.values())
    stock_final = {r["seed"]: r["curve"][-1]["curve_accuracy"] for r in runs.get("stock", [])}
    rows = {}
    for setting, records in runs.items():
        reached = [reach_time(r, stock_final[r["seed"]]) if r["seed"] in stock_final else None for r in records]
        rows[setting] = {
            "seeds": [r["seed"] for r in records],
            "steps": records[0]["steps"],
            "acc": [r["curve"][-1]["accuracy"] for r in records],
            "margin": [r["curve"][-1]["margin"] for r in records],
            "acc_equal_cpu": [interp(*_curve(r, "cpu"), budget) for r in records],
            "reach": reached,
            "step_cpu": [statistics.median(r["step_cpu"]) for r in records],
            "tokens": [r["tokens_executed"] / r["steps"] for r in records],
            "auto": [r.get("auto_choice") for r in records],
        }
    return rows, budget


def paired_speedup(base: dict | None, row: dict) -> str:
    """The base's CPU per step over the row's, per seed both ran (a seed's cells may run in different sessions, on a
    machine whose speed drifts: a ratio is read within a seed), median [min, max] over those seeds."""
    by_seed = dict(zip(base["seeds"], base["step_cpu"])) if base else {}
    return spread([by_seed[seed] / step for seed, step in zip(row["seeds"], row["step_cpu"]) if seed in by_seed],
                  "{:.2f}x")


def _auto_text(choices) -> str:
    made = [c for c in choices if c]
    if not made:
        return ""
    kinds = sorted({f"branch {c[0]:g}, position {c[1]:g}" for c in made})
    return "; ".join(kinds)


def table(model: str, task: str, runs: dict) -> str:
    from .real_run import LABELS

    rows, budget = summarize(runs)
    any_row = next(iter(runs.values()))[0]
    curve_pairs = any_row["curve"][1].get("pairs") if len(any_row["curve"]) > 2 else any_row["eval_pairs"]
    training = "full fine-tuning" if any_row.get("training") == "full" else "LoRA"
    lines = [f"**{model} x {task}**: {any_row['steps']} steps of {any_row['pairs']} pairs, {training}; equal steps: "
             f"{any_row['eval_pairs']} held-out pairs; curves (equal CPU time, time to stock's accuracy): the first "
             f"{curve_pairs} of them at steps {', '.join(str(p['step']) for p in any_row['curve'][1:])}; equal CPU "
             f"time = {budget:.0f} s of training CPU (the fastest setting's median for those steps). Median over "
             "seeds [min, max].", "",
             f"| setting | seeds | accuracy, equal steps ({any_row['eval_pairs']} pairs) | margin, equal steps | "
             f"accuracy, equal CPU time ({curve_pairs} pairs) | CPU s to stock's final accuracy ({curve_pairs} pairs) "
             "| CPU s / step | speed-up vs stock / vs exact | policy tokens / step |",
             "|---|---|---|---|---|---|---|---|---|"]
    for setting, row in rows.items():
        ratios = " / ".join(paired_speedup(rows.get(base), row) for base in ("stock", "exact"))
        reached = [t for t in row["reach"] if t is not None]
        reach = (spread(reached, "{:.0f}") + ("" if len(reached) == len(row["reach"]) else
                                               f" ({len(row['reach']) - len(reached)} of {len(row['reach'])} "
                                               "seeds not within the steps)")) if reached else "not within the steps"
        label = LABELS[setting] + (f" (chose: {_auto_text(row['auto'])})" if _auto_text(row["auto"]) else "")
        lines.append(f"| {label} | {len(row['seeds'])} | {spread(row['acc'])} | {spread(row['margin'], '{:+.3f}')} | "
                     f"{spread(row['acc_equal_cpu'])} | {reach} | {spread(row['step_cpu'], '{:.2f}')} | {ratios} | "
                     f"{spread(row['tokens'], '{:.0f}')} |")
    return "\n".join(lines)


def auto_verdict(model: str, task: str, runs: dict) -> str:
    """`auto` against the best fixed setting and the exact preset at equal CPU time (medians, and the seeds' range)."""
    if "auto" not in runs:
        return ""
    rows, budget = summarize(runs)
    median = {s: statistics.median(r["acc_equal_cpu"]) for s, r in rows.items()}
    fixed = {s: v for s, v in median.items() if s != "auto"}
    best = max(fixed, key=fixed.get)
    # The target (docs/quality.md): within 2 points of the best setting and of the exact preset, or of the wider seed
    # range of the two settings compared if larger.
    def seed_range(setting):
        return max(rows[setting]["acc_equal_cpu"]) - min(rows[setting]["acc_equal_cpu"])

    allowed = {s: max(0.02, seed_range("auto"), seed_range(s)) for s in (best, "exact") if s in fixed}
    met = all(median["auto"] - fixed[s] >= -allowance for s, allowance in allowed.items())
    seeds = min(len(rows[s]["seeds"]) for s in {"auto", best})
    spread_text = (f"target {'met' if met else 'MISSED'}: allowed "
                   + ", ".join(f"-{a:.3f} against {'the exact preset' if s == 'exact' else s}"
                               for s, a in allowed.items())
                   + (" (one seed: 64 pairs read one pair as 0.016)" if seeds < 2 else ""))
    reasons = sorted({c[3] for c in rows["auto"]["auto"] if c})
    text = (f"- {model} x {task}: at {budget:.0f} s of training CPU, `auto` {median['auto']:.3f}, the best fixed "
            f"setting ({best}) {fixed[best]:.3f} ({median['auto'] - fixed[best]:+.3f}), the exact preset "
            f"{median.get('exact', float('nan')):.3f}; {spread_text}.")
    if reasons:
        text += " Its last decision: " + " | ".join(f"\"{r}\"" for r in reasons)
    return text


def plot(groups: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    from .real_run import LABELS

    figure, axes = plt.subplots(len(groups), 2, figsize=(11, 3.6 * len(groups)), squeeze=False, sharey="row")
    colors = plt.get_cmap("tab10")
    for row, ((model, task), runs) in enumerate(groups.items()):
        for column, (x, label) in enumerate((("step", "training step"),
                                             ("cpu", "training CPU time (s, one thread; evaluation excluded)"))):
            axis = axes[row][column]
            for i, (setting, records) in enumerate(runs.items()):
                points = sorted({p[x] for r in records for p in r["curve"]})
                end = min(r["curve"][-1][x] for r in records)
                grid = [g for g in points if g <= end] if x == "step" else [end * k / 40 for k in range(41)]
                values = [[interp(*_curve(r, x), g) for r in records] for g in grid]
                axis.plot(grid, [statistics.median(v) for v in values], color=colors(i), label=LABELS[setting],
                          lw=1.8 if setting in ("stock", "exact", "auto") else 1.1, marker="o" if x == "step" else None,
                          ms=3)
                axis.fill_between(grid, [min(v) for v in values], [max(v) for v in values], color=colors(i),
                                  alpha=0.12, lw=0)
            axis.axhline(0.5, color="grey", ls="--", lw=1)
            axis.set(xlabel=label, title=f"{model} x {task}")
            axis.grid(alpha=0.3)
        axes[row][0].set_ylabel("held-out reward accuracy, the curve's pairs\n(median over seeds, band: min-max)")
    axes[0][1].legend(fontsize=7, loc="lower right")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return True


def cells_line(groups: dict) -> str:
    parts = []
    for (model, task), runs in groups.items():
        for setting, records in runs.items():
            parts.append(f"{model}/{task}/{setting}: seeds {','.join(str(r['seed']) for r in records)} "
                         f"({records[0]['steps']} steps)")
    return "; ".join(parts)


def write_report(records, out, docs: Path = DOCS) -> str:
    """The tables (printed, and spliced into `docs`/quality.md between its markers) and the plot
    (`docs`/img/real_models.png)."""
    image, headline = docs / "img" / "real_models.png", docs / "quality.md"
    groups = _groups(records)
    if not groups:
        out.write("no stored study cells\n")
        return ""
    blocks = [table(model, task, runs) for (model, task), runs in groups.items()]
    verdicts = [v for v in (auto_verdict(m, t, r) for (m, t), r in groups.items()) if v]
    commits = sorted({r["commit"] for rs in groups.values() for recs in rs.values() for r in recs})
    dates = sorted({r["date"][:10] for rs in groups.values() for recs in rs.values() for r in recs})
    text = "\n\n".join(blocks + (["`auto` at equal CPU time:\n\n" + "\n".join(verdicts)] if verdicts else []) + [
        f"Cells stored: {cells_line(groups)}. Measured {', '.join(dates)} at commit(s) {', '.join(commits)}, one "
        "torch thread, CPU time of the training process (user + system) on the project's shared 2-core machine."])
    drawn = plot(groups, image)
    out.write(text + "\n" + (f"\nwrote {image}\n" if drawn else "\n(no plot: matplotlib missing)\n"))
    if headline.is_file():
        doc = headline.read_text()
        if BEGIN in doc and END in doc:
            head, rest = doc.split(BEGIN, 1)
            headline.write_text(head + BEGIN + "\n" + text + "\n" + END + rest.split(END, 1)[1])
            out.write(f"updated {headline}\n")
    return text
