"""The ``kdagen::forward`` and ``kdagen::decode`` custom ops on the CPU: their fake (meta) implementations,
`torch.library.opcheck`, `torch.compile(fullgraph=True)` traces, the refusal of bad arguments and of inputs
that require grad.

No variant is compiled: `kdagen.get_kernel` is replaced by a fake kernel that runs the runtime's argument
checks and computes the result with `kdagen.reference` on the CPU (decode a token at a time, on the pool).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import kdagen
from kdagen import ops
from kdagen.decode import validate_decode_inputs
from kdagen.plan import bwd_state_tiles
from kdagen.reference import kda_recurrent_reference
from kdagen.runtime import check_scale, state_shape, validate_inputs
from kdagen.spec import KernelSpec
from kdagen.workspace import tile_slots

PRE = dict(arch="sm_90a", head_dim_k=64, head_dim_v=64, gate="precomputed", safe_gate=False, lower_bound=None,
           l2norm_qk=False)
LB_VK = dict(arch="sm_90a", head_dim_k=64, head_dim_v=128, gva_ratio=2, gate="lower_bound", lower_bound=-5.0,
             safe_gate=True, state_layout="vk", beta_dtype="bf16")


class FakeKernel:
    """A CPU stand-in for `KDAKernel`: the runtime's checks, then the fp64 reference cast like the kernel's
    outputs. Records the policy of each call and counts the decode steps that got past the checks."""

    def __init__(self, spec: KernelSpec) -> None:
        self.spec = spec
        self.policies: list[Any] = []
        self.decodes = 0

    def _reference(self, q, k, v, g, beta, **kw):
        s = self.spec
        return kda_recurrent_reference(q, k, v, g, beta, gate=s.gate, lower_bound=s.lower_bound,
                                       l2norm_qk=s.l2norm_qk, state_layout=s.state_layout, **kw)

    def __call__(self, q, k, v, g, beta, *, scale=None, A_log=None, dt_bias=None, initial_state=None,
                 output_final_state=False, cu_seqlens=None, policy=None):
        s = self.spec
        validate_inputs(s, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, require_cuda=False)
        self.policies.append(policy)
        o, ht = self._reference(
            q, k, v, g, beta, scale=check_scale(scale, s.head_dim_k), initial_state=initial_state,
            output_final_state=output_final_state, cu_seqlens=cu_seqlens, A_log=A_log, dt_bias=dt_bias)
        return o.to(q.dtype), (None if ht is None else ht.float())

    def decode(self, q, k, v, g, beta, *, state_pool, state_indices, scale=None, A_log=None, dt_bias=None,
               num_accepted_tokens=None, has_initial_state=None, update_state=True, cu_seqlens=None,
               out=None):
        """`KDAKernel.decode`'s slot semantics (`kdagen.decode`) a token at a time, on the pool in place."""
        s = self.spec
        bsz, seqlen, _, hv, nreq = validate_decode_inputs(
            s, q, k, v, g, beta, A_log, dt_bias, state_pool, state_indices, num_accepted_tokens,
            has_initial_state, cu_seqlens, out, require_cuda=False)
        self.decodes += 1
        scale = check_scale(scale, s.head_dim_k)
        o = out if out is not None else torch.zeros(bsz, seqlen, hv, s.head_dim_v, dtype=q.dtype)
        idx = state_indices.view(nreq, -1).tolist()
        cu = None if cu_seqlens is None else cu_seqlens.tolist()
        for n, slots in enumerate(idx):
            b, lo, hi = (n, 0, seqlen) if cu is None else (0, cu[n], cu[n + 1])
            accepted = 1 if num_accepted_tokens is None else int(num_accepted_tokens[n])
            src = slots[min(max(accepted, 1), len(slots)) - 1]
            if src < 0:  # padding: nothing read or written, o = 0
                o[b, lo:hi] = 0
                continue
            fresh = has_initial_state is not None and not bool(has_initial_state[n])
            h = torch.zeros_like(state_pool[src]) if fresh else state_pool[src].clone()
            for t in range(lo, hi):
                step = (x[b:b + 1, t:t + 1] for x in (q, k, v, g, beta))
                o_t, h = self._reference(*step, scale=scale, initial_state=h[None], output_final_state=True,
                                         A_log=A_log, dt_bias=dt_bias)
                h = h[0].float()
                o[b, t] = o_t[0, 0].to(o.dtype)
                if update_state and len(slots) > 1 and slots[t - lo] >= 0:
                    state_pool[slots[t - lo]] = h
            if update_state and len(slots) == 1:
                state_pool[src] = h
        return o


@pytest.fixture
def kernels(monkeypatch: pytest.MonkeyPatch) -> dict[str, FakeKernel]:
    """`kdagen.get_kernel` -> one FakeKernel per spec (by canonical JSON)."""
    made: dict[str, FakeKernel] = {}

    def fake_get_kernel(spec: Any, policy: Any = None, force: bool = False) -> FakeKernel:
        resolved = kdagen.resolve_spec(spec)[1]
        return made.setdefault(resolved.canonical_json(), FakeKernel(resolved))

    monkeypatch.setattr(kdagen, "get_kernel", fake_get_kernel)
    return made


def _inputs(spec: dict[str, Any], B: int = 1, T: int = 7, H: int = 2, seed: int = 0) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    K, V, HV = spec["head_dim_k"], spec["head_dim_v"], H * spec.get("gva_ratio", 1)
    dt = torch.bfloat16
    beta_dt = torch.bfloat16 if spec.get("beta_dtype") == "bf16" else torch.float32
    out = {
        "q": torch.randn(B, T, H, K, generator=gen).to(dt),
        "k": torch.randn(B, T, H, K, generator=gen).to(dt),
        "v": torch.randn(B, T, HV, V, generator=gen).to(dt),
        "g": torch.randn(B, T, HV, K, generator=gen) if spec["gate"] != "precomputed"
        else -torch.rand(B, T, HV, K, generator=gen),
        "beta": torch.rand(B, T, HV, generator=gen).to(beta_dt),
    }
    if spec["gate"] != "precomputed":
        out["A_log"] = torch.randn(HV, generator=gen) * 0.1
        out["dt_bias"] = torch.randn(HV * K, generator=gen) * 0.1
    return out


def _op_args(spec: dict[str, Any], inp: dict[str, Any], *, initial_state=None, final=True, cu=None,
             policy=None) -> tuple:
    return (ops.spec_json(spec), inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], None, inp.get("A_log"),
            inp.get("dt_bias"), initial_state, final, cu, policy)


# ---- the fake implementation ------------------------------------------------------------------------------


def _lb_vk_fakes(tokens: int, dtype: torch.dtype, beta_dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    # LB_VK's inputs (H 2, HV 4, K 64, V 128) for `tokens` tokens in three sequences: (q, v, g, beta, cu),
    # made under the caller's FakeTensorMode.
    q = torch.empty(1, tokens, 2, 64, dtype=dtype)
    v = torch.empty(1, tokens, 4, 128, dtype=dtype)
    g, beta = torch.empty(1, tokens, 4, 64), torch.empty(1, tokens, 4, dtype=beta_dtype)
    return q, v, g, beta, torch.empty(4, dtype=torch.int32)


@pytest.mark.parametrize("layout", ["kv", "vk"])
def test_fake_shapes_follow_the_spec(layout: str) -> None:
    spec = {**LB_VK, "state_layout": layout}
    sj = ops.spec_json(spec)
    with FakeTensorMode():
        q, v, g, beta, cu = _lb_vk_fakes(9, torch.float16, torch.float32)
        o, ht = torch.ops.kdagen.forward(sj, q, q, v, g, beta, None, None, None, None, True, cu, None)
        o2, none = torch.ops.kdagen.forward(sj, q, q, v, g, beta, None, None, None, None, False, None, None)
    assert (tuple(o.shape), o.dtype) == ((1, 9, 4, 128), torch.float16)
    expected = (3, 4, 64, 128) if layout == "kv" else (3, 4, 128, 64)
    assert (tuple(ht.shape), ht.dtype) == (expected, torch.float32)
    assert tuple(o2.shape) == (1, 9, 4, 128)
    assert (tuple(none.shape), none.dtype) == ((0,), torch.float32)


@pytest.mark.parametrize("layout", ["kv", "vk"])
def test_fake_forward_train_keeps_a_state_a_run(layout: str) -> None:
    # recompute=False returns the states the backward reads: one a run of the planner's tiles (64 tokens),
    # at the run ids' bound, in the MMA type and the state layout; recompute=True an empty tensor.
    spec = {**LB_VK, "state_layout": layout}
    sj = ops.spec_json(spec)
    with FakeTensorMode():
        q, v, g, beta, cu = _lb_vk_fakes(200, torch.bfloat16, torch.bfloat16)
        args = (sj, q, q, v, g, beta, None, None, None, None, True, cu, None)
        _, _, kept = torch.ops.kdagen.forward_train(*args, False)
        _, _, none = torch.ops.kdagen.forward_train(*args, True)
    slots = 200 // 64 + 3 + 1
    assert slots == tile_slots(200, 3, bwd_state_tiles(KernelSpec(**spec)))
    assert (tuple(kept.shape), kept.dtype) == ((slots, 4, 64, 128) if layout == "kv" else (slots, 4, 128, 64),
                                               torch.bfloat16)
    assert none.numel() == 0


def test_fake_batch_gives_n_equal_b() -> None:
    sj = ops.spec_json(PRE)
    with FakeTensorMode():
        q = torch.empty(3, 5, 2, 64, dtype=torch.bfloat16)
        g, beta = torch.empty(3, 5, 2, 64), torch.empty(3, 5, 2)
        o, ht = torch.ops.kdagen.forward(sj, q, q, q, g, beta, None, None, None, None, True, None, None)
    assert tuple(ht.shape) == (3, 2, 64, 64)


# ---- opcheck against the fake CPU kernel ---------------------------------------------------------------


@pytest.mark.parametrize("case", ["batch_final", "varlen_no_final", "gate_h0_vk"])
def test_opcheck(kernels: dict[str, FakeKernel], case: str) -> None:
    if case == "batch_final":
        spec, inp = PRE, _inputs(PRE, B=2, T=5)
        args = _op_args(spec, inp)
    elif case == "varlen_no_final":
        spec, inp = PRE, _inputs(PRE, T=9)
        args = _op_args(spec, inp, final=False, cu=torch.tensor([0, 4, 9], dtype=torch.int32))
    else:
        spec, inp = LB_VK, _inputs(LB_VK, T=6)
        h0 = torch.randn(2, 4, 128, 64)
        args = _op_args(spec, inp, initial_state=h0, cu=torch.tensor([0, 1, 6], dtype=torch.int64))
    torch.library.opcheck(torch.ops.kdagen.forward, args)


def test_kda_forward_matches_the_kernel(kernels: dict[str, FakeKernel]) -> None:
    inp = _inputs(LB_VK, T=6)
    h0 = torch.randn(1, 4, 128, 64)
    o, ht = ops.kda_forward(KernelSpec(**LB_VK), **inp, initial_state=h0, output_final_state=True, scale=0.5)
    fake = FakeKernel(KernelSpec(**LB_VK))
    ref_o, ref_ht = fake(**inp, initial_state=h0, output_final_state=True, scale=0.5)
    assert torch.equal(o, ref_o) and torch.equal(ht, ref_ht)
    o2, none = ops.kda_forward(LB_VK, **inp)
    assert none is None and torch.equal(o2, FakeKernel(KernelSpec(**LB_VK))(**inp)[0])


def test_spec_forms_give_one_json() -> None:
    spec = KernelSpec(**PRE)
    sj = spec.canonical_json()
    assert ops.spec_json(spec) == ops.spec_json(PRE) == ops.spec_json(sj) == sj
    assert ops.spec_json('{"arch": "sm_90a"}') == KernelSpec(arch="sm_90a").canonical_json()
    with pytest.raises(kdagen.SpecError, match="head_dim_k"):
        ops.spec_json('{"arch": "sm_90a", "head_dim_k": 96}')


def test_policy_reaches_the_kernel(kernels: dict[str, FakeKernel]) -> None:
    from kdagen.policy import SchedulePolicy

    inp = _inputs(PRE)
    ops.kda_forward(PRE, **inp, policy=SchedulePolicy(intracard_cp="off", fused="off"))
    ops.kda_forward(PRE, **inp)
    (kernel,) = kernels.values()
    assert kernel.policies == [SchedulePolicy(intracard_cp="off", fused="off"), None]


def test_input_errors_are_the_runtimes(kernels: dict[str, FakeKernel]) -> None:
    inp = _inputs(PRE)
    inp["g"] = inp["g"].to(torch.bfloat16)
    with pytest.raises(kdagen.InputError, match="g: expected dtype torch.float32"):
        ops.kda_forward(PRE, **inp)
    with pytest.raises(kdagen.InputError, match="scale"):
        ops.kda_forward(PRE, **_inputs(PRE), scale=True)


# ---- torch.compile ----------------------------------------------------------------------------------------


class _Layer(torch.nn.Module):
    def __init__(self, spec: Any) -> None:
        super().__init__()
        self.spec = spec

    def forward(self, q, k, v, g, beta, A_log, dt_bias, cu_seqlens):
        o, ht = ops.kda_forward(self.spec, q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias,
                                output_final_state=True, cu_seqlens=cu_seqlens)
        return o.float() * 2, ht.sum(dim=0)


@pytest.mark.parametrize("form", ["spec", "json"])
def test_compile_fullgraph(kernels: dict[str, FakeKernel], form: str) -> None:
    torch._dynamo.reset()
    spec = KernelSpec(**LB_VK)
    layer = _Layer(spec if form == "spec" else spec.canonical_json())
    inp = _inputs(LB_VK, T=8)
    args = (inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], inp["A_log"], inp["dt_bias"],
            torch.tensor([0, 3, 8], dtype=torch.int32))
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    got, want = compiled(*args), layer(*args)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# ---- autograd ---------------------------------------------------------------------------------------------


class _PassThrough(TorchDispatchMode):
    # A dispatch mode that changes nothing: what make_fx and torch.compile's tracing set up around a call.
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


def test_requires_grad_records_the_autograd_node(kernels: dict[str, FakeKernel]) -> None:
    # (tests/test_backward_cpu.py runs the backward itself on an emulated kernel.)
    inp = _inputs(PRE)
    inp["v"] = inp["v"].clone().requires_grad_()
    o, _ = ops.kda_forward(PRE, **inp)
    # Plain tensors take the eager form of the op (the same forward and autograd formula, no dispatch) ...
    assert o.requires_grad and type(o.grad_fn).__name__ == "_EagerTrainBackward"
    # ... and under a dispatch mode (what tracing sets up) the op itself.
    with _PassThrough():
        o, _ = ops.kda_forward(PRE, **inp)
    assert o.requires_grad and "forward_train" in type(o.grad_fn).__name__.lower() + str(o.grad_fn)
    o2, _ = torch.ops.kdagen.forward(*_op_args(PRE, inp))  # the op called directly records it too
    assert o2.requires_grad
    # The pool form has no backward: refused with the runtime's error before any kernel runs.
    pool = torch.zeros(2, 4, 64, 64)
    with pytest.raises(kdagen.InputError, match="^v: requires grad, but this call has no backward"):
        ops.kda_forward(PRE, **inp, state_pool=pool, state_indices=torch.zeros(1, dtype=torch.int32))
    with torch.no_grad():
        o, _ = ops.kda_forward(PRE, **inp)
    assert not o.requires_grad


# ---- kdagen::decode ---------------------------------------------------------------------------------------


def _pool(spec: dict[str, Any], slots: int, hv: int, seed: int = 1, interleave: int = 1) -> torch.Tensor:
    """A pool of `slots` states whose slots are `interleave` slot sizes apart (layers sharing a buffer)."""
    gen = torch.Generator().manual_seed(seed)
    inner = state_shape(KernelSpec(**spec), 1, hv)[1:]
    return (torch.randn(slots, interleave, *inner, generator=gen) * 0.1)[:, 0]


def _decode_case(case: str) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(spec, inputs, the decode keywords) of a named call: plain decode with a padding slot, verify with
    FLA's slot semantics and fresh requests, varlen into `out`, output-only verify on a V-first pool."""
    if case == "plain":
        spec, inp = PRE, _inputs(PRE, B=4, T=1)
        kw = {"state_indices": torch.tensor([5, -1, 0, 3])}
    elif case == "verify":
        spec, inp = LB_VK, _inputs(LB_VK, B=3, T=3)
        kw = {"state_indices": torch.arange(9, dtype=torch.int32).view(3, 3),
              "num_accepted_tokens": torch.tensor([1, 3, 2], dtype=torch.int32),
              "has_initial_state": torch.tensor([True, False, True])}
    elif case == "varlen_out":
        spec, inp = LB_VK, _inputs(LB_VK, B=1, T=6)
        kw = {"state_indices": torch.tensor([2, 7, 4]),
              "cu_seqlens": torch.tensor([0, 1, 3, 5], dtype=torch.int32),
              "out": torch.full((1, 6, 4, 128), 7.0, dtype=torch.bfloat16), "scale": 0.25}
    elif case == "no_update_vk":
        spec, inp = {**PRE, "state_layout": "vk"}, _inputs({**PRE, "state_layout": "vk"}, B=2, T=2)
        kw = {"state_indices": torch.tensor([[1, 2], [3, 4]]), "update_state": False}
    else:
        raise AssertionError(case)
    hv = inp["v"].shape[2]
    kw["state_pool"] = _pool(spec, 10, hv, interleave=2 if case == "plain" else 1)
    return spec, inp, kw


def _decode_op_args(spec: dict[str, Any], inp: dict[str, Any], kw: dict[str, Any]) -> tuple:
    return (ops.spec_json(spec), inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], kw["state_pool"],
            kw["state_indices"], kw.get("scale"), inp.get("A_log"), inp.get("dt_bias"),
            kw.get("num_accepted_tokens"), kw.get("has_initial_state"), kw.get("update_state", True),
            kw.get("cu_seqlens"), kw.get("out"))


def _decode_op(sj: str, q: Any, k: Any, v: Any, g: Any, beta: Any, pool: Any, idx: Any, **kw: Any) -> Any:
    """``kdagen::decode`` with every argument passed (the schema has no defaults), the rest as None."""
    return torch.ops.kdagen.decode(sj, q, k, v, g, beta, pool, idx, kw.get("scale"), kw.get("A_log"),
                                   kw.get("dt_bias"), kw.get("num_accepted_tokens"),
                                   kw.get("has_initial_state"), kw.get("update_state", True),
                                   kw.get("cu_seqlens"), kw.get("out"))


def _cloned(kw: dict[str, Any]) -> dict[str, Any]:
    return {name: (t.clone() if name in ("state_pool", "out") else t) for name, t in kw.items()}


DECODE_CASES = ["plain", "verify", "varlen_out", "no_update_vk"]


def _pre_empty(n: int, s: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Uninitialised q (also k and v), g and beta of PRE: n requests of s tokens, 2 heads."""
    return torch.empty(n, s, 2, 64, dtype=torch.bfloat16), torch.empty(n, s, 2, 64), torch.empty(n, s, 2)


def test_decode_schema_declares_its_writes() -> None:
    schema = torch.ops.kdagen.decode.default._schema
    written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    assert written == {"state_pool", "out"}
    assert [str(r.type) for r in schema.returns] == ["Tensor"]
    assert ops.DECODE_OP_NAME == "kdagen::decode" and "kda_decode" in ops.__all__


@pytest.mark.parametrize("layout", ["kv", "vk"])
def test_decode_fake_shapes(layout: str) -> None:
    spec = {**LB_VK, "state_layout": layout}
    sj = ops.spec_json(spec)
    inner = (4, 64, 128) if layout == "kv" else (4, 128, 64)
    with FakeTensorMode():
        q = torch.empty(3, 2, 2, 64, dtype=torch.bfloat16)
        v = torch.empty(3, 2, 4, 128, dtype=torch.bfloat16)
        g, beta = torch.empty(3, 2, 4, 64), torch.empty(3, 2, 4, dtype=torch.bfloat16)
        pool, idx = torch.empty(16, *inner), torch.empty(3, 2, dtype=torch.int64)
        o = _decode_op(sj, q, q, v, g, beta, pool, idx)
        # packed requests: [1, T, ...] with cu_seqlens, on the CPU (its values are not read)
        qp, vp = q.view(1, 6, 2, 64), v.view(1, 6, 4, 128)
        cu = torch.empty(4, dtype=torch.int32)
        o_packed = _decode_op(sj, qp, qp, vp, g.view(1, 6, 4, 64), beta.view(1, 6, 4), pool, idx[:, 0],
                              cu_seqlens=cu)
        into = _decode_op(sj, q, q, v, g, beta, pool, idx,
                          out=torch.empty(3, 2, 4, 128, dtype=torch.bfloat16))
    assert (tuple(o.shape), o.dtype) == ((3, 2, 4, 128), torch.bfloat16)
    assert tuple(o_packed.shape) == (1, 6, 4, 128)
    assert (tuple(into.shape), into.dtype) == ((0,), torch.bfloat16)


def test_decode_on_meta_tensors() -> None:
    sj = ops.spec_json(PRE)
    with torch.device("meta"):
        q, g, beta = _pre_empty(5, 1)
        pool = torch.empty(64, 3, 2, 64, 64)[:, 1]  # an interleaved pool
        o = _decode_op(sj, q, q, q, g, beta, pool, torch.empty(5, dtype=torch.int32))
    assert (o.device.type, tuple(o.shape), o.dtype) == ("meta", (5, 1, 2, 64), torch.bfloat16)


# (argument, a bad value made under FakeTensorMode, the error's message)
BAD_FAKE_ARGUMENTS = [
    ("state_pool", lambda: torch.empty(8, 2, 64, 64, dtype=torch.bfloat16),
     "state_pool: expected dtype torch.float32"),
    ("state_pool", lambda: torch.empty(8, 2, 64, 32),
     r"state_pool: expected \[P, HV, K, V\] = \[P, 2, 64, 64\]"),
    ("state_indices", lambda: torch.empty(2, dtype=torch.int32),
     r"state_indices: expected \[N\] or \[N, M\]"),
    ("state_indices", lambda: torch.empty(3), "state_indices: expected dtype torch.int32 or torch.int64"),
    ("T", lambda: 9, "at most 8 tokens a request"),
    ("out", lambda: torch.empty(3, 1, 2, 64), r"out: expected a torch.bfloat16 tensor \[B, T, HV, V\]"),
    ("scale", lambda: -1.0, "scale: expected a finite real number > 0"),
]


@pytest.mark.parametrize(("name", "make", "message"), BAD_FAKE_ARGUMENTS,
                         ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD_FAKE_ARGUMENTS)])
def test_decode_fake_refuses_bad_arguments(name: str, make: Any, message: str) -> None:
    """The fake implementation runs the decode checks, so a bad call fails while tracing, as in eager."""
    with FakeTensorMode():
        args: dict[str, Any] = {"T": 1, "state_pool": torch.empty(8, 2, 64, 64), "scale": None, "out": None,
                                "state_indices": torch.zeros(3, dtype=torch.int32)}
        args[name] = make()
        q, g, beta = _pre_empty(3, args["T"])
        with pytest.raises(kdagen.InputError, match=message):
            _decode_op(ops.spec_json(PRE), q, q, q, g, beta, args["state_pool"], args["state_indices"],
                       scale=args["scale"], out=args["out"])


@pytest.mark.parametrize("case", DECODE_CASES)
def test_decode_opcheck(kernels: dict[str, FakeKernel], case: str) -> None:
    spec, inp, kw = _decode_case(case)
    torch.library.opcheck(torch.ops.kdagen.decode, _decode_op_args(spec, inp, kw))


@pytest.mark.parametrize("case", DECODE_CASES)
@pytest.mark.parametrize("form", ["kernel", "spec", "json"])
def test_kda_decode_matches_kernel_decode(kernels: dict[str, FakeKernel], case: str, form: str) -> None:
    spec, inp, kw = _decode_case(case)
    fake = FakeKernel(KernelSpec(**spec))
    want_kw = _cloned(kw)
    want = fake.decode(**inp, **want_kw)
    before = kw["state_pool"].clone()
    handle = {"kernel": fake, "spec": KernelSpec(**spec), "json": ops.spec_json(spec)}[form]
    got = ops.kda_decode(handle, **inp, **kw)
    assert torch.equal(got, want) and torch.equal(kw["state_pool"], want_kw["state_pool"])
    if "out" in kw:
        assert got is kw["out"]
    if kw.get("update_state", True):
        assert not torch.equal(kw["state_pool"], before)
    else:
        assert torch.equal(kw["state_pool"], before)


def test_decode_bad_arguments_are_refused_before_any_launch(kernels: dict[str, FakeKernel]) -> None:
    spec, inp, kw = _decode_case("verify")
    before = kw["state_pool"].clone()
    bad = [
        ({"state_pool": kw["state_pool"].mT.contiguous().mT}, "state_pool: expected each slot compact"),
        ({"num_accepted_tokens": torch.ones(2, dtype=torch.int32)},
         r"num_accepted_tokens: expected a tensor \[N\]"),
        ({"has_initial_state": torch.ones(3, dtype=torch.int32)},
         "has_initial_state: expected a bool tensor"),
        ({"scale": "0.5"}, "scale: expected a finite real number > 0 or None, got str"),
    ]
    for change, message in bad:
        with pytest.raises(kdagen.InputError, match=message):
            ops.kda_decode(spec, **inp, **{**kw, **change})
    assert all(k.decodes == 0 for k in kernels.values())
    assert torch.equal(kw["state_pool"], before)


def test_decode_requires_grad_gives_the_runtime_error(kernels: dict[str, FakeKernel]) -> None:
    spec, inp, kw = _decode_case("plain")
    before = kw["state_pool"].clone()
    inp["q"] = inp["q"].clone().requires_grad_()
    with pytest.raises(kdagen.InputError, match="q: requires grad, but this call has no backward"):
        ops.kda_decode(spec, **inp, **kw)
    assert torch.equal(kw["state_pool"], before)
    # The op called directly runs (a mutating op takes no autograd formula); a backward through o is torch's
    # error for an op with no formula, so no gradient is made up.
    o = torch.ops.kdagen.decode(*_decode_op_args(spec, inp, kw))
    with pytest.raises(RuntimeError, match="no autograd formula"):
        o.float().sum().backward()
    with torch.no_grad():
        o = ops.kda_decode(spec, **inp, **kw)
    assert not o.requires_grad


class _DecodeLayer(torch.nn.Module):
    """A layer's decode step between torch ops, as a model would call it."""

    def __init__(self, kernel: Any) -> None:
        super().__init__()
        self.kernel = kernel

    def forward(self, q, k, v, g, beta, A_log, dt_bias, kw):
        o = ops.kda_decode(self.kernel, q * 2, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, **kw)
        return o.float().square().sum(dim=-1), kw["state_pool"].sum()  # the pool as the op left it


@pytest.mark.parametrize("case", DECODE_CASES)
def test_decode_compile_fullgraph(kernels: dict[str, FakeKernel], case: str) -> None:
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    torch._dynamo.reset()
    spec, inp, kw = _decode_case(case)
    fake = FakeKernel(KernelSpec(**spec))
    layer = _DecodeLayer(fake)
    args = (inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], inp.get("A_log"), inp.get("dt_bias"))
    want_kw = _cloned(kw)
    want = layer(*args, want_kw)
    backend = AotEagerAndRecordGraphs()
    got = torch.compile(layer, fullgraph=True, backend=backend)(*args, kw)
    for w, g_ in zip(want, got):
        assert torch.equal(w, g_)
    assert torch.equal(kw["state_pool"], want_kw["state_pool"])
    if "out" in kw:
        assert torch.equal(kw["out"], want_kw["out"])
    # Dynamo's graph calls the op once; the functionalized graph writes the pool back into the input.
    (dynamo_graph,) = backend.graphs
    assert str(dynamo_graph.code).count("torch.ops.kdagen.decode") == 1
    (fw,) = backend.fw_graphs
    assert "auto_functionalized" in str(fw.code) and "copy_" in str(fw.code)


def test_decode_compile_traces_fake_and_meta_inputs() -> None:
    """Tracing needs no kernel: shapes flow from the fake implementation (no `get_kernel` fixture here)."""
    sj = ops.spec_json(PRE)

    def step(q, g, beta, pool, idx):
        o = ops.kda_decode(sj, q, q, q, g, beta, state_pool=pool, state_indices=idx)
        return o.sum(dim=-1)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    with torch.device("meta"):
        q, g, beta = _pre_empty(4, 2)
        out = compiled(q, g, beta, torch.empty(9, 2, 64, 64), torch.empty(4, 2, dtype=torch.int64))
    assert (out.device.type, tuple(out.shape), out.dtype) == ("meta", (4, 2, 2), torch.bfloat16)
    # make_fx over fake tensors: the op is one node of the graph, its o shaped by the fake implementation
    from torch.fx.experimental.proxy_tensor import make_fx

    q, g, beta = _pre_empty(4, 1)
    graph = make_fx(step, tracing_mode="fake")(q, g, beta, torch.empty(9, 2, 64, 64),
                                               torch.empty(4, dtype=torch.int64))
    (node,) = [n for n in graph.graph.nodes if n.target is torch.ops.kdagen.decode.default]
    assert tuple(node.meta["val"].shape) == (4, 1, 2, 64)


def test_decode_compile_refuses_bad_arguments_while_tracing(kernels: dict[str, FakeKernel]) -> None:
    spec, inp, kw = _decode_case("plain")
    layer = _DecodeLayer(ops.spec_json(spec))
    kw["state_pool"] = kw["state_pool"].double()
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    # Dynamo reports the fake implementation's error in its own (TorchRuntimeError), naming it.
    with pytest.raises(Exception, match=r"InputError\(.state_pool: expected dtype torch.float32"):
        compiled(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], None, None, kw)
    assert not kernels  # no kernel was looked up, nothing launched
