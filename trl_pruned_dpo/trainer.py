"""`PrunedDPOTrainer`: TRL's `DPOTrainer` with a pruned forward of the [chosen; rejected] batch.

How it departs from stock TRL 1.16 (whose `_compute_loss` does one policy forward of the stacked batch, one reference
forward, then the loss and metrics), in the order of docs/method.md:

- `concatenated_forward` draws the masks on the host (method/masks.py, with "auto"'s probabilities: auto.py) and runs
  them in the layout `forward_choice` decided (forward_choice.py) through pruned_forward.py (plan on the host, execute
  on the device, inverse-probability-weighted per-token terms for the policy, the reference's sums under the same
  masks). The micro-step's record (metrics.MicroStepRecord) is handed to metrics.py and auto.py.
- `compute_loss` hands those terms to TRL's own `_compute_loss` through a replay "model" (seam.Replay), so every TRL
  loss, `ld_alpha`, `use_weighting` and every TRL metric run unchanged on unbiased estimates of what they consume;
  metrics.py then renames what no longer estimates stock's value.
- Evaluation is never pruned: it is TRL's own path. So is training whenever `uses_pruned_forward(args)` is false
  (pruning off): a drop-in by construction (docs/parity.md).
- `auto` keep probabilities (auto.py), per-token reference precompute (reference.py) and run-safety (safety/) are
  called from here; none of them imports the trainer.
"""

import functools

import torch
from datasets import Dataset, IterableDataset

from . import forward_choice, metrics
from .auto import AutoKeepProbs
from .config import AUTO, PrunedDPOConfig, uses_pruned_forward
from .errors import TrainingDiverged
from .forward_choice import ForwardChoice
from .method import attention
from .method.masks import PruneMasks, draw_masks, mask_generator
from .notices import checkpointing_names_quiet, trl_padding_free_notice_hidden
from .pruned_forward import masks_to, pruned_forward, reference_log_probs, reference_sums
from .reference import HOST_KEY, REF_TOKEN_COLUMNS, REF_TOKEN_KEY, host_batch, precompute_per_token, pruned_collator
from .safety import checkpoints, guards
from .safety.data_checks import check_training_pairs
from .safety.run_state import RunState
from .sampler import prompt_group_sampler
from .seam import (
    DPOTrainer, Replay, as_pruned_config, logging_window, restore_logging_window, run_output_dir, train_metrics,
    trl_loss, without_tied_keys,
)


def _before_train(trainer, resume_from_checkpoint):
    """The run state a `train()` starts from (safety/): the checkpoint to resume (said where it needs a note), the
    guard's, auto's and the logging window's state from it; the checks and warnings of pruned training."""
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
    return resume


class PrunedDPOTrainer(DPOTrainer):
    """DPO with stochastic pruning of the computation graph. Same constructor as `trl.DPOTrainer`.

    `args` must be a [`PrunedDPOConfig`]; its pruning fields choose what is pruned. Read-only views of its state:
    `forward_choice` (which forward trains, and why), `last_micro_step` (the last training micro-step's masks and
    work counts; `last_prune_stats` its counts), `run_state` (resume, divergence guard, stop request) and
    `auto_keep_probs` (what "auto" measured and chose, or None).
    """

    _tag_names = ["trl", "dpo", "trl-pruned-dpo"]
    # The plugin's forward even with every pruning and saving off: the benchmarks' `none` row (its machinery at
    # identity). Not for training: pruning off is TRL's own path by design.
    always_pruned_forward = False

    def __init__(self, model, ref_model=None, args: PrunedDPOConfig | None = None, *pargs, **kwargs):
        args = as_pruned_config(model, args, PrunedDPOConfig)
        # A no-op without an accelerator, but torch warns at every loader.
        if args.dataloader_pin_memory and not torch.accelerator.is_available():
            args.dataloader_pin_memory = False
        train_dataset = kwargs.get("train_dataset", pargs[1] if len(pargs) > 1 else None)
        processing_class = kwargs.get("processing_class", pargs[3] if len(pargs) > 3 else None)
        # Refuse what the pruned forward cannot do, before TRL's precompute runs.
        self._forward_choice = forward_choice.before_trl(args, train_dataset, processing_class,
                                                         self.always_pruned_forward)
        self.run_state, self.last_micro_step, self._auto, self._mask_step = RunState(), None, None, (-1, 0)
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
            self._auto = AutoKeepProbs(args, policy.config, self, adapters=is_peft_model(policy))
            # It reads the gradient norms of each step (auto.py).
            self.add_callback(self._auto)

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
        return self.last_micro_step.counts if self.last_micro_step is not None else {}

    # ----------------------------------------------------------------------------------------------------------- data
    def _get_train_sampler(self, train_dataset=None):
        """`group_by_prompt`: a prompt's pairs in one micro-batch (sampler.py); otherwise TRL's own sampler."""
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        sampler = prompt_group_sampler(self.args, dataset, self._train_batch_size)
        return sampler if sampler is not None else super()._get_train_sampler(train_dataset)

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

        def log_probs(model, batch, scored):
            return reference_log_probs(self, model, batch, scored, self._layout(batch), {})

        return precompute_per_token(self, dataset, batch_size, log_probs, functools.partial(reference_sums, self))

    # ----------------------------------------------------------------------------------------------- plan: the masks
    def draw_masks(self, inputs, options: dict, generator: torch.Generator) -> PruneMasks:
        """This micro-step's masks under `options` (`masks.draw_masks`'s sampling keywords, "auto" ones chosen), drawn
        on the host from the batch's token layout (no device sync) with `generator`, keyed by (prune_seed, global
        step, micro-step, rank): resuming draws the same masks. A subclass may draw its own (evaluation/prototypes.py).
        """
        host = host_batch(inputs)
        return draw_masks(host.input_ids, host.completion_mask, **options, generator=generator,
                          attention_mask=host.attention_mask)

    def _draw(self, inputs) -> tuple[tuple[int, int], dict, PruneMasks]:
        """(global step, micro-step), the options and the host copy of the masks of this micro-step's draw."""
        step = self.state.global_step
        self._mask_step = (step, self._mask_step[1] + 1 if self._mask_step[0] == step else 0)
        options = self.args.mask_options()
        if self._auto is not None:
            options = self._auto.options(inputs, options, *self._mask_step)
        generator = mask_generator(self.args.prune_seed, *self._mask_step, self.accelerator.process_index)
        return self._mask_step, options, masks_to(self.draw_masks(inputs, options, generator), "cpu")

    def _layout(self, inputs) -> tuple[bool, bool]:
        """(packed, share) for this batch. The first packed batch of a family outside the tested table is checked
        first (also when it is the reference precompute's): the forward choice's one change."""
        if self._forward_choice.layout(inputs)[0] and self._forward_choice.unproven:
            self._forward_choice = forward_choice.check_first_batch(self._forward_choice, self, inputs)
        packed, share = self._forward_choice.layout(inputs)
        # Kept until the trainer's next stock forward: checkpointing recomputes in the backward.
        if packed:
            attention.use_packed(self._forward_choice.models)
        return packed, share

    # ------------------------------------------------------------------------------------------ execute: the forwards
    def concatenated_forward(self, model, inputs) -> tuple[dict[str, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """The pruned forward of the [chosen; rejected] batch (pruned_forward.py): the policy's per-token outputs as
        inverse-probability-weighted terms whose row sums are unbiased for the full sums (Eqs. 1-3), and the
        reference's per-branch sums (chosen, rejected) under the same masks. Keeps the micro-step's record in
        `last_micro_step`."""
        step, options, masks = self._draw(inputs)
        if self.args.branch_keep_prob == AUTO:
            # With "auto", this step's: none where it keeps every branch (auto.py).
            prunes_branches = self._auto.prunes_branches
        else:
            prunes_branches = self.args.branch_keep_prob < 1
        done = pruned_forward(self, model, inputs, masks, self._layout(inputs), prunes_branches)
        run_means = self._auto.run_means(options, inputs["input_ids"].size(0) // 2) if self._auto else []
        self.last_micro_step = metrics.MicroStepRecord(step, options, done.masks, done.counts, done.aux_loss,
                                                       run_means, self._forward_choice.share_prompt)
        return done.per_token, done.reference

    # --------------------------------------------------------------------------------------- estimate: TRL's loss
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # Evaluation, and pruning off: TRL's own path, with the attention each model was loaded with (attention.py).
        if not self.model.training or not self._forward_choice.pruned:
            if self._forward_choice.packed:
                attention.use_packed(self._forward_choice.models, packed=False)
            inputs = {k: v for k, v in inputs.items() if k not in (REF_TOKEN_KEY, HOST_KEY)}
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        return self._pruned_loss(model, inputs, return_outputs)

    def _pruned_loss(self, model, inputs, return_outputs=False):
        """The pruned training loss: TRL's `_compute_loss` on the estimates, through the replay seam (seam.Replay)."""
        if return_outputs:
            raise ValueError("PrunedDPOTrainer does not return model outputs during training (TRL deprecated them).")
        per_token, (ref_chosen, ref_rejected) = self.concatenated_forward(model, inputs)
        record = self.last_micro_step
        batch = {k: v for k, v in inputs.items() if k != REF_TOKEN_KEY}
        # The reference: the batch's.
        batch["ref_chosen_logps"], batch["ref_rejected_logps"] = ref_chosen, ref_rejected
        loss = trl_loss(self, Replay(aux_loss=record.aux_loss, **per_token), batch)
        metrics.log_pruned_metrics(record, per_token, self.args, train_metrics(self), self._pending)
        if self._auto is not None:
            self._auto.add_work(record.counts)
        return loss

    # -------------------------------------------------------------------------------- resume and failures (safety/)
    # The stop-signal flag rides on the step's one fused read (guards.check_step).
    reads_stop_signal = True

    def train(self, resume_from_checkpoint=None, *pargs, **kwargs):
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
            # Each model's own attention back (attention.py).
            if self._forward_choice.packed:
                attention.use_packed(self._forward_choice.models, packed=False)
        if self.run_state.diverged is not None:
            raise TrainingDiverged(self.run_state.diverged)
        return output

    def evaluate(self, *pargs, **kwargs):
        with checkpointing_names_quiet():
            return super().evaluate(*pargs, **kwargs)

    def predict(self, *pargs, **kwargs):
        with checkpointing_names_quiet():
            return super().predict(*pargs, **kwargs)

    def _issue_warnings_after_load(self, load_result):
        # A resume: a tied head is not missing (seam.py).
        super()._issue_warnings_after_load(without_tied_keys(self.accelerator.unwrap_model(self.model), load_result))

    def training_step(self, model, inputs, num_items_in_batch=None):
        # The first micro-step after a resume reopens the logging window.
        window = self.run_state.take_window()
        if window is not None:
            self.run_state.restored_logging_window = restore_logging_window(self, window)
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.run_state.add_loss(loss)
        return loss

    def _maybe_log_save_evaluate(self, tr_loss, grad_norm, *pargs, **kwargs):
        # An optimizer step just ended: check it before it is logged or saved.
        self.run_state.end_step(self, grad_norm, run_output_dir(self))
        super()._maybe_log_save_evaluate(tr_loss, grad_norm, *pargs, **kwargs)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        # The plugin's metrics, read once per logging step (every process logs together).
        self._pending.flush(train_metrics(self))
        super().log(logs, start_time)

    def _save_checkpoint(self, model, trial):
        """TRL's checkpoint, then the run state and the completion marker (safety/checkpoints.py)."""
        # The logging window saved below holds values, not device counts.
        self._pending.flush(train_metrics(self))
        state = {"window": logging_window(self, self._pending.deferred), **self.run_state.state_dict(),
                 "auto": self._auto.state_dict() if self._auto is not None else None}
        checkpoints.save_complete(self, super()._save_checkpoint, model, trial, state, run_output_dir(self, trial))
