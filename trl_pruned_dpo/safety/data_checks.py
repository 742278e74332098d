"""Checks of the prepared (tokenized) training pairs that stock TRL leaves silent.

- Degenerate pairs: `chosen` identical to `rejected` (two empty responses included). Such a pair has
  D_w - D_l = 0 whatever the policy, so it contributes no gradient at all; a dataset of them trains to
  `grad_norm 0`, `positions scored 0%` and reward accuracy 0 without a word. Counted, with one example index, in one
  warning; a dataset where every pair is degenerate is refused. A pair with one empty response (nothing but the EOS
  TRL appends) still has a signal, the EOS: it is counted in a warning of its own, usually a preprocessing slip.
- Truncation: the collator cuts every prompt+response sequence to `max_length`; the share of pairs that lose
  response tokens is reported in one warning. TRL drops the pairs whose prompt alone fills `max_length`; if that is
  every pair, training would fail later with an unrelated error, so it is refused here.

Streaming (iterable) datasets are not checked: counting them would consume them.
"""

import warnings

from ..errors import EmptyTrainingSet

VISION_ERROR = (
    "Pruning supports text datasets only (the pruned forward slices rows and columns of token tensors, not images): "
    "turn pruning off (keep probabilities 1, prefix_prune_prob=0, prune_common_prefix=False) to train a "
    "vision-language model, which is then stock DPOTrainer."
)


def check_prunable(args, train_dataset, processing_class) -> None:
    """Reject what stock accepts but the pruned forward cannot do, before any work."""
    from transformers import ProcessorMixin

    parallel = args.parallelism_config
    if parallel is not None and parallel.non_data_parallel_size > 1:
        raise ValueError(
            f"Pruning with tensor/context/sequence parallelism (tp={parallel.tp_size}, cp={parallel.cp_size}, "
            f"sp={parallel.sp_size}) is not supported: the ranks that share a batch would draw different masks. Use "
            "data parallelism only (FSDP/ZeRO/DDP), or turn pruning off."
        )
    if isinstance(processing_class, ProcessorMixin) and train_dataset is not None:
        sample = next(iter(train_dataset))
        if "image" in sample or "images" in sample:
            raise ValueError(VISION_ERROR)

_BATCH = 1024  # rows read at a time


def _response(ids: list[int], eos_id: int | None) -> list[int]:
    return ids[:-1] if ids and eos_id is not None and ids[-1] == eos_id else ids


def check_training_pairs(trainer, given) -> None:
    """Warn about degenerate and truncated pairs of `trainer.train_dataset` (after TRL's tokenization and
    filtering), refuse a dataset that cannot train. `given`: the training dataset passed to the trainer."""
    prepared, args = trainer.train_dataset, trainer.args
    if not hasattr(prepared, "__len__") or not {"prompt_ids", "chosen_ids", "rejected_ids"} <= set(
            prepared.column_names or ()):
        return
    max_length, keep_start = args.max_length, args.truncation_mode == "keep_start"
    eos_id = getattr(getattr(trainer, "_tokenizer", None), "eos_token_id", None)
    n_before = len(given) if hasattr(given, "__len__") else None
    if len(prepared) == 0 and n_before:
        raise EmptyTrainingSet(
            f"Every one of the {n_before} training pairs was dropped because its prompt alone fills `max_length` "
            f"({max_length}) tokens: nothing is left to train on. Raise `max_length` (or shorten the prompts).")
    degenerate, first, empty, first_empty, truncated = 0, None, 0, None, 0
    for start in range(0, len(prepared), _BATCH):
        rows = prepared[start : start + _BATCH]
        for offset, (prompt, chosen, rejected) in enumerate(
                zip(rows["prompt_ids"], rows["chosen_ids"], rows["rejected_ids"])):
            if chosen == rejected:
                degenerate += 1
                first = start + offset if first is None else first
            elif not _response(chosen, eos_id) or not _response(rejected, eos_id):
                empty += 1
                first_empty = start + offset if first_empty is None else first_empty
            # keep_start cuts the end of prompt + response; keep_end cuts the start, the prompt first.
            longest = max(len(chosen), len(rejected)) + (len(prompt) if keep_start else 0)
            if max_length is not None and longest > max_length:
                truncated += 1
    total = len(prepared)
    if n_before and n_before > total:
        warnings.warn(
            f"{n_before - total} of {n_before} training pairs were dropped (their prompt alone fills `max_length`, "
            f"{max_length} tokens). Raise `max_length` to keep them.", UserWarning, stacklevel=3)
    if degenerate == total:
        raise ValueError(
            f"Every training pair is degenerate ({total} of {total}: `chosen` identical to `rejected`): DPO gets no "
            "gradient from such pairs. Check the dataset's columns and preprocessing.")
    if degenerate:
        warnings.warn(
            f"{degenerate} of {total} training pairs ({100 * degenerate / total:.1f}%) are degenerate (`chosen` "
            f"identical to `rejected`), e.g. prepared row {first}: they add no gradient. Remove them from the "
            "dataset.", UserWarning, stacklevel=3)
    if empty:
        warnings.warn(
            f"{empty} of {total} training pairs ({100 * empty / total:.1f}%) have an empty response (only the EOS), "
            f"e.g. prepared row {first_empty}. Check the dataset's preprocessing.", UserWarning, stacklevel=3)
    if truncated:
        kept = "start" if keep_start else "end"
        warnings.warn(
            f"{truncated} of {total} training pairs ({100 * truncated / total:.1f}%) are longer than `max_length` "
            f"({max_length} tokens, prompt + response) and lose response tokens (the {kept} is kept). Raise "
            "`max_length` if the end of a response matters.", UserWarning, stacklevel=3)
