"""Render a variant's plan into CuTe DSL source files, deterministically.

Each `StagePlan` of the plan (``name``, ``template`` under ``templates/``, ``params``) becomes the text of
``<name>.py``. A template sees ``spec`` (the `KernelSpec`), ``plan``, ``stage`` and ``p`` (= ``stage.params``,
keys sorted). Undefined names are errors (StrictUndefined): a template cannot silently render a hole.

Every file starts with a header naming the generator version, the variant's canonical spec JSON, the plan's
family and reason, the template and every template it pulled in (with sha256), and the sha256 of the body.
No timestamps, no absolute paths: the same spec and templates give the same bytes on every machine.

Templates are found through `kdagen.paths.templates_dir()` (the checkout's ``templates/``, or the wheel's
``kdagen/_data/templates``); every function takes ``templates=`` to override it (tests use fixtures).
Writing and checking the ``generated/`` tree is `kdagen.tree`'s.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import jinja2

from kdagen import paths
from kdagen.spec import KernelSpec
from kdagen.version import __version__

__all__ = ["PlanLike", "StagePlanLike", "Planner", "make_environment", "render_variant"]


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

    Rendering compiles every template it touches (``cache_size=0``, see `_TrackingLoader`), and compiling is
    most of the time of a first `get_kernel` in a process that renders (the cache key needs the rendered
    sources). The loader still serves the source on every render, so dependency tracking is unchanged, and
    Jinja checks a compiled template against the sha1 of that source before using it, so a stale entry is
    never run. The disk copy is an optimisation only: a directory that cannot be written (a read-only cache)
    is skipped.
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
