"""The pre-registered study's two tasks (docs/study.md): one with near-copy rejections, one with dissimilar ones.

`builtin:python-docs` and `builtin:python-docstrings` mix the two kinds (half the pairs each), so neither is a task of
one kind. These two are built from the same text as `builtin:python-docstrings` (the standard library's docstrings,
trl_pruned_dpo/demo/realtext.py) and differ **only in the rejected answer**:

- the same held-out split: whole modules (`DOCSTRING_HELD_OUT_SHARE` of them) never trained on;
- the same prompts (a topic, in 2 of realtext's 4 phrasings, in the train and in the held-out split) in the same
  order, and the same chosen answers (the topic's opening, 2 to 3 sentences);
- `docstrings-near`: rejected = the chosen answer with one of its sentences replaced by a sentence of another topic of
  a similar length (realtext's near-copy);
- `docstrings-far`: rejected = the opening of another topic of a similar length: an answer to a different prompt
  (realtext's independent rejection).

A topic whose opening has a single sentence cannot be near-copied, so it is left out of both. Every draw is seeded per
pair (split, topic, phrasing), so the two tasks' prompts and chosen answers are identical, pair for pair.
"""

import random

from datasets import Dataset, DatasetDict

KINDS = {"docstrings-near": "near", "docstrings-far": "far"}
QUESTIONS_PER_TOPIC = 2  # phrasings per topic, in the train and in the held-out split


def make_study_splits(task: str, seed: int = 0) -> DatasetDict:
    """`task` one of KINDS' names; `seed` draws the held-out modules, the phrasings and the answers."""
    from trl_pruned_dpo.demo import realtext

    kind = KINDS[task]
    groups = [list(topics) for _, topics in realtext.docstrings()]
    random.Random(f"trl-pruned-dpo/study-docstrings/{seed}").shuffle(groups)
    cut = round(len(groups) * realtext.DOCSTRING_HELD_OUT_SHARE)
    splits = {}
    for split, part in (("train", groups[cut:]), ("test", groups[:cut])):
        topics = [topic for group in part for topic in group]
        # Foreign sentences (a near-copy's replacement): the first three of each topic of this split, with their topic.
        pool = [(title, s) for title, sentences in topics for s in sentences[:3]
                if len(s.split()) <= realtext.MAX_WORDS]
        rows = []
        for index, (title, own) in enumerate(topics):
            if len(own) < 2:
                continue
            others = topics[:index] + topics[index + 1:]
            draw = f"trl-pruned-dpo/study-docstrings/{seed}/{split}/{title}"
            phrasings = random.Random(draw).sample(realtext.DOCSTRING_QUESTIONS, QUESTIONS_PER_TOPIC)
            for question in phrasings:
                chosen = realtext._opening(own, random.Random(f"{draw}/{question}/chosen"), least=2)
                if len(chosen) < 2:  # the first sentence alone fills MAX_WORDS: no near-copy possible
                    continue
                rng = random.Random(f"{draw}/{question}/{kind}")
                if kind == "near":
                    rejected = list(chosen)
                    i = rng.randrange(len(rejected))
                    foreign = [s for t, s in pool if t != title and s not in chosen]
                    target = len(rejected[i].split())  # a replacement of a similar length: length is no cue
                    rejected[i] = min(rng.sample(foreign, 8), key=lambda s: abs(len(s.split()) - target))
                else:
                    candidates = [realtext._opening(sentences, rng) for _, sentences in rng.sample(others, 8)]
                    rejected = min(candidates, key=lambda c: abs(realtext._words(c) - realtext._words(chosen)))
                rows.append({"prompt": [{"role": "user", "content": question.format(title=title)}],
                             "chosen": [{"role": "assistant", "content": " ".join(chosen)}],
                             "rejected": [{"role": "assistant", "content": " ".join(rejected)}]})
        random.Random(f"trl-pruned-dpo/study-docstrings/{seed}/{split}/order").shuffle(rows)
        splits[split] = Dataset.from_list(rows)
    return DatasetDict(splits)
