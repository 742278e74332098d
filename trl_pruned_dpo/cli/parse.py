"""`trl dpo`'s argument parsing with `PrunedDPOConfig` in place of `DPOConfig`, and its errors made one line.

YAML keys and flags are the same as `trl dpo`'s; a key or flag that is neither a field nor an `accelerate launch`
option is an error (TRL hands it to accelerate, which fails with its own usage message); a YAML value of the wrong
type, an invalid value or an output folder that cannot be written is one line, before anything is loaded.
"""

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import PROG, InputError
from ..safety.output_dir import check_writable, is_main_process

if TYPE_CHECKING:
    from trl import TrlParser

# Set by the launching process: its children train instead of relaunching.
LAUNCHED_ENV = "TRL_PRUNED_DPO_LAUNCHED"


def under_launcher() -> bool:
    return os.environ.get(LAUNCHED_ENV) == "1" or "LOCAL_RANK" in os.environ or "ACCELERATE_DYNAMO_BACKEND" in os.environ


USAGE = f"{PROG} [--config FILE.yaml] [--KEY VALUE ...] [--compare] [accelerate launch options]"
DESCRIPTION = (
    "`trl dpo` with PrunedDPOTrainer: the same keys (YAML or flags), plus the pruning options listed first. "
    "Offline demo: `trl-pruned-dpo --config configs/demo.yaml`; add `--compare` to train stock DPOTrainer first and "
    "print both (held-out accuracy, time, tokens executed). Any `accelerate launch` option (e.g. --num_processes 4, "
    "--accelerate_config zero3) relaunches through accelerate. docs/cli.md has the details."
)


def make_parser(prog: str = PROG):
    """`trl dpo`'s parser with `PrunedDPOConfig` in place of `DPOConfig`; its --help shows the plugin's own options
    first (TRL's list runs to ~900 lines before them)."""
    import dataclasses

    from trl import DatasetMixtureConfig, DPOConfig, ModelConfig, ScriptArguments, TrlParser

    from ..config import PrunedDPOConfig

    parser = TrlParser((ScriptArguments, PrunedDPOConfig, ModelConfig, DatasetMixtureConfig), prog=prog,
                       usage=USAGE, description=DESCRIPTION)
    own = {f.name for f in dataclasses.fields(PrunedDPOConfig)} - {f.name for f in dataclasses.fields(DPOConfig)}
    # `padding_free` is DPOConfig's field, which the plugin honours and turns on by default (config.py).
    own.add("padding_free")
    group = parser.add_argument_group("trl-pruned-dpo (pruning and run safety; docs/method.md, docs/cli.md)")
    # Argparse keeps each group's actions in `_group_actions`: moving them moves the help.
    rest = parser._optionals
    for action in [a for a in rest._group_actions if a.dest in own or a.dest in ("help", "config")]:
        rest._group_actions.remove(action)
        group._group_actions.append(action)
    parser._action_groups.remove(group)
    parser._action_groups.insert(parser._action_groups.index(rest), group)
    rest.title = "every other key: trl dpo's (ScriptArguments, DPOConfig, ModelConfig, DatasetMixtureConfig)"
    return parser


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
        elif in_launch_option:
            # The value of a launch option.
            launch.append(token)
    return launch, unknown


def _suggest(name: str, parser: "TrlParser") -> str:
    import difflib

    fields = [a.dest for a in parser._actions]
    close = difflib.get_close_matches(name.lstrip("-"), fields, n=1, cutoff=0.75)
    return f" (did you mean `{close[0]}`?)" if close else ""


def _remaining_strings(parser: "TrlParser", argv: list[str]) -> tuple[list[str], list[str]]:
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
    # One line instead of ~165 lines of usage.
    parser.error = _raise_usage_error
    try:
        argv = save_steps_switch_strategy(argv)
        check_yaml_value_types(parser, argv)
        *parsed, config_remaining, cli_remaining = parser.parse_args_and_config(
            argv, return_remaining_strings=True, separate_remaining_strings=True
        )
    except yaml.YAMLError as error:
        raise InputError(f"config file is not valid YAML ({' '.join(str(error).split())}): fix its syntax.") from None
    except (ValueError, TypeError, RuntimeError) as error:
        # A configuration's __post_init__ refused a value: the message names the option.
        # Some settings only hold under a launcher (e.g. `ddp_backend: gloo` wants a process group): if this process
        # is about to launch, leave the validation to the launched processes.
        parsed, (config_remaining, cli_remaining) = [None] * 4, _remaining_strings(parser, argv)
        if not (_split_remaining(config_remaining + cli_remaining, _accelerate_options())[0] and
                not under_launcher()):
            message = " ".join(str(error).split())
            # Transformers suggests `use_cpu`; here bf16 was asked for explicitly.
            if "bf16" in message:
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
        # Before the output folder is created or anything is loaded.
        check_writable(parsed[1].output_dir)
    return (*parsed, launch_args, cli_remaining)


def _flag(argv: list[str], key: str) -> str | None:
    """The value of command-line flag `--key` (`--key V`, `--key=V`, or the hyphenated spelling), or None."""
    names = {f"--{key}", f"--{key.replace('_', '-')}"}
    for index, token in enumerate(argv):
        name, _, value = token.partition("=")
        if name in names:
            return value if value else (argv[index + 1] if index + 1 < len(argv) else "")
    return None


def save_steps_switch_strategy(argv: list[str]) -> list[str]:
    """`argv`, with `--save_strategy steps` added where the command line gives `save_steps` and the config file sets
    `save_strategy: "no"` (the demo configs do): the flag is the newer intent, so it saves, and a note says so. A
    `save_steps` that `save_strategy: no` would ignore from the same source (both flags, or both YAML keys) is an
    error: TRL would save nothing and say nothing."""
    import yaml

    config = {}
    if "--config" in argv:
        loaded = yaml.safe_load(Path(argv[argv.index("--config") + 1]).read_text())
        config = loaded if isinstance(loaded, dict) else {}
    flag_steps, flag_strategy = _flag(argv, "save_steps"), _flag(argv, "save_strategy")
    yaml_steps, yaml_strategy = config.get("save_steps"), config.get("save_strategy")
    strategy = flag_strategy if flag_strategy is not None else yaml_strategy
    steps = flag_steps if flag_steps is not None else yaml_steps
    if steps is None or str(strategy).lower() != "no":
        return argv
    if flag_strategy is not None or flag_steps is None:
        where = "--save_strategy no" if flag_strategy is not None else "the config file's save_strategy: \"no\""
        raise InputError(f"save_steps {steps} has no effect with {where}: nothing would be saved before the end. "
                         "Set save_strategy to steps, or drop save_steps.")
    # Once, not again in each launched process.
    if is_main_process() and os.environ.get(LAUNCHED_ENV) != "1":
        print(f"{PROG}: --save_steps {steps}: save_strategy set to \"steps\" (the config file said \"no\"); a "
              f"checkpoint every {steps} steps.", file=sys.stderr, flush=True)
    return [*argv, "--save_strategy", "steps"]


def _raise_usage_error(message: str):
    """`parser.error`: argparse would print the whole usage (~165 lines) before the one line that matters."""
    raise InputError(f"{message}. Fix it in the YAML or on the command line (`{PROG} --help` lists every option).")


def check_yaml_value_types(parser: "TrlParser", argv: list[str]) -> None:
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
            # Unknown keys are reported later; strings are converted and checked by argparse.
            continue
        for item in value if isinstance(value, list) and action.nargs in ("+", "*") else [value]:
            wrong = isinstance(item, bool) != (action.type is string_to_bool) or (
                action.type is int and not isinstance(item, int)) or (
                action.type is float and not isinstance(item, (int, float)))
            if wrong:
                raise InputError(f"YAML key `{key}` must be {expected[action.type]}, got {item!r}: fix it in the "
                                 "config file.")

