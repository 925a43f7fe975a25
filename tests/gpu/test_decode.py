"""GPU numerics of `KDAKernel.decode` against the fp64 token recurrence: plain decode on a slot-indexed pool
(both layouts, an interleaved pool, padding slots, fresh requests), speculative-decode verify with FLA's
slot semantics, output-only verify, 256 consecutive steps, decode after a prefill, and CUDA-graph replay.
Relative RMSE of o and of every written state within 0.005; padding and unrelated slots bitwise untouched.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import kdagen.decode
import kdagen.policy
from kdagen.errors import InputError
from kdagen.policy import SchedulePolicy
from kdagen.reference import assert_close, rel_rmse

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


@pytest.fixture(autouse=True, params=["off", "whole", "parts", "direct"],
                ids=["per-item", "streaming-whole", "streaming-parts", "streaming-direct"])
def decode_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test runs on both decode stages: one CTA an item (forced), and the streaming grid (the automatic
    choice where the variant has it; skipped where it has not). There with whole states and with states split
    into value parts wherever there are fewer items than SMs, whatever the layout and token count
    (`decode_parts` forced either way), the final states and a speculative token's states returned through
    the ring (`decode_staged_store` forced, as on calls of many items); and with whole states stored by the
    consumers (as on few)."""
    path = request.param
    kernel_for = cases.kernel_for
    rule = kdagen.decode.decode_parts
    if path in ("whole", "direct"):
        monkeypatch.setattr(kdagen.decode, "decode_parts", lambda *args, **kwargs: 1)
    elif path == "parts":
        monkeypatch.setattr(kdagen.decode, "decode_parts",
                            lambda items, sms, v, v_first, tokens: rule(items, sms, v, True, tokens))
    if path != "off":
        monkeypatch.setattr(kdagen.decode, "decode_staged_store", lambda items, ctas: path != "direct")

    def forced(name: str) -> Any:
        kernel = kernel_for(name)
        if path != "off" and kernel._decode_stream is None:
            pytest.skip(f"{name}: this variant has no streaming decode stage")
        return kernel.with_policy(SchedulePolicy(decode_stream="off" if path == "off" else "on"))

    monkeypatch.setattr(cases, "kernel_for", forced)
    return path
DECODE_SPECS = [
    "lb_safe",
    "softplus",
    "p_reset_vk_bbf16",
    "lb_safe_gva2_vk_bbf16",
    "lb_safe_gva4_k64v64",
    "lb_safe_k128v64_vk",
    "lb_safe_logit",  # beta logits: sigmoid(beta) at the decode kernel's load
    "lb_safe_gva2_vk_bbf16_logit_x2",  # 2 sigmoid(beta), bf16 logits
    "lb_safe_sbf16",  # a bf16 pool: the bulk-copy path
    "lb_safe_mma_sync_vk_sbf16",  # a bf16 pool in the V-first layout: the register path
]


def _inputs(spec: dict[str, Any], n: int, s: int, h: int, seed: int, init: bool = True) -> dict[str, Any]:
    # n requests of s tokens each: the matrix's inputs for a fixed-length case
    return cases.build_inputs(spec, cases.F(n, s, h, init=init, seed=seed))


def _reference(spec: dict[str, Any], inp: dict[str, Any], h0: Any) -> tuple[torch.Tensor, Any]:
    # the fp64 recurrence from the state h0 (the slots the kernel reads), final state included
    return cases.run_reference(spec, {**inp, "initial_state": h0})


def _states_after_each_token(spec: dict[str, Any], inp: dict[str, Any], h0: Any, s: int) -> list[Any]:
    # the fp64 states after tokens 0 .. s - 1 of every request, from h0 (a verify's slots, token by token)
    tokens = ("q", "k", "v", "g", "beta")
    return [_reference(spec, {key: (val[:, : t + 1] if key in tokens else val) for key, val in inp.items()},
                       h0)[1] for t in range(s)]


def _call(kernel: Any, inp: dict[str, Any], **kw: Any) -> torch.Tensor:
    return kernel.decode(
        inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], A_log=inp["A_log"], dt_bias=inp["dt_bias"], **kw
    )


@pytest.mark.parametrize("spec_name", DECODE_SPECS)
@pytest.mark.parametrize("interleave", [1, 3])
def test_decode_step_on_a_pool(spec_name: str, interleave: int) -> None:
    spec = cases.SPECS[spec_name]
    kernel = cases.kernel_for(spec_name)
    n, h = 6, 2
    hv = h * spec["gva_ratio"]
    inp = _inputs(spec, n, 1, h, seed=11)
    pool = cases.decode_pool(spec, 16, hv, interleave)
    idx = torch.tensor([3, 9, -1, 0, 15, 7], dtype=torch.int64, device="cuda")  # one padding entry
    before = pool.clone()
    h0 = torch.stack([pool[max(int(i), 0)] for i in idx.tolist()])
    o = _call(kernel, inp, state_pool=pool, state_indices=idx)
    torch.cuda.synchronize()
    ref_o, ref_ht = _reference(spec, inp, h0)
    live = idx >= 0
    assert_close("o", ref_o[live], o[live], TOL)
    assert torch.count_nonzero(o[~live]) == 0, "o of a padding slot is not zero"
    for row, slot in enumerate(idx.tolist()):
        if slot >= 0:
            assert_close(f"pool[{slot}]", ref_ht[row], pool[slot], TOL)
    untouched = [s for s in range(16) if s not in idx.tolist()]
    assert torch.equal(pool[untouched], before[untouched]), "a slot no request names was written"


@pytest.mark.parametrize("spec_name", ["lb_safe", "p_reset_vk_bbf16", "lb_safe_gva4_k64v64",
                                       "lb_safe_gva2_vk_bbf16_logit_x2", "lb_safe_sbf16"])
@pytest.mark.parametrize("accepted", [[1, 2, 4], [4, 1, 3]])
def test_speculative_verify_writes_the_state_after_each_token(spec_name: str, accepted: list[int]) -> None:
    spec = cases.SPECS[spec_name]
    kernel = cases.kernel_for(spec_name)
    n, s, h = 3, 4, 2
    hv = h * spec["gva_ratio"]
    inp = _inputs(spec, n, s, h, seed=5)
    pool = cases.decode_pool(spec, 4 * n + 2, hv)
    idx = torch.arange(4 * n, device="cuda", dtype=torch.int32).view(n, 4)  # request r owns slots 4r..4r+3
    acc = torch.tensor(accepted, dtype=torch.int32, device="cuda")
    h0 = torch.stack([pool[int(idx[r, a - 1])] for r, a in enumerate(accepted)])
    o = _call(kernel, inp, state_pool=pool, state_indices=idx, num_accepted_tokens=acc)
    torch.cuda.synchronize()
    ref_o, _ = _reference(spec, inp, h0)
    assert_close("o", ref_o, o, TOL)
    for t, ref_t in enumerate(_states_after_each_token(spec, inp, h0, s)):
        for r in range(n):
            assert_close(f"state after token {t} of request {r}", ref_t[r], pool[int(idx[r, t])], TOL)


@pytest.mark.parametrize("spec_name", ["lb_safe", "lb_safe_sbf16", "p_reset_vk_bbf16"])
def test_verify_skips_negative_token_slots_and_padded_requests(spec_name: str) -> None:
    """A verify row's negative entry after the loaded one skips that token's state (its slot untouched, the
    later tokens' states still written); a request whose loaded entry is negative is padding: o zero and
    none of its slots written."""
    spec = cases.SPECS[spec_name]
    kernel = cases.kernel_for(spec_name)
    n, s, h = 3, 4, 2
    hv = h * spec["gva_ratio"]
    inp = _inputs(spec, n, s, h, seed=7)
    pool = cases.decode_pool(spec, 4 * n + 2, hv)
    idx = torch.arange(4 * n, device="cuda", dtype=torch.int32).view(n, 4)
    idx[0, 2] = -1  # request 0: token 2's state is not kept
    idx[2, 0] = -1  # request 2 loads from entry 0: padding
    before = pool.clone()
    h0 = torch.stack([pool[max(int(idx[r, 0]), 0)] for r in range(n)])
    o = _call(kernel, inp, state_pool=pool, state_indices=idx,
              num_accepted_tokens=torch.ones(n, dtype=torch.int32, device="cuda"))
    torch.cuda.synchronize()
    ref_o, _ = _reference(spec, inp, h0)
    assert_close("o", ref_o[:2], o[:2], TOL)
    assert torch.count_nonzero(o[2]) == 0, "o of a padded request is not zero"
    for t, ref_t in enumerate(_states_after_each_token(spec, inp, h0, s)):
        for r in range(2):
            slot = int(idx[r, t])
            if slot >= 0:
                assert_close(f"state after token {t} of request {r}", ref_t[r], pool[slot], TOL)
    untouched = [2, 8, 9, 10, 11, 4 * n, 4 * n + 1]  # request 0's token 2, request 2's four, the spares
    assert torch.equal(pool[untouched], before[untouched]), "a skipped or padded slot was written"


@pytest.mark.parametrize("spec_name", ["lb_safe", "lb_safe_sbf16", "p_reset_vk_bbf16"])
def test_verify_of_many_requests_takes_the_ring_and_matches_the_stores(
    spec_name: str, decode_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A verify call large enough for the automatic rule to copy each token's state out through the ring
    (`decode_staged_store`: 16 items a CTA) writes the same o and the same slots, bit for bit, as the
    consumers' own stores, and matches the fp64 recurrence. On the streaming grid with whole states only."""
    if decode_path != "whole":
        pytest.skip("the streaming grid with whole states (the other paths store from registers)")
    spec = cases.SPECS[spec_name]
    kernel = cases.kernel_for(spec_name)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    h, s = 16, 3
    hv = h * spec["gva_ratio"]
    n = -(-16 * sms // hv)  # 16 (request, value head) items an SM
    monkeypatch.setattr(kdagen.decode, "decode_staged_store", kdagen.policy.decode_staged_store)
    assert kdagen.decode.decode_staged_store(n * hv, sms)
    inp = _inputs(spec, n, s, h, seed=13)
    pool = cases.decode_pool(spec, s * n + 1, hv)
    idx = torch.randperm(s * n, device="cuda", dtype=torch.int32).view(n, s)
    acc = torch.ones(n, dtype=torch.int32, device="cuda")
    h0 = pool[idx[:, 0].long()].clone()
    outs = {}
    for rule in (True, False):
        monkeypatch.setattr(kdagen.decode, "decode_staged_store", lambda items, ctas, rule=rule: rule)
        mine = pool.clone()
        o = _call(kernel, inp, state_pool=mine, state_indices=idx, num_accepted_tokens=acc)
        outs[rule] = (o, mine)
    torch.cuda.synchronize()
    assert torch.equal(outs[True][0], outs[False][0]), "o differs between the ring's copies and the stores"
    assert torch.equal(outs[True][1], outs[False][1]), "the pool differs between the copies and the stores"
    ref_o, ref_ht = _reference(spec, inp, h0)
    assert_close("o", ref_o, outs[True][0], TOL)
    assert_close("state after the last token", ref_ht, outs[True][1][idx[:, s - 1].long()], TOL)


def test_output_only_verify_and_fresh_requests() -> None:
    spec = cases.SPECS["lb_safe"]
    kernel = cases.kernel_for("lb_safe")
    n, s, h = 4, 3, 2
    inp = _inputs(spec, n, s, h, seed=8)
    pool = cases.decode_pool(spec, 8, h)
    before = pool.clone()
    idx = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 0], [1, 2, 3]], dtype=torch.int32, device="cuda")
    fresh = torch.tensor([True, False, True, False], device="cuda")  # has_initial_state
    o = _call(kernel, inp, state_pool=pool, state_indices=idx, has_initial_state=fresh, update_state=False)
    torch.cuda.synchronize()
    assert torch.equal(pool, before), "update_state=False wrote the pool"
    h0 = torch.stack([pool[int(idx[r, 0])] * float(fresh[r]) for r in range(n)])
    ref_o, _ = _reference(spec, inp, h0)
    assert_close("o", ref_o, o, TOL)


@pytest.mark.parametrize("spec_name", ["lb_safe", "softplus"])
def test_256_consecutive_steps(spec_name: str) -> None:
    spec = cases.SPECS[spec_name]
    kernel = cases.kernel_for(spec_name)
    n, steps, h = 3, 256, 2
    inp = _inputs(spec, n, steps, h, seed=21)
    pool = cases.decode_pool(spec, n, h * spec["gva_ratio"])
    h0 = pool.clone()
    idx = torch.arange(n, dtype=torch.int32, device="cuda")
    outs = []
    for t in range(steps):
        step = {
            key: (val[:, t : t + 1] if key in ("q", "k", "v", "g", "beta") else val)
            for key, val in inp.items()
        }
        outs.append(_call(kernel, step, state_pool=pool, state_indices=idx))
    torch.cuda.synchronize()
    ref_o, ref_ht = _reference(spec, inp, h0)
    assert_close("o after 256 steps", ref_o, torch.cat(outs, dim=1), TOL)
    assert_close("state after 256 steps", ref_ht, pool, TOL)


def test_decode_continues_a_prefill_and_replays_in_a_cuda_graph() -> None:
    spec = cases.SPECS["lb_safe_gbf16"]
    kernel = cases.kernel_for("lb_safe_gbf16")
    n, h, prompt = 2, 4, 300
    full = _inputs(spec, n, prompt + 2, h, seed=3, init=False)
    pre = {
        key: (val[:, :prompt] if key in ("q", "k", "v", "g", "beta") else val) for key, val in full.items()
    }
    _, ht = kernel(
        pre["q"],
        pre["k"],
        pre["v"],
        pre["g"],
        pre["beta"],
        A_log=pre["A_log"],
        dt_bias=pre["dt_bias"],
        output_final_state=True,
    )
    pool = torch.zeros(5, *ht.shape[1:], device="cuda")
    idx = torch.tensor([4, 1], dtype=torch.int32, device="cuda")
    pool[idx.long()] = ht
    steps = [
        {
            key: (val[:, prompt + t : prompt + t + 1] if key in ("q", "k", "v", "g", "beta") else val)
            for key, val in full.items()
        }
        for t in range(2)
    ]
    static = {key: (val.clone() if isinstance(val, torch.Tensor) else val) for key, val in steps[0].items()}
    out = torch.empty_like(static["v"])
    _call(kernel, static, state_pool=pool.clone(), state_indices=idx, out=out)  # warm-up outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _call(kernel, static, state_pool=pool, state_indices=idx, out=out)
    outs = []
    for step in steps:
        cases.copy_into(static, step)
        graph.replay()
        outs.append(out.clone())
    torch.cuda.synchronize()
    ref_o, ref_ht = _reference(spec, full, None)
    assert_close("o of the decode steps", ref_o[:, prompt:], torch.cat(outs, dim=1), TOL)
    assert_close("state after prefill + 2 decode steps", ref_ht, pool[idx.long()], TOL)


def test_bad_decode_arguments_are_refused_before_any_launch() -> None:
    spec = cases.SPECS["lb_safe"]
    kernel = cases.kernel_for("lb_safe")
    inp = _inputs(spec, 2, 1, 2, seed=1)
    pool = cases.decode_pool(spec, 4, 2)
    idx = torch.zeros(2, dtype=torch.int32, device="cuda")
    with pytest.raises(InputError, match="state_pool: expected dtype torch.float32"):
        _call(kernel, inp, state_pool=pool.half(), state_indices=idx)
    with pytest.raises(InputError, match="state_indices: expected \\[N\\] or \\[N, M\\] with N = 2"):
        _call(kernel, inp, state_pool=pool, state_indices=idx[:1])
    with pytest.raises(InputError, match="state_indices: expected dtype"):
        _call(kernel, inp, state_pool=pool, state_indices=idx.float())
    with pytest.raises(InputError, match="state_pool: expected each slot compact"):
        _call(kernel, inp, state_pool=pool.transpose(2, 3), state_indices=idx)
    with pytest.raises(InputError, match="num_accepted_tokens: given, but state_indices has one column"):
        _call(kernel, inp, state_pool=pool, state_indices=idx, num_accepted_tokens=idx)


def test_bf16_state_error_over_1024_steps() -> None:
    """A bf16 pool rounds the state after every step; the error of o against the fp64 recurrence (whose
    state is never rounded) after 1, 64 and 1024 steps, printed, and within 0.005 after one step and 0.01
    after 1024."""
    spec = cases.SPECS["lb_safe_sbf16"]
    kernel = cases.kernel_for("lb_safe_sbf16")
    n, h, steps = 4, 2, 1024
    full = _inputs(spec, n, steps, h, seed=11)
    h0 = full["initial_state"]  # bf16 (the spec's state dtype), as the pool holds it
    idx = torch.arange(1, n + 1, dtype=torch.int32, device="cuda")
    pool = torch.zeros(n + 1, *h0.shape[1:], dtype=torch.bfloat16, device="cuda")
    pool[idx.long()] = h0
    ref_o, _ = _reference(spec, full, h0)
    errors = {}
    with torch.no_grad():
        for t in range(steps):
            step = {key: (val[:, t : t + 1] if key in ("q", "k", "v", "g", "beta") else val)
                    for key, val in full.items()}
            o = _call(kernel, step, state_pool=pool, state_indices=idx)
            if t + 1 in (1, 64, 1024):
                errors[t + 1] = rel_rmse(ref_o[:, t : t + 1], o)
    print(f"bf16 state, relative RMSE of o after 1, 64, 1024 steps: {errors}")
    assert errors[1] <= TOL, errors
    assert errors[1024] <= 0.01, errors


@pytest.mark.parametrize("spec_name", ["lb_safe", "lb_safe_gva2_vk_bbf16_logit_x2"])
def test_decode_takes_slices_of_packed_projections(spec_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """q, k, v, g, beta as row-strided views go to the stage without a copy and give the same o and states
    as compact tensors, bit for bit."""
    import kdagen.decode as decode

    spec = cases.SPECS[spec_name]
    kernel = cases.kernel_for(spec_name)
    n, s, h = 3, 2, 2
    hv = h * spec["gva_ratio"]
    inp = _inputs(spec, n, s, h, seed=9)
    idx = torch.arange(n * s, dtype=torch.int32, device="cuda").view(n, s)
    pool_a = cases.decode_pool(spec, n * s + 1, hv)
    pool_b = pool_a.clone()
    o_a = _call(kernel, inp, state_pool=pool_a, state_indices=idx)
    packed = cases.packed_projections(inp)
    strided = {**inp, **{key: packed[key] for key in ("q", "k", "v", "g", "beta")}}
    copies: list[int] = []
    real = decode._compact
    monkeypatch.setattr(decode, "_compact", lambda t: copies.append(1) or real(t))
    o_b = _call(kernel, strided, state_pool=pool_b, state_indices=idx)
    torch.cuda.synchronize()
    assert not copies, "a row-strided input was copied"
    assert torch.equal(o_a, o_b)
    assert torch.equal(pool_a, pool_b)
