"""The trainer's run-safety state, one object (`trainer.run_state`): where a `train()` resumed from, the divergence
guard, the stop request of a caught signal, and the optimizer step's loss the guard reads.

Written by the trainer (at the start of `train()`, each micro-step and each step's end) and by safety/signals.py (the
stop request); read by the guard (guards.check_step), auto.py (the step's loss) and the CLI's summary.
"""

import dataclasses
from typing import TYPE_CHECKING, Any

from . import checkpoints, guards

if TYPE_CHECKING:
    import torch

    from ..config import PrunedDPOConfig


@dataclasses.dataclass
class RunState:
    """The safety fields of a run (safety/). `stop_request` outlives a `train()`: the CLI sets it before calling it."""

    # The checkpoint the last `train()` resumed from, and whether its partial logging window was restored (else the
    # logs restart there)
    resumed_from: str | None = None
    restored_logging_window: bool = False
    divergence_guard: guards.DivergenceGuard | None = None
    # A caught signal's request to stop (safety/signals.py)
    stop_request: object = None
    # This optimizer step's loss, summed over its micro-steps (None: no step running), the fp16 loss scale it runs
    # under (a device copy; None without a scaler), and why the run diverged
    step_loss: object = None
    step_scale: object = None
    diverged: str | None = None
    # The resumed checkpoint's logging window, until the first micro-step reopens it
    pending_window: dict | None = None

    def begin(self, resume: str | None, args: "PrunedDPOConfig") -> dict | None:
        """A `train()` starts from `resume` (a checkpoint, or None): its guard and logging window. Returns the run state
        saved with that checkpoint (for auto.py), or None."""
        saved = checkpoints.read_run_state(resume, args.process_index) if resume else None
        self.resumed_from, self.restored_logging_window = resume, False
        self.step_loss = self.step_scale = self.diverged = None
        self.pending_window = (saved.get("window") or {}) if saved is not None else None
        self.divergence_guard = guards.DivergenceGuard.from_run_state(saved, args.divergence_factor)
        return saved

    def take_window(self) -> dict | None:
        """The logging window to reopen at the first micro-step after a resume (once), else None."""
        window, self.pending_window = self.pending_window, None
        return window

    def add_loss(self, loss: "torch.Tensor", scaler: Any = None) -> None:
        """A micro-step's loss, summed into the step's (no device read). At a step's first, with an fp16 loss scaler
        (`accelerator.scaler`), a device copy of the scale the step runs under: the guard compares it with the scale
        after the optimizer step to see a step the scaler skipped (guards.check_step)."""
        if self.step_loss is None:
            scale = guards.loss_scale(scaler)
            self.step_scale = None if scale is None else scale.detach().clone()
        self.step_loss = loss.detach() if self.step_loss is None else self.step_loss + loss.detach()

    def end_step(self, trainer: Any, grad_norm: "torch.Tensor | float | None", output_dir: str) -> None:
        """An optimizer step just ended: check it (guards.check_step) before it is logged or saved."""
        if self.step_loss is None:
            return
        loss, scale, self.step_loss, self.step_scale = self.step_loss, self.step_scale, None, None
        self.diverged = guards.check_step(trainer, self, loss, grad_norm, output_dir, scale) or self.diverged

    def state_dict(self) -> dict:
        """What a checkpoint keeps of it: the guard's worst values."""
        return {"guard": self.divergence_guard.state_dict()}
