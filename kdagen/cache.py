"""The artifact store: ``<root>/<arch>/<slug>-<key>/{<stage>.o, meta.json}``.

Rules (design.md "Keys"):

- publish writes each artifact to a temp file in the entry directory and `os.replace`s it into place;
  ``meta.json`` is written last and is the commit marker: an entry without it does not exist;
- `lookup` trusts nothing: meta must parse and match the key, the spec and the stages, and every artifact's
  size and sha256 must match, else it returns None and the caller rebuilds (self-healing, never a crash);
- `lock` gives a per-entry file lock; callers look up again after taking it, since another process may
  have published meanwhile.

This module knows nothing about KDA beyond ``spec.arch``, ``spec.slug()`` and ``spec.canonical_json()``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from kdagen import paths
from kdagen.files import write_atomic

if TYPE_CHECKING:
    from filelock import FileLock

__all__ = ["ArtifactCache", "CacheEntry", "META_NAME", "ARTIFACT_SUFFIX"]

META_NAME = "meta.json"
ARTIFACT_SUFFIX = ".o"
LOCK_NAME = ".lock"
# An artifact name is a stage name (stored as <name>.o) or a file name with its own suffix (<stage>.so).
_STAGE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*(\.[a-z]+)?$")
_ENTRY_RE = re.compile(r"^.+-[0-9a-f]{24}$")  # <slug>-<24 hex key>: what clean() may delete
_ARCH_RE = re.compile(r"^sm_\d+[a-z]?$")


class SpecLike(Protocol):
    arch: str

    def slug(self) -> str: ...

    def canonical_json(self) -> str: ...


@dataclass(frozen=True)
class CacheEntry:
    """One directory of the store, as found on disk (`meta` is None when missing or unreadable)."""

    arch: str
    name: str  # <slug>-<key>
    path: Path
    meta: dict[str, Any] | None
    bytes: int  # total size of the files in it

    @property
    def key(self) -> str | None:
        return (self.meta or {}).get("key")

    @property
    def complete(self) -> bool:
        return self.meta is not None


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def artifact_file(name: str) -> str:
    """The file an artifact is stored in: ``<name>.o`` unless the name carries its own suffix."""
    return name if "." in name else f"{name}{ARTIFACT_SUFFIX}"


def _read_meta(path: Path) -> dict[str, Any] | None:
    try:
        meta = json.loads((path / META_NAME).read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


class ArtifactCache:
    """The artifact store rooted at `root` (default ``$KDAGEN_CACHE_DIR`` or ``~/.cache/kdagen``)."""

    def __init__(self, root: str | os.PathLike[str] | None = None) -> None:
        self.root = Path(root).expanduser() if root is not None else paths.cache_dir()

    def __repr__(self) -> str:
        return f"ArtifactCache({str(self.root)!r})"

    def entry_dir(self, spec: SpecLike, key: str) -> Path:
        return self.root / spec.arch / f"{spec.slug()}-{key}"

    # -- reading ------------------------------------------------------------------------------------------

    def lookup(self, spec: SpecLike, key: str, stages: Iterable[str]) -> dict[str, Path] | None:
        """{stage: path of its ``.o``} if a complete, intact entry exists; else None (the caller rebuilds)."""
        entry = self.entry_dir(spec, key)
        meta = _read_meta(entry)
        stages = list(stages)
        if (
            meta is None
            or meta.get("key") != key
            or meta.get("spec") != json.loads(spec.canonical_json())
            or meta.get("stages") != stages
        ):
            return None
        arts = meta.get("artifacts")
        if not isinstance(arts, dict) or set(arts) != set(stages):
            return None
        out: dict[str, Path] = {}
        for stage in stages:
            info = arts[stage]
            path = entry / artifact_file(stage)
            try:
                if (
                    not isinstance(info, dict)
                    or path.stat().st_size != info.get("bytes")
                    or _sha256_file(path) != info.get("sha256")
                ):
                    return None
            except OSError:
                return None
            out[stage] = path
        return out

    # -- writing ------------------------------------------------------------------------------------------

    def lock(self, spec: SpecLike, key: str, timeout: float = -1) -> FileLock:
        """A file lock for one entry (use as a context manager). Look up again after acquiring it.

        `timeout` < 0 waits forever: a compile holding it can take minutes.
        """
        from filelock import FileLock  # here: a process that only loads cached kernels never locks

        entry = self.entry_dir(spec, key)
        entry.mkdir(parents=True, exist_ok=True)
        return FileLock(str(entry / LOCK_NAME), timeout=timeout)

    def publish(
        self, spec: SpecLike, key: str, artifacts: dict[str, bytes], meta: dict[str, Any] | None = None
    ) -> dict[str, Path]:
        """Store the artifacts of one entry atomically; returns {stage: path}.

        `artifacts` maps stage name -> object bytes, in stage order. `meta` holds anything extra worth
        keeping (compile seconds, toolchain, key parts); kdagen's own fields (key, spec, stages, artifacts)
        take precedence over same-named ones in it.
        """
        if not artifacts:
            raise ValueError("publish: no artifacts")
        for stage in artifacts:
            if not _STAGE_RE.match(stage):
                raise ValueError(f"publish: stage name {stage!r} is not a plain file name")
        entry = self.entry_dir(spec, key)
        entry.mkdir(parents=True, exist_ok=True)
        # Withdraw the commit marker first, so that a reader never pairs an old meta with new artifacts.
        with contextlib.suppress(FileNotFoundError):
            (entry / META_NAME).unlink()
        out: dict[str, Path] = {}
        records: dict[str, dict[str, Any]] = {}
        for stage, data in artifacts.items():
            path = entry / artifact_file(stage)
            write_atomic(path, data, durable=True)
            out[stage] = path
            records[stage] = {
                "file": path.name,
                "bytes": len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
            }
        full = {
            **(meta or {}),
            "key": key,
            "slug": spec.slug(),
            "arch": spec.arch,
            "spec": json.loads(spec.canonical_json()),
            "stages": list(artifacts),
            "artifacts": records,
        }
        meta_text = json.dumps(full, indent=2, sort_keys=True) + "\n"
        write_atomic(entry / META_NAME, meta_text.encode(), durable=True)  # last: the commit marker
        return out

    # -- housekeeping -------------------------------------------------------------------------------------

    def _arch_dirs(self, arch: str | None) -> list[Path]:
        if not self.root.is_dir():
            return []
        if arch is not None:
            d = self.root / arch
            return [d] if d.is_dir() else []
        return sorted(d for d in self.root.iterdir() if d.is_dir() and _ARCH_RE.match(d.name))

    def entries(self, arch: str | None = None) -> list[CacheEntry]:
        """Every entry directory (complete or not), sorted by arch then name."""
        out = []
        for adir in self._arch_dirs(arch):
            for d in sorted(adir.iterdir()):
                if d.is_dir() and _ENTRY_RE.match(d.name):
                    size = sum(f.stat().st_size for f in d.iterdir() if f.is_file())
                    out.append(CacheEntry(adir.name, d.name, d, _read_meta(d), size))
        return out

    def clean(self, arch: str | None = None) -> int:
        """Delete the entries of one arch (or all); returns how many were removed.

        Only directories shaped like entries (``<slug>-<24 hex>`` under ``sm_NN[a]/``) are touched, so a
        mistaken ``KDAGEN_CACHE_DIR`` cannot wipe unrelated files.
        """
        removed = 0
        for adir in self._arch_dirs(arch):
            for d in list(adir.iterdir()):
                if d.is_dir() and _ENTRY_RE.match(d.name):
                    shutil.rmtree(d, ignore_errors=True)
                    removed += 1
            with contextlib.suppress(OSError):
                adir.rmdir()  # only if now empty
        return removed
