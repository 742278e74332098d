"""`PrunedDPOTrainer`: TRL's `DPOTrainer` with a pruned forward of the [chosen; rejected] batch.

How it departs from stock TRL 1.16 (whose `_compute_loss` does one policy forward of the stacked batch, one reference
forward, then the loss and metrics), in the order of docs/method.md:

- `concatenated_forward` plans on the host (method/masks.py draws the masks, method/plan.py lays out the rows), executes
  on the device (method/execute.py: the backpropagated rows with grad, the others under `torch.no_grad()`, scoring only
  kept positions through TRL's own fused LM head), and returns inverse-probability-weighted per-token terms
  (method/estimators.py) for the policy, and the reference's sums under the same masks.
- `compute_loss` hands those terms to TRL's own `_compute_loss` through a replay "model" (seam.Replay), so every TRL
  loss, `ld_alpha`, `use_weighting` and every TRL metric run unchanged on unbiased estimates of what they consume;
  metrics.py then renames what no longer estimates stock's value.
- Evaluation is never pruned: it is TRL's own path. So is training whenever `uses_pruned_forward(args)` is false
  (pruning off): a drop-in by construction (docs/parity.md).
- `auto` keep probabilities (auto.py), per-token reference precompute (reference.py) and run-safety (safety/) are
  called from here; none of them imports the trainer.
"""

import dataclasses
import warnings

import torch
from accelerate.utils import is_peft_model
from datasets import Dataset, IterableDataset

from . import metrics
from .auto import AutoKeepProbs
from .config import AUTO, EXACT_SAVINGS, PrunedDPOConfig, uses_pruned_forward
from .errors import TrainingDiverged
from .notices import checkpointing_names_quiet, trl_padding_free_notice_hidden
from .method.estimators import horvitz_thompson, scale_branch_gradient
from .method import attention
from .method.execute import packed_against_padded, run_group
from .method.masks import PruneMasks, draw_masks, mask_generator
from .method.plan import plan_policy, plan_reference, work_counts
from .reference import (
    HOST_KEY, NON_MODEL_KEYS, REF_TOKEN_COLUMNS, REF_TOKEN_KEY, host_batch, precompute_per_token, pruned_collator,
)
from .safety import checkpoints, guards
from .sampler import prompt_group_sampler
from .safety.data_checks import VISION_ERROR, check_prunable, check_training_pairs
from .seam import (
    DPOTrainer, Replay, as_pruned_config, check_compact_lm_head, compact_lm_head, logging_window, no_grad_block,
    reference_context, restore_logging_window, trl_loss, without_tied_keys,
)

# Batch keys the packed forward knows how to pack; any other per-token input makes it run padded.
_SHAREABLE_KEYS = {"input_ids", "attention_mask"} | NON_MODEL_KEYS


def _masks_to(masks: PruneMasks, device) -> PruneMasks:
    """The masks on `device` (a copy; a no-op for tensors already there)."""
    return PruneMasks(**{f.name: getattr(masks, f.name).to(device, non_blocking=True)
                         for f in dataclasses.fields(masks)})


def _without_savings(args, why: ValueError | str) -> str | None:
    """The exact savings cannot run. A refusal (ValueError) is raised where an estimator is on; otherwise one line
    says why and what runs instead: with only the savings on, TRL's own forward (returns why), else the plugin's
    padded rows (None)."""
    if isinstance(why, ValueError) and args.pruning_enabled:
        raise why
    stock = not args.pruning_enabled
    wanted = " and ".join(name for name in EXACT_SAVINGS if getattr(args, name, False))
    then = "TRL's own forward runs (exact; pruning is off)" if stock else "Training runs padded rows (exact, slower)"
    warnings.warn(f"{wanted} ignored: {str(why).rstrip('.')}. {then}.", stacklevel=4)
    return str(why) if stock else None


def _before_train(trainer, resume_from_checkpoint):
    """The run state a `train()` starts from (safety/): the checkpoint to resume (said where it needs a note), the
    guard's, auto's and the logging window's state from it; the checks and warnings of pruned training."""
    from transformers.utils import logging

    args = trainer.args
    if trainer.train_dataset is not None and trainer._uses_pruned_forward:  # pruning off: stock's own error
        guards.check_not_empty(trainer.train_dataset, args)
    resume, note = checkpoints.resolve_resume(resume_from_checkpoint, args)
    if note and trainer.is_world_process_zero():
        logging.get_logger(__name__).warning(note)
    trainer.resumed_from, trainer.restored_logging_window = resume, False
    trainer._step_loss, trainer._diverged = None, None
    trainer._pending_run_state = checkpoints.read_run_state(resume, args.process_index) if resume else None
    if trainer._auto_probs is not None:  # its statistics and choice: a resume draws the masks of no resume
        trainer._auto_probs.load_state_dict((trainer._pending_run_state or {}).get("auto"))
    trainer.divergence_guard = guards.DivergenceGuard.from_run_state(trainer._pending_run_state, args.divergence_factor)
    if trainer._uses_pruned_forward:  # pruning off: stock says nothing
        guards.warn_before_training(args)
    metrics.discard_pending(trainer)
    return resume


class PrunedDPOTrainer(DPOTrainer):
    """DPO with stochastic pruning of the computation graph. Same constructor as `trl.DPOTrainer`.

    `args` must be a [`PrunedDPOConfig`]; its pruning fields choose what is pruned. After each training micro-step,
    `last_prune_stats` holds the raw counts of the work done (tokens executed, positions scored, rows backpropagated).
    """

    _tag_names = ["trl", "dpo", "trl-pruned-dpo"]

    def __init__(self, model, ref_model=None, args: PrunedDPOConfig | None = None, *pargs, **kwargs):
        args = as_pruned_config(model, args, PrunedDPOConfig)
        if args.dataloader_pin_memory and not torch.accelerator.is_available():
            args.dataloader_pin_memory = False  # a no-op without an accelerator, but torch warns at every loader
        train_dataset = kwargs.get("train_dataset", pargs[1] if len(pargs) > 1 else None)
        self._stock_reason = None  # why a run with only the exact savings on is TRL's own (they need what it lacks)
        if uses_pruned_forward(args):  # refuse what the pruned forward cannot do, before TRL's precompute runs
            processing_class = kwargs.get("processing_class", pargs[3] if len(pargs) > 3 else None)
            try:
                check_prunable(args, train_dataset, processing_class)
            except ValueError as refusal:
                self._stock_reason = _without_savings(args, refusal)
            check_compact_lm_head()
        self.last_prune_stats: dict[str, int] = {}
        self._mask_step = (-1, 0)  # (global step, micro-step) of the last draw
        self._grad_rows_aux_loss = self._auto_probs = None  # the MoE router loss of the grad rows; "auto" (auto.py)
        with trl_padding_free_notice_hidden(uses_pruned_forward(args) and args.padding_free):  # the plugin says it
            super().__init__(model, ref_model, args, *pargs, **kwargs)
        if self._uses_pruned_forward:
            check_training_pairs(self, train_dataset)  # degenerate and truncated pairs: warn, or refuse (one rank)
            if self._is_vision_dataset:  # a processor not passed in (loaded by TRL): known only now
                self._stock_reason = _without_savings(args, ValueError(VISION_ERROR))
        self._share_backend = self._shared_prompt_backend() if self._uses_pruned_forward else None  # (or stock)
        if self._uses_pruned_forward:
            self.data_collator = pruned_collator(self.data_collator, args, self.train_dataset)
        if args.auto_keep_probs:
            self._auto_probs = AutoKeepProbs(args, self.accelerator.unwrap_model(self.model).config, self)
            self.add_callback(self._auto_probs)  # it reads the gradient norms of each step (auto.py)

    @property
    def _uses_pruned_forward(self) -> bool:
        return uses_pruned_forward(self.args) and self._stock_reason is None

    # ----------------------------------------------------------------------------------------------------------- data
    def _get_train_sampler(self, train_dataset=None):
        """`group_by_prompt`: a prompt's pairs in one micro-batch (sampler.py); otherwise TRL's own sampler."""
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        sampler = prompt_group_sampler(self.args, dataset, self._train_batch_size)
        return sampler if sampler is not None else super()._get_train_sampler(train_dataset)

    def _set_signature_columns_if_needed(self):
        super()._set_signature_columns_if_needed()
        if self._uses_pruned_forward:  # keep the per-token reference columns (once, however often it is called)
            missing = [c for c in REF_TOKEN_COLUMNS if c not in self._signature_columns]
            self._signature_columns = list(self._signature_columns) + missing

    def _precompute_ref_logps(self, dataset: Dataset, name: str, batch_size: int) -> Dataset:
        """With pruning on, also stores the per-token reference log-probs beside their sums (the masks need them:
        reference.py). With pruning off, and for what TRL rejects (an IterableDataset), it is TRL's own."""
        if not self._uses_pruned_forward or isinstance(dataset, IterableDataset):
            return super()._precompute_ref_logps(dataset, name, batch_size)
        return precompute_per_token(self, dataset, batch_size)

    # ----------------------------------------------------------------------------------------------- plan: the masks
    def _mask_options(self, inputs=None) -> dict:
        """The sampling probabilities of this micro-batch's draw, as `masks.draw_masks` takes them: the config's, with
        any "auto" one chosen by `auto.AutoKeepProbs` (per-pair for branches) before the draw it weights."""
        args = self.args
        options = dict(position_keep_prob=args.position_keep_prob, prefix_prune_prob=args.prefix_prune_prob,
                       prefix_min_ratio=args.prefix_min_ratio, branch_keep_prob=args.branch_keep_prob,
                       branch_sampling=args.branch_sampling, drop_common_prefix=args.prune_common_prefix)
        if self._auto_probs is not None and inputs is not None:
            options = self._auto_probs.options(self, inputs, options, *self._mask_step)
        return options

    def _prunes_branches(self) -> bool:
        """Whether branch pruning can drop rows (a structural choice, the same on every process; with "auto", this
        step's: none where it keeps every branch, auto.py)."""
        if self.args.branch_keep_prob == AUTO:
            return self._auto_probs.prunes_branches
        return self.args.branch_keep_prob < 1

    def _draw_masks(self, inputs) -> PruneMasks:
        """This micro-step's masks, drawn on the host from the batch's token layout (no device sync), from a generator
        keyed by (prune_seed, global step, micro-step, rank): resuming draws the same masks."""
        host = host_batch(inputs)
        step = self.state.global_step
        micro = self._mask_step[1] + 1 if self._mask_step[0] == step else 0
        self._mask_step = (step, micro)
        generator = mask_generator(self.args.prune_seed, step, micro, self.accelerator.process_index)
        return draw_masks(host.input_ids, host.completion_mask, **self._mask_options(inputs), generator=generator,
                          attention_mask=host.attention_mask)

    _packed = False  # whether the forward runs packed (padding_free / share_prompt on a model the packed path takes)
    _unproven: list = []  # models whose family no test proves exact: checked on the first packed batch

    def _shared_prompt_backend(self) -> str | None:
        """The layout, once: packed (`padding_free`/`share_prompt` on models `attention.packed_verdict` allows; a family
        outside the tested table only after `_check_packed` agrees on the first batch) or padded (said once). Returns
        the packed attention when prompts are shared, else None."""
        args = self.args
        if self.aux_loss_enabled and args.prune_common_prefix:  # exact by claim, and it could not be: refuse
            raise ValueError("prune_common_prefix cannot be exact with the MoE router auxiliary loss "
                             "(output_router_logits=True): stock's router loss counts every token of every row, and "
                             "the common prefix's rows and positions do not run; turn one of them off.")
        if not any(getattr(args, name, False) for name in EXACT_SAVINGS):
            return None
        models = [self.accelerator.unwrap_model(m) for m in (self.model, self.ref_model) if m is not None]
        models = [m.get_base_model() if is_peft_model(m) else m for m in models]
        verdicts = [attention.packed_verdict(model) for model in models]
        reason = next((v for v in verdicts if v not in (None, attention.CHECK)), None)
        if self.aux_loss_enabled and not reason:  # stock's router loss counts every padded row's tokens; a packed row
            reason = "the MoE router auxiliary loss needs the padded batch"  # counts a shared prompt once
            if args.pruning_enabled:
                reason += " (with pruning on, the router loss is the backpropagated rows' own, over their tokens run)"
        if reason:
            self._stock_reason = _without_savings(args, reason)
            return None
        self._packed, self._packed_models = True, models
        self._unproven = [m for m, v in zip(models, verdicts) if v == attention.CHECK]
        return attention.PACKED if args.share_prompt else None

    def _check_packed(self, inputs) -> None:
        """Once, on the first packed batch, for a family outside the tested table: the packed and the padded per-token
        log-probs of a few pairs, no grad; packed from then on only if they agree to round-off (1e-4 in float32, 5e-2
        in half precision, absolute), else one line naming the largest difference and padded (or stock's) forwards.
        Every process runs it and takes the worst (the same layout everywhere)."""
        unproven, self._unproven = self._unproven, []
        host, share = host_batch(inputs), self._share_backend is not None

        def no_grad():  # no grad, no checkpointing, TRL's head on the labelled positions only
            stack = no_grad_block(self.model, self.args.gradient_checkpointing_kwargs)
            stack.enter_context(compact_lm_head())
            return stack

        worst, where, failure = torch.zeros((), device=inputs["input_ids"].device), "", None
        for model in unproven:
            try:
                difference = packed_against_padded(model, self._packed_models, host, inputs, share, NON_MODEL_KEYS,
                                                   no_grad)
            except Exception as error:  # noqa: BLE001 - a model the packed forward cannot run: padded, said why
                failure, where = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}", \
                    model.config.model_type
                worst = torch.full_like(worst, float("inf"))
                break
            if difference > worst:
                worst, where = difference, model.config.model_type
        worst = self.accelerator.reduce(worst, reduction="max")
        tolerance = 1e-4 if next(unproven[0].parameters()).dtype in (torch.float32, torch.float64) else 5e-2
        if float(worst) <= tolerance:
            return
        self._packed, self._share_backend = False, None
        attention.use_packed(self._packed_models, packed=False)
        found = (f"the packed forward failed ({failure})" if failure else
                 f"the packed per-token log-probs differ from the padded ones by {float(worst):.2g} (> {tolerance:g})")
        self._stock_reason = _without_savings(self.args, f"its family ({where or 'on another process'}) is not one a "
                                              f"test proves exact, and on the first batch {found}")

    def _layout(self, inputs) -> tuple[bool, bool]:
        """(packed, share) for this batch: a batch with per-token inputs other than token ids runs padded."""
        packed = self._packed and not (set(inputs) - _SHAREABLE_KEYS)
        if packed and self._unproven:  # the first packed batch of a family outside the tested table (also when it is
            self._check_packed(inputs)  # the reference precompute's)
            packed = self._packed
        if packed:  # kept until the trainer's next stock forward: checkpointing recomputes in the backward
            attention.use_packed(self._packed_models)
        return packed, packed and self._share_backend is not None

    # ------------------------------------------------------------------------------------------ execute: the forwards
    def _reference_log_probs(self, model, inputs, scored: torch.Tensor):
        """Per-token reference log-probs (rows, cols) on the `scored` positions, 0 elsewhere; never backpropagated."""
        packed, share = self._layout(inputs)
        group = plan_reference(host_batch(inputs), scored.cpu(), share, packed)
        with reference_context(self.model, self.accelerator.unwrap_model(self.model), self.ref_model,
                               self.args.gradient_checkpointing_kwargs), compact_lm_head():
            outputs, _ = run_group(model, group, ("log_probs",), inputs, NON_MODEL_KEYS)
        self._count("reference_tokens_executed", group.tokens)
        self._count("reference_positions_scored", group.scored)
        return outputs["log_probs"].float()

    def _reference_sums(self, inputs, per_token: torch.Tensor):
        """Per-branch reference sums from per-token values, through TRL's own `compute_ref_log_probs` (ld_alpha)."""
        return DPOTrainer.compute_ref_log_probs(self, Replay(log_probs=per_token), inputs)

    def _policy_forwards(self, model, inputs, masks: PruneMasks, fields):
        """The policy forwards of the plan: per-token outputs of the grad group on the grid, and a function running the
        frozen group (in the micro-step's one no-grad block) that returns its outputs on the grid, or None."""
        packed, share = self._layout(inputs)
        grad_cost = 4.0 if self.args.gradient_checkpointing else 3.0  # forward + backward (+ recompute), Eq. in method
        plan = plan_policy(host_batch(inputs), masks, frozen_group=self._prunes_branches(), grad_cost=grad_cost,
                           share=share, packed=packed)
        # MoE (padded only): the router aux loss is the grad rows' own, over their executed columns (docs/parity.md)
        router = {"output_router_logits": True} if self.aux_loss_enabled else {}
        per_token, outputs = run_group(model, plan.grad, fields, inputs, NON_MODEL_KEYS, **router)
        if router:
            self._grad_rows_aux_loss = outputs.aux_loss * (1.0 if plan.grad.scored else 0.0)
        counts = (("policy_tokens_executed", plan.grad.tokens), ("grad_tokens_executed", plan.grad.tokens),
                  ("shared_pairs", plan.shared_pairs), ("split_pairs", plan.split_pairs))
        for name, value in counts[: 4 if share else 2]:
            self._count(name, value)

        def run_frozen():
            if plan.frozen is None:
                return None
            self._count("policy_tokens_executed", plan.frozen.tokens)
            return run_group(model, plan.frozen, fields, inputs, NON_MODEL_KEYS)[0]

        return per_token, run_frozen

    def concatenated_forward(self, model, inputs) -> tuple[dict[str, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """The pruned forward of the [chosen; rejected] batch.

        Returns the policy's per-token outputs (log-probs and TRL's metric fields) as inverse-probability-weighted
        terms whose row sums are unbiased for the full sums (Eqs. 1-2), with the straight-through branch scaling
        applied to the log-probs (Eq. 3), and the reference's per-branch sums (chosen, rejected) under the same masks.

        Plan on the host (masks, layout), then execute: the backpropagated forward first, then every no-grad forward
        (frozen branches, reference) in one block, so gradient checkpointing is toggled at most once per micro-step.
        """
        masks = _masks_to(self._draw_masks(inputs), "cpu")  # the host copy the plan reads
        self.last_prune_stats = {}
        response = inputs["completion_mask"][:, 1:].bool()
        fields = ("log_probs", "entropy", "mean_logits", "is_top1") + (
            ("log_sum_sq_probs",) if self.use_weighting else ()
        )
        with compact_lm_head():
            per_token, run_frozen = self._policy_forwards(model, inputs, masks, fields)
            on_device = _masks_to(masks, response.device)  # once: the reference estimate and the policy's
            with no_grad_block(self.model, self.args.gradient_checkpointing_kwargs):
                frozen = run_frozen()
                reference = self._pruned_reference(model, inputs, masks, on_device)
        if frozen is not None:  # the groups fill disjoint cells (zero elsewhere); combined outside no_grad
            for f in fields:
                per_token[f] = per_token[f] | frozen[f] if f == "is_top1" else per_token[f] + frozen[f]

        for f in fields:
            if f != "is_top1":
                per_token[f] = horvitz_thompson(per_token[f].float(), on_device.weights)
        per_token["is_top1"] = per_token["is_top1"].bool() & on_device.scored
        if self._prunes_branches():
            per_token["log_probs"] = scale_branch_gradient(per_token["log_probs"], on_device.branch_scale)

        for name, value in work_counts(host_batch(inputs), masks).items():
            self._count(name, value)
        self._last_masks = on_device
        return per_token, reference

    def _pruned_reference(self, model, inputs, masks: PruneMasks, on_device: PruneMasks):
        """Reference sums under the policy's masks (`prune_reference`), or exact sums over every kept position;
        `masks` are the host copy (the plan reads them), `on_device` the same masks where the estimate is made."""
        prune = self.args.prune_reference
        weights, exact = on_device.weights, on_device.exact
        if self.precompute_ref_logps:
            if not prune and not self.args.prune_common_prefix:
                return inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]
            stored = inputs[REF_TOKEN_KEY].to(weights.device)
            return self._reference_sums(inputs, horvitz_thompson(stored, weights if prune else exact.float()))
        reference_model = self.ref_model if self.ref_model is not None else self.model
        if prune:
            per_token = self._reference_log_probs(reference_model, inputs, masks.scored)
            return self._reference_sums(inputs, horvitz_thompson(per_token, weights))
        per_token = self._reference_log_probs(reference_model, inputs, masks.exact)
        return self._reference_sums(inputs, per_token * exact)

    # --------------------------------------------------------------------------------------- estimate: TRL's loss
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not self.model.training or not self._uses_pruned_forward:  # evaluation, and pruning off: TRL's own path
            if self._packed:  # the attention each model was loaded with (attention.py)
                attention.use_packed(self._packed_models, packed=False)
            inputs = {k: v for k, v in inputs.items() if k not in (REF_TOKEN_KEY, HOST_KEY)}
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        return self._pruned_loss(model, inputs, return_outputs)

    def _pruned_loss(self, model, inputs, return_outputs=False):
        """The pruned training loss: TRL's `_compute_loss` on the estimates, through the replay seam (seam.Replay)."""
        if return_outputs:
            raise ValueError("PrunedDPOTrainer does not return model outputs during training (TRL deprecated them).")
        per_token, (ref_chosen, ref_rejected) = self.concatenated_forward(model, inputs)
        batch = {k: v for k, v in inputs.items() if k != REF_TOKEN_KEY}
        batch["ref_chosen_logps"], batch["ref_rejected_logps"] = ref_chosen, ref_rejected
        loss = trl_loss(self, Replay(aux_loss=self._grad_rows_aux_loss, **per_token), batch)  # reference: the batch's
        metrics.relabel_stock_metrics(self, metrics.log_pruned_metrics(self, per_token))
        return loss

    def _count(self, name: str, value: int):
        self.last_prune_stats[name] = self.last_prune_stats.get(name, 0) + int(value)

    # -------------------------------------------------------------------------------- resume and failures (safety/)
    resumed_from: str | None = None  # the checkpoint the last `train()` resumed from
    restored_logging_window = False  # whether its partial logging window was restored (else logs restart there)
    divergence_guard: guards.DivergenceGuard | None = None
    reads_stop_signal = True  # the stop-signal flag rides on the step's one fused read (guards.check_step)
    _step_loss = _diverged = _pending_run_state = None
    _defer_metrics = False  # inside `train()`: metrics are read at the logging step (metrics.flush)

    def train(self, resume_from_checkpoint=None, *pargs, **kwargs):
        """TRL's `train`, resuming only from a complete checkpoint with this run's pruning settings (`True`: the newest
        complete one; a stock checkpoint resumes with a note), warning about settings that should alarm, and stopping
        a diverging run (safety/). Raises `errors.ResumeError` and `errors.TrainingDiverged`, each one line."""
        resume = _before_train(self, resume_from_checkpoint)
        self._defer_metrics = True
        try:
            with checkpointing_names_quiet():  # TRL's calls of transformers' deprecated names (notices.py)
                output = super().train(resume, *pargs, **kwargs)
        finally:
            self._defer_metrics = False
            if self._packed:  # each model's own attention back (attention.py)
                attention.use_packed(self._packed_models, packed=False)
        if self._diverged is not None:
            raise TrainingDiverged(self._diverged)
        return output

    def evaluate(self, *pargs, **kwargs):
        with checkpointing_names_quiet():  # as in `train`
            return super().evaluate(*pargs, **kwargs)

    def predict(self, *pargs, **kwargs):
        with checkpointing_names_quiet():  # as in `train`
            return super().predict(*pargs, **kwargs)

    def _issue_warnings_after_load(self, load_result):  # a resume: a tied head is not missing (seam.py)
        super()._issue_warnings_after_load(without_tied_keys(self.accelerator.unwrap_model(self.model), load_result))

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self._pending_run_state is not None:  # first micro-step after a resume: reopen the logging window
            self.restored_logging_window = restore_logging_window(self, self._pending_run_state.get("window") or {})
            self._pending_run_state = None
        loss = super().training_step(model, inputs, num_items_in_batch)
        self._step_loss = loss.detach() if self._step_loss is None else self._step_loss + loss.detach()
        return loss

    def _maybe_log_save_evaluate(self, tr_loss, grad_norm, *pargs, **kwargs):
        if self._step_loss is not None:  # an optimizer step just ended: check it before it is logged or saved
            loss, self._step_loss = self._step_loss, None
            self._diverged = guards.check_step(self, loss, grad_norm) or self._diverged
        super()._maybe_log_save_evaluate(tr_loss, grad_norm, *pargs, **kwargs)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        metrics.flush(self)  # the plugin's metrics, read once per logging step (every process logs together)
        super().log(logs, start_time)

    def _save_checkpoint(self, model, trial):
        """TRL's checkpoint, then the run state and the completion marker (safety/checkpoints.py)."""
        metrics.flush(self)  # the logging window saved below holds values, not device counts
        state = {"window": logging_window(self, self._defer_metrics), "guard": self.divergence_guard.state_dict(),
                 "auto": self._auto_probs.state_dict() if self._auto_probs is not None else None}
        checkpoints.save_complete(self, super()._save_checkpoint, model, trial, state)
