"""Stopping cleanly on a signal, and the command that resumes.

`stop_on_signals`: SIGTERM or Ctrl-C (SIGINT) during training stops at the end of the current step and saves a
checkpoint there; the run then exits non-zero (128 + signal number) and its summary says where it stopped and how to
resume. A second signal ends the process at once. A callback: it never imports the trainer.
"""

import json
import os
import shlex
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import Any

from ..errors import PROG
from . import checkpoints
from .output_dir import is_main_process

# The command line of this run, for the "resume with" hint.
_command: list[str] | None = None
# The user's command line, for processes started by `accelerate launch`.
_COMMAND_ENV = "TRL_PRUNED_DPO_COMMAND"


def remember_command(argv: list[str]) -> None:
    """Keep this run's arguments for the "resume with" hint; launched processes get the launching one's (theirs
    lack the accelerate flags)."""
    global _command
    # LOCAL_RANK is set when a launcher started this process.
    inherited = os.environ.get(_COMMAND_ENV) if "LOCAL_RANK" in os.environ else None
    _command = json.loads(inherited) if inherited else list(argv)
    os.environ[_COMMAND_ENV] = json.dumps(_command)


def launcher_stop_code(error: BaseException) -> int | None:
    """Exit code for torch's elastic launcher having forwarded a stop signal to the training processes (which stopped
    cleanly and printed their summary), or None for any other error."""
    try:
        from torch.distributed.elastic.multiprocessing.api import SignalException
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    return 128 + int(error.sigval) if isinstance(error, SignalException) else None


def resume_command() -> str:
    """This run's command with `--resume_from_checkpoint true` (any earlier resume flag dropped)."""
    args, skip = [], False
    for token in _command or []:
        if skip:
            skip = False
            continue
        if token == "--resume_from_checkpoint":
            skip = True
            continue
        if token.startswith("--resume_from_checkpoint="):
            continue
        args.append(token)
    return shlex.join([PROG, *args, "--resume_from_checkpoint", "true"])


@dataclass
class StopRequest:
    signal_name: str | None = None
    signal_number: int | None = None
    step: int | None = None
    max_steps: int | None = None
    checkpoint: str | None = None

    @property
    def exit_code(self) -> int:
        return 0 if self.signal_number is None else 128 + self.signal_number


def _stop_callback(request: StopRequest, accelerator: Any, fused_read: bool) -> Any:
    """The callback that stops training after the step a signal arrived in. `accelerator`: the trainer's;
    `fused_read`: the trainer reads the stop flag in its own one read per step (guards.check_step)."""
    import torch
    from transformers import TrainerCallback

    class StopOnSignal(TrainerCallback):
        """Turns a caught signal into "stop after this step, and save a checkpoint of it"."""

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            requested = request.signal_number is not None
            if args.world_size > 1 and fused_read:
                # The trainer's one fused read per step agrees on it (guards.check_step).
                return control
            # Every process must stop at the same step, whichever one the signal reached.
            if args.world_size > 1:
                flag = torch.tensor([float(requested)], device=accelerator.device)
                requested = bool(accelerator.reduce(flag, reduction="sum").item() > 0)
            if requested:
                control.should_training_stop = True
                control.should_save = True
            return control

    return StopOnSignal()


@contextmanager
def stop_on_signals(trainer: Any) -> Iterator[StopRequest]:
    """Within the block, SIGTERM and SIGINT stop training cleanly at the end of the current step (see module doc)."""
    request = StopRequest()
    previous = {}

    def handler(number: int, frame: FrameType | None) -> None:
        request.signal_number = number
        request.signal_name = signal.Signals(number).name
        # A second signal acts as it would have without us.
        for sig, old in previous.items():
            signal.signal(sig, old)
        if is_main_process():
            print(f"{PROG}: {request.signal_name} received: stopping after this step and saving a checkpoint "
                  "(send it again to stop at once).", flush=True)

    for sig in (signal.SIGTERM, signal.SIGINT):
        previous[sig] = signal.signal(sig, handler)
    callback = _stop_callback(request, trainer.accelerator, getattr(trainer, "reads_stop_signal", False))
    trainer.add_callback(callback)
    trainer.run_state.stop_request = request
    try:
        yield request
    finally:
        trainer.remove_callback(callback)
        for sig, old in previous.items():
            if signal.getsignal(sig) is handler:
                signal.signal(sig, old)
    if request.signal_number is not None:
        request.step, request.max_steps = trainer.state.global_step, trainer.state.max_steps
        folder = os.path.join(trainer.args.output_dir, f"checkpoint-{request.step}")
        request.checkpoint = folder if checkpoints.incomplete_reason(folder) is None and os.path.isdir(folder) else None

