"""The backward's per-tile algebra down to the call's inputs: the device code of the `bwd_grads` stage
(templates/common/bwd_grads.py.j2; kda-math.md §8, stages 5 to 8).

From a tile's products with its states (dQd, dKd, dAkt, dAq, dgt, by `bwd_tile`) and its intra-tile matrices
Aqk and Akk (by `bwd_prepare`) back through P = (I + L)^-1 diag(beta), Aqk and the decays to the prepared q,
k, g and beta, then through their transforms (l2norm and scale of q and k, the gate, beta's sigmoid) to the
inputs as given. One CTA of K threads per (tile, q/k head), fp32 on CUDA cores but for Kg dAkt^T (`kg_dakt`)
and the 16 x 16 x 16 products (`half_product`), on tf32 warp MMAs: every product is 16 x 16 or 16 x K. The CTA
takes its head's value heads one after the other (GVA), summing their gradients of q and k in registers, so
that the group sum and the l2norm's backward (which needs whole rows) stay in the CTA. Thread c owns key
column c for the column-wise parts (the decays' cumsum and its reverse, the intra-tile products back to q and
k); the 16 x 16 matrices are shared, an 8-column half of a product a warp. Without the safe gate the decays
exp(G_r - G_s) are taken pair by pair (s <= r, so every factor is <= 1): exact for any gate, hard resets
included; with it they go through a mid-tile anchor (`_value_head`). The gate's parameters get per-tile
partial sums ([tile, HV, K]) that the caller adds up in a fixed order: no float atomics. The gate's and beta's
transcendental functions take their hardware approximations (ex2.approx, rcp.approx), as the forward's prepare
stage does: an IEEE division and an accurate exp a row cost more issue slots than the row's arithmetic.
`kdagen.tile_grads` is the same computation in torch (its reference).
"""

from dataclasses import dataclass
from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import warp

from kdagen.kernels.bwd_grads_shape import MAT_PAD, ROW_PAD, mma_warps
from kdagen.kernels.common import cu_at, token_rows, zero_padding_tail
from kdagen.kernels.gate import beta_value, decay, log_decay, sigmoid, softplus
from kdagen.kernels.prepare_tile import tf32

__all__ = [
    "GradsConfig", "grads_mma", "grads_tile", "half_product", "kg_dakt", "row_sums", "zero_tail",
]

F32 = cutlass.Float32
L2NORM_EPS = 1e-6  # as the forward's l2norm
# Rows ahead of their use that the column phase's global reads are issued (read where used, their latency
# was ~0.6 of the stage's 4.4 ms at B=2 T=8192 H=64: docs/experiments.md, "Backward: bwd_prepare, loads
# issued together, the column phase's reads ahead")
PREFETCH_ROWS = 4


@dataclass(frozen=True)
class GradsConfig:
    """What shapes a `bwd_grads` tile's code: sizes, dtypes, the gate, beta's mode and l2norm."""

    k: int  # key head dim, and the CTA's threads (one key column each)
    bt: int  # tokens per tile
    gva: int  # value heads per q/k head
    dtype: Any  # q, k and their gradients (cutlass.BFloat16 or Float16)
    g_dtype: Any  # g and its gradient
    beta_dtype: Any  # beta and its gradient
    gate: str  # "precomputed", "softplus" or "lower_bound"
    lower_bound: float | None
    safe_gate: bool  # g >= lower_bound >= -5 promised: decays through a mid-tile anchor (`_value_head`)
    beta: str  # how beta is given: "prob", "logit" or "logit_x2"
    l2norm: bool

    @property
    def mma_warps(self) -> int:
        return mma_warps(self.k)

    @property
    def pairs(self) -> int:
        # entries of a 16 x 16 matrix a thread
        return self.bt * self.bt // self.k


@cute.jit
def row_sums(vals: cute.Tensor, sRed: cute.Tensor, tidx, n: cutlass.Constexpr, warps: cutlass.Constexpr,
             sInv=None, eps: cutlass.Constexpr = 0.0):
    # vals[i] (n values a thread, n a power of two <= 32) -> their sums over the CTA's threads, in every
    # thread; sRed holds warps + 1 rows of n. A warp sums by a transposing butterfly: each step hands half of
    # a lane's values to its partner and adds the partner's half of its own, so after log2(n) steps lane l
    # holds the warp's sum of value l % n, in n - 1 shuffles (a plain butterfly a value takes 5 n). Thread i
    # then adds the warps' sums of value i in order, and every thread reads the n totals: the same bits
    # every run. With sInv (n entries): 1/sqrt(sum + eps) in place of each sum, also written to sInv, taken
    # once a value rather than in every thread.
    warp = tidx // 32
    lane = tidx % 32
    for step in cutlass.range_constexpr(n.bit_length() - 1):
        half = n >> (step + 1)
        upper = (lane & half) != 0
        for i in cutlass.range_constexpr(half):
            send = cutlass.select_(upper, vals[i], vals[i + half])
            keep = cutlass.select_(upper, vals[i + half], vals[i])
            vals[i] = keep + cute.arch.shuffle_sync_bfly(send, offset=half)
    for step in cutlass.range_constexpr(6 - n.bit_length()):  # lanes l and l + n hold parts of one value
        vals[0] = vals[0] + cute.arch.shuffle_sync_bfly(vals[0], offset=n << step)
    if lane < n:
        sRed[warp, lane] = vals[0]
    cute.arch.sync_threads()
    if tidx < n:
        t = sRed[0, tidx]
        for w in cutlass.range_constexpr(1, warps):
            t = t + sRed[w, tidx]
        if cutlass.const_expr(sInv is not None):
            t = cute.math.rsqrt(t + eps)
            sInv[tidx] = t
        sRed[warps, tidx] = t
    cute.arch.sync_threads()
    for i0 in cutlass.range_constexpr(0, n, 4):
        v = cute.make_tensor(sRed.iterator + warps * n + i0, cute.make_layout((4,))).load()
        for i in cutlass.range_constexpr(4):
            vals[i0 + i] = v[i]
    cute.arch.sync_threads()


def grads_mma():
    """The stage's one tiled MMA: m16n8k8 tf32, one warp (`kg_dakt`)."""
    return cute.make_tiled_mma(warp.MmaTF32Op((16, 8, 8)), (1, 1, 1))


@cute.jit
def kg_dakt(mma: cute.TiledMma, sKg: cute.Tensor, sDakt: cute.Tensor, sOut: cute.Tensor, tidx,
            bt: cutlass.Constexpr, k: cutlass.Constexpr, warps: cutlass.Constexpr):
    # Kg dAkt^T (bt x bt, a sum over the k keys) on tensor cores (`grads_mma`), by warps 0 .. warps - 1:
    # warp w sums the 8-key steps w, w + warps, ... into sOut[w]. Fragments (lane = 4 g + t): A slot hh + 2 c2
    # is (row g + 8 hh, k-slot t + 4 c2), B slot c2 + 2 nb is (k-slot t + 4 c2, column g + 8 nb), C slot i is
    # (row g + 8 ((i // 2) % 2), column 8 (i // 4) + 2 t + i % 2). Step ks's k-slot t + 4 c2 is key
    # 32 (ks // 4) + ks % 4 + 8 t + 4 c2 (any order of the keys gives the sum): with rows K + 1 words apart
    # (`ROW_PAD`), a load's lanes (row g, key 8 t + ...) fall on 32 banks.
    w = tidx // 32
    lane = tidx % 32
    g = lane // 4
    t = lane % 4
    thr = mma.get_slice(lane)
    acc = cute.make_rmem_tensor(thr.partition_shape_C((bt, bt)), F32)
    acc.fill(0.0)
    for ks in range(w, k // 8, warps):
        k0 = 32 * (ks // 4) + ks % 4 + 8 * t
        a = cute.make_rmem_tensor(thr.partition_shape_A((bt, 8)), cutlass.Int32)
        b = cute.make_rmem_tensor(thr.partition_shape_B((bt, 8)), cutlass.Int32)
        for hh in cutlass.range_constexpr(2):
            for c2 in cutlass.range_constexpr(2):
                a[hh + 2 * c2] = tf32(sKg[g + 8 * hh, k0 + 4 * c2])
                b[c2 + 2 * hh] = tf32(sDakt[g + 8 * hh, k0 + 4 * c2])
        cute.gemm(mma, acc, a, b, acc)
    for i in cutlass.range_constexpr(cute.size(acc)):
        sOut[w, g + 8 * ((i // 2) % 2), 8 * (i // 4) + 2 * t + i % 2] = acc[i]


@cute.jit
def half_product(mma: cute.TiledMma, vA: cute.Tensor, vB: cute.Tensor, n0: cutlass.Constexpr, lane,
                 acc=None):
    # acc + vA vB[:, n0 : n0 + 8] (vA, vB: 16 x 16 shared-memory views, A[m, k] and B[k, n], either of them
    # a transposed view: `_t`), by one warp in two tf32 MMAs, into acc (a new zero accumulator when none is
    # given), which it returns. Fragments (lane = 4 g + t): A slot hh + 2 c2 is (row g + 8 hh, k t + 4 c2),
    # B slot c2 is (k t + 4 c2, column n0 + g), C slot i is `half_coord`'s (row g + 8 (i // 2), column
    # n0 + 2 t + i % 2).
    g = lane // 4
    t = lane % 4
    thr = mma.get_slice(lane)
    if cutlass.const_expr(acc is None):
        acc = _zero_half(mma, lane, 16)
    for ks in cutlass.range_constexpr(2):
        k0 = 8 * ks
        a = cute.make_rmem_tensor(thr.partition_shape_A((16, 8)), cutlass.Int32)
        b = cute.make_rmem_tensor(thr.partition_shape_B((8, 8)), cutlass.Int32)
        for c2 in cutlass.range_constexpr(2):
            for hh in cutlass.range_constexpr(2):
                a[hh + 2 * c2] = tf32(vA[g + 8 * hh, k0 + t + 4 * c2])
            b[c2] = tf32(vB[k0 + t + 4 * c2, n0 + g])
        cute.gemm(mma, acc, a, b, acc)
    return acc


@cute.jit
def _t(sM: cute.Tensor, bt: cutlass.Constexpr):
    # The transpose of a [bt, bt] matrix in `grads_tile`'s padded layout, as a view.
    return cute.make_tensor(sM.iterator, cute.make_layout((bt, bt), stride=(1, bt + MAT_PAD)))


@cute.jit
def half_coord(lane, n0: cutlass.Constexpr, i: cutlass.Constexpr):
    # (row, column) of C slot i of `half_product`'s accumulator for columns n0 ..
    return lane // 4 + 8 * (i // 2), n0 + 2 * (lane % 4) + i % 2


@cute.jit
def _zero_half(mma: cute.TiledMma, lane, bt: cutlass.Constexpr):
    # A zero accumulator for `half_product`.
    acc = cute.make_rmem_tensor(mma.get_slice(lane).partition_shape_C((bt, 8)), F32)
    acc.fill(0.0)
    return acc


@cute.jit
def _kgda_sum(mma: cute.TiledMma, sKgDa: cute.Tensor, n0: cutlass.Constexpr, lane, bt: cutlass.Constexpr,
              warps: cutlass.Constexpr):
    # `kg_dakt`'s warps' partial products, added in order, as `half_product`'s accumulator for columns n0 ..
    acc = _zero_half(mma, lane, bt)
    for i in cutlass.range_constexpr(4):
        r, s = half_coord(lane, n0, i)
        for w in cutlass.range_constexpr(warps):
            acc[i] = acc[i] + sKgDa[w, r, s]
    return acc


@cute.jit
def _store_lower(sOut: cute.Tensor, acc: cute.Tensor, n0: cutlass.Constexpr, lane):
    # `half_product`'s result into sOut, its lower triangle (diagonal included) and zeros above.
    for i in cutlass.range_constexpr(4):
        r, s = half_coord(lane, n0, i)
        sOut[r, s] = cutlass.select_(s <= r, acc[i], F32(0.0))


@cute.jit
def _prefetch_row(cfg: cutlass.Constexpr, vDqd, vDkd, vG, r, c, slot: cutlass.Constexpr, pre_qd, pre_kd,
                  pre_g):
    # Row r's dQd, dKd (and g, for an in-kernel gate's backward) of column c into prefetch slot `slot`.
    pre_qd[slot] = vDqd[r, c]
    pre_kd[slot] = vDkd[r, c]
    if cutlass.const_expr(cfg.gate != "precomputed"):
        pre_g[slot] = vG[r, c].to(F32)


@cute.jit
def grads_tile(cfg: cutlass.Constexpr, mQ, mK, mG, mBeta, mALog, mDt, mDqd, mDkd, mDakt, mDaq, mDgt, mMats,
               mDq, mDk, mDg, mDbeta, mDaLog, mDdt, mma, scale, tile, h, t0, rows, tidx):
    """Tile `tile` (its rows t0 .. t0 + rows) and q/k head h, by the CTA's K threads (`tidx` = key column).
    The gate's tensors (mALog, mDt, mDaLog, mDdt) are None for a precomputed gate."""
    smem = cutlass.memory.SmemAllocator()
    # The layout `bwd_grads_shape.smem_bytes` counts: token rows of K columns (padded: ROW_PAD), ...
    rows_k = cute.make_layout((cfg.bt, cfg.k), stride=(cfg.k + ROW_PAD, 1))
    sQ = smem.allocate_tensor(F32, rows_k, 16)  # prepared q (normalised, scaled)
    sK = smem.allocate_tensor(F32, rows_k, 16)  # prepared k (normalised)
    # Kg dAkt^T by the warps' key slices (`kg_dakt`), summed in order where used
    per_warp = cute.make_layout((cfg.mma_warps, cfg.bt, cfg.bt), stride=(cfg.bt * cfg.bt, cfg.bt, 1))
    sKgDa = smem.allocate_tensor(F32, per_warp, 16)
    sKg = smem.allocate_tensor(F32, rows_k, 16)  # k exp(G_last - G)
    sDakt = smem.allocate_tensor(F32, rows_k, 16)
    mat = cute.make_layout((cfg.bt, cfg.bt), stride=(cfg.bt + MAT_PAD, 1))
    sAqk = smem.allocate_tensor(F32, mat, 16)  # (Q K^T) masked by the pairwise decays, lower incl.
    sAkk = smem.allocate_tensor(F32, mat, 16)
    sT = smem.allocate_tensor(F32, mat, 16)  # (I + L)^-1
    sP = smem.allocate_tensor(F32, mat, 16)  # (I + L)^-1 diag(beta)
    sDaq = smem.allocate_tensor(F32, mat, 16)
    sDP = smem.allocate_tensor(F32, mat, 16)
    # dAqk and dAkk: read as broadcasts in the column phase, four entries a load (`mat`'s rows are 16-byte
    # aligned)
    sDAqk = smem.allocate_tensor(F32, mat, 16)
    sY = smem.allocate_tensor(F32, mat, 16)  # T^T dP diag(beta)
    sDL = smem.allocate_tensor(F32, mat, 16)
    sDAkk = smem.allocate_tensor(F32, mat, 16)
    sB = smem.allocate_tensor(F32, cute.make_layout((cfg.bt,)), 16)
    # the row sums' warp sums and their totals (`row_sums`)
    sRed = smem.allocate_tensor(F32, cute.make_layout((cfg.k // 32 + 1, 2 * cfg.bt), stride=(2 * cfg.bt, 1)),
                                16)
    # 1/|q_r|, 1/|k_r|
    sNorm = smem.allocate_tensor(F32, cute.make_layout((2, cfg.bt), stride=(cfg.bt, 1)), 16)
    c = tidx

    # ---- q and k of the head, normalised once for its value heads (rows past the tile's end are zero) ----
    # Loads past the tile's rows read its last row (in bounds) and are replaced by zero: no branch around a
    # load, so the compiler issues a loop's loads together instead of waiting on each. Every access goes
    # through a view of the tile's rows (`token_rows`: 32-bit offsets from one base).
    last = rows - 1
    # One value head: its loads are issued first, so that their latency passes under the q and k phase's
    # (for a group, each head issues its own as it starts)
    first = None
    if cutlass.const_expr(cfg.gva == 1):
        first = _head_loads(cfg, mG, mBeta, mALog, mDt, mDakt, mDaq, mDgt, mMats, tile, h, t0, last, tidx)
    vQ = token_rows(mQ, t0, h, cfg.bt)
    vK = token_rows(mK, t0, h, cfg.bt)
    sums = cute.make_rmem_tensor(cute.make_layout((2 * cfg.bt,)), F32)
    for r in cutlass.range_constexpr(cfg.bt):
        tr = cutlass.min(r, last)
        x_q = cutlass.select_(r < rows, vQ[tr, c].to(F32), F32(0.0))
        x_k = cutlass.select_(r < rows, vK[tr, c].to(F32), F32(0.0))
        sQ[r, c] = x_q
        sK[r, c] = x_k
        sums[r] = x_q * x_q
        sums[cfg.bt + r] = x_k * x_k
    if cutlass.const_expr(cfg.l2norm):
        # sums -> 1/|q_r| and 1/|k_r| (also kept in sNorm for the backward through the norm)
        norms = cute.make_tensor(sNorm.iterator, cute.make_layout((2 * cfg.bt,)))
        row_sums(sums, sRed, tidx, 2 * cfg.bt, cfg.k // 32, norms, L2NORM_EPS)
    for r in cutlass.range_constexpr(cfg.bt):
        n_q = F32(1.0)
        n_k = F32(1.0)
        if cutlass.const_expr(cfg.l2norm):
            n_q = sums[r]
            n_k = sums[cfg.bt + r]
        sQ[r, c] = sQ[r, c] * n_q * scale
        sK[r, c] = sK[r, c] * n_k

    # ---- each value head of the group: its gradients of q and k summed, of g and beta written ----
    acc_q = cute.make_rmem_tensor(cute.make_layout((cfg.bt,)), F32)
    acc_k = cute.make_rmem_tensor(cute.make_layout((cfg.bt,)), F32)
    acc_q.fill(0.0)
    acc_k.fill(0.0)
    shared = (sQ, sK, sKgDa, sKg, sDakt, sAqk, sAkk, sT, sP, sDaq, sDP, sDAqk, sY, sDL, sDAkk, sB)
    if cutlass.const_expr(cfg.gva > 1):
        for j in cutlass.range(cfg.gva, unroll=1):
            cute.arch.sync_threads()  # the previous head's reads of the shared tiles are done
            hv = h * cfg.gva + j
            loads = _head_loads(cfg, mG, mBeta, mALog, mDt, mDakt, mDaq, mDgt, mMats, tile, hv, t0, last,
                                tidx)
            _value_head(cfg, mG, mDqd, mDkd, mDg, mDbeta, mDaLog, mDdt, mma, tile, hv, t0, rows, last, tidx,
                        shared, acc_q, acc_k, loads)
    else:
        for j in cutlass.range_constexpr(1):  # one value head: nothing carried across a loop
            cute.arch.sync_threads()
            _value_head(cfg, mG, mDqd, mDkd, mDg, mDbeta, mDaLog, mDdt, mma, tile, h * cfg.gva + j, t0, rows,
                        last, tidx, shared, acc_q, acc_k, first)

    # ---- back through the scale and the l2norm: dx = (dy - y (y . dy)) / |x|, y = x / |x| ----
    cute.arch.sync_threads()
    for r in cutlass.range_constexpr(cfg.bt):
        acc_q[r] = acc_q[r] * scale
    if cutlass.const_expr(cfg.l2norm):
        inv_scale = 1.0 / scale
        for r in cutlass.range_constexpr(cfg.bt):
            sums[r] = sQ[r, c] * inv_scale * acc_q[r]
            sums[cfg.bt + r] = sK[r, c] * acc_k[r]
        row_sums(sums, sRed, tidx, 2 * cfg.bt, cfg.k // 32)
        for r in cutlass.range_constexpr(cfg.bt):
            acc_q[r] = sNorm[0, r] * (acc_q[r] - sQ[r, c] * inv_scale * sums[r])
            acc_k[r] = sNorm[1, r] * (acc_k[r] - sK[r, c] * sums[cfg.bt + r])
    vDq = token_rows(mDq, t0, h, cfg.bt)
    vDk = token_rows(mDk, t0, h, cfg.bt)
    for r in cutlass.range_constexpr(cfg.bt):
        if r < rows:
            vDq[r, c] = acc_q[r].to(cfg.dtype)
            vDk[r, c] = acc_k[r].to(cfg.dtype)


@cute.jit
def _head_loads(cfg: cutlass.Constexpr, mG, mBeta, mALog, mDt, mDakt, mDaq, mDgt, mMats, tile, hv, t0, last,
                tidx):
    # A value head's global reads for `_value_head`, as loaded (nothing waits on them here): its g and dAkt
    # of column tidx (rows past the tile's end read its last row), its dAq and Mqk / Akk entries (`pairs` a
    # thread), beta of row tidx % bt, dgt of column tidx and the gate's parameters.
    c = tidx
    raw_g = cute.make_rmem_tensor(cute.make_layout((cfg.bt,)), mG.element_type)
    raw_a = cute.make_rmem_tensor(cute.make_layout((cfg.bt,)), F32)
    vG = token_rows(mG, t0, hv, cfg.bt)
    vDakt = token_rows(mDakt, t0, hv, cfg.bt)
    for r in cutlass.range_constexpr(cfg.bt):
        tr = cutlass.min(r, last)
        raw_g[r] = vG[tr, c]
        raw_a[r] = vDakt[tr, c]
    vDaq = token_rows(mDaq, t0, hv, cfg.bt)
    mats = mMats[tile, hv, None, None, None]  # prepare's Mqk and Akk of the tile
    raw_m = cute.make_rmem_tensor(cute.make_layout((3, cfg.pairs)), F32)  # dAq, Mqk, Akk
    for j in cutlass.range_constexpr(cfg.pairs):
        e = tidx + cfg.k * j
        r = e // cfg.bt
        s = e % cfg.bt
        raw_m[0, j] = vDaq[cutlass.min(r, last), s]
        raw_m[1, j] = mats[0, r, s]
        raw_m[2, j] = mats[1, r, s]
    raw_b = mBeta[t0 + cutlass.min(tidx % cfg.bt, last), hv]
    dgt = mDgt[tile, hv, c]
    a_log = F32(0.0)
    dt = F32(0.0)
    if cutlass.const_expr(cfg.gate != "precomputed"):
        a_log = mALog[hv]
        dt = mDt[hv, c]
    return raw_g, raw_a, raw_m, raw_b, dgt, a_log, dt


@cute.jit
def _value_head(cfg: cutlass.Constexpr, mG, mDqd, mDkd, mDg, mDbeta, mDaLog, mDdt, mma, tile, hv, t0, rows,
                last, tidx, shared, acc_q, acc_k, loads):
    # One value head of the tile: its gradients of q and k added to acc_q and acc_k, of g and beta (and the
    # gate's parameters' partial sums) written; `loads` are its `_head_loads`.
    sQ, sK, sKgDa, sKg, sDakt, sAqk, sAkk, sT, sP, sDaq, sDP, sDAqk, sY, sDL, sDAkk, sB = shared
    c = tidx
    raw_g, raw_a, raw_m, raw_b, dgt, a_log, dt = loads
    a_scale = F32(1.0)
    if cutlass.const_expr(cfg.gate != "precomputed"):
        a_scale = cute.math.exp(a_log)
    vG = token_rows(mG, t0, hv, cfg.bt)
    vDqd = token_rows(mDqd, t0, hv, cfg.bt)
    vDkd = token_rows(mDkd, t0, hv, cfg.bt)
    vDg = token_rows(mDg, t0, hv, cfg.bt)
    # ---- the value head's decays (cumsum of the log decay in the tile), dAkt, dAq and beta ----
    rG = cute.make_rmem_tensor(cute.make_layout((cfg.bt,)), F32)
    acc = F32(0.0)
    for r in cutlass.range_constexpr(cfg.bt):
        g_r = log_decay(raw_g[r].to(F32), dt, a_scale, cfg.gate, cfg.lower_bound, True)
        x_g = cutlass.select_(r < rows, g_r, F32(0.0))
        x_a = cutlass.select_(r < rows, raw_a[r], F32(0.0))
        acc = acc + x_g
        rG[r] = acc
        sDakt[r, c] = x_a
    g_last = acc
    for r in cutlass.range_constexpr(cfg.bt):
        sKg[r, c] = sK[r, c] * decay(g_last - rG[r])
    for j in cutlass.range_constexpr(cfg.pairs):
        e = tidx + cfg.k * j
        r = e // cfg.bt
        s = e % cfg.bt
        sDaq[r, s] = cutlass.select_(r < rows, raw_m[0, j], F32(0.0))
        # Aqk and Akk, the lower triangles (Akk's without its unused diagonal) of prepare's products; zero
        # above (the entries nothing reads are read and dropped).
        sAqk[r, s] = cutlass.select_(s <= r, raw_m[1, j], F32(0.0))
        sAkk[r, s] = cutlass.select_(s < r, raw_m[2, j], F32(0.0))
    if tidx < cfg.bt:
        sB[tidx] = cutlass.select_(tidx < rows, beta_value(raw_b.to(F32), cfg.beta), F32(0.0))
    cute.arch.sync_threads()

    # ---- T = (I + L)^-1, L = the strict lower triangle of diag(beta) Akk: lane j < 16 of the last warp
    # solves column j, while the other warps form Kg dAkt^T on tensor cores ----
    solver = cfg.k - 32
    if tidx >= solver and tidx < solver + cfg.bt:
        j_col = tidx - solver
        rT = cute.make_rmem_tensor(cute.make_layout((cfg.bt,)), F32)
        for r in cutlass.range_constexpr(cfg.bt):
            x = F32(0.0)
            if r == j_col:
                x = F32(1.0)
            dot = F32(0.0)
            for j in cutlass.range_constexpr(r):
                dot = dot + sAkk[r, j] * rT[j]
            x = x - sB[r] * dot
            rT[r] = x
            sT[r, j_col] = x
            sP[r, j_col] = x * sB[j_col]
    if tidx < max(solver, 32):  # (a single warp, at K = 32, does both)
        kg_dakt(mma, sKg, sDakt, sKgDa, tidx, cfg.bt, cfg.k, cfg.mma_warps)
    cute.arch.sync_threads()

    # ---- the 16 x 16 x 16 products on tensor cores (`half_product`, an 8-column half a job, the jobs dealt
    # to the warps in turn): dP = Aqk^T dAq + Kg dAkt^T and dAqk = dAq P^T (lower triangles: no upper entry
    # reaches a result) ----
    w = tidx // 32
    lane = tidx % 32
    nw = cfg.k // 32
    for job in cutlass.range_constexpr(4):
        if w == job % nw:
            n0 = 8 * (job % 2)
            if cutlass.const_expr(job < 2):
                prod = _kgda_sum(mma, sKgDa, n0, lane, cfg.bt, cfg.mma_warps)
                _store_lower(sDP, half_product(mma, _t(sAqk, cfg.bt), sDaq, n0, lane, prod), n0, lane)
            else:
                _store_lower(sDAqk, half_product(mma, sDaq, _t(sP, cfg.bt), n0, lane), n0, lane)
    cute.arch.sync_threads()

    # ---- through the inverse: Y = T^T dP diag(beta), then dL = -Y T^T (strict lower); dbeta's share from
    # A's columns, sum_i dP_ic T_ic, by the last warp ----
    for job in cutlass.range_constexpr(2):
        if w == job % nw:
            prod = half_product(mma, _t(sT, cfg.bt), sDP, 8 * job, lane)
            for i in cutlass.range_constexpr(4):
                r, s = half_coord(lane, 8 * job, i)
                sY[r, s] = prod[i] * sB[s]
    db = F32(0.0)
    db_lane = tidx - 32 * (nw - 1)  # lane of the last warp
    if db_lane >= 0 and db_lane < cfg.bt:
        for i in cutlass.range_constexpr(cfg.bt):
            db = db + sDP[i, db_lane] * sT[i, db_lane]
    cute.arch.sync_threads()
    for job in cutlass.range_constexpr(2):
        if w == job % nw:
            prod = half_product(mma, sY, _t(sT, cfg.bt), 8 * job, lane)
            for i in cutlass.range_constexpr(4):
                r, s = half_coord(lane, 8 * job, i)
                d_l = cutlass.select_(s < r, -prod[i], F32(0.0))
                sDL[r, s] = d_l
                sDAkk[r, s] = d_l * sB[r]
    cute.arch.sync_threads()
    # ... and from L's rows (dbeta_r += sum_s dL_rs Akk_rs), then through beta's transform
    if db_lane >= 0 and db_lane < cfg.bt:
        for i in cutlass.range_constexpr(cfg.bt):
            db = db + sDL[db_lane, i] * sAkk[db_lane, i]
        if db_lane < rows:
            if cutlass.const_expr(cfg.beta != "prob"):
                sg = sigmoid(raw_b.to(F32), True)  # (beta of row db_lane: db_lane = tidx % bt here)
                db = db * sg * (1.0 - sg)
                if cutlass.const_expr(cfg.beta == "logit_x2"):
                    db = db * 2.0
            mDbeta[t0 + db_lane, hv] = db.to(cfg.beta_dtype)

    # ---- column c: the intra-tile products back to q, k and the decays, and dg ----
    # The rows loop's global reads (dQd, dKd and g of a row) are issued PREFETCH_ROWS rows ahead of their use.
    pre_qd = cute.make_rmem_tensor(cute.make_layout((PREFETCH_ROWS,)), F32)
    pre_kd = cute.make_rmem_tensor(cute.make_layout((PREFETCH_ROWS,)), F32)
    pre_g = cute.make_rmem_tensor(cute.make_layout((PREFETCH_ROWS,)), F32)
    for j in cutlass.range_constexpr(PREFETCH_ROWS):
        _prefetch_row(cfg, vDqd, vDkd, vG, cutlass.min(cfg.bt - 1 - j, last), c, j, pre_qd, pre_kd, pre_g)
    # (P dAkt)_r first (the gradient of k exp(G_last - G)), and with it the state's share of dG_last. P is
    # lower triangular (T's entries above the diagonal are exact zeros of the solve), so row r sums r + 1.
    rdkg = cute.make_rmem_tensor(cute.make_layout((cfg.bt,)), F32)
    d_akt = cute.make_rmem_tensor(cute.make_layout((cfg.bt,)), F32)
    for i in cutlass.range_constexpr(cfg.bt):
        d_akt[i] = sDakt[i, c]
    d_last = dgt * decay(g_last)  # exp(G_last) on the state
    for r in cutlass.range_constexpr(cfg.bt):
        dkg = F32(0.0)
        for i in cutlass.range_constexpr(r + 1):
            dkg = dkg + sP[r, i] * d_akt[i]
        rdkg[r] = dkg
        d_last = d_last + dkg * sKg[r, c]
    # Then the rows last to first: once row r is done, every row r' >= r has added to its column sum rdc[r],
    # so its dq, dk and dG are final and dG joins the reverse cumsum at once (which starts with dG_last's
    # extra term, shared by every row). q and k of this column are read from shared memory where used (fewer
    # registers: more CTAs an SM).
    # With the safe gate each pair's decay exp(G_r - G_s) is e_r / e_s, e = exp(G - G_m) from the middle
    # row m: |G - G_m| <= 8 x 5, so e and 1/e stay within 2^+-58 and the sums keep 2^69 of headroom for the
    # gradients' scale; k_s / e_s is formed once a column (kt) and no pair takes an exp. Otherwise
    # (hard resets possible) every pair takes its own exp(G_r - G_s) <= 1.
    rdc = cute.make_rmem_tensor(cute.make_layout((cfg.bt,)), F32)  # dk_col (over e_s with the safe gate)
    rdc.fill(0.0)
    kt = cute.make_rmem_tensor(cute.make_layout((cfg.bt,)), F32)
    g_mid = rG[cfg.bt // 2]
    f_mid = F32(0.0)
    if cutlass.const_expr(cfg.safe_gate):
        f_mid = decay(g_last - g_mid)
        for s in cutlass.range_constexpr(cfg.bt):
            kt[s] = sK[s, c] * decay(g_mid - rG[s])
    acc = d_last
    d_alog = F32(0.0)
    d_dt = F32(0.0)
    for i in cutlass.range_constexpr(cfg.bt):
        r = cfg.bt - 1 - i
        slot = i % PREFETCH_ROWS
        x_qd = cutlass.select_(r < rows, pre_qd[slot], F32(0.0))
        x_kd = cutlass.select_(r < rows, pre_kd[slot], F32(0.0))
        x_g = pre_g[slot]
        if cutlass.const_expr(i + PREFETCH_ROWS < cfg.bt):
            _prefetch_row(cfg, vDqd, vDkd, vG, cutlass.min(r - PREFETCH_ROWS, last), c, slot, pre_qd, pre_kd,
                          pre_g)
        q_r = sQ[r, c]
        k_r = sK[r, c]
        dq_r = F32(0.0)
        dk_r = F32(0.0)
        e_r = F32(1.0)
        if cutlass.const_expr(cfg.safe_gate):
            e_r = decay(rG[r] - g_mid)
            # 1/e_r by rcp: exp(g_mid - G_r) would be kt's factor again, which the compiler then keeps
            # live (spilled) from kt's loop to here
            inv_e = cute.arch.rcp_approx(e_r)
        qe = q_r * e_r
        ke = k_r * e_r
        for s0 in cutlass.range_constexpr(0, r + 1, 4):
            va = cute.make_tensor(sDAqk.iterator + r * (cfg.bt + MAT_PAD) + s0, cute.make_layout((4,))).load()
            vb = cute.make_tensor(sDAkk.iterator + r * (cfg.bt + MAT_PAD) + s0, cute.make_layout((4,))).load()
            for s in cutlass.range_constexpr(s0, min(s0 + 4, r + 1)):
                a = va[s - s0]
                b = vb[s - s0]
                if cutlass.const_expr(cfg.safe_gate):
                    dq_r = dq_r + a * kt[s]
                    dk_r = dk_r + b * kt[s]
                    rdc[s] = rdc[s] + a * qe + b * ke
                else:
                    w = decay(rG[r] - rG[s])
                    k_s = sK[s, c] * w
                    dq_r = dq_r + a * k_s
                    dk_r = dk_r + b * k_s
                    rdc[s] = rdc[s] + (a * q_r + b * k_r) * w
        if cutlass.const_expr(cfg.safe_gate):
            dq_r = dq_r * e_r
            dk_r = dk_r * e_r
            rdc[r] = rdc[r] * inv_e
        dkg = rdkg[r]
        # exp(G_last - G_r): with the safe gate from e_r (as the factor of sKg's setup it would stay live)
        f_r = F32(0.0)
        if cutlass.const_expr(cfg.safe_gate):
            f_r = f_mid * inv_e
        else:
            f_r = decay(g_last - rG[r])
        eg = decay(rG[r])
        q_eg = x_qd * eg
        k_eg = x_kd * eg
        acc_q[r] = acc_q[r] + q_eg + dq_r
        acc_k[r] = acc_k[r] + dk_r + rdc[r] + k_eg + dkg * f_r
        acc = acc + (q_r * dq_r + k_r * (dk_r - rdc[r]) + k_eg * k_r + q_eg * q_r - dkg * sKg[r, c])  # + dG_r
        # dg_r = the sum of dG over rows r and after, through the gate
        if cutlass.const_expr(cfg.gate == "precomputed"):
            if r < rows:
                vDg[r, c] = acc.to(cfg.g_dtype)
        elif cutlass.const_expr(cfg.gate == "lower_bound"):
            # g = lb sigmoid(z), z = a (x + dt); rows past the tile's end add nothing
            z = a_scale * (x_g + dt)
            sg = sigmoid(z, True)
            dz = cutlass.select_(r < rows, acc * (cfg.lower_bound * sg * (1.0 - sg)), F32(0.0))
            d_dt = d_dt + dz * a_scale
            d_alog = d_alog + dz * z
            if r < rows:
                vDg[r, c] = (dz * a_scale).to(cfg.g_dtype)
        else:
            # g = -a softplus(y), y = x + dt; rows past the tile's end add nothing
            y = x_g + dt
            d_y = cutlass.select_(r < rows, -acc * a_scale, F32(0.0))
            dx = d_y * sigmoid(y, True)
            d_dt = d_dt + dx
            d_alog = d_alog + d_y * softplus(y, True)
            if r < rows:
                vDg[r, c] = dx.to(cfg.g_dtype)
    if cutlass.const_expr(cfg.gate != "precomputed"):
        mDaLog[tile, hv, c] = d_alog
        mDdt[tile, hv, c] = d_dt


@cute.jit
def zero_tail(cfg: cutlass.Constexpr, mCu: cute.Tensor, mDq: cute.Tensor, mDk: cute.Tensor, mDg: cute.Tensor,
              mDbeta: cute.Tensor, h: cutlass.Int32, tidx: cutlass.Int32):
    """dq and dk of q/k head h, dg and dbeta of its value heads, zero for the tokens past cu_seqlens[-1]
    (engine padding: the forward's o there is 0 whatever they hold, and no tile covers them), by the CTA's
    K threads."""
    zero_padding_tail(mDq, mCu, h, 0, tidx, cfg.k, cfg.k, cfg.dtype)
    zero_padding_tail(mDk, mCu, h, 0, tidx, cfg.k, cfg.k, cfg.dtype)
    tail0 = cu_at(mCu, mCu.shape[0] - 1, mDbeta.shape[0])
    for j in cutlass.range(cfg.gva, unroll=1):
        hv = h * cfg.gva + j
        zero_padding_tail(mDg, mCu, hv, 0, tidx, cfg.k, cfg.k, cfg.g_dtype)
        for t in range(tail0 + tidx, mDbeta.shape[0], cfg.k):
            mDbeta[t, hv] = cfg.beta_dtype(0.0)
