"""GPU numerics of kdagen kernels against the fp64 token recurrence (kdagen.reference), plus CUDA graphs, the
prebuilt-artifact path (KDAGEN_DISABLE_JIT) and input validation.

Metric: relative RMSE of kda-math §4.1, tolerance 0.005 for o and the final state. The matrix (tests/gpu/
_cases.py) covers odd T, T=1, varlen with length-1 sequences, GVA 1/2/4, both beta dtypes, beta given as a
probability or as logits (sigmoid and 2 sigmoid in the kernel), with and without an initial state, final
state on/off, every gate mode (hard resets on the non-safe ones), gate extremes, l2norm on/off, the four
(K, V) pairs, bf16 and fp16, both state layouts and both families, in the compiled specs of `_cases.SPECS`.

Every test needs a CUDA GPU (sm_90a); without one the whole module is skipped.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from kdagen.policy import PlanFacts, SchedulePolicy, device_picks_fused
from kdagen.reference import assert_close

try:  # tests/gpu is not a package: pytest puts this folder on sys.path (rootdir-relative import mode)
    from . import _cases as cases  # type: ignore[no-redef]
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import _cases as cases  # type: ignore[no-redef]

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA GPU (kdagen kernels target sm_90a); torch.cuda.is_available() is False",
    ),
]

REPO_ROOT = Path(__file__).resolve().parents[2]
TOL = cases.GPU_TOL


# ---------------------------------------------------------------------------------------------------------
# the numerics matrix
# ---------------------------------------------------------------------------------------------------------


def _check_against_reference(spec_name: str, case: cases.Case, policy: SchedulePolicy | None = None) -> None:
    spec = cases.SPECS[spec_name]
    kernel = cases.kernel_for(spec_name)
    if policy is not None:
        kernel = kernel.with_policy(policy)
    inp = cases.build_inputs(spec, case)
    h0_before = None if inp["initial_state"] is None else inp["initial_state"].clone()

    o, ht = cases.run_kernel(kernel, inp, case.final)
    torch.cuda.synchronize()
    ref_o, ref_ht = cases.run_reference(spec, inp, case.final)

    assert isinstance(o, torch.Tensor), f"o: expected a tensor, got {type(o).__name__}"
    assert o.dtype == inp["q"].dtype, f"o: dtype {o.dtype}, expected q.dtype {inp['q'].dtype}"
    assert o.device == inp["q"].device
    assert tuple(o.shape) == tuple(ref_o.shape), f"o: shape {tuple(o.shape)}, expected {tuple(ref_o.shape)}"
    assert_close("o", ref_o, o, TOL)
    if case.final:
        assert ht is not None, "ht: None although output_final_state=True"
        want = cases.state_dtype(spec)  # the spec's
        assert ht.dtype == want, f"ht: dtype {ht.dtype}, expected {want}"
        assert tuple(ht.shape) == tuple(ref_ht.shape), f"ht: shape {tuple(ht.shape)} ({spec['state_layout']})"
        assert_close("ht", ref_ht, ht, TOL)
    else:
        assert ht is None, "ht: expected None when output_final_state=False"
    if h0_before is not None:
        assert torch.equal(inp["initial_state"], h0_before), "initial_state was modified by the kernel"


@pytest.mark.parametrize(("spec_name", "case"), cases.MATRIX, ids=[f"{n}:{c.id}" for n, c in cases.MATRIX])
def test_numerics(spec_name: str, case: cases.Case) -> None:
    _check_against_reference(spec_name, case)


# The fused prepare + recurrence kernel (the wgmma variants the planner gives one: those with the safe gate).
# fused="on" runs it on every whole-sequence call: the numerics matrix of those specs against the fp64
# reference, and bit-identity with the two-stage path (fused="off") on the same inputs, since the
# arithmetic is the same and only the route of the per-step operands differs (shared memory instead of the
# workspace).
def _has_fused_stage(spec_name: str) -> bool:
    from kdagen.plan import make_plan
    from kdagen.spec import KernelSpec

    return any(s.name == "fused" for s in make_plan(KernelSpec(**cases.SPECS[spec_name])).stages)


FUSED_MATRIX = tuple((n, c) for n, c in cases.MATRIX if _has_fused_stage(n))


@pytest.mark.parametrize(("spec_name", "case"), FUSED_MATRIX, ids=[f"{n}:{c.id}" for n, c in FUSED_MATRIX])
def test_fused_kernel(spec_name: str, case: cases.Case) -> None:
    kernel = cases.kernel_for(spec_name)
    assert any(s.name == "fused" for s in kernel.plan.stages), f"{spec_name}: the plan has no fused kernel"
    _check_against_reference(spec_name, case, SchedulePolicy(fused="on"))
    inp = cases.build_inputs(cases.SPECS[spec_name], case)
    o_f, ht_f = cases.run_kernel(kernel.with_policy(SchedulePolicy(fused="on")), inp, case.final)
    o_s, ht_s = cases.run_kernel(kernel.with_policy(SchedulePolicy(fused="off")), inp, case.final)
    torch.cuda.synchronize()
    assert torch.equal(o_f, o_s), "o: the fused kernel and the two-stage path differ"
    if case.final:
        assert torch.equal(ht_f, ht_s), "ht: the fused kernel and the two-stage path differ"


def test_fused_kernel_many_chains_per_cta() -> None:
    """The fused kernel's persistent grid with more chains than SMs: CTAs take several chains from the
    device counter, the ring running on across them, among them empty and length-1 sequences; engine padding
    past cu_seqlens[-1] reads o = 0. Against the reference, and bit for bit against the two-stage path."""
    spec = cases.SPECS["lb_safe"]
    lengths = [(i * 37) % 97 for i in range(160)]  # every length 0..96 (empty, 1, around 16-token steps)
    cu = (0, *torch.tensor(lengths).cumsum(0).tolist())
    case = cases.VL(tuple(cu), 2, init=True, seed=11)
    assert len(lengths) * 2 > 2 * torch.cuda.get_device_properties(0).multi_processor_count
    inp = cases.build_inputs(spec, case)
    padded = dict(inp)
    for name in ("q", "k", "v", "g", "beta"):
        t = inp[name]
        filler = torch.randn((1, 40, *t.shape[2:]), device=t.device).to(t.dtype)  # garbage, not zeros
        padded[name] = torch.cat([t, filler], dim=1)
    kernel = cases.kernel_for("lb_safe")
    o_f, ht_f = cases.run_kernel(kernel.with_policy(SchedulePolicy(fused="on")), padded, True)
    o_s, ht_s = cases.run_kernel(kernel.with_policy(SchedulePolicy(fused="off")), padded, True)
    torch.cuda.synchronize()
    assert torch.all(o_f[:, case.total :] == 0), "o past cu_seqlens[-1] must be exactly zero"
    ref_o, ref_ht = cases.run_reference(spec, inp, True)
    assert_close("o", ref_o, o_f[:, : case.total], TOL)
    assert_close("ht", ref_ht, ht_f, TOL)
    assert torch.equal(o_f, o_s), "o: the fused kernel and the two-stage path differ"
    assert torch.equal(ht_f, ht_s), "ht: the fused kernel and the two-stage path differ"


# The fused kernel's CTA-pair form (calls whose chains fill at most half the SMs): against the reference, and
# bit for bit against the one-CTA form (fused_pair="off") and the two-stage path, on specs that cover it
# (lb_safe: fp32 g, three prepare warps a CTA; the others four; lb_safe_logit: beta logits); the last case of
# each puts a pair on every SM of a 132-SM card (128 SMs at GVA 4).
PAIR_SPECS = ("lb_safe_gbf16", "lb_safe", "lb_safe_gva2_vk_bbf16_gbf16", "lb_safe_k64v128_nol2_bbf16_gbf16",
              "p_safe_gva4_l2_vk_gbf16", "lb_safe_logit", "lb_safe_sbf16")


def _pair_cases(g: int) -> tuple[cases.Case, ...]:
    # Value heads 4, 4, 4, 8, 16 and 66 (64 at GVA 4): q/k heads = value heads / g.
    return (cases.F(1, 1000, 4 // g, init=True), cases.VL(cases.CU_EDGE, 4 // g, init=True),
            cases.F(1, 1, 4 // g), cases.VL(cases.CU_5, 8 // g, init=True, seed=5),
            cases.F(2, 130, 16 // g, init=True, seed=7), cases.F(1, 333, 66 // g, seed=9))


PAIR_MATRIX = tuple((n, c) for n in PAIR_SPECS for c in _pair_cases(cases.SPECS[n]["gva_ratio"]))


@pytest.mark.parametrize(("spec_name", "case"), PAIR_MATRIX, ids=[f"{n}:{c.id}" for n, c in PAIR_MATRIX])
def test_fused_pair_form(spec_name: str, case: cases.Case) -> None:
    spec = cases.SPECS[spec_name]
    kernel = cases.kernel_for(spec_name)
    assert any(s.name == "fused_pair" for s in kernel.plan.stages), f"{spec_name}: no pair form in the plan"
    inp = cases.build_inputs(spec, case)
    nseq = case.B if case.cu is None else len(case.cu) - 1
    hv = inp["v"].shape[2]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if 2 * nseq * hv > sms:
        pytest.skip(f"{nseq * hv} chains need {2 * nseq * hv} CTAs for the pair form; this GPU has {sms} SMs")
    paired = kernel.with_policy(SchedulePolicy(fused="on", fused_pair="auto"))
    assert paired.schedule(nseq, case.total, hv, sms).fused_args[2] >= 1, "the call takes no pair form"
    o_p, ht_p = cases.run_kernel(paired, inp, True)
    o_1, ht_1 = cases.run_kernel(kernel.with_policy(SchedulePolicy(fused="on", fused_pair="off")), inp, True)
    o_s, ht_s = cases.run_kernel(kernel.with_policy(SchedulePolicy(fused="off")), inp, True)
    torch.cuda.synchronize()
    ref_o, ref_ht = cases.run_reference(spec, inp, True)
    assert_close("o", ref_o, o_p, TOL)
    assert_close("ht", ref_ht, ht_p, TOL)
    assert torch.equal(o_p, o_1) and torch.equal(ht_p, ht_1), "the pair form and the one-CTA form differ"
    assert torch.equal(o_p, o_s) and torch.equal(ht_p, ht_s), "the pair form and the two-stage path differ"


def _kernel_times_us(fn: Callable[[], Any]) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            for name in ("setup", "fused", "prepare", "recurrence"):
                if f"{name}_kernel" in ev.name:
                    times[name] = times.get(name, 0.0) + ev.time_range.elapsed_us()
    return times


def _fused_expected(lengths: tuple[int, ...], heads: int, kernel: Any) -> bool | None:
    """The setup kernel's rule for these lengths (`kdagen.policy.device_picks_fused`, its host mirror), or
    None when the host settles the call (kdagen.policy.fused_args: no fused launch)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    args = kernel.schedule(len(lengths), sum(lengths), heads, sms, SchedulePolicy()).fused_args
    if args[0] == 0:
        return None
    facts = PlanFacts.from_plan(kernel.spec, kernel.plan)
    return device_picks_fused(lengths, heads, sms, facts, args[2] if len(args) > 2 else 0)


# 128 chains of equal length (one full wave on 132 SMs); as many chains with one sequence doing most of the
# work; 64 chains (half the SMs: the CTA-pair form, taken); 64 chains of 256 tokens (the pair form declined).
@pytest.mark.parametrize("lengths", [(2048, 2048), (4000, 96), (2048,), (256,)])
def test_setup_kernel_chooses_the_path(lengths: tuple[int, ...]) -> None:
    """fused="auto": the setup kernel picks the path from the lengths on the device; the kernels of the
    other path exit at once. Which one did the work shows in the kernels' durations (the chosen path takes
    ~100x longer than an exiting grid at these sizes)."""
    spec = cases.SPECS["lb_safe_gbf16"]
    cu = (0, *torch.tensor(lengths).cumsum(0).tolist())
    inp = cases.build_inputs(spec, cases.VL(tuple(cu), 64, seed=3))
    kernel = cases.kernel_for("lb_safe_gbf16").with_policy(SchedulePolicy())
    fused = _fused_expected(lengths, 64, kernel)
    times = _kernel_times_us(lambda: cases.run_kernel(kernel, inp, True))
    if fused is None:  # the fused kernel is not even launched
        assert "fused" not in times, times
    elif fused:
        assert times["fused"] > 10 * max(times["prepare"], times["recurrence"]), times
    else:
        assert times["prepare"] > 10 * times["fused"], times
    ref_o, ref_ht = cases.run_reference(spec, inp, True)
    o, ht = cases.run_kernel(kernel, inp, True)
    assert_close("o", ref_o, o, TOL)
    assert_close("ht", ref_ht, ht, TOL)


def test_explicit_scale() -> None:
    spec = cases.SPECS["lb_safe"]
    case = cases.VL(cases.CU_EDGE, 2, init=True, seed=3)
    inp = cases.build_inputs(spec, case)
    o, ht = cases.run_kernel(cases.kernel_for("lb_safe"), inp, True, scale=0.3)
    ref_o, ref_ht = cases.run_reference(spec, inp, True, scale=0.3)
    assert_close("o", ref_o, o, TOL)
    assert_close("ht", ref_ht, ht, TOL)


def test_padding_tokens_past_cu_seqlens_are_zero() -> None:
    """Engines pad packed batches: tokens past cu_seqlens[-1] belong to no sequence and must read o = 0."""
    spec = cases.SPECS["lb_safe"]
    case = cases.VL((0, 100, 250), 2, init=True, seed=5)
    inp = cases.build_inputs(spec, case)
    pad = 50
    padded = dict(inp)
    for name in ("q", "k", "v", "g", "beta"):
        t = inp[name]
        filler = torch.randn((1, pad, *t.shape[2:]), device=t.device).to(t.dtype)  # garbage, not zeros
        padded[name] = torch.cat([t, filler], dim=1)
    o, ht = cases.run_kernel(cases.kernel_for("lb_safe"), padded, True)
    ref_o, ref_ht = cases.run_reference(spec, inp, True)
    assert torch.all(o[:, case.total :] == 0), "o past cu_seqlens[-1] must be exactly zero"
    assert_close("o", ref_o, o[:, : case.total], TOL)
    assert_close("ht", ref_ht, ht, TOL)


def test_empty_inputs_launch_nothing_and_pass_the_state_through() -> None:
    """Zero tokens: o is empty, the final state is the initial one (zeros without one); zero sequences too."""
    inp = _valid_inputs()
    kernel = cases.kernel_for("lb_safe")
    empty = {n: (t[:, :0] if n in ("q", "k", "v", "g", "beta") else t) for n, t in inp.items()}
    empty["cu_seqlens"] = torch.zeros(3, dtype=torch.int32, device="cuda")  # two empty sequences
    o, ht = cases.run_kernel(kernel, empty, True)
    assert o.shape == (1, 0, *inp["v"].shape[2:]) and o.dtype == inp["v"].dtype
    assert torch.equal(ht, inp["initial_state"])
    empty["initial_state"] = None
    _, ht = cases.run_kernel(kernel, empty, True)
    assert ht.shape == inp["initial_state"].shape and not ht.any()
    empty["cu_seqlens"] = torch.zeros(1, dtype=torch.int32, device="cuda")  # no sequences at all
    _, ht = cases.run_kernel(kernel, empty, True)
    assert ht.shape == (0, *inp["initial_state"].shape[1:])


# Intra-card context parallelism: forced with short segments (intracard_cp=<tokens>) so that small
# inputs exercise segment maps, merges across many segments, segments that end mid-tile, empty sequences
# and the final state of the last segment; and once in "auto", where a long sequence with one head picks it.
CP_CASES = [
    ("lb_safe", cases.F(2, 1000, 2, init=True), 256),
    ("lb_safe", cases.VL((0, 0, 1, 64, 65, 130, 700), 2, init=True), 64),
    ("p_reset_vk_bbf16", cases.VL((0, 15, 100, 300, 1200), 2, init=True, mask_p=0.3, hard_reset=True), 128),
    ("softplus", cases.F(1, 777, 1, init=True, mask_p=0.2, hard_reset=True), 48),
    ("lb_safe_gva2_vk_bbf16", cases.F(1, 2048, 2, init=False), 512),
    ("lb_safe_gva4_k64v64", cases.F(1, 1500, 1, init=True), 160),
    ("lb_safe", cases.F(1, 8192, 1, init=True), "auto"),
]


@pytest.mark.parametrize(
    ("spec_name", "case", "seg"), CP_CASES, ids=[f"{n}:{c.id}:cp{s}" for n, c, s in CP_CASES]
)
def test_intracard_cp(spec_name: str, case: cases.Case, seg: int | str) -> None:
    _check_against_reference(spec_name, case, SchedulePolicy(intracard_cp=seg))


# Longest-first recurrence, forced on small inputs (seq_order="length"): the order stage ranks the
# sequences by length on the device and grid slice z of the recurrence runs the z-th longest. Ties, empty
# and length-1 sequences, the longest last. Each (sequence, head, V-slice) is computed the same way wherever
# its CTA sits in the grid, so the results must equal those of the input order bit for bit, in both families.
ORDER_CASES = [
    ("lb_safe", cases.VL((0, 5, 5, 70, 70, 135, 1200), 2, init=True)),
    ("p_reset_vk_bbf16", cases.VL((0, 1, 17, 33, 900), 2, init=True, mask_p=0.3, hard_reset=True)),
]


@pytest.mark.parametrize("family", ["wgmma", "mma_sync"])
@pytest.mark.parametrize(("spec_name", "case"), ORDER_CASES, ids=[f"{n}:{c.id}" for n, c in ORDER_CASES])
def test_longest_first_order(spec_name: str, case: cases.Case, family: str) -> None:
    import kdagen

    spec = {**cases.SPECS[spec_name], "family": family}
    kernel = kdagen.get_kernel(spec)
    inp = cases.build_inputs(spec, case)
    outs = {}
    for order in ("input", "length"):
        outs[order] = cases.run_kernel(kernel.with_policy(SchedulePolicy(seq_order=order)), inp, True)
    torch.cuda.synchronize()
    ref_o, ref_ht = cases.run_reference(spec, inp, True)
    o, ht = outs["length"]
    assert_close("o (longest first)", ref_o, o, TOL)
    assert_close("ht (longest first)", ref_ht, ht, TOL)
    assert torch.equal(o, outs["input"][0]), "o: longest-first and input order differ"
    assert torch.equal(ht, outs["input"][1]), "ht: longest-first and input order differ"


# ---------------------------------------------------------------------------------------------------------
# CUDA graphs
# ---------------------------------------------------------------------------------------------------------


def _capture(kernel: Any, static: dict[str, Any]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]:
    # Warm up on a side stream first (lazy module loads, allocator pools), as torch.cuda.graph requires.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            cases.run_kernel(kernel, static, True)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, ht = cases.run_kernel(kernel, static, True)
    return graph, o, ht


def test_cuda_graph_replay_with_new_inputs() -> None:
    spec = cases.SPECS["lb_safe"]
    kernel = cases.kernel_for("lb_safe")
    case = cases.VL((0, 15, 100, 300, 301, 512), 2, init=True)
    static = cases.build_inputs(spec, case)
    graph, o, ht = _capture(kernel, static)
    for seed in (101, 202):
        cases.copy_into(static, cases.build_inputs(spec, cases.with_seed(case, seed)))
        graph.replay()
        torch.cuda.synchronize()
        ref_o, ref_ht = cases.run_reference(spec, static)
        assert_close(f"o (replay seed {seed})", ref_o, o, TOL)
        assert_close(f"ht (replay seed {seed})", ref_ht, ht, TOL)


def test_cuda_graph_replay_rechooses_the_fused_path() -> None:
    """fused="auto" under a captured graph: the setup kernel picks the path from cu_seqlens at every
    replay (two equal sequences: the fused kernel; one long and one short: the two-stage path), and both
    replays match the reference."""
    spec = cases.SPECS["lb_safe_gbf16"]
    kernel = cases.kernel_for("lb_safe_gbf16").with_policy(SchedulePolicy())
    case = cases.VL((0, 1024, 2048), 64, init=True)
    static = cases.build_inputs(spec, case)
    graph, o, ht = _capture(kernel, static)
    for cu in ((0, 1024, 2048), (0, 2000, 2048)):
        expected = _fused_expected(tuple(b - a for a, b in zip(cu, cu[1:])), 64, kernel)
        assert expected is not None
        cases.copy_into(static, cases.build_inputs(spec, replace(case, cu=cu, seed=11)))
        times = _kernel_times_us(graph.replay)
        if expected:
            assert times["fused"] > 10 * times["prepare"], (cu, times)
        else:
            assert times["prepare"] > 10 * times["fused"], (cu, times)
        ref_o, ref_ht = cases.run_reference(spec, static)
        assert_close(f"o (replay, cu {cu})", ref_o, o, TOL)
        assert_close(f"ht (replay, cu {cu})", ref_ht, ht, TOL)


@pytest.mark.parametrize("order", ["auto", "length"])
def test_cuda_graph_replay_with_new_cu_seqlens(order: str) -> None:
    """Same N and total tokens, different boundaries: nothing may be derived from cu_seqlens on the host (with
    `length`, the longest-first order is recomputed on the device at every replay)."""
    spec = cases.SPECS["lb_safe_gva2_vk_bbf16"]
    kernel = cases.kernel_for("lb_safe_gva2_vk_bbf16").with_policy(SchedulePolicy(seq_order=order))
    case = cases.VL((0, 15, 100, 300, 301, 512), 2, init=True)
    static = cases.build_inputs(spec, case)
    graph, o, ht = _capture(kernel, static)
    new_cu = (0, 1, 200, 201, 400, 512)  # length-1 sequences and a chunk-crossing long one
    cases.copy_into(static, cases.build_inputs(spec, replace(case, cu=new_cu, seed=7)))
    assert static["cu_seqlens"].tolist() == list(new_cu)
    graph.replay()
    torch.cuda.synchronize()
    ref_o, ref_ht = cases.run_reference(spec, static)
    assert_close("o (replay, new cu_seqlens)", ref_o, o, TOL)
    assert_close("ht (replay, new cu_seqlens)", ref_ht, ht, TOL)


# ---------------------------------------------------------------------------------------------------------
# cu_seqlens out of range on the GPU: clamped on the device, the call ends
# ---------------------------------------------------------------------------------------------------------

_BAD_CU_SNIPPET = """
import json, sys
import torch
import kdagen
from kdagen.reference import make_inputs

spec = json.loads(sys.argv[1])
kernel = kdagen.get_kernel(spec)
T, H = 1024, 2
inp = make_inputs(1, T, H, H * spec["gva_ratio"], spec["head_dim_k"], spec["head_dim_v"], dtype=spec["dtype"],
                  beta_dtype=spec["beta_dtype"], g_dtype=spec["g_dtype"], gate=spec["gate"],
                  safe_gate=spec["safe_gate"], lower_bound=spec["lower_bound"], seed=3, device="cuda",
                  l2norm_qk=spec["l2norm_qk"], cu_seqlens=[0, 500, T], with_initial_state=True,
                  state_layout=spec["state_layout"])

def call(cu):
    cu = torch.tensor(cu, dtype=torch.int32, device="cuda")
    o, ht = kernel(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], A_log=inp["A_log"],
                   dt_bias=inp["dt_bias"], initial_state=inp["initial_state"], output_final_state=True,
                   cu_seqlens=cu)
    torch.cuda.synchronize()
    return o, ht

# (bad offsets, the valid offsets they clamp to: [0, T] on the device)
for bad, valid in (([0, 500, 5000], [0, 500, T]), ([0, 2**30, T], [0, T, T]), ([0, -64, T], [0, 0, T]),
                   ([-7, 300, T + 16], [0, 300, T])):
    o, ht = call(bad)
    o_ref, ht_ref = call(valid)
    same = torch.equal(o, o_ref) and torch.equal(ht, ht_ref)
    print("CASE", bad, "ended; same as", valid, ":", same, flush=True)
    assert same, f"cu_seqlens={bad}: results differ from those of {valid}"
print("DONE")
"""

_BAD_CU_RUNS = [
    ("wgmma fused, CTA pairs", {**cases.SPECS["lb_safe"], "family": "wgmma"}, {"KDAGEN_FUSED": "on"}),
    ("wgmma fused, one CTA a chain", {**cases.SPECS["lb_safe"], "family": "wgmma"},
     {"KDAGEN_FUSED": "on", "KDAGEN_FUSED_PAIR": "off"}),
    ("wgmma two-stage", {**cases.SPECS["lb_safe"], "family": "wgmma"}, {"KDAGEN_FUSED": "off"}),
    ("mma_sync", {**cases.SPECS["lb_safe"], "family": "mma_sync"}, {}),
    ("non-safe gate", cases.SPECS["p_reset_vk_bbf16"], {}),
    ("intra-card CP", {**cases.SPECS["lb_safe"], "family": "wgmma"}, {"KDAGEN_INTRACARD_CP": "256"}),
]


@pytest.mark.parametrize(("label", "spec", "env"), _BAD_CU_RUNS, ids=[r[0] for r in _BAD_CU_RUNS])
def test_out_of_range_device_cu_seqlens_end_the_call(label: str, spec: dict[str, Any], env: dict[str, str]):
    """cu_seqlens on the GPU are not read on the host (no synchronisation), so values past the tokens or below
    zero reach the kernels. They clamp every offset into [0, T]: the call ends, neither hanging on a tile no
    prepare CTA makes nor faulting, with the results of the clamped offsets. Run in a child process, so that
    a hang or a dead CUDA context fails this test instead of the session."""
    import kdagen

    kdagen.get_kernel(dict(spec))  # built (or found) here, so the child only loads it
    try:
        res = subprocess.run([sys.executable, "-c", _BAD_CU_SNIPPET, json.dumps(spec)],
                             env=_subprocess_env(**env), capture_output=True, text=True, timeout=300,
                             cwd=REPO_ROOT)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{label}: the call did not end in 300 s (a hang); output so far: {e.stdout!r}")
    assert res.returncode == 0 and "DONE" in res.stdout, f"{label}: {res.stdout}\n{res.stderr[-3000:]}"
    print(res.stdout.strip())


# ---------------------------------------------------------------------------------------------------------
# prebuilt artifacts: KDAGEN_DISABLE_JIT
# ---------------------------------------------------------------------------------------------------------


def _subprocess_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env


_LOAD_SNIPPET = """
import json, time
import torch
import kdagen
from kdagen.reference import make_inputs

spec = json.loads({spec_json!r})
t0 = time.perf_counter()
kernel = kdagen.get_kernel(spec)
load_ms = (time.perf_counter() - t0) * 1e3
inp = make_inputs(1, 100, 2, 2, 128, 128, dtype="bf16", beta_dtype="fp32", g_dtype="fp32",
                  gate="lower_bound", safe_gate=True, lower_bound=-5.0, seed=0, device="cuda",
                  cu_seqlens=[0, 1, 100], with_initial_state=True)
o, ht = kernel(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], A_log=inp["A_log"],
               dt_bias=inp["dt_bias"], initial_state=inp["initial_state"], output_final_state=True,
               cu_seqlens=inp["cu_seqlens"])
torch.cuda.synchronize()
assert torch.isfinite(o.float()).all() and torch.isfinite(ht).all()
print(f"kdagen: loaded {{kernel!r}} from the cache in {{load_ms:.1f}} ms (KDAGEN_DISABLE_JIT=1)")
"""


def test_fresh_process_loads_from_cache_without_jit() -> None:
    spec = cases.SPECS["lb_safe"]
    cases.kernel_for("lb_safe")  # builds into the cache if this session has not yet
    code = _LOAD_SNIPPET.format(spec_json=json.dumps(spec))
    res = subprocess.run([sys.executable, "-c", code], env=_subprocess_env(KDAGEN_DISABLE_JIT="1"),
                         capture_output=True, text=True, timeout=600, cwd=REPO_ROOT)
    assert res.returncode == 0, f"fresh process failed (stdout: {res.stdout!r})\n{res.stderr}"
    match = re.search(r"from the cache in ([0-9.]+) ms", res.stdout)
    assert match, res.stdout
    print(res.stdout.strip())


def test_cache_miss_raises_under_disable_jit(tmp_path: Path) -> None:
    from kdagen.spec import KernelSpec

    spec = cases.SPECS["lb_safe"]
    code = textwrap.dedent(f"""
        import json, kdagen
        from kdagen.errors import CacheMissError
        try:
            kdagen.get_kernel(json.loads({json.dumps(spec)!r}))
        except CacheMissError as e:
            print("CacheMissError:", e)
        else:
            raise SystemExit("no CacheMissError for a spec absent from an empty cache")
    """)
    env = _subprocess_env(KDAGEN_DISABLE_JIT="1", KDAGEN_CACHE_DIR=str(tmp_path / "empty-cache"),
                          KDAGEN_GENERATED_DIR=str(tmp_path / "generated"))
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                         cwd=REPO_ROOT)
    assert res.returncode == 0, f"stdout: {res.stdout!r}\n{res.stderr}"
    assert res.stdout.startswith("CacheMissError:"), res.stdout
    slug = KernelSpec(**spec).slug()
    assert slug in res.stdout, f"the CacheMissError message should name the spec ({slug}): {res.stdout!r}"


# ---------------------------------------------------------------------------------------------------------
# input validation: InputError naming the argument
# ---------------------------------------------------------------------------------------------------------


def _valid_inputs(spec_name: str = "lb_safe") -> dict[str, Any]:
    # K = V = 128 and N = 2 sequences; the spec's layout is kv.
    return cases.build_inputs(cases.SPECS[spec_name], cases.VL((0, 20, 64), 2, init=True))


def _bad_cu(values: list[int], device: str = "cpu") -> Callable[[dict[str, Any]], None]:
    # Values are only checked when cu_seqlens lives on the CPU: reading device values would synchronise
    # (kdagen/runtime.py contract), so these cases pass a host tensor.
    def mutate(inp: dict[str, Any]) -> None:
        inp["cu_seqlens"] = torch.tensor(values, dtype=torch.int32, device=device)
        inp["initial_state"] = None  # N may change with the values: keep the error about cu_seqlens alone

    return mutate


def _set(name: str, make: Callable[[dict[str, Any]], Any]) -> Callable[[dict[str, Any]], None]:
    def mutate(inp: dict[str, Any]) -> None:
        inp[name] = make(inp)

    return mutate


def _batch2(inp: dict[str, Any]) -> None:
    for n in ("q", "k", "v", "g", "beta"):
        inp[n] = torch.cat([inp[n], inp[n]], dim=0)


def _hv3(inp: dict[str, Any]) -> None:  # HV = 3 with H = 2 (and gva_ratio 1)
    for n in ("v", "g", "beta"):
        x = inp[n]
        inp[n] = torch.cat([x, x[:, :, :1]], dim=2)
    inp["A_log"] = torch.cat([inp["A_log"], inp["A_log"][:1]])
    inp["dt_bias"] = torch.cat([inp["dt_bias"], inp["dt_bias"][:128]])
    inp["initial_state"] = None


def _head_dim_64(names: tuple[str, ...]) -> Callable[[dict[str, Any]], None]:
    def mutate(inp: dict[str, Any]) -> None:
        for n in names:
            inp[n] = inp[n][..., :64].contiguous()

    return mutate


# (id, mutation of valid inputs, argument names of which at least one must appear in the message)
BAD_INPUTS: tuple[tuple[str, Callable[[dict[str, Any]], None], tuple[str, ...]], ...] = (
    ("q-dtype-fp16", _set("q", lambda i: i["q"].half()), ("q",)),
    ("k-shape", _set("k", lambda i: i["k"][:, :-1].contiguous()), ("k",)),
    ("v-dtype-fp32", _set("v", lambda i: i["v"].float()), ("v",)),
    ("g-on-cpu", _set("g", lambda i: i["g"].cpu()), ("g",)),
    ("q-on-cpu", _set("q", lambda i: i["q"].cpu()), ("q",)),
    ("beta-dtype-bf16", _set("beta", lambda i: i["beta"].bfloat16()), ("beta",)),
    ("beta-shape", _set("beta", lambda i: i["beta"][..., None].contiguous()), ("beta",)),
    ("cu-non-monotonic", _bad_cu([0, 40, 20, 64]), ("cu_seqlens",)),
    ("cu-not-starting-at-0", _bad_cu([5, 20, 64]), ("cu_seqlens",)),
    ("cu-float", _set("cu_seqlens", lambda i: i["cu_seqlens"].float()), ("cu_seqlens",)),
    ("cu-with-batch-2", _batch2, ("cu_seqlens", "q", "B")),
    ("hv-not-multiple-of-h", _hv3, ("v", "HV")),
    ("head-dim-k-64", _head_dim_64(("q", "k", "g")), ("q", "k")),
    ("head-dim-v-64", _head_dim_64(("v",)), ("v",)),
    ("h0-dtype-bf16", _set("initial_state", lambda i: i["initial_state"].bfloat16()), ("initial_state",)),
    ("h0-shape-n", _set("initial_state", lambda i: i["initial_state"][:1].contiguous()), ("initial_state",)),
    ("h0-shape-v", _set("initial_state", lambda i: i["initial_state"][..., :64].contiguous()),
     ("initial_state",)),
    ("A_log-shape", _set("A_log", lambda i: i["A_log"][:1].contiguous()), ("A_log",)),
)


def _names_argument(message: str, names: tuple[str, ...]) -> bool:
    return any(re.search(rf"(?<![A-Za-z0-9_]){re.escape(n)}(?![A-Za-z0-9_])", message) for n in names)


@pytest.mark.parametrize(
    ("mutate", "names"), [(m, n) for _, m, n in BAD_INPUTS], ids=[b[0] for b in BAD_INPUTS]
)
def test_bad_input_raises_input_error(
    mutate: Callable[[dict[str, Any]], None], names: tuple[str, ...]
) -> None:
    from kdagen.errors import InputError

    kernel = cases.kernel_for("lb_safe")
    # A valid call first, with cu_seqlens on the GPU, so that its signature is in the kernel's validated
    # set: the mutated call below must still be checked in full.
    valid = _valid_inputs()
    valid["cu_seqlens"] = valid["cu_seqlens"].cuda()
    cases.run_kernel(kernel, valid, True)
    inp = _valid_inputs()
    mutate(inp)
    with pytest.raises(InputError) as err:
        cases.run_kernel(kernel, inp, True)
    assert _names_argument(str(err.value), names), f"message should name one of {names}: {err.value}"


def test_repeated_signature_skips_checks_but_not_results() -> None:
    """A second call with the same argument properties takes the validated fast path (the first one put its
    signature in the kernel's set) and computes the same result."""
    kernel = cases.kernel_for("lb_safe")
    inp = _valid_inputs()
    inp["cu_seqlens"] = inp["cu_seqlens"].cuda()
    first = cases.run_kernel(kernel, inp, True)
    assert len(kernel._validated) >= 1
    second = cases.run_kernel(kernel, inp, True)
    torch.cuda.synchronize()
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


def test_gva_ratio_mismatch_raises_input_error() -> None:
    """A GVA-2 kernel called with HV == H."""
    from kdagen.errors import InputError

    kernel = cases.kernel_for("lb_safe_gva2_vk_bbf16")
    inp = cases.build_inputs(cases.SPECS["lb_safe"], cases.VL((0, 20, 64), 2))
    inp["beta"] = inp["beta"].bfloat16()
    with pytest.raises(InputError) as err:
        cases.run_kernel(kernel, inp, True)
    assert _names_argument(str(err.value), ("v", "HV", "gva_ratio")), str(err.value)


def test_valid_inputs_pass() -> None:
    """The unmodified inputs of the validation tests are accepted: each failure above is the mutation's."""
    o, ht = cases.run_kernel(cases.kernel_for("lb_safe"), _valid_inputs(), True)
    torch.cuda.synchronize()
    assert torch.isfinite(o.float()).all() and ht is not None


# ---------------------------------------------------------------------------------------------------------
# Large calls
# ---------------------------------------------------------------------------------------------------------


def test_workspace_past_2_gib_matches_the_sequence_alone() -> None:
    """A call whose workspace exceeds 2 GiB (a flat byte tensor would not pass TVM-FFI's int32 shape check):
    its last, short sequence equals the same sequence run alone, bit for bit (a sequence's result does not
    depend on the others in the call). 65536 tokens x 64 heads: ~3.6 GB of workspace, ~9 GB in all."""
    from kdagen import workspace
    from kdagen.reference import make_inputs

    spec = cases.SPECS["lb_safe_gbf16"]
    kernel = cases.kernel_for("lb_safe_gbf16")
    heads, dim, lens = 64, 128, (65472, 64)
    total = sum(lens)
    ws = workspace.layout(total, heads, len(lens), dim, 2)
    assert ws.size > 2**31
    inp = make_inputs(
        1, total, heads, heads, dim, dim, dtype=spec["dtype"], beta_dtype=spec["beta_dtype"],
        g_dtype=spec["g_dtype"], gate=spec["gate"], safe_gate=spec["safe_gate"],
        lower_bound=spec["lower_bound"], l2norm_qk=spec["l2norm_qk"], seed=7, device="cuda",
        cu_seqlens=[0, lens[0], total],
    )
    q, k, v, g, beta, cu = (inp[n] for n in ("q", "k", "v", "g", "beta", "cu_seqlens"))
    kw = {"A_log": inp["A_log"], "dt_bias": inp["dt_bias"], "output_final_state": True}
    o, ht = kernel(q, k, v, g, beta, cu_seqlens=cu, **kw)
    s = lens[0]
    alone = [x[:, s:].contiguous() for x in (q, k, v, g, beta)]
    o1, ht1 = kernel(*alone, cu_seqlens=torch.tensor([0, lens[1]], dtype=torch.int32, device="cuda"), **kw)
    torch.cuda.synchronize()
    assert torch.isfinite(o1.float()).all() and o1.float().abs().max() > 0
    assert torch.equal(o[:, s:], o1), "o of the last sequence differs from the sequence alone"
    assert torch.equal(ht[1], ht1[0]), "final state of the last sequence differs from the sequence alone"
