"""The workspace layout (CPU only): every buffer 16-byte aligned, in bounds, and apart from the others."""

from __future__ import annotations

import pytest

from kdagen import plan, workspace


@pytest.mark.parametrize(
    ("total", "heads", "seqs", "k", "elem"),
    [(1, 1, 1, 64, 2), (63, 3, 2, 64, 2), (512, 64, 1, 128, 2), (1000, 6, 7, 128, 2), (32768, 64, 2, 128, 2),
     (17, 5, 17, 64, 4)],
)
def test_buffers_are_aligned_disjoint_and_in_bounds(total: int, heads: int, seqs: int, k: int, elem: int):
    ws = workspace.layout(total, heads, seqs, k, elem)
    slots = total // plan.CHUNK + seqs + 1
    assert ws.tile_slots == slots
    sizes = {  # bytes each buffer needs, in layout order
        "kd": total * heads * k * elem,
        "qd": total * heads * k * elem,
        "akt": total * heads * k * elem,
        "aq": total * heads * plan.CHUNK * elem,
        "gt": slots * heads * k * 4,
        "ready": slots * heads * 4,
        "order": (seqs + 2) * 4,  # the ranking, the mode word, the fused kernel's chain counter
        "cu": (seqs + 1) * 4,  # cu_seqlens clamped into [0, T], for prepare
    }
    starts = {"kd": 0, **{name: getattr(ws, name) for name in sizes if name != "kd"}}
    spans = sorted((starts[n], starts[n] + sizes[n], n) for n in sizes)
    for (_, end, name), (start, _, nxt) in zip(spans, spans[1:]):
        assert end <= start, f"{name} overlaps {nxt}"
    assert spans[-1][1] <= ws.size
    assert all(off % 16 == 0 for off in starts.values()) and ws.size % workspace.ROW == 0
