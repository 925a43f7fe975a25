"""The KDA backward of a loaded kernel (kda-math.md §8), run on the current CUDA stream.

Four parts, after prepare (`bwd_prepare`):
1. The state entering every run of `bwd_tile`'s tiles (64 tokens, `plan.BWD_STATE_TILES` tiles), written
   in the MMA type into the slot of its run id (`floor(bos / 64) + seq + step`, the tiles' map at the run's
   length, `kdagen.kernels.run_map`). Recomputed in the backward by the recurrence alone on prepare's tiles
   (`bwd_states`, which derives the slots from the offsets and writes the entering states itself), on a
   second stream beside part 2, or, where intra-card CP splits the call, by the kernel's own forward with a
   checkpoint every run at the slots of a run map made here (`tile_states`); or saved by that forward
   (`recompute=False`).
2. The reverse scan of the state's gradient (`bwd_scan` stage, after `bwd_prepare`: prepare, also keeping
   every tile's intra-tile matrices Mqk and Akk): dS leaving every tile and the gradient of the initial
   states, from prepare's tiles and dO alone; split into segments by intra-card CP (`bwd_cp_*` stages)
   where the forward's schedule would split the call.
3. Every tile's products with its two states (`bwd_tile` stage, one CTA a run of tiles and head, carrying
   the state entering the run through its tiles): dV, and the gradients of the folded step's operands (dQd,
   dKd, dAkt, dAq, dgt).
4. The rest of every tile's gradients (`bwd_grads` stage, one CTA a tile and q/k head, fp32 from prepare's
   Mqk and Akk;
   `kdagen.tile_grads.input_grads` is its torch reference): back through P, Aqk and the decays to the
   prepared inputs, then through the l2norm, the gate and beta's transform to the inputs as given, summing
   the GVA groups; dA_log and ddt_bias as per-tile partial sums, added up here in torch.

Gradients come back in the inputs' dtypes: dq, dk, dv, dg (of the raw gate input for in-kernel gates), dbeta
(of beta as given), dA_log, ddt_bias (the shape given), dh0 (fp32, the state layout).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, NamedTuple

import torch

from kdagen import workspace
from kdagen.arch import CHUNK
from kdagen.kernels import run_map
from kdagen.runtime import _TORCH_DTYPE, check_scale, state_shape

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


def _offsets(kernel: KDAKernel, cu_seqlens: torch.Tensor | None, bsz: int, seqlen: int,
             device: torch.device) -> torch.Tensor:
    # Fixed lengths: the forward's own cached offsets (the same key as `KDAKernel._prefill`'s).
    if cu_seqlens is None:
        return kernel._cached(("cu", device, bsz, seqlen), lambda: torch.arange(
            0, bsz * seqlen + 1, seqlen, dtype=torch.int32, device=device))
    return cu_seqlens.to(device=device, dtype=torch.int32)


def _run_map(cu: torch.Tensor, most: int, run: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the first run id of every sequence [N] (int64), the slots of its checkpoints [N, most] (int32)):
    checkpoint m (after `run` (m + 1) tokens) goes to run m + 1's slot; the one at the sequence's end (its
    final state, no run's start) is skipped (-1). The formulas are `run_map`'s, which the states' recurrence
    (`bwd_states`) evaluates on the device instead."""
    nseq = cu.numel() - 1
    cu = cu.long()
    first = run_map.first_run(cu[:-1], torch.arange(nseq, device=cu.device), run)
    # Checkpoint m exists where run m + 1 does.
    runs = run_map.runs_of(cu[1:] - cu[:-1], run)
    m1 = torch.arange(1, most + 1, device=cu.device)
    ck = torch.where(m1 < runs[:, None], first[:, None] + m1, -1)
    return first, ck.to(torch.int32)


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
    zero_unused: bool = True,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward, keeping the state entering every run of `bwd_tile`'s tiles: ``(o, final states [N, ...],
    states)``, states ``[run slots, HV, ...]`` in the spec's state layout and its dtype (the MMA type, in
    which `bwd_tile` reads them: half the bytes of fp32 written here and read there, the same products).

    The forward runs on a pool of N slots (sequence n's initial state, then its final one) with a
    checkpoint every run (64 tokens) into the states: the state after each full run lands in the slot of
    the next run's id; the first run's (the initial state) is copied in after. ``out`` takes o (the
    forward's contract)."""
    bsz, seqlen, hv = v.shape[:3]
    total = bsz * seqlen
    cu = _offsets(kernel, cu_seqlens, bsz, seqlen, q.device)
    nseq = cu.numel() - 1
    states = _new_states(kernel, total, nseq, hv, q.device, zero_unused)
    sdt = _TORCH_DTYPE[kernel.spec.state_dtype]
    pool = (initial_state.to(sdt, copy=True).contiguous() if initial_state is not None
            else torch.zeros(state_shape(kernel.spec, nseq, hv), dtype=sdt, device=q.device))
    first, ck = _run_slots(kernel, cu, cu_seqlens is None, bsz, seqlen)
    idx = kernel._cached(("seq_ids", q.device, nseq), lambda: torch.arange(
        nseq, dtype=torch.int32, device=q.device))
    o, _ = kernel._prefill(q, k, v, g, beta, scale=scale, A_log=A_log, dt_bias=dt_bias, initial_state=None,
                           output_final_state=False, cu_seqlens=cu_seqlens, policy=policy, state_pool=pool,
                           state_indices=idx, has_initial_state=None,
                           checkpoint_interval=CHUNK * kernel.bwd_state_tiles, start_positions=None,
                           checkpoint_indices=ck, out=out, tile_states=states)
    _first_states(states, first, initial_state)
    return o, pool, states


def _new_states(kernel: KDAKernel, total: int, nseq: int, hv: int, device: torch.device,
                zero_unused: bool) -> torch.Tensor:
    # The kept states' buffer: a slot a run id, in the spec's state layout and its MMA type.
    slots = workspace.tile_slots(total, nseq, kernel.bwd_state_tiles)
    shape = state_shape(kernel.spec, slots, hv)
    dt = _TORCH_DTYPE[kernel.spec.dtype]
    return (torch.zeros if zero_unused else torch.empty)(shape, dtype=dt, device=device)


def _run_slots(kernel: KDAKernel, cu: torch.Tensor, fixed: bool, bsz: int,
               seqlen: int) -> tuple[torch.Tensor, torch.Tensor]:
    # `_run_map` of the call. A sequence holds at most its length // run checkpoints: the call's T with
    # fixed lengths, else (no device read of cu_seqlens) all its tokens. With fixed lengths the map depends
    # on the sizes alone and is made once (a call's host time is most of a small backward's).
    run = CHUNK * kernel.bwd_state_tiles
    most = max(1, (seqlen if fixed else bsz * seqlen) // run)
    if fixed:
        return kernel._cached(("run_map", cu.device, bsz, seqlen, run), lambda: _run_map(cu, most, run))
    return _run_map(cu, most, run)


def _first_states(states: torch.Tensor, first: torch.Tensor, initial_state: torch.Tensor | None) -> None:
    # The state entering each sequence's first run is its initial state (zero when None): no checkpoint
    # writes it.
    if initial_state is not None:
        states.index_copy_(0, first, initial_state.to(states.dtype))
    else:
        states.index_fill_(0, first, 0.0)


def _states_beside_scan(kernel: KDAKernel, nseq: int, total: int, hv: int, device: torch.device,
                        policy: object) -> bool:
    # The recomputed states come from the recurrence alone (`bwd_states`, beside the reverse scan) where the
    # variant has the stage and the forward's schedule runs whole sequences; where it splits them (intra-card
    # CP: few long sequences, whose serial chains alone would leave most SMs idle) the forward itself reruns.
    if kernel._bwd_states is None or total == 0 or nseq == 0:  # (an empty call: the forward's early return)
        return False
    return kernel._schedule(nseq, total, hv, kernel._sm_count(device), policy).seg_len is None


class _SideStream:
    """A second stream forked from the current one (`with` makes it current), joined back by `join`; on a
    CPU device (the backward's emulation) both are no-ops. Tensors it uses are the caller's, alive until
    after the join."""

    def __init__(self, kernel: KDAKernel, device: torch.device) -> None:
        self._main = self._side = None
        if device.type == "cuda":
            self._main = torch.cuda.current_stream(device)
            self._side = kernel._cached(("side stream", device), lambda: torch.cuda.Stream(device))
            self._side.wait_stream(self._main)

    def __enter__(self) -> _SideStream:
        self._ctx = torch.cuda.stream(self._side) if self._side is not None else contextlib.nullcontext()
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._ctx.__exit__(*exc)

    def join(self) -> None:
        if self._main is not None:
            self._main.wait_stream(self._side)


def _mats(ws: workspace.Workspace, hv: int, device: torch.device) -> torch.Tensor:
    # Every tile's Mqk and Akk from prepare (bwd_prepare), for bwd_grads: lower triangles, the rest unread.
    return torch.empty((ws.tile_slots, hv, 2, CHUNK, CHUNK), dtype=torch.float32, device=device)


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
    cu = _offsets(kernel, cu_seqlens, bsz, seqlen, device)
    nseq = cu.numel() - 1
    dt = _TORCH_DTYPE[spec.dtype]
    ws = workspace.layout(total, hv, nseq, kdim, dt.itemsize)
    buf = torch.empty((ws.size // workspace.ROW, workspace.ROW), dtype=torch.uint8, device=device)
    sizes = (bsz, seqlen, nh, hv, nseq)
    compact = [t.contiguous() for t in (q, k, g, beta)]
    gate_args = kernel._gate_args(A_log, dt_bias, hv, device)
    sms = kernel._sm_count(device)
    # Prepare first: the GPU starts on it while the host sets up the forward that recomputes the states
    # (which needs none of prepare's results), and that forward's workspace is gone before the products'
    # buffers below are allocated.
    mats = _mats(ws, hv, device)
    with kernel._stream_scope(device):
        kd, qd, akt, aq, gt, cu_c = kernel._run_prepare(*compact, gate_args, cu, ws, buf, sizes, scale, sms,
                                                        mats=mats)
    v_c = v.contiguous().view(total, hv, vdim)
    # dv (v's dtype is the MMA type) first holds the forward's o, which is 0 past cu_seqlens[-1], the rows
    # bwd_tile does not write (the other gradients' tails are bwd_grads').
    dv = torch.empty((total, hv, vdim), dtype=dt, device=device)
    side = None
    if states is None and _states_beside_scan(kernel, nseq, total, hv, device, policy):
        # The recurrence alone on prepare's tiles, on a second stream forked here, after prepare and the
        # allocation of every buffer it writes: it runs beside the reverse scan (both read only prepare's
        # tiles), and bwd_tile waits for both.
        states = _new_states(kernel, total, nseq, hv, device, zero_unused=False)
        side = _SideStream(kernel, device)

    # ---- the reverse scan: dS leaving every tile, dh0 ----
    # Launched before the states' host setup (their run map, the recurrence's launch, or the forward's
    # rerun), so that the GPU runs it meanwhile. Every tile id of a sequence is written by the scan and read
    # by bwd_tile; unused ids are never read. In the MMA type, as bwd_tile stages it: the same operands as an
    # fp32 dh, half the bytes.
    dh = torch.empty((ws.tile_slots, hv, vdim, kdim), dtype=dt, device=device)
    dh0 = torch.empty(state_shape(spec, nseq, hv), dtype=torch.float32, device=device)
    dht_arg = dht.to(torch.float32).contiguous() if dht is not None else kernel._cached(
        ("zero dht", device, hv), lambda: torch.zeros(state_shape(spec, 1, hv), dtype=torch.float32,
                                                      device=device))
    if do is None:  # only the final state's gradient reaches the call
        do = torch.zeros(v.shape[:3] + (vdim,), dtype=dt, device=device)
    do_arg = do.to(dt).contiguous().view(total, hv, vdim)
    with kernel._stream_scope(device):
        kernel._run_reverse_scan(kd, qd, akt, aq, gt, do_arg, cu_c, dht_arg, dh0, dh, int(dht is not None),
                                 policy)

    if side is not None:
        with side:
            h0 = None if initial_state is None else initial_state.to(kernel._state_dtype)
            # (its o goes to dv, which bwd_tile writes after the join; the run map and the first states are
            # the stage's own)
            kernel._run_states(kd, qd, akt, aq, gt, v_c, cu_c, ws, buf, h0, states, dv)
    elif states is None:  # the forward's rerun, after the scan on the same stream
        _, _, states = tile_states(kernel, q, k, v, g, beta, scale=scale, A_log=A_log, dt_bias=dt_bias,
                                   initial_state=initial_state, cu_seqlens=cu_seqlens, policy=policy,
                                   zero_unused=False, out=dv.view(v.shape[:3] + (vdim,)))

    f32 = torch.float32
    prods = {name: torch.empty((total, hv, d), dtype=f32, device=device)
             for name, d in (("dqd", kdim), ("dkd", kdim), ("dakt", kdim), ("daq", CHUNK))}
    dgt = torch.empty((ws.tile_slots, hv, kdim), dtype=f32, device=device)
    # bwd_grads writes the gradients of the inputs as given (q and k through the l2norm and the GVA sum, g
    # through the gate, beta through its transform); the gate's parameters get per-tile partial sums.
    dq = torch.empty((total, nh, kdim), dtype=q.dtype, device=device)
    dk = torch.empty((total, nh, kdim), dtype=k.dtype, device=device)
    dg = torch.empty((total, hv, kdim), dtype=g.dtype, device=device)
    dbeta = torch.empty((total, hv), dtype=beta.dtype, device=device)
    gate_parts: tuple[torch.Tensor, ...] = ()
    if gate_args:  # unused tile ids are never written: zero so that the sums over tiles see nothing there
        gate_parts = tuple(torch.zeros((2, ws.tile_slots, hv, kdim), dtype=f32, device=device))
    q_c, k_c, g_c, beta_c = compact
    with kernel._stream_scope(device):
        if side is not None:
            side.join()
        kernel._bwd_tile(kd, akt, aq, v_c, do_arg, gt, cu_c, states, dh,
                         dv, prods["dqd"], prods["dkd"], prods["dakt"], prods["daq"], dgt)
        gate_in = (gate_args[0], gate_args[1].view(hv, kdim)) if gate_args else ()
        kernel._bwd_grads(q_c.view(total, nh, kdim), k_c.view(total, nh, kdim), g_c.view(total, hv, kdim),
                          beta_c.view(total, hv), *gate_in, prods["dqd"], prods["dkd"], prods["dakt"],
                          prods["daq"], dgt, mats, cu_c, dq, dk, dg, dbeta, *gate_parts, float(scale))

    d_alog = d_bias = None
    if A_log is not None:
        d_alog = gate_parts[0].sum(dim=(0, 2)).reshape(A_log.shape).to(A_log.dtype)
    if dt_bias is not None:
        d_bias = gate_parts[1].sum(dim=0).reshape(dt_bias.shape).to(dt_bias.dtype)
    return Grads(dq.view(q.shape), dk.view(k.shape), dv.view(v.shape), dg.view(g.shape),
                 dbeta.view(beta.shape), d_alog, d_bias, dh0)
