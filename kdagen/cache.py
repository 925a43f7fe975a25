"""The artifact store: ``<root>/<arch>/<slug>-<key>/{<stage>.o, meta.json}``.

Rules (design.md "Keys"):

- publish writes each artifact to a temp file in the entry directory and `os.replace`s it into place;
  ``meta.json`` is written last and is the commit marker: an entry without it does not exist;
- `lookup` trusts nothing: meta must parse and match the key, the spec and the stages, and every artifact's
  size and sha256 must match, else it returns None and the caller rebuilds (self-healing, never a crash);
- `lock` gives a per-entry file lock; callers look up again after taking it, since another process may
  have published meanwhile;
- publish removes every file an earlier build left in the entry (a ``.so`` the new build did not make must
  not sit beside the new objects);
- a store that cannot be written (a read-only directory, a directory where ``meta.json`` or ``.lock``
  belongs) is a `CacheError` naming the path and the remedy, raised before anything is compiled.

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
from kdagen.errors import CacheError
from kdagen.files import sha256_file, write_atomic

if TYPE_CHECKING:
    from filelock import FileLock

__all__ = ["ArtifactCache", "CacheEntry", "Cleaned", "META_NAME", "ARTIFACT_SUFFIX"]

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


def artifact_file(name: str) -> str:
    """The file an artifact is stored in: ``<name>.o`` unless the name carries its own suffix."""
    return name if "." in name else f"{name}{ARTIFACT_SUFFIX}"


def _remove_stale(entry: Path, keep: set[str]) -> None:
    """Delete the artifact files of an earlier build that `keep` does not name.

    Hidden files (the lock, another publisher's temp files) and folders (the rendered sources) stay.
    """
    for path in entry.iterdir():
        if path.name in keep or path.name.startswith(".") or path.name == META_NAME or not path.is_file():
            continue
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _read_meta(path: Path) -> dict[str, Any] | None:
    try:
        meta = json.loads((path / META_NAME).read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


@dataclass(frozen=True)
class Cleaned:
    """What `ArtifactCache.clean` removed: the number of entries, and the derived-data folders by name."""

    entries: int
    derived: tuple[str, ...] = ()


# Beside the <arch>/ folders: data derived from the sources (compiled templates, remembered digests), which a
# clean of every target removes with the entries.
_DERIVED_SUBDIRS = (paths.CACHE_SOURCES_SUBDIR, paths.CACHE_TEMPLATES_SUBDIR)


def _cache_error(path: Path, root: Path, e: OSError | str) -> CacheError:
    why = e if isinstance(e, str) else (e.strerror or str(e))
    return CacheError(
        f"cache: cannot write {path}: {why}; make the cache directory {root} writable (and remove what is "
        f"in the way), or set {paths.ENV_CACHE_DIR} to a writable directory"
    )


class _EntryLock:
    """A `FileLock` whose failures to open the lock file are `CacheError`s (its timeout stays `Timeout`)."""

    def __init__(self, lock: FileLock, root: Path) -> None:
        self._lock = lock
        self._root = root

    def __enter__(self) -> _EntryLock:
        from filelock import Timeout

        try:
            self._lock.acquire()
        except Timeout:
            raise
        except OSError as e:
            raise _cache_error(Path(self._lock.lock_file), self._root, e) from e
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


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
                    or sha256_file(path) != info.get("sha256")
                ):
                    return None
            except OSError:
                return None
            out[stage] = path
        return out

    # -- writing ------------------------------------------------------------------------------------------

    def lock(self, spec: SpecLike, key: str, timeout: float = -1) -> _EntryLock:
        """A file lock for one entry (use as a context manager). Look up again after acquiring it.

        `timeout` < 0 waits forever: a compile holding it can take minutes. Makes the entry directory and
        checks that the entry can be written, so a store that cannot take the build fails here, before a
        compile, with a `CacheError`.
        """
        from filelock import FileLock  # here: a process that only loads cached kernels never locks

        entry = self._writable_entry(spec, key)
        return _EntryLock(FileLock(str(entry / LOCK_NAME), timeout=timeout), self.root)

    def _writable_entry(self, spec: SpecLike, key: str) -> Path:
        """The entry directory, made if missing; `CacheError` where it or its files cannot be written."""
        entry = self.entry_dir(spec, key)
        try:
            entry.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise _cache_error(entry, self.root, e) from e
        for name in (META_NAME, LOCK_NAME):
            if (entry / name).is_dir():
                raise _cache_error(entry / name, self.root, "a directory where a file belongs")
        if not os.access(entry, os.W_OK | os.X_OK):
            raise _cache_error(entry, self.root, "the directory is not writable")
        return entry

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
        entry = self._writable_entry(spec, key)
        try:
            return self._publish(entry, spec, key, artifacts, meta or {})
        except OSError as e:
            raise _cache_error(Path(e.filename) if e.filename else entry, self.root, e) from e

    def _publish(
        self, entry: Path, spec: SpecLike, key: str, artifacts: dict[str, bytes], meta: dict[str, Any]
    ) -> dict[str, Path]:
        # Withdraw the commit marker first, so that a reader never pairs an old meta with new artifacts.
        with contextlib.suppress(FileNotFoundError):
            (entry / META_NAME).unlink()
        _remove_stale(entry, {artifact_file(stage) for stage in artifacts})
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
            **meta,
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

    def clean(self, arch: str | None = None) -> Cleaned:
        """Delete the entries of one arch, or of all and the derived data beside them; says what went.

        Only directories shaped like entries (``<slug>-<24 hex>`` under ``sm_NN[a]/``) and the derived-data
        folders (``sources/``, ``templates/``: recomputed on the next build or load) are touched, so a
        mistaken ``KDAGEN_CACHE_DIR`` cannot wipe unrelated files. The derived data is not target-specific,
        so a clean of one arch keeps it.
        """
        removed = 0
        for adir in self._arch_dirs(arch):
            for d in list(adir.iterdir()):
                if d.is_dir() and _ENTRY_RE.match(d.name):
                    shutil.rmtree(d, ignore_errors=True)
                    removed += 1
            with contextlib.suppress(OSError):
                adir.rmdir()  # only if now empty
        derived: list[str] = []
        if arch is None:
            for name in _DERIVED_SUBDIRS:
                if (self.root / name).is_dir():
                    shutil.rmtree(self.root / name, ignore_errors=True)
                    derived.append(name)
        return Cleaned(removed, tuple(derived))
