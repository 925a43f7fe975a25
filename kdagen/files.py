"""Writing a file so that a reader sees the old bytes or the new ones, never a part of them."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

__all__ = ["write_atomic"]

FILE_MODE = 0o644


def write_atomic(path: Path, data: bytes, *, durable: bool = False) -> None:
    """Write `data` to a temp file beside `path`, then `os.replace` it into place (same file system).

    `durable` also fsyncs before the rename (cache artifacts and their commit marker). The mode is 0644:
    `mkstemp` makes 0600 files, and a cache or a generated tree may be shared by the users of a build box.
    The parent directory must exist.
    """
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.chmod(tmp, FILE_MODE)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
