"""Warm-started built-in models: a built-in tiny model after a short supervised fine-tuning on right answers.

DPO sharpens a policy that already half-knows its task: from the random init of ``builtin:tiny-demo`` the demo's
held-out preference accuracy stays at chance (0.47 after 300 steps). ``builtin:tiny-demo-sft`` is that init after
a few hundred steps of next-token training on the *chosen* answers of ``builtin:sort-short``-shaped data, whose
prompts are kept out of that dataset's train and test splits, so DPO on it is measured on prompts the model never
saw. The loop is a plain causal-LM one (AdamW, warmup then cosine decay, loss on the completion tokens only) over
sequences laid out as TRL's DPO lays them out for this tokenizer: ``<bos> prompt completion <eos>``.

The result is deterministic from the recipe and the seed, and cached like the other built-in models (model.py).
The loop, `train_causal_lm`, is the project's one SFT loop: evaluation/sft.py (the toy quality study's starting
policy) and evaluation/real_run.py (the real-model study's warm start) call it too.
"""

import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .tasks import BUILTIN_VARIANTS, load_builtin, make_examples
from .tokenizer import build_tokenizer


@dataclass(frozen=True)
class SFTRecipe:
    """What determines a warm-started model (its cache folder is keyed by a hash of these fields)."""

    # The BUILTIN_MODELS entry it starts from.
    base: str = "tiny-demo"
    # The BUILTIN_VARIANTS entry whose task and sizes it trains on.
    dataset: str = "sort-short"
    n_examples: int = 8192
    steps: int = 400
    batch_size: int = 32
    learning_rate: float = 3e-3
    warmup: int = 30
    # Far from the DPO splits' seeds (0 and 1_000_003).
    data_seed: int = 2_000_003
    # Torch threads while training: the result then does not depend on the caller's thread count.
    threads: int = 1
    # Test pairs drawn for the DPO dataset (tasks.BUILTIN_VARIANTS), kept out of SFT.
    held_out_pairs: int = 1024


SFT_MODELS = {"tiny-demo-sft": SFTRecipe()}


def sft_examples(recipe: SFTRecipe, seed: int) -> list[dict[str, str]]:
    """SFT examples of the recipe's task and sizes, none with a prompt of the DPO dataset's train or test split."""
    variant = BUILTIN_VARIANTS[recipe.dataset]
    # The recipe's hash names the cache folder: it must change with the split.
    if variant.n_test != recipe.held_out_pairs:
        raise ValueError(f"SFTRecipe.held_out_pairs={recipe.held_out_pairs} but {recipe.dataset} draws "
                         f"{variant.n_test}.")
    held = {p for split in load_builtin(recipe.dataset, seed).values() for p in split["prompt"]}
    rows = make_examples(variant.task, recipe.n_examples, recipe.data_seed + seed, variant.min_size,
                         variant.max_size)
    return [row for row in rows if row["prompt"] not in held]


def encode(tokenizer: Any, rows: list[dict[str, str]]) -> list[tuple[list[int], int]]:
    """(ids, first completion index) per row: ``<bos> prompt completion <eos>``, as TRL lays out a DPO sequence for
    the demo's tokenizer."""
    encoded = []
    for row in rows:
        prompt = tokenizer(row["prompt"])["input_ids"]
        full = tokenizer(row["prompt"] + row["chosen"])["input_ids"] + [tokenizer.eos_token_id]
        encoded.append((full, len(prompt)))
    return encoded


def _batch(encoded: list[tuple[list[int], int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, labels, attention_mask), right-padded; labels only on the completion (and its EOS)."""
    width = max(len(ids) for ids, _ in encoded)
    input_ids = torch.full((len(encoded), width), pad_id, dtype=torch.long)
    labels = torch.full((len(encoded), width), -100, dtype=torch.long)
    attention = torch.zeros((len(encoded), width), dtype=torch.long)
    for i, (ids, start) in enumerate(encoded):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, start : len(ids)] = input_ids[i, start : len(ids)]
        attention[i, : len(ids)] = 1
    return input_ids, labels, attention


def train_causal_lm(model: torch.nn.Module, encoded: list[tuple[list[int], int]], steps: int, batch_size: int,
                    learning_rate: float, warmup: int, pad_id: int, order: random.Random, log: Callable[[str], None],
                    log_every: int = 100) -> torch.nn.Module:
    """The one SFT loop of the project (the demo's warm start, the toy quality study's, the real-model study's):
    `steps` AdamW steps on `batch_size` examples drawn from `encoded` ((ids, first completion index) pairs) with
    `order`, the loss on the completion tokens only, linear warm-up then cosine decay to a tenth, gradients clipped
    at 1. Trains `model` in place (train mode); the caller seeds torch and sets the thread count."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.0, betas=(0.9, 0.98))

    def lr_factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    started = time.perf_counter()
    model.train()
    for step in range(steps):
        input_ids, labels, attention = _batch([order.choice(encoded) for _ in range(batch_size)], pad_id)
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % log_every == 0 or step + 1 == steps:
            log(f"  SFT step {step + 1}/{steps}: loss {loss.item():.3f} ({time.perf_counter() - started:.0f} s)")
    return model


def fine_tune(model: torch.nn.Module, recipe: SFTRecipe, seed: int = 0,
              log: Callable[[str], None] | None = None) -> torch.nn.Module:
    """Train `model` (a fresh built-in init) in place by `recipe`; returns it in eval mode. Leaves the caller's
    global RNGs untouched."""
    log = log or (lambda message: print(message, file=sys.stderr, flush=True))
    tokenizer = build_tokenizer()
    encoded = encode(tokenizer, sft_examples(recipe, seed))
    threads = torch.get_num_threads()
    # A thread count may change the order of reductions, hence the weights.
    torch.set_num_threads(recipe.threads)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            train_causal_lm(model, encoded, recipe.steps, recipe.batch_size, recipe.learning_rate, recipe.warmup,
                            tokenizer.pad_token_id, random.Random(f"trl-pruned-dpo/sft/{seed}"), log)
    finally:
        torch.set_num_threads(threads)
    return model.eval()
