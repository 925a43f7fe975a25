"""One build-and-load lifecycle.

spec -> plan -> rendered sources -> key -> cache (compile on a miss) -> loaded kernel.

A build that found or made its entry remembers its sources' digests (`kdagen.source_memo`); the next process
asking for the same spec with the same templates and generator computes the key from them and loads without
importing Jinja or rendering. Anything short of a complete entry under that key renders as before.

`get_kernel` looks in the registered bundles (`kdagen.bundle`) before all of that: a spec found there is
planned and loaded from the bundle's files, with no key computed at all.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kdagen import bundle, paths, source_memo
from kdagen.errors import BuildError, CacheMissError, LoadError
from kdagen.keys import cache_key, key_from_digests, source_digests, toolchain_fingerprint
from kdagen.plan import Plan, make_plan
from kdagen.spec import (
    KernelSpec,
    parse_spec_ref,
    plain_values,
    resolve_spec,
    trusted_spec,
    validate_capabilities,
)

if TYPE_CHECKING:
    from kdagen.cache import ArtifactCache


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
    paths: dict[str, Path] = field(default_factory=dict)  # {stage: its .o}, digests checked
    plan: Plan | None = None
    shared: dict[str, Path] = field(default_factory=dict)  # {stage: its .so}, digests checked, where built


def _options(spec: KernelSpec, target: str | None = None) -> str:
    from kdagen.compile import compile_options  # no cutlass import: compile imports it lazily

    return compile_options(target or spec.arch)


def check_target(spec: KernelSpec, target: str | None) -> str:
    """The compile target of a build: the spec's arch, or (test-only) a target whose GPUs run the spec's plans
    (`ArchInfo.emulated_on`), so that the sm_80 and sm_89 plans are run on an H100. Refuses anything else."""
    if target is None or target == spec.arch:
        return spec.arch
    allowed = spec.arch_info.emulated_on
    if target not in allowed:
        raise BuildError(
            f"target={target!r}: a {spec.arch} plan can be compiled only for {spec.arch}"
            + (f" or, to test it, for {', '.join(allowed)}" if allowed else "")
        )
    return target


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


def _remembered_key(spec: KernelSpec, plan: Plan, generator: str, target: str | None = None) -> str | None:
    """The key from the source digests remembered for `generator` (`kdagen.source_memo`), or None."""
    digests = source_memo.load_digests(spec.canonical_json(), generator)
    if digests is None or set(digests) != {f"{s.name}.py" for s in plan.stages}:
        return None
    return key_from_digests(spec, digests, _options(spec, target))[0]


def _compile_all(
    spec: KernelSpec, plan: Plan, rendered: dict[str, str], entry: Path, target: str
) -> tuple[dict, float]:
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
            result = compile_stage_file(path, target)
        except Exception as e:  # the DSL raises many types; report the stage and the spec
            raise BuildError(
                f"compiling stage {stage.name!r} of {spec.slug()} for {target} failed: {e}"
            ) from e
        objects[stage.name] = result.object_bytes
        seconds += result.seconds
        lib = link_shared(result.object_bytes)
        if lib is not None:
            shared[f"{stage.name}.so"] = lib
    # Shared libraries only if every stage got one: a loader then never mixes the two paths.
    return {**objects, **(shared if len(shared) == len(objects) else {})}, seconds


def build_variant(
    spec: Any, force: bool = False, name: str | None = None, target: str | None = None
) -> BuildResult:
    """Make sure the variant's artifacts are in the cache, compiling them on a miss; says what was done.

    `target` (test-only) compiles the spec's plan for another target that runs it (`check_target`); the
    compile options, and so the key, name the target.
    """
    ref = str(spec) if isinstance(spec, (str, Path)) else None  # "file.yaml:name", for messages
    vname, spec = resolve_spec(spec)
    name = name or vname
    from kdagen.cache import ArtifactCache  # here: a kernel from a bundle never opens the cache

    cache = ArtifactCache()
    plan = _planned(spec)
    target = check_target(spec, target)
    stages = plan.stage_names
    generator = source_memo.generator_digest()
    key = None if force else _remembered_key(spec, plan, generator, target)
    if key is not None:
        found = lookup_built(cache, spec, key, stages)
        if found is not None:
            return _cached(name, spec, key, plan, found)
    # No remembered key, or nothing built under it: render, which a compile needs anyway.
    rendered = _render(spec, plan)
    key, parts = cache_key(spec, rendered, _options(spec, target))
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
                objects, seconds = _compile_all(spec, plan, rendered, cache.entry_dir(spec, key), target)
                meta = {
                    "name": name,
                    "compile_seconds": round(seconds, 3),
                    "toolchain": toolchain_fingerprint(),
                    "target": target,
                    "key_parts": {k: v["sha256"] for k, v in parts.items()},
                    "plan": {"family": plan.family, "reason": plan.reason},
                }
                published = cache.publish(spec, key, objects, meta)
                remember()
                size = sum(len(b) for b in objects.values())
                objs, libs = _split(published, stages)
                return BuildResult(
                    name, spec, spec.slug(), key, stages, seconds, size, False, objs, plan, libs
                )
    remember()
    return _cached(name, spec, key, plan, found)


def _split(found: dict[str, Path], stages: list[str]) -> tuple[dict[str, Path], dict[str, Path]]:
    """({stage: .o}, {stage: .so} where the entry has one) from an entry's artifact paths."""
    objs = {s: found[s] for s in stages}
    libs = {s: found[f"{s}.so"] for s in stages if f"{s}.so" in found}
    return objs, libs


def _cached(name: str | None, spec: KernelSpec, key: str, plan: Plan, found: dict[str, Path]) -> BuildResult:
    size = sum(p.stat().st_size for p in found.values())
    objs, libs = _split(found, plan.stage_names)
    return BuildResult(name, spec, spec.slug(), key, plan.stage_names, 0.0, size, True, objs, plan, libs)


def lookup_built(
    cache: ArtifactCache, spec: KernelSpec, key: str, stages: list[str]
) -> dict[str, Path] | None:
    """The valid cache entry of a build (objects, plus shared libraries where they were made), or None."""
    # An entry holds each stage's object and, where the build box had a C compiler, its shared library.
    return cache.lookup(spec, key, stages + [f"{s}.so" for s in stages]) or cache.lookup(spec, key, stages)


# Loaded kernels, one per key, and the argument each get_kernel call named -> its kernel: a repeated call
# returns from memory before resolving, hashing or rendering anything.
_loaded: dict[str, Any] = {}
_by_argument: dict[tuple[str, ...], Any] = {}
_lock = threading.Lock()


def _argument_key(spec: Any) -> tuple[str, ...] | None:
    """What identifies a get_kernel argument within this process, or None when it has no stable identity.

    A reference (``"file.yaml:name"``) counts with the working directory it is resolved against; a
    `KernelSpec` by its canonical JSON; a dict by its sorted JSON.
    """
    try:
        if isinstance(spec, (str, os.PathLike)):
            return ("ref", os.fspath(spec), os.getcwd())
        if isinstance(spec, KernelSpec):
            return ("spec", spec.canonical_json())
        if isinstance(spec, dict):
            return ("dict", json.dumps(spec, sort_keys=True))
    except (OSError, TypeError, ValueError):  # no working directory; a dict JSON cannot hold
        return None
    return None


def get_kernel(spec: Any, force: bool = False, target: str | None = None):
    """A ready `KDAKernel` for `spec` (a KernelSpec, a dict, or "file.yaml:name"); cached per process.

    A repeated call with the same argument returns the kernel loaded before, without reading any file
    (edits to a spec file or a template within the process are not seen). `force` rebuilds and reloads.
    `target` (test-only, `check_target`) runs the spec's plan compiled for another target.
    """
    arg = _argument_key(spec)
    if arg is not None and target is not None:
        arg = (*arg, "target", target)
    if not force and arg is not None:
        hit = _by_argument.get(arg)
        if hit is not None:
            return hit
    found = None if force or target is not None else _bundle_entry(spec)
    if found is not None:
        name, resolved, entry = found
        with _lock:
            kernel = _bundled(resolved, name, entry)
            if arg is not None:
                _by_argument[arg] = kernel
        return kernel
    name, resolved = resolve_spec(spec)
    with _lock:
        kernel = _kernel(resolved, name, force, target)
        if arg is not None:
            _by_argument[arg] = kernel
    return kernel


def _bundle_entry(spec: Any) -> tuple[str | None, KernelSpec, bundle.BundleEntry] | None:
    """(variant name, spec, entry) of a get_kernel argument found in a registered bundle without validating
    it, or None (then `resolve_spec` and `_kernel` take it as before).

    Only a valid spec is in a bundle, so a hit needs no validation: a dict is looked up by the canonical
    JSON of its values read without pydantic (`plain_values`, where it can), a ``"file.yaml:name"`` by its
    file's bytes (`bundle.find_in_file`), with no YAML read, a `KernelSpec` by its canonical JSON. A bundle
    that cannot be used here is a miss now: the normal path checks the spec first, then finds the bundle's
    error again, in the order it always had.
    """
    try:
        if isinstance(spec, KernelSpec):
            entry = bundle.find(spec.canonical_json())
            return None if entry is None else (None, spec, entry)
        if isinstance(spec, dict):
            values = plain_values(spec)
            if values is None:
                return None
            resolved = KernelSpec._trusted(values)
            entry = bundle.find(resolved.canonical_json())
            return None if entry is None else (None, resolved, entry)
        if isinstance(spec, (str, os.PathLike)):
            return _bundle_ref(os.fspath(spec))
    except bundle.BundleError:
        return None
    return None


def _bundle_ref(ref: str) -> tuple[str | None, KernelSpec, bundle.BundleEntry] | None:
    path, name = parse_spec_ref(ref)
    try:
        data = paths.find_spec_file(path).read_bytes()
    except OSError:
        return None  # resolve_spec says what is wrong with the file
    found = bundle.find_in_file(hashlib.sha256(data).hexdigest(), name)
    if found is None:
        return None
    name, entry = found
    spec = trusted_spec(entry.spec_json)
    return None if spec is None else (name, spec, entry)


def _kernel(spec: KernelSpec, name: str | None, force: bool, target: str | None = None):
    from kdagen.runtime import KDAKernel

    if not force and target is None:  # a forced rebuild, or a test-only target, is the cache's business
        entry = bundle.find(spec.canonical_json())
        if entry is not None:
            return _bundled(spec, name, entry)
    try:
        built = build_variant(spec, force=force, name=name, target=target)
    except CacheMissError as e:
        if not bundle.registered():
            raise
        raise CacheMissError(f"{e}; not in the bundle(s) searched either: {bundle.searched()}") from e
    hit = None if force else _loaded.get(built.key)
    if hit is None:
        built, funcs = _load_or_rebuild(built, spec, name, target)
        hit = _loaded[built.key] = KDAKernel(spec, built.plan, funcs, name=name)
    return hit


def _bundled(spec: KernelSpec, name: str | None, entry: bundle.BundleEntry):
    """The kernel of a bundle's entry: planned here (pure Python), loaded from the bundle's files; nothing
    rendered or hashed. One kernel per key and process, shared with the cache path."""
    from kdagen.runtime import KDAKernel

    hit = _loaded.get(entry.key)
    if hit is None:
        plan = make_plan(spec)
        if tuple(plan.stage_names) != entry.stages:
            raise bundle.BundleError(
                f"bundle {entry.bundle}: variant {', '.join(entry.names) or entry.key} has stages "
                f"{', '.join(entry.stages)}, and this kdagen plans {', '.join(plan.stage_names)}; "
                "build the bundle again with this kdagen"
            )
        funcs = entry.load()
        hit = _loaded[entry.key] = KDAKernel(spec, plan, funcs, name=name or next(iter(entry.names), None))
    return hit


def _load_or_rebuild(
    built: BuildResult, spec: KernelSpec, name: str | None, target: str | None = None
) -> tuple[BuildResult, dict]:
    """Load every stage of `built`; a failure rebuilds the entry once, and a second failure is a LoadError."""
    try:
        return built, _load_stages(built)
    except LoadError as e:
        if paths.jit_disabled():
            raise LoadError(
                f"{e}; {paths.ENV_DISABLE_JIT}=1 forbids the rebuild: rebuild it with kdagen build --force, "
                f"or remove {_entry_of(built)}"
            ) from e.__cause__
    rebuilt = build_variant(spec, force=True, name=name, target=target)
    try:
        return rebuilt, _load_stages(rebuilt)
    except LoadError as e:
        raise LoadError(f"{e} (after one rebuild of the entry); remove {_entry_of(rebuilt)}") from e.__cause__


def _entry_of(built: BuildResult) -> Path:
    return next(iter(built.paths.values())).parent


def _load_stages(built: BuildResult) -> dict[str, Any]:
    """{stage: loaded function} from the paths whose digests the lookup checked (the .so where there is
    one)."""
    from kdagen.compile import load_object

    funcs: dict[str, Any] = {}
    for stage in built.stages:
        obj, lib = built.paths[stage], built.shared.get(stage)
        try:
            funcs[stage] = load_object(obj, lib)
        except Exception as e:  # TVM-FFI and the DSL raise many types; name the entry and the stage
            shown = lib if lib is not None else obj
            raise LoadError(
                f"loading stage {stage!r} of cache entry {_entry_of(built)} from {shown.name} failed: "
                f"{type(e).__name__}: {e}"
            ) from e
    return funcs
