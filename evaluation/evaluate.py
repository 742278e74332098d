"""Exact held-out metrics: nothing here is pruned.

- `preference_metrics`: TRL's own evaluation (`trainer.evaluate`, the unpruned path for both trainers) on the held-out
  pairs: implicit-reward preference accuracy (TRL's `rewards/accuracies`: the fraction of pairs with
  beta * (D_w - D_l) > 0; a tie, as at step 0 where the policy is the reference, counts as wrong) and the mean
  reward margin.
- `generation_accuracy`: greedy decoding of held-out prompts, judged by the task's ground truth (`is_correct`);
  also the fraction whose completion *starts with* the right answer (`gen_prefix_acc`: right content, possibly
  not stopped at the right place), which separates "wrong answer" from "did not emit EOS" (DPO on near-copy pairs
  is known to displace likelihood away from EOS).
- `logprob_preference`: the fraction of pairs where the policy itself gives the chosen answer the higher
  log-probability (used to check the warm start; DPO's implicit reward is relative to the reference instead).
"""

import torch

from .tasks import is_correct, solve, task_of


def preference_metrics(trainer, eval_dataset) -> dict[str, float]:
    metrics = trainer.evaluate(eval_dataset=eval_dataset)
    return {"pref_acc": float(metrics["eval_rewards/accuracies"]), "margin": float(metrics["eval_rewards/margins"])}


@torch.no_grad()
def generation_accuracy(model, tokenizer, rows, batch_size: int = 32) -> dict[str, float]:
    """Greedy completions of `rows`' prompts, judged by `is_correct`; overall and per task.

    The token budget of a batch is the longest right answer in it plus two (EOS, one spare), so decoding stops
    where a right answer must have ended; a longer completion is wrong anyway.
    """
    was_training = model.training
    model.eval()
    rows = sorted(rows, key=lambda r: len(solve(r["prompt"])))
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    correct: dict[str, list[bool]] = {}
    prefix_right = []
    try:
        for start in range(0, len(rows), batch_size):
            chunk = rows[start : start + batch_size]
            encoded = tokenizer([r["prompt"] for r in chunk], return_tensors="pt", padding=True)
            budget = max(len(solve(r["prompt"])) for r in chunk) + 2
            output = model.generate(
                **encoded,
                max_new_tokens=budget,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
            completions = tokenizer.batch_decode(output[:, encoded["input_ids"].size(1) :], skip_special_tokens=False)
            for row, completion in zip(chunk, completions):
                task = task_of(row["prompt"])
                correct.setdefault(task, []).append(is_correct(task, row["prompt"], completion))
                prefix_right.append(completion.split("<", 1)[0].startswith(solve(row["prompt"])))
    finally:
        tokenizer.padding_side = side
        model.train(was_training)
    flat = [c for values in correct.values() for c in values]
    result = {"gen_acc": sum(flat) / max(len(flat), 1), "gen_prefix_acc": sum(prefix_right) / max(len(flat), 1)}
    result.update({f"gen_acc/{task}": sum(v) / len(v) for task, v in sorted(correct.items())})
    return result


@torch.no_grad()
def logprob_preference(model, tokenizer, rows, batch_size: int = 32) -> float:
    """Fraction of pairs whose chosen completion (with EOS) has the higher total log-probability under `model`."""
    model.eval()
    wins = 0
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        scores = []
        for key in ("chosen", "rejected"):
            seqs = [tokenizer(r["prompt"] + r[key])["input_ids"] + [tokenizer.eos_token_id] for r in chunk]
            starts = [len(tokenizer(r["prompt"])["input_ids"]) for r in chunk]
            width = max(map(len, seqs))
            ids = torch.full((len(seqs), width), tokenizer.pad_token_id)
            mask = torch.zeros_like(ids)
            for i, s in enumerate(seqs):
                ids[i, : len(s)] = torch.tensor(s)
                mask[i, : len(s)] = 1
            logp = model(input_ids=ids, attention_mask=mask).logits[:, :-1].log_softmax(-1)
            token = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
            keep = torch.zeros_like(token)
            for i, (s, b) in enumerate(zip(seqs, starts)):
                keep[i, b - 1 : len(s) - 1] = 1
            scores.append((token * keep).sum(-1))
        wins += int((scores[0] > scores[1]).sum())
    return wins / max(len(rows), 1)
