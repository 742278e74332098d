"""The real-text built-in tasks' held-out splits (no model needed): at least 200 held-out pairs each, held out by
whole group (a language-reference section; a standard-library module), conversational, honest pairs."""

from trl.data_utils import is_conversational

from trl_pruned_dpo.demo.realtext import DOCSTRING_QUESTIONS, docstrings, make_docstring_splits
from trl_pruned_dpo.demo.tasks import builtin_names, load_builtin


def _topic(question: str) -> str:
    return question.split("`")[1]


def test_python_docs_holds_out_at_least_200_pairs():
    splits = load_builtin("builtin:python-docs")
    assert len(splits["test"]) >= 200 and len(splits["train"]) >= 400


def test_python_docstrings_is_a_builtin_held_out_by_module():
    assert "builtin:python-docstrings" in builtin_names()
    splits = load_builtin("builtin:python-docstrings")
    assert len(splits["test"]) >= 200 and len(splits["train"]) >= 1000
    assert splits["train"][:3] == make_docstring_splits(0)["train"][:3] != make_docstring_splits(1)["train"][:3]
    known = {name for _, topics in docstrings() for name, _ in topics}
    modules = {}
    for split in splits:
        topics = {_topic(row["prompt"][0]["content"]) for row in splits[split]}
        assert topics <= known
        modules[split] = {t.rsplit(".", 1)[0] for t in topics}
    assert not modules["train"] & modules["test"]  # a held-out function's module is never trained on
    phrasings = {q.split("`")[0] for q in DOCSTRING_QUESTIONS}
    near = 0
    for row in splits["test"]:
        assert is_conversational(row) and row["prompt"][0]["content"].split("`")[0] in phrasings
        chosen, rejected = row["chosen"][0]["content"], row["rejected"][0]["content"]
        assert chosen != rejected and row["chosen"][0]["role"] == row["rejected"][0]["role"] == "assistant"
        near += bool(set(chosen.split(". ")) & set(rejected.split(". ")))  # a sentence in common: a near-copy
    # Near-copies need a docstring of two sentences or more: about a quarter of the pairs (the rest independent).
    assert 0.15 < near / len(splits["test"]) < 0.5, near


def test_the_docstrings_task_is_the_same_whatever_this_process_patched(monkeypatch):
    """The standard library's docstrings are read in a fresh interpreter: a function patched in this process (as a
    test, or torch's `inspect.getfile`, does) is still read as its module's own. Failed before: the first read cached
    whatever was patched at that moment, and a patched `shlex.split` dropped its topic from every later split of the
    run (the study harness then refused its own calibration: "measured on other data")."""
    import shlex
    import subprocess

    from trl_pruned_dpo.demo import realtext

    docstrings.cache_clear()
    clean = docstrings()
    monkeypatch.setattr(shlex, "split", lambda text: text.split())
    monkeypatch.setattr(subprocess, "run", lambda *args, **kwargs: (_ for _ in ()).throw(AssertionError("mocked")))
    docstrings.cache_clear()
    try:
        assert docstrings() == clean
    finally:
        docstrings.cache_clear()
    names = {name for _, topics in clean for name, _ in topics}
    assert "shlex.split" in names and not names & set(realtext.NOT_READ)
