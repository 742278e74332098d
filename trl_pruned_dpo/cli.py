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
  and the fractions of the graph that pruning kept, read from the logged `prune/*` metrics).
"""

import os
import shutil
import socket
import sys
import time
from functools import partial
from pathlib import Path
from urllib.parse import urlparse

from .run_control import (
    RUN_ERRORS, closing_lines, disk_full_as_error, exit_code, launcher_stop_code, output_lock, preflight, remember_command,
    stop_on_signals,
)

PROG = "trl-pruned-dpo"
_CHILD_ENV = "TRL_PRUNED_DPO_LAUNCHED"  # set by the launching process: its children train instead of relaunching
_PRUNE_METRICS = {
    "prune/tokens_executed": "tokens executed",
    "prune/positions_scored": "positions scored",
    "prune/branches_backpropagated": "branches backpropagated",
    "prune/tokens_backpropagated": "tokens backpropagated",
}


class InputError(Exception):
    """Bad user input: printed as one line (problem and fix), exit code 2."""


# --- parsing ----------------------------------------------------------------------------------------------------------


def make_parser(prog: str = PROG):
    """`trl dpo`'s parser with `PrunedDPOConfig` in place of `DPOConfig`."""
    from trl import DatasetMixtureConfig, ModelConfig, ScriptArguments, TrlParser

    from .config import PrunedDPOConfig

    return TrlParser((ScriptArguments, PrunedDPOConfig, ModelConfig, DatasetMixtureConfig), prog=prog)


def _accelerate_options() -> set[str]:
    from accelerate.commands.launch import launch_command_parser

    return set(launch_command_parser()._option_string_actions) | {"--accelerate_config"}


def _split_remaining(remaining: list[str], known: set[str]) -> tuple[list[str], list[str]]:
    """Split leftover argument strings into (accelerate launch arguments, unknown option names)."""
    launch, unknown, in_launch_option = [], [], False
    for token in remaining:
        if token.startswith("-"):
            key = token.split("=", 1)[0]
            in_launch_option = key in known
            if in_launch_option:
                launch.append(token)
            else:
                unknown.append(key)
        elif in_launch_option:  # the value of a launch option
            launch.append(token)
    return launch, unknown


def _suggest(name: str, parser) -> str:
    import difflib

    fields = [a.dest for a in parser._actions]
    close = difflib.get_close_matches(name.lstrip("-"), fields, n=1, cutoff=0.75)
    return f" (did you mean `{close[0]}`?)" if close else ""


def _remaining_strings(parser, argv: list[str]) -> tuple[list[str], list[str]]:
    """What `parse_args_and_config` leaves over (YAML keys, command-line strings), without building the dataclasses."""
    import yaml

    args, config_remaining = list(argv), []
    if "--config" in args:
        index = args.index("--config")
        config = yaml.safe_load(Path(args[index + 1]).read_text())
        config = config if isinstance(config, dict) else {}
        del args[index : index + 2]
        dests = {action.dest for action in parser._actions}
        config_remaining = [s for k, v in config.items() if k not in dests and k != "env" for s in (f"--{k}", str(v))]
    return config_remaining, parser.parse_known_args(args)[1]


def parse(argv: list[str]):
    """Parse `argv` like `trl dpo`. Returns (script_args, training_args, model_args, dataset_args, launch_args,
    cli_remaining): the four dataclasses, the `accelerate launch` arguments (from the YAML and the command line, with
    `--accelerate_config` resolved), and the command-line strings that were accelerate options."""
    import yaml

    if "--config" in argv:
        index = argv.index("--config")
        path = argv[index + 1] if index + 1 < len(argv) else None
        if path is None or not Path(path).is_file():
            raise InputError(
                f"config file {path!r} not found: pass an existing YAML file to --config (e.g. configs/demo.yaml "
                "from the repository), or give every option as a flag."
            )
    parser = make_parser()
    try:
        *parsed, config_remaining, cli_remaining = parser.parse_args_and_config(
            argv, return_remaining_strings=True, separate_remaining_strings=True
        )
    except yaml.YAMLError as error:
        raise InputError(f"config file is not valid YAML ({' '.join(str(error).split())}): fix its syntax.") from None
    except (ValueError, TypeError, RuntimeError) as error:  # the configs' __post_init__: the message names the option
        # Some settings only hold under a launcher (e.g. `ddp_backend: gloo` wants a process group): if this process
        # is about to launch, leave the validation to the launched processes.
        parsed, (config_remaining, cli_remaining) = [None] * 4, _remaining_strings(parser, argv)
        if not (_split_remaining(config_remaining + cli_remaining, _accelerate_options())[0] and
                not _under_launcher()):
            message = " ".join(str(error).split())
            if "bf16" in message:  # transformers suggests `use_cpu`; the usual cause is DPOConfig's bf16=True default
                message += " (DPOConfig defaults to bf16=True: without a bf16 device pass `--bf16 false`.)"
            raise InputError(f"invalid configuration: {message} Fix it in the YAML or on the command line.") from None
    known = _accelerate_options()
    config_launch, config_unknown = _split_remaining(config_remaining, known)
    cli_launch, cli_unknown = _split_remaining(cli_remaining, known)
    if config_unknown or cli_unknown:
        where = [f"YAML key `{k.lstrip('-')}`{_suggest(k, parser)}" for k in config_unknown]
        where += [f"argument `{k}`{_suggest(k, parser)}" for k in cli_unknown]
        raise InputError(
            f"unknown {', '.join(where)}: not a field of ScriptArguments, PrunedDPOConfig, ModelConfig or "
            f"DatasetMixtureConfig, nor an `accelerate launch` option. Fix the spelling or remove it "
            f"(`{PROG} --help` lists every key)."
        )
    launch_args = config_launch + cli_launch
    if launch_args:
        from trl.cli.accelerate_config import resolve_accelerate_config_argument

        try:
            launch_args = resolve_accelerate_config_argument(launch_args)
        except ValueError as error:
            raise InputError(f"{error} (this repository's configs/accelerate/*.yaml are paths)") from None
    return (*parsed, launch_args, cli_remaining)


# --- launching --------------------------------------------------------------------------------------------------------


def _under_launcher() -> bool:
    return os.environ.get(_CHILD_ENV) == "1" or "LOCAL_RANK" in os.environ or "ACCELERATE_DYNAMO_BACKEND" in os.environ


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

    os.environ[_CHILD_ENV] = "1"
    args = launch_command_parser().parse_args([*launch_args, "--module", "trl_pruned_dpo", *training_argv])
    try:
        launch_command(args)
    except subprocess.CalledProcessError as error:  # the children printed their own error
        return error.returncode or 1
    except Exception as error:  # SIGTERM/SIGINT forwarded to the children, which stopped and said so (run_control.py)
        code = launcher_stop_code(error)
        if code is None:
            raise
        return code
    return 0


# --- model and data ---------------------------------------------------------------------------------------------------


def _hub_unreachable() -> str | None:
    """Why the Hub cannot be used now (offline mode, no route), or None. A 3 s probe, instead of the ~25 s of
    retries huggingface_hub spends before failing with no network."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout=3).close()
    except OSError as error:
        return f"{url.hostname} cannot be reached ({error.strerror or error})"
    return None


def _go_offline() -> None:
    """Hub offline mode for this process and its children: cached models and datasets load, nothing is requested."""
    import datasets.config
    from huggingface_hub import constants

    os.environ["HF_HUB_OFFLINE"] = "1"
    constants.HF_HUB_OFFLINE = True  # both libraries read these at call time; the env var only at import
    datasets.config.HF_HUB_OFFLINE = True


def _is_hub_id(name: str | None) -> bool:
    from .demo.model import is_builtin

    return bool(name) and not is_builtin(name) and not Path(name).expanduser().exists() and not _looks_like_path(name)


def _looks_like_path(name: str) -> bool:
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or (os.sep != "/" and os.sep in name)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0].rstrip(".") if text else type(error).__name__


def resolve_model(name: str | None, revision: str | None = None) -> str:
    """A loadable path or hub id for `name`; raises InputError, before anything is written, if it cannot load."""
    from .demo.model import is_builtin, resolve_model as resolve_builtin

    if not name:
        raise InputError("no model given: set `model_name_or_path` (a local folder, a hub id, or builtin:tiny-demo).")
    if is_builtin(name):
        try:
            return resolve_builtin(name)
        except ValueError as error:
            raise InputError(str(error)) from None
    if Path(name).expanduser().is_dir():
        return str(Path(name).expanduser())
    if _looks_like_path(name):
        raise InputError(f"model folder {name!r} does not exist: fix the path, or use a hub id or builtin:tiny-demo.")
    from huggingface_hub import constants
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(name, revision=revision)
    except OSError as error:
        if constants.HF_HUB_OFFLINE:
            raise InputError(
                f"cannot load model {name!r}: it is not a local folder nor in the Hugging Face cache, and the Hub is "
                f"offline or unreachable. Fix: download it where there is network (`hf download {name}`) and bring "
                "the cache or the folder here, pass a local folder, or use builtin:tiny-demo."
            ) from None
        raise InputError(f"cannot load model {name!r} from the Hub: {_first_line(error)}. Fix the id or revision, "
                         "or pass a local folder.") from None
    return name


def load_data(script_args, dataset_args):
    """The dataset `trl dpo` would load, plus `builtin:<task>`. Returns (DatasetDict, display name)."""
    from datasets import load_dataset
    from trl import get_dataset

    from .demo.tasks import BUILTIN_PREFIX, load_builtin

    name = script_args.dataset_name
    if dataset_args.datasets:  # like `trl dpo`: a mixture wins over `dataset_name`
        name, load = "the `datasets` mixture", partial(get_dataset, dataset_args)
    elif not name:
        raise InputError("no dataset given: set `dataset_name` (a hub id, a local folder, or builtin:mix) or "
                         "`datasets`.")
    elif name.startswith(BUILTIN_PREFIX):
        load = partial(load_builtin, name)
    else:
        load = partial(load_dataset, name, name=script_args.dataset_config, streaming=script_args.dataset_streaming)
    try:
        return load(), name
    except Exception as error:  # datasets raises many types (DatasetNotFoundError, ConnectionError, ValueError, ...)
        from huggingface_hub import constants

        hint = " (the Hub is offline or unreachable and it is not cached)" if constants.HF_HUB_OFFLINE else ""
        raise InputError(f"cannot load dataset {name}: {_first_line(error)}{hint}. Fix the name, split or config, "
                         "or pass a local folder or builtin:mix.") from None


def check_splits(dataset, name: str, script_args, training_args):
    """The train (and, when evaluating, test) split, with the columns DPO needs."""
    splits = list(dataset.keys())
    wanted = [("dataset_train_split", script_args.dataset_train_split)]
    if training_args.eval_strategy != "no":
        wanted.append(("dataset_test_split", script_args.dataset_test_split))
    found = []
    for key, split in wanted:
        if split not in dataset:
            raise InputError(f"dataset {name} has no split {split!r} (it has {splits}): set `{key}` to one of them"
                             + (", or `eval_strategy: no`." if key == "dataset_test_split" else "."))
        columns = dataset[split].column_names or list(next(iter(dataset[split])).keys())
        missing = [c for c in ("chosen", "rejected") if c not in columns]
        if missing:
            raise InputError(
                f"dataset {name} split {split!r} lacks column(s) {missing} (it has {columns}): DPO needs `prompt`, "
                "`chosen` and `rejected` (or `chosen`/`rejected` holding the prompt as their shared start). Fix: "
                "rename the columns (Dataset.rename_column) or choose a preference dataset."
            )
        found.append(dataset[split])
    return found[0], (found[1] if len(found) > 1 else None)


# --- training ---------------------------------------------------------------------------------------------------------


class _OutputGuard:
    """Removes the output folder when the run that created it fails before writing any checkpoint, so a failed run
    leaves nothing that looks like a result. A folder that existed before, or holds checkpoints, is left alone."""

    def __init__(self, output_dir: str):
        self.path = Path(output_dir)
        self.created = not self.path.exists()

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback):
        if kind is not None and self.created and self.path.is_dir() and not any(self.path.glob("checkpoint-*")):
            shutil.rmtree(self.path, ignore_errors=True)
        return False


def _mean(history: list[dict], key: str) -> float | None:
    values = [entry[key] for entry in history if key in entry]
    return sum(values) / len(values) if values else None


def summarize(trainer, model_name: str, model_path: str, wall_seconds: float) -> str:
    """What ran: steps, time, the last logged loss and accuracies, and the mean `prune/*` fractions (n/a if the
    trainer logged none)."""
    args, state = trainer.args, trainer.state
    history = state.log_history
    train_log = next((e for e in reversed(history) if "train_runtime" in e), {})
    # With fewer steps than `logging_steps`, TRL folds the metrics into the closing entry (loss as `train_loss`).
    last = next((e for e in reversed(history) if "loss" in e), {**train_log, "loss": train_log.get("train_loss")})
    last_eval = next((e for e in reversed(history) if "eval_rewards/accuracies" in e), None)
    pairs = state.global_step * args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size

    def fmt(value, pattern="{:.3f}"):
        return "n/a" if value is None else pattern.format(value)

    lines = [
        f"{PROG} summary",
        ("model", model_name if model_name == model_path else f"{model_name} -> {model_path}"),
        ("pruning", f"position_keep_prob={args.position_keep_prob} prefix_prune_prob={args.prefix_prune_prob} "
                    f"(min ratio {args.prefix_min_ratio}) branch_keep_prob={args.branch_keep_prob} "
                    f"({args.branch_sampling}) prune_common_prefix={args.prune_common_prefix}"),
        ("steps", f"{state.global_step} ({pairs} pairs) in {fmt(train_log.get('train_runtime'), '{:.1f}')} s of "
                  f"training, {wall_seconds:.1f} s in all"),
        ("last loss / reward acc.", f"{fmt(last.get('loss'))} / {fmt(last.get('rewards/accuracies'))} "
                                    f"(step {last.get('step', 'n/a')}, training batches)"),
    ]
    if last_eval is not None:
        lines.append(("held-out reward acc.", f"{fmt(last_eval['eval_rewards/accuracies'])} "
                                              f"(step {last_eval.get('step')}, eval split)"))
    for key, label in _PRUNE_METRICS.items():
        share = _mean(history, key)
        suffix = {"prune/tokens_executed": " of the full graph", "prune/positions_scored": " of response positions"}
        lines.append((label, "n/a" if share is None else f"{100 * share:.1f}%{suffix.get(key, '')}"))
    lines += closing_lines(trainer)  # worst values, resume note, saved model or where the run stopped
    return "\n".join(line if isinstance(line, str) else f"  {line[0]:<24} {line[1]}" for line in lines)


def _apply_thread_count() -> None:
    """Honour OMP_NUM_THREADS from the YAML `env:` mapping: torch read the variable when TRL imported it, before the
    YAML was parsed."""
    import torch

    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0 and int(threads) != torch.get_num_threads():
        torch.set_num_threads(int(threads))


def train(script_args, training_args, model_args, dataset_args, started: float | None = None) -> int:
    """Train in this process, as `trl dpo`'s script does, with `PrunedDPOTrainer`. Returns the exit code."""
    import transformers
    from packaging.version import Version
    from trl import get_peft_config, get_quantization_config

    from .trainer import PrunedDPOTrainer

    started = time.perf_counter() if started is None else started
    _apply_thread_count()
    preflight(training_args)  # output_dir writable and free, resume possible: one line before any work
    names = [model_args.model_name_or_path, script_args.dataset_name]
    if training_args.push_to_hub or dataset_args.datasets or any(_is_hub_id(n) for n in names):
        if _hub_unreachable():
            _go_offline()  # cached models and datasets still load, at once instead of after retries
    else:
        _go_offline()  # builtin or local only: guarantee that nothing is requested from the Hub
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
        except ValueError as error:  # TRL and the plugin reject option combinations here, naming them
            if os.environ.get("TRL_PRUNED_DPO_TRACEBACK"):
                raise
            raise InputError(f"{' '.join(str(error).split())} (TRL_PRUNED_DPO_TRACEBACK=1 shows where)") from None
        if script_args.ignore_bias_buffers:  # the same DDP workaround as `trl dpo`
            import torch

            trainer.model._ddp_params_and_buffers_to_ignore = [
                name for name, buffer in trainer.model.named_buffers() if buffer.dtype == torch.bool
            ]
        with stop_on_signals(trainer) as stop:
            trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        evaluated = [e.get("step") for e in trainer.state.log_history if "eval_loss" in e]
        if eval_dataset is not None and trainer.state.global_step not in evaluated and not stop.signal_number:
            trainer.evaluate()
        if not stop.signal_number:  # a stopped run leaves its checkpoint, not a final model that looks finished
            with disk_full_as_error("the final model", training_args.output_dir):
                trainer.save_model(training_args.output_dir)
    trainer.accelerator.print(summarize(trainer, model_args.model_name_or_path, model_path,
                                        time.perf_counter() - started))
    if training_args.push_to_hub and not stop.signal_number:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
        trainer.accelerator.print(f"Model pushed to the Hub: {trainer.hub_model_id}")
    if Version(transformers.__version__) >= Version("5.18.0"):
        trainer.end()
    return stop.exit_code


# --- entry point ------------------------------------------------------------------------------------------------------


def _print_error(message: str) -> None:
    rank = os.environ.get("RANK")
    prefix = f"{PROG}: error: " if rank in (None, "0") else f"{PROG} [rank {rank}]: error: "
    print(prefix + message, file=sys.stderr, flush=True)


def _process_started() -> float:
    """`time.perf_counter()` at process start (Linux), so the summary's total includes the imports that ran before
    `main`; elsewhere, now."""
    now = time.perf_counter()
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return now - max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return now


def main(argv: list[str] | None = None) -> int:
    """Console script `trl-pruned-dpo` and `python -m trl_pruned_dpo`. Returns the exit code."""
    started = _process_started()
    argv = list(sys.argv[1:] if argv is None else argv)
    remember_command(argv)
    try:
        script_args, training_args, model_args, dataset_args, launch_args, cli_remaining = parse(argv)
        if launch_args and not _under_launcher():
            return launch(launch_args, _without(argv, cli_remaining))
        return train(script_args, training_args, model_args, dataset_args, started)
    except InputError as error:
        _print_error(str(error))
        return 2
    except RUN_ERRORS as error:  # run_control.py: bad resume or output_dir (2), diverged or disk full (1)
        _print_error(" ".join(str(error).split()))
        return exit_code(error)
    except KeyboardInterrupt:
        _print_error("interrupted.")
        return 130
