"""Compile-only (CPU): the stages that take the caller's q, k, v, g, beta or o declare them row-strided (a
dynamic 64-bit token stride with the divisibility of 16 bytes, beta any, the head and element dims
compact) and compile for their target: sm_90a (wgmma, with the fused kernel and its CTA-pair form inside
`forward`) and sm_80 (mma_sync)."""

from __future__ import annotations

from pathlib import Path

import pytest

import kdagen.build
import kdagen.compile
import kdagen.plan
from kdagen.spec import KernelSpec

CASES = {
    "sm90a-wgmma-gbf16": KernelSpec(arch="sm_90a", g_dtype="bf16"),
    "sm80-mma_sync": KernelSpec(arch="sm_80"),
}
# stage -> the arguments it takes from the caller, each as [tokens, heads, D] or [B, T, heads, D]
STRIDED = {
    "forward": ("q", "k", "g", "beta", "v", "o"),
    "prepare": ("q", "k", "g", "beta"),
    "cp_prescan": ("v",),
    "cp_segments": ("v", "o"),
}


def _rendered(spec: KernelSpec, tmp_path: Path) -> Path:
    _plan, rendered, _key, _parts = kdagen.build.describe(spec)
    src = tmp_path / spec.slug()
    src.mkdir()
    for name, text in rendered.items():
        (src / name).write_text(text)
    return src


@pytest.mark.parametrize("case", list(CASES))
def test_strided_stages_compile(tmp_path: Path, case: str) -> None:
    spec = CASES[case]
    src = _rendered(spec, tmp_path)
    bytes_of = {"BFloat16": 2, "Float16": 2, "Float32": 4}
    stages = set(kdagen.plan.make_plan(spec).stage_names)
    if spec.arch == "sm_90a":
        assert {"fused", "fused_pair"} <= {s.name for s in kdagen.plan.make_plan(spec).stages}
    for stage, names in STRIDED.items():
        assert stage in stages
        module = kdagen.compile._import_generated(src / f"{stage}.py")
        sig = {entry[0]: entry for entry in module.SIGNATURE}
        for name in names:
            _, _, dtype, shape, stride = sig[name]
            token = stride[-len(shape[-2:]) - 1] if name != "beta" else stride[-2]
            inner = stride[-2:] if name != "beta" else stride[-1:]
            assert inner == ((shape[-1], 1) if name != "beta" else (1,)), f"{stage}.{name}: {stride}"
            if name == "beta":
                assert isinstance(token, str), f"{stage}.beta: {stride}"
            else:
                assert isinstance(token, tuple) and token[1] * bytes_of[dtype] == 16, (stage, name, stride)
        out = kdagen.compile.compile_stage_file(src / f"{stage}.py", spec.arch)
        assert out.object_bytes[:4] == b"\x7fELF", f"{case} {stage}: not an ELF object"
