"""The chunk-local part of the KDA backward in torch, from the two states of every tile, batched over every
chunk of a call; and the tile map the backward's kernels share.

The backward (`kdagen.backward`) takes every tile's products with its states from the `bwd_tile` stage and
continues in the `bwd_grads` stage (whose torch form is `kdagen.tile_grads`); `chunk_local_backward`
computes the same gradients from the states themselves, the reference that path is tested against
(`tests/test_tile_grads.py`).

Given the state entering every 16-token tile (``h``) and the gradient of the state leaving it (``dh``), both
computed by the backward's scans, each tile's gradients of q, k, v, g and beta depend on that tile alone
(kda-math §8, stages 1, 2, 4-6 and 8 within a chunk). This module runs
:func:`kdagen.chunk_math.chunk_stage_backward` on slabs of consecutive tile ids (tiles and value heads
flattened into its batch dim): each slab's zero-padded tiles are gathered from the tokens, and its gradients
are scattered back to them, so only one slab's tiles are held at a time.

Tiles follow the tile-id map of the GPU kernels (:func:`tile_map`): they restart at each sequence start, and
token t of sequence n (``bos = cu_seqlens[n]``) sits in tile ``bos // 16 + n + (t - bos) // 16`` at row
``(t - bos) % 16``. Everything runs on the inputs' device with torch ops whose sizes are known on the host, so
the device path never synchronises with the host.

A padded row (q = k = v = do = 0, g = 0, beta = 0) contributes nothing to its tile's valid rows: its L and
Aqk rows and columns vanish, its A row is zero (beta = 0), and G keeps the cumsum of the last valid token, so
the boundary terms of the state (G's last row) are those of the unpadded chunk.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kdagen.arch import CHUNK
from kdagen.chunk_math import chunk_stage_backward
from kdagen.workspace import tile_slots

__all__ = ["DEFAULT_MAX_BATCH", "DEFAULT_MAX_BATCH_ANCHORED", "TileMap", "chunk_local_backward",
           "default_mm_dtype", "tile_map", "tile_slots"]

Tensor = torch.Tensor

# Batch entries (tile x value head) per call of chunk_stage_backward. Its largest intermediates are the
# pairwise [batch, 16, 16, K] tensors (the decays E and k_s E, the einsum products and dE), 128 KiB per entry
# at K = 128 in fp32, about six of them alive at the peak; with the slab's tiles and states a slab takes
# ~970 KiB per entry at K = V = 128 fp32 (measured on an H100 and on the CPU), so 1024 entries hold ~0.95 GiB
# (twice that in fp64). Larger slabs gain nothing measurable: the work, not the launches, sets the time
# (T = 8191, HV = 32 on an H100: 186 ms at 1024, 182 ms at 4096).
DEFAULT_MAX_BATCH = 1024
# The anchored form builds no [batch, 16, 16, K] tensor, and no [batch, K, V] one but the copy of a state that
# sum_v S dS takes where h and dh differ in layout (freed before the tile's intermediates), or the states'
# two bf16 copies: its peak is set by the [batch, 16, K] intermediates, ~250 KiB per entry at K = V = 128
# fp32 with the slab's tiles (measured on the CPU as the growth of the peak resident memory from 512 to 2048
# entries per slab, dh a transposed view as the backward passes it: 248 KiB per entry, against 778 KiB for
# the pairwise form by the same measurement), so 2048 entries take ~0.5 GiB (twice that in fp64), less than
# the pairwise form's 1024.
DEFAULT_MAX_BATCH_ANCHORED = 2048

_GRADS = ("dq", "dk", "dv", "dg", "dbeta")


class TileMap(NamedTuple):
    """Where each token sits in the padded tiles: ``tile`` (int64 [total]) its tile id, ``row`` (int64
    [total]) its row in the tile, and ``slots`` the number of tile ids (:func:`tile_slots`)."""

    tile: Tensor
    row: Tensor
    slots: int


def tile_map(cu_seqlens: Tensor, total: int) -> TileMap:
    """The tile id and row of every token of a packed call (``cu_seqlens`` [N + 1], ``cu_seqlens[-1] ==
    total``, empty sequences allowed), on ``cu_seqlens``'s device, without a host synchronisation."""
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens: expected [N + 1] with N >= 1, got shape {tuple(cu_seqlens.shape)}")
    num_seqs = cu_seqlens.numel() - 1
    cu = cu_seqlens.to(torch.int64)
    t = torch.arange(total, dtype=torch.int64, device=cu.device)
    # The sequence of token t is the last n with cu[n] <= t: that skips the empty sequences starting at t.
    seq = torch.searchsorted(cu, t, right=True) - 1
    bos = cu[seq]
    rel = t - bos
    tile = bos // CHUNK + seq + rel // CHUNK
    return TileMap(tile, rel % CHUNK, tile_slots(total, num_seqs))


def default_mm_dtype(device: torch.device, dt: torch.dtype) -> torch.dtype:
    """The dtype of the state products' operands when ``chunk_local_backward`` is not given one: bf16 for fp32
    on CUDA (tensor cores), else ``dt`` itself (the CPU, and fp64 anywhere, compute them exactly)."""
    return torch.bfloat16 if device.type == "cuda" and dt == torch.float32 else dt


def _check_shape(name: str, x: Tensor, want: tuple[int, ...]) -> None:
    if tuple(x.shape) != want:
        raise ValueError(f"{name}: expected shape {want}, got {tuple(x.shape)}")


def chunk_local_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    do: Tensor,
    h: Tensor,
    dh: Tensor,
    tmap: TileMap,
    *,
    max_batch: int | None = None,
    anchored: bool = False,
    mm_dtype: torch.dtype | None = None,
) -> dict[str, Tensor]:
    """The gradients of the prepared inputs of every token, each tile on its own.

    Inputs are per value head and token-major: ``q`` [total, HV, K] (scale * l2norm(q), expanded to the value
    heads), ``k`` [total, HV, K], ``v`` [total, HV, V], ``g`` [total, HV, K] (natural-log decay), ``beta``
    [total, HV] (after the beta mode), ``do`` [total, HV, V]; ``h`` [slots, HV, K, V] the state entering each
    tile and ``dh`` [slots, HV, K, V] the gradient of the state leaving it, any strides; ``tmap`` from
    :func:`tile_map`. Tile ids that hold no token are computed from zero inputs and their rows reach no token,
    so whatever ``h`` and ``dh`` hold there (NaN included) cannot reach a result.

    Computed in fp64 if ``q`` is fp64, else fp32, in slabs of ``max(1, max_batch // HV)`` tiles (each call
    of ``chunk_stage_backward`` sees at most that many tiles times HV batch entries; ``max_batch`` defaults to
    :data:`DEFAULT_MAX_BATCH`, or :data:`DEFAULT_MAX_BATCH_ANCHORED` when ``anchored``). ``anchored`` runs
    ``chunk_stage_backward``'s anchored form, without pairwise [.., 16, 16, K] tensors: only for g >= -5 (the
    safe gate), since a hard reset overflows its factors. Returns ``dq``, ``dk``, ``dg`` [total, HV, K],
    ``dv`` [total, HV, V] and ``dbeta`` [total, HV] in the compute dtype.

    ``mm_dtype`` is the dtype of the operands of the products with the states (``chunk_stage_backward``'s
    ``mm_dtype``). None takes :func:`default_mm_dtype`: bf16 for fp32 on CUDA (tensor cores with fp32
    accumulation; FLA's backward keeps its states in bf16), the compute dtype otherwise (the CPU, and fp64
    anywhere, compute the products as exactly as the rest). Each slab's states are taken from ``h`` and ``dh``
    once: views in the compute dtype, or one copy each cast to ``mm_dtype``. The gradient of the state
    entering each tile, which the backward's scan computes, is not computed here.
    """
    if q.dim() != 3:
        raise ValueError(f"q: expected [total, HV, K], got shape {tuple(q.shape)}")
    total, HV, K = q.shape
    if v.dim() != 3:
        raise ValueError(f"v: expected [total, HV, V], got shape {tuple(v.shape)}")
    V = v.shape[-1]
    slots = tmap.slots
    for name, x, want in (("k", k, (total, HV, K)), ("g", g, (total, HV, K)), ("v", v, (total, HV, V)),
                          ("do", do, (total, HV, V)), ("beta", beta, (total, HV)),
                          ("h", h, (slots, HV, K, V)), ("dh", dh, (slots, HV, K, V)),
                          ("tmap.tile", tmap.tile, (total,)), ("tmap.row", tmap.row, (total,))):
        _check_shape(name, x, want)
    if max_batch is None:
        max_batch = DEFAULT_MAX_BATCH_ANCHORED if anchored else DEFAULT_MAX_BATCH
    if max_batch < 1:
        raise ValueError(f"max_batch: expected >= 1, got {max_batch}")
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    dev = q.device
    if mm_dtype is None:
        mm_dtype = default_mm_dtype(dev, dt)
    # The states in the products' dtype: views of h and dh in the compute dtype, else one cast copy a slab,
    # row-major [n, K, V] as chunk_stage_backward uses them.
    cast = mm_dtype != dt
    sdt, fmt = (mm_dtype, torch.contiguous_format) if cast else (dt, torch.preserve_format)
    # One row past the tokens receives the padded rows' gradients; it is dropped at the end.
    outs = {name: torch.empty((total + 1, *x.shape[1:]), dtype=dt, device=dev)
            for name, x in (("dq", q), ("dk", k), ("dv", v), ("dg", g), ("dbeta", beta))}
    if total == 0:
        return {name: x[:0] for name, x in outs.items()}
    # The token at each (tile, row), `total` where none sits: tiles are filled a slab at a time by a gather,
    # so no padded copy of a whole input or gradient is ever held.
    src = torch.full((slots * CHUNK,), total, dtype=torch.int64, device=dev)
    src[tmap.tile * CHUNK + tmap.row] = torch.arange(total, dtype=torch.int64, device=dev)
    per = max(1, max_batch // HV)
    for t0 in range(0, slots, per):
        t1 = min(t0 + per, slots)
        nt, n = t1 - t0, (t1 - t0) * HV
        idx = src[t0 * CHUNK:t1 * CHUNK]  # [nt * 16], tile-major
        real = idx < total
        take = idx.clamp(max=total - 1)
        qs, ks, vs, gs, bs, dos = (_slab_tiles(x, take, real, nt, dt) for x in (q, k, v, g, beta, do))
        S = h[t0:t1].to(sdt, memory_format=fmt).reshape(n, K, V)
        dS = dh[t0:t1].to(sdt, memory_format=fmt).reshape(n, K, V)
        grads = chunk_stage_backward(qs, ks, vs, gs, bs, S, dos, dS, anchored=anchored, state_grad=False,
                                     mm_dtype=mm_dtype if cast else None)
        for name, out in outs.items():
            x = grads[name]  # [nt * HV, 16, *]
            rows = x.view(nt, HV, CHUNK, *x.shape[2:]).transpose(1, 2).reshape(nt * CHUNK, *out.shape[1:])
            out.index_copy_(0, idx, rows)
    return {name: x[:total] for name, x in outs.items()}


def _slab_tiles(x: Tensor, take: Tensor, real: Tensor, nt: int, dt: torch.dtype) -> Tensor:
    """Tokens ``take`` of ``x`` [total, HV, *] as padded tiles [nt * HV, 16, *] in ``dt``, zero where
    ``real`` is False (rows past a sequence's end and unused tile ids)."""
    rows = x.index_select(0, take).to(dt)
    rows = torch.where(real.view(-1, *([1] * (x.dim() - 1))), rows, 0.0)
    return rows.view(nt, CHUNK, *x.shape[1:]).transpose(1, 2).reshape(nt * x.shape[1], CHUNK, *x.shape[2:])
