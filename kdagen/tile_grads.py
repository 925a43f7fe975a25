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

import torch

from kdagen.arch import CHUNK
from kdagen.backward_local import TileMap, _slab_tiles
from kdagen.chunk_math import backward_from_dA, chunk_parts

__all__ = ["grads_from_products", "tile_grads", "DEFAULT_MAX_BATCH"]

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
