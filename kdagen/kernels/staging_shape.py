"""The staging buffer of the bulk-copied state stores (`kdagen.kernels.state_copy`): a plain module, so that
the planner sizes a kernel's buffer (its rounds) from the same formulas the device code lays it out by."""

from __future__ import annotations

__all__ = ["MAX_ROUNDS", "staging_pitch", "staging_rows", "staging_bytes", "staging_rounds"]

MAX_ROUNDS = 8  # a round holds whole 8-key blocks of the accumulators; K = 64 allows 8 at most


def staging_pitch(width: int, bv: int, k: int, kv_layout: bool, rounds: int = 1) -> int:
    """The staging buffer's row pitch in elements of `width` bits: a slot row of the round plus the fewest
    16-byte units that put a warp's accumulator stores in distinct banks (`_conflict_free`)."""
    esize = width // 8
    row = (bv if kv_layout else k // rounds) * esize
    pad = 16
    while not _conflict_free((row + pad) // 4, esize, kv_layout):
        pad += 16
    return (row + pad) // esize


def _conflict_free(pitch_words: int, esize: int, kv_layout: bool) -> bool:
    # One store instruction of a warp (every other is this one moved by a constant): lane 4g + q holds row g
    # and keys 2q, 2q + 1. K-first rows are keys: each element alone; V-first rows are values: the key pair at
    # once (8 bytes for fp32, served a half-warp at a time). Distinct banks, or the same 4-byte word.
    halves = [range(16), range(16, 32)] if not kv_layout and esize == 4 else [range(32)]
    for lanes in halves:
        banks: dict[int, set[int]] = {}
        for lane in lanes:
            g, q = divmod(lane, 4)
            byte = 2 * q * pitch_words * 4 + g * esize if kv_layout else g * pitch_words * 4 + 2 * q * esize
            for w in range(max(1, 2 * esize // 4) if not kv_layout else 1):
                word = byte // 4 + w
                banks.setdefault(word % 32, set()).add(word)
        if any(len(words) > 1 for words in banks.values()):
            return False
    return True


def staging_rows(bv: int, k: int, kv_layout: bool, rounds: int = 1) -> int:
    """The staged rows of a round: its keys with K-first (each a key's bv values), every value row else."""
    return k // rounds if kv_layout else bv


def staging_bytes(width: int, bv: int, k: int, kv_layout: bool, rounds: int = 1) -> int:
    """The staging buffer's size in bytes for one round of a (bv, K) tile of `width`-bit elements."""
    assert k % (8 * rounds) == 0, "a round holds whole 8-key blocks"
    pitch = staging_pitch(width, bv, k, kv_layout, rounds)
    return staging_rows(bv, k, kv_layout, rounds) * pitch * width // 8


def staging_rounds(free_bytes: int, buffers: int, width: int, bv: int, k: int, kv_layout: bool) -> int:
    """The fewest rounds (a power of two) in which `buffers` staging buffers of `width`-bit elements fit
    `free_bytes`; 0 where none fits (the kernel then stores from its accumulators)."""
    rounds = 1
    while rounds <= MAX_ROUNDS and k % (8 * rounds) == 0:
        if buffers * staging_bytes(width, bv, k, kv_layout, rounds) <= free_bytes:
            return rounds
        rounds *= 2
    return 0
