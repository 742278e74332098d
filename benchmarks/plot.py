"""The PNG of a step_time run: speedup per setting with its FLOP limit marked, working-memory ratio, and scaling."""

from __future__ import annotations

import json
import sys


def _group_key(row):
    return (row["reference"], row["checkpointing"])


def _group_label(key):
    reference, ckpt = key
    return f"{reference} ref, ckpt {'on' if ckpt else 'off'}"


def plot(rows: list[dict], meta: dict, path: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    main = [r for r in rows if r["kind"] == "main"]
    scaling = [r for r in rows if r["kind"] == "scaling"]
    settings = list(dict.fromkeys(r["setting"] for r in rows))
    groups = list(dict.fromkeys(_group_key(r) for r in main))
    vocabs = sorted({r["vocab"] for r in scaling})
    if vocabs:
        fig, grid = plt.subplots(2, 2, figsize=(14, 10))
        axes = [grid[0][0], grid[0][1], grid[1][0], grid[1][1]]
    else:
        fig, axes = plt.subplots(1, 2, figsize=(12.4, 4.6))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    width = 0.8 / max(len(groups), 1)

    ax = axes[0]
    for gi, key in enumerate(groups):
        for si, setting in enumerate(settings):
            row = next((r for r in main if _group_key(r) == key and r["setting"] == setting), None)
            if row is None:
                continue
            x = si + (gi - (len(groups) - 1) / 2) * width
            ax.bar(x, row["speedup"], width * 0.9, color=colors[gi % len(colors)],
                   label=_group_label(key) if si == 0 else None)
            ax.plot([x - width * 0.45, x + width * 0.45], [row["flop_limit"]] * 2, color="black", lw=1.5,
                    label="FLOP limit" if gi == 0 and si == 0 else None)
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.set_xticks(range(len(settings)), settings)
    ax.set_ylabel("speedup over stock TRL (median step time)")
    ax.set_title("Step-time speedup (bars) vs FLOP limit (black)")
    ax.legend(fontsize=8)

    ax = axes[1]
    any_memory = False
    for gi, key in enumerate(groups):
        for si, setting in enumerate(settings):
            row = next((r for r in main if _group_key(r) == key and r["setting"] == setting), None)
            if row is None or row.get("memory_ratio") is None:
                continue
            any_memory = True
            x = si + (gi - (len(groups) - 1) / 2) * width
            ax.bar(x, row["memory_ratio"], width * 0.9, color=colors[gi % len(colors)],
                   label=_group_label(key) if si == 0 else None)
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.set_xticks(range(len(settings)), settings)
    ax.set_ylabel("working memory, pruned / stock (lower is better)")
    ax.set_title("Peak working memory ratio" + ("" if any_memory else " (not measured)"))
    if any_memory:
        ax.legend(fontsize=8)

    for ax, vocab in zip(axes[2:], vocabs[:2]):
        for si, setting in enumerate(settings):
            pts = sorted((r["response_len"], r["speedup"], r["flop_limit"]) for r in scaling
                         if r["setting"] == setting and r["vocab"] == vocab)
            if not pts:
                continue
            xs, ys, lims = zip(*pts)
            color = colors[si % len(colors)]
            ax.plot(xs, ys, "-", marker="o", color=color, label=setting)
            ax.plot(xs, lims, "_", color=color, markersize=16, mew=2)
        ax.axhline(1.0, color="grey", lw=0.8, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["response_len"] for r in scaling}), [str(x) for x in
                                                                    sorted({r["response_len"] for r in scaling})])
        ax.set_xlabel("response length (tokens)")
        ax.set_ylabel("speedup over stock (lines); FLOP limit (ticks)")
        r0 = scaling[0]
        share = next(r["head_share"] for r in scaling if r["vocab"] == vocab)
        ax.set_title(f"Scaling, vocab {vocab // 1024}k (LM head ~{share:.0%} of FLOPs): {r0['reference']} ref, "
                     f"ckpt {'on' if r0['checkpointing'] else 'off'}, {r0['batch_pairs']} pair/step", fontsize=10)
        ax.legend(fontsize=8, ncol=2)

    m = meta.get("machine", {})
    fig.suptitle(f"trl-pruned-dpo vs TRL {m.get('trl', '?')} DPOTrainer -- {m.get('device', '?')}: "
                 f"{m.get('gpu') or m.get('cpu', '?')}, {m.get('torch_threads', '?')} threads, {meta.get('dtype')}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":  # re-plot a results file: python -m benchmarks.plot results.json out.png
    with open(sys.argv[1]) as f:
        data = json.load(f)
    plot(data["results"], data["meta"], sys.argv[2])
