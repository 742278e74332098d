"""A real-text task with several responses per prompt: ``builtin:python-docs-ranked`` (prompt groups, issue 37).

The sections of the Python language reference (realtext.py, ``pydoc_data``) with at least three sentences of opening
prose. Per prompt (one user message asking about a section, in one of a few phrasings) k = 4 answers of graded
quality, from most to least on topic:

- 0: the section's opening, three sentences;
- 1: the same with its last sentence replaced by a sentence of another section of a similar length;
- 2: the same with its last two sentences replaced;
- 3: the opening of another section, of a similar length (wholly off topic).

Every better answer is paired with every worse one: 6 pairs per prompt, sharing their prompt and, in pairs of the
first three answers, their first sentence or two (near-copies). Held out: whole sections (none of their prompts or
answers is trained on). Deterministic from the seed for a given Python version.
"""

import random

from datasets import Dataset, DatasetDict

from .realtext import HELD_OUT_SHARE, MAX_WORDS, QUESTIONS, sections

# Answers per prompt: 0 (on topic) .. 3 (off topic).
LEVELS = 4


def _similar(target: int, pool: list[str], rng: random.Random) -> str:
    """A sentence of `pool` close to `target` words (from a sample of 8: the length is no cue)."""
    return min(rng.sample(pool, min(8, len(pool))), key=lambda s: abs(len(s.split()) - target))


def _answers(own: tuple[str, ...], others: list[tuple[str, tuple[str, ...]]], rng: random.Random) -> list[str]:
    """The LEVELS answers of one section, best first."""
    opening = list(own[:3])
    foreign = [s for _, sents in others for s in sents[:3] if len(s.split()) <= MAX_WORDS and s not in opening]
    answers = [opening]
    for replaced in range(1, LEVELS - 1):
        answer = list(answers[-1])
        answer[-replaced] = _similar(len(opening[-replaced].split()), foreign, rng)
        answers.append(answer)
    words = sum(len(s.split()) for s in opening)
    candidates = [list(sents[:3]) for _, sents in rng.sample(others, 8)
                  if len(sents) >= 3 and not set(sents[:3]) & set(opening)]
    answers.append(min(candidates, key=lambda c: abs(sum(len(s.split()) for s in c) - words)))
    return [" ".join(a) for a in answers]


def make_ranked_splits(seed: int = 0, questions_train: int = 2, questions_test: int = 1) -> DatasetDict:
    """Train and held-out pairs, all 6 pairs of each prompt together (a prompt group): sections with three sentences
    of opening prose (each at most MAX_WORDS words), HELD_OUT_SHARE of them held out; `questions_*` prompts per
    section. Answers and replacements of either split come from sections of the same split."""
    rng = random.Random(f"trl-pruned-dpo/python-docs-ranked/{seed}")
    pool = [(title, own) for title, own in sections() if len(own) >= 3 and all(len(s.split()) <= MAX_WORDS
                                                                                for s in own[:3])]
    rng.shuffle(pool)
    cut = int(len(pool) * HELD_OUT_SHARE)
    splits = {}
    for split, part, n_questions in (("train", pool[cut:], questions_train), ("test", pool[:cut], questions_test)):
        groups = []
        for index, (title, own) in enumerate(part):
            others = part[:index] + part[index + 1:]
            for question in rng.sample(QUESTIONS, n_questions):
                answers = _answers(own, others, rng)
                user = [{"role": "user", "content": question.format(title=title)}]
                groups.append([{"prompt": user, "chosen": [{"role": "assistant", "content": answers[a]}],
                                "rejected": [{"role": "assistant", "content": answers[b]}]}
                               for a in range(LEVELS) for b in range(a + 1, LEVELS)])
        # The groups in a random order, each group's pairs together.
        rng.shuffle(groups)
        splits[split] = Dataset.from_list([row for group in groups for row in group])
    return DatasetDict(splits)
