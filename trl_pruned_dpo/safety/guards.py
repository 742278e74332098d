"""Numbers that should alarm: settings that make the estimate useless, and a run that diverges.

- Before training (`pretraining_warnings`): the largest inverse-probability weight the sampling can produce
  (docs/method.md, Eqs. 1-3: 1 / (p_pos * q_min) for a scored token, times 1 / p_br for its gradient) above
  `MAX_INVERSE_WEIGHT`, and `beta = 0` (the loss no longer depends on the policy: no gradient).
- During training (`DivergenceGuard`): a non-finite loss or gradient norm stops the run before that step is
  checkpointed, naming the last good checkpoint. On by default only when the pruned forward is used
  (`stop_on_divergence` unset); with every pruning off it is off, as stock trains on. A step `divergence_factor` times
  the median of the steps before it stops the run only when that field is set: a saturating DPO loss (median ~1e-4)
  meets one ordinary hard batch (~0.7) as a 7000x "explosion". Stock Trainer logs hide a NaN loss
  (`logging_nan_inf_filter` replaces it by the running mean), so the check reads every step's own loss: one fused
  device->host read per optimizer step (loss, gradient norm, the stop-signal flag of safety/signals.py, and the
  loss scaler's skip), none when the guard is off and no signal handler needs it.
- fp16 with a loss scaler: a step the scaler skipped is not divergence. Its gradient overflowed at the scale it ran
  under, the scaler backed the scale off and nothing was updated (normal fp16 training). It stops the run only when
  its loss is non-finite (the forward overflowed: no loss scale fixes that) or it overflowed at a loss scale of
  `MIN_LOSS_SCALE` or less (the gradient overflows fp16 unscaled). The skip is seen two ways, either enough:
  accelerate's `optimizer_step_was_skipped` (a non-fused optimizer, DeepSpeed), and the loss scale after the
  optimizer step below the one the step ran under (the fused optimizers, transformers' default `adamw_torch_fused`,
  take the scaler's found-inf flag into their own kernel, so accelerate sees the step called and its flag stays
  False).
- The worst values seen (largest loss and gradient norm, non-finite, zero-gradient and skipped steps) are kept for the
  summary, and saved in checkpoints so that a resumed run reports the whole run's.
"""

import math
import statistics
import warnings
from typing import TYPE_CHECKING, Any

from ..config import AUTO, BRANCH_GRID, POSITION_GRID, uses_pruned_forward
from ..errors import EmptyTrainingSet
from . import checkpoints

if TYPE_CHECKING:
    import torch

    from ..config import PrunedDPOConfig

# Above this largest weight, a small batch mostly keeps nothing (zero gradient) and the rare kept term is multiplied
# by the weight: with keep probabilities 0.01 a measured run had 28 of 30 steps with gradient norm 0 and the others
# near 1,000. 20 is e.g. branch 0.25 with position 0.2; docs/cli.md "Failures and resume".
MAX_INVERSE_WEIGHT = 20.0
# Steps in the running median.
_HISTORY = 100
# A skipped step that ran at this loss scale or lower stops the run: its gradient overflows fp16 even unscaled, which no
# scale fixes, and the scaler would halve the scale towards 0 step after step. DeepSpeed's `min_loss_scale` and
# Megatron-LM's `--min-loss-scale` default to 1 for the same reason. From GradScaler's initial 2**16 a run gets there
# after 17 consecutive skips; a healthy run settles after a few, then skips one step in each growth interval.
MIN_LOSS_SCALE = 1.0


def check_not_empty(dataset: Any, args: "PrunedDPOConfig") -> None:
    """An empty training set makes the sampler fail with `num_samples=0`: say so. (Pairs all dropped by truncation
    are refused earlier, when the trainer is built: data_checks.py.)"""
    try:
        rows = len(dataset)
    except TypeError:
        # An IterableDataset: its length is unknown before iterating.
        return
    if not rows:
        raise EmptyTrainingSet("the training dataset has no rows: check the dataset and its train split.")


def largest_inverse_weight(args: "PrunedDPOConfig") -> float:
    """The largest weight the configured sampling gives a token's contribution to the gradient (Eqs. 1-3)."""
    # "auto" picks from its grid (auto.py): its smallest value bounds the weight
    position = min(POSITION_GRID) if args.position_keep_prob == AUTO else args.position_keep_prob
    branch = min(BRANCH_GRID) if args.branch_keep_prob == AUTO else args.branch_keep_prob
    weight = 1.0 / position / branch
    if args.prefix_prune_prob > 0:
        # q_t is smallest at the last token of the longest response: (1 - p) + p / (L - k0 + 1), k0 = ceil(r L)
        longest = getattr(args, "max_completion_length", None) or args.max_length or 1024
        span = longest - math.ceil(args.prefix_min_ratio * longest) + 1
        weight /= (1.0 - args.prefix_prune_prob) + args.prefix_prune_prob / max(span, 1)
    return weight


def pretraining_warnings(args: "PrunedDPOConfig") -> list[str]:
    """One sentence per setting that makes training meaningless or very noisy."""
    found = []
    weight = largest_inverse_weight(args)
    if weight > MAX_INVERSE_WEIGHT:
        found.append(
            f"the sampling gives inverse-probability weights up to {weight:.0f} (above {MAX_INVERSE_WEIGHT:.0f}): "
            f"most steps will keep nothing and the others carry {weight:.0f}x gradients. Raise the keep "
            "probabilities (position_keep_prob, branch_keep_prob) or lower prefix_prune_prob."
        )
    if args.beta == 0 and any(loss != "sft" for loss in args.loss_type):
        found.append("beta is 0: the DPO loss no longer depends on the policy and gives no gradient. Set beta > 0.")
    return found


def warn_before_training(args: "PrunedDPOConfig") -> None:
    for message in pretraining_warnings(args):
        warnings.warn(f"trl-pruned-dpo: {message}", UserWarning, stacklevel=3)


class DivergenceGuard:
    """Watches each optimizer step's loss and gradient norm; keeps the worst values seen."""

    def __init__(self, factor: float | None = None):
        # `divergence_factor`: with None, only non-finite values stop a run.
        self.factor = factor
        # The largest |loss|, as (step, value).
        self.worst_loss: tuple[int, float] | None = None
        self.worst_grad_norm: tuple[int, float] | None = None
        self.nonfinite_steps = 0
        self.zero_grad_steps = 0
        # Steps the fp16 loss scaler skipped (gradient overflow)
        self.skipped_steps = 0
        self.steps = 0
        self._losses: list[float] = []
        self._grad_norms: list[float] = []

    def observe(self, step: int, loss: float | None, grad_norm: float | None, skipped: bool = False,
                loss_scale: float | None = None) -> str | None:
        """Record one optimizer step; return why it diverged, or None if it looks sane.

        `skipped`: the fp16 loss scaler skipped the step (its gradient overflowed at `loss_scale`, the scale the step
        ran under, where known). Its gradient norm is the overflow's, not the model's, and nothing was updated: it is
        neither checked nor kept; the step diverged only if its loss is non-finite or `loss_scale` is at most
        `MIN_LOSS_SCALE`."""
        self.steps += 1
        problem = None
        if skipped:
            self.skipped_steps += 1
            grad_norm = None
        for name, value, history in (("loss", loss, self._losses), ("gradient norm", grad_norm, self._grad_norms)):
            if value is None:
                continue
            if not math.isfinite(value):
                problem = problem or f"{name} is {value}"
                continue
            size = abs(value)
            median = statistics.median(history) if history else 0.0
            if self.factor is not None and median > 0 and size > self.factor * median:
                problem = problem or (f"{name} {value:.3g} is {size / median:.0f}x the median of the steps before it "
                                      f"({median:.3g})")
            history.append(size)
            del history[:-_HISTORY]
        if skipped and problem is None and loss_scale is not None and loss_scale <= MIN_LOSS_SCALE:
            problem = (f"the fp16 loss scaler skipped it at loss scale {loss_scale:g}: its gradient overflows fp16 "
                       f"even unscaled (a scale of {MIN_LOSS_SCALE:g} or less), which no loss scale fixes")
        if problem is not None:
            self.nonfinite_steps += int(any(v is not None and not math.isfinite(v) for v in (loss, grad_norm)))
        if grad_norm == 0:
            self.zero_grad_steps += 1
        self._record_worst(step, loss, grad_norm)
        return problem

    def _record_worst(self, step: int, loss: float | None, grad_norm: float | None) -> None:
        def worse(current: tuple[int, float] | None, value: float | None) -> tuple[int, float] | None:
            if value is None:
                return current
            if current is None or not math.isfinite(value) or (math.isfinite(current[1]) and abs(value) > current[1]):
                return (step, abs(value) if math.isfinite(value) else value)
            return current

        self.worst_loss = worse(self.worst_loss, loss)
        self.worst_grad_norm = worse(self.worst_grad_norm, grad_norm)

    def summary(self) -> str | None:
        """'largest loss ... (step s), largest grad norm ... (step t)[, N of M steps with zero gradient]'."""
        if not self.steps:
            return None
        parts = []
        for label, worst in (("largest loss", self.worst_loss), ("largest grad norm", self.worst_grad_norm)):
            if worst is not None:
                parts.append(f"{label} {worst[1]:.4g} (step {worst[0]})")
        if self.nonfinite_steps:
            parts.append(f"{self.nonfinite_steps} of {self.steps} steps non-finite")
        if self.zero_grad_steps:
            parts.append(f"{self.zero_grad_steps} of {self.steps} steps with zero gradient")
        if self.skipped_steps:
            parts.append(f"{self.skipped_steps} of {self.steps} steps skipped by the fp16 loss scaler")
        return ", ".join(parts) or None

    @classmethod
    def from_run_state(cls, run_state: dict | None, factor: float | None = None) -> "DivergenceGuard":
        """A guard that continues the one saved in a checkpoint's run state (a new one if there is none)."""
        guard = cls(factor)
        if run_state and "guard" in run_state:
            guard.load_state_dict(run_state["guard"])
        return guard

    # Saved in each checkpoint (checkpoints.RUN_STATE) so that a resumed run reports the worst of the whole run.
    def state_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("worst_loss", "worst_grad_norm", "nonfinite_steps", "zero_grad_steps",
                                              "skipped_steps", "steps", "_losses", "_grad_norms")}

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, tuple(value) if key.startswith("worst") and value is not None else value)


def stops_on_divergence(args: "PrunedDPOConfig") -> bool:
    """`stop_on_divergence`, or when unset: whether the pruned forward is used (pruning off behaves as stock)."""
    value = getattr(args, "stop_on_divergence", None)
    return uses_pruned_forward(args) if value is None else bool(value)


def loss_scale(scaler: Any) -> "torch.Tensor | None":
    """The fp16 loss scale as the device tensor a `torch.amp.GradScaler` keeps (its private `_scale`: `get_scale()`
    would read it to the host, a sync), or None without an enabled scaler or before its first `scale()`. The scaler
    updates that tensor in place; the caller copies what it keeps. Pinned by tests/test_gpu_setups_safety.py (a real
    GradScaler's skip seen through it with the fused optimizer)."""
    # accelerate's scalers are GradScalers (FSDP's sharded one included); anything else is read as enabled
    if scaler is None or not getattr(scaler, "is_enabled", lambda: True)():
        return None
    return getattr(scaler, "_scale", None)


def step_values(accelerator: Any, world: int, loss: "torch.Tensor", grad_norm: "torch.Tensor | float | None",
                stop_requested: bool, scale_before: "torch.Tensor | None" = None
                ) -> tuple[float, float | None, bool, bool, float | None]:
    """This optimizer step's loss (mean over the `world` processes), gradient norm, whether any process was asked to
    stop, whether the fp16 loss scaler skipped the step, and the loss scale it ran under (`scale_before`, a device copy
    taken before the optimizer step; None without a scaler): one fused vector, one all-reduce (through the trainer's
    `accelerator`) when distributed, one device->host read.

    Skipped: accelerate says so (`optimizer_step_was_skipped`), or the scale after the step is below `scale_before`
    (the scaler backs off only on an overflow; it grows only after a run of good steps)."""
    import torch

    device = loss.device
    norm = grad_norm if isinstance(grad_norm, torch.Tensor) else torch.tensor(
        math.nan if grad_norm is None else float(grad_norm))
    # FSDP2's clip_grad_norm_ returns the (replicated) total norm as a DTensor.
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    flags = torch.tensor([float(stop_requested), float(accelerator.optimizer_step_was_skipped)], device=device)
    scale_after = loss_scale(accelerator.scaler)
    scales = (torch.stack([scale_before.reshape(()), scale_after.reshape(())]).float().to(device)
              if scale_before is not None and scale_after is not None else torch.full((2,), math.nan, device=device))
    values = torch.cat([loss.detach().float().reshape(1), norm.detach().float().reshape(1).to(device), flags, scales])
    if world > 1:
        values = accelerator.reduce(values, reduction="sum") / world
    loss_value, norm_value, stop, accelerate_skipped, before, after = values.tolist()
    skipped = accelerate_skipped > 0 or after < before
    return (loss_value, (None if grad_norm is None else norm_value), stop > 0, skipped,
            None if math.isnan(before) else before)


def check_step(trainer: Any, run_state: Any, loss: "torch.Tensor", grad_norm: "torch.Tensor | float | None",
               output_dir: str, scale_before: "torch.Tensor | None" = None) -> str | None:
    """An optimizer step just ended with `loss` (this process's, summed over its micro-steps): when the guard is on,
    record it in `run_state.divergence_guard` (a step the fp16 loss scaler skipped as such: `scale_before` is the loss
    scale it ran under, a device copy), and when it diverged stop training without checkpointing it (naming
    the last complete checkpoint under `output_dir`); when a stop signal reached any process (safety/signals.py,
    `run_state.stop_request`), stop with a checkpoint. Returns the one-line reason, or None.

    Reads nothing from the device when the guard is off and no signal needs agreeing on across processes; else one
    fused read (`step_values`), the same on every process, so every process takes the same decision."""
    args, control = trainer.args, trainer.control
    guard_on = stops_on_divergence(args)
    request = run_state.stop_request
    signalled = request is not None and request.signal_number is not None
    if not guard_on and (request is None or args.world_size == 1):
        # The signal callback decides alone in a single process.
        return None
    loss_value, norm, stop, skipped, scale = step_values(trainer.accelerator, args.world_size, loss, grad_norm,
                                                         signalled, scale_before)
    # A signal reached some process: all stop here, with a checkpoint of this step.
    if stop:
        control.should_training_stop = control.should_save = True
    if not guard_on:
        return None
    step = trainer.state.global_step
    # Only an fp16 loss scaler's skip is normal: DeepSpeed's bf16 optimizer also skips a step whose gradient norm is not
    # finite, with no scale to back off, and there it is divergence.
    skipped = skipped and bool(args.fp16)
    problem = run_state.divergence_guard.observe(step, loss_value, norm, skipped=skipped, loss_scale=scale)
    if problem is None:
        return None
    last = checkpoints.last_complete(output_dir)
    restart = f"resume from the last complete checkpoint, {last}" if last else "start again"
    control.should_save = control.should_evaluate = False
    control.should_training_stop = True
    return (f"training diverged at step {step}: {problem}. Stopped without checkpointing it. Lower learning_rate (or "
            f"raise the keep probabilities) and {restart}; or pass --stop_on_divergence false to train on.")
