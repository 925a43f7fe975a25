"""Every tile's gradients of the prepared inputs from the backward's products with the states.

The `bwd_tile` stage gives, per 16-token tile, the gradients of the folded forward step's operands
(R = V - Kd S, O = Qd S + Aq R, S' = diag(gt) S + Akt^T R, with Kd = K exp(G), Qd = Q exp(G),
Akt = P^T Kg, Aq = Aqk P, gt = exp(G_last), P = (I + L)^-1 diag(beta)):
``dqd`` = dO S^T, ``dkd`` = -dR S^T, ``dakt`` = R dS'^T, ``daq`` = dO R^T and ``dgt`` = the row sums of
S * dS'. What is left is small per-tile algebra, here in torch (the `bwd_grads` stage's reference; the
backward runs the stage): through Aq and Akt to P, Aqk and Kg
(dP = Aqk^T dAq + Kg dAkt^T, dAqk = dAq P^T, dKg = P dAkt), then FLA's stage formulas from dP on
(`kdagen.chunk_math.backward_from_dA`: the inverse's dL, dbeta, the intra-tile products back to q, k and
the decays, dg by the reverse cumsum; kda-math §8), as `chunk_stage_backward` continues from its
dA = dV_new R^T. No tensor of a state's size (K x V) is built.
"""

from __future__ import annotations

from typing import Any

import torch

from kdagen.arch import CHUNK
from kdagen.backward_local import TileMap, _slab_tiles, tile_map
from kdagen.chunk_math import backward_from_dA, chunk_parts
from kdagen.reference import kda_beta, kda_gate, l2norm

__all__ = ["grads_from_products", "tile_grads", "input_grads", "DEFAULT_MAX_BATCH"]

# `kdagen.reference.l2norm`'s eps and the softplus gate's threshold (kda-math §2.1, §2.2): the backward
# differentiates the forms the kernels compute.
L2NORM_EPS = 1e-6
SOFTPLUS_THRESHOLD = 20.0

Tensor = torch.Tensor

# Batch entries (tile x value head) a slab: the largest tensors are [batch, 16, K] (no pairwise [16, 16, K]
# decays in the anchored form; with the pairwise form, four of those at 128 KiB an entry in fp32 at K = 128).
DEFAULT_MAX_BATCH = 4096


def grads_from_products(qc: Tensor, kc: Tensor, gc: Tensor, bc: Tensor, dqd: Tensor, dkd: Tensor,
                        dakt: Tensor, daq: Tensor, dgt: Tensor, *,
                        anchored: bool = False) -> dict[str, Tensor]:
    """One batch of tiles ([Bt, n, *], the prepared q, k, natural-log g and beta) from the products
    ``dqd``, ``dkd``, ``dakt`` [Bt, n, K], ``daq`` [Bt, n, n] and ``dgt`` [Bt, K]: dq, dk, dg [Bt, n, K] and
    dbeta [Bt, n]. ``anchored`` as in `chunk_parts` (only for g >= -5)."""
    bt, n, K = qc.shape
    dummy = qc.new_zeros((bt, n, 1))
    c = chunk_parts(qc, kc, dummy, gc, bc, qc.new_zeros((bt, K, 1)), anchored=anchored)
    zero = torch.zeros((), dtype=qc.dtype, device=qc.device)
    # Aq = Aqk P and Akt = P^T Kg back to P, Aqk and Kg; then the stages after dA (P is chunk_math's A), with
    # dQd = dqd (of Q * exp(G)) and dKd = dkd (of K * exp(G)).
    P = c["A"]
    dP = c["Aqk"].transpose(1, 2) @ daq + c["kg"] @ dakt.transpose(1, 2)
    dAqk = torch.where(c["incl"], daq @ P.transpose(1, 2), zero)
    return backward_from_dA(c, qc, kc, bc, dP, dAqk, dqd, dkd, P @ dakt, dgt, anchored=anchored)


def tile_grads(q: Tensor, k: Tensor, g: Tensor, beta: Tensor, dqd: Tensor, dkd: Tensor, dakt: Tensor,
               daq: Tensor, dgt: Tensor, tmap: TileMap, *, anchored: bool = False,
               max_batch: int | None = None) -> dict[str, Tensor]:
    """`grads_from_products` over every tile of a call, token-major: q, k, g [total, HV, K] (prepared, g the
    natural-log decay), beta [total, HV]; the products dqd, dkd, dakt [total, HV, K], daq [total, HV, 16] and
    dgt [slots, HV, K] (at each tile's id). Returns dq, dk, dg [total, HV, K] and dbeta [total, HV] in fp32
    (fp64 for fp64 inputs), in slabs of ``max_batch`` (default `DEFAULT_MAX_BATCH`) tiles x heads, without
    host synchronisation."""
    total, hv, kdim = q.shape
    slots = tmap.slots
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    dev = q.device
    outs = {name: torch.empty((total + 1, *x.shape[1:]), dtype=dt, device=dev)
            for name, x in (("dq", q), ("dk", k), ("dg", g), ("dbeta", beta))}
    if total == 0:
        return {name: x[:0] for name, x in outs.items()}
    # The token at each (tile, row), `total` where none sits (rows past a sequence's end, unused tile ids):
    # those rows are zero, reach no token, and write their gradients to the row past the tokens.
    src = torch.full((slots * CHUNK,), total, dtype=torch.int64, device=dev)
    src[tmap.tile * CHUNK + tmap.row] = torch.arange(total, dtype=torch.int64, device=dev)
    per = max(1, (max_batch or DEFAULT_MAX_BATCH) // hv)
    for t0 in range(0, slots, per):
        t1 = min(t0 + per, slots)
        nt = t1 - t0
        idx = src[t0 * CHUNK:t1 * CHUNK]
        real = idx < total
        take = idx.clamp(max=total - 1)
        tiles = [_slab_tiles(x, take, real, nt, dt) for x in (q, k, g, beta, dqd, dkd, dakt, daq)]
        dgt_s = dgt[t0:t1].to(dt).reshape(nt * hv, kdim)
        grads = grads_from_products(*tiles, dgt_s, anchored=anchored)
        for name, out in outs.items():
            x = grads[name]  # [nt * HV, 16, *]
            rows = x.view(nt, hv, CHUNK, *x.shape[2:]).transpose(1, 2).reshape(nt * CHUNK, *out.shape[1:])
            out.index_copy_(0, idx, rows)
    return {name: x[:total] for name, x in outs.items()}


def input_grads(spec: Any, q: Tensor, k: Tensor, g: Tensor, beta: Tensor, A_log: Tensor | None,
                dt_bias: Tensor | None, dqd: Tensor, dkd: Tensor, dakt: Tensor, daq: Tensor, dgt: Tensor,
                cu: Tensor, scale: float) -> dict[str, Tensor | None]:
    """What the `bwd_grads` stage computes, in torch: from the call's inputs as given (q, k [T, H, K], g
    [T, HV, K], beta [T, HV], the gate's A_log and dt_bias or None) and `bwd_tile`'s products, the gradients
    of those inputs (fp32): dq and dk (the GVA sums, through the scale and the l2norm), dg (through the
    gate), dbeta (through beta's transform), dA_log and ddt_bias (None where not given)."""
    total, nh, kdim = q.shape
    hv = g.shape[1]
    group = hv // nh
    f32 = torch.float64 if q.dtype == torch.float64 else torch.float32
    qf, kf = q.to(f32), k.to(f32)
    qp, kp = (l2norm(qf), l2norm(kf)) if spec.l2norm_qk else (qf, kf)
    qp = (qp * scale).repeat_interleave(group, dim=1)
    kp = kp.repeat_interleave(group, dim=1)
    a_log = A_log
    if a_log is None and spec.gate == "softplus":  # the kernels' default: exp(A_log) = 1
        a_log = torch.zeros(hv, dtype=f32, device=q.device)
    gp = kda_gate(g.to(f32), gate=spec.gate, A_log=a_log, dt_bias=dt_bias, lower_bound=spec.lower_bound)
    bp = kda_beta(beta.to(f32), spec.beta)
    grads = tile_grads(qp, kp, gp, bp, dqd, dkd, dakt, daq, dgt, tile_map(cu, total), anchored=spec.safe_gate)
    dq = _qk_backward(qf, grads["dq"].view(total, nh, group, kdim).sum(2) * scale, spec.l2norm_qk)
    dk = _qk_backward(kf, grads["dk"].view(total, nh, group, kdim).sum(2), spec.l2norm_qk)
    dg, d_alog, d_bias = _gate_backward(spec.gate, spec.lower_bound, g, grads["dg"], A_log, dt_bias)
    dbeta = _beta_backward(spec.beta, beta, grads["dbeta"])
    return {"dq": dq, "dk": dk, "dg": dg, "dbeta": dbeta, "dA_log": d_alog, "ddt_bias": d_bias}


def _qk_backward(x: torch.Tensor, dy: torch.Tensor, l2norm_qk: bool) -> torch.Tensor:
    """The gradient of x (fp32) from that of l2norm(x) (or of x itself): y = x r, r = (|x|^2 + eps)^-1/2,
    dx = r (dy - y (y . dy))."""
    if not l2norm_qk:
        return dy
    r = torch.rsqrt(x.square().sum(-1, keepdim=True) + L2NORM_EPS)
    y = x * r
    return r * (dy - y * (dy * y).sum(-1, keepdim=True))


def _gate_backward(gate: str, lower_bound: float | None, g: torch.Tensor, dg: torch.Tensor,
                   A_log: torch.Tensor | None, dt_bias: torch.Tensor | None,
                   ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(d g_raw, dA_log, ddt_bias) from the gradient of the log-decay, for `kda_gate`'s forms (kda-math
    §2.1): lower_bound lb sigmoid(a (x + b)), softplus -a softplus(x + b) (threshold 20), a = exp(A_log)."""
    if gate == "precomputed":
        return dg, None, None
    hv, kdim = g.shape[-2], g.shape[-1]
    x = g.to(torch.float32)
    if dt_bias is not None:
        x = x + dt_bias.to(torch.float32).reshape(hv, kdim)
    a = None if A_log is None else A_log.to(torch.float32).exp().reshape(hv, 1)
    if gate == "lower_bound":
        z = x if a is None else a * x
        s = torch.sigmoid(z)
        dz = dg * (float(lower_bound) * s * (1.0 - s))  # type: ignore[arg-type]
        dx = dz if a is None else dz * a
        da = None if a is None else dz * z  # d/dA_log of a x is a x
    else:
        a1 = torch.ones((hv, 1), dtype=torch.float32, device=g.device) if a is None else a
        slope = torch.where(x > SOFTPLUS_THRESHOLD, torch.ones_like(x), torch.sigmoid(x))
        dx = -dg * a1 * slope
        da = None if a is None else -dg * a1 * torch.nn.functional.softplus(x, 1.0, SOFTPLUS_THRESHOLD)
    token_dims = tuple(range(g.dim() - 2))
    d_alog = None
    if da is not None and A_log is not None:
        d_alog = da.sum(dim=(*token_dims, g.dim() - 1)).reshape(A_log.shape).to(A_log.dtype)
    d_bias = None if dt_bias is None else dx.sum(dim=token_dims).reshape(dt_bias.shape).to(dt_bias.dtype)
    return dx, d_alog, d_bias


def _beta_backward(mode: str, beta: torch.Tensor, dbp: torch.Tensor) -> torch.Tensor:
    """The gradient of beta as given from that of beta as used (`kda_beta`): prob as is, logit through the
    sigmoid, logit_x2 through twice the sigmoid."""
    if mode == "prob":
        return dbp
    s = torch.sigmoid(beta.to(torch.float32))
    return dbp * s * (1.0 - s) * (2.0 if mode == "logit_x2" else 1.0)
