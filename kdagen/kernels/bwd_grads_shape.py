"""The `bwd_grads` CTA's shape: a plain module, so that the planner sizes the stage (its CTAs an SM) from
the same layout the device code allocates (`bwd_grads.grads_tile`)."""

from __future__ import annotations

__all__ = ["MAT_PAD", "ROW_PAD", "mma_warps", "smem_bytes"]

# Padding of a [16, K] fp32 tile's rows: one word, so that 16 threads reading one column of 16 rows hit 16
# banks; `bwd_grads.kg_dakt`'s order of the keys relies on it too (rows K + 1 = 1 mod 32 words apart put its
# fragment loads on 32 banks).
ROW_PAD = 1
# Padding of the 16 x 16 matrices' rows: a stride of 20 words puts a warp's MMA fragment reads (row g,
# column t: 8 rows by 4 columns) on 32 different banks.
MAT_PAD = 4
TILES = 4  # [bt, K] fp32: q, k, k exp(G_last - G), dAkt
MATRICES = 10  # [bt, bt] fp32


def mma_warps(k: int) -> int:
    """Warps that form Kg dAkt^T (`bwd_grads.kg_dakt`): all but the last, which solves for T meanwhile."""
    return max(1, k // 32 - 1)


def smem_bytes(k: int, bt: int) -> int:
    """Shared memory of a CTA (K threads, a tile of bt tokens): the tiles, `kg_dakt`'s per-warp [bt, bt]
    partial products, the matrices, beta, the row sums' warp sums and totals ([K / 32 + 1, 2 bt]) and the
    norms ([2, bt]), all fp32 (every piece a multiple of 16 bytes, so no alignment gaps)."""
    words = (TILES * bt * (k + ROW_PAD) + mma_warps(k) * bt * bt + MATRICES * bt * (bt + MAT_PAD) + bt
             + (k // 32 + 1) * 2 * bt + 2 * bt)
    return 4 * words
