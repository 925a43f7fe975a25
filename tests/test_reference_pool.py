"""CPU tests of the pool forms of the fp64 oracle (kdagen.reference.kda_pool_prefill_reference and
kda_pool_decode_reference): each must equal the plain token recurrence on the same tokens, read and write
exactly the slots the runtime's contract names (padding, fresh sequences, untouched slots), place prefix-cache
checkpoints at absolute positions, and follow FLA's verify semantics.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kdagen.reference import (
    kda_pool_decode_reference,
    kda_pool_prefill_reference,
    kda_recurrent_reference,
    make_inputs,
)

K = V = 16
H, HV = 1, 2
OPTS: dict[str, Any] = {"gate": "lower_bound", "lower_bound": -5.0, "l2norm_qk": True}
EXACT = 1e-12  # the pool forms run the same fp64 recurrence; only the fp64 pool's round trip differs


def _inputs(T: int, seed: int = 0, B: int = 1, cu: list[int] | None = None) -> dict[str, Any]:
    x = make_inputs(B, T, H, HV, K, V, dtype="fp32", beta_dtype="fp32", g_dtype="fp32", gate="lower_bound",
                    safe_gate=True, lower_bound=-5.0, seed=seed, device="cpu", cu_seqlens=cu)
    return {name: x[name] for name in ("q", "k", "v", "g", "beta", "A_log", "dt_bias")}


def _pool(slots: int, layout: str = "kv", seed: int = 1) -> torch.Tensor:
    shape = (slots, HV, K, V) if layout == "kv" else (slots, HV, V, K)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _ref(x: dict[str, Any], lo: int, hi: int, h0: torch.Tensor | None, layout: str = "kv",
         b: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain recurrence over tokens lo..hi of batch row b: (o [hi-lo, HV, V], final state)."""
    piece = {n: (t[b:b + 1, lo:hi] if n in ("q", "k", "v", "g", "beta") else t) for n, t in x.items()}
    o, ht = kda_recurrent_reference(**piece, initial_state=None if h0 is None else h0[None],
                                    output_final_state=True, state_layout=layout, **OPTS)
    return o[0], ht[0]


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and (a.numel() == 0 or bool((a.double() - b.double()).abs().max() <= EXACT))


@pytest.mark.parametrize("layout", ["kv", "vk"])
def test_prefill_slots_padding_fresh(layout: str) -> None:
    cu = [0, 5, 12, 12, 20]
    x = _inputs(20, cu=cu)
    pool = _pool(8, layout)
    pool[6] = float("nan")  # a fresh sequence's slot may hold anything
    before = pool.clone()
    idx = torch.tensor([3, -1, 2, 6])  # sequence 1 is padding; sequence 2 is empty
    fresh = torch.tensor([True, True, True, False])
    o = kda_pool_prefill_reference(**x, state_pool=pool, state_indices=idx, cu_seqlens=cu,
                                   has_initial_state=fresh, state_layout=layout, **OPTS)
    o0, h0 = _ref(x, 0, 5, before[3], layout)
    o3, h3 = _ref(x, 12, 20, None, layout)
    assert _close(o[0, 0:5], o0) and _close(pool[3], h0)
    assert torch.count_nonzero(o[0, 5:12]) == 0, "a padding sequence's o is not zero"
    assert torch.equal(pool[2], before[2]), "an empty sequence changed its slot"
    assert _close(o[0, 12:20], o3) and _close(pool[6], h3)
    for s in (0, 1, 4, 5, 7):
        assert torch.equal(pool[s], before[s]), f"slot {s}, named by no sequence, was written"


def test_prefill_fixed_batch_rows() -> None:
    x = _inputs(9, B=2)
    pool = _pool(4)
    before = pool.clone()
    o = kda_pool_prefill_reference(**x, state_pool=pool, state_indices=[1, 0], **OPTS)
    for b, slot in enumerate((1, 0)):
        ob, hb = _ref(x, 0, 9, before[slot], b=b)
        assert _close(o[b], ob) and _close(pool[slot], hb)


def test_prefill_checkpoints_at_absolute_positions() -> None:
    """A request of 100 tokens prefilled in pieces of 48, 48 and 4 with C = 32: the checkpoints are the
    states after 32, 64 and 96 tokens, wherever the pieces start."""
    x = _inputs(100)
    C = 32
    pool = _pool(10)
    pool[:] = float("nan")
    pieces = [(0, 48, [1, 2]), (48, 96, [3, 4]), (96, 100, [5])]
    for lo, hi, ck in pieces:
        kda_pool_prefill_reference(
            **{n: (t[:, lo:hi] if n in ("q", "k", "v", "g", "beta") else t) for n, t in x.items()},
            state_pool=pool, state_indices=[0], has_initial_state=[lo > 0], checkpoint_interval=C,
            start_positions=[lo], checkpoint_indices=[ck], **OPTS)
    _, final = _ref(x, 0, 100, None)
    assert _close(pool[0], final)
    for slot, p in ((1, 32), (3, 64), (4, 96)):
        assert _close(pool[slot], _ref(x, 0, p, None)[1]), f"checkpoint at {p} (slot {slot})"
    # Slot 2 (a second checkpoint in the first piece) and slot 5 (none in the last) are never written.
    assert torch.isnan(pool[2]).all() and torch.isnan(pool[5]).all()


def test_prefill_checkpoint_skips_and_grid() -> None:
    x = _inputs(64)
    C = 16
    base = _pool(8)
    # Negative slots and m past the row's end skip: positions 16, 32, 48, 64 to [-1, 2] -> only 32.
    pool = base.clone()
    kda_pool_prefill_reference(**x, state_pool=pool, state_indices=[0], checkpoint_interval=C,
                               checkpoint_indices=[[-1, 2]], **OPTS)
    assert _close(pool[2], _ref(x, 0, 32, base[0])[1])
    assert all(torch.equal(pool[s], base[s]) for s in (1, 3, 4, 5, 6, 7))
    # A checkpoint at the piece's last token, and none at its start (start < p).
    pool = base.clone()
    kda_pool_prefill_reference(**{n: (t[:, :16] if t is not None and t.dim() > 2 else t)
                                  for n, t in x.items()},
                               state_pool=pool, state_indices=[0], checkpoint_interval=C,
                               start_positions=[32], checkpoint_indices=[[3, 4]], **OPTS)
    assert _close(pool[3], pool[0]) and torch.equal(pool[4], base[4])
    # A start off the 16-token grid writes no checkpoints.
    pool = base.clone()
    kda_pool_prefill_reference(**x, state_pool=pool, state_indices=[0], checkpoint_interval=C,
                               start_positions=[8], checkpoint_indices=[[3, 4, 5, 6]], **OPTS)
    assert all(torch.equal(pool[s], base[s]) for s in (3, 4, 5, 6))
    with pytest.raises(ValueError, match="multiple of 16"):
        kda_pool_prefill_reference(**x, state_pool=base.clone(), state_indices=[0], checkpoint_interval=24,
                                   checkpoint_indices=[[3]], **OPTS)


@pytest.mark.parametrize("layout", ["kv", "vk"])
def test_decode_one_slot(layout: str) -> None:
    x = _inputs(3, B=3)
    x = {n: (t[:, :1] if t.dim() > 2 else t) for n, t in x.items()}  # [N=3, S=1]
    pool = _pool(6, layout)
    before = pool.clone()
    o = kda_pool_decode_reference(**x, state_pool=pool, state_indices=torch.tensor([4, -1, 0]),
                                  has_initial_state=[True, True, False], state_layout=layout, **OPTS)
    o0, h0 = _ref(x, 0, 1, before[4], layout, b=0)
    o2, h2 = _ref(x, 0, 1, None, layout, b=2)
    assert _close(o[0], o0) and _close(pool[4], h0)
    assert torch.count_nonzero(o[1]) == 0
    assert _close(o[2], o2) and _close(pool[0], h2)
    assert all(torch.equal(pool[s], before[s]) for s in (1, 2, 3, 5))


def test_decode_verify_rollback() -> None:
    """[N, S] slots: the state after each token goes to its column; the next call reads the accepted one."""
    S = 4
    x = _inputs(2 * S, B=2)
    first = {n: (t[:, :S] if t.dim() > 2 else t) for n, t in x.items()}
    second = {n: (t[:, S:] if t.dim() > 2 else t) for n, t in x.items()}
    pool = _pool(10)
    start = pool.clone()
    idx = torch.tensor([[0, 1, 2, 3], [5, 6, -1, 8]])  # request 1 keeps no state after its token 2
    o = kda_pool_decode_reference(**first, state_pool=pool, state_indices=idx, **OPTS)
    for n in range(2):
        h = start[idx[n, 0]]
        for t in range(S):
            ot, h = _ref(first, t, t + 1, h, b=n)
            assert _close(o[n, t], ot[0])
            if idx[n, t] >= 0:
                assert _close(pool[idx[n, t]], h), f"request {n}: state after token {t}"
    assert torch.equal(pool[7], start[7]) and torch.equal(pool[4], start[4])
    # Accept 3 tokens of request 0 and 2 of request 1: the next step continues from idx[n, a - 1].
    mid = pool.clone()
    o2 = kda_pool_decode_reference(**second, state_pool=pool, state_indices=idx,
                                   num_accepted_tokens=torch.tensor([3, 2]), update_state=False, **OPTS)
    assert torch.equal(pool, mid), "update_state=False wrote a state"
    for n, a in ((0, 3), (1, 2)):
        ref_o, _ = _ref(second, 0, S, mid[idx[n, a - 1]], b=n)
        assert _close(o2[n], ref_o)
    # Reading a padding column makes the request padding; accepted counts are clamped into [1, M].
    o3 = kda_pool_decode_reference(**second, state_pool=pool, state_indices=idx,
                                   num_accepted_tokens=[9, 3], **OPTS)
    assert _close(o3[0], _ref(second, 0, S, mid[3], b=0)[0])
    assert torch.count_nonzero(o3[1]) == 0 and torch.equal(pool[5], mid[5])


def test_decode_packed() -> None:
    cu = [0, 2, 2, 5]
    x = _inputs(5, cu=cu)
    pool = _pool(4)
    before = pool.clone()
    o = kda_pool_decode_reference(**x, state_pool=pool, state_indices=[2, 1, 0], cu_seqlens=cu, **OPTS)
    for n, (lo, hi) in enumerate(zip(cu, cu[1:])):
        slot = (2, 1, 0)[n]
        on, hn = _ref(x, lo, hi, before[slot])
        assert _close(o[0, lo:hi], on) and _close(pool[slot], hn)
