"""The studies' one resumable result store: JSON files keyed by a fingerprint of what produced them.

Both drivers (quality.py, regimes.py) and the report (write_doc.py) use it, so it sits below all of them and imports
nothing of the study: a result is reused only while the fingerprint of its configuration is unchanged.
"""

import hashlib
import json
import os
import subprocess
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def fingerprint(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def load(path: Path, expected: str):
    """The cached result at `path`, or None when there is none or it was produced by another configuration."""
    if path.is_file():
        data = json.loads(path.read_text())
        if data.get("fingerprint") == expected:
            return data
    return None


def save(path: Path, data: dict):
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")  # one writer per process (--jobs)
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


def setting_key(setting) -> dict:
    """What identifies a setting's results. Prototype options added after results were first cached are left out
    at their default, so adding one does not invalidate those results."""
    key = asdict(setting)
    for late in ("balanced", "accumulation"):
        if key[late] in (False, 1):
            del key[late]
    law = key.pop("mask_law")  # was a boolean `shared_masks` when the first results were cached
    key["shared_masks"] = law == "pair"
    if law == "row":
        key["row_masks"] = True
    return key


def commit() -> str:
    """The commit the results were produced at, for the report ("unknown" outside a git checkout)."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
