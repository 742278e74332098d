"""`group_by_prompt`: a training sampler that keeps the pairs of one prompt in the same micro-batch, so that the
packed forward runs their prompt once and each distinct response once (docs/prompt_groups.md).

The order of an epoch: the prompt groups shuffled (a permutation drawn from (seed, epoch), the same on every rank),
then laid into micro-batches of exactly `batch_size` indices, each group whole where it fits: a batch takes the first
groups of the shuffled order that fit its room (looking ahead at most `LOOKAHEAD` groups), and only when none does is
the next group split across this batch and the next (a group larger than a batch is always split). The pairs of a
group keep their dataset order. A resumed run rebuilds the same order and skips the batches it trained
(transformers' `skip_first_batches`), so it sees what the uninterrupted run sees.
"""

import warnings
from collections import deque
from collections.abc import Hashable, Iterable
from typing import Any

import torch
from torch.utils.data import Sampler

# Groups looked at to fill a batch's room before one is split.
LOOKAHEAD = 64


def prompt_groups_of(prompts: Iterable[list | Hashable]) -> list[list[int]]:
    """The indices of each distinct prompt (token ids, or any hashable row), in order of first appearance."""
    groups: dict = {}
    for index, prompt in enumerate(prompts):
        groups.setdefault(tuple(prompt) if isinstance(prompt, list) else prompt, []).append(index)
    return list(groups.values())


def grouped_order(groups: list[list[int]], batch_size: int, generator: torch.Generator) -> list[int]:
    """Every index once: the groups in a random order, filled into consecutive batches of `batch_size`, a group split
    only where no group of the next LOOKAHEAD fits the room left."""
    pending = deque(groups[i] for i in torch.randperm(len(groups), generator=generator).tolist())
    order, room = [], batch_size
    while pending:
        fits = next((i for i, g in zip(range(LOOKAHEAD), pending) if len(g) <= room), None)
        # Split the next group: its head fills this batch, its rest waits at the front.
        if fits is None:
            group = pending.popleft()
            taken, rest = group[:room], group[room:]
            pending.appendleft(rest)
        else:
            taken = pending[fits]
            del pending[fits]
        order += taken
        room -= len(taken)
        if room == 0:
            room = batch_size
    return order


class PromptGroupSampler(Sampler):
    """Indices of an epoch in prompt groups (`grouped_order`), from (seed, epoch): the same on every rank and on a
    resume. transformers and accelerate call `set_epoch` at each epoch."""

    def __init__(self, groups: list[list[int]], batch_size: int, seed: int):
        self.groups, self.batch_size, self.seed = groups, batch_size, seed
        self.epoch = 0
        self.size = sum(len(g) for g in groups)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.size

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        return iter(grouped_order(self.groups, self.batch_size, generator))


def prompt_group_sampler(args: Any, dataset: Any, batch_size: int) -> PromptGroupSampler | None:
    """The training sampler `group_by_prompt` asks for, over TRL's tokenized dataset (its `prompt_ids` column), seeded
    as transformers seeds its own (`data_seed`, else `seed`); None when it is off, or (said in one line) when the
    dataset has no length or no `prompt_ids` (an IterableDataset: its own order)."""
    if not getattr(args, "group_by_prompt", False):
        return None
    columns = getattr(dataset, "column_names", None) or ()
    if "prompt_ids" not in columns or not hasattr(dataset, "__len__"):
        warnings.warn("group_by_prompt ignored: the training dataset has no length or no `prompt_ids` column (an "
                      "IterableDataset is consumed in its own order); pairs that share a prompt within a batch still "
                      "share it.", stacklevel=3)
        return None
    seed = args.data_seed if args.data_seed is not None else args.seed
    return PromptGroupSampler(prompt_groups_of(dataset["prompt_ids"]), batch_size, seed)
