"""The staging buffer of the staged state stores (`kdagen.kernels.staging_shape`, laid out by
`kdagen.kernels.state_copy` under the 128-byte swizzle): every store of a warp hits distinct banks, a box is
whole swizzle rows, and the planner's rounds fit the kernels' shared memory."""

from __future__ import annotations

import itertools

import pytest

from kdagen import plan
from kdagen.kernels.staging_shape import (
    box_byte,
    box_fits,
    buffer_bytes,
    staging_box,
    staging_bytes,
    staging_rounds,
)
from kdagen.spec import load_spec_file

CASES = [(w, kv, k, r) for w, kv, k in itertools.product((32, 16), (True, False), (64, 128))
         for r in (1, 2, 4, 8) if box_fits(w, 64, k, kv, r)]


def _swizzled(row: int, col: int, esize: int, rows: int) -> int:
    # Byte offset of (row, col) in a box of `rows` rows: 128-byte swizzle atoms (8 rows of 128 bytes, the
    # 16-byte units of a row moved by the row's index mod 8), the atoms of a row's next 128 bytes after all
    # the rows of the first (a multiple of 1024 bytes away either way, which moves no bank).
    per = 128 // esize
    byte = (col % per) * esize
    return (col // per) * rows * 128 + row * 128 + (byte ^ ((row % 8) << 4))


@pytest.mark.parametrize("width,kv,k,rounds", CASES)
def test_box_byte_is_the_swizzled_layout(width, kv, k, rounds):
    rows, cols = staging_box(64, k, kv, rounds)
    seen = set()
    for r in range(rows):
        for c in range(cols):
            b = box_byte(r, c, width, rows)
            assert b == _swizzled(r, c, width // 8, rows)
            seen.add(b)
    assert len(seen) == rows * cols and max(seen) < staging_bytes(width, 64, k, kv, rounds)


@pytest.mark.parametrize("width,kv,k,rounds", CASES)
def test_every_store_is_the_base_moved_by_a_constant(width, kv, k, rounds):
    # `state_copy._store_offsets` checks its decomposition for every thread of the warpgroup (an assert at
    # trace time); here over the accumulator coordinates of the wgmma fragment (lane 4 g + q: rows g, g + 8,
    # key pairs 2 q + 8 j), for every round.
    from kdagen.kernels.state_copy import _store_offsets
    coords = [(8 * h, 8 * j + e) for j in range(k // 8) for h in (0, 1) for e in (0, 1)]
    n = 0
    for rnd in range(rounds):
        n += len(_store_offsets(64, k, kv, rounds, rnd, width, coords))
    assert n == len(coords)


def _warp_stores(width: int, kv: bool, k: int, rounds: int, rnd: int, bv: int = 64):
    """The byte addresses, by lane, of each store instruction of warp 0 in round `rnd`, as
    `stage_state_round` issues them: lane 4g + q holds value rows g and g + 8 and keys 2q + 8j (+1), one
    element a store."""
    esize = width // 8
    seg = k // rounds
    rows, _ = staging_box(bv, k, kv, rounds)
    stores = []
    for row_off in (0, 8):
        for j in range(k // 8):
            if (8 * j) // seg != rnd:
                continue
            for pair_off in (0, 1):
                addrs = []
                for lane in range(32):
                    g, q = divmod(lane, 4)
                    v, key = g + row_off, 2 * q + 8 * j + pair_off - rnd * seg
                    addrs.append(_swizzled(key, v, esize, rows) if kv else _swizzled(v, key, esize, rows))
                stores.append(addrs)
    return stores


def _wavefronts(addrs: list[int], size: int) -> int:
    # Within a warp's access, distinct 4-byte words in the same bank take one wavefront each.
    banks: dict[int, set[int]] = {}
    for a in addrs:
        word = a // 4
        banks.setdefault(word % 32, set()).add(word)
    return max(len(words) for words in banks.values())


@pytest.mark.parametrize("width,kv,k,rounds", CASES)
def test_stores_are_conflict_free(width, kv, k, rounds):
    # but fp32 V-first, whose key pairs of rows g and g ^ 1 meet in one bank (two wavefronts a store)
    bound = 2 if width == 32 and not kv else 1
    for rnd in range(rounds):
        stores = _warp_stores(width, kv, k, rounds, rnd)
        assert stores, "a round without stores"
        for addrs in stores:
            assert _wavefronts(addrs, width // 8) <= bound, addrs


@pytest.mark.parametrize("width,kv,k,rounds", CASES)
def test_a_round_fills_its_box(width, kv, k, rounds):
    bv, esize = 64, width // 8
    rows, cols = staging_box(bv, k, kv, rounds)
    assert rows % 8 == 0 and cols * esize % 128 == 0
    assert staging_bytes(width, bv, k, kv, rounds) == rows * cols * esize
    assert staging_bytes(width, bv, k, kv, rounds) % 1024 == 0
    # every element a round stores lands inside the buffer
    for rnd in range(rounds):
        seen = {a for addrs in _warp_stores(width, kv, k, rounds, rnd) for a in addrs}
        assert max(seen) + esize <= staging_bytes(width, bv, k, kv, rounds)


def test_rounds_are_the_fewest_that_fit():
    one = staging_bytes(32, 64, 128, True)
    assert staging_rounds(one, 1, 32, 64, 128, True) == 1
    assert staging_rounds(one - 1, 1, 32, 64, 128, True) == 2
    assert staging_rounds(2 * one, 2, 32, 64, 128, True) == 1
    assert staging_rounds(0, 1, 32, 64, 128, True) == 0
    # a V-first round keeps rows of 128 bytes at least: fp32 K = 128 stops at four
    assert staging_rounds(staging_bytes(32, 64, 128, False, 4), 1, 32, 64, 128, False) == 4
    assert staging_rounds(staging_bytes(32, 64, 128, False, 4) - 1, 1, 32, 64, 128, False) == 0


@pytest.mark.parametrize("name", ["k128", "k128-vk", "k128-sbf16", "k128-gbf16", "k64"])
def test_planned_staging_fits(name):
    spec = load_spec_file("specs/sm90.yaml")[name]
    stages = {s.name: s.params for s in plan.make_plan(spec).stages}
    limit = spec.arch_info.smem_bytes_per_block
    kinds = {"pool_rounds": 8 * plan.nbytes(spec.state_dtype), "tiles_rounds": 8 * plan.nbytes(spec.dtype)}
    kv, k, bv = spec.state_layout == "kv", spec.head_dim_k, min(64, spec.head_dim_v)
    checked = 0
    for fused in ("fused", "fused_pair"):
        p = stages.get(fused)
        # (width, rounds) of each staged kind: a bf16 pool and bf16 tile states are two kinds of one width
        staged = [(w, p[name]) for name, w in kinds.items() if p is not None and p[name]]
        if not staged:
            continue
        assert all(1 <= r <= plan.STAGING_MAX_ROUNDS for _, r in staged)
        used = plan._fused_smem_bytes(spec, p["stages"], p["prep_warps"])
        wgs = 1 if p["pair"] else spec.head_dim_v // 64
        # (1024 bytes for the buffer's alignment)
        assert used + 1024 + wgs * buffer_bytes(staged, bv, k, kv) <= limit
        checked += 1
    assert checked, "no fused kernel of this variant stages its stores"


def test_an_fp32_pool_beside_the_ring_takes_four_rounds():
    spec = load_spec_file("specs/sm90.yaml")["k128"]
    fused = next(s.params for s in plan.make_plan(spec).stages if s.name == "fused")
    assert fused["pool_rounds"] == 4 and fused["tiles_rounds"] == 2


@pytest.mark.parametrize("name", ["k128", "k128-vk", "k128-sbf16", "k128-gbf16", "k64"])
def test_the_recurrence_stages_within_what_prepare_leaves_it(name):
    # The wgmma recurrence runs beside prepare's CTAs: with its staging buffer (the pool's stores only) it
    # still fits the SM beside them (each CTA with the 1 KB reserve), and within one block's limit.
    spec = load_spec_file("specs/sm90.yaml")[name]
    stages = {s.name: s.params for s in plan.make_plan(spec).stages}
    rec, prep = stages["recurrence"], stages["prepare"]
    assert rec["pool_rounds"], "the recurrence stages no stores"
    assert "tiles_rounds" not in rec, "tile states are stored from the accumulators"
    assert 1 <= rec["pool_rounds"] <= plan.STAGING_MAX_ROUNDS
    kv, k, bv = spec.state_layout == "kv", spec.head_dim_k, min(64, spec.head_dim_v)
    buffer = staging_bytes(8 * plan.nbytes(spec.state_dtype), bv, k, kv, rec["pool_rounds"])
    used = plan._recurrence_smem_bytes(spec, rec["stages"]) + 1024 + buffer
    prepare = prep["overlap_ctas_per_sm"] * (prep["heads_per_cta"] * plan._prepare_warp_smem(spec) + 1024)
    assert used + 1024 + prepare <= spec.arch_info.smem_bytes_per_sm
    assert used <= spec.arch_info.smem_bytes_per_block


def test_the_portable_recurrence_stages_nothing():
    spec = load_spec_file("specs/sm90.yaml")["k128-mma_sync-kv"]
    rec = next(s.params for s in plan.make_plan(spec).stages if s.name == "recurrence")
    assert "pool_rounds" not in rec and "tiles_rounds" not in rec
