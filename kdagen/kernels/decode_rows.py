"""The streaming decode's token ring row, in words (fp32): a plain module, so that the planner sizes the
stage's shared memory from the same formula the device code lays the row out by (`decode_ring.DecodeConfig`).
"""

from __future__ import annotations

__all__ = ["key_vector_words", "row_words"]


def key_vector_words(k: int) -> int:
    """Words of one key vector in a row (q, k or the decays): K and 4 words of padding, which put the second
    half of each vector in other banks than the first (a column's two threads read the halves at once)."""
    return k + 4


def row_words(k: int, v: int) -> int:
    """A token's row: q, k and the decays (a key vector each), v, and beta padded to 16 bytes."""
    return 3 * key_vector_words(k) + v + 4
