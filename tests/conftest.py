"""Tiny local assets for the tests: a character tokenizer, a 2-layer Llama built from a config, preference data.

Nothing here touches a hub.
"""

import copy
import os
import string

import pytest
import torch
from datasets import Dataset
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(max(1, min(2, torch.get_num_threads())))

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]


def char_tokenizer() -> PreTrainedTokenizerFast:
    alphabet = SPECIALS + list(string.ascii_letters + string.digits + string.punctuation + " ")
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>"
    )


def tiny_model(tokenizer, seed: int = 0, layers: int = 2, hidden: int = 32) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    return LlamaForCausalLM(config)


def preference_rows(n: int = 8, seed: int = 0):
    """Sums with a right and a near-copy wrong answer; lengths vary."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        a, b = (int(x) for x in torch.randint(1, 999, (2,), generator=g))
        pad = "." * int(torch.randint(0, 12, (1,), generator=g))
        right = f"{a}+{b}={a + b}{pad}"
        wrong = f"{a}+{b}={a + b + 1 + i % 3}{pad}"
        rows.append({"prompt": f"Q{i}: {a}+{b}? ", "chosen": right, "rejected": wrong})
    return rows


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
