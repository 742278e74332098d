"""A built-in dataset as a local folder of JSON-lines splits (``train.jsonl``, ``test.jsonl``), for tools that take
only paths: `python -m trl_pruned_dpo.demo prepare`, and `trl dpo` under the opt-in hook (trl_hook_startup.py).

The default folder is named by a hash of its content, under the demo cache: the same name and seed always give the
same folder, a changed generator a new one. It is written into a temporary sibling and renamed, so processes started
together (one per rank) never read a half-written split.
"""

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path

from .model import cache_dir
from .tasks import BUILTIN_PREFIX, load_builtin


def _write_splits(splits: dict[str, str], folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for split, text in splits.items():
        (folder / f"{split}.jsonl").write_text(text)


def export_builtin(name: str, folder: Path | None = None, seed: int = 0) -> Path:
    """Write the splits of built-in dataset `name` (``builtin:<task>``) as `<folder>/<split>.jsonl`; returns the
    folder (by default, the cached one)."""
    splits = {split: "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in data)
              for split, data in load_builtin(name, seed).items()}
    if folder is not None:
        _write_splits(splits, folder)
        return folder
    digest = hashlib.sha256(json.dumps(splits, sort_keys=True).encode()).hexdigest()[:10]
    folder = cache_dir() / "datasets" / f"{name.removeprefix(BUILTIN_PREFIX)}-seed{seed}-{digest}"
    if folder.is_dir():
        return folder
    # A plain mkdir of a unique sibling (not mkdtemp, which would leave the folder 0700), then one rename.
    temporary = folder.with_name(f".{folder.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        _write_splits(splits, temporary)
        try:
            temporary.rename(folder)
        except OSError:
            # Another process got there first; its folder is identical.
            if not folder.is_dir():
                raise
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
    return folder
