"""Compile-only (CPU): the stages that read or write the states on a pool, for sm_90a (the wgmma family with
the fused kernel and its CTA-pair form, `kv`) and a portable mma_sync variant (sm_80, `vk`). Their
signatures declare the states with a dynamic 64-bit slot stride (compact within a slot), the slot map, the
has-initial flags and, where states are written, the prefix-cache checkpoints; they compile for their
target."""

from __future__ import annotations

from pathlib import Path

import pytest

import kdagen.build
import kdagen.compile
import kdagen.plan
from kdagen.dtypes import DTYPES
from kdagen.spec import KernelSpec

CASES = {
    "sm90a-wgmma-kv": KernelSpec(arch="sm_90a"),
    "sm80-mma_sync-vk": KernelSpec(arch="sm_80", state_layout="vk"),
}
POOL_STAGES = ("forward", "cp_merge", "cp_segments")


def _rendered(spec: KernelSpec, tmp_path: Path) -> Path:
    _plan, rendered, _key, _parts = kdagen.build.describe(spec)
    src = tmp_path / spec.slug()
    src.mkdir()
    for name, text in rendered.items():
        (src / name).write_text(text)
    return src


def _signature(path: Path) -> dict[str, tuple]:
    module = kdagen.compile._import_generated(path)
    return {entry[0]: entry for entry in module.SIGNATURE}


@pytest.mark.parametrize("case", list(CASES))
def test_pool_stages_compile(tmp_path: Path, case: str) -> None:
    spec = CASES[case]
    plan = kdagen.plan.make_plan(spec)
    assert plan.family == ("wgmma" if spec.arch == "sm_90a" else "mma_sync")
    src = _rendered(spec, tmp_path)
    k, v = spec.head_dim_k, spec.head_dim_v
    inner = (k * v, v, 1) if spec.state_layout == "kv" else (k * v, k, 1)
    for stage in POOL_STAGES:
        sig = _signature(src / f"{stage}.py")
        states = [name for name in ("h0", "ht") if name in sig]
        assert states, f"{stage}: no state argument"
        for name in states:
            stride = sig[name][4]
            # the slot stride: dynamic, declared a multiple of 16 bytes (what the runtime checks)
            sym, divisor = stride[0]
            assert isinstance(sym, str) and divisor * DTYPES[spec.state_dtype].nbytes == 16, f"{stage}.{name}"
            assert tuple(stride[1:]) == inner, f"{stage}.{name}: {stride}"
        assert sig["state_indices"][2] == "Int32" and sig["pooled"][1] == "Int32", stage
        if "h0" in sig:
            assert sig["has_initial"][2] == "Uint8" and "has_h0" in sig, stage
        if "ht" in sig:  # the stages that write states write the prefix-cache checkpoints too
            assert len(sig["checkpoint_indices"][3]) == 2 and sig["start_positions"][2] == "Int32", stage
            assert sig["ckpt_every"][1] == "Int32", stage
        out = kdagen.compile.compile_stage_file(src / f"{stage}.py", spec.arch)
        assert out.object_bytes[:4] == b"\x7fELF", f"{case} {stage}: not an ELF object"
