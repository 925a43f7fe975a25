"""The chunk-local backward in torch (`kdagen.backward_local`) against the stagewise fp64 oracle
(`kda_chunked_backward_stages`, chunk size 16): given each tile's entering state and the gradient of its
leaving state, the batched tiles give the oracle's dq, dk, dv, dg and dbeta of the prepared inputs, over
fixed-length and varlen batches (an empty sequence, partial tiles), GVA, hard resets, gate and beta forms,
initial and final states, strided states and any slab size. The anchored form (no pairwise [.., 16, 16, K]
tensors) equals the pairwise one under the safe gate (g >= -5), tiles at g = -5 throughout included. The
chunk-local path skips the entering state's gradient and builds no [batch, K, V] temporary but the copies it
needs; its products with the states in bf16 (the default on CUDA) stay within 4e-3 rel RMSE of the oracle."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kdagen.backward_local as bl
from kdagen.arch import CHUNK
from kdagen.backward_local import (
    DEFAULT_MAX_BATCH,
    DEFAULT_MAX_BATCH_ANCHORED,
    TileMap,
    chunk_local_backward,
    default_mm_dtype,
    tile_map,
    tile_slots,
)
from kdagen.chunk_math import chunk_parts, chunk_stage_backward, chunk_step
from kdagen.reference import HARD_RESET_G, _prepare, kda_chunked_backward_stages, make_inputs, rel_rmse
from kdagen.workspace import layout

Tensor = torch.Tensor
F64 = torch.float64
GRADS = ("dq", "dk", "dv", "dg", "dbeta")

# name: (B, lengths (None: fixed length T), T, H, HV, K, V, gate, beta_mode, hard-reset tokens of the flat
# token axis, state layout)
CASES: dict[str, tuple] = {
    "fixed_b2": (2, None, 37, 2, 2, 16, 16, "precomputed", "prob", (3, 20, 37 + 16), "kv"),
    "varlen_gva": (1, [0, 5, 16, 33, 1, 20], 75, 1, 2, 32, 16, "precomputed", "prob", (5, 22, 40, 74), "vk"),
    "varlen_lb_logit": (1, [17, 31, 0, 16], 64, 2, 4, 16, 32, "lower_bound", "logit_x2", (), "kv"),
}


def _cu(B: int, lengths: list[int] | None, T: int) -> list[int]:
    lens = lengths if lengths is not None else [T] * B
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return cu


def _case(name: str, seed: int = 3, safe: bool = False) -> dict[str, Any]:
    """The prepared inputs of a case (fp64, token-major [total, HV, *]), a random dO and final-state gradient,
    and the oracle's gradients. With ``safe`` the gate keeps the safe gate's promise g >= -5 instead of the
    hard resets: g = -5 rand (precomputed) or the lower-bound gate, a tenth of it masked to no decay, and
    every even tile id at g = -5 exactly for every step (the 40-nat span from a tile's middle row)."""
    B, lengths, T, H, HV, K, V, gate, beta_mode, resets, state_layout = CASES[name]
    cu = _cu(B, lengths, T)
    lb = -5.0 if gate == "lower_bound" else None
    inp = make_inputs(B, T, H, HV, K, V, dtype=F64, beta_dtype=F64, g_dtype=F64, gate=gate,
                      beta_mode=beta_mode, safe_gate=False, lower_bound=lb, seed=seed, device="cpu",
                      mask_p=0.1, hard_reset=not safe, cu_seqlens=cu if lengths is not None else None,
                      with_initial_state=True, state_layout=state_layout)
    g = inp["g"].reshape(B * T, HV, K).clone()
    if safe:
        if gate == "precomputed":
            u = torch.rand(g.shape, generator=torch.Generator().manual_seed(seed + 11), dtype=F64)
            g = torch.where(g == 0, 0.0, -5.0 * u)
        at_min = tile_map(torch.tensor(cu), B * T).tile % 2 == 0
        # The lower-bound gate is -5 * sigmoid(exp(A_log) (g + dt_bias)): -5 exactly at a raw +1000.
        g[at_min] = -5.0 if gate == "precomputed" else 1000.0
    else:
        for t in resets:  # a hard reset of every channel of the token
            g[t] = HARD_RESET_G
    inp["g"] = g.reshape(B, T, HV, K)
    kw = {"scale": 0.4, "cu_seqlens": inp["cu_seqlens"], "gate": gate, "A_log": inp["A_log"],
          "dt_bias": inp["dt_bias"], "lower_bound": lb, "l2norm_qk": True, "state_layout": state_layout,
          "beta_mode": beta_mode}
    raw = [inp[x] for x in ("q", "k", "v", "g", "beta")]
    p = _prepare(*raw, initial_state=inp["initial_state"], dtype=F64, **kw)
    gen = torch.Generator().manual_seed(seed + 7)
    do = torch.randn(B, T, HV, V, generator=gen, dtype=F64)
    N = len(cu) - 1
    dht = torch.randn((N, HV, K, V) if state_layout == "kv" else (N, HV, V, K), generator=gen, dtype=F64)
    ref = kda_chunked_backward_stages(*raw, do, dht=dht, initial_state=inp["initial_state"], chunk_size=CHUNK,
                                      **kw)
    flat = {x: getattr(p, x).reshape(B * T, *getattr(p, x).shape[2:]) for x in ("q", "k", "v", "g", "beta")}
    return {"cu": cu, "x": flat, "do": do.reshape(B * T, HV, V), "h0": p.h0,
            "dht": dht if state_layout == "kv" else dht.transpose(-1, -2), "layout": state_layout,
            "ref": {x: ref[x].reshape(B * T, *ref[x].shape[2:]) for x in GRADS}, "HV": HV, "K": K, "V": V}


def _tile_states(c: dict[str, Any], fill: float = 0.0) -> tuple[Tensor, Tensor, list[int]]:
    """h (the state entering each tile) and dh (the gradient of the state leaving it) [slots, HV, K, V], by
    plain loops over each sequence's chunks; tile ids not used hold `fill`. Also the used ids."""
    cu, x, HV, K, V = c["cu"], c["x"], c["HV"], c["K"], c["V"]
    slots = len(cu) - 1 + cu[-1] // CHUNK + 1
    h = torch.full((slots, HV, K, V), fill, dtype=F64)
    dh = torch.full((slots, HV, K, V), fill, dtype=F64)
    used = []
    names = ("q", "k", "v", "g", "beta")
    for n, (bos, eos) in enumerate(zip(cu[:-1], cu[1:])):
        starts = range(bos, eos, CHUNK)
        chunks = [(bos // CHUNK + n + j, c0, min(c0 + CHUNK, eos)) for j, c0 in enumerate(starts)]
        S = c["h0"][n]
        for tile, c0, c1 in chunks:
            h[tile] = S
            _, S = chunk_step(*(x[name][c0:c1].transpose(0, 1) for name in names), S)
        dS = c["dht"][n]
        for tile, c0, c1 in reversed(chunks):
            dh[tile] = dS
            dS = chunk_stage_backward(*(x[name][c0:c1].transpose(0, 1) for name in names), h[tile],
                                      c["do"][c0:c1].transpose(0, 1), dS)["dS"]
        used += [tile for tile, _, _ in chunks]
    return h, dh, used


def _run(c: dict[str, Any], h: Tensor, dh: Tensor, dtype: torch.dtype = F64, **kw: Any) -> dict[str, Tensor]:
    x = c["x"]
    total = x["q"].shape[0]
    tmap = tile_map(torch.tensor(c["cu"], dtype=torch.int32), total)
    if c["layout"] == "vk":  # the caller's states may be transposed views
        h = h.transpose(-1, -2).contiguous().transpose(-1, -2)
        dh = dh.transpose(-1, -2).contiguous().transpose(-1, -2)
    args = [x[name].to(dtype) for name in ("q", "k", "v", "g", "beta")]
    return chunk_local_backward(*args, c["do"].to(dtype), h.to(dtype), dh.to(dtype), tmap, **kw)


def _assert_fp64_close(ref: dict[str, Tensor], out: dict[str, Tensor], tol: float = 1e-10) -> None:
    for name in GRADS:
        assert out[name].dtype == F64 and out[name].shape == ref[name].shape, name
        err = (out[name] - ref[name]).abs().max().item()
        scale = max(1.0, ref[name].abs().max().item())
        assert err <= tol * scale, f"{name}: max abs err {err:.3e} (max |ref| {scale:.3e})"


@pytest.mark.parametrize(
    "cu",
    [[0, 37, 74], [0, 0, 5, 21, 54, 55, 75], [0, 16, 16, 16, 32], [0, 1], [0, 15, 30, 30], [0, 0], [0, 64]],
)
def test_tile_map_matches_loop(cu: list[int]) -> None:
    total = cu[-1]
    tmap = tile_map(torch.tensor(cu, dtype=torch.int32), total)
    tiles, rows = [], []
    for n, (bos, eos) in enumerate(zip(cu[:-1], cu[1:])):
        for t in range(bos, eos):
            tiles.append(bos // 16 + n + (t - bos) // 16)
            rows.append((t - bos) % 16)
    assert isinstance(tmap, TileMap)
    assert tmap.tile.dtype == torch.int64 and tmap.row.dtype == torch.int64
    assert tmap.tile.tolist() == tiles and tmap.row.tolist() == rows
    assert tmap.slots == total // 16 + len(cu) - 1 + 1
    pairs = set(zip(tiles, rows))
    assert len(pairs) == total and all(0 <= t < tmap.slots for t in tiles)  # injective, in range


def test_tile_slots_is_the_workspace_rule() -> None:
    for total, num_seqs in ((0, 1), (15, 1), (16, 1), (75, 6), (4096, 33)):
        assert tile_slots(total, num_seqs) == total // 16 + num_seqs + 1
        assert tile_slots(total, num_seqs) == layout(total, 8, num_seqs, 128, 2).tile_slots


@pytest.mark.parametrize("name", list(CASES))
def test_chunk_local_backward_fp64(name: str) -> None:
    c = _case(name)
    h, dh, _ = _tile_states(c)
    _assert_fp64_close(c["ref"], _run(c, h, dh))


@pytest.mark.parametrize("name", list(CASES))
def test_chunk_local_backward_fp32(name: str) -> None:
    c = _case(name)
    h, dh, _ = _tile_states(c)
    out = _run(c, h, dh, torch.float32)
    for grad in GRADS:
        assert out[grad].dtype == torch.float32, grad
        err = rel_rmse(c["ref"][grad], out[grad])
        assert err < 1e-4, f"{grad}: rel RMSE {err:.3e}"


@pytest.mark.parametrize("max_batch", [1, 4 * 4 + 3])
def test_slab_size_does_not_change_results(max_batch: int) -> None:
    """One tile per slab, and slabs of 4 tiles (HV = 4; 9 tile ids, so the last slab holds one), equal one
    slab and the oracle."""
    c = _case("varlen_lb_logit")
    h, dh, _ = _tile_states(c)
    one = _run(c, h, dh)
    assert len(c["cu"]) - 1 + c["cu"][-1] // CHUNK + 1 <= DEFAULT_MAX_BATCH // c["HV"]  # one slab by default
    small = _run(c, h, dh, max_batch=max_batch)
    _assert_fp64_close(one, small, 1e-13)
    _assert_fp64_close(c["ref"], small)


def test_unused_tile_ids_do_not_leak() -> None:
    """Tile ids that hold no token (an empty sequence's, the bound's spare ones) may hold NaN states."""
    c = _case("varlen_gva")
    h, dh, used = _tile_states(c, fill=float("nan"))
    assert len(used) < h.shape[0] and not torch.isnan(h[used]).any()
    out = _run(c, h, dh, max_batch=2 * c["HV"])
    for name in GRADS:
        assert torch.isfinite(out[name]).all(), name
    _assert_fp64_close(c["ref"], out)


def test_shapes_are_checked() -> None:
    c = _case("fixed_b2")
    h, dh, _ = _tile_states(c)
    with pytest.raises(ValueError, match="dh"):
        _run(c, h, dh[:-1])
    with pytest.raises(ValueError, match="max_batch"):
        _run(c, h, dh, max_batch=0)


def test_empty_call() -> None:
    tmap = tile_map(torch.tensor([0, 0]), 0)
    z = torch.zeros(0, 2, 16, dtype=F64)
    states = torch.zeros(tmap.slots, 2, 16, 16, dtype=F64)
    out = chunk_local_backward(z, z, z, z, torch.zeros(0, 2, dtype=F64), z, states, states, tmap)
    assert {name: tuple(x.shape) for name, x in out.items()} == {
        "dq": (0, 2, 16), "dk": (0, 2, 16), "dv": (0, 2, 16), "dg": (0, 2, 16), "dbeta": (0, 2)}


# ---- the anchored form (safe gate) ----

STAGE_OUTS = ("dq", "dk", "dv", "dg", "dbeta", "dS", "dAqk")


def _stage_inputs(n: int, fill: str, tiles: int = 6, H: int = 2, HV: int = 4, K: int = 32, V: int = 16,
                  seed: int = 5) -> list[Tensor]:
    """fp64 inputs of `chunk_stage_backward` for ``tiles`` GVA-shaped tiles of n rows, batch [tiles * HV]
    (q and k shared by each group of HV // H value heads, as the backward expands them; v, g, beta per value
    head): g = -5 rand with a tenth of it 0 (no decay); ``fill`` "min" sets every g to -5, "mixed" every
    other entry, so G spans 5 * 8 = 40 nats from the middle row either way."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen, dtype=F64)

    group = HV // H
    q = torch.nn.functional.normalize(rnd(tiles, H, n, K), dim=-1) * K ** -0.5
    k = torch.nn.functional.normalize(rnd(tiles, H, n, K), dim=-1)
    q, k = (x.repeat_interleave(group, dim=1).reshape(tiles * HV, n, K) for x in (q, k))
    g = -5.0 * torch.rand(tiles * HV, n, K, generator=gen, dtype=F64)
    g = torch.where(torch.rand(g.shape, generator=gen, dtype=F64) < 0.1, 0.0, g)
    if fill == "min":
        g[:] = -5.0
    elif fill == "mixed":
        g[::2] = -5.0
    beta = torch.rand(tiles * HV, n, generator=gen, dtype=F64)
    return [q, k, rnd(tiles * HV, n, V), g, beta, rnd(tiles * HV, K, V), rnd(tiles * HV, n, V),
            rnd(tiles * HV, K, V)]


@pytest.mark.parametrize("fill", ["rand", "mixed", "min"])
@pytest.mark.parametrize("n", [16, 11, 2, 1])
def test_anchored_stage_equals_pairwise_fp64(n: int, fill: str) -> None:
    """Full and partial tiles: every output of the anchored form, the decays' gradient dg included, is the
    pairwise form's to rounding."""
    x = _stage_inputs(n, fill)
    pair = chunk_stage_backward(*x)
    anch = chunk_stage_backward(*x, anchored=True)
    for name in STAGE_OUTS:
        assert anch[name].dtype == F64 and anch[name].shape == pair[name].shape, name
        err = (anch[name] - pair[name]).abs().max().item()
        scale = pair[name].abs().max().item()
        assert err <= 1e-10 * scale, f"{name}: max abs err {err:.3e} (max |ref| {scale:.3e})"


@pytest.mark.parametrize("fill", ["rand", "mixed", "min"])
@pytest.mark.parametrize("n", [16, 9])
def test_anchored_stage_fp32(n: int, fill: str) -> None:
    """In fp32 the anchored form is as close to the fp64 pairwise form as the fp32 pairwise form is: within
    1e-5 rel RMSE, or half again the pairwise form's own fp32 error where that is larger (dg of a batch of
    tiles all at g = -5, ~2e-5 in both forms: its reverse cumsum cancels the state's boundary terms)."""
    x = _stage_inputs(n, fill)
    ref = chunk_stage_backward(*x)
    x32 = [t.float() for t in x]
    pair = chunk_stage_backward(*x32)
    anch = chunk_stage_backward(*x32, anchored=True)
    for name in STAGE_OUTS:
        assert anch[name].dtype == torch.float32, name
        err, own = rel_rmse(ref[name], anch[name]), rel_rmse(ref[name], pair[name])
        assert err <= max(1e-5, 1.5 * own), f"{name}: rel RMSE {err:.3e} (pairwise fp32 {own:.3e})"


def test_anchored_builds_no_pairwise_tensor() -> None:
    """No tensor of the anchored form has the pairwise shape [.., n, n, K] (the pairwise form builds them)."""
    n, K = 16, 32
    x = _stage_inputs(n, "rand", K=K)
    shapes: list[tuple[int, ...]] = []

    class Shapes(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, Tensor):
                    shapes.append(tuple(t.shape))
            return out

    def pairwise(shape: tuple[int, ...]) -> bool:
        return len(shape) >= 4 and shape[-3:] == (n, n, K)

    with Shapes():
        chunk_stage_backward(*x)
    assert any(pairwise(s) for s in shapes)  # the probe sees the pairwise form's tensors
    shapes.clear()
    with Shapes():
        parts = chunk_parts(*x[:6], anchored=True)
        chunk_stage_backward(*x, anchored=True)
    assert shapes and not any(pairwise(s) for s in shapes), [s for s in shapes if pairwise(s)]
    assert "E" not in parts and "Ek" not in parts


@pytest.mark.parametrize("name", list(CASES))
def test_chunk_local_backward_anchored(name: str) -> None:
    """Through the tile map (partial tiles, GVA, varlen, an empty sequence) under the safe gate: the anchored
    slabs give the oracle's gradients in fp64 (1e-10) and fp32 (rel RMSE 1e-5), by default and in small
    slabs."""
    c = _case(name, safe=True)
    g = c["x"]["g"]
    assert g.min().item() >= -5.0 and (g == -5.0).sum().item() >= g.numel() // 4
    h, dh, _ = _tile_states(c)
    _assert_fp64_close(c["ref"], _run(c, h, dh, anchored=True))
    _assert_fp64_close(c["ref"], _run(c, h, dh, anchored=True, max_batch=2 * c["HV"] + 1))
    out = _run(c, h, dh, torch.float32, anchored=True)
    for grad in GRADS:
        assert out[grad].dtype == torch.float32, grad
        err = rel_rmse(c["ref"][grad], out[grad])
        assert err < 1e-5, f"{grad}: rel RMSE {err:.3e}"


def test_anchored_default_slab(monkeypatch: pytest.MonkeyPatch) -> None:
    """The flag reaches every slab, and the anchored form's default slab is the larger one (2048 entries,
    about the pairwise 1024's memory)."""
    calls: list[tuple[int, bool]] = []

    def probe(*args: Tensor, anchored: bool = False, **kw: Any) -> dict[str, Tensor]:
        # The chunk-local path never asks for the entering state's gradient, and on the CPU keeps fp32.
        assert kw == {"state_grad": False, "mm_dtype": None}
        calls.append((args[0].shape[0], anchored))
        return chunk_stage_backward(*args, anchored=anchored, **kw)

    monkeypatch.setattr(bl, "chunk_stage_backward", probe)
    HV, K, total = 2, 4, 16 * 1500
    tmap = tile_map(torch.tensor([0, total]), total)
    gen = torch.Generator().manual_seed(1)
    x = [torch.rand(total, HV, K, generator=gen) for _ in range(5)]
    states = torch.zeros(tmap.slots, HV, K, K)
    for anchored, per in ((False, DEFAULT_MAX_BATCH), (True, DEFAULT_MAX_BATCH_ANCHORED)):
        calls.clear()
        out = chunk_local_backward(x[0], x[1], x[2], -x[3], x[4][..., 0], x[4], states, states, tmap,
                                   anchored=anchored)
        assert all(torch.isfinite(t).all() for t in out.values())
        assert calls[0] == (per, anchored) and sum(b for b, _ in calls) == tmap.slots * HV
        assert {a for _, a in calls} == {anchored}
    assert DEFAULT_MAX_BATCH_ANCHORED == 2 * DEFAULT_MAX_BATCH


# ---- the state products: no state gradient, no [batch, K, V] temporaries, bf16 operands ----


@pytest.mark.parametrize("anchored", [False, True])
def test_state_grad_flag(anchored: bool) -> None:
    """``state_grad=False`` drops dS and changes no other output by a bit; an ``mm_dtype`` equal to the
    inputs' dtype is no cast."""
    x = _stage_inputs(11, "rand")
    full = chunk_stage_backward(*x, anchored=anchored)
    part = chunk_stage_backward(*x, anchored=anchored, state_grad=False)
    assert set(full) - set(part) == {"dS"}
    same = chunk_stage_backward(*x, anchored=anchored, state_grad=False, mm_dtype=F64)
    for name in part:
        assert torch.equal(part[name], full[name]) and torch.equal(same[name], full[name]), name


class _BigAllocs(TorchDispatchMode):
    """The new storages of ``min_numel`` elements or more, in any dtype, that the ops under the mode allocate
    (views of an input are not new), as (op, shape, dtype)."""

    def __init__(self, min_numel: int) -> None:
        super().__init__()
        self.min_numel = min_numel
        self.rows: list[tuple[str, tuple[int, ...], torch.dtype]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        given = (*args, *(kwargs or {}).values())
        flat = [t for a in given for t in (a if isinstance(a, (list, tuple)) else [a])]
        ins = {t.untyped_storage().data_ptr() for t in flat if isinstance(t, Tensor)}
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if (isinstance(t, Tensor) and t.untyped_storage().data_ptr() not in ins
                    and t.untyped_storage().nbytes() // t.element_size() >= self.min_numel):
                self.rows.append((str(func), tuple(t.shape), t.dtype))
        return out


def test_no_state_sized_temporaries() -> None:
    """Without the state gradient and with row-major states, the anchored form builds no tensor of [batch,
    K, V]'s size (K = V = 64, n = 16: every other one holds at most [batch, 2n, K], half that); with it, the
    state gradient alone; a transposed dS' costs one copy (for sum_v S dS'); bf16 products the two cast
    states."""
    x = _stage_inputs(16, "rand", tiles=2, K=64, V=64)
    S, dS = x[5], x[7]
    big = S.numel()
    runs: dict[str, list[tuple[str, tuple[int, ...], torch.dtype]]] = {}
    for name, states, kw in (("plain", (S, dS), {"state_grad": False}), ("state_grad", (S, dS), {}),
                             ("transposed", (S, dS.transpose(1, 2).contiguous().transpose(1, 2)),
                              {"state_grad": False}),
                             ("bf16", (S, dS), {"state_grad": False, "mm_dtype": torch.bfloat16})):
        args = [*x[:5], states[0], x[6], states[1]]
        with _BigAllocs(big) as probe:
            chunk_stage_backward(*args, anchored=True, **kw)
        runs[name] = probe.rows
    assert runs["plain"] == [], runs["plain"]
    assert [(shape, dt) for _, shape, dt in runs["state_grad"]] == [(tuple(S.shape), F64)], runs["state_grad"]
    assert len(runs["transposed"]) == 1, runs["transposed"]
    bf16 = [(tuple(S.shape), torch.bfloat16)] * 2
    assert [(shape, dt) for _, shape, dt in runs["bf16"]] == bf16, runs["bf16"]


def test_default_mm_dtype() -> None:
    assert default_mm_dtype(torch.device("cuda", 0), torch.float32) == torch.bfloat16
    assert default_mm_dtype(torch.device("cuda", 0), F64) == F64
    assert default_mm_dtype(torch.device("cpu"), torch.float32) == torch.float32


@pytest.mark.parametrize("name", list(CASES))
def test_bf16_state_products(name: str) -> None:
    """Both forms in fp32 with the state products' operands in bf16 (on the CPU: torch's bf16 matmul, whose
    result is rounded to bf16 as well; CUDA returns its fp32 accumulators): within 4e-3 rel RMSE of the
    fp64 oracle, hard resets (pairwise) and the safe gate (anchored) alike."""
    for safe in (False, True):
        c = _case(name, safe=safe)
        h, dh, _ = _tile_states(c)
        out = _run(c, h, dh, torch.float32, anchored=safe, mm_dtype=torch.bfloat16)
        for grad in GRADS:
            assert out[grad].dtype == torch.float32, grad
            err = rel_rmse(c["ref"][grad], out[grad])
            assert err <= 4e-3, f"{grad} ({'anchored' if safe else 'pairwise'}): rel RMSE {err:.3e}"
