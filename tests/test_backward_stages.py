"""The stagewise fp64 backward oracle (`kda_chunked_backward_stages`, FLA's chunked backward formulas of
kda-math §8) against torch.autograd of the token recurrence (`kda_reference_autograd`): dq, dk, dv, dg,
dbeta, dh0 (and, through the gate's and beta's own backward, dA_log, ddt_bias and the raw gate's and
logits' gradients) agree to the fp64 rounding floor over gate forms, hard resets, GVA, varlen, both state
layouts and partial chunks."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kdagen.reference import (
    kda_beta,
    kda_chunked_backward_stages,
    kda_gate,
    kda_reference_autograd,
    make_inputs,
)

F64 = torch.float64

# (B, T, H, HV, K, V, chunk, cu_seqlens, layout, gate, extra make_inputs keywords)
CASES = [
    (1, 40, 2, 2, 16, 8, 16, None, "kv", "precomputed", {}),
    (2, 37, 1, 2, 8, 8, 16, None, "vk", "precomputed", {}),
    (1, 50, 2, 4, 8, 16, 16, [0, 7, 30, 50], "kv", "precomputed", {}),
    (1, 70, 1, 1, 16, 16, 64, [0, 64, 70], "kv", "precomputed", {}),
    (2, 33, 2, 2, 8, 8, 16, None, "kv", "lower_bound", {}),
    (1, 48, 1, 1, 8, 8, 16, None, "vk", "precomputed", {"mask_p": 0.2, "hard_reset": True}),
    (1, 35, 2, 2, 8, 8, 16, None, "kv", "softplus", {"beta_mode": "logit"}),
]


def _run(case: tuple, seed: int = 1) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, Any]]:
    B, T, H, HV, K, V, chunk, cu, layout, gate, extra = case
    beta_mode = extra.pop("beta_mode", "prob")
    lb = -5.0 if gate == "lower_bound" else None
    inp = make_inputs(B, T, H, HV, K, V, dtype=F64, beta_dtype=F64, g_dtype=F64, gate=gate,
                      safe_gate=lb is not None, lower_bound=lb, seed=seed, device="cpu", l2norm_qk=False,
                      cu_seqlens=cu, with_initial_state=True, state_layout=layout, beta_mode=beta_mode,
                      **extra)
    for name in ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias"):
        if inp[name] is not None:
            inp[name] = inp[name].detach().to(F64).requires_grad_(True)
    kw = {"scale": 0.3, "cu_seqlens": cu, "state_layout": layout, "gate": gate, "A_log": inp["A_log"],
          "dt_bias": inp["dt_bias"], "lower_bound": lb, "beta_mode": beta_mode}
    o, ht = kda_reference_autograd(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"],
                                   initial_state=inp["initial_state"], output_final_state=True, **kw)
    gen = torch.Generator().manual_seed(seed + 100)
    do = torch.randn(o.shape, generator=gen, dtype=F64)
    dht = torch.randn(ht.shape, generator=gen, dtype=F64)
    ((o * do).sum() + (ht * dht).sum()).backward()
    stages = kda_chunked_backward_stages(
        *(inp[name].detach() for name in ("q", "k", "v", "g", "beta")), do, dht=dht,
        initial_state=inp["initial_state"].detach(), chunk_size=chunk, **kw)
    return inp, stages, {"H": H, "HV": HV, "K": K, "chunk": chunk, "cu": cu, "B": B, "T": T, "gate": gate,
                         "lb": lb, "beta_mode": beta_mode}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().norm() / b.detach().norm())


@pytest.mark.parametrize("case", CASES, ids=[f"{c[9]}-{c[8]}-HV{c[3]}-{'varlen' if c[7] else 'fixed'}-{i}"
                                             for i, c in enumerate(CASES)])
def test_stages_give_autograds_dq_dv_dh0(case: tuple) -> None:
    inp, st, m = _run(tuple(x.copy() if isinstance(x, dict) else x for x in case))
    assert torch.isfinite(st["dq"]).all() and torch.isfinite(st["dh"]).all()
    # q and k as prepared (scale applied to q, both expanded to the value heads): summed over each group
    group = (*st["dq"].shape[:2], m["H"], m["HV"] // m["H"], m["K"])
    assert _rel(st["dq"].view(group).sum(3) * 0.3, inp["q"].grad) < 1e-12
    assert _rel(st["dk"].view(group).sum(3), inp["k"].grad) < 1e-12
    assert _rel(st["dv"], inp["v"].grad) < 1e-12
    assert _rel(st["dh0"], inp["initial_state"].grad) < 1e-12
    # the gate's and beta's own backward (kda_gate, kda_beta) carry dg and dbeta to the raw inputs
    raw = [inp["g"]] + [inp[n] for n in ("A_log", "dt_bias") if inp[n] is not None]
    gate = kda_gate(inp["g"], gate=m["gate"], A_log=inp["A_log"], dt_bias=inp["dt_bias"], lower_bound=m["lb"])
    for x, want in zip(raw, torch.autograd.grad(gate, raw, st["dg"])):
        assert _rel(want, x.grad) < 1e-12
    (dbeta,) = torch.autograd.grad(kda_beta(inp["beta"], m["beta_mode"]), [inp["beta"]], st["dbeta"])
    assert _rel(dbeta, inp["beta"].grad) < 1e-12


def test_chunk_state_gradients_and_dAqk_shape() -> None:
    inp, st, m = _run(CASES[2])
    cu, chunk = m["cu"], m["chunk"]
    firsts, count = [], 0
    for bos, eos in zip(cu[:-1], cu[1:]):
        firsts.append(count)
        count += -(-(eos - bos) // chunk)
    assert st["dh"].shape[0] == count
    # the gradient of the state entering a sequence's first chunk is that sequence's dh0 (kv layout here)
    assert torch.equal(st["dh"][firsts], st["dh0"])
    # dAqk rows hold their chunk's columns, lower triangle with the diagonal only
    for bos, eos in zip(cu[:-1], cu[1:]):
        for c0 in range(bos, eos, chunk):
            block = st["dAqk"][0, c0:min(c0 + chunk, eos)]  # [n, HV, chunk]
            n = block.shape[0]
            upper = torch.triu(torch.ones(n, chunk, dtype=torch.bool), diagonal=1)
            assert not block.permute(1, 0, 2)[:, upper].any()
