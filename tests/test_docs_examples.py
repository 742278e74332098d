"""Every example in README.md and docs/*.md runs as written, on a CPU machine, offline.

- each fenced ```python block is executed, in a fresh namespace, from an empty working folder, with the demo cache
  in a temp folder (the blocks build what they need from the built-in demo, as a reader would);
- each `trl-pruned-dpo ...` line of a ```bash block is parsed by the real command line (flags, YAML keys and config
  paths exist; nothing is trained: the end-to-end runs are in test_cli.py).
"""

import re
import shlex
from pathlib import Path

import pytest

from trl_pruned_dpo import cli

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)


def blocks(language: str):
    found = []
    for path in DOCS:
        text = path.read_text()
        for match in FENCE.finditer(text):
            if match.group(1) == language:
                line = text[: match.start()].count("\n") + 1
                found.append(pytest.param(match.group(2), id=f"{path.relative_to(REPO)}:{line}"))
    return found


def commands():
    """`trl-pruned-dpo` invocations in the bash blocks: continuation lines joined, `&&` chains split, comments cut."""
    found = []
    for param in blocks("bash"):
        script = param.values[0].replace("\\\n", " ")
        for line in script.splitlines():
            for part in line.split("#", 1)[0].split("&&"):
                words = shlex.split(part)
                if words and words[0] == "trl-pruned-dpo":
                    found.append(pytest.param(words[1:], id=f"{param.id}:{' '.join(words[1:3])}"))
    return found


PYTHON_BLOCKS, COMMANDS = blocks("python"), commands()


def test_the_docs_have_examples():
    assert PYTHON_BLOCKS and COMMANDS  # the extraction found what the README shows


@pytest.mark.parametrize("code", PYTHON_BLOCKS)
def test_python_block_runs_as_written(code, tmp_path, monkeypatch):
    monkeypatch.setenv("TRL_PRUNED_DPO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "<doc block>", "exec"), {"__name__": "__doc_example__"})


@pytest.mark.parametrize("argv", COMMANDS)
def test_command_line_parses(argv, monkeypatch):
    monkeypatch.chdir(REPO)
    parsed = cli.parse([a for a in argv if a != "--compare"])
    assert parsed[4] or parsed[1].output_dir  # launch arguments, or a complete training config
