"""Writing to disk so that a crash or a full disk leaves nothing half-trusted: files flushed to disk (fsync), JSON
written atomically, new files given the mode of their siblings, and a full disk told apart from other write errors.

Knows nothing of checkpoints: checkpoints.py writes its completion marker through these, and says a full disk in one
line naming the last complete checkpoint (`disk_full_message`, `disk_full_as_error`).
"""

import errno
import json
import os
import shutil
import tempfile
from pathlib import Path


def fsync(path: Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    except OSError as error:
        # Some filesystems cannot fsync a directory; the data files were synced.
        if not directory or error.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def default_mode(directory: bool = False) -> int:
    """The mode a plain `open()` (or `mkdir()`) gives a new file (folder) under this process's umask."""
    umask = os.umask(0)
    os.umask(umask)
    return (0o777 if directory else 0o666) & ~umask


def give_default_modes(folder: str | os.PathLike) -> None:
    """Give the files and folders that an atomic writer left private (0600 / 0700) the mode of their siblings.

    safetensors >= 0.8 writes each weights file through a temporary file, which is created 0600 and renamed into place
    (safetensors issue 782), so `model.safetensors` came out `-rw-------` beside a `-rw-r--r--` config.json; stock
    `trl dpo` does the same. Only modes exactly 0600 / 0700 change, so a mode set on purpose otherwise is kept.
    """
    folder = Path(folder)
    for path in [folder, *folder.rglob("*")]:
        if path.is_dir() and not path.is_symlink() and path.stat().st_mode & 0o777 == 0o700:
            path.chmod(default_mode(directory=True))
        elif path.is_file() and not path.is_symlink() and path.stat().st_mode & 0o777 == 0o600:
            path.chmod(default_mode())


def write_json_atomic(path: Path, content: dict) -> None:
    """Write `content` to `path` so that a reader sees either nothing or all of it (write, fsync, rename). The
    temporary file's name is unique, so writers on several nodes sharing a filesystem never write the same file."""
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    # `mkstemp` creates it 0600; the marker is as readable as the checkpoint.
    os.chmod(temporary, default_mode())
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(json.dumps(content, indent=1, sort_keys=True))
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    fsync(path.parent, directory=True)


# --- disk full ------------------------------------------------------------------------------------------------------

_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
# torch.save's C++ stream writer reports a short write without an errno
_FULL_TEXT = ("no space left", "disk quota", "file too large", "iostream error", "unexpected pos",
              "file write failed", "ioerror")
LOW_SPACE_BYTES = 64 << 20


def free_bytes(path: str | os.PathLike) -> int | None:
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def is_disk_full(error: BaseException, where: str | os.PathLike) -> bool:
    """Whether `error`, raised while writing under `where`, means there was no room to write."""
    seen = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in _FULL_ERRNOS:
            return True
        seen = seen.__cause__ or seen.__context__
    text = str(error).lower()
    if not any(pattern in text for pattern in _FULL_TEXT):
        return False
    free = free_bytes(where)
    return "no space left" in text or "disk quota" in text or (free is not None and free < LOW_SPACE_BYTES)
