"""`PrunedDPOTrainer`: TRL's `DPOTrainer` with a pruned forward of the [chosen; rejected] batch.

How it departs from stock TRL 1.16 (whose `_compute_loss` does one policy forward of the stacked batch, one reference
forward, then the loss and metrics), in the order of docs/method.md:

- `merged_forward` (and `concatenated_forward`, a pass of one batch) plans each micro-step on the host from its token
  ids, once (`plan_micro_step`: the masks of method/masks.py with "auto"'s probabilities from auto.py, in the layout
  `forward_choice` decided), and runs the pass (pruned_forward.run_pass, with the `ForwardContext` built once per
  trainer). It returns each micro-step's typed record: inverse-probability-weighted per-token terms for the policy,
  the reference's sums under the same masks.
- `compute_loss` hands that record to TRL's own `_compute_loss` through a replay "model" (seam.Replay), so every TRL
  loss, `ld_alpha`, `use_weighting` and every TRL metric run unchanged on unbiased estimates of what they consume;
  metrics.py then renames what no longer estimates stock's value, and auto.py gets the record's work counts.
- Evaluation is never pruned: it is TRL's own path. So is training whenever `uses_pruned_forward(args)` is false
  (pruning off): a drop-in by construction (docs/parity.md).
- With gradient accumulation, the micro-batches of an optimizer step run in as few packed passes as
  `step_token_budget` allows (merged_step.py): `get_batch_samples` groups them, `training_step` defers a micro-batch
  to its pass's last one, whose `compute_loss` plans each as unmerged and runs them in one policy and one reference
  forward (pruned_forward.run_pass), TRL's loss per micro-batch.
- `auto` keep probabilities (auto.py), per-token reference precompute (reference.py) and run-safety (safety/) are
  called from here; none of them imports the trainer.
"""

from collections.abc import Iterator
import functools
from typing import Any

import torch
from datasets import Dataset, IterableDataset

from . import forward_choice, merged_step, metrics
from .auto import AutoDraw, AutoKeepProbs
from .config import AUTO, PrunedDPOConfig, uses_pruned_forward
from .errors import TrainingDiverged
from .forward_choice import ForwardChoice
from .method.masks import PruneMasks, draw_masks, mask_generator
from .method.plan import HostBatch, Layout, MicroStepPlan, plan_micro_step, plan_reference
from .notices import checkpointing_names_quiet, trl_padding_free_notice_hidden
from .pruned_forward import ForwardContext, MicroStepRecord, reference_log_probs, run_pass
from .reference import HOST_KEY, REF_TOKEN_COLUMNS, REF_TOKEN_KEY, host_batch, precompute_per_token, pruned_collator
from .safety import checkpoints, guards
from .safety.data_checks import check_training_pairs, refuse_emptied
from .safety.run_state import RunState
from .sampler import prompt_group_sampler
from .seam import (
    DPOTrainer, Replay, as_pruned_config, attention, deepspeed_reference_engine, logging_window,
    restore_logging_window, run_output_dir, train_metrics, trl_loss, without_tied_keys,
)


def _before_train(trainer: "PrunedDPOTrainer", resume_from_checkpoint: str | bool | None) -> str | None:
    """The run state a `train()` starts from (safety/): the checkpoint to resume (said where it needs a note), the
    guard's, auto's and the logging window's state from it; the checks and warnings of pruned training; whether a
    step's micro-batches can merge, once methods may have been patched onto the trainer (merged_step.py)."""
    from transformers.utils import logging

    args, pruned = trainer.args, trainer.forward_choice.pruned
    # Pruning off: stock's own error, and stock says nothing before training.
    if trainer.train_dataset is not None and pruned:
        guards.check_not_empty(trainer.train_dataset, args)
    resume, note = checkpoints.resolve_resume(resume_from_checkpoint, args)
    if note and trainer.is_world_process_zero():
        logging.get_logger(__name__).warning(note)
    saved = trainer.run_state.begin(resume, args)
    # Auto's statistics and choice: a resume draws the masks of no resume.
    if trainer.auto_keep_probs is not None:
        trainer.auto_keep_probs.load_state_dict((saved or {}).get("auto"))
    if pruned:
        guards.warn_before_training(args)
    trainer._pending.discard(train_metrics(trainer))
    trainer._merger = merged_step.StepMerger(merged_step.why_unmerged(
        args, trainer.forward_choice, trainer.accelerator, trainer.aux_loss_enabled, trainer.is_fsdp_enabled,
        merged_step.bypassed_overrides(trainer, PrunedDPOTrainer)))
    return resume


def _trl_reference_sums(trainer: "PrunedDPOTrainer", per_token: torch.Tensor,
                        batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's `compute_ref_log_probs` (the per-branch sums, with `ld_alpha`) of per-token reference log-probs."""
    return DPOTrainer.compute_ref_log_probs(trainer, Replay(log_probs=per_token), batch)


class PrunedDPOTrainer(DPOTrainer):
    """DPO with stochastic pruning of the computation graph. Same constructor as `trl.DPOTrainer`.

    `args` must be a [`PrunedDPOConfig`]; its pruning fields choose what is pruned. Read-only views of its state:
    `forward_choice` (which forward trains, and why), `last_micro_step` (the last training micro-step's record: its
    plan, masks and work counts; `last_prune_stats` its counts), `run_state` (resume, divergence guard, stop request)
    and `auto_keep_probs` (what "auto" measured and chose, or None).
    """

    _tag_names = ["trl", "dpo", "trl-pruned-dpo"]
    # The plugin's forward with everything off: the benchmarks' `none` row. Not for training (off is TRL's own path).
    always_pruned_forward = False

    def __init__(self, model: torch.nn.Module | str, ref_model: torch.nn.Module | str | None = None,
                 args: PrunedDPOConfig | None = None, *pargs: Any, **kwargs: Any):
        args = as_pruned_config(model, args, PrunedDPOConfig)
        # A no-op without an accelerator, but torch warns at every loader.
        if args.dataloader_pin_memory and not torch.accelerator.is_available():
            args.dataloader_pin_memory = False
        train_dataset = kwargs.get("train_dataset", pargs[1] if len(pargs) > 1 else None)
        processing_class = kwargs.get("processing_class", pargs[3] if len(pargs) > 3 else None)
        # Refuse what the pruned forward cannot do, before TRL's precompute runs.
        self._forward_choice = forward_choice.before_trl(args, train_dataset, processing_class,
                                                         self.always_pruned_forward)
        self.run_state = RunState()
        self.last_micro_step: MicroStepRecord | None = None
        self._auto: AutoKeepProbs | None = None
        self._context: ForwardContext | None = None
        # (global step, micro-step) of the last draw.
        self._mask_step = (-1, 0)
        # The merged step (merged_step.py): the pass the running micro-batch ends.
        self._pass: tuple[dict, ...] | None = None
        with trl_padding_free_notice_hidden(uses_pruned_forward(args) and args.padding_free):
            super().__init__(model, ref_model, args, *pargs, **kwargs)
        self._pending = metrics.PendingMetrics(self.accelerator)
        if self._forward_choice.pruned:
            # Degenerate and truncated pairs: warn, or refuse (one rank).
            check_training_pairs(self, train_dataset)
        models = [self.accelerator.unwrap_model(m) for m in (self.model, self.ref_model) if m is not None]
        self._forward_choice = forward_choice.after_trl(self._forward_choice, args, models, self.aux_loss_enabled,
                                                        self._is_vision_dataset)
        if self._forward_choice.pruned:
            self.data_collator = pruned_collator(self.data_collator, args, self.train_dataset)
        if args.auto_keep_probs:
            from accelerate.utils import is_peft_model

            policy = self.accelerator.unwrap_model(self.model)
            self._auto = AutoKeepProbs(args, policy.config, is_peft_model(policy), self.is_deepspeed_enabled)
            # It hooks the gradients of the model as training wraps it (auto.py).
            self.add_callback(self._auto)
        # The merged step's state (merged_step.py), set up by each `train()`.
        self._merger = merged_step.StepMerger(None)
        # Whether this run can drop a branch at all ("auto" on adapter training never does).
        self._drops_branches = (self._auto is not None and "branch" in self._auto.families) or (
            args.branch_keep_prob != AUTO and args.branch_keep_prob < 1)

    @property
    def forward_choice(self) -> ForwardChoice:
        """Which forward trains (TRL's own, padded or packed rows), and why (forward_choice.py)."""
        return self._forward_choice

    @property
    def auto_keep_probs(self) -> AutoKeepProbs | None:
        """What "auto" measured and chose (auto.py), or None without an "auto" keep probability."""
        return self._auto

    @property
    def last_prune_stats(self) -> dict[str, int]:
        """The raw counts of the work of the last training micro-step (tokens executed, positions scored, rows ...)."""
        return self.last_micro_step.counts.as_dict() if self.last_micro_step is not None else {}

    def forward_context(self) -> ForwardContext:
        """What the pruned forward needs of this trainer, built once (again only if training re-wrapped the policy)."""
        if self._context is None or self._context.policy is not self.model:
            # TRL's own per-branch sums (ld_alpha), of per-token values.
            reference_sums = functools.partial(_trl_reference_sums, self)
            self._context = ForwardContext(
                policy=self.model, unwrapped_policy=self.accelerator.unwrap_model(self.model),
                reference=self.ref_model, accelerator=self.accelerator,
                checkpointing_kwargs=self.args.gradient_checkpointing_kwargs,
                precomputed_reference=self.precompute_ref_logps, prune_reference=self.args.prune_reference,
                prune_common_prefix=self.args.prune_common_prefix, use_weighting=self.use_weighting,
                aux_loss_enabled=self.aux_loss_enabled, reference_sums=reference_sums)
        return self._context

    # ----------------------------------------------------------------------------------------------------------- data
    def _get_train_sampler(self, train_dataset: Dataset | None = None) -> Any:
        """`group_by_prompt`: a prompt's pairs in one micro-batch (sampler.py); otherwise TRL's own sampler."""
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        sampler = prompt_group_sampler(self.args, dataset, self._train_batch_size)
        return sampler if sampler is not None else super()._get_train_sampler(train_dataset)

    def get_batch_samples(self, epoch_iterator: Iterator, num_batches: int,
                          device: torch.device) -> tuple[list, torch.Tensor | int | None]:
        """transformers' prefetch of an optimizer step's micro-batches, unchanged; grouped into the merged step's
        passes (merged_step.StepMerger)."""
        batches, num_items_in_batch = super().get_batch_samples(epoch_iterator, num_batches, device)
        self._merger.group(self.args, self._forward_choice, batches, self.accelerator)
        return batches, num_items_in_batch

    def _set_signature_columns_if_needed(self):
        super()._set_signature_columns_if_needed()
        # Keep the per-token reference columns (once, however often it is called).
        if self._forward_choice.pruned:
            missing = [c for c in REF_TOKEN_COLUMNS if c not in self._signature_columns]
            self._signature_columns = list(self._signature_columns) + missing

    def _precompute_ref_logps(self, dataset: Dataset, name: str, batch_size: int) -> Dataset:
        """With pruning on, also stores the per-token reference log-probs beside their sums (the masks need them:
        reference.py). With pruning off, and for what TRL rejects (an IterableDataset), it is TRL's own."""
        if not self._forward_choice.pruned or isinstance(dataset, IterableDataset):
            return super()._precompute_ref_logps(dataset, name, batch_size)
        refuse_emptied(dataset, name, self.args.max_length)
        context = self.forward_context()

        def log_probs(model: torch.nn.Module, batch: dict, scored: torch.Tensor) -> torch.Tensor:
            host = host_batch(batch)
            layout = self._layout(batch, host)
            group = plan_reference(host, scored.cpu(), layout.share, layout.packed)
            return reference_log_probs(context, model, group, batch)

        # As TRL: the policy (prepared once for DeepSpeed) where no reference model is given.
        if self.ref_model is None and self.is_deepspeed_enabled:
            model = deepspeed_reference_engine(self)
        else:
            model = self.ref_model or self.model
        return precompute_per_token(self.accelerator, self.args, self.data_collator, model, dataset, batch_size,
                                    log_probs, context.reference_sums)

    # ------------------------------------------------------------------------------ plan on the host, run on the device
    def draw_masks(self, host: HostBatch, options: dict, generator: torch.Generator) -> PruneMasks:
        """This micro-step's masks under `options` (`masks.draw_masks`'s sampling keywords, "auto" ones chosen), drawn
        from the batch's host copy of its token layout (no device sync) with `generator`, keyed by (prune_seed, global
        step, micro-step, rank): resuming draws the same masks. A subclass may draw its own (evaluation/prototypes)."""
        return draw_masks(host.input_ids, host.completion_mask, **options, generator=generator,
                          attention_mask=host.attention_mask)

    def _layout(self, inputs: dict, host: HostBatch) -> Layout:
        """How this batch runs, after the first batch's checks of a family outside the tested table
        (`forward_choice.first_batch_checks`: the forward choice's one change)."""
        if self._forward_choice.pending:
            self._forward_choice = forward_choice.first_batch_checks(self._forward_choice, self.forward_context(),
                                                                     self.args, host, inputs)
        layout = self._forward_choice.layout(inputs)
        # Kept until the trainer's next stock forward: checkpointing recomputes in the backward.
        if layout.packed:
            attention.use_packed(self._forward_choice.models)
        return layout

    def plan(self, inputs: dict) -> MicroStepPlan:
        """This micro-step's plan, made once on the host from the batch's token ids: the draw's step and options
        ("auto"'s probabilities asked for), the masks, the layout, the forwards and their work counts."""
        host = host_batch(inputs)
        layout = self._layout(inputs, host)
        step = self.state.global_step
        self._mask_step = (step, self._mask_step[1] + 1 if self._mask_step[0] == step else 0)
        options = self.args.mask_options()
        draw = self._auto.draw(*self._mask_step, host) if self._auto is not None else AutoDraw({}, None, ())
        options.update(draw.keep_probs)
        # A number keeps its branches structurally: the same on every process; "auto" says per step.
        prunes_branches = self.args.branch_keep_prob < 1 if draw.prunes_branches is None else draw.prunes_branches
        generator = mask_generator(self.args.prune_seed, *self._mask_step, self.accelerator.process_index)
        masks = self.draw_masks(host, options, generator).to("cpu")
        # The reference runs where it is not precomputed, on the policy's masks with `prune_reference`.
        live = not self.precompute_ref_logps
        reference_scored = (masks.scored if self.args.prune_reference else masks.exact) if live else None
        return plan_micro_step(self._mask_step, options, host, masks, layout,
                               prunes_branches=prunes_branches, reference_scored=reference_scored, means=draw.means)

    def concatenated_forward(self, model: torch.nn.Module, inputs: dict) -> MicroStepRecord:
        """The pruned forward of the [chosen; rejected] batch: a pass of one (`merged_forward`). Its record holds the
        policy's per-token outputs as inverse-probability-weighted terms whose row sums are unbiased for the full sums
        (Eqs. 1-3), and the reference's per-branch sums (chosen, rejected) under the same masks."""
        return self.merged_forward(model, [inputs])[0]

    def merged_forward(self, model: torch.nn.Module, batches: list[dict]) -> list[MicroStepRecord]:
        """The pruned forward of a pass's micro-batches, in order (one unmerged; several in a merged step,
        merged_step.py): each planned on the host (`plan`: its masks keyed by its own micro-step), all run in one
        policy and one reference forward (pruned_forward.run_pass). One record per micro-batch; the last is kept as
        `last_micro_step`, a view for the user: nothing here reads it back."""
        plans = [self.plan(batch) for batch in batches]
        records = run_pass(self.forward_context(), model, batches, plans)
        self.last_micro_step = records[-1]
        return records

    # --------------------------------------------------------------------------------------- estimate: TRL's loss
    def compute_loss(self, model: torch.nn.Module, inputs: dict, return_outputs: bool = False,
                     num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        # Evaluation, and pruning off: TRL's own path, with the attention each model was loaded with (attention.py).
        if not self.model.training or not self._forward_choice.pruned:
            if self._forward_choice.packed:
                attention.use_packed(self._forward_choice.models, packed=False)
            inputs = {k: v for k, v in inputs.items() if k not in (REF_TOKEN_KEY, HOST_KEY)}
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if return_outputs:
            raise ValueError("PrunedDPOTrainer does not return model outputs during training (TRL deprecated them).")
        # The pass `inputs` ends: alone, or (merged_step.py) after its earlier micro-batches, prepared as
        # `training_step` would have prepared them. A pass of one runs through the public per-batch hook.
        earlier = [self._prepare_inputs(batch) for batch in self._pass[:-1]] if self._pass is not None else []
        batches = earlier + [inputs]
        records = self.merged_forward(model, batches) if earlier else [self.concatenated_forward(model, inputs)]
        # TRL's loss per micro-batch; their sum, which transformers scales by the accumulation steps and
        # backpropagates once.
        return torch.stack([self._micro_step_loss(r, b) for r, b in zip(records, batches)]).sum()

    def _micro_step_loss(self, record: MicroStepRecord, inputs: dict) -> torch.Tensor:
        """TRL's loss of one micro-batch from its record (TRL's metrics logged by TRL), then the plugin's metrics."""
        batch = {k: v for k, v in inputs.items() if k != REF_TOKEN_KEY}
        batch["ref_chosen_logps"], batch["ref_rejected_logps"] = record.reference
        loss = trl_loss(self, Replay(aux_loss=record.aux_loss, **record.per_token), batch)
        metrics.log_pruned_metrics(record, self.args, train_metrics(self), self._pending, self._drops_branches)
        if self._auto is not None:
            self._auto.add_work(record.counts)
        return loss

    # -------------------------------------------------------------------------------- resume and failures (safety/)
    # The stop-signal flag rides on the step's one fused read (guards.check_step).
    reads_stop_signal = True

    def train(self, resume_from_checkpoint: str | bool | None = None, *pargs: Any, **kwargs: Any) -> Any:
        """TRL's `train`, resuming only from a complete checkpoint with this run's pruning settings (`True`: the newest
        complete one; a stock checkpoint resumes with a note), warning about settings that should alarm, and stopping
        a diverging run (safety/). Raises `errors.ResumeError` and `errors.TrainingDiverged`, each one line."""
        resume = _before_train(self, resume_from_checkpoint)
        # Inside `train()`, the plugin's metrics are read at the logging step (metrics.PendingMetrics).
        self._pending.deferred = True
        try:
            # TRL's calls of transformers' deprecated names (notices.py).
            with checkpointing_names_quiet():
                output = super().train(resume, *pargs, **kwargs)
        finally:
            self._pending.deferred = False
            self._merger.passes = None
            # Auto's gradient hooks, also after a `train()` that raised.
            if self._auto is not None:
                self._auto.detach()
            # Each model's own attention back (attention.py).
            if self._forward_choice.packed:
                attention.use_packed(self._forward_choice.models, packed=False)
        if self.run_state.diverged is not None:
            raise TrainingDiverged(self.run_state.diverged)
        return output

    def evaluate(self, *pargs: Any, **kwargs: Any) -> dict[str, float]:
        with checkpointing_names_quiet():
            return super().evaluate(*pargs, **kwargs)

    def predict(self, *pargs: Any, **kwargs: Any) -> Any:
        with checkpointing_names_quiet():
            return super().predict(*pargs, **kwargs)

    def _issue_warnings_after_load(self, load_result: Any) -> None:
        # A resume: a tied head is not missing (seam/).
        super()._issue_warnings_after_load(without_tied_keys(self.accelerator.unwrap_model(self.model), load_result))

    def training_step(self, model: torch.nn.Module, inputs: dict,
                      num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        # The first micro-step after a resume reopens the logging window.
        window = self.run_state.take_window()
        if window is not None:
            self.run_state.restored_logging_window = restore_logging_window(self, window)
        members = self._merger.pass_of(inputs)
        # A merged step's micro-batch that does not end its pass runs in its pass, at the pass's last micro-batch.
        if members == ():
            return torch.zeros((), device=self.args.device)
        self._pass = members if members is not None and len(members) > 1 else None
        try:
            loss = super().training_step(model, inputs, num_items_in_batch)
        finally:
            self._pass = None
        self.run_state.add_loss(loss, self.accelerator.scaler)
        # The backward is done, the gradient not clipped yet.
        if self._auto is not None:
            self._auto.after_backward(self.state.global_step, self.run_state.step_scale)
        return loss

    def _maybe_log_save_evaluate(self, tr_loss: torch.Tensor, grad_norm: torch.Tensor | float | None, *pargs: Any,
                                 **kwargs: Any) -> None:
        # An optimizer step just ended (once: the epoch's end calls this again): auto takes its measurements, the guard
        # checks it before it is logged or saved.
        if self._auto is not None and self.run_state.step_loss is not None:
            self._auto.end_step(self.state.global_step - 1, grad_norm, self.run_state.step_loss,
                                self.current_gradient_accumulation_steps, self.accelerator, self.run_state.step_scale)
        self.run_state.end_step(self, grad_norm, run_output_dir(self))
        super()._maybe_log_save_evaluate(tr_loss, grad_norm, *pargs, **kwargs)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        # The plugin's metrics, read once per logging step (every process logs together).
        self._pending.flush(train_metrics(self))
        super().log(logs, start_time)

    def _save_checkpoint(self, model: torch.nn.Module, trial: Any) -> None:
        """TRL's checkpoint, then the run state and the completion marker (safety/checkpoints.py)."""
        # The logging window saved below holds values, not device counts.
        self._pending.flush(train_metrics(self))
        state = {"window": logging_window(self, self._pending.deferred), **self.run_state.state_dict(),
                 "auto": self._auto.state_dict() if self._auto is not None else None,
                 # The run's record of the attention kernel its packed rows ran (named at the first packed forward).
                 "attention_kernel": self._forward_choice.kernel}
        checkpoints.save_complete(self, super()._save_checkpoint, model, trial, state, run_output_dir(self, trial))
