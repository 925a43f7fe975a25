"""CPU tests of the differentiable oracle (``kdagen.reference.kda_reference_autograd``) in fp64.

The backward kernels' GPU tests take their expected gradients from this function, so here it must (1) compute
exactly the forward of ``kda_recurrent_reference`` over every mode, (2) have correct gradients for every input
(``torch.autograd.gradcheck`` against central finite differences, at tiny sizes), and (3) give the raw-gate
gradient of the lower-bound gate that the chain rule through ``lb * sigmoid(exp(A_log) * (g + dt_bias))``
gives. Imports ``kdagen.reference`` directly, never ``kdagen`` itself.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch

from kdagen.reference import (
    kda_chunked_reference,
    kda_gate,
    kda_recurrent_reference,
    kda_reference_autograd,
    make_inputs,
)

Tensor = torch.Tensor
FWD_ATOL = 1e-12  # autograd form vs kda_recurrent_reference, both fp64
GRAD_ATOL = 1e-11  # two fp64 autograd paths through the same math
LB = -5.0
GRAD_NAMES = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")


def _lb(gate: str) -> float | None:
    return LB if gate == "lower_bound" else None


def _inputs(
    *,
    B: int,
    T: int,
    H: int,
    HV: int,
    K: int,
    V: int,
    gate: str,
    cu: list[int] | None,
    init: bool,
    layout: str,
    l2norm_qk: bool,
    seed: int = 0,
    mask_p: float = 0.0,
    hard_reset: bool = False,
    beta_mode: str = "prob",
) -> dict[str, Tensor | None]:
    """FLA-style inputs from ``make_inputs``, every floating tensor cast to fp64 (A_log/dt_bias included)."""
    x = make_inputs(B, T, H, HV, K, V, dtype="fp32", beta_dtype="fp32", g_dtype="fp32", gate=gate,
                    safe_gate=False, lower_bound=_lb(gate), seed=seed, device="cpu", mask_p=mask_p,
                    hard_reset=hard_reset, l2norm_qk=l2norm_qk, cu_seqlens=cu, with_initial_state=init,
                    state_layout=layout, beta_mode=beta_mode)
    return {n: (t.double() if t is not None and t.is_floating_point() else t) for n, t in x.items()}


# ----------------------------------------------------------------------------------------------------------
# Forward equals kda_recurrent_reference
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "gate,l2norm_qk,group,init,varlen,layout",
    list(itertools.product(("precomputed", "softplus", "lower_bound"), (False, True), (1, 2), (False, True),
                           (False, True), ("kv", "vk"))),
)
def test_forward_matches_recurrent(
    gate: str, l2norm_qk: bool, group: int, init: bool, varlen: bool, layout: str
) -> None:
    # K != V so that a swapped state layout cannot pass; varlen includes a length-1 sequence.
    cu = [0, 1, 4, 7] if varlen else None
    B, H = (1, 2) if varlen else (2, 2)
    x = _inputs(B=B, T=7, H=H, HV=H * group, K=8, V=4, gate=gate, cu=cu, init=init, layout=layout,
                l2norm_qk=l2norm_qk, seed=7)
    kw = dict(gate=gate, lower_bound=_lb(gate), l2norm_qk=l2norm_qk, state_layout=layout,
              output_final_state=True, scale=0.7)
    o_ref, ht_ref = kda_recurrent_reference(**x, **kw)
    o, ht = kda_reference_autograd(**x, **kw)
    assert o.dtype == torch.float64 and ht.dtype == torch.float64
    assert o.shape == o_ref.shape and ht.shape == ht_ref.shape
    torch.testing.assert_close(o, o_ref, atol=FWD_ATOL, rtol=0)
    torch.testing.assert_close(ht, ht_ref, atol=FWD_ATOL, rtol=0)


@pytest.mark.parametrize("gate", ["precomputed", "softplus", "lower_bound"])
def test_forward_hard_reset_and_lower_bound_without_A_log(gate: str) -> None:
    # Masked gates and hard resets (kda-math §4.2); the lower-bound gate also in its A_log-free form.
    x = _inputs(B=1, T=9, H=1, HV=2, K=4, V=4, gate=gate, cu=[0, 5, 9], init=True, layout="kv",
                l2norm_qk=True, seed=3, mask_p=0.3, hard_reset=True)
    if gate == "lower_bound":
        x["A_log"] = None
    kw = dict(gate=gate, lower_bound=_lb(gate), l2norm_qk=True, output_final_state=True)
    o_ref, ht_ref = kda_recurrent_reference(**x, **kw)
    o, ht = kda_reference_autograd(**x, **kw)
    torch.testing.assert_close(o, o_ref, atol=FWD_ATOL, rtol=0)
    torch.testing.assert_close(ht, ht_ref, atol=FWD_ATOL, rtol=0)


def test_dtype_rule_and_no_final_state() -> None:
    # The compute dtype is the inputs' promoted dtype, at least fp32; without output_final_state: None.
    x = make_inputs(1, 3, 1, 1, 4, 4, dtype="bf16", beta_dtype="fp32", g_dtype="fp32", gate="precomputed",
                    safe_gate=False, lower_bound=None, seed=0, device="cpu")
    o, ht = kda_reference_autograd(**x)
    assert o.dtype == torch.float32 and ht is None
    x64 = {n: (t.double() if t is not None else t) for n, t in x.items()}
    o64, _ = kda_reference_autograd(**x64)
    assert o64.dtype == torch.float64


# ----------------------------------------------------------------------------------------------------------
# gradcheck of o and the final state w.r.t. every differentiable input
# ----------------------------------------------------------------------------------------------------------


def _grad_leaves(x: dict[str, Tensor | None], gate: str) -> dict[str, Tensor]:
    """The inputs that have a gradient for this gate mode, as fresh fp64 leaves."""
    names = [n for n in GRAD_NAMES if x.get(n) is not None]
    if gate == "precomputed":
        names = [n for n in names if n not in ("A_log", "dt_bias")]
    return {n: x[n].detach().clone().requires_grad_(True) for n in names}


def _as_fn(
    x: dict[str, Tensor | None], names: list[str], **kw: object
) -> Callable[..., tuple[Tensor, Tensor]]:
    """Positional-argument wrapper for gradcheck: (leaves in ``names`` order) -> (o, final_state)."""
    fixed = {n: t for n, t in x.items() if n not in names}
    if kw.get("gate") == "precomputed":
        fixed["A_log"] = fixed["dt_bias"] = None

    def fn(*leaves: Tensor) -> tuple[Tensor, Tensor]:
        o, ht = kda_reference_autograd(**fixed, **dict(zip(names, leaves)), output_final_state=True, **kw)
        return o, ht

    return fn


# Tiny on purpose (full-Jacobian gradcheck): T = 5, K = V = 4, GVA 2 (H = 1, HV = 2), two sequences, an
# initial state (so dh0 is checked) and the final state as a second output (so dht reaches every input).
GRADCHECK_CASES = [
    pytest.param(gate, l2, layout, id=f"{gate}-l2{int(l2)}-{layout}")
    for gate in ("precomputed", "softplus", "lower_bound")
    for l2, layout in ((False, "kv"), (True, "vk"))
]


@pytest.mark.parametrize("gate,l2norm_qk,layout", GRADCHECK_CASES)
def test_gradcheck_varlen_gva(gate: str, l2norm_qk: bool, layout: str) -> None:
    x = _inputs(B=1, T=5, H=1, HV=2, K=4, V=4, gate=gate, cu=[0, 2, 5], init=True, layout=layout,
                l2norm_qk=l2norm_qk, seed=11)
    leaves = _grad_leaves(x, gate)
    expected = {"q", "k", "v", "g", "beta", "initial_state"} | ({"A_log", "dt_bias"} if gate != "precomputed"
                                                                else set())
    assert set(leaves) == expected
    fn = _as_fn(x, list(leaves), gate=gate, lower_bound=_lb(gate), l2norm_qk=l2norm_qk, state_layout=layout)
    assert torch.autograd.gradcheck(fn, tuple(leaves.values()), eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("beta_mode", ["logit", "logit_x2"])
def test_gradcheck_beta_logits(beta_mode: str) -> None:
    # beta given as logits: the gradient reaches them through the (doubled) sigmoid.
    x = _inputs(B=1, T=5, H=1, HV=2, K=4, V=4, gate="lower_bound", cu=[0, 2, 5], init=True, layout="kv",
                l2norm_qk=True, seed=19, beta_mode=beta_mode)
    leaves = _grad_leaves(x, "lower_bound")
    fn = _as_fn(x, list(leaves), gate="lower_bound", lower_bound=LB, l2norm_qk=True, beta_mode=beta_mode)
    assert torch.autograd.gradcheck(fn, tuple(leaves.values()), eps=1e-6, atol=1e-7, rtol=1e-5)


def test_gradcheck_fixed_batch_without_initial_state() -> None:
    # Fixed length B = 2, H = HV = 2 (no GVA), zero initial state, default scale.
    x = _inputs(B=2, T=3, H=2, HV=2, K=4, V=4, gate="precomputed", cu=None, init=False, layout="kv",
                l2norm_qk=False, seed=5)
    leaves = _grad_leaves(x, "precomputed")
    assert "initial_state" not in leaves
    fn = _as_fn(x, list(leaves), gate="precomputed")
    assert torch.autograd.gradcheck(fn, tuple(leaves.values()), eps=1e-6, atol=1e-7, rtol=1e-5)


# ----------------------------------------------------------------------------------------------------------
# Gradients against independent paths
# ----------------------------------------------------------------------------------------------------------


def _vjp(
    fn: Callable[..., tuple[Tensor, Tensor]], leaves: dict[str, Tensor], do: Tensor, dht: Tensor
) -> dict[str, Tensor]:
    """Gradients of ``(o * do).sum() + (ht * dht).sum()``: the loss of FLA's backward tests (§4.2)."""
    o, ht = fn(**leaves)
    grads = torch.autograd.grad((o * do).sum() + (ht * dht).sum(), list(leaves.values()))
    return dict(zip(leaves, grads))


def test_lower_bound_gate_chain_rule() -> None:
    x = _inputs(B=1, T=6, H=1, HV=2, K=4, V=4, gate="lower_bound", cu=[0, 2, 6], init=True, layout="kv",
                l2norm_qk=True, seed=13)
    gen = torch.Generator().manual_seed(1)
    do = torch.randn(1, 6, 2, 4, generator=gen, dtype=torch.float64)
    dht = torch.randn(2, 2, 4, 4, generator=gen, dtype=torch.float64)
    kw = dict(l2norm_qk=True, output_final_state=True)
    rest = {n: x[n] for n in ("q", "k", "v", "beta", "initial_state", "cu_seqlens")}

    # Path A: the in-kernel lower-bound gate of kda_reference_autograd.
    leaves = _grad_leaves(x, "lower_bound")
    g_a = {n: leaves[n] for n in ("g", "A_log", "dt_bias")}
    ga = _vjp(lambda **lv: kda_reference_autograd(**rest, **lv, gate="lower_bound", lower_bound=LB, **kw),
              g_a, do, dht)

    # Path B: autograd through kda_gate, then the precomputed-gate recurrence.
    g_b = {n: x[n].detach().clone().requires_grad_(True) for n in ("g", "A_log", "dt_bias")}

    def via_gate(g: Tensor, A_log: Tensor, dt_bias: Tensor) -> tuple[Tensor, Tensor]:
        gd = kda_gate(g, gate="lower_bound", A_log=A_log, dt_bias=dt_bias, lower_bound=LB)
        return kda_reference_autograd(**rest, g=gd, gate="precomputed", **kw)

    gb = _vjp(via_gate, g_b, do, dht)

    # Path C: the chain rule written out. With a = exp(A_log), x = g + dt_bias, s = sigmoid(a x), the gate is
    # lb s, so d gate = lb s (1 - s) (a dx + a x dA_log); dt_bias sums over tokens, A_log over tokens and K.
    gd0 = kda_gate(x["g"], gate="lower_bound", A_log=x["A_log"], dt_bias=x["dt_bias"], lower_bound=LB)
    gd0 = gd0.detach().requires_grad_(True)
    dgate = _vjp(lambda g: kda_reference_autograd(**rest, g=g, gate="precomputed", **kw),
                 {"g": gd0}, do, dht)["g"]
    HV, K = 2, 4
    a = x["A_log"].exp().reshape(HV, 1)
    xr = x["g"] + x["dt_bias"].reshape(HV, K)
    s = torch.sigmoid(a * xr)
    dpre = dgate * LB * s * (1 - s)  # d loss / d (a x)
    gc = {
        "g": dpre * a,
        "dt_bias": (dpre * a).sum(dim=(0, 1)).reshape(HV * K),
        "A_log": (dpre * xr * a).sum(dim=(0, 1, 3)),
    }
    for n in ("g", "A_log", "dt_bias"):
        assert ga[n].abs().max() > 0, n
        torch.testing.assert_close(ga[n], gb[n], atol=GRAD_ATOL, rtol=0, msg=lambda m, n=n: f"{n} A/B: {m}")
        torch.testing.assert_close(ga[n], gc[n], atol=GRAD_ATOL, rtol=0, msg=lambda m, n=n: f"{n} A/C: {m}")


@pytest.mark.parametrize(("beta_mode", "factor"), [("logit", 1.0), ("logit_x2", 2.0)])
def test_beta_logit_chain_rule(beta_mode: str, factor: float) -> None:
    # d loss / d logit = d loss / d beta * c s (1 - s), s = sigmoid(logit), c = 1 or 2: the gradient of the
    # prob-mode recurrence at beta = c s, times the sigmoid's derivative written out.
    x = _inputs(B=1, T=6, H=1, HV=2, K=4, V=4, gate="precomputed", cu=[0, 2, 6], init=True, layout="vk",
                l2norm_qk=True, seed=23, beta_mode=beta_mode)
    gen = torch.Generator().manual_seed(3)
    do = torch.randn(1, 6, 2, 4, generator=gen, dtype=torch.float64)
    dht = torch.randn(2, 2, 4, 4, generator=gen, dtype=torch.float64)
    kw = dict(l2norm_qk=True, state_layout="vk", output_final_state=True, A_log=None, dt_bias=None)
    rest = {n: x[n] for n in ("q", "k", "v", "g", "initial_state", "cu_seqlens")}
    logit = x["beta"].detach().clone().requires_grad_(True)
    ga = _vjp(lambda beta: kda_reference_autograd(**rest, beta=beta, beta_mode=beta_mode, **kw),
              {"beta": logit}, do, dht)["beta"]
    s = torch.sigmoid(x["beta"])
    prob = (factor * s).detach().requires_grad_(True)
    gp = _vjp(lambda beta: kda_reference_autograd(**rest, beta=beta, **kw), {"beta": prob}, do, dht)["beta"]
    assert ga.abs().max() > 0
    torch.testing.assert_close(ga, gp * factor * s * (1 - s), atol=GRAD_ATOL, rtol=0)


@pytest.mark.parametrize("gate", ["precomputed", "softplus"])
def test_gradients_match_chunked_formulation(gate: str) -> None:
    # An independent formulation (chunks of 2: partial chunks, triangular solve) gives the same gradients.
    x = _inputs(B=1, T=7, H=1, HV=2, K=4, V=3, gate=gate, cu=[0, 3, 7], init=True, layout="vk",
                l2norm_qk=True, seed=17)
    gen = torch.Generator().manual_seed(2)
    do = torch.randn(1, 7, 2, 3, generator=gen, dtype=torch.float64)
    dht = torch.randn(2, 2, 3, 4, generator=gen, dtype=torch.float64)
    kw = dict(gate=gate, l2norm_qk=True, state_layout="vk", output_final_state=True,
              cu_seqlens=x["cu_seqlens"])
    leaves = _grad_leaves(x, gate)
    fixed = {} if gate != "precomputed" else {"A_log": None, "dt_bias": None}
    ga = _vjp(lambda **lv: kda_reference_autograd(**lv, **fixed, **kw), leaves, do, dht)
    leaves_c = {n: t.detach().clone().requires_grad_(True) for n, t in leaves.items()}
    gc = _vjp(lambda **lv: kda_chunked_reference(**lv, **fixed, **kw, chunk_size=2), leaves_c, do, dht)
    for n in leaves:
        torch.testing.assert_close(ga[n], gc[n], atol=1e-10, rtol=0, msg=lambda m, n=n: f"{n}: {m}")
