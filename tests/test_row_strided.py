"""Row-strided inputs and ``out=`` of the forward on the CPU: which views of one packed projection go to the
kernels as they are and which are copied (`kdagen.runtime.row_strided`, `KDAKernel._inputs`), the checks
of a bad ``out`` (InputError naming it), the validated-signature memo seeing strides and alignment, and the
``kdagen::forward`` op passing a strided view through to the kernel without a copy."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import kdagen
from kdagen import ops
from kdagen.errors import InputError
from kdagen.runtime import KDAKernel, _signature, row_strided, validate_forward_inputs
from kdagen.spec import KernelSpec

SPEC = KernelSpec(arch="sm_90a")  # K = V = 128, bf16, fp32 g and beta
GBF16 = KernelSpec(arch="sm_90a", g_dtype="bf16", beta_dtype="bf16")
B, T, H, K = 2, 5, 2, 128


def _packed(b: int = B, t: int = T, h: int = H, spec: KernelSpec = SPEC, pad: int = 0) -> dict[str, Any]:
    """q, k, v as slices of one bf16 projection [B, T, 3 H K + pad], g and beta of one gate projection in
    g's dtype [B, T, H K + 32 + pad] (beta there where the spec's beta dtype is g's, else apart)."""
    qkv = torch.randn(b, t, 3 * h * K + pad).to(torch.bfloat16)
    gdt = getattr(torch, {"fp32": "float32", "bf16": "bfloat16"}[spec.g_dtype])
    gb = torch.randn(b, t, h * K + 32 + pad).to(gdt)  # beta's columns start 16 elements after g's
    bdt = getattr(torch, {"fp32": "float32", "bf16": "bfloat16"}[spec.beta_dtype])
    beta = gb[..., h * K + 16:h * K + 16 + h] if bdt == gdt else torch.rand(b, t, h).to(bdt)
    return {
        "q": qkv[..., :h * K].view(b, t, h, K),
        "k": qkv[..., h * K:2 * h * K].view(b, t, h, K),
        "v": qkv[..., 2 * h * K:3 * h * K].view(b, t, h, K),
        "g": gb[..., :h * K].view(b, t, h, K),
        "beta": beta,
    }


def _kernel(spec: KernelSpec = SPEC) -> KDAKernel:
    kernel = object.__new__(KDAKernel)  # no stages: only the host-side decisions are exercised
    kernel.spec, kernel._validated = spec, {}
    return kernel


@pytest.mark.parametrize("spec", [SPEC, GBF16], ids=["g32", "gbf16"])
def test_packed_projection_slices_pass_without_a_copy(spec: KernelSpec) -> None:
    x = _packed(spec=spec)
    assert not any(t.is_contiguous() for t in x.values())
    assert _kernel(spec)._inputs(**x) == (True,) * 5
    assert validate_forward_inputs(spec, **x, require_cuda=False) == (B, T, H, H, B)
    # B = 1 (packed varlen): the batch stride is never read
    one = _packed(b=1, spec=spec)
    assert _kernel(spec)._inputs(**one) == (True,) * 5


def test_layouts_that_are_copied() -> None:
    x = _packed()
    kernel = _kernel()
    # a token stride that is not a multiple of 16 bytes (3 H K + 1 bf16 elements)
    odd = _packed(pad=1)
    assert kernel._inputs(**odd)[:4] == (False,) * 4 and kernel._inputs(**odd)[4]  # beta: any stride
    # a base off 16 bytes: the projection sliced one element in
    qkv = torch.randn(B, T, 3 * H * K + 8).to(torch.bfloat16)
    assert not kernel._inputs(**{**x, "q": qkv[..., 1:1 + H * K].view(B, T, H, K)})[0]
    # heads not compact (every other head of a wider projection)
    wide = torch.randn(B, T, 2 * H, K).to(torch.bfloat16)
    assert not kernel._inputs(**{**x, "q": wide[:, :, ::2]})[0]
    # B and T that do not fold: the first T tokens of a longer batch
    long = torch.randn(B, 2 * T, H, K).to(torch.bfloat16)
    assert not kernel._inputs(**{**x, "k": long[:, :T]})[1]
    assert kernel._inputs(**{**x, "k": long[:1, :T]})[1]  # ... but with B = 1 they do
    # a transposed view, and overlapping rows (a token stride below the row)
    assert not kernel._inputs(**{**x, "v": torch.randn(B, H, T, K).to(torch.bfloat16).transpose(1, 2)})[2]
    rows = torch.randn(T * K + H * K).to(torch.bfloat16)
    assert not row_strided(rows.as_strided((1, T, H, K), (0, K, K, 1)), 8)  # token stride K < H K
    # beta with a non-unit head stride
    assert not kernel._inputs(**{**x, "beta": torch.rand(B, T, 2 * H)[..., ::2]})[4]
    # contiguous inputs pass as before
    assert kernel._inputs(**{n: t.contiguous() for n, t in x.items()}) == (True,) * 5


def test_a_copied_input_is_compact() -> None:
    from kdagen.runtime import _compact

    x = _packed(pad=1)["q"]
    c = _compact(x)
    assert c.is_contiguous() and c.stride() == (T * H * K, H * K, K, 1) and torch.equal(c, x)
    assert c.data_ptr() % 16 == 0


def _out(b: int = B, t: int = T, h: int = H, **kw: Any) -> torch.Tensor:
    return torch.zeros(b, t, h, K, dtype=torch.bfloat16, **kw)


def test_good_out_is_accepted() -> None:
    x = _packed()
    assert validate_forward_inputs(SPEC, **x, out=_out(), require_cuda=False) == (B, T, H, H, B)
    wide = torch.zeros(B, T, H * K + 64, dtype=torch.bfloat16)  # row-strided: o beside another output
    assert validate_forward_inputs(SPEC, **x, out=wide[..., :H * K].view(B, T, H, K), require_cuda=False)


@pytest.mark.parametrize("make,message", [
    (lambda x: "o", "^out: expected a torch.Tensor, got str"),
    (lambda x: _out(t=T + 1),
     r"^out: expected shape \[B, T, HV, V\] = \[2, 5, 2, 128\], got \[2, 6, 2, 128\]"),
    (lambda x: _out().float(), "^out: expected dtype torch.bfloat16"),
    (lambda x: _out(device="meta"), "^out: expected a tensor on cpu"),
    (lambda x: torch.zeros(B, T, K, H, dtype=torch.bfloat16).transpose(2, 3),
     "^out: expected a contiguous or row-strided tensor"),
    (lambda x: torch.zeros(B, 2 * T, H, K, dtype=torch.bfloat16)[:, :T], "^out: expected a contiguous or "
     "row-strided tensor"),
    (lambda x: torch.zeros(B * T * H * K + 1, dtype=torch.bfloat16)[1:].view(B, T, H, K),
     "^out: expected a 16-byte aligned tensor"),
    (lambda x: x["v"], "^out: overlaps the memory of q"),  # v's rows interleave with q's in the projection
    (lambda x: _out().requires_grad_(), "^out: requires grad"),
])
def test_bad_out_is_named(make: Any, message: str) -> None:
    x = _packed()
    with pytest.raises(InputError, match=message):
        validate_forward_inputs(SPEC, **x, out=make(x), require_cuda=False)


def test_out_overlapping_a_contiguous_input_or_the_state() -> None:
    x = {n: t.contiguous() for n, t in _packed().items()}
    with pytest.raises(InputError, match="^out: overlaps the memory of v"):
        validate_forward_inputs(SPEC, **x, out=x["v"], require_cuda=False)
    h0 = torch.zeros(B, H, K, K)
    with pytest.raises(InputError, match="^out: overlaps the memory of the states"):
        validate_forward_inputs(SPEC, **x, initial_state=h0, out=h0.view(-1).view(torch.bfloat16)[
            :B * T * H * K].view(B, T, H, K), require_cuda=False)


def _sig(**kw: Any) -> tuple | None:
    base: dict[str, Any] = {"A_log": None, "dt_bias": None, "initial_state": None, "cu_seqlens": None}
    return _signature(**{**base, **kw})


def test_signature_sees_strides_alignment_and_out() -> None:
    x = _packed()
    contiguous = {n: t.contiguous() for n, t in x.items()}
    sig = _sig(**x)
    assert sig is not None and sig == _sig(**_packed()) and sig != _sig(**contiguous)
    odd = _packed(pad=8)  # another token stride (still a multiple of 16 bytes)
    qkv = torch.randn(B, T, 3 * H * K + 16).to(torch.bfloat16)
    shifted = {**x, "q": qkv[..., 8:8 + H * K].view(B, T, H, K)}  # same strides, 16-byte aligned
    misaligned = {**x, "q": qkv[..., 1:1 + H * K].view(B, T, H, K)}
    sigs = [_sig(**odd), _sig(**misaligned), _sig(**x, out=_out()), _sig(**x, out=_out().view(-1).view(
        B, T, H, K))]
    assert all(s is not None and s != sig for s in sigs)
    assert _sig(**shifted) != _sig(**misaligned)
    assert sigs[2] == sigs[3]  # the same out layout: one entry (out's address is checked every call)


# ---- the kdagen::forward op passes strided views through ---------------------------------------------------

PRE = dict(arch="sm_90a", head_dim_k=128, head_dim_v=128, gate="precomputed", safe_gate=False,
           lower_bound=None, l2norm_qk=False)


class Recorder:
    """A stand-in kernel that records the tensors it is given and returns zeros."""

    seen: list[dict[str, torch.Tensor]] = []

    def __init__(self, spec: KernelSpec) -> None:
        self.spec = spec

    def __call__(self, q, k, v, g, beta, **kw):
        Recorder.seen.append({"q": q, "k": k, "v": v, "g": g, "beta": beta})
        return q.new_zeros(v.shape), None


def test_forward_op_passes_strided_views(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kdagen, "get_kernel", lambda spec, policy=None, force=False: Recorder(
        kdagen.resolve_spec(spec)[1]))
    Recorder.seen.clear()
    x = _packed(b=1)
    x["g"] = -x["g"].abs()
    ops.kda_forward(PRE, **x)
    (seen,) = Recorder.seen
    for name, t in x.items():
        assert seen[name].data_ptr() == t.data_ptr() and seen[name].stride() == t.stride(), name
