"""Held-out accuracy of `group_by_prompt` against shuffled pairs at equal steps (issue 37).

    python -m evaluation.prompt_groups_accuracy [--seeds 0 1 2] [--steps 150] [--out benchmarks/results/...]

The demo's setting (builtin:tiny-demo-sft, a tiny Llama warm-started by SFT on sorting; configs/demo.yaml's
hyperparameters), trained on a multi-pair sorting task: per prompt (sort 3 to 12 numbers) 4 answers of graded
quality, right and with 1, 2, 3 mistakes (each one more position replaced), all 6 pairs. The same pairs, the same
steps and seed; only the order differs: TRL's shuffled pairs, or `group_by_prompt=True` (a prompt's 6 pairs in one
micro-batch of 12). Evaluated exactly (TRL's evaluation) on builtin:sort-short's held-out pairs (prompts never
trained on; right against one mistake): preference accuracy and mean reward margin.

(The real-text multi-pair task, builtin:python-docs-ranked, needs a real model: SmolLM2 on this 2-core CPU costs
minutes per step, so the comparison runs on the task the tiny model can learn.)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile

from datasets import Dataset

LEVELS = 4


def graded_rows(n_prompts: int, seed: int, exclude: set[str]) -> list[dict]:
    """`n_prompts` sorting prompts, each with LEVELS answers (0..3 mistakes) and all their pairs, groups together."""
    rng = random.Random(f"prompt-groups-accuracy/{seed}")
    rows = []
    while len(rows) < 6 * n_prompts:
        size = rng.randint(3, 12)
        items = [rng.randrange(100) for _ in range(size)]
        prompt = "sort: " + " ".join(map(str, items)) + " ="
        if prompt in exclude:
            continue
        answer = sorted(items)
        answers = [list(answer)]
        for position in rng.sample(range(size), LEVELS - 1):
            wrong = list(answers[-1])
            wrong[position] = rng.choice([v for v in range(100) if v != answer[position]])
            answers.append(wrong)
        texts = [" " + " ".join(map(str, a)) for a in answers]
        rows += [{"prompt": prompt, "chosen": texts[a], "rejected": texts[b]}
                 for a in range(LEVELS) for b in range(a + 1, LEVELS)]
    return rows


def run(grouped: bool, seed: int, steps: int, train, test, policy_dir: str) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_pruned_dpo import PrunedDPOConfig, PrunedDPOTrainer

    args = PrunedDPOConfig(
        output_dir=tempfile.mkdtemp(prefix="groups-acc-"), loss_type=["sigmoid"], beta=0.1, learning_rate=1e-4,
        lr_scheduler_type="cosine", warmup_steps=10, max_steps=steps, per_device_train_batch_size=12,
        per_device_eval_batch_size=64, bf16=False, gradient_checkpointing=False, logging_steps=10**6,
        save_strategy="no", report_to="none", seed=seed, data_seed=seed, disable_tqdm=True, group_by_prompt=grouped,
    )
    model = AutoModelForCausalLM.from_pretrained(policy_dir)
    reference = AutoModelForCausalLM.from_pretrained(policy_dir)
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    trainer = PrunedDPOTrainer(model=model, ref_model=reference, args=args, train_dataset=train,
                               eval_dataset=test, processing_class=tokenizer)
    trainer.train()
    metrics = trainer.evaluate()
    shared = trainer.last_prune_stats
    return dict(grouped=grouped, seed=seed, pref_acc=metrics["eval_rewards/accuracies"],
                margin=metrics["eval_rewards/margins"], last_step_tokens=shared.get("policy_tokens_executed"))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--prompts", type=int, default=400)
    parser.add_argument("--out", default="benchmarks/results/prompt_groups_accuracy_cpu")
    args = parser.parse_args(argv)
    import torch

    from benchmarks.workload import quiet
    from trl_pruned_dpo.demo import load_builtin, resolve_model

    quiet()
    torch.set_num_threads(1)
    policy_dir = resolve_model("builtin:tiny-demo-sft")
    held_out = load_builtin("builtin:sort-short")["test"]
    train = Dataset.from_list(graded_rows(args.prompts, 0, set(held_out["prompt"])))
    results = []
    for seed in args.seeds:
        for grouped in (False, True):
            results.append(run(grouped, seed, args.steps, train, held_out, policy_dir))
            print(results[-1], flush=True)
    summary = {}
    for grouped in (False, True):
        accs = [r["pref_acc"] for r in results if r["grouped"] == grouped]
        summary["grouped" if grouped else "shuffled"] = dict(
            mean=statistics.mean(accs), sd=statistics.stdev(accs) if len(accs) > 1 else 0.0, runs=accs)
    diffs = [g["pref_acc"] - s["pref_acc"] for s, g in zip(results[::2], results[1::2])]
    summary["grouped_minus_shuffled"] = dict(mean=statistics.mean(diffs), per_seed=diffs)
    print(json.dumps(summary, indent=1))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "accuracy.json"), "w") as f:
        json.dump(dict(meta=vars(args), runs=results, summary=summary), f, indent=1)


if __name__ == "__main__":
    main()
