"""Preference tasks with a checkable ground truth, for the offline demo and the quality study.

Each example is a prompt, the right answer (`chosen`) and a near-copy of it with one planted mistake (`rejected`),
so preference accuracy measures whether the model learned the task, not noise. The two completions share a common
prefix up to the mistake, whose position is uniform over the answer: short and long shared prefixes both occur.

Tasks (the `size` of an example is drawn uniformly from `[min_size, max_size]`):

- ``sort``    ``"sort: 52 7 13 ="`` -> ``" 7 13 52"``; size = number of items (0..99). Mistake: two adjacent
  distinct items swapped, or one item replaced by another number.
- ``add``     ``"add: 48+97 ="`` -> ``" 8+7+0=15, 4+9+1=14 => 145"``: column sums from the right (digit + digit +
  carry), then the total; size = digits of the longer operand. Mistake: one column sum off by one, the later
  carries and the total computed from the wrong sum (a consistent near-copy; the total is always wrong).
- ``reverse`` ``"reverse: abc ="`` -> ``" cba"``; size = characters. Mistake: one character replaced.
- ``mix``     the three above, in equal shares.

Completions start with a space and prompts end on ``" ="``, so a character-level tokenizer splits them cleanly.
`is_correct` judges any completion (e.g. a generated one) against the prompt alone.
"""

import random
import string
from typing import NamedTuple

from datasets import Dataset, DatasetDict

TASKS = ("sort", "add", "reverse")
DEFAULT_SIZES = {"sort": (1, 32), "add": (1, 12), "reverse": (1, 64)}
_ALPHABET = string.ascii_lowercase


# --- ground truth -----------------------------------------------------------------------------------------------------


def _parse(prompt: str) -> tuple[str, str]:
    """Split ``"<task>: <body> ="`` into (task, body)."""
    head, _, rest = prompt.partition(":")
    task = head.strip()
    if task not in TASKS or not rest.rstrip().endswith("="):
        raise ValueError(f"Not a demo prompt: {prompt!r}")
    return task, rest.strip()[:-1].strip()


def _add_steps(a: str, b: str, wrong_column: int | None = None, delta: int = 0) -> str:
    """Worked column addition of two digit strings; `wrong_column` (from the right) gets `delta` added to its sum."""
    width = max(len(a), len(b))
    a, b = a.zfill(width), b.zfill(width)
    steps, digits, carry = [], [], 0
    for column in range(width):
        x, y = int(a[-1 - column]), int(b[-1 - column])
        total = x + y + carry + (delta if column == wrong_column else 0)
        steps.append(f"{x}+{y}+{carry}={total}")
        digits.append(str(total % 10))
        carry = total // 10
    if carry:
        digits.append(str(carry))
    answer = "".join(reversed(digits)).lstrip("0") or "0"
    return " " + ", ".join(steps) + " => " + answer


def solve(prompt: str) -> str:
    """The right completion for a demo prompt (what `chosen` holds)."""
    task, body = _parse(prompt)
    if task == "sort":
        return " " + " ".join(str(v) for v in sorted(int(t) for t in body.split()))
    if task == "add":
        a, b = body.split("+")
        return _add_steps(a.strip(), b.strip())
    return " " + body[::-1]


def is_correct(task: str | None, prompt: str, completion: str) -> bool:
    """Whether `completion` answers `prompt` correctly. `task` may be None or "mix": it is read from the prompt.

    sort and reverse: the answer must equal the right one (surrounding whitespace and a trailing EOS-like token
    ignored); add: the total after ``=>`` must be the right sum (the worked steps are not graded).
    """
    prompt_task, body = _parse(prompt)
    if task not in (None, "mix", prompt_task):
        raise ValueError(f"Prompt {prompt!r} is a {prompt_task!r} prompt, not {task!r}.")
    # Drop "<eos>" and anything generated after it.
    answer = completion.split("<", 1)[0].strip()
    if prompt_task == "add":
        a, b = (int(t) for t in body.split("+"))
        return answer.rpartition("=>")[2].strip() == str(a + b)
    return answer == solve(prompt).strip()


# --- generators -------------------------------------------------------------------------------------------------------


def _sort_example(rng: random.Random, size: int) -> tuple[str, str, str]:
    items = [rng.randrange(100) for _ in range(size)]
    # A swap needs two distinct values.
    if size >= 2 and len(set(items)) == 1:
        items[0] = (items[0] + 1) % 100
    prompt = "sort: " + " ".join(map(str, items)) + " ="
    answer = sorted(items)
    wrong = list(answer)
    distinct_neighbours = [i for i in range(size - 1) if answer[i] != answer[i + 1]]
    if distinct_neighbours and rng.random() < 0.5:
        i = rng.choice(distinct_neighbours)
        wrong[i], wrong[i + 1] = wrong[i + 1], wrong[i]
    else:
        i = rng.randrange(size)
        wrong[i] = rng.choice([v for v in range(100) if v != answer[i]])
    return prompt, " " + " ".join(map(str, answer)), " " + " ".join(map(str, wrong))


def _add_example(rng: random.Random, size: int) -> tuple[str, str, str]:
    a = str(rng.randrange(10 ** (size - 1) if size > 1 else 0, 10**size))
    b = str(rng.randrange(10 ** rng.randint(1, size)))
    prompt = f"add: {a}+{b} ="
    column = rng.randrange(max(len(a), len(b)))
    chosen = _add_steps(a, b)
    # +1 or -1, but never a negative column sum.
    delta = rng.choice((-1, 1))
    rejected = _add_steps(a, b, column, delta)
    if "-" in rejected or rejected == chosen:
        rejected = _add_steps(a, b, column, -delta)
    return prompt, chosen, rejected


def _reverse_example(rng: random.Random, size: int) -> tuple[str, str, str]:
    text = "".join(rng.choice(_ALPHABET) for _ in range(size))
    answer = text[::-1]
    i = rng.randrange(size)
    wrong = answer[:i] + rng.choice(_ALPHABET.replace(answer[i], "")) + answer[i + 1 :]
    return f"reverse: {text} =", " " + answer, " " + wrong


_GENERATORS = {"sort": _sort_example, "add": _add_example, "reverse": _reverse_example}


def make_examples(
    task: str, n: int, seed: int, min_size: int | None = None, max_size: int | None = None
) -> list[dict[str, str]]:
    """`n` examples as dicts with prompt/chosen/rejected, a pure function of the arguments."""
    if task not in TASKS + ("mix",):
        raise ValueError(f"Unknown demo task {task!r}: choose among {list(TASKS + ('mix',))}.")
    # String seeds hash with SHA-512: stable across runs.
    rng = random.Random(f"trl-pruned-dpo/{task}/{seed}")
    examples = []
    for index in range(n):
        name = TASKS[index % len(TASKS)] if task == "mix" else task
        low, high = min_size or DEFAULT_SIZES[name][0], max_size or DEFAULT_SIZES[name][1]
        if not 1 <= low <= high:
            raise ValueError(f"Need 1 <= min_size <= max_size, got {low} and {high}.")
        size = rng.randint(low, high)
        prompt, chosen, rejected = _GENERATORS[name](rng, size)
        assert is_correct(name, prompt, chosen) and not is_correct(name, prompt, rejected), prompt
        examples.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return examples


def make_dataset(
    task: str, n: int, seed: int = 0, min_size: int | None = None, max_size: int | None = None
) -> Dataset:
    """A `datasets.Dataset` of `n` preference pairs (columns prompt, chosen, rejected) for `task`."""
    return Dataset.from_list(make_examples(task, n, seed, min_size, max_size))


def make_splits(
    task: str, n_train: int, n_test: int, seed: int = 0, min_size: int | None = None, max_size: int | None = None
) -> DatasetDict:
    """Train and test splits whose prompts do not overlap (duplicates of train prompts are dropped from test, so the
    test split may come out slightly smaller than `n_test` for tiny sizes)."""
    train = make_examples(task, n_train, seed, min_size, max_size)
    seen = {example["prompt"] for example in train}
    test = [e for e in make_examples(task, n_test, seed + 1_000_003, min_size, max_size) if e["prompt"] not in seen]
    return DatasetDict(train=Dataset.from_list(train), test=Dataset.from_list(test))


# --- built-in dataset names -------------------------------------------------------------------------------------------

BUILTIN_PREFIX = "builtin:"
BUILTIN_SPLIT_SIZES = {"train": 4096, "test": 256}


class Variant(NamedTuple):
    """A named variant of a task: its sizes (`min_size` to `max_size`), the train pairs and the test pairs drawn."""

    task: str
    min_size: int
    max_size: int
    n_train: int
    n_test: int


# Named variants. `sort-short` (1 to 12 numbers, responses of 2 to ~36 tokens) is what the SFT-warm-started demo model
# (demo/sft.py) learns to rank within a minute of CPU. Its 1024 drawn test pairs leave 969 once the prompts seen in
# training are dropped: enough that one evaluation's sampling error (~0.013 at an accuracy of 0.85) is below the
# differences the demo reports.
BUILTIN_VARIANTS = {"sort-short": Variant("sort", 1, 12, 2048, 1024)}


# Real English text in the conversational format (realtext.py).
REAL_TEXT = "python-docs"
# The same text, 4 graded answers and all 6 pairs per prompt (ranked.py).
RANKED_TEXT = "python-docs-ranked"
# The standard library's docstrings, the same format (realtext.py).
REAL_TEXT_DOCSTRINGS = "python-docstrings"


def builtin_names() -> list[str]:
    return [BUILTIN_PREFIX + t for t in TASKS + ("mix",) + tuple(BUILTIN_VARIANTS)
            + (REAL_TEXT, REAL_TEXT_DOCSTRINGS, RANKED_TEXT)]


def load_builtin(name: str, seed: int = 0) -> DatasetDict:
    """The dataset named ``builtin:<task>`` (sort, add, reverse, mix): 4096 train and up to 256 held-out test pairs
    with default sizes, generated in memory (well under a second) from `seed`; or a named variant
    (``builtin:sort-short``: 2048 train pairs of 1 to 12 numbers, 969 held-out pairs); or ``builtin:python-docs``,
    real text from the Python documentation as chat messages (realtext.py: 420 train and 224 held-out pairs);
    ``builtin:python-docstrings``, the standard library's docstrings, likewise (~1570 train, ~220 held-out pairs); or
    ``builtin:python-docs-ranked``, the Python documentation's text with 4 graded answers per prompt, all 6 pairs
    (ranked.py)."""
    task = name[len(BUILTIN_PREFIX):] if name.startswith(BUILTIN_PREFIX) else name
    if task == REAL_TEXT:
        from .realtext import make_splits as real_text_splits

        return real_text_splits(seed)
    if task == RANKED_TEXT:
        from .ranked import make_ranked_splits

        return make_ranked_splits(seed)
    if task == REAL_TEXT_DOCSTRINGS:
        from .realtext import make_docstring_splits

        return make_docstring_splits(seed)
    if task in BUILTIN_VARIANTS:
        variant = BUILTIN_VARIANTS[task]
        return make_splits(variant.task, variant.n_train, variant.n_test, seed, variant.min_size, variant.max_size)
    if task not in TASKS + ("mix",):
        raise ValueError(f"Unknown built-in dataset {name!r}: choose among {builtin_names()}.")
    return make_splits(task, BUILTIN_SPLIT_SIZES["train"], BUILTIN_SPLIT_SIZES["test"], seed)
