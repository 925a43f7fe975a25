"""GPU checks of the framework layer: `kdagen.fla.chunk_kda` against FLA's own `chunk_kda` (when `fla` is
importable; otherwise against the fp64 reference), and the ``kdagen::forward`` custom op under
`torch.compile(fullgraph=True)` against the eager call.

Every test needs a CUDA GPU (sm_90a); without one the whole module is skipped.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch

import kdagen
from kdagen import fla, ops
from kdagen.reference import assert_close, kda_recurrent_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA GPU (kdagen kernels target sm_90a); torch.cuda.is_available() is False",
    ),
]

HAS_FLA = importlib.util.find_spec("fla") is not None
TOL_REF = 0.005  # relative RMSE against the fp64 reference (as tests/gpu/test_numerics.py)
TOL_FLA = 0.01  # relative RMSE between two bf16 kernels, each within TOL_REF of the reference


def _inputs(T: int, H: int, HV: int, K: int, V: int, raw_gate: bool, seed: int = 0,
            beta_logits: bool = False) -> dict[str, Any]:
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device="cuda").to(dtype)

    g = randn(1, T, HV, K, dtype=torch.float32)
    if not raw_gate:  # a precomputed log-decay within the safe range [-5, 0)
        g = -torch.rand(1, T, HV, K, generator=gen, device="cuda") * 0.5
    beta = randn(1, T, HV, dtype=torch.float32) if beta_logits else torch.rand(1, T, HV, generator=gen,
                                                                                 device="cuda")
    return {"q": randn(1, T, H, K), "k": randn(1, T, H, K), "v": randn(1, T, HV, V), "g": g, "beta": beta}


# (id, head counts, FLA flags): the in-kernel lower_bound gate with l2norm, GVA 2 and a V-first state; the
# precomputed safe gate with the K-first state; beta logits with the in-kernel 2 sigmoid, as engines call it.
CASES = [
    ("lb-safe-l2-gva2-vk", dict(H=2, HV=4), dict(use_gate_in_kernel=True, safe_gate=True, lower_bound=-5.0,
                                                 use_qk_l2norm_in_kernel=True, state_v_first=True)),
    ("precomputed-safe-kv", dict(H=4, HV=4), dict(safe_gate=True, use_qk_l2norm_in_kernel=True)),
    ("lb-safe-l2-vk-beta-logit_x2", dict(H=4, HV=4),
     dict(use_gate_in_kernel=True, safe_gate=True, lower_bound=-5.0, use_qk_l2norm_in_kernel=True,
          state_v_first=True, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True)),
]


@pytest.mark.parametrize("heads,flags", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_chunk_kda_matches_fla(heads: dict[str, int], flags: dict[str, Any]) -> None:
    K = V = 128
    HV = heads["HV"]
    inp = _inputs(T=333, K=K, V=V, raw_gate=flags.get("use_gate_in_kernel", False),
                  beta_logits=flags.get("use_beta_sigmoid_in_kernel", False), **heads)
    cu = torch.tensor([0, 1, 200, 333], dtype=torch.int64, device="cuda")
    v_first = flags.get("state_v_first", False)
    h0 = torch.randn(3, HV, V, K, device="cuda") if v_first else torch.randn(3, HV, K, V, device="cuda")
    gate = {}
    if flags.get("use_gate_in_kernel"):
        gate = {"A_log": torch.randn(HV, device="cuda") * 0.1,
                "dt_bias": torch.randn(HV * K, device="cuda") * 0.1}
    kwargs = dict(initial_state=h0, output_final_state=True, cu_seqlens=cu, **flags, **gate)
    with torch.inference_mode():
        o, ht = fla.chunk_kda(**inp, **kwargs)
    torch.cuda.synchronize()
    if HAS_FLA:
        from fla.ops.kda import chunk_kda as fla_chunk_kda

        with torch.inference_mode():
            want_o, want_ht = fla_chunk_kda(**inp, **kwargs)
        tol = TOL_FLA
    else:
        spec = fla.choose_spec(inp["q"], inp["v"], inp["g"], inp["beta"], **{
            f: flags[f] for f in ("use_qk_l2norm_in_kernel", "use_gate_in_kernel", "safe_gate", "lower_bound",
                                  "state_v_first", "use_beta_sigmoid_in_kernel", "allow_neg_eigval")
            if f in flags})
        want_o, want_ht = kda_recurrent_reference(
            **inp, initial_state=h0, output_final_state=True, cu_seqlens=cu, gate=spec.gate,
            lower_bound=spec.lower_bound, l2norm_qk=spec.l2norm_qk, state_layout=spec.state_layout,
            beta_mode=spec.beta, **gate)
        tol = TOL_REF
    assert o.dtype == inp["q"].dtype and tuple(o.shape) == (1, 333, HV, V)
    assert_close("o", want_o.double(), o, tol)
    assert_close("ht", want_ht.double(), ht, tol)


class _Layer(torch.nn.Module):
    """A layer calling the op between torch ops, as a model would."""

    def __init__(self, spec: dict[str, Any]) -> None:
        super().__init__()
        self.spec_json = ops.spec_json(spec)

    def forward(self, q, k, v, g, beta, A_log, dt_bias, cu_seqlens):
        o, ht = ops.kda_forward(self.spec_json, q * 1.0, k, v, g, beta, A_log=A_log, dt_bias=dt_bias,
                                output_final_state=True, cu_seqlens=cu_seqlens)
        return o, o.float().square().mean(dim=-1), ht


OP_SPEC = {"arch": "sm_90a", "gate": "lower_bound", "lower_bound": -5.0, "safe_gate": True}


def test_custom_op_under_torch_compile_matches_eager() -> None:
    spec = dict(OP_SPEC)
    HV, K = 4, 128
    inp = _inputs(T=257, H=4, HV=HV, K=K, V=128, raw_gate=True, seed=1)
    args = (inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], torch.randn(HV, device="cuda") * 0.1,
            torch.randn(HV * K, device="cuda") * 0.1, torch.tensor([0, 100, 257], dtype=torch.int32,
                                                                   device="cuda"))
    layer = _Layer(spec)
    kdagen.get_kernel(spec)  # build outside the traced region
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True)
    with torch.inference_mode():
        want = layer(*args)
        got = compiled(*args)
    torch.cuda.synchronize()
    for name, w, g in zip(("o", "o_sq", "ht"), want, got):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        torch.testing.assert_close(g, w, msg=lambda m, name=name: f"{name}: {m}")


# FLA's flags of the serving step on a pool (beside state_v_first, indices and the gate's parameters)
POOL_FLAGS = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, lower_bound=-5.0)


@pytest.mark.skipif(not HAS_FLA, reason="compares with FLA's fused_recurrent_kda_fwd (no fla-core)")
@pytest.mark.parametrize("state_v_first", [False, True], ids=["kv", "vk"])
def test_fused_recurrent_kda_fwd_matches_fla_on_a_pool(state_v_first: bool) -> None:
    """The serving step on a pool with FLA's verify semantics (2 tokens a request, one slot a token)."""
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd as fla_fwd

    n, s, h, K = 3, 2, 2, 128
    inp = {name: x.view(n, s, *x.shape[2:]) for name, x in _inputs(T=n * s, H=h, HV=h, K=K, V=K,
                                                                     raw_gate=True).items()}
    gate = {"A_log": torch.randn(h, device="cuda") * 0.1, "dt_bias": torch.randn(h * K, device="cuda") * 0.1}
    pool = torch.randn(8, h, K, K, device="cuda") * 0.1
    idx = torch.tensor([[0, 1], [2, 3], [5, 6]], device="cuda")
    accepted = torch.tensor([1, 2, 1], device="cuda")
    flags = dict(**POOL_FLAGS, state_v_first=state_v_first, ssm_state_indices=idx,
                 num_accepted_tokens=accepted, **gate)
    ours_pool, theirs_pool = pool.clone(), pool.clone()
    with torch.inference_mode():
        o, _ = fla.fused_recurrent_kda_fwd(**inp, initial_state=ours_pool, **flags)
        want_o, _ = fla_fwd(**inp, initial_state=theirs_pool, **flags)
    torch.cuda.synchronize()
    assert_close("o", want_o.double(), o, TOL_FLA)
    written = idx.flatten()
    assert_close("pool", theirs_pool[written].double(), ours_pool[written], TOL_FLA)
