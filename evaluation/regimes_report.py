"""The "Regimes" section of docs/quality.md, from the regimes study's cached results (evaluation/regimes.py).

Readings, per cell (regime, batch size B) and setting, paired by seed against stock, 95% t-intervals over seeds:

- equal steps: the level of the held-out preference accuracy around the equal-steps budget N (mean of the curve at
  three points over the last third of the budget, as in the main tables);
- equal work: a setting whose work for N steps is c times stock's on the token clock (median over seeds) is read at
  N / c steps; equal measured s: the same with its seconds per step over stock's, timed round-robin in one process
  (regimes.Regimes.timing), plus auto's measurement; "(≥)" marks a run that ended before (a lower bound);
- time to stock's accuracy at N: when a setting first reaches it, over when stock itself first did (work, and
  seconds from the round-robin step time; "never" when a seed does not reach it in its run);
- auto: what it chose in each seed (branch / position keep probability for the pairs that are not near-copies), the
  measured B_simple and r, and the work its measurement took (share of the run's work to N).
"""

import json
import math
import statistics
from pathlib import Path

from .report import curve, interp, mean_ci, window, write_section
from .settings import SETTINGS as ALL

START, END = "<!-- regimes:start -->", "<!-- regimes:end -->"


def _runs(study, regime, batch, setting):
    folder = study.out / f"{regime}-b{batch}" / "runs"
    out = {}
    for path in sorted(folder.glob(f"{setting}-s*.json")):
        data = json.loads(path.read_text())
        if data.get("fingerprint") == study.fingerprint(regime, batch, setting, data["seed"]):
            out[data["seed"]] = data
    return out


def _level(run, step, width):
    xs, ys = curve(run, "pref_acc")
    return window(xs, ys, step, width)


def _measure_cost(run) -> float:
    """auto's measurement work in token units (all of it at step 0 in these short runs); older records kept only
    its seconds, converted at the run's own cost per second."""
    if "auto_measure_cost" in run:
        return run["auto_measure_cost"]
    if run.get("auto_measure_seconds"):
        return run["auto_measure_seconds"] / run["train_time"] * run["cost_units"]
    return 0.0


def _cost_at(run, step):
    """Work done by `step` in token units (forward 1 per executed token, backward 2, reference forward 1; train.py),
    auto's measurements included: the hardware-free clock of the equal-time reading."""
    xs, cs = curve(run, "cost")
    return interp([0] + xs, [0] + cs, step) + _measure_cost(run)


def _fmt(pair, signed=False, pct=True):
    mean, half = pair
    if mean is None or math.isnan(mean):
        return "—"
    scale = 100 if pct else 1
    sign = "+" if signed and mean >= 0 else ""
    body = f"{sign}{mean * scale:.1f}"
    return body if math.isnan(half) else f"{body} ± {half * scale:.1f}"


def _step_time_ratios(study, regime, batch) -> dict:
    """Seconds per step over stock's, round-robin in one process (regimes.Regimes.timing); {} when not timed."""
    path = study.out / f"timing-{regime}-b{batch}.json"
    if not path.is_file():
        return {}
    return {name: row["ratio"] for name, row in json.loads(path.read_text())["timing"].items()}


def cell_summary(study, regime, batch, settings):
    stock = _runs(study, regime, batch, "stock")
    if not stock:
        return None
    step_time = _step_time_ratios(study, regime, batch)
    n = next(iter(stock.values()))["config"]["steps"]
    width = n / 3
    out = {"steps": n, "seeds": sorted(stock), "rows": {}}
    stock_level = {s: _level(r, n, width) for s, r in stock.items()}
    stock_cost = {s: _cost_at(r, n) for s, r in stock.items()}
    for name in settings:
        runs = stock if name == "stock" else _runs(study, regime, batch, name)
        seeds = sorted(set(runs) & set(stock))
        if not seeds:
            continue
        ratio = statistics.median(_cost_at(runs[s], n) / stock_cost[s] for s in seeds)
        # seconds: the round-robin step time, plus auto's measurement (its share of the run's token work to N)
        measured = step_time[name] + statistics.median(_measure_cost(runs[s]) / stock_cost[s] for s in seeds) \
            if name in step_time else math.nan
        max_steps = min(runs[s]["max_steps"] for s in seeds)
        target = n / ratio
        lower = target > max_steps
        at_n = [_level(runs[s], n, width) for s in seeds]
        at_t = [_level(runs[s], min(target, max_steps), width) for s in seeds]
        timed = math.isfinite(measured)
        target_s = n / measured if timed else math.nan  # the same reading on the measured seconds
        at_s = [_level(runs[s], min(target_s, max_steps), width) for s in seeds] if timed else []
        row = {
            "seeds": len(seeds), "ratio": ratio, "measured_ratio": measured, "lower_bound": lower,
            "acc_n": mean_ci(at_n), "d_n": mean_ci([a - stock_level[s] for a, s in zip(at_n, seeds)]),
            "acc_t": mean_ci(at_t), "d_t": mean_ci([a - stock_level[s] for a, s in zip(at_t, seeds)]),
            "d_s": mean_ci([a - stock_level[s] for a, s in zip(at_s, seeds)]) if timed else (math.nan, math.nan),
            "lower_bound_s": timed and target_s > max_steps,
        }
        if name != "stock":
            row["reach"] = _time_to_reach(runs, stock, stock_level, seeds, measured)
        autos = [runs[s].get("auto") for s in seeds if runs[s].get("auto")]
        if autos:
            first = [a[0] for a in autos]
            row["auto"] = {
                "branch_seeds": [f["branch_keep_prob"] for f in first],
                "position_seeds": [f["position_keep_prob"] for f in first],
                "b_simple": statistics.median(f["b_simple"] for f in first),
                "r_branch": statistics.median(f["r_branch"] for f in first),
                "r_branch_point": statistics.median(f.get("r_branch_point", f["r_branch"]) for f in first),
                "r_position": statistics.median(f.get("r_position") or 0.0 for f in first),  # None: not probed
                "near": statistics.median(f.get("near_copy_fraction", math.nan) for f in first),  # old auto only
                "half_cost": statistics.median(f.get("branch_half_cost", math.nan) for f in first),
                "overhead": statistics.median(_measure_cost(runs[s]) / _cost_at(runs[s], n) for s in seeds
                                              if runs[s].get("auto")),
            }
        out["rows"][name] = row
    return out


def _first_reach(run, level):
    """The first evaluated step at which the held-out accuracy reaches `level`, or None."""
    xs, ys = curve(run, "pref_acc")
    return next((x for x, y in zip(xs, ys) if y >= level), None)


def _time_to_reach(runs, stock, stock_level, seeds, measured):
    """Time to stock's held-out accuracy at N, over the time stock itself took to first reach it (medians over seeds):
    on the token clock, and in seconds (steps to it times the setting's round-robin step time over stock's). A seed
    that never reaches it counts its whole run (a lower bound, counted as "never")."""
    work, seconds, never = [], [], 0
    for s in seeds:
        run = runs[s]
        stock_hit = _first_reach(stock[s], stock_level[s]) or curve(stock[s], "pref_acc")[0][-1]
        hit = _first_reach(run, stock_level[s])
        if hit is None:
            never += 1
            hit = curve(run, "pref_acc")[0][-1]
        work.append(_cost_at(run, hit) / _cost_at(stock[s], stock_hit))
        seconds.append(hit / stock_hit * measured)
    return statistics.median(work), statistics.median(seconds), never


def b_simple(meta: dict) -> float:
    """tr(Σ) / |G|² from diagnose's metadata: per-batch noise E|g_B - G|² = tr(Σ) / B, and |Ḡ|² of the mean of n
    batches, which overestimates |G|² by tr(Σ) / (n B)."""
    batch, noise, n = meta["batch_size"], meta["sgd_noise"], meta["sgd_batches"]
    g2 = meta["pooled_norm2"] - noise / n
    return batch * noise / g2 if g2 > 0 else math.inf


def _gradients(study, regime):
    path = study.out / f"gradients-{regime}.json"
    if not path.is_file():
        return None
    diag = json.loads(path.read_text())["diagnostics"]
    return {"b_simple": b_simple(diag["_meta"]), **{k: v["noise_vs_sgd"] for k, v in diag.items() if k != "_meta"}}


def _model_factor(b_simple, r, batch):
    """Predicted steps to a loss relative to stock's: (1 + B_simple (1 + r) / B) / (1 + B_simple / B)."""
    if b_simple is None or r is None or not math.isfinite(b_simple):
        return None
    return (1 + b_simple * (1 + r) / batch) / (1 + b_simple / batch)


def render(study, regimes, batches, settings) -> str:
    diagnosed = study.diagnosed  # the regimes study's design, read from the study (this module never imports it)
    lines = [START, "", "## Regimes: data x batch size", ""]
    lines += [
        "Generated by `python -m evaluation.regimes --stage report --docs docs` (evaluation/regimes.py, "
        "evaluation/regimes_report.py). Same starting policy as above; the same number of steps at every batch size "
        f"(N = {study.steps}, so B = 64 sees 8x the pairs of B = 8), learning rate 1e-4 x sqrt(B / 8) (square-root "
        "rule for Adam), warmup 80 pairs; every run goes on to 1.5 N to be read at equal work. *near*: the main "
        "study's near-copy pairs; *dissimilar*: two different answers that differ from the first response token on, "
        "10% of labels swapped as annotators disagree (tasks.dissimilar_pairs). "
        f"{study.n_test} held-out pairs. Δ in points, paired by seed against stock, mean ± 95% t-interval. *Equal work* "
        "reads a setting at N / c steps, c its work for N steps over stock's on the token clock (forward 1 per "
        "executed token, backward 2, reference forward 1; padding executed counts; auto's measurements included; "
        "median over seeds); *equal measured s* does the same with the measured seconds per step over stock's (the "
        "bracketed ratio: full training steps timed round-robin in one process on the same batches, median over "
        f"{study.timing_rounds} rounds, one CPU thread; auto's measurement added as its share of the run's work to N; "
        "these are CPU seconds, where the packed forward's dense attention mask costs more than its tokens say).",
        "",
    ]
    diag = {r: _gradients(study, r) for r in regimes}
    lines += ["Noise, per regime, at the starting policy (batches of 8 pairs): B_simple = tr(Σ) / |G|² of stock, and "
              "each setting's extra-noise ratio r (noise / SGD noise).", "",
              "| regime | B_simple | " + " | ".join(ALL[n].label for n in diagnosed) + " |",
              "|---|---|" + "---|" * len(diagnosed)]
    for regime in regimes:
        g = diag[regime]
        if g is None:
            lines.append(f"| {regime} | (not measured) |" + " |" * len(diagnosed))
            continue
        cells = [f"{g[n]:.2f}" if n in g else "—" for n in diagnosed]
        lines.append(f"| {regime} | {g['b_simple']:.1f} | " + " | ".join(cells) + " |")
    lines += ["", "| regime | B | setting | seeds | work per step (x stock) [measured s] | Δ @N | Δ @ equal work | "
              "Δ @ equal measured s | model: steps x | time to stock's acc @N, over stock's own: work [s] |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    auto_lines = []
    for regime in regimes:
        g = diag[regime] or {}
        for batch in batches:
            summary = cell_summary(study, regime, batch, settings)
            if summary is None:
                lines.append(f"| {regime} | {batch} | (no runs yet) | | | | | | | |")
                continue
            stock = summary["rows"]["stock"]
            lines.append(f"| {regime} | {batch} | stock: {_fmt(stock['acc_n'])} % @N = {summary['steps']} | "
                         f"{stock['seeds']} | 1.00 | — | — | — | — | — |")
            for name in settings:
                row = summary["rows"].get(name)
                if name == "stock" or row is None:
                    continue
                factor = _model_factor(g.get("b_simple"), g.get(name), batch)
                reach, reach_s, never = row["reach"]
                reach_text = f"{reach:.2f} [{reach_s:.2f}]" + (f" ({never} never)" if never else "")
                lines.append(
                    f"| {regime} | {batch} | {ALL[name].label} | {row['seeds']} | {row['ratio']:.2f} [{row['measured_ratio']:.2f}] | "
                    f"{_fmt(row['d_n'], signed=True)} | {_fmt(row['d_t'], signed=True)}"
                    f"{' (≥)' if row['lower_bound'] else ''} | {_fmt(row['d_s'], signed=True)}"
                    f"{' (≥)' if row['lower_bound_s'] else ''} | {'—' if factor is None else f'{factor:.2f}'} | "
                    f"{reach_text} |")
                if "auto" in row:
                    a = row["auto"]
                    auto_lines.append(
                        f"| {regime} | {batch} | {ALL[name].label} | {', '.join(f'{v:g}' for v in a['branch_seeds'])} | "
                        f"{', '.join(f'{v:g}' for v in a['position_seeds'])} | {a['near']:.0%} | "
                        f"{a['b_simple']:.1f} | {a['r_branch']:.2f} ({a['r_branch_point']:.2f}) | "
                        f"{a['r_position']:.2f} | {a['half_cost']:.2f} | {a['overhead']:.1%} |")
    lines += ["", "*model: steps x* is the critical-batch prediction of the steps to a given loss relative to stock, "
              "(1 + B_simple (1 + r) / B) / (1 + B_simple / B), from the noise table; a setting pays at equal work when "
              "its work per step times this factor is below 1.", ""]
    if auto_lines:
        lines += ["What `auto` chose in each seed (its one measurement, at step 0), for the pairs that are not "
                  "near-copies (near-copies always keep both branches), from what it measured (medians over seeds: "
                  "B_simple; each family's r at p = 1/2, at the 90% upper bound the choice reads, point estimate in "
                  "brackets; the work of a branch draw at 1/2 over the exact work, through the run's own forward), "
                  "and the work its measurement took as a share of the run's work to N (a run this short pays it in "
                  "full; a long run pays it once per MEASURE_EVERY = 200 steps):", "",
                  "| regime | B | setting | branch keep (per seed) | position keep (per seed) | near-copy pairs | "
                  "B_simple (measured) | r branch @0.5 bound (point) | r position @0.5 | branch work @0.5 | "
                  "measurement work (share of run to N) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|",
                  *auto_lines, ""]
    lines.append(END)
    return "\n".join(lines) + "\n"


def write(study, regimes, batches, settings, docs: Path | None):
    text = render(study, regimes, batches, settings)
    path = study.out / "regimes.md" if docs is None else Path(docs) / "quality.md"
    if docs is None:
        path.write_text(text)
    else:
        write_section(path, START, END, text)
    print(f"wrote {path}", flush=True)
    return text
