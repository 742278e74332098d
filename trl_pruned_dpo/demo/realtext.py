"""Real-text preference tasks from the Python documentation every Python installation ships.

``builtin:python-docs``: the sections of the language reference that `help()` shows (``pydoc_data.topics``: "The
"assert" statement", "Augmented assignment statements", "Dictionaries", ...). ``builtin:python-docstrings``: the
docstrings of public functions and classes of a fixed list of standard-library modules (``json.dumps``,
``shutil.copytree``, ...). Both are turned into preference pairs in TRL's conversational format (``prompt``,
``chosen``, ``rejected`` as lists of messages; TRL applies the model's chat template):

- prompt: one user message asking about a topic (a section's title, a function's dotted name), in one of a few
  phrasings;
- chosen: the opening of that topic's text (its first 1 to 3 sentences, capped near 40 words: ragged lengths);
- rejected, half the pairs, *independent*: the opening of another topic, of a similar length (so length is no cue);
- rejected, the other half, *near-copy*: the chosen answer (then 2 to 3 sentences) with one of its sentences (uniform
  over them, so the common prefix of the two answers is short or long) replaced by a sentence from another topic
  of a similar length (a topic of one sentence gets an independent rejection instead).

Why chosen is better, in a way a model can learn: it is about what was asked; the rejected answer is about another
topic, wholly or in one sentence. Held-out: whole sections (python-docs) or whole modules (python-docstrings) are held
out, so no held-out prompt (nor its answer, nor, for docstrings, its module) is ever trained on. Deterministic from
the seed for a given Python version (the text is that version's documentation).
"""

import random
import re
from functools import lru_cache
# Bound at import: a later patch of `subprocess.run` (tests mock it for the model builds) does not reach the reader.
from subprocess import run as _run_process

from datasets import Dataset, DatasetDict

QUESTIONS = (
    "What does the Python language reference say about {title}?",
    "Explain {title} in Python, briefly.",
    "In Python, what should I know about {title}?",
    "Give me a short description of {title} from the Python docs.",
)
DOCSTRING_QUESTIONS = (
    "What does `{title}` do in Python?",
    "Describe the Python standard library's `{title}`.",
    "In Python, what is `{title}` for?",
    "Briefly, what does `{title}` in the standard library do?",
)
# The share of the sections held out: 56 of 161, asked in every phrasing, 224 held-out pairs.
HELD_OUT_SHARE = 0.35
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
    # A one-sentence answer with its sentence replaced is an independent one.
    near_copy = near_copy and len(own) >= 2
    chosen = _opening(own, rng, least=2 if near_copy else 1)
    if near_copy and len(chosen) >= 2:
        rejected = list(chosen)
        i = rng.randrange(len(rejected))
        foreign = [s for _, sents in others for s in sents[:3] if s not in chosen and len(s.split()) <= MAX_WORDS]
        # A replacement of a similar length: the answer's length is no cue.
        target = len(rejected[i].split())
        rejected[i] = min(rng.sample(foreign, 8), key=lambda s: abs(len(s.split()) - target))
    else:
        candidates = [_opening(sents, rng) for _, sents in rng.sample(others, 8)]
        rejected = min(candidates, key=lambda c: abs(_words(c) - _words(chosen)))
    user = [{"role": "user", "content": question.format(title=title)}]
    return {"prompt": user, "chosen": [{"role": "assistant", "content": " ".join(chosen)}],
            "rejected": [{"role": "assistant", "content": " ".join(rejected)}]}


def _split_pairs(groups: list[list[tuple[str, tuple[str, ...]]]], questions: tuple[str, ...], questions_train: int,
                 questions_test: int, held_out_share: float, rng: random.Random) -> DatasetDict:
    """Train and held-out test pairs from `groups` of topics (a group is held out whole: a section, a module): the
    groups are shuffled and `held_out_share` of them held out; each train topic gives `questions_train` pairs (one per
    phrasing), each held-out one `questions_test`; near-copy and independent rejections alternate. The rejected text
    of either split comes from topics of the same split."""
    groups = list(groups)
    rng.shuffle(groups)
    cut = round(len(groups) * held_out_share)
    splits = {}
    for split, part, n_questions in (("train", groups[cut:], questions_train), ("test", groups[:cut], questions_test)):
        topics = [topic for group in part for topic in group]
        rows = []
        for index, (title, own) in enumerate(topics):
            others = topics[:index] + topics[index + 1:]
            for q, question in enumerate(rng.sample(questions, n_questions)):
                rows.append(_pair(title, own, others, question, (index + q) % 2 == 0, rng))
        rng.shuffle(rows)
        splits[split] = Dataset.from_list(rows)
    return DatasetDict(splits)


def make_splits(seed: int = 0, questions_train: int = len(QUESTIONS), questions_test: int = len(QUESTIONS),
                held_out_share: float = HELD_OUT_SHARE) -> DatasetDict:
    """``builtin:python-docs``: each section a group of its own (420 train pairs, 224 held-out with the defaults)."""
    rng = random.Random(f"trl-pruned-dpo/python-docs/{seed}")
    return _split_pairs([[section] for section in sections()], QUESTIONS, questions_train, questions_test,
                        held_out_share, rng)


# The standard-library modules whose public docstrings make ``builtin:python-docstrings`` (pure-Python and C modules
# alike; a module this Python lacks is skipped). A fixed list, so the task does not depend on what else is imported.
DOCSTRING_MODULES = (
    "argparse", "base64", "binascii", "calendar", "cmath", "codecs", "configparser", "contextlib", "copy", "csv",
    "dataclasses", "datetime", "decimal", "difflib", "dis", "doctest", "email.utils", "enum", "fnmatch", "ftplib",
    "functools", "gc", "getpass", "glob", "gzip", "hashlib", "heapq", "hmac", "html", "http.client", "imaplib",
    "inspect", "io", "ipaddress", "itertools", "json", "linecache", "locale", "logging", "math", "mimetypes",
    "operator", "os", "os.path", "pathlib", "pickle", "pkgutil", "platform", "plistlib", "pprint", "queue", "quopri",
    "random", "re", "secrets", "selectors", "shelve", "shlex", "shutil", "signal", "site", "smtplib", "socket",
    "sqlite3", "statistics", "string", "subprocess", "sys", "sysconfig", "tarfile", "tempfile", "textwrap",
    "threading", "time", "timeit", "tokenize", "traceback", "types", "typing", "unicodedata", "urllib.parse",
    "urllib.request", "uuid", "warnings", "weakref", "webbrowser", "xml.etree.ElementTree", "zipfile", "zlib",
)
# Left out: torch replaces `inspect.getfile` in every process that imports it (torch.package), so a training process
# never read it; out, the task is the one every run has trained and been measured on.
NOT_READ = ("inspect.getfile",)
# The share of the modules held out.
DOCSTRING_HELD_OUT_SHARE = 0.2


def _docstring_sentences(doc: str) -> tuple[str, ...]:
    """The sentences of a docstring's prose paragraphs, signature lines ("dumps(obj, ...)", "f(x) -> y") dropped."""
    lines = [line for line in doc.split("\n") if not re.match(r"^\s*[\w.]+\(.*\)( -> .*)?\s*$", line)]
    return tuple(s for p in _paragraphs(lines) for s in _sentences(p) if s[0].isupper())


# Run in a fresh interpreter (`-I`): the standard library's public functions and classes of each module, with their
# docstrings. In this process a patched function (a test's monkeypatched `subprocess.run`, `logging.captureWarnings`)
# is not the module's own, and would silently drop a topic and change every split after it.
_READ_DOCSTRINGS = """
import importlib, inspect, json, sys
found = []
for name in json.load(sys.stdin):
    try:
        module = importlib.import_module(name)
    except ImportError:
        continue
    documented = []
    for attribute in sorted(a for a in dir(module) if not a.startswith("_")):
        obj = getattr(module, attribute)
        kind = inspect.isfunction(obj) or inspect.isbuiltin(obj) or inspect.isclass(obj)
        own = getattr(obj, "__module__", None) in (name, module.__name__)
        if kind and own and f"{name}.{attribute}" not in sys.argv[1:]:
            documented.append((attribute, inspect.getdoc(obj) or ""))
    found.append((name, documented))
json.dump(found, sys.stdout)
"""


@lru_cache(maxsize=1)
def docstrings() -> tuple[tuple[str, tuple[tuple[str, tuple[str, ...]], ...]], ...]:
    """(module, ((dotted name, sentences of its docstring's prose), ...)) for each module of DOCSTRING_MODULES with
    at least two documented public functions or classes defined in it; a text documented under several names keeps
    its first. Read from a fresh interpreter of this Python, so the same whatever this process imported or patched."""
    import json
    import sys

    read = _run_process([sys.executable, "-I", "-c", _READ_DOCSTRINGS, *NOT_READ],
                          input=json.dumps(DOCSTRING_MODULES), capture_output=True, text=True)
    if read.returncode != 0:
        raise RuntimeError(f"reading the standard library's docstrings failed: {read.stderr.strip()[-500:]}")
    found, seen = [], set()
    for name, documented in json.loads(read.stdout):
        topics = []
        for attribute, doc in documented:
            sentences = _docstring_sentences(doc)
            if sentences and sentences[0] not in seen:
                seen.add(sentences[0])
                topics.append((f"{name}.{attribute}", sentences))
        if len(topics) >= 2:
            found.append((name, tuple(topics)))
    return tuple(found)


def make_docstring_splits(seed: int = 0, questions_train: int = 2, questions_test: int = 1,
                          held_out_share: float = DOCSTRING_HELD_OUT_SHARE) -> DatasetDict:
    """``builtin:python-docstrings``: each module a group, held out whole (a held-out function's module is never
    trained on)."""
    rng = random.Random(f"trl-pruned-dpo/python-docstrings/{seed}")
    return _split_pairs([list(topics) for _, topics in docstrings()], DOCSTRING_QUESTIONS, questions_train,
                        questions_test, held_out_share, rng)
