"""Prompt groups on multi-pair data: tokens executed and step time of stock `DPOTrainer`, pair sharing (the packed
defaults before prompt groups: each pair's prompt once) and prompt groups (each prompt once per batch, each distinct
response once), side by side in one process (issue 37, item 4).

    python -m benchmarks.prompt_groups [--scale 0.25] [--rounds 3] [--out benchmarks/results/prompt_groups_cpu]

Workloads: k = 2..6 responses per prompt, paired "best" against the rest (k - 1 pairs) or "all" pairs (k(k - 1)/2),
UltraFeedback-shaped lengths (workload.LENGTH_MODELS, at `--scale`), the bench model (workload.MODEL_SHAPE), a live
reference, gradient checkpointing on (TRL's defaults). Each micro-batch holds whole prompt groups (at least
`--pairs` pairs) and every side is fed the same batches in the same order (a sequential sampler), from identical
weights. Pair sharing is the same trainer with the plan's trees cut to pairs (`packing.pair_trees`, benchmark only).
One torch thread, the process CPU-time clock, warm-up rounds then rounds in alternating order: per side the median
step, and each speedup the median of the per-round ratios (a round's three steps ran back to back on one batch).
"Arithmetic": per prompt group its prompt once plus each distinct response (tokens); "executed": the policy forward's
tokens (stock: its padded rows).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import random
import statistics
import time

import torch
from torch.utils.data import SequentialSampler

from benchmarks.workload import StepRunner, Workload, build_model, build_trainer, length_model, machine_info, quiet

SIDES = ("stock", "pairs", "groups")


def group_rows(k: int, pairing: str, groups: int, scale: float, rng: random.Random) -> dict:
    """`groups` prompts with `k` responses each (UltraFeedback-shaped lengths, a geometric shared start with the first
    response), paired best-vs-rest or all pairs; words `t<i>` (one token each; TRL appends the EOS)."""
    model = length_model("ultrafeedback").scaled(scale)
    rows = {"prompt": [], "chosen": [], "rejected": []}

    def words(n):
        return [f"t{rng.randrange(3, 8192)}" for _ in range(n)]

    for _ in range(groups):
        prompt, first, _, _ = model.sample(rng)
        answers = [words(first - 1)]
        for _ in range(k - 1):
            _, length, _, shared = model.sample(rng)
            shared = min(shared, length - 2, len(answers[0]) - 1)
            answers.append(answers[0][: max(shared, 0)] + words(length - 1 - max(shared, 0)))
        pairs = [(0, j) for j in range(1, k)] if pairing == "best" else [(a, b) for a in range(k)
                                                                        for b in range(a + 1, k)]
        text = " ".join(words(prompt))
        for a, b in pairs:
            rows["prompt"].append(text)
            rows["chosen"].append(" " + " ".join(answers[a]))
            rows["rejected"].append(" " + " ".join(answers[b]))
    return rows


@contextlib.contextmanager
def pair_sharing(active: bool):
    """The plan's trees cut to pairs (the defaults before prompt groups): each pair's prompt once. Patched where the
    micro-step's plan reads them (method/plan.py), not where they are defined (method/packing.py)."""
    from trl_pruned_dpo.method import packing, plan

    original = plan.row_trees
    if active:
        plan.row_trees = lambda host, share: packing.pair_trees(torch.full((host.input_ids.size(0) // 2,), share))
    try:
        yield
    finally:
        plan.row_trees = original


def arithmetic(batch) -> int:
    """Per prompt group of the batch, its prompt once plus each distinct response, in tokens."""
    ids, valid, completion = batch["input_ids"].cpu(), batch["attention_mask"].cpu().bool(), \
        batch["completion_mask"].cpu().bool()
    groups: dict = {}
    for row in range(ids.size(0)):
        prompt = tuple(ids[row][valid[row] & ~completion[row]].tolist())
        groups.setdefault(prompt, set()).add(tuple(ids[row][completion[row]].tolist()))
    return sum(len(p) + sum(len(r) for r in responses) for p, responses in groups.items())


def time_workload(k: int, pairing: str, args, log) -> dict:
    pairs_per_group = k - 1 if pairing == "best" else k * (k - 1) // 2
    groups_per_batch = max(2, math.ceil(args.pairs / pairs_per_group))
    w = Workload(vocab_size=8192, batch_size=groups_per_batch * pairs_per_group, num_batches=args.batches,
                 lengths="ultrafeedback", length_scale=args.scale, reference_noise=0.01, name=f"k{k}-{pairing}")
    from datasets import Dataset

    data = Dataset.from_dict(group_rows(k, pairing, groups_per_batch * args.batches, args.scale, random.Random(k)))
    base = build_model(w)
    runners = {}
    for side in SIDES:
        trainer = build_trainer("stock" if side == "stock" else "pruned", w, copy.deepcopy(base), precompute=False,
                                checkpointing=True, pruning={}, dataset=data)
        trainer._get_train_sampler = lambda *a, _t=trainer, **kw: SequentialSampler(_t.train_dataset)
        runners[side] = StepRunner(trainer)
    times = {s: [] for s in SIDES}
    counts = {s: [] for s in SIDES}  # per measured step: (policy tokens, reference tokens, arithmetic, real tokens)
    first_loss = {}
    for r in range(args.warmup + args.rounds):
        for side in SIDES if r % 2 == 0 else SIDES[::-1]:
            runner = runners[side]
            with pair_sharing(side == "pairs"):
                start = time.process_time()
                loss = runner.step()
                elapsed = time.process_time() - start
            first_loss.setdefault(side, float(loss))  # the first batch, on identical weights: the same loss
            if r >= args.warmup:
                stats = runner.trainer.last_prune_stats if side != "stock" else {}
                batch = runner.last_batch
                padded = batch["input_ids"].numel()
                times[side].append(elapsed)
                counts[side].append((stats.get("policy_tokens_executed", padded),
                                     stats.get("reference_tokens_executed", padded), arithmetic(batch),
                                     int(batch["attention_mask"].sum())))
        if r >= args.warmup:
            log(f"  {w.name} round {r - args.warmup + 1}: " + " ".join(f"{s}={times[s][-1]:.2f}s" for s in SIDES))
    median = {s: statistics.median(times[s]) for s in SIDES}
    total = {s: [sum(c[i] for c in counts[s]) for i in range(4)] for s in SIDES}  # over the measured steps
    out = dict(k=k, pairing=pairing, pairs_per_batch=w.batch_size, groups_per_batch=groups_per_batch,
               steps=args.rounds, arithmetic=round(total["groups"][2] / args.rounds),
               real_tokens=round(total["stock"][3] / args.rounds))
    for s in SIDES:
        out[f"{s}_tokens"] = round(total[s][0] / args.rounds)  # mean per step
        out[f"{s}_reference_tokens"] = round(total[s][1] / args.rounds)
        out[f"{s}_step_s"] = round(median[s], 3)
        out[f"{s}_first_loss"] = first_loss[s]
    out["groups_over_arithmetic"] = round(total["groups"][0] / total["groups"][2], 4)
    # the speedups: medians of the per-round ratios (each round's sides ran back to back on the same batch)
    def ratio(a, b):
        return round(statistics.median(x / y for x, y in zip(times[a], times[b])), 3)

    out["speedup_vs_pairs"] = ratio("pairs", "groups")
    out["speedup_vs_stock"] = ratio("stock", "groups")
    out["pairs_vs_stock"] = ratio("stock", "pairs")
    return out


def format_table(rows: list[dict]) -> str:
    head = ("| k | pairing | pairs/batch | tokens: stock / pairs / groups (arithmetic) | step s: stock / pairs / groups"
            " | groups vs pairs | groups vs stock |\n|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        lines.append(f"| {r['k']} | {r['pairing']} | {r['pairs_per_batch']} | {r['stock_tokens']} / "
                     f"{r['pairs_tokens']} / {r['groups_tokens']} ({r['arithmetic']}) | {r['stock_step_s']:.2f} / "
                     f"{r['pairs_step_s']:.2f} / {r['groups_step_s']:.2f} | {r['speedup_vs_pairs']:.2f}x | "
                     f"{r['speedup_vs_stock']:.2f}x |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scale", type=float, default=0.25, help="UltraFeedback length scale (1 = full)")
    parser.add_argument("--pairs", type=int, default=6, help="at least this many pairs per batch (whole groups)")
    parser.add_argument("--batches", type=int, default=2, help="distinct batches, cycled")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--k", type=int, nargs="+", default=[2, 3, 4, 5, 6])
    parser.add_argument("--out", default="benchmarks/results/prompt_groups_cpu")
    args = parser.parse_args(argv)
    quiet()
    torch.set_num_threads(1)
    rows = []
    for k in args.k:
        for pairing in ("best",) if k == 2 else ("best", "all"):
            rows.append(time_workload(k, pairing, args, lambda m: print(m, flush=True)))
            print(format_table(rows[-1:]).splitlines()[-1], flush=True)
    table = format_table(rows)
    print(table)
    os.makedirs(args.out, exist_ok=True)
    meta = dict(vars(args), clock="process CPU time, one torch thread, median of rounds",
                machine=machine_info("cpu", 1))
    with open(os.path.join(args.out, "prompt_groups.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    with open(os.path.join(args.out, "prompt_groups.md"), "w") as f:
        f.write(table + "\n")


if __name__ == "__main__":
    main()
