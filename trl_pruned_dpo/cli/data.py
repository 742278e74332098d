"""The model and the data a command line names: builtin demo assets, local folders and files, or the Hub (offline
when it cannot be reached). Every failure is an `InputError` of one line, raised before anything is written."""

import os
import socket
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from ..errors import InputError
from ..notices import progress_bars_hidden

if TYPE_CHECKING:
    from trl import DatasetMixtureConfig, ScriptArguments

    from ..config import PrunedDPOConfig

def hub_unreachable() -> str | None:
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


def go_offline() -> None:
    """Hub offline mode for this process and its children: cached models and datasets load, nothing is requested."""
    import datasets.config
    from huggingface_hub import constants

    os.environ["HF_HUB_OFFLINE"] = "1"
    # Both libraries read these flags at call time, the environment variable only at import.
    constants.HF_HUB_OFFLINE = True
    datasets.config.HF_HUB_OFFLINE = True


def is_hub_id(name: str | None) -> bool:
    from ..demo.model import is_builtin

    return bool(name) and not is_builtin(name) and not Path(name).expanduser().exists() and not _looks_like_path(name)


def _looks_like_path(name: str) -> bool:
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or (os.sep != "/" and os.sep in name)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0].rstrip(".") if text else type(error).__name__


def resolve_model(name: str | None, revision: str | None = None) -> str:
    """A loadable path or hub id for `name`; raises InputError, before anything is written, if it cannot load."""
    from ..demo.model import is_builtin, resolve_model as resolve_builtin

    if not name:
        raise InputError("no model given: set `model_name_or_path` (a local folder, a hub id, or builtin:tiny-demo).")
    if is_builtin(name):
        try:
            # Building it once prints its own line; stock `trl dpo` shows no such bars.
            with progress_bars_hidden():
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


def load_data(script_args: "ScriptArguments", dataset_args: "DatasetMixtureConfig") -> tuple[Any, str]:
    """The dataset `trl dpo` would load, plus `builtin:<task>`. Returns (DatasetDict, display name)."""
    from datasets import load_dataset
    from trl import get_dataset

    from ..demo.tasks import BUILTIN_PREFIX, load_builtin

    name = script_args.dataset_name
    # Like `trl dpo`: a mixture wins over `dataset_name`.
    if dataset_args.datasets:
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
    except Exception as error:
        # The datasets library raises many types (DatasetNotFoundError, ConnectionError, ValueError, ...).
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


def check_splits(dataset: Any, name: str, script_args: "ScriptArguments",
                 training_args: "PrunedDPOConfig") -> tuple[Any, Any]:
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


def apply_thread_count() -> None:
    """Honour OMP_NUM_THREADS from the YAML `env:` mapping: torch read the variable when TRL imported it, before the
    YAML was parsed."""
    import torch

    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0 and int(threads) != torch.get_num_threads():
        torch.set_num_threads(int(threads))

