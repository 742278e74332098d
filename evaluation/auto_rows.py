"""The `auto` rows of issue 21 from a regimes study folder: per cell and seed, held-out accuracy at N against stock,
the work to N over stock's (token clock), and what `auto` chose when.

    python -m evaluation.auto_rows runs/regimes dissimilar-b32 dissimilar-clean-b32
"""

import json
import sys
from pathlib import Path

N = 24


def at(run, key, step=N):
    return next(c[key] for c in run["curve"] if c["step"] == step)


def main(argv=None):
    folder, *cells = argv or sys.argv[1:]
    for cell in cells:
        runs = {p.stem: json.loads(p.read_text()) for p in (Path(folder) / cell / "runs").glob("*.json")}
        for seed in sorted({int(k.rsplit("-s", 1)[1]) for k in runs}):
            stock = runs.get(f"stock-s{seed}")
            if stock is None:
                continue
            line = [f"{cell} s{seed}: stock {100 * at(stock, 'pref_acc'):.1f}%"]
            for name in ("branch_cp", "auto_cp"):
                run = runs.get(f"{name}-s{seed}")
                if run is None:
                    continue
                delta = 100 * (at(run, "pref_acc") - at(stock, "pref_acc"))
                work = at(run, "cost") / at(stock, "cost")
                line.append(f"{name} Δ@N {delta:+.1f}, work x{work:.2f}, seconds x{at(run, 'time') / at(stock, 'time'):.2f}")
                for h in run.get("auto") or []:
                    if h is (run["auto"][0]) or h is run["auto"][-1] or h["branch_keep_prob"] != 1.0:
                        line.append(f"  step {h['step']}: B_simple {h['b_simple']:.1f} (<= {h['b_simple_upper']:.1f}),"
                                    f" r_branch <= {h['r_branch']}, half cost {h['branch_half_cost']:.2f}, "
                                    f"branch {h['branch_keep_prob']}")
            print("\n".join(line))


if __name__ == "__main__":
    main()
