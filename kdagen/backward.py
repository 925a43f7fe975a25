"""The KDA backward of a loaded kernel (kda-math.md §8), run on the current CUDA stream.

Four parts, in order:
1. The state entering every 16-token tile (`tile_states`): the kernel's own forward on a scratch state pool
   with a prefix-cache checkpoint every tile, so each tile's state lands in the slot of its tile id
   (`floor(bos / 16) + seq + step`, the map prepare and the recurrence share). Recomputed in the backward,
   or saved by the forward (`recompute=False`).
2. The reverse scan of the state's gradient (`bwd_scan` stage, after `prepare`): dS leaving every tile and
   the gradient of the initial states, from prepare's tiles and dO alone.
3. Every tile's products with its two states (`bwd_tile` stage, one CTA a tile and head): dV, and the
   gradients of the folded step's operands (dQd, dKd, dAkt, dAq, dgt).
4. The rest of every tile's gradients (`bwd_grads` stage, one CTA a tile and head, fp32; `kdagen.tile_grads`
   is its torch reference): back through P, Aqk and the decays to the prepared inputs (`kdagen.reference`'s
   `kda_gate`, `l2norm`, `kda_beta` forms), then, in torch, the GVA group sums and the l2norm's, gate's and
   beta's backward by their closed forms (the backward op runs below autograd).

Gradients come back in the inputs' dtypes: dq, dk, dv, dg (of the raw gate input for in-kernel gates), dbeta
(of beta as given), dA_log, ddt_bias (the shape given), dh0 (fp32, the state layout).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from kdagen import workspace
from kdagen.arch import CHUNK
from kdagen.reference import kda_beta, kda_gate, l2norm
from kdagen.runtime import _TORCH_DTYPE, check_scale, state_shape

# `kdagen.reference.l2norm`'s eps and the softplus gate's threshold (kda-math §2.1, §2.2): the backward
# differentiates the forms the kernels compute.
L2NORM_EPS = 1e-6
SOFTPLUS_THRESHOLD = 20.0

if TYPE_CHECKING:
    from kdagen.runtime import KDAKernel

__all__ = ["Grads", "tile_states", "run_backward"]


class Grads(NamedTuple):
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    dg: torch.Tensor
    dbeta: torch.Tensor
    dA_log: torch.Tensor | None
    ddt_bias: torch.Tensor | None
    dh0: torch.Tensor


def _offsets(cu_seqlens: torch.Tensor | None, bsz: int, seqlen: int, device: torch.device) -> torch.Tensor:
    if cu_seqlens is None:
        return torch.arange(0, bsz * seqlen + 1, seqlen, dtype=torch.int32, device=device)
    return cu_seqlens.to(device=device, dtype=torch.int32)


def tile_states(
    kernel: KDAKernel,
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
    cu_seqlens: torch.Tensor | None,
    policy: object = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward, keeping the state entering every tile: ``(o, final states [N, ...], states)``, states
    ``[tile slots, HV, ...]`` in the spec's state layout and dtype (slots no tile uses are zero).

    The forward runs on a pool of ``tile slots + N`` slots: sequence n's state slot is ``slots + n`` (its
    initial state, then its final one), and a checkpoint every 16 tokens writes the state after each full
    tile into the slot of the next tile's id; the first tile's (the initial state) is copied in after."""
    bsz, seqlen, hv = v.shape[:3]
    total = bsz * seqlen
    cu = _offsets(cu_seqlens, bsz, seqlen, q.device)
    nseq = cu.numel() - 1
    slots = workspace.tile_slots(total, nseq)
    spec = kernel.spec
    sdt = _TORCH_DTYPE[spec.state_dtype]
    # Zero-filled: the tile slots no sequence uses are never read, but the states are an output of the
    # training forward (recompute=False) and hold no uninitialised memory.
    pool = torch.zeros(state_shape(spec, slots + nseq, hv), dtype=sdt, device=q.device)
    if initial_state is not None:
        pool[slots:].copy_(initial_state)
    first = (cu[:-1] // CHUNK + torch.arange(nseq, device=q.device, dtype=torch.int32)).long()
    lengths = (cu[1:] - cu[:-1]).long()
    # Checkpoint m (after 16 (m + 1) tokens) goes to tile m + 1's slot; the one at the sequence's end (its
    # final state, no tile's start) is skipped.
    most = max(1, total // CHUNK)
    m = torch.arange(most, device=q.device)
    ck = torch.where(CHUNK * (m[None, :] + 1) < lengths[:, None], first[:, None] + m[None, :] + 1, -1)
    idx = torch.arange(slots, slots + nseq, dtype=torch.int32, device=q.device)
    o, _ = kernel(q, k, v, g, beta, scale=scale, A_log=A_log, dt_bias=dt_bias,
                  cu_seqlens=cu_seqlens, policy=policy, state_pool=pool, state_indices=idx,
                  checkpoint_interval=CHUNK, checkpoint_indices=ck.to(torch.int32))
    final = pool[slots:].clone()
    states = pool[:slots]
    if initial_state is not None:
        states.index_copy_(0, first, initial_state.to(sdt))
    else:
        states.index_fill_(0, first, 0.0)
    return o, final, states


def run_backward(
    kernel: KDAKernel,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    do: torch.Tensor | None,
    *,
    dht: torch.Tensor | None,
    scale: float | None,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    states: torch.Tensor | None = None,
    policy: object = None,
) -> Grads:
    """Gradients of the forward's inputs given dO (``do``, [B, T, HV, V]) and the final states' gradient
    (``dht``, the state layout; None: zero). ``states`` are `tile_states`' (recomputed when None). The
    inputs are the forward's, already validated by it."""
    spec = kernel.spec
    bsz, seqlen, nh, kdim = q.shape
    hv, vdim = v.shape[2], v.shape[3]
    total = bsz * seqlen
    device = q.device
    scale = check_scale(scale, kdim)
    cu = _offsets(cu_seqlens, bsz, seqlen, device)
    nseq = cu.numel() - 1
    if states is None:
        _, _, states = tile_states(kernel, q, k, v, g, beta, scale=scale, A_log=A_log, dt_bias=dt_bias,
                                   initial_state=initial_state, cu_seqlens=cu_seqlens, policy=policy)

    # ---- the reverse scan: dS leaving every tile, dh0 ----
    dt = _TORCH_DTYPE[spec.dtype]
    ws = workspace.layout(total, hv, nseq, kdim, dt.itemsize)
    buf = torch.empty((ws.size // workspace.ROW, workspace.ROW), dtype=torch.uint8, device=device)
    sizes = (bsz, seqlen, nh, hv, nseq)
    compact = [t.contiguous() for t in (q, k, g, beta)]
    gate_args = kernel._gate_args(A_log, dt_bias, hv, device)
    sms = kernel._sm_count(device)
    # Every tile id of a sequence is written by the scan and read by bwd_tile; unused ids are never read.
    dh = torch.empty((ws.tile_slots, hv, vdim, kdim), dtype=torch.float32, device=device)
    dh0 = torch.empty(state_shape(spec, nseq, hv), dtype=torch.float32, device=device)
    dht_arg = dht.to(torch.float32).contiguous() if dht is not None else torch.zeros(
        state_shape(spec, 1, hv), dtype=torch.float32, device=device)
    if do is None:  # only the final state's gradient reaches the call
        do = torch.zeros(v.shape[:3] + (vdim,), dtype=dt, device=device)
    do_arg = do.to(dt).contiguous().view(total, hv, vdim)
    f32 = torch.float32
    prods = {name: torch.empty((total, hv, d), dtype=f32, device=device)
             for name, d in (("dv", vdim), ("dqd", kdim), ("dkd", kdim), ("dakt", kdim), ("daq", CHUNK))}
    dgt = torch.empty((ws.tile_slots, hv, kdim), dtype=f32, device=device)
    # The prepared inputs in fp32, one row a value head, as bwd_grads differentiates them.
    group = hv // nh
    qf, kf = q.to(f32), k.to(f32)
    qp, kp = (l2norm(qf), l2norm(kf)) if spec.l2norm_qk else (qf, kf)
    qp = (qp * scale).repeat_interleave(group, dim=2).reshape(total, hv, kdim)
    kp = kp.repeat_interleave(group, dim=2).reshape(total, hv, kdim)
    gp = kda_gate(g.to(f32), gate=spec.gate, A_log=_a_log(spec.gate, A_log, hv, device), dt_bias=dt_bias,
                  lower_bound=spec.lower_bound).reshape(total, hv, kdim).contiguous()
    bp = kda_beta(beta.to(f32), spec.beta).reshape(total, hv).contiguous()
    grads = {name: torch.empty((total, hv, kdim), dtype=f32, device=device) for name in ("dq", "dk", "dg")}
    grads["dbeta"] = torch.empty((total, hv), dtype=f32, device=device)
    with kernel._stream_scope(device):
        kd, qd, akt, aq, gt, cu_c = kernel._run_prepare(*compact, gate_args, cu, ws, buf, sizes, scale, sms)
        kernel._bwd_scan(kd, qd, akt, aq, gt, do_arg, cu_c, dht_arg, dh0, dh, int(dht is not None))
        kernel._bwd_tile(kd, akt, aq, v.contiguous().view(total, hv, vdim), do_arg, cu_c, states, dh,
                         prods["dv"], prods["dqd"], prods["dkd"], prods["dakt"], prods["daq"], dgt)
        kernel._bwd_grads(qp.contiguous(), kp.contiguous(), gp, bp, prods["dqd"], prods["dkd"], prods["dakt"],
                          prods["daq"], dgt, cu_c, grads["dq"], grads["dk"], grads["dg"], grads["dbeta"])

    # ---- the input transforms' backward and the GVA group sums ----
    dq = _qk_backward(qf, grads["dq"].view(bsz, seqlen, nh, group, kdim).sum(3) * scale, spec.l2norm_qk)
    dk = _qk_backward(kf, grads["dk"].view(bsz, seqlen, nh, group, kdim).sum(3), spec.l2norm_qk)
    dg, d_alog, d_bias = _gate_backward(spec.gate, spec.lower_bound, g, grads["dg"].view(g.shape), A_log,
                                        dt_bias)
    dbeta = _beta_backward(spec.beta, beta, grads["dbeta"].view(beta.shape))
    dv = prods["dv"].view(v.shape).to(v.dtype)
    return Grads(dq.to(q.dtype), dk.to(k.dtype), dv, dg.to(g.dtype), dbeta.to(beta.dtype), d_alog, d_bias,
                 dh0)


def _a_log(gate: str, A_log: torch.Tensor | None, hv: int, device: torch.device) -> torch.Tensor | None:
    # The kernels' default where A_log is not given: zero, so exp(A_log) = 1 (the softplus form needs one).
    if A_log is None and gate == "softplus":
        return torch.zeros(hv, dtype=torch.float32, device=device)
    return A_log


def _qk_backward(x: torch.Tensor, dy: torch.Tensor, l2norm_qk: bool) -> torch.Tensor:
    """The gradient of x (fp32) from that of l2norm(x) (or of x itself): y = x r, r = (|x|^2 + eps)^-1/2,
    dx = r (dy - y (y . dy))."""
    if not l2norm_qk:
        return dy
    r = torch.rsqrt(x.square().sum(-1, keepdim=True) + L2NORM_EPS)
    y = x * r
    return r * (dy - y * (dy * y).sum(-1, keepdim=True))


def _gate_backward(gate: str, lower_bound: float | None, g: torch.Tensor, dg: torch.Tensor,
                   A_log: torch.Tensor | None, dt_bias: torch.Tensor | None,
                   ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(d g_raw, dA_log, ddt_bias) from the gradient of the log-decay, for `kda_gate`'s forms (kda-math
    §2.1): lower_bound lb sigmoid(a (x + b)), softplus -a softplus(x + b) (threshold 20), a = exp(A_log)."""
    if gate == "precomputed":
        return dg, None, None
    hv, kdim = g.shape[-2], g.shape[-1]
    x = g.to(torch.float32)
    if dt_bias is not None:
        x = x + dt_bias.to(torch.float32).reshape(hv, kdim)
    a = None if A_log is None else A_log.to(torch.float32).exp().reshape(hv, 1)
    if gate == "lower_bound":
        z = x if a is None else a * x
        s = torch.sigmoid(z)
        dz = dg * (float(lower_bound) * s * (1.0 - s))  # type: ignore[arg-type]
        dx = dz if a is None else dz * a
        da = None if a is None else dz * z  # d/dA_log of a x is a x
    else:
        a1 = torch.ones((hv, 1), dtype=torch.float32, device=g.device) if a is None else a
        slope = torch.where(x > SOFTPLUS_THRESHOLD, torch.ones_like(x), torch.sigmoid(x))
        dx = -dg * a1 * slope
        da = None if a is None else -dg * a1 * torch.nn.functional.softplus(x, 1.0, SOFTPLUS_THRESHOLD)
    token_dims = tuple(range(g.dim() - 2))
    d_alog = None
    if da is not None and A_log is not None:
        d_alog = da.sum(dim=(*token_dims, g.dim() - 1)).reshape(A_log.shape).to(A_log.dtype)
    d_bias = None if dt_bias is None else dx.sum(dim=token_dims).reshape(dt_bias.shape).to(dt_bias.dtype)
    return dx, d_alog, d_bias


def _beta_backward(mode: str, beta: torch.Tensor, dbp: torch.Tensor) -> torch.Tensor:
    """The gradient of beta as given from that of beta as used (`kda_beta`): prob as is, logit through the
    sigmoid, logit_x2 through twice the sigmoid."""
    if mode == "prob":
        return dbp
    s = torch.sigmoid(beta.to(torch.float32))
    return dbp * s * (1.0 - s) * (2.0 if mode == "logit_x2" else 1.0)
