"""Planner choices that the runtime and templates rely on (CPU only): family per target, which template each
stage of a family uses, and the prepare-beside-recurrence parameters (the run-time scheduling decisions are
tested in tests/test_policy.py)."""

from __future__ import annotations

import pytest

from kdagen.arch import get_arch
from kdagen.plan import (
    BWD_GRADS_MIN_REGS,
    BWD_STATE_TILES,
    DECODE_STREAM_MAX_STAGES,
    _prepare_warp_smem,
    bwd_state_tiles,
    make_plan,
)
from kdagen.spec import KernelSpec


def _templates(spec: KernelSpec) -> dict[str, str]:
    return {s.name: s.template for s in make_plan(spec).stages}


def test_sm90a_auto_is_wgmma_with_shared_stages():
    plan = make_plan(KernelSpec(arch="sm_90a"))
    assert plan.family == "wgmma"
    assert "mma_sync" in plan.reason  # says what the shared stages are
    assert _templates(KernelSpec(arch="sm_90a")) == {
        "prepare": "mma_sync/prepare.py.j2",
        "recurrence": "wgmma/recurrence.py.j2",
        "fused": "wgmma/fused.py.j2",
        "fused_pair": "wgmma/fused.py.j2",
        "forward": "common/forward.py.j2",
        "cp_prescan": "mma_sync/recurrence.py.j2",
        "cp_merge": "mma_sync/cp_merge.py.j2",
        "cp_segments": "mma_sync/recurrence.py.j2",
        "decode": "common/decode.py.j2",
        "decode_stream": "common/decode_stream.py.j2",
        "bwd_prepare": "mma_sync/bwd_prepare.py.j2",
        "bwd_recurrence": "wgmma/recurrence.py.j2",
        "bwd_states": "common/bwd_states.py.j2",
        "bwd_scan": "mma_sync/bwd_scan.py.j2",
        "bwd_cp_prescan": "mma_sync/bwd_scan.py.j2",
        "bwd_cp_merge": "mma_sync/cp_merge.py.j2",
        "bwd_cp_segments": "mma_sync/bwd_scan.py.j2",
        "bwd_tile": "mma_sync/bwd_tile.py.j2",
        "bwd_grads": "common/bwd_grads.py.j2",
    }


def test_summary_and_stage_notes():
    # `kdagen list` shows the summary in a line and the notes behind --why; neither is rendered.
    plan = make_plan(KernelSpec(arch="sm_90a"))
    assert plan.summary == (
        "the faster recurrence on Hopper; fused kernel when the chains fill the SMs, CTA pairs at half"
    )
    assert all(s.note for s in plan.stages)
    assert make_plan(KernelSpec(arch="sm_90a", family="mma_sync")).summary == "requested in the spec"
    sm80 = make_plan(KernelSpec(arch="sm_80"))
    assert sm80.summary == "the only family for sm_80"
    notes = {s.name: s.note for s in sm80.stages}
    assert "beside" not in notes["prepare"] and notes["forward"].endswith("the recurrence after it")  # no PDL


@pytest.mark.parametrize("arch", ["sm_80", "sm_89", "sm_100a"])
def test_other_targets_are_mma_sync(arch: str):
    plan = make_plan(KernelSpec(arch=arch))
    assert plan.family == "mma_sync"
    templates = _templates(KernelSpec(arch=arch))
    assert templates.pop("forward") == "common/forward.py.j2"
    assert templates.pop("decode") == "common/decode.py.j2"
    # the streaming decode needs bulk copies: sm_100a has them, sm_80 and sm_89 do not
    stream = templates.pop("decode_stream", None)
    assert stream == ("common/decode_stream.py.j2" if arch == "sm_100a" else None)
    assert templates.pop("bwd_grads") == "common/bwd_grads.py.j2"
    assert templates.pop("bwd_states") == "common/bwd_states.py.j2"  # an entry over the recurrence
    assert all(t.startswith("mma_sync/") for t in templates.values())


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_recurrence_is_compiled_into_forward_only(arch: str):
    # The whole-sequence path is one launch (`forward` imports the variant's prepare and recurrence modules);
    # prepare stays a stage of its own for the intra-card CP path.
    plan = make_plan(KernelSpec(arch=arch))
    names = [s.name for s in plan.stages]
    imported = ("prepare", "recurrence", "fused")
    assert names.index("forward") > max(names.index(n) for n in imported if n in names)
    if "bwd_recurrence" in names:  # `bwd_states` imports it
        assert names.index("bwd_states") > names.index("bwd_recurrence")
    stream = ["decode_stream"] if arch == "sm_90a" else []
    assert plan.stage_names == ["prepare", "forward", "cp_prescan", "cp_merge", "cp_segments", "decode",
                                *stream, "bwd_prepare", "bwd_states", "bwd_scan", "bwd_cp_prescan",
                                "bwd_cp_merge", "bwd_cp_segments", "bwd_tile", "bwd_grads"]


@pytest.mark.parametrize(
    ("arch", "family", "safe_gate", "fused"),
    [("sm_90a", "auto", True, True), ("sm_90a", "wgmma", True, True), ("sm_90a", "auto", False, False),
     ("sm_90a", "mma_sync", True, False), ("sm_80", "auto", True, False), ("sm_100a", "auto", True, False)],
)
def test_fused_kernel_only_for_wgmma_with_the_safe_gate(arch: str, family: str, safe_gate: bool, fused: bool):
    # The fused prepare + recurrence kernel is compiled into `forward` (never a stage of its own), and the
    # stages that must agree on the mode word (forward's setup kernel, prepare, the recurrence) all know it.
    spec = KernelSpec(arch=arch, family=family, safe_gate=safe_gate,
                      **({} if safe_gate else {"gate": "softplus", "lower_bound": None}))
    plan = make_plan(spec)
    params = {s.name: s.params for s in plan.stages}
    assert ("fused" in params) is fused
    assert "fused" not in plan.stage_names
    assert params["forward"]["fused"] is fused
    assert params["prepare"]["fused"] is fused
    assert params["recurrence"]["fused"] is fused
    assert ("fused prepare + recurrence kernel" in plan.reason) is fused
    if fused:
        f = params["fused"]
        assert f["stages"] >= f["prep_warps"]  # a stage's empty barrier is never two phases behind


@pytest.mark.parametrize("g_dtype", ["bf16", "fp32"])
@pytest.mark.parametrize(("head_dim_k", "head_dim_v"), [(64, 64), (64, 128), (128, 64), (128, 128)])
def test_fused_kernel_fits_one_cta_per_sm(head_dim_k: int, head_dim_v: int, g_dtype: str):
    # Every safe-gate wgmma spec gets the fused kernel: its CTA (ring and prepare tiles) fits sm_90a's
    # shared memory at every head-dim pair and g dtype (the largest, K=V=128 with fp32 g, ~190 KB).
    from kdagen.plan import _fused_smem_bytes

    spec = KernelSpec(arch="sm_90a", head_dim_k=head_dim_k, head_dim_v=head_dim_v, g_dtype=g_dtype)
    assert _fused_smem_bytes(spec) <= get_arch("sm_90a").smem_bytes_per_block
    assert any(s.name == "fused" for s in make_plan(spec).stages)


@pytest.mark.parametrize(
    ("overrides", "warps"),
    [({}, 4),
     ({"head_dim_k": 64}, 4),
     ({"state_layout": "vk", "gva_ratio": 4}, 4),
     ({"g_dtype": "fp32"}, 3),  # fp32 g tiles: three prepare warps a CTA leave room for the 8-stage ring
     ({"g_dtype": "fp32", "head_dim_k": 64}, 4),
     ({"head_dim_v": 64}, None),  # one block of value rows: nothing to split between two CTAs
     ({"family": "mma_sync"}, None),
     ({"gate": "softplus", "lower_bound": None, "safe_gate": False}, None)],  # no fused kernel at all
)
def test_fused_pair_form_in_the_plan(overrides: dict, warps: int | None):
    # The CTA-pair form of the fused kernel is a second module compiled into `forward` (the runtime picks it
    # per call), with two CTAs' prepare warps sharing one ring: one stage for each of them at least, and an
    # even depth so that every stage is made by the same CTA.
    from kdagen.plan import _fused_smem_bytes

    spec = KernelSpec(**{"arch": "sm_90a", "g_dtype": "bf16", **overrides})
    plan = make_plan(spec)
    params = {s.name: s.params for s in plan.stages}
    pair = warps is not None
    assert ("fused_pair" in params) is pair
    assert "fused_pair" not in plan.stage_names
    assert params["forward"]["fused_pair"] is pair
    assert ("in CTA pairs" in plan.reason) is pair
    if pair:
        f = params["fused_pair"]
        assert f["pair"] is True and params["fused"]["pair"] is False
        assert f["prep_warps"] == warps and params["fused"]["prep_warps"] == 4
        assert f["stages"] >= 2 * f["prep_warps"] and f["stages"] % 2 == 0
        smem = _fused_smem_bytes(spec, f["stages"], f["prep_warps"])
        assert smem <= get_arch("sm_90a").smem_bytes_per_block


def test_mma_sync_selectable_on_sm90a():
    spec = KernelSpec(arch="sm_90a", family="mma_sync")
    assert make_plan(spec).family == "mma_sync"
    assert _templates(spec)["recurrence"] == "mma_sync/recurrence.py.j2"


@pytest.mark.parametrize(("arch", "pdl"), [("sm_80", False), ("sm_90a", True), ("sm_100a", True)])
def test_prepare_leaves_room_for_the_recurrence_only_with_pdl(arch: str, pdl: bool):
    plan = make_plan(KernelSpec(arch=arch, family="mma_sync"))
    prep = next(s for s in plan.stages if s.name == "prepare").params
    rec = next(s for s in plan.stages if s.name == "recurrence").params
    assert prep["pdl"] is pdl and rec["pdl"] is pdl
    if pdl:  # registers for one CTA more than shared memory allows; one CTA fewer beside the recurrence
        assert prep["min_ctas_per_sm"] == prep["ctas_per_sm"] + 1
        assert prep["overlap_ctas_per_sm"] == max(1, prep["ctas_per_sm"] - 1)  # mma_sync on these targets
    else:
        assert prep["min_ctas_per_sm"] == prep["ctas_per_sm"] == prep["overlap_ctas_per_sm"]


@pytest.mark.parametrize(("family", "beside"), [("mma_sync", 3), ("wgmma", 2)])
def test_prepare_beside_the_recurrence_fits_its_busiest_subpartition(family: str, beside: int):
    # Four prepare CTAs fit an SM alone (K=128, safe gate); beside one recurrence CTA, the sub-partition that
    # holds two of the wgmma recurrence's five warps has room for two prepare warps only (H200 timeline of
    # 2026-11-26: with three, the recurrence started only when prepare had ended).
    prep = next(s for s in make_plan(KernelSpec(arch="sm_90a", family=family)).stages if s.name == "prepare")
    assert prep.params["ctas_per_sm"] == 4
    assert prep.params["overlap_ctas_per_sm"] == beside


@pytest.mark.parametrize("arch", ["sm_80", "sm_89", "sm_90a", "sm_100a"])
@pytest.mark.parametrize("gate", ["softplus", "precomputed"])
def test_prepare_without_the_safe_gate_takes_the_most_warps_its_shared_memory_allows(arch: str, gate: str):
    # The anchored path keeps its products in registers: a warp takes the safe gate's shared memory, so on
    # sm_90a and sm_100a both gates get the same layout (four heads, four CTAs, two beside the wgmma
    # recurrence). Where four heads a CTA leave an SM fewer warps (sm_80, sm_89), the non-safe variants take
    # the heads a CTA that give the most; those CTAs then keep the SM (the count beside the recurrence equals
    # the count alone).
    spec = KernelSpec(arch=arch, gate=gate, safe_gate=False, lower_bound=None)
    assert _prepare_warp_smem(spec) == _prepare_warp_smem(KernelSpec(arch=arch))
    prep = next(s for s in make_plan(spec).stages if s.name == "prepare").params
    safe = next(s for s in make_plan(KernelSpec(arch=arch)).stages if s.name == "prepare").params
    assert safe["heads_per_cta"] == 4
    assert safe["ctas_per_sm"] == {"sm_80": 2, "sm_89": 1, "sm_90a": 4, "sm_100a": 4}[arch]  # as before
    layout = (prep["heads_per_cta"], prep["ctas_per_sm"])
    assert layout == {"sm_80": (1, 11), "sm_89": (2, 3), "sm_90a": (4, 4), "sm_100a": (4, 4)}[arch]
    per_warp = _prepare_warp_smem(spec)
    assert layout[1] * (layout[0] * per_warp + 1024) <= get_arch(arch).smem_bytes_per_block  # it fits
    if layout[0] == 4:
        assert prep["overlap_ctas_per_sm"] == safe["overlap_ctas_per_sm"]
    else:
        assert prep["overlap_ctas_per_sm"] == prep["ctas_per_sm"]


@pytest.mark.parametrize(("arch", "stages"), [("sm_80", 2), ("sm_89", 1), ("sm_90a", 3), ("sm_100a", 3)])
@pytest.mark.parametrize("head_dim_k", [64, 128])
def test_merge_prefetch_fits_the_targets_shared_memory(arch: str, stages: int, head_dim_k: int):
    # The merge buffers as many maps (bf16 hi and lo planes) as the target's shared memory holds, up to three;
    # at K=128 that is one map on sm_89 (99 KB a block), two on sm_80, three on sm_90a and sm_100a.
    spec = KernelSpec(arch=arch, head_dim_k=head_dim_k, head_dim_v=128)
    p = next(s for s in make_plan(spec).stages if s.name == "cp_merge").params
    k = head_dim_k
    used = p["stages"] * 2 * k * k * 2 + 2 * p["block_v"] * k * 2
    assert used <= get_arch(arch).smem_bytes_per_block
    assert p["warps"] * 16 == k and p["block_v"] == 16
    assert p["stages"] == (stages if k == 128 else 3)


@pytest.mark.parametrize("mode", ["prob", "logit", "logit_x2"])
@pytest.mark.parametrize("arch,family", [("sm_90a", "auto"), ("sm_90a", "mma_sync"), ("sm_80", "auto")])
def test_beta_mode_reaches_every_stage_that_loads_beta(mode: str, arch: str, family: str):
    # prepare (both families), the fused kernel and its pair form (they inherit prepare's params), decode and
    # the backward's bwd_grads load beta; the other stages never read it, and their params, so their rendered
    # files, do not change.
    spec = KernelSpec(arch=arch, family=family, beta=mode)
    plan = make_plan(spec)
    loads = {"prepare", "fused", "fused_pair", "decode", "decode_stream", "bwd_grads"}
    assert {s.name: s.params["beta"] for s in plan.stages if s.name in loads} == {
        s.name: mode for s in plan.stages if s.name in loads
    }
    assert all("beta" not in s.params for s in plan.stages if s.name not in loads)
    prob = make_plan(spec.replace(beta="prob"))
    assert [s.params for s in prob.stages if s.name not in loads] == [
        s.params for s in plan.stages if s.name not in loads
    ]


@pytest.mark.parametrize("arch", ["sm_80", "sm_89", "sm_90a", "sm_100a"])
@pytest.mark.parametrize("k", [64, 128])
def test_bwd_grads_runs_as_many_ctas_as_fit(arch: str, k: int):
    # The CTAs an SM bwd_grads is compiled for fit the target's shared memory and leave at least
    # BWD_GRADS_MIN_REGS registers a thread; on sm_90a at K = 128 that is the measured four.
    spec = KernelSpec(arch=arch, head_dim_k=k, head_dim_v=k)
    ctas = {s.name: s.params for s in make_plan(spec).stages}["bwd_grads"]["min_ctas"]
    # four [16, K + 1] tiles, the kg_dakt warps' [16, 16] partials, ten [16, 20] matrices, beta, the row
    # sums' rows and the norms (fp32), plus the driver's 1 KB
    words = 4 * 16 * (k + 1) + max(1, k // 32 - 1) * 256 + 10 * 16 * 20 + 16 + (k // 32 + 1) * 32 + 32
    smem = 4 * words + 1024
    assert 1 <= ctas and ctas * smem <= get_arch(arch).smem_bytes_per_block + 1024
    assert ctas == 1 or ctas * k * BWD_GRADS_MIN_REGS <= 65536
    if arch == "sm_90a" and k == 128:
        assert ctas == 4


@pytest.mark.parametrize("arch", ["sm_80", "sm_89", "sm_90a", "sm_100a"])
@pytest.mark.parametrize(("k", "v"), [(128, 128), (64, 64), (128, 64), (64, 128)])
def test_bwd_tile_runs_and_ring_fit_shared_memory(arch: str, k: int, v: int):
    # bwd_tile takes a run of BWD_STATE_TILES tiles a CTA (the forward keeps a state a run) with its tiles'
    # rows in a ring that fits a CTA: two deep on sm_90a at K = V = 128, the measured form (two CTAs an SM),
    # one on sm_89 (99 KB a CTA), and never a deeper ring that costs CTAs an SM.
    spec = KernelSpec(arch=arch, head_dim_k=k, head_dim_v=v)
    p = {s.name: s.params for s in make_plan(spec).stages}["bwd_tile"]
    assert p["state_tiles"] == bwd_state_tiles(spec) == BWD_STATE_TILES == 4
    warps = min(8, min(k, v) // 16)
    cap = get_arch(arch).smem_bytes_per_block

    def smem(ring: int) -> int:  # S and dS^T, R and dR, dgt's partial sums, the ring, alignment
        rows = 2 * 16 * (2 * k + 2 * v + 16) + 4 * k
        return 2 * (2 * k * v + 2 * 16 * v) + 4 * warps * k + ring * rows + 2048

    assert p["ring"] in (1, 2) and smem(p["ring"]) <= cap
    ctas = {r: min((cap + 1024) // smem(r), 16 // warps) for r in (1, 2) if smem(r) <= cap}
    assert ctas[p["ring"]] == max(ctas.values())
    if arch == "sm_90a" and k == v == 128:
        assert p["ring"] == 2 and ctas[2] == 2
    if arch == "sm_89" and k == v == 128:
        assert p["ring"] == 1


@pytest.mark.parametrize("arch", ["sm_80", "sm_89", "sm_90a", "sm_100a"])
@pytest.mark.parametrize(("k", "v"), [(128, 128), (64, 64), (128, 64)])
@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["kv", "vk"])
def test_streaming_decode_ring_fits_shared_memory(arch: str, k: int, v: int, state_dtype: str, layout: str):
    # The streaming decode exists where bulk copies do, for both layouts, with at least two states in its
    # ring; the ring and the token rows fit the target's shared memory.
    spec = KernelSpec(arch=arch, head_dim_k=k, head_dim_v=v, state_dtype=state_dtype, state_layout=layout)
    stages = {s.name: s.params for s in make_plan(spec).stages}
    info = get_arch(arch)
    if not info.has_bulk_copy:
        assert "decode_stream" not in stages
        return
    p = stages["decode_stream"]
    slot = k * v * (4 if state_dtype == "fp32" else 2)
    tokens = p["stagers"] * p["token_stages"] * (3 * (k + 4) + v + 4) * 4
    assert 2 <= p["stages"] <= DECODE_STREAM_MAX_STAGES
    assert p["stages"] * slot + tokens + 1024 <= info.smem_bytes_per_block
    if (k, v, state_dtype) == (128, 128, "fp32"):
        assert p["stages"] == 3  # 64 KB states


def test_bwd_states_take_a_recurrence_that_stages_nothing():
    # The forward's wgmma recurrence stages the pool's stores; beside the backward's reverse scan a staging
    # buffer slows the recurrence, so `bwd_states` imports a copy without one (the portable family has
    # none to leave out).
    stages = {s.name: s for s in make_plan(KernelSpec(arch="sm_90a")).stages}
    assert stages["recurrence"].params["pool_rounds"] >= 1
    bwd = stages["bwd_recurrence"]
    assert not bwd.compiled and bwd.template == stages["recurrence"].template
    assert bwd.params["pool_rounds"] == 0 and "tiles_rounds" not in bwd.params
    assert {k: v for k, v in bwd.params.items() if k != "pool_rounds"} == {
        k: v for k, v in stages["recurrence"].params.items() if k != "pool_rounds"}
    assert stages["bwd_states"].params["recurrence"] == "bwd_recurrence"
    portable = {s.name: s for s in make_plan(KernelSpec(arch="sm_90a", family="mma_sync")).stages}
    assert "bwd_recurrence" not in portable and portable["bwd_states"].params["recurrence"] == "recurrence"
