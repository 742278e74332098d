"""`trl-pruned-dpo`: the drop-in for `trl dpo` that trains with `PrunedDPOTrainer`.

Same arguments and YAML keys as `trl dpo` (`ScriptArguments`, `DPOConfig` -> `PrunedDPOConfig`, `ModelConfig`,
`DatasetMixtureConfig`), the pruning fields being ordinary flags/keys. Like `trl dpo`, anything that is an
`accelerate launch` option (`--num_processes`, `--accelerate_config zero2`, ...) makes it relaunch itself through
accelerate (`python -m trl_pruned_dpo` in each process); with none, it trains in this process.

Departures from `trl dpo`, all on purpose:
- `model_name_or_path: builtin:tiny-demo` and `dataset_name: builtin:<task>` name the offline demo (demo/);
- a YAML key or flag that is neither a field nor an accelerate option is an error (TRL hands it to accelerate,
  which fails with its own usage message);
- bad input (missing config, unknown key, invalid value, missing columns, unreachable model or dataset) is reported
  as one line naming the problem and the fix, exit code 2, before the output folder is created;
- when an eval split is configured, the run ends with an evaluation, and prints a summary of what ran (steps, time,
  and the fractions of the graph that pruning kept, read from the logged `prune/*` metrics);
- `--compare` trains stock `trl.DPOTrainer`, then `PrunedDPOTrainer`, on the same config and prints both (cli/compare.py).
"""

import os
import shutil
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

# This module loads first (the package imports lazily): its import time is the program's start.
_PROGRAM_STARTED = time.perf_counter()

from ..errors import PROG, RUN_ERRORS, InputError, exit_code  # noqa: E402 - after the start time
from ..safety.checkpoints import disk_full_as_error  # noqa: E402
from ..safety.disk_writes import give_default_modes  # noqa: E402
from ..safety.output_dir import is_main_process, output_lock, preflight  # noqa: E402
from ..safety.signals import launcher_stop_code, remember_command, stop_on_signals  # noqa: E402
from .data import apply_thread_count, check_splits, go_offline, hub_unreachable, is_hub_id, load_data  # noqa: E402
from .data import resolve_model  # noqa: E402 - patched by tests to prove nothing is loaded before a refusal
from .parse import LAUNCHED_ENV, parse, under_launcher  # noqa: E402
from .summary import summarize  # noqa: E402

if TYPE_CHECKING:
    from trl import DatasetMixtureConfig, ModelConfig, ScriptArguments

    from ..config import PrunedDPOConfig

__all__ = ["main", "parse", "summarize", "train"]

def _without(argv: list[str], subsequence: list[str]) -> list[str]:
    """`argv` with the ordered `subsequence` (the accelerate flags given on the command line) removed."""
    rest, items = [], iter(subsequence)
    current = next(items, None)
    for token in argv:
        if current is not None and token == current:
            current = next(items, None)
        else:
            rest.append(token)
    return rest


def launch(launch_args: list[str], training_argv: list[str]) -> int:
    """Run `python -m trl_pruned_dpo <training_argv>` under `accelerate launch <launch_args>`."""
    import subprocess

    from accelerate.commands.launch import launch_command, launch_command_parser

    os.environ[LAUNCHED_ENV] = "1"
    args = launch_command_parser().parse_args([*launch_args, "--module", "trl_pruned_dpo", *training_argv])
    try:
        launch_command(args)
    except subprocess.CalledProcessError as error:
        # The children printed their own error.
        return error.returncode or 1
    except Exception as error:
        # The launcher forwarded SIGTERM or SIGINT to the children, which stopped and said so (safety/signals.py).
        code = launcher_stop_code(error)
        if code is None:
            raise
        return code
    return 0


class _OutputGuard:
    """Removes the output folder when the run that created it fails before writing any checkpoint, so a failed run
    leaves nothing that looks like a result. A folder that existed before, or holds checkpoints, is left alone. Only
    the main process (the one holding the output lock) decides and deletes: another rank's error never removes the
    folder, nor the main process's lock, under a run that is still going."""

    def __init__(self, output_dir: str):
        self.path = Path(output_dir)
        self.main = is_main_process()
        self.created = self.main and not self.path.exists()

    def __enter__(self) -> "_OutputGuard":
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> bool:
        if (kind is not None and self.main and self.created and self.path.is_dir()
                and not any(self.path.glob("checkpoint-*"))):
            shutil.rmtree(self.path, ignore_errors=True)
        return False


def train(script_args: "ScriptArguments", training_args: "PrunedDPOConfig", model_args: "ModelConfig",
          dataset_args: "DatasetMixtureConfig", started: float | None = None) -> int:
    """Train in this process, as `trl dpo`'s script does, with `PrunedDPOTrainer`. Returns the exit code."""
    import transformers
    from packaging.version import Version
    from trl import get_peft_config, get_quantization_config

    from ..trainer import PrunedDPOTrainer

    started = time.perf_counter() if started is None else started
    apply_thread_count()
    # Refuse in one line, before any work, an output_dir that is not writable or not free, or an impossible resume.
    preflight(training_args)
    names = [model_args.model_name_or_path, script_args.dataset_name]
    if training_args.push_to_hub or dataset_args.datasets or any(is_hub_id(n) for n in names):
        if hub_unreachable():
            # Cached models and datasets still load, at once instead of after retries.
            go_offline()
    else:
        # Builtin or local only: guarantee that nothing is requested from the Hub.
        go_offline()
    model_path = resolve_model(model_args.model_name_or_path, model_args.model_revision)
    dataset, dataset_name = load_data(script_args, dataset_args)
    train_dataset, eval_dataset = check_splits(dataset, dataset_name, script_args, training_args)

    model_init_kwargs = dict(
        revision=model_args.model_revision,
        trust_remote_code=training_args.trust_remote_code,
        attn_implementation=model_args.attn_implementation,
        dtype=model_args.dtype,
    )
    model_init_kwargs.update(training_args.model_init_kwargs or {})
    training_args.model_init_kwargs = model_init_kwargs

    with _OutputGuard(training_args.output_dir), output_lock(training_args.output_dir):
        try:
            trainer = PrunedDPOTrainer(
                model=model_path,
                args=training_args,
                train_dataset=train_dataset,
                eval_dataset=eval_dataset,
                quantization_config=get_quantization_config(model_args),
                peft_config=get_peft_config(model_args),
            )
        except ValueError as error:
            # TRL and the plugin reject option combinations here, naming them.
            if os.environ.get("TRL_PRUNED_DPO_TRACEBACK"):
                raise
            raise InputError(f"{' '.join(str(error).split())} (TRL_PRUNED_DPO_TRACEBACK=1 shows where)") from None
        # The same DDP workaround as `trl dpo`.
        if script_args.ignore_bias_buffers:
            import torch

            trainer.model._ddp_params_and_buffers_to_ignore = [
                name for name, buffer in trainer.model.named_buffers() if buffer.dtype == torch.bool
            ]
        with stop_on_signals(trainer) as stop:
            trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        evaluated = [e.get("step") for e in trainer.state.log_history if "eval_loss" in e]
        if eval_dataset is not None and trainer.state.global_step not in evaluated and not stop.signal_number:
            trainer.evaluate()
        # A stopped run leaves its checkpoint, not a final model that looks finished.
        if not stop.signal_number:
            with disk_full_as_error("the final model", training_args.output_dir):
                trainer.save_model(training_args.output_dir)
                give_default_modes(training_args.output_dir)
    trainer.accelerator.print(summarize(trainer, model_args.model_name_or_path, model_path,
                                        time.perf_counter() - started))
    if training_args.push_to_hub and not stop.signal_number:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
        trainer.accelerator.print(f"Model pushed to the Hub: {trainer.hub_model_id}")
    if Version(transformers.__version__) >= Version("5.18.0"):
        trainer.end()
    return stop.exit_code


def _print_error(message: str) -> None:
    rank = os.environ.get("RANK")
    prefix = f"{PROG}: error: " if rank in (None, "0") else f"{PROG} [rank {rank}]: error: "
    print(prefix + message, file=sys.stderr, flush=True)


def silence_library_noise() -> None:
    """The command line is the whole program, so here the filters are process-wide: transformers' deprecation notices
    about the `gradient_checkpointing*` names TRL itself uses (printed even when it is false; stock `DPOTrainer`
    under `--compare` included), DataLoader's pin_memory notice on a machine without an accelerator, and
    bitsandbytes' CPU-kernel notice (printed on import, QLoRA or not). Through the Python API the package does the
    same, scoped to its own calls (trl_pruned_dpo/notices.py); what stays is listed in docs/cli.md."""
    import warnings

    from ..notices import hide_import_notices

    deprecated = r"`(is_)?gradient_checkpointing(_kwargs|_enable|_disable)?` is deprecated"
    warnings.filterwarnings("ignore", message=deprecated, category=FutureWarning)
    warnings.filterwarnings("ignore", message=r"'pin_memory' argument is set as true but no accelerator",
                            category=UserWarning)
    hide_import_notices()


def _compare(script_args: "ScriptArguments", training_args: "PrunedDPOConfig", model_args: "ModelConfig",
             dataset_args: "DatasetMixtureConfig", launch_args: list[str]) -> int:
    if launch_args:
        raise InputError(f"--compare runs both trainers in this process: drop the accelerate options {launch_args}.")
    from .compare import compare

    return compare(script_args, training_args, model_args, dataset_args)


def main(argv: list[str] | None = None) -> int:
    """Console script `trl-pruned-dpo` and `python -m trl_pruned_dpo`. Returns the exit code."""
    started = _PROGRAM_STARTED if argv is None else time.perf_counter()
    argv = list(sys.argv[1:] if argv is None else argv)
    remember_command(argv)
    silence_library_noise()
    # `--compare` trains stock DPOTrainer, then the pruned one, side by side (cli/compare.py).
    compare = "--compare" in argv
    argv = [a for a in argv if a != "--compare"]
    try:
        # The script, training, model and dataset arguments, then the accelerate options and what is left for them.
        *trl_args, launch_args, cli_remaining = parse(argv)
        if compare:
            return _compare(*trl_args, launch_args)
        if launch_args and not under_launcher():
            return launch(launch_args, _without(argv, cli_remaining))
        return train(*trl_args, started)
    except RUN_ERRORS as error:
        # The errors of errors.py: bad input, resume or output_dir (exit code 2), diverged or disk full (1).
        _print_error(" ".join(str(error).split()))
        return exit_code(error)
    except KeyboardInterrupt:
        _print_error("interrupted.")
        return 130

