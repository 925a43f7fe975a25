"""`KDAKernel`: validates a call, allocates outputs and workspaces, and launches the planned stages.

Contract (what is validated, what is the caller's duty):
- q, k: [B, T, H, K]; v: [B, T, HV, V]; g: [B, T, HV, K]; beta: [B, T, HV]; dtypes as the spec says. beta
  is a probability or logits as the spec's `beta` says; its values are not checked (that would synchronise).
  Row-strided inputs (slices of one packed projection, e.g. ``qkv[..., :H*K].view(B, T, H, K)``) are read
  in place, without a copy, when (`row_strided`): the head and element dims are compact (strides (K, 1),
  beta's head stride 1), the token stride is at least a row and a multiple of 16 bytes (beta: any), B and T
  fold into one token dim (B == 1, or stride(0) == T * stride(1)) and the base is 16-byte aligned. Any
  other layout (a transposed view, an odd token stride, a misaligned base) is copied first into a compact
  tensor (as FLA's input guard does).
- out (optional): the caller's buffer for o, [B, T, HV, V] in q's dtype on q's device, contiguous or
  row-strided as above, 16-byte aligned, overlapping no input's bytes (InputError otherwise); the call
  writes every element and returns it as o. Outputs never alias inputs.
- cu_seqlens: [N+1] int32/int64 on the inputs' device or on the CPU; B must be 1. Values (start at 0,
  non-decreasing, end <= B*T) are checked when they are on the CPU; device-resident values are the
  caller's duty, because reading them would synchronise with the GPU (`validate_cu_seqlens` does that
  check on request). The kernels clamp every offset they read into [0, T], so a call with device-resident
  values past the tokens of q or below zero still ends (no fault, no wait on a tile that no prepare CTA
  makes) and computes the clamped offsets; decreasing values give unspecified results.
  Tokens past cu_seqlens[-1] get o = 0.
- initial_state / final state: the spec's state dtype (fp32 or bf16), [N, HV, K, V] (`kv`) or
  [N, HV, V, K] (`vk`).
- Or a slot-indexed state pool, read and written in place (exclusive with initial_state and
  output_final_state): state_pool (the spec's state dtype) [P, HV, K, V] (`kv`) or [P, HV, V, K] (`vk`),
  compact within a slot, any slot stride at least a slot's size (a pool may interleave layers), 16-byte
  aligned;
  state_indices int32/int64 [N] on q's device: sequence n reads its initial state from slot idx[n] and
  writes its final state back there; a negative index is padding (nothing read or written, o = 0 for its
  tokens). has_initial_state bool [N] (optional): False starts that sequence from zero without the caller
  clearing its slot. Indices must be < P, and the live sequences' slots distinct (the caller's duty:
  checking would synchronise); slot arithmetic is 64-bit.
- Prefix-cache checkpoints (a pool only): checkpoint_interval C, a positive multiple of 16 tokens;
  checkpoint_indices int32/int64 [N, M]; start_positions int32/int64 [N] (optional, else 0): the tokens
  already in sequence n's state, so its piece covers absolute positions start .. start + len. The state at
  every absolute position p that is a multiple of C with start < p <= start + len (the state after the
  request's first p tokens) is written to pool slot checkpoint_indices[n, m], m = 0, 1, ... in order; a
  negative index, or m >= M, skips it. start_positions[n] must be a multiple of 16 and >= 0 (the caller's
  duty; a piece that starts elsewhere writes no checkpoints). Checkpoint slots must differ from every slot
  the call reads.
- A_log: fp32 [HV]; dt_bias: fp32, exactly [HV * K] (as FLA takes it) or [HV, K]; no other shape with as many
  elements is accepted. H >= 1.
- scale: None (K ** -0.5) or a finite real number > 0 (a Python or NumPy scalar, not a tensor or a bool).
- Training: with torch grad mode enabled, a compact-state forward whose inputs require grad records an
  autograd node (`kdagen.backward`); decode, the forward on a state pool and a forward into `out` have no
  backward and refuse such inputs (run them under `torch.no_grad()` / `torch.inference_mode()`).
- Sizes must fit the kernels' 32-bit index arithmetic: B*T*H*K (q, k), B*T*HV*K (g and the per-token
  workspace rows), B*T*HV*V (v, o) and N*HV*K*V (the compact states; not a pool's) are each at most
  2**31 - 1 elements.
- No host-device synchronisation, so a call can be captured in a CUDA graph.
"""

from __future__ import annotations

import contextlib
import copy
import math
import numbers
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake

from kdagen import workspace
from kdagen.compile import TENSOR_ALIGN
from kdagen.dtypes import DTYPES
from kdagen.errors import InputError
from kdagen.plan import CHUNK, Plan
from kdagen.policy import PlanFacts, Schedule, SchedulePolicy, default_policy
from kdagen.policy import schedule as decide
from kdagen.spec import KernelSpec

_TORCH_DTYPE = {name: getattr(torch, d.torch) for name, d in DTYPES.items()}
_ALIGN = TENSOR_ALIGN  # bytes: what the stages are compiled to assume of every tensor
# TVM-FFI takes the launch stream from torch itself when torch offers the DLPack C exchange API.
_TORCH_SETS_FFI_STREAM = hasattr(torch.Tensor, "__dlpack_c_exchange_api__")


def _need(cond: bool, msg: str | Callable[[], str]) -> None:
    # Messages that format values are passed as lambdas: a call checks ~30 conditions, and formatting every
    # message up front cost more host time than the launches (H200 host, B=1 T=512).
    if not cond:
        raise InputError(msg() if callable(msg) else msg)


def _check_tensor(
    name: str, t: Any, dtype: torch.dtype, shape: tuple[int, ...], device: torch.device
) -> None:
    if isinstance(t, torch.Tensor) and t.dtype == dtype and t.shape == shape and t.device == device:
        return
    _need(isinstance(t, torch.Tensor), lambda: f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    _need(t.dtype == dtype, lambda: f"{name}: expected dtype {dtype}, got {t.dtype}")
    _need(t.device == device, lambda: f"{name}: expected a tensor on {device} (where q is), got {t.device}")
    _need(tuple(t.shape) == shape, lambda: f"{name}: expected shape {list(shape)}, got {list(t.shape)}")


def row_strided(t: torch.Tensor, unit: int) -> bool:
    """True when `t` ([B, T, heads, D], or beta's [B, T, heads]) can go to the kernels as it is: its last
    dim(s) compact (strides (D, 1), or (1,) for beta's heads), a token stride at least a row's elements and a
    multiple of `unit` (16 bytes of elements: the stages' vector loads and TMA boxes; 1 for beta, read by
    element), B and T folding into one token dim (B == 1, or stride(0) == T * stride(1): the stages index
    the tokens of the packed batch) and the base 16-byte aligned."""
    st, shape = t.stride(), t.shape
    row = 1
    for i in range(len(shape) - 1, 1, -1):
        if st[i] != row:
            return False
        row *= shape[i]
    return (st[1] >= row and st[1] % unit == 0 and (shape[0] == 1 or st[0] == shape[1] * st[1])
            and t.data_ptr() % _ALIGN == 0)


def _compact(t: torch.Tensor) -> torch.Tensor:
    # A compact, 16-byte aligned copy (torch.empty's canonical strides even for dims of size 1).
    out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    out.copy_(t)
    return out


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    # [first, last + 1) bytes a tensor's elements occupy (its strides are non-negative).
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if n > 0)
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def check_out(out: Any, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
    """InputError unless `out` is a tensor of `shape` ([B, T, HV, V]) and `dtype` on `device`, contiguous
    or row-strided (`row_strided`: rows compact, a token stride of 16 bytes' multiple, B and T folding) and
    16-byte aligned. Its overlap with the inputs is `check_out_aliasing`'s (addresses: every call)."""
    _need(isinstance(out, torch.Tensor), lambda: f"out: expected a torch.Tensor, got {type(out).__name__}")
    _need(tuple(out.shape) == shape, lambda: f"out: expected shape [B, T, HV, V] = {list(shape)}, got "
          f"{list(out.shape)}")
    _need(out.dtype == dtype, lambda: f"out: expected dtype {dtype} (q's), got {out.dtype}")
    _need(out.device == device, lambda: f"out: expected a tensor on {device} (where q is), got {out.device}")
    if out.numel() == 0:
        return
    data = has_data(out)
    unit = _ALIGN // out.element_size()
    _need(out.is_contiguous() or not data or row_strided(out, unit), lambda: (
        f"out: expected a contiguous or row-strided tensor (strides (..., {shape[3]}, 1), a token stride of "
        f"at least {shape[2] * shape[3]} elements and a multiple of {unit}, stride(0) == T * stride(1) "
        f"unless B == 1), got strides {list(out.stride())}"))
    _need(not data or out.data_ptr() % _ALIGN == 0, "out: expected a 16-byte aligned tensor")


def check_out_aliasing(out: torch.Tensor, inputs: dict[str, Any]) -> None:
    """InputError when the bytes of `out` overlap those of a tensor of `inputs` (by address range: row
    slices of one buffer that interleave count as overlapping)."""
    if out.numel() == 0 or not has_data(out):
        return
    lo, hi = _byte_span(out)
    for name, t in inputs.items():
        if isinstance(t, torch.Tensor) and t.numel() and has_data(t):
            a, b = _byte_span(t)
            if a < hi and lo < b:
                raise InputError(f"out: overlaps the memory of {name}; pass a separate buffer")


def _prepared(t: torch.Tensor) -> torch.Tensor:
    # The compiled stages assume compact row-major, 16-byte aligned storage.
    if not t.is_contiguous() or t.data_ptr() % _ALIGN:
        t = t.contiguous() if not t.is_contiguous() else t.clone()
    return t


def _carve(buf: torch.Tensor, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    # A typed view of the workspace bytes at `offset` (see kdagen.workspace).
    return buf[offset:offset + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)


# Validated call signatures kept per kernel (cleared when full: an engine sees few distinct shapes).
_MAX_SIGNATURES = 256


def remember(cache: dict, key: Any, value: Any) -> Any:
    """Store `value` under `key` in a per-kernel cache of call signatures, emptied when it is full."""
    if len(cache) >= _MAX_SIGNATURES:
        cache.clear()
    cache[key] = value
    return value


def _props(t: Any) -> tuple | None:
    return None if t is None else (type(t), t.shape, t.dtype, t.device, t.requires_grad)


def _layout(t: Any) -> tuple:
    return (t.stride(), t.data_ptr() % _ALIGN)


def _signature(q: Any, k: Any, v: Any, g: Any, beta: Any, A_log: Any, dt_bias: Any, initial_state: Any,
               cu_seqlens: Any, state_pool: Any = None, state_indices: Any = None,
               has_initial_state: Any = None, output_final_state: Any = False,
               checkpoint_interval: Any = None, start_positions: Any = None,
               checkpoint_indices: Any = None, out: Any = None) -> tuple | None:
    """Everything the argument checks and the copy decisions read (type, shape, dtype, device of each
    tensor; the strides and alignment of q, k, v, g, beta and out, which decide which inputs go to the
    kernels as they are (`row_strided`); a pool's strides and alignment, and whether a compact final state
    is asked for beside it), or None when a call must be checked in full: cu_seqlens on the CPU (its values
    are checked) or an argument that is not a tensor (the checks then raise the error that names it)."""
    try:
        cu = _props(cu_seqlens)
        if cu is not None and cu[3].type == "cpu":
            return None
        pool = None
        if state_pool is not None or state_indices is not None or has_initial_state is not None \
                or checkpoint_interval is not None or start_positions is not None \
                or checkpoint_indices is not None:
            if checkpoint_interval is not None and type(checkpoint_interval) is not int:
                return None  # (checked in full: the check names it)
            pool = (_props(state_pool), state_pool.stride(), state_pool.data_ptr() % _ALIGN,
                    _props(state_indices), _props(has_initial_state), bool(output_final_state),
                    checkpoint_interval, _props(start_positions), _props(checkpoint_indices))
        layouts = (_layout(q), _layout(k), _layout(v), _layout(g), _layout(beta))
        return (_props(q), _props(k), _props(v), _props(g), _props(beta), _props(A_log), _props(dt_bias),
                _props(initial_state), cu, torch.is_grad_enabled(), pool, layouts,
                None if out is None else (_props(out), _layout(out)))
    except (AttributeError, RuntimeError):  # not a tensor, or one without an address (fake)
        return None


def has_data(t: torch.Tensor) -> bool:
    """False for a tensor with no values or address to read: a meta tensor, or a fake one (`FakeTensorMode`,
    `torch.compile`'s tracing). Checks that read values or addresses leave such a tensor out."""
    return not (t.is_meta or is_fake(t))


def validate_cu_seqlens(cu_seqlens: torch.Tensor, total_tokens: int | None = None) -> None:
    """Check the values of ``cu_seqlens`` (reads them on the host: synchronises if they live on a GPU)."""
    vals = cu_seqlens.detach().to("cpu", torch.int64)
    _need(vals.numel() >= 1, "cu_seqlens: expected at least one element [0, ...]")
    _need(int(vals[0]) == 0, lambda: f"cu_seqlens: expected cu_seqlens[0] == 0, got {int(vals[0])}")
    steps = vals[1:] - vals[:-1]
    if steps.numel() and int(steps.min()) < 0:
        bad = int(torch.nonzero(steps < 0)[0, 0])
        raise InputError(
            f"cu_seqlens: expected non-decreasing values, got {int(vals[bad])} then {int(vals[bad + 1])} "
            f"at index {bad}"
        )
    if total_tokens is not None:
        _need(
            int(vals[-1]) <= total_tokens,
            lambda: f"cu_seqlens: last value {int(vals[-1])} exceeds the {total_tokens} tokens of q",
        )


INT32_MAX = 2**31 - 1  # the kernels index tensors with 32-bit products of their (symbolic int32) dims


def state_shape(spec: KernelSpec, n: int, hv: int) -> tuple[int, int, int, int]:
    """The shape of the initial/final state of `n` sequences with `hv` value heads, in the spec's layout."""
    k, v = spec.head_dim_k, spec.head_dim_v
    return (n, hv, k, v) if spec.state_layout == "kv" else (n, hv, v, k)


def check_scale(scale: Any, head_dim_k: int) -> float:
    """`scale` as a float: None gives K ** -0.5; else a finite real number > 0 (InputError otherwise)."""
    if scale is None:
        return head_dim_k ** -0.5
    _need(isinstance(scale, numbers.Real) and not isinstance(scale, bool),
          lambda: f"scale: expected a finite real number > 0 or None, got {type(scale).__name__} {scale!r}")
    value = float(scale)
    _need(math.isfinite(value) and value > 0,
          lambda: f"scale: expected a finite real number > 0 or None, got {value!r}")
    return value


def _check_fits_int32(name: str, dims: dict[str, int]) -> None:
    n = math.prod(dims.values())
    _need(n <= INT32_MAX, lambda: (
        f"{name}: {'*'.join(dims)} = {'*'.join(map(str, dims.values()))} = {n} elements exceed the kernels' "
        f"32-bit index limit of 2**31 - 1 = {INT32_MAX}; split the call into smaller batches"
    ))


def refuse_grad(tensors: dict[str, Any]) -> None:
    """InputError naming the tensors of `tensors` that require grad, for the calls that have no backward:
    decode, the forward on a state pool, a forward into `out`."""
    wanting = [name for name, t in tensors.items() if isinstance(t, torch.Tensor) and t.requires_grad]
    _need(not wanting, lambda: (
        f"{', '.join(wanting)}: requires grad, but this call has no backward (decode, the forward on a state "
        "pool and a forward into out= are inference-only); call it under torch.no_grad() or "
        "torch.inference_mode(), or pass detached tensors"
    ))


def _check_no_grad(tensors: dict[str, Any]) -> None:
    if torch.is_grad_enabled():
        refuse_grad(tensors)


def validate_inputs(
    spec: KernelSpec,
    q: Any,
    k: Any,
    v: Any,
    g: Any,
    beta: Any,
    A_log: Any = None,
    dt_bias: Any = None,
    initial_state: Any = None,
    cu_seqlens: Any = None,
    *,
    require_cuda: bool = True,
    compact_state: bool = True,
) -> tuple[int, int, int, int, int]:
    """Every check of a call's tensor arguments for `spec` (InputError naming the argument and what was
    expected); returns (B, T, H, HV, N). Nothing here needs a GPU; `require_cuda=False` leaves out the check
    that q is a CUDA tensor, so the other checks can be run on CPU, meta or fake tensors (the values of a
    meta or fake cu_seqlens are not read). `compact_state=False`: the states live in a pool
    (`check_state_pool`), so the 32-bit limit of compact [N, ...] states does not apply."""
    kdim, vdim = spec.head_dim_k, spec.head_dim_v
    dt = _TORCH_DTYPE[spec.dtype]
    # ---- shapes, dtypes, devices (nothing is launched or written before all checks pass) ----
    _need(isinstance(q, torch.Tensor), lambda: f"q: expected a torch.Tensor, got {type(q).__name__}")
    _need(q.dim() == 4, lambda: f"q: expected 4 dims [B, T, H, K], got shape {list(q.shape)}")
    device = q.device
    if require_cuda:
        _need(device.type == "cuda", lambda: f"q: expected a CUDA tensor, got device {device}")
    bsz, seqlen, nh, kq = q.shape
    _need(nh >= 1, lambda: f"q: expected at least one head (H >= 1 in [B, T, H, K]), got {list(q.shape)}")
    _need(kq == kdim, lambda: f"q: expected head dim K={kdim} (the spec's head_dim_k), got {kq}")
    _need(q.dtype == dt, lambda: f"q: expected dtype {dt} (the spec's dtype {spec.dtype}), got {q.dtype}")
    _check_tensor("k", k, dt, (bsz, seqlen, nh, kdim), device)
    _need(isinstance(v, torch.Tensor) and v.dim() == 4,
          lambda: f"v: expected 4 dims [B, T, HV, V], got {getattr(v, 'shape', v)}")
    hv = v.shape[2]
    _need(hv % nh == 0 and hv // nh == spec.gva_ratio,
          lambda: f"v: expected HV = gva_ratio * H = {spec.gva_ratio} * {nh} = {spec.gva_ratio * nh} "
          f"value heads (HV must be a multiple of H), got HV={hv}")
    _check_tensor("v", v, dt, (bsz, seqlen, hv, vdim), device)
    _check_tensor("g", g, _TORCH_DTYPE[spec.g_dtype], (bsz, seqlen, hv, kdim), device)
    _check_tensor("beta", beta, _TORCH_DTYPE[spec.beta_dtype], (bsz, seqlen, hv), device)

    total = bsz * seqlen
    if cu_seqlens is None:
        nseq = bsz
    else:
        _need(isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.dim() == 1,
              "cu_seqlens: expected a 1-D tensor [N+1]")
        _need(cu_seqlens.dtype in (torch.int32, torch.int64),
              lambda: f"cu_seqlens: expected dtype torch.int32 or torch.int64, got {cu_seqlens.dtype}")
        _need(cu_seqlens.device == device or cu_seqlens.device.type == "cpu",
              lambda: f"cu_seqlens: expected a tensor on {device} or on the CPU, got {cu_seqlens.device}")
        _need(bsz == 1, lambda: f"q: with cu_seqlens the batch must be packed as B=1, got B={bsz}")
        _need(cu_seqlens.numel() >= 1, "cu_seqlens: expected at least one element [0, ...]")
        if cu_seqlens.device.type == "cpu" and has_data(cu_seqlens):
            validate_cu_seqlens(cu_seqlens, total)
        nseq = cu_seqlens.numel() - 1

    if spec.gate == "softplus":
        _need(A_log is not None, "A_log: required by the softplus gate (gate: softplus in the spec)")
    if spec.gate != "precomputed":
        if A_log is not None:
            _check_tensor("A_log", A_log, torch.float32, (hv,), device)
        if dt_bias is not None:
            _need(isinstance(dt_bias, torch.Tensor) and tuple(dt_bias.shape) in ((hv * kdim,), (hv, kdim)),
                  lambda: f"dt_bias: expected shape [HV*K] = [{hv * kdim}] or [HV, K] = [{hv}, {kdim}], got "
                  f"{list(getattr(dt_bias, 'shape', [type(dt_bias).__name__]))}")
            _check_tensor("dt_bias", dt_bias, torch.float32, tuple(dt_bias.shape), device)
    else:
        _need(A_log is None and dt_bias is None,
              "A_log/dt_bias: given, but the spec's gate is 'precomputed' (g is already the log-decay)")
    if initial_state is not None:
        _check_tensor("initial_state", initial_state, _TORCH_DTYPE[spec.state_dtype],
                      state_shape(spec, nseq, hv), device)

    # ---- sizes the kernels' 32-bit index arithmetic can address ----
    _check_fits_int32("q/k", {"B": bsz, "T": seqlen, "H": nh, "K": kdim})
    _check_fits_int32("g", {"B": bsz, "T": seqlen, "HV": hv, "K": kdim})
    _check_fits_int32("v/o", {"B": bsz, "T": seqlen, "HV": hv, "V": vdim})
    if compact_state:
        _check_fits_int32("state", {"N": nseq, "HV": hv, "K": kdim, "V": vdim})

    _check_no_grad({"q": q, "k": k, "v": v, "g": g, "beta": beta, "A_log": A_log, "dt_bias": dt_bias,
                    "initial_state": initial_state})
    return bsz, seqlen, nh, hv, nseq


def slot_shape(spec: KernelSpec, hv: int) -> tuple[int, int, int]:
    """The shape of one slot of a state pool (the state of one sequence) in the spec's layout."""
    return state_shape(spec, 1, hv)[1:]  # type: ignore[return-value]


def check_state_pool(spec: KernelSpec, state_pool: Any, hv: int, device: torch.device) -> None:
    """InputError unless `state_pool` is a pool of the spec's state dtype, [P, HV, K, V] (`kv`) or
    [P, HV, V, K] (`vk`) on `device`, compact within a slot, with a slot stride of at least a slot's size
    (any larger one: a pool may interleave layers) and 16-byte aligned slots. Decode and the forward on a
    pool share it."""
    _need(isinstance(state_pool, torch.Tensor), lambda: (
        f"state_pool: expected a torch.Tensor, got {type(state_pool).__name__}"))
    want = slot_shape(spec, hv)
    dims = "[P, HV, K, V]" if spec.state_layout == "kv" else "[P, HV, V, K]"
    _need(state_pool.dim() == 4 and tuple(state_pool.shape[1:]) == want, lambda: (
        f"state_pool: expected {dims} = [P, {', '.join(map(str, want))}] (state_layout "
        f"{spec.state_layout!r}), got {list(state_pool.shape)}"))
    sdt = _TORCH_DTYPE[spec.state_dtype]
    _need(state_pool.dtype == sdt, lambda: (
        f"state_pool: expected dtype {sdt} (the spec's state_dtype), got {state_pool.dtype}"))
    _need(state_pool.device == device, lambda: (
        f"state_pool: expected a tensor on {device} (where q is), got {state_pool.device}"))
    slot = want[0] * want[1] * want[2]
    inner = (want[1] * want[2], want[2], 1)
    _need(tuple(state_pool.stride()[1:]) == inner, lambda: (
        f"state_pool: expected each slot compact (strides {list(inner)} after the slot's), got strides "
        f"{list(state_pool.stride())}"))
    _need(state_pool.shape[0] <= 1 or state_pool.stride(0) >= slot, lambda: (
        f"state_pool: expected a slot stride of at least a slot's {slot} elements, got "
        f"{state_pool.stride(0)}"))
    aligned = not has_data(state_pool) or state_pool.data_ptr() % _ALIGN == 0
    _need(aligned and (state_pool.stride(0) * state_pool.element_size()) % _ALIGN == 0, lambda: (
        "state_pool: expected 16-byte aligned slots (the base pointer and the slot stride in bytes)"))


def check_index_tensor(name: str, t: Any, device: torch.device, shape_ok: Callable[[torch.Tensor], bool],
                       expected: str) -> None:
    """InputError unless `t` is an int32/int64 tensor on `device` whose shape passes `shape_ok` (`expected`
    says which shape): the checks of every tensor of indices, slots or token counts."""
    _need(isinstance(t, torch.Tensor), lambda: f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    _need(t.dtype in (torch.int32, torch.int64), lambda: (
        f"{name}: expected dtype torch.int32 or torch.int64, got {t.dtype}"))
    _need(t.device == device, lambda: f"{name}: expected a tensor on {device} (where q is), got {t.device}")
    _need(shape_ok(t), lambda: f"{name}: expected {expected}, got {list(t.shape)}")


def check_state_indices(state_indices: Any, n: int, device: torch.device, *, unit: str,
                        columns: bool = False) -> int:
    """InputError unless `state_indices` is an int32/int64 tensor on `device` of shape [N] (or, with
    `columns`, [N, M]) for the call's `n` sequences or requests (`unit` names them in the message); returns
    M (1 for [N])."""
    dims = (1, 2) if columns else (1,)
    form = "[N] or [N, M]" if columns else "[N]"
    check_index_tensor("state_indices", state_indices, device, lambda t: t.dim() in dims and t.shape[0] == n,
                       f"{form} with N = {n} {unit}")
    return 1 if state_indices.dim() == 1 else state_indices.shape[1]


def check_has_initial_state(has_initial_state: Any, n: int, device: torch.device) -> None:
    """InputError unless `has_initial_state` is a bool tensor [N] on `device`."""
    t = has_initial_state
    _need(isinstance(t, torch.Tensor) and t.dtype == torch.bool and t.shape == (n,), lambda: (
        f"has_initial_state: expected a bool tensor [N] = [{n}], got "
        f"{getattr(t, 'dtype', type(t).__name__)} {list(getattr(t, 'shape', []))}"))
    _need(t.device == device, lambda: f"has_initial_state: expected a tensor on {device}, got {t.device}")


def check_state_form(state_pool: Any, state_indices: Any, has_initial_state: Any, initial_state: Any,
                     output_final_state: Any, checkpoint_interval: Any = None, start_positions: Any = None,
                     checkpoint_indices: Any = None) -> None:
    """InputError where a forward call mixes the two forms of its states: compact (initial_state,
    output_final_state) and a pool (state_pool with state_indices, optionally has_initial_state and
    prefix-cache checkpoints), or gives checkpoint arguments without checkpoint_interval."""
    if checkpoint_interval is None:
        _need(checkpoint_indices is None, "checkpoint_indices: given without checkpoint_interval (the tokens "
              "between checkpoints)")
        _need(start_positions is None, "start_positions: given without checkpoint_interval (it places the "
              "checkpoints)")
    if state_pool is None:
        _need(checkpoint_interval is None, "checkpoint_interval: given without state_pool (checkpoints are "
              "written into pool slots)")
        _need(state_indices is None,
              "state_indices: given without state_pool (the pool whose slots it names)")
        _need(has_initial_state is None, "has_initial_state: given without state_pool; it flags the pool "
              "slots to read (with compact states, pass initial_state or not)")
        return
    _need(initial_state is None, "initial_state: given together with state_pool; pass the initial states "
          "either compact (initial_state) or in the pool (state_pool with state_indices), not both")
    _need(not output_final_state, "output_final_state: True together with state_pool; the final states "
          "are written back into the pool's slots in place, and no compact final state is returned")
    _need(state_indices is not None, "state_indices: required with state_pool (one slot per sequence)")


def check_checkpoints(checkpoint_interval: Any, start_positions: Any, checkpoint_indices: Any, n: int,
                      device: torch.device) -> None:
    """InputError unless the prefix-cache checkpoint arguments are a positive multiple of 16 tokens
    (checkpoint_interval), int32/int64 [N, M] pool slots on `device` (checkpoint_indices) and, where given,
    int32/int64 [N] start positions on `device`."""
    c = checkpoint_interval
    _need(isinstance(c, numbers.Integral) and not isinstance(c, bool) and c > 0 and c % CHUNK == 0, lambda: (
        f"checkpoint_interval: expected a positive multiple of {CHUNK} (tokens between checkpoints), got "
        f"{c!r}"))
    _need(checkpoint_indices is not None,
          "checkpoint_indices: required with checkpoint_interval ([N, M] pool slots)")
    check_index_tensor("checkpoint_indices", checkpoint_indices, device,
                       lambda t: t.dim() == 2 and t.shape[0] == n and t.shape[1] >= 1,
                       f"[N, M] with N = {n} sequences and M >= 1")
    if start_positions is not None:
        check_index_tensor("start_positions", start_positions, device,
                           lambda t: t.dim() == 1 and t.shape[0] == n, f"a tensor [N] = [{n}]")


def validate_forward_inputs(
    spec: KernelSpec,
    q: Any,
    k: Any,
    v: Any,
    g: Any,
    beta: Any,
    A_log: Any = None,
    dt_bias: Any = None,
    initial_state: Any = None,
    cu_seqlens: Any = None,
    state_pool: Any = None,
    state_indices: Any = None,
    has_initial_state: Any = None,
    output_final_state: Any = False,
    checkpoint_interval: Any = None,
    start_positions: Any = None,
    checkpoint_indices: Any = None,
    out: Any = None,
    *,
    require_cuda: bool = True,
) -> tuple[int, int, int, int, int]:
    """Every check of a forward call (`KDAKernel.__call__`): `validate_inputs`, with ``state_pool`` the
    pool form's (the pool, the indices, has_initial_state, the checkpoints; neither initial_state nor
    output_final_state beside it), and with ``out`` the output buffer's (`check_out`,
    `check_out_aliasing`). Returns (B, T, H, HV, N)."""
    check_state_form(state_pool, state_indices, has_initial_state, initial_state, output_final_state,
                     checkpoint_interval, start_positions, checkpoint_indices)
    if state_pool is None:
        sizes = validate_inputs(spec, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens,
                                require_cuda=require_cuda)
        _validate_out(spec, out, sizes, q, k, v, g, beta, initial_state)
        return sizes
    sizes = validate_inputs(spec, q, k, v, g, beta, A_log, dt_bias, None, cu_seqlens,
                            require_cuda=require_cuda, compact_state=False)
    _validate_out(spec, out, sizes, q, k, v, g, beta, state_pool)
    _bsz, _seqlen, _nh, hv, nseq = sizes
    device = q.device
    check_state_pool(spec, state_pool, hv, device)
    check_state_indices(state_indices, nseq, device, unit="sequences")
    if has_initial_state is not None:
        check_has_initial_state(has_initial_state, nseq, device)
    if checkpoint_interval is not None:
        check_checkpoints(checkpoint_interval, start_positions, checkpoint_indices, nseq, device)
    _check_no_grad({"state_pool": state_pool})  # (validate_inputs checked q, k, v, g, beta, A_log, dt_bias)
    return sizes


def _validate_out(spec: KernelSpec, out: Any, sizes: tuple[int, ...], q: Any, k: Any, v: Any, g: Any,
                  beta: Any, state: Any) -> None:
    if out is None:
        return
    bsz, seqlen, _nh, hv, _n = sizes
    check_out(out, (bsz, seqlen, hv, spec.head_dim_v), _TORCH_DTYPE[spec.dtype], q.device)
    check_out_aliasing(out, {"q": q, "k": k, "v": v, "g": g, "beta": beta, "the states": state})
    _check_no_grad({"out": out})


def _zero_fresh_slots(state_pool: torch.Tensor, idx: torch.Tensor, has_initial_state: torch.Tensor) -> None:
    # A call with no tokens launches no kernel, yet a sequence that starts from zero (has_initial_state
    # False) still ends with a zero state in its slot. On the device, without a synchronisation: the slots
    # to clear are marked by a scatter, then cleared in one masked fill.
    fresh = (idx >= 0) & ~has_initial_state
    marks = torch.zeros(state_pool.shape[0], dtype=torch.int32, device=state_pool.device)
    marks.index_add_(0, idx.clamp(min=0).long(), fresh.to(torch.int32))
    state_pool.masked_fill_((marks > 0).view(-1, 1, 1, 1), 0.0)


def _cp_buffers(total: int, nseq: int, hv: int, kdim: int, vdim: int, seg_len: int,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Intra-card CP's per-segment buffers, the forward's and the backward's: the prescan's maps (B^T rows,
    then M's bf16 planes in the bytes of K fp32 rows) and the merge's state (or gradient) for every
    segment, over the segment-slot map's bound (as for tiles)."""
    slots = total // seg_len + nseq + 1
    cp_maps = torch.empty((slots, hv, vdim + kdim, kdim), dtype=torch.float32, device=device)
    seg_states = torch.empty((slots, hv, vdim, kdim), dtype=torch.float32, device=device)
    return cp_maps, seg_states


class KDAKernel:
    """A loaded, ready-to-call KDA forward for one spec.

    Scheduling (intra-card CP, prepare beside the recurrence, the fused kernel and its pair form, sequence
    order) follows a `kdagen.policy.SchedulePolicy`: the kernel's own (`policy`; `default_policy()` unless
    given), a view's (`with_policy`), or a call's (``policy=``). Decisions are pure functions of the call's
    sizes (`kdagen.policy.schedule`), cached per size; no environment is read per call.
    """

    def __init__(self, spec: KernelSpec, plan: Plan, stages: dict[str, Callable], name: str | None = None,
                 policy: SchedulePolicy | Mapping[str, Any] | None = None):
        self.spec = spec
        self.plan = plan
        self.name = name
        self._forward = stages["forward"]  # the whole-sequence path: setup, prepare, recurrence in one call
        self._prepare = stages["prepare"]  # alone, for the intra-card CP path
        self._cp = (stages["cp_prescan"], stages["cp_merge"], stages["cp_segments"])
        self._decode = stages.get("decode")  # a few tokens a request on a state pool (kdagen.decode)
        self._decode_stream = stages.get("decode_stream")  # the same, streamed by a persistent grid
        self._bwd_prepare = stages.get("bwd_prepare")  # prepare, also writing the tiles' Mqk and Akk
        self._bwd_scan = stages.get("bwd_scan")  # the backward's reverse state scan (kdagen.backward)
        self._bwd_states = stages.get("bwd_states")  # the recurrence alone on its tiles: the kept states
        # and its intra-card CP: the segments' maps, their merge last to first, the segment pass
        self._bwd_cp = tuple(stages.get(f"bwd_cp_{part}") for part in ("prescan", "merge", "segments"))
        self._bwd_tile = stages.get("bwd_tile")  # the backward's products with the states, a tile at a time
        self._bwd_grads = stages.get("bwd_grads")  # the backward's per-tile algebra after bwd_tile
        params = {s.name: s.params for s in plan.stages}
        # Prepare CTAs per SM: alone (intra-card CP path) and beside the recurrence (plain path).
        self._prepare_ctas = (params["prepare"]["ctas_per_sm"], params["prepare"]["overlap_ctas_per_sm"])
        self._prepare_heads_per_cta = params["prepare"]["heads_per_cta"]
        # Tiles between the states the forward keeps for the backward (`kdagen.backward.tile_states`).
        self.bwd_state_tiles: int = params["bwd_tile"]["state_tiles"]
        # What the scheduling decisions need of the plan, and the policy they follow (kdagen.policy).
        self._facts = PlanFacts.from_plan(spec, plan)
        self._policy: SchedulePolicy = SchedulePolicy.coerce(policy) or default_policy()
        self._schedules: dict[tuple, Schedule] = {}
        self._dummies: dict[tuple, torch.Tensor] = {}
        self._elem_bytes = _TORCH_DTYPE[spec.dtype].itemsize
        # signature -> (B, T, H, HV, N) (decode), or that and which inputs pass without a copy (forward)
        self._validated: dict[tuple, Any] = {}
        import tvm_ffi

        self._ffi = tvm_ffi

    def __repr__(self) -> str:
        return f"KDAKernel({self.name or self.spec.slug()}, family={self.plan.family})"

    def _state_shape(self, n: int, hv: int) -> tuple[int, int, int, int]:
        return state_shape(self.spec, n, hv)

    @property
    def _state_dtype(self) -> torch.dtype:
        """The states' storage dtype (the spec's state_dtype): initial and final states, pools."""
        return _TORCH_DTYPE[self.spec.state_dtype]

    @property
    def policy(self) -> SchedulePolicy:
        """The scheduling policy of this kernel's calls (a call's ``policy=`` overrides it for that call)."""
        return self._policy

    def with_policy(self, policy: SchedulePolicy | Mapping[str, Any]) -> KDAKernel:
        """A view of this kernel whose calls use `policy` (a `SchedulePolicy` or a dict of its fields).

        The view shares the loaded stages, the helper tensors and the validated call signatures with this
        kernel (nothing is loaded or compiled again) and keeps its own cache of decisions; this kernel is
        unchanged."""
        view = copy.copy(self)
        view._policy = SchedulePolicy.coerce(policy)  # type: ignore[assignment]
        view._schedules = {}
        return view

    def schedule(self, num_seqs: int, total_tokens: int, num_v_heads: int, sms: int,
                 policy: SchedulePolicy | None = None) -> Schedule:
        """The decisions (`kdagen.policy.Schedule`) a call of this size makes on a device of `sms` SMs under
        `policy` (default: the kernel's). Pure host work; calls cache it per size."""
        policy = self._policy if policy is None else policy
        return decide(num_seqs, total_tokens, num_v_heads, sms, self._facts, policy)

    def cp_segment_len(
        self, num_seqs: int, total_tokens: int, num_v_heads: int, device: torch.device | None = None
    ) -> int | None:
        """Segment length intra-card CP would use for a call of this size on `device` (default: the current
        CUDA device) under the kernel's policy, or None for whole sequences, for tools that report the
        schedule, such as the benchmark's serial floor."""
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return self.schedule(num_seqs, total_tokens, num_v_heads, self._sm_count(device)).seg_len

    def _schedule(self, nseq: int, total: int, hv: int, sms: int, policy: SchedulePolicy | None) -> Schedule:
        # Cached per call size (and per policy for a call's own): the cost model weighs up to a dozen options.
        key: tuple = (nseq, total, hv, sms) if policy is None or policy is self._policy else \
            (nseq, total, hv, sms, policy)
        found = self._schedules.get(key)
        if found is None:
            found = remember(self._schedules, key, self.schedule(nseq, total, hv, sms, policy))
        return found

    def _sm_count(self, device: torch.device) -> int:
        return self._cached(
            ("sms", device), lambda: torch.cuda.get_device_properties(device).multi_processor_count
        )

    def _cached(self, key: tuple, make: Callable[[], torch.Tensor]) -> Any:
        # Constant helper tensors (zero gate parameters, unused state slots) are made once per device/shape,
        # so steady-state calls allocate only outputs and workspaces.
        t = self._dummies.get(key)
        if t is None:
            t = self._dummies[key] = make()
        return t

    def _no_pool(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        # One-element stand-ins for state_indices (int32) and has_initial_state (bytes) where the stages
        # read neither (no pool; every sequence's flag implied).
        return (self._cached(("idx", device), lambda: torch.zeros(1, dtype=torch.int32, device=device)),
                self._cached(("init", device), lambda: torch.zeros(1, dtype=torch.uint8, device=device)))

    def _no_checkpoints(self, device: torch.device) -> torch.Tensor:
        # checkpoint_indices' one-element stand-in where the stages read none (no checkpoints, or slots the
        # stage derives itself); -1 would skip, were it read.
        return self._cached(("ckpt", device),
                            lambda: torch.full((1, 1), -1, dtype=torch.int32, device=device))

    def _unused_state(self, device: torch.device, hv: int) -> torch.Tensor:
        # A one-slot zero state (the state dtype) where a stage's initial or final state is not read or
        # written: no initial state given, no final state asked for.
        return self._cached(("state", device, hv), lambda: torch.zeros(
            self._state_shape(1, hv), dtype=self._state_dtype, device=device))

    def _no_start(self, device: torch.device) -> torch.Tensor:
        # start_positions' one-element zero where none are given (the kernels extend it with zeros).
        return self._cached(("start", device), lambda: torch.zeros(1, dtype=torch.int32, device=device))

    def _gate_args(self, A_log: Any, dt_bias: Any, hv: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        # (A_log [HV], dt_bias [HV * K]) for an in-kernel gate, zeros where not given; () for a precomputed g.
        if self.spec.gate == "precomputed":
            return ()
        kdim = self.spec.head_dim_k
        a_log = A_log if A_log is not None else self._cached(
            ("zeros", device, hv), lambda: torch.zeros(hv, dtype=torch.float32, device=device))
        if dt_bias is None:
            bias = self._cached(("zeros", device, hv * kdim),
                                lambda: torch.zeros(hv * kdim, dtype=torch.float32, device=device))
        else:  # [HV * K], as FLA takes it and the forward stage reads it
            bias = _prepared(dt_bias if dt_bias.dim() == 1 else dt_bias.reshape(hv * kdim))
        return (_prepared(a_log), bias)

    def _stream_scope(self, device: torch.device) -> Any:
        # The stages launch on TVM-FFI's environment stream, which must be torch's current stream (calls then
        # order with surrounding torch work and are recorded by CUDA-graph capture). A torch with the DLPack
        # exchange API (2.10+) hands TVM-FFI that stream with the first tensor argument; an older one needs it
        # set explicitly, which costs a stream query per call.
        if _TORCH_SETS_FFI_STREAM:
            return contextlib.nullcontext()
        ffi_device = self._cached(("ffi", device), lambda: self._ffi.device(f"cuda:{device.index or 0}"))
        return self._ffi.use_raw_stream(ffi_device, torch.cuda.current_stream(device).cuda_stream)

    def decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        *,
        state_pool: torch.Tensor,
        state_indices: torch.Tensor,
        scale: float | None = None,
        A_log: torch.Tensor | None = None,
        dt_bias: torch.Tensor | None = None,
        num_accepted_tokens: torch.Tensor | None = None,
        has_initial_state: torch.Tensor | None = None,
        update_state: bool = True,
        cu_seqlens: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Decode or speculative-decode verify on a slot-indexed state pool, in place; returns o
        [N, S, HV, V] (or `out`). Gate, beta and l2norm as in the forward. The contract (shapes, slots,
        padding, FLA's verify semantics): `kdagen.decode`."""
        from kdagen.decode import run_decode

        if self._decode is None:
            raise InputError(f"{self.name or self.spec.slug()}: this build has no decode stage; rebuild it")
        return run_decode(self, q, k, v, g, beta, state_pool=state_pool, state_indices=state_indices,
                          scale=scale, A_log=A_log, dt_bias=dt_bias, num_accepted_tokens=num_accepted_tokens,
                          has_initial_state=has_initial_state, update_state=update_state,
                          cu_seqlens=cu_seqlens, out=out)

    def _validate(
        self,
        q: Any,
        k: Any,
        v: Any,
        g: Any,
        beta: Any,
        A_log: Any,
        dt_bias: Any,
        initial_state: Any,
        cu_seqlens: Any,
        state_pool: Any = None,
        state_indices: Any = None,
        has_initial_state: Any = None,
        output_final_state: Any = False,
        checkpoint_interval: Any = None,
        start_positions: Any = None,
        checkpoint_indices: Any = None,
        out: Any = None,
    ) -> tuple[int, int, int, int, int]:
        """Every check of a call's arguments (InputError naming the argument); returns (B, T, H, HV, N)."""
        return validate_forward_inputs(self.spec, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens,
                                       state_pool, state_indices, has_initial_state, output_final_state,
                                       checkpoint_interval, start_positions, checkpoint_indices, out)

    def _inputs(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor) -> tuple[bool, ...]:
        """Which of q, k, v, g, beta go to the kernels as they are (`row_strided`: compact or row-strided
        and aligned); the others are copied. Decided once per call signature."""
        # A token stride must be a multiple of 16 bytes' elements (beta, read by element: any).
        spec = self.spec
        units = (*(_ALIGN // _TORCH_DTYPE[d].itemsize for d in (spec.dtype,) * 3 + (spec.g_dtype,)), 1)
        return tuple(t.numel() == 0 or (t.is_contiguous() and t.data_ptr() % _ALIGN == 0)
                     or row_strided(t, unit) for t, unit in zip((q, k, v, g, beta), units))

    def _run_prepare(self, q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     gate_args: tuple[torch.Tensor, ...], cu: torch.Tensor, ws: workspace.Workspace,
                     buf: torch.Tensor, sizes: tuple[int, ...], scale: float,
                     sms: int, mats: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """Prepare alone (the intra-card CP path, the backward): its per-tile intermediates carved from the
        workspace `buf` ((kd, qd, akt [T, HV, K], aq [T, HV, 16], gt [tile slots, HV, K]) and cu_seqlens
        clamped into [0, T] (the setup kernel's job on the plain path: prepare and the stages after it search
        the offsets without clamps of their own). With `mats` ([tile slots, HV, 2, 16, 16] fp32, the
        backward's) the `bwd_prepare` stage runs instead and also writes every tile's Mqk and Akk there.
        Launched on the current stream; returns (kd, qd, akt, aq, gt, cu)."""
        bsz, seqlen, nh, hv, nseq = sizes
        total, kdim, dt = bsz * seqlen, self.spec.head_dim_k, _TORCH_DTYPE[self.spec.dtype]
        buf = buf.view(-1)
        kd, qd, akt = (_carve(buf, off, dt, (total, hv, kdim)) for off in (0, ws.qd, ws.akt))
        aq = _carve(buf, ws.aq, dt, (total, hv, CHUNK))
        gt = _carve(buf, ws.gt, torch.float32, (ws.tile_slots, hv, kdim))
        ready = _carve(buf, ws.ready, torch.int32, (ws.tile_slots, hv))  # raised by prepare, unread here
        cu = torch.clamp(cu, 0, total, out=_carve(buf, ws.cu, torch.int32, (nseq + 1,)))
        items = ws.tile_slots * -(-hv // self._prepare_heads_per_cta)
        prepare_ctas = max(1, min(items, self._prepare_ctas[0] * sms))
        if gate_args:
            gate_args = (gate_args[0], gate_args[1].view(hv, kdim))
        inputs = (q.view(total, nh, kdim), k.view(total, nh, kdim), g.view(total, hv, kdim),
                  beta.view(total, hv), *gate_args, cu, kd, qd, akt, aq, gt, ready)
        if mats is None:
            self._prepare(*inputs, float(scale), prepare_ctas, 0)
        else:
            self._bwd_prepare(*inputs, mats, float(scale), prepare_ctas, 0)
        return kd, qd, akt, aq, gt, cu

    def _run_states(self, kd: torch.Tensor, qd: torch.Tensor, akt: torch.Tensor, aq: torch.Tensor,
                    gt: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, ws: workspace.Workspace,
                    buf: torch.Tensor, initial_state: torch.Tensor | None, states: torch.Tensor,
                    scratch: torch.Tensor) -> None:
        """The backward's kept states from prepare's tiles (after `_run_prepare` into `ws` / `buf`, whose
        ready flags it has raised): the recurrence alone (`bwd_states`) from each sequence's initial state
        (zero when None) writes the state entering every run of bwd_tile's tiles into `states`, at the
        slots `kdagen.kernels.run_map` derives from the offsets (no map from the host). Its o goes to
        `scratch` ([T, HV, V] in the MMA type), a buffer the caller writes again later. On the current
        stream."""
        total, hv, _ = kd.shape
        nseq = cu.numel() - 1
        device = kd.device
        ready = _carve(buf.view(-1), ws.ready, torch.int32, (ws.tile_slots, hv))
        # No ranking (by_length 0) and the two-stage path's mode word (0) in order[N].
        order = self._cached(("order", device, nseq), lambda: torch.zeros(nseq + 1, dtype=torch.int32,
                                                                           device=device))
        unused = self._unused_state(device, hv)
        h0 = _prepared(initial_state) if initial_state is not None else unused
        idx, init = self._no_pool(device)
        start = self._no_start(device)
        no_ck = self._no_checkpoints(device)
        with self._stream_scope(device):
            # to_tiles 2: the slots from the offsets, the entering state included (checkpoint_indices unread)
            has_h0, store_ht, pooled, to_tiles, by_length = int(initial_state is not None), 0, 0, 2, 0
            self._bwd_states(kd, qd, akt, aq, gt, v, cu, ready, order, h0, unused, idx, init, start,
                             no_ck, states, has_h0, store_ht, pooled, self.bwd_state_tiles, to_tiles,
                             scratch, by_length)

    def _run_reverse_scan(self, kd: torch.Tensor, qd: torch.Tensor, akt: torch.Tensor, aq: torch.Tensor,
                          gt: torch.Tensor, do: torch.Tensor, cu: torch.Tensor, dht: torch.Tensor,
                          dh0: torch.Tensor, dh: torch.Tensor, has_dht: int,
                          policy: SchedulePolicy | None) -> None:
        """The backward's reverse scan (`kdagen.backward`) after `_run_prepare` (its tiles and clamped `cu`):
        the state's gradient leaving every tile into `dh`, and `dh0`. Intra-card CP splits the sequences into
        segments where the forward's schedule for this call would (the scan's serial chain is the forward
        recurrence's, step for step, so the same decision fits): segment maps, their merge last segment to
        first from `dht`, and every segment's pass from its merged gradient. On the current stream."""
        total, hv, kdim = kd.shape
        vdim = do.shape[2]
        nseq = cu.numel() - 1
        device = kd.device
        sched = self._schedule(nseq, total, hv, self._sm_count(device), policy)
        if sched.seg_len is None:
            self._bwd_scan(kd, qd, akt, aq, gt, do, cu, dht, dh0, dh, has_dht)
            return
        prescan, merge, segments = self._bwd_cp
        seg_len = sched.seg_len
        cp_maps, seg_dh = _cp_buffers(total, nseq, hv, kdim, vdim, seg_len, device)
        idx, init = self._no_pool(device)
        prescan(kd, qd, akt, aq, gt, do, cu, cp_maps, seg_len)
        merge(cp_maps, cu, dht, idx, init, seg_dh, has_dht, 0, seg_len)
        segments(kd, qd, akt, aq, gt, do, cu, seg_dh, dh0, dh, seg_len)

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        *,
        scale: float | None = None,
        A_log: torch.Tensor | None = None,
        dt_bias: torch.Tensor | None = None,
        initial_state: torch.Tensor | None = None,
        output_final_state: bool = False,
        cu_seqlens: torch.Tensor | None = None,
        policy: SchedulePolicy | None = None,
        state_pool: torch.Tensor | None = None,
        state_indices: torch.Tensor | None = None,
        has_initial_state: torch.Tensor | None = None,
        checkpoint_interval: int | None = None,
        start_positions: torch.Tensor | None = None,
        checkpoint_indices: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        recompute: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The forward of the spec: ``(o, final_state or None)``; o is ``out`` when given (the caller's
        [B, T, HV, V] buffer, contiguous or row-strided: the module's contract).

        With grad enabled and an input that requires grad (q, k, v, g, beta, A_log, dt_bias,
        initial_state), the call goes through the ``kdagen::forward_train`` op and records its autograd
        node (`kdagen.backward` has the backward): compact states only, no ``out``. The backward needs the
        state entering every 64 tokens: ``recompute=True`` reruns the forward for them in the backward,
        False keeps them from the forward (K x V in the spec's dtype per 64 tokens and value head: 2x o's
        bytes at K = V = 128).

        q, k, v, g and beta may be row-strided views (slices of one packed projection): read in place when
        their rows are compact, the token stride is a multiple of 16 bytes (beta: any), B and T fold into
        one token dim and the base is 16-byte aligned (`row_strided`); otherwise they are copied first.

        With ``state_pool`` and ``state_indices`` (the module's contract) each sequence starts from its
        pool slot (or from zero where ``has_initial_state`` is False) and its final state is written back
        into that slot in place: ``(o, None)``; with ``checkpoint_interval`` and ``checkpoint_indices`` the
        states at every multiple of the interval (absolute positions, from ``start_positions``) go into the
        pool too. `policy` (a `kdagen.policy.SchedulePolicy`) schedules this
        call instead of the kernel's own (`with_policy` makes a kernel view that keeps one); scheduling
        never changes the results beyond the rounding of the chosen path (the fused paths are bit-identical
        to the two-stage path)."""
        if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in (
                q, k, v, g, beta, A_log, dt_bias, initial_state)):
            from kdagen.ops import kda_forward

            # The op loads the spec's kernel afresh: a view's policy (`with_policy`) goes with the call.
            if policy is None and self._policy != default_policy():
                policy = self._policy
            return kda_forward(self.spec, q, k, v, g, beta, scale=scale, A_log=A_log, dt_bias=dt_bias,
                               initial_state=initial_state, output_final_state=output_final_state,
                               cu_seqlens=cu_seqlens, policy=policy, state_pool=state_pool,
                               state_indices=state_indices, has_initial_state=has_initial_state,
                               checkpoint_interval=checkpoint_interval, start_positions=start_positions,
                               checkpoint_indices=checkpoint_indices, out=out, recompute=recompute)
        return self._prefill(q, k, v, g, beta, scale=scale, A_log=A_log, dt_bias=dt_bias,
                             initial_state=initial_state, output_final_state=output_final_state,
                             cu_seqlens=cu_seqlens, policy=policy, state_pool=state_pool,
                             state_indices=state_indices, has_initial_state=has_initial_state,
                             checkpoint_interval=checkpoint_interval, start_positions=start_positions,
                             checkpoint_indices=checkpoint_indices, out=out)

    def _prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        *,
        scale: float | None,
        A_log: torch.Tensor | None,
        dt_bias: torch.Tensor | None,
        initial_state: torch.Tensor | None,
        output_final_state: bool,
        cu_seqlens: torch.Tensor | None,
        policy: SchedulePolicy | None,
        state_pool: torch.Tensor | None,
        state_indices: torch.Tensor | None,
        has_initial_state: torch.Tensor | None,
        checkpoint_interval: int | None,
        start_positions: torch.Tensor | None,
        checkpoint_indices: torch.Tensor | None,
        out: torch.Tensor | None,
        tile_states: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`__call__` without autograd. With `tile_states` (the backward's: [slots, HV, ...] in the state
        layout, the spec's dtype, contiguous) the checkpoints go to its slots instead of the pool's."""
        spec = self.spec
        kdim, vdim = spec.head_dim_k, spec.head_dim_v
        dt = _TORCH_DTYPE[spec.dtype]

        # ---- shapes, dtypes, devices (nothing is launched or written before all checks pass) ----
        # The checks depend only on the properties in `sig`, so a call whose signature was validated before
        # skips them (a small call is bound by host time, and the checks were ~15 us of it on an H100 host).
        # The signature also records the inputs' strides and alignment, so the memo keeps which inputs go to
        # the kernels as they are (`_inputs`); only out's overlap with the inputs (addresses) is checked on
        # every call.
        sig = _signature(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, state_pool,
                         state_indices, has_initial_state, output_final_state, checkpoint_interval,
                         start_positions, checkpoint_indices, out)
        found = self._validated.get(sig) if sig is not None else None
        if found is None:
            sizes = self._validate(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, state_pool,
                                   state_indices, has_initial_state, output_final_state, checkpoint_interval,
                                   start_positions, checkpoint_indices, out)
            found = (sizes, self._inputs(q, k, v, g, beta))
            if sig is not None:
                remember(self._validated, sig, found)
        elif out is not None:
            check_out_aliasing(out, {"q": q, "k": k, "v": v, "g": g, "beta": beta,
                                     "the states": state_pool if state_pool is not None else initial_state})
        sizes, direct = found
        bsz, seqlen, nh, hv, nseq = sizes
        total = bsz * seqlen
        device = q.device
        scale = check_scale(scale, kdim)
        pooled = state_pool is not None

        # ---- nothing to launch for empty inputs ----
        if total == 0 or nseq == 0:
            o = torch.zeros((bsz, seqlen, hv, vdim), dtype=dt, device=device) if out is None else out.zero_()
            ht = None
            if pooled:
                if nseq and has_initial_state is not None:
                    _zero_fresh_slots(state_pool, state_indices, has_initial_state)
            elif output_final_state:
                ht = torch.zeros(self._state_shape(nseq, hv), dtype=self._state_dtype, device=device)
                if initial_state is not None:
                    ht.copy_(initial_state)
            return o, ht

        if cu_seqlens is None:
            cu = self._cached(("cu", device, bsz, seqlen), lambda: torch.arange(
                0, total + 1, seqlen, dtype=torch.int32, device=device))
        elif cu_seqlens.dtype != torch.int32 or cu_seqlens.device != device:
            cu = cu_seqlens.to(device=device, dtype=torch.int32, non_blocking=True)
        else:
            cu = cu_seqlens
        cu = _prepared(cu)
        if not all(direct):
            q, k, v, g, beta = (t if ok else _compact(t) for t, ok in zip((q, k, v, g, beta), direct))

        gate_args = self._gate_args(A_log, dt_bias, hv, device)
        ht = None
        if pooled:
            # The pool is read and written in place (h0 and ht are the same tensor, its slot stride passed
            # as it is); the kernels take the slots as int32 and the flags as bytes.
            h0 = ht_arg = state_pool
            idx = _prepared(state_indices if state_indices.dtype == torch.int32
                            else state_indices.to(torch.int32))
            init = self._no_pool(device)[1]
            if has_initial_state is not None:
                init = _prepared(has_initial_state.view(torch.uint8))
            has_h0, store_ht = (1 if has_initial_state is None else 2), 1
        else:
            unused = self._unused_state(device, hv)
            h0 = _prepared(initial_state) if initial_state is not None else unused
            idx, init = self._no_pool(device)
            if output_final_state:
                ht = torch.empty(self._state_shape(nseq, hv), dtype=self._state_dtype, device=device)
            ht_arg = ht if ht is not None else unused
            has_h0, store_ht = int(initial_state is not None), int(ht is not None)
        # Prefix-cache checkpoints: the pieces' start positions (absent: the one-element zero, which the
        # kernels extend with zeros) and the checkpoints' slots, or one-element dummies with every = 0.
        start = self._no_start(device)
        ckpt = self._no_checkpoints(device)
        every = 0
        if checkpoint_interval is not None:
            every = checkpoint_interval // CHUNK
            ckpt = _prepared(checkpoint_indices if checkpoint_indices.dtype == torch.int32
                             else checkpoint_indices.to(torch.int32))
            if start_positions is not None:
                start = _prepared(start_positions if start_positions.dtype == torch.int32
                                  else start_positions.to(torch.int32))
        if tile_states is None:
            tiles, ck_tiles = self._cached(("tiles", device, hv), lambda: torch.zeros(
                self._state_shape(1, hv), dtype=dt, device=device)), 0
        else:
            assert tile_states.dtype == dt and tile_states.is_contiguous() and every, "tile_states"
            tiles, ck_tiles = tile_states, 1
        states = (h0, ht_arg, idx, init, start, ckpt, tiles)

        # ---- one workspace for the per-tile intermediates (kda-math.md §2.3 folded form) ----
        ws = workspace.layout(total, hv, nseq, kdim, self._elem_bytes)
        buf = torch.empty((ws.size // workspace.ROW, workspace.ROW), dtype=torch.uint8, device=device)
        o = out if out is not None else torch.empty((bsz, seqlen, hv, vdim), dtype=dt, device=device)

        stream_scope = self._stream_scope(device)
        sms = self._sm_count(device)
        sched = self._schedule(nseq, total, hv, sms, policy)
        items = ws.tile_slots * -(-hv // self._prepare_heads_per_cta)
        with stream_scope:
            if sched.seg_len is None:
                # Prepare is a persistent grid (every CTA resident at once) that lets the recurrence launch
                # at once (the recurrence follows the ready flags). Beside the recurrence (`sched.beside`)
                # prepare takes fewer CTAs per SM so that the two run side by side; otherwise the
                # recurrence's CTAs take the SMs as prepare's CTAs leave, with no wait for the last of them.
                # Tokens past cu_seqlens[-1] (engine padding) get o = 0 from the recurrence itself.
                prepare_ctas = max(1, min(items, self._prepare_ctas[1 if sched.beside else 0] * sms))
                self._forward(q, k, g, beta, *gate_args, cu, v, *states, o, buf, ws.qd, ws.akt, ws.aq, ws.gt,
                              ws.ready, ws.order, ws.cu, float(scale), prepare_ctas, 1, has_h0, store_ht,
                              int(pooled), every, ck_tiles, int(sched.by_length), *sched.fused_args)
                return o, ht
            kd, qd, akt, aq, gt, cu = self._run_prepare(q, k, g, beta, gate_args, cu, ws, buf, sizes, scale,
                                                        sms)
            v2, o2 = v.view(total, hv, vdim), o.view(total, hv, vdim)
            prescan, merge, segments = self._cp
            seg_len = sched.seg_len
            cp_maps, seg_h0 = _cp_buffers(total, nseq, hv, kdim, vdim, seg_len, device)
            prescan(kd, qd, akt, aq, gt, v2, cu, cp_maps, seg_len)
            # The merge reads each sequence's initial state, the segment pass writes its final one (on a
            # pool, the same slot: the merge has read it by then).
            merge(cp_maps, cu, h0, idx, init, seg_h0, has_h0, int(pooled), seg_len)
            segments(kd, qd, akt, aq, gt, v2, cu, seg_h0, ht_arg, idx, start, ckpt, tiles, store_ht,
                     int(pooled), every, ck_tiles, o2, seg_len)
        return o, ht
