"""One run per output folder, and a folder that can be written, checked before any work (`preflight`).

The lock is an advisory `flock` on `output_dir/LOCK_NAME`: the kernel releases it when the process ends, however it
ends (kill -9 included), so a lock file left behind by a dead run is stale by construction and simply taken over. The
file holds the owner's pid, host and start time, for the message a second run prints. `flock` is per host on network
filesystems that do not forward it; the lock is a guard against mistakes, not a distributed mutex.
"""

import errno
import fcntl
import os
import socket
import tempfile
import time
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import OutputDirError
from . import checkpoints

if TYPE_CHECKING:
    from ..config import PrunedDPOConfig

LOCK_NAME = ".trl-pruned-dpo.lock"


def _existing_ancestor(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_writable(output_dir: str | os.PathLike) -> None:
    """Fail in one line if `output_dir` (or, before it exists, the folder it will be created in) cannot be written.

    Creates and removes a temporary file there: permission bits alone miss read-only mounts, root squash and /proc
    (where `os.access` says yes to root).
    """
    target = Path(output_dir).expanduser()
    where = target if target.is_dir() else _existing_ancestor(target)
    if not where.is_dir():
        raise OutputDirError(f"output_dir {output_dir} cannot be created: {where} is a file, not a folder. Choose "
                             "another output_dir.")
    try:
        with tempfile.NamedTemporaryFile(dir=where, prefix=".trl-pruned-dpo-write-test-"):
            pass
    except OSError as error:
        reason = error.strerror or str(error)
        raise OutputDirError(f"output_dir {output_dir} is not writable: {where} cannot be written ({reason}). Choose "
                             "a writable output_dir or fix its permissions.") from None


def _owner(path: Path) -> str:
    try:
        info = dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)
    except OSError:
        return "another process"
    return f"pid {info.get('pid', '?')} on {info.get('host', '?')}, since {info.get('started', '?')}"


def check_free(output_dir: str | os.PathLike) -> None:
    """Fail early if another live run holds `output_dir` (the lock itself is taken later, by `OutputLock`)."""
    path = Path(output_dir) / LOCK_NAME
    if not path.is_file():
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as error:
        if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise _busy(output_dir, path) from None
    finally:
        os.close(fd)


def _busy(output_dir: str | os.PathLike, path: Path) -> OutputDirError:
    return OutputDirError(f"output_dir {output_dir} is in use by another trl-pruned-dpo run ({_owner(path)}): wait "
                          f"for it to end, or choose another output_dir (two runs would overwrite each other's "
                          "checkpoints).")


class OutputLock:
    """Hold the lock on `output_dir` for the life of the `with` block (and of the process, at the latest)."""

    def __init__(self, output_dir: str | os.PathLike):
        self.output_dir = output_dir
        self.path = Path(output_dir) / LOCK_NAME
        self.fd: int | None = None
        # The owner named by a stale lock file that was taken over.
        self.took_over: str | None = None

    def __enter__(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as error:
                os.close(fd)
                if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise _busy(self.output_dir, self.path) from None
                raise
            # The previous owner may have unlinked the file between our open and our flock: then we hold a lock on
            # a file nobody else will open. Retry on the file now at the path.
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        stale = os.read(fd, 4096).decode(errors="replace")
        if "pid=" in stale:
            self.took_over = _owner(self.path)
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
        os.write(fd, f"pid={os.getpid()}\nhost={socket.gethostname()}\nstarted={started}\n".encode())
        self.fd = fd
        return self

    def __exit__(self, *exc: object) -> bool:
        if self.fd is not None:
            try:
                # Unlinked while still locked: a waiting run then retries on a new file.
                self.path.unlink(missing_ok=True)
            except OSError:
                pass
            os.close(self.fd)
            self.fd = None
        return False


def is_main_process() -> bool:
    """The process that owns the run's lock: the only one, or global rank 0 under a launcher."""
    return os.environ.get("RANK", "0") == "0"


def preflight(training_args: "PrunedDPOConfig") -> None:
    """One-line errors (OutputDirError, ResumeError) before any work: writable, not in use, resumable."""
    check_writable(training_args.output_dir)
    # The other ranks would see their own run's lock.
    if is_main_process():
        check_free(training_args.output_dir)
    checkpoints.resolve_resume(training_args.resume_from_checkpoint, training_args)


def output_lock(output_dir: str | os.PathLike) -> AbstractContextManager:
    """`OutputLock(output_dir)` in the main process; nothing in the other ranks of the same run."""
    return OutputLock(output_dir) if is_main_process() else nullcontext()
