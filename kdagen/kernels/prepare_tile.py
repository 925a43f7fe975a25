"""Prepare's per-tile math (kda-math.md §2.1-§2.3, folded form), one warp per (16-token tile, value head), in
phases a kernel calls in order.

Two kernels run the tile: the stand-alone prepare stage (outputs to the workspace, a ready flag per tile) and
the fused wgmma kernel (outputs into a stage of the recurrence's shared-memory ring). `TileConfig` says which,
and every phase takes what differs between them as arguments; what each kernel does between the phases (its
stores, its next tile's loads, its hand-off) stays in its own source.

1. `tile_views`: the warp's shared-memory views.
2. `stage_inputs` (stand-alone only; the fused kernel loads a tile's inputs during the tile before it).
3. `decay_blocks`: l2norm, the gate, the chunk-local cumsum in log2 units and the decayed copies kd, qd, kr
   per 16-column block, with the products of the intra-tile matrices L and Mqk accumulated on the way.
4. `park_beta`, then `tile_matrices`: L (strict lower, beta on the row) and Mqk (lower incl.) into shared
   memory.
5. `solve_tile`: P = (I + L)^-1 diag(beta) by forward substitution.
6. `fold_q` (Aq = Mqk P) and `fold_k` (Ak^T = P^T Kr), whose accumulators the kernel stores.
"""

from dataclasses import dataclass
from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import warp

from kdagen.kernels.common import pack2, row_copy, swizzled_rows
from kdagen.kernels.gate import beta_value
from kdagen.kernels.prepare import (
    anchored_operands,
    col_offset,
    col_side_row,
    ex2,
    gram_b,
    ld_block,
    load_dt_bias,
    load_tile,
    row_side_row,
)

__all__ = [
    "LOG2E",
    "LN2",
    "TileConfig",
    "TileViews",
    "tf32",
    "store_pair",
    "tile_views",
    "fragment_rows",
    "stage_inputs",
    "l2norm_scales",
    "decay_blocks",
    "park_beta",
    "tile_matrices",
    "solve_tile",
    "fold_q",
    "fold_k",
]

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@dataclass(frozen=True)
class TileConfig:
    """What shapes a tile's code: sizes, dtypes, the gate and its promise, l2norm, and the kernel that runs
    it."""

    k: int  # key head dim
    bt: int  # tokens per tile
    gva: int  # value heads per q/k head
    dtype: Any  # q, k and the 16-bit outputs (cutlass.BFloat16 or Float16)
    g_dtype: Any  # g as given
    beta: str  # how beta is given: "prob", "logit" or "logit_x2" (`kdagen.kernels.gate.beta_value`)
    gate: str  # "precomputed", "softplus" or "lower_bound"
    lower_bound: float | None
    safe_gate: bool  # g >= lower_bound promised: the chunk-start anchor on tensor cores
    l2norm: bool
    unroll_kb: int  # column blocks per trip of the rolled block loop
    fused: bool  # run by the fused kernel (ring outputs) rather than the stand-alone stage

    @property
    def nkb(self) -> int:
        return self.k // 16

    @property
    def kp(self) -> int:
        # Padded 16-bit rows (272 B at K=128): ldmatrix and column-wise reads hit distinct banks.
        return self.k + 8


@dataclass(frozen=True)
class TileViews:
    """The warp's shared-memory views of one tile (`tile_views`)."""

    sQ: Any  # q, padded rows (then qd on its way out in the stand-alone stage)
    sK: Any  # k, padded rows (then kd, then Ak^T in the stand-alone stage)
    sQv: Any  # the unpadded (bt, K) views
    sKv: Any
    sKr: Any  # kr = k 2^(b_last - b), fp16, XOR-swizzled rows
    sKr32: Any
    sQ32: Any  # 32-bit views for the packed stores of the stand-alone stage (None in the fused kernel)
    sK32: Any
    sGb: Any  # g: one 16-column block (stand-alone) or the whole tile (fused)
    sL: Any  # L (fp32), P^T (fp16), Mqk (fp32)
    sPt: Any
    sM: Any
    sBeta: Any


@cute.jit
def tf32(x):
    # An fp32 value as a tf32 operand, rounded to nearest with ties away from zero: what cvt.rna.tf32.f32
    # gives for every finite value (the operands here are), in two integer instructions where cvt.rna takes
    # three or four with its NaN check. The stand-alone prepare keeps cvt.rna: at its 96-register cap this
    # form cost it ~1.5% (docs/experiments.md, "tf32 conversions").
    return (cutlass.Float32(x).bitcast(cutlass.Int32) + 0x1000) & cutlass.Int32(-0x2000)


@cute.jit
def store_pair(s_image: cute.Tensor, image: cute.ComposedLayout, coord, x0, x1, dtype: cutlass.Constexpr):
    # x0 and x1 as one packed 32-bit store at `coord` (innermost index even) and the element after it of a
    # ring image (`s_image`, allocated with `image`'s swizzle on its pointer). The swizzle acts on byte
    # addresses (it rides on the shared-memory pointer, as CuTe's swizzle_ptr does), and the 32-bit pointer
    # drops it, so it is applied here to the byte offset of the unswizzled layout; applied to the element
    # index (crd2idx of the composed layout) it would scramble the wrong bits.
    words = cute.make_tensor(cute.recast_ptr(s_image.iterator, dtype=cutlass.Int32),
                             cute.make_layout((cute.cosize(image.outer) // 2,)))
    byte = cute.crd2idx(coord, image.outer) * (dtype.width // 8)
    swizzled = cute.make_composed_layout(image.inner, 0, cute.make_layout(1 << 24))
    words[cute.crd2idx(byte, swizzled) // 4] = pack2(x0, x1, dtype)


def tile_views(cfg: TileConfig, w, sQ_all, sK_all, sKr_all, sGb_all, sBeta_all, sLPM_all=None,
               lpm_words: int = 0) -> TileViews:
    """Warp w's views (trace time). Once kd and qd have left, the stand-alone stage keeps L, P^T and Mqk in
    its q and k tiles (bt * kp 16-bit values each, >= 2304 B); the fused kernel, whose q and k tiles take the
    next tile's inputs as soon as kd and qd are out, keeps them in a buffer of their own (`sLPM_all`,
    `lpm_words` 32-bit words a warp)."""
    bt, k = cfg.bt, cfg.k
    # (the offset is asserted a multiple of a whole tile, so the pointer keeps its 128-byte alignment)
    sKr = cute.make_tensor(sKr_all.iterator + cute.assume(w * (bt * k), divby=bt * k), swizzled_rows(bt, k))
    sGb = sGb_all[w, None, None]
    sQ = sQ_all[w, None, None]
    sK = sK_all[w, None, None]
    sQv = cute.local_tile(sQ, (bt, k), (0, 0))
    sKv = cute.local_tile(sK, (bt, k), (0, 0))
    sQ32 = None
    sK32 = None
    if not cfg.fused:
        pair_rows = cute.make_layout((bt, cfg.kp // 2), stride=(cfg.kp // 2, 1))
        sQ32 = cute.make_tensor(cute.recast_ptr(sQ.iterator, dtype=cutlass.Int32), pair_rows)
        sK32 = cute.make_tensor(cute.recast_ptr(sK.iterator, dtype=cutlass.Int32), pair_rows)
    sKr32 = cute.make_tensor(cute.recast_ptr(sKr.iterator, dtype=cutlass.Int32),
                             cute.make_layout((bt * k // 2,)))
    sq = cute.make_layout((bt, bt), stride=(bt, 1))
    if cfg.fused:
        sL = cute.make_tensor(sLPM_all.iterator + w * lpm_words, sq)
        sPt = cute.make_tensor(
            cute.recast_ptr(sLPM_all.iterator + w * lpm_words + bt * bt, dtype=cutlass.Float16), sq
        )
        sM = cute.make_tensor(sLPM_all.iterator + w * lpm_words + bt * bt + bt * bt // 2, sq)
    else:
        sL = cute.make_tensor(cute.recast_ptr(sQ.iterator, dtype=cutlass.Float32), sq)
        sPt = cute.make_tensor(cute.recast_ptr(sQ.iterator, dtype=cutlass.Float16) + 2 * bt * bt, sq)
        sM = cute.make_tensor(cute.recast_ptr(sK.iterator, dtype=cutlass.Float32), sq)
    sBeta = sBeta_all[w, None]
    return TileViews(sQ, sK, sQv, sKv, sKr, sKr32, sQ32, sK32, sGb, sL, sPt, sM, sBeta)


def fragment_rows(gq, rows):
    """The lane's fragment rows (g, g + 8) and whether they are in the sequence (`rows` of the tile are)."""
    rr = (gq, gq + 8)
    return rr, (rr[0] < rows, rr[1] < rows)


@cute.jit
def stage_inputs(cfg, lane, gq, mQ, mK, mG, mBeta, h, hv, t0, rows, views):
    """The stand-alone stage's tile inputs: q and k tiles and block 0 of g by cp.async (rows past the
    sequence end read as zero), and beta of row `lane` (transformed by `cfg.beta`; zero past the sequence
    end), loaded now and parked in shared memory only after the column blocks (its first use). Returns (the
    lane's `fragment_rows`, beta of row `lane`, the g copy, g's rows of the tile)."""
    copy_in = row_copy(cfg.dtype, cfg.k, 32)
    shape = (cfg.bt, cfg.k)
    load_tile(copy_in, lane, cute.local_tile(cute.domain_offset((t0, 0), mQ[None, h, None]), shape, (0, 0)),
              views.sQv, rows)
    load_tile(copy_in, lane, cute.local_tile(cute.domain_offset((t0, 0), mK[None, h, None]), shape, (0, 0)),
              views.sKv, rows)
    copy_g = row_copy(cfg.g_dtype, 16, 32)
    g_rows = cute.domain_offset((t0, 0), mG[None, hv, None])
    load_tile(copy_g, lane, cute.local_tile(g_rows, (cfg.bt, 16), (0, 0)), views.sGb, rows)  # block 0 of g
    cute.arch.cp_async_commit_group()
    rr, valid = fragment_rows(gq, rows)
    bl = cutlass.Float32(0.0)
    if lane < rows:
        bl = beta_value(mBeta[t0 + lane, hv].to(cutlass.Float32), cfg.beta)
    cute.arch.cp_async_wait_group(0)
    cute.arch.sync_warp()
    return rr, valid, bl, copy_g, g_rows


@cute.jit
def l2norm_scales(cfg, ldsm, mma_in, lane, gq, sQv, sKv, scale, mask):
    """l2norm (§2.2) of the lane's two fragment rows: the sums of squares are the diagonal of the Gram matrix
    X X^T, one tensor-core product per 16-column block (exact 16-bit products, fp32 accumulation). Returns
    the row scales of q (with `scale` folded in) and of k, zero on rows past the sequence end (`mask`)."""
    bt = cfg.bt
    thr_in = mma_in.get_slice(lane)
    gram_q = cute.make_rmem_tensor(thr_in.partition_shape_C((bt, bt)), cutlass.Float32)
    gram_k = cute.make_rmem_tensor(thr_in.partition_shape_C((bt, bt)), cutlass.Float32)
    gram_q.fill(0.0)
    gram_k.fill(0.0)
    for kb in cutlass.range_constexpr(cfg.nkb):
        rQ = ld_block(ldsm, mma_in, lane, sQv, kb, bt)
        cute.gemm(mma_in, gram_q, rQ, gram_b(mma_in, lane, rQ, bt, cfg.dtype), gram_q)
        rK = ld_block(ldsm, mma_in, lane, sKv, kb, bt)
        cute.gemm(mma_in, gram_k, rK, gram_b(mma_in, lane, rK, bt, cfg.dtype), gram_k)
    # Row r's diagonal entry sits in lane 4 (r % 8) + (r % 8) // 2, slot (r % 2) (+ 6 for r >= 8).
    src = 4 * gq + gq // 2
    odd = gq % 2 == 1
    ssq = [cute.arch.shuffle_sync(cutlass.select_(odd, gram_q[1 + 6 * hh], gram_q[6 * hh]), offset=src)
           for hh in range(2)]
    ssk = [cute.arch.shuffle_sync(cutlass.select_(odd, gram_k[1 + 6 * hh], gram_k[6 * hh]), offset=src)
           for hh in range(2)]
    rq = tuple(cute.math.rsqrt(ssq[hh] + 1e-6) * scale * mask[hh] for hh in range(2))
    rk = tuple(cute.math.rsqrt(ssk[hh] + 1e-6) * mask[hh] for hh in range(2))
    return rq, rk


@cute.jit
def decay_blocks(cfg, views, lane, gq, tq, rr, valid, rows, scale, mma_tf32, mma_in, a_scale=None, mALog=None,
                 mDtBias=None, hv=None, copy_g=None, g_rows=None, mGt=None, tile=None, sDt=None, sGt=None,
                 stage=None, sKd=None, sQd=None, kd_layout=None):
    """l2norm, the gate and its chunk-local cumsum, and the decayed copies, per 16-column block (§2.1-§2.3).

    kd and qd go to the warp's k and q tiles (stand-alone) or the ring stage's images (`sKd`, `sQd` in
    `kd_layout`, fused); the whole-tile decay of each column to `mGt[tile, hv]` or `sGt[0, :, stage]`; kr to
    the warp's kr tile. The gate's dt_bias comes from `mDtBias[hv]` (stand-alone) or `sDt` (fused, staged
    per chain), exp(A_log) as `a_scale` (fused) or from `mALog[hv]` (stand-alone). `rr` and `valid` are the
    lane's `fragment_rows`. Returns the intra-tile products: (acc_l, acc_m) with the safe gate, else (the
    four anchored levels' accumulators, Mqk's diagonal).
    """
    bt = cfg.bt
    sQv, sKv, sGb, sKr, sKr32 = views.sQv, views.sKv, views.sGb, views.sKr, views.sKr32

    # q and k of one 16-column block as A fragments (ldmatrix): slot i is row g + 8 ((i // 2) % 2),
    # column 16 kb + 2t + (i % 2) + 8 (i // 4). Loaded per block, so few registers stay live.
    ldsm = cute.make_tiled_copy_A(
        cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), cfg.dtype), mma_in
    )
    mask = tuple(cutlass.Float32(1.0) if valid[hh] else cutlass.Float32(0.0) for hh in range(2))

    # ---- l2norm (§2.2) ----
    if cutlass.const_expr(cfg.l2norm):
        rq, rk = l2norm_scales(cfg, ldsm, mma_in, lane, gq, sQv, sKv, scale, mask)
    else:
        rq = tuple(scale * mask[hh] for hh in range(2))
        rk = mask
    if cutlass.const_expr(cfg.gate != "precomputed" and not cfg.fused):
        a_scale = cute.math.exp(mALog[hv])
    if cutlass.const_expr(cfg.gate == "lower_bound"):
        sig_coef = -a_scale * LOG2E
        # g's bound in log2 units, masked rows 0
        lb_row = tuple(cfg.lower_bound * LOG2E * mask[hh] for hh in range(2))

    if cutlass.const_expr(cfg.safe_gate):
        thr = mma_tf32.get_slice(lane)
        acc_l = cute.make_rmem_tensor(thr.partition_shape_C((bt, bt)), cutlass.Float32)
        acc_m = cute.make_rmem_tensor(thr.partition_shape_C((bt, bt)), cutlass.Float32)
        acc_l.fill(0.0)
        acc_m.fill(0.0)
    else:
        # No gate bound (kda-math.md §2.3): 2^-b alone may overflow after a hard reset, so every pair (r, s)
        # of the strict lower triangle takes its decay through an anchor a between them, b_r <= a <= b_s:
        # k_r 2^(b_r - a) and k_s 2^(a - b_s) are both at most |k| in size, and their product carries the
        # exact decay 2^(b_r - b_s). The triangle splits into four levels of block pairs (an odd block of rows
        # under the even block of columns before it, blocks of B = 8, 4, 2, 1 rows), each with the anchor
        # at the last row of the even block; a row is on the row side of a level's pairs or on the column
        # side, never both. Each level is one tf32 product per 8 columns, m16n8k8, its 16 rows the level's 8
        # row-side rows twice (q for Mqk, then k for L) and its 8 columns the column-side rows, gathered
        # by one shuffle per value (`anchored_operands`): the four levels' accumulators hold the 120
        # pairs in 16 registers a lane. The diagonal of Mqk (no decay) is a plain dot product.
        mma_n8 = cute.make_tiled_mma(warp.MmaTF32Op((16, 8, 8)), (1, 1, 1))
        thr8 = mma_n8.get_slice(lane)
        acc_lv = [cute.make_rmem_tensor(thr8.partition_shape_C((bt, 8)), cutlass.Float32) for _ in range(4)]
        for lev in cutlass.range_constexpr(4):
            acc_lv[lev].fill(0.0)
        diag = [cutlass.Float32(0.0), cutlass.Float32(0.0)]
    # ---- per 16-column block: gate, cumsum in log2 units, decayed copies (§2.1, §2.3) ----
    # A rolled loop: unrolled, the body overflows the instruction cache at 16 warps per SM.
    for kb in cutlass.range(cfg.nkb, unroll=cfg.unroll_kb):
        if cutlass.const_expr(cfg.gate != "precomputed"):
            if cutlass.const_expr(cfg.fused):
                dtb_cur = [sDt[2 * tq + col_offset(kb, c)] for c in range(4)]  # (staged once per chain)
            else:
                dtb_cur = load_dt_bias(mDtBias, hv, tq, kb)
        if cutlass.const_expr(cfg.fused):
            g_cur = [[sGb[rr[hh], 2 * tq + col_offset(kb, c)].to(cutlass.Float32) for c in range(4)]
                     for hh in range(2)]
        else:
            if kb > 0:
                cute.arch.cp_async_wait_group(0)  # g block kb has landed
                cute.arch.sync_warp()
            g_cur = [[sGb[rr[hh], 2 * tq + col_offset(0, c)].to(cutlass.Float32) for c in range(4)]
                     for hh in range(2)]
            if kb + 1 < cfg.nkb:  # the next block's loads overlap this block's math
                cute.arch.sync_warp()  # every lane has read block kb of g
                load_tile(copy_g, lane, cute.local_tile(g_rows, (bt, 16), (0, kb + 1)), sGb, rows)
                cute.arch.cp_async_commit_group()
        rQ = ld_block(ldsm, mma_in, lane, sQv, kb, bt)
        rK = ld_block(ldsm, mma_in, lane, sKv, kb, bt)
        if cutlass.const_expr(not cfg.fused):
            # Outputs of block kb overwrite only block kb's columns of sQ and sK, which every lane has read
            # by now: later blocks stay intact.
            cute.arch.sync_warp()
        b = [[cutlass.Float32(0.0)] * 4, [cutlass.Float32(0.0)] * 4]
        if cutlass.const_expr(cfg.gate == "lower_bound"):
            # sigmoid(a (g + dt)) = 1 / (1 + 2^(g c + dt c)) with c = -a log2(e): one FMA per element.
            dtc = [dtb_cur[c] * sig_coef for c in range(4)]
        for hh in cutlass.range_constexpr(2):
            for c in cutlass.range_constexpr(4):
                x = g_cur[hh][c]
                if cutlass.const_expr(cfg.gate == "softplus"):
                    x = x + dtb_cur[c]
                    # softplus(x) = max(x, 0) + log(1 + e^-|x|): branch-free, exact in both tails; ex2/lg2 are
                    # one MUFU op each
                    sp = cutlass.max(x, 0.0) + cute.math.log2(
                        1.0 + ex2(-cute.math.absf(x) * LOG2E), approx=True, ftz=True
                    ) * LN2
                    b[hh][c] = sp * (-a_scale * LOG2E) * mask[hh]
                elif cutlass.const_expr(cfg.gate == "lower_bound"):
                    # ex2 and an approximate reciprocal: an IEEE divide is ~10 instructions
                    b[hh][c] = cute.arch.rcp_approx(1.0 + ex2(x * sig_coef + dtc[c])) * lb_row[hh]
                else:
                    b[hh][c] = x * (LOG2E * mask[hh])
        # Inclusive scan down the 16 rows of each column: rows g live in lanes 4g + t, so the scan
        # shuffles by multiples of 4 lanes over each half, then adds the first half's total.
        blast = [cutlass.Float32(0.0)] * 4
        for c in cutlass.range_constexpr(4):
            for off in cutlass.range_constexpr(3):
                step = 1 << off
                y0 = cute.arch.shuffle_sync_up(b[0][c], offset=4 * step)
                y1 = cute.arch.shuffle_sync_up(b[1][c], offset=4 * step)
                if gq >= step:
                    b[0][c] = b[0][c] + y0
                    b[1][c] = b[1][c] + y1
            b[1][c] = b[1][c] + cute.arch.shuffle_sync(b[0][c], offset=28 + tq)
            blast[c] = cute.arch.shuffle_sync(b[1][c], offset=28 + tq)
        gtot = [ex2(blast[c]) for c in range(4)]  # whole-tile decay of each column
        if cutlass.const_expr(cfg.safe_gate):
            # tf32 operands of the block's two 8-column halves: half pc holds the lane's columns
            # 16 kb + 2t + 8 pc + {0, 1} as the k indices t and t + 4 of an m16n8k8 product. A and B take the
            # same order of k, so the products are exact dot products over the block's columns, with no
            # data movement: A slot (row half hh, k half c2) = hh + 2 c2, B slot (k half c2, n block hh).
            a_kd = [cute.make_rmem_tensor(thr.partition_shape_A((bt, 8)), cutlass.Int32) for _ in range(2)]
            a_qd = [cute.make_rmem_tensor(thr.partition_shape_A((bt, 8)), cutlass.Int32) for _ in range(2)]
            b_ki = [cute.make_rmem_tensor(thr.partition_shape_B((bt, 8)), cutlass.Int32) for _ in range(2)]
        # Column pairs (2t, 2t+1) and (2t+8, 2t+9) are adjacent in shared memory and in the fragments, so
        # every 16-bit result leaves as a packed pair: one cvt.rn.*x2 and one 32-bit store per two values.
        for hh in cutlass.range_constexpr(2):
            r = rr[hh]
            for pc in cutlass.range_constexpr(2):
                col = 2 * tq + col_offset(kb, 2 * pc)  # the pair's first column (even)
                kdv = [cutlass.Float32(0.0)] * 2
                qdv = [cutlass.Float32(0.0)] * 2
                krv = [cutlass.Float32(0.0)] * 2
                if cutlass.const_expr(cfg.safe_gate):
                    kiv = [cutlass.Float32(0.0)] * 2
                for c2 in cutlass.range_constexpr(2):
                    c = 2 * pc + c2
                    ia = c2 + 2 * hh + 4 * pc  # A-fragment slot (v0, v1, v2) = (c % 2, hh, c // 2)
                    kn = rK[ia].to(cutlass.Float32) * rk[hh]
                    qn = rQ[ia].to(cutlass.Float32) * rq[hh]
                    bb = b[hh][c]
                    e = ex2(bb)
                    kdv[c2] = kn * e
                    qdv[c2] = qn * e
                    if hh == 0 and gq == 0:
                        if cutlass.const_expr(cfg.fused):
                            sGt[0, col + c2, stage] = gtot[c]
                        else:
                            mGt[tile, hv, col + c2] = gtot[c]
                    if cutlass.const_expr(cfg.safe_gate):
                        # Chunk-start anchor: 2^-b <= 2^(15 * 5 * log2 e) = 2^108 under the promise lb >= -5.
                        kiv[c2] = kn * ex2(-bb)
                        # kr = k 2^(b_last - b) = ki 2^b_last: both factors are in range under the promise
                        krv[c2] = kiv[c2] * gtot[c]
                    else:
                        krv[c2] = kn * ex2(blast[c] - bb)
                        diag[hh] = diag[hh] + qn * kn
                if cutlass.const_expr(cfg.fused):
                    # kd and qd straight into the stage's images, as packed pairs
                    store_pair(sKd, kd_layout, (r, col, stage), kdv[0], kdv[1], cfg.dtype)
                    store_pair(sQd, kd_layout, (r, col, stage), qdv[0], qdv[1], cfg.dtype)
                else:
                    views.sK32[r, col // 2] = pack2(kdv[0], kdv[1], cfg.dtype)
                    views.sQ32[r, col // 2] = pack2(qdv[0], qdv[1], cfg.dtype)
                sKr32[cute.crd2idx((r, col), sKr.layout) // 2] = pack2(krv[0], krv[1], cutlass.Float16)
                if cutlass.const_expr(cfg.safe_gate):
                    for c2 in cutlass.range_constexpr(2):
                        if cutlass.const_expr(cfg.fused):
                            a_kd[pc][hh + 2 * c2] = tf32(kdv[c2])
                            a_qd[pc][hh + 2 * c2] = tf32(qdv[c2])
                            b_ki[pc][c2 + 2 * hh] = tf32(kiv[c2])
                        else:
                            a_kd[pc][hh + 2 * c2] = cutlass.Int32(cute.arch.cvt_f32_tf32(kdv[c2]))
                            a_qd[pc][hh + 2 * c2] = cutlass.Int32(cute.arch.cvt_f32_tf32(qdv[c2]))
                            b_ki[pc][c2 + 2 * hh] = cutlass.Int32(cute.arch.cvt_f32_tf32(kiv[c2]))
        if cutlass.const_expr(cfg.safe_gate):
            for pc in cutlass.range_constexpr(2):
                cute.gemm(mma_tf32, acc_l, a_kd[pc], b_ki[pc], acc_l)
                cute.gemm(mma_tf32, acc_m, a_qd[pc], b_ki[pc], acc_m)
        else:
            kn4 = [[rK[c % 2 + 2 * hh + 4 * (c // 2)].to(cutlass.Float32) * rk[hh] for c in range(4)]
                   for hh in range(2)]
            qn4 = [[rQ[c % 2 + 2 * hh + 4 * (c // 2)].to(cutlass.Float32) * rq[hh] for c in range(4)]
                   for hh in range(2)]
            for lev in cutlass.range_constexpr(4):
                a_lv, b_lv = anchored_operands(thr8, lane, gq, tq, 8 >> lev, b, kn4, qn4, bt)
                for pc in cutlass.range_constexpr(2):
                    cute.gemm(mma_n8, acc_lv[lev], a_lv[pc], b_lv[pc], acc_lv[lev])

    cute.arch.sync_warp()
    if cutlass.const_expr(cfg.safe_gate):
        return acc_l, acc_m
    return acc_lv, diag


@cute.jit
def park_beta(lane, bl, rr, views, bt: cutlass.Constexpr):
    # beta of row `lane` into the warp's beta slots; returns beta of the lane's fragment rows. The warp
    # barrier also orders the reads of kd and qd before L and Mqk reuse their tiles.
    sBeta = views.sBeta
    if lane < bt:
        sBeta[lane] = bl
    cute.arch.sync_warp()
    return (sBeta[rr[0]], sBeta[rr[1]])


@cute.jit
def tile_matrices(cfg, views, lane, gq, tq, rr, beta_r, acc, mMats=None, tile=None, hv=None):
    """The intra-tile matrices L (strict lower, beta on the row) and Mqk (lower incl.) into shared memory,
    from `decay_blocks`' products. With `mMats` ([tile slots, HV, 2, bt, bt] fp32, the backward's) also Mqk
    and Akk = L without beta (the strict lower triangles, and Mqk's diagonal) to mMats[tile, hv]."""
    sL, sM, sBeta = views.sL, views.sM, views.sBeta
    if cutlass.const_expr(cfg.safe_gate):
        acc_l, acc_m = acc
        # C slot (v0, v1, n): row g + 8 v1, column 8 n + 2t + v0.
        for i in cutlass.range_constexpr(cute.size(acc_l)):
            hh = (i // 2) % 2
            r = rr[hh]
            s = 8 * (i // 4) + 2 * tq + (i % 2)
            vl = cutlass.Float32(0.0)
            if r > s:
                vl = acc_l[i] * beta_r[hh]
            sL[r, s] = vl
            vm = cutlass.Float32(0.0)
            if r >= s:
                vm = acc_m[i]
            sM[r, s] = vm
            if cutlass.const_expr(mMats is not None):
                mMats[tile, hv, 0, r, s] = vm
                mMats[tile, hv, 1, r, s] = cutlass.select_(r > s, acc_l[i], cutlass.Float32(0.0))
    else:
        acc_lv, diag = acc
        # Zeros first (the upper triangles, L's diagonal), then each level's pairs and Mqk's diagonal.
        zeros = cute.make_layout((8,))
        cute.make_tensor(sL.iterator + 8 * lane, zeros).fill(0.0)
        cute.make_tensor(sM.iterator + 8 * lane, zeros).fill(0.0)
        for hh in cutlass.range_constexpr(2):  # the quad's four partial dot products of each row
            diag[hh] = diag[hh] + cute.arch.shuffle_sync_bfly(diag[hh], offset=1)
            diag[hh] = diag[hh] + cute.arch.shuffle_sync_bfly(diag[hh], offset=2)
        cute.arch.sync_warp()
        if tq == 0:
            for hh in cutlass.range_constexpr(2):
                sM[rr[hh], rr[hh]] = diag[hh]
                if cutlass.const_expr(mMats is not None):
                    mMats[tile, hv, 0, rr[hh], rr[hh]] = diag[hh]
        for lev in cutlass.range_constexpr(4):
            blk = 8 >> lev
            # C slot (v0, v1): row g + 8 v1 of the level's product (v1 = 0: Mqk, 1: L), column 2t + v0.
            r = row_side_row(gq, blk)
            for v0 in cutlass.range_constexpr(2):
                s = col_side_row(2 * tq + v0, blk)
                if r // (2 * blk) == s // (2 * blk):  # the same block pair: a pair of this level
                    sM[r, s] = acc_lv[lev][v0]
                    sL[r, s] = acc_lv[lev][2 + v0] * sBeta[r]
                    if cutlass.const_expr(mMats is not None):
                        mMats[tile, hv, 0, r, s] = acc_lv[lev][v0]
                        mMats[tile, hv, 1, r, s] = acc_lv[lev][2 + v0]
    cute.arch.sync_warp()


@cute.jit
def solve_tile(views, lane, bt: cutlass.Constexpr):
    # P = (I + L)^-1 diag(beta), stored transposed in fp16: forward substitution in fp32, one lane per column.
    sL, sPt, sBeta = views.sL, views.sPt, views.sBeta
    if lane < bt:
        col_j = lane
        xs = cute.make_rmem_tensor(cute.make_layout((bt,)), cutlass.Float32)
        for ii in cutlass.range_constexpr(bt):
            acc_i = cutlass.Float32(0.0)
            if ii == col_j:
                acc_i = cutlass.Float32(1.0)
            if cutlass.const_expr(ii > 0):
                # Row ii of L up to column ii, in 16-byte loads (the same address in every lane: a broadcast).
                width = 4 * ((ii + 3) // 4)
                l_row = cute.make_tensor(sL.iterator + ii * bt, cute.make_layout((width,))).load()
                for jj in cutlass.range_constexpr(ii):
                    acc_i = acc_i - l_row[jj] * xs[jj]
            xs[ii] = acc_i
        bj = sBeta[col_j]
        for ii in cutlass.range_constexpr(bt):
            sPt[col_j, ii] = (xs[ii] * bj).to(cutlass.Float16)
    cute.arch.sync_warp()


@cute.jit
def fold_q(views, mma_f16, lane, gq, tq, bt: cutlass.Constexpr):
    """The fold's first product (fp16 in, fp32 accumulate): Aq = Mqk P. Returns (acc_q, P^T as an A
    fragment for `fold_k`)."""
    sM, sPt = views.sM, views.sPt
    thr16 = mma_f16.get_slice(lane)
    a_m = cute.make_rmem_tensor(thr16.partition_shape_A((bt, bt)), cutlass.Float16)
    a_pt = cute.make_rmem_tensor(thr16.partition_shape_A((bt, bt)), cutlass.Float16)
    for i in cutlass.range_constexpr(cute.size(a_m)):
        r = gq + 8 * ((i // 2) % 2)
        s = 2 * tq + (i % 2) + 8 * (i // 4)
        a_m[i] = sM[r, s].to(cutlass.Float16)
        a_pt[i] = sPt[r, s]
    b_p = cute.make_rmem_tensor(thr16.partition_shape_B((bt, bt)), cutlass.Float16)
    for i in cutlass.range_constexpr(cute.size(b_p)):
        # B slot (v0, v1, n): k = 2t + v0 + 8 v1 (token r), n-index 8 n + g (output column j): P[r, j].
        b_p[i] = sPt[8 * (i // 4) + gq, 2 * tq + (i % 2) + 8 * ((i // 2) % 2)]
    acc_q = cute.make_rmem_tensor(thr16.partition_shape_C((bt, bt)), cutlass.Float32)
    acc_q.fill(0.0)
    cute.gemm(mma_f16, acc_q, a_m, b_p, acc_q)
    return acc_q, a_pt


@cute.jit
def fold_k(views, mma_f16, lane, a_pt, bt: cutlass.Constexpr, k: cutlass.Constexpr):
    """The fold's second product: Ak^T = P^T Kr (k channels by bt tokens, fp32 accumulators)."""
    sKr = views.sKr
    thr16 = mma_f16.get_slice(lane)
    # kr as the (N=K, K=bt) B operand: token-major in shared memory, so ldmatrix.trans (the swizzle keeps it
    # conflict-free).
    sKr_b = cute.composition(sKr, cute.make_layout((k, bt), stride=(bt, 1)))
    b_kr = thr16.make_fragment_B(thr16.partition_B(sKr_b))
    ldsm_t = cute.make_tiled_copy_B(
        cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), cutlass.Float16), mma_f16
    )
    thr_kr = ldsm_t.get_slice(lane)
    cute.copy(ldsm_t, thr_kr.partition_S(sKr_b), thr_kr.retile(b_kr))
    acc_k = cute.make_rmem_tensor(thr16.partition_shape_C((bt, k)), cutlass.Float32)
    acc_k.fill(0.0)
    cute.gemm(mma_f16, acc_k, a_pt, b_kr, acc_k)
    return acc_k
