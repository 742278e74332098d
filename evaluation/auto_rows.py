"""The `auto` rows of docs/quality.md ("`auto` on the regimes cells") from a regimes study folder: per cell and seed, `auto` (one micro-batch per step: the
B / 2B path; `auto_cp_acc2`, two: the engine path) and a fixed branch 0.5 against
the exact plugin run of the same seed (`common_prefix`: the unpruned path, which computes stock's loss): held-out
accuracy at N and averaged over the evaluations from N to 1.5 N (less noisy than one evaluation), the work to N
over the exact run's (token clock), and the first step `auto` chose to prune.

    python -m evaluation.auto_rows runs/regimes reversed-b32 dissimilar-b32 dissimilar-clean-b32
"""

import json
import statistics
import sys
from pathlib import Path

def budget(run) -> int:
    """N, the run's equal-steps budget (24 in the published study)."""
    return run["config"]["steps"]


def at(run, key):
    return next(c[key] for c in run["curve"] if c["step"] == budget(run))


def late(run):
    return statistics.mean(c["pref_acc"] for c in run["curve"] if c["step"] >= budget(run))


def rows(folder: Path, cell: str, setting: str):
    """(seed, Δ@N, Δ late, work to N) of `setting` against the exact run, per seed that has both."""
    for path in sorted((folder / cell / "runs").glob(f"{setting}-s*.json")):
        exact_path = path.with_name(path.name.replace(setting, "common_prefix"))
        if not exact_path.exists():
            continue
        run, exact = json.loads(path.read_text()), json.loads(exact_path.read_text())
        yield run, exact, (run["seed"], 100 * (at(run, "pref_acc") - at(exact, "pref_acc")),
                           100 * (late(run) - late(exact)), at(run, "cost") / at(exact, "cost"))


def main(argv=None):
    folder, *cells = argv or sys.argv[1:]
    for cell in cells:
        print(f"{cell}:")
        for setting in ("auto_cp", "auto_cp_acc2", "branch_cp"):
            found = list(rows(Path(folder), cell, setting))
            if not found:
                continue
            seeds = [r for _, _, r in found]
            exact = ", ".join(f"{100 * at(e, 'pref_acc'):.1f}" for _, e, _ in found)
            line = (f"  {setting:12s} seeds {[s[0] for s in seeds]}: exact @N {exact}; Δ@N "
                    + ", ".join(f"{s[1]:+.1f}" for s in seeds) + f" (mean {statistics.mean(s[1] for s in seeds):+.1f})"
                    + "; Δ N..1.5N " + ", ".join(f"{s[2]:+.1f}" for s in seeds)
                    + f" (mean {statistics.mean(s[2] for s in seeds):+.1f}); work to N "
                    + ", ".join(f"{s[3]:.3f}" for s in seeds) + " of exact's (x"
                    + ", x".join(f"{1 / s[3]:.2f}" for s in seeds) + " faster)")
            if setting.startswith("auto"):
                first = [min((h["step"] for h in run.get("auto") or [] if h["branch_keep_prob"] < 1), default=None)
                         for run, _, _ in found]
                line += f"; first step pruned {first}"
            print(line)


if __name__ == "__main__":
    main()
