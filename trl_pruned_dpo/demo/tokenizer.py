"""A character-level tokenizer built locally: one token per printable ASCII character, plus specials.

No download, no training: the vocabulary is fixed, so the same ids come out on every machine. Every prompt and
completion the demo tasks write is printable ASCII, so ``tokenize(prompt + completion)`` is always the tokenized
prompt followed by the tokenized completion (no merges across the boundary), which is what TRL's DPO tokenization
assumes. A ``<bos>`` token is prepended to every sequence; TRL appends ``<eos>`` to non-conversational completions.
"""

import string

from tokenizers import Tokenizer, decoders, models, processors
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>"}
# Sorted so the id of each character is a fixed function of the character set.
CHARACTERS = sorted(set(string.printable) - set("\t\n\r\x0b\x0c"))


def build_vocab() -> dict[str, int]:
    """Token -> id: the four specials first (pad=0), then the printable characters in code-point order."""
    tokens = list(SPECIAL_TOKENS.values()) + CHARACTERS
    return {token: index for index, token in enumerate(tokens)}


def build_tokenizer(model_max_length: int = 1024) -> PreTrainedTokenizerFast:
    """Return the character-level tokenizer (a `PreTrainedTokenizerFast`, saved and reloaded like any other)."""
    vocab = build_vocab()
    # BPE with no merges and no pre-tokenizer splits text into single characters, spaces included.
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=SPECIAL_TOKENS["unk_token"]))
    backend.add_special_tokens(list(SPECIAL_TOKENS.values()))
    bos = SPECIAL_TOKENS["bos_token"]
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, vocab[bos])]
    )
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, model_max_length=model_max_length, padding_side="right", **SPECIAL_TOKENS
    )
