"""`KDAKernel.decode`: a few tokens a request on a slot-indexed state pool, updated in place.

Contract (what is validated, what is the caller's duty):
- q, k: [N, S, H, K]; v: [N, S, HV, V]; g: [N, S, HV, K]; beta: [N, S, HV] (S = 1 for plain decode, up to
  `MAX_TOKENS` for speculative-decode verify), dtypes as the spec says, any token stride (rows compact);
  or packed as [1, T, ...] with
  `cu_seqlens` [N+1] (each request's tokens, at most `MAX_TOKENS` each: the caller's duty when the offsets
  are on the GPU).
- state_pool: the spec's state dtype (fp32 or bf16), [P, HV, K, V] (`kv`) or [P, HV, V, K] (`vk`), compact
  within a slot, any slot stride at least a slot's size (a pool may interleave layers), 16-byte aligned. It
  is read and written in place.
- state_indices: int32 or int64, [N] or [N, M] on the pool's device. The state is read from
  idx[n, accepted - 1] (accepted = num_accepted_tokens[n], default 1); with M = 1 the final state is written
  back to that slot, with M > 1 the state after the request's token t to idx[n, t] (FLA's semantics, so
  that an engine can roll back to any accepted prefix). A negative index is padding: nothing is read or
  written for it and its o is zero. Indices must be < P (the caller's duty: checking them would
  synchronise); slot arithmetic is 64-bit.
- num_accepted_tokens: int32/int64 [N], values in [1, M] (clamped on the device); has_initial_state: bool
  [N], False starts the request from zero without the caller clearing its slot.
- update_state=False writes no state (output-only verify). `out`: the caller's [N, S, HV, V] buffer for o.
- No host-device synchronisation: a call can be captured in a CUDA graph.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from kdagen.dtypes import nbytes
from kdagen.policy import decode_parts, decode_staged_store, decode_streams
from kdagen.runtime import (
    _check_no_grad,
    _compact,
    _need,
    _prepared,
    _props,
    check_has_initial_state,
    check_index_tensor,
    check_scale,
    check_state_indices,
    check_state_pool,
    has_data,
    remember,
    row_strided,
    validate_inputs,
)

if TYPE_CHECKING:
    from kdagen.runtime import KDAKernel

__all__ = ["MAX_TOKENS", "validate_decode_inputs", "run_decode"]

MAX_TOKENS = 8  # tokens a request: one, or a verify step's draft tokens plus one


def _tokens(t: torch.Tensor) -> torch.Tensor:
    """`t` ([B, S, heads, D], or beta's [B, S, heads]) as the stage's [B*S, heads(, D)] with its token
    stride: a row-strided view (slices of one packed projection, 16-byte aligned) goes as it is, anything
    else is copied (the stage reads by element, so any token stride does)."""
    if not row_strided(t, 1):
        t = _compact(t)
    return t.as_strided((t.shape[0] * t.shape[1], *t.shape[2:]), (t.stride(1), *t.stride()[2:]))


def validate_decode_inputs(
    spec: Any,
    q: Any,
    k: Any,
    v: Any,
    g: Any,
    beta: Any,
    A_log: Any,
    dt_bias: Any,
    state_pool: Any,
    state_indices: Any,
    num_accepted_tokens: Any = None,
    has_initial_state: Any = None,
    cu_seqlens: Any = None,
    out: Any = None,
    *,
    require_cuda: bool = True,
) -> tuple[int, int, int, int, int]:
    """Every check of a decode call's arguments (InputError naming the argument and what was expected);
    returns (B, T, H, HV, N) of q's [B, T, H, K] and the requests. Nothing here needs a GPU: with
    `require_cuda=False` the checks run on CPU, meta or fake tensors (``kdagen::decode``'s fake
    implementation), where those that read values or addresses (CPU cu_seqlens values, alignment, out
    aliasing an input) are left out for a tensor that has none."""
    bsz, seqlen, nh, hv, nreq = validate_inputs(
        spec, q, k, v, g, beta, A_log, dt_bias, None, cu_seqlens, require_cuda=require_cuda
    )
    if cu_seqlens is None:
        _need(seqlen <= MAX_TOKENS, lambda: (
            f"q: expected at most {MAX_TOKENS} tokens a request ([N, S, H, K] with S <= {MAX_TOKENS}), got "
            f"S={seqlen}; a longer piece is a prefill (kernel(...) with state_pool)"))
    device = q.device
    vdim = spec.head_dim_v

    check_state_pool(spec, state_pool, hv, device)
    cols = check_state_indices(state_indices, nreq, device, unit="requests", columns=True)
    _need(cols >= 1, "state_indices: expected at least one column")
    if cu_seqlens is None and cols > 1:
        _need(cols == seqlen, lambda: (
            f"state_indices: expected [N, S] = [{nreq}, {seqlen}] (a slot for the state after each token) or "
            f"[N], got {list(state_indices.shape)}"))

    if num_accepted_tokens is not None:
        check_index_tensor("num_accepted_tokens", num_accepted_tokens, device,
                           lambda t: t.dim() == 1 and t.shape[0] == nreq, f"a tensor [N] = [{nreq}]")
        _need(cols > 1, "num_accepted_tokens: given, but state_indices has one column ([N, M] with M > 1 "
              "names the slot after each token)")
    if has_initial_state is not None:
        check_has_initial_state(has_initial_state, nreq, device)
    if out is not None:
        dt = q.dtype
        _need(isinstance(out, torch.Tensor) and tuple(out.shape) == (bsz, seqlen, hv, vdim)
              and out.dtype == dt and out.device == device, lambda: (
                  f"out: expected a {dt} tensor [B, T, HV, V] = [{bsz}, {seqlen}, {hv}, {vdim}] on {device}, "
                  f"got {getattr(out, 'dtype', type(out).__name__)} {list(getattr(out, 'shape', []))}"))
        data = has_data(out)
        _need(out.is_contiguous() and (not data or out.data_ptr() % 16 == 0),
              "out: expected a contiguous, 16-byte aligned tensor")
        _need(not data or not any(out.data_ptr() == x.data_ptr() for x in (q, k, v, g, beta)),
              "out: must not alias an input")
    _check_no_grad({"state_pool": state_pool})  # (validate_inputs checked q, k, v, g, beta, A_log, dt_bias)
    return bsz, seqlen, nh, hv, nreq


def run_decode(
    kernel: KDAKernel,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    state_pool: torch.Tensor,
    state_indices: torch.Tensor,
    scale: float | None,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    num_accepted_tokens: torch.Tensor | None,
    has_initial_state: torch.Tensor | None,
    update_state: bool,
    cu_seqlens: torch.Tensor | None,
    out: torch.Tensor | None,
) -> torch.Tensor:
    """Validate (once per call signature), convert the index tensors, and launch the decode stage."""
    spec = kernel.spec
    # The checks read only what `sig` records (and the pool's and out's addresses), so a repeated call
    # skips them; offsets on the CPU are checked every call.
    try:
        sig: tuple | None = (
            "decode", *(_props(x) for x in (q, k, v, g, beta, A_log, dt_bias, state_pool, state_indices,
                                              num_accepted_tokens, has_initial_state, cu_seqlens)),
            state_pool.stride(), state_pool.data_ptr() % 16,
            None if out is None else (_props(out), out.stride(), out.data_ptr()), torch.is_grad_enabled(),
        )
    except AttributeError:
        sig = None
    if cu_seqlens is not None and getattr(cu_seqlens, "device", None) is not None \
            and cu_seqlens.device.type == "cpu":
        sig = None
    sizes = kernel._validated.get(sig) if sig is not None else None
    if sizes is None:
        sizes = validate_decode_inputs(spec, q, k, v, g, beta, A_log, dt_bias, state_pool, state_indices,
                                       num_accepted_tokens, has_initial_state, cu_seqlens, out)
        if sig is not None:
            remember(kernel._validated, sig, sizes)
    bsz, seqlen, nh, hv, nreq = sizes
    device = q.device
    scale = check_scale(scale, spec.head_dim_k)
    o = out if out is not None else torch.empty((bsz, seqlen, hv, spec.head_dim_v), dtype=q.dtype,
                                                device=device)
    total = bsz * seqlen
    if nreq == 0 or total == 0:
        return o
    if cu_seqlens is not None and out is None:
        o.zero_()  # tokens past cu_seqlens[-1] get o = 0

    idx = state_indices if state_indices.dim() == 2 else state_indices.view(nreq, 1)
    idx = _prepared(idx.to(torch.int32) if idx.dtype != torch.int32 else idx)
    acc, init = kernel._no_pool(device)  # one-element stand-ins, read only where given
    if num_accepted_tokens is not None:
        acc = _prepared(num_accepted_tokens.to(torch.int32) if num_accepted_tokens.dtype != torch.int32
                        else num_accepted_tokens)
    if has_initial_state is not None:
        init = _prepared(has_initial_state.view(torch.uint8))
    if cu_seqlens is None:
        cu = kernel._cached(("dec-cu", device), lambda: torch.zeros(1, dtype=torch.int32, device=device))
        per_seq = seqlen
    else:
        cu = _prepared(cu_seqlens.to(device=device, dtype=torch.int32, non_blocking=True))
        per_seq = 0

    kdim, vdim = spec.head_dim_k, spec.head_dim_v
    gate_args = kernel._gate_args(A_log, dt_bias, hv, device)
    if gate_args:
        gate_args = (gate_args[0], gate_args[1].view(hv, kdim))
    qf, kf, vf, gf, bf = (_tokens(x) for x in (q, k, v, g, beta))
    args = (qf, kf, vf, gf, bf, *gate_args, cu, idx, acc, init, state_pool, o.view(total, hv, vdim),
            float(scale), per_seq, int(num_accepted_tokens is not None), int(has_initial_state is not None),
            int(bool(update_state)))
    with kernel._stream_scope(device):
        sms = kernel._sm_count(device)
        v_first, tokens = spec.state_layout == "vk", seqlen if cu_seqlens is None else 0
        if decode_streams(kernel._decode_stream is not None, nreq * hv, sms, v_first, tokens, kernel.policy,
                          8 * nbytes(spec.state_dtype)):
            parts = decode_parts(nreq * hv, sms, vdim, v_first, tokens)
            items = nreq * hv * parts
            ctas = min(items, sms)
            kernel._decode_stream(*args, parts, int(decode_staged_store(items, ctas)), ctas)
        else:
            kernel._decode(*args)
    return o
