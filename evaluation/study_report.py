"""The pre-registered study's analysis (docs/study.md), from its store (`python -m evaluation.real_models --plan prereg
--report`). Written before the study ran; it prints, it fits nothing and chooses nothing from the cells but what
docs/study.md defines (the best fixed setting: the highest mean equal-time accuracy).

Per (model, task):
- equal steps: each setting's held-out accuracy (every held-out pair) at each evaluated step, as the paired difference
  from the exact preset of the same seed, mean over seeds and its 95% paired t-interval;
- equal time: each setting's accuracy where its user-CPU budget (the exact preset's for its steps, the same seed's)
  ended, against the exact preset's at its last step, the same way; the steps it reached and the CPU it used;
- stock against the exact preset on the seeds stock ran (the claim: the same accuracy);
- divergence (real_run.divergence), counted per setting and arm, every diverged run listed and kept in the numbers;
- `auto`'s targets: at equal time, the mean paired difference from the best fixed setting at least -1 point, and the
  95% paired interval against the exact preset not wholly below 0.
"""

import statistics

FIXED = ("exact", "branch", "position", "all")  # the fixed settings `auto` is compared with
WITHIN_POINTS = 1.0  # auto's target against the best fixed setting, in points of held-out accuracy
MIN_SEEDS = 5
# Student's t, 0.975 quantile, by degrees of freedom (1..30); above 30, 1.96.
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def paired(differences: list[float]) -> tuple[float, float | None]:
    """(mean, half-width of the 95% paired t-interval; None below two seeds) of per-seed differences."""
    n = len(differences)
    mean = sum(differences) / n
    if n < 2:
        return mean, None
    t = T975[n - 2] if n - 1 <= len(T975) else 1.96
    return mean, t * statistics.stdev(differences) / n ** 0.5


def _points(mean: float, half: float | None) -> str:
    return f"{100 * mean:+.1f}" + ("" if half is None else f" ± {100 * half:.1f}")


def _cells(records) -> dict:
    """{(model, task): {(setting, arm): {seed: record}}}, the latest record of a cell kept."""
    out = {}
    for record in records:
        arm = record.get("arm", "steps")
        out.setdefault((record["model"], record["task"]), {}).setdefault((record["setting"], arm), {})[
            record["seed"]] = record
    return out


def _at(record: dict, step: int):
    return next((p["accuracy"] for p in record["curve"] if p["step"] == step), None)


def _final(record: dict) -> float:
    return record["curve"][-1]["accuracy"]


def equal_time(cells: dict) -> dict:
    """{setting: {seed: accuracy where its budget ended}}: the exact preset's is its last step's."""
    out = {"exact": {seed: _final(r) for seed, r in cells.get(("exact", "steps"), {}).items()}}
    for (setting, arm), by_seed in cells.items():
        if arm == "time":
            out[setting] = {seed: _final(r) for seed, r in by_seed.items()}
    return out


def auto_verdict(cells: dict) -> tuple[str, str]:
    """("met" | "MISSED" | "incomplete", the reason) for `auto`'s two targets on one (model, task)."""
    timed = equal_time(cells)
    if "auto" not in timed or not timed["exact"]:
        return "incomplete", "no equal-time cells of auto or the exact preset"
    means = {s: statistics.mean(v.values()) for s, v in timed.items() if s in FIXED and v}
    best = max(means, key=means.get)
    seeds = sorted(set(timed["auto"]) & set(timed[best]) & set(timed["exact"]))
    if len(seeds) < MIN_SEEDS or set(FIXED) - set(means):
        return "incomplete", (f"{len(seeds)} paired seeds (the target needs {MIN_SEEDS}), fixed settings "
                              f"{', '.join(sorted(means))}")
    versus_best, _ = paired([timed["auto"][s] - timed[best][s] for s in seeds])
    versus_exact, half = paired([timed["auto"][s] - timed["exact"][s] for s in seeds])
    within = versus_best >= -WITHIN_POINTS / 100
    not_below = versus_exact + half >= 0
    reason = (f"against the best fixed setting ({best}) {_points(versus_best, None)} points (target >= "
              f"-{WITHIN_POINTS:g}: {'met' if within else 'missed'}); against the exact preset "
              f"{_points(versus_exact, half)} (target: the interval not wholly below 0: "
              f"{'met' if not_below else 'missed'}); {len(seeds)} seeds")
    return ("met" if within and not_below else "MISSED"), reason


def report(model: str, task: str, cells: dict) -> str:
    from .real_run import LABELS

    exact = cells.get(("exact", "steps"), {})
    lines = [f"**{model} x {task}**"]
    if not exact:
        return "\n".join(lines + ["no exact-preset cell stored: nothing is compared"])
    any_exact = next(iter(exact.values()))
    steps = [p["step"] for p in any_exact["curve"][1:]]
    lines.append(f"{any_exact['steps']} steps of {any_exact['pairs']} pairs, {any_exact['training']}, "
                 f"{any_exact['eval_pairs']} held-out pairs at steps {', '.join(map(str, steps))}; exact-preset "
                 f"seeds {', '.join(map(str, sorted(exact)))}. Differences in points of held-out accuracy, paired by "
                 "seed against the exact preset: mean ± 95% t half-width (n seeds).")
    loads = [x for by_seed in cells.values() for r in by_seed.values() for x in r.get("load", [])]
    if loads:
        lines.append(f"The machine's 1-minute load average at the cells' starts and ends: median "
                     f"{statistics.median(loads):.1f} [{min(loads):.1f}, {max(loads):.1f}] (CPU time is the clock; "
                     "other jobs still move it).")
    lines += ["", "| setting | " + " | ".join(f"step {s}" for s in steps) + " |",
              "|---|" + "---|" * len(steps)]
    lines.append("| exact preset (accuracy, mean) | " + " | ".join(
        f"{statistics.mean(a for r in exact.values() if (a := _at(r, s)) is not None):.3f} ({len(exact)})"
        for s in steps) + " |")
    for (setting, arm), by_seed in cells.items():
        if arm != "steps" or setting == "exact":
            continue
        row = []
        for s in steps:
            diffs = [_at(r, s) - _at(exact[seed], s) for seed, r in sorted(by_seed.items())
                     if seed in exact and _at(r, s) is not None and _at(exact[seed], s) is not None]
            row.append(f"{_points(*paired(diffs))} ({len(diffs)})" if diffs else "–")
        lines.append(f"| {LABELS[setting]} | " + " | ".join(row) + " |")

    timed = equal_time(cells)
    lines += ["", "Equal time (each setting's budget: the same seed's exact-preset training user CPU for its "
              f"{any_exact['steps']} steps):", "",
              "| setting | seeds | steps reached | user CPU used / budget | accuracy (mean) | vs exact preset |",
              "|---|---|---|---|---|---|"]
    for setting, by_seed in timed.items():
        records = cells[(setting, "steps" if setting == "exact" else "time")]
        reached = [r.get("steps_done", r["steps"]) for r in records.values()]
        used = [sum(r["step_user"]) / (r.get("budget_user_s") or sum(r["step_user"])) for r in records.values()]
        diffs = [a - timed["exact"][seed] for seed, a in sorted(by_seed.items()) if seed in timed["exact"]]
        versus = "–" if setting == "exact" else (f"{_points(*paired(diffs))} ({len(diffs)})" if diffs else "–")
        lines.append(f"| {LABELS[setting]} | {len(by_seed)} | {min(reached)}-{max(reached)} | "
                     f"{min(used):.2f}-{max(used):.2f} | {statistics.mean(by_seed.values()):.3f} | {versus} |")

    stock = cells.get(("stock", "steps"), {})
    for seed, record in sorted(stock.items()):
        if seed in exact:
            gaps = ", ".join(f"step {s} {_points(_at(record, s) - _at(exact[seed], s), None)}" for s in steps
                             if _at(record, s) is not None and _at(exact[seed], s) is not None)
            lines.append(f"\nStock against the exact preset, seed {seed}: {gaps} points.")

    diverged = [(setting, arm, seed, r["divergence"]) for (setting, arm), by_seed in cells.items()
                for seed, r in sorted(by_seed.items()) if r.get("divergence")]
    counts = {(setting, arm): (sum(bool(r.get("divergence")) for r in by_seed.values()), len(by_seed))
              for (setting, arm), by_seed in cells.items()}
    lines.append("\nDiverged runs (kept in every number above): " + (
        "; ".join(f"{LABELS[s]} ({arm}) {k} of {n}" for (s, arm), (k, n) in counts.items() if k) + ". "
        + "; ".join(f"{LABELS[s]}, {arm}, seed {seed}: {why}" for s, arm, seed, why in diverged)
        if diverged else "none."))
    verdict, reason = auto_verdict(cells)
    lines.append(f"\n`auto`'s targets: {verdict}: {reason}.")
    return "\n".join(lines)


def write_study_report(records, out) -> str:
    groups = _cells(records)
    if not groups:
        out.write("no stored cells of the pre-registered study\n")
        return ""
    blocks = [report(model, task, cells) for (model, task), cells in sorted(groups.items())]
    verdicts = [auto_verdict(cells)[0] for cells in groups.values()]
    if all(v == "met" for v in verdicts):
        overall = "`auto` met its targets on every task: README may recommend it as docs/study.md says."
    elif "MISSED" in verdicts:
        overall = ("`auto` MISSED a target: README calls it experimental and the recommendation stays the exact "
                   "preset (docs/study.md).")
    else:
        overall = "The study is incomplete: no verdict on `auto` yet."
    commits = sorted({r["commit"] for r in records})
    text = "\n\n".join(blocks + [overall, f"Cells: {len(records)} stored, at commit(s) {', '.join(commits)}."])
    out.write(text + "\n")
    return text
