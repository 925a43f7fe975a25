"""GPU numerics of the forward on a slot-indexed state pool (``kernel(..., state_pool=, state_indices=,
has_initial_state=)``) against the fp64 token recurrence: varlen batches with mixed slots, a padding entry
(negative index: its slot bitwise untouched, its o zero), fresh sequences whose slots hold NaN garbage, a
pool whose slots are interleaved with other layers' (those bytes bitwise untouched), both state layouts,
both families, the fused kernel (one CTA and CTA pairs), intra-card CP, chunked prefill (two pieces of a
sequence continuing from the slot equal the whole), and CUDA-graph replay. Each pool call is also
bit-identical to the compact form on the same states (same arithmetic, different addressing).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

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

TOL = cases.GPU_TOL
LAYERS = 3  # the pool under test is layer 1 of 3 interleaved slot by slot
CU = (0, 15, 100, 100, 300, 333, 500)  # an empty sequence, partial last steps
IDX = (5, 0, 9, -1, 2, 7)  # sequence 3 is padding
FRESH = (False, True, False, True, True, False)  # has_initial_state: garbage (NaN) in the False slots


def _kernel(spec_name: str, family: str) -> Any:
    import kdagen

    if family == "auto":
        return cases.kernel_for(spec_name)
    kernel = kdagen.get_kernel({**cases.SPECS[spec_name], "family": family})
    assert kernel.plan.family == family
    return kernel


def _layers(spec: dict[str, Any], slots: int, hv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(all layers, this layer's pool): [slots, LAYERS, HV, ...] and its [:, 1] view (slot stride 3 slots)."""
    k, v = spec["head_dim_k"], spec["head_dim_v"]
    inner = (hv, k, v) if spec["state_layout"] == "kv" else (hv, v, k)
    base = torch.randn(slots, LAYERS, *inner, device="cuda", dtype=torch.float32) * 0.5
    base = base.to(cases.state_dtype(spec))
    return base, base[:, 1]


def _h0(pool: torch.Tensor, idx: torch.Tensor, fresh: torch.Tensor | None) -> torch.Tensor:
    # The states the kernel must start from: the slot, or zero for padding and fresh sequences (no multiply:
    # the garbage is NaN).
    rows = []
    for n, slot in enumerate(idx.tolist()):
        start = slot >= 0 and (fresh is None or bool(fresh[n]))
        rows.append(pool[slot].clone() if start else torch.zeros_like(pool[0]))
    return torch.stack(rows)


def _call(kernel: Any, inp: dict[str, Any], policy: SchedulePolicy | None = None, **kw: Any) -> Any:
    k = kernel.with_policy(policy) if policy is not None else kernel
    return k(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], A_log=inp["A_log"], dt_bias=inp["dt_bias"],
             cu_seqlens=inp["cu_seqlens"], **kw)


def _check_pool_call(spec_name: str, family: str, cu: tuple[int, ...], idx_list: tuple[int, ...],
                     fresh_list: tuple[bool, ...] | None, policy: SchedulePolicy | None, h: int = 2,
                     seed: int = 0) -> None:
    spec = cases.SPECS[spec_name]
    kernel = _kernel(spec_name, family)
    inp = cases.build_inputs(spec, cases.VL(cu, h, seed=seed))
    hv = h * spec["gva_ratio"]
    base, pool = _layers(spec, 12, hv)
    idx = torch.tensor(idx_list, dtype=torch.int32, device="cuda")
    fresh = None if fresh_list is None else torch.tensor(fresh_list, device="cuda")
    if fresh is not None:
        for n, slot in enumerate(idx_list):
            if slot >= 0 and not fresh_list[n]:
                pool[slot].fill_(float("nan"))
    h0 = _h0(pool, idx, fresh)
    before = base.clone()

    o, none = _call(kernel, inp, policy, state_pool=pool, state_indices=idx, has_initial_state=fresh)
    torch.cuda.synchronize()
    assert none is None
    ref_o, ref_ht = cases.run_reference(spec, {**inp, "initial_state": h0})

    live_tokens = torch.zeros(cu[-1], dtype=torch.bool, device="cuda")
    for n, slot in enumerate(idx_list):
        if slot >= 0:
            live_tokens[cu[n]:cu[n + 1]] = True
    assert_close("o (live sequences)", ref_o[0, live_tokens], o[0, live_tokens], TOL)
    assert torch.count_nonzero(o[0, ~live_tokens]) == 0, "o of a padding sequence is not zero"
    for n, slot in enumerate(idx_list):
        if slot >= 0:
            assert_close(f"pool[{slot}] (sequence {n})", ref_ht[n], pool[slot], TOL)
    named = {s for s in idx_list if s >= 0}
    for s in range(pool.shape[0]):
        if s not in named:
            assert torch.equal(base[s, 1], before[s, 1]), f"slot {s}, named by no live sequence, was written"
    for layer in (0, 2):
        assert torch.equal(base[:, layer], before[:, layer]), f"layer {layer} of the interleaved pool changed"

    # The compact form on the same states computes the same numbers bit for bit.
    o_c, ht_c = _call(kernel, inp, policy, initial_state=h0, output_final_state=True)
    torch.cuda.synchronize()
    assert torch.equal(o[0, live_tokens], o_c[0, live_tokens]), "o differs from the compact form"
    for n, slot in enumerate(idx_list):
        if slot >= 0:
            assert torch.equal(pool[slot], ht_c[n]), f"pool[{slot}] differs from the compact form"


VARLEN = [
    ("lb_safe", "auto", SchedulePolicy(fused="off")),  # wgmma two-stage, kv
    ("lb_safe", "auto", SchedulePolicy(fused="on", fused_pair="off")),  # fused kernel, one CTA a chain
    ("lb_safe", "auto", SchedulePolicy(fused="on")),  # fused kernel in CTA pairs (few chains)
    ("lb_safe", "mma_sync", None),  # mma_sync recurrence, kv
    ("p_reset_vk_bbf16", "auto", None),  # wgmma two-stage, vk
    ("p_reset_vk_bbf16", "mma_sync", None),  # mma_sync recurrence, vk
    ("lb_safe_gva2_vk_bbf16", "auto", SchedulePolicy(fused="on", fused_pair="off")),  # fused, vk, GVA 2
    ("lb_safe_gva4_k64v64", "auto", SchedulePolicy(fused="on")),  # fused, K=V=64 (no pair form)
]


@pytest.mark.parametrize(("spec_name", "family", "policy"), VARLEN,
                         ids=[f"{n}-{f}-{p}" for n, f, p in VARLEN])
def test_varlen_on_a_pool(spec_name: str, family: str, policy: SchedulePolicy | None) -> None:
    _check_pool_call(spec_name, family, CU, IDX, FRESH, policy)


def test_every_slot_read_when_has_initial_state_is_absent() -> None:
    _check_pool_call("lb_safe", "auto", CU, IDX, None, None, seed=3)


CP = [
    ("lb_safe", (0, 700, 701, 1333), (4, -1, 10), (True, True, False), 128),
    ("p_reset_vk_bbf16", (0, 0, 900, 1000), (1, 3, -1), (False, True, True), 256),
    ("lb_safe_gva2_vk_bbf16", (0, 2048), (6,), (True,), 512),
]


@pytest.mark.parametrize(("spec_name", "cu", "idx", "fresh", "seg"), CP, ids=[f"{c[0]}-cp{c[4]}" for c in CP])
def test_intracard_cp_on_a_pool(spec_name: str, cu: tuple[int, ...], idx: tuple[int, ...],
                                fresh: tuple[bool, ...], seg: int) -> None:
    kernel = cases.kernel_for(spec_name)
    hv = 2 * cases.SPECS[spec_name]["gva_ratio"]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    policy = SchedulePolicy(intracard_cp=seg)
    assert kernel.schedule(len(cu) - 1, cu[-1], hv, sms, policy).seg_len == seg, "the call takes no CP path"
    _check_pool_call(spec_name, "auto", cu, idx, fresh, policy, seed=5)


CHUNKED = [("lb_safe", "auto"), ("p_reset_vk_bbf16", "mma_sync"), ("lb_safe_gva2_vk_bbf16", "auto")]


@pytest.mark.parametrize(("spec_name", "family"), CHUNKED)
def test_chunked_prefill_continues_from_the_slot(spec_name: str, family: str) -> None:
    spec = cases.SPECS[spec_name]
    kernel = _kernel(spec_name, family)
    h = 2
    lengths, cuts = (200, 37, 513), (64, 20, 301)  # each sequence in two pieces, cut anywhere
    cu = (0, *torch.tensor(lengths).cumsum(0).tolist())
    whole = cases.build_inputs(spec, cases.VL(tuple(cu), h, seed=9))
    _, pool = _layers(spec, 6, h * spec["gva_ratio"])
    idx = torch.tensor([4, 1, 3], dtype=torch.int32, device="cuda")
    for slot in idx.tolist():
        pool[slot].fill_(float("nan"))  # fresh requests: their slots are never read

    def piece(first: bool) -> dict[str, Any]:
        rows, offsets = [], [0]
        for n, (length, cut) in enumerate(zip(lengths, cuts)):
            lo, hi = (0, cut) if first else (cut, length)
            rows.append(torch.arange(cu[n] + lo, cu[n] + hi, device="cuda"))
            offsets.append(offsets[-1] + hi - lo)
        sel = torch.cat(rows)
        part = {name: whole[name][:, sel] for name in ("q", "k", "v", "g", "beta")}
        part.update(A_log=whole["A_log"], dt_bias=whole["dt_bias"],
                    cu_seqlens=torch.tensor(offsets, dtype=torch.int32, device="cuda"))
        return part

    first, second = piece(True), piece(False)
    o1, _ = _call(kernel, first, state_pool=pool, state_indices=idx,
                  has_initial_state=torch.zeros(3, dtype=torch.bool, device="cuda"))
    o2, _ = _call(kernel, second, state_pool=pool, state_indices=idx,
                  has_initial_state=torch.ones(3, dtype=torch.bool, device="cuda"))
    torch.cuda.synchronize()
    ref_o, ref_ht = cases.run_reference(spec, {**whole, "initial_state": None})
    o = torch.empty_like(ref_o, dtype=o1.dtype)
    for n, (length, cut) in enumerate(zip(lengths, cuts)):
        a, b = int(first["cu_seqlens"][n]), int(second["cu_seqlens"][n])
        o[0, cu[n]:cu[n] + cut] = o1[0, a:a + cut]
        o[0, cu[n] + cut:cu[n + 1]] = o2[0, b:b + length - cut]
    assert_close("o (two pieces)", ref_o, o, TOL)
    for n, slot in enumerate(idx.tolist()):
        assert_close(f"pool[{slot}] after both pieces", ref_ht[n], pool[slot], TOL)


def test_pool_call_replays_in_a_cuda_graph() -> None:
    spec = cases.SPECS["lb_safe"]
    kernel = cases.kernel_for("lb_safe")
    h = 2
    static = cases.build_inputs(spec, cases.VL(CU, h, seed=1))
    _, pool = _layers(spec, 12, h)
    idx = torch.tensor(IDX, dtype=torch.int32, device="cuda")
    fresh = torch.tensor(FRESH, device="cuda")
    start = pool.clone()
    _call(kernel, static, state_pool=pool, state_indices=idx, has_initial_state=fresh)  # warm-up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_static, _ = _call(kernel, static, state_pool=pool, state_indices=idx, has_initial_state=fresh)
    fresh_inp = cases.build_inputs(spec, cases.VL(CU, h, seed=2))
    cases.copy_into(static, fresh_inp)
    pool.copy_(start)
    graph.replay()
    torch.cuda.synchronize()
    replayed, pool_replayed = o_static.clone(), pool.clone()
    pool.copy_(start)
    o_eager, _ = _call(kernel, fresh_inp, state_pool=pool, state_indices=idx, has_initial_state=fresh)
    torch.cuda.synchronize()
    assert torch.equal(replayed, o_eager), "the replayed o differs from an eager call"
    assert torch.equal(pool_replayed, pool), "the replayed pool differs from an eager call"


# Prefix-cache checkpoints: the state at every multiple of the interval (absolute positions: each piece
# continues from start_positions tokens already in its slot) goes into checkpoint_indices' slots in order.
CK_CU = (0, 200, 264, 300, 301, 500)
CK_START = (64, 0, 48, 32, 0)  # multiples of 16
CK_IDX = (0, 1, 2, -1, 3)  # sequence 3 is padding
CK_M = 7


def _prefix_state(spec: dict[str, Any], inp: dict[str, Any], lo: int, tokens: int, h0: torch.Tensor) -> Any:
    # The fp64 state after the first `tokens` tokens of the piece at lo, from h0.
    part = {name: inp[name][:, lo:lo + tokens] for name in ("q", "k", "v", "g", "beta")}
    part.update(A_log=inp["A_log"], dt_bias=inp["dt_bias"], initial_state=h0[None], cu_seqlens=None)
    return cases.run_reference(spec, part)[1][0]


CHECKPOINTS = [
    ("lb_safe", "auto", SchedulePolicy(fused="off"), 32),
    ("lb_safe", "auto", SchedulePolicy(fused="on"), 64),
    ("lb_safe", "auto", SchedulePolicy(fused="on", fused_pair="off"), 16),
    ("p_reset_vk_bbf16", "mma_sync", None, 48),
    ("p_reset_vk_bbf16", "auto", SchedulePolicy(intracard_cp=64), 32),
    ("lb_safe", "auto", SchedulePolicy(intracard_cp=128), 48),
    # The fused kernels' bulk-copied pool stores (kdagen.kernels.state_copy): an fp32 pool in two rounds (bf16
    # g leaves the room), a bf16 one in one CTA and in CTA pairs, K = 64 in one round.
    ("lb_safe_gbf16", "auto", SchedulePolicy(fused="on", fused_pair="off"), 64),
    ("lb_safe_sbf16", "auto", SchedulePolicy(fused="on", fused_pair="off"), 16),
    ("lb_safe_sbf16", "auto", SchedulePolicy(fused="on"), 48),
    ("lb_safe_gva4_k64v64", "auto", SchedulePolicy(fused="on"), 32),
]


@pytest.mark.parametrize(("spec_name", "family", "policy", "interval"), CHECKPOINTS,
                         ids=[f"{n}-{f}-{p}-C{c}" for n, f, p, c in CHECKPOINTS])
def test_prefix_cache_checkpoints(spec_name: str, family: str, policy: SchedulePolicy | None,
                                  interval: int) -> None:
    spec = cases.SPECS[spec_name]
    kernel = _kernel(spec_name, family)
    h = 2
    inp = cases.build_inputs(spec, cases.VL(CK_CU, h, seed=13))
    n = len(CK_CU) - 1
    base, pool = _layers(spec, 4 + n * CK_M, h * spec["gva_ratio"])
    idx = torch.tensor(CK_IDX, dtype=torch.int32, device="cuda")
    start = torch.tensor(CK_START, dtype=torch.int64, device="cuda")
    # Sequence s's checkpoints go to slots 4 + s * CK_M + m; every third one is skipped (-1).
    ck = torch.tensor([[-1 if (s + m) % 3 == 2 else 4 + s * CK_M + m for m in range(CK_M)] for s in range(n)],
                      dtype=torch.int32, device="cuda")
    h0 = _h0(pool, idx, None)
    before = base.clone()
    o, _ = _call(kernel, inp, policy, state_pool=pool, state_indices=idx, checkpoint_interval=interval,
                 start_positions=start, checkpoint_indices=ck)
    torch.cuda.synchronize()

    written = set()
    for s_, slot in enumerate(CK_IDX):
        if slot < 0:
            continue
        lo, length, first = CK_CU[s_], CK_CU[s_ + 1] - CK_CU[s_], CK_START[s_]
        for m in range(CK_M):
            p = (first // interval + 1 + m) * interval
            target = int(ck[s_, m])
            if p > first + length or target < 0:
                continue
            want = _prefix_state(spec, inp, lo, p - first, h0[s_])
            label = f"checkpoint {m} of sequence {s_} (position {p}, slot {target})"
            assert_close(label, want, pool[target], TOL)
            written.add(target)
        written.add(slot)
    ref_o, ref_ht = cases.run_reference(spec, {**inp, "initial_state": h0})
    for s_, slot in enumerate(CK_IDX):
        if slot >= 0:
            assert_close(f"pool[{slot}] (final state of sequence {s_})", ref_ht[s_], pool[slot], TOL)
    for s in range(pool.shape[0]):
        if s not in written:
            assert torch.equal(base[s, 1], before[s, 1]), f"slot {s} was written, no checkpoint names it"
    for layer in (0, 2):
        assert torch.equal(base[:, layer], before[:, layer]), f"layer {layer} of the interleaved pool changed"
    # The output is the plain pool call's, bit for bit: checkpoints only add stores.
    pool.copy_(before[:, 1])
    o_plain, _ = _call(kernel, inp, policy, state_pool=pool, state_indices=idx)
    torch.cuda.synchronize()
    assert torch.equal(o, o_plain), "checkpoints changed o"


def test_a_start_off_the_16_token_grid_writes_no_checkpoint() -> None:
    spec = cases.SPECS["lb_safe"]
    kernel = cases.kernel_for("lb_safe")
    inp = cases.build_inputs(spec, cases.VL((0, 100), 2, seed=17))
    base, pool = _layers(spec, 6, 2)
    before = base.clone()
    _call(kernel, inp, state_pool=pool, state_indices=torch.tensor([0], dtype=torch.int32, device="cuda"),
          checkpoint_interval=16, start_positions=torch.tensor([8], device="cuda"),
          checkpoint_indices=torch.tensor([[1, 2, 3, 4, 5]], dtype=torch.int32, device="cuda"))
    torch.cuda.synchronize()
    assert torch.equal(base[1:, 1], before[1:, 1]), "a checkpoint was written for a start off the grid"
