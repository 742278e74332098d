"""The host plan's cost per micro-step: what runs on the CPU before every forward (masks, the policy plan, the
reference plan, the counts), at GPU-sized batches, one pair per prompt and prompt groups (issue 37, item 6).

    python -m benchmarks.host_plan [--repeats 20] [--out benchmarks/results/host_plan_cpu]

Batches are built as TRL's collator lays them out (right-padded [chosen; rejected] rows, token ids random), with
UltraFeedback-shaped lengths (workload.LENGTH_MODELS) scaled to the token counts of the issue: 8 pairs / ~8.9k
tokens, 16 / ~34k, 64 / ~142k (tokens: the rows' real tokens), and the same sizes as prompt groups of 4 responses,
all 6 pairs each. One torch thread, the process CPU-time clock, the median of `repeats` plans (after one warm-up).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from itertools import combinations

import torch

from benchmarks.workload import length_model
from trl_pruned_dpo.method.masks import draw_masks, mask_generator
from trl_pruned_dpo.method.packing import HostBatch
from trl_pruned_dpo.method.plan import Layout, plan_micro_step

VOCAB = 32000
SIZES = [(8, 1.25), (16, 2.5), (64, 2.4)]  # (pairs, length scale): ~8.9k, ~34k, ~142k real tokens


def host_batch(pairs: list[tuple[list[int], list[int], list[int]]]) -> HostBatch:
    """(prompt, chosen, rejected) token lists -> the collated host layout, right-padded."""
    rows = [(p, c) for p, c, _ in pairs] + [(p, r) for p, _, r in pairs]
    width = max(len(p) + len(c) for p, c in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    attention, completion = torch.zeros_like(ids), torch.zeros_like(ids)
    for i, (p, c) in enumerate(rows):
        ids[i, : len(p) + len(c)] = torch.tensor(p + c)
        attention[i, : len(p) + len(c)] = 1
        completion[i, len(p): len(p) + len(c)] = 1
    return HostBatch(ids, attention, completion)


def make_pairs(n_pairs: int, scale: float, responses: int, rng: random.Random):
    """`n_pairs` pairs: one per prompt (`responses` 2), or prompts with `responses` answers and all their pairs."""
    model = length_model("ultrafeedback").scaled(scale)

    def words(n):
        return [rng.randrange(4, VOCAB) for _ in range(n)]

    pairs = []
    while len(pairs) < n_pairs:
        prompt, *_ = model.sample(rng)
        answers = [words(model.sample(rng)[1]) for _ in range(responses)]
        prompt_ids = words(prompt)
        pairs += [(prompt_ids, answers[a], answers[b]) for a, b in combinations(range(responses), 2)]
    return pairs[:n_pairs]


def plan_once(batch: HostBatch, share: bool = True) -> None:
    """What the trainer plans per micro-step with the defaults (nothing pruned, both exact savings on), from a fresh
    host batch (as each micro-step's collator makes one: nothing derived from an earlier plan)."""
    host = HostBatch(batch.input_ids, batch.attention_mask, batch.completion_mask)
    masks = draw_masks(host.input_ids, host.completion_mask, position_keep_prob=1.0, prefix_prune_prob=0.0,
                       prefix_min_ratio=0.5, branch_keep_prob=1.0, branch_sampling="paired", drop_common_prefix=False,
                       generator=mask_generator(0, 0, 0, 0), attention_mask=host.attention_mask)
    plan_micro_step((0, 0), {}, host, masks, Layout(packed=True, share=share), prunes_branches=False,
                    reference_scored=masks.scored)


def measure(host: HostBatch, repeats: int) -> float:
    plan_once(host)
    times = []
    for _ in range(repeats):
        start = time.process_time()
        plan_once(host)
        times.append(time.process_time() - start)
    return statistics.median(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default="benchmarks/results/host_plan_cpu")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for responses, label in ((2, "one pair per prompt"), (4, "4 responses, all 6 pairs")):
        for pairs, scale in SIZES:
            host = host_batch(make_pairs(pairs, scale, responses, random.Random(0)))
            tokens = int(host.attention_mask.sum())
            seconds = measure(host, args.repeats)
            rows.append(dict(data=label, pairs=pairs, tokens=tokens, ms=round(1e3 * seconds, 2),
                             us_per_token=round(1e6 * seconds / tokens, 3)))
            print(f"{label:26s} {pairs:3d} pairs {tokens:7d} tokens: {1e3 * seconds:7.2f} ms  "
                  f"{1e6 * seconds / tokens:.3f} us/token", flush=True)
    os.makedirs(args.out, exist_ok=True)
    meta = dict(clock="process CPU time, one torch thread, median of repeats", repeats=args.repeats,
                torch=torch.__version__, cpu=os.cpu_count())
    with open(os.path.join(args.out, "host_plan.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
