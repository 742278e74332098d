"""Checks of the prepared (tokenized) training pairs that stock TRL leaves silent.

- Degenerate pairs: `chosen` identical to `rejected` (two empty responses included). Such a pair has
  D_w - D_l = 0 whatever the policy, so it contributes no gradient at all; a dataset of them trains to
  `grad_norm 0`, `positions scored 0%` and reward accuracy 0 without a word. Counted, with one example index, in one
  warning; a dataset where every pair is degenerate is refused. A pair with one empty response (nothing but the EOS
  TRL appends) still has a signal, the EOS: it is counted in a warning of its own, usually a preprocessing slip.
- Truncation: the collator cuts every prompt+response sequence to `max_length`; the share of pairs that lose
  response tokens is reported in one warning. TRL drops the pairs whose prompt alone fills `max_length`; if that is
  every pair, training would fail later with an unrelated error, so it is refused here (with a precomputed reference,
  TRL's precompute would fail first, on an empty concatenation: `refuse_emptied`, before it).
- Prompts cut differently: with `truncation_mode="keep_end"` the collator cuts each row from its start, so a pair
  whose two responses differ in length loses different prompt tokens in its two rows. `share_prompt` shares only the
  leading tokens the two rows really hold in common (method/packing.py `common_tokens`), so such a pair stays exact but
  runs its prompt twice: counted in one warning.

Run only when the pruned forward is used (with every pruning off the plugin is stock, which says nothing), once, on
the main process, vectorised over the Arrow columns (O(rows + tokens) in numpy, no Python loop over rows); the outcome
(a refusal, or nothing) is broadcast so that every process raises the same error. Streaming (iterable) datasets are not
checked: counting them would consume them.
"""

import warnings
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import EmptyTrainingSet

if TYPE_CHECKING:
    import pyarrow as pa
    from datasets import Dataset

    from ..config import PrunedDPOConfig

VISION_ERROR = (
    "Pruning supports text datasets only (the pruned forward slices rows and columns of token tensors, not images): "
    "turn pruning off (keep probabilities 1, prefix_prune_prob=0, prune_common_prefix=False) to train a "
    "vision-language model, which is then stock DPOTrainer."
)


def check_prunable(args: "PrunedDPOConfig", train_dataset: Any, processing_class: Any) -> None:
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


def _token_lists(table: "pa.Table", name: str) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, values) of a list-of-int column: row i is values[offsets[i]:offsets[i + 1]]."""
    column = table.column(name).combine_chunks()
    return column.offsets.to_numpy(), column.values.to_numpy(zero_copy_only=False)


def _identical(chosen: tuple[np.ndarray, np.ndarray], rejected: tuple[np.ndarray, np.ndarray], rows: np.ndarray,
               lengths: np.ndarray) -> np.ndarray:
    """For each of `rows` (whose chosen and rejected both have `lengths` tokens): are the two lists equal?"""
    total = int(lengths.sum())
    if total == 0:
        return np.ones(len(rows), dtype=bool)
    row_of = np.repeat(np.arange(len(rows)), lengths)
    within = np.arange(total) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    differ = chosen[1][chosen[0][rows][row_of] + within] != rejected[1][rejected[0][rows][row_of] + within]
    return np.bincount(row_of[differ], minlength=len(rows)) == 0


def _response_lengths(offsets: np.ndarray, values: np.ndarray, eos_id: int | None) -> np.ndarray:
    """Tokens of each response without the EOS TRL appends."""
    lengths = np.diff(offsets)
    if eos_id is None:
        return lengths
    ends_with_eos = (lengths > 0) & (values[np.maximum(offsets[1:] - 1, 0)] == eos_id) if len(values) else lengths > 0
    return lengths - ends_with_eos.astype(lengths.dtype)


def pair_findings(prepared: "Dataset", max_length: int | None, keep_start: bool, eos_id: int | None) -> dict:
    """Counts (and the first example row) of degenerate, one-sided empty and truncated pairs; numpy over Arrow."""
    table = prepared.with_format("arrow")[:]
    prompt, chosen, rejected = (_token_lists(table, c) for c in ("prompt_ids", "chosen_ids", "rejected_ids"))
    chosen_len, rejected_len = np.diff(chosen[0]), np.diff(rejected[0])
    degenerate = np.zeros(len(chosen_len), dtype=bool)
    same_length = np.flatnonzero(chosen_len == rejected_len)
    degenerate[same_length] = _identical(chosen, rejected, same_length, chosen_len[same_length])
    empty = ~degenerate & ((_response_lengths(*chosen, eos_id) == 0) | (_response_lengths(*rejected, eos_id) == 0))
    # keep_start cuts the end of prompt + response; keep_end cuts the start, the prompt first.
    longest = np.maximum(chosen_len, rejected_len) + (np.diff(prompt[0]) if keep_start else 0)
    truncated = longest > max_length if max_length is not None else np.zeros_like(degenerate)
    # keep_end: a row longer than max_length loses its first tokens; two rows of unequal length lose unequal numbers
    cut_start = (np.maximum(chosen_len, rejected_len) + np.diff(prompt[0]) > max_length) if (
        max_length is not None and not keep_start) else np.zeros_like(degenerate)
    misaligned = cut_start & (chosen_len != rejected_len)

    def first(flags: np.ndarray) -> int | None:
        hits = np.flatnonzero(flags)
        return int(hits[0]) if len(hits) else None

    return {"total": len(chosen_len), "degenerate": int(degenerate.sum()), "first": first(degenerate),
            "empty": int(empty.sum()), "first_empty": first(empty), "truncated": int(truncated.sum()),
            "misaligned": int(misaligned.sum())}


def dropped_everything(n_before: int | None, max_length: int | None) -> EmptyTrainingSet:
    """The refusal of a training set TRL's truncation filter emptied (`n_before`: how many pairs it had, if known)."""
    every = f"Every one of the {n_before} training pairs was" if n_before else "Every training pair was"
    return EmptyTrainingSet(f"{every} dropped because its prompt alone fills `max_length` ({max_length}) tokens: "
                            "nothing is left to train on. Raise `max_length` (or shorten the prompts).")


def refuse_emptied(dataset: Any, name: str, max_length: int | None) -> None:
    """Before the reference precompute: a training set TRL's truncation filter left empty is refused (TRL's
    constructor has read a first row of what it was given, so the filter emptied it)."""
    if name == "train" and len(dataset) == 0:
        raise dropped_everything(None, max_length)


def check_training_pairs(trainer: Any, given: Any) -> None:
    """Warn about degenerate and truncated pairs of `trainer.train_dataset` (after TRL's tokenization and
    filtering), refuse a dataset that cannot train. `given`: the training dataset passed to the trainer.

    Computed on the main process only; a refusal reaches every process (one broadcast when distributed)."""
    accelerator = trainer.accelerator
    findings, error = None, None
    if accelerator.is_main_process:
        try:
            findings = _findings(trainer.train_dataset, trainer.args, trainer.processing_class, given)
        except (ValueError, EmptyTrainingSet) as refused:
            error = refused
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        shared = [None if error is None else (type(error), str(error))]
        broadcast_object_list(shared, from_process=0)
        if shared[0] is not None:
            error = shared[0][0](shared[0][1])
    if error is not None:
        raise error
    if findings:
        _warn(findings)


def _findings(prepared: Any, args: "PrunedDPOConfig", tokenizer: Any, given: Any) -> dict | None:
    """What `_warn` says of the prepared training pairs (`prepared`: the trainer's `train_dataset`, `tokenizer`: its
    `processing_class`, `given`: the dataset passed to it), or None when there is nothing to check; refuses a dataset
    that cannot train."""
    if not hasattr(prepared, "__len__") or not {"prompt_ids", "chosen_ids", "rejected_ids"} <= set(
            prepared.column_names or ()):
        return None
    max_length = args.max_length
    # A processor's public tokenizer.
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
    eos_id = getattr(tokenizer, "eos_token_id", None)
    n_before = len(given) if hasattr(given, "__len__") else None
    if len(prepared) == 0 and n_before:
        raise dropped_everything(n_before, max_length)
    found = pair_findings(prepared, max_length, args.truncation_mode == "keep_start", eos_id)
    total = found["total"]
    if found["degenerate"] == total:
        raise ValueError(
            f"Every training pair is degenerate ({total} of {total}: `chosen` identical to `rejected`): DPO gets no "
            "gradient from such pairs. Check the dataset's columns and preprocessing.")
    return {**found, "n_before": n_before, "max_length": max_length, "kept": "start" if args.truncation_mode ==
            "keep_start" else "end", "share_prompt": bool(getattr(args, "share_prompt", False))}


def _warn(found: dict) -> None:
    total, n_before, max_length = found["total"], found["n_before"], found["max_length"]
    degenerate, empty, truncated = found["degenerate"], found["empty"], found["truncated"]
    if n_before and n_before > total:
        warnings.warn(
            f"{n_before - total} of {n_before} training pairs were dropped (their prompt alone fills `max_length`, "
            f"{max_length} tokens). Raise `max_length` to keep them.", UserWarning, stacklevel=4)
    if degenerate:
        warnings.warn(
            f"{degenerate} of {total} training pairs ({100 * degenerate / total:.1f}%) are degenerate (`chosen` "
            f"identical to `rejected`), e.g. prepared row {found['first']}: they add no gradient. Remove them from the "
            "dataset.", UserWarning, stacklevel=4)
    if empty:
        warnings.warn(
            f"{empty} of {total} training pairs ({100 * empty / total:.1f}%) have an empty response (only the EOS), "
            f"e.g. prepared row {found['first_empty']}. Check the dataset's preprocessing.", UserWarning, stacklevel=4)
    if truncated:
        warnings.warn(
            f"{truncated} of {total} training pairs ({100 * truncated / total:.1f}%) are longer than `max_length` "
            f"({max_length} tokens, prompt + response) and lose response tokens (the {found['kept']} is kept). Raise "
            "`max_length` if the end of a response matters.", UserWarning, stacklevel=4)
    misaligned = found.get("misaligned", 0)
    if misaligned and found.get("share_prompt"):
        warnings.warn(
            f"{misaligned} of {total} training pairs are cut from the start (`truncation_mode='keep_end'`) by "
            "different amounts in their two rows, which then hold different prompt tokens: their prompts run "
            "unshared (still exact, but executed twice). Raise `max_length` or use `truncation_mode='keep_start'` to "
            "share them.", UserWarning, stacklevel=4)
