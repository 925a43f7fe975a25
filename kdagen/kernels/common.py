"""Device building blocks every stage shares: layouts and copies, packing, ready flags, state and output
access, sequence bounds.

Trace-time helpers (plain functions) build layouts and copies; `@cute.jit` ones are inlined into the kernel
that calls them. Every value that differs between variants is a parameter: a `cutlass.Constexpr` where it
shapes the code (the state layout, tile sizes, the output dtype).
"""

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync

from kdagen.kernels import run_map

__all__ = [
    "swizzled_rows",
    "row_copy",
    "a_view",
    "split_bf16",
    "pack2",
    "wait_flag",
    "wait_ready_group",
    "map_planes",
    "state_slots",
    "checkpoint_first",
    "checkpoint_slot",
    "checkpoint_step",
    "tile_runs",
    "state_tile",
    "store_state_tile",
    "state_load",
    "state_store",
    "store_o_step",
    "cu_at",
    "request_tokens",
    "zero_rows",
    "zero_padding_tail",
    "find_run",
    "segment_run",
    "store_segment_map",
    "seq_of_slice",
    "tile_rows",
    "token_rows",
    "run_rows",
    "fused_mode",
    "mma_input",
    "load_step",
]


def swizzled_rows(rows: int, cols: int, stages: int | None = None):
    """(rows, cols[, stages]) of 16-bit values from an 8 x 64 atom (128-byte rows) with a 3-bit XOR swizzle:
    conflict-free ldmatrix (plain and .trans) and 16-byte cp.async."""
    atom = cute.make_composed_layout(
        cute.make_swizzle(3, 3, 3), 0, cute.make_layout((8, 64), stride=(64, 1))
    )
    if stages is None:
        return cute.tile_to_shape(atom, (rows, cols), (0, 1))
    return cute.tile_to_shape(atom, (rows, cols, stages), (0, 1, 2))


def row_copy(dtype, cols: int, threads: int, to_global: bool = False):
    """16 bytes per thread per copy, threads laid out row-major over a (rows, cols) tile: cp.async into
    shared memory, or plain vector stores out of it."""
    per_row = cols * dtype.width // 128
    op = (
        cute.nvgpu.CopyUniversalOp()
        if to_global
        else cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL)
    )
    atom = cute.make_copy_atom(op, dtype, num_bits_per_copy=128)
    thr = cute.make_layout((threads // per_row, per_row), stride=(per_row, 1))
    return cute.make_tiled_copy_tv(atom, thr, cute.make_layout((1, 128 // dtype.width)))


@cute.jit
def a_view(r: cute.Tensor) -> cute.Tensor:
    # A 16-bit copy of an m16n8k16 C fragment ((2,2), M, N) re-viewed as an A fragment (((2,2),2), M, N/2):
    # two n8 tiles are one k16 block, a within-lane regrouping (the FlashAttention-2 P@V trick).
    d = cute.logical_divide(r.layout, (None, None, 2))
    view = cute.make_layout(
        ((d.shape[0], d.shape[2][0]), d.shape[1], d.shape[2][1]),
        stride=((d.stride[0], d.stride[2][0]), d.stride[1], d.stride[2][1]),
    )
    return cute.make_tensor(r.iterator, view)


@cute.jit
def split_bf16(x: cutlass.Float32):
    # x ~= hi + lo in bf16: three bf16 products (hi*hi + hi*lo + lo*hi) keep ~16 mantissa bits, which
    # cancelling dot products need (one bf16 product loses ~2 digits there; kda-math.md §2.7).
    hi = x.to(cutlass.BFloat16)
    lo = (x - hi.to(cutlass.Float32)).to(cutlass.BFloat16)
    return hi, lo


@cute.jit
def pack2(x0: cutlass.Float32, x1: cutlass.Float32, dtype):
    # Two fp32 values as one 32-bit word of two 16-bit values (x0 in the low half): one cvt.rn.*x2.
    f = cute.make_rmem_tensor(cute.make_layout((2,)), cutlass.Float32)
    f[0] = x0
    f[1] = x1
    h = cute.make_rmem_tensor(cute.make_layout((2,)), dtype)
    h.store(f.load().to(dtype))
    return cute.recast_tensor(h, cutlass.Int32)[0]


@cute.jit
def wait_flag(mReady: cute.Tensor, tile: cutlass.Int32, hv: cutlass.Int32):
    # Spin until prepare has raised the ready flag of (tile, value head). Acquire loads: once the flag is
    # seen, the tile's outputs are visible too.
    flag = mReady.iterator + cute.crd2idx((tile, hv), mReady.layout)
    seen = cute.arch.load(flag, cutlass.Int32, sem="acquire", scope="gpu")
    while seen == 0:
        seen = cute.arch.load(flag, cutlass.Int32, sem="acquire", scope="gpu")


@cute.jit
def wait_ready_group(mReady, tile_base, hv, first, num_steps, lane, ready_group: cutlass.Constexpr):
    # Lanes 0 .. ready_group - 1 of the calling warp wait, one tile each, until prepare has flagged the tiles
    # of steps first .. first + ready_group - 1. One wait per group keeps the flag latency off most steps;
    # the caller orders its loads of those steps after the wait.
    s = first + lane
    if lane < ready_group and s < num_steps:
        wait_flag(mReady, tile_base + s, hv)


@cute.jit
def map_planes(mMaps: cute.Tensor, slot: cutlass.Int32, hv: cutlass.Int32, k: cutlass.Constexpr,
               v: cutlass.Constexpr) -> cute.Tensor:
    # The segment map M of (slot, value head) in intra-card CP: two k x k bf16 planes, hi then lo, stored in
    # the bytes of the map's fp32 rows v.. The prescan writes them; the merge copies them.
    base = mMaps.iterator + cute.crd2idx((slot, hv, v, 0), mMaps.layout)
    return cute.make_tensor(
        cute.recast_ptr(base, dtype=cutlass.BFloat16), cute.make_layout((2, k, k), stride=(k * k, k, 1))
    )


@cute.jit
def store_segment_map(acc_s: cute.Tensor, coord_s: cute.Tensor, mMaps: cute.Tensor, slot: cutlass.Int32,
                      hv: cutlass.Int32, v0: cutlass.Int32, m_part: cutlass.Boolean, k: cutlass.Constexpr,
                      v: cutlass.Constexpr):
    # A CP prescan's result for (segment slot, value head): the slices of the offset (rows v0.. of the map's
    # first v fp32 rows), or, for the slices that ran from the identity (m_part, rows v0 - v..), the map M
    # already split for the merge's bf16x3 products, into the planes of `map_planes`, which the merge copies
    # straight into its B operand.
    if m_part:
        mM = map_planes(mMaps, slot, hv, k, v)
        for i in cutlass.range_constexpr(cute.size(acc_s)):
            r = v0 - v + coord_s[i][0]
            mM[0, r, coord_s[i][1]], mM[1, r, coord_s[i][1]] = split_bf16(acc_s[i])
    else:
        for i in cutlass.range_constexpr(cute.size(acc_s)):
            mMaps[slot, hv, v0 + coord_s[i][0], coord_s[i][1]] = acc_s[i]


@cute.jit
def state_slots(mIdx: cute.Tensor, mInit: cute.Tensor, seq: cutlass.Int32, num_seqs: cutlass.Int32,
                has_h0: cutlass.Int32, store_ht: cutlass.Int32, pooled: cutlass.Int32):
    # (slot read, slot written, padding) of sequence `seq`'s state, read once per sequence. A slot of -1 is
    # none: the state starts from zero, or is not written. The compact form (pooled = 0) keeps state n in
    # slot n; on a pool (pooled = 1) the slot is state_indices[seq] and a negative one marks a padding
    # sequence (padding = 1: nothing read or written, o = 0). has_h0: 0 reads no state, 1 every sequence's
    # slot, 2 the slots whose has_initial_state byte mInit[seq] is set. seq = num_seqs (the recurrence's
    # padding-tail slice) has no state.
    slot = cutlass.Int32(-1)
    pad = cutlass.Int32(0)
    if seq < num_seqs:
        slot = seq
        if pooled != 0:
            slot = mIdx[seq]
            if slot < 0:
                slot = cutlass.Int32(-1)
                pad = cutlass.Int32(1)
    slot_in = slot
    if has_h0 == 0:
        slot_in = cutlass.Int32(-1)
    if has_h0 == 2 and slot >= 0:
        if mInit[seq] == 0:
            slot_in = cutlass.Int32(-1)
    slot_out = slot
    if store_ht == 0:
        slot_out = cutlass.Int32(-1)
    return slot_in, slot_out, pad


@cute.jit
def checkpoint_first(mStart: cute.Tensor, mCk: cute.Tensor, seq: cutlass.Int32, num_seqs: cutlass.Int32,
                     every: cutlass.Int32, step0: cutlass.Int32, bt: cutlass.Constexpr, runs=None):
    # Prefix-cache checkpoints of sequence `seq`: (the first step at or after step0 whose end is one, its
    # checkpoint number, its pool slot), or (-1, 0, -1) for none. The piece starts at absolute position
    # start_positions[seq] (tokens already in the state); checkpoint m is the state at the m-th multiple of
    # C = every * bt past it. With a start that is a multiple of bt they fall on step ends, every `every`
    # steps from the first; a start that is not (the caller's duty) takes none: those states are never
    # formed. Sequences past mStart's length start at 0 (the runtime passes a one-element zero when no
    # positions are given). `runs`: `tile_runs`' slots, where the recurrence takes them.
    nxt = cutlass.Int32(-1)
    m = cutlass.Int32(0)
    slot = cutlass.Int32(-1)
    if every > 0 and seq < num_seqs:
        start = cutlass.Int32(0)
        if seq < mStart.shape[0]:
            start = cutlass.max(mStart[seq], 0)
        if start % bt == 0:
            first = (every * bt - start % (every * bt)) // bt - 1
            nxt = first
            if step0 > first:
                m = (step0 - first + every - 1) // every
                nxt = first + m * every
            slot = checkpoint_slot(mCk, seq, m, runs)
    return nxt, m, slot


@cute.jit
def checkpoint_slot(mCk: cute.Tensor, seq: cutlass.Int32, m: cutlass.Int32, runs=None) -> cutlass.Int32:
    # The pool slot of checkpoint m of sequence seq: checkpoint_indices[seq, m], or -1 (skip) past its M
    # columns or where the caller put a negative index. With `runs` (`tile_runs`: the first checkpoint's
    # slot and their count, a negative count where the caller gave checkpoint_indices) the slot is derived.
    slot = cutlass.Int32(-1)
    if cutlass.const_expr(runs is None):
        if m < mCk.shape[1]:
            slot = mCk[seq, m]
    else:
        first, count = runs
        if count >= 0:
            if m < count:
                slot = first + m
        elif m < mCk.shape[1]:
            slot = mCk[seq, m]
    return slot


@cute.jit
def tile_runs(to_tiles: cutlass.Int32, bos: cutlass.Int32, seq: cutlass.Int32, run_len: cutlass.Int32,
              every: cutlass.Int32, bt: cutlass.Constexpr):
    # The backward's kept states with their slots derived from the offsets (`to_tiles` 2, no
    # checkpoint_indices to read): (the slot of the run after the sequence's first, the count of its
    # checkpoints: one a run of `every` steps but the last, whose end is the sequence's final state), by the
    # host's formulas (`run_map`); (0, -1) otherwise. The state entering the first run (the initial state)
    # goes to first - 1, which no checkpoint writes: the recurrence stores it as it starts.
    first = cutlass.Int32(0)
    count = cutlass.Int32(-1)
    if to_tiles == 2:
        run = every * bt
        first = run_map.first_run(bos, seq, run) + 1
        count = cutlass.max(run_map.runs_of(run_len, run) - 1, 0)
    return first, count


@cute.jit
def checkpoint_step(thr_s, acc_s: cute.Tensor, mHt: cute.Tensor, mTs: cute.Tensor, to_tiles: cutlass.Int32,
                    mCk: cute.Tensor, seq: cutlass.Int32, hv: cutlass.Int32, v0: cutlass.Int32,
                    step: cutlass.Int32, rows: cutlass.Int32, ck_next: cutlass.Int32, ck_m: cutlass.Int32,
                    ck_slot: cutlass.Int32, every: cutlass.Int32, bv: cutlass.Constexpr,
                    bt: cutlass.Constexpr, kv_layout: cutlass.Constexpr, staging=None, runs=None):
    # After step `step` of a sequence (`rows` of its bt tokens in the run): when it ends on the next
    # checkpoint (`checkpoint_first`), the state in the accumulators (S^T rows v0 .. v0 + bv, partitioned by
    # the MMA slice `thr_s`) goes to its slot `ck_slot`, and the next checkpoint is `every` steps on. The
    # slot is the pool's (mHt, the state dtype), or with `to_tiles` one of mTs (the MMA type: the backward's
    # states entering its tiles, which it reads in that type, so half the bytes of fp32 go either way).
    # Its slot is read now, so that the read's latency passes in those steps instead of stalling the
    # serial chain at the checkpoint. A partial last step ends short of its checkpoint: no write. One
    # compare a step otherwise. With `staging` (a `state_copy.StagedStores`: sm_90 and later), the kinds of
    # store it takes go through shared memory and a tensor copy, which drains off the chain. `runs`: as
    # `checkpoint_slot`'s. Returns (ck_next, ck_m, ck_slot): the caller rebinds them in its step loop.
    if step == ck_next and rows >= bt:
        if ck_slot >= 0:
            if to_tiles != 0:
                if cutlass.const_expr(staging is not None and staging.tiles is not None):
                    staging.store_tiles(thr_s, acc_s, ck_slot, hv, v0)
                else:
                    store_state_tile(thr_s, acc_s, mTs, ck_slot, hv, v0, bv, kv_layout)
            elif cutlass.const_expr(staging is not None and staging.pool is not None):
                staging.store_pool(thr_s, acc_s, ck_slot, hv, v0)
            else:
                store_state_tile(thr_s, acc_s, mHt, ck_slot, hv, v0, bv, kv_layout)
        ck_m = ck_m + 1
        ck_next = ck_next + every
        ck_slot = checkpoint_slot(mCk, seq, ck_m, runs)
    return ck_next, ck_m, ck_slot


@cute.jit
def state_tile(mS: cute.Tensor, slot: cutlass.Int32, hv: cutlass.Int32, v0: cutlass.Int32,
               bv: cutlass.Constexpr, kv_layout: cutlass.Constexpr) -> cute.Tensor:
    # S^T rows v0 .. v0 + bv of the state in `slot` (laid out as `state_load` reads it) as a (bv, K) tensor:
    # one base address and the slot's static inner strides, so that a partition of it has fixed offsets.
    head = mS[slot, hv, None, None]
    if cutlass.const_expr(kv_layout):
        s_v, s_k, k = head.layout.stride[1], head.layout.stride[0], head.shape[0]
    else:
        s_v, s_k, k = head.layout.stride[0], head.layout.stride[1], head.shape[1]
    return cute.make_tensor(head.iterator + v0 * s_v, cute.make_layout((bv, k), stride=(s_v, s_k)))


@cute.jit
def store_state_tile(thr_s, acc_s: cute.Tensor, mS: cute.Tensor, slot: cutlass.Int32, hv: cutlass.Int32,
                     v0: cutlass.Int32, bv: cutlass.Constexpr, kv_layout: cutlass.Constexpr):
    # The accumulators of S^T rows v0 .. v0 + bv (partitioned by the MMA slice `thr_s` over a (bv, K) tile)
    # into slot `slot` of mS, rounded to its dtype, each store at a fixed offset from one address. An MMA
    # accumulator holds key columns in pairs from an even one, and lanes 4 apart hold neighbouring rows. With
    # the V-first layout (keys contiguous) neighbouring lanes swap pairs into 4 contiguous keys, one vector
    # store each (a warp's store covers 64 bytes of a row, where scalar stores cover 8 bytes of 8 rows);
    # with the K-first one (values contiguous) a 16-bit state's lanes 4 apart swap into 2 contiguous values,
    # one 4-byte store where there were two 2-byte ones (fp32 ones stay scalar: a warp's store then fills
    # whole 32-byte sectors, and the swap measured slower).
    # The thread's offset, computed here, is declared a multiple of the vector so that the pointer keeps the
    # alignment the vectorizer needs (the partition's own offset carries none). docs/experiments.md, "State
    # stores".
    tile = state_tile(mS, slot, hv, v0, bv, kv_layout)
    tS = thr_s.partition_C(tile)
    first = thr_s.partition_C(cute.make_identity_tensor(tile.shape))[0]
    if cutlass.const_expr(kv_layout and mS.element_type.width == 32):
        for i in cutlass.range_constexpr(cute.size(acc_s)):
            tS[i] = acc_s[i].to(mS.element_type)
    elif cutlass.const_expr(kv_layout):
        # Lane 4g + q holds rows g and g + 8 (of each 16), keys 2q + 8j and 2q + 8j + 1. Two exchanges
        # transpose them into 4 contiguous rows of one key a lane: with its partner 4 lanes away (row g ^ 1)
        # the even-row lane keeps key 2q + 8j of both rows, the odd-row one key 2q + 8j + 1; then with the
        # one 8 lanes away (row g ^ 2) the lower lane keeps rows g0, g0 + 1 and takes g0 + 2, g0 + 3 (g0 =
        # g & ~1), the upper one keeps rows g0 + 8, g0 + 9 and takes the two below. A warp's store then
        # writes 16 rows of 8 keys: whole 32-byte sectors. The lane's base is a key on if odd, and
        # 6 rows on if upper, a row back if odd.
        s_k = mS.layout.stride[2]
        odd = first[0] % 2
        upper = (first[0] // 2) % 2
        is_odd = odd == 1
        is_upper = upper == 1
        off = (slot * mS.layout.stride[0] + hv * mS.layout.stride[1] + v0 + first[0]
               + first[1] * s_k + odd * (s_k - 1) + upper * 6)
        base = mS.iterator + cute.assume(off, divby=4)
        quad = cute.make_rmem_tensor(cute.make_layout(4), mS.element_type)
        for i, i8 in _row_halves(tS.layout, cute.size(acc_s)):
            # after the first exchange: this lane's key in rows (g0, g0 + 1) and (g0 + 8, g0 + 9)
            r = cute.arch.shuffle_sync_bfly(cutlass.select_(is_odd, acc_s[i], acc_s[i + 1]), offset=4)
            r8 = cute.arch.shuffle_sync_bfly(cutlass.select_(is_odd, acc_s[i8], acc_s[i8 + 1]), offset=4)
            lo0 = cutlass.select_(is_odd, r, acc_s[i])
            lo1 = cutlass.select_(is_odd, acc_s[i + 1], r)
            hi0 = cutlass.select_(is_odd, r8, acc_s[i8])
            hi1 = cutlass.select_(is_odd, acc_s[i8 + 1], r8)
            # the second: the lower lane sends its rows g0 + 8, g0 + 9, the upper one its rows g0, g0 + 1
            y0 = cute.arch.shuffle_sync_bfly(cutlass.select_(is_upper, lo0, hi0), offset=8)
            y1 = cute.arch.shuffle_sync_bfly(cutlass.select_(is_upper, lo1, hi1), offset=8)
            quad[0] = cutlass.Float32(cutlass.select_(is_upper, y0, lo0)).to(mS.element_type)
            quad[1] = cutlass.Float32(cutlass.select_(is_upper, y1, lo1)).to(mS.element_type)
            quad[2] = cutlass.Float32(cutlass.select_(is_upper, hi0, y0)).to(mS.element_type)
            quad[3] = cutlass.Float32(cutlass.select_(is_upper, hi1, y1)).to(mS.element_type)
            cute.autovec_copy(quad, cute.make_tensor(base + tS.layout(i), cute.make_layout(4)))
    else:
        off = (slot * mS.layout.stride[0] + hv * mS.layout.stride[1] + (v0 + first[0]) * mS.layout.stride[2]
               + first[1])
        groups = _key_quads(tS.layout, cute.size(acc_s))
        # Lanes 2m and 2m + 1 hold the same row's key pairs 2 apart: each sends the other the pair it lacks,
        # so that the even lane holds the 4 keys from column 8j + 2q and the odd one those from
        # 8(j + 1) + 2q - 2 (its base is 6 keys on), each stored at once.
        odd = (first[1] // 2) % 2
        is_odd = odd == 1
        base = mS.iterator + cute.assume(off + odd * 6, divby=4)
        quad = cute.make_rmem_tensor(cute.make_layout(4), mS.element_type)
        for n in cutlass.range_constexpr(len(groups)):
            i, i2 = groups[n]
            r0 = cute.arch.shuffle_sync_bfly(cutlass.select_(is_odd, acc_s[i], acc_s[i2]), offset=1)
            r1 = cute.arch.shuffle_sync_bfly(cutlass.select_(is_odd, acc_s[i + 1], acc_s[i2 + 1]), offset=1)
            quad[0] = cutlass.Float32(cutlass.select_(is_odd, r0, acc_s[i])).to(mS.element_type)
            quad[1] = cutlass.Float32(cutlass.select_(is_odd, r1, acc_s[i + 1])).to(mS.element_type)
            quad[2] = cutlass.Float32(cutlass.select_(is_odd, acc_s[i2], r0)).to(mS.element_type)
            quad[3] = cutlass.Float32(cutlass.select_(is_odd, acc_s[i2 + 1], r1)).to(mS.element_type)
            cute.autovec_copy(quad, cute.make_tensor(base + tS.layout(i), cute.make_layout(4)))


def _row_halves(layout, n: int) -> list[tuple[int, int]]:
    # Trace time: the accumulator elements (i, i8) whose key pairs (i, i + 1) and (i8, i8 + 1) are 8 rows
    # apart, the first in the upper half of a 16-row block, over a K-first tile (rows contiguous). An MMA
    # accumulator holds a thread's rows g and g + 8 of each 16, so every element falls in one such group.
    offs = [layout(i) for i in range(n)]
    at = {o: i for i, o in enumerate(offs)}
    step = offs[1] - offs[0]  # the key stride: elements i, i + 1 are a key pair
    groups = []
    for i in range(0, n, 2):
        o = offs[i]
        assert offs[i + 1] == o + step, "accumulator pairs not adjacent"
        if (o % step) % 16 == 0:  # a row g element (rows are contiguous: o mod the key stride is the row)
            i8 = at[o + 8]
            assert offs[i8 + 1] == o + 8 + step, "accumulator pairs not adjacent"
            groups.append((i, i8))
    assert 4 * len(groups) == n, "accumulator rows do not form 8-apart halves"
    return groups


def _key_quads(layout, n: int) -> list[tuple[int, int]]:
    # Trace time: the accumulator elements (i, i2) whose key pairs (i, i + 1) and (i2, i2 + 1) are 8 keys
    # apart in the same row, the first in an even 8-key block, over a V-first tile (keys contiguous). An MMA
    # accumulator holds a thread's keys as pairs at 2q + 8j, so every element falls in one such group.
    offs = [layout(i) for i in range(n)]
    at = {o: i for i, o in enumerate(offs)}
    groups = []
    for i, o in enumerate(offs):
        if o % 2 == 0 and o % 16 < 8:
            i2 = at[o + 8]
            assert at[o + 1] == i + 1 and at[o + 9] == i2 + 1, "accumulator pairs not adjacent"
            groups.append((i, i2))
    assert 4 * len(groups) == n, "accumulator keys do not form 8-apart pairs"
    return groups


@cute.jit
def state_load(mS: cute.Tensor, n: cutlass.Int32, hv: cutlass.Int32, vr: cutlass.Int32, kc: cutlass.Int32,
               kv_layout: cutlass.Constexpr):
    # Element (value row vr, key column kc) of the state in slot n: mS is [slots, HV, K, V] with kv_layout,
    # else [slots, HV, V, K], compact within a slot, the slot stride a dynamic 64-bit stride (a pool may
    # interleave layers, and slot x stride may pass 2^31 elements). The recurrences and the merge read S^T
    # entries this way.
    # A bf16 state (the spec's state_dtype) is widened here: the arithmetic is fp32.
    x = cutlass.Float32(0.0)
    if cutlass.const_expr(kv_layout):
        x = mS[n, hv, kc, vr].to(cutlass.Float32)
    else:
        x = mS[n, hv, vr, kc].to(cutlass.Float32)
    return x


@cute.jit
def state_store(mS: cute.Tensor, n: cutlass.Int32, hv: cutlass.Int32, vr: cutlass.Int32, kc: cutlass.Int32,
                x: cutlass.Float32, kv_layout: cutlass.Constexpr):
    # `state_load`'s element, written (rounded to the state's dtype).
    if cutlass.const_expr(kv_layout):
        mS[n, hv, kc, vr] = x.to(mS.element_type)
    else:
        mS[n, hv, vr, kc] = x.to(mS.element_type)


@cute.jit
def store_o_step(thr_mma, tile: cute.Tensor, acc_o: cute.Tensor, coord_o: cute.Tensor, rows: cutlass.Int32,
                 bv: cutlass.Constexpr, bt: cutlass.Constexpr, dtype: cutlass.Constexpr):
    # A step's O^T (bv values x bt tokens, partitioned by `thr_mma`, coordinates `coord_o`) into its
    # (tokens, values) tile of o, viewed as (values, tokens). The addresses come from the tile's layout (one
    # base, fixed offsets) and only a run's last, partial step is masked: per-element index arithmetic and a
    # branch per store would be over a quarter of a consumer warp's instructions per step
    # (docs/experiments.md, "o stores").
    vt = cute.make_layout((bv, bt), stride=(tile.layout.stride[1], tile.layout.stride[0]))
    tOg = thr_mma.partition_C(cute.make_tensor(tile.iterator, vt))
    if rows >= bt:
        for i in cutlass.range_constexpr(cute.size(acc_o)):
            tOg[i] = acc_o[i].to(dtype)
    else:
        for i in cutlass.range_constexpr(cute.size(acc_o)):
            if coord_o[i][1] < rows:
                tOg[i] = acc_o[i].to(dtype)


@cute.jit
def cu_at(mCu: cute.Tensor, j: cutlass.Int32, num_tokens: cutlass.Int32) -> cutlass.Int32:
    # cu_seqlens[j] clamped into [0, num_tokens]. Offsets left on the GPU are not checked on the host (that
    # would synchronise), and one out of range must neither send a kernel past its tensors nor make the
    # recurrence wait for a tile that no prepare CTA makes: garbage in gives garbage out, but the call ends.
    # Prepare, which searches the offsets for every tile, reads a clamped copy made with this helper by the
    # forward stage's setup kernel, so every stage agrees on the bounds.
    return cutlass.min(cutlass.max(mCu[j], 0), num_tokens)


@cute.jit
def request_tokens(mCu: cute.Tensor, n: cutlass.Int32, tokens_per_seq: cutlass.Int32,
                   num_tokens: cutlass.Int32):
    # Decode request n's token range [bos, eos): n * S .. of an [N, S] batch (tokens_per_seq = S), or the
    # clamped offsets of a packed one (tokens_per_seq = 0).
    bos = n * tokens_per_seq
    eos = bos + tokens_per_seq
    if tokens_per_seq == 0:
        bos = cu_at(mCu, n, num_tokens)
        eos = cu_at(mCu, n + 1, num_tokens)
    return bos, eos


@cute.jit
def zero_rows(mO: cute.Tensor, t0: cutlass.Int32, t1: cutlass.Int32, hv: cutlass.Int32, v0: cutlass.Int32,
              tidx: cutlass.Int32, bv: cutlass.Constexpr, num_threads: cutlass.Constexpr,
              dtype: cutlass.Constexpr):
    # o = 0 for tokens t0 .. t1 - 1 in head hv and bv value columns from v0, by num_threads threads (thread
    # tidx): the o of tokens no recurrence step writes (engine padding, a padding sequence of a pool).
    for idx in range(tidx, (t1 - t0) * bv, num_threads):
        mO[t0 + idx // bv, hv, v0 + idx % bv] = dtype(0.0)


@cute.jit
def zero_padding_tail(mO: cute.Tensor, mCu: cute.Tensor, hv: cutlass.Int32, v0: cutlass.Int32,
                      tidx: cutlass.Int32, bv: cutlass.Constexpr, num_threads: cutlass.Constexpr,
                      dtype: cutlass.Constexpr):
    # o = 0 for the tokens past cu_seqlens[-1] (engine padding), in this CTA's head and V-slice (bv value
    # columns from v0), by its num_threads threads: the caller need not zero-fill o first.
    tail0 = cu_at(mCu, mCu.shape[0] - 1, mO.shape[0])
    zero_rows(mO, tail0, mO.shape[0], hv, v0, tidx, bv, num_threads, dtype)


@cute.jit
def find_run(mCu: cute.Tensor, unit: cutlass.Int32, slot: cutlass.Int32) -> cutlass.Int32:
    # The sequence that owns `slot` in the map slot = floor(bos / unit) + seq + j (j: the unit-sized piece of
    # the sequence). The map is injective and monotone in seq, so a binary search over cu_seqlens finds it on
    # the device: no host-side table, no synchronisation. Callers pass offsets already clamped into [0, T].
    lo = cutlass.Int32(0)
    hi = mCu.shape[0] - 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if mCu[mid] // unit + mid <= slot:
            lo = mid
        else:
            hi = mid
    return lo


@cute.jit
def segment_run(mCu: cute.Tensor, seg_len: cutlass.Int32, z: cutlass.Int32, bt: cutlass.Constexpr):
    # Segment slot z of intra-card CP (the map z = floor(bos / seg_len) + seq + j, as for tiles): its
    # sequence, the sequence's offsets, the segment's index j in it, its first token, its length (<= 0
    # where the sequence has no segment j) and its first step. Offsets clamped into [0, T] by the caller.
    seq = find_run(mCu, seg_len, z)
    bos = mCu[seq]
    eos = mCu[seq + 1]
    j = z - (bos // seg_len + seq)
    run0 = bos + j * seg_len
    run_len = cutlass.max(cutlass.min(seg_len, eos - run0), 0)
    step0 = j * (seg_len // bt)
    return seq, bos, eos, j, run0, run_len, step0


@cute.jit
def tile_rows(mCu: cute.Tensor, bt: cutlass.Constexpr, tile: cutlass.Int32):
    # Tile `tile` of the map tile = floor(bos / bt) + seq + step (prepare's, the scans' and the backward's):
    # (its first token t0, its rows: at most bt, <= 0 where no sequence has this tile id, and its sequence's
    # first token bos: t0 < bos also means none).
    t0, rows, bos, _ = run_rows(mCu, bt, tile)
    return t0, rows, bos


@cute.jit
def run_rows(mCu: cute.Tensor, unit: cutlass.Constexpr, run: cutlass.Int32):
    # `tile_rows` for pieces of `unit` tokens (the map run = floor(bos / unit) + seq + step), with the
    # sequence: (t0, rows, bos, seq).
    seq = find_run(mCu, unit, run)
    bos = mCu[seq]
    t0 = bos + (run - (bos // unit + seq)) * unit
    rows = cutlass.min(mCu[seq + 1] - t0, unit)
    return t0, rows, bos, seq


@cute.jit
def seq_of_slice(mOrder: cute.Tensor, by_length: cutlass.Int32, z: cutlass.Int32,
                 num_seqs: cutlass.Int32) -> cutlass.Int32:
    # The sequence of the recurrence's grid slice z: the z-th longest when the forward stage's setup kernel
    # ranked them (by_length), else sequence z; z = N (the padding tail) stays N. Setup ran before prepare, so
    # the entry is there; the load is gpu-scoped (not from a possibly stale L1 line of an earlier call's
    # buffer).
    seq = z
    if by_length != 0:
        if z < num_seqs:
            seq = cute.arch.load(mOrder.iterator + z, cutlass.Int32, sem="acquire", scope="gpu")
    return seq


@cute.jit
def fused_mode(mOrder: cute.Tensor, num_seqs: cutlass.Int32) -> cutlass.Int32:
    # The path the forward stage's setup kernel chose for this call (1: the fused kernel, 0: prepare and the
    # recurrence), in the word after the ranking, order[N]. Setup ran before every reader; gpu-scoped, as
    # `seq_of_slice`'s loads.
    return cute.arch.load(mOrder.iterator + num_seqs, cutlass.Int32, sem="acquire", scope="gpu")


@cute.jit
def mma_input(acc: cute.Tensor, dtype: cutlass.Constexpr) -> cute.Tensor:
    # An fp32 m16n8k16 C fragment rounded to `dtype` and re-viewed as an A fragment (`a_view`): how the
    # mma_sync recurrences feed a state or a step's residual back into the next product.
    r = cute.make_rmem_tensor_like(acc, dtype)
    r.store(acc.load().to(dtype))
    return a_view(r)


@cute.jit
def load_step(step, stage, rows, v_rows, tidx, gt_threads: cutlass.Constexpr, copy_k, copy_v, copy_aq,
              copy_gt, tKg, tKs, tKc, tVg, tVs, tVc, tAg, tAs, tAc, tGg, tGs):
    # One 16-token step's operands of the mma_sync recurrences into ring stage `stage` by cp.async: the three
    # K-wide tiles (tKg -> tKs) and aq (first warp) for their first `rows` rows, the value-side tile for its
    # first `v_rows`, gt (first `gt_threads` threads). Rows past a sequence's end are zero-filled: they then
    # add nothing to the step's products.
    for m in cutlass.range_constexpr(cute.size(tKc.shape[1])):
        if cute.elem_less(tKc[0, m, 0][0], rows):
            for j in cutlass.range_constexpr(3):
                cute.copy(copy_k, tKg[j][None, m, None, step], tKs[j][None, m, None, stage])
        else:
            for j in cutlass.range_constexpr(3):
                tKs[j][None, m, None, stage].fill(0)
    for m in cutlass.range_constexpr(cute.size(tVc.shape[1])):
        if cute.elem_less(tVc[0, m, 0][0], v_rows):
            cute.copy(copy_v, tVg[None, m, None, step], tVs[None, m, None, stage])
        else:
            tVs[None, m, None, stage].fill(0)
    if tidx < 32:
        for m in cutlass.range_constexpr(cute.size(tAc.shape[1])):
            if cute.elem_less(tAc[0, m, 0][0], rows):
                cute.copy(copy_aq, tAg[None, m, None, step], tAs[None, m, None, stage])
            else:
                tAs[None, m, None, stage].fill(0)
    if tidx < gt_threads:
        cute.copy(copy_gt, tGg[None, None, None, step], tGs[None, None, None, stage])


@cute.jit
def token_rows(m: cute.Tensor, t0, head, n: cutlass.Constexpr) -> cute.Tensor:
    """Tokens t0 .. t0 + n of one head of m ([tokens, heads, columns]) as an (n, columns) view from one base
    address with a 32-bit token stride: an access then costs a 32-bit multiply-add and a pointer add, where
    m's own layout (64-bit strides) takes a 64-bit index product. A tile's n tokens keep their offsets
    within the int32 range."""
    base = m.iterator + cute.crd2idx((t0, head, 0), m.layout)
    layout = cute.make_layout((n, m.shape[2]), stride=(cutlass.Int32(m.layout.stride[0]), m.layout.stride[2]))
    return cute.make_tensor(base, layout)
