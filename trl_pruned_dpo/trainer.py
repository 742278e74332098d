"""`PrunedDPOTrainer`: TRL's `DPOTrainer` with a pruned forward of the [chosen; rejected] batch.

How it departs from stock TRL 1.16 (whose `_compute_loss` does one policy forward of the stacked batch, one reference
forward, then the loss and metrics):

- `concatenated_forward` draws the masks (masks.py), then runs the backpropagated rows with grad and the others
  under `torch.no_grad()`, each group trimmed to the longest row it still needs, scoring only kept positions through
  TRL's own fused LM head (compacted on every device). It returns inverse-probability-weighted per-token terms
  (estimators.py) for the policy and the reference.
- `compute_loss` hands those terms to TRL's own `_compute_loss` through a replay "model", so every TRL loss,
  `ld_alpha`, `use_weighting` and every TRL metric run unchanged on unbiased estimates of what they consume.
- Evaluation is never pruned: it is TRL's own path.
- With `precompute_ref_log_probs=True` the per-token reference log-probs are stored (not just their sums) so the
  same masks apply to them.
"""

import contextlib
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from accelerate.utils import is_peft_model
from datasets import Dataset, IterableDataset, concatenate_datasets
from torch.utils.data import DataLoader

from ._trl import DPOTrainer, compact_lm_head, disable_gradient_checkpointing, use_adapter
from .auto import AutoKeepProbs
from .config import AUTO, PrunedDPOConfig
from .estimators import horvitz_thompson, scale_branch_gradient
from .masks import PruneMasks, draw_masks, executed_columns, mask_generator

# Dataset columns and batch key of the stored per-token reference log-probs (response positions, in order).
REF_TOKEN_COLUMNS = ("ref_chosen_token_logps", "ref_rejected_token_logps")
REF_TOKEN_KEY = "ref_token_logps"
_NON_MODEL_KEYS = {"completion_mask", "ref_chosen_logps", "ref_rejected_logps", REF_TOKEN_KEY}


class _Replay:
    """Stands in for the model in TRL's `_compute_loss`: returns per-token outputs computed beforehand."""

    def __init__(self, **per_token):
        self.outputs = SimpleNamespace(aux_loss=None, **per_token)

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


class PrunedDPOTrainer(DPOTrainer):
    """DPO with stochastic pruning of the computation graph. Same constructor as `trl.DPOTrainer`.

    `args` must be a [`PrunedDPOConfig`]; its pruning fields choose what is pruned. After each training micro-step,
    `last_prune_stats` holds the raw counts of the work done (tokens executed, positions scored, rows backpropagated).
    """

    _tag_names = ["trl", "dpo", "trl-pruned-dpo"]

    def __init__(self, model, ref_model=None, args: PrunedDPOConfig | None = None, *pargs, **kwargs):
        if args is None:
            raise ValueError("PrunedDPOTrainer needs `args=PrunedDPOConfig(output_dir=..., ...)`.")
        if not isinstance(args, PrunedDPOConfig):
            raise TypeError(
                f"`args` must be a PrunedDPOConfig, got {type(args).__name__}. PrunedDPOConfig takes every DPOConfig "
                "field: build it with the same arguments plus the pruning fields."
            )
        train_dataset = kwargs.get("train_dataset", pargs[1] if len(pargs) > 1 else None)
        if train_dataset is not None:
            sample = next(iter(train_dataset))
            if "image" in sample or "images" in sample:
                raise ValueError("PrunedDPOTrainer supports text datasets only; use trl.DPOTrainer for vision data.")
            tokenized = {"prompt_ids", "chosen_ids", "rejected_ids"} <= set(sample)
            missing = [c for c in ("chosen", "rejected") if c not in sample]
            if missing and not tokenized:
                raise ValueError(
                    f"The training dataset has no {missing} column(s) (it has {sorted(sample)}): a preference "
                    "dataset needs `chosen` and `rejected` (and `prompt`, or a prompt shared at their start)."
                )
        self.last_prune_stats: dict[str, int] = {}
        self._mask_step = (-1, 0)  # (global step, micro-step) of the last draw
        self._forced_mask_options = None
        super().__init__(model, ref_model, args, *pargs, **kwargs)
        if self.aux_loss_enabled:
            raise ValueError(
                "PrunedDPOTrainer does not support the MoE router auxiliary loss: set `router_aux_loss_coef=0.0`."
            )
        if args.precompute_ref_log_probs:
            self.data_collator = _PerTokenReferenceCollator(self.data_collator)
        self._auto_probs = None  # "auto" keep probabilities (auto.py)
        if args.auto_keep_probs:
            self._auto_probs = AutoKeepProbs(args, self.accelerator.unwrap_model(self.model).config,
                                             reference=not args.precompute_ref_log_probs)

    # ----------------------------------------------------------------------------------------------------------- data
    def _set_signature_columns_if_needed(self):
        super()._set_signature_columns_if_needed()
        self._signature_columns = list(self._signature_columns) + list(REF_TOKEN_COLUMNS)

    def _precompute_ref_logps(self, dataset: Dataset, name: str, batch_size: int) -> Dataset:
        """Like TRL's, but stores the per-token reference log-probs beside their sums (the masks need them).

        Every process computes the whole dataset (no sharding, no cache file): simple and identical on all ranks.
        """
        if isinstance(dataset, IterableDataset):
            raise ValueError("`precompute_ref_log_probs=True` needs a map-style Dataset, not an IterableDataset.")
        if self.ref_model is None and self.is_deepspeed_enabled:
            if self._precompute_engine is None:
                from trl.models import prepare_deepspeed

                self._precompute_engine = prepare_deepspeed(self.model, self.accelerator)
            model = self._precompute_engine
        else:
            model = self.ref_model or self.model
        loader = DataLoader(dataset, batch_size=batch_size, collate_fn=self.data_collator, shuffle=False)
        columns = {"ref_chosen_logps": [], "ref_rejected_logps": [], **{c: [] for c in REF_TOKEN_COLUMNS}}
        for batch in loader:
            batch = self._prepare_inputs(batch)
            response = batch["completion_mask"][:, 1:].bool()
            per_token = self._reference_log_probs(model, batch, response)
            chosen_sum, rejected_sum = self._reference_sums(batch, per_token)
            columns["ref_chosen_logps"] += chosen_sum.cpu().tolist()
            columns["ref_rejected_logps"] += rejected_sum.cpu().tolist()
            rows = [per_token[r][response[r]].float().cpu().tolist() for r in range(per_token.size(0))]
            half = len(rows) // 2
            columns[REF_TOKEN_COLUMNS[0]] += rows[:half]
            columns[REF_TOKEN_COLUMNS[1]] += rows[half:]
        stale = [c for c in columns if c in dataset.column_names]
        if stale:
            dataset = dataset.remove_columns(stale)
        return concatenate_datasets([dataset, Dataset.from_dict(columns)], axis=1)

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
        forced = getattr(self, "_forced_mask_options", None)
        if forced is not None:  # auto.py's measurements: their own options and generator, no step bookkeeping
            return draw_masks(inputs["input_ids"], inputs["completion_mask"], **forced)
        generator = self._next_mask_generator()
        return draw_masks(inputs["input_ids"], inputs["completion_mask"], **self._mask_options(inputs),
                          generator=generator)

    def _forward_rows(self, model, inputs, rows: torch.Tensor, scored: torch.Tensor, executed: torch.Tensor):
        """Run `rows` of the batch, trimmed to the longest executed row, scoring the `scored` positions only.

        Returns the fused-head outputs (per-token tensors of shape (len(rows), width - 1)) and the width. An empty
        `rows` still runs one row of two tokens, scoring nothing: every process must run the same modules in the same
        order (ZeRO-3/FSDP), and a grad group must stay connected to the graph.
        """
        if rows.numel() == 0:
            rows, width = rows.new_zeros(1), 2
            scored = torch.zeros_like(scored)
        else:
            width = int(executed[rows].max())
        input_ids = inputs["input_ids"][rows, :width]
        labels = torch.full_like(input_ids, -100)
        labels[:, 1:] = torch.where(scored[rows, : width - 1], input_ids[:, 1:], -100)
        total_rows, total_cols = inputs["input_ids"].shape
        kwargs = {}
        for key, value in inputs.items():
            if key in _NON_MODEL_KEYS or key == "input_ids":
                continue
            if torch.is_tensor(value) and value.dim() >= 2 and value.shape[:2] == (total_rows, total_cols):
                value = value[rows, :width]
            elif torch.is_tensor(value) and value.dim() >= 1 and value.size(0) == total_rows:
                value = value[rows]
            kwargs[key] = value
        with compact_lm_head():
            outputs = model(input_ids=input_ids, labels=labels, use_cache=False, fused_lm_head=True, **kwargs)
        return outputs, width

    def _reference_log_probs(self, model, inputs, scored: torch.Tensor, executed: torch.Tensor | None = None):
        """Per-token reference log-probs (rows, cols) on the `scored` positions, 0 elsewhere; never backpropagated."""
        if executed is None:
            executed = executed_columns(scored)
        rows = torch.nonzero(executed > 0).flatten()
        per_token = torch.zeros(scored.shape, dtype=torch.float32, device=scored.device)
        adapter = contextlib.nullcontext()
        if self.ref_model is None and is_peft_model(self.model):
            # Reference = the policy with its adapter disabled (or TRL's frozen "ref" adapter copy)
            unwrapped = self.accelerator.unwrap_model(self.model)
            adapter = use_adapter(unwrapped, adapter_name="ref" if "ref" in unwrapped.peft_config else None)
        with (
            torch.no_grad(),
            disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs),
            adapter,
        ):
            outputs, width = self._forward_rows(model, inputs, rows, scored, executed)
        if rows.numel():
            per_token[rows, : width - 1] = outputs.log_probs[:, -(width - 1) :].float()
        self._count("reference_tokens_executed", max(rows.numel(), 1) * width)
        self._count("reference_positions_scored", int(scored[rows].sum()) if rows.numel() else 0)
        return per_token

    def _reference_sums(self, inputs, per_token: torch.Tensor):
        """Per-branch reference sums from per-token values, through TRL's own `compute_ref_log_probs` (ld_alpha)."""
        return DPOTrainer.compute_ref_log_probs(self, _Replay(log_probs=per_token), inputs)

    def concatenated_forward(self, model, inputs) -> tuple[dict[str, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """The pruned forward of the [chosen; rejected] batch.

        Returns the policy's per-token outputs (log-probs and TRL's metric fields) as inverse-probability-weighted
        terms whose row sums are unbiased for the full sums, with the straight-through branch scaling applied to the
        log-probs (Eq. 3), and the reference's per-branch sums (chosen, rejected) under the same masks.
        """
        masks = self._draw_masks(inputs)
        self.last_prune_stats = {}
        response = inputs["completion_mask"][:, 1:].bool()
        shape, device = response.shape, response.device
        needed = masks.executed > 0
        grad_rows = torch.nonzero(needed & masks.backprop).flatten()
        frozen_rows = torch.nonzero(needed & ~masks.backprop).flatten()

        fields = ("log_probs", "entropy", "mean_logits", "is_top1") + (
            ("log_sum_sq_probs",) if self.use_weighting else ()
        )
        per_token = {f: torch.zeros(shape, dtype=torch.bool if f == "is_top1" else torch.float32, device=device)
                     for f in fields}
        connect = None
        groups = [(grad_rows, True)]
        if self._prunes_branches():  # a structural choice, the same on every process
            groups.append((frozen_rows, False))
        for rows, with_grad in groups:
            context = contextlib.nullcontext() if with_grad else torch.no_grad()
            freeze = contextlib.nullcontext() if with_grad else disable_gradient_checkpointing(
                self.model, self.args.gradient_checkpointing_kwargs
            )
            with context, freeze:
                outputs, width = self._forward_rows(model, inputs, rows, masks.scored, masks.executed)
            tokens = max(rows.numel(), 1) * width
            self._count("policy_tokens_executed", tokens)
            if with_grad:
                self._count("grad_tokens_executed", tokens)
            if rows.numel() == 0:
                if with_grad:
                    connect = outputs.log_probs.sum() * 0.0
                continue
            for f in fields:
                value = getattr(outputs, f)[:, -(width - 1) :]
                if f == "log_probs":
                    # out-of-place so autograd keeps the grad rows' history
                    per_token[f] = per_token[f].index_put((rows,), torch.nn.functional.pad(
                        value.float(), (0, shape[1] - (width - 1))))
                else:
                    per_token[f][rows, : width - 1] = value.to(per_token[f].dtype)

        weights = masks.weights.to(device)
        for f in fields:
            if f != "is_top1":
                per_token[f] = horvitz_thompson(per_token[f], weights)
        per_token["is_top1"] &= masks.scored
        if self._prunes_branches():
            per_token["log_probs"] = scale_branch_gradient(per_token["log_probs"], masks.branch_scale.to(device))
        if connect is not None:
            per_token["log_probs"] = per_token["log_probs"] + connect

        reference = self._pruned_reference(model, inputs, masks, response)
        self._count("positions_scored", int(masks.scored.sum()))
        self._count("grad_positions_scored", int(masks.scored[masks.backprop].sum()))
        self._count("tokens_needed", int(masks.executed.sum()))
        self._count("response_positions", int(response.sum()))
        self._count("rows", shape[0])
        self._count("grad_rows", int(masks.backprop.sum()))
        self._count("full_tokens", inputs["input_ids"].numel())
        self._last_masks = masks
        return per_token, reference

    def _pruned_reference(self, model, inputs, masks: PruneMasks, response: torch.Tensor):
        """Reference sums under the policy's masks (`prune_reference`), or exact sums over every kept position."""
        prune = self.args.prune_reference
        if self.precompute_ref_logps:
            if not prune and not self.args.prune_common_prefix:
                return inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]
            stored = inputs[REF_TOKEN_KEY].to(masks.weights.device)
            weights = masks.weights if prune else masks.exact.float()
            return self._reference_sums(inputs, horvitz_thompson(stored, weights))
        reference_model = self.ref_model if self.ref_model is not None else self.model
        if prune:
            per_token = self._reference_log_probs(reference_model, inputs, masks.scored, masks.executed)
            return self._reference_sums(inputs, horvitz_thompson(per_token, masks.weights))
        per_token = self._reference_log_probs(reference_model, inputs, masks.exact)
        return self._reference_sums(inputs, per_token * masks.exact)

    # ----------------------------------------------------------------------------------------------------------- loss
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not self.model.training:  # evaluation is exact: TRL's own path
            inputs = {k: v for k, v in inputs.items() if k != REF_TOKEN_KEY}
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if return_outputs:
            raise ValueError("PrunedDPOTrainer does not return model outputs during training (TRL deprecated them).")
        per_token, (ref_chosen, ref_rejected) = self.concatenated_forward(model, inputs)
        batch = {k: v for k, v in inputs.items() if k != REF_TOKEN_KEY}
        batch["ref_chosen_logps"], batch["ref_rejected_logps"] = ref_chosen, ref_rejected
        precompute = self.precompute_ref_logps
        self.precompute_ref_logps = True  # TRL then reads the reference sums from the batch
        try:
            loss = self._compute_loss(_Replay(**per_token), batch, return_outputs=False)
        finally:
            self.precompute_ref_logps = precompute
        self._log_pruned_metrics(per_token, inputs)
        return loss

    def _count(self, name: str, value: int):
        self.last_prune_stats[name] = self.last_prune_stats.get(name, 0) + int(value)

    def _log_pruned_metrics(self, per_token, inputs):
        """The `prune/` fractions, and TRL's token accuracy re-estimated from the scored positions only."""
        masks, stats = self._last_masks, self.last_prune_stats
        chosen_response = inputs["completion_mask"][:, 1:].bool().chunk(2)[0]
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
                float((chosen_top1 * chosen_weights).sum()),
                int(chosen_response.sum()),
            ],
            dtype=torch.float64,
            device=self.accelerator.device,
        )
        totals = self.accelerator.gather(counts.unsqueeze(0)).sum(dim=0).tolist()
        (scored, response, executed, grad_tokens, full, grad_rows, rows, top1, chosen_tokens) = totals
        metrics = self._metrics["train"]
        if metrics["mean_token_accuracy"]:  # TRL counted only scored positions as correct; use the HT estimate
            metrics["mean_token_accuracy"][-1] = top1 / chosen_tokens if chosen_tokens > 0 else 0.0
        metrics["prune/positions_scored"].append(scored / max(response, 1))
        metrics["prune/tokens_executed"].append(executed / max(full, 1))
        metrics["prune/tokens_backpropagated"].append(grad_tokens / max(full, 1))
        metrics["prune/branches_backpropagated"].append(grad_rows / max(rows, 1))
