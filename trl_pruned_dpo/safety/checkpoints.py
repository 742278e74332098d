"""Checkpoints a resume can trust: a completion marker written last, the newest complete checkpoint, the pruning
configuration stored beside it, and disk-full errors said in one line (recognised by disk_writes.py, which also
flushes and atomically writes the marker).

transformers writes `checkpoint-N/` file by file (weights, optimizer, scheduler, RNG, then `trainer_state.json`) and
nothing says when it is done: a kill or a full disk in between leaves a folder that looks like a checkpoint, that
`get_last_checkpoint` picks, and that fails on load (or worse, loads a truncated optimizer). Here a checkpoint is
complete only when its marker `MARKER` exists, and the marker lists every file with its size, written after every
file has been flushed to disk (fsync) and renamed into place atomically. A file that is later truncated or deleted
makes the checkpoint incomplete again.

The marker also stores the pruning configuration: masks are a function of (prune_seed, step, micro-step, rank) and of
the sampling fields (docs/method.md, "Contract"), so resuming with other values would silently draw other masks.

A checkpoint the plugin did not write (stock `DPOTrainer`'s, or one from before the marker) has neither the marker nor
the `SAVING` sentinel the plugin writes first and removes last: it resumes, with a one-line note that its files are not
verified. A plugin save cut short leaves the sentinel (or its per-process run state) without the marker: skipped.

Several processes: the marker has one writer (`args.should_save`: the main process, or one per node with
`save_on_each_node`), written through a unique temporary name and renamed atomically; only the main process removes a
failed checkpoint. A failure on any process is shared with all of them (one exchange of one-line reasons), so every
process raises the same one-line error instead of waiting at a barrier for one that died.
"""

import json
import os
import re
import shutil
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import DiskFullError, ResumeError
from .disk_writes import free_bytes, fsync, give_default_modes, is_disk_full, write_json_atomic

if TYPE_CHECKING:
    from ..config import PrunedDPOConfig

MARKER = "pruned_dpo_complete.json"
# Per process: the logging window and the worst values, so that a resume logs like no resume.
RUN_STATE = "pruned_dpo_run_state.json"
MARKER_VERSION = 1
# Written before a checkpoint's first file, removed once its marker is in place.
SAVING = "pruned_dpo_saving"

# The fields that decide which masks are drawn (docs/method.md) and which pairs share a batch (`group_by_prompt`);
# compared on resume.
PRUNING_FIELDS = (
    "position_keep_prob", "prefix_prune_prob", "prefix_min_ratio", "branch_keep_prob", "branch_sampling",
    "prune_reference", "prune_common_prefix", "prune_seed", "group_by_prompt",
)
OVERRIDE_FLAG = "allow_pruning_change_on_resume"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
# Not part of a checkpoint's content: the marker itself, and the sentinel transformers' JIT checkpoint writes before
# calling `_save_checkpoint` and removes after it (it would be listed, then missing).
_NOT_CONTENT = {MARKER, SAVING, "checkpoint-is-incomplete.txt"}


def _is_content(path: Path) -> bool:
    """Whether `path` belongs in the manifest (not the marker, its temporary copies, the sentinels)."""
    return path.name not in _NOT_CONTENT and not (path.name.startswith(f".{MARKER}.") and path.name.endswith(".tmp"))


# --- writing --------------------------------------------------------------------------------------------------------


def pruning_config(args: "PrunedDPOConfig") -> dict:
    return {name: getattr(args, name) for name in PRUNING_FIELDS}


def mark_complete(folder: str | os.PathLike, args: "PrunedDPOConfig", step: int) -> None:
    """Write the completion marker of `folder`: every file flushed to disk first, then the manifest, atomically."""
    folder = Path(folder)
    give_default_modes(folder)
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and _is_content(p)):
        fsync(path)
        files[path.relative_to(folder).as_posix()] = path.stat().st_size
    for directory in [folder, *(p for p in folder.rglob("*") if p.is_dir())]:
        fsync(directory, directory=True)
    write_json_atomic(folder / MARKER, {
        "version": MARKER_VERSION, "step": step, "files": files, "pruning": pruning_config(args),
    })
    (folder / SAVING).unlink(missing_ok=True)


def unmark(folder: str | os.PathLike) -> None:
    """Before (re)writing a checkpoint folder: remove its marker and leave the `SAVING` sentinel, so a half-written
    one is never trusted, nor taken for a stock checkpoint."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / MARKER).unlink(missing_ok=True)
    (folder / SAVING).touch()


def _run_state_path(folder: str | os.PathLike, rank: int) -> Path:
    return Path(folder) / RUN_STATE.replace(".json", f"-{rank}.json")


def write_run_state(folder: str | os.PathLike, rank: int, state: dict) -> None:
    """This process's logging window and worst values, beside its checkpoint (covered by the marker)."""
    path = _run_state_path(folder, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(state))


def read_run_state(folder: str | os.PathLike, rank: int) -> dict | None:
    """The state `write_run_state` saved, or None (a checkpoint from before it existed, or another world size)."""
    try:
        return json.loads(_run_state_path(folder, rank).read_text())
    except (OSError, ValueError):
        return None


# --- reading --------------------------------------------------------------------------------------------------------


def incomplete_reason(folder: str | os.PathLike) -> str | None:
    """Why `folder` is not a complete checkpoint, or None if it is."""
    folder = Path(folder)
    marker = folder / MARKER
    if not marker.is_file():
        if not any(folder.iterdir()):
            return "empty"
        if is_foreign(folder):
            return None
        missing = [name for name in ("trainer_state.json",) if not (folder / name).is_file()]
        return "no completion marker" + (f", no {missing[0]}" if missing else "") + " (interrupted while saving)"
    try:
        manifest = json.loads(marker.read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return "unreadable completion marker"
    for name, size in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} missing"
        if path.stat().st_size != size:
            return f"{name} is {path.stat().st_size} bytes, {size} when saved (truncated or overwritten)"
    return None


def is_foreign(folder: str | os.PathLike) -> bool:
    """A checkpoint trl-pruned-dpo did not write (stock `DPOTrainer`'s): no marker, no trace of a plugin save (the
    `SAVING` sentinel, a run state), and transformers' last file, `trainer_state.json`, in place."""
    folder = Path(folder)
    return (not (folder / MARKER).exists() and not (folder / SAVING).exists()
            and (folder / "trainer_state.json").is_file() and not any(folder.glob(RUN_STATE.replace(".json", "-*"))))


def checkpoint_step(folder: str | os.PathLike) -> int | None:
    match = _CHECKPOINT.match(Path(folder).name)
    return int(match.group(1)) if match else None


def scan(output_dir: str | os.PathLike) -> tuple[Path | None, list[tuple[Path, str]]]:
    """(newest complete checkpoint in `output_dir` or None, [(newer incomplete checkpoint, why)], newest first)."""
    root = Path(output_dir)
    if not root.is_dir():
        return None, []
    folders = [p for p in root.iterdir() if p.is_dir() and checkpoint_step(p) is not None]
    skipped = []
    for folder in sorted(folders, key=checkpoint_step, reverse=True):
        reason = incomplete_reason(folder)
        if reason is None:
            return folder, skipped
        skipped.append((folder, reason))
    return None, skipped


def last_complete(output_dir: str | os.PathLike) -> Path | None:
    return scan(output_dir)[0]


def stored_pruning(folder: str | os.PathLike) -> dict | None:
    try:
        return json.loads((Path(folder) / MARKER).read_text()).get("pruning")
    except (OSError, ValueError):
        return None


def pruning_differences(folder: str | os.PathLike, args: "PrunedDPOConfig") -> list[str]:
    """`field: checkpoint value -> this run's value` for every pruning field that differs."""
    stored = stored_pruning(folder) or {}
    now = pruning_config(args)
    return [f"{name} {stored[name]!r} -> {now[name]!r}" for name in PRUNING_FIELDS
            if name in stored and stored[name] != now[name]]


def is_resume_request(value: str | bool | None) -> bool:
    """`--resume_from_checkpoint true/auto/last` (any case), or `True` from Python."""
    return value is True or (isinstance(value, str) and value.strip().lower() in ("true", "auto", "last"))


def resolve_resume(value: str | bool | None, args: "PrunedDPOConfig") -> tuple[str | None, str | None]:
    """The checkpoint to resume from for `resume_from_checkpoint=value`, and a sentence saying what was chosen.

    `True`/"true"/"auto"/"last": the newest complete checkpoint in `args.output_dir`, skipping incomplete newer ones.
    A path: that checkpoint, which must be complete. Either way its stored pruning configuration must equal this
    run's, unless `args.allow_pruning_change_on_resume`. Raises ResumeError (one line) otherwise.
    """
    if value is None or value is False or (isinstance(value, str) and value.strip().lower() in ("", "false", "no")):
        return None, None
    output_dir = args.output_dir
    if is_resume_request(value):
        chosen, skipped = scan(output_dir)
        if chosen is None:
            found = "; ".join(f"{p.name}: {why}" for p, why in skipped) or "no checkpoint-* folder"
            raise ResumeError(f"nothing to resume in {output_dir}: no complete checkpoint ({found}). Start without "
                              "--resume_from_checkpoint, or point it at a complete checkpoint.")
        note = f"resuming from {chosen}"
        if skipped:
            note += " (skipped incomplete " + "; ".join(f"{p.name}: {why}" for p, why in skipped) + ")"
    else:
        chosen = Path(value)
        if not chosen.is_dir():
            raise ResumeError(f"checkpoint {value} does not exist: pass a checkpoint folder, or `true` for the newest "
                              f"complete one in {output_dir}.")
        reason = incomplete_reason(chosen)
        if reason is not None:
            newest = last_complete(chosen.parent)
            hint = f"the newest complete one is {newest}" if newest else "there is no complete one beside it"
            raise ResumeError(f"checkpoint {chosen} is incomplete ({reason}): {hint}. Resume from that, or with "
                              "`--resume_from_checkpoint true`.")
        note = f"resuming from {chosen}"
    if is_foreign(chosen):
        note += (" (no trl-pruned-dpo completion marker, e.g. a stock DPOTrainer checkpoint: resumed as stock resumes "
                 "it, its files not verified)")
    changed = pruning_differences(chosen, args)
    if changed and not getattr(args, OVERRIDE_FLAG, False):
        raise ResumeError(f"checkpoint {chosen} was trained with other pruning settings ({', '.join(changed)}): a "
                          "resumed run would draw other masks. Use the checkpoint's values, or pass "
                          f"--{OVERRIDE_FLAG} true to resume with the new ones.")
    if changed:
        note += f"; pruning settings changed on purpose ({', '.join(changed)})"
    return str(chosen), note


# --- disk full ------------------------------------------------------------------------------------------------------


def disk_full_message(what: str, where: str | os.PathLike, output_dir: str | os.PathLike) -> str:
    free = free_bytes(where)
    last = last_complete(output_dir)
    return (f"disk full while writing {what} ({Path(where).absolute()}, {0 if free is None else free >> 20} MiB "
            f"free); the last complete checkpoint is {last or 'none'}. Free some space and resume with "
            "--resume_from_checkpoint true.")


@contextmanager
def disk_full_as_error(what: str, where: str | os.PathLike, output_dir: str | os.PathLike | None = None):
    """Re-raise an out-of-space error inside the block as a one-line DiskFullError naming `what` and `where`."""
    try:
        yield
    except DiskFullError:
        raise
    except Exception as error:
        if not is_disk_full(error, where):
            raise
        raise DiskFullError(disk_full_message(what, where, output_dir or where)) from None


# --- saving ---------------------------------------------------------------------------------------------------------


def _agree(args: "PrunedDPOConfig", error: BaseException | None) -> tuple[str | None, int | None, bool]:
    """Every process learns whether any failed, and why: (the one-line reason, the failing process, whether it is a
    full disk), the same on all, or (None, None, False). One exchange of small objects, instead of a barrier that a
    process which died would never reach. `args`: the trainer's (its process index and world size)."""
    local = None if error is None else " ".join(str(error).split()) or type(error).__name__
    me, full = args.process_index, isinstance(error, DiskFullError)
    if args.world_size == 1:
        return local, (None if local is None else me), full
    from accelerate.utils import gather_object

    failed = [f for f in gather_object([(me, local, full)]) if f[1] is not None]
    if not failed:
        return None, None, False
    # A full disk first: it names the remedy.
    rank, reason, full = min(failed, key=lambda f: (not f[2], f[0]))
    return reason, rank, full


def save_complete(trainer: Any, save: Callable[[Any, Any], None], model: Any, trial: Any, run_state: dict,
                  run_dir: str) -> None:
    """`save(model, trial)` (TRL's checkpoint, in `run_dir`), then every process's `run_state` and the completion
    marker; older checkpoints are rotated only after the new one is complete. A failure on any process (a full disk
    said in one line, the partial folder removed by the main process) ends every process with the same one-line
    error."""
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

    args = trainer.args
    folder = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}")
    name = os.path.basename(folder)
    limit, args.save_total_limit = args.save_total_limit, None

    def attempt(step: Callable[[], object]) -> BaseException | None:
        try:
            step()
        except Exception as error:
            # The error is shared with every process below.
            if is_disk_full(error, folder):
                return DiskFullError(disk_full_message(name, folder, run_dir) + " The incomplete checkpoint was "
                                     "removed.")
            return error
        return None

    def files():
        if args.should_save:
            unmark(folder)
        save(model, trial)
        write_run_state(folder, args.process_index, run_state)

    try:
        for step in (files, lambda: mark_complete(folder, args, trainer.state.global_step) if args.should_save
                     else None):
            error = attempt(step)
            # Every file is written before the marker, on every process.
            reason, rank, full = _agree(args, error)
            if reason is None:
                continue
            # One process cleans: the others may share the folder.
            if full and trainer.is_world_process_zero():
                shutil.rmtree(folder, ignore_errors=True)
            if rank == args.process_index:
                raise error
            if full:
                raise DiskFullError(reason)
            raise RuntimeError(f"process {rank} failed while saving {name}: {reason}")
    finally:
        args.save_total_limit = limit
    if args.should_save:
        rotate_checkpoints(output_dir=run_dir, save_total_limit=limit,
                           best_model_checkpoint=trainer.state.best_model_checkpoint, use_mtime=True)
