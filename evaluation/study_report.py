"""The pre-registered study's analysis (docs/study.md, as amended under "Changes", 2026-12-05), from its store
(`python -m evaluation.real_models --plan prereg --report`). Written before any study cell ran; it fits nothing and
chooses nothing from the cells.

Which cells: only those of one pin (commit, dirty flag, libraries' versions, rules' hash: study_pin.Provenance), the
pinned commit's (`study_pin.txt` next to the store, or `--pin-commit`); cells of other pins stay in the store and are
listed as superseded, never mixed into a table. With no pin given and cells of several pins stored, it refuses.

Per (model, task), each setting against the exact preset, paired by seed (same seed, same held-out pairs), mean over
seeds and its 95% paired t-interval:
- readouts (`real_run.held_out_readouts`, recomputed from each record's per-pair margins): the held-out DPO loss and
  the mean margin (primary), reward accuracy (secondary);
- equal steps: at every evaluated step; equal time: each setting's run over its N steps (N from the calibration; a
  setting whose N is the plan's steps reads its equal-steps run) against the exact preset's last step, with the steps
  and the training user CPU it used against the exact preset's;
- the speed-up (median user CPU per step against the exact preset's, same seed);
- stock against the exact preset, judged: at most one held-out pair apart in accuracy at every evaluation;
- divergence (real_run.divergence), counted per setting and arm, every diverged run listed and kept in the numbers;
- `auto`'s verdict (non-inferiority against the exact preset at equal time, NONINFERIORITY below), with its keep
  probabilities over the run and its executed-token share beside it.

Plots (`plot`, with `--report`): per task, the held-out DPO loss and the mean margin against the training step and
against the training user CPU, each seed's run faint, the mean over seeds bold, the equal-time runs' end points marked.
"""

import statistics
from dataclasses import dataclass
from pathlib import Path

from .real_run import LABELS, held_out_readouts
from .study_pin import record_pin_label

# The readouts, in order: the two primary ones, then the secondary one; and whether lower is better.
READOUTS = ("loss", "margin", "accuracy")
LOWER_IS_BETTER = {"loss": True, "margin": False, "accuracy": False}
# `auto`'s non-inferiority margins (docs/study.md, "Changes", 2026-12-05), on both primary readouts, at equal time,
# against the exact preset: the 95% paired interval's upper bound of (auto - exact) held-out DPO loss below +0.02,
# and its lower bound of (auto - exact) mean margin above -0.05.
NONINFERIORITY = {"loss": 0.02, "margin": 0.05}
MIN_SEEDS = 5
STOCK_PAIRS_APART = 1  # stock against the exact preset: at most this many held-out pairs apart in accuracy
# Student's t, 0.975 quantile, by degrees of freedom (1..30); above 30, 1.96.
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


@dataclass(frozen=True)
class Paired:
    """Per-seed differences' mean and 95% paired t-interval (`half` None below two seeds)."""

    mean: float
    half: float | None
    n: int

    @property
    def identical(self) -> bool:
        """Every difference the same (two seeds or more): a zero-width interval that says nothing of the spread."""
        return self.half == 0.0

    @property
    def low(self) -> float | None:
        return None if self.half is None else self.mean - self.half

    @property
    def high(self) -> float | None:
        return None if self.half is None else self.mean + self.half


def paired(differences: list[float]) -> Paired:
    n = len(differences)
    mean = sum(differences) / n
    if n < 2:
        return Paired(mean, None, n)
    t = T975[n - 2] if n - 1 <= len(T975) else 1.96
    return Paired(mean, t * statistics.stdev(differences) / n ** 0.5, n)


def _show(readout: str, p: Paired) -> str:
    scale, unit = (100, "") if readout == "accuracy" else (1, "")
    digits = 1 if readout == "accuracy" else 4
    text = f"{scale * p.mean:+.{digits}f}{unit}"
    if p.identical:
        return text + f" (identical in all {p.n})"
    return text + ("" if p.half is None else f" ± {scale * p.half:.{digits}f}") + f" ({p.n})"


# -------------------------------------------------------------------------------------------------- the cells read


def readouts(point: dict) -> dict:
    """A curve point's readouts: recomputed from its per-pair margins where it has them, else as stored."""
    if "margins" in point:
        return held_out_readouts(point["margins"])
    return {k: point[k] for k in READOUTS if k in point}


def _point(record: dict, step: int | None = None) -> dict | None:
    """The readouts at `step` (None: the record's last evaluation)."""
    if step is None:
        return readouts(record["curve"][-1])
    return next((readouts(p) for p in record["curve"] if p["step"] == step), None)


def select(records: list[dict], pinned: str | None) -> tuple[list[dict], dict[str, int], str | None]:
    """(the cells of one pin, {other pin: cells} superseded, a refusal or None). Only study cells (plan prereg or
    smoke) count."""
    study = [r for r in records if r.get("plan") in ("prereg", "smoke")]
    labels = {}
    for record in study:
        labels.setdefault(record_pin_label(record), []).append(record)
    if pinned is not None:
        chosen = [label for label, rs in labels.items()
                  if any(r.get("provenance", {}).get("commit", "").startswith(pinned) for r in rs)]
    else:
        chosen = list(labels)
    if len(chosen) > 1:
        return [], {}, ("refusing to mix cells of different pins in one table; pins present:\n  " + "\n  ".join(
            f"{label}: {len(labels[label])} cells" for label in sorted(labels))
            + "\n(give the pinned commit: --pin-commit, or study_pin.txt next to the store)")
    current = labels[chosen[0]] if chosen else []
    return current, {label: len(rs) for label, rs in labels.items() if label not in chosen}, None


def cells_by_task(records: list[dict]) -> tuple[dict, list[str]]:
    """({(model, task): {(setting, arm): {seed: record}}}, duplicates: the first record of a key is kept)."""
    out, seen, duplicates = {}, set(), []
    for record in records:
        if record["key"] in seen:
            duplicates.append(f"{record['task']} {record['setting']} {record.get('arm')} seed {record['seed']}")
            continue
        seen.add(record["key"])
        out.setdefault((record["model"], record["task"]), {}).setdefault(
            (record["setting"], record.get("arm", "steps")), {})[record["seed"]] = record
    return out, duplicates


def equal_time(cells: dict, steps: int) -> dict:
    """{setting: {seed: record read at equal time}}: the exact preset's equal-steps run; each other setting's
    equal-time run, or its equal-steps run where its N (`equal_time_steps`, from the calibration) is the plan's steps
    (the two runs would be one)."""
    out = {"exact": dict(cells.get(("exact", "steps"), {}))}
    for (setting, arm), by_seed in cells.items():
        if setting == "exact" or setting == "stock":
            continue
        for seed, record in by_seed.items():
            if arm == "time" or record.get("equal_time_steps") == steps:
                out.setdefault(setting, {})[seed] = record
    return out


def differences(records: dict, exact: dict, readout: str, step: int | None, exact_step: int | None = None):
    """Per-seed (setting - exact preset) differences of one readout, on the seeds both have."""
    out = []
    for seed, record in sorted(records.items()):
        if seed not in exact:
            continue
        mine, theirs = _point(record, step), _point(exact[seed], exact_step if exact_step is not None else step)
        if mine and theirs and readout in mine and readout in theirs:
            out.append(mine[readout] - theirs[readout])
    return out


# -------------------------------------------------------------------------------------------------- the verdicts


def noninferior(diffs: list[float], readout: str) -> tuple[bool | None, str]:
    """(passed, why) of one primary readout's non-inferiority test; None: not decidable (fewer than MIN_SEEDS
    seeds, or identical differences, whose zero-width interval is no evidence of anything)."""
    if len(diffs) < MIN_SEEDS:
        return None, f"{len(diffs)} paired seeds (the test needs {MIN_SEEDS})"
    p = paired(diffs)
    delta = NONINFERIORITY[readout]
    if p.identical:
        return None, f"{readout}: the {p.n} differences are identical ({p.mean:+.4f}): no interval, not tested"
    if LOWER_IS_BETTER[readout]:
        ok = p.high < delta
        return ok, (f"{readout} (lower is better): auto - exact {p.mean:+.4f}, 95% interval [{p.low:+.4f}, "
                    f"{p.high:+.4f}]; upper bound {'below' if ok else 'NOT below'} +{delta:g}")
    ok = p.low > -delta
    return ok, (f"{readout} (higher is better): auto - exact {p.mean:+.4f}, 95% interval [{p.low:+.4f}, "
                f"{p.high:+.4f}]; lower bound {'above' if ok else 'NOT above'} -{delta:g}")


def wording(loss: Paired | None, margin: Paired | None) -> str:
    """A fixed setting's equal-time reading in words (docs/study.md, "Changes" 2): *costs quality* when the loss
    interval lies wholly above 0 or the margin interval wholly below 0, *gains* when the reverse, *no difference
    measured* otherwise; descriptive only."""
    if loss is None or margin is None or loss.half is None or margin.half is None:
        return "–"
    costs = loss.low > 0 or margin.high < 0
    gains = loss.high < 0 or margin.low > 0
    return "mixed" if costs and gains else "costs quality" if costs else "gains" if gains else "no difference measured"


def auto_verdict(cells: dict, steps: int) -> tuple[str, str]:
    """("met" | "missed" | "experimental", the reasons) of `auto` on one task: non-inferior to the exact preset at
    equal time on both primary readouts. Fewer than MIN_SEEDS paired seeds: "experimental" (docs/study.md); an
    undecidable test (identical differences) is not a pass: "missed"."""
    timed = equal_time(cells, steps)
    if "auto" not in timed or not timed["exact"]:
        return "experimental", "no equal-time cells of auto or the exact preset"
    results = [noninferior(differences(timed["auto"], timed["exact"], readout, None), readout)
               for readout in NONINFERIORITY]
    reasons = "; ".join(dict.fromkeys(why for _, why in results))
    if any(ok is None and "paired seeds" in why for ok, why in results):
        return "experimental", reasons
    return ("met" if all(ok for ok, _ in results) else "missed"), reasons


def auto_choices(records: dict) -> str:
    """What `auto` did over its runs: the share of steps at each (branch, position) keep probability, its mean
    position keep probability, its executed-token share and its last stated reason."""
    counts, total, shares, reasons = {}, 0, [], set()
    for record in records.values():
        for branch, position in record.get("auto_keep_probs_steps", []):
            counts[(branch, position)] = counts.get((branch, position), 0) + 1
            total += 1
        shares.append(record.get("tokens_executed_share", 1.0))
        if record.get("auto_choice"):
            reasons.add(str(record["auto_choice"][-1]))
    if not records:
        return "no runs"
    kinds = ", ".join(f"branch {b:g} / position {p:g} on {100 * k / total:.0f}% of steps"
                      for (b, p), k in sorted(counts.items())) if total else "no per-step record"
    mean_position = (sum(p * k for (_, p), k in counts.items()) / total) if total else float("nan")
    return (f"{kinds}; mean position keep probability {mean_position:.3f}; executed-token share "
            f"{statistics.mean(shares):.3f} (mean over {len(shares)} runs); last reasons: "
            + " | ".join(sorted(reasons)))


def stock_judged(cells: dict, steps: list[int]) -> list[str]:
    """Stock against the exact preset on the seeds stock ran: holds when every evaluation is at most
    STOCK_PAIRS_APART held-out pair(s) apart in accuracy."""
    exact, lines = cells.get(("exact", "steps"), {}), []
    for seed, record in sorted(cells.get(("stock", "steps"), {}).items()):
        if seed not in exact:
            lines.append(f"Stock, seed {seed}: no exact-preset cell of that seed yet.")
            continue
        pairs = record["eval_pairs"]
        gaps, margins = [], []
        for s in steps:
            mine, theirs = _point(record, s), _point(exact[seed], s)
            if mine and theirs:
                gaps.append((s, round(abs(mine["accuracy"] - theirs["accuracy"]) * pairs)))
                margins.append(abs(mine["margin"] - theirs["margin"]))
        holds = bool(gaps) and all(g <= STOCK_PAIRS_APART for _, g in gaps)
        lines.append(f"Stock against the exact preset, seed {seed}: {'HOLDS' if holds else 'FAILS'} (at most "
                     f"{STOCK_PAIRS_APART} held-out pair apart at every evaluation): pairs apart "
                     + ", ".join(f"step {s} {g}" for s, g in gaps)
                     + (f"; largest mean-margin difference {max(margins):.2e}" if margins else "") + ".")
    return lines


# -------------------------------------------------------------------------------------------------- the report


def _step_cpu_ratio(records: dict, exact: dict) -> str:
    ratios = [statistics.median(r["step_user"]) / statistics.median(exact[seed]["step_user"])
              for seed, r in records.items() if seed in exact and r.get("step_user") and exact[seed].get("step_user")]
    return f"{statistics.median(ratios):.3f} [{min(ratios):.3f}, {max(ratios):.3f}]" if ratios else "–"


def report(model: str, task: str, cells: dict) -> str:
    exact = cells.get(("exact", "steps"), {})
    lines = [f"**{model} x {task}**"]
    if not exact:
        return "\n".join(lines + ["no exact-preset cell stored: nothing is compared"])
    any_exact = next(iter(exact.values()))
    steps_total = any_exact["steps"]
    steps = [p["step"] for p in any_exact["curve"][1:]]
    lines.append(f"{steps_total} steps of {any_exact['pairs']} pairs, {any_exact['training']}, "
                 f"{any_exact['eval_pairs']} held-out pairs at steps {', '.join(map(str, steps))}; exact-preset "
                 f"seeds {', '.join(map(str, sorted(exact)))}. Differences paired by seed against the exact preset: "
                 "mean ± 95% t half-width (seeds); loss and margin in their units, accuracy in points.")
    loads = [x for by_seed in cells.values() for r in by_seed.values() for x in r.get("load", [])]
    if loads:
        lines.append(f"The machine's 1-minute load average at the cells' starts and ends: median "
                     f"{statistics.median(loads):.1f} [{min(loads):.1f}, {max(loads):.1f}].")
    others = [(s, by_seed) for (s, arm), by_seed in cells.items() if arm == "steps" and s != "exact"]
    for readout in READOUTS:
        kind = "primary" if readout in NONINFERIORITY else "secondary"
        better = "lower" if LOWER_IS_BETTER[readout] else "higher"
        lines += ["", f"Equal steps, held-out {readout} ({kind}; {better} is better):", "",
                  "| setting | " + " | ".join(f"step {s}" for s in steps) + " |", "|---|" + "---|" * len(steps)]
        means = []
        for s in steps:
            values = [p[readout] for r in exact.values() if (p := _point(r, s)) and readout in p]
            means.append(f"{statistics.mean(values):.4f} ({len(values)})" if values else "–")
        lines.append("| exact preset (mean) | " + " | ".join(means) + " |")
        for setting, by_seed in others:
            row = [(_show(readout, paired(d)) if (d := differences(by_seed, exact, readout, s)) else "–")
                   for s in steps]
            lines.append(f"| {LABELS[setting]} | " + " | ".join(row) + " |")

    lines += ["", "Speed (equal-steps arm): median user CPU per step against the exact preset's, same seed, median "
              "[range] over seeds:", ""]
    lines += [f"- {LABELS[s]}: {_step_cpu_ratio(by_seed, exact)}" for s, by_seed in others]

    timed = equal_time(cells, steps_total)
    lines += ["", f"Equal time (each setting over its N steps from the calibration, against the exact preset at step "
              f"{steps_total}):", "",
              "| setting | seeds | N | user CPU / exact's | " + " | ".join(f"{r} vs exact" for r in READOUTS)
              + " | reading |", "|---|---|---|---|" + "---|" * len(READOUTS) + "---|"]
    for setting, by_seed in timed.items():
        if setting == "exact" or not by_seed:
            continue
        n_steps = sorted({r["steps"] for r in by_seed.values()})
        used = [sum(r["step_user"]) / sum(exact[seed]["step_user"]) for seed, r in by_seed.items() if seed in exact]
        intervals = {readout: (paired(d) if (d := differences(by_seed, exact, readout, None)) else None)
                     for readout in READOUTS}
        cells_ = [_show(readout, p) if p else "–" for readout, p in intervals.items()]
        lines.append(f"| {LABELS[setting]} | {len(by_seed)} | {'/'.join(map(str, n_steps))} | "
                     + (f"{statistics.median(used):.3f} [{min(used):.3f}, {max(used):.3f}]" if used else "–")
                     + " | " + " | ".join(cells_) + f" | {wording(intervals['loss'], intervals['margin'])} |")

    lines += [""] + stock_judged(cells, steps)

    diverged = [(setting, arm, seed, r["divergence"]) for (setting, arm), by_seed in cells.items()
                for seed, r in sorted(by_seed.items()) if r.get("divergence")]
    counts = []
    for (setting, arm), by_seed in cells.items():
        k = sum(bool(r.get("divergence")) for r in by_seed.values())
        nl = sum(r.get("nonfinite_losses", 0) for r in by_seed.values())
        nm = sum(r.get("nonfinite_margins", 0) for r in by_seed.values())
        counts.append(f"{LABELS[setting]} ({arm}) {k} of {len(by_seed)}"
                      + (f", {nl} non-finite losses, {nm} non-finite margins" if nl or nm else ""))
    lines.append("\nDiverged runs, kept in every number above (a non-finite margin counts as a miss, and as the "
                 "evaluation's lowest finite margin or 0 in loss and margin): " + "; ".join(counts) + ". "
                 + ("; ".join(f"{LABELS[s]}, {arm}, seed {seed}: {why}" for s, arm, seed, why in diverged)
                    if diverged else "None diverged."))
    verdict, reason = auto_verdict(cells, steps_total)
    lines.append(f"\n`auto`'s target (non-inferior to the exact preset at equal time, on both primary readouts): "
                 f"**{verdict}**: {reason}.")
    auto_runs = {**{f"steps/{k}": v for k, v in cells.get(("auto", "steps"), {}).items()},
                 **{f"time/{k}": v for k, v in cells.get(("auto", "time"), {}).items()}}
    lines.append(f"`auto`'s choices over its runs: {auto_choices(auto_runs)}.")
    return "\n".join(lines)


def overall(verdicts: list[str]) -> str:
    if verdicts and all(v == "met" for v in verdicts):
        return ("`auto` met its target on every task: README may say it matched the exact preset at equal time "
                "within the margins (docs/study.md); the exact preset stays the default recommendation.")
    if "missed" in verdicts:
        return "`auto` missed its target: README calls it experimental; the recommendation stays the exact preset."
    return ("Fewer than 5 seeds of a comparison (or no cells): `auto` is experimental until every cell is in; the "
            "recommendation stays the exact preset.")


def plot(model: str, task: str, cells: dict, path: Path) -> bool:
    """The held-out DPO loss and mean margin against the step and the training user CPU (evaluation excluded), per
    setting of the equal-steps arm: each seed faint, the mean over seeds bold (seeds at the same steps); the
    equal-time runs' end points as crosses. False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figure, axes = plt.subplots(2, 2, figsize=(11, 7.5), sharey="row", squeeze=False)
    colors = plt.get_cmap("tab10")
    settings = [s for s, arm in cells if arm == "steps"]
    for row, readout in enumerate(("loss", "margin")):
        for column, (x, label) in enumerate((("step", "training step"), ("user", "training user CPU (s, one thread)"))):
            axis = axes[row][column]
            for i, setting in enumerate(settings):
                runs = list(cells[(setting, "steps")].values())
                curves = [[(p.get(x, 0.0), readouts(p).get(readout)) for p in r["curve"]] for r in runs]
                for curve in curves:
                    axis.plot(*zip(*curve), color=colors(i), lw=0.6, alpha=0.3)
                common = min(map(len, curves))
                mean = [(statistics.mean(c[k][0] for c in curves), statistics.mean(c[k][1] for c in curves))
                        for k in range(common)]
                axis.plot(*zip(*mean), color=colors(i), lw=2, marker="o", ms=3, label=LABELS[setting])
                timed = cells.get((setting, "time"), {}).values()
                ends = [(r["curve"][-1].get(x, 0.0), _point(r)[readout]) for r in timed]
                if ends:
                    axis.scatter(*zip(*ends), color=colors(i), marker="x", s=30)
            axis.set(xlabel=label, title=f"{model} x {task}")
            axis.grid(alpha=0.3)
        axes[row][0].set_ylabel({"loss": "held-out DPO loss (lower is better)",
                                 "margin": "held-out mean margin (higher is better)"}[readout])
    axes[0][1].legend(fontsize=7)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return True


def _plan_steps(cells: dict) -> int:
    exact = cells.get(("exact", "steps"), {})
    return next(iter(exact.values()))["steps"] if exact else 0


def write_study_report(records, out, pinned: str | None = None, images: Path | None = None,
                       calibration: dict | None = None) -> int:
    """Print the analysis of the pinned cells (and, with `images`, write a plot per task there; with `calibration`,
    the calibration file's entries, its table: the speed-ups measured interleaved); 2 (and why) when the store holds
    several pins and none is given."""
    current, superseded, refusal = select(records, pinned)
    if refusal:
        out.write(refusal + "\n")
        return 2
    groups, duplicates = cells_by_task(current)
    blocks = [report(model, task, cells) for (model, task), cells in sorted(groups.items())]
    if images is not None:
        for (model, task), cells in sorted(groups.items()):
            if cells.get(("exact", "steps")):
                path = images / f"study_{model}_{task}.png"
                blocks.append(f"wrote {path}" if plot(model, task, cells, path) else "(no plot: matplotlib missing)")
    if not blocks:
        blocks = [f"no stored cells of the pre-registered study{f' at pin {pinned}' if pinned else ''}"]
    verdicts = [auto_verdict(cells, _plan_steps(cells))[0] for cells in groups.values()]
    if calibration:
        from .study_calibration import table

        blocks.append("Equal time's calibration (per-step user CPU, interleaved in one process; N from it):\n\n"
                      + table(calibration))
    pins = sorted({record_pin_label(r) for r in current})
    tail = [overall(verdicts), f"Cells tabulated: {len(current)}, pin {', '.join(pins) or '–'}."]
    if superseded:
        tail.append("Superseded cells, kept in the store, in no table: " + "; ".join(
            f"{label}: {n}" for label, n in sorted(superseded.items())) + ".")
    if duplicates:
        tail.append("Stored twice (the first kept): " + "; ".join(duplicates) + ".")
    out.write("\n\n".join(blocks + tail) + "\n")
    return 0

