"""`kdagen.fla` on the CPU: the spec chosen for FLA's flags, the errors for what kdagen does not build, the
call path of `chunk_kda` on a fake kernel, and the decode entry points that are not built yet.

The arch detection is replaced (the tensors are CPU tensors) and no variant is compiled: `kdagen.get_kernel`
returns a fake kernel that computes the result with `kdagen.reference`.
"""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import kdagen
from kdagen import fla
from kdagen.reference import kda_recurrent_reference
from kdagen.runtime import check_scale, validate_inputs

REPO = Path(__file__).resolve().parent.parent
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


class FakeKernel:
    """The runtime's argument checks, then the fp64 reference cast like the kernel's outputs."""

    def __init__(self, spec: kdagen.KernelSpec) -> None:
        self.spec = spec

    def __call__(self, q, k, v, g, beta, *, scale=None, A_log=None, dt_bias=None, initial_state=None,
                 output_final_state=False, cu_seqlens=None, policy=None, recompute=True, **pool):
        s = self.spec
        self.recompute = recompute  # what kdagen.fla passed
        if pool:  # the forward on a state pool: what kdagen.fla passed
            self.prefilled = pool
            return (torch.zeros_like(v) if pool.get("out") is None else pool["out"]), None
        validate_inputs(s, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, require_cuda=False)
        o, ht = kda_recurrent_reference(
            q, k, v, g, beta, scale=check_scale(scale, s.head_dim_k), initial_state=initial_state,
            output_final_state=output_final_state, cu_seqlens=cu_seqlens, gate=s.gate, A_log=A_log,
            dt_bias=dt_bias, lower_bound=s.lower_bound, l2norm_qk=s.l2norm_qk, state_layout=s.state_layout,
            beta_mode=s.beta)
        return o.to(q.dtype), (None if ht is None else ht.float())

    def decode(self, q, k, v, g, beta, **kw):
        self.decoded = kw  # what kdagen.fla passed
        return torch.zeros_like(v) if kw.get("out") is None else kw["out"]


@pytest.fixture
def on_h100(monkeypatch: pytest.MonkeyPatch) -> list[kdagen.KernelSpec]:
    """CPU tensors count as an sm_90a device; `kdagen.get_kernel` gives fake kernels and records the specs."""
    asked: list[kdagen.KernelSpec] = []

    def fake_get_kernel(spec: Any, policy: Any = None, force: bool = False) -> FakeKernel:
        asked.append(spec)
        return FakeKernel(spec)

    monkeypatch.setattr(fla, "device_arch", lambda device: "sm_90a")
    monkeypatch.setattr(kdagen, "get_kernel", fake_get_kernel)
    return asked


def _tensors(K: int = 64, V: int = 64, H: int = 2, HV: int = 2, T: int = 6, dtype: torch.dtype = BF16,
             g_dtype: torch.dtype = FP32, beta_dtype: torch.dtype = FP32, seed: int = 0) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "q": torch.randn(1, T, H, K, generator=gen).to(dtype),
        "k": torch.randn(1, T, H, K, generator=gen).to(dtype),
        "v": torch.randn(1, T, HV, V, generator=gen).to(dtype),
        "g": (-torch.rand(1, T, HV, K, generator=gen)).to(g_dtype),
        "beta": torch.rand(1, T, HV, generator=gen).to(beta_dtype),
    }


def _choose(t: dict[str, Any], **flags: Any) -> kdagen.KernelSpec:
    return fla.choose_spec(t["q"], t["v"], t["g"], t["beta"], arch="sm_90a", **flags)


# ---- the spec of each flag combination ------------------------------------------------------------------

A_LOG = torch.zeros(2)
CASES: list[tuple[str, dict[str, Any], dict[str, Any], dict[str, Any]]] = [
    # (id, tensor options, FLA flags, expected spec fields)
    ("precomputed", {}, {}, dict(gate="precomputed", safe_gate=False, lower_bound=None, l2norm_qk=False,
                                 state_layout="kv", beta="prob")),
    ("precomputed-lb-ignored", {}, dict(lower_bound=-3.0), dict(gate="precomputed", lower_bound=None)),
    ("precomputed-safe", {}, dict(safe_gate=True),
     dict(gate="precomputed", safe_gate=True, lower_bound=-5.0)),
    ("precomputed-safe-lb", {}, dict(safe_gate=True, lower_bound=-3.0),
     dict(safe_gate=True, lower_bound=-3.0)),
    ("lower_bound-safe", {}, dict(use_gate_in_kernel=True, safe_gate=True, lower_bound=-5.0),
     dict(gate="lower_bound", safe_gate=True, lower_bound=-5.0)),
    ("lower_bound", {}, dict(use_gate_in_kernel=True, lower_bound=-7.0),
     dict(gate="lower_bound", safe_gate=False, lower_bound=-7.0)),
    ("softplus", {}, dict(use_gate_in_kernel=True, A_log=A_LOG),
     dict(gate="softplus", safe_gate=False, lower_bound=None)),
    ("l2-vk", {}, dict(use_qk_l2norm_in_kernel=True, state_v_first=True),
     dict(l2norm_qk=True, state_layout="vk")),
    ("gva4-k64v128-fp16-bf16aux", dict(K=64, V=128, H=2, HV=8, dtype=FP16, g_dtype=BF16, beta_dtype=BF16), {},
     dict(head_dim_k=64, head_dim_v=128, gva_ratio=4, dtype="fp16", g_dtype="bf16", beta_dtype="bf16")),
    ("k128", dict(K=128, V=128), {}, dict(head_dim_k=128, head_dim_v=128, gva_ratio=1, dtype="bf16",
                                          g_dtype="fp32", beta_dtype="fp32", arch="sm_90a")),
    ("beta-sigmoid", {}, dict(use_beta_sigmoid_in_kernel=True), dict(beta="logit")),
    ("beta-sigmoid-neg-eigval", dict(beta_dtype=BF16), dict(use_beta_sigmoid_in_kernel=True,
                                                            allow_neg_eigval=True),
     dict(beta="logit_x2", beta_dtype="bf16")),
    # FLA's rule: allow_neg_eigval takes effect only with the in-kernel sigmoid; alone, beta is as given.
    ("neg-eigval-alone", {}, dict(allow_neg_eigval=True), dict(beta="prob")),
]


@pytest.mark.parametrize("opts,flags,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_spec_of_flags(opts: dict[str, Any], flags: dict[str, Any], expected: dict[str, Any]) -> None:
    spec = _choose(_tensors(**opts), **flags)
    assert {f: getattr(spec, f) for f in expected} == expected


@pytest.mark.parametrize("cap,arch", [((9, 0), "sm_90a"), ((8, 0), "sm_80"), ((10, 0), "sm_100a")])
def test_arch_from_the_device(monkeypatch: pytest.MonkeyPatch, cap: tuple[int, int], arch: str) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: cap)
    fla._arch_of.cache_clear()
    try:
        assert fla.device_arch(torch.device("cuda", 0)) == arch
    finally:
        fla._arch_of.cache_clear()


def test_unknown_capability_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (8, 6))
    fla._arch_of.cache_clear()
    try:
        with pytest.raises(kdagen.InputError, match=r"compute capability 8\.6.*sm_90a \(9\.0\)"):
            fla.device_arch(torch.device("cuda", 0))
    finally:
        fla._arch_of.cache_clear()
    with pytest.raises(kdagen.InputError, match="q: expected a CUDA tensor"):
        fla.device_arch(torch.device("cpu"))


# ---- what kdagen does not build ---------------------------------------------------------------------------

ERRORS: list[tuple[str, dict[str, Any], dict[str, Any], str]] = [
    ("fp32-q", dict(dtype=FP32), {}, r"q: dtype torch.float32 is not built by kdagen \(supported: "
                                     r"torch.bfloat16, torch.float16\)"),
    ("k256", dict(K=256), {}, r"q: head dim K=256 is not built by kdagen \(supported: 64, 128\)"),
    ("v32", dict(V=32), {}, r"v: head dim V=32 is not built"),
    ("gva3", dict(H=2, HV=6), {}, r"v: HV / H = 6 / 2: kdagen builds HV = r \* H for r in 1, 2, 4, 8"),
    ("fp16-g", dict(g_dtype=FP16), {}, r"g: dtype torch.float16 is not built"),
    ("safe-gate-no-bound", {}, dict(use_gate_in_kernel=True, safe_gate=True),
     r"lower_bound: safe_gate=True"),
    ("softplus-no-A_log", {}, dict(use_gate_in_kernel=True),
     r"A_log: use_gate_in_kernel=True without"),
    ("safe-bound-too-low", {}, dict(use_gate_in_kernel=True, safe_gate=True, lower_bound=-6.0),
     r"lower_bound: safe_gate=True needs lower_bound in \[-5, 0\)"),
    ("positive-bound", {}, dict(use_gate_in_kernel=True, lower_bound=0.5),
     r"lower_bound: .*needs a bound < 0"),
    ("precomputed-safe-bad-bound", {}, dict(safe_gate=True, lower_bound=-9.0),
     r"lower_bound: safe_gate=True"),
    ("recompute-not-bool", {}, dict(disable_recompute=1), r"disable_recompute: expected True or False"),
    ("intermediate", {}, dict(return_intermediate_states=True), r"return_intermediate_states: True"),
    ("cp", {}, dict(cp_context=object()), r"cp_context: .*context parallelism"),
    ("unknown-keyword", {}, dict(foo=1), r"foo: unknown keyword"),
    ("chunk-size", {}, dict(chunk_size=128), r"chunk_size: expected 32 or 64"),
    ("both-layout-names", {}, dict(state_v_first=True, transpose_state_layout=True),
     r"transpose_state_layout: cannot pass both"),
    ("graph-padding", {}, dict(use_graph=True, max_num_seqs=4, cu_seqlens=torch.tensor([0, 6])),
     r"max_num_seqs: with use_graph, cu_seqlens must hold exactly max_num_seqs \+ 1 = 5"),
    ("cpu-offsets-alone", {}, dict(cu_seqlens_cpu=torch.tensor([0, 6])), r"cu_seqlens_cpu: given without"),
    ("final-not-bool", {}, dict(output_final_state=torch.tensor(True)),
     r"output_final_state: expected True"),
]


@pytest.mark.parametrize("opts,kwargs,message", [c[1:] for c in ERRORS], ids=[c[0] for c in ERRORS])
def test_unsupported_is_refused(on_h100: list, opts: dict[str, Any], kwargs: dict[str, Any],
                                message: str) -> None:
    t = _tensors(**opts)
    with pytest.raises(kdagen.InputError, match=r"^kdagen\.fla: " + message):
        fla.chunk_kda(**t, **kwargs)
    assert on_h100 == []  # refused before any kernel is asked for


@pytest.mark.parametrize("disable_recompute", [False, True])
def test_disable_recompute_keeps_the_states(monkeypatch: pytest.MonkeyPatch, disable_recompute: bool) -> None:
    # FLA's disable_recompute keeps the forward's intermediates for the backward: recompute=False.
    kernels: list[FakeKernel] = []

    def fake_get_kernel(spec: Any, policy: Any = None, force: bool = False) -> FakeKernel:
        kernels.append(FakeKernel(spec))
        return kernels[-1]

    monkeypatch.setattr(fla, "device_arch", lambda device: "sm_90a")
    monkeypatch.setattr(kdagen, "get_kernel", fake_get_kernel)
    fla.chunk_kda(**_tensors(), disable_recompute=disable_recompute)
    assert kernels[-1].recompute is (not disable_recompute)


# ---- the call path --------------------------------------------------------------------------------------


def test_call_matches_the_reference(on_h100: list) -> None:
    t = _tensors(K=64, V=128, H=2, HV=4, T=9, beta_dtype=BF16)
    t["g"] = torch.randn_like(t["g"])  # raw gate input
    A_log, dt_bias = torch.randn(4) * 0.1, torch.randn(4 * 64) * 0.1
    h0 = torch.randn(2, 4, 128, 64)
    cu = torch.tensor([0, 4, 9], dtype=torch.int64)
    with pytest.warns(DeprecationWarning, match="transpose_state_layout"):
        o, ht = fla.chunk_kda(**t, scale=0.3, initial_state=h0, output_final_state=True,
                              use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, safe_gate=True,
                              lower_bound=-4.0, cu_seqlens=cu, cu_seqlens_cpu=cu, A_log=A_log,
                              dt_bias=dt_bias, transpose_state_layout=True, chunk_size=64, use_graph=True,
                              max_num_seqs=2)
    (spec,) = on_h100
    got = (spec.gate, spec.lower_bound, spec.safe_gate, spec.state_layout, spec.l2norm_qk, spec.gva_ratio)
    assert got == ("lower_bound", -4.0, True, "vk", True, 2)
    ref_o, ref_ht = kda_recurrent_reference(**t, scale=0.3, initial_state=h0, output_final_state=True,
                                            cu_seqlens=cu, gate="lower_bound", A_log=A_log, dt_bias=dt_bias,
                                            lower_bound=-4.0, l2norm_qk=True, state_layout="vk")
    assert torch.equal(o, ref_o.to(BF16)) and torch.equal(ht, ref_ht.float())


@pytest.mark.parametrize(("flags", "factor"), [
    (dict(use_beta_sigmoid_in_kernel=True), 1.0),
    (dict(use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True), 2.0),
])
def test_beta_logits_match_the_sigmoid_applied_first(on_h100: list, flags: dict[str, Any],
                                                     factor: float) -> None:
    # FLA's meaning of the flags: chunk_kda on logits equals chunk_kda on factor * sigmoid(logits).
    t = _tensors(T=7)
    t["beta"] = torch.randn(t["beta"].shape, generator=torch.Generator().manual_seed(4))  # logits
    h0 = torch.randn(1, 2, 64, 64)
    o, ht = fla.chunk_kda(**t, initial_state=h0, output_final_state=True, **flags)
    assert on_h100[-1].beta == ("logit_x2" if factor == 2.0 else "logit")
    prob = {**t, "beta": factor * torch.sigmoid(t["beta"].double())}
    ref_o, ref_ht = kda_recurrent_reference(**prob, initial_state=h0, output_final_state=True)
    torch.testing.assert_close(o, ref_o.to(BF16), rtol=0, atol=0.02)
    torch.testing.assert_close(ht, ref_ht.float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["fused_recurrent_kda", "fused_recurrent_kda_fwd"])
@pytest.mark.parametrize(("flags", "mode"), [
    ({}, "prob"),
    (dict(use_beta_sigmoid_in_kernel=True), "logit"),
    (dict(use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True), "logit_x2"),
    (dict(allow_neg_eigval=True), "prob"),
])
def test_recurrent_entry_points_pick_the_beta_mode(on_h100: list, name: str, flags: dict[str, Any],
                                                   mode: str) -> None:
    t = _tensors(T=1)
    getattr(fla, name)(**t, initial_state=torch.zeros(1, 2, 64, 64), **flags)
    assert on_h100[-1].beta == mode


def test_gate_parameters_are_ignored_without_the_in_kernel_gate(on_h100: list) -> None:
    # As in FLA, A_log and dt_bias are read only with use_gate_in_kernel=True (the runtime refuses them with
    # a precomputed gate, so passing them through would fail).
    t = _tensors()
    o, ht = fla.chunk_kda(**t, A_log=torch.zeros(2), dt_bias=torch.zeros(128))
    assert ht is None and tuple(o.shape) == (1, 6, 2, 64)
    assert on_h100[0].gate == "precomputed"


def test_positional_order_is_flas(on_h100: list) -> None:
    t = _tensors()
    o, ht = fla.chunk_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], 0.25, None, True)
    ref_o, ref_ht = kda_recurrent_reference(**t, scale=0.25, output_final_state=True)
    assert torch.equal(o, ref_o.to(BF16)) and torch.equal(ht, ref_ht.float())


# ---- FLA 0.6.0's signatures -------------------------------------------------------------------------------

# Parameter names in order, from fla-core 0.6.0's fla/ops/kda/chunk.py and fused_recurrent.py.
FLA_SIGNATURES = {
    "chunk_kda": "q k v g beta scale initial_state output_final_state use_qk_l2norm_in_kernel "
                 "use_gate_in_kernel use_beta_sigmoid_in_kernel allow_neg_eigval safe_gate lower_bound "
                 "disable_recompute return_intermediate_states state_v_first cu_seqlens cu_seqlens_cpu "
                 "cp_context use_graph max_num_seqs kwargs",
    "fused_recurrent_kda": "q k v g beta A_log dt_bias scale initial_state output_final_state "
                           "use_qk_l2norm_in_kernel use_gate_in_kernel use_beta_sigmoid_in_kernel "
                           "allow_neg_eigval lower_bound state_v_first cu_seqlens kwargs",
    "fused_recurrent_kda_fwd": "q k v g beta A_log dt_bias initial_state scale output_final_state "
                               "inplace_final_state state_v_first cu_seqlens ssm_state_indices "
                               "num_accepted_tokens use_qk_l2norm_in_kernel use_gate_in_kernel "
                               "use_beta_sigmoid_in_kernel allow_neg_eigval lower_bound out kwargs",
}


@pytest.mark.parametrize("name", sorted(FLA_SIGNATURES))
def test_signatures_are_flas(name: str) -> None:
    fn = getattr(fla, name)
    fn = getattr(fn, "__wrapped__", fn)  # torch.compiler.disable wraps chunk_kda
    assert list(inspect.signature(fn).parameters) == FLA_SIGNATURES[name].split()


def test_fused_recurrent_kda_is_the_forward(on_h100: list[kdagen.KernelSpec]) -> None:
    t = _tensors(T=5)
    h0 = torch.randn(1, 2, 64, 64)
    o, ht = fla.fused_recurrent_kda(**t, initial_state=h0, output_final_state=True)
    ref_o, ref_ht = FakeKernel(on_h100[-1])(**t, initial_state=h0, output_final_state=True)
    assert torch.equal(o, ref_o) and torch.equal(ht, ref_ht)


def _pool_call(t: dict[str, Any], pool: torch.Tensor, **kw: Any) -> tuple[Any, Any, FakeKernel]:
    kernels: list[FakeKernel] = []
    original = kdagen.get_kernel

    def remember(spec: Any, **k: Any) -> FakeKernel:
        kernel = original(spec, **k)
        kernels.append(kernel)
        return kernel

    kdagen.get_kernel = remember
    try:
        o, state = fla.fused_recurrent_kda_fwd(**t, initial_state=pool, **kw)
    finally:
        kdagen.get_kernel = original
    return o, state, kernels[-1]


def test_fused_recurrent_kda_fwd_with_indices_is_decode(on_h100: list[kdagen.KernelSpec]) -> None:
    t = {name: x.view(3, 2, *x.shape[2:]) for name, x in _tensors(T=6).items()}  # 3 requests, 2 tokens each
    pool = torch.zeros(8, 2, 64, 64)
    idx = torch.tensor([[0, 1], [2, 3], [4, 5]])
    accepted = torch.tensor([1, 2, 1])
    o, state, kernel = _pool_call(t, pool, ssm_state_indices=idx, num_accepted_tokens=accepted)
    assert state is pool and o.shape == t["v"].shape
    assert kernel.decoded["state_pool"] is pool and kernel.decoded["state_indices"] is idx
    assert kernel.decoded["num_accepted_tokens"] is accepted


def test_fused_recurrent_kda_fwd_without_indices_decodes_each_sequence_in_place(
    on_h100: list[kdagen.KernelSpec],
) -> None:
    t = {name: x.view(3, 2, *x.shape[2:]) for name, x in _tensors(T=6).items()}
    pool = torch.zeros(3, 2, 64, 64)
    _, state, kernel = _pool_call(t, pool)
    assert state is pool and torch.equal(kernel.decoded["state_indices"], torch.arange(3, dtype=torch.int32))


def test_fused_recurrent_kda_fwd_longer_pieces_are_prefill_on_the_pool(
    on_h100: list[kdagen.KernelSpec],
) -> None:
    t = {name: x.view(2, 12, *x.shape[2:]) for name, x in _tensors(T=24).items()}  # 2 pieces of 12 tokens
    pool = torch.zeros(5, 2, 64, 64)
    idx = torch.tensor([3, 1])
    o, state, kernel = _pool_call(t, pool, ssm_state_indices=idx)
    assert state is pool and o.shape == t["v"].shape
    assert kernel.prefilled["state_pool"] is pool and kernel.prefilled["state_indices"] is idx
    # the same without indices: the states as a pool of one slot each, no copy back
    _, state, kernel = _pool_call(t, torch.zeros(2, 2, 64, 64))
    assert torch.equal(kernel.prefilled["state_indices"], torch.arange(2, dtype=torch.int32))
    # packed pieces with offsets on the CPU: one of 9 tokens is longer than a decode step
    flat = _tensors(T=12)
    cu = torch.tensor([0, 3, 12])
    _, _, kernel = _pool_call(flat, pool, ssm_state_indices=idx, cu_seqlens=cu)
    assert kernel.prefilled["state_indices"] is idx
    _, _, kernel = _pool_call(flat, pool, ssm_state_indices=idx, cu_seqlens=torch.tensor([0, 4, 8]))
    assert hasattr(kernel, "decoded") and not hasattr(kernel, "prefilled")


@pytest.mark.parametrize(("kw", "message"), [
    ({"ssm_state_indices": torch.zeros(1, dtype=torch.int64), "inplace_final_state": False},
     "kdagen.fla: inplace_final_state: False with ssm_state_indices"),
    ({"num_accepted_tokens": torch.ones(1, dtype=torch.int64)}, "num_accepted_tokens: given without"),
    ({"bogus": 1}, "kdagen.fla: bogus: unknown keyword"),
])
def test_fused_recurrent_kda_fwd_refusals(on_h100: list[kdagen.KernelSpec], kw: dict[str, Any],
                                          message: str) -> None:
    t = _tensors(T=1)
    with pytest.raises(kdagen.InputError, match=message):
        fla.fused_recurrent_kda_fwd(**t, initial_state=torch.zeros(1, 2, 64, 64), **kw)


def test_lazy_attribute_from_a_light_import() -> None:
    code = ("import sys, kdagen\nassert 'torch' not in sys.modules\n"
            "assert callable(kdagen.fla.chunk_kda) and callable(kdagen.ops.kda_forward)\n")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)
