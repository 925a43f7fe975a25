"""The forward's state-pool form on the CPU: every bad argument of a call with ``state_pool`` gets an
InputError naming it (`kdagen.runtime.validate_forward_inputs`), the validated-signature memo sees the new
arguments, a call with no tokens still clears the slots of fresh sequences, and the ``kdagen::forward_pool``
op's fake implementation and its mutation (no variant is compiled: a CPU stand-in kernel gathers the slots,
runs the fp64 reference and scatters the final states back)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import kdagen
from kdagen import ops
from kdagen.errors import InputError
from kdagen.reference import kda_recurrent_reference
from kdagen.runtime import (
    KDAKernel,
    _signature,
    _zero_fresh_slots,
    check_scale,
    validate_forward_inputs,
)
from kdagen.spec import KernelSpec

SPEC = KernelSpec(arch="sm_90a")  # K = V = 128, lower_bound gate, bf16, fp32 g and beta, kv layout
VK = KernelSpec(arch="sm_90a", state_layout="vk")


def _args(n: int = 3, t: int = 8, h: int = 2, slots: int = 8, spec: KernelSpec = SPEC, **over: Any) -> dict:
    # n sequences of t tokens each as a [n, t] batch, a pool of `slots` slots.
    k, v = spec.head_dim_k, spec.head_dim_v
    inner = (h, k, v) if spec.state_layout == "kv" else (h, v, k)
    args: dict[str, Any] = {
        "q": torch.zeros(n, t, h, k, dtype=torch.bfloat16),
        "k": torch.zeros(n, t, h, k, dtype=torch.bfloat16),
        "v": torch.zeros(n, t, h, v, dtype=torch.bfloat16),
        "g": torch.zeros(n, t, h, k),
        "beta": torch.zeros(n, t, h),
        "state_pool": torch.zeros(slots, *inner),
        "state_indices": torch.arange(n, dtype=torch.int32),
    }
    args.update(over)
    return args


def _check(spec: KernelSpec = SPEC, **kw: Any) -> tuple[int, ...]:
    sizes = {name: kw.pop(name) for name in ("n", "t", "h", "slots") if name in kw}
    a = _args(spec=spec, **sizes)
    a.update(kw)
    return validate_forward_inputs(spec, **a, require_cuda=False)


def test_valid_pool_calls_pass() -> None:
    assert _check() == (3, 8, 2, 2, 3)
    layers = torch.zeros(8, 3, 2, 128, 128)  # three layers interleaved slot by slot
    assert _check(state_pool=layers[:, 1]) == (3, 8, 2, 2, 3)
    assert _check(state_indices=torch.tensor([5, -1, 0])) == (3, 8, 2, 2, 3)  # int64, a padding entry
    assert _check(has_initial_state=torch.tensor([True, False, True])) == (3, 8, 2, 2, 3)
    cu = torch.tensor([0, 3, 3, 10], dtype=torch.int32)
    assert _check(n=1, t=10, cu_seqlens=cu, state_indices=torch.tensor([2, 7, -1], dtype=torch.int32)) == (
        1, 10, 2, 2, 3)
    assert _check(VK) == (3, 8, 2, 2, 3)
    one = torch.zeros(1, 2, 128, 128)
    assert _check(state_pool=one, state_indices=torch.zeros(3, dtype=torch.int32)) == (3, 8, 2, 2, 3)


def test_a_pool_lifts_the_compact_state_limit() -> None:
    # N*HV*K*V past 2**31 elements: refused for compact states, fine for a pool (64-bit slot arithmetic).
    n = 2**31 // (2 * 128 * 128) + 1
    meta = {name: torch.zeros(x.shape, dtype=x.dtype, device="meta") for name, x in _args(n=n, t=1).items()}
    meta["state_pool"] = torch.zeros(4, 2, 128, 128, device="meta")
    assert validate_forward_inputs(SPEC, **meta, require_cuda=False)[4] == n
    del meta["state_pool"], meta["state_indices"]
    with pytest.raises(InputError, match="^state: N\\*HV\\*K\\*V"):
        validate_forward_inputs(SPEC, **meta, require_cuda=False)


_POOL = torch.zeros(8, 2, 128, 128)
_ODD = torch.zeros(8 * 2 * 128 * 128 + 1)[1:].view(8, 2, 128, 128)  # 4 bytes past an aligned base
_NARROW = torch.zeros(3 * 128 * 128 * 2).as_strided((3, 2, 128, 128), (128 * 128, 128 * 128, 128, 1))
_ODD_STRIDE = torch.zeros(8 * 32769).as_strided((8, 2, 128, 128), (32769, 16384, 128, 1))
_I32 = torch.int32
_SEQS = r"^state_indices: expected \[N\] with N = 3 sequences, got "
_FLAGS = r"^has_initial_state: expected a bool tensor \[N\] = \[3\], got "


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"state_pool": "pool"}, "^state_pool: expected a torch.Tensor, got str$"),
        ({"state_pool": _POOL.to(torch.bfloat16)}, "^state_pool: expected dtype torch.float32"),
        ({"state_pool": torch.zeros(8, 3, 128, 128)},
         r"^state_pool: expected \[P, HV, K, V\] = \[P, 2, 128, 128\]"),
        ({"state_pool": torch.zeros(8, 2, 128, 64)}, r"^state_pool: expected \[P, HV, K, V\]"),
        ({"state_pool": torch.zeros(2, 128, 128)}, r"^state_pool: expected \[P, HV, K, V\]"),
        ({"state_pool": _POOL.to("meta")}, "^state_pool: expected a tensor on cpu"),
        ({"state_pool": _POOL.transpose(2, 3)}, "^state_pool: expected each slot compact"),
        ({"state_pool": _NARROW},
         "^state_pool: expected a slot stride of at least a slot's 32768 elements, got 16384$"),
        ({"state_pool": _ODD}, "^state_pool: expected 16-byte aligned slots"),
        ({"state_pool": _ODD_STRIDE}, "^state_pool: expected 16-byte aligned slots"),
        ({"state_indices": None}, r"^state_indices: required with state_pool \(one slot per sequence\)$"),
        ({"state_indices": [0, 1, 2]}, "^state_indices: expected a torch.Tensor, got list$"),
        ({"state_indices": torch.zeros(3)}, "^state_indices: expected dtype torch.int32 or torch.int64"),
        ({"state_indices": torch.zeros(3, dtype=_I32, device="meta")},
         "^state_indices: expected a tensor on cpu"),
        ({"state_indices": torch.zeros(4, dtype=_I32)}, _SEQS + r"\[4\]$"),
        ({"state_indices": torch.zeros(3, 1, dtype=_I32)}, _SEQS + r"\[3, 1\]$"),
        ({"has_initial_state": torch.ones(3, dtype=_I32)}, _FLAGS + r"torch.int32 \[3\]$"),
        ({"has_initial_state": torch.ones(2, dtype=torch.bool)}, _FLAGS + r"torch.bool \[2\]$"),
        ({"has_initial_state": [True] * 3}, _FLAGS + r"list \[\]$"),
        ({"has_initial_state": torch.ones(3, dtype=torch.bool, device="meta")},
         "^has_initial_state: expected a tensor on cpu"),
        ({"initial_state": torch.zeros(3, 2, 128, 128)}, "^initial_state: given together with state_pool;"),
        ({"output_final_state": True}, "^output_final_state: True together with state_pool;"),
        ({"state_pool": None},
         r"^state_indices: given without state_pool \(the pool whose slots it names\)$"),
        ({"state_pool": None, "state_indices": None, "has_initial_state": torch.ones(3, dtype=torch.bool)},
         "^has_initial_state: given without state_pool;"),
        ({"state_pool": _POOL.clone().requires_grad_()},
         "^state_pool: requires grad, but this call has no backward"),
    ],
)
def test_bad_pool_arguments_are_named(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(InputError, match=message):
        _check(**kw)


def test_vk_pool_shape_is_named() -> None:
    vk = r"^state_pool: expected \[P, HV, V, K\] = \[P, 2, 128, 128\] \(state_layout 'vk'\)"
    with pytest.raises(InputError, match=vk):
        _check(VK, state_pool=torch.zeros(8, 2, 128))


def test_the_pool_is_checked_after_the_inputs() -> None:
    # A bad q is named first, as in the compact form.
    with pytest.raises(InputError, match="^q: expected head dim K=128"):
        _check(q=torch.zeros(3, 8, 2, 64, dtype=torch.bfloat16))


def test_checkpoint_arguments_pass() -> None:
    ck = torch.full((3, 2), -1, dtype=torch.int32)
    assert _check(checkpoint_interval=64, checkpoint_indices=ck) == (3, 8, 2, 2, 3)
    assert _check(checkpoint_interval=16, checkpoint_indices=ck.long(),
                  start_positions=torch.tensor([0, 32, 4096])) == (3, 8, 2, 2, 3)


_CK = torch.zeros(3, 2, dtype=torch.int32)
_POSITIVE = "^checkpoint_interval: expected a positive"


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"checkpoint_interval": 24, "checkpoint_indices": _CK},
         "^checkpoint_interval: expected a positive multiple of 16 .*, got 24$"),
        ({"checkpoint_interval": 0, "checkpoint_indices": _CK}, _POSITIVE),
        ({"checkpoint_interval": -16, "checkpoint_indices": _CK}, _POSITIVE),
        ({"checkpoint_interval": True, "checkpoint_indices": _CK}, _POSITIVE),
        ({"checkpoint_interval": 32.0, "checkpoint_indices": _CK}, _POSITIVE),
        ({"checkpoint_interval": 32}, r"^checkpoint_indices: required with checkpoint_interval"),
        ({"checkpoint_interval": 32, "checkpoint_indices": _CK.float()},
         "^checkpoint_indices: expected dtype torch.int32 or torch.int64"),
        ({"checkpoint_interval": 32, "checkpoint_indices": _CK.to("meta")},
         "^checkpoint_indices: expected a tensor on cpu"),
        ({"checkpoint_interval": 32, "checkpoint_indices": _CK[0]},
         r"^checkpoint_indices: expected \[N, M\] with N = 3 sequences and M >= 1, got \[2\]$"),
        ({"checkpoint_interval": 32, "checkpoint_indices": _CK[:2]},
         r"^checkpoint_indices: expected \[N, M\] with N = 3 sequences and M >= 1, got \[2, 2\]$"),
        ({"checkpoint_interval": 32, "checkpoint_indices": _CK[:, :0]},
         r"^checkpoint_indices: expected \[N, M\] with N = 3 sequences and M >= 1, got \[3, 0\]$"),
        ({"checkpoint_interval": 32, "checkpoint_indices": _CK,
          "start_positions": torch.zeros(2, dtype=_I32)},
         r"^start_positions: expected a tensor \[N\] = \[3\], got \[2\]$"),
        ({"checkpoint_interval": 32, "checkpoint_indices": _CK, "start_positions": torch.zeros(3)},
         "^start_positions: expected dtype torch.int32 or torch.int64"),
        ({"checkpoint_interval": 32, "checkpoint_indices": _CK,
          "start_positions": torch.zeros(3, dtype=_I32, device="meta")},
         "^start_positions: expected a tensor on cpu"),
        ({"checkpoint_indices": _CK}, "^checkpoint_indices: given without checkpoint_interval"),
        ({"start_positions": torch.zeros(3, dtype=_I32)},
         "^start_positions: given without checkpoint_interval"),
        ({"state_pool": None, "state_indices": None, "checkpoint_interval": 32, "checkpoint_indices": _CK},
         "^checkpoint_interval: given without state_pool"),
    ],
)
def test_bad_checkpoint_arguments_are_named(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(InputError, match=message):
        _check(**kw)


def test_signature_covers_the_pool() -> None:
    a = _args()
    base = {name: a[name] for name in ("q", "k", "v", "g", "beta")}
    plain = {**base, "A_log": None, "dt_bias": None, "initial_state": None, "cu_seqlens": None}
    pooled = {**plain, "state_pool": a["state_pool"], "state_indices": a["state_indices"]}
    sig = _signature(**pooled)
    assert sig is not None and sig == _signature(**pooled) and sig != _signature(**plain)
    layers = torch.zeros(8, 3, 2, 128, 128)
    variants = [
        {**pooled, "state_pool": layers[:, 0]},  # another slot stride
        {**pooled, "state_pool": torch.zeros(8 * 32768 + 1)[1:].view(8, 2, 128, 128)},  # alignment
        {**pooled, "state_pool": torch.zeros(9, 2, 128, 128)},  # shape
        {**pooled, "state_indices": a["state_indices"].long()},  # dtype
        {**pooled, "has_initial_state": torch.ones(3, dtype=torch.bool)},  # presence
        {**pooled, "output_final_state": True},  # the conflict the checks refuse
        {**pooled, "checkpoint_interval": 32, "checkpoint_indices": _CK},  # checkpoints
        {**pooled, "checkpoint_interval": 64, "checkpoint_indices": _CK},  # their interval
        {**pooled, "checkpoint_interval": 64, "checkpoint_indices": _CK, "start_positions": _CK[:, 0]},
        {**plain, "state_indices": a["state_indices"]},  # indices without a pool
    ]
    sigs = [_signature(**x) for x in variants[:-1]]
    assert all(s is not None and s != sig for s in sigs) and len(set(sigs)) == len(sigs)
    assert _signature(**variants[-1]) is None  # no pool to read strides from: the full checks name it
    assert _signature(**{**pooled, "state_pool": "pool"}) is None
    assert _signature(**{**pooled, "checkpoint_interval": 32.0, "checkpoint_indices": _CK}) is None


def test_no_tokens_clears_fresh_slots_only() -> None:
    layers = torch.randn(6, 2, 2, 4, 4)  # two layers interleaved slot by slot; the pool is layer 1
    before = layers.clone()
    pool = layers[:, 1]
    idx = torch.tensor([4, -1, 1, 2], dtype=torch.int64)
    flags = torch.tensor([False, False, True, False])  # fresh: slots 4 and 2 (the -1 entry is padding)
    _zero_fresh_slots(pool, idx, flags)
    for s in range(6):
        if s in (4, 2):
            assert not pool[s].any(), f"slot {s}: a fresh sequence's slot must be zero"
        else:
            assert torch.equal(pool[s], before[s, 1]), f"slot {s} changed"
    assert torch.equal(layers[:, 0], before[:, 0]), "the other layer's slots changed"


def test_call_with_no_tokens_on_a_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    kernel = object.__new__(KDAKernel)
    kernel.spec, kernel._validated = SPEC, {}
    monkeypatch.setattr(KDAKernel, "_validate", lambda self, *args: (1, 0, 2, 2, 2))
    a = _args(n=1, t=0)
    pool = torch.ones(4, 2, 128, 128)
    o, ht = kernel(a["q"], a["k"], a["v"], a["g"], a["beta"], state_pool=pool,
                   state_indices=torch.tensor([3, 0], dtype=torch.int32),
                   has_initial_state=torch.tensor([True, False]), cu_seqlens=torch.tensor([0, 0, 0]))
    assert ht is None and o.shape == (1, 0, 2, 128)
    assert not pool[0].any() and pool[1:].eq(1).all()


# ---- the kdagen::forward_pool op --------------------------------------------------------------------------

PRE = dict(arch="sm_90a", head_dim_k=64, head_dim_v=64, gate="precomputed", safe_gate=False, lower_bound=None,
           l2norm_qk=False)


class PoolKernel:
    """A CPU stand-in for `KDAKernel` on a pool: the runtime's checks, then the fp64 reference from the
    gathered slots, the final states scattered back (padding entries skipped, their o zero) and the
    prefix-cache checkpoints written where the contract places them."""

    def __init__(self, spec: KernelSpec) -> None:
        self.spec = spec

    def _reference(self, q, k, v, g, beta, h0, scale, A_log, dt_bias, cu_seqlens):
        s = self.spec
        return kda_recurrent_reference(
            q, k, v, g, beta, scale=check_scale(scale, s.head_dim_k), initial_state=h0,
            output_final_state=True, cu_seqlens=cu_seqlens, gate=s.gate, A_log=A_log, dt_bias=dt_bias,
            lower_bound=s.lower_bound, l2norm_qk=s.l2norm_qk, state_layout=s.state_layout)

    def __call__(self, q, k, v, g, beta, *, scale=None, A_log=None, dt_bias=None, initial_state=None,
                 output_final_state=False, cu_seqlens=None, policy=None, state_pool=None, state_indices=None,
                 has_initial_state=None, checkpoint_interval=None, start_positions=None,
                 checkpoint_indices=None):
        validate_forward_inputs(self.spec, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens,
                                state_pool, state_indices, has_initial_state, output_final_state,
                                checkpoint_interval, start_positions, checkpoint_indices, require_cuda=False)
        live = state_indices >= 0
        h0 = state_pool[state_indices.clamp(min=0)].clone()
        if has_initial_state is not None:
            h0[~has_initial_state] = 0
        o, ht = self._reference(q, k, v, g, beta, h0, scale, A_log, dt_bias, cu_seqlens)
        o = o.to(q.dtype)
        bsz, seqlen = q.shape[0], q.shape[1]
        cu = cu_seqlens.tolist() if cu_seqlens is not None else [i * seqlen for i in range(bsz + 1)]
        flat = o.view(-1, *o.shape[2:])
        tokens = {name: x.reshape(1, -1, *x.shape[2:]) for name, x in (("q", q), ("k", k), ("v", v), ("g", g),
                                                                         ("beta", beta))}
        for n, ok in enumerate(live.tolist()):
            if not ok:
                flat[cu[n]:cu[n + 1]] = 0
                continue
            if checkpoint_interval is not None:
                c = checkpoint_interval
                start = 0 if start_positions is None else int(start_positions[n])
                length = cu[n + 1] - cu[n]
                for m in range(checkpoint_indices.shape[1]):
                    p = (start // c + 1 + m) * c
                    slot = int(checkpoint_indices[n, m])
                    if p > start + length or start % 16 or slot < 0:
                        continue
                    part = {name: x[:, cu[n]:cu[n] + p - start] for name, x in tokens.items()}
                    _, state = self._reference(**part, h0=h0[n:n + 1], scale=scale, A_log=A_log,
                                               dt_bias=dt_bias, cu_seqlens=None)
                    state_pool[slot] = state[0].float()
            state_pool[int(state_indices[n])] = ht[n].float()
        return o, None


@pytest.fixture
def pool_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kdagen, "get_kernel", lambda spec, policy=None, force=False: PoolKernel(
        kdagen.resolve_spec(spec)[1]))


def _pool_inputs(seed: int = 0) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "q": torch.randn(1, 9, 2, 64, generator=gen).to(torch.bfloat16),
        "k": torch.randn(1, 9, 2, 64, generator=gen).to(torch.bfloat16),
        "v": torch.randn(1, 9, 2, 64, generator=gen).to(torch.bfloat16),
        "g": -torch.rand(1, 9, 2, 64, generator=gen),
        "beta": torch.rand(1, 9, 2, generator=gen),
    }


def test_forward_pool_fake_gives_o() -> None:
    sj = ops.spec_json(PRE)
    with FakeTensorMode():
        q = torch.empty(1, 9, 2, 64, dtype=torch.bfloat16)
        g, beta = torch.empty(1, 9, 2, 64), torch.empty(1, 9, 2)
        pool, idx = torch.empty(5, 2, 64, 64), torch.empty(3, dtype=torch.int32)
        o = torch.ops.kdagen.forward_pool(sj, q, q, q, g, beta, None, None, None, None, None, pool, idx, None)
    assert (tuple(o.shape), o.dtype) == ((1, 9, 2, 64), torch.bfloat16)


def test_forward_pool_opcheck(pool_kernels: None) -> None:
    inp = _pool_inputs()
    pool = torch.randn(5, 2, 64, 64)
    args = (ops.spec_json(PRE), inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], None, None, None,
            torch.tensor([0, 4, 4, 9], dtype=torch.int32), None, pool,
            torch.tensor([3, -1, 0], dtype=torch.int32), torch.tensor([True, True, False]))
    torch.library.opcheck(torch.ops.kdagen.forward_pool, args)


def test_kda_forward_on_a_pool(pool_kernels: None) -> None:
    inp = _pool_inputs(1)
    pool = torch.randn(5, 2, 64, 64)
    want = pool.clone()
    idx = torch.tensor([3, -1, 0], dtype=torch.int32)
    cu = torch.tensor([0, 4, 6, 9], dtype=torch.int32)
    o, ht = ops.kda_forward(PRE, **inp, cu_seqlens=cu, state_pool=pool, state_indices=idx)
    o_ref, _ = PoolKernel(KernelSpec(**PRE))(**inp, cu_seqlens=cu, state_pool=want, state_indices=idx)
    assert ht is None and torch.equal(o, o_ref) and torch.equal(pool, want)
    assert not o[0, 4:6].any()
    with pytest.raises(InputError, match="^output_final_state: True together with state_pool"):
        ops.kda_forward(PRE, **inp, cu_seqlens=cu, state_pool=pool, state_indices=idx,
                        output_final_state=True)
    with pytest.raises(InputError, match="^state_indices: given without state_pool"):
        ops.kda_forward(PRE, **inp, cu_seqlens=cu, state_indices=idx)
    with pytest.raises(InputError, match="^state_pool: requires grad"):
        ops.kda_forward(PRE, **inp, cu_seqlens=cu, state_pool=pool.clone().requires_grad_(),
                        state_indices=idx)


def test_forward_pool_opcheck_with_checkpoints(pool_kernels: None) -> None:
    inp = _pool_inputs(2)
    pool = torch.randn(8, 2, 64, 64)
    ck = torch.tensor([[5, -1], [6, 7], [-1, -1]], dtype=torch.int32)
    args = (ops.spec_json(PRE), inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], None, None, None,
            torch.tensor([0, 4, 4, 9], dtype=torch.int32), None, pool,
            torch.tensor([3, -1, 0], dtype=torch.int32), None, 16, torch.tensor([16, 0, 32]), ck)
    torch.library.opcheck(torch.ops.kdagen.forward_pool, args)


def test_kda_forward_checkpoints_land_in_their_slots(pool_kernels: None) -> None:
    # A piece of 40 tokens after 16 in the state (it ends at position 56), interval 16: checkpoints at
    # positions 32 and 48 (16 and 32 tokens into the piece); the third slot (64) is past the piece.
    gen = torch.Generator().manual_seed(4)
    t = 40
    inp = {
        "q": torch.randn(1, t, 2, 64, generator=gen).to(torch.bfloat16),
        "k": torch.randn(1, t, 2, 64, generator=gen).to(torch.bfloat16),
        "v": torch.randn(1, t, 2, 64, generator=gen).to(torch.bfloat16),
        "g": -torch.rand(1, t, 2, 64, generator=gen),
        "beta": torch.rand(1, t, 2, generator=gen),
    }
    pool = torch.randn(6, 2, 64, 64)
    before = pool.clone()
    ck = torch.tensor([[4, 5, 2]], dtype=torch.int32)
    ops.kda_forward(PRE, **inp, state_pool=pool, state_indices=torch.tensor([1], dtype=torch.int32),
                    checkpoint_interval=16, start_positions=torch.tensor([16]), checkpoint_indices=ck)
    kernel = PoolKernel(KernelSpec(**PRE))
    for slot, tokens in ((4, 16), (5, 32)):
        part = {name: x[:, :tokens] for name, x in inp.items()}
        _, state = kernel._reference(**part, h0=before[1:2], scale=None, A_log=None, dt_bias=None,
                                     cu_seqlens=None)
        assert torch.equal(pool[slot], state[0].float()), f"checkpoint slot {slot}"
    assert torch.equal(pool[2], before[2]), "a third checkpoint past the piece was written"
    assert torch.equal(pool[0], before[0]) and torch.equal(pool[3], before[3])

