"""The study's preference data: tasks with a programmatic ground truth whose mistakes a tiny model can learn to
see, with responses from 2 tokens to ~240.

- ``sort`` comes from `trl_pruned_dpo.demo.tasks` (generator and ground truth), with 1 to 24 items.
- ``count`` is added here: ``"count: 17 to 21 ="`` -> ``" 17 18 19 20 21"`` (1 to 80 numbers, all below 100: up to
  ~240 tokens from a short prompt). Mistake: one number replaced by a neighbour (n - 2 .. n + 2), the rest unchanged.

Every pair is a near-copy: the rejected answer is the chosen one with a single planted mistake at a uniform position,
so on average about half of each response is a common prefix (the hard case for single-branch gradients, shared
docs/method.md "Bias, honestly"). Both tasks' mistakes are *locally* checkable (a break in the order or in the +1
pattern), which the demo's 2-layer model learns by SFT; the demo's ``reverse`` (a lookup in the prompt) and ``add``
(operand copying) are left out: measured with this model, DPO's held-out accuracy on them stays at or below chance
(reverse 26%, add 44% after 150 stock steps), so they would only add noise to the comparison.
"""

import random

from datasets import Dataset

from trl_pruned_dpo.demo import tasks as demo

# task -> (min_size, max_size). Response lengths in characters (= tokens, the demo tokenizer is char-level):
# sort 2..~72, count 2..~240.
STUDY_SIZES = {"sort": (1, 24), "count": (1, 80)}
QUICK_SIZES = {"sort": (1, 6), "count": (1, 10)}

# Seeds of the three splits' generators; they are far apart.
_SPLIT_SEEDS = {"sft": 10_000, "train": 20_000, "test": 30_000}


def _count_answer(start: int, stop: int) -> str:
    return " " + " ".join(str(n) for n in range(start, stop + 1))


def _count_example(rng: random.Random, size: int) -> dict[str, str]:
    start = rng.randrange(0, 100 - size + 1)
    numbers = list(range(start, start + size))
    i = rng.randrange(size)
    wrong = list(numbers)
    wrong[i] = rng.choice([v for v in range(numbers[i] - 2, numbers[i] + 3) if v >= 0 and v != numbers[i]])
    return {"prompt": f"count: {start} to {start + size - 1} =", "chosen": " " + " ".join(map(str, numbers)),
            "rejected": " " + " ".join(map(str, wrong))}


def solve(prompt: str) -> str:
    """The right completion for a study prompt."""
    if task_of(prompt) == "count":
        start, _, stop = prompt.partition(":")[2].strip()[:-1].strip().partition(" to ")
        return _count_answer(int(start), int(stop))
    return demo.solve(prompt)


def is_correct(task: str | None, prompt: str, completion: str) -> bool:
    """Whether `completion` answers `prompt` (EOS and anything after it ignored, surrounding whitespace too)."""
    if task_of(prompt) == "count":
        return completion.split("<", 1)[0].strip() == solve(prompt).strip()
    return demo.is_correct(task, prompt, completion)


def make_examples(task: str, n: int, seed: int, min_size: int, max_size: int) -> list[dict[str, str]]:
    if task != "count":
        return demo.make_examples(task, n, seed, min_size, max_size)
    rng = random.Random(f"trl-pruned-dpo/quality/count/{seed}")
    rows = [_count_example(rng, rng.randint(min_size, max_size)) for _ in range(n)]
    assert all(is_correct("count", r["prompt"], r["chosen"]) and not is_correct("count", r["prompt"], r["rejected"])
               for r in rows)
    return rows


def task_of(prompt: str) -> str:
    return prompt.partition(":")[0].strip()


def make_study_splits(n_sft: int, n_train: int, n_test: int, seed: int = 0, quick: bool = False) -> dict:
    """{'sft', 'train', 'test'}: lists of {prompt, chosen, rejected}, the tasks in equal shares and interleaved.

    Test prompts are drawn first and are unique; train prompts are unique and never test prompts; SFT examples never
    use a test or train prompt (they may repeat). The data do not depend on the run seed: every setting and seed
    sees the same pairs (the run seed moves the data order and the mask draws only), so differences between seeds
    are training noise, not data noise.
    """
    sizes = QUICK_SIZES if quick else STUDY_SIZES
    names = list(sizes)
    per_task = {}
    for name in names:
        seen: set[str] = set()
        per_task[name] = {}
        for split, n, unique in (("test", n_test, True), ("train", n_train, True), ("sft", n_sft, False)):
            want, rows, attempt = -(-n // len(names)), [], 0
            while len(rows) < want and attempt < 50:
                for row in make_examples(name, 2 * want + 16, _SPLIT_SEEDS[split] + 1000 * attempt + seed,
                                         *sizes[name]):
                    if row["prompt"] not in seen and len(rows) < want:
                        rows.append(row)
                        if unique:
                            seen.add(row["prompt"])
                attempt += 1
            if split != "sft":
                seen.update(r["prompt"] for r in rows)
            per_task[name][split] = rows
    splits = {}
    for split, n in (("sft", n_sft), ("train", n_train), ("test", n_test)):
        columns = [per_task[name][split] for name in names]
        splits[split] = [columns[i % len(names)][i // len(names)] for i in range(n)
                         if i // len(names) < len(columns[i % len(names)])]
    return splits


def far_pairs(rows, seed: int = 0) -> list[dict[str, str]]:
    """The same prompts and chosen answers, each rejected answer replaced by an unrelated wrong one of the same size
    (sort: other numbers, sorted; count: a run from another start): pairs that share little more than the prompt,
    the opposite of the near-copies. Used only to contrast the gradient diagnostics."""
    rng = random.Random(f"trl-pruned-dpo/quality/far/{seed}")
    out = []
    for row in rows:
        answer = row["chosen"].split()
        for _ in range(100):
            if task_of(row["prompt"]) == "count":
                start = rng.randrange(0, 100 - len(answer) + 1)
                wrong = " " + " ".join(str(n) for n in range(start, start + len(answer)))
            else:
                wrong = " " + " ".join(map(str, sorted(rng.randrange(100) for _ in answer)))
            if not is_correct(None, row["prompt"], wrong):
                break
        out.append({**row, "rejected": wrong})
    return out


LABEL_NOISE = 0.1  # share of dissimilar pairs whose preference label is swapped


def dissimilar_pairs(rows, seed: int = 0, label_noise: float = LABEL_NOISE) -> list[dict[str, str]]:
    """The dissimilar-pairs regime: two different answers of different quality, not a planted mistake.

    The separator space moves from the answers into the prompt (the character sequence of every row is unchanged:
    the demo tokenizer is char-level, so the starting policy sees exactly what it was trained on), so the two answers
    start at their first number. chosen is the right answer; rejected is a plausible wrong answer that differs from
    the first response token on at most positions: count, the same number of numbers counted from another start
    (shifted by 10 to 30 where the range allows, with a different first digit where one exists); sort, the same items sorted descending.
    (Like UltraFeedback-style pairs, nothing aligns the two answers, so a common prefix is rare and short.)

    A fraction LABEL_NOISE of the pairs, train and held-out alike, have their labels swapped, as annotators disagree on
    real preference data (UltraFeedback-style sets: 20-30%): without it stock DPO saturates this task (held-out
    accuracy 0.97 after a few hundred pairs), and the extra noise of pruning could not show.
    """
    rng = random.Random(f"trl-pruned-dpo/quality/dissimilar/{seed}")
    out = []
    for row in rows:
        answer = row["chosen"].split()
        if task_of(row["prompt"]) == "count":
            start, size = int(answer[0]), len(answer)
            starts = [start + d for d in range(-30, 31) if abs(d) >= 10 and 0 <= start + d <= 100 - size]
            starts = starts or [s for s in range(0, 100 - size + 1) if s != start]
            differ = [s for s in starts if str(s)[0] != answer[0][0]]
            wrong_start = rng.choice(differ or starts)
            wrong = [str(n) for n in range(wrong_start, wrong_start + size)]
        else:
            wrong = [str(v) for v in sorted(map(int, answer), reverse=True)]
            if wrong == answer:  # one item, or all equal: a neighbouring number instead
                wrong = [str(int(v) + 1 if int(v) < 99 else int(v) - 1) for v in answer]
        chosen, rejected = " ".join(answer), " ".join(wrong)
        if rng.random() < label_noise:
            chosen, rejected = rejected, chosen
        out.append({"prompt": row["prompt"] + " ", "chosen": chosen, "rejected": rejected})
    return out


def reversed_pairs(rows, seed: int = 0) -> list[dict[str, str]]:
    """Dissimilar pairs with one consistent mistake: rejected is the chosen answer in reverse order (count and sort
    alike; a one-item answer keeps dissimilar_pairs' neighbouring number), no swapped labels. Every pair carries the
    same signal ("ascending, not descending"), so the per-pair gradients agree: at the starting policy B_simple =
    tr Σ / |G|² is 2.4 (per-pair gradients of 96 training pairs), against 7.7 for dissimilar-clean and 12 for
    dissimilar, with about the same extra noise of a branch draw at 1/2 (r 1.5, 1.4, 1.3). The cell of issue 21
    where a fixed branch 0.5 should cost little at equal steps (B >> B_simple (1 + r))."""
    out = []
    for row in dissimilar_pairs(rows, seed, label_noise=0.0):
        answer = row["chosen"].split()
        out.append({**row, "rejected": " ".join(reversed(answer)) if len(answer) > 1 else row["rejected"]})
    return out


# dissimilar-clean: the same pairs without swapped labels, where stock nearly saturates
REGIMES = {"near": lambda rows: rows, "dissimilar": dissimilar_pairs,
           "dissimilar-clean": lambda rows: dissimilar_pairs(rows, label_noise=0.0), "reversed": reversed_pairs}


def as_dataset(rows) -> Dataset:
    return Dataset.from_list(rows)


__all__ = ["REGIMES", "STUDY_SIZES", "QUICK_SIZES", "as_dataset", "dissimilar_pairs", "is_correct", "reversed_pairs", "make_study_splits", "solve", "task_of"]
