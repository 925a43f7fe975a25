"""PyTorch oracle for the KDA forward pass (kda-math.md §2-§4).

Independent of every kernel in kdagen: nothing here is generated, and nothing here is shared with the
templates. Two formulations are provided so that they can check each other:

- :func:`kda_recurrent_reference`: the token recurrence of kda-math §2.0 / §3, vectorised over sequences and
  heads, looping over time only. This is the oracle the GPU tests compare against (fp64 by default).
- :func:`kda_chunked_reference`: the chunked form of kda-math §2.3-§2.5 (L, Aqk, triangular inverse, W/U,
  inter-chunk state recurrence, output), per sequence, with explicit partial last chunks.
- :func:`kda_reference_autograd`: the token recurrence again, built step by step without in-place updates so
  that autograd differentiates it; the oracle of the backward kernels (gradients of q, k, v, g, beta, A_log,
  dt_bias and the initial state, with the final state's gradient taken into account).
- :func:`kda_chunked_backward_stages`: FLA's chunked backward stage by stage, checked against autograd of the
  token recurrence. Its per-chunk formulas are those of :mod:`kdagen.chunk_math`, which the torch backward
  (:mod:`kdagen.backward_local`) batches over all chunks; autograd is the check independent of both.
- :func:`kda_pool_prefill_reference` and :func:`kda_pool_decode_reference`: the runtime's forms on a
  slot-indexed state pool (prefill with prefix-cache checkpoints; decode and speculative verify with FLA's
  semantics), in place, built on the token recurrence piece by piece.

Shapes follow FLA ``chunk_kda``: q, k ``[B,T,H,K]``; v ``[B,T,HV,V]``; g ``[B,T,HV,K]``; beta ``[B,T,HV]``
(a probability, or logits as ``beta_mode`` says: :func:`kda_beta`); value head ``hv`` reads q/k head
``hv // (HV // H)``; with ``cu_seqlens`` the batch is packed (B == 1) and every sequence has its own state;
states are ``[N,HV,K,V]`` ("kv") or ``[N,HV,V,K]`` ("vk").

Also here: the relative-RMSE metric of kda-math §4.1, input generators in the FLA test style (§4.2) and the
benchmark length generators (§4.4).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

from kdagen.chunk_math import chunk_stage_backward, chunk_step

__all__ = [
    "BetaMode",
    "GateMode",
    "StateLayout",
    "assert_close",
    "cu_seqlens_from_lengths",
    "kda_beta",
    "kda_chunked_reference",
    "kda_chunked_backward_stages",
    "kda_gate",
    "kda_pool_decode_reference",
    "kda_pool_prefill_reference",
    "kda_recurrent_reference",
    "kda_reference_autograd",
    "l2norm",
    "make_inputs",
    "rel_rmse",
    "to_torch_dtype",
    "varlen_lengths",
]

Tensor = torch.Tensor
GateMode = Literal["precomputed", "softplus", "lower_bound"]
BetaMode = Literal["prob", "logit", "logit_x2"]
StateLayout = Literal["kv", "vk"]

GATE_MODES: tuple[str, ...] = ("precomputed", "softplus", "lower_bound")
BETA_MODES: tuple[str, ...] = ("prob", "logit", "logit_x2")
STATE_LAYOUTS: tuple[str, ...] = ("kv", "vk")
HARD_RESET_G = -1000.0  # the "hard reset" log-decay of the FLA varlen tests: exp(-1000) == 0 in fp32/fp64

_DTYPE_NAMES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "fp64": torch.float64,
    "float64": torch.float64,
    "double": torch.float64,
}


def to_torch_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """Map a spec dtype name ("bf16", "fp16", "fp32", ...) or a torch dtype to a torch dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(_DTYPE_NAMES)}") from None


# ----------------------------------------------------------------------------------------------------------
# Gate and l2norm (kda-math §2.1, §2.2)
# ----------------------------------------------------------------------------------------------------------


def kda_gate(
    g: Tensor,
    *,
    gate: GateMode,
    A_log: Tensor | None = None,
    dt_bias: Tensor | None = None,
    lower_bound: float | None = None,
) -> Tensor:
    """Per-step natural-log decay from ``g`` (kda-math §2.1).

    The result is fp64 when ``g`` is fp64 and fp32 otherwise (fp32 is what FLA computes the gate in; pass an
    fp64 ``g`` to get the oracle's fp64 gate). ``g`` is ``[..., HV, K]``; ``A_log`` ``[HV]``; ``dt_bias``
    ``[HV*K]`` or ``[HV, K]``.

    - ``"precomputed"``: ``g`` already is the log-decay; returned as is. ``lower_bound`` is ignored: with
      ``safe_gate`` it is the caller's promise, and FLA does not clamp either.
    - ``"softplus"``: ``-exp(A_log) * softplus(g + dt_bias)``, softplus with threshold 20 (``x > 20 -> x``).
    - ``"lower_bound"``: ``lb * sigmoid(exp(A_log) * (g + dt_bias))``; without ``A_log``:
      ``lb * sigmoid(g + dt_bias)``.
    """
    if gate not in GATE_MODES:
        raise ValueError(f"gate: expected one of {GATE_MODES}, got {gate!r}")
    out_dtype = torch.float64 if g.dtype == torch.float64 else torch.float32
    x = g.to(out_dtype)
    if gate == "precomputed":
        return x
    if g.dim() < 2:
        raise ValueError(f"g: expected [..., HV, K], got shape {tuple(g.shape)}")
    HV, K = g.shape[-2], g.shape[-1]
    if dt_bias is not None:
        if dt_bias.numel() != HV * K:
            raise ValueError(
                f"dt_bias: expected {HV * K} elements ([HV*K] or [HV,K]), got {tuple(dt_bias.shape)}"
            )
        x = x + dt_bias.to(device=x.device, dtype=out_dtype).reshape(HV, K)
    a = None
    if A_log is not None:
        if A_log.numel() != HV:
            raise ValueError(f"A_log: expected {HV} elements ([HV]), got {tuple(A_log.shape)}")
        a = A_log.to(device=x.device, dtype=out_dtype).reshape(HV, 1).exp()
    if gate == "softplus":
        if a is None:
            raise ValueError("A_log: required by the softplus gate")
        if lower_bound is not None:
            raise ValueError("lower_bound: must be None with the softplus gate (it selects the sigmoid form)")
        return -a * F.softplus(x, beta=1.0, threshold=20.0)
    if lower_bound is None:
        raise ValueError("lower_bound: required by the lower_bound gate")
    if a is not None:
        x = a * x
    return float(lower_bound) * torch.sigmoid(x)


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (kda-math §2.2).

    Computed in fp32 for 16-bit inputs (as FLA does) and in the input dtype for fp32/fp64; returns x.dtype.
    """
    xc = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    y = xc * torch.rsqrt(xc.square().sum(dim=-1, keepdim=True) + eps)
    return y.to(x.dtype)


def kda_beta(beta: Tensor, mode: BetaMode = "prob") -> Tensor:
    """beta as the recurrence uses it, from beta as given (kda-math §1.1; the spec's ``beta`` field):
    ``"prob"``: as is; ``"logit"``: ``sigmoid(beta)``; ``"logit_x2"``: ``2 * sigmoid(beta)`` (FLA's
    ``allow_neg_eigval``). Differentiable; the dtype of ``beta``."""
    if mode not in BETA_MODES:
        raise ValueError(f"beta_mode: expected one of {BETA_MODES}, got {mode!r}")
    if mode == "prob":
        return beta
    return torch.sigmoid(beta) * (2.0 if mode == "logit_x2" else 1.0)


# ----------------------------------------------------------------------------------------------------------
# Shared preparation (validation, gate, l2norm, GVA, sequence split)
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Prepared:
    q: Tensor  # [B,T,HV,K], l2-normalised if asked, times scale, in the compute dtype
    k: Tensor  # [B,T,HV,K]
    v: Tensor  # [B,T,HV,V]
    g: Tensor  # [B,T,HV,K] natural-log decay
    beta: Tensor  # [B,T,HV], after `kda_beta`
    h0: Tensor | None  # [N,HV,K,V] ("kv" layout) or None
    seqs: tuple[tuple[int, int, int], ...]  # (batch index, bos, eos) per sequence
    out_shape: tuple[int, int, int, int]  # [B,T,HV,V]


def _seq_bounds(
    B: int, T: int, cu_seqlens: Tensor | Sequence[int] | None
) -> tuple[tuple[int, int, int], ...]:
    if cu_seqlens is None:
        return tuple((b, 0, T) for b in range(B))
    cu = [int(x) for x in (cu_seqlens.tolist() if isinstance(cu_seqlens, Tensor) else cu_seqlens)]
    if B != 1:
        raise ValueError(f"cu_seqlens: requires B == 1 (packed varlen input), got B={B}")
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != T:
        raise ValueError(f"cu_seqlens: expected [0, ..., T={T}] with at least 2 entries, got {cu}")
    if any(b > e for b, e in pairwise(cu)):
        raise ValueError(f"cu_seqlens: must be non-decreasing, got {cu}")
    return tuple((0, b, e) for b, e in pairwise(cu))


def _prepare(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: float | None,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | Sequence[int] | None,
    gate: GateMode,
    A_log: Tensor | None,
    dt_bias: Tensor | None,
    lower_bound: float | None,
    l2norm_qk: bool,
    state_layout: StateLayout,
    dtype: torch.dtype,
    beta_mode: BetaMode,
) -> _Prepared:
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"q, k: expected equal shapes [B,T,H,K], got {tuple(q.shape)} and {tuple(k.shape)}")
    B, T, H, K = q.shape
    if v.dim() != 4 or v.shape[:2] != (B, T):
        raise ValueError(f"v: expected [B={B},T={T},HV,V], got {tuple(v.shape)}")
    HV, V = v.shape[2], v.shape[3]
    if HV % H != 0:
        raise ValueError(f"v: HV={HV} must be a multiple of H={H}")
    if g.shape != (B, T, HV, K):
        raise ValueError(f"g: expected {(B, T, HV, K)}, got {tuple(g.shape)}")
    if beta.shape != (B, T, HV):
        raise ValueError(f"beta: expected {(B, T, HV)}, got {tuple(beta.shape)}")
    if state_layout not in STATE_LAYOUTS:
        raise ValueError(f"state_layout: expected one of {STATE_LAYOUTS}, got {state_layout!r}")
    seqs = _seq_bounds(B, T, cu_seqlens)
    N = len(seqs)

    h0 = None
    if initial_state is not None:
        want = (N, HV, K, V) if state_layout == "kv" else (N, HV, V, K)
        if tuple(initial_state.shape) != want:
            raise ValueError(f"initial_state: expected {want} for layout {state_layout!r}, "
                             f"got {tuple(initial_state.shape)}")
        h0 = initial_state.to(dtype)
        if state_layout == "vk":
            h0 = h0.transpose(-1, -2)
        h0 = h0.contiguous()

    # The gate is evaluated in the compute dtype: kda_gate keeps fp64 for an fp64 input.
    gd = kda_gate(g.to(dtype), gate=gate, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound).to(dtype)
    qd, kd = q.to(dtype), k.to(dtype)
    if l2norm_qk:
        qd, kd = l2norm(qd), l2norm(kd)
    s = float(K) ** -0.5 if scale is None else float(scale)
    group = HV // H
    qd = (qd * s).repeat_interleave(group, dim=2)
    kd = kd.repeat_interleave(group, dim=2)
    return _Prepared(
        q=qd, k=kd, v=v.to(dtype), g=gd, beta=kda_beta(beta.to(dtype), beta_mode), h0=h0, seqs=seqs,
        out_shape=(B, T, HV, V),
    )


def _final_layout(S: Tensor, state_layout: StateLayout) -> Tensor:
    S = S.to(torch.float64)
    return (S.transpose(-1, -2) if state_layout == "vk" else S).contiguous()


# ----------------------------------------------------------------------------------------------------------
# Token recurrence (kda-math §2.0, §3)
# ----------------------------------------------------------------------------------------------------------


def _pad_sequences(x: Tensor, seqs: tuple[tuple[int, int, int], ...], t_max: int) -> Tensor:
    """[B,T,...] -> [N,t_max,...], zero-padded at the end of each sequence."""
    out = x.new_zeros((len(seqs), t_max, *x.shape[2:]))
    for i, (b, bos, eos) in enumerate(seqs):
        out[i, : eos - bos] = x[b, bos:eos]
    return out


@dataclass(frozen=True)
class _Steps:
    """A call's sequences as token steps of all (sequence, value head) pairs at once: step t of every tensor
    is [NH, ...], NH = N * HV, each sequence padded to t_max with q = k = v = g = beta = 0."""

    decay: Tensor  # [t_max, NH, K, 1], exp(g)
    q: Tensor  # [t_max, NH, 1, K]
    k: Tensor  # [t_max, NH, K]
    v: Tensor  # [t_max, NH, 1, V]
    beta: Tensor  # [t_max, NH, 1, 1]
    t_max: int


_Pad = Callable[[Tensor, tuple[tuple[int, int, int], ...], int], Tensor]


def _token_steps(p: _Prepared, pad: _Pad) -> _Steps:
    # `pad` lays [B,T,...] out as [N,t_max,...] (into a new tensor or, for autograd, functionally)
    nh = len(p.seqs) * p.out_shape[2]
    kdim, vdim = p.k.shape[-1], p.out_shape[3]
    t_max = max((eos - bos for _, bos, eos in p.seqs), default=0)
    qs, ks, vs, gs, bs = (pad(x, p.seqs, t_max).transpose(0, 1) for x in (p.q, p.k, p.v, p.g, p.beta))
    return _Steps(decay=gs.exp().reshape(t_max, nh, kdim, 1), q=qs.reshape(t_max, nh, 1, kdim),
                  k=ks.reshape(t_max, nh, kdim), v=vs.reshape(t_max, nh, 1, vdim),
                  beta=bs.reshape(t_max, nh, 1, 1), t_max=t_max)


def kda_recurrent_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | Sequence[int] | None = None,
    gate: GateMode = "precomputed",
    A_log: Tensor | None = None,
    dt_bias: Tensor | None = None,
    lower_bound: float | None = None,
    l2norm_qk: bool = False,
    state_layout: StateLayout = "kv",
    dtype: torch.dtype = torch.float64,
    beta_mode: BetaMode = "prob",
) -> tuple[Tensor, Tensor | None]:
    """Token-by-token KDA forward (kda-math §2.0), computed in ``dtype``, on the device of the inputs.

    Per value head and sequence: ``S <- Diag(exp(g_t)) S``; ``S <- S + beta_t k_t (v_t - k_t^T S)^T``;
    ``o_t = S^T (scale q_t)``, beta_t from ``beta`` by ``beta_mode`` (:func:`kda_beta`). Returns
    ``(o [B,T,HV,V] fp64, final_state fp64 in state_layout | None)``.
    ``initial_state`` is ``[N,HV,K,V]`` ("kv") or ``[N,HV,V,K]`` ("vk"), N = B or len(cu_seqlens)-1.
    """
    p = _prepare(q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens, gate=gate,
                 A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, l2norm_qk=l2norm_qk,
                 state_layout=state_layout, dtype=dtype, beta_mode=beta_mode)
    B, T, HV, V = p.out_shape
    K = p.k.shape[-1]
    N = len(p.seqs)
    NH = N * HV
    # Every sequence padded to t_max with q = k = v = 0, g = 0, beta = 0: such a step multiplies S by exactly
    # 1 and adds exactly 0, so all sequences advance in lock-step and the padding cannot change any result.
    st = _token_steps(p, _pad_sequences)
    t_max = st.t_max

    if p.h0 is None:
        S = torch.zeros(NH, K, V, dtype=dtype, device=p.v.device)
    else:
        S = p.h0.reshape(NH, K, V).clone()
    o_pad = torch.empty(t_max, NH, 1, V, dtype=dtype, device=p.v.device)
    for t in range(t_max):
        S.mul_(st.decay[t])
        kt = st.k[t]
        delta = st.beta[t] * (st.v[t] - torch.bmm(kt.unsqueeze(1), S))  # beta (v - k^T S), [NH,1,V]
        S.baddbmm_(kt.unsqueeze(2), delta)  # S += k delta^T
        torch.bmm(st.q[t], S, out=o_pad[t])

    o_seq = o_pad.reshape(t_max, N, HV, V).transpose(0, 1)  # [N,t_max,HV,V]
    o = torch.zeros(B, T, HV, V, dtype=torch.float64, device=p.v.device)
    for i, (b, bos, eos) in enumerate(p.seqs):
        o[b, bos:eos] = o_seq[i, : eos - bos]
    final = _final_layout(S.reshape(N, HV, K, V), state_layout) if output_final_state else None
    return o, final


# ----------------------------------------------------------------------------------------------------------
# Differentiable token recurrence: the oracle of the backward kernels (kda-math §8)
# ----------------------------------------------------------------------------------------------------------


def _autograd_dtype(*xs: Tensor) -> torch.dtype:
    """The dtype the differentiable recurrence computes in: the promoted dtype of the inputs, at least fp32.

    fp64 inputs (the gradcheck and the GPU backward tests) stay fp64; 16-bit inputs are lifted to fp32,
    the dtype of the state in every kernel, since a 16-bit recurrence would measure nothing useful.
    """
    dt = xs[0].dtype
    for x in xs[1:]:
        dt = torch.promote_types(dt, x.dtype)
    return torch.promote_types(dt, torch.float32)


def _pad_sequences_functional(x: Tensor, seqs: tuple[tuple[int, int, int], ...], t_max: int) -> Tensor:
    """[B,T,...] -> [N,t_max,...], zero-padded at the end of each sequence, built without in-place writes."""
    rows = []
    for b, bos, eos in seqs:
        piece = x[b, bos:eos]
        pad = t_max - (eos - bos)
        if pad:
            piece = torch.cat([piece, piece.new_zeros((pad, *piece.shape[1:]))], dim=0)
        rows.append(piece)
    return torch.stack(rows) if rows else x.new_zeros((0, t_max, *x.shape[2:]))


def kda_reference_autograd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | Sequence[int] | None = None,
    gate: GateMode = "precomputed",
    A_log: Tensor | None = None,
    dt_bias: Tensor | None = None,
    lower_bound: float | None = None,
    l2norm_qk: bool = False,
    state_layout: StateLayout = "kv",
    beta_mode: BetaMode = "prob",
) -> tuple[Tensor, Tensor | None]:
    """Differentiable token-by-token KDA forward: the oracle of the backward kernels' GPU tests.

    Same arguments and forward semantics as :func:`kda_recurrent_reference` (gate modes, l2norm, scale, GVA,
    varlen, both state layouts), but every step builds a new state tensor instead of updating one in place,
    so ``torch.autograd`` differentiates through it. Gradients reach q, k, v, g (the raw gate for the
    in-kernel gates), beta (the logits, through the sigmoid, with the logit modes), A_log, dt_bias and
    initial_state; a loss that uses the returned final state backpropagates through it too (the ``dht`` term
    of kda-math §8).

    Computed in the promoted dtype of q, k, v, g, beta (at least fp32; fp64 for the gradcheck and the GPU
    tests' oracle). Returns ``(o [B,T,HV,V], final_state in state_layout | None)``, both in that dtype.
    """
    dtype = _autograd_dtype(q, k, v, g, beta)
    # _prepare is differentiable: dtype casts, kda_gate, l2norm, scale and the GVA repeat_interleave (whose
    # backward sums dq/dk over each group of value heads, kda-math §8 step 7) are all autograd ops.
    p = _prepare(q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens, gate=gate,
                 A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, l2norm_qk=l2norm_qk,
                 state_layout=state_layout, dtype=dtype, beta_mode=beta_mode)
    B, T, HV, V = p.out_shape
    K = p.k.shape[-1]
    N = len(p.seqs)
    NH = N * HV
    # Zero padding (q = k = v = g = beta = 0) is an exact identity step, as in kda_recurrent_reference, and
    # it contributes exactly zero to every gradient.
    st = _token_steps(p, _pad_sequences_functional)
    t_max = st.t_max

    if p.h0 is None:
        S = torch.zeros(NH, K, V, dtype=dtype, device=p.v.device)
    else:
        S = p.h0.reshape(NH, K, V)
    outs: list[Tensor] = []
    for t in range(t_max):
        S = S * st.decay[t]
        kt = st.k[t]
        delta = st.beta[t] * (st.v[t] - torch.bmm(kt.unsqueeze(1), S))  # beta (v - k^T S), [NH,1,V]
        S = S + torch.bmm(kt.unsqueeze(2), delta)  # S + k delta^T
        outs.append(torch.bmm(st.q[t], S))  # [NH,1,V]

    if outs:
        o_seq = torch.cat(outs, dim=1).reshape(NH, t_max, V)
    else:
        o_seq = S.new_zeros((NH, 0, V))
    o_seq = o_seq.reshape(N, HV, t_max, V).transpose(1, 2)  # [N,t_max,HV,V]
    # Unpad: each batch row is the concatenation, in order, of the sequences it holds (one per row for fixed
    # length, all of them in row 0 for varlen).
    per_row: list[list[Tensor]] = [[] for _ in range(B)]
    for i, (b, bos, eos) in enumerate(p.seqs):
        per_row[b].append(o_seq[i, : eos - bos])
    o = torch.stack([torch.cat(pc, dim=0) if pc else o_seq.new_zeros((T, HV, V)) for pc in per_row])
    final = None
    if output_final_state:
        final = S.reshape(N, HV, K, V)
        if state_layout == "vk":
            final = final.transpose(-1, -2)
        final = final.contiguous()
    return o, final


# ----------------------------------------------------------------------------------------------------------
# Chunked formulation (kda-math §2.3-§2.5)
# ----------------------------------------------------------------------------------------------------------


def kda_chunked_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | Sequence[int] | None = None,
    gate: GateMode = "precomputed",
    A_log: Tensor | None = None,
    dt_bias: Tensor | None = None,
    lower_bound: float | None = None,
    l2norm_qk: bool = False,
    state_layout: StateLayout = "kv",
    dtype: torch.dtype = torch.float64,
    chunk_size: int = 64,
    beta_mode: BetaMode = "prob",
) -> tuple[Tensor, Tensor | None]:
    """Chunked KDA forward (kda-math §2.3-§2.5); arguments and results as :func:`kda_recurrent_reference`.

    Chunks restart at each sequence start; the last chunk of a sequence may be partial (n < chunk_size),
    handled by slicing, not padding. Per chunk: ``L = tril_strict(beta_r k_r . k_s exp(G_r - G_s))``,
    ``Aqk = tril(scale q_r . k_s exp(G_r - G_s))``, ``A = (I + L)^{-1} diag(beta)``, ``W = A (K * exp(G))``,
    ``U = A V``, ``V_new = U - W S``, ``O = (scale Q * exp(G)) S + Aqk V_new``,
    ``S <- exp(G_last) S + (K * exp(G_last - G))^T V_new``.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size: expected >= 1, got {chunk_size}")
    p = _prepare(q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens, gate=gate,
                 A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, l2norm_qk=l2norm_qk,
                 state_layout=state_layout, dtype=dtype, beta_mode=beta_mode)
    B, T, HV, V = p.out_shape
    K = p.k.shape[-1]
    o = torch.zeros(B, T, HV, V, dtype=torch.float64, device=p.v.device)
    finals = []
    for i, (b, bos, eos) in enumerate(p.seqs):
        S = p.h0[i].clone() if p.h0 is not None else torch.zeros(HV, K, V, dtype=dtype, device=p.v.device)
        for c0 in range(bos, eos, chunk_size):
            c1 = min(c0 + chunk_size, eos)
            sl = (b, slice(c0, c1))
            oc, S = chunk_step(
                p.q[sl].transpose(0, 1), p.k[sl].transpose(0, 1), p.v[sl].transpose(0, 1),
                p.g[sl].transpose(0, 1), p.beta[sl].transpose(0, 1), S,
            )
            o[b, c0:c1] = oc.transpose(0, 1).to(torch.float64)
        finals.append(S)
    final = _final_layout(torch.stack(finals), state_layout) if output_final_state else None
    return o, final


def kda_chunked_backward_stages(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    do: Tensor,
    *,
    dht: Tensor | None = None,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    cu_seqlens: Tensor | Sequence[int] | None = None,
    gate: GateMode = "precomputed",
    A_log: Tensor | None = None,
    dt_bias: Tensor | None = None,
    lower_bound: float | None = None,
    l2norm_qk: bool = False,
    state_layout: StateLayout = "kv",
    chunk_size: int = 64,
    beta_mode: BetaMode = "prob",
) -> dict[str, Tensor]:
    """FLA's chunked backward in fp64 (kda-math §8), chunk by chunk and stage by stage: the oracle that
    backward kernels are tested against, each stage on its own (`chunk_stage_backward` has the formulas).

    Arguments as :func:`kda_chunked_reference`, plus ``do`` (the gradient of o, [B, T, HV, V]) and ``dht``
    (of the final state, in ``state_layout``; None: zero). Gradients are of the *prepared* inputs, per value
    head: q is scale * l2norm(q) and k is l2norm(k), both expanded to the value heads (sum over a group for
    GVA, then the l2norm and scale backward give the raw gradients); g is the log-decay after the gate (its
    backward, `kda_gate`'s, gives the raw gate's, dA_log and ddt_bias); beta after the beta mode.
    - ``dq``, ``dk``, ``dg``: [B, T, HV, K]; ``dv``: [B, T, HV, V] (v has no transform: the raw gradient);
      ``dbeta``: [B, T, HV];
    - ``dh0``: [N, HV, K, V] or [N, HV, V, K] (``state_layout``), of the initial state;
    - ``dAqk``: [B, T, HV, chunk_size], row r of a chunk holds d Aqk[r, s] for its chunk's columns s (zero
      past the chunk's tokens and above the diagonal);
    - ``dh``: [chunks, HV, K, V], the gradient of the state entering each chunk, in sequence and chunk
      order (the reverse scan's output, kv layout).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size: expected >= 1, got {chunk_size}")
    p = _prepare(q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens, gate=gate,
                 A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, l2norm_qk=l2norm_qk,
                 state_layout=state_layout, dtype=torch.float64, beta_mode=beta_mode)
    B, T, HV, V = p.out_shape
    K = p.k.shape[-1]
    f64 = {"dtype": torch.float64, "device": p.v.device}
    dO = do.to(torch.float64)
    out = {"dq": torch.zeros(B, T, HV, K, **f64), "dk": torch.zeros(B, T, HV, K, **f64),
           "dv": torch.zeros(B, T, HV, V, **f64), "dg": torch.zeros(B, T, HV, K, **f64),
           "dbeta": torch.zeros(B, T, HV, **f64)}
    dAqk = torch.zeros(B, T, HV, chunk_size, **f64)
    dh0, dh_all = [], []
    for i, (b, bos, eos) in enumerate(p.seqs):
        S = p.h0[i].clone() if p.h0 is not None else torch.zeros(HV, K, V, **f64)
        starts, states = list(range(bos, eos, chunk_size)), []
        for c0 in starts:  # stage 1: the states entering the chunks
            states.append(S)
            sl = (b, slice(c0, min(c0 + chunk_size, eos)))
            _, S = chunk_step(*(x[sl].transpose(0, 1) for x in (p.q, p.k, p.v, p.g, p.beta)), S)
        dS = torch.zeros(HV, K, V, **f64)
        if dht is not None:
            dS = dht[i].to(torch.float64)
            dS = dS.transpose(-1, -2) if state_layout == "vk" else dS
        dh_seq = []
        for c0, S_in in zip(reversed(starts), reversed(states)):
            c1 = min(c0 + chunk_size, eos)
            sl = (b, slice(c0, c1))
            grads = chunk_stage_backward(
                *(x[sl].transpose(0, 1) for x in (p.q, p.k, p.v, p.g, p.beta)), S_in,
                dO[sl].transpose(0, 1), dS)
            for name in ("dq", "dk", "dv", "dg", "dbeta"):
                out[name][b, c0:c1] = grads[name].transpose(0, 1)
            dAqk[b, c0:c1, :, : c1 - c0] = grads["dAqk"].transpose(0, 1)
            dS = grads["dS"]
            dh_seq.append(dS)
        dh_all += reversed(dh_seq)
        dh0.append(dS)
    empty = torch.zeros(0, HV, K, V, **f64)
    return {**out, "dh0": _final_layout(torch.stack(dh0), state_layout), "dAqk": dAqk,
            "dh": torch.stack(dh_all) if dh_all else empty}


# ----------------------------------------------------------------------------------------------------------
# A slot-indexed state pool: prefill with prefix-cache checkpoints, decode and verify (the runtime's contract)
# ----------------------------------------------------------------------------------------------------------

CHECKPOINT_GRID = 16  # a piece whose start is off this grid writes no checkpoints (the runtime's contract)


def _ints(x: Tensor | Sequence[int] | None, n: int, default: int) -> list[int]:
    if x is None:
        return [default] * n
    vals = x.tolist() if isinstance(x, Tensor) else list(x)
    if len(vals) != n:
        raise ValueError(f"expected {n} values (one per sequence), got {len(vals)}")
    return [int(a) for a in vals]


def _pool_steps(
    x: dict[str, Tensor],
    b: int,
    cuts: Sequence[int],
    state: Tensor,
    opts: dict,
) -> tuple[list[Tensor], list[Tensor]]:
    """The token recurrence over x[b, cuts[0]:cuts[-1]] from `state` (one slot, in the pool's layout):
    (o of each run between consecutive cuts, the state at every cut after the first)."""
    outs, states = [], []
    for lo, hi in pairwise(cuts):
        if hi > lo:
            o, final = kda_recurrent_reference(
                *(t[b:b + 1, lo:hi] for t in (x["q"], x["k"], x["v"], x["g"], x["beta"])),
                initial_state=state.unsqueeze(0), output_final_state=True, **opts)
            state = final[0]
            outs.append(o[0])
        states.append(state)
    return outs, states


def kda_pool_prefill_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    state_pool: Tensor,
    state_indices: Tensor | Sequence[int],
    cu_seqlens: Tensor | Sequence[int] | None = None,
    has_initial_state: Tensor | Sequence[bool] | None = None,
    checkpoint_interval: int | None = None,
    start_positions: Tensor | Sequence[int] | None = None,
    checkpoint_indices: Tensor | Sequence[Sequence[int]] | None = None,
    scale: float | None = None,
    gate: GateMode = "precomputed",
    A_log: Tensor | None = None,
    dt_bias: Tensor | None = None,
    lower_bound: float | None = None,
    l2norm_qk: bool = False,
    state_layout: StateLayout = "kv",
    dtype: torch.dtype = torch.float64,
) -> Tensor:
    """The forward on a slot-indexed state pool, in place, by the token recurrence: what
    ``KDAKernel.__call__`` does with ``state_pool`` (the contract in kdagen/runtime.py). Returns o
    ``[B,T,HV,V]`` fp64; the pool keeps its dtype (states are computed in ``dtype`` and stored back).

    Sequence n (a batch row, or a piece of ``cu_seqlens``) starts from pool slot ``state_indices[n]``, or from
    zero where ``has_initial_state[n]`` is False, and its final state goes back to that slot; a negative slot
    is padding (o = 0, nothing read or written). With ``checkpoint_interval`` C, the piece covers absolute
    positions ``start .. start + len`` (``start = start_positions[n]``, default 0: the tokens already in the
    state), and the state after the request's first p tokens, for every multiple p of C with
    ``start < p <= start + len``, goes to slot ``checkpoint_indices[n][m]``, m = 0, 1, ... in order (a
    negative slot, or m past the row's end, skips it). A start off the 16-token grid writes no checkpoints.
    Every slot is read before any is written within a sequence; sequences run in order (the contract's
    distinct slots make the order immaterial)."""
    B, T = q.shape[:2]
    HV, V = v.shape[2], v.shape[3]
    seqs = _seq_bounds(B, T, cu_seqlens)
    N = len(seqs)
    slots = _ints(state_indices, N, 0)
    fresh = [not f for f in _ints(has_initial_state, N, 1)]
    starts = _ints(start_positions, N, 0)
    if checkpoint_interval is not None and (checkpoint_interval <= 0
                                            or checkpoint_interval % CHECKPOINT_GRID):
        raise ValueError(f"checkpoint_interval: expected a positive multiple of {CHECKPOINT_GRID}, "
                         f"got {checkpoint_interval}")
    ck: list[list[int]] = [[] for _ in range(N)]
    if checkpoint_interval is not None and checkpoint_indices is not None:
        rows = checkpoint_indices.tolist() if isinstance(checkpoint_indices, Tensor) else checkpoint_indices
        ck = [[int(s) for s in row] for row in rows]
        if len(ck) != N:
            raise ValueError(f"checkpoint_indices: expected {N} rows (one per sequence), got {len(ck)}")
    opts = dict(scale=scale, gate=gate, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                l2norm_qk=l2norm_qk, state_layout=state_layout, dtype=dtype)
    x = {"q": q, "k": k, "v": v, "g": g, "beta": beta}
    o = torch.zeros(B, T, HV, V, dtype=torch.float64, device=q.device)
    for n, (b, bos, eos) in enumerate(seqs):
        slot = slots[n]
        if slot < 0:
            continue
        state = torch.zeros_like(state_pool[0], dtype=dtype) if fresh[n] else state_pool[slot].to(dtype)
        start, c = starts[n], checkpoint_interval
        marks: list[int] = []  # absolute positions of the piece's checkpoints
        if c is not None and start % CHECKPOINT_GRID == 0:
            marks = list(range((start // c + 1) * c, start + eos - bos + 1, c))
        outs, states = _pool_steps(x, b, [bos, *(bos + p - start for p in marks), eos], state, opts)
        if outs:
            o[b, bos:eos] = torch.cat(outs)
        for m, st in enumerate(states[:len(marks)]):
            dst = ck[n][m] if m < len(ck[n]) else -1
            if dst >= 0:
                state_pool[dst].copy_(st)
        state_pool[slot].copy_(states[-1])
    return o


def kda_pool_decode_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    state_pool: Tensor,
    state_indices: Tensor | Sequence[int] | Sequence[Sequence[int]],
    num_accepted_tokens: Tensor | Sequence[int] | None = None,
    has_initial_state: Tensor | Sequence[bool] | None = None,
    update_state: bool = True,
    cu_seqlens: Tensor | Sequence[int] | None = None,
    scale: float | None = None,
    gate: GateMode = "precomputed",
    A_log: Tensor | None = None,
    dt_bias: Tensor | None = None,
    lower_bound: float | None = None,
    l2norm_qk: bool = False,
    state_layout: StateLayout = "kv",
    dtype: torch.dtype = torch.float64,
) -> Tensor:
    """Decode and speculative-decode verify on a slot-indexed state pool, in place, by the token recurrence:
    what ``KDAKernel.decode`` does (FLA's verify semantics; the contract in kdagen/decode.py). Returns o in
    q's ``[N,S,HV,V]`` (or packed ``[1,T,HV,V]`` with ``cu_seqlens``) shape, fp64.

    ``state_indices`` is ``[N]`` or ``[N, M]``. Request n reads its state from ``idx[n, a - 1]``,
    ``a = num_accepted_tokens[n]`` (default 1) clamped into ``[1, M]``, or starts from zero where
    ``has_initial_state[n]`` is False; a negative read slot is padding (o = 0, nothing written). With one
    column the final state goes back to the read slot; with M > 1 the state after the request's token t goes
    to ``idx[n, t]`` (t < M; a negative slot skips it), so that an engine can roll back to any accepted
    prefix. ``update_state=False`` writes nothing."""
    B, T = q.shape[:2]
    HV, V = v.shape[2], v.shape[3]
    seqs = _seq_bounds(B, T, cu_seqlens)
    N = len(seqs)
    idx = state_indices.tolist() if isinstance(state_indices, Tensor) else list(state_indices)
    rows = [[int(s) for s in (r if isinstance(r, (list, tuple)) else [r])] for r in idx]
    if len(rows) != N:
        raise ValueError(f"state_indices: expected {N} rows (one per request), got {len(rows)}")
    cols = len(rows[0]) if rows else 1
    accepted = _ints(num_accepted_tokens, N, 1)
    fresh = [not f for f in _ints(has_initial_state, N, 1)]
    opts = dict(scale=scale, gate=gate, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                l2norm_qk=l2norm_qk, state_layout=state_layout, dtype=dtype)
    x = {"q": q, "k": k, "v": v, "g": g, "beta": beta}
    o = torch.zeros(B, T, HV, V, dtype=torch.float64, device=q.device)
    for n, (b, bos, eos) in enumerate(seqs):
        slot = rows[n][min(max(accepted[n] - 1, 0), cols - 1)]
        if slot < 0:
            continue
        state = torch.zeros_like(state_pool[0], dtype=dtype) if fresh[n] else state_pool[slot].to(dtype)
        outs, states = _pool_steps(x, b, range(bos, eos + 1), state, opts)
        if outs:
            o[b, bos:eos] = torch.cat(outs)
        if not update_state:
            continue
        if cols == 1:
            state_pool[slot].copy_(states[-1] if states else state)
            continue
        for t, st in enumerate(states[:cols]):
            if rows[n][t] >= 0:
                state_pool[rows[n][t]].copy_(st)
    return o


# ----------------------------------------------------------------------------------------------------------
# Error metric (kda-math §4.1)
# ----------------------------------------------------------------------------------------------------------


def _rms(x: Tensor) -> float:
    return x.square().mean().sqrt().item()


def rel_rmse(ref: Tensor, out: Tensor) -> float:
    """``RMS(ref - out) / (RMS(ref) + 1e-8)`` over all elements, in fp64."""
    r = ref.detach().to(torch.float64)
    o = out.detach().to(device=r.device, dtype=torch.float64)
    return _rms(r - o) / (_rms(r) + 1e-8)


def assert_close(name: str, ref: Tensor, out: Tensor, ratio: float, *, err_atol: float = 1e-6) -> None:
    """FLA's ``assert_close`` (kda-math §4.1): pass if max|ref-out| <= err_atol; else require no NaN and
    ``rel_rmse(ref, out) < ratio``. Raises AssertionError naming ``name`` and the numbers."""
    if tuple(ref.shape) != tuple(out.shape):
        raise AssertionError(f"{name}: shape mismatch: ref {tuple(ref.shape)} vs out {tuple(out.shape)}")
    if ref.numel() == 0:
        return
    r = ref.detach().to(torch.float64)
    o = out.detach().to(device=r.device, dtype=torch.float64)
    abs_err = (r - o).abs().max().item()
    if abs_err <= err_atol:  # NaN compares False, so a NaN never passes here
        return
    for label, x in (("reference", r), ("output", o)):
        nans = int(torch.isnan(x).sum().item())
        if nans:
            raise AssertionError(f"{name}: {nans} NaN of {x.numel()} elements in the {label}")
    err = _rms(r - o) / (_rms(r) + 1e-8)
    if not err < ratio:
        raise AssertionError(
            f"{name}: relative RMSE {err:.4e} >= {ratio:.4e} "
            f"(max abs err {abs_err:.4e}, RMS(ref) {_rms(r):.4e})"
        )


# ----------------------------------------------------------------------------------------------------------
# Input generators (kda-math §4.2, §4.4)
# ----------------------------------------------------------------------------------------------------------


def _as_cu_list(cu_seqlens: Tensor | Sequence[int]) -> list[int]:
    return [int(x) for x in (cu_seqlens.tolist() if isinstance(cu_seqlens, Tensor) else cu_seqlens)]


def make_inputs(
    B: int,
    T: int,
    H: int,
    HV: int,
    K: int,
    V: int,
    *,
    dtype: torch.dtype | str,
    beta_dtype: torch.dtype | str,
    g_dtype: torch.dtype | str,
    gate: GateMode,
    beta_mode: BetaMode = "prob",
    safe_gate: bool,
    lower_bound: float | None,
    seed: int,
    device: torch.device | str,
    mask_p: float = 0.0,
    hard_reset: bool = False,
    gate_logit_normalizer: float = 1.0,
    l2norm_qk: bool = True,
    cu_seqlens: Tensor | Sequence[int] | None = None,
    with_initial_state: bool = False,
    state_layout: StateLayout = "kv",
) -> dict[str, Tensor | None]:
    """Random KDA inputs in the FLA test style (kda-math §4.2), deterministic in ``seed`` on any device.

    Returns ``{q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens}``: keyword arguments accepted both
    by the references and by a kdagen kernel (``A_log``/``dt_bias``/``initial_state``/``cu_seqlens`` may be
    None).

    - q, k, v: randn in ``dtype``. Without in-kernel l2norm, q and k are pre-normalised (``F.normalize``) so
      the recurrence stays contractive (beta * |k|^2 <= 1).
    - ``gate == "precomputed"``: ``g = logsigmoid(randn) / gate_logit_normalizer``; a fraction ``mask_p`` of
      the elements is set to 0 (no decay), or to -1000 (hard reset) with ``hard_reset``;
      ``clamp(lower_bound, 0)`` if ``safe_gate``.
    - in-kernel gates: ``g`` is the raw input, randn; masked elements become -1000 (gate ~ 0, no decay), or
      +1000 with ``hard_reset`` (softplus: decay ~ -1000 exp(A_log); lower_bound: decay = lower_bound).
      ``A_log = randn(HV).clamp(-2, 2)`` (exp(A_log) in [0.14, 7.4]), ``dt_bias = randn(HV*K)``, both fp32.
    - beta = sigmoid(randn) in ``beta_dtype``; with a logit ``beta_mode`` the logits randn themselves (the
      same draws, so ``kda_beta(beta, "logit")`` is the prob mode's beta).
    - initial_state = randn fp32, ``[N,HV,K,V]`` or ``[N,HV,V,K]``.
    - cu_seqlens (list or tensor) requires B == 1 and T == cu_seqlens[-1]; returned as int32 on ``device``.
    """
    if gate not in GATE_MODES:
        raise ValueError(f"gate: expected one of {GATE_MODES}, got {gate!r}")
    if beta_mode not in BETA_MODES:
        raise ValueError(f"beta_mode: expected one of {BETA_MODES}, got {beta_mode!r}")
    if HV % H != 0:
        raise ValueError(f"HV={HV} must be a multiple of H={H}")
    if state_layout not in STATE_LAYOUTS:
        raise ValueError(f"state_layout: expected one of {STATE_LAYOUTS}, got {state_layout!r}")
    if (safe_gate or gate == "lower_bound") and lower_bound is None:
        raise ValueError("lower_bound: required with safe_gate or the lower_bound gate")
    if safe_gate and gate == "softplus":
        raise ValueError("safe_gate: the softplus gate is unbounded below and cannot be safe")
    N = B
    cu_list = None
    if cu_seqlens is not None:
        cu_list = _as_cu_list(cu_seqlens)
        if B != 1 or cu_list[-1] != T:
            raise ValueError(
                f"cu_seqlens: requires B == 1 and T == cu_seqlens[-1]; got B={B}, T={T}, {cu_list}"
            )
        N = len(cu_list) - 1

    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32)

    def mask_like(x: Tensor) -> Tensor:
        return torch.rand(x.shape, generator=gen, dtype=torch.float32) < mask_p

    q, k, v = randn(B, T, H, K), randn(B, T, H, K), randn(B, T, HV, V)
    if not l2norm_qk:
        q, k = F.normalize(q, p=2, dim=-1), F.normalize(k, p=2, dim=-1)

    A_log = dt_bias = None
    if gate == "precomputed":
        g = F.logsigmoid(randn(B, T, HV, K)) / gate_logit_normalizer
        if mask_p > 0:
            g = g.masked_fill(mask_like(g), HARD_RESET_G if hard_reset else 0.0)
        if safe_gate:
            g = g.clamp(float(lower_bound), 0.0)
    else:
        g = randn(B, T, HV, K)
        if mask_p > 0:
            g = g.masked_fill(mask_like(g), 1000.0 if hard_reset else -1000.0)
        A_log = randn(HV).clamp(-2.0, 2.0)
        dt_bias = randn(HV * K)
    beta = randn(B, T, HV)
    if beta_mode == "prob":
        beta = torch.sigmoid(beta)
    h0 = None
    if with_initial_state:
        h0 = randn(N, HV, K, V) if state_layout == "kv" else randn(N, HV, V, K)

    def put(x: Tensor | None, dt: torch.dtype | str) -> Tensor | None:
        return None if x is None else x.to(device=device, dtype=to_torch_dtype(dt)).contiguous()

    return {
        "q": put(q, dtype),
        "k": put(k, dtype),
        "v": put(v, dtype),
        "g": put(g, g_dtype),
        "beta": put(beta, beta_dtype),
        "A_log": put(A_log, torch.float32),
        "dt_bias": put(dt_bias, torch.float32),
        "initial_state": put(h0, torch.float32),
        "cu_seqlens": None if cu_list is None else torch.tensor(cu_list, dtype=torch.int32, device=device),
    }


def varlen_lengths(num_seqs: int, total: int, dist: str) -> list[int]:
    """Sequence lengths of the cuLA/kdagen varlen benchmarks (kda-math §4.4); they sum to ``total``.

    - ``"uniform"``: ``total // num_seqs`` each, the remainder added to the first.
    - ``"skewed"``: one long sequence first, then ``N - 1`` short ones of ``max(1, total // (2(N-1)))``.
    - ``"random"``: ``RandomState(42).dirichlet(ones(N)) * total`` rounded, each >= 1, remainder to the first.
    """
    N, T = int(num_seqs), int(total)
    if N < 1 or T < N:
        raise ValueError(f"varlen_lengths: need 1 <= num_seqs <= total, got num_seqs={N}, total={T}")
    if dist == "uniform":
        per = T // N
        lens = [per] * N
        lens[0] += T - per * N
    elif dist == "skewed":
        if N == 1:
            return [T]
        short = max(1, T // (2 * (N - 1)))
        lens = [T - short * (N - 1)] + [short] * (N - 1)
    elif dist == "random":
        raw = np.random.RandomState(42).dirichlet(np.ones(N))
        arr = np.maximum(1, np.round(raw * T).astype(np.int64))
        arr[0] += T - int(arr.sum())
        arr = np.maximum(1, arr)
        lens = [int(x) for x in arr]
    else:
        raise ValueError(f"dist: expected 'uniform', 'random' or 'skewed', got {dist!r}")
    if sum(lens) != T or min(lens) < 1:
        raise ValueError(f"varlen_lengths({N}, {T}, {dist!r}) produced invalid lengths {lens}")
    return lens


def cu_seqlens_from_lengths(
    lengths: Sequence[int], device: torch.device | str, dtype: torch.dtype = torch.int32
) -> Tensor:
    """``[0, l0, l0+l1, ...]`` as a 1-D tensor of ``dtype`` on ``device``."""
    cu = [0]
    for n in lengths:
        if int(n) < 0:
            raise ValueError(f"lengths: expected non-negative lengths, got {list(lengths)}")
        cu.append(cu[-1] + int(n))
    return torch.tensor(cu, dtype=dtype, device=device)
