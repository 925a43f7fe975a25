"""The `bwd_tile` CTA's shape: a plain module, so that the planner sizes the stage (its ring of tiles, its
CTAs an SM) from the same formulas the device code is laid out by (`bwd_tile.ProductsConfig`)."""

from __future__ import annotations

__all__ = ["MAX_WARPS", "min_ctas", "ring_smem_bytes", "warps"]

MAX_WARPS = 8  # 16 output columns a warp: two CTAs an SM (shared memory) keep 16 warps busy


def warps(k: int, v: int) -> int:
    """Warps side by side along an output's columns, 16 each: the narrower head dim sets how many."""
    return min(MAX_WARPS, min(k, v) // 16)


def min_ctas(k: int, v: int) -> int:
    """CTAs an SM the registers are capped for: 16 warps, 128 registers a thread. Uncapped, the carried
    state's accumulators take the compiler to ~230 and one CTA an SM, idle while it waits on its loads."""
    return 2 * MAX_WARPS // warps(k, v)


def ring_smem_bytes(k: int, v: int, bt: int, ring: int) -> int:
    """Shared memory of a CTA with `ring` tiles of rows, at most: S and dS^T ([K, V] each), R and dR ([bt, V]
    each), dgt's partial sums (counted at a warp a key), a tile's Kd, Akt, dO, V, Aq and gt a ring slot, and
    2 KB of alignment and the driver's reserve."""
    rows = 2 * bt * (2 * k + 2 * v + bt) + 4 * k
    return 2 * (2 * k * v + 2 * bt * v) + 4 * warps(k, v) * k + ring * rows + 2048
