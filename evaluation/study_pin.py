"""What a pre-registered study cell was produced by (docs/study.md, "Changes", 2026-12-05), so that no cell is ever
reused from other code or data, and the one commit the study runs from.

- `Provenance`: the checkout's commit and whether it is dirty, the libraries' versions, and a hash of `auto`'s rules
  and the harness's scoring code (their source files, not a hand-kept string). Read once when the process starts
  (the code it imported) and checked again at each cell's start and end: a checkout that moved or changed meanwhile
  stops the study instead of crediting its cells to a commit that did not produce them.
- `data_hash`: a hash of a task's train and held-out pairs as the cells use them.
- The pin: `study_pin.txt` next to the store holds the one commit the study runs from (`--pin` writes it). Study
  cells refuse to run from another commit, from a dirty checkout, or with the package imported from elsewhere (an
  editable install of another checkout) (`--smoke` and `--allow-dirty` skip these checks, and their records say so).
"""

import hashlib
import json
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

from .store import REPO

# `auto`'s rules and the harness's scoring code: a change to any of these files makes every study cell new.
RULES_FILES = ("trl_pruned_dpo/auto.py", "trl_pruned_dpo/method/noise.py", "evaluation/real_run.py")
LIBRARIES = ("torch", "transformers", "trl", "peft", "accelerate", "datasets")
PIN_FILE = "study_pin.txt"
# Where the study's own results live: appending to a store inside the checkout does not make it dirty.
NOT_CODE = (":(exclude)evaluation/results", ":(exclude)runs")


def _git(*args: str, cwd: Path = REPO) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


def head_commit(cwd: Path = REPO) -> str:
    """The checkout's full commit hash ("unknown" outside a git checkout)."""
    try:
        return _git("rev-parse", "HEAD", cwd=cwd)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def dirty_paths(cwd: Path = REPO) -> list[str]:
    """Tracked files changed and files not ignored that git does not track, outside the results (`NOT_CODE`)."""
    try:
        return _git("status", "--porcelain", "--", ".", *NOT_CODE, cwd=cwd).splitlines()
    except (OSError, subprocess.CalledProcessError):
        return ["(not a git checkout)"]


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in LIBRARIES:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "absent"
    return out


def rules_hash() -> str:
    """A hash of `auto`'s rules and the scoring code, from their source files as this checkout has them."""
    digest = hashlib.sha256()
    for name in RULES_FILES:
        digest.update(name.encode() + b"\0" + (REPO / name).read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def data_hash(train_rows, eval_rows) -> str:
    """A hash of a task's train and held-out pairs, in the order the cells get them."""
    digest = hashlib.sha256()
    for split in (train_rows, eval_rows):
        for row in split:
            digest.update(json.dumps([row["prompt"], row["chosen"], row["rejected"]], sort_keys=True).encode())
        digest.update(b"\1")
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class Provenance:
    commit: str
    dirty: bool
    versions: dict
    rules: str

    @classmethod
    def read(cls) -> "Provenance":
        return cls(commit=head_commit(), dirty=bool(dirty_paths()), versions=versions(), rules=rules_hash())

    def key(self) -> dict:
        """What a cell's key holds of it (the dirty flag too: a dirty smoke cell is never a clean cell)."""
        return asdict(self)

    def pin_label(self) -> str:
        """What the report groups by: records of different labels are never mixed in one table."""
        libs = ",".join(f"{k}={v}" for k, v in sorted(self.versions.items()))
        return f"{self.commit[:12]}{'+dirty' if self.dirty else ''} rules {self.rules} [{libs}]"


def record_pin_label(record: dict) -> str:
    """`Provenance.pin_label` of a stored record (records without provenance: their short commit alone)."""
    if "provenance" not in record:
        return f"{record.get('commit', 'unknown')} (no provenance: before 2026-12-05)"
    p = record["provenance"]
    return Provenance(p["commit"], p["dirty"], p["versions"], p["rules"]).pin_label()


def read_pin(store_dir: Path) -> str | None:
    path = store_dir / PIN_FILE
    return path.read_text().split()[0] if path.is_file() and path.read_text().strip() else None


def write_pin(store_dir: Path) -> str:
    """Pin this checkout's commit for the study: refused from a dirty checkout. Returns the commit."""
    dirty = dirty_paths()
    if dirty:
        raise SystemExit("refusing to pin a dirty checkout (commit or remove these first):\n  " + "\n  ".join(dirty))
    commit = head_commit()
    store_dir.mkdir(parents=True, exist_ok=True)
    (store_dir / PIN_FILE).write_text(f"{commit}\n")
    return commit


def check_runnable(provenance: Provenance, store_dir: Path, bypass: bool) -> None:
    """Refuse to run study cells from a dirty checkout or from a commit other than the pinned one (`bypass`: the
    smoke protocol and `--allow-dirty`, whose cells carry their dirty flag and commit in their key)."""
    import trl_pruned_dpo

    package = Path(trl_pruned_dpo.__file__).resolve()
    if REPO not in package.parents and not bypass:  # e.g. an editable install of another checkout
        raise SystemExit(f"trl_pruned_dpo is imported from {package.parent}, not from this checkout ({REPO}): run "
                         "from the checkout's root (python -m ...), or with PYTHONPATH set to it")
    if bypass:
        return
    if provenance.dirty:
        raise SystemExit("refusing to run study cells from a dirty checkout (docs/study.md, 'Changes'):\n  "
                         + "\n  ".join(dirty_paths()))
    pinned = read_pin(store_dir)
    if pinned is None:
        raise SystemExit(f"no {store_dir / PIN_FILE}: pin the study's commit first (--pin, from a clean checkout)")
    if pinned != provenance.commit:
        raise SystemExit(f"this checkout is at {provenance.commit}, the study is pinned at {pinned}: run it from a "
                         f"checkout of the pinned commit (git worktree add <dir> {pinned})")


def check_unchanged(provenance: Provenance) -> None:
    """Between cells: the checkout must still be the code this process imported and the records name."""
    now = Provenance.read()
    if (now.commit, now.dirty, now.rules) != (provenance.commit, provenance.dirty, provenance.rules):
        was, is_ = (f"{p.commit[:12]}{'+dirty' if p.dirty else ''}" for p in (provenance, now))
        raise SystemExit(f"the checkout changed while the study ran ({was} -> {is_}, or its rules' files): stopping; "
                         "no cell of the changed code is stored")


def committed(path: Path) -> bool:
    """Whether `path` is tracked by the git checkout holding it, unchanged since its last commit."""
    try:
        _git("ls-files", "--error-unmatch", path.name, cwd=path.parent)
        return _git("status", "--porcelain", "--", path.name, cwd=path.parent) == ""
    except (OSError, subprocess.CalledProcessError):
        return False
