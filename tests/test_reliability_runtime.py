"""Argument checks of the forward that need no GPU (CPU and meta tensors): heads, dt_bias, scale, grad,
and the 32-bit index limits of the kernels."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch

from kdagen.errors import InputError
from kdagen.runtime import INT32_MAX, KDAKernel, _signature, check_scale, validate_inputs
from kdagen.spec import KernelSpec

SPEC = KernelSpec(arch="sm_90a")  # K = V = 128, gva 1, gate lower_bound, bf16, fp32 g and beta


def _inputs(
    spec: KernelSpec = SPEC, b: int = 1, t: int = 8, h: int = 2, device: str = "cpu"
) -> dict[str, Any]:
    hv = h * spec.gva_ratio
    kd, vd = spec.head_dim_k, spec.head_dim_v

    def make(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=device)

    return {
        "q": make((b, t, h, kd), torch.bfloat16),
        "k": make((b, t, h, kd), torch.bfloat16),
        "v": make((b, t, hv, vd), torch.bfloat16),
        "g": make((b, t, hv, kd), torch.float32),
        "beta": make((b, t, hv), torch.float32),
    }


def _error(spec: KernelSpec = SPEC, **args: Any) -> str:
    with pytest.raises(InputError) as info:
        validate_inputs(spec, **args, require_cuda=False)
    return str(info.value)


def _ok(spec: KernelSpec = SPEC, **args: Any) -> tuple[int, ...]:
    return validate_inputs(spec, **args, require_cuda=False)


def test_valid_cpu_inputs_pass_all_but_the_device_check():
    assert _ok(**_inputs()) == (1, 8, 2, 2, 1)
    with pytest.raises(InputError, match="^q: expected a CUDA tensor, got device cpu$"):
        validate_inputs(SPEC, **_inputs())


def test_no_heads_is_an_input_error():
    msg = _error(**_inputs(h=0))
    assert msg == "q: expected at least one head (H >= 1 in [B, T, H, K]), got [1, 8, 0, 128]"


@pytest.mark.parametrize("shape", [(128, 2), (64, 2, 2), (2, 128, 1), (1, 256)])
def test_dt_bias_must_be_hv_k(shape: tuple[int, ...]):
    msg = _error(**_inputs(), dt_bias=torch.zeros(shape))
    assert msg == f"dt_bias: expected shape [HV*K] = [256] or [HV, K] = [2, 128], got {list(shape)}"


@pytest.mark.parametrize("shape", [(256,), (2, 128)])
def test_dt_bias_shapes_accepted(shape: tuple[int, ...]):
    assert _ok(**_inputs(), dt_bias=torch.zeros(shape)) == (1, 8, 2, 2, 1)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), 0.0, -0.1, "0.1", True,
                                 torch.tensor(0.1), None.__class__])
def test_scale_must_be_a_finite_positive_real(bad: Any):
    with pytest.raises(InputError) as info:
        check_scale(bad, 128)
    assert str(info.value).startswith("scale: expected a finite real number > 0 or None, got ")


def test_scale_accepted():
    assert check_scale(None, 128) == 128 ** -0.5
    assert check_scale(0.25, 128) == 0.25
    assert check_scale(1, 128) == 1.0 and isinstance(check_scale(1, 128), float)
    assert check_scale(np.float32(0.5), 128) == 0.5


def test_call_checks_scale_before_allocating(monkeypatch: pytest.MonkeyPatch):
    kernel = object.__new__(KDAKernel)
    kernel.spec, kernel._validated = SPEC, {}
    monkeypatch.setattr(KDAKernel, "_validate", lambda self, *args: (1, 8, 2, 2, 1))
    x = _inputs()

    def no_alloc(*args: Any, **kwargs: Any):
        raise AssertionError("allocated before the scale was checked")

    for name in ("empty", "zeros", "arange"):
        monkeypatch.setattr(torch, name, no_alloc)
    for bad in (float("nan"), "0.1"):
        with pytest.raises(InputError, match="^scale: "):
            kernel(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=bad)


def test_inputs_that_require_grad_are_refused_where_there_is_no_backward():
    # validate_inputs is what decode and the pool forward run; the compact forward routes grad first.
    x = _inputs()
    x["q"].requires_grad_(True)
    x["g"].requires_grad_(True)
    msg = _error(**x)
    assert msg.startswith("q, g: requires grad, but this call has no backward (decode, the forward on a")
    dt_bias = torch.zeros(256, requires_grad=True)
    assert _error(**_inputs(), dt_bias=dt_bias).startswith("dt_bias: requires grad")
    with torch.no_grad():
        assert _ok(**x) == (1, 8, 2, 2, 1)
    with torch.inference_mode():
        assert _ok(**x) == (1, 8, 2, 2, 1)


def test_signature_sees_grad():
    # A call validated without grad must not let a later call with grad skip the checks.
    x = _inputs()
    args = {**x, "A_log": None, "dt_bias": None, "initial_state": None, "cu_seqlens": None}
    plain = _signature(**args)
    with torch.no_grad():
        assert _signature(**args) != plain
    assert _signature(**{**args, "q": x["q"].clone().requires_grad_(True)}) != plain


# -- 32-bit index limits (meta tensors: no memory) -----------------------------------------------------------


def test_q_k_past_int32_is_refused():
    t = 2**31 // (2 * 128)  # B*T*H*K = 2**31
    msg = _error(**_inputs(t=t, device="meta"))
    assert msg.startswith(f"q/k: B*T*H*K = 1*{t}*2*128 = {2**31} elements exceed the kernels' 32-bit index")
    assert str(INT32_MAX) in msg
    assert _ok(**_inputs(t=t - 1, device="meta")) == (1, t - 1, 2, 2, 1)


def test_v_o_past_int32_is_refused():
    spec = SPEC.replace(head_dim_k=64)
    t = 2**31 // (2 * 128)  # q, k and g fit (K = 64), v and o do not (V = 128)
    assert _error(spec, **_inputs(spec, t=t, device="meta")).startswith("v/o: B*T*HV*V = ")


def test_g_past_int32_is_refused():
    spec = SPEC.replace(gva_ratio=2)
    t = 2**31 // (2 * 2 * 128)  # q and k fit (H = 2); g, v and o do not (HV = 4)
    assert _error(spec, **_inputs(spec, t=t, device="meta")).startswith("g: B*T*HV*K = ")


def test_state_past_int32_is_refused():
    n = 2**31 // (2 * 128 * 128)  # N*HV*K*V = 2**31 with HV = 2
    cu = torch.zeros(n + 1, dtype=torch.int32, device="meta")
    msg = _error(**_inputs(t=8, device="meta"), cu_seqlens=cu)
    assert msg.startswith(f"state: N*HV*K*V = {n}*2*128*128 = {2**31} elements exceed")
    assert math.prod((n - 1, 2, 128, 128)) <= INT32_MAX
