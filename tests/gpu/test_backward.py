"""The backward on the GPU: gradients of every input against fp64 autograd of the token recurrence
(`kda_reference_autograd`), relative RMSE within kda-math §4's bounds (dq, dk, dv, dh0, dA_log, ddt_bias
0.008; dg, dbeta 0.02), over a cover of the forward's spec matrix (gate modes, safe gate on and off with
hard resets, GVA, head dims 64 and 128, bf16 and fp16, both state layouts, beta modes, both families), fixed
length and varlen, both recompute modes (the kept states, one every 64 tokens, giving the recomputed
gradients bit for bit)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from kdagen.policy import SchedulePolicy
from kdagen.reference import kda_reference_autograd, rel_rmse

try:  # tests/gpu is not a package: pytest puts this folder on sys.path (rootdir-relative import mode)
    from ._cases import CASES, SPECS, VL, Case, F, build_inputs, kernel_for
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _cases import CASES, SPECS, VL, Case, F, build_inputs, kernel_for  # type: ignore[no-redef]

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TOL = {"q": 0.008, "k": 0.008, "v": 0.008, "initial_state": 0.008, "A_log": 0.008, "dt_bias": 0.008,
       "g": 0.02, "beta": 0.02}
GRADS = tuple(TOL)
MAX_T = 1000  # the fp64 token-loop oracle's cost bounds the cases taken from the forward matrix


def _cases() -> list[tuple[str, Case]]:
    # Up to two cases a spec from the forward matrix (the shortest fixed-length and varlen ones), every spec.
    picked = []
    for name, cases in CASES.items():
        short = [c for c in cases if c.total <= MAX_T]
        fixed = [c for c in short if c.cu is None][:1]
        varlen = [c for c in short if c.cu is not None][:1]
        picked += [(name, c) for c in fixed + varlen]
    return picked


BWD = _cases()


def _grads(spec: dict[str, Any], case: Case, recompute: bool,
           policy: SchedulePolicy | None = None) -> tuple[dict, dict]:
    inp = build_inputs(spec, case)
    names = [n for n in GRADS if inp.get(n) is not None]
    gen = torch.Generator(device="cuda").manual_seed(case.seed + 11)
    leaves = {n: inp[n].clone().requires_grad_() for n in names}
    args = {**inp, **leaves}
    kern = kernel_for_spec(spec)
    if policy is not None:  # the view's policy schedules the forward and the backward
        kern = kern.with_policy(policy)
    o, ht = kern(args["q"], args["k"], args["v"], args["g"], args["beta"], A_log=args["A_log"],
                 dt_bias=args["dt_bias"], initial_state=args["initial_state"], output_final_state=case.final,
                 cu_seqlens=args["cu_seqlens"], recompute=recompute)
    do = torch.randn(o.shape, device="cuda", generator=gen).to(o.dtype)
    outs, grads_out = [o], [do]
    if ht is not None:
        outs.append(ht)
        grads_out.append(torch.randn(ht.shape, device="cuda", generator=gen, dtype=ht.dtype))
    torch.autograd.backward(outs, grads_out)

    ref = {n: inp[n].double().clone().requires_grad_() for n in names}
    rargs = {**{n: (t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t)
                for n, t in inp.items()}, **ref}
    o_r, ht_r = kda_reference_autograd(
        rargs["q"], rargs["k"], rargs["v"], rargs["g"], rargs["beta"], A_log=rargs["A_log"],
        dt_bias=rargs["dt_bias"], initial_state=rargs["initial_state"], output_final_state=case.final,
        cu_seqlens=inp["cu_seqlens"], gate=spec["gate"], lower_bound=spec["lower_bound"],
        l2norm_qk=spec["l2norm_qk"], state_layout=spec["state_layout"], beta_mode=spec.get("beta", "prob"))
    r_outs = [o_r] + ([ht_r] if ht_r is not None else [])
    torch.autograd.backward(r_outs, [x.double() for x in grads_out])
    return ({n: leaves[n].grad for n in names}, {n: ref[n].grad for n in names})


def _gate_error(spec: dict[str, Any], inp: dict[str, Any], got: torch.Tensor, want: torch.Tensor,
                dg_ref: torch.Tensor) -> float:
    """dA_log's error relative to the size of what it sums: ||got - want|| / ||summands||, the summands
    being the raw gate's fp64 gradient times d(log-decay)/dA_log over d(log-decay)/dg_raw (x = g_raw +
    dt_bias: x for the lower-bound form, softplus(x) / sigmoid(x) for softplus). dA_log sums T x K terms a
    head with random signs, so its own relative RMSE measures how much they cancel more than how accurate
    they are (FLA's tests only warn on dA for this reason, kda-math §4.2)."""
    hv, kdim = inp["g"].shape[-2], inp["g"].shape[-1]
    x = inp["g"].double()
    if inp["dt_bias"] is not None:
        x = x + inp["dt_bias"].double().reshape(hv, kdim)
    if spec["gate"] == "lower_bound":
        factor = x
    else:
        factor = torch.nn.functional.softplus(x, 1.0, 20.0) / torch.where(x > 20, 1.0, torch.sigmoid(x))
    summands = (dg_ref * factor).reshape(-1, hv, kdim)
    return float((got.double() - want).norm() / summands.norm()) if summands.norm() > 0 else 0.0


def kernel_for_spec(spec: dict[str, Any]) -> Any:
    name = next(n for n, s in SPECS.items() if s == spec)
    return kernel_for(name)


def _check_gradients(spec_name: str, case: Case, policy: SchedulePolicy | None = None) -> None:
    spec = SPECS[spec_name]
    got, want = _grads(spec, case, recompute=True, policy=policy)
    # kda-math §4.1's rule: a gradient within 1e-6 of the reference everywhere passes (a zero gradient, such
    # as the gate's of a lone first token, has no relative error to speak of).
    errors = {n: 0.0 if float((got[n].double() - want[n]).abs().max()) <= 1e-6 else
              rel_rmse(want[n], got[n].double()) for n in got}
    if "A_log" in got and errors["A_log"] > 0:  # a sum: its error against its summands' size (`_gate_error`)
        errors["A_log"] = _gate_error(spec, build_inputs(spec, case), got["A_log"], want["A_log"], want["g"])
    bad = {n: round(e, 5) for n, e in errors.items() if not e <= TOL[n]}
    assert not bad, f"error over the bound: {bad} (all: { {n: round(e, 5) for n, e in errors.items()} })"


@pytest.mark.parametrize(("spec_name", "case"), BWD, ids=[f"{s}-{c.id}" for s, c in BWD])
def test_gradients(spec_name: str, case: Case) -> None:
    _check_gradients(spec_name, case)


# Intra-card CP in the backward (the reverse scan in segments: maps, the merge last segment to first, the
# segment pass), forced with short segments as in the forward's CP tests, so that small inputs have many
# segments, segments that end mid-tile, empty sequences, dht carried through the merge and dh0 from each
# sequence's first segment. The forward for the tile states runs in CP too.
BWD_CP = [
    ("lb_safe", F(2, 1000, 2, init=True), 256),
    ("lb_safe", VL((0, 0, 1, 64, 65, 130, 700), 2, init=True), 64),
    ("p_reset_vk_bbf16", VL((0, 15, 100, 300, 1000), 2, init=True, mask_p=0.3, hard_reset=True), 128),
    ("softplus", F(1, 777, 1, init=True, mask_p=0.2, hard_reset=True), 48),
    ("lb_safe_gva4_k64v64", F(1, 1000, 1, init=True), 160),
    ("p_reset_gva2_k64v128", F(1, 600, 2, init=True, final=False), 64),
    ("lb_safe_mma_sync_logit_x2", F(1, 700, 2, init=True), 96),
    ("lb_safe_sbf16", F(1, 900, 2, init=True), 128),
]


@pytest.mark.parametrize(
    ("spec_name", "case", "seg"), BWD_CP, ids=[f"{n}-{c.id}-cp{s}" for n, c, s in BWD_CP]
)
def test_gradients_with_intracard_cp(spec_name: str, case: Case, seg: int,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # The autograd op loads the spec's kernel (the same object): its CP stages are counted on the way.
    kern = kernel_for(spec_name)
    calls: list[str] = []

    def counted(name: str, stage: Any) -> Any:
        def call(*args: Any) -> Any:
            calls.append(name)
            return stage(*args)
        return call

    monkeypatch.setattr(kern, "_bwd_cp", tuple(counted(n, f) for n, f in zip(
        ("prescan", "merge", "segments"), kern._bwd_cp, strict=True)))
    _check_gradients(spec_name, case, SchedulePolicy(intracard_cp=seg))
    assert calls == ["prescan", "merge", "segments"], calls  # the reverse scan ran in segments


# The tile states of the backward's forward from the fused kernel (bulk-copied through shared memory,
# kdagen.kernels.state_copy), in one CTA a chain and in CTA pairs: the fused forward is the two-stage one bit
# for bit, so the gradients must be too.
FUSED_TILES = [
    ("lb_safe", F(2, 1000, 2, init=True), "off"),
    ("lb_safe", VL((0, 0, 1, 64, 65, 130, 700), 2, init=True), "on"),
    ("lb_safe_sbf16", F(1, 900, 2, init=True), "off"),
]


@pytest.mark.parametrize(("spec_name", "case", "pair"), FUSED_TILES,
                         ids=[f"{n}-{c.id}-pair_{p}" for n, c, p in FUSED_TILES])
def test_tile_states_from_the_fused_kernel(spec_name: str, case: Case, pair: str) -> None:
    spec = SPECS[spec_name]
    fused, _ = _grads(spec, case, recompute=True, policy=SchedulePolicy(fused="on", fused_pair=pair))
    two_stage, _ = _grads(spec, case, recompute=True, policy=SchedulePolicy(fused="off"))
    for n in two_stage:
        assert torch.equal(fused[n], two_stage[n]), n


SAVED = [("lb_safe", c) for c in CASES["lb_safe"][:4]] + [("p_reset_vk_bbf16", CASES["p_reset_vk_bbf16"][1])]


@pytest.mark.parametrize(("spec_name", "case"), SAVED, ids=[f"{s}-{c.id}" for s, c in SAVED])
def test_saved_states_give_the_recomputed_gradients(spec_name: str, case: Case) -> None:
    # recompute=False keeps the forward's tile states; the backward then equals the recomputing one bit for
    # bit (the same kernels on the same values).
    spec = SPECS[spec_name]
    got_saved, _ = _grads(spec, case, recompute=False)
    got, _ = _grads(spec, case, recompute=True)
    for n in got:
        assert torch.equal(got[n], got_saved[n]), n


def test_gradients_are_deterministic() -> None:
    spec = SPECS["lb_safe"]
    case = CASES["lb_safe"][3]
    a, _ = _grads(spec, case, recompute=True)
    b, _ = _grads(spec, case, recompute=True)
    for n in a:
        assert torch.equal(a[n], b[n]), n


@pytest.mark.parametrize("cp", [None, 64], ids=["whole", "cp64"])
def test_tokens_past_the_last_sequence_get_zero_gradients(cp: int | None) -> None:
    # Engine padding: the tokens past cu_seqlens[-1] get o = 0 whatever they hold, so each of their gradients
    # is exactly 0 (dq, dk, dg, dbeta from bwd_grads' last tile id; dv holds the forward's o there), and the
    # sequences' gradients are those of the oracle without the tail. With CP the states come from the
    # forward (the other path to dv's tail).
    spec = SPECS["lb_safe"]
    case = VL((0, 15, 100, 300), 2, init=True)
    inp = build_inputs(spec, case)
    n_real, pad = case.total, 37
    seq_inputs = ("q", "k", "v", "g", "beta")
    names = [n for n in GRADS if inp.get(n) is not None]
    # the tail: copies of the first rows (valid values of each input's kind)
    leaves = {n: (torch.cat([inp[n], inp[n][:, :pad]], dim=1) if n in seq_inputs else inp[n]).clone()
              .requires_grad_() for n in names}
    kern = kernel_for("lb_safe")
    if cp is not None:
        kern = kern.with_policy(SchedulePolicy(intracard_cp=cp))
    o, ht = kern(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], A_log=leaves["A_log"],
                 dt_bias=leaves["dt_bias"], initial_state=leaves["initial_state"], output_final_state=True,
                 cu_seqlens=inp["cu_seqlens"])
    assert not o[:, n_real:].any()
    gen = torch.Generator(device="cuda").manual_seed(3)
    do = torch.randn(o.shape, device="cuda", generator=gen).to(o.dtype)  # nonzero on the tail too
    dht = torch.randn(ht.shape, device="cuda", generator=gen)
    torch.autograd.backward([o, ht], [do, dht])
    for n in seq_inputs:
        assert not leaves[n].grad[:, n_real:].any(), n

    ref = {n: inp[n].double().clone().requires_grad_() for n in names}
    o_r, ht_r = kda_reference_autograd(
        ref["q"], ref["k"], ref["v"], ref["g"], ref["beta"], A_log=ref["A_log"], dt_bias=ref["dt_bias"],
        initial_state=ref["initial_state"], output_final_state=True, cu_seqlens=inp["cu_seqlens"],
        gate=spec["gate"], lower_bound=spec["lower_bound"], l2norm_qk=spec["l2norm_qk"],
        state_layout=spec["state_layout"])
    torch.autograd.backward([o_r, ht_r], [do[:, :n_real].double(), dht.double()])
    got = {n: leaves[n].grad[:, :n_real] if n in seq_inputs else leaves[n].grad for n in names}
    errors = {n: rel_rmse(ref[n].grad, got[n].double()) for n in names}
    errors["A_log"] = _gate_error(spec, inp, got["A_log"], ref["A_log"].grad, ref["g"].grad)
    bad = {n: round(e, 5) for n, e in errors.items() if not e <= TOL[n]}
    assert not bad, f"error over the bound: {bad}"
