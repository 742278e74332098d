"""pytest fixtures over the tiny local assets of tests/tiny.py (re-exported here for older imports)."""

import copy
import logging
import os

import pytest
import torch
from datasets import Dataset

from tiny import *  # noqa: F403 - the builders, for `from conftest import ...`
from tiny import char_tokenizer, preference_rows, tiny_model

# Tiny models: threads only add synchronisation. A run alone on the machine with real weights (CI's Gemma 3 file, after
# the two-worker run) sets TEST_TORCH_THREADS to the cores it has.
torch.set_num_threads(int(os.environ.get("TEST_TORCH_THREADS", "1")))
logging.getLogger("trl_pruned_dpo")  # the plugin's loggers are made on first use: their parent exists from the start


@pytest.fixture(autouse=True)
def process_state_restored():
    """Each test leaves the environment and the loggers as it found them. The research scripts' `quiet()` (their
    smoke tests run some in this process) raises `trl_pruned_dpo`, `transformers` and others to ERROR and sets
    environment variables for good: every later test in the process then saw none of the plugin's warnings, so a test
    of a warning passed or failed by which file ran before it. A logger that existed gets its level and propagation
    back (the plugin's parent logger exists from the start); one that was only a parent name (a placeholder) goes back
    to the defaults; one created by an import keeps what its library set."""
    environ = dict(os.environ)
    manager = logging.root.manager
    before = {name: (node.level, node.propagate, node.disabled) if isinstance(node, logging.Logger)
              else None for name, node in manager.loggerDict.items()}
    root_level = logging.root.level
    yield
    os.environ.clear()
    os.environ.update(environ)
    for name, node in list(manager.loggerDict.items()):
        if not isinstance(node, logging.Logger) or name not in before:
            continue
        level, propagate, disabled = before[name] or (logging.NOTSET, True, False)
        if node.level != level:  # setLevel clears every logger's cache: only where it changed
            node.setLevel(level)
        node.propagate, node.disabled = propagate, disabled
    if logging.root.level != root_level:
        logging.root.setLevel(root_level)


@pytest.fixture(scope="session")
def tokenizer():
    return char_tokenizer()


@pytest.fixture()
def dataset():
    return Dataset.from_list(preference_rows())


@pytest.fixture()
def model_pair(tokenizer):
    model = tiny_model(tokenizer)
    return model, copy.deepcopy(model)
