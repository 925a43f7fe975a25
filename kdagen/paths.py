"""Every path and every environment variable kdagen uses, in one place.

Where things are found:

- **From a checkout** (the normal case, including ``pip install -e .``): the package directory's parent is
  the repository root when it holds ``pyproject.toml``; ``templates/``, ``specs/``, ``generated/`` and
  ``benchmarks/`` are read from there.
- **From a wheel** (``pip install .``): pyproject maps ``templates/`` and ``specs/`` into the package as
  ``kdagen/_data/templates`` and ``kdagen/_data/specs``, so they ship as package data and are found there.
  Rendered sources then go to ``<cache dir>/generated`` unless ``KDAGEN_GENERATED_DIR`` says otherwise.

Environment variables (read on every call, so tests and long-lived processes see changes):

- ``KDAGEN_CACHE_DIR``: the artifact store; default ``~/.cache/kdagen``.
- ``KDAGEN_GENERATED_DIR``: where rendered sources are written; default ``<repo>/generated``.
- ``KDAGEN_DISABLE_JIT``: ``1``/``true``/``yes``/``on`` turns a cache miss into `CacheMissError`
  (serving must not compile).
- ``KDAGEN_BUNDLE``: bundles (`kdagen.bundle`) for `kdagen.get_kernel` to search before the cache, one
  directory or several separated by ``os.pathsep``. Unlike the others it is read once, at the first
  `kdagen.get_kernel` of a process: a bundle's manifest is checked when it is loaded, not per call.

The scheduling variables (``KDAGEN_INTRACARD_CP``, ``KDAGEN_OVERLAP``, ``KDAGEN_FUSED``,
``KDAGEN_FUSED_PAIR``, ``KDAGEN_SEQ_ORDER``, ``KDAGEN_DECODE_STREAM``; `SCHEDULE_ENV`) are different: an
override of the default `kdagen.policy.SchedulePolicy` for experiments, read once per process by
`kdagen.policy.default_policy`.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType

__all__ = [
    "ENV_CACHE_DIR",
    "ENV_DISABLE_JIT",
    "ENV_BUNDLE",
    "ENV_INTRACARD_CP",
    "ENV_OVERLAP",
    "ENV_FUSED",
    "ENV_FUSED_PAIR",
    "ENV_SEQ_ORDER",
    "ENV_DECODE_STREAM",
    "ENV_GENERATED_DIR",
    "package_dir",
    "repo_root",
    "data_root",
    "templates_dir",
    "specs_dir",
    "benchmarks_dir",
    "generated_dir",
    "cache_dir",
    "jit_disabled",
    "bundle_dirs",
    "find_spec_file",
    "load_module",
    "SCHEDULE_ENV",
    "schedule_env",
]

ENV_CACHE_DIR = "KDAGEN_CACHE_DIR"
ENV_DISABLE_JIT = "KDAGEN_DISABLE_JIT"
ENV_GENERATED_DIR = "KDAGEN_GENERATED_DIR"
ENV_BUNDLE = "KDAGEN_BUNDLE"
ENV_INTRACARD_CP = "KDAGEN_INTRACARD_CP"
ENV_OVERLAP = "KDAGEN_OVERLAP"
ENV_FUSED = "KDAGEN_FUSED"
ENV_FUSED_PAIR = "KDAGEN_FUSED_PAIR"
ENV_SEQ_ORDER = "KDAGEN_SEQ_ORDER"
ENV_DECODE_STREAM = "KDAGEN_DECODE_STREAM"
# The scheduling override (kdagen.policy): SchedulePolicy field -> environment variable.
SCHEDULE_ENV = {
    "intracard_cp": ENV_INTRACARD_CP,
    "overlap": ENV_OVERLAP,
    "fused": ENV_FUSED,
    "fused_pair": ENV_FUSED_PAIR,
    "seq_order": ENV_SEQ_ORDER,
    "decode_stream": ENV_DECODE_STREAM,
}

_TRUE = {"1", "true", "yes", "on"}

# Beside the artifact entries (<arch>/) in the cache directory: data derived from the sources, which
# `kdagen clean` removes with the entries.
CACHE_TEMPLATES_SUBDIR = "templates"  # compiled Jinja templates (render._CompiledTemplates)
CACHE_SOURCES_SUBDIR = "sources"  # remembered rendered-source digests (source_memo)


def package_dir() -> Path:
    """The directory of the `kdagen` package itself."""
    return Path(__file__).resolve().parent


def repo_root() -> Path | None:
    """The checkout this package runs from, or None when it runs from an installed wheel."""
    root = package_dir().parent
    # pyproject.toml next to the package means a source tree (a wheel never installs one there).
    if (root / "pyproject.toml").is_file() and (root / "kdagen").is_dir():
        return root
    return None


def data_root() -> Path:
    """Where ``templates/`` and ``specs/`` live: the checkout, else the wheel's ``kdagen/_data``."""
    root = repo_root()
    return root if root is not None else package_dir() / "_data"


def templates_dir() -> Path:
    return data_root() / "templates"


def specs_dir() -> Path:
    return data_root() / "specs"


def benchmarks_dir() -> Path | None:
    """``benchmarks/`` of the checkout; benchmarks are not shipped in the wheel."""
    root = repo_root()
    return root / "benchmarks" if root is not None else None


def _env_path(name: str) -> Path | None:
    value = os.environ.get(name, "").strip()
    return Path(value).expanduser() if value else None


def cache_dir() -> Path:
    """The artifact store root (``$KDAGEN_CACHE_DIR``, default ``~/.cache/kdagen``)."""
    return _env_path(ENV_CACHE_DIR) or Path("~/.cache/kdagen").expanduser()


def generated_dir() -> Path:
    """Where rendered sources go (``$KDAGEN_GENERATED_DIR``, default ``<repo>/generated``).

    An installed wheel has no repository, so it falls back to ``<cache dir>/generated``: the files must
    exist on disk for as long as the process compiles them (the DSL reads their source text).
    """
    env = _env_path(ENV_GENERATED_DIR)
    if env is not None:
        return env
    root = repo_root()
    return root / "generated" if root is not None else cache_dir() / "generated"


def jit_disabled() -> bool:
    """True when ``KDAGEN_DISABLE_JIT`` asks that a cache miss be an error instead of a compile."""
    return os.environ.get(ENV_DISABLE_JIT, "").strip().lower() in _TRUE


def bundle_dirs() -> list[Path]:
    """The bundle directories ``KDAGEN_BUNDLE`` names (``os.pathsep``-separated; empty items skipped)."""
    value = os.environ.get(ENV_BUNDLE, "")
    return [Path(item.strip()).expanduser() for item in value.split(os.pathsep) if item.strip()]


def find_spec_file(path: str | os.PathLike[str]) -> Path:
    """Resolve a spec file name as a user wrote it.

    Tried in order: as given (relative to the working directory), then relative to the data root, so that
    ``"specs/sm90.yaml"`` works from any directory and from an installed wheel. Returns the path as given
    when nothing matches, so the caller's "not found" message shows what the user typed.
    """
    p = Path(path).expanduser()
    if p.is_file() or p.is_absolute():
        return p
    for candidate in (data_root() / p, specs_dir() / p):
        if candidate.is_file():
            return candidate
    return p


def load_module(name: str, path: str | os.PathLike[str]) -> ModuleType:
    """Import the Python file at `path` as module `name` (registered in ``sys.modules``, so that code run at
    import time, and the DSL, which re-reads the source from that file, can find it)."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {os.fspath(path)!r} as a module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def schedule_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The scheduling variables that are set (non-empty), stripped and lower-cased, by `SchedulePolicy`
    field name. Parsed and validated by `kdagen.policy.SchedulePolicy.from_env`, which
    `kdagen.policy.default_policy` calls once per process: an override for experiments, not a per-call
    switch."""
    env = os.environ if environ is None else environ
    out: dict[str, str] = {}
    for name, var in SCHEDULE_ENV.items():
        value = env.get(var, "").strip().lower()
        if value:
            out[name] = value
    return out
