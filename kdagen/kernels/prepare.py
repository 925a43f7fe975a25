"""Building blocks of prepare's per-tile math (kda-math.md §2.1-§2.3): the warp MMAs, tile loads and stores,
fragment helpers, and the anchored operands of the path without a gate bound.

One warp handles one 16-token tile of one value head; every lane holds the m16n8k16 fragment layout (rows g
and g + 8, columns 2t, 2t + 1, 2t + 8, 2t + 9 of each 16-column block, lane = 4 g + t). The stand-alone
prepare stage and the fused wgmma kernel both run the tile.
"""

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import warp

__all__ = [
    "prepare_mmas",
    "col_offset",
    "load_tile",
    "store_tile",
    "ex2",
    "load_dt_bias",
    "gram_b",
    "ld_block",
    "row_side_row",
    "col_side_row",
    "anchored_operands",
]


def prepare_mmas(dtype):
    """The tile's warp MMAs (trace time). L and Mqk: tf32 products over 8 key columns at a time, fp32
    accumulation (kda-math.md §2.7: FLA's precision for these tiles); the fold in fp16; and the inputs'
    fragment layout typed like them (`dtype`): ldmatrix of q and k (and a 16-bit g) lands in it (l2norm's
    Gram matrix)."""
    mma_tf32 = cute.make_tiled_mma(warp.MmaTF32Op((16, 8, 8)), (1, 1, 1), permutation_mnk=(16, 16, 8))
    mma_f16 = cute.make_tiled_mma(
        warp.MmaF16BF16Op(cutlass.Float16, cutlass.Float32, (16, 8, 16)), (1, 1, 1),
        permutation_mnk=(16, 16, 16),
    )
    mma_in = cute.make_tiled_mma(
        warp.MmaF16BF16Op(dtype, cutlass.Float32, (16, 8, 16)), (1, 1, 1), permutation_mnk=(16, 16, 16)
    )
    return mma_tf32, mma_f16, mma_in


def col_offset(kb: int, c: int) -> int:
    """Column offset (within the lane's quad position) of slot c of block kb: 2t + {0, 1, 8, 9}."""
    return 16 * kb + (c % 2) + 8 * (c // 2)


@cute.jit
def load_tile(tiled, lane, g_tile, s_tile, rows):
    # Rows past the sequence end are zero-filled.
    thr = tiled.get_slice(lane)
    src = thr.partition_S(g_tile)
    dst = thr.partition_D(s_tile)
    coord = thr.partition_S(cute.make_identity_tensor(g_tile.shape))
    for m in cutlass.range_constexpr(cute.size(dst.shape[1])):
        if coord[0, m, 0][0] < rows:
            cute.copy(tiled, src[None, m, None], dst[None, m, None])
        else:
            dst[None, m, None].fill(0)


@cute.jit
def store_tile(tiled, lane, s_tile, g_tile, rows):
    # Only rows of this sequence are written: the rest belong to the next sequence.
    thr = tiled.get_slice(lane)
    src = thr.partition_S(s_tile)
    dst = thr.partition_D(g_tile)
    coord = thr.partition_D(cute.make_identity_tensor(g_tile.shape))
    for m in cutlass.range_constexpr(cute.size(src.shape[1])):
        if coord[0, m, 0][0] < rows:
            cute.copy(tiled, src[None, m, None], dst[None, m, None])


@cute.jit
def ex2(x):
    # 2^x, flushing subnormal results to zero: MUFU.EX2 alone. Without ftz every ex2 takes a range check and
    # two fix-up multiplies. Results below 2^-126 only ever scale values that are then negligible (decays),
    # so flushing them changes nothing measurable.
    return cute.math.exp2(x, approx=True, ftz=True)


@cute.jit
def load_dt_bias(mDtBias, hv, tq, kb):
    # dt_bias of the lane's columns 2t + {0, 1, 8, 9} of block kb (L1-resident after the first tiles).
    return [mDtBias[hv, 2 * tq + col_offset(kb, c)] for c in range(4)]


@cute.jit
def gram_b(mma_in, lane, ra, bt: cutlass.Constexpr, dtype: cutlass.Constexpr):
    # The B fragment of X^T from the A fragment of X (same bt x bt block): lane (g, t) holds B[k][n] = X[n][k]
    # at (k, n) = (2t + v0 + 8 v1, 8 n' + g), which is its own A slot (v0, n', v1). In 32-bit words (value
    # pairs) the two fragments differ by swapping words 1 and 2.
    thr = mma_in.get_slice(lane)
    rb = cute.make_rmem_tensor(thr.partition_shape_B((bt, bt)), dtype)
    a32 = cute.recast_tensor(ra, cutlass.Int32)
    b32 = cute.recast_tensor(rb, cutlass.Int32)
    b32[0] = a32[0]
    b32[1] = a32[2]
    b32[2] = a32[1]
    b32[3] = a32[3]
    return rb


@cute.jit
def ld_block(ldsm, mma_in, lane, s_tile, kb, bt: cutlass.Constexpr):
    # 16-column block kb of a (bt, K) tile as an A fragment of `mma_in`, by ldmatrix.
    block = cute.local_tile(s_tile, (bt, 16), (0, kb))
    thr = mma_in.get_slice(lane)
    frag = thr.make_fragment_A(thr.partition_A(block))
    thr_ld = ldsm.get_slice(lane)
    cute.copy(ldsm, thr_ld.partition_S(block), thr_ld.retile(frag))
    return frag


# The anchored products of prepare without a gate bound. A level of block size `blk` pairs rows of odd
# blocks (the row side) with rows of the even block before them (the column side). Lanes 4g + t hold rows g
# and g + 8; for blk <= 4 both are on the same side, the row side where g // blk is odd. The level's product
# takes as its row g the row-side row `row_side_row(g)` and as its column n the column-side row
# `col_side_row(n)`: the lane's own row g where it is on that side, else row (g +- blk) + 8 of another lane,
# which is on it.


def row_side_row(g, blk: int):
    if blk == 8:
        return g + 8
    return cutlass.select_((g // blk) % 2 == 1, g, g + blk + 8)


def col_side_row(n, blk: int):
    if blk == 8:
        return n
    return cutlass.select_((n // blk) % 2 == 0, n, n - blk + 8)


def anchored_operands(thr8, lane, gq, tq, blk: int, b, kn4, qn4, bt: int):
    """A and B fragments (tf32, two 8-column halves) of one level's product over the lane's block of
    columns: A rows g = q and g + 8 = k of row-side row `row_side_row(g)`, scaled by 2^(b_r - a); B column
    n = k of column-side row `col_side_row(n)`, scaled by 2^(a - b_s); a = b at the anchor row (the last row
    of the pair's even block), the same column. Slots as in the safe path: A (row half hh, k half c2) = hh +
    2 c2, B (k half c2) = c2, k index t + 4 c2 being column 2t + c2 + 8 pc."""
    if blk == 8:
        anchor = [cute.arch.shuffle_sync(b[0][c], offset=28 + tq) for c in range(4)]  # row 7
        e = [[ex2(anchor[c] - b[0][c]) for c in range(4)],  # rows 0-7: column side
             [ex2(b[1][c] - anchor[c]) for c in range(4)]]  # rows 8-15: row side
        row_side = None
    else:
        src = 4 * ((gq // (2 * blk)) * (2 * blk) + blk - 1) + tq
        row_side = (gq // blk) % 2 == 1
        e = []
        for hh in range(2):
            e_h = []
            for c in range(4):
                d = b[hh][c] - cute.arch.shuffle_sync(b[hh][c], offset=src)
                e_h.append(ex2(cutlass.select_(row_side, d, -d)))
            e.append(e_h)
    ks = [[kn4[hh][c] * e[hh][c] for c in range(4)] for hh in range(2)]
    qs = [[qn4[hh][c] * e[hh][c] for c in range(4)] for hh in range(2)]
    src_a = 4 * ((gq + blk) % 8) + tq  # the lane of row-side row g + blk (+ 8), for the column-side lanes
    src_b = 4 * ((gq + 8 - blk) % 8) + tq  # the lane of column-side row g - blk (+ 8), for the row-side lanes
    a_frag, b_frag = [], []
    for pc in range(2):
        fa = cute.make_rmem_tensor(thr8.partition_shape_A((bt, 8)), cutlass.Int32)
        fb = cute.make_rmem_tensor(thr8.partition_shape_B((8, 8)), cutlass.Int32)
        for c2 in range(2):
            c = 2 * pc + c2
            if blk == 8:
                aq, ak, bk = qs[1][c], ks[1][c], ks[0][c]
            else:
                aq = cutlass.select_(row_side, qs[0][c], cute.arch.shuffle_sync(qs[1][c], offset=src_a))
                ak = cutlass.select_(row_side, ks[0][c], cute.arch.shuffle_sync(ks[1][c], offset=src_a))
                bk = cutlass.select_(row_side, cute.arch.shuffle_sync(ks[1][c], offset=src_b), ks[0][c])
            fa[2 * c2] = cutlass.Int32(cute.arch.cvt_f32_tf32(aq))
            fa[1 + 2 * c2] = cutlass.Int32(cute.arch.cvt_f32_tf32(ak))
            fb[c2] = cutlass.Int32(cute.arch.cvt_f32_tf32(bk))
        a_frag.append(fa)
        b_frag.append(fb)
    return a_frag, b_frag
