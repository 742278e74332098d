"""`PrunedDPOTrainer`: TRL's `DPOTrainer` with a pruned forward of the [chosen; rejected] batch.

How it departs from stock TRL 1.16 (whose `_compute_loss` does one policy forward of the stacked batch, one reference
forward, then the loss and metrics):

- `concatenated_forward` draws the masks (masks.py), then runs the backpropagated rows with grad and the others
  under `torch.no_grad()`, each group trimmed to the longest row it still needs, scoring only kept positions through
  TRL's own fused LM head (compacted on every device). It returns inverse-probability-weighted per-token terms
  (estimators.py) for the policy and the reference.
- `compute_loss` hands those terms to TRL's own `_compute_loss` through a replay "model", so every TRL loss,
  `ld_alpha`, `use_weighting` and every TRL metric run unchanged on unbiased estimates of what they consume.
- Evaluation is never pruned: it is TRL's own path. So is training whenever `uses_pruned_forward(args)` is false
  (pruning off): a drop-in by construction (docs/parity.md).
- With `precompute_ref_log_probs=True` the per-token reference log-probs are stored (not just their sums) so the
  same masks apply to them.
"""

import contextlib
import dataclasses
import os
import shutil
import warnings
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pyarrow as pa
import torch
from accelerate.utils import is_peft_model
from datasets import Dataset, IterableDataset, concatenate_datasets
from datasets.table import InMemoryTable
from torch.utils.data import DataLoader
from transformers import ProcessorMixin

from . import checkpoints
from ._trl import (
    DPOConfig,
    DPOTrainer,
    check_compact_lm_head,
    compact_lm_head,
    disable_gradient_checkpointing,
    get_config_model_id,
    use_adapter,
)
from .auto import AutoKeepProbs
from .config import AUTO, PrunedDPOConfig
from .data_checks import check_training_pairs
from .estimators import horvitz_thompson, scale_branch_gradient
from .execute import row_multiple, run_group, unsupported_reason
from .guards import DivergenceGuard, TrainingDiverged, check_not_empty, warn_before_training
from .masks import PruneMasks, draw_masks, executed_columns, mask_generator
from .plan import HostBatch, common_tokens, plan_policy, plan_reference, unshared_rows, work_counts

# Dataset columns and batch key of the stored per-token reference log-probs (response positions, in order).
REF_TOKEN_COLUMNS = ("ref_chosen_token_logps", "ref_rejected_token_logps")
REF_TOKEN_KEY = "ref_token_logps"
# Batch key of the host copy of the token layout (plan.HostBatch), attached by the collator.
HOST_KEY = "host_batch"
_NON_MODEL_KEYS = {"completion_mask", "ref_chosen_logps", "ref_rejected_logps", REF_TOKEN_KEY, HOST_KEY}
# Batch keys the shared-prompt forward knows how to pack; any other per-token input makes it run unshared.
_SHAREABLE_KEYS = {"input_ids", "attention_mask"} | _NON_MODEL_KEYS


def _masks_to(masks: PruneMasks, device) -> PruneMasks:
    """The masks on `device` (a copy; a no-op for tensors already there)."""
    return PruneMasks(**{f.name: getattr(masks, f.name).to(device, non_blocking=True)
                         for f in dataclasses.fields(masks)})


@dataclass
class _HostCopyCollator:
    """Wraps the collator: attaches a host copy of the token layout, so the plan never reads device tensors."""

    collator: Any

    def __call__(self, examples):
        batch = self.collator(examples)
        batch[HOST_KEY] = HostBatch(batch["input_ids"], batch["attention_mask"], batch["completion_mask"])
        return batch


class _Replay:
    """Stands in for the model in TRL's `_compute_loss`: returns per-token outputs computed beforehand."""

    def __init__(self, aux_loss=None, **per_token):
        self.outputs = SimpleNamespace(aux_loss=aux_loss, **per_token)

    def __call__(self, *args, **kwargs):
        return self.outputs


@dataclass
class _PerTokenReferenceCollator:
    """Wraps the collator: pads the stored per-token reference log-probs onto the batch's response positions."""

    collator: Any

    def __call__(self, examples):
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


_VISION_ERROR = (
    "Pruning supports text datasets only (the pruned forward slices rows and columns of token tensors, not images): "
    "turn pruning off (keep probabilities 1, prefix_prune_prob=0, prune_common_prefix=False) to train a "
    "vision-language model, which is then stock DPOTrainer."
)


def uses_pruned_forward(args) -> bool:
    """THE switch between the plugin's forward and TRL's own: with it False, training, the reference precompute, the
    collator and the signature columns are stock's (exact parity by construction, docs/parity.md).

    True when any estimator is on (`pruning_enabled`, which includes `prune_common_prefix`) or when an exact plugin
    feature needs the plugin's forward (`share_prompt`, issue 9; read with getattr until that field exists).
    """
    if not isinstance(args, PrunedDPOConfig):
        return False
    return args.pruning_enabled or bool(getattr(args, "share_prompt", False))


def _as_pruned_config(model, args):
    """The trainer's config: stock's default when `args` is None, a plain `DPOConfig` promoted with pruning off.

    A promoted config is the same settings object (its `__dict__` is shared, nothing re-validated or re-derived),
    carrying the pruning fields at their identity defaults, so swapping the class changes nothing a user passed.
    """
    if args is None:  # stock: DPOConfig(f"{model_name}-DPO")
        model_name = model if isinstance(model, str) else get_config_model_id(model.config)
        return PrunedDPOConfig(f"{model_name.split('/')[-1]}-DPO")
    if isinstance(args, PrunedDPOConfig) or not isinstance(args, DPOConfig):
        return args  # anything else is TRL's to accept or reject
    promoted = PrunedDPOConfig.__new__(PrunedDPOConfig)
    promoted.__dict__ = args.__dict__
    for f in dataclasses.fields(PrunedDPOConfig):
        if f.name not in promoted.__dict__:
            setattr(promoted, f.name, f.default)
    promoted.prune_seed = args.seed
    return promoted


def _check_prunable(args: PrunedDPOConfig, train_dataset, processing_class):
    """Reject what stock accepts but the pruned forward cannot do, before any work."""
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
            raise ValueError(_VISION_ERROR)


class PrunedDPOTrainer(DPOTrainer):
    """DPO with stochastic pruning of the computation graph. Same constructor as `trl.DPOTrainer`.

    `args` must be a [`PrunedDPOConfig`]; its pruning fields choose what is pruned. After each training micro-step,
    `last_prune_stats` holds the raw counts of the work done (tokens executed, positions scored, rows backpropagated).
    """

    _tag_names = ["trl", "dpo", "trl-pruned-dpo"]

    def __init__(self, model, ref_model=None, args: PrunedDPOConfig | None = None, *pargs, **kwargs):
        args = _as_pruned_config(model, args)
        train_dataset = kwargs.get("train_dataset", pargs[1] if len(pargs) > 1 else None)
        if uses_pruned_forward(args):
            # The plugin's own refusals: only what stock accepts and the pruned forward cannot do, checked before any
            # work (TRL precomputes reference log-probs inside its constructor). Everything else is TRL's to reject.
            _check_prunable(args, train_dataset, kwargs.get("processing_class", pargs[3] if len(pargs) > 3 else None))
            check_compact_lm_head()
        self.last_prune_stats: dict[str, int] = {}
        self._mask_step = (-1, 0)  # (global step, micro-step) of the last draw
        self._grad_rows_aux_loss = None
        self._forced_mask_options = None  # auto.py's measurements draw with their own options
        self._auto_probs = None  # "auto" keep probabilities (auto.py)
        self._share_backend = None  # resolved below, once the model is prepared (precompute runs unshared)
        super().__init__(model, ref_model, args, *pargs, **kwargs)
        check_training_pairs(self, train_dataset)  # degenerate and truncated pairs: warn, or refuse (data_checks.py)
        if uses_pruned_forward(args):
            if self._is_vision_dataset:  # a processor not passed in (loaded by TRL): known only now
                raise ValueError(_VISION_ERROR)
            if args.precompute_ref_log_probs:
                self.data_collator = _PerTokenReferenceCollator(self.data_collator)
            if not isinstance(self.train_dataset, (IterableDataset, torch.utils.data.IterableDataset)):
                # (batches of an iterable dataset may be dispatched across processes, which carries tensors only)
                self.data_collator = _HostCopyCollator(self.data_collator)
            self._share_backend = self._shared_prompt_backend()
        if args.auto_keep_probs:
            self._auto_probs = AutoKeepProbs(args, self.accelerator.unwrap_model(self.model).config)

    @property
    def _uses_pruned_forward(self) -> bool:
        return uses_pruned_forward(self.args)

    # ----------------------------------------------------------------------------------------------------------- data
    def _set_signature_columns_if_needed(self):
        super()._set_signature_columns_if_needed()
        if self._uses_pruned_forward:  # keep the per-token reference columns (once, however often it is called)
            missing = [c for c in REF_TOKEN_COLUMNS if c not in self._signature_columns]
            self._signature_columns = list(self._signature_columns) + missing

    def _precompute_ref_logps(self, dataset: Dataset, name: str, batch_size: int) -> Dataset:
        """With pruning on, also stores the per-token reference log-probs beside their sums (the masks need them).

        With pruning off, and for what TRL rejects (an IterableDataset), it is TRL's own. Like TRL's: under
        `accelerator.autocast()`, each process computes its shard of the batches, gathered in dataset order. The
        per-token values travel as one flat float32 buffer with row offsets (an Arrow list column), never as a Python
        list per row. Kept in memory: no cache file (TRL caches only the sums).
        """
        if not self._uses_pruned_forward or isinstance(dataset, IterableDataset):
            return super()._precompute_ref_logps(dataset, name, batch_size)
        if self.ref_model is None and self.is_deepspeed_enabled:
            if self._precompute_engine is None:
                from trl.models import prepare_deepspeed

                self._precompute_engine = prepare_deepspeed(self.model, self.accelerator)
            model = self._precompute_engine
        else:
            model = self.ref_model or self.model
        loader = self.accelerator.prepare(DataLoader(
            dataset, batch_size=batch_size, collate_fn=self.data_collator, shuffle=False,
            num_workers=self.args.dataloader_num_workers, pin_memory=self.args.dataloader_pin_memory,
        ))
        sums, values, lengths = ({"chosen": [], "rejected": []} for _ in range(3))
        for batch in loader:
            response = batch["completion_mask"][:, 1:].bool()
            with self.accelerator.autocast():  # as TRL's compute_ref_log_probs: bf16 stores what stock stores
                per_token = self._reference_log_probs(model, batch, response)
            chosen_sum, rejected_sum = self._reference_sums(batch, per_token)
            # pad every process's batch to the same width, then gather (dataset order; duplicates of the last batch
            # dropped, like TRL's gather_for_metrics of the sums)
            per_token = self.accelerator.pad_across_processes(per_token.float(), dim=1)
            response = self.accelerator.pad_across_processes(response.int(), dim=1)
            gathered = self.accelerator.gather_for_metrics(
                (chosen_sum, rejected_sum, *per_token.chunk(2), *response.chunk(2))
            )
            for i, branch in enumerate(("chosen", "rejected")):
                branch_values, branch_response = gathered[2 + i].cpu(), gathered[4 + i].cpu().bool()
                sums[branch].append(gathered[i].float().cpu())
                values[branch].append(branch_values[branch_response])  # row-major: row by row, in order
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

    # -------------------------------------------------------------------------------------------------------- forward
    def _next_mask_generator(self) -> torch.Generator:
        """The generator of this micro-step's masks: keyed by (prune_seed, global step, micro-step, rank)."""
        step = self.state.global_step
        micro = self._mask_step[1] + 1 if self._mask_step[0] == step else 0
        self._mask_step = (step, micro)
        return mask_generator(self.args.prune_seed, step, micro, self.accelerator.process_index)

    def _mask_options(self, inputs=None) -> dict:
        """The sampling probabilities of this micro-batch's draw, as `masks.draw_masks` takes them: the config's, with
        any "auto" one chosen by `auto.AutoKeepProbs` (per-pair for branches) before the draw it weights."""
        args = self.args
        options = dict(
            position_keep_prob=args.position_keep_prob,
            prefix_prune_prob=args.prefix_prune_prob,
            prefix_min_ratio=args.prefix_min_ratio,
            branch_keep_prob=args.branch_keep_prob,
            branch_sampling=args.branch_sampling,
            drop_common_prefix=args.prune_common_prefix,
        )
        if self._auto_probs is not None and inputs is not None:
            step, micro = self._mask_step
            measure_generator = mask_generator(self.args.prune_seed, step, -1 - micro, self.accelerator.process_index)
            options = self._auto_probs.options(self, self.accelerator.unwrap_model(self.model), inputs, options, step,
                                               micro, measure_generator)
        return options

    def _prunes_branches(self) -> bool:
        """Whether branch pruning can drop rows (a structural choice, the same on every process)."""
        return self.args.branch_keep_prob == AUTO or self.args.branch_keep_prob < 1

    def _draw_masks(self, inputs) -> PruneMasks:
        """This micro-step's masks, drawn on the host from the batch's token layout (no device sync)."""
        host = self._host_batch(inputs)
        forced = self._forced_mask_options
        if forced is not None:  # auto.py's measurements: their own options and generator, no step bookkeeping
            return draw_masks(host.input_ids, host.completion_mask, **forced)
        generator = self._next_mask_generator()
        return draw_masks(host.input_ids, host.completion_mask, **self._mask_options(inputs), generator=generator)

    def _host_batch(self, inputs) -> HostBatch:
        """The batch's token layout on the host: the collator's copy, else one copy now (precompute, custom loops)."""
        host = inputs.get(HOST_KEY)
        if host is None:
            host = HostBatch(*(inputs[k].cpu() for k in ("input_ids", "attention_mask", "completion_mask")))
        return host

    def _shared_prompt_backend(self) -> str | None:
        """The attention backend of the shared-prompt forward, or None (off, or the model cannot: one warning)."""
        if not self.args.share_prompt:
            return None
        reasons = []
        if self.aux_loss_enabled:  # TRL's fused head computes it with the attention mask, which must then be 2D
            reasons.append("the MoE router auxiliary loss needs the unpacked (2D) attention mask")
        for model in (self.model, self.ref_model):
            if model is None:
                continue
            model = self.accelerator.unwrap_model(model)
            model = model.get_base_model() if is_peft_model(model) else model
            reason = unsupported_reason(model)
            if reason:
                reasons.append(reason)
        if reasons:
            warnings.warn(
                f"share_prompt=True is ignored: {reasons[0]}. Training runs the unshared forward (exact, slower).",
                stacklevel=3,
            )
            return None
        return self.accelerator.unwrap_model(self.model).config._attn_implementation

    def _forward_rows(self, model, inputs, rows: torch.Tensor, scored: torch.Tensor, width: int, **model_kwargs):
        """Run `rows` of the batch, trimmed to `width` columns, scoring the `scored` positions only.

        `rows` and `scored` live on the host (the plan, `plan.unshared_rows`). Returns the fused-head outputs
        (per-token tensors of shape (len(rows), width - 1)). An empty `rows` still runs one row of two tokens, scoring
        nothing: every process must run the same modules in the same order (ZeRO-3/FSDP), and a grad group must stay
        connected to the graph.
        """
        if rows.numel() == 0:
            rows = rows.new_zeros(1)
            scored = torch.zeros_like(scored)
        device = inputs["input_ids"].device
        index = rows.to(device, non_blocking=True)
        input_ids = inputs["input_ids"][index, :width]
        labels = torch.full_like(input_ids, -100)
        keep = scored[rows, : width - 1].to(device, non_blocking=True)
        labels[:, 1:] = torch.where(keep, input_ids[:, 1:], -100)
        total_rows, total_cols = inputs["input_ids"].shape
        kwargs = {}
        for key, value in inputs.items():
            if key in _NON_MODEL_KEYS or key == "input_ids":
                continue
            if torch.is_tensor(value) and value.dim() >= 2 and value.shape[:2] == (total_rows, total_cols):
                value = value[index, :width]
            elif torch.is_tensor(value) and value.dim() >= 1 and value.size(0) == total_rows:
                value = value[index]
            kwargs[key] = value
        kwargs.update(model_kwargs)
        with compact_lm_head():
            outputs = model(input_ids=input_ids, labels=labels, use_cache=False, fused_lm_head=True, **kwargs)
        return outputs

    def _no_grad_block(self) -> contextlib.ExitStack:
        """No grad and no gradient checkpointing (nothing to recompute); nested blocks do not toggle it again."""
        stack = contextlib.ExitStack()
        stack.enter_context(torch.no_grad())
        stack.enter_context(disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs))
        return stack

    def _reference_context(self) -> contextlib.ExitStack:
        """A no-grad block, with the policy's adapter disabled when the reference is the PEFT policy without it."""
        stack = self._no_grad_block()
        if self.ref_model is None and is_peft_model(self.model):
            # Reference = the policy with its adapter disabled (or TRL's frozen "ref" adapter copy)
            unwrapped = self.accelerator.unwrap_model(self.model)
            stack.enter_context(use_adapter(unwrapped, adapter_name="ref" if "ref" in unwrapped.peft_config else None))
        return stack

    def _reference_log_probs(self, model, inputs, scored: torch.Tensor, executed: torch.Tensor | None = None):
        """Per-token reference log-probs (rows, cols) on the `scored` positions, 0 elsewhere; never backpropagated."""
        scored = scored.cpu()  # the plan is made on the host (a no-op in training, where the masks live there)
        device = inputs["input_ids"].device
        if self._share_backend is not None and self._can_share(inputs):
            host = self._host_batch(inputs)
            group = plan_reference(host, scored, common_tokens(host), row_multiple(self._share_backend))
            with self._reference_context():
                outputs, _ = run_group(model, group, ("log_probs",), self._share_backend, device)
            self._count("reference_tokens_executed", group.input_ids.numel())
            self._count("reference_positions_scored", group.scored)
            return outputs["log_probs"].float()
        executed = executed_columns(scored) if executed is None else executed.cpu()
        rows, width, positions = unshared_rows(scored, executed, torch.ones_like(executed, dtype=torch.bool))
        per_token = torch.zeros(scored.shape, dtype=torch.float32, device=device)
        with self._reference_context():
            outputs = self._forward_rows(model, inputs, rows, scored, width)
        if rows.numel():
            per_token[rows.to(device), : width - 1] = outputs.log_probs[:, -(width - 1) :].float()
        self._count("reference_tokens_executed", max(rows.numel(), 1) * width)
        self._count("reference_positions_scored", positions)
        return per_token

    def _reference_sums(self, inputs, per_token: torch.Tensor):
        """Per-branch reference sums from per-token values, through TRL's own `compute_ref_log_probs` (ld_alpha)."""
        return DPOTrainer.compute_ref_log_probs(self, _Replay(log_probs=per_token), inputs)

    def _can_share(self, inputs) -> bool:
        """The packed forward feeds the model token ids only: a batch with other per-token inputs runs unshared."""
        return not (set(inputs) - _SHAREABLE_KEYS)

    def _policy_shared(self, model, inputs, masks: PruneMasks, fields, device):
        """The shared-prompt policy forwards (plan.py, execute.py): per-token outputs on the grid, and the frozen pass.

        Returns (per_token, run_frozen): run_frozen() runs the no-grad group (inside the micro-step's single no-grad
        block) and returns its per-token outputs on the grid (zero outside its rows), or None.
        """
        host = self._host_batch(inputs)
        common = common_tokens(host)
        grad_cost = 4.0 if self.args.gradient_checkpointing else 3.0  # forward + backward (+ recompute), Eq. in method
        plan = plan_policy(host, masks, frozen_group=self._prunes_branches(), grad_cost=grad_cost,
                           common=common, multiple=row_multiple(self._share_backend))
        # (no MoE router aux loss here: `_shared_prompt_backend` keeps such models on the unshared forward)
        per_token, _ = run_group(model, plan.grad, fields, self._share_backend, device)
        executed = plan.grad.input_ids.numel()
        self._count("policy_tokens_executed", executed)
        self._count("grad_tokens_executed", executed)
        self._count("shared_pairs", plan.shared_pairs)
        self._count("split_pairs", plan.split_pairs)

        def run_frozen():
            if plan.frozen is None:
                return None
            self._count("policy_tokens_executed", plan.frozen.input_ids.numel())
            return run_group(model, plan.frozen, fields, self._share_backend, device)[0]

        return per_token, run_frozen

    def _policy_unshared(self, model, inputs, masks: PruneMasks, fields, shape, device):
        """The unshared policy forwards: backpropagated rows with grad; returns (per_token, run_frozen) like above."""

        def run(with_grad):
            rows, width, _ = unshared_rows(masks.scored, masks.executed, masks.backprop == with_grad)
            per_token = {f: torch.zeros(shape, dtype=torch.bool if f == "is_top1" else torch.float32, device=device)
                         for f in fields}
            # MoE: the router aux loss is the grad rows' own, over their executed columns (docs/parity.md)
            router = {"output_router_logits": True} if with_grad and self.aux_loss_enabled else {}
            outputs = self._forward_rows(model, inputs, rows, masks.scored, width, **router)
            if router:
                self._grad_rows_aux_loss = outputs.aux_loss * (1.0 if rows.numel() else 0.0)
            tokens = max(rows.numel(), 1) * width
            self._count("policy_tokens_executed", tokens)
            if with_grad:
                self._count("grad_tokens_executed", tokens)
            if rows.numel() == 0:
                if with_grad:  # keep the grad group connected to the graph
                    per_token["log_probs"] = per_token["log_probs"] + outputs.log_probs.sum() * 0.0
                return per_token
            index = rows.to(device, non_blocking=True)
            for f in fields:
                value = getattr(outputs, f)[:, -(width - 1) :]
                if f == "log_probs":
                    # out-of-place so autograd keeps the grad rows' history
                    per_token[f] = per_token[f].index_put((index,), torch.nn.functional.pad(
                        value.float(), (0, shape[1] - (width - 1))))
                else:
                    per_token[f][index, : width - 1] = value.to(per_token[f].dtype)
            return per_token

        def run_frozen():
            # a structural choice, the same on every process
            return run(False) if self._prunes_branches() else None

        return run(True), run_frozen

    def concatenated_forward(self, model, inputs) -> tuple[dict[str, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """The pruned forward of the [chosen; rejected] batch.

        Returns the policy's per-token outputs (log-probs and TRL's metric fields) as inverse-probability-weighted
        terms whose row sums are unbiased for the full sums, with the straight-through branch scaling applied to the
        log-probs (Eq. 3), and the reference's per-branch sums (chosen, rejected) under the same masks.

        Plan on the host (masks, layout), then execute: the backpropagated forward first, then every no-grad forward
        (frozen branches, reference) in one block, so gradient checkpointing is toggled at most once per micro-step.
        """
        masks = _masks_to(self._draw_masks(inputs), "cpu")  # the host copy the plan reads
        self.last_prune_stats = {}
        response = inputs["completion_mask"][:, 1:].bool()
        shape, device = response.shape, response.device
        fields = ("log_probs", "entropy", "mean_logits", "is_top1") + (
            ("log_sum_sq_probs",) if self.use_weighting else ()
        )
        if self._share_backend is not None and self._can_share(inputs):
            per_token, run_frozen = self._policy_shared(model, inputs, masks, fields, device)
        else:
            per_token, run_frozen = self._policy_unshared(model, inputs, masks, fields, shape, device)
        with self._no_grad_block():
            frozen = run_frozen()
            reference = self._pruned_reference(model, inputs, masks, response)
        if frozen is not None:  # the groups fill disjoint cells (zero elsewhere); combined outside no_grad
            for f in fields:
                per_token[f] = per_token[f] | frozen[f] if f == "is_top1" else per_token[f] + frozen[f]

        on_device = _masks_to(masks, device)
        for f in fields:
            if f != "is_top1":
                per_token[f] = horvitz_thompson(per_token[f].float(), on_device.weights)
        per_token["is_top1"] = per_token["is_top1"].bool() & on_device.scored
        if self._prunes_branches():
            per_token["log_probs"] = scale_branch_gradient(per_token["log_probs"], on_device.branch_scale)

        for name, value in work_counts(self._host_batch(inputs), masks).items():
            self._count(name, value)
        self._last_masks = on_device
        return per_token, reference

    def _pruned_reference(self, model, inputs, masks: PruneMasks, response: torch.Tensor):
        """Reference sums under the policy's masks (`prune_reference`), or exact sums over every kept position.

        `masks` are the host copy (the plan reads them); the weights go to the device for the estimate.
        """
        prune = self.args.prune_reference
        device = response.device
        weights = masks.weights.to(device, non_blocking=True)
        exact = masks.exact.to(device, non_blocking=True)
        if self.precompute_ref_logps:
            if not prune and not self.args.prune_common_prefix:
                return inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]
            stored = inputs[REF_TOKEN_KEY].to(device)
            return self._reference_sums(inputs, horvitz_thompson(stored, weights if prune else exact.float()))
        reference_model = self.ref_model if self.ref_model is not None else self.model
        if prune:
            per_token = self._reference_log_probs(reference_model, inputs, masks.scored, masks.executed)
            return self._reference_sums(inputs, horvitz_thompson(per_token, weights))
        per_token = self._reference_log_probs(reference_model, inputs, masks.exact)
        return self._reference_sums(inputs, per_token * exact)

    # ----------------------------------------------------------------------------------------------------------- loss
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not self.model.training or not self._uses_pruned_forward:  # evaluation, and pruning off: TRL's own path
            inputs = {k: v for k, v in inputs.items() if k not in (REF_TOKEN_KEY, HOST_KEY)}
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        return self._pruned_loss(model, inputs, return_outputs)

    def _pruned_loss(self, model, inputs, return_outputs=False):
        """The pruned training loss: TRL's `_compute_loss` on the estimates, through the replay seam (`_Replay`)."""
        if return_outputs:
            raise ValueError("PrunedDPOTrainer does not return model outputs during training (TRL deprecated them).")
        per_token, (ref_chosen, ref_rejected) = self.concatenated_forward(model, inputs)
        batch = {k: v for k, v in inputs.items() if k != REF_TOKEN_KEY}
        batch["ref_chosen_logps"], batch["ref_rejected_logps"] = ref_chosen, ref_rejected
        precompute = self.precompute_ref_logps
        self.precompute_ref_logps = True  # TRL then reads the reference sums from the batch
        try:
            replay = _Replay(aux_loss=self._grad_rows_aux_loss, **per_token)
            loss = self._compute_loss(replay, batch, return_outputs=False)
        finally:
            self.precompute_ref_logps = precompute
        common_prefix_totals = self._log_pruned_metrics(per_token, inputs)
        self._relabel_stock_metrics(common_prefix_totals)
        return loss

    def _count(self, name: str, value: int):
        self.last_prune_stats[name] = self.last_prune_stats.get(name, 0) + int(value)

    def _log_pruned_metrics(self, per_token, inputs):
        """The `prune/` fractions, and TRL's token accuracy re-estimated from the scored positions only.

        One gather (the step's one sync). With `prune_common_prefix`, returns the summed (chosen top-1 estimate,
        entropy, exact positions, chosen logits, chosen exact positions, rejected logits, rejected exact positions)
        for `_relabel_stock_metrics`; else None."""
        masks, stats = self._last_masks, self.last_prune_stats
        chosen_weights = masks.weights.chunk(2)[0]
        chosen_top1 = per_token["is_top1"].chunk(2)[0].float()
        counts = torch.tensor(
            [
                stats["positions_scored"],
                stats["response_positions"],
                stats["policy_tokens_executed"],
                stats["grad_tokens_executed"],
                stats["full_tokens"],
                stats["grad_rows"],
                stats["rows"],
                stats["chosen_response_positions"],
            ],
            dtype=torch.float64,
        ).to(self.accelerator.device, non_blocking=True)
        top1_estimate = (chosen_top1 * chosen_weights).sum().double().reshape(1)
        counts = torch.cat([counts[:-1], top1_estimate, counts[-1:]])  # device values: the one sync is below
        if self.args.prune_common_prefix:  # the sums `_relabel_stock_metrics` needs ride on the same gather
            exact_w, exact_l = masks.exact.chunk(2)
            mean_logits_w, mean_logits_l = per_token["mean_logits"].chunk(2)
            counts = torch.cat([counts, torch.stack([
                per_token["entropy"].sum(), masks.exact.sum(),
                mean_logits_w.sum(), exact_w.sum(), mean_logits_l.sum(), exact_l.sum(),
            ]).double()])
        totals = self.accelerator.gather(counts.unsqueeze(0)).sum(dim=0).tolist()
        (scored, response, executed, grad_tokens, full, grad_rows, rows, top1, chosen_tokens) = totals[:9]
        metrics = self._metrics["train"]
        if metrics["mean_token_accuracy"]:  # TRL counted only scored positions as correct; use the HT estimate
            metrics["mean_token_accuracy"][-1] = top1 / chosen_tokens if chosen_tokens > 0 else 0.0
        metrics["prune/positions_scored"].append(scored / max(response, 1))
        metrics["prune/tokens_executed"].append(executed / max(full, 1))
        metrics["prune/tokens_backpropagated"].append(grad_tokens / max(full, 1))
        metrics["prune/branches_backpropagated"].append(grad_rows / max(rows, 1))
        if self._share_backend is not None:  # which execution the cost model picked (docs/method.md)
            shared, split = stats.get("shared_pairs", 0), stats.get("split_pairs", 0)
            metrics["prune/pairs_shared"].append(shared / max(shared + split, 1))
        return (top1, *totals[9:]) if self.args.prune_common_prefix else None

    # ------------------------------------------------------------------------------------------------- metric names
    def _relabel_stock_metrics(self, common_prefix_totals):
        """Move this step's stock-named metrics that do not estimate what stock logs to names that say what they are.

        Stock-named metrics stay only where their expectation over the masks is stock's value: the per-branch sums
        (logps, rewards, margins) and the per-token means (entropy, logits, token accuracy) are Horvitz-Thompson sums
        over exact counts. Moved, because no unbiased value exists (docs/parity.md):
        - `rewards/accuracies` under random position/prefix pruning: a step function of the noisy margin;
        - `aux_loss` with pruning on: the router loss of the grad rows' executed columns only;
        - under `prune_common_prefix`, every per-branch and per-token metric: the common prefix is never scored, so
          they cover the response after it (token means re-estimated over those positions).
        """
        metrics, args = self._metrics["train"], self.args

        def move(name, value=None, new=None):
            old = metrics[name].pop()
            if not metrics[name]:
                del metrics[name]  # TRL's `log` averages every key: no empty list may stay behind
            metrics[new or f"prune/{name}"].append(old if value is None else value)

        if self.aux_loss_enabled and args.pruning_enabled:
            move("aux_loss", new="prune/aux_loss_grad_rows")
        if args.position_keep_prob == AUTO or args.position_keep_prob < 1 or args.prefix_prune_prob > 0:
            move("rewards/accuracies", new="prune/rewards/accuracies_of_estimate")
        if not args.prune_common_prefix:
            return
        top1_w, entropy, exact, logits_w, count_w, logits_l, count_l = common_prefix_totals
        suffix = "_after_common_prefix"
        move("entropy", entropy / exact if exact else 0.0, "prune/entropy" + suffix)
        move("logits/chosen", logits_w / count_w if count_w else 0.0, "prune/logits/chosen" + suffix)
        move("logits/rejected", logits_l / count_l if count_l else 0.0, "prune/logits/rejected" + suffix)
        move("mean_token_accuracy", top1_w / count_w if count_w else 0.0, "prune/mean_token_accuracy" + suffix)
        for name in ("logps/chosen", "logps/rejected", "rewards/chosen", "rewards/rejected"):
            move(name, new=f"prune/{name}{suffix}")

    # ---------------------------------------------------------------------------- resume and failures (checkpoints.py)
    resumed_from: str | None = None  # the checkpoint the last `train()` resumed from
    restored_logging_window = False  # whether its partial logging window was restored (else logs restart there)
    divergence_guard: DivergenceGuard | None = None
    _step_loss = _diverged = _pending_run_state = None

    def train(self, resume_from_checkpoint=None, *pargs, **kwargs):
        """TRL's `train`, resuming only from a complete checkpoint with this run's pruning settings, warning before
        training about settings that should alarm, and stopping a diverging run (guards.py).

        `resume_from_checkpoint=True` (or "true"/"auto"/"last") takes the newest *complete* checkpoint in
        `output_dir`, saying which, and which newer incomplete ones it skipped. Raises `checkpoints.ResumeError`
        (nothing to resume, an incomplete checkpoint, other pruning settings) and `guards.TrainingDiverged`.
        """
        from transformers.utils import logging

        if self.train_dataset is not None:
            check_not_empty(self.train_dataset, self.args)
        resume, note = checkpoints.resolve_resume(resume_from_checkpoint, self.args)
        if note and self.is_world_process_zero():
            logging.get_logger(__name__).warning(note)
        self.resumed_from, self.restored_logging_window = resume, False
        self.divergence_guard = DivergenceGuard()
        self._step_loss, self._diverged, self._pending_run_state = None, None, None
        if resume is not None:
            self._pending_run_state = checkpoints.read_run_state(resume, self.args.process_index)
            if self._pending_run_state and "guard" in self._pending_run_state:
                self.divergence_guard.load_state_dict(self._pending_run_state["guard"])
        warn_before_training(self.args)
        output = super().train(resume, *pargs, **kwargs)
        if self._diverged is not None:
            raise TrainingDiverged(self._diverged)
        return output

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self._pending_run_state is not None:  # first micro-step after a resume: reopen the logging window
            self._restore_logging_window(self._pending_run_state.get("window") or {})
            self._pending_run_state = None
        loss = super().training_step(model, inputs, num_items_in_batch)
        self._step_loss = loss.detach() if self._step_loss is None else self._step_loss + loss.detach()
        return loss

    def _maybe_log_save_evaluate(self, tr_loss, grad_norm, *pargs, **kwargs):
        if self._step_loss is not None:  # an optimizer step just ended: check it before it is logged or saved
            loss, self._step_loss = self._step_loss, None
            if self.args.world_size > 1:  # every process must take the same decision
                loss = self.accelerator.reduce(loss, reduction="mean")
            norm = None if grad_norm is None else float(grad_norm)
            problem = self.divergence_guard.observe(self.state.global_step, float(loss), norm)
            if problem is not None and self.args.stop_on_divergence:
                last = checkpoints.last_complete(self._get_output_dir(trial=None))
                restart = f"resume from the last complete checkpoint, {last}" if last else "start again"
                self._diverged = (
                    f"training diverged at step {self.state.global_step}: {problem}. Stopped without checkpointing "
                    f"it. Lower learning_rate (or raise the keep probabilities) and {restart}; or pass "
                    "--stop_on_divergence false to train on."
                )
                self.control.should_save = self.control.should_evaluate = False
                self.control.should_training_stop = True
        super()._maybe_log_save_evaluate(tr_loss, grad_norm, *pargs, **kwargs)

    def _logging_window(self) -> dict:
        """What the Trainer and TRL have accumulated since the last log: restored on resume, so that a resumed run
        logs (and summarises) the same numbers as an uninterrupted one."""
        if not hasattr(self, "_tr_loss"):  # saved outside `train()`: no window open
            return {}
        return {
            "tr_loss": float(self._tr_loss),
            "last_logged": self._globalstep_last_logged,
            "metrics": {key: list(values) for key, values in self._metrics["train"].items()},
            # TRL's `num_tokens` counter, which TRL itself does not restore on resume
            "total_train_tokens": getattr(self, "_total_train_tokens", 0),
        }

    def _restore_logging_window(self, window: dict) -> None:
        if not window or not hasattr(self, "_tr_loss"):
            return
        self._tr_loss += torch.tensor(window["tr_loss"], dtype=self._tr_loss.dtype, device=self._tr_loss.device)
        self._globalstep_last_logged = window["last_logged"]
        for key, values in window["metrics"].items():
            self._metrics["train"][key][:0] = values
        self._total_train_tokens = window.get("total_train_tokens", 0)
        self.restored_logging_window = True

    def _save_checkpoint(self, model, trial):
        """TRL's checkpoint, then the run state and the completion marker; older checkpoints are rotated only after
        the new one is complete, and a full disk is said in one line (the partial folder is removed)."""
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

        run_dir = self._get_output_dir(trial=trial)
        folder = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        limit, self.args.save_total_limit = self.args.save_total_limit, None
        try:
            if self.args.should_save:
                checkpoints.unmark(folder)
            super()._save_checkpoint(model, trial)
            state = {"window": self._logging_window(), "guard": self.divergence_guard.state_dict()}
            checkpoints.write_run_state(folder, self.args.process_index, state)
            self.accelerator.wait_for_everyone()  # every process's files are written before the marker
            if self.args.should_save:
                checkpoints.mark_complete(folder, self.args, self.state.global_step)
        except Exception as error:
            if not checkpoints.is_disk_full(error, folder):
                raise
            if self.args.should_save:
                shutil.rmtree(folder, ignore_errors=True)
            raise checkpoints.DiskFullError(
                checkpoints.disk_full_message(os.path.basename(folder), folder, run_dir) + " The incomplete "
                "checkpoint was removed."
            ) from None
        finally:
            self.args.save_total_limit = limit
        if self.args.should_save:
            rotate_checkpoints(output_dir=run_dir, save_total_limit=limit,
                               best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True)
