"""Building blocks of the per-item decode step (templates/common/decode.py.j2): one CTA per (request, value
head, BV-wide value slice), KS threads per value column (adjacent lanes), each holding K / KS of the
column's state values (fp32) in registers from the load to the store.

A thread's keys come in groups of 4 adjacent keys, the column's KS threads interleaved group by group
(`key_of`): their same-time shared-memory reads of q, k and the decays fall in different banks, and in a
V-first row each group is one 16-byte vector. A token's inputs are loaded into registers (`load_token`)
well before they are staged into shared memory (`stage_token`), so that their loads stay in flight while
the previous token is computed. The token recurrence is kda-math.md §2.0's (`column_step`).
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute

from kdagen.kernels.decode_ring import partial_sum, warp_sum
from kdagen.kernels.gate import decay, log_decay

__all__ = [
    "ItemConfig", "key_of", "load_column", "store_column", "token_registers", "load_gate_bias", "load_token",
    "stage_token", "column_step",
]


@dataclass(frozen=True)
class ItemConfig:
    """What shapes a per-item decode CTA's code: head dims, its columns and threads a column, the gate,
    l2norm, the dot products' ILP and the pool's layout."""

    k: int  # key head dim
    v: int  # value head dim
    block_v: int  # value columns per CTA
    key_split: int  # threads per value column (a power of 2)
    gate: str  # "precomputed", "softplus" or "lower_bound"
    lower_bound: float | None
    l2norm: bool
    partial_sums: int  # independent partial sums of each dot product over a thread's keys
    kv_layout: bool  # pool [P, HV, K, V] if True, else [P, HV, V, K]

    @property
    def threads(self) -> int:
        return self.block_v * self.key_split

    @property
    def warps(self) -> int:
        return self.threads // 32

    @property
    def keys(self) -> int:
        # state values a thread holds
        return self.k // self.key_split

    @property
    def rounds(self) -> int:
        # a token's key inputs a thread loads (the CTA's threads cover K in rounds)
        return (self.k + self.threads - 1) // self.threads


@cute.jit
def key_of(r: cutlass.Constexpr, p, cfg: cutlass.Constexpr):
    """Key of a thread's r-th state value, p its part of the column (key_split = 1: key r)."""
    return (r // 4) * (4 * cfg.key_split) + p * 4 + r % 4


@cute.jit
def _state_column(mPool: cute.Tensor, slot, hv, j, cfg: cutlass.Constexpr):
    # Column j of the state S of (slot, value head): K values, a row of the V-first layout.
    col = mPool[slot, hv, None, j]
    if cutlass.const_expr(not cfg.kv_layout):
        col = mPool[slot, hv, j, None]
    return col


@cute.jit
def load_column(mPool: cute.Tensor, slot, hv, j, p, rS: cute.Tensor, cfg: cutlass.Constexpr) -> cute.Tensor:
    """The thread's part of state column j into fp32 registers `rS` (a bf16 pool widened as loaded)."""
    col = _state_column(mPool, slot, hv, j, cfg)
    sdt = mPool.element_type
    if cutlass.const_expr(cfg.key_split == 1 and sdt == cutlass.Float32):
        cute.autovec_copy(col, rS)
    elif cutlass.const_expr(cfg.key_split == 1):
        raw = cute.make_rmem_tensor(cute.make_layout((cfg.k,)), sdt)
        cute.autovec_copy(col, raw)
        rS.store(raw.load().to(cutlass.Float32))
    else:
        groups = cute.zipped_divide(col, (4,))  # the column's groups of 4 keys: vectors in a V-first row
        for gi in cutlass.range_constexpr(cfg.keys // 4):
            raw = cute.make_rmem_tensor(cute.make_layout((4,)), sdt)
            cute.autovec_copy(groups[None, gi * cfg.key_split + p], raw)
            for e in cutlass.range_constexpr(4):
                rS[gi * 4 + e] = raw[e].to(cutlass.Float32)
    return rS


@cute.jit
def store_column(rS: cute.Tensor, mPool: cute.Tensor, slot, hv, j, p, cfg: cutlass.Constexpr):
    """The thread's fp32 part of state column j into the pool (rounded to the pool's type)."""
    col = _state_column(mPool, slot, hv, j, cfg)
    sdt = mPool.element_type
    if cutlass.const_expr(cfg.key_split == 1 and sdt == cutlass.Float32):
        cute.autovec_copy(rS, col)
    elif cutlass.const_expr(cfg.key_split == 1):
        raw = cute.make_rmem_tensor(cute.make_layout((cfg.k,)), sdt)
        raw.store(rS.load().to(sdt))
        cute.autovec_copy(raw, col)
    else:
        groups = cute.zipped_divide(col, (4,))
        for gi in cutlass.range_constexpr(cfg.keys // 4):
            raw = cute.make_rmem_tensor(cute.make_layout((4,)), sdt)
            for e in cutlass.range_constexpr(4):
                raw[e] = rS[gi * 4 + e].to(sdt)
            cute.autovec_copy(raw, groups[None, gi * cfg.key_split + p])


@cute.jit
def _block_sums(a, b, sRed: cute.Tensor, lane, w, cfg: cutlass.Constexpr):
    # (sum of a, sum of b) over the CTA's threads: butterflies in each warp, then every thread adds the
    # warps' partial sums from shared memory. The caller orders the reads of sRed before its next write.
    a = warp_sum(a)
    b = warp_sum(b)
    if lane == 0:
        sRed[w] = a
        sRed[cfg.warps + w] = b
    cute.arch.sync_threads()
    sa = cutlass.Float32(0.0)
    sb = cutlass.Float32(0.0)
    for i in cutlass.range_constexpr(cfg.warps):
        sa = sa + sRed[i]
        sb = sb + sRed[cfg.warps + i]
    return sa, sb


@cute.jit
def token_registers(qk_dtype: cutlass.Constexpr, g_dtype: cutlass.Constexpr, cfg: cutlass.Constexpr):
    """A token's inputs in registers between their load and their staging: q, k and gate elements (as
    stored), v and beta (fp32, `rVB`), and the gate's bias per key (fp32, zero until `load_gate_bias`)."""
    rQ = cute.make_rmem_tensor(cute.make_layout((cfg.rounds,)), qk_dtype)
    rK = cute.make_rmem_tensor(cute.make_layout((cfg.rounds,)), qk_dtype)
    rG = cute.make_rmem_tensor(cute.make_layout((cfg.rounds,)), g_dtype)
    rVB = cute.make_rmem_tensor(cute.make_layout((2,)), cutlass.Float32)
    rDt = cute.make_rmem_tensor(cute.make_layout((cfg.rounds,)), cutlass.Float32)
    rDt.fill(0.0)
    return rQ, rK, rG, rVB, rDt


@cute.jit
def load_gate_bias(mDtBias: cute.Tensor, hv, tidx, rDt: cute.Tensor, cfg: cutlass.Constexpr):
    """The gate's bias of value head hv at this thread's keys (tidx, tidx + threads, ...) into `rDt`."""
    for e0 in cutlass.range_constexpr(0, cfg.k, cfg.threads):
        if e0 + tidx < cfg.k:
            rDt[e0 // cfg.threads] = mDtBias[hv, e0 + tidx]


@cute.jit
def load_token(mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mG: cute.Tensor, mBeta: cute.Tensor,
               t, h, hv, j, tidx, rQ: cute.Tensor, rK: cute.Tensor, rG: cute.Tensor, rVB: cute.Tensor,
               cfg: cutlass.Constexpr):
    """Token t's inputs as stored into registers, unused until `stage_token`, so that the loads stay in
    flight meanwhile: this thread's q, k and gate elements (keys tidx, tidx + threads, ...), the column's
    v and the head's beta as given (`rVB`: v, beta)."""
    for e0 in cutlass.range_constexpr(0, cfg.k, cfg.threads):
        e = e0 + tidx
        if e < cfg.k:
            rQ[e0 // cfg.threads] = mQ[t, h, e]
            rK[e0 // cfg.threads] = mK[t, h, e]
            rG[e0 // cfg.threads] = mG[t, hv, e]
    rVB[0] = mV[t, hv, j].to(cutlass.Float32)
    rVB[1] = mBeta[t, hv].to(cutlass.Float32)


@cute.jit
def stage_token(
    rQ: cute.Tensor, rK: cute.Tensor, rG: cute.Tensor, rDt: cute.Tensor, tidx, lane, w,
    a_scale: cutlass.Float32, scale: cutlass.Float32,
    sQ: cute.Tensor, sK: cute.Tensor, sD: cute.Tensor, sRed: cute.Tensor, cfg: cutlass.Constexpr,
):
    """The loaded token's scaled q, k and decays (from the gate's bias `rDt`) into shared memory, with the
    l2norm of q and k (§2.2) from the CTA's sums of squares. The caller syncs before reading them."""
    ssq_q = cutlass.Float32(0.0)
    ssq_k = cutlass.Float32(0.0)
    for e0 in cutlass.range_constexpr(0, cfg.k, cfg.threads):
        e = e0 + tidx
        r = e0 // cfg.threads
        if e < cfg.k:
            qe = rQ[r].to(cutlass.Float32)
            ke = rK[r].to(cutlass.Float32)
            ssq_q = ssq_q + qe * qe
            ssq_k = ssq_k + ke * ke
            sQ[e] = qe
            sK[e] = ke
            sD[e] = decay(log_decay(rG[r].to(cutlass.Float32), rDt[r], a_scale, cfg.gate, cfg.lower_bound))
    rq = scale
    rk = cutlass.Float32(1.0)
    if cutlass.const_expr(cfg.l2norm):
        sq_sum, sk_sum = _block_sums(ssq_q, ssq_k, sRed, lane, w, cfg)
        rq = cute.math.rsqrt(sq_sum + 1e-6) * scale
        rk = cute.math.rsqrt(sk_sum + 1e-6)
    for e0 in cutlass.range_constexpr(0, cfg.k, cfg.threads):
        e = e0 + tidx
        if e < cfg.k:
            sQ[e] = sQ[e] * rq
            sK[e] = sK[e] * rk


@cute.jit
def column_step(rS: cute.Tensor, sQ: cute.Tensor, sK: cute.Tensor, sD: cute.Tensor, p, b: cutlass.Float32,
                vj: cutlass.Float32, cfg: cutlass.Constexpr) -> cutlass.Float32:
    """One token on the thread's part of a value column: S <- Diag(exp(g)) S, u = beta (v_j - k^T S),
    S <- S + k u; returns o_j = q^T S (in every thread of the column)."""
    dots = [cutlass.Float32(0.0)] * cfg.partial_sums
    for r in cutlass.range_constexpr(cfg.keys):
        i = key_of(r, p, cfg)
        rS[r] = rS[r] * sD[i]
        dots[r % cfg.partial_sums] = dots[r % cfg.partial_sums] + sK[i] * rS[r]
    u = b * (vj - warp_sum(partial_sum(dots), cfg.key_split))
    accs = [cutlass.Float32(0.0)] * cfg.partial_sums
    for r in cutlass.range_constexpr(cfg.keys):
        i = key_of(r, p, cfg)
        rS[r] = rS[r] + sK[i] * u
        accs[r % cfg.partial_sums] = accs[r % cfg.partial_sums] + sQ[i] * rS[r]
    return warp_sum(partial_sum(accs), cfg.key_split)
