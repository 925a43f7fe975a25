"""Cache round trip through the real pipeline (CPU): build, load in a fresh process, self-heal, JIT off.

design.md "Testing": cache round-trip (export, load in a fresh process). One small variant
(sm_90a, K = V = 64) is compiled once per module into a temp cache; each destructive test works on its own
copy of that cache.
Loading an exported ``.o`` needs no GPU (cutedsl.md §2b); only a launch would.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import kdagen
import kdagen.build
from kdagen.cache import ArtifactCache
from kdagen.errors import CacheMissError, InputError
from kdagen.spec import KernelSpec, resolve_spec

REF = "specs/sm90.yaml:k64"
NAME, SPEC = resolve_spec(REF)
REPO = Path(__file__).resolve().parent.parent


def test_the_variant_is_small():
    assert isinstance(SPEC, KernelSpec) and NAME == "k64"
    assert (SPEC.arch, SPEC.head_dim_k, SPEC.head_dim_v) == ("sm_90a", 64, 64)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, kdagen.build.BuildResult]:
    """A cache holding the one variant, built once; tests copy it before changing anything."""
    root = tmp_path_factory.mktemp("pristine-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KDAGEN_CACHE_DIR", str(root))
        mp.delenv("KDAGEN_DISABLE_JIT", raising=False)
        res = kdagen.build.build_variant(SPEC, name=NAME)
    assert res.cached is False
    return root, res


@pytest.fixture
def cache(pristine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, kdagen.build.BuildResult]:
    """A private copy of the pristine cache, selected through KDAGEN_CACHE_DIR."""
    src, res = pristine
    root = tmp_path / "cache"
    shutil.copytree(src, root)
    monkeypatch.setenv("KDAGEN_CACHE_DIR", str(root))
    monkeypatch.delenv("KDAGEN_DISABLE_JIT", raising=False)
    return root, res


def _entry(root: Path, key: str) -> Path:
    return root / SPEC.arch / f"{SPEC.slug()}-{key}"


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _assert_valid(root: Path, key: str, stages: list[str]) -> dict[str, Path]:
    found = kdagen.build.lookup_built(ArtifactCache(root), SPEC, key, stages)
    assert found is not None, f"the entry {_entry(root, key)} is not valid"
    return found


# ---- a fresh process loads what this one built -------------------------------------------------------------

_CHILD = textwrap.dedent(
    """
    import json, sys, time
    import kdagen.build
    from kdagen.spec import resolve_spec

    name, spec = resolve_spec({ref!r})
    t0 = time.perf_counter()
    res = kdagen.build.build_variant(spec, name=name)
    hit_s = time.perf_counter() - t0
    report = {{
        "cached": res.cached,
        "key": res.key,
        "paths": {{s: str(p) for s, p in res.paths.items()}},
        "hit_seconds": hit_s,
        "cutlass_after_hit": sorted(m for m in sys.modules if m.split(".")[0] == "cutlass"),
        "jinja2_after_hit": "jinja2" in sys.modules,
        "loads": {{}},
    }}
    from kdagen.compile import load_object

    t0 = time.perf_counter()
    import cutlass.cute  # what the first load pays once per process (tvm_ffi imports torch), timed apart
    import tvm_ffi

    report["import_seconds"] = time.perf_counter() - t0
    for stage, path in res.paths.items():
        t0 = time.perf_counter()
        fn = load_object(path)
        report["loads"][stage] = {{
            "seconds": time.perf_counter() - t0,
            "type": type(fn).__module__ + "." + type(fn).__name__,
        }}
    report["generated_modules"] = sorted(m for m in sys.modules if m.startswith("kdagen_gen_"))
    print("REPORT " + json.dumps(report))
    """
)


def test_fresh_process_hits_and_loads(cache):
    root, res = cache
    env = {**os.environ, "KDAGEN_CACHE_DIR": str(root), "KDAGEN_DISABLE_JIT": "1"}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD.format(ref=REF)],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=240,
    )
    assert out.returncode == 0, f"child failed:\n{out.stdout}\n{out.stderr}"
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("REPORT ")][-1]
    report = json.loads(line.removeprefix("REPORT "))
    print(json.dumps(report, indent=2))

    assert report["cached"] is True  # with KDAGEN_DISABLE_JIT=1 a miss would have raised instead
    assert report["key"] == res.key
    assert report["paths"] == {s: str(_entry(root, res.key) / f"{s}.o") for s in res.stages}
    # A cache hit is answered from package metadata and the store: the DSL is not imported.
    assert report["cutlass_after_hit"] == []
    # The key comes from the source digests the build remembered (kdagen.source_memo): no render, no Jinja.
    assert report["jinja2_after_hit"] is False
    assert set(report["loads"]) == set(res.stages)
    for stage, info in report["loads"].items():
        assert info["type"] == "tvm_ffi.core.Function", f"{stage}: loaded {info['type']}"
    # Loading an exported object does not import the kernel's Python source.
    assert report["generated_modules"] == []


# ---- self-healing ------------------------------------------------------------------------------------------


def test_corrupt_artifact_is_rebuilt(cache):
    root, res = cache
    entry = _entry(root, res.key)
    stage = res.stages[0]
    art = entry / f"{stage}.o"
    original = art.read_bytes()
    data = bytearray(original)
    mid = len(data) // 2
    data[mid : mid + 16] = bytes(b ^ 0xFF for b in data[mid : mid + 16])  # same size, different bytes
    art.write_bytes(bytes(data))
    # the damage is noticed
    assert kdagen.build.lookup_built(ArtifactCache(root), SPEC, res.key, res.stages) is None

    again = kdagen.build.build_variant(SPEC, name=NAME)
    assert again.cached is False
    assert again.key == res.key
    assert again.paths == {s: entry / f"{s}.o" for s in res.stages}
    found = _assert_valid(root, res.key, res.stages)
    meta = json.loads((entry / "meta.json").read_text())
    assert meta["artifacts"][stage]["sha256"] == _sha(found[stage])
    # The compile is deterministic (cutedsl.md TL;DR 1), so the rebuilt object is the original one.
    assert found[stage].read_bytes() == original
    assert kdagen.build.build_variant(SPEC, name=NAME).cached is True


def test_missing_meta_is_rebuilt(cache):
    root, res = cache
    entry = _entry(root, res.key)
    (entry / "meta.json").unlink()
    assert kdagen.build.lookup_built(ArtifactCache(root), SPEC, res.key, res.stages) is None

    again = kdagen.build.build_variant(SPEC, name=NAME)
    assert again.cached is False
    assert (entry / "meta.json").is_file()
    _assert_valid(root, res.key, res.stages)
    assert kdagen.build.build_variant(SPEC, name=NAME).cached is True


# ---- KDAGEN_DISABLE_JIT=1 with an empty cache --------------------------------------------------------------


def test_cache_miss_with_jit_disabled_names_the_spec(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    root = tmp_path / "empty"
    monkeypatch.setenv("KDAGEN_CACHE_DIR", str(root))
    monkeypatch.setenv("KDAGEN_DISABLE_JIT", "1")
    with pytest.raises(CacheMissError) as info:
        kdagen.build.build_variant(SPEC)
    assert SPEC.slug() in str(info.value)
    assert not root.exists()  # a refused build writes nothing, not even a lock


def test_cache_miss_with_jit_disabled_names_the_slug_for_a_reference(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("KDAGEN_CACHE_DIR", str(tmp_path / "empty"))
    monkeypatch.setenv("KDAGEN_DISABLE_JIT", "1")
    with pytest.raises(CacheMissError) as info:
        kdagen.build.build_variant(REF)
    assert NAME in str(info.value)
    assert SPEC.slug() in str(info.value)


def test_get_kernel_cache_miss_with_jit_disabled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("KDAGEN_CACHE_DIR", str(tmp_path / "empty"))
    monkeypatch.setenv("KDAGEN_DISABLE_JIT", "1")
    with pytest.raises(CacheMissError):
        kdagen.get_kernel(REF)


# ---- get_kernel on a machine without a GPU -----------------------------------------------------------------


def test_get_kernel_loads_without_a_gpu_and_refuses_cpu_tensors(cache, monkeypatch: pytest.MonkeyPatch):
    import torch

    from kdagen.runtime import KDAKernel

    monkeypatch.setenv("KDAGEN_DISABLE_JIT", "1")  # must come from the cache
    kernel = kdagen.get_kernel(REF)
    assert isinstance(kernel, KDAKernel)
    assert kernel.spec == SPEC and kernel.name == NAME
    assert kdagen.get_kernel(SPEC) is kernel  # one loaded kernel per key and process

    T, H, K, V = 32, 2, SPEC.head_dim_k, SPEC.head_dim_v
    HV = H * SPEC.gva_ratio
    q = torch.randn(1, T, H, K, dtype=torch.bfloat16)
    k = torch.randn(1, T, H, K, dtype=torch.bfloat16)
    v = torch.randn(1, T, HV, V, dtype=torch.bfloat16)
    g = torch.randn(1, T, HV, K, dtype=torch.float32)
    beta = torch.rand(1, T, HV, dtype=torch.float32)
    with pytest.raises(InputError) as info:
        kernel(q, k, v, g, beta, output_final_state=True)
    msg = str(info.value)
    assert msg.startswith("q:"), msg
    assert "cuda" in msg.lower(), msg
