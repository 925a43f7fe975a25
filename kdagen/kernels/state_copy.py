"""A state tile from a recurrence's accumulators to a slot through shared memory and a tensor copy (sm_90 and
later).

Stores straight from the accumulators cost each SM's store stream ~0.8 us a 32 KB tile, on the serial chain
(docs/experiments.md, "State stores"). Here the consumer threads write the tile into a staging buffer laid
out as the slot's box (`staging_shape`), and one lane of the warpgroup's first warp hands the box to the
copy engine with one tensor copy (TMA). The chain goes on while the copy drains. The buffer is written again
only after the copy has read it. A bulk copy a row cost the chain most of what the stores themselves had
(docs/experiments.md, "Checkpoints: where the time goes, one tensor copy a round"): the copy engine takes
them one by one.

The box is the slot's (its contiguous dimension innermost, no padding) under the 128-byte swizzle, which
keeps the accumulators' stores in distinct banks: an MMA accumulator gives lane 4g + q rows g and g + 8 and
key pairs 2q + 8j, 2q + 8j + 1, and the swizzle moves each row's 16-byte units by the row's index mod 8.

A kernel short of shared memory stages a tile in `rounds`, each a range of K / rounds keys: the buffer holds
one round, and each round waits for the copy of the one before to have read it (which is why the planner
allows few).

The copy's descriptor is made on the host (`state_store_tma`, in the stage's launch function) for the whole
target tensor: a slot, a head and the round's box are its coordinates.
"""

from dataclasses import dataclass
from typing import Any

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync
from cutlass.utils import LayoutEnum

from kdagen.kernels.bulk import bulk_commit, bulk_wait_all, bulk_wait_read
from kdagen.kernels.staging_shape import box_byte, staging_box

__all__ = [
    "accumulator_coords",
    "staging_layout",
    "staging_tensor",
    "state_store_tma",
    "stage_state_round",
    "copy_state_round",
    "bulk_store_state_tile",
    "StagedStores",
    "store_final_state",
]


def accumulator_coords(layout, n: int, big: int) -> list[tuple[int, int]]:
    """Trace time: (value row, key) of each of a thread's n accumulator elements relative to its first, from
    the partition layout of a (bv, K) tile of stride (1, big)."""
    return [(layout(i) % big, layout(i) // big) for i in range(n)]


def staging_layout(dtype, bv: int, k: int, kv_layout: bool, rounds: int):
    """Trace time: one round's box in shared memory, (rows, contiguous) under the 128-byte swizzle (the
    layout a wgmma B operand of that shape takes, which TMA reads as it is)."""
    rows, cols = staging_box(bv, k, kv_layout, rounds)
    layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (64, rows, cols), dtype, 1)
    return cute.slice_(layout, (None, None, 0))


@cute.jit
def staging_tensor(buf, dtype: cutlass.Constexpr, bv: cutlass.Constexpr, k: cutlass.Constexpr,
                   kv_layout: cutlass.Constexpr, rounds: cutlass.Constexpr) -> cute.Tensor:
    """The box of one round (`staging_layout`) at the shared-memory pointer `buf` (1024-byte aligned), in
    `dtype`."""
    layout = staging_layout(dtype, bv, k, kv_layout, rounds)
    return cute.make_tensor(cute.recast_ptr(buf, swizzle_=layout.inner, dtype=dtype), layout.outer)


@cute.jit
def state_store_tma(mS: cute.Tensor, bv: cutlass.Constexpr, k: cutlass.Constexpr,
                    kv_layout: cutlass.Constexpr, rounds: cutlass.Constexpr):
    """Host side: the tensor copy (atom, coordinate tensor) of one round's box into mS ([slots, HV, rows,
    contiguous], any slot stride of 16 bytes), its modes ordered (rows, contiguous, head, slot)."""
    view = cute.make_tensor(mS.iterator, cute.make_layout(
        (mS.shape[2], mS.shape[3], mS.shape[1], mS.shape[0]),
        stride=(mS.stride[2], mS.stride[3], mS.stride[1], mS.stride[0])))
    return cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), view,
                                       staging_layout(mS.element_type, bv, k, kv_layout, rounds),
                                       staging_box(bv, k, kv_layout, rounds))


def _store_offsets(bv: int, k: int, kv_layout: bool, rounds: int, rnd: int, width: int,
                   coords: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """Trace time: for each accumulator element of round `rnd` (index, xor, add): its box byte offset is
    (the thread's first element's offset ^ xor) + add, for every thread of the warpgroup. A thread's first
    element is value row 16 w + g, key 2 q (warp w, lane 4 g + q); its other elements sit at static offsets,
    which move the swizzle's bits (4 to 6) and the rest apart, so one base register and one XOR a store
    address them all (checked here for every thread)."""
    rows, _ = staging_box(bv, k, kv_layout, rounds)
    seg = k // rounds

    def byte(v: int, key: int) -> int:
        return box_byte(key, v, width, rows) if kv_layout else box_byte(v, key, width, rows)

    firsts = [(16 * w + g, 2 * q) for w in range(bv // 16) for g in range(8) for q in range(4)]
    out = []
    for i, (dv, dk) in enumerate(coords):
        if dk // seg != rnd:
            continue
        dk -= rnd * seg
        ref, at = byte(0, 0), byte(dv, dk)
        xor = (at ^ ref) & 0x70
        add = (at & ~0x70) - (ref & ~0x70)
        assert all(byte(v + dv, key + dk) == (byte(v, key) ^ xor) + add for v, key in firsts), \
            "a store's offset is not the base's moved by a constant"
        out.append((i, xor, add))
    return out


@cute.jit
def stage_state_round(thr_s, acc_s: cute.Tensor, sBox: cute.Tensor, bv: cutlass.Constexpr,
                      k: cutlass.Constexpr, kv_layout: cutlass.Constexpr, rounds: cutlass.Constexpr,
                      rnd: cutlass.Constexpr):
    # Round `rnd` of the accumulators of a (bv, K) tile of S^T (partitioned by the MMA slice `thr_s`): its
    # keys into the box sBox (rows, contiguous), rounded to its type. A thread's keys are 2q + (static
    # offsets), 2q < 8, and a round is whole 8-key blocks, so which elements fall in the round is known at
    # trace time, and so is each one's offset from the thread's first (`_store_offsets`): one live address,
    # as the stores' addresses would otherwise be hoisted before the recurrence's loop and held there.
    big = 4 * k
    dtype = sBox.element_type
    rows, _ = staging_box(bv, k, kv_layout, rounds)
    coords = accumulator_coords(
        thr_s.partition_C(cute.make_tensor(sBox.iterator, cute.make_layout((bv, k), stride=(1, big)))).layout,
        cute.size(acc_s), big)
    first = thr_s.partition_C(cute.make_identity_tensor((bv, k)))[0]
    if cutlass.const_expr(kv_layout):
        base = box_byte(first[1], first[0], dtype.width, rows)
    else:
        base = box_byte(first[0], first[1], dtype.width, rows)
    base = sBox.iterator.toint() + base  # (the box is 1024-byte aligned: the swizzle's bits are the offset's)
    for i, xor, add in _store_offsets(bv, k, kv_layout, rounds, rnd, dtype.width, coords):
        at = cute.make_ptr(dtype, (base ^ xor) + add, cute.AddressSpace.smem, assumed_align=dtype.width // 8)
        cute.make_tensor(at, cute.make_layout(1))[0] = acc_s[i].to(dtype)


@cute.jit
def copy_state_round(tma, sBox: cute.Tensor, slot: cutlass.Int32, hv: cutlass.Int32, v0: cutlass.Int32,
                     bv: cutlass.Constexpr, k: cutlass.Constexpr, kv_layout: cutlass.Constexpr,
                     rounds: cutlass.Constexpr, rnd: cutlass.Constexpr):
    # One warp (the copy issues from one of its lanes): the staged box of round `rnd` to slot `slot` (value
    # head hv, rows v0 .. v0 + bv of S^T) by the tensor copy `tma` (`state_store_tma`'s pair), and its bulk
    # group closed.
    atom, coords = tma
    box = staging_box(bv, k, kv_layout, rounds)
    at = (rnd, v0 // bv) if kv_layout else (v0 // bv, rnd)
    g_box = cute.local_tile(coords[None, None, hv, slot], box, at)
    t_s, t_g = cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(sBox, 0, 2),
                                     cute.group_modes(g_box, 0, 2))
    cute.copy(atom, t_s, t_g)
    bulk_commit()


@cute.jit
def bulk_store_state_tile(thr_s, acc_s: cute.Tensor, sBox: cute.Tensor, tma, slot: cutlass.Int32,
                          hv: cutlass.Int32, v0: cutlass.Int32, warp: cutlass.Int32,
                          threads: cutlass.Constexpr, barrier_id: cutlass.Constexpr, bv: cutlass.Constexpr,
                          k: cutlass.Constexpr, kv_layout: cutlass.Constexpr, rounds: cutlass.Constexpr):
    # The accumulators of S^T rows v0 .. v0 + bv into slot `slot` of the tensor copy `tma`'s target, by the
    # `threads` threads that hold them (`warp`: this thread's warp among them, warp-uniform; one lane of
    # warp 0 copies) through the staging box sBox, round by round: wait until the box's earlier copy has read
    # it (every thread waits for its own copies, then all at named barrier `barrier_id`), stage, make the
    # stores visible to the copy engine, copy. The last round's copy drains while the caller goes on; before
    # the CTA exits, or a store that must land after it, the threads wait (`bulk.bulk_wait_read`,
    # `bulk.bulk_wait_all`). Every branch here is warp-uniform: a thread-dependent one would leave the
    # recurrence's loop with values the compiler no longer proves uniform (the wgmma descriptors then move to
    # uniform registers at every step).
    for rnd in cutlass.range_constexpr(rounds):
        bulk_wait_read()
        cute.arch.barrier(barrier_id=barrier_id, number_of_threads=threads)
        stage_state_round(thr_s, acc_s, sBox, bv, k, kv_layout, rounds, rnd)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=barrier_id, number_of_threads=threads)
        if warp == 0:
            copy_state_round(tma, sBox, slot, hv, v0, bv, k, kv_layout, rounds, rnd)


@dataclass(frozen=True)
class StagedStores:
    """A kernel's staged state stores: this thread's warp (`warp`, warp-uniform) among the `threads` that
    store, their named barrier, the tile's shape, and for each kind of store that takes the staging buffer
    (box, tma, rounds): its box there (a swizzled tensor at the buffer, `staging_tensor`), its tensor copy
    (`state_store_tma`) and its rounds; the pool's (`pool`: checkpoints and final states) and the backward's
    tile states (`tiles`), None for a kind stored from the accumulators. `common.checkpoint_step` takes one
    for its checkpoints; the kernel stores its final state with `store_final_state` where `pool` is set.
    `StagedStores.at` makes one from the buffer and each kind's (dtype, tma, coordinates, rounds)."""

    warp: Any
    threads: int
    barrier_id: int
    bv: int
    k: int
    kv_layout: bool
    pool: Any = None
    tiles: Any = None

    @classmethod
    def at(cls, buf, warp, threads: int, barrier_id: int, bv: int, k: int, kv_layout: bool, pool=None,
           tiles=None) -> "StagedStores":
        """Trace time: the stores through the staging buffer at `buf` (1024-byte aligned), `pool` and `tiles`
        each (dtype, tma atom, its coordinate tensor, rounds) or None."""
        def kind(spec):
            if spec is None:
                return None
            dtype, atom, coords, rounds = spec
            return staging_tensor(buf, dtype, bv, k, kv_layout, rounds), (atom, coords), rounds

        return cls(warp, threads, barrier_id, bv, k, kv_layout, pool=kind(pool), tiles=kind(tiles))

    def _store(self, kind, thr_s, acc_s, slot, hv, v0):
        box, tma, rounds = kind
        bulk_store_state_tile(thr_s, acc_s, box, tma, slot, hv, v0, self.warp, self.threads, self.barrier_id,
                              self.bv, self.k, self.kv_layout, rounds)

    def store_pool(self, thr_s, acc_s, slot, hv, v0):
        self._store(self.pool, thr_s, acc_s, slot, hv, v0)

    def store_tiles(self, thr_s, acc_s, slot, hv, v0):
        self._store(self.tiles, thr_s, acc_s, slot, hv, v0)


@cute.jit
def store_final_state(staging: StagedStores, thr_s, acc_s: cute.Tensor, slot: cutlass.Int32,
                      hv: cutlass.Int32, v0: cutlass.Int32, ckpt_every: cutlass.Int32, ck_next: cutlass.Int32,
                      num_steps: cutlass.Int32):
    # A chain's final state into its pool slot after `num_steps` steps, with checkpoints every `ckpt_every`
    # steps, the next at `ck_next` (`common.checkpoint_step`): a checkpoint's copies land first, should its
    # slot be this one; none are waited for where the last step was a checkpoint (the same state).
    if ckpt_every > 0 and ck_next - ckpt_every != num_steps - 1:
        bulk_wait_all()
    staging.store_pool(thr_s, acc_s, slot, hv, v0)
