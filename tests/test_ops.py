"""The ``kdagen::forward`` custom op on the CPU: its fake (meta) implementation, `torch.library.opcheck`, a
`torch.compile(fullgraph=True)` trace, and the refusal of inputs that require grad.

No variant is compiled: `kdagen.get_kernel` is replaced by a fake kernel that runs the runtime's argument
checks and computes the result with `kdagen.reference` on the CPU.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import kdagen
from kdagen import ops
from kdagen.reference import kda_recurrent_reference
from kdagen.runtime import check_scale, validate_inputs
from kdagen.spec import KernelSpec

PRE = dict(arch="sm_90a", head_dim_k=64, head_dim_v=64, gate="precomputed", safe_gate=False, lower_bound=None,
           l2norm_qk=False)
LB_VK = dict(arch="sm_90a", head_dim_k=64, head_dim_v=128, gva_ratio=2, gate="lower_bound", lower_bound=-5.0,
             safe_gate=True, state_layout="vk", beta_dtype="bf16")


class FakeKernel:
    """A CPU stand-in for `KDAKernel`: the runtime's checks, then the fp64 reference cast like the kernel's
    outputs. Records the policy of each call."""

    def __init__(self, spec: KernelSpec) -> None:
        self.spec = spec
        self.policies: list[Any] = []

    def __call__(self, q, k, v, g, beta, *, scale=None, A_log=None, dt_bias=None, initial_state=None,
                 output_final_state=False, cu_seqlens=None, policy=None):
        s = self.spec
        validate_inputs(s, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, require_cuda=False)
        self.policies.append(policy)
        o, ht = kda_recurrent_reference(
            q, k, v, g, beta, scale=check_scale(scale, s.head_dim_k), initial_state=initial_state,
            output_final_state=output_final_state, cu_seqlens=cu_seqlens, gate=s.gate, A_log=A_log,
            dt_bias=dt_bias, lower_bound=s.lower_bound, l2norm_qk=s.l2norm_qk, state_layout=s.state_layout)
        return o.to(q.dtype), (None if ht is None else ht.float())


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


@pytest.mark.parametrize("layout", ["kv", "vk"])
def test_fake_shapes_follow_the_spec(layout: str) -> None:
    spec = {**LB_VK, "state_layout": layout}
    sj = ops.spec_json(spec)
    with FakeTensorMode():
        q = torch.empty(1, 9, 2, 64, dtype=torch.float16)
        v = torch.empty(1, 9, 4, 128, dtype=torch.float16)
        g, beta = torch.empty(1, 9, 4, 64), torch.empty(1, 9, 4)
        cu = torch.empty(4, dtype=torch.int32)
        o, ht = torch.ops.kdagen.forward(sj, q, q, v, g, beta, None, None, None, None, True, cu, None)
        o2, none = torch.ops.kdagen.forward(sj, q, q, v, g, beta, None, None, None, None, False, None, None)
    assert (tuple(o.shape), o.dtype) == ((1, 9, 4, 128), torch.float16)
    expected = (3, 4, 64, 128) if layout == "kv" else (3, 4, 128, 64)
    assert (tuple(ht.shape), ht.dtype) == (expected, torch.float32)
    assert tuple(o2.shape) == (1, 9, 4, 128)
    assert (tuple(none.shape), none.dtype) == ((0,), torch.float32)


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


# ---- no backward ------------------------------------------------------------------------------------------


def test_requires_grad_gives_the_runtime_error(kernels: dict[str, FakeKernel]) -> None:
    inp = _inputs(PRE)
    inp["v"] = inp["v"].clone().requires_grad_()
    with pytest.raises(kdagen.InputError, match="v: requires grad, but the kernel is forward-only"):
        ops.kda_forward(PRE, **inp)
    # The op called directly refuses it too (its autograd registration), with the same error.
    with pytest.raises(kdagen.InputError, match="v: requires grad, but the kernel is forward-only"):
        torch.ops.kdagen.forward(*_op_args(PRE, inp))
    with torch.no_grad():
        o, _ = ops.kda_forward(PRE, **inp)
    assert not o.requires_grad
