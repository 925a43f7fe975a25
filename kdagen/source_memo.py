"""The rendered-source digests of a variant, remembered so that a cache hit needs no Jinja.

The cache key hashes the sha256 of every rendered stage file (`kdagen.keys`), so a key used to cost a render,
and importing Jinja plus rendering was most of a first `get_kernel` in a process. A render is a pure
function of the spec, the generator's code (planner and renderer: the ``*.py`` of the `kdagen` package), the
template files and the Jinja and pydantic versions: ``render.py`` promises the same bytes for the same
inputs on every machine, and the planner reads no environment. This module hashes exactly those inputs into
a memo id and keeps ``{stage file: sha256}`` under ``<cache dir>/sources/<memo id>.json``.

A changed template, planner line or Jinja release gives another memo id, so a stale memo is never read. Only
digests are stored, never sources: a build that must compile renders again. Memos are an optimisation only: a
cache directory that cannot be written, or a memo that does not parse, falls back to rendering.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata as md
import json
from pathlib import Path

from kdagen import paths
from kdagen.files import tree_digest, write_atomic
from kdagen.version import __version__

__all__ = ["generator_digest", "memo_id", "load_digests", "store_digests", "MEMO_DIR"]

MEMO_DIR = paths.CACHE_SOURCES_SUBDIR
_FORMAT = 1  # bump when the memo's content changes meaning


@functools.cache
def _version(package: str) -> str:
    # From metadata, not an import: not importing Jinja (nor pydantic) is the point of the memo.
    try:
        return md.version(package)
    except md.PackageNotFoundError:
        return "none"


def generator_digest(templates: Path | None = None, package: Path | None = None) -> str:
    """sha256 over everything a render depends on besides the spec.

    Read afresh on every call (about a millisecond): a long-lived process that edits a template sees the edit.
    """
    # pydantic too: templates print spec fields as its model validates them (`kdagen.spec_model`).
    versions = (
        f"kdagen {__version__}; jinja2 {_version('jinja2')}; pydantic {_version('pydantic')}; memo {_FORMAT}"
    )
    h = hashlib.sha256(versions.encode() + b"\n")
    h.update(b"package\n")
    tree_digest(h, package or paths.package_dir(), "*.py")
    h.update(b"templates\n")
    tree_digest(h, templates or paths.templates_dir(), "*")
    return h.hexdigest()


def memo_id(spec_json: str, generator: str) -> str:
    """The memo's file stem: one spec, one generator."""
    return hashlib.sha256(f"{generator}\n{spec_json}".encode()).hexdigest()[:32]


def _memo_path(spec_json: str, generator: str, root: Path | None) -> Path:
    return (root or paths.cache_dir()) / MEMO_DIR / f"{memo_id(spec_json, generator)}.json"


def load_digests(spec_json: str, generator: str, root: Path | None = None) -> dict[str, str] | None:
    """The remembered ``{stage file: sha256}``, or None when there is none (or it is unreadable)."""
    path = _memo_path(spec_json, generator, root)
    try:
        memo = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(memo, dict) or memo.get("spec") != spec_json or memo.get("generator") != generator:
        return None  # a truncated or foreign file: render instead
    digests = memo.get("sources")
    if (
        not isinstance(digests, dict)
        or not digests
        or not all(isinstance(k, str) and isinstance(v, str) and len(v) == 64 for k, v in digests.items())
    ):
        return None
    return dict(digests)


def store_digests(spec_json: str, generator: str, digests: dict[str, str], root: Path | None = None) -> None:
    """Remember the digests (atomically; silently skipped where the cache directory is read-only)."""
    if load_digests(spec_json, generator, root) == digests:
        return  # already there: `kdagen list` and friends describe every variant on every run
    path = _memo_path(spec_json, generator, root)
    text = json.dumps({"spec": spec_json, "generator": generator, "sources": digests}, sort_keys=True)
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, text.encode())
