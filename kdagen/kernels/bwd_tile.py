"""The backward's products with the states: the device code of the `bwd_tile` stage
(templates/mma_sync/bwd_tile.py.j2; kda-math.md §8, stages 2, 4 and 5 in the folded form of the forward's
step: R = V - Kd S, O = Qd S + Aq R, S' = diag(gt) S + Akt^T R).

Given the state S entering a tile and the gradient dS of the state leaving it, a tile's gradients of the
step's operands are dR = Aq^T dO + Akt dS (= dV), dQd = dO S^T, dKd = -dR S^T, dAkt = R dS^T, dAq = dO R^T
and dgt = the row sums of S * dS; everything after them is the `bwd_grads` stage's
(`kdagen.kernels.bwd_grads`). One CTA per (run of tiles, value head; the planner's run length), of up to eight
warps (`ProductsConfig.warps`): the forward keeps only the state entering each run, and the CTA carries it
through the run's tiles in fp32 accumulators as the forward does (S' above, one more 16-row product a tile),
so that the states' bytes, written by the forward and read here, are a run's fraction of a state a tile.
S (in the MMA type, as the forward wrote it) and each tile's dS (the scan's) are staged in shared memory
(dgt sums their products in fp32, as FLA takes it from its bf16 states), and the products run on warp MMAs,
the warps splitting the output columns. A tile's rows sit in a ring (`ProductsConfig.ring`; of two, the
next tile's rows load during this one's products), and its dS is requested once the previous tile's last
product has read the buffer.
"""

from dataclasses import dataclass
from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import warp

from kdagen.kernels import bwd_tile_shape
from kdagen.kernels.common import row_copy, swizzled_rows
from kdagen.kernels.prepare import load_tile

_HIGH = -0x10000  # a 32-bit word's high 16 bits

__all__ = [
    "ProductsConfig", "gemm", "gemm_into", "load_c", "products_mmas", "run_products",
    "stage_dh", "stage_rows", "stage_rows_of", "stage_state", "state_products", "store_c", "store_rows",
]



@dataclass(frozen=True)
class ProductsConfig:
    """What shapes a `bwd_tile` tile's code: head dims, tile length, the MMA type and the states' layout."""

    k: int  # key head dim
    v: int  # value head dim
    bt: int  # tokens per tile
    dtype: Any  # the MMA type (cutlass.BFloat16 or Float16): the tiles, dh, and S as staged
    kv_layout: bool  # h is [slots, HV, K, V] if True, else [slots, HV, V, K]
    ring: int  # tiles of rows staged at once (2: the next tile's load during this one's products)

    @property
    def warps(self) -> int:
        return bwd_tile_shape.warps(self.k, self.v)

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def min_ctas(self) -> int:
        return bwd_tile_shape.min_ctas(self.k, self.v)


def products_mmas(dtype, warps: int):
    """The stage's two tiled MMAs: `warps` warps side by side along N (16 columns of an output to each warp in
    turn: one ldmatrix.x4 of B per k-block), and one warp alone for the 16-column dAq."""
    op = warp.MmaF16BF16Op(dtype, cutlass.Float32, (16, 8, 16))
    mma_wide = cute.make_tiled_mma(op, (1, warps, 1), permutation_mnk=(16, warps * 16, 16))
    mma1 = cute.make_tiled_mma(op, (1, 1, 1), permutation_mnk=(16, 16, 16))
    return mma_wide, mma1


@cute.jit
def run_products(cfg: cutlass.Constexpr, mKd, mAkt, mAq, mV, mDo, mGt, mH, mDh, mDv, mDqd, mDkd, mDakt, mDaq,
                 mDgt, mma_wide, mma1, slot, tile0, hv, t0, rows, tidx, warp_idx, lane):
    """The run of tiles from tile id `tile0` (rows t0 .. t0 + rows, up to the run's length) and value
    head hv, by the CTA's `cfg.threads` threads, from the state entering the run (slot `slot` of mH):
    `mma_wide` is `products_mmas`' many-warp MMA, `mma1` its one-warp MMA."""
    smem = cutlass.memory.SmemAllocator()
    sS = smem.allocate_tensor(cfg.dtype, swizzled_rows(cfg.k, cfg.v), 1024)  # S (key rows)
    sD = smem.allocate_tensor(cfg.dtype, swizzled_rows(cfg.v, cfg.k), 1024)  # dS^T (value rows)
    # A tile's rows in a ring of `cfg.ring` (of two: the next tile's rows load while this one's products run).
    sKd2 = smem.allocate_tensor(cfg.dtype, swizzled_rows(cfg.bt, cfg.k, cfg.ring), 1024)
    sAkt2 = smem.allocate_tensor(cfg.dtype, swizzled_rows(cfg.bt, cfg.k, cfg.ring), 1024)
    sDo2 = smem.allocate_tensor(cfg.dtype, swizzled_rows(cfg.bt, cfg.v, cfg.ring), 1024)
    sV2 = smem.allocate_tensor(cfg.dtype, swizzled_rows(cfg.bt, cfg.v, cfg.ring), 1024)
    sAq2 = smem.allocate_tensor(
        cfg.dtype, cute.make_layout((cfg.bt, cfg.bt, cfg.ring), stride=(cfg.bt, 1, cfg.bt * cfg.bt)), 128)
    sG2 = smem.allocate_tensor(
        cutlass.Float32, cute.make_layout((1, cfg.k, cfg.ring), stride=(cfg.k, 1, cfg.k)), 16)
    sR = smem.allocate_tensor(cfg.dtype, swizzled_rows(cfg.bt, cfg.v), 1024)
    sDr = smem.allocate_tensor(cfg.dtype, swizzled_rows(cfg.bt, cfg.v), 1024)
    # dgt's partial sums, a warp's (its value columns) a key
    sPart = smem.allocate_tensor(cutlass.Float32, cute.make_layout((cfg.warps, cfg.k), stride=(cfg.k, 1)), 16)

    # ---- the first tile's rows and dS and the state entering the run, then (a ring of two) the second's ----
    # Every load is issued before any is waited on (the stage is bound by their latency): the tiles, dS and a
    # K-first S by cp.async, a V-first S by 16-byte loads into registers (it is transposed on the way in).
    n_tiles = (rows + cfg.bt - 1) // cfg.bt
    stage_rows_of(cfg, mKd, mAkt, mAq, mV, mDo, mGt, sKd2, sAkt2, sAq2, sV2, sDo2, sG2, 0, tile0, t0, hv,
                  rows, tidx)
    stage_dh(cfg, mDh, sD, tile0, hv, tidx)
    if cutlass.const_expr(cfg.kv_layout):
        copy_s = row_copy(cfg.dtype, cfg.v, cfg.threads)
        thr_s = copy_s.get_slice(tidx)
        cute.copy(copy_s, thr_s.partition_S(mH[slot, hv, None, None]), thr_s.partition_D(sS))
    cute.arch.cp_async_commit_group()
    if cutlass.const_expr(cfg.ring > 1):
        if n_tiles > 1:
            stage_rows_of(cfg, mKd, mAkt, mAq, mV, mDo, mGt, sKd2, sAkt2, sAq2, sV2, sDo2, sG2, 1, tile0 + 1,
                          t0 + cfg.bt, hv, rows - cfg.bt, tidx)
        cute.arch.cp_async_commit_group()
    if cutlass.const_expr(not cfg.kv_layout):
        stage_state(mH, sS, slot, hv, tidx, cfg.k, cfg.v, cfg.kv_layout, cfg.dtype, cfg.threads)

    thr = mma_wide.get_slice(tidx)
    ldsm = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), cfg.dtype)
    ldsm_t = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), cfg.dtype)
    # Operand views, (M or N, K) each: K-major ones take plain ldmatrix, MN-major ones ldmatrix.trans.
    # (N=v, K=key): S^T, MN-major
    sS_kv = cute.composition(sS, cute.make_layout((cfg.v, cfg.k), stride=(cfg.k, 1)))
    # (N=key, K=v): dS^T^T, MN-major
    sDT = cute.composition(sD, cute.make_layout((cfg.k, cfg.v), stride=(cfg.v, 1)))
    # (N=v, K=s): R^T, MN-major (the carry's B)
    sRT = cute.composition(sR, cute.make_layout((cfg.v, cfg.bt), stride=(cfg.bt, 1)))
    tRs = thr.partition_C(sR)
    # The accumulators' rows are 16 m + 8 h + g for lane 4g + q (m: the 16-row block, h: the half): thread
    # 0's slice gives each accumulator's r = 2 m + h, the same for every thread.
    rows0 = mma_wide.get_slice(0).partition_C(cute.make_identity_tensor((cfg.k, cfg.v)))
    tDrs = thr.partition_C(sDr)

    # S in fp32 accumulators (key rows), carried from tile to tile as the forward carries it; sS holds its
    # copy in the MMA type, the operand of every product (the forward's operand too).
    tSs = thr.partition_C(sS)
    acc_s = cute.make_rmem_tensor(thr.partition_shape_C((cfg.k, cfg.v)), cutlass.Float32)
    cute.arch.cp_async_wait_group(cfg.ring - 1)
    cute.arch.sync_threads()
    load_c(tSs, acc_s, cfg.dtype)

    for j in range(n_tiles):
        st = j % cfg.ring
        tile = tile0 + j
        tj = t0 + j * cfg.bt
        rj = cutlass.min(rows - j * cfg.bt, cfg.bt)
        sKd = sKd2[None, None, st]
        sAkt = sAkt2[None, None, st]
        sDo = sDo2[None, None, st]
        sV = sV2[None, None, st]
        sAq = sAq2[None, None, st]
        # (M=t, K=s): Aq^T, MN-major; (N=v, K=s): dO^T, MN-major; (M=key, K=s): Akt^T, MN-major
        sAqT = cute.composition(sAq, cute.make_layout((cfg.bt, cfg.bt), stride=(cfg.bt, 1)))
        sDoT = cute.composition(sDo, cute.make_layout((cfg.v, cfg.bt), stride=(cfg.bt, 1)))
        sAktT = cute.composition(sAkt, cute.make_layout((cfg.k, cfg.bt), stride=(cfg.bt, 1)))

        # ---- Kd S and Akt dS (16 x V each) and dgt, the row sums of S * dS over the values, in one pass over
        # the key blocks (S and dS read once for all three); dgt's warp sums are added in order below ----
        acc_d = gemm(mma_wide, thr, tidx, sAqT, sDoT, ldsm_t, ldsm_t, cfg.bt, cfg.v, cfg.bt)
        acc_r = cute.make_rmem_tensor(thr.partition_shape_C((cfg.bt, cfg.v)), cutlass.Float32)
        acc_r.fill(0.0)
        state_products(mma_wide, thr, tidx, sKd, sAkt, sS_kv, sD, ldsm, ldsm_t, acc_r, acc_d, sPart, warp_idx,
                       cfg.bt, cfg.k, cfg.v)
        # ---- R = V - Kd S; rows past the tile's end are zero (their Kd and V are) ----
        v_in = cute.make_rmem_tensor(acc_r.layout, cutlass.Float32)
        load_c(thr.partition_C(sV), v_in, cfg.dtype)
        for i in cutlass.range_constexpr(cute.size(acc_r)):
            acc_r[i] = v_in[i] - acc_r[i]
        store_c(acc_r, tRs, cfg.dtype)
        # ---- dR = Aq^T dO + Akt dS: dV, and -dR for dKd ----
        store_rows(acc_d, thr, mDv, tj, hv, rj, cfg.bt, cfg.v)
        for i in cutlass.range_constexpr(cute.size(acc_d)):
            acc_d[i] = -acc_d[i]
        store_c(acc_d, tDrs, cfg.dtype)
        cute.arch.sync_threads()

        # ---- dAkt = R dS^T (16 x K), the last reader of dS ----
        acc_a = gemm(mma_wide, thr, tidx, sR, sDT, ldsm, ldsm_t, cfg.bt, cfg.k, cfg.v)
        store_rows(acc_a, thr, mDakt, tj, hv, rj, cfg.bt, cfg.k)
        cute.arch.sync_threads()
        # The next tile's dS loads while this tile's other products and the carry run.
        if j + 1 < n_tiles:
            stage_dh(cfg, mDh, sD, tile + 1, hv, tidx)
        cute.arch.cp_async_commit_group()
        if tidx < cfg.k:
            acc = sPart[0, tidx]
            for w in cutlass.range_constexpr(1, cfg.warps):
                acc = acc + sPart[w, tidx]
            mDgt[tile, hv, tidx] = acc

        # ---- dQd = dO S^T, dKd = -dR S^T (16 x K) ----
        acc_q = gemm(mma_wide, thr, tidx, sDo, sS, ldsm, ldsm, cfg.bt, cfg.k, cfg.v)
        acc_k = gemm(mma_wide, thr, tidx, sDr, sS, ldsm, ldsm, cfg.bt, cfg.k, cfg.v)
        store_rows(acc_q, thr, mDqd, tj, hv, rj, cfg.bt, cfg.k)
        store_rows(acc_k, thr, mDkd, tj, hv, rj, cfg.bt, cfg.k)
        # ---- dAq = dO R^T (16 x 16), one warp ----
        if warp_idx == 0:
            thr1 = mma1.get_slice(lane)
            acc_aq = gemm(mma1, thr1, lane, sDo, sR, ldsm, ldsm, cfg.bt, cfg.bt, cfg.v)
            store_rows(acc_aq, thr1, mDaq, tj, hv, rj, cfg.bt, cfg.bt)

        # ---- the state into the next tile: S' = diag(gt) S + Akt^T R ----
        if j + 1 < n_tiles:
            gts = cute.make_rmem_tensor(cute.make_layout((cfg.k // 8,)), cutlass.Float32)  # a row's gt
            for r in cutlass.range_constexpr(cfg.k // 8):
                gts[r] = sG2[0, 8 * r + lane // 4, st]
            for i in cutlass.range_constexpr(cute.size(acc_s)):
                acc_s[i] = acc_s[i] * gts[rows0[i][0] // 8]
            gemm_into(mma_wide, thr, tidx, sAktT, sRT, ldsm_t, ldsm_t, acc_s, cfg.bt)
            # Once every thread is past this tile's reads of S and of its ring slot: S' into sS, and the
            # rows of the tile `ring` on into the slot.
            cute.arch.sync_threads()
            store_c(acc_s, tSs, cfg.dtype)
            if j + cfg.ring < n_tiles:
                stage_rows_of(cfg, mKd, mAkt, mAq, mV, mDo, mGt, sKd2, sAkt2, sAq2, sV2, sDo2, sG2, st,
                              tile + cfg.ring, tj + cfg.ring * cfg.bt, hv, rows - (j + cfg.ring) * cfg.bt,
                              tidx)
            cute.arch.cp_async_commit_group()
            # In flight, oldest first: (a ring of two) the next tile's rows, its dS, the rows `ring` on: all
            # but the last land.
            cute.arch.cp_async_wait_group(cfg.ring - 1)
            cute.arch.sync_threads()


@cute.jit
def state_products(mma_wide: cute.TiledMma, thr, tidx, sKd: cute.Tensor, sAkt: cute.Tensor,
                   sS_kv: cute.Tensor, sD: cute.Tensor, ldsm, ldsm_t, acc_r: cute.Tensor, acc_d: cute.Tensor,
                   sPart: cute.Tensor, warp_idx, bt: cutlass.Constexpr, k: cutlass.Constexpr,
                   v: cutlass.Constexpr):
    # acc_r += Kd S and acc_d += Akt dS (bt x v each, the sums over the keys), and dgt's partial sums over
    # each warp's value columns into sPart[warp], in one pass over 16-key blocks (a rolled loop: few
    # registers beside the carried state). S (as (N=value, K=key), by ldmatrix.trans from its staged copy)
    # and dS (sD, by ldmatrix) are both the wide MMA's B operand, so their fragments share one layout and
    # dgt multiplies them as loaded (fp32 sums of the staged copies). Lane 4g + q holds keys 2q + {0, 1, 8,
    # 9} of the block at some of the warp's values: it sums its values of each key, then the eight lanes of
    # its q add theirs by a transposing butterfly (each step hands half of a lane's keys to its partner),
    # after which lane 4g + q (g even) holds key 2q + (g >> 1 & 1) + 8 (g >> 2). Fixed order (no atomics).
    s2r_a = cute.make_tiled_copy_A(ldsm, mma_wide)
    s2r_s = cute.make_tiled_copy_B(ldsm_t, mma_wide)
    s2r_d = cute.make_tiled_copy_B(ldsm, mma_wide)
    thr_a = s2r_a.get_slice(tidx)
    thr_s = s2r_s.get_slice(tidx)
    thr_d = s2r_d.get_slice(tidx)
    # one 16-key block's fragments
    rKd = cute.make_rmem_tensor(thr.partition_shape_A((bt, 16)), sKd.element_type)
    rAkt = cute.make_rmem_tensor(thr.partition_shape_A((bt, 16)), sAkt.element_type)
    rS = cute.make_rmem_tensor(thr.partition_shape_B((v, 16)), sS_kv.element_type)
    rD = cute.make_rmem_tensor(thr.partition_shape_B((v, 16)), sD.element_type)
    tKd = thr_a.partition_S(sKd)
    tAkt = thr_a.partition_S(sAkt)
    tSs = thr_s.partition_S(sS_kv)
    tDs = thr_d.partition_S(sD)
    rKd_v = thr_a.retile(rKd)
    rAkt_v = thr_a.retile(rAkt)
    rS_v = thr_s.retile(rS)
    rD_v = thr_d.retile(rD)
    # the key (within its 16-key block) of each value of a block's B fragment, for lane 0
    blk_keys = mma_wide.get_slice(0).partition_B(cute.make_identity_tensor((v, k)))[None, None, 0]
    lane = tidx % 32
    for kb in cutlass.range(k // 16, unroll=1):
        cute.copy(s2r_a, tKd[None, None, kb], rKd_v[None, None, 0])
        cute.copy(s2r_s, tSs[None, None, kb], rS_v[None, None, 0])
        cute.copy(s2r_a, tAkt[None, None, kb], rAkt_v[None, None, 0])
        cute.copy(s2r_d, tDs[None, None, kb], rD_v[None, None, 0])
        cute.gemm(mma_wide, acc_r, rKd[None, None, 0], rS[None, None, 0], acc_r)
        cute.gemm(mma_wide, acc_d, rAkt[None, None, 0], rD[None, None, 0], acc_d)
        sums = cute.make_rmem_tensor(cute.make_layout((4,)), cutlass.Float32)
        sums.fill(0.0)
        if cutlass.const_expr(sD.element_type == cutlass.BFloat16):
            # a 32-bit word holds two adjacent keys' values (the lower key in its low half): bf16 into fp32 by
            # a shift or a mask, one instruction each
            wS = cute.recast_tensor(rS, cutlass.Int32)
            wD = cute.recast_tensor(rD, cutlass.Int32)
            for i in cutlass.range_constexpr(cute.size(wS)):
                assert blk_keys[2 * i + 1][1] == blk_keys[2 * i][1] + 1  # (checked as traced)
                slot = 2 * ((blk_keys[2 * i][1] % 16) // 8)
                sums[slot] = sums[slot] + (wS[i] << 16).bitcast(cutlass.Float32) * (wD[i] << 16).bitcast(
                    cutlass.Float32)
                sums[slot + 1] = sums[slot + 1] + (wS[i] & _HIGH).bitcast(cutlass.Float32) * (
                    wD[i] & _HIGH).bitcast(cutlass.Float32)
        else:
            for i in cutlass.range_constexpr(cute.size(rS)):
                c = blk_keys[i][1] % 16
                slot = (c % 2) + 2 * (c // 8)
                sums[slot] = sums[slot] + rS[i].to(cutlass.Float32) * rD[i].to(cutlass.Float32)
        for step in cutlass.range_constexpr(2):
            half = 2 >> step
            upper = (lane & (16 >> step)) != 0
            for j in cutlass.range_constexpr(half):
                send = cutlass.select_(upper, sums[j], sums[j + half])
                keep = cutlass.select_(upper, sums[j + half], sums[j])
                sums[j] = keep + cute.arch.shuffle_sync_bfly(send, offset=16 >> step)
        sums[0] = sums[0] + cute.arch.shuffle_sync_bfly(sums[0], offset=4)
        g = lane // 4
        if g % 2 == 0:
            sPart[warp_idx, 16 * kb + 2 * (lane % 4) + (g >> 1) % 2 + 8 * (g >> 2)] = sums[0]


@cute.jit
def store_rows(acc: cute.Tensor, thr, mDst: cute.Tensor, t0, hv, rows, bt: cutlass.Constexpr,
               cols: cutlass.Constexpr):
    # A tile's product (bt x cols fp32 accumulators of `thr`'s partition) into
    # rows t0 .. t0 + rows of head hv of mDst, in its dtype: a whole tile by the partition's vector stores
    # (an accumulator's column pairs are adjacent) from one base address, a sequence's partial last tile
    # element by element.
    tile = cute.local_tile(cute.domain_offset((t0, 0), mDst[None, hv, None]), (bt, cols), (0, 0))
    g = thr.partition_C(tile)
    if rows == bt:
        frag = cute.make_rmem_tensor(g.shape, mDst.element_type)
        for i in cutlass.range_constexpr(cute.size(acc)):
            frag[i] = acc[i].to(mDst.element_type)
        cute.autovec_copy(frag, g)
    else:
        coord = thr.partition_C(cute.make_identity_tensor((bt, cols)))
        for i in cutlass.range_constexpr(cute.size(acc)):
            if coord[i][0] < rows:
                g[i] = acc[i].to(mDst.element_type)


@cute.jit
def store_c(acc: cute.Tensor, tDst: cute.Tensor, dtype: cutlass.Constexpr):
    # fp32 accumulators into their partition of a shared-memory tile (the same elements in the same order),
    # rounded to `dtype`: a fragment in the partition's own layout, copied by vector stores where the
    # partition's offsets allow (an accumulator's column pairs are adjacent).
    frag = cute.make_rmem_tensor(tDst.shape, dtype)
    for i in cutlass.range_constexpr(cute.size(acc)):
        frag[i] = acc[i].to(dtype)
    cute.autovec_copy(frag, tDst)


@cute.jit
def load_c(tSrc: cute.Tensor, acc: cute.Tensor, dtype: cutlass.Constexpr):
    # The reverse of `store_c`: a partition of a shared-memory tile into fp32 accumulators.
    frag = cute.make_rmem_tensor(tSrc.shape, dtype)
    cute.autovec_copy(tSrc, frag)
    for i in cutlass.range_constexpr(cute.size(acc)):
        acc[i] = frag[i].to(cutlass.Float32)


@cute.jit
def stage_rows_of(cfg: cutlass.Constexpr, mKd, mAkt, mAq, mV, mDo, mGt, sKd2, sAkt2, sAq2, sV2, sDo2, sG2, st,
                  tile, t0, hv, rows, tidx):
    # A tile's rows of Kd, Akt, Aq, V and dO (zero past its end) and its decay gt into ring slot `st`, by
    # cp.async.
    stage_rows(mKd, sKd2[None, None, st], t0, hv, rows, tidx, cfg.bt, cfg.k, cfg.dtype, cfg.threads)
    stage_rows(mAkt, sAkt2[None, None, st], t0, hv, rows, tidx, cfg.bt, cfg.k, cfg.dtype, cfg.threads)
    stage_rows(mDo, sDo2[None, None, st], t0, hv, rows, tidx, cfg.bt, cfg.v, cfg.dtype, cfg.threads)
    stage_rows(mV, sV2[None, None, st], t0, hv, rows, tidx, cfg.bt, cfg.v, cfg.dtype, cfg.threads)
    stage_rows(mAq, sAq2[None, None, st], t0, hv, rows, tidx, cfg.bt, cfg.bt, cfg.dtype, cfg.threads)
    if tidx < cfg.k // 4:
        copy_g = row_copy(cutlass.Float32, cfg.k, cfg.k // 4)
        thr_g = copy_g.get_slice(tidx)
        g = cute.local_tile(mGt[None, hv, None], (1, cfg.k), (tile, 0))
        cute.copy(copy_g, thr_g.partition_S(g), thr_g.partition_D(sG2[None, None, st]))


@cute.jit
def stage_dh(cfg: cutlass.Constexpr, mDh, sD, tile, hv, tidx):
    # The gradient of the state leaving a tile, dS^T (the scan's), by cp.async.
    copy_d = row_copy(cfg.dtype, cfg.k, cfg.threads)
    thr_d = copy_d.get_slice(tidx)
    cute.copy(copy_d, thr_d.partition_S(mDh[tile, hv, None, None]), thr_d.partition_D(sD))


@cute.jit
def gemm(tiled_mma: cute.TiledMma, thr, tidx, sA: cute.Tensor, sB: cute.Tensor, atom_a, atom_b,
          m: cutlass.Constexpr, n: cutlass.Constexpr, k: cutlass.Constexpr) -> cute.Tensor:
    # C (m x n, fp32) = A (m x k) B^T (B as (n, k)), both from shared memory (`gemm_into` from zero).
    acc = cute.make_rmem_tensor(thr.partition_shape_C((m, n)), cutlass.Float32)
    acc.fill(0.0)
    gemm_into(tiled_mma, thr, tidx, sA, sB, atom_a, atom_b, acc, k)
    return acc


@cute.jit
def gemm_into(tiled_mma: cute.TiledMma, thr, tidx, sA: cute.Tensor, sB: cute.Tensor, atom_a, atom_b,
              acc: cute.Tensor, k: cutlass.Constexpr):
    # acc (m x n, fp32, partitioned by `thr`) += A (m x k) B^T (B as (n, k)), both from shared memory through
    # ldmatrix (`atom_a`, `atom_b`: plain for K-major operands, .trans for MN-major ones), k/16 blocks.
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
    for kb in cutlass.range_constexpr(k // 16):
        cute.copy(s2r_a, tAs[None, None, kb], rA_v[None, None, kb])
        cute.copy(s2r_b, tBs[None, None, kb], rB_v[None, None, kb])
        cute.gemm(tiled_mma, acc, rA[None, None, kb], rB[None, None, kb], acc)


@cute.jit
def stage_rows(mSrc: cute.Tensor, sDst: cute.Tensor, t0, hv, rows, tidx, bt: cutlass.Constexpr,
               cols: cutlass.Constexpr, dtype: cutlass.Constexpr, threads: cutlass.Constexpr):
    # Rows t0 .. t0 + rows of head hv (bt x cols of the MMA type) into sDst by cp.async, 16 bytes a copy;
    # the rows past the tile's end are zero-filled (no read past the tensor).
    active = bt * cols * dtype.width // 128  # 16-byte copies of the tile
    if tidx < active:
        g = cute.local_tile(cute.domain_offset((t0, 0), mSrc[None, hv, None]), (bt, cols), (0, 0))
        load_tile(row_copy(dtype, cols, min(threads, active)), tidx, g, sDst, rows)


@cute.jit
def stage_state(mH: cute.Tensor, sS: cute.Tensor, slot, hv, tidx, k: cutlass.Constexpr, v: cutlass.Constexpr,
                kv_layout: cutlass.Constexpr, dtype: cutlass.Constexpr, threads: cutlass.Constexpr):
    # S of (slot, hv) (any dtype and either layout) into sS (key rows, the MMA type): 16-byte loads along
    # the state's contiguous dim, a batch of them issued before any is converted and stored.
    n = 128 // mH.element_type.width  # elements a load
    lines = v if kv_layout else k  # elements of a contiguous row
    per_row = lines // n
    loads = k * v // n // threads
    batch = min(loads, 16)
    for b in cutlass.range_constexpr(loads // batch):
        raw = cute.make_rmem_tensor(cute.make_layout((n, batch), stride=(1, n)), mH.element_type)
        for j in cutlass.range_constexpr(batch):
            e = tidx + threads * (b * batch + j)
            row = mH[slot, hv, e // per_row, None]
            cute.autovec_copy(cute.local_tile(row, (n,), (e % per_row,)), raw[None, j])
        for j in cutlass.range_constexpr(batch):
            e = tidx + threads * (b * batch + j)
            r = e // per_row
            if cutlass.const_expr(kv_layout):  # n adjacent values of a key row: one vector store
                x = cute.make_rmem_tensor(cute.make_layout((n,)), dtype)
                x.store(raw[None, j].load().to(dtype))
                cute.autovec_copy(x, cute.local_tile(sS[r, None], (n,), (e % per_row,)))
            else:
                for i in cutlass.range_constexpr(n):
                    sS[(e % per_row) * n + i, r] = raw[i, j].to(dtype)
