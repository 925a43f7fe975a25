"""Render a variant's plan into CuTe DSL source files, deterministically, and check ``generated/``.

Each `StagePlan` of the plan (``name``, ``template`` under ``templates/``, ``params``) becomes
``<generated>/<arch>/<slug>/<name>.py``. A template sees ``spec`` (the `KernelSpec`), ``plan``, ``stage`` and
``p`` (= ``stage.params``, keys sorted). Undefined names are errors (StrictUndefined): a template cannot
silently render a hole.

Every file starts with a header naming the generator version, the variant's canonical spec JSON, the plan's
family and reason, the template and every template it pulled in (with sha256), and the sha256 of the body.
No timestamps, no absolute paths: the same spec and templates give the same bytes on every machine.

Templates are found through `kdagen.paths.templates_dir()` (the checkout's ``templates/``, or the wheel's
``kdagen/_data/templates``); every function takes ``templates=`` to override it (tests use fixtures).
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import json
import os
import shutil
import sys
import textwrap
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

import jinja2

from kdagen import __version__, paths
from kdagen.files import write_atomic
from kdagen.spec import KernelSpec, load_spec_file

__all__ = [
    "PlanLike",
    "StagePlanLike",
    "make_environment",
    "render_variant",
    "generated_dir_for",
    "write_variant",
    "expected_tree",
    "check_tree",
    "default_planner",
    "extra_paths",
    "prune_tree",
]

_IGNORED_NAMES = {"__pycache__"}  # importing a generated file by path leaves bytecode beside it


class StagePlanLike(Protocol):
    name: str
    template: str
    params: dict[str, Any]


class PlanLike(Protocol):
    family: str
    reason: str
    stages: tuple[StagePlanLike, ...]


Planner = Callable[[KernelSpec], PlanLike]


def _sha256(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


class _TrackingLoader(jinja2.FileSystemLoader):
    """A FileSystemLoader that records every template it serves (main, included, imported, extended).

    The environment runs with ``cache_size=0`` so that every render asks the loader again; otherwise a
    second render would reuse compiled templates and record nothing.
    """

    def __init__(self, searchpath: str | os.PathLike[str]) -> None:
        super().__init__(searchpath)
        self.seen: dict[str, str] = {}  # template name -> sha256 of its file

    def get_source(self, environment: jinja2.Environment, template: str) -> tuple[str, str | None, Any]:
        source, filename, uptodate = super().get_source(environment, template)
        assert filename is not None
        self.seen[template] = _sha256(Path(filename).read_bytes())
        return source, filename, uptodate


class _CompiledTemplates(jinja2.BytecodeCache):
    """Compiled templates, kept in memory for the process and on disk under the cache directory.

    Rendering compiles every template it touches (``cache_size=0``, see `_TrackingLoader`), and compiling was
    most of the time a first `get_kernel` took in a process (the cache key needs the rendered sources). The
    loader still serves the source on every render, so dependency tracking is unchanged, and Jinja checks a
    compiled template against the sha1 of that source before using it, so a stale entry is never run. The disk
    copy is an optimisation only: a directory that cannot be written (a read-only cache) is skipped.
    """

    def __init__(self) -> None:
        self._memory: dict[str, tuple[str, Any]] = {}  # bucket key -> (source checksum, code object)

    @staticmethod
    def _disk() -> jinja2.FileSystemBytecodeCache | None:
        # Jinja and Python versions in the name: marshal data and Jinja's generated code are theirs.
        version = f"jinja{jinja2.__version__}-py{sys.version_info[0]}{sys.version_info[1]}"
        directory = paths.cache_dir() / paths.CACHE_TEMPLATES_SUBDIR / version
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError:
            return None
        return jinja2.FileSystemBytecodeCache(str(directory))

    def load_bytecode(self, bucket: jinja2.bccache.Bucket) -> None:
        hit = self._memory.get(bucket.key)
        if hit is not None and hit[0] == bucket.checksum:
            bucket.code = hit[1]
            return
        disk = self._disk()
        if disk is not None:
            disk.load_bytecode(bucket)  # resets the bucket on a checksum or version mismatch
            if bucket.code is not None:
                self._memory[bucket.key] = (bucket.checksum, bucket.code)

    def dump_bytecode(self, bucket: jinja2.bccache.Bucket) -> None:
        self._memory[bucket.key] = (bucket.checksum, bucket.code)
        disk = self._disk()
        if disk is not None:
            with contextlib.suppress(OSError):
                disk.dump_bytecode(bucket)


_COMPILED = _CompiledTemplates()


def _pyrepr(value: Any) -> str:
    return repr(value)


def make_environment(templates: str | os.PathLike[str] | None = None) -> jinja2.Environment:
    """The Jinja environment kdagen renders with (exposed for template tooling and tests)."""
    root = Path(templates) if templates is not None else paths.templates_dir()
    env = jinja2.Environment(
        loader=_TrackingLoader(root),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,  # Python source, not HTML
        cache_size=0,
        bytecode_cache=_COMPILED,
    )
    env.filters["pyrepr"] = _pyrepr
    return env


def _comment(text: str, width: int | None = None) -> list[str]:
    lines = text.splitlines()
    if width is not None:
        lines = [w for line in lines for w in (textwrap.wrap(line, width) or [""])]
    return [("# " + line).rstrip() for line in lines] or ["#"]


def _header(spec: KernelSpec, plan: PlanLike, stage: StagePlanLike, deps: dict[str, str], body: str) -> str:
    lines = [
        f"# GENERATED by kdagen {__version__} -- do not edit.",
        "# Edit the template (or the planner) and re-render: `kdagen render`; CI runs `kdagen check`.",
        "#",
        "# spec (canonical JSON):",
        *_comment(spec.canonical_json()),
        "#",
        f"# plan: family {plan.family}; stage {stage.name!r} "
        f"({[s.name for s in plan.stages].index(stage.name) + 1} of {len(plan.stages)})"
        + ("" if getattr(stage, "compiled", True) else "; a module other stages import, not compiled alone"),
        "# plan reason:",
        *_comment(plan.reason, width=100),
        "# stage params:",
        *_comment(json.dumps(stage.params, sort_keys=True, default=repr)),
        "#",
        f"# template: {stage.template}  sha256 {deps[stage.template]}",
        *[
            f"# includes: {name}  sha256 {sha}"
            for name, sha in sorted(deps.items())
            if name != stage.template
        ],
        f"# body sha256: {_sha256(body)}",
    ]
    return "\n".join(lines) + "\n\n"


def render_variant(
    spec: KernelSpec, plan: PlanLike, *, templates: str | os.PathLike[str] | None = None
) -> dict[str, str]:
    """{``<stage>.py``: text} for every stage of `plan`, in stage order. Writes no sources; the templates it
    compiles are kept under the cache directory (`_CompiledTemplates`)."""
    names = [s.name for s in plan.stages]
    if len(set(names)) != len(names):
        raise ValueError(f"plan for {spec.slug()}: duplicate stage names {names}")
    env = make_environment(templates)
    loader = env.loader
    assert isinstance(loader, _TrackingLoader)
    out: dict[str, str] = {}
    for stage in plan.stages:
        loader.seen = {}
        params = dict(sorted(stage.params.items()))
        try:
            body = env.get_template(stage.template).render(spec=spec, plan=plan, stage=stage, p=params)
        except jinja2.TemplateError as e:
            where = f"{getattr(e, 'filename', None) or stage.template}:{getattr(e, 'lineno', '?')}"
            raise type(e)(f"rendering stage {stage.name!r} of {spec.slug()} ({where}): {e}") from e
        if not body.endswith("\n"):
            body += "\n"
        out[f"{stage.name}.py"] = _header(spec, plan, stage, dict(loader.seen), body) + body
    return out


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
