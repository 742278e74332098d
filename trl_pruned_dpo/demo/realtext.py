"""A real-text preference task from the Python documentation every Python installation ships (``pydoc_data``).

``builtin:python-docs``: the sections of the language reference that `help()` shows (``pydoc_data.topics``: "The
"assert" statement", "Augmented assignment statements", "Dictionaries", ...), turned into preference pairs in TRL's
conversational format (``prompt``, ``chosen``, ``rejected`` as lists of messages; TRL applies the model's chat template):

- prompt: one user message asking about a section by its title, in one of a few phrasings;
- chosen: the opening of that section (its first 1 to 3 sentences, capped near 40 words: ragged lengths);
- rejected, half the pairs, *independent*: the opening of another section, of a similar length (so length is no cue);
- rejected, the other half, *near-copy*: the chosen answer (then 2 to 3 sentences) with one of its sentences (uniform
  over them, so the common prefix of the two answers is short or long) replaced by a sentence from another section
  of a similar length (a section of one sentence gets an independent rejection instead).

Why chosen is better, in a way a model can learn: it is about what was asked; the rejected answer is about another
topic, wholly or in one sentence. Held-out: whole sections are held out, so no held-out prompt (nor its answer) is
ever trained on. Deterministic from the seed for a given Python version (the text is that version's documentation).
"""

import random
import re
from functools import lru_cache

from datasets import Dataset, DatasetDict

QUESTIONS = (
    "What does the Python language reference say about {title}?",
    "Explain {title} in Python, briefly.",
    "In Python, what should I know about {title}?",
    "Give me a short description of {title} from the Python docs.",
)
HELD_OUT_SHARE = 0.25  # of the sections
MAX_WORDS = 40
_TITLE_RULE = re.compile(r"[*=\-~^]{3,}")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"“*(])")


def _paragraphs(lines: list[str]) -> list[str]:
    """Prose paragraphs of a section: blocks separated by blank lines, not indented (indented blocks are grammar or
    code), not introducing a code block (ending on ':'), whitespace normalized."""
    blocks, block = [], []
    for line in lines + [""]:
        if line.strip():
            block.append(line)
        elif block:
            blocks.append(block)
            block = []
    prose = [" ".join(" ".join(line.split()) for line in b) for b in blocks if not b[0].startswith(" ")]
    return [p for p in prose if not p.endswith(":") and len(p.split()) >= 6]


def _sentences(paragraph: str) -> list[str]:
    return [s.strip() for s in _SENTENCE_END.split(paragraph) if len(s.split()) >= 3]


@lru_cache(maxsize=1)
def sections() -> tuple[tuple[str, tuple[str, ...]], ...]:
    """(title, sentences of its opening prose) for each section of pydoc's topics with at least one such sentence;
    titles are unique (a title found in several topics keeps its first section)."""
    from pydoc_data.topics import topics

    found, seen = [], set()
    for key in sorted(topics):
        lines = topics[key].split("\n")
        starts = [i for i in range(len(lines) - 1)
                  if lines[i].strip() and _TITLE_RULE.fullmatch(lines[i + 1].strip())
                  and len(lines[i + 1].strip()) >= len(lines[i].strip())]
        for n, start in enumerate(starts):
            title = lines[start].strip()
            end = starts[n + 1] if n + 1 < len(starts) else len(lines)
            sentences = [s for p in _paragraphs(lines[start + 2:end]) for s in _sentences(p)]
            if sentences and title not in seen:
                seen.add(title)
                found.append((title, tuple(sentences)))
    return tuple(found)


def _opening(sentences: tuple[str, ...], rng: random.Random, least: int = 1) -> list[str]:
    """The first `least` to 3 sentences, stopping before MAX_WORDS (the first sentence always, cut if it is longer)."""
    wanted = rng.randint(least, 3)
    out, words = [], 0
    for sentence in sentences[:wanted]:
        n = len(sentence.split())
        if out and words + n > MAX_WORDS:
            break
        out.append(sentence if n <= MAX_WORDS else " ".join(sentence.split()[:MAX_WORDS]) + " ...")
        words += n
    return out


def _words(sentences: list[str]) -> int:
    return sum(len(s.split()) for s in sentences)


def _pair(title: str, own: tuple[str, ...], others: list[tuple[str, tuple[str, ...]]], question: str,
          near_copy: bool, rng: random.Random) -> dict:
    near_copy = near_copy and len(own) >= 2  # a one-sentence answer with its sentence replaced is an independent one
    chosen = _opening(own, rng, least=2 if near_copy else 1)
    if near_copy and len(chosen) >= 2:
        rejected = list(chosen)
        i = rng.randrange(len(rejected))
        foreign = [s for _, sents in others for s in sents[:3] if s not in chosen and len(s.split()) <= MAX_WORDS]
        target = len(rejected[i].split())  # a replacement of a similar length: the answer's length is no cue
        rejected[i] = min(rng.sample(foreign, 8), key=lambda s: abs(len(s.split()) - target))
    else:
        candidates = [_opening(sents, rng) for _, sents in rng.sample(others, 8)]
        rejected = min(candidates, key=lambda c: abs(_words(c) - _words(chosen)))
    user = [{"role": "user", "content": question.format(title=title)}]
    return {"prompt": user, "chosen": [{"role": "assistant", "content": " ".join(chosen)}],
            "rejected": [{"role": "assistant", "content": " ".join(rejected)}]}


def make_splits(seed: int = 0, questions_train: int = len(QUESTIONS), questions_test: int = 2) -> DatasetDict:
    """Train and held-out test pairs: the sections are split (HELD_OUT_SHARE held out); each train section gives
    `questions_train` pairs (one per phrasing), each held-out one `questions_test`; near-copy and independent
    rejections alternate. The rejected text of either split comes from sections of the same split."""
    rng = random.Random(f"trl-pruned-dpo/python-docs/{seed}")
    pool = list(sections())
    rng.shuffle(pool)
    cut = int(len(pool) * HELD_OUT_SHARE)
    splits = {}
    for split, part, n_questions in (("train", pool[cut:], questions_train), ("test", pool[:cut], questions_test)):
        rows = []
        for index, (title, own) in enumerate(part):
            others = part[:index] + part[index + 1:]
            for q, question in enumerate(rng.sample(QUESTIONS, n_questions)):
                rows.append(_pair(title, own, others, question, (index + q) % 2 == 0, rng))
        rng.shuffle(rows)
        splits[split] = Dataset.from_list(rows)
    return DatasetDict(splits)
