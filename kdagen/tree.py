"""The ``generated/`` tree: write a variant's rendered files, and check or prune the tree against the specs.

A variant's files live in ``<generated>/<arch>/<slug>/``, one ``<stage>.py`` per stage of its plan
(`kdagen.render` makes the text). `check_tree` is what ``kdagen check`` runs in CI: the committed tree must be
exactly what the spec files render to now. Bytecode caches and dotfiles are never reported.
"""

from __future__ import annotations

import difflib
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

from kdagen import paths
from kdagen.files import write_atomic
from kdagen.render import PlanLike, Planner, render_variant
from kdagen.spec import KernelSpec, load_spec_file

__all__ = [
    "generated_dir_for",
    "write_variant",
    "default_planner",
    "expected_tree",
    "extra_paths",
    "check_tree",
    "prune_tree",
]

_IGNORED_NAMES = {"__pycache__"}  # importing a generated file by path leaves bytecode beside it


def generated_dir_for(spec: KernelSpec, root: str | os.PathLike[str] | None = None) -> Path:
    """``<generated>/<arch>/<slug>/``; the generated root defaults to `kdagen.paths.generated_dir()`."""
    base = Path(root) if root is not None else paths.generated_dir()
    return base / spec.arch / spec.slug()


def _write_if_changed(path: Path, text: str) -> None:
    try:
        if path.read_text() == text:
            return  # keep the mtime: nothing changed
    except OSError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, text.encode())


def write_variant(
    spec: KernelSpec,
    plan: PlanLike,
    root: str | os.PathLike[str] | None = None,
    *,
    templates: str | os.PathLike[str] | None = None,
) -> dict[str, Path]:
    """Render and write atomically into `generated_dir_for(spec, root)`; returns {file name: path}.

    Stage files the plan no longer produces are removed from that directory, so it holds exactly the plan.
    """
    files = render_variant(spec, plan, templates=templates)
    d = generated_dir_for(spec, root)
    out = {}
    for name, text in files.items():
        _write_if_changed(d / name, text)
        out[name] = d / name
    for old in d.glob("*.py"):
        if old.name not in files:
            old.unlink()
    return out


def default_planner() -> Planner:
    """`kdagen.plan.make_plan`, imported on first use (tests substitute a fake planner here)."""
    from kdagen.plan import make_plan

    return make_plan


def _expected(
    spec_files: Iterable[str | os.PathLike[str]],
    root: Path,
    planner: Planner | None,
    templates: str | os.PathLike[str] | None,
) -> tuple[dict[Path, str], dict[Path, str]]:
    """({path: text}, {variant directory: "file.yaml:name" that produces it})."""
    plan_of = planner or default_planner()
    out: dict[Path, str] = {}
    origin: dict[Path, str] = {}
    for f in spec_files:
        for name, spec in load_spec_file(f).items():
            d = generated_dir_for(spec, root)
            if d in origin:  # the same spec under another name: one directory, rendered once
                continue
            origin[d] = f"{f}:{name}"
            for fname, text in render_variant(spec, plan_of(spec), templates=templates).items():
                out[d / fname] = text
    return out, origin


def expected_tree(
    spec_files: Iterable[str | os.PathLike[str]],
    root: str | os.PathLike[str] | None = None,
    *,
    planner: Planner | None = None,
    templates: str | os.PathLike[str] | None = None,
) -> dict[Path, str]:
    """Every file the given spec files produce under the generated root: {path: text}.

    Variants with the same spec (under different names or files) share a directory and are rendered once.
    `planner` defaults to `kdagen.plan.make_plan`.
    """
    base = Path(root) if root is not None else paths.generated_dir()
    return _expected(spec_files, base, planner, templates)[0]


def _ignored(rel: Path) -> bool:
    return any(part in _IGNORED_NAMES or part.startswith(".") or part.endswith(".pyc") for part in rel.parts)


def extra_paths(expected: Iterable[Path], root: Path) -> list[Path]:
    """Files and directories under `root` that are not in (or above) `expected`, topmost only, sorted.

    Bytecode caches and dotfiles are ignored.
    """
    expected = set(expected)
    wanted_dirs = {root} | {q for p in expected for q in p.parents}
    out: list[Path] = []
    if not root.is_dir():
        return out
    for dirpath, dirnames, filenames in os.walk(root):
        d = Path(dirpath)
        keep = []
        for name in sorted(dirnames):
            sub = d / name
            if _ignored(sub.relative_to(root)):
                continue
            if sub in wanted_dirs:
                keep.append(name)
            else:
                out.append(sub)  # reported once, not descended into
        dirnames[:] = keep
        out += [
            d / n
            for n in sorted(filenames)
            if not _ignored((d / n).relative_to(root)) and d / n not in expected
        ]
    return sorted(out)


def check_tree(
    spec_files: Iterable[str | os.PathLike[str]],
    root: str | os.PathLike[str] | None = None,
    *,
    planner: Planner | None = None,
    templates: str | os.PathLike[str] | None = None,
) -> list[str]:
    """Compare the generated root with what the spec files produce; [] when it is up to date.

    Each problem is a readable paragraph: a stale file with its unified diff (on disk -> rendered now), a
    missing file, or a file or directory that no spec produces (reported once at its topmost directory).
    Bytecode caches and dotfiles are ignored.
    """
    base = Path(root) if root is not None else paths.generated_dir()
    expected, origin = _expected(spec_files, base, planner, templates)
    shown = _shown_root(base)
    problems: list[str] = []
    for d, ref in sorted(origin.items()):
        if not d.is_dir():
            problems.append(f"missing directory: {shown / d.relative_to(base)}/ (from {ref})")
    for path, text in sorted(expected.items()):
        rel = shown / path.relative_to(base)
        if not path.parent.is_dir():
            continue  # reported above, once per directory
        if not path.is_file():
            problems.append(f"missing: {rel} (from {origin[path.parent]})")
            continue
        actual = path.read_text()
        if actual != text:
            diff = "".join(
                difflib.unified_diff(
                    actual.splitlines(keepends=True),
                    text.splitlines(keepends=True),
                    fromfile=f"{rel} (on disk)",
                    tofile=f"{rel} (rendered now)",
                )
            )
            problems.append(f"stale: {rel} (from {origin[path.parent]})\n{diff}")
    for extra in extra_paths(expected, base):
        kind = "directory" if extra.is_dir() else "file"
        slash = "/" if extra.is_dir() else ""
        problems.append(f"extra {kind} (no spec produces it): {shown / extra.relative_to(base)}{slash}")
    return problems


def prune_tree(
    spec_files: Iterable[str | os.PathLike[str]],
    root: str | os.PathLike[str] | None = None,
    *,
    planner: Planner | None = None,
    templates: str | os.PathLike[str] | None = None,
) -> list[Path]:
    """Delete what no spec produces under the generated root (see `extra_paths`); returns what went."""
    base = Path(root) if root is not None else paths.generated_dir()
    expected = expected_tree(spec_files, base, planner=planner, templates=templates)
    removed = extra_paths(expected, base)
    for p in removed:
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink()
    return removed


def _shown_root(base: Path) -> Path:
    # Paths in messages: relative to the working directory when possible, as a user would type them.
    try:
        return base.resolve().relative_to(Path.cwd().resolve())
    except ValueError:
        return base
