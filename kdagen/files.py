"""Files: writing one so that a reader sees the old bytes or the new ones, never a part of them; hashing a
file or a tree of files."""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["write_atomic", "sha256_file", "tree_digest"]

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


def sha256_file(path: Path) -> str:
    """sha256 of a file's bytes, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def tree_digest(h: Any, root: Path, pattern: str) -> None:
    """Feed `h` the relative path and bytes of every file under `root` matching `pattern` (sorted, no
    `__pycache__`), each prefixed by the lengths, so that no two trees hash alike."""
    files = sorted(
        p for p in root.rglob(pattern) if p.is_file() and "__pycache__" not in p.relative_to(root).parts
    )
    for path in files:
        rel = path.relative_to(root).as_posix().encode()
        data = path.read_bytes()
        h.update(b"%d:%s%d:" % (len(rel), rel, len(data)))
        h.update(data)
