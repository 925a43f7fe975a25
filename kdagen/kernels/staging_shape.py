"""The staging buffer of the bulk-copied state stores (`kdagen.kernels.state_copy`): a plain module, so that
the planner sizes a kernel's buffer (its rounds) from the same formulas the device code lays it out by.

A round of a (bv value rows, K keys) tile of S^T is a box of the slot's rows: K-first, K / rounds key rows
of bv values; V-first, bv value rows of K / rounds keys. The buffer holds the box as the slot does (its
contiguous dimension innermost) without padding, under the 128-byte swizzle that one tensor copy (TMA)
undoes on its way out: rows of at least 128 bytes, in groups of eight.
"""

from __future__ import annotations

__all__ = ["MAX_ROUNDS", "staging_box", "box_fits", "box_byte", "staging_bytes", "buffer_bytes",
           "staging_rounds"]

MAX_ROUNDS = 8  # a round holds whole 8-key blocks of the accumulators; K = 64 allows 8 at most
SWIZZLE_BYTES = 128  # the swizzle's row: a box's contiguous extent is a multiple of it
SWIZZLE_ROWS = 8  # rows a swizzle pattern spans


def staging_box(bv: int, k: int, kv_layout: bool, rounds: int = 1) -> tuple[int, int]:
    """(rows, contiguous elements a row) of one round's box in the slot."""
    return (k // rounds, bv) if kv_layout else (bv, k // rounds)


def box_byte(row: int, col: int, width: int, rows: int) -> int:
    """Byte offset of element (row, col) of a box of `rows` rows of `width`-bit elements: 128-byte swizzle
    atoms (8 rows of 128 bytes; a row's 16-byte units XORed with the row's index mod 8), a row's next 128
    bytes in the next atom column, after all the rows of the one before (the layout of a wgmma B operand and
    of TMA's 128-byte swizzle; works on plain ints and on the DSL's)."""
    esize = width // 8
    per = 128 // esize
    return (col // per) * rows * 128 + row * 128 + (((col % per) * esize) ^ ((row % 8) << 4))


def box_fits(width: int, bv: int, k: int, kv_layout: bool, rounds: int) -> bool:
    """Whether a round is whole 8-key blocks, its rows whole swizzle patterns and its row whole swizzle
    rows."""
    rows, cols = staging_box(bv, k, kv_layout, rounds)
    return (k % (8 * rounds) == 0 and rows % SWIZZLE_ROWS == 0
            and cols * width // 8 % SWIZZLE_BYTES == 0)


def staging_bytes(width: int, bv: int, k: int, kv_layout: bool, rounds: int = 1) -> int:
    """The staging buffer's size in bytes for one round of a (bv, K) tile of `width`-bit elements (a multiple
    of 1024, the swizzle's alignment)."""
    assert box_fits(width, bv, k, kv_layout, rounds), "a round's box is not whole swizzle rows"
    return bv * k * width // 8 // rounds


def buffer_bytes(kinds, bv: int, k: int, kv_layout: bool) -> int:
    """The staging buffer of a kernel whose kinds of store, (width, rounds) each (0 rounds: not staged), share
    it: the largest of their boxes."""
    return max(staging_bytes(width, bv, k, kv_layout, rounds) for width, rounds in kinds if rounds)


def staging_rounds(free_bytes: int, buffers: int, width: int, bv: int, k: int, kv_layout: bool) -> int:
    """The fewest rounds (a power of two) in which `buffers` staging buffers of `width`-bit elements fit
    `free_bytes`; 0 where none fits (the kernel then stores from its accumulators)."""
    rounds = 1
    while rounds <= MAX_ROUNDS and box_fits(width, bv, k, kv_layout, rounds):
        if buffers * staging_bytes(width, bv, k, kv_layout, rounds) <= free_bytes:
            return rounds
        rounds *= 2
    return 0
