"""The backward's plumbing on the CPU (`kdagen.backward`, the ``kdagen::forward_train`` and
``kdagen::backward`` ops and their autograd registration), on a kernel whose device parts are emulated in
fp64: its forward (the pool form with a checkpoint every run of tiles, as `tile_states` calls it) is the
reference's, and its reverse scan (`bwd_scan`, or the `bwd_cp_*` stages in CP segments) is the chunked
backward's state gradient, a chunk at a time, whole or in the segmented form, and `bwd_tile` carries each
run's state through its tiles in fp64. Everything else runs as on the GPU: the tile map, the states' and
dS's layouts, the chunk-local backward, the gate's, l2norm's and beta's backward and the GVA sums, both
recompute modes. The gradients must equal those of the fp64 autograd oracle (`kda_reference_autograd`) over
gate modes, GVA, varlen with partial tiles, both state layouts and beta modes."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kdagen
from kdagen import backward, ops
from kdagen.chunk_math import chunk_parts, chunk_stage_backward
from kdagen.plan import bwd_state_tiles
from kdagen.policy import SchedulePolicy
from kdagen.reference import (
    _prepare,
    _seq_bounds,
    kda_beta,
    kda_pool_prefill_reference,
    kda_recurrent_reference,
    kda_reference_autograd,
    make_inputs,
    rel_rmse,
)
from kdagen.runtime import check_scale, state_shape
from kdagen.spec import KernelSpec
from kdagen.tile_grads import input_grads

GRADS = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")


class EmuKernel:
    """`KDAKernel`'s surface that `kdagen.backward` uses, the device parts in fp64 torch."""

    def __init__(self, spec: KernelSpec) -> None:
        self.spec = spec
        self.last: dict[str, Any] = {}
        self.scans = 0
        self.segmented = 0  # reverse scans run in CP segments
        self.bwd_state_tiles = bwd_state_tiles(spec)  # as KDAKernel's: tiles a run of the kept states
        self._dummies: dict[tuple, torch.Tensor] = {}
        self._bwd_states = True  # the stage exists: `_run_states` below
        self._state_dtype = torch.float32
        self.states_runs = 0  # recomputed states from prepare's tiles (`_run_states`)
        self.launches: list[str] = []  # the backward's stages in the order the host launched them

    def _opts(self) -> dict[str, Any]:
        s = self.spec
        return {"gate": s.gate, "lower_bound": s.lower_bound, "l2norm_qk": s.l2norm_qk,
                "state_layout": s.state_layout}

    def __call__(self, q, k, v, g, beta, *, scale=None, A_log=None, dt_bias=None, initial_state=None,
                 output_final_state=False, cu_seqlens=None, policy=None, state_pool=None, state_indices=None,
                 has_initial_state=None, checkpoint_interval=None, start_positions=None,
                 checkpoint_indices=None, out=None, recompute=True):
        if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in (
                q, k, v, g, beta, A_log, dt_bias, initial_state)):
            return ops.kda_forward(self.spec, q, k, v, g, beta, scale=scale, A_log=A_log, dt_bias=dt_bias,
                                   initial_state=initial_state, output_final_state=output_final_state,
                                   cu_seqlens=cu_seqlens, policy=policy, recompute=recompute)
        scale = check_scale(scale, self.spec.head_dim_k)
        self.last = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "scale": scale, "A_log": A_log,
                     "dt_bias": dt_bias, "cu_seqlens": cu_seqlens}
        if state_pool is not None:
            # (The pool reference takes beta as used: the spec's beta mode applied here.)
            o = kda_pool_prefill_reference(
                q, k, v, g, kda_beta(beta.double(), self.spec.beta), state_pool=state_pool,
                state_indices=state_indices, cu_seqlens=cu_seqlens,
                has_initial_state=has_initial_state, checkpoint_interval=checkpoint_interval,
                start_positions=start_positions, checkpoint_indices=checkpoint_indices, scale=scale,
                A_log=A_log, dt_bias=dt_bias, **self._opts())
            return o.to(q.dtype), None
        o, ht = kda_recurrent_reference(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                        output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                        A_log=A_log, dt_bias=dt_bias, beta_mode=self.spec.beta,
                                        **self._opts())
        return o.to(q.dtype), (None if ht is None else ht.float())

    def _prefill(self, q, k, v, g, beta, *, state_pool, state_indices, checkpoint_indices, tile_states,
                 **kw):
        # As KDAKernel's: the checkpoints go to tile_states' slots (rounded to its dtype), the sequences'
        # states to the pool's.
        if self.launches and self.launches[-1] != "states":  # tile_states: the forward's rerun
            self.launches.append("forward")
        nt = tile_states.shape[0]
        pool = torch.cat([torch.zeros((nt, *state_pool.shape[1:]), dtype=state_pool.dtype), state_pool])
        o, _ = self(q, k, v, g, beta, state_pool=pool, state_indices=state_indices + nt,
                    checkpoint_indices=checkpoint_indices, **kw)
        tile_states.copy_(pool[:nt])
        state_pool.copy_(pool[nt:])
        return o, None

    def _gate_args(self, A_log, dt_bias, hv, device):
        # as KDAKernel's: (A_log [HV], dt_bias [HV * K]) for an in-kernel gate, zeros where not given
        if self.spec.gate == "precomputed":
            return ()
        kdim = self.spec.head_dim_k
        a_log = A_log if A_log is not None else torch.zeros(hv, device=device)
        bias = dt_bias.reshape(hv * kdim) if dt_bias is not None else torch.zeros(hv * kdim, device=device)
        return (a_log, bias)

    def _sm_count(self, device):
        return 1

    def _schedule(self, nseq, total, hv, sms, policy):
        # as KDAKernel's where it matters here: segments only where a policy forces intra-card CP
        seg = policy.intracard_cp if policy is not None and isinstance(policy.intracard_cp, int) else None
        return SimpleNamespace(seg_len=seg)

    def _run_states(self, kd, qd, akt, aq, gt, v, cu, ws, buf, initial_state, states, scratch):
        # As KDAKernel's (bwd_states): the recurrence from each sequence's initial state writing the state
        # entering every run into `states`, here the emulated forward on the inputs of the forward run last,
        # at the slots of the host's run map (the formulas the stage evaluates on the device).
        x, nseq = self.last, cu.numel() - 1
        first, checkpoints = backward._run_slots(self, cu, False, 1, v.shape[0])
        pool = (initial_state.clone() if initial_state is not None
                else torch.zeros(state_shape(self.spec, nseq, v.shape[1])))
        self.states_runs += 1
        self.launches.append("states")
        self._prefill(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=x["scale"], A_log=x["A_log"],
                      dt_bias=x["dt_bias"], cu_seqlens=x["cu_seqlens"], state_pool=pool,
                      state_indices=torch.arange(nseq, dtype=torch.int32), checkpoint_indices=checkpoints,
                      checkpoint_interval=16 * self.bwd_state_tiles, tile_states=states)
        backward._first_states(states, first, initial_state)

    def _cached(self, key, make):
        # as KDAKernel's: constant helper tensors made once a key
        if key not in self._dummies:
            self._dummies[key] = make()
        return self._dummies[key]

    def _stream_scope(self, device):
        return contextlib.nullcontext()

    def _run_prepare(self, q, k, g, beta, gate_args, cu, ws, buf, sizes, scale, sms, mats=None):
        # (bwd_grads' reference forms the tiles' Mqk and Akk itself: `mats` stays unwritten)
        self.launches.append("prepare")
        return (None,) * 5 + (cu,)

    def _run_reverse_scan(self, kd, qd, akt, aq, gt, do, cu, dht, dh0, dh, has_dht, policy):
        """dS leaving every tile (at its tile id, [V, K]) and dh0 (the state layout), by the chunked
        backward in fp64 from the inputs of the forward run last (the one `tile_states` ran). A policy that
        forces intra-card CP (segments of `intracard_cp` tokens) takes the device's segmented form: every
        segment's offset (from zero) and linear map (from the identity with dO = 0), the maps combined last
        segment to first from dht, then every segment again from its merged gradient."""
        self.scans += 1
        self.launches.append("scan")
        x, s = self.last, self.spec
        p = _prepare(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=x["scale"], initial_state=None,
                     cu_seqlens=x["cu_seqlens"], gate=s.gate, A_log=x["A_log"], dt_bias=x["dt_bias"],
                     lower_bound=s.lower_bound, l2norm_qk=s.l2norm_qk, state_layout=s.state_layout,
                     dtype=torch.float64, beta_mode=s.beta)
        hv, kdim, vdim = p.v.shape[2], p.k.shape[-1], p.v.shape[-1]
        seqlen = p.v.shape[1]
        dO = do.double().view(p.v.shape)
        seg = self._schedule(cu.numel() - 1, do.shape[0], hv, 1, policy).seg_len  # (as the runtime decides)
        self.segmented += seg is not None

        def back(b, bos, a, e, dS, d_o, tiles):
            # dS back through tokens [a, e) of the sequence at bos in batch row b (a tile-aligned run); the
            # gradient leaving each tile to dh at its tile id when given the sequence's tile base. The states
            # entering the tiles are not needed for dS (chunk_stage_backward's dS_in does not depend on S).
            for c0 in reversed(range(a, e, 16)):
                c1 = min(c0 + 16, e)
                if tiles is not None:
                    dh[tiles + (c0 - bos) // 16] = dS.transpose(-1, -2).float()
                sl = (b, slice(c0, c1))
                S = torch.zeros(hv, kdim, dS.shape[-1], dtype=torch.float64)
                v0 = torch.zeros(hv, c1 - c0, dS.shape[-1], dtype=torch.float64)
                dS = chunk_stage_backward(*(t[sl].transpose(0, 1) for t in (p.q, p.k)), v0,
                                          *(t[sl].transpose(0, 1) for t in (p.g, p.beta)), S,
                                          d_o[sl].transpose(0, 1), dS)["dS"]
            return dS

        no_do = torch.zeros(*p.v.shape[:3], kdim, dtype=torch.float64)
        eye = torch.eye(kdim, dtype=torch.float64).expand(hv, kdim, kdim)
        for i, (b, bos, eos) in enumerate(_seq_bounds(p.v.shape[0], seqlen, x["cu_seqlens"])):
            tiles = (b * seqlen + bos) // 16 + i  # the kernels' tile-id map
            dS = torch.zeros(hv, kdim, vdim, dtype=torch.float64)
            if has_dht:
                d = dht[i].double()
                dS = d.transpose(-1, -2) if s.state_layout == "vk" else d
            if seg is None:
                dS = back(b, bos, bos, eos, dS, dO, tiles)
            else:
                runs = [(a, min(a + seg, eos)) for a in range(bos, eos, seg)] or [(bos, bos)]
                zero = torch.zeros_like(dS)
                # dS entering a segment = its map @ dS leaving it + its offset
                offsets = [back(b, bos, a, e, zero, dO, None) for a, e in runs]
                maps = [back(b, bos, a, e, eye, no_do, None) for a, e in runs]
                leaving = [dS] * len(runs)
                for j in reversed(range(1, len(runs))):
                    leaving[j - 1] = maps[j] @ leaving[j] + offsets[j]
                for j in reversed(range(len(runs))):
                    dS_j = back(b, bos, *runs[j], leaving[j], dO, tiles)
                    if j == 0:
                        dS = dS_j
            dh0[i] = (dS.transpose(-1, -2) if s.state_layout == "vk" else dS).float()

    def _bwd_tile(self, kd, akt, aq, v, do, gt, cu, states, dh, dv, dqd, dkd, dakt, daq, dgt):
        """`bwd_tile`'s products a tile at a time in fp64 (the folded step's formulas), from the inputs of the
        forward run last and the states it is given: one a run of tiles, carried through the run's tiles by
        the forward's step, as the stage carries it."""
        self.launches.append("tile")
        x, s = self.last, self.spec
        p = _prepare(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=x["scale"], initial_state=None,
                     cu_seqlens=x["cu_seqlens"], gate=s.gate, A_log=x["A_log"], dt_bias=x["dt_bias"],
                     lower_bound=s.lower_bound, l2norm_qk=s.l2norm_qk, state_layout=s.state_layout,
                     dtype=torch.float64, beta_mode=s.beta)
        seqlen = p.v.shape[1]
        run = 16 * self.bwd_state_tiles
        dO = do.double().view(p.v.shape)
        for i, (b, bos, eos) in enumerate(_seq_bounds(p.v.shape[0], seqlen, x["cu_seqlens"])):
            start = b * seqlen + bos
            for c0 in range(bos, eos, 16):
                c1 = min(c0 + 16, eos)
                tile = start // 16 + i + (c0 - bos) // 16
                if (c0 - bos) % run == 0:  # a run's first tile: its state as the forward kept it
                    S = states[start // run + i + (c0 - bos) // run].double()
                    S = S.transpose(-1, -2) if s.state_layout == "vk" else S
                dS = dh[tile].double().transpose(-1, -2)
                sl = (b, slice(c0, c1))
                qc, kc, vc, gc, bc = (t[sl].transpose(0, 1) for t in (p.q, p.k, p.v, p.g, p.beta))
                c = chunk_parts(qc, kc, vc, gc, bc, S)
                P = c["A"]
                aq_, akt_ = c["Aqk"] @ P, P.transpose(1, 2) @ c["kg"]
                R = vc - c["KE"] @ S
                dR = aq_.transpose(1, 2) @ dO[sl].transpose(0, 1) + akt_ @ dS
                rows = slice(b * seqlen + c0, b * seqlen + c1)
                dv[rows] = dR.transpose(0, 1).to(dv.dtype)
                dqd[rows] = (dO[sl].transpose(0, 1) @ S.transpose(1, 2)).transpose(0, 1).float()
                dkd[rows] = (-dR @ S.transpose(1, 2)).transpose(0, 1).float()
                dakt[rows] = (R @ dS.transpose(1, 2)).transpose(0, 1).float()
                daq[rows] = 0.0  # the kernel writes all 16 columns (zero past the tile's tokens)
                daq[rows, :, : c1 - c0] = (dO[sl].transpose(0, 1) @ R.transpose(1, 2)).transpose(0, 1).float()
                dgt[tile] = (S * dS).sum(dim=2).float()
                S = c["g_last"].transpose(1, 2).exp() * S + akt_.transpose(1, 2) @ R  # into the next tile

    def _bwd_grads(self, q, k, g, beta, *rest):
        """`bwd_grads` by its torch reference (`kdagen.tile_grads.input_grads`); the gate's parameters' totals
        land in the first tile's partial sums."""
        gated = self.spec.gate != "precomputed"
        a_log, dt_bias = rest[:2] if gated else (None, None)
        rest = rest[2:] if gated else rest
        dqd, dkd, dakt, daq, dgt, _mats, cu, dq, dk, dg, dbeta = rest[:11]
        parts, scale = rest[11:-1], rest[-1]
        hv, kdim = g.shape[1], g.shape[2]
        bias = None if dt_bias is None else dt_bias.reshape(hv, kdim)
        out = input_grads(self.spec, q, k, g, beta, a_log, bias, dqd, dkd, dakt, daq, dgt, cu, scale)
        for name, x in (("dq", dq), ("dk", dk), ("dg", dg), ("dbeta", dbeta)):
            x.copy_(out[name])
        if gated:
            for x in parts:
                x.zero_()
            parts[0][0, :, 0] = out["dA_log"]
            parts[1][0] = out["ddt_bias"]


@pytest.fixture
def emu(monkeypatch: pytest.MonkeyPatch) -> dict[str, EmuKernel]:
    made: dict[str, EmuKernel] = {}

    def fake_get_kernel(spec: Any, policy: Any = None, force: bool = False) -> EmuKernel:
        resolved = kdagen.resolve_spec(spec)[1]
        return made.setdefault(resolved.canonical_json(), EmuKernel(resolved))

    monkeypatch.setattr(kdagen, "get_kernel", fake_get_kernel)
    return made


CASES = [
    # (id, spec fields, B, T, H, HV, cu_seqlens, initial state)
    ("lb-fixed", dict(gate="lower_bound", lower_bound=-5.0, safe_gate=True, l2norm_qk=True), 2, 21, 2, 2,
     None, True),
    ("lb-varlen-gva", dict(gate="lower_bound", lower_bound=-5.0, safe_gate=True, l2norm_qk=True, gva_ratio=2),
     1, 57, 1, 2, [0, 5, 16, 16, 49, 57], True),
    ("softplus-vk-logit", dict(gate="softplus", lower_bound=None, safe_gate=False, l2norm_qk=True,
                               state_layout="vk", beta="logit"), 1, 40, 2, 2, [0, 17, 40], False),
    ("precomputed-no-l2", dict(gate="precomputed", lower_bound=None, safe_gate=False, l2norm_qk=False,
                               beta="logit_x2"), 1, 33, 2, 2, None, True),
    # Sequences past one run of kept states (64 tokens): a run's state carried through its four tiles, a
    # second run from the forward's checkpoint, one sequence of exactly one run and a short one after.
    ("lb-varlen-runs", dict(gate="lower_bound", lower_bound=-5.0, safe_gate=True, l2norm_qk=True),
     1, 150, 1, 1, [0, 70, 134, 150], True),
]


def _case(fields: dict, B: int, T: int, H: int, HV: int, cu: list[int] | None, init: bool):
    spec = KernelSpec(arch="sm_90a", head_dim_k=64, head_dim_v=64, **fields)
    s = spec
    x = make_inputs(B, T, H, HV, 64, 64, dtype="bf16", beta_dtype="fp32", g_dtype="fp32", gate=s.gate,
                    safe_gate=s.safe_gate, lower_bound=s.lower_bound, seed=3, device="cpu",
                    l2norm_qk=s.l2norm_qk, cu_seqlens=cu, with_initial_state=init,
                    state_layout=s.state_layout, beta_mode=s.beta)
    return spec, x


@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_gradients_match_the_oracle(emu: dict, case: tuple, recompute: bool) -> None:
    kern = _check_gradients(case, recompute)
    assert kern.segmented == 0


@pytest.mark.parametrize("seg", [16, 32])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_gradients_through_cp_segments(emu: dict, case: tuple, seg: int) -> None:
    # The reverse scan in intra-card CP's segmented form (offsets, maps, the merge last segment to first,
    # the segment pass) gives the oracle's gradients: segments of one or two tiles over these short
    # sequences, some ending mid-tile, an empty sequence, dht carried through the merge.
    kern = _check_gradients(case, True, SchedulePolicy(intracard_cp=seg))
    assert kern.segmented == 1


def _check_gradients(case: tuple, recompute: bool, policy: SchedulePolicy | None = None) -> EmuKernel:
    _, fields, B, T, H, HV, cu, init = case
    spec, x = _case(fields, B, T, H, HV, cu, init)
    names = [n for n in GRADS if x.get(n) is not None]
    leaves = {n: x[n].clone().requires_grad_() for n in names}
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    gen = torch.Generator().manual_seed(7)
    nseq = B if cu is None else len(cu) - 1
    kern = kdagen.get_kernel(spec)
    o, ht = kern(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"],
                 A_log=leaves.get("A_log"), dt_bias=leaves.get("dt_bias"),
                 initial_state=leaves.get("initial_state"), output_final_state=True, cu_seqlens=cu_t,
                 recompute=recompute, policy=policy)
    do = torch.randn(o.shape, generator=gen).to(o.dtype)
    dht = torch.randn(ht.shape, generator=gen)
    torch.autograd.backward((o, ht), (do, dht))
    assert kern.scans == 1 and ht.shape[0] == nseq
    # Recomputed states come from prepare's tiles beside the scan, or from the forward where CP splits.
    assert kern.states_runs == (1 if recompute and policy is None else 0)
    # The scan goes right after prepare, so that the GPU runs it while the host sets up the states.
    states = ["states"] if recompute and policy is None else ["forward"] if recompute else []
    assert kern.launches[-(3 + len(states)):] == ["prepare", "scan", *states, "tile"], kern.launches

    ref = {n: x[n].double().clone().requires_grad_() for n in names}
    o_r, ht_r = kda_reference_autograd(
        ref["q"], ref["k"], ref["v"], ref["g"], ref["beta"], A_log=ref.get("A_log"),
        dt_bias=ref.get("dt_bias"), initial_state=ref.get("initial_state"), output_final_state=True,
        cu_seqlens=cu, gate=spec.gate, lower_bound=spec.lower_bound, l2norm_qk=spec.l2norm_qk,
        state_layout=spec.state_layout, beta_mode=spec.beta)
    torch.autograd.backward((o_r, ht_r), (do.double(), dht.double()))
    for n in names:
        got, want = leaves[n].grad, ref[n].grad
        assert got is not None and got.shape == want.shape and got.dtype == x[n].dtype, n
        # bf16 inputs, dv and the kept states in their dtype (as on the GPU); the rest is fp32 or fp64.
        # dA_log sums a head's every token and key (two heads of 21 tokens here): its terms cancel, and the
        # rounding of the run's first state shows at up to 2.4% of it (2e-7 with fp64 states), where a state
        # in a wrong slot or tile shows at O(1).
        bound = 3e-2 if n == "A_log" else 5e-3
        assert rel_rmse(want, got.double()) < bound, (n, rel_rmse(want, got.double()))
    return kern


class _PassThrough(TorchDispatchMode):
    # A dispatch mode that changes nothing: what make_fx and torch.compile's tracing set up around a call.
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


def test_the_eager_form_and_the_ops_give_the_same_gradients(emu: dict) -> None:
    # Plain tensors take `_EagerTrain` (no op dispatch); under a dispatch mode the kdagen::forward_train and
    # kdagen::backward ops run. Both run the same functions, so the gradients are bitwise equal.
    _, fields, B, T, H, HV, cu, init = CASES[2]
    spec, x = _case(fields, B, T, H, HV, cu, init)
    cu_t = torch.tensor(cu, dtype=torch.int32)
    kern = kdagen.get_kernel(spec)
    nodes, grads = [], []
    for mode in (contextlib.nullcontext(), _PassThrough()):
        leaves = {n: x[n].clone().requires_grad_() for n in GRADS if x.get(n) is not None}
        with mode:
            o, ht = kern(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"],
                         A_log=leaves.get("A_log"), dt_bias=leaves.get("dt_bias"),
                         initial_state=leaves.get("initial_state"), output_final_state=True, cu_seqlens=cu_t)
            (o.float().square().sum() + ht.square().sum()).backward()
        nodes.append(type(o.grad_fn).__name__)
        grads.append({n: t.grad for n, t in leaves.items()})
    assert nodes[0] == "_EagerTrainBackward" and nodes[1] != nodes[0], nodes
    for n in grads[0]:
        assert torch.equal(grads[0][n], grads[1][n]), n


def test_only_the_final_state_carries_a_gradient(emu: dict) -> None:
    # o is unused: its gradient reaches the backward as None (zero dO); q gets exactly zero, k its share.
    spec, x = _case(CASES[0][1], 1, 20, 2, 2, None, True)
    q, k = x["q"].clone().requires_grad_(), x["k"].clone().requires_grad_()
    kern = kdagen.get_kernel(spec)
    _, ht = kern(q, k, x["v"], x["g"], x["beta"], A_log=x["A_log"], dt_bias=x["dt_bias"],
                 initial_state=x["initial_state"], output_final_state=True)
    ht.sum().backward()
    ref_k = x["k"].double().clone().requires_grad_()
    _, ht_r = kda_reference_autograd(x["q"].double(), ref_k, x["v"].double(), x["g"].double(),
                                     x["beta"].double(), A_log=x["A_log"].double(),
                                     dt_bias=x["dt_bias"].double(), initial_state=x["initial_state"].double(),
                                     output_final_state=True, gate=spec.gate, lower_bound=spec.lower_bound,
                                     l2norm_qk=True)
    ht_r.sum().backward()
    assert rel_rmse(ref_k.grad, k.grad.double()) < 5e-3
    assert not q.grad.any()


def test_a_training_step_compiles_whole(emu: dict) -> None:
    # torch.compile(fullgraph=True) traces the forward op and its autograd formula (the backward op) with
    # their fake implementations; the compiled step's gradients equal the eager step's.
    _, fields, B, T, H, HV, cu, init = CASES[1]
    spec, x = _case(fields, B, T, H, HV, cu, init)
    sj = ops.spec_json(spec)
    cu_t = torch.tensor(cu, dtype=torch.int32)

    def step(q, k, v, g, beta, A_log, dt_bias, h0):
        o, ht = ops.kda_forward(sj, q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=h0,
                                output_final_state=True, cu_seqlens=cu_t)
        return o.float().square().sum() + ht.square().sum()

    runs = []
    for fn in (step, torch.compile(step, fullgraph=True, backend="aot_eager")):
        leaves = [x[n].clone().requires_grad_() for n in GRADS]
        fn(*leaves).backward()
        runs.append([t.grad for t in leaves])
    for name, a, b in zip(GRADS, *runs):
        assert b is not None and torch.allclose(a.float(), b.float(), rtol=1e-3, atol=1e-5), name


def test_opcheck_of_the_training_ops(emu: dict) -> None:
    _, fields, B, T, H, HV, cu, init = CASES[2]  # softplus, vk, beta logits, varlen
    spec, x = _case(fields, B, T, H, HV, cu, init)
    sj = ops.spec_json(spec)
    cu_t = torch.tensor(cu, dtype=torch.int32)
    inp = [x[n] for n in ("q", "k", "v", "g", "beta")]
    torch.library.opcheck(torch.ops.kdagen.forward_train,
                          (sj, *inp, None, x["A_log"], x["dt_bias"], None, True, cu_t, None, False))
    o, ht = kda_recurrent_reference(*inp, A_log=x["A_log"], dt_bias=x["dt_bias"], output_final_state=True,
                                    cu_seqlens=cu, gate=spec.gate, l2norm_qk=True,
                                    state_layout=spec.state_layout, beta_mode=spec.beta)
    do, dht = torch.randn(o.shape).to(torch.bfloat16), torch.randn(ht.shape)
    torch.library.opcheck(torch.ops.kdagen.backward,
                          (sj, *inp, None, x["A_log"], x["dt_bias"], None, cu_t, None, None, do, dht))
