"""GPU: the forward on row-strided inputs (q, k, v as slices of one packed projection, g and beta of another)
and into a row-strided ``out``, on every path (the two-stage path of each family, the fused kernel with one
CTA and in CTA pairs, intra-card CP, a pool): bit-identical to the same call on contiguous copies, within
the fp64 reference's tolerance, the columns of the buffers beside o untouched, and no input copied
(`kdagen.runtime._compact` is never called; a misaligned view is, and still gives the same result).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import kdagen.runtime
from kdagen.policy import SchedulePolicy
from kdagen.reference import assert_close

try:  # tests/gpu is not a package: pytest puts this folder on sys.path (rootdir-relative import mode)
    from . import _cases as cases  # type: ignore[no-redef]
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import _cases as cases  # type: ignore[no-redef]

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (sm_90a)"),
]

PAD, SENTINEL = cases.PAD, cases.SENTINEL
_packed = cases.packed_projections


def _strided_out(b: int, t: int, hv: int, v: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(a [B, T, HV V + PAD] buffer full of SENTINEL, o as its first HV V columns)."""
    buf = torch.full((b, t, hv * v + PAD), SENTINEL, dtype=dtype, device="cuda")
    return buf, buf[..., :hv * v].view(b, t, hv, v)


class NoCopy:
    """Counts `kdagen.runtime._compact` calls (the copy of an input the kernels cannot read in place)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        real = kdagen.runtime._compact

        def counted(t: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            return real(t)

        monkeypatch.setattr(kdagen.runtime, "_compact", counted)


def _kernel(spec_name: str, family: str) -> Any:
    import kdagen

    if family == "auto":
        return cases.kernel_for(spec_name)
    kernel = kdagen.get_kernel({**cases.SPECS[spec_name], "family": family})
    assert kernel.plan.family == family
    return kernel


def _call(kernel: Any, x: dict[str, Any], inp: dict[str, Any], policy: Any, **kw: Any) -> tuple[Any, Any]:
    return kernel(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=inp["A_log"], dt_bias=inp["dt_bias"],
                  cu_seqlens=inp["cu_seqlens"], policy=policy, **kw)


PATHS = [
    ("lb_safe_gbf16", "auto", cases.F(2, 300, 2, init=True), SchedulePolicy(fused="off")),  # wgmma two-stage
    ("lb_safe_gbf16", "auto", cases.VL((0, 100, 333, 600), 2, init=True),
     SchedulePolicy(fused="on", fused_pair="off")),  # fused kernel, one CTA a chain
    ("lb_safe_gbf16", "auto", cases.VL((0, 500), 2, init=True), SchedulePolicy(fused="on")),  # CTA pairs
    ("lb_safe", "auto", cases.F(2, 300, 2, init=True),
     SchedulePolicy(fused="on", fused_pair="off")),  # fp32 g: beta in the gate projection
    ("lb_safe_gbf16", "auto", cases.F(1, 4096, 1, init=True), SchedulePolicy(intracard_cp=512)),  # CP
    ("lb_safe_mma_sync_logit_x2", "auto", cases.VL((0, 15, 300, 777), 2, init=True), SchedulePolicy()),
    ("softplus_mma_sync_bbf16_logit", "auto", cases.F(1, 2048, 1, init=True),
     SchedulePolicy(intracard_cp=256)),  # mma_sync, CP, beta apart from g
    ("lb_safe_gva2_vk_bbf16", "auto", cases.VL((0, 65, 400), 2, init=True), SchedulePolicy()),
]


@pytest.mark.parametrize(("spec_name", "family", "case", "policy"), PATHS,
                         ids=[f"{p[0]}-{p[2].id}-{i}" for i, p in enumerate(PATHS)])
def test_strided_matches_contiguous(monkeypatch: pytest.MonkeyPatch, spec_name: str, family: str,
                                    case: cases.Case, policy: SchedulePolicy) -> None:
    spec = cases.SPECS[spec_name]
    kernel = _kernel(spec_name, family)
    if policy.intracard_cp != "auto":
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        hv = case.H * spec["gva_ratio"]
        nseq = case.B if case.cu is None else len(case.cu) - 1
        seg = kernel.schedule(nseq, case.B * case.total, hv, sms, policy).seg_len
        assert seg, "the call takes no CP path"
    inp = cases.build_inputs(spec, case)
    h0 = inp["initial_state"]
    o_c, ht_c = _call(kernel, inp, inp, policy, initial_state=h0, output_final_state=True)

    x = _packed(inp)
    v = x["v"]
    buf, out = _strided_out(v.shape[0], v.shape[1], v.shape[2], spec["head_dim_v"], v.dtype)
    counter = NoCopy(monkeypatch)
    for _ in range(2):  # the second call takes the validated-signature fast path
        o_s, ht_s = _call(kernel, x, inp, policy, initial_state=h0, output_final_state=True, out=out)
        torch.cuda.synchronize()
        assert o_s is out and counter.calls == 0, "a row-strided input was copied"
        assert torch.equal(o_s, o_c), "o on strided inputs differs from the contiguous call"
        assert torch.equal(ht_s, ht_c), "the final state on strided inputs differs from the contiguous call"
    assert buf[..., -PAD:].eq(SENTINEL).all(), "o's neighbouring columns were written"
    for b in x["buffers"]:
        assert b[..., -PAD:].eq(SENTINEL).all(), "an input buffer was written"

    o_ref, ht_ref = cases.run_reference(spec, inp)
    assert_close("o", o_ref, o_s, cases.GPU_TOL)
    assert_close("ht", ht_ref, ht_s, cases.GPU_TOL)


def test_misaligned_view_is_copied_and_agrees(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = cases.SPECS["lb_safe_gbf16"]
    kernel = cases.kernel_for("lb_safe_gbf16")
    inp = cases.build_inputs(spec, cases.F(2, 200, 2, init=True))
    o_c, ht_c = _call(kernel, inp, inp, None, initial_state=inp["initial_state"], output_final_state=True)
    x = _packed(inp, shift=1)  # q, k, v one element in (bases off 16 bytes) with an odd token stride
    counter = NoCopy(monkeypatch)
    o_s, ht_s = _call(kernel, x, inp, None, initial_state=inp["initial_state"], output_final_state=True)
    assert counter.calls == 3  # q, k, v; g and beta went as they are
    assert torch.equal(o_s, o_c) and torch.equal(ht_s, ht_c)


@pytest.mark.parametrize("policy", [SchedulePolicy(fused="off"), SchedulePolicy(fused="on")],
                         ids=["two-stage", "fused"])
def test_strided_on_a_pool(monkeypatch: pytest.MonkeyPatch, policy: SchedulePolicy) -> None:
    spec = cases.SPECS["lb_safe_gbf16"]
    kernel = cases.kernel_for("lb_safe_gbf16")
    inp = cases.build_inputs(spec, cases.VL((0, 40, 300, 301), 2, init=True))
    pool = torch.randn(6, 2, 128, 128, device="cuda") * 0.5
    idx = torch.tensor([4, -1, 1], dtype=torch.int32, device="cuda")
    pool_c = pool.clone()
    o_c, _ = _call(kernel, inp, inp, policy, state_pool=pool_c, state_indices=idx)
    x = _packed(inp)
    _buf, out = _strided_out(1, 301, 2, 128, torch.bfloat16)
    counter = NoCopy(monkeypatch)
    o_s, _ = _call(kernel, x, inp, policy, state_pool=pool, state_indices=idx, out=out)
    assert o_s is out and counter.calls == 0
    assert torch.equal(o_s, o_c) and torch.equal(pool, pool_c)


def test_no_allocation_the_size_of_the_inputs(monkeypatch: pytest.MonkeyPatch) -> None:
    # Beyond the mock: a call with `out` on strided inputs allocates only its workspace (prepare's per-token
    # intermediates, ~3 x q's bytes per value head), never a copy of q, k, v or g on top of it.
    spec = cases.SPECS["lb_safe_gbf16"]
    kernel = cases.kernel_for("lb_safe_gbf16")
    inp = cases.build_inputs(spec, cases.F(1, 8192, 4))
    x = _packed(inp)
    _buf, out = _strided_out(1, 8192, 4, 128, torch.bfloat16)
    policy = SchedulePolicy(fused="off")
    _call(kernel, x, inp, policy, out=out)  # warm: validation, helpers
    torch.cuda.synchronize()
    contiguous = {n: inp[n] for n in ("q", "k", "v", "g", "beta")}
    peaks = []
    for args in (x, contiguous):
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        _call(kernel, args, inp, policy, out=out)
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - before)
    assert peaks[0] == peaks[1], f"strided inputs allocated {peaks[0]} bytes, contiguous ones {peaks[1]}"
