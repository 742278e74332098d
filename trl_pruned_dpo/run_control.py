"""What the command line adds around training so that a run that fails, is stopped or is resumed says so.

- `preflight`: before any model or data is loaded, the output folder must be writable and not held by another run,
  and a requested resume must have a complete checkpoint with this run's pruning settings (one-line errors).
- `stop_on_signals`: SIGTERM or Ctrl-C (SIGINT) during training stops at the end of the current step and saves a
  checkpoint there; the run then exits non-zero (128 + signal number) and its summary says where it stopped and how
  to resume. A second signal ends the process at once.
- `closing_lines`: the summary's last lines: worst values seen, the resume note, and either where the model was saved
  or where the run stopped.
"""

import json
import os
import shlex
import signal
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

from . import checkpoints
from .checkpoints import DiskFullError, ResumeError, disk_full_as_error
from .guards import EmptyTrainingSet, TrainingDiverged
from .output_dir import OutputDirError, OutputLock, check_free, check_writable  # noqa: F401 - OutputLock re-exported

__all__ = ["RUN_ERRORS", "closing_lines", "disk_full_as_error", "exit_code",
           "launcher_stop_code", "output_lock", "preflight", "remember_command", "stop_on_signals"]

# Failures the command line reports in one line: bad input (exit 2) or a run that could not go on (exit 1).
_INPUT_ERRORS = (ResumeError, OutputDirError, EmptyTrainingSet)
RUN_ERRORS = (*_INPUT_ERRORS, TrainingDiverged, DiskFullError)


def exit_code(error: BaseException) -> int:
    return 2 if isinstance(error, _INPUT_ERRORS) else 1

PROG = "trl-pruned-dpo"
_command: list[str] | None = None  # the command line of this run, for the "resume with" hint


_COMMAND_ENV = "TRL_PRUNED_DPO_COMMAND"  # the user's command line, for processes started by `accelerate launch`


def remember_command(argv: list[str]) -> None:
    """Keep this run's arguments for the "resume with" hint; launched processes get the launching one's (theirs
    lack the accelerate flags)."""
    global _command
    inherited = os.environ.get(_COMMAND_ENV) if "LOCAL_RANK" in os.environ else None  # started by a launcher
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


def _is_main_process() -> bool:
    """The process that owns the run's lock: the only one, or global rank 0 under a launcher."""
    return os.environ.get("RANK", "0") == "0"


def preflight(training_args) -> None:
    """One-line errors (OutputDirError, ResumeError) before any work: writable, not in use, resumable."""
    check_writable(training_args.output_dir)
    if _is_main_process():  # the other ranks would see their own run's lock
        check_free(training_args.output_dir)
    checkpoints.resolve_resume(training_args.resume_from_checkpoint, training_args)


def output_lock(output_dir):
    """`OutputLock(output_dir)` in the main process; nothing in the other ranks of the same run."""
    return OutputLock(output_dir) if _is_main_process() else nullcontext()


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


def _stop_callback(request: StopRequest, trainer):
    import torch
    from transformers import TrainerCallback

    class StopOnSignal(TrainerCallback):
        """Turns a caught signal into "stop after this step, and save a checkpoint of it"."""

        def on_step_end(self, args, state, control, **kwargs):
            requested = request.signal_number is not None
            if args.world_size > 1:  # every process must stop at the same step, whichever one the signal reached
                flag = torch.tensor([float(requested)], device=trainer.accelerator.device)
                requested = bool(trainer.accelerator.reduce(flag, reduction="sum").item() > 0)
            if requested:
                control.should_training_stop = True
                control.should_save = True
            return control

    return StopOnSignal()


@contextmanager
def stop_on_signals(trainer):
    """Within the block, SIGTERM and SIGINT stop training cleanly at the end of the current step (see module doc)."""
    request = StopRequest()
    previous = {}

    def handler(number, frame):
        request.signal_number = number
        request.signal_name = signal.Signals(number).name
        for sig, old in previous.items():  # a second signal acts as it would have without us
            signal.signal(sig, old)
        if _is_main_process():
            print(f"{PROG}: {request.signal_name} received: stopping after this step and saving a checkpoint "
                  "(send it again to stop at once).", flush=True)

    for sig in (signal.SIGTERM, signal.SIGINT):
        previous[sig] = signal.signal(sig, handler)
    callback = _stop_callback(request, trainer)
    trainer.add_callback(callback)
    trainer.stop_request = request
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


def closing_lines(trainer) -> list:
    """Summary lines (label, text) or plain strings: worst values, resume note, then saved model or stop."""
    args, lines, stop = trainer.args, [], getattr(trainer, "stop_request", None)
    guard = getattr(trainer, "divergence_guard", None)
    worst = guard.summary() if guard is not None else None
    if worst:
        lines.append(("worst values", worst))
    if getattr(trainer, "resumed_from", None):
        start = checkpoints.checkpoint_step(trainer.resumed_from)
        note = f"{trainer.resumed_from}: the training time covers steps {start + 1 if start is not None else '?'}-"
        note += f"{trainer.state.global_step} only"
        if not getattr(trainer, "restored_logging_window", False):
            note += "; the first logged loss and prune/* figures after it cover only the resumed steps"
        lines.append(("resumed from", note))
    if stop is not None and stop.signal_number is not None:
        saved = f"checkpoint {stop.checkpoint} saved" if stop.checkpoint else "no checkpoint saved"
        lines.append(f"stopped at step {stop.step} of {stop.max_steps} by {stop.signal_name}; {saved}; resume with "
                     f"`{resume_command()}`")
    else:
        lines.append(("saved", f"{args.output_dir} (model and tokenizer)"))
    return lines
