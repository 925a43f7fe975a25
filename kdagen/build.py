"""One build-and-load lifecycle.

spec -> plan -> rendered sources -> key -> cache (compile on a miss) -> loaded kernel.

A build that found or made its entry remembers its sources' digests (`kdagen.source_memo`); the next process
asking for the same spec with the same templates and generator computes the key from them and loads without
importing Jinja or rendering. Anything short of a complete entry under that key renders as before.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kdagen import paths, source_memo
from kdagen.cache import ArtifactCache
from kdagen.errors import BuildError, CacheMissError
from kdagen.keys import cache_key, key_from_digests, source_digests, toolchain_fingerprint
from kdagen.plan import Plan, make_plan
from kdagen.spec import KernelSpec, resolve_spec, validate_capabilities


@dataclass
class BuildResult:
    name: str | None
    spec: KernelSpec
    slug: str
    key: str
    stages: list[str]
    compile_seconds: float
    artifact_bytes: int
    cached: bool
    paths: dict[str, Path] = field(default_factory=dict)
    plan: Plan | None = None


def _options(spec: KernelSpec) -> str:
    from kdagen.compile import compile_options  # no cutlass import: compile imports it lazily

    return compile_options(spec.arch)


def _render(spec: KernelSpec, plan: Plan) -> dict[str, str]:
    # Imported here: Jinja is not needed (nor imported) when a remembered key finds a built entry.
    from kdagen.render import render_variant

    return render_variant(spec, plan)


def _planned(spec: KernelSpec) -> Plan:
    validate_capabilities(spec)
    return make_plan(spec)


def describe(spec: KernelSpec) -> tuple[Plan, dict[str, str], str, dict[str, Any]]:
    """(plan, rendered sources, key, key parts) without compiling anything."""
    plan = _planned(spec)
    rendered = _render(spec, plan)
    key, parts = cache_key(spec, rendered, _options(spec))
    return plan, rendered, key, parts


def _remembered_key(spec: KernelSpec, plan: Plan, generator: str) -> str | None:
    """The key from the source digests remembered for `generator` (`kdagen.source_memo`), or None."""
    digests = source_memo.load_digests(spec.canonical_json(), generator)
    if digests is None or set(digests) != {f"{s.name}.py" for s in plan.stages}:
        return None
    return key_from_digests(spec, digests, _options(spec))[0]


def _compile_all(spec: KernelSpec, plan: Plan, rendered: dict[str, str], entry: Path) -> tuple[dict, float]:
    from kdagen.compile import compile_stage_file

    # The DSL re-reads kernel source from disk while compiling, so the rendered files live next to the
    # artifacts they produced (the cache entry), independent of any checkout's generated/ tree.
    src = entry / "src"
    src.mkdir(parents=True, exist_ok=True)
    from kdagen.compile import link_shared

    objects: dict[str, bytes] = {}
    shared: dict[str, bytes] = {}
    seconds = 0.0
    # Every rendered file first: a stage may import another stage's module from beside it.
    for stage in plan.stages:
        (src / f"{stage.name}.py").write_text(rendered[f"{stage.name}.py"])
    for stage in plan.stages:
        if not stage.compiled:
            continue
        path = src / f"{stage.name}.py"
        try:
            result = compile_stage_file(path, spec.arch)
        except Exception as e:  # the DSL raises many types; report the stage and the spec
            raise BuildError(
                f"compiling stage {stage.name!r} of {spec.slug()} for {spec.arch} failed: {e}"
            ) from e
        objects[stage.name] = result.object_bytes
        seconds += result.seconds
        lib = link_shared(result.object_bytes)
        if lib is not None:
            shared[f"{stage.name}.so"] = lib
    # Shared libraries only if every stage got one: a loader then never mixes the two paths.
    return {**objects, **(shared if len(shared) == len(objects) else {})}, seconds


def build_variant(spec: Any, force: bool = False, name: str | None = None) -> BuildResult:
    """Make sure the variant's artifacts are in the cache, compiling them on a miss; says what was done."""
    ref = str(spec) if isinstance(spec, (str, Path)) else None  # "file.yaml:name", for messages
    vname, spec = resolve_spec(spec)
    name = name or vname
    cache = ArtifactCache()
    plan = _planned(spec)
    stages = plan.stage_names
    generator = source_memo.generator_digest()
    key = None if force else _remembered_key(spec, plan, generator)
    if key is not None:
        found = lookup_built(cache, spec, key, stages)
        if found is not None:
            return _cached(name, spec, key, plan, found)
    # No remembered key, or nothing built under it: render, which a compile needs anyway.
    rendered = _render(spec, plan)
    key, parts = cache_key(spec, rendered, _options(spec))
    unchanged = source_memo.generator_digest() == generator  # no template or module edited during the render

    def remember() -> None:  # only once the entry exists: a refused build writes nothing
        if unchanged:
            source_memo.store_digests(spec.canonical_json(), generator, source_digests(rendered))

    found = None if force else lookup_built(cache, spec, key, stages)
    if found is None:
        if paths.jit_disabled():
            what = f"{ref or name or 'spec'} = {spec.slug()}"
            how = "kdagen build " + (ref.rsplit(":", 1)[0] if ref else "<the spec file holding it>")
            raise CacheMissError(
                f"{paths.ENV_DISABLE_JIT}=1 and no cached build of {what} (key {key}) in {cache.root}; "
                f"build it first ({how}) or unset {paths.ENV_DISABLE_JIT} (spec: {spec.canonical_json()})"
            )
        with cache.lock(spec, key):
            # another process may have built it meanwhile
            found = None if force else lookup_built(cache, spec, key, stages)
            if found is None:
                objects, seconds = _compile_all(spec, plan, rendered, cache.entry_dir(spec, key))
                meta = {
                    "name": name,
                    "compile_seconds": round(seconds, 3),
                    "toolchain": toolchain_fingerprint(),
                    "key_parts": {k: v["sha256"] for k, v in parts.items()},
                    "plan": {"family": plan.family, "reason": plan.reason},
                }
                published = cache.publish(spec, key, objects, meta)
                remember()
                size = sum(len(b) for b in objects.values())
                objs = {s: published[s] for s in stages}
                return BuildResult(name, spec, spec.slug(), key, stages, seconds, size, False, objs, plan)
    remember()
    return _cached(name, spec, key, plan, found)


def _cached(name: str | None, spec: KernelSpec, key: str, plan: Plan, found: dict[str, Path]) -> BuildResult:
    size = sum(p.stat().st_size for p in found.values())
    objs = {s: found[s] for s in plan.stage_names}
    return BuildResult(name, spec, spec.slug(), key, plan.stage_names, 0.0, size, True, objs, plan)


def lookup_built(
    cache: ArtifactCache, spec: KernelSpec, key: str, stages: list[str]
) -> dict[str, Path] | None:
    """The valid cache entry of a build (objects, plus shared libraries where they were made), or None."""
    # An entry holds each stage's object and, where the build box had a C compiler, its shared library.
    return cache.lookup(spec, key, stages + [f"{s}.so" for s in stages]) or cache.lookup(spec, key, stages)


_loaded: dict[str, Any] = {}
_lock = threading.Lock()
last_load_seconds: float = 0.0


def get_kernel(spec: Any):
    """A ready `KDAKernel` for `spec` (a KernelSpec, a dict, or "file.yaml:name"); cached per process."""
    global last_load_seconds
    from kdagen.compile import load_object
    from kdagen.runtime import KDAKernel

    start = time.perf_counter()
    name, spec = resolve_spec(spec)
    with _lock:
        built = build_variant(spec, name=name)
        hit = _loaded.get(built.key)
        if hit is None:
            funcs = {stage: load_object(path) for stage, path in built.paths.items()}
            hit = _loaded[built.key] = KDAKernel(spec, built.plan, funcs, name=name)
    last_load_seconds = time.perf_counter() - start
    return hit
