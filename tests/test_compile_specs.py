"""Compile-only: every variant of every ``specs/*.yaml`` for its own target, through the real pipeline (CPU).

design.md "Testing": compile-only of every variant for its target. Each variant goes through
`kdagen.build.build_variant` (spec -> plan -> render -> key -> cute.compile -> cache) into a temp cache; the
checks are parametrized per variant ("file:name"), so a failure names the variant. A second pass checks that
the cache answers without compiling, and two variants are compiled again with ``--keep-ptx`` to read the PTX:
the target must be the spec's, the stages of mma_sync templates must use warp MMAs only (no wgmma, no
tcgen05), and the wgmma recurrence must run on warpgroup MMAs fed by TMA.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

import kdagen.build
import kdagen.compile
import kdagen.plan
from kdagen import paths
from kdagen.spec import KernelSpec, load_spec_file

SPEC_FILES = sorted(paths.specs_dir().glob("*.yaml"))


def _variants() -> list[tuple[str, str, KernelSpec]]:
    out = []
    for f in SPEC_FILES:
        for name, spec in load_spec_file(f).items():
            out.append((f"{f.name}:{name}", name, spec))
    return out


VARIANTS = _variants()
IDS = [vid for vid, _, _ in VARIANTS]


@dataclass
class Built:
    result: kdagen.build.BuildResult | None
    error: BaseException | None
    seconds: float
    first_of_key: bool  # False when an earlier variant had the same key (then it is a legitimate hit)


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory: pytest.TempPathFactory):
    """A temp cache for the whole module; the env stays set until the module is done."""
    root = tmp_path_factory.mktemp("kdagen-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KDAGEN_CACHE_DIR", str(root))
        mp.setenv("KDAGEN_GENERATED_DIR", str(tmp_path_factory.mktemp("generated")))
        mp.delenv("KDAGEN_DISABLE_JIT", raising=False)
        assert paths.cache_dir() == root  # read at call time, not at import
        yield root


@pytest.fixture(scope="module")
def built(cache_root: Path) -> dict[str, Built]:
    """Build every variant once. A failure is recorded, not raised, so the other variants still run."""
    out: dict[str, Built] = {}
    seen: set[str] = set()
    for vid, name, spec in VARIANTS:
        start = time.perf_counter()
        try:
            res, err = kdagen.build.build_variant(spec, name=name), None
        except Exception as e:  # reported by the test of this variant
            res, err = None, e
        first = res is not None and res.key not in seen
        if res is not None:
            seen.add(res.key)
        out[vid] = Built(res, err, time.perf_counter() - start, first)
    return out


def _get(built: dict[str, Built], vid: str) -> kdagen.build.BuildResult:
    b = built[vid]
    if b.error is not None:
        raise AssertionError(f"{vid}: build_variant failed: {type(b.error).__name__}: {b.error}") from b.error
    return b.result


def test_spec_files_found():
    names = {f.name for f in SPEC_FILES}
    assert {"sm80.yaml", "sm89.yaml", "sm90.yaml", "sm100.yaml"} <= names
    assert len(VARIANTS) >= 4


@pytest.mark.parametrize("vid,name,spec", VARIANTS, ids=IDS)
def test_variant_compiles(built: dict[str, Built], cache_root: Path, vid: str, name: str, spec: KernelSpec):
    res = _get(built, vid)
    print(f"{vid}: build_variant {built[vid].seconds:.2f} s (compile {res.compile_seconds:.2f} s)")
    plan, _rendered, key, _parts = kdagen.build.describe(spec)
    assert re.fullmatch(r"[0-9a-f]{24}", res.key)
    assert res.key == key
    assert res.name == name
    assert res.spec == spec
    assert res.slug == spec.slug()
    assert res.stages == plan.stage_names and res.stages
    if built[vid].first_of_key:
        assert res.cached is False, f"{vid}: first build in an empty cache reported a cache hit"
        assert res.compile_seconds > 0

    # The entry lives under the spec's own arch: <cache>/<arch>/<slug>-<key>/.
    entry = cache_root / spec.arch / f"{spec.slug()}-{key}"
    assert set(res.paths) == set(res.stages)
    total = 0
    for stage in res.stages:
        p = res.paths[stage]
        assert p == entry / f"{stage}.o"
        assert p.is_file(), f"{vid}: missing artifact {p}"
        size = p.stat().st_size
        assert size > 0, f"{vid}: empty artifact {p}"
        assert p.read_bytes()[:4] == b"\x7fELF", f"{vid}: {p.name} is not an ELF object"
        total += size
        # With a C compiler on the build box (CI has one) each stage also ships as a shared library,
        # the artifact a serving process loads without importing the DSL.
        lib = p.with_suffix(".so")
        assert lib.is_file() and lib.read_bytes()[:4] == b"\x7fELF", f"{vid}: missing shared library {lib}"
        total += lib.stat().st_size
    assert res.artifact_bytes == total

    meta_path = entry / "meta.json"
    assert meta_path.is_file() and meta_path.stat().st_size > 0
    meta = json.loads(meta_path.read_text())
    assert meta["key"] == key
    assert meta["arch"] == spec.arch
    assert meta["slug"] == spec.slug()
    assert meta["spec"] == json.loads(spec.canonical_json())
    assert meta["stages"] == res.stages + [f"{stage}.so" for stage in res.stages]
    for stage in res.stages:
        data = res.paths[stage].read_bytes()
        assert meta["artifacts"][stage]["bytes"] == len(data)
        assert meta["artifacts"][stage]["sha256"] == hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("vid,name,spec", VARIANTS, ids=IDS)
def test_variant_second_build_is_a_hit(
    built: dict[str, Built], monkeypatch: pytest.MonkeyPatch, vid: str, name: str, spec: KernelSpec
):
    first = _get(built, vid)
    mtimes = {s: p.stat().st_mtime_ns for s, p in first.paths.items()}

    def no_compile(*args, **kwargs):
        raise AssertionError(f"{vid}: a cache hit must not compile (compile_stage_file{args!r})")

    def no_render(*args, **kwargs):
        raise AssertionError(f"{vid}: a cache hit must take its key from the remembered source digests")

    monkeypatch.setattr(kdagen.compile, "compile_stage_file", no_compile)
    with monkeypatch.context() as m:
        m.setattr(kdagen.build, "_render", no_render)
        again = kdagen.build.build_variant(spec, name=name)
    assert again.cached is True
    assert again.compile_seconds == 0.0
    assert again.key == first.key == kdagen.build.describe(spec)[2]
    assert again.paths == first.paths
    assert again.artifact_bytes == first.artifact_bytes
    assert {s: p.stat().st_mtime_ns for s, p in again.paths.items()} == mtimes  # nothing rewritten


# ---- the PTX honours the target ----------------------------------------------------------------------------

PTX_CASES = [
    ("sm90.yaml", "sm_90a"),
    ("sm100.yaml", "sm_100a"),
]
_DSL_TO_PTX = {"BFloat16": "bf16", "Float16": "f16"}
_MMA_RE = re.compile(r"mma\.sync\.aligned\.m\d+n\d+k\d+\.[a-z0-9.]+")
_F16_ATOM_RE = re.compile(r"MmaF16BF16Op\(\s*([\w.]+)\s*,\s*cutlass\.Float32\s*,\s*\(16,\s*8,\s*16\)\s*\)")
_TF32_ATOM_RE = re.compile(r"MmaTF32Op\(\s*\(16,\s*8,\s*8\)\s*\)")


def _first_variant(file_name: str, arch: str) -> tuple[str, KernelSpec]:
    for vid, _name, spec in VARIANTS:
        if vid.startswith(f"{file_name}:") and spec.arch == arch:
            return vid, spec
    pytest.fail(f"no {arch} variant in specs/{file_name}")


_SIBLING_RE = re.compile(r'^\w+ = sibling\(__name__, __file__, "(\w+)"\)$', flags=re.M)


_PREPARE_MMAS_RE = re.compile(r"\bprepare_mmas\(\s*([\w.]+)\s*\)")
_PRODUCTS_MMAS_RE = re.compile(r"\bproducts_mmas\(\s*([\w.]+)\s*[,)]")
_GRADS_MMA_RE = re.compile(r"\bgrads_mma\(\)")


def _expected_mmas(source: str) -> set[str]:
    """The warp-MMA PTX instructions the rendered stage asks for through its CuTe MMA atoms: its own, and
    those of `kdagen.kernels.prepare.prepare_mmas(dtype)` where it calls it (tf32 for L and Mqk, fp16 for
    the fold, and the inputs' dtype for the Gram matrix) and of
    `kdagen.kernels.bwd_tile.products_mmas(dtype, warps)` (that dtype) and of
    `kdagen.kernels.bwd_grads.grads_mma()` (tf32)."""
    out = set()
    atoms = _F16_ATOM_RE.findall(source) + _PRODUCTS_MMAS_RE.findall(source)
    for dtype in _PREPARE_MMAS_RE.findall(source):
        atoms += ["cutlass.Float16", dtype]
        out.add("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32")
    for ab in atoms:
        if not ab.startswith("cutlass."):  # an alias such as DT = cutlass.BFloat16
            m = re.search(rf"^{re.escape(ab)}\s*=\s*(cutlass\.\w+)\s*$", source, flags=re.M)
            assert m, f"cannot resolve MMA operand type {ab!r} in the rendered source"
            ab = m.group(1)
        t = _DSL_TO_PTX[ab.removeprefix("cutlass.")]
        out.add(f"mma.sync.aligned.m16n8k16.row.col.f32.{t}.{t}.f32")
    if _TF32_ATOM_RE.search(source) or _GRADS_MMA_RE.search(source):
        out.add("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32")
    return out


def _ptx_of(src: Path, stage: str, arch: str, dump: Path) -> str:
    dump.mkdir(parents=True)  # the DSL writes nothing (and says nothing) when --dump-dir does not exist
    options = f"--keep-ptx --dump-dir {dump}"
    out = kdagen.compile.compile_stage_file(src / f"{stage}.py", arch, extra_options=options)
    assert out.object_bytes[:4] == b"\x7fELF"
    ptx = sorted(dump.glob("*.ptx"))
    assert len(ptx) == 1, f"expected one .ptx in {dump}, found {[p.name for p in dump.iterdir()]}"
    assert ptx[0].name.endswith(f".{arch}.ptx")
    return ptx[0].read_text()


def _kernel_registers(cubin: bytes) -> list[int]:
    """Registers per thread of each kernel in a cubin: the REGCOUNT attributes (0x2f, a 4-byte-length
    record of function index and count) of its `.nv.info*` ELF sections."""
    shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names_at = sections[shstrndx][4]
    regs = []
    for name, _type, _flags, _addr, offset, size, *_ in sections:
        title = cubin[names_at + name : cubin.index(b"\0", names_at + name)]
        if not title.startswith(b".nv.info"):
            continue
        info, i = cubin[offset : offset + size], 0
        while i < len(info):
            fmt, attr = info[i], info[i + 1]
            if fmt == 0x04:  # a record with a 2-byte length
                length = struct.unpack_from("<H", info, i + 2)[0]
                if attr == 0x2F:
                    regs.append(struct.unpack_from("<II", info, i + 4)[1])
                i += 4 + length
            else:
                i += 4 if fmt == 0x03 else 2
    return regs


@pytest.mark.parametrize("file_name,arch", PTX_CASES, ids=[a for _, a in PTX_CASES])
def test_ptx_targets_the_spec_arch(tmp_path: Path, file_name: str, arch: str):
    """Each stage's PTX: ``.target <arch>`` and exactly the warp-MMA atoms its source declares; no wgmma or
    tcgen05 in mma_sync templates; the wgmma recurrence on warpgroup MMAs and TMA."""
    vid, spec = _first_variant(file_name, arch)
    plan, rendered, _key, _parts = kdagen.build.describe(spec)
    assert plan.family == ("wgmma" if arch == "sm_90a" else "mma_sync")
    templates = {st.name: st.template for st in plan.stages}
    src = tmp_path / "src" / spec.slug()
    src.mkdir(parents=True)
    for fname, text in rendered.items():
        (src / fname).write_text(text)

    for stage in plan.stage_names:
        ptx = _ptx_of(src, stage, arch, tmp_path / f"dump-{stage}")
        targets = re.findall(r"^\.target\s+(\S+)", ptx, flags=re.M)
        assert targets == [arch], f"{vid} {stage}: .target lines {targets}, expected [{arch}]"
        assert "tcgen05" not in ptx, f"{vid} {stage}: PTX contains tcgen05"
        # A stage's kernels: its own and those of the stage modules it imports (forward: prepare, recurrence).
        parts = [stage, *_SIBLING_RE.findall(rendered[f"{stage}.py"])]
        if any(templates[part].startswith("wgmma/") for part in parts):
            wg = "wgmma.mma_async.sync.aligned"
            for needed in (f"{wg}.m64n16k16.f32", f"{wg}.m64n{spec.head_dim_k}k16", "cp.async.bulk.tensor"):
                assert needed in ptx, f"{vid} {stage}: PTX lacks {needed} (wgmma family)"
        else:
            assert "wgmma" not in ptx, f"{vid} {stage}: PTX contains wgmma (mma_sync templates only)"
        found = set(_MMA_RE.findall(ptx))
        expected = set().union(*(_expected_mmas(rendered[f"{part}.py"]) for part in parts))
        print(f"{vid} {stage} ({arch}): {sorted(found)}")
        assert found == expected, f"{vid} {stage}: PTX has {sorted(found)}, source asks {sorted(expected)}"
        if stage == "prepare":
            assert any(m.startswith("mma.sync.aligned.m16n8k16.") for m in found), f"{vid}: no m16n8k16"


def test_beta_logit_variant_has_the_sigmoid_where_beta_is_loaded(tmp_path: Path):
    """The sm_90a variant of specs/sm90.yaml with ``beta: logit``: its prepare and decode stages compile for
    sm_90a, and their PTX has the sigmoid of the loaded beta (one more ex2 and a rounded reciprocal of
    1 + e^-x) that the same spec with ``beta: prob`` lacks."""
    vid, spec = next((vid, s) for vid, _, s in VARIANTS if vid.startswith("sm90.yaml:") and s.beta == "logit")
    assert spec.arch == "sm_90a"
    for stage in ("prepare", "decode"):
        counts = {}
        for s in (spec, spec.replace(beta="prob")):
            rendered = kdagen.build.describe(s)[1]
            src = tmp_path / s.slug()
            src.mkdir(exist_ok=True)
            (src / f"{stage}.py").write_text(rendered[f"{stage}.py"])
            ptx = _ptx_of(src, stage, "sm_90a", tmp_path / f"dump-{s.beta}-{stage}")
            assert re.findall(r"^\.target\s+(\S+)", ptx, flags=re.M) == ["sm_90a"]
            counts[s.beta] = (ptx.count("rcp.rn.f32"), ptx.count("ex2.approx"))
        print(f"{vid} {stage}: (rcp.rn, ex2) {counts}")
        (rcp, ex2), (rcp0, ex20) = counts["logit"], counts["prob"]
        assert rcp > rcp0 and ex2 > ex20, f"{vid} {stage}: no sigmoid of beta in the PTX ({counts})"


@pytest.mark.parametrize("family", ["mma_sync", "wgmma"])
def test_recurrence_registers_match_the_plan(tmp_path: Path, family: str):
    """The planner sizes prepare beside the recurrence from the recurrence CTA's registers before anything is
    compiled (`kdagen.plan._RECURRENCE_CTA`); the compiled sm_90a recurrence (K=V=128) must not need more."""
    spec = KernelSpec(arch="sm_90a", family=family)
    _plan, rendered, _key, _parts = kdagen.build.describe(spec)
    src, dump = tmp_path / "src", tmp_path / "dump"
    src.mkdir()
    dump.mkdir()  # the DSL writes nothing (and says nothing) when --dump-dir does not exist
    (src / "recurrence.py").write_text(rendered["recurrence.py"])
    options = f"--keep-cubin --dump-dir {dump}"
    kdagen.compile.compile_stage_file(src / "recurrence.py", "sm_90a", extra_options=options)
    cubins = sorted(dump.glob("*.cubin"))
    assert len(cubins) == 1, f"expected one cubin, found {[c.name for c in cubins]}"
    regs = _kernel_registers(cubins[0].read_bytes())
    assumed = kdagen.plan._RECURRENCE_CTA[family][1]
    assert regs and max(regs) <= assumed, f"{family} recurrence: {regs} registers, the plan assumes {assumed}"


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
def test_streaming_decode_keeps_its_columns_in_registers(tmp_path: Path, state_dtype: str):
    """The sm_90a streaming decode (K = V = 128): its states arrive by bulk copies completing on mbarriers,
    its CTA has the planned threads (two a value column, a loader and the stager warps), and ptxas gives each
    thread room for its half column (more than 64 registers, within the 65536 / threads an SM allows; past
    256 threads it can fall back to 32 registers and spill every column)."""
    spec = KernelSpec(arch="sm_90a", state_dtype=state_dtype)
    plan, rendered, _key, _parts = kdagen.build.describe(spec)
    params = {s.name: s.params for s in plan.stages}["decode_stream"]
    src, dump = tmp_path / "src", tmp_path / "dump"
    src.mkdir()
    dump.mkdir()  # the DSL writes nothing (and says nothing) when --dump-dir does not exist
    (src / "decode_stream.py").write_text(rendered["decode_stream.py"])
    options = f"--keep-cubin --keep-ptx --dump-dir {dump}"
    kdagen.compile.compile_stage_file(src / "decode_stream.py", "sm_90a", extra_options=options)
    ptx = next(dump.glob("*.ptx")).read_text()
    threads = 2 * spec.head_dim_v + 32 * (1 + params["stagers"])
    assert f".reqntid {threads}, 1, 1" in ptx
    assert "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes" in ptx
    regs = _kernel_registers(next(dump.glob("*.cubin")).read_bytes())
    assert regs and 64 < max(regs) <= 65536 // threads, f"{regs} registers at {threads} threads"
