"""The batch as the pruned forward needs it: a host copy of the token layout, and per-token reference log-probs.

- `HostCopyCollator` attaches a CPU copy of the token layout (packing.HostBatch), so the plan never reads device tensors:
  also for an `IterableDataset`, unless its batches are dispatched from process 0 (`batches_dispatched`), which carries
  device tensors only; then `host_batch` copies the layout once per micro-step, said once.
- With `precompute_ref_log_probs=True` the masks need per-token reference log-probs, where TRL stores only their sums:
  `precompute_per_token` stores both, and `PerTokenReferenceCollator` pads the stored values onto each batch's
  response positions.
"""

import warnings
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import torch
from datasets import Dataset, IterableDataset, concatenate_datasets
from datasets.table import InMemoryTable
from torch.utils.data import DataLoader

from .method.packing import HostBatch

# Dataset columns and batch key of the stored per-token reference log-probs (response positions, in order).
REF_TOKEN_COLUMNS = ("ref_chosen_token_logps", "ref_rejected_token_logps")
REF_TOKEN_KEY = "ref_token_logps"
# Batch key of the host copy of the token layout, attached by `HostCopyCollator`.
HOST_KEY = "host_batch"
# Batch keys that are not model inputs.
NON_MODEL_KEYS = frozenset({"completion_mask", "ref_chosen_logps", "ref_rejected_logps", REF_TOKEN_KEY, HOST_KEY})


@dataclass
class HostCopyCollator:
    """Wraps the collator: attaches a host copy of the token layout, so the plan never reads device tensors."""

    collator: Any

    def __call__(self, examples: list[dict]) -> dict:
        batch = self.collator(examples)
        batch[HOST_KEY] = HostBatch(batch["input_ids"], batch["attention_mask"], batch["completion_mask"])
        return batch


def host_batch(inputs: dict) -> HostBatch:
    """The batch's token layout on the host: the collator's copy, else one copy now (dispatched batches, precompute,
    custom loops), the three tensors in one device->host transfer. Called once per micro-step (the plan holds it)."""
    host = inputs.get(HOST_KEY)
    if host is None:
        layout = [inputs[k] for k in ("input_ids", "attention_mask", "completion_mask")]
        copied = torch.stack([t.long() for t in layout]).cpu()
        host = HostBatch(*(part.to(t.dtype) for part, t in zip(copied, layout)))
    return host


@dataclass
class PerTokenReferenceCollator:
    """Wraps the collator: pads the stored per-token reference log-probs onto the batch's response positions."""

    collator: Any

    def __call__(self, examples: list[dict]) -> dict:
        if REF_TOKEN_COLUMNS[0] not in examples[0]:
            return self.collator(examples)
        stripped = [{k: v for k, v in ex.items() if k not in REF_TOKEN_COLUMNS} for ex in examples]
        batch = self.collator(stripped)
        values = [ex[REF_TOKEN_COLUMNS[0]] for ex in examples] + [ex[REF_TOKEN_COLUMNS[1]] for ex in examples]
        response = batch["completion_mask"][:, 1:].bool()
        ref = torch.zeros(response.shape, dtype=torch.float32)
        for row, row_values in enumerate(values):
            if len(row_values) != int(response[row].sum()):
                raise ValueError(
                    "The stored per-token reference log-probs do not match the collated response length; the dataset "
                    "was precomputed with a different `max_length`/collator. Recompute (a new trainer does)."
                )
            ref[row, response[row]] = torch.tensor(row_values, dtype=torch.float32)
        batch[REF_TOKEN_KEY] = ref
        return batch


def batches_dispatched(args: Any, train_dataset: Any) -> bool:
    """Whether accelerate dispatches the training batches from process 0: an iterable dataset across processes, unless
    `accelerator_config.dispatch_batches=False` (accelerate's `prepare_data_loader`: None means dispatch an
    `IterableDataset`). Process 0 collates every process's rows and broadcasts them as device tensors, so a host copy
    cannot travel with them. In one process the dispatcher passes the collated batch through unchanged."""
    iterable = isinstance(train_dataset, (IterableDataset, torch.utils.data.IterableDataset))
    return iterable and args.world_size > 1 and args.accelerator_config.dispatch_batches is not False


def pruned_collator(collator: Any, args: Any, train_dataset: Any) -> Any:
    """TRL's collator, wrapped for the pruned forward: stored per-token reference values (with a precomputed
    reference), and the host copy of the token layout, but where batches are dispatched from process 0
    (`batches_dispatched`): there each micro-step copies it from the device, said here once."""
    if args.precompute_ref_log_probs:
        collator = PerTokenReferenceCollator(collator)
    if batches_dispatched(args, train_dataset):
        warnings.warn(
            "The IterableDataset's batches are dispatched from process 0 as device tensors (accelerate's default "
            "across processes), so each micro-step copies its token layout to the host to plan it (one device read). "
            "Set accelerator_config={'dispatch_batches': False} to collate on each process (each then reads its "
            "own shard or slice of the data) and read nothing.",
            stacklevel=3)
        return collator
    return HostCopyCollator(collator)


def precompute_per_token(accelerator: Any, args: Any, collator: Any, model: torch.nn.Module, dataset: Dataset,
                         batch_size: int, reference_log_probs: Any, reference_sums: Any) -> Dataset:
    """`dataset` with the reference sums and the per-token reference log-probs as columns.

    Like TRL's precompute: under `accelerator.autocast()`, each process computes its shard of the batches of `model`
    (the reference, as TRL picks it), gathered in dataset order. The per-token values travel as one flat float32
    buffer with row offsets (an Arrow list column), never as a Python list per row. Kept in memory: no cache file (TRL
    caches only the sums). `reference_log_probs(model, batch, scored)` and `reference_sums(per_token, batch)`: the
    reference forward in the trainer's layout.
    """
    loader = accelerator.prepare(DataLoader(
        dataset, batch_size=batch_size, collate_fn=collator, shuffle=False,
        num_workers=args.dataloader_num_workers,
        # Else a no-op that warns.
        pin_memory=args.dataloader_pin_memory and torch.accelerator.is_available(),
    ))
    sums, values, lengths = ({"chosen": [], "rejected": []} for _ in range(3))
    for batch in loader:
        response = batch["completion_mask"][:, 1:].bool()
        # As TRL's compute_ref_log_probs: bf16 stores what stock stores.
        with accelerator.autocast():
            per_token = reference_log_probs(model, batch, response)
        chosen_sum, rejected_sum = reference_sums(per_token, batch)
        # pad every process's batch to the same width, then gather (dataset order; duplicates of the last batch
        # dropped, like TRL's gather_for_metrics of the sums)
        per_token = accelerator.pad_across_processes(per_token.float(), dim=1)
        response = accelerator.pad_across_processes(response.int(), dim=1)
        gathered = accelerator.gather_for_metrics((chosen_sum, rejected_sum, *per_token.chunk(2), *response.chunk(2)))
        for i, branch in enumerate(("chosen", "rejected")):
            branch_values, branch_response = gathered[2 + i].cpu(), gathered[4 + i].cpu().bool()
            sums[branch].append(gathered[i].float().cpu())
            # Row-major: row by row, in order.
            values[branch].append(branch_values[branch_response])
            lengths[branch].append(branch_response.sum(dim=1))
    columns = {}
    for branch in ("chosen", "rejected"):
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.cat(lengths[branch]).cumsum(0)])
        columns[f"ref_{branch}_logps"] = pa.array(torch.cat(sums[branch]).numpy())
        columns[f"ref_{branch}_token_logps"] = pa.ListArray.from_arrays(
            pa.array(offsets.numpy().astype("int32")), pa.array(torch.cat(values[branch]).numpy())
        )
    stale = [c for c in columns if c in dataset.column_names]
    if stale:
        dataset = dataset.remove_columns(stale)
    return concatenate_datasets([dataset, Dataset(InMemoryTable(pa.table(columns)))], axis=1)
