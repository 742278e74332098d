"""pytest fixtures over the tiny local assets of tests/tiny.py (re-exported here for older imports)."""

import copy

import pytest
import torch
from datasets import Dataset

from tiny import *  # noqa: F403 - the builders, for `from conftest import ...`
from tiny import char_tokenizer, preference_rows, tiny_model

torch.set_num_threads(1)  # tiny models: threads only add synchronisation


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
