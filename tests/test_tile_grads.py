"""`kdagen.tile_grads`: a tile's gradients from the products the `bwd_tile` stage computes (its formulas,
emulated here in fp64 from the states) equal `chunk_stage_backward`'s, over full and partial tiles, both
decay forms, hard resets (pairwise form), and through the slab driver with the kernels' tile map."""

from __future__ import annotations

import pytest
import torch

from kdagen.backward_local import chunk_local_backward, tile_map
from kdagen.chunk_math import chunk_parts, chunk_stage_backward
from kdagen.tile_grads import grads_from_products, tile_grads

F64 = torch.float64


def _products(q, k, v, g, beta, S, do, dS, anchored):
    """What `bwd_tile` computes for a batch of tiles: (dv, dqd, dkd, dakt, daq, dgt), from the folded step."""
    c = chunk_parts(q, k, v, g, beta, S, anchored=anchored)
    P, Aqk, kg, KE = c["A"], c["Aqk"], c["kg"], c["KE"]
    aq, akt = Aqk @ P, P.transpose(1, 2) @ kg
    R = v - KE @ S
    dR = aq.transpose(1, 2) @ do + akt @ dS
    St, dSt = S.transpose(1, 2), dS.transpose(1, 2)
    return dR, do @ St, -dR @ St, R @ dSt, do @ R.transpose(1, 2), (S * dS).sum(dim=2)


def _batch(bt: int, n: int, K: int, V: int, *, seed: int, safe: bool):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(bt, n, K, generator=gen, dtype=F64) * K ** -0.5
    k = torch.nn.functional.normalize(torch.randn(bt, n, K, generator=gen, dtype=F64), dim=-1)
    v = torch.randn(bt, n, V, generator=gen, dtype=F64)
    if safe:
        g = -5.0 * torch.rand(bt, n, K, generator=gen, dtype=F64)
    else:
        g = torch.nn.functional.logsigmoid(torch.randn(bt, n, K, generator=gen, dtype=F64))
        g[:, n // 3] = -1000.0  # a hard reset inside the tile
    beta = torch.rand(bt, n, generator=gen, dtype=F64)
    S = torch.randn(bt, K, V, generator=gen, dtype=F64)
    do = torch.randn(bt, n, V, generator=gen, dtype=F64)
    dS = torch.randn(bt, K, V, generator=gen, dtype=F64)
    return q, k, v, g, beta, S, do, dS


@pytest.mark.parametrize("anchored", [False, True])
@pytest.mark.parametrize("n", [16, 11, 1])
def test_grads_from_products_equal_the_stage_formulas(anchored: bool, n: int) -> None:
    q, k, v, g, beta, S, do, dS = _batch(6, n, 32, 24, seed=n, safe=anchored)
    want = chunk_stage_backward(q, k, v, g, beta, S, do, dS, anchored=anchored)
    dv, dqd, dkd, dakt, daq, dgt = _products(q, k, v, g, beta, S, do, dS, anchored)
    got = grads_from_products(q, k, g, beta, dqd, dkd, dakt, daq, dgt, anchored=anchored)
    assert torch.allclose(dv, want["dv"], rtol=1e-10, atol=1e-10)
    for name in ("dq", "dk", "dg", "dbeta"):
        assert torch.allclose(got[name], want[name], rtol=1e-9, atol=1e-10), name


def test_a_wrong_product_changes_the_result() -> None:
    q, k, v, g, beta, S, do, dS = _batch(4, 16, 16, 16, seed=3, safe=True)
    g = g * 0.02  # weak decays: the state's term exp(G_last) dgt matters
    dv, dqd, dkd, dakt, daq, dgt = _products(q, k, v, g, beta, S, do, dS, True)
    ok = grads_from_products(q, k, g, beta, dqd, dkd, dakt, daq, dgt, anchored=True)
    bad = grads_from_products(q, k, g, beta, dqd, dkd, dakt, daq, dgt * 0, anchored=True)
    assert not torch.allclose(ok["dg"], bad["dg"])
    bad = grads_from_products(q, k, g, beta, dqd, dkd, dakt.flip(1), daq, dgt, anchored=True)
    assert not torch.allclose(ok["dbeta"], bad["dbeta"])


@pytest.mark.parametrize("anchored", [False, True])
def test_tile_grads_match_the_chunk_local_backward(anchored: bool) -> None:
    # Token-major inputs of a varlen call (an empty sequence, partial tiles), the tile map, and per-tile
    # states; the products per tile from `_products`, scattered like the kernel writes them.
    cu = torch.tensor([0, 5, 21, 21, 54, 55], dtype=torch.int32)
    total, hv, K, V = 55, 2, 16, 8
    tm = tile_map(cu, total)
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(total, hv, K, generator=gen, dtype=F64) * 0.3
    k = torch.nn.functional.normalize(torch.randn(total, hv, K, generator=gen, dtype=F64), dim=-1)
    v = torch.randn(total, hv, V, generator=gen, dtype=F64)
    g = -5.0 * torch.rand(total, hv, K, generator=gen, dtype=F64)
    beta = torch.rand(total, hv, generator=gen, dtype=F64)
    do = torch.randn(total, hv, V, generator=gen, dtype=F64)
    h = torch.randn(tm.slots, hv, K, V, generator=gen, dtype=F64)
    dh = torch.randn(tm.slots, hv, K, V, generator=gen, dtype=F64)
    want = chunk_local_backward(q, k, v, g, beta, do, h, dh, tm, anchored=anchored)

    prods = {n: torch.zeros(total, hv, d, dtype=F64)
             for n, d in (("dqd", K), ("dkd", K), ("dakt", K), ("daq", 16))}
    dgt = torch.zeros(tm.slots, hv, K, dtype=F64)
    for t in range(tm.slots):
        toks = [i for i in range(total) if int(tm.tile[i]) == t]
        if not toks:
            continue
        sl = torch.tensor(toks)
        n = len(toks)
        tiles = [x[sl].transpose(0, 1) for x in (q, k, v, g, beta, do)]  # [hv, n, *]
        _, dqd, dkd, dakt, daq, dg_t = _products(*tiles[:5], h[t], tiles[5], dh[t], anchored)
        for name, x in (("dqd", dqd), ("dkd", dkd), ("dakt", dakt)):
            prods[name][sl] = x.transpose(0, 1)
        prods["daq"][sl, :, :n] = daq.transpose(0, 1)
        dgt[t] = dg_t
    got = tile_grads(q, k, g, beta, prods["dqd"], prods["dkd"], prods["dakt"], prods["daq"], dgt, tm,
                     anchored=anchored, max_batch=3)
    for name in ("dq", "dk", "dg", "dbeta"):
        assert torch.allclose(got[name], want[name], rtol=1e-9, atol=1e-10), name
