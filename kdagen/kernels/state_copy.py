"""A state tile from a recurrence's accumulators to a slot through shared memory and bulk copies (sm_90 and
later).

Stores straight from the accumulators cost each SM's store stream ~0.8 us a 32 KB tile, on the serial chain
(docs/experiments.md, "State stores"). Here the consumer threads write the tile into a staging buffer laid
out as the slot's rows, and each thread hands rows to the copy engine with one bulk copy each. The chain goes
on while the copies drain. The buffer is written again only after every thread's earlier copies have read
it.

A kernel short of shared memory stages a tile in `rounds`, each a range of K / rounds keys: the buffer holds
one round, and each round waits for the copies of the one before to have read it (which is why the planner
allows few: docs/experiments.md, "State stores through shared memory and bulk copies").

The staging rows are the slot's contiguous rows: with the K-first layout a key's `bv` values of the V-slice,
with the V-first one a value row's keys of the round. Each row is padded so that the accumulators' stores hit
distinct banks: an MMA accumulator gives lane 4g + q rows g and g + 8 and key pairs 2q + 8j, 2q + 8j + 1.
K-first stores are scalar; V-first ones store a thread's key pair at once. Rows stay 16-byte aligned, as the
copies need.
"""

from dataclasses import dataclass
from typing import Any

import cutlass
import cutlass.cute as cute

from kdagen.kernels.bulk import bulk_commit, bulk_store, bulk_wait_read, global_address
from kdagen.kernels.staging_shape import staging_pitch, staging_rows

__all__ = [
    "accumulator_coords",
    "stage_state_round",
    "copy_state_round",
    "bulk_store_state_tile",
    "StagedStores",
]


def accumulator_coords(layout, n: int, big: int) -> list[tuple[int, int]]:
    """Trace time: (value row, key) of each of a thread's n accumulator elements relative to its first, from
    the partition layout of a (bv, K) tile of stride (1, big)."""
    return [(layout(i) % big, layout(i) // big) for i in range(n)]


@cute.jit
def stage_state_round(thr_s, acc_s: cute.Tensor, buf, dtype: cutlass.Constexpr, bv: cutlass.Constexpr,
                      k: cutlass.Constexpr, kv_layout: cutlass.Constexpr, rounds: cutlass.Constexpr,
                      rnd: cutlass.Constexpr):
    # Round `rnd` of the accumulators of a (bv, K) tile of S^T (partitioned by the MMA slice `thr_s`): its
    # keys into the staging buffer at the shared-memory pointer `buf`, rounded to `dtype`, each row as the
    # slot holds it. A thread's keys are 2q + (static offsets), 2q < 8, and a round is whole 8-key blocks,
    # so which elements fall in the round is known at trace time.
    big = 4 * k
    pitch = staging_pitch(dtype.width, bv, k, kv_layout, rounds)
    seg = k // rounds
    base = cute.recast_ptr(buf, dtype=dtype)
    coords = accumulator_coords(
        thr_s.partition_C(cute.make_tensor(base, cute.make_layout((bv, k), stride=(1, big)))).layout,
        cute.size(acc_s), big)
    first = thr_s.partition_C(cute.make_identity_tensor((bv, k)))[0]
    if cutlass.const_expr(kv_layout):
        at = cute.make_tensor(base + (first[1] * pitch + first[0]), cute.make_layout(seg * pitch))
        for i in cutlass.range_constexpr(cute.size(acc_s)):
            dv, dk = coords[i]
            if cutlass.const_expr(dk // seg == rnd):
                at[(dk - rnd * seg) * pitch + dv] = acc_s[i].to(dtype)
    else:
        # The thread's first key is even, and so is every key pair's offset: pairs stay 2-aligned.
        at = base + cute.assume(first[0] * pitch + first[1], divby=2)
        pair = cute.make_rmem_tensor(cute.make_layout(2), dtype)
        for i in cutlass.range_constexpr(0, cute.size(acc_s), 2):
            dv, dk = coords[i]
            assert coords[i + 1] == (dv, dk + 1) and dk % 2 == 0, "accumulator pairs not adjacent"
            if cutlass.const_expr(dk // seg == rnd):
                pair[0] = acc_s[i].to(dtype)
                pair[1] = acc_s[i + 1].to(dtype)
                dst = cute.make_tensor(at + (dv * pitch + dk - rnd * seg), cute.make_layout(2))
                cute.autovec_copy(pair, dst)


@cute.jit
def copy_state_round(buf, mS: cute.Tensor, slot: cutlass.Int32, hv: cutlass.Int32, v0: cutlass.Int32,
                     t: cutlass.Int32, threads: cutlass.Constexpr, bv: cutlass.Constexpr,
                     k: cutlass.Constexpr, kv_layout: cutlass.Constexpr, rounds: cutlass.Constexpr,
                     rnd: cutlass.Constexpr):
    # Thread t of `threads` copies rows t, t + threads, ... of round `rnd` of the staged tile into slot `slot`
    # of mS (value head hv, rows v0 .. v0 + bv of S^T), one bulk copy a row, and closes its bulk group.
    pitch = staging_pitch(mS.element_type.width, bv, k, kv_layout, rounds)
    rows = staging_rows(bv, k, kv_layout, rounds)
    seg = k // rounds
    row_bytes = (bv if kv_layout else seg) * mS.element_type.width // 8
    base = cute.recast_ptr(buf, dtype=mS.element_type)
    for j in cutlass.range_constexpr((rows + threads - 1) // threads):
        r = t + j * threads
        if r < rows:
            if cutlass.const_expr(kv_layout):
                dst = global_address(mS, (slot, hv, rnd * seg + r, v0))
            else:
                dst = global_address(mS, (slot, hv, v0 + r, rnd * seg))
            bulk_store(dst, (base + r * pitch).toint(), row_bytes)
    bulk_commit()


@cute.jit
def bulk_store_state_tile(thr_s, acc_s: cute.Tensor, buf, mS: cute.Tensor, slot: cutlass.Int32,
                          hv: cutlass.Int32, v0: cutlass.Int32, t: cutlass.Int32, threads: cutlass.Constexpr,
                          barrier_id: cutlass.Constexpr, bv: cutlass.Constexpr, k: cutlass.Constexpr,
                          kv_layout: cutlass.Constexpr, rounds: cutlass.Constexpr):
    # The accumulators of S^T rows v0 .. v0 + bv into slot `slot` of mS, by the `threads` threads that hold
    # them (t: this one's index) through the staging buffer `buf`, round by round: wait until the buffer's
    # earlier copies have read it (this thread's, then everyone's, at named barrier `barrier_id`), stage,
    # make the stores visible to the copy engine, copy. The last round's copies drain while the caller goes
    # on; before the CTA exits, or a store that must land after them, it waits (`bulk.bulk_wait_all`).
    for rnd in cutlass.range_constexpr(rounds):
        bulk_wait_read()
        cute.arch.barrier(barrier_id=barrier_id, number_of_threads=threads)
        stage_state_round(thr_s, acc_s, buf, mS.element_type, bv, k, kv_layout, rounds, rnd)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=barrier_id, number_of_threads=threads)
        copy_state_round(buf, mS, slot, hv, v0, t, threads, bv, k, kv_layout, rounds, rnd)


@dataclass(frozen=True)
class StagedStores:
    """A kernel's staged state stores: its staging buffer (`buf`, a shared-memory pointer of at least
    `staging_shape.staging_bytes` for every dtype it stores, in `rounds`), this thread's index `t` among the
    `threads` that store, their named barrier, the tile's shape, and which stores take the buffer: the pool's
    (`pool`: checkpoints and final states) and the backward's tile states (`tiles`); the others are stored
    from the accumulators. `common.checkpoint_step` takes one for its checkpoints; the kernel stores its final
    state with `store` where `pool`."""

    buf: Any
    t: Any
    threads: int
    barrier_id: int
    bv: int
    k: int
    kv_layout: bool
    rounds: int
    pool: bool
    tiles: bool

    def store(self, thr_s, acc_s, mS, slot, hv, v0):
        bulk_store_state_tile(thr_s, acc_s, self.buf, mS, slot, hv, v0, self.t, self.threads, self.barrier_id,
                              self.bv, self.k, self.kv_layout, self.rounds)
