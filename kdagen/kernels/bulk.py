"""Bulk copies between global and shared memory (sm_90 and later): one thread moves a contiguous block of
any multiple of 16 bytes with one instruction, which the copy engine streams, so that a block of state costs
the SMs neither registers nor instructions while it is in flight.

Addresses are integers: shared memory as the CTA's 32-bit shared address (`tensor.iterator.toint()`),
global memory as a 64-bit generic address (`global_address`). Both ends and the size must be 16-byte aligned.
A load completes on an mbarrier (the caller arms it with `mbarrier_arrive_and_expect_tx` for the bytes); a
store is tracked by bulk groups: `bulk_commit` closes the group, `bulk_wait_read` waits until every
committed store has read its shared memory (which may then be overwritten, or the CTA exit).
"""

import cutlass
import cutlass.cute as cute
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

__all__ = [
    "global_address", "bulk_load", "bulk_store", "bulk_commit", "bulk_wait_read", "bulk_wait_all",
    "group_wait_read", "group_store",
]


@cute.jit
def global_address(t: cute.Tensor, coord) -> cutlass.Int64:
    """The generic address of element `coord` of the global tensor `t` (64-bit offset arithmetic)."""
    return (t.iterator + cute.crd2idx(coord, t.layout)).toint()


@dsl_user_op
def bulk_load(dst, src, nbytes, mbar, *, loc=None, ip=None):
    """`nbytes` from global address `src` (Int64) to this CTA's shared memory at `dst`, completing on the
    mbarrier at shared address `mbar`."""
    llvm.inline_asm(
        None,
        [cutlass.Int32(dst).ir_value(loc=loc, ip=ip), cutlass.Int64(src).ir_value(loc=loc, ip=ip),
         cutlass.Int32(nbytes).ir_value(loc=loc, ip=ip), cutlass.Int32(mbar).ir_value(loc=loc, ip=ip)],
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [$1], $2, [$3];",
        "r,l,r,r", has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def bulk_store(dst, src, nbytes, *, loc=None, ip=None):
    """`nbytes` from this CTA's shared memory at `src` to global address `dst` (Int64), in the current bulk
    group. The shared memory must be written and made visible to the async proxy first
    (`cute.arch.fence_proxy("async.shared", space="cta")` and a barrier)."""
    llvm.inline_asm(
        None,
        [cutlass.Int64(dst).ir_value(loc=loc, ip=ip), cutlass.Int32(src).ir_value(loc=loc, ip=ip),
         cutlass.Int32(nbytes).ir_value(loc=loc, ip=ip)],
        "cp.async.bulk.global.shared::cta.bulk_group [$0], [$1], $2;",
        "l,r,r", has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def bulk_commit(*, loc=None, ip=None):
    """Close the current bulk group (the stores issued since the last commit)."""
    llvm.inline_asm(None, [], "cp.async.bulk.commit_group;", "", has_side_effects=True,
                    is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


@dsl_user_op
def bulk_wait_read(*, loc=None, ip=None):
    """Wait until every committed bulk group has read its source shared memory."""
    llvm.inline_asm(None, [], "cp.async.bulk.wait_group.read 0;", "", has_side_effects=True,
                    is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


@dsl_user_op
def bulk_wait_all(*, loc=None, ip=None):
    """Wait until every committed bulk group has completed: its writes are done and visible to this thread,
    so that a later store to the same addresses lands after them."""
    llvm.inline_asm(None, [], "cp.async.bulk.wait_group 0;", "", has_side_effects=True,
                    is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


@cute.jit
def group_wait_read(leader, threads: cutlass.Constexpr, barrier_id: cutlass.Constexpr):
    """Before a group of `threads` threads (named barrier `barrier_id`) rewrites shared memory that its
    leader bulk-copied out (`group_store`): the leader waits until its copies have read it, and the barrier
    tells the rest."""
    if leader:
        bulk_wait_read()
    cute.arch.barrier(barrier_id=barrier_id, number_of_threads=threads)


@cute.jit
def group_store(dst, src, nbytes, leader, threads: cutlass.Constexpr, barrier_id: cutlass.Constexpr):
    """After every thread of the group has written its part of `nbytes` at shared address `src`: the writes
    made visible to the copy engine, a barrier, and the leader's one bulk copy to global address `dst`, in
    a group of its own, which proceeds while the threads go on."""
    cute.arch.fence_proxy("async.shared", space="cta")
    cute.arch.barrier(barrier_id=barrier_id, number_of_threads=threads)
    if leader:
        bulk_store(dst, src, nbytes)
        bulk_commit()
