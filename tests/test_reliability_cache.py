"""The artifact store and the build-and-load lifecycle when things go wrong (CPU only, nothing compiled).

The planner, the render, the compile and the loader are faked: what is tested is which files are trusted,
what is rebuilt, and which errors a caller sees.
"""

from __future__ import annotations

import sys
import time
import types
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from conftest import fake_plan

import kdagen
import kdagen.build
import kdagen.compile
import kdagen.runtime
from kdagen import keys
from kdagen.cache import ArtifactCache, Cleaned
from kdagen.cli import cli
from kdagen.errors import CacheError, KdagenError, LoadError
from kdagen.spec import KernelSpec, resolve_spec

SPEC = KernelSpec(arch="sm_90a")
KEY = "0123456789abcdef01234567"
RENDERED = {"alpha.py": "a = 1\n", "beta.py": "b = 2\n"}


class FakeKernel:
    def __init__(self, spec: KernelSpec, plan: Any, funcs: dict[str, Any], name: str | None = None) -> None:
        self.spec, self.plan, self.funcs, self.name = spec, plan, funcs, name


@pytest.fixture
def fake_build(isolated_env, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """build_variant and get_kernel with every expensive step faked; `state` counts compiles and loads.

    `state["libs"]` says whether the fake compile makes shared libraries; `state["bad_loads"]` is how many
    loads fail before one succeeds.
    """
    state: dict[str, Any] = {"compiles": 0, "loads": [], "libs": True, "bad_loads": 0}

    def compile_all(spec: KernelSpec, plan: Any, rendered: dict[str, str], entry: Path, target: str):
        state["compiles"] += 1
        n = state["compiles"]
        objects: dict[str, bytes] = {s.name: f"obj {s.name} {n}".encode() for s in plan.stages}
        if state["libs"]:
            objects.update({f"{s.name}.so": f"lib {s.name} {n}".encode() for s in plan.stages})
        return objects, 0.5

    def load_object(path: Path, shared: Path | None = None) -> str:
        used = shared if shared is not None else path
        state["loads"].append(used)
        if state["bad_loads"] > 0:
            state["bad_loads"] -= 1
            raise RuntimeError(f"tvm_ffi: cannot open {used.name}")
        return used.read_text()

    monkeypatch.setattr(kdagen.build, "_planned", fake_plan)
    monkeypatch.setattr(kdagen.build, "_render", lambda spec, plan: dict(RENDERED))
    monkeypatch.setattr(kdagen.build, "_compile_all", compile_all)
    monkeypatch.setattr(kdagen.compile, "load_object", load_object)
    monkeypatch.setattr(kdagen.runtime, "KDAKernel", FakeKernel)
    monkeypatch.setattr(kdagen.build, "_loaded", {})
    monkeypatch.setattr(kdagen.build, "_by_argument", {})
    return state


# -- 1. the .so that is loaded is the checked one -----------------------------------------------------------


def test_publish_removes_files_of_an_earlier_build(tmp_path: Path):
    cache = ArtifactCache(tmp_path)
    first = cache.publish(SPEC, KEY, {"alpha": b"o1", "alpha.so": b"l1"})
    entry = first["alpha"].parent
    (entry / "src").mkdir()
    (entry / "src" / "alpha.py").write_text("a = 1\n")
    cache.publish(SPEC, KEY, {"alpha": b"o2"})  # a rebuild whose C compiler failed
    assert sorted(p.name for p in entry.iterdir() if p.is_file()) == ["alpha.o", "meta.json"]
    assert (entry / "src" / "alpha.py").is_file()  # the rendered sources stay


def test_rebuild_without_a_c_compiler_leaves_no_old_so(fake_build: dict[str, Any]):
    first = kdagen.build.build_variant(SPEC)
    assert set(first.shared) == {"alpha", "beta"}
    fake_build["libs"] = False
    again = kdagen.build.build_variant(SPEC, force=True)
    assert again.shared == {}
    entry = again.paths["alpha"].parent
    assert not list(entry.glob("*.so"))


def test_get_kernel_loads_the_checked_so(fake_build: dict[str, Any]):
    built = kdagen.build.build_variant(SPEC)
    kernel = kdagen.build.get_kernel(SPEC)
    assert fake_build["loads"] == [built.shared["alpha"], built.shared["beta"]]
    assert kernel.funcs == {"alpha": "lib alpha 1", "beta": "lib beta 1"}


def test_load_object_reads_only_the_files_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A `.so` beside an object that the caller did not name (so no digest checked it) is never loaded."""
    import tvm_ffi

    obj, stray = tmp_path / "alpha.o", tmp_path / "alpha.so"
    obj.write_bytes(b"obj")
    stray.write_bytes(b"\x7fELF damaged")
    opened: list[str] = []
    monkeypatch.setattr(kdagen.compile, "_runtime_library", lambda: tmp_path / "libruntime.so")
    monkeypatch.setattr(kdagen.compile, "_preloaded", {tmp_path / "libruntime.so"})
    monkeypatch.setattr(tvm_ffi, "load_module", lambda p: opened.append(p) or {"fn": "from " + Path(p).name})
    fake_cute = types.SimpleNamespace(
        runtime=types.SimpleNamespace(
            load_module=lambda p, enable_tvm_ffi: opened.append(p) or types.SimpleNamespace(fn="from .o")
        )
    )
    monkeypatch.setitem(sys.modules, "cutlass", types.SimpleNamespace(cute=fake_cute))
    monkeypatch.setitem(sys.modules, "cutlass.cute", fake_cute)
    assert kdagen.compile.load_object(obj) == "from .o"
    assert opened == [str(obj)]
    checked = tmp_path / "checked.so"
    assert kdagen.compile.load_object(obj, checked) == "from checked.so"
    assert opened[-1] == str(checked)


def test_damaged_so_is_rebuilt_before_loading(fake_build: dict[str, Any]):
    built = kdagen.build.build_variant(SPEC)
    built.shared["beta"].write_bytes(b"lib beta X")  # same size, other bytes
    kernel = kdagen.build.get_kernel(SPEC)
    assert fake_build["compiles"] == 2
    assert kernel.funcs["beta"] == "lib beta 2"


def test_load_failure_rebuilds_once(fake_build: dict[str, Any]):
    kdagen.build.build_variant(SPEC)
    fake_build["bad_loads"] = 1
    kernel = kdagen.build.get_kernel(SPEC)
    assert fake_build["compiles"] == 2
    assert kernel.funcs == {"alpha": "lib alpha 2", "beta": "lib beta 2"}


def test_load_failure_after_a_rebuild_names_the_entry(fake_build: dict[str, Any]):
    built = kdagen.build.build_variant(SPEC)
    fake_build["bad_loads"] = 2
    with pytest.raises(LoadError) as info:
        kdagen.build.get_kernel(SPEC)
    msg = str(info.value)
    assert fake_build["compiles"] == 2
    entry = built.paths["alpha"].parent
    assert f"loading stage 'alpha' of cache entry {entry} from alpha.so failed" in msg
    assert "RuntimeError: tvm_ffi: cannot open alpha.so" in msg and "after one rebuild" in msg
    assert isinstance(info.value, KdagenError)


def test_load_failure_with_jit_disabled_names_the_entry(
    fake_build: dict[str, Any], monkeypatch: pytest.MonkeyPatch
):
    built = kdagen.build.build_variant(SPEC)
    monkeypatch.setenv("KDAGEN_DISABLE_JIT", "1")
    fake_build["bad_loads"] = 1
    with pytest.raises(LoadError) as info:
        kdagen.build.get_kernel(SPEC)
    assert fake_build["compiles"] == 1
    assert str(built.paths["alpha"].parent) in str(info.value)
    assert "KDAGEN_DISABLE_JIT=1 forbids the rebuild" in str(info.value)


# -- 6. a cache that cannot be written ----------------------------------------------------------------------


def _cache_error(fn, *args: Any) -> str:
    with pytest.raises(CacheError) as info:
        fn(*args)
    msg = str(info.value)
    assert "KDAGEN_CACHE_DIR" in msg
    return msg


def test_cache_dir_that_is_a_file(fake_build: dict[str, Any], isolated_env, monkeypatch: pytest.MonkeyPatch):
    isolated_env["cache"].parent.mkdir(parents=True, exist_ok=True)
    isolated_env["cache"].write_text("not a directory\n")
    msg = _cache_error(kdagen.build.get_kernel, SPEC)
    assert str(isolated_env["cache"]) in msg
    assert fake_build["compiles"] == 0


def test_cache_dir_not_writable(fake_build: dict[str, Any], monkeypatch: pytest.MonkeyPatch):
    def refuse(self: Path, *args: Any, **kwargs: Any) -> None:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "mkdir", refuse)
    msg = _cache_error(kdagen.build.get_kernel, SPEC)
    assert "Permission denied" in msg and "writable" in msg
    assert fake_build["compiles"] == 0


@pytest.mark.parametrize("name", ["meta.json", ".lock"])
def test_directory_where_a_file_belongs(fake_build: dict[str, Any], name: str):
    key = keys.cache_key(SPEC, RENDERED, kdagen.build._options(SPEC))[0]
    entry = ArtifactCache().entry_dir(SPEC, key)
    (entry / name).mkdir(parents=True)
    msg = _cache_error(kdagen.build.get_kernel, SPEC)
    assert f"{entry / name}: a directory where a file belongs" in msg
    assert fake_build["compiles"] == 0


def test_publish_onto_a_meta_directory(tmp_path: Path):
    cache = ArtifactCache(tmp_path)
    (cache.entry_dir(SPEC, KEY) / "meta.json").mkdir(parents=True)
    msg = _cache_error(cache.publish, SPEC, KEY, {"alpha": b"x"})
    assert "meta.json" in msg


# -- 8. a repeated get_kernel returns from memory -----------------------------------------------------------


def test_repeated_get_kernel_returns_from_memory(fake_build: dict[str, Any], monkeypatch: pytest.MonkeyPatch):
    ref = "specs/sm90.yaml:k128"
    monkeypatch.chdir(kdagen.paths.data_root())
    first = kdagen.get_kernel(ref)
    spec = resolve_spec(ref)[1]
    args = [ref, spec.replace(), spec.model_dump()]
    for arg in args[1:]:
        assert kdagen.get_kernel(arg) is first  # one kernel per key
    calls: list[Any] = []

    def no_build(*a: Any, **k: Any):
        calls.append(a)
        raise AssertionError("built again")

    monkeypatch.setattr(kdagen.build, "build_variant", no_build)
    monkeypatch.setattr(kdagen.build, "resolve_spec", no_build)
    for arg in args:
        start = time.perf_counter()
        for _ in range(1000):
            assert kdagen.get_kernel(arg) is first
        per_call = (time.perf_counter() - start) / 1000
        assert per_call < 50e-6, f"{type(arg).__name__}: {per_call * 1e6:.1f} us a call"
    assert calls == []


def test_force_rebuilds_and_reloads(fake_build: dict[str, Any]):
    first = kdagen.build.get_kernel(SPEC)
    again = kdagen.build.get_kernel(SPEC, force=True)
    assert fake_build["compiles"] == 2 and again is not first
    assert kdagen.build.get_kernel(SPEC) is again


def test_last_load_seconds_is_gone():
    assert not hasattr(kdagen.build, "last_load_seconds")


# -- 9. kdagen clean asks the cache -------------------------------------------------------------------------


def test_clean_removes_the_derived_data_of_every_target(tmp_path: Path):
    cache = ArtifactCache(tmp_path)
    cache.publish(SPEC, KEY, {"alpha": b"x"})
    for d in ("sources", "templates"):
        (tmp_path / d).mkdir()
    assert cache.clean("sm_90a") == Cleaned(1, ())
    assert (tmp_path / "sources").is_dir()
    assert cache.clean() == Cleaned(0, ("sources", "templates"))
    assert not (tmp_path / "sources").exists() and not (tmp_path / "templates").exists()


def test_cli_clean_asks_the_cache(isolated_env, monkeypatch: pytest.MonkeyPatch):
    calls: list[str | None] = []

    def clean(self: ArtifactCache, arch: str | None = None) -> Cleaned:
        calls.append(arch)
        return Cleaned(3, ("sources",))

    monkeypatch.setattr(ArtifactCache, "clean", clean)
    (isolated_env["cache"] / "sources").mkdir(parents=True)
    r = CliRunner().invoke(cli, ["clean"], catch_exceptions=False)
    assert r.output.startswith(f"removed 3 cache entries and sources/ from {isolated_env['cache']}")
    assert calls == [None]
    assert (isolated_env["cache"] / "sources").is_dir()  # the command removed nothing itself
