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
- `--compare` trains stock `trl.DPOTrainer`, then `PrunedDPOTrainer`, on the same config and prints both (demo/compare.py).
"""

import os
import shutil
import socket
import sys
import time
from functools import partial
from pathlib import Path
from urllib.parse import urlparse

_PROGRAM_STARTED = time.perf_counter()  # this module loads first (the package imports lazily): the program's start

from .run_control import (  # noqa: E402 - after the start time
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
    parser.error = _raise_usage_error  # one line instead of ~165 lines of usage
    try:
        check_yaml_value_types(parser, argv)
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
            if "bf16" in message:  # transformers suggests `use_cpu`; here bf16 was asked for explicitly
                message += " (bf16 was set to true: without a bf16 device pass `--bf16 false`, or leave it unset.)"
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
    if parsed[1] is not None:
        check_output_dir(parsed[1].output_dir)
    return (*parsed, launch_args, cli_remaining)


def _raise_usage_error(message: str):
    """`parser.error`: argparse would print the whole usage (~165 lines) before the one line that matters."""
    raise InputError(f"{message}. Fix it in the YAML or on the command line (`{PROG} --help` lists every option).")


def check_yaml_value_types(parser, argv: list[str]) -> None:
    """Refuse YAML values of the wrong type. The YAML becomes argparse defaults, and argparse converts (and checks)
    only string defaults: `per_device_train_batch_size: 2.5` would reach the dataclasses unchecked and fail deep in
    training with a traceback."""
    import yaml
    from transformers.hf_argparser import string_to_bool

    if "--config" not in argv:
        return
    config = yaml.safe_load(Path(argv[argv.index("--config") + 1]).read_text())
    actions = {action.dest: action for action in parser._actions}
    expected = {int: "an integer", float: "a number", string_to_bool: "true or false"}
    for key, value in (config if isinstance(config, dict) else {}).items():
        action = actions.get(key)
        if action is None or action.type not in expected or value is None or isinstance(value, str):
            continue  # unknown keys are reported later; strings are converted and checked by argparse
        for item in value if isinstance(value, list) and action.nargs in ("+", "*") else [value]:
            wrong = isinstance(item, bool) != (action.type is string_to_bool) or (
                action.type is int and not isinstance(item, int)) or (
                action.type is float and not isinstance(item, (int, float)))
            if wrong:
                raise InputError(f"YAML key `{key}` must be {expected[action.type]}, got {item!r}: fix it in the "
                                 "config file.")


def check_output_dir(output_dir: str) -> None:
    """Refuse an output folder that cannot be created or written (under a file, in /proc, read-only), before any
    work: the trainer would otherwise fail with a traceback after loading the model and the data."""
    import tempfile

    path = Path(output_dir).expanduser().absolute()
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise InputError(f"output_dir {output_dir!r} cannot be created: {existing} is a file. Choose another "
                         "`output_dir`.")
    try:  # os.access says yes to root even on /proc: try for real, with a probe folder removed at once
        os.rmdir(tempfile.mkdtemp(prefix=".trl-pruned-dpo-probe-", dir=existing))
    except OSError as error:
        raise InputError(f"output_dir {output_dir!r} cannot be written ({existing}: "
                         f"{error.strerror or error}). Choose another `output_dir`.") from None


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
    elif Path(name).expanduser().is_file():
        load = partial(load_dataset, _file_builder(name), data_files=str(Path(name).expanduser()))
    else:
        load = partial(load_dataset, name, name=script_args.dataset_config, streaming=script_args.dataset_streaming)
    try:
        return load(), name
    except Exception as error:  # datasets raises many types (DatasetNotFoundError, ConnectionError, ValueError, ...)
        from huggingface_hub import constants

        hint = " (the Hub is offline or unreachable and it is not cached)" if constants.HF_HUB_OFFLINE else ""
        raise InputError(f"cannot load dataset {name}: {_first_line(error)}{hint}. Fix the name, split or config, "
                         "or pass a local folder or builtin:mix.") from None


_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow"}


def _file_builder(name: str) -> str:
    """The `datasets` builder for a local data file (its rows become the `train` split)."""
    builder = _FILE_BUILDERS.get(Path(name).suffix.lower())
    if builder is None:
        raise InputError(f"dataset file {name!r} has an unknown format: use {sorted(_FILE_BUILDERS)} or a folder "
                         "of them.")
    return builder


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
                    f"({args.branch_sampling}) prune_common_prefix={args.prune_common_prefix} "
                    f"share_prompt={args.share_prompt}"),
        ("steps", f"{state.global_step} ({pairs} pairs) in {fmt(train_log.get('train_runtime'), '{:.1f}')} s of "
                  f"training, {wall_seconds:.1f} s in all"),
        ("last loss / reward acc.", f"{fmt(last.get('loss'))} / {fmt(last.get('rewards/accuracies'))} "
                                    f"(step {last.get('step', 'n/a')}, training batches)"),
    ]
    if last_eval is not None:
        lines.append(("held-out reward acc.", f"{fmt(last_eval['eval_rewards/accuracies'])} "
                                              f"(step {last_eval.get('step')}, eval split)"))
    auto = getattr(trainer, "_auto_probs", None)
    if auto is not None and auto.history:  # what "auto" chose last, and why (trl_pruned_dpo/auto.py)
        choice = auto.history[-1]
        lines.append(("auto chose", f"branch {choice['branch_keep_prob']:g}, position {choice['position_keep_prob']:g} "
                                    f"at step {choice['step']}: {choice['reason']}"))
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


def silence_library_noise() -> None:
    """Hide other libraries' messages that are not the user's business: deprecation notices about names TRL itself
    passes (`gradient_checkpointing`, printed even when it is false), DataLoader's pin_memory notice on a machine
    without an accelerator, and bitsandbytes' CPU-kernel notice (printed on import, QLoRA or not)."""
    import logging
    import warnings

    warnings.filterwarnings("ignore", message=r"`(is_)?gradient_checkpointing` is deprecated", category=FutureWarning)
    warnings.filterwarnings("ignore", message=r"'pin_memory' argument is set as true but no accelerator",
                            category=UserWarning)
    logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(
        lambda record: "gemm_4bit_forward" not in record.getMessage())


def _compare(script_args, training_args, model_args, dataset_args, launch_args) -> int:
    if launch_args:
        raise InputError(f"--compare runs both trainers in this process: drop the accelerate options {launch_args}.")
    from .demo.compare import compare

    return compare(script_args, training_args, model_args, dataset_args)


def main(argv: list[str] | None = None) -> int:
    """Console script `trl-pruned-dpo` and `python -m trl_pruned_dpo`. Returns the exit code."""
    started = _PROGRAM_STARTED if argv is None else time.perf_counter()
    argv = list(sys.argv[1:] if argv is None else argv)
    remember_command(argv)
    silence_library_noise()
    compare = "--compare" in argv  # stock DPOTrainer, then the pruned one, side by side (demo/compare.py)
    argv = [a for a in argv if a != "--compare"]
    try:
        script_args, training_args, model_args, dataset_args, launch_args, cli_remaining = parse(argv)
        if compare:
            return _compare(script_args, training_args, model_args, dataset_args, launch_args)
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
