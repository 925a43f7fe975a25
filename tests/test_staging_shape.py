"""The staging buffer of the bulk-copied state stores (`kdagen.kernels.staging_shape`, laid out by
`kdagen.kernels.state_copy`): every store of a warp hits distinct banks, the copied rows are 16-byte aligned,
and the planner's rounds fit the kernels' shared memory."""

from __future__ import annotations

import itertools

import pytest

from kdagen import plan
from kdagen.kernels.staging_shape import staging_bytes, staging_pitch, staging_rounds, staging_rows
from kdagen.spec import load_spec_file

CASES = [(w, kv, k, r) for w, kv, k in itertools.product((32, 16), (True, False), (64, 128))
         for r in (1, 2, 4, 8) if k % (8 * r) == 0]


def _warp_stores(width: int, kv: bool, k: int, rounds: int, rnd: int, bv: int = 64):
    """The byte addresses, by lane, of each store instruction of warp 0 in round `rnd`, as
    `stage_state_round` issues them: lane 4g + q holds rows g and g + 8 and keys 2q + 8j (+1); K-first stores
    each element, V-first a key pair at once."""
    esize = width // 8
    pitch = staging_pitch(width, bv, k, kv, rounds)
    seg = k // rounds
    stores = []
    for row_off in (0, 8):
        for j in range(k // 8):
            if (8 * j) // seg != rnd:
                continue
            for pair_off in ((0, 1) if kv else (0,)):
                addrs = []
                for lane in range(32):
                    g, q = divmod(lane, 4)
                    v, key = g + row_off, 2 * q + 8 * j + pair_off
                    elem = (key - rnd * seg) * pitch + v if kv else v * pitch + key - rnd * seg
                    addrs.append(elem * esize)
                stores.append((addrs, esize if kv else 2 * esize))
    return stores


def _wavefronts(addrs: list[int], size: int) -> int:
    # Shared memory serves 128 bytes a wavefront: an access of 8 bytes a lane takes two (half-warps), and
    # within one, distinct 4-byte words in the same bank take one wavefront each.
    groups = [addrs[:16], addrs[16:]] if size == 8 else [addrs]
    total = 0
    for grp in groups:
        banks: dict[int, set[int]] = {}
        for a in grp:
            for w in range(max(1, size // 4)):
                word = a // 4 + w
                banks.setdefault(word % 32, set()).add(word)
        total += max(len(words) for words in banks.values())
    return total


@pytest.mark.parametrize("width,kv,k,rounds", CASES)
def test_stores_are_conflict_free(width, kv, k, rounds):
    for rnd in range(rounds):
        stores = _warp_stores(width, kv, k, rounds, rnd)
        assert stores, "a round without stores"
        for addrs, size in stores:
            assert _wavefronts(addrs, size) == (2 if size == 8 else 1), (addrs, size)


@pytest.mark.parametrize("width,kv,k,rounds", CASES)
def test_rows_fit_and_align(width, kv, k, rounds):
    bv, esize = 64, width // 8
    pitch = staging_pitch(width, bv, k, kv, rounds)
    row_bytes = (bv if kv else k // rounds) * esize
    assert pitch * esize % 16 == 0 and row_bytes % 16 == 0 and pitch * esize >= row_bytes
    assert staging_bytes(width, bv, k, kv, rounds) == staging_rows(bv, k, kv, rounds) * pitch * esize
    # the stores of a round land inside the buffer
    for rnd in range(rounds):
        for addrs, size in _warp_stores(width, kv, k, rounds, rnd):
            assert max(addrs) + size <= staging_bytes(width, bv, k, kv, rounds)


def test_rounds_are_the_fewest_that_fit():
    one = staging_bytes(32, 64, 128, True)
    assert staging_rounds(one, 1, 32, 64, 128, True) == 1
    assert staging_rounds(one - 1, 1, 32, 64, 128, True) == 2
    assert staging_rounds(2 * one, 2, 32, 64, 128, True) == 1
    assert staging_rounds(0, 1, 32, 64, 128, True) == 0


@pytest.mark.parametrize("name", ["k128", "k128-vk", "k128-sbf16", "k128-gbf16", "k64"])
def test_planned_staging_fits(name):
    spec = load_spec_file("specs/sm90.yaml")[name]
    stages = {s.name: s.params for s in plan.make_plan(spec).stages}
    limit = spec.arch_info.smem_bytes_per_block
    kinds = {"staged_pool": 8 * plan.nbytes(spec.state_dtype), "staged_tiles": 8 * plan.nbytes(spec.dtype)}
    kv, k, bv = spec.state_layout == "kv", spec.head_dim_k, min(64, spec.head_dim_v)
    checked = 0
    for fused in ("fused", "fused_pair"):
        p = stages.get(fused)
        if p is None or not p["staging_rounds"]:
            continue
        rounds = p["staging_rounds"]
        assert 1 <= rounds <= plan.STAGING_MAX_ROUNDS
        staged = [w for name, w in kinds.items() if p[name]]
        assert staged, "a buffer no store takes"
        used = plan._fused_smem_bytes(spec, p["stages"], p["prep_warps"])
        wgs = 1 if p["pair"] else spec.head_dim_v // 64
        assert used + wgs * max(staging_bytes(w, bv, k, kv, rounds) for w in staged) <= limit
        checked += 1
    assert checked, "no fused kernel of this variant stages its stores"


def test_fp32_pool_stores_stay_direct_where_they_would_take_four_rounds():
    spec = load_spec_file("specs/sm90.yaml")["k128"]
    fused = next(s.params for s in plan.make_plan(spec).stages if s.name == "fused")
    assert fused["staged_tiles"] and not fused["staged_pool"] and fused["staging_rounds"] == 2
