"""The backward's products with the states: the device code of the `bwd_tile` stage
(templates/mma_sync/bwd_tile.py.j2; kda-math.md §8, stages 2, 4 and 5 in the folded form of the forward's
step: R = V - Kd S, O = Qd S + Aq R, S' = diag(gt) S + Akt^T R).

Given the state S entering a tile and the gradient dS of the state leaving it, a tile's gradients of the
step's operands are dR = Aq^T dO + Akt dS (= dV), dQd = dO S^T, dKd = -dR S^T, dAkt = R dS^T, dAq = dO R^T
and dgt = the row sums of S * dS; everything after them is the `bwd_grads` stage's
(`kdagen.kernels.bwd_grads`). One CTA of four warps per (tile, value head): S (in the state's dtype) and dS
(in the MMA type, as the scan writes it) are staged in shared memory as the MMA type (dgt sums their
products in fp32, as FLA takes it from its bf16 states), and the five products run on warp MMAs, the warps
splitting the output columns.
"""

from dataclasses import dataclass
from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import warp

from kdagen.kernels.common import swizzled_rows

__all__ = ["ProductsConfig", "THREADS", "WARPS", "gemm", "products_mmas", "tile_products"]

WARPS = 4  # each takes a quarter of an output's columns
THREADS = 32 * WARPS


@dataclass(frozen=True)
class ProductsConfig:
    """What shapes a `bwd_tile` tile's code: head dims, tile length, the MMA type and the states' layout."""

    k: int  # key head dim
    v: int  # value head dim
    bt: int  # tokens per tile
    dtype: Any  # the MMA type (cutlass.BFloat16 or Float16): the tiles, dh, and S as staged
    kv_layout: bool  # h is [slots, HV, K, V] if True, else [slots, HV, V, K]


def products_mmas(dtype):
    """The stage's two tiled MMAs: four warps side by side along N (16 columns of an output to each warp in
    turn: one ldmatrix.x4 of B per k-block), and one warp alone for the 16-column dAq."""
    op = warp.MmaF16BF16Op(dtype, cutlass.Float32, (16, 8, 16))
    mma4 = cute.make_tiled_mma(op, (1, WARPS, 1), permutation_mnk=(16, WARPS * 16, 16))
    mma1 = cute.make_tiled_mma(op, (1, 1, 1), permutation_mnk=(16, 16, 16))
    return mma4, mma1


@cute.jit
def tile_products(cfg: cutlass.Constexpr, mKd, mAkt, mAq, mV, mDo, mH, mDh, mDv, mDqd, mDkd, mDakt, mDaq,
                  mDgt, mma4, mma1, tile, hv, t0, rows, tidx, warp_idx, lane):
    """Tile `tile` (its rows t0 .. t0 + rows) and value head hv, by the CTA's THREADS threads: `mma4` is
    `products_mmas`' four-warp MMA, `mma1` its one-warp MMA."""
    smem = cutlass.memory.SmemAllocator()
    sS = smem.allocate_tensor(cfg.dtype, swizzled_rows(cfg.k, cfg.v), 1024)  # S (key rows)
    sD = smem.allocate_tensor(cfg.dtype, swizzled_rows(cfg.v, cfg.k), 1024)  # dS^T (value rows)
    sKd = smem.allocate_tensor(cfg.dtype, swizzled_rows(cfg.bt, cfg.k), 1024)
    sAkt = smem.allocate_tensor(cfg.dtype, swizzled_rows(cfg.bt, cfg.k), 1024)
    sDo = smem.allocate_tensor(cfg.dtype, swizzled_rows(cfg.bt, cfg.v), 1024)
    sR = smem.allocate_tensor(cfg.dtype, swizzled_rows(cfg.bt, cfg.v), 1024)
    sDr = smem.allocate_tensor(cfg.dtype, swizzled_rows(cfg.bt, cfg.v), 1024)
    sAq = smem.allocate_tensor(cfg.dtype, cute.make_layout((cfg.bt, cfg.bt), stride=(cfg.bt, 1)), 128)

    # ---- stage the tile's rows (zero past its end) and the two states, then dgt ----
    # Element e = tidx + THREADS j of each tensor: consecutive threads on consecutive elements (coalesced),
    # and the loops unrolled so that many loads are in flight at once (the stage is bound by their latency).
    for j in cutlass.range_constexpr(cfg.bt * cfg.k // THREADS):
        e = tidx + THREADS * j
        r = e // cfg.k
        c = e % cfg.k
        kd = cfg.dtype(0.0)
        at = cfg.dtype(0.0)
        if r < rows:
            kd = mKd[t0 + r, hv, c]
            at = mAkt[t0 + r, hv, c]
        sKd[r, c] = kd
        sAkt[r, c] = at
    for j in cutlass.range_constexpr(cfg.bt * cfg.v // THREADS):
        e = tidx + THREADS * j
        r = e // cfg.v
        c = e % cfg.v
        x = cfg.dtype(0.0)
        if r < rows:
            x = mDo[t0 + r, hv, c]
        sDo[r, c] = x
    for j in cutlass.range_constexpr(cfg.bt * cfg.bt // THREADS):
        e = tidx + THREADS * j
        r = e // cfg.bt
        x = cfg.dtype(0.0)
        if r < rows:
            x = mAq[t0 + r, hv, e % cfg.bt]
        sAq[r, e % cfg.bt] = x
    # The states as the MMA type in shared memory (S converted from the state's dtype).
    for j in cutlass.range(cfg.k * cfg.v // THREADS, unroll=16):
        e = tidx + THREADS * j
        if cutlass.const_expr(cfg.kv_layout):
            sS[e // cfg.v, e % cfg.v] = mH[tile, hv, e // cfg.v, e % cfg.v].to(cfg.dtype)
        else:
            sS[e % cfg.k, e // cfg.k] = mH[tile, hv, e // cfg.k, e % cfg.k].to(cfg.dtype)
        sD[e // cfg.k, e % cfg.k] = mDh[tile, hv, e // cfg.k, e % cfg.k]
    cute.arch.sync_threads()
    # dgt: thread i sums key row i of S * dS over the values (fp32 sums of the staged products).
    for kc in range(tidx, cfg.k, THREADS):
        acc = cutlass.Float32(0.0)
        for vr in cutlass.range(cfg.v, unroll=8):
            acc = acc + sS[kc, vr].to(cutlass.Float32) * sD[vr, kc].to(cutlass.Float32)
        mDgt[tile, hv, kc] = acc
    cute.arch.sync_threads()

    thr = mma4.get_slice(tidx)
    ldsm = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), cfg.dtype)
    ldsm_t = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), cfg.dtype)
    # Operand views, (M or N, K) each: K-major ones take plain ldmatrix, MN-major ones ldmatrix.trans.
    # (N=v, K=key): S^T, MN-major
    sS_kv = cute.composition(sS, cute.make_layout((cfg.v, cfg.k), stride=(cfg.k, 1)))
    # (M=t, K=s): Aq^T, MN-major
    sAqT = cute.composition(sAq, cute.make_layout((cfg.bt, cfg.bt), stride=(cfg.bt, 1)))
    # (N=v, K=s): dO^T, MN-major
    sDoT = cute.composition(sDo, cute.make_layout((cfg.v, cfg.bt), stride=(cfg.bt, 1)))
    # (N=key, K=v): dS^T^T, MN-major
    sDT = cute.composition(sD, cute.make_layout((cfg.k, cfg.v), stride=(cfg.v, 1)))

    # ---- R = V - Kd S (16 x V) ----
    acc_r = gemm(mma4, thr, tidx, sKd, sS_kv, ldsm, ldsm_t, cfg.bt, cfg.v, cfg.k)
    coord_v = thr.partition_C(cute.make_identity_tensor((cfg.bt, cfg.v)))
    for i in cutlass.range_constexpr(cute.size(acc_r)):
        r = coord_v[i][0]
        c = coord_v[i][1]
        x = cutlass.Float32(0.0)
        if r < rows:
            x = mV[t0 + r, hv, c].to(cutlass.Float32) - acc_r[i]
        sR[r, c] = x.to(cfg.dtype)
    # ---- dR = Aq^T dO + Akt dS (16 x V): dV, and -dR for dKd ----
    acc_d = gemm(mma4, thr, tidx, sAqT, sDoT, ldsm_t, ldsm_t, cfg.bt, cfg.v, cfg.bt)
    acc_d2 = gemm(mma4, thr, tidx, sAkt, sD, ldsm, ldsm, cfg.bt, cfg.v, cfg.k)
    for i in cutlass.range_constexpr(cute.size(acc_d)):
        r = coord_v[i][0]
        c = coord_v[i][1]
        x = acc_d[i] + acc_d2[i]
        if r < rows:
            mDv[t0 + r, hv, c] = x
        sDr[r, c] = (-x).to(cfg.dtype)
    cute.arch.sync_threads()

    # ---- dQd = dO S^T, dKd = -dR S^T, dAkt = R dS^T (16 x K) ----
    coord_k = thr.partition_C(cute.make_identity_tensor((cfg.bt, cfg.k)))
    acc_q = gemm(mma4, thr, tidx, sDo, sS, ldsm, ldsm, cfg.bt, cfg.k, cfg.v)
    acc_k = gemm(mma4, thr, tidx, sDr, sS, ldsm, ldsm, cfg.bt, cfg.k, cfg.v)
    acc_a = gemm(mma4, thr, tidx, sR, sDT, ldsm, ldsm_t, cfg.bt, cfg.k, cfg.v)
    for i in cutlass.range_constexpr(cute.size(acc_q)):
        r = coord_k[i][0]
        c = coord_k[i][1]
        if r < rows:
            mDqd[t0 + r, hv, c] = acc_q[i]
            mDkd[t0 + r, hv, c] = acc_k[i]
            mDakt[t0 + r, hv, c] = acc_a[i]
    # ---- dAq = dO R^T (16 x 16), one warp ----
    if warp_idx == 0:
        thr1 = mma1.get_slice(lane)
        acc_aq = gemm(mma1, thr1, lane, sDo, sR, ldsm, ldsm, cfg.bt, cfg.bt, cfg.v)
        coord_q = thr1.partition_C(cute.make_identity_tensor((cfg.bt, cfg.bt)))
        for i in cutlass.range_constexpr(cute.size(acc_aq)):
            r = coord_q[i][0]
            if r < rows:
                mDaq[t0 + r, hv, coord_q[i][1]] = acc_aq[i]


@cute.jit
def gemm(tiled_mma: cute.TiledMma, thr, tidx, sA: cute.Tensor, sB: cute.Tensor, atom_a, atom_b,
          m: cutlass.Constexpr, n: cutlass.Constexpr, k: cutlass.Constexpr) -> cute.Tensor:
    # C (m x n, fp32) = A (m x k) B^T (B as (n, k)), both from shared memory through ldmatrix (`atom_a`,
    # `atom_b`: plain for K-major operands, .trans for MN-major ones), k/16 blocks.
    s2r_a = cute.make_tiled_copy_A(atom_a, tiled_mma)
    s2r_b = cute.make_tiled_copy_B(atom_b, tiled_mma)
    thr_a = s2r_a.get_slice(tidx)
    thr_b = s2r_b.get_slice(tidx)
    rA = thr.make_fragment_A(thr.partition_A(sA))
    rB = thr.make_fragment_B(thr.partition_B(sB))
    tAs = thr_a.partition_S(sA)
    tBs = thr_b.partition_S(sB)
    rA_v = thr_a.retile(rA)
    rB_v = thr_b.retile(rB)
    acc = cute.make_rmem_tensor(thr.partition_shape_C((m, n)), cutlass.Float32)
    acc.fill(0.0)
    for kb in cutlass.range_constexpr(k // 16):
        cute.copy(s2r_a, tAs[None, None, kb], rA_v[None, None, kb])
        cute.copy(s2r_b, tBs[None, None, kb], rB_v[None, None, kb])
        cute.gemm(tiled_mma, acc, rA[None, None, kb], rB[None, None, kb], acc)
    return acc
