"""Drop-ins for FLA's KDA entry points (fla-core 0.6.0, ``fla/ops/kda``), with FLA's keyword names.

``from kdagen.fla import chunk_kda`` replaces ``from fla.ops.kda import chunk_kda`` for the forward: the spec
is chosen from the tensors and the flags (`choose_spec`), built or loaded through `kdagen.get_kernel`, and
called; the return form is FLA's ``(o, final_state or None)``.

How FLA's arguments become a `KernelSpec`:

| FLA | spec field |
|---|---|
| the CUDA device of q (capability 8.0, 8.9, 9.0, 10.0) | ``arch`` sm_80, sm_89, sm_90a, sm_100a |
| q.shape[-1], v.shape[-1] | ``head_dim_k``, ``head_dim_v`` (64 or 128) |
| v.shape[2] / q.shape[2] | ``gva_ratio`` (1, 2, 4, 8) |
| q.dtype, g.dtype, beta.dtype | ``dtype`` (bf16, fp16), ``g_dtype``, ``beta_dtype`` (fp32, bf16) |
| ``use_gate_in_kernel`` with ``lower_bound`` | ``gate: lower_bound``, that bound |
| ``use_gate_in_kernel`` without ``lower_bound`` | ``gate: softplus`` (A_log required) |
| ``use_gate_in_kernel=False`` | ``gate: precomputed``; with ``safe_gate``, bound ``lower_bound`` or -5 |
| ``safe_gate`` | ``safe_gate`` |
| ``use_qk_l2norm_in_kernel`` | ``l2norm_qk`` |
| ``state_v_first`` (old name ``transpose_state_layout``) | ``state_layout`` ``vk`` (else ``kv``) |
| ``use_beta_sigmoid_in_kernel`` | ``beta: logit`` (beta holds logits; sigmoid(beta) in the kernel) |
| ``use_beta_sigmoid_in_kernel`` and ``allow_neg_eigval`` | ``beta: logit_x2`` (2 sigmoid(beta)) |
| neither | ``beta: prob`` |

As in FLA, ``A_log``/``dt_bias`` are read only with ``use_gate_in_kernel=True``, ``lower_bound`` only
with the in-kernel gate or ``safe_gate``, and ``allow_neg_eigval`` only with ``use_beta_sigmoid_in_kernel``
(FLA's rule: alone it leaves beta as given). Whatever kdagen does not build (another head dim, an fp32 q, a
backward option, context parallelism, an unknown keyword) raises a `kdagen.InputError` that names the keyword
and what is supported: never a silent fallback.

`fused_recurrent_kda` (the token recurrence over any length: the forward) and `fused_recurrent_kda_fwd`
(the serving step on a state pool: `KDAKernel.decode`) keep FLA's signatures.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch

import kdagen
from kdagen.dtypes import DTYPES
from kdagen.errors import InputError
from kdagen.spec import SAFE_LOWER_BOUND_MIN, KernelSpec

__all__ = ["chunk_kda", "fused_recurrent_kda", "fused_recurrent_kda_fwd", "choose_spec", "device_arch"]


# The exact target of each compute capability kdagen builds for.
_ARCH_OF_CAPABILITY: dict[tuple[int, int], str] = {(8, 0): "sm_80", (8, 9): "sm_89", (9, 0): "sm_90a",
                                                   (10, 0): "sm_100a"}
_DTYPE_NAME = {getattr(torch, d.torch): name for name, d in DTYPES.items()}
_HEAD_DIMS = (64, 128)
_GVA_RATIOS = (1, 2, 4, 8)
_FLA_CHUNK_SIZES = (32, 64)  # what FLA accepts; kdagen's kernels step 16 tokens, with the same results


def _refuse(keyword: str, message: str) -> InputError:
    return InputError(f"kdagen.fla: {keyword}: {message}")


@functools.cache
def _arch_of(device_index: int) -> str:
    cap = torch.cuda.get_device_capability(device_index)
    arch = _ARCH_OF_CAPABILITY.get(cap)
    if arch is None:
        known = ", ".join(f"{a} ({c[0]}.{c[1]})" for c, a in _ARCH_OF_CAPABILITY.items())
        raise InputError(f"q: device cuda:{device_index} has compute capability {cap[0]}.{cap[1]}, which "
                         f"kdagen does not build for (targets: {known})")
    return arch


def device_arch(device: torch.device) -> str:
    """The exact kdagen target of the CUDA device `device` (cached per device)."""
    if device.type != "cuda":
        raise InputError(f"q: expected a CUDA tensor, got device {device}")
    return _arch_of(device.index if device.index is not None else torch.cuda.current_device())


def _dtype_name(name: str, t: Any, allowed: tuple[str, ...]) -> str:
    if not isinstance(t, torch.Tensor):
        raise _refuse(name, f"expected a torch.Tensor, got {type(t).__name__}")
    found = _DTYPE_NAME.get(t.dtype)
    if found not in allowed:
        shown = ", ".join(str(d) for d, n in _DTYPE_NAME.items() if n in allowed)
        raise _refuse(name, f"dtype {t.dtype} is not built by kdagen (supported: {shown})")
    return found  # type: ignore[return-value]


def _head_dim(name: str, t: torch.Tensor, what: str) -> int:
    if t.dim() != 4:
        raise _refuse(name, f"expected 4 dims [B, T, heads, {what}], got shape {list(t.shape)}")
    d = int(t.shape[-1])
    if d not in _HEAD_DIMS:
        raise _refuse(name, f"head dim {what}={d} is not built by kdagen (supported: "
                      f"{', '.join(map(str, _HEAD_DIMS))})")
    return d


def _gate_fields(use_gate_in_kernel: bool, safe_gate: bool, lower_bound: float | None,
                 A_log: Any) -> dict[str, Any]:
    """The spec's gate, lower_bound and safe_gate from FLA's gate flags (FLA's own rules, then kdagen's)."""
    safe = bool(safe_gate)
    if not use_gate_in_kernel:
        if not safe:
            return {"gate": "precomputed", "safe_gate": False, "lower_bound": None}  # FLA ignores the bound
        lb = SAFE_LOWER_BOUND_MIN if lower_bound is None else float(lower_bound)
        if not SAFE_LOWER_BOUND_MIN <= lb < 0:
            raise _refuse("lower_bound", f"safe_gate=True needs lower_bound in [{SAFE_LOWER_BOUND_MIN:g}, 0) "
                          f"(the promised bound of the precomputed g), got {lower_bound}")
        return {"gate": "precomputed", "safe_gate": True, "lower_bound": lb}
    if lower_bound is None:
        if safe:
            raise _refuse("lower_bound", "safe_gate=True with use_gate_in_kernel=True needs a lower_bound in "
                          f"[{SAFE_LOWER_BOUND_MIN:g}, 0) (as in FLA); got None")
        if A_log is None:
            raise _refuse("A_log", "use_gate_in_kernel=True without lower_bound (the softplus gate "
                          "-exp(A_log) * softplus(g + dt_bias)) needs A_log [HV]; got None")
        return {"gate": "softplus", "safe_gate": False, "lower_bound": None}
    lb = float(lower_bound)
    if safe and not SAFE_LOWER_BOUND_MIN <= lb < 0:
        raise _refuse("lower_bound", f"safe_gate=True needs lower_bound in [{SAFE_LOWER_BOUND_MIN:g}, 0), "
                      f"got {lower_bound}")
    if not lb < 0:
        raise _refuse("lower_bound", f"the lower_bound gate lower_bound * sigmoid(...) needs a bound < 0, "
                      f"got {lower_bound}")
    return {"gate": "lower_bound", "safe_gate": safe, "lower_bound": lb}


@functools.lru_cache(maxsize=256)
def _spec(fields: tuple[tuple[str, Any], ...]) -> KernelSpec:
    return KernelSpec(**dict(fields))


def _beta_mode(use_beta_sigmoid_in_kernel: bool, allow_neg_eigval: bool) -> str:
    """The spec's beta from FLA's two flags: allow_neg_eigval doubles the in-kernel sigmoid and, as in FLA,
    does nothing without it."""
    if not use_beta_sigmoid_in_kernel:
        return "prob"
    return "logit_x2" if allow_neg_eigval else "logit"


def choose_spec(
    q: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    A_log: Any = None,
    arch: str | None = None,
) -> KernelSpec:
    """The `KernelSpec` that `chunk_kda` runs for these tensors and FLA flags (`InputError` naming the
    keyword for what kdagen does not build). `arch` defaults to q's CUDA device's (`device_arch`)."""
    dtype = _dtype_name("q", q, ("bf16", "fp16"))
    kdim, vdim = _head_dim("q", q, "K"), _head_dim("v", v, "V")
    h, hv = int(q.shape[2]), int(v.shape[2])
    if h < 1 or hv % h or hv // h not in _GVA_RATIOS:
        raise _refuse("v", f"HV / H = {hv} / {h}: kdagen builds HV = r * H for r in "
                      f"{', '.join(map(str, _GVA_RATIOS))}")
    fields = {
        "arch": arch if arch is not None else device_arch(q.device),
        "head_dim_k": kdim,
        "head_dim_v": vdim,
        "gva_ratio": hv // h,
        **_gate_fields(use_gate_in_kernel, safe_gate, lower_bound, A_log),
        "l2norm_qk": bool(use_qk_l2norm_in_kernel),
        "dtype": dtype,
        "g_dtype": _dtype_name("g", g, ("fp32", "bf16")),
        "beta_dtype": _dtype_name("beta", beta, ("fp32", "bf16")),
        "beta": _beta_mode(use_beta_sigmoid_in_kernel, allow_neg_eigval),
        "state_layout": "vk" if state_v_first else "kv",
    }
    return _spec(tuple(sorted(fields.items())))


def _refuse_set(keyword: str, value: Any, default: Any, why: str) -> None:
    if value is not default and value != default:
        raise _refuse(keyword, f"{value!r} is not supported by kdagen ({why}); pass {default!r}")


def _state_v_first(state_v_first: bool, kwargs: dict[str, Any]) -> bool:
    # FLA's deprecated name for state_v_first, with FLA's rule and warning.
    if "transpose_state_layout" not in kwargs:
        return bool(state_v_first)
    if state_v_first:
        raise _refuse("transpose_state_layout", "cannot pass both `state_v_first` and the deprecated "
                      "`transpose_state_layout`")
    warnings.warn("`transpose_state_layout` is deprecated and renamed to `state_v_first`.",
                  DeprecationWarning, stacklevel=3)
    return bool(kwargs.pop("transpose_state_layout"))


def _check_graph_args(use_graph: bool, max_num_seqs: int | None, cu_seqlens: Any) -> None:
    # kdagen's calls never synchronise with the host and are CUDA-graph capturable as they are, so use_graph
    # needs nothing more; FLA's padding rule for max_num_seqs is kept.
    if max_num_seqs is None or not use_graph:
        return
    if cu_seqlens is None or cu_seqlens.shape[0] - 1 != max_num_seqs:
        got = None if cu_seqlens is None else cu_seqlens.shape[0] - 1
        raise _refuse("max_num_seqs", f"with use_graph, cu_seqlens must hold exactly max_num_seqs + 1 = "
                      f"{max_num_seqs + 1} offsets (pad with zero-length sequences), got {got} sequences")


@torch.compiler.disable  # as FLA's chunk_kda; `kdagen.ops.kda_forward` is the traceable form
def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    cp_context: Any = None,
    use_graph: bool = False,
    max_num_seqs: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """FLA's ``chunk_kda`` (fla-core 0.6.0) on a kdagen kernel: ``(o [B, T, HV, V], final_state or None)``.

    Same positional order and keywords as FLA; ``A_log``, ``dt_bias``, ``chunk_size`` and the deprecated
    ``transpose_state_layout`` come through ``**kwargs`` as there. The spec is `choose_spec`'s. Accepted and
    not needed: ``cu_seqlens_cpu`` (kdagen never reads the offsets on the host), ``use_graph`` (every call is
    capturable; rows past ``cu_seqlens[-1]`` get o = 0) and ``chunk_size`` 32 or 64 (the kernels step 16
    tokens; the recurrence is the same). ``use_beta_sigmoid_in_kernel`` and ``allow_neg_eigval`` pick the
    spec's ``beta`` (beta logits, the sigmoid and its doubling in the kernel). Refused with an `InputError`
    naming the keyword: ``return_intermediate_states``, ``cp_context`` and any other keyword. Inputs that
    require grad record kdagen's autograd node (`kdagen.backward`); ``disable_recompute=True`` keeps the
    forward's states (one every 64 tokens) for the backward instead of recomputing them, as FLA's keeps its
    intermediates.
    """
    v_first = _state_v_first(state_v_first, kwargs)
    A_log, dt_bias = kwargs.pop("A_log", None), kwargs.pop("dt_bias", None)
    chunk_size = kwargs.pop("chunk_size", 64)
    if kwargs:
        raise _refuse(", ".join(sorted(kwargs)), "unknown keyword (kdagen.fla.chunk_kda takes FLA 0.6.0's "
                      "keywords plus A_log, dt_bias, chunk_size, transpose_state_layout)")
    if chunk_size not in _FLA_CHUNK_SIZES:
        raise _refuse("chunk_size", f"expected 32 or 64 (as FLA), got {chunk_size!r}")
    if not isinstance(disable_recompute, bool):
        raise _refuse("disable_recompute", f"expected True or False, got {type(disable_recompute).__name__}")
    _refuse_set("return_intermediate_states", return_intermediate_states, False,
                "the per-chunk states are not an output of the kernels")
    _refuse_set("cp_context", cp_context, None, "no multi-device context parallelism")
    if not isinstance(output_final_state, bool):
        raise _refuse("output_final_state",
                      f"expected True or False, got {type(output_final_state).__name__}")
    _check_graph_args(use_graph, max_num_seqs, cu_seqlens)
    if cu_seqlens is None and cu_seqlens_cpu is not None:
        raise _refuse("cu_seqlens_cpu", "given without cu_seqlens; pass the offsets as cu_seqlens")

    spec = choose_spec(q, v, g, beta, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                       use_gate_in_kernel=use_gate_in_kernel, safe_gate=safe_gate, lower_bound=lower_bound,
                       state_v_first=v_first, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                       allow_neg_eigval=allow_neg_eigval, A_log=A_log)
    if not use_gate_in_kernel:
        A_log, dt_bias = None, None  # FLA reads them only with the in-kernel gate
    kernel = kdagen.get_kernel(spec)
    return kernel(q, k, v, g, beta, scale=scale, A_log=A_log, dt_bias=dt_bias, initial_state=initial_state,
                  output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                  recompute=not disable_recompute)


def _recurrent_kernel(name: str, q: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      kwargs: dict[str, Any], *, state_v_first: bool, use_qk_l2norm_in_kernel: bool,
                      use_gate_in_kernel: bool, use_beta_sigmoid_in_kernel: bool, allow_neg_eigval: bool,
                      lower_bound: float | None) -> tuple[Any, Any, Any]:
    """(kernel, A_log, dt_bias) of FLA's recurrent entry point `name`: its refusals, `choose_spec` (no safe
    gate: FLA's recurrent kernels take no such promise; the beta flags as in `chunk_kda`), and the gate
    parameters FLA reads (only with the in-kernel gate). `kwargs` holds A_log, dt_bias and what else the
    caller passed."""
    v_first = _state_v_first(state_v_first, kwargs)
    A_log, dt_bias = kwargs.pop("A_log", None), kwargs.pop("dt_bias", None)
    if kwargs:
        raise _refuse(", ".join(sorted(kwargs)), f"unknown keyword (kdagen.fla.{name} takes FLA 0.6.0's "
                      "keywords)")
    spec = choose_spec(q, v, g, beta, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                       use_gate_in_kernel=use_gate_in_kernel, safe_gate=False, lower_bound=lower_bound,
                       state_v_first=v_first, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                       allow_neg_eigval=allow_neg_eigval, A_log=A_log)
    if not use_gate_in_kernel:
        A_log, dt_bias = None, None
    return kdagen.get_kernel(spec), A_log, dt_bias


def _longer_than(q: torch.Tensor, cu_seqlens: torch.Tensor | None, tokens: int) -> bool:
    """Whether some sequence has more than `tokens` tokens, as far as the host knows without a sync: q's T
    for a [N, T] batch, the offsets when they are on the CPU; device-resident offsets count as short (their
    lengths are the caller's promise, as for the decode kernel)."""
    if cu_seqlens is None:
        return q.shape[1] > tokens
    if cu_seqlens.device.type == "cpu" and cu_seqlens.numel() > 1:
        return int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) > tokens
    return False


def fused_recurrent_kda_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    scale: float | None = None,
    output_final_state: bool = False,
    inplace_final_state: bool = True,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    ssm_state_indices: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    out: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FLA's decode step (fla-core 0.6.0 signature) on a kdagen kernel: ``(o, final_state)``.

    With ``ssm_state_indices`` (continuous batching) ``initial_state`` is the state pool and the call is
    `KDAKernel.decode`: ``ssm_state_indices`` [N] or [N, 1+S] -> ``state_indices``, ``num_accepted_tokens``
    as FLA (the state is read from ``idx[n, num_accepted_tokens[n] - 1]`` and, with [N, 1+S], written to
    ``idx[n, t]`` after token t), ``out`` the caller's output; the pool is updated in place and returned
    (``inplace_final_state=True``, the only form built with indices). Without indices ``initial_state`` is
    [N, HV, K, V] (V-first with ``state_v_first``): ``inplace_final_state`` writes the final states back into
    it (the decode kernel for up to `kdagen.decode.MAX_TOKENS` tokens a sequence, the forward on the states
    as a pool otherwise; with [N] indices and longer pieces the forward on the indexed pool too),
    else they come back as a new tensor when ``output_final_state``. The beta flags pick the spec's ``beta``
    as in `chunk_kda`. Refused with an `InputError` naming the keyword: indices without
    ``inplace_final_state``, unknown keywords.
    """
    from kdagen.decode import MAX_TOKENS

    kernel, A_log, dt_bias = _recurrent_kernel(
        "fused_recurrent_kda_fwd", q, v, g, beta, {**kwargs, "A_log": A_log, "dt_bias": dt_bias},
        state_v_first=state_v_first, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval, lower_bound=lower_bound)
    if ssm_state_indices is not None:
        if not inplace_final_state:
            raise _refuse("inplace_final_state", "False with ssm_state_indices (per-token states in a new "
                          "tensor) is not built; the pool is updated in place")
        if initial_state is None:
            raise _refuse("initial_state", "required with ssm_state_indices: it is the state pool")
        if ssm_state_indices.dim() == 1 and num_accepted_tokens is None and _longer_than(
                q, cu_seqlens, MAX_TOKENS):
            # Pieces longer than a decode step (chunked prefill): the forward on the pool, in place.
            o, _ = kernel(q, k, v, g, beta, scale=scale, A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu_seqlens,
                          state_pool=initial_state, state_indices=ssm_state_indices, out=out)
            return o, initial_state
        o = kernel.decode(q, k, v, g, beta, state_pool=initial_state, state_indices=ssm_state_indices,
                          scale=scale, A_log=A_log, dt_bias=dt_bias, num_accepted_tokens=num_accepted_tokens,
                          cu_seqlens=cu_seqlens, out=out)
        return o, initial_state
    if num_accepted_tokens is not None:
        raise _refuse("num_accepted_tokens", "given without ssm_state_indices")
    if inplace_final_state:
        if initial_state is None:
            raise _refuse("initial_state", "required with inplace_final_state=True (FLA's default)")
        if cu_seqlens is None and q.shape[1] <= MAX_TOKENS:
            n = initial_state.shape[0]
            idx = torch.arange(n, dtype=torch.int32, device=q.device)
            o = kernel.decode(q, k, v, g, beta, state_pool=initial_state, state_indices=idx, scale=scale,
                              A_log=A_log, dt_bias=dt_bias, out=out)
            return o, initial_state
        # Longer sequences: the forward with the states as a pool of one slot a sequence, in place.
        idx = torch.arange(initial_state.shape[0], dtype=torch.int32, device=q.device)
        o, _ = kernel(q, k, v, g, beta, scale=scale, A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu_seqlens,
                      state_pool=initial_state, state_indices=idx, out=out)
        return o, initial_state
    o, ht = kernel(q, k, v, g, beta, scale=scale, A_log=A_log, dt_bias=dt_bias, initial_state=initial_state,
                   output_final_state=output_final_state, cu_seqlens=cu_seqlens)
    if out is not None:
        out.copy_(o)
        o = out
    return o, ht


def fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FLA's token-recurrent KDA (fla-core 0.6.0 signature) on a kdagen kernel: ``(o, final_state or
    None)``, the forward's result (the same recurrence; `chunk_kda`'s spec rules, the beta flags
    included, without the safe gate).
    ``initial_state`` and the final state are [N, HV, K, V], V-first with ``state_v_first``."""
    kernel, A_log, dt_bias = _recurrent_kernel(
        "fused_recurrent_kda", q, v, g, beta, {**kwargs, "A_log": A_log, "dt_bias": dt_bias},
        state_v_first=state_v_first, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval, lower_bound=lower_bound)
    return kernel(q, k, v, g, beta, scale=scale, A_log=A_log, dt_bias=dt_bias, initial_state=initial_state,
                  output_final_state=output_final_state, cu_seqlens=cu_seqlens)
