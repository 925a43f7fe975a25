"""The byte layout of a call's workspace: the per-tile intermediates prepare writes and the recurrence reads.

One allocation per call holds them all (allocator calls are a visible part of a small call's host time).
The `forward` stage receives the byte offsets and carves its tensors there; the intra-card CP path views the
same layout through torch. Every offset is a multiple of 16 bytes (the stages' vector and TMA accesses).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

# Tokens per tile (every family's chunk size), and the workspace's row width (it is allocated as
# [size / ROW, ROW] bytes, the planner's choice).
from kdagen.arch import CHUNK
from kdagen.plan import WORKSPACE_ROW as ROW

ALIGN = 16


def _up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Workspace(NamedTuple):
    """Byte offsets of each buffer (kd starts at 0) and the total size (a multiple of ROW).

    kd, qd, akt: [T, HV, K] (the input dtype); aq: [T, HV, 16]; gt: [S, HV, K] fp32; ready: [S, HV] int32;
    order: [N + 2] int32 (the ranking, at [N] the path the setup kernel chose, at [N + 1] the fused kernel's
    chain counter); cu: [N + 1] int32, cu_seqlens clamped into [0, T] for prepare (by the setup kernel, or by
    the runtime on the intra-card CP path), after the order; S = T // 16 + N + 1 tile slots (the bound of
    the tile-id map floor(bos/16) + seq + step).
    """

    qd: int
    akt: int
    aq: int
    gt: int
    ready: int
    order: int
    cu: int
    size: int
    tile_slots: int


def tile_slots(total: int, num_seqs: int, tiles: int = 1) -> int:
    """Tile ids a call of `total` tokens in `num_seqs` sequences may use: the bound of the injective map
    floor(bos/16) + seq + step; with `tiles`, the ids of runs of that many tiles (floor(bos/(16 tiles)) +
    seq + step). Plain arithmetic (symbolic sizes trace through it)."""
    return total // (CHUNK * tiles) + num_seqs + 1


@functools.lru_cache(maxsize=256)  # a call site sees few distinct sizes; the lookup is cheaper than the sums
def layout(total: int, num_v_heads: int, num_seqs: int, head_dim_k: int, elem_bytes: int) -> Workspace:
    slots = tile_slots(total, num_seqs)
    plane = _up(total * num_v_heads * head_dim_k * elem_bytes)
    aq = 3 * plane
    gt = aq + _up(total * num_v_heads * CHUNK * elem_bytes)
    ready = gt + _up(slots * num_v_heads * head_dim_k * 4)
    order = ready + _up(slots * num_v_heads * 4)
    cu = order + _up((num_seqs + 2) * 4)
    size = -(-(cu + (num_seqs + 1) * 4) // ROW) * ROW
    return Workspace(plane, 2 * plane, aq, gt, ready, order, cu, size, slots)
