"""Building blocks of the wgmma consumers (the Hopper recurrence and the fused kernel): their MMAs, the
ring's shared-memory images, register A operands made from accumulators, and a consumer warpgroup's state
load, step and store. The state S^T (value rows by key columns) lives in fp32 wgmma accumulators; each step
reads one stage of a shared-memory ring, which the calling kernel fills, waits for and releases."""

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import warpgroup
from cutlass.tensor_utils import LayoutEnum

from kdagen.kernels.common import state_load

__all__ = [
    "consumer_mmas",
    "ring_layouts",
    "a_operand_for",
    "store_as_a",
    "consumer_load_state",
    "consumer_step",
]


def consumer_mmas(dtype, bv: int, bt: int, k: int):
    """(mma_x, mma_s), trace time. X^T, O^T (bv x bt, k over the K keys) and O^T += R^T Aq^T (k over bt
    tokens): B operands K-major. S^T += R^T Ak (bv x K, k over bt tokens): Ak is stored token-major, i.e.
    its B operand is N-major."""
    k_major = warpgroup.OperandMajorMode.K
    mma_x = sm90_utils.make_trivial_tiled_mma(
        dtype, dtype, k_major, k_major, cutlass.Float32, (1, 1, 1), (bv, bt), warpgroup.OperandSource.RMEM
    )
    mma_s = sm90_utils.make_trivial_tiled_mma(
        dtype, dtype, k_major, warpgroup.OperandMajorMode.MN, cutlass.Float32, (1, 1, 1), (bv, k),
        warpgroup.OperandSource.RMEM,
    )
    return mma_x, mma_s


def ring_layouts(dtype, bv: int, bt: int, k: int, stages: int):
    """Trace time: the ring's images of kd and qd, Aq, Ak in the wgmma B layouts (swizzled), `stages` deep."""
    kd_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (bv, bt, k), dtype, stages)
    aq_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (bv, bt, bt), dtype, stages)
    ak_layout = sm90_utils.make_smem_layout_b(LayoutEnum.COL_MAJOR, (bv, k, bt), dtype, stages)
    return kd_layout, aq_layout, ak_layout


@cute.jit
def a_operand_for(acc: cute.Tensor, mma: cute.TiledMma, dtype: cutlass.Constexpr) -> cute.Tensor:
    # A 16-bit register A operand of `mma` shaped to take `acc`. On Hopper an accumulator's per-thread values,
    # taken eight at a time, are exactly the A values of one 16-wide k-block (two 8-column blocks of C make
    # one k16 block), so the A fragment is the accumulator's storage under a regrouped layout.
    a_vals = mma.tv_layout_A.shape[1]
    c = acc.layout
    layout = cute.make_layout(
        (a_vals, c.shape[1], (c.shape[2], cute.size(c, mode=[0]) // cute.size(a_vals))),
        stride=(c.stride[0], c.stride[1], (c.stride[2], cute.size(a_vals, mode=[2]) * c.stride[0][2])),
    )
    return cute.make_rmem_tensor_like(layout, dtype)


@cute.jit
def store_as_a(acc: cute.Tensor, op: cute.Tensor, dtype: cutlass.Constexpr):
    # Convert the fp32 accumulator into its A operand (allocated once, outside the step loop, by
    # `a_operand_for`): written in place, so the wgmma reads registers no loop-carried copy has to move.
    cute.make_tensor(op.iterator, acc.layout).store(acc.load().to(dtype))


@cute.jit
def consumer_load_state(acc_s, coord_s, mH0, slot, hv, v0, kv_layout: cutlass.Constexpr):
    # The state entering a run, S^T rows v0.. of the warpgroup, from slot `slot` of mH0 (zero for slot -1:
    # no initial state, a fresh or padding sequence, the padding slice; `common.state_slots`), into the fp32
    # accumulators.
    for i in cutlass.range_constexpr(cute.size(acc_s)):
        acc_s[i] = cutlass.Float32(0.0)
    if slot >= 0:
        for i in cutlass.range_constexpr(cute.size(acc_s)):
            acc_s[i] = state_load(mH0, slot, hv, v0 + coord_s[i][0], coord_s[i][1], kv_layout)


@cute.jit
def consumer_step(stage, rows, tidx, mma_x, mma_s, acc_s, acc_x, acc_o, rS, rR, coord_s, coord_x, rKd, rQd,
                  rAq, rAk, sAk, sV, sGt, v_off, k: cutlass.Constexpr, bt: cutlass.Constexpr,
                  consumers: cutlass.Constexpr, dtype: cutlass.Constexpr):
    """One recurrence step of a consumer warpgroup from ring stage `stage` (kda-math.md §2.4-§2.5): the state
    decayed, X^T and O^T from the state entering the step, R^T = V^T - X^T, then O^T += R^T Aq^T and
    S^T += R^T Ak. `rows` of the step's bt tokens are in the run; `v_off` is the warpgroup's first value row
    within the stage's v tile. The caller releases the stage and stores o. Returns `mma_x`, whose accumulate
    field the step sets: the caller rebinds it in its step loop, so that the tracer carries it."""
    if rows < bt:
        # The run's last, partial step: rows past its end may hold another sequence's values or
        # uninitialised memory. They are masked out of R below; zeroing them in Ak as well keeps even
        # a NaN there (0 * NaN) out of the state.
        for idx in range(tidx, k * bt, consumers):
            if idx // k >= rows:
                sAk[idx % k, idx // k, stage] = dtype(0.0)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=1, number_of_threads=consumers)

    # Decay the state by gt (a per-key-column scale). rS already holds the state entering the step,
    # which batch 1 reads, so this is off its path.
    for i in cutlass.range_constexpr(cute.size(acc_s)):
        acc_s[i] = acc_s[i] * sGt[0, coord_s[i][1], stage]

    # Batch 1: X^T = S^T Kd^T and O^T = S^T Qd^T (the state entering the step), K/16 k-blocks each;
    # the first k-block overwrites the accumulators.
    warpgroup.fence()
    for kb in cutlass.range_constexpr(k // 16):
        mma_x.set(warpgroup.Field.ACCUMULATE, kb != 0)
        cute.gemm(mma_x, acc_x, rS[None, None, kb], rKd[None, None, kb, stage], acc_x)
        cute.gemm(mma_x, acc_o, rS[None, None, kb], rQd[None, None, kb, stage], acc_o)
    warpgroup.commit_group()
    warpgroup.wait_group(0)

    # R^T = V^T - X^T; columns past the run's end are exactly zero.
    for i in cutlass.range_constexpr(cute.size(acc_x)):
        t = coord_x[i][1]
        r = sV[t, v_off + coord_x[i][0], stage].to(cutlass.Float32) - acc_x[i]
        acc_x[i] = cutlass.select_(t < rows, r, cutlass.Float32(0.0))
    store_as_a(acc_x, rR, dtype)

    # Batch 2: O^T += R^T Aq^T and S^T <- S^T diag(gt) + R^T Ak.
    mma_x.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.fence()
    cute.gemm(mma_x, acc_o, rR, rAq[None, None, None, stage], acc_o)
    cute.gemm(mma_s, acc_s, rR, rAk[None, None, None, stage], acc_s)
    warpgroup.commit_group()
    warpgroup.wait_group(0)
    return mma_x
