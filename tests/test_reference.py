"""CPU tests of the PyTorch oracle (kdagen/reference.py): the recurrent and chunked formulations must agree in
fp64, match hand-written steps, and the metric and input generators must behave as kda-math §4 says.

Imports ``kdagen.reference`` directly, never ``kdagen`` itself, so these tests do not depend on the rest of
the package (or on cutlass).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from kdagen.reference import (
    assert_close,
    cu_seqlens_from_lengths,
    kda_beta,
    kda_chunked_reference,
    kda_gate,
    kda_recurrent_reference,
    l2norm,
    make_inputs,
    rel_rmse,
    varlen_lengths,
)

FP64_TOL = 1e-10  # chunked vs recurrent, both fp64


@dataclass(frozen=True)
class RefCase:
    """One input configuration for the chunked-vs-recurrent cross-check."""

    name: str
    B: int
    T: int
    H: int
    HV: int
    K: int
    V: int
    gate: str
    safe_gate: bool
    lower_bound: float | None
    chunk_size: int
    cu_seqlens: tuple[int, ...] | None = None
    init: bool = False
    layout: str = "kv"
    l2norm_qk: bool = False
    mask_p: float = 0.0
    hard_reset: bool = False
    gln: float = 1.0
    seed: int = 0


# A covering design, not the full product: every row below exercises several of odd T, length-1 sequences,
# GVA 1/2/4, initial state on/off, hard resets with non-safe gates, each gate mode, both state layouts,
# l2norm on/off, and chunk sizes 16 / 64 (including sequences shorter than, equal to and just over a chunk).
CASES: tuple[RefCase, ...] = (
    RefCase("T63-c16-prec-safe-init", 2, 63, 2, 2, 32, 16, "precomputed", True, -5.0, 16, init=True),
    RefCase("T65-c64-softplus-gva2-vk-l2", 2, 65, 1, 2, 32, 16, "softplus", False, None, 64, layout="vk",
            l2norm_qk=True),
    RefCase("T100-c16-lbsafe-gva4-init-l2", 1, 100, 1, 4, 16, 32, "lower_bound", True, -5.0, 16, init=True,
            l2norm_qk=True),
    RefCase("T100-c64-prec-reset-gva2-vk-init", 2, 100, 2, 4, 32, 16, "precomputed", False, None, 64,
            init=True, layout="vk", mask_p=0.3, hard_reset=True),
    RefCase("T63-c64-prec-gln0.1", 1, 63, 2, 2, 16, 16, "precomputed", False, None, 64, gln=0.1, seed=3),
    RefCase("T65-c16-prec-gln10-mask-vk", 2, 65, 1, 1, 16, 32, "precomputed", False, None, 16, layout="vk",
            mask_p=0.5, gln=10.0, seed=4),
    RefCase("T64-c64-lb-nonsafe-reset-gva2", 1, 64, 2, 4, 32, 16, "lower_bound", False, -5.0, 64, init=True,
            mask_p=0.2, hard_reset=True, l2norm_qk=True),
    RefCase("varlen-len1-c16-prec-reset-init", 1, 100, 2, 2, 32, 16, "precomputed", False, None, 16,
            cu_seqlens=(0, 1, 2, 17, 18, 83, 100), init=True, mask_p=0.5, hard_reset=True),
    RefCase("varlen-len1-c64-softplus-reset-gva4-vk", 1, 130, 1, 4, 32, 16, "softplus", False, None, 64,
            cu_seqlens=(0, 1, 64, 65, 130), init=True, layout="vk", mask_p=0.2, hard_reset=True,
            l2norm_qk=True),
    RefCase("varlen-c16-lb-nonsafe-gva2", 1, 163, 2, 4, 16, 32, "lower_bound", False, -3.0, 16,
            cu_seqlens=(0, 15, 100, 163), l2norm_qk=False, seed=5),
    RefCase("varlen-c64-lbsafe-init-vk-l2", 1, 200, 1, 1, 32, 32, "lower_bound", True, -5.0, 64,
            cu_seqlens=(0, 15, 16, 200), init=True, layout="vk", l2norm_qk=True, seed=6),
    RefCase("varlen-c16-prec-safe-gva4", 1, 49, 1, 4, 16, 16, "precomputed", True, -5.0, 16,
            cu_seqlens=(0, 16, 32, 33, 49), mask_p=0.3, seed=7),
)


def _inputs(c: RefCase) -> dict:
    return make_inputs(
        c.B, c.T, c.H, c.HV, c.K, c.V, dtype=torch.bfloat16, beta_dtype=torch.float32, g_dtype=torch.float32,
        gate=c.gate, safe_gate=c.safe_gate, lower_bound=c.lower_bound, seed=c.seed, device="cpu",
        mask_p=c.mask_p, hard_reset=c.hard_reset, gate_logit_normalizer=c.gln, l2norm_qk=c.l2norm_qk,
        cu_seqlens=c.cu_seqlens, with_initial_state=c.init, state_layout=c.layout,
    )


def _ref_kwargs(c: RefCase) -> dict:
    return dict(gate=c.gate, lower_bound=c.lower_bound, l2norm_qk=c.l2norm_qk, state_layout=c.layout,
                output_final_state=True)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_chunked_matches_recurrent(case: RefCase) -> None:
    inp = _inputs(case)
    o_r, h_r = kda_recurrent_reference(**inp, **_ref_kwargs(case))
    o_c, h_c = kda_chunked_reference(**inp, **_ref_kwargs(case), chunk_size=case.chunk_size)
    assert o_r.dtype == h_r.dtype == torch.float64
    assert o_r.shape == (case.B, case.T, case.HV, case.V)
    n = case.B if case.cu_seqlens is None else len(case.cu_seqlens) - 1
    kv = (case.K, case.V) if case.layout == "kv" else (case.V, case.K)
    assert h_r.shape == (n, case.HV, *kv)
    assert torch.isfinite(o_r).all() and torch.isfinite(h_r).all()
    assert rel_rmse(o_r, o_c) < FP64_TOL, rel_rmse(o_r, o_c)
    assert rel_rmse(h_r, h_c) < FP64_TOL, rel_rmse(h_r, h_c)


@pytest.mark.parametrize("fn", [kda_recurrent_reference, kda_chunked_reference], ids=["recurrent", "chunked"])
def test_vk_layout_is_kv_transposed(fn) -> None:
    inp = make_inputs(1, 70, 1, 2, 32, 16, dtype="bf16", beta_dtype="fp32", g_dtype="fp32",
                      gate="precomputed", safe_gate=False, lower_bound=None, seed=11, device="cpu",
                      cu_seqlens=[0, 5, 70], with_initial_state=True, l2norm_qk=False)
    o_kv, h_kv = fn(**inp, output_final_state=True, state_layout="kv")
    inp_vk = dict(inp, initial_state=inp["initial_state"].transpose(-1, -2).contiguous())
    o_vk, h_vk = fn(**inp_vk, output_final_state=True, state_layout="vk")
    assert h_vk.shape == (2, 2, 16, 32)
    assert torch.equal(o_kv, o_vk)
    assert torch.equal(h_vk, h_kv.transpose(-1, -2))


def test_t1_equals_one_manual_step() -> None:
    """T = 1, GVA 2, in-kernel lower-bound gate with A_log and dt_bias, l2norm and an initial state."""
    K, V, HV, lb = 8, 4, 2, -5.0
    inp = make_inputs(1, 1, 1, HV, K, V, dtype="fp32", beta_dtype="fp32", g_dtype="fp32", gate="lower_bound",
                      safe_gate=True, lower_bound=lb, seed=2, device="cpu", with_initial_state=True,
                      l2norm_qk=True)
    scale = 0.37
    kw = dict(scale=scale, gate="lower_bound", lower_bound=lb, l2norm_qk=True, output_final_state=True)
    o_r, h_r = kda_recurrent_reference(**inp, **kw)
    o_c, h_c = kda_chunked_reference(**inp, **kw, chunk_size=16)

    d = torch.float64
    q = inp["q"][0, 0, 0].to(d)
    k = inp["k"][0, 0, 0].to(d)
    q = q / math.sqrt(float((q * q).sum()) + 1e-6)
    k = k / math.sqrt(float((k * k).sum()) + 1e-6)
    for hv in range(HV):  # both value heads read q/k head 0
        a = math.exp(float(inp["A_log"][hv]))
        x = inp["g"][0, 0, hv].to(d) + inp["dt_bias"].reshape(HV, K)[hv].to(d)
        alpha = torch.exp(lb / (1.0 + torch.exp(-a * x)))  # exp(lb * sigmoid(a x))
        beta = float(inp["beta"][0, 0, hv])
        v = inp["v"][0, 0, hv].to(d)
        S0 = inp["initial_state"][0, hv].to(d)  # [K,V]
        eye = torch.eye(K, dtype=d)
        S1 = (eye - beta * torch.outer(k, k)) @ torch.diag(alpha) @ S0 + beta * torch.outer(k, v)
        o = S1.T @ (scale * q)
        torch.testing.assert_close(h_r[0, hv], S1, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(o_r[0, 0, hv], o, rtol=1e-12, atol=1e-12)
    assert rel_rmse(o_r, o_c) < FP64_TOL and rel_rmse(h_r, h_c) < FP64_TOL


@pytest.mark.parametrize(("mode", "factor"), [("logit", 1.0), ("logit_x2", 2.0)])
def test_beta_modes_one_manual_step(mode: str, factor: float) -> None:
    """T = 1 with beta given as logits: the step of test_t1_equals_one_manual_step with beta = factor /
    (1 + e^-x) computed by hand, in both formulations."""
    K, V, HV = 8, 4, 2
    inp = make_inputs(1, 1, 1, HV, K, V, dtype="fp32", beta_dtype="fp32", g_dtype="fp32", gate="precomputed",
                      safe_gate=False, lower_bound=None, seed=4, device="cpu", with_initial_state=True,
                      l2norm_qk=False, beta_mode=mode)
    kw = dict(scale=0.5, output_final_state=True, beta_mode=mode)
    o_r, h_r = kda_recurrent_reference(**inp, **kw)
    o_c, h_c = kda_chunked_reference(**inp, **kw, chunk_size=16)
    d = torch.float64
    q, k = inp["q"][0, 0, 0].to(d), inp["k"][0, 0, 0].to(d)
    for hv in range(HV):
        x = float(inp["beta"][0, 0, hv])
        beta = factor / (1.0 + math.exp(-x))
        alpha = inp["g"][0, 0, hv].to(d).exp()
        S0 = inp["initial_state"][0, hv].to(d)
        S1 = (torch.eye(K, dtype=d) - beta * torch.outer(k, k)) @ torch.diag(alpha) @ S0
        S1 = S1 + beta * torch.outer(k, inp["v"][0, 0, hv].to(d))
        torch.testing.assert_close(h_r[0, hv], S1, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(o_r[0, 0, hv], S1.T @ (0.5 * q), rtol=1e-12, atol=1e-12)
    assert rel_rmse(o_r, o_c) < FP64_TOL and rel_rmse(h_r, h_c) < FP64_TOL


@pytest.mark.parametrize("fn", [kda_recurrent_reference, kda_chunked_reference], ids=["recurrent", "chunked"])
def test_beta_modes_equal_the_transform_applied_first(fn) -> None:
    """Varlen with a length-1 sequence, GVA, bf16 logits: each logit mode equals the prob mode on
    sigmoid(beta) (times 2 for logit_x2), the transform in fp64 as the oracle's compute dtype."""
    cu = [0, 1, 17, 40]
    inp = make_inputs(1, 40, 1, 2, 16, 8, dtype="bf16", beta_dtype="bf16", g_dtype="fp32", gate="softplus",
                      safe_gate=False, lower_bound=None, seed=12, device="cpu", cu_seqlens=cu,
                      with_initial_state=True, beta_mode="logit")
    logits = inp["beta"]
    assert (logits < 0).any() and (logits > 1).any()  # logits, not probabilities
    kw = dict(gate="softplus", l2norm_qk=True, output_final_state=True)
    for mode, factor in (("logit", 1.0), ("logit_x2", 2.0)):
        o, h = fn(**inp, **kw, beta_mode=mode)
        by_hand = factor * torch.sigmoid(logits.double())
        o_p, h_p = fn(**{**inp, "beta": by_hand}, **kw, beta_mode="prob")
        torch.testing.assert_close(o, o_p, rtol=0, atol=1e-12)
        torch.testing.assert_close(h, h_p, rtol=0, atol=1e-12)
    o_2, _ = fn(**inp, **kw, beta_mode="logit_x2")
    o_1, _ = fn(**inp, **kw, beta_mode="logit")
    assert rel_rmse(o_1, o_2) > 0.01  # the doubling is not lost


def test_kda_beta_and_make_inputs_beta_modes() -> None:
    x = torch.tensor([-30.0, -1.0, 0.0, 2.0, 30.0], dtype=torch.float64)
    assert kda_beta(x, "prob") is x
    torch.testing.assert_close(kda_beta(x, "logit"), 1 / (1 + torch.exp(-x)), rtol=0, atol=1e-15)
    torch.testing.assert_close(kda_beta(x, "logit_x2"), 2 / (1 + torch.exp(-x)), rtol=0, atol=1e-15)
    with pytest.raises(ValueError, match="beta_mode: expected one of"):
        kda_beta(x, "sigmoid")  # type: ignore[arg-type]
    kw = dict(dtype="fp32", beta_dtype="fp32", g_dtype="fp32", gate="precomputed", safe_gate=False,
              lower_bound=None, seed=3, device="cpu")
    prob = make_inputs(1, 64, 1, 2, 16, 8, **kw)
    logit = make_inputs(1, 64, 1, 2, 16, 8, **kw, beta_mode="logit_x2")
    assert ((prob["beta"] > 0) & (prob["beta"] < 1)).all()  # probabilities
    assert (logit["beta"] < 0).any() and (logit["beta"].abs() > 1).any()  # logits
    torch.testing.assert_close(prob["beta"], torch.sigmoid(logit["beta"]))  # the same draws
    assert all(torch.equal(prob[n], logit[n]) for n in ("q", "k", "v", "g"))
    with pytest.raises(ValueError, match="beta_mode"):
        make_inputs(1, 4, 1, 1, 16, 16, **kw, beta_mode="logits")  # type: ignore[arg-type]


def _naive_loop(inp: dict, cu: list[int], G: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Scalar-head loop in the first form of kda-math §2.0: S = (I - b k k^T) Diag(a) S + b k v^T."""
    d = torch.float64
    q, k, v, g, beta = (inp[n].to(d)[0] for n in ("q", "k", "v", "g", "beta"))
    h0 = inp["initial_state"].to(d)
    _, HV, V = v.shape
    K = q.shape[-1]
    o = torch.zeros(q.shape[0], HV, V, dtype=d)
    finals = torch.zeros(len(cu) - 1, HV, K, V, dtype=d)
    for i in range(len(cu) - 1):
        for hv in range(HV):
            S = h0[i, hv].clone()
            for t in range(cu[i], cu[i + 1]):
                kt, qt = k[t, hv // G], q[t, hv // G]
                transition = torch.eye(K, dtype=d) - beta[t, hv] * torch.outer(kt, kt)
                S = transition @ (g[t, hv].exp()[:, None] * S)
                S = S + beta[t, hv] * torch.outer(kt, v[t, hv])
                o[t, hv] = S.T @ (scale * qt)
            finals[i, hv] = S
    return o[None], finals


def test_recurrent_matches_scalar_loop() -> None:
    cu = [0, 1, 9, 30]
    inp = make_inputs(1, 30, 2, 4, 8, 6, dtype="fp32", beta_dtype="fp32", g_dtype="fp32", gate="precomputed",
                      safe_gate=False, lower_bound=None, seed=9, device="cpu", cu_seqlens=cu,
                      with_initial_state=True, l2norm_qk=False, mask_p=0.2, hard_reset=True)
    o_ref, h_ref = _naive_loop(inp, cu, G=2, scale=0.5)
    o, h = kda_recurrent_reference(**inp, scale=0.5, output_final_state=True)
    torch.testing.assert_close(o, o_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(h, h_ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("fn", [kda_recurrent_reference, kda_chunked_reference], ids=["recurrent", "chunked"])
def test_fixed_batch_equals_packed_varlen(fn) -> None:
    B, T = 3, 40
    inp = make_inputs(B, T, 1, 2, 16, 8, dtype="bf16", beta_dtype="bf16", g_dtype="fp32", gate="softplus",
                      safe_gate=False, lower_bound=None, seed=21, device="cpu", with_initial_state=True)
    kw = dict(gate="softplus", l2norm_qk=True, output_final_state=True)
    o_b, h_b = fn(**inp, **kw)
    packed = {n: (x.reshape(1, B * T, *x.shape[2:]) if n in ("q", "k", "v", "g", "beta") else x)
              for n, x in inp.items()}
    packed["cu_seqlens"] = torch.tensor([0, 40, 80, 120], dtype=torch.int32)
    o_p, h_p = fn(**packed, **kw)
    torch.testing.assert_close(o_p.reshape(B, T, 2, 8), o_b, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(h_p, h_b, rtol=1e-13, atol=1e-13)


def test_fp32_compute_close_to_fp64() -> None:
    inp = make_inputs(2, 65, 1, 1, 32, 32, dtype="bf16", beta_dtype="fp32", g_dtype="fp32",
                      gate="lower_bound", safe_gate=True, lower_bound=-5.0, seed=1, device="cpu",
                      with_initial_state=True)
    kw = dict(gate="lower_bound", lower_bound=-5.0, l2norm_qk=True, output_final_state=True)
    o64, h64 = kda_recurrent_reference(**inp, **kw)
    o32, h32 = kda_recurrent_reference(**inp, **kw, dtype=torch.float32)
    assert o32.dtype == torch.float64  # results are always returned in fp64
    assert rel_rmse(o64, o32) < 1e-5 and rel_rmse(h64, h32) < 1e-5


@pytest.mark.parametrize("fn", [kda_recurrent_reference, kda_chunked_reference], ids=["recurrent", "chunked"])
def test_hard_reset_forgets_history(fn) -> None:
    """A token with g = -1000 on every channel wipes the state: what follows equals a fresh start there."""
    T, r = 50, 23
    inp = make_inputs(1, T, 1, 1, 16, 8, dtype="fp32", beta_dtype="fp32", g_dtype="fp32", gate="precomputed",
                      safe_gate=False, lower_bound=None, seed=4, device="cpu", with_initial_state=True,
                      l2norm_qk=False)
    inp["g"][:, r] = -1000.0
    o, h = fn(**inp, output_final_state=True)
    tail = {n: (x[:, r:].contiguous() if n in ("q", "k", "v", "g", "beta") else x) for n, x in inp.items()}
    tail["initial_state"] = torch.zeros_like(inp["initial_state"])
    o_t, h_t = fn(**tail, output_final_state=True)
    torch.testing.assert_close(o[:, r:], o_t, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(h, h_t, rtol=1e-12, atol=1e-12)


def test_no_final_state_and_default_scale() -> None:
    inp = make_inputs(1, 5, 1, 1, 16, 8, dtype="fp32", beta_dtype="fp32", g_dtype="fp32", gate="precomputed",
                      safe_gate=False, lower_bound=None, seed=0, device="cpu")
    o, h = kda_recurrent_reference(**inp)
    assert h is None
    o2, _ = kda_recurrent_reference(**inp, scale=16**-0.5)
    assert torch.equal(o, o2)
    assert kda_chunked_reference(**inp)[1] is None


# ----------------------------------------------------------------------------------------------------------
# gate and l2norm
# ----------------------------------------------------------------------------------------------------------


def test_kda_gate_formulas() -> None:
    torch.manual_seed(0)
    HV, K = 3, 4
    g = torch.randn(2, 5, HV, K, dtype=torch.float64) * 4
    g[0, 0, 0, 0] = 30.0  # above the softplus threshold (20): softplus(x) == x
    A_log = torch.randn(HV, dtype=torch.float64)
    dt = torch.randn(HV * K, dtype=torch.float64)
    x = g + dt.reshape(HV, K)
    a = A_log.exp()[:, None]

    assert torch.equal(kda_gate(g, gate="precomputed", lower_bound=-5.0), g)
    sp = kda_gate(g, gate="softplus", A_log=A_log, dt_bias=dt)
    manual = -a * torch.where(x > 20, x, torch.log1p(torch.exp(x)))
    torch.testing.assert_close(sp, manual, rtol=1e-14, atol=0)
    assert sp[0, 0, 0, 0] == -a[0, 0] * x[0, 0, 0, 0]

    lb = kda_gate(g, gate="lower_bound", A_log=A_log, dt_bias=dt.reshape(HV, K), lower_bound=-5.0)
    torch.testing.assert_close(lb, -5.0 / (1 + torch.exp(-a * x)), rtol=1e-14, atol=0)
    assert (lb >= -5.0).all() and (lb <= 0).all()
    lb_no_a = kda_gate(g, gate="lower_bound", dt_bias=dt, lower_bound=-2.0)
    torch.testing.assert_close(lb_no_a, -2.0 * torch.sigmoid(x), rtol=1e-14, atol=0)

    assert kda_gate(g.bfloat16(), gate="softplus", A_log=A_log.float()).dtype == torch.float32
    assert sp.dtype == torch.float64
    with pytest.raises(ValueError, match="A_log"):
        kda_gate(g, gate="softplus")
    with pytest.raises(ValueError, match="lower_bound"):
        kda_gate(g, gate="lower_bound", A_log=A_log)
    with pytest.raises(ValueError, match="dt_bias"):
        kda_gate(g, gate="softplus", A_log=A_log, dt_bias=dt[:-1])
    with pytest.raises(ValueError, match="gate"):
        kda_gate(g, gate="sigmoid")  # type: ignore[arg-type]


def test_l2norm() -> None:
    x = torch.randn(3, 7, 64)
    y = l2norm(x.double())
    torch.testing.assert_close(y.norm(dim=-1), torch.ones(3, 7, dtype=torch.float64), rtol=1e-6, atol=1e-6)
    assert l2norm(x.bfloat16()).dtype == torch.bfloat16


# ----------------------------------------------------------------------------------------------------------
# metric (kda-math §4.1)
# ----------------------------------------------------------------------------------------------------------


def test_rel_rmse_value() -> None:
    ref = torch.ones(100, dtype=torch.float64)
    assert rel_rmse(ref, ref * 1.01) == pytest.approx(0.01 / (1 + 1e-8), rel=1e-9)
    assert rel_rmse(ref, ref) == 0.0


def test_assert_close_catches_one_percent_error() -> None:
    torch.manual_seed(0)
    ref = torch.randn(4, 64, 32, dtype=torch.float64)
    noise = torch.randn_like(ref)
    assert_close("o", ref, ref, 0.005)
    assert_close("o", ref, ref + 0.001 * noise, 0.005)  # 0.1 % relative RMSE passes
    assert_close("o", ref, (ref + 0.001 * noise).bfloat16(), 0.005)  # dtype of out does not matter
    with pytest.raises(AssertionError, match=r"^o: relative RMSE 1\.0\d*e-02 >= 5\.0+e-03"):
        assert_close("o", ref, ref + 0.01 * noise, 0.005)  # 1 % error is caught


def test_assert_close_abs_err_pass_nan_and_shape() -> None:
    tiny = torch.full((10,), 1e-9, dtype=torch.float64)
    assert_close("ht", tiny, torch.zeros(10), 1e-6)  # max abs err 1e-9 <= 1e-6 passes despite 100 % rel error
    ref = torch.ones(10)
    bad = ref.clone()
    bad[3] = float("nan")
    with pytest.raises(AssertionError, match="ht: 1 NaN of 10 elements in the output"):
        assert_close("ht", ref, bad, 0.5)
    with pytest.raises(AssertionError, match="NaN of 10 elements in the reference"):
        assert_close("ht", bad, ref, 0.5)
    with pytest.raises(AssertionError, match="ht: shape mismatch"):
        assert_close("ht", ref, ref[None], 0.5)
    with pytest.raises(AssertionError, match="relative RMSE inf"):
        assert_close("ht", ref, torch.full((10,), float("inf")), 0.5)


# ----------------------------------------------------------------------------------------------------------
# generators (kda-math §4.2, §4.4)
# ----------------------------------------------------------------------------------------------------------


def test_varlen_lengths() -> None:
    assert varlen_lengths(10, 4096, "uniform") == [415] + [409] * 9
    assert varlen_lengths(10, 4096, "skewed") == [4096 - 227 * 9] + [227] * 9
    assert varlen_lengths(1, 100, "skewed") == [100]
    for n in (10, 20):
        for total in (4096, 8192, 16384):
            for dist in ("uniform", "random", "skewed"):
                lens = varlen_lengths(n, total, dist)
                assert len(lens) == n and sum(lens) == total and min(lens) >= 1
    assert varlen_lengths(20, 8192, "random") == varlen_lengths(20, 8192, "random")
    assert len(set(varlen_lengths(20, 8192, "random"))) > 5
    with pytest.raises(ValueError, match="dist"):
        varlen_lengths(3, 10, "zipf")


def test_cu_seqlens_from_lengths() -> None:
    cu = cu_seqlens_from_lengths([3, 1, 5], "cpu")
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 4, 9]
    assert cu_seqlens_from_lengths([2], "cpu", dtype=torch.int64).dtype == torch.int64


def test_make_inputs_shapes_dtypes_and_determinism() -> None:
    kw = dict(dtype="bf16", beta_dtype="bf16", g_dtype="bf16", gate="softplus", safe_gate=False,
              lower_bound=None, device="cpu", cu_seqlens=[0, 3, 10], with_initial_state=True,
              state_layout="vk")
    a = make_inputs(1, 10, 2, 4, 16, 8, seed=5, **kw)
    b = make_inputs(1, 10, 2, 4, 16, 8, seed=5, **kw)
    c = make_inputs(1, 10, 2, 4, 16, 8, seed=6, **kw)
    assert a["q"].shape == (1, 10, 2, 16) and a["v"].shape == (1, 10, 4, 8)
    assert a["g"].shape == (1, 10, 4, 16) and a["beta"].shape == (1, 10, 4)
    assert a["q"].dtype == a["g"].dtype == a["beta"].dtype == torch.bfloat16
    assert a["A_log"].shape == (4,) and a["dt_bias"].shape == (64,) and a["A_log"].dtype == torch.float32
    assert a["initial_state"].shape == (2, 4, 8, 16) and a["initial_state"].dtype == torch.float32
    assert a["cu_seqlens"].dtype == torch.int32 and a["cu_seqlens"].tolist() == [0, 3, 10]
    assert all(torch.equal(a[n], b[n]) for n in ("q", "k", "v", "g", "beta", "initial_state"))
    assert not torch.equal(a["q"], c["q"])
    with pytest.raises(ValueError, match="cu_seqlens"):
        make_inputs(2, 10, 2, 4, 16, 8, seed=5, **kw)


def test_make_inputs_gates() -> None:
    base = dict(dtype="fp32", beta_dtype="fp32", g_dtype="fp32", seed=0, device="cpu")
    reset = make_inputs(2, 64, 1, 1, 16, 16, gate="precomputed", safe_gate=False, lower_bound=None,
                        mask_p=0.3, hard_reset=True, l2norm_qk=False, **base)
    assert (reset["g"] == -1000.0).any() and (reset["g"] <= 0).all()
    assert reset["A_log"] is None and reset["dt_bias"] is None
    torch.testing.assert_close(reset["q"].norm(dim=-1), torch.ones(2, 64, 1))  # pre-normalised without l2norm
    safe = make_inputs(2, 64, 1, 1, 16, 16, gate="precomputed", safe_gate=True, lower_bound=-5.0, mask_p=0.3,
                       hard_reset=True, gate_logit_normalizer=0.1, **base)
    assert safe["g"].min() >= -5.0 and safe["g"].max() <= 0.0 and (safe["g"] == -5.0).any()
    zeros = make_inputs(1, 64, 1, 1, 16, 16, gate="precomputed", safe_gate=False, lower_bound=None,
                        mask_p=0.5, **base)
    assert ((zeros["g"] == 0).float().mean() - 0.5).abs() < 0.05
    lb = make_inputs(1, 64, 1, 2, 16, 16, gate="lower_bound", safe_gate=False, lower_bound=-5.0, mask_p=0.2,
                     hard_reset=True, **base)
    assert (lb["g"] == 1000.0).any()
    decay = kda_gate(lb["g"], gate="lower_bound", A_log=lb["A_log"], dt_bias=lb["dt_bias"], lower_bound=-5.0)
    assert (decay[lb["g"] == 1000.0] == -5.0).all()
    with pytest.raises(ValueError, match="safe_gate"):
        make_inputs(1, 4, 1, 1, 16, 16, gate="softplus", safe_gate=True, lower_bound=-5.0, **base)
    with pytest.raises(ValueError, match="lower_bound"):
        make_inputs(1, 4, 1, 1, 16, 16, gate="lower_bound", safe_gate=False, lower_bound=None, **base)


def test_reference_input_validation() -> None:
    inp = make_inputs(2, 8, 2, 4, 16, 8, dtype="fp32", beta_dtype="fp32", g_dtype="fp32", gate="precomputed",
                      safe_gate=False, lower_bound=None, seed=0, device="cpu", with_initial_state=True)
    with pytest.raises(ValueError, match="cu_seqlens"):
        kda_recurrent_reference(**dict(inp, cu_seqlens=[0, 4, 8]))
    with pytest.raises(ValueError, match="initial_state"):
        kda_recurrent_reference(**dict(inp, initial_state=inp["initial_state"][:1]))
    with pytest.raises(ValueError, match="initial_state"):
        kda_recurrent_reference(**inp, state_layout="vk")  # a kv-shaped state with K != V
    with pytest.raises(ValueError, match="multiple"):
        three = {n: inp[n][:, :, :3] for n in ("v", "g", "beta")}
        kda_recurrent_reference(**dict(inp, **three, initial_state=None))
    one = {n: (x[:1] if n in ("q", "k", "v", "g", "beta") else x) for n, x in inp.items()}
    with pytest.raises(ValueError, match="non-decreasing"):
        kda_recurrent_reference(**dict(one, initial_state=None, cu_seqlens=[0, 5, 3, 8]))
    with pytest.raises(ValueError, match="cu_seqlens"):
        kda_recurrent_reference(**dict(one, initial_state=None, cu_seqlens=[1, 8]))
