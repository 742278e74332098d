"""The `auto` rows of issue 21 from a regimes study folder: per cell and seed, held-out accuracy at N against stock,
the work to N over stock's (token clock) and, where the cell has the exact plugin run (`common_prefix`, the
unpruned path), over that run's, and what `auto` chose when.

    python -m evaluation.auto_rows runs/regimes dissimilar-b32 dissimilar-clean-b32 reversed-b64
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
            stock, exact = runs.get(f"stock-s{seed}"), runs.get(f"common_prefix-s{seed}")
            if stock is None and exact is None:
                continue
            name = "stock" if stock is not None else "the unpruned path (no stock run: Δ and work over it)"
            stock = stock or exact  # the exact plugin path computes stock's loss (tests/test_off_means_stock.py)
            line = [f"{cell} s{seed}: {name} {100 * at(stock, 'pref_acc'):.1f}%"]
            if exact is not None and exact is not stock:
                line.append(f"common_prefix Δ@N {100 * (at(exact, 'pref_acc') - at(stock, 'pref_acc')):+.1f}, "
                            f"work x{at(exact, 'cost') / at(stock, 'cost'):.2f}")
            for name in ("branch_cp", "auto_cp"):
                run = runs.get(f"{name}-s{seed}")
                if run is None:
                    continue
                delta = 100 * (at(run, "pref_acc") - at(stock, "pref_acc"))
                work = at(run, "cost") / at(stock, "cost")
                line.append(f"{name} Δ@N {delta:+.1f}, work x{work:.2f}, "
                            f"seconds x{at(run, 'time') / at(stock, 'time'):.2f}"
                            + (f", work over the unpruned path x{at(run, 'cost') / at(exact, 'cost'):.2f}, seconds "
                               f"x{at(run, 'time') / at(exact, 'time'):.2f}" if exact is not None else ""))
                for h in run.get("auto") or []:
                    line.append(f"  step {h['step']}: B_simple {h['b_simple']:.1f} ({h.get('b_simple_lower', 0):.1f}"
                                f"..{h['b_simple_upper']:.1f}), r_branch <= {h['r_branch']:.2f}, half cost "
                                f"{h['branch_half_cost']:.2f}, branch {h['branch_keep_prob']}, probed rarely: "
                                f"{h.get('probed_rarely')}")
            print("\n".join(line))


if __name__ == "__main__":
    main()
