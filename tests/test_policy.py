"""The scheduling policy (kdagen/policy.py) and the policy sweep's pure parts (benchmarks/bench_policy.py),
on the CPU: validation, the environment override read once, every decision function, the kernel's policy
views, and --check on a small recorded sweep (tests/fixtures/policy-sweep-small.json: 14 points of the H100
sweep the cost model is fitted to)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from kdagen import paths, policy
from kdagen.plan import make_plan
from kdagen.policy import (
    AUTO,
    COSTS,
    PlanFacts,
    SchedulePolicy,
    by_length,
    cp_segment_len,
    cp_time_us,
    decode_parts,
    decode_staged_store,
    decode_streams,
    device_picks_fused,
    fused_args,
    overlap,
    pair_step_limit,
    schedule,
    whole_time_us,
)
from kdagen.runtime import KDAKernel
from kdagen.spec import KernelSpec

sys.path.insert(0, str(paths.benchmarks_dir()))
import bench_policy  # noqa: E402

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "policy-sweep-small.json"
SMS = 132


def _facts(**spec: object) -> PlanFacts:
    s = KernelSpec(**{"arch": "sm_90a", **spec})
    return PlanFacts.from_plan(s, make_plan(s))


def _kernel(**spec: object) -> KDAKernel:
    s = KernelSpec(**{"arch": "sm_90a", **spec})
    plan = make_plan(s)
    return KDAKernel(s, plan, dict.fromkeys(plan.stage_names, lambda *a: None))


FUSED = _facts(g_dtype="bf16")  # the wgmma family with the safe gate: fused kernel and pair form
PLAIN = _facts(family="mma_sync")  # no fused kernel


# ---- the policy object ----


def test_default_is_all_auto():
    assert SchedulePolicy() == AUTO
    assert AUTO.label() == "auto"
    assert {AUTO, SchedulePolicy()} == {AUTO}  # frozen, hashable


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"intracard_cp": 100}, "intracard_cp: expected 'auto', 'off' or a positive multiple of 16"),
     ({"intracard_cp": -16}, "intracard_cp"), ({"intracard_cp": 0}, "intracard_cp"),
     ({"intracard_cp": True}, "intracard_cp"), ({"intracard_cp": "1024"}, "got '1024'"),
     ({"overlap": "yes"}, "overlap: expected 'auto', 'on' or 'off', got 'yes'"),
     ({"fused": "sometimes"}, "fused: expected"), ({"fused_pair": None}, "fused_pair: expected"),
     ({"seq_order": "sorted"}, "seq_order: expected 'auto', 'length' or 'input', got 'sorted'"),
     ({"decode_stream": "always"}, "decode_stream: expected 'auto', 'on' or 'off', got 'always'")],
)
def test_invalid_fields_are_rejected_on_construction(kwargs: dict, match: str):
    with pytest.raises(ValueError, match=match):
        SchedulePolicy(**kwargs)


def test_frozen_and_replace_validates():
    p = SchedulePolicy(intracard_cp=1024, fused="off")
    with pytest.raises(AttributeError):
        p.fused = "on"  # type: ignore[misc]
    assert p.replace(fused="on") == SchedulePolicy(intracard_cp=1024, fused="on")
    with pytest.raises(ValueError, match="overlap"):
        p.replace(overlap="maybe")


@pytest.mark.parametrize(
    "p", [AUTO, SchedulePolicy(intracard_cp="off", fused="on", fused_pair="off"),
          SchedulePolicy(intracard_cp=2048, overlap="off", seq_order="input")])
def test_label_round_trip(p: SchedulePolicy):
    assert SchedulePolicy.from_label(p.label()) == p


def test_coerce():
    assert SchedulePolicy.coerce(None) is None
    assert SchedulePolicy.coerce(AUTO) is AUTO
    assert SchedulePolicy.coerce({"fused": "off"}) == SchedulePolicy(fused="off")
    with pytest.raises(TypeError, match="policy: expected a SchedulePolicy"):
        SchedulePolicy.coerce("off")  # type: ignore[arg-type]


# ---- the environment override ----


@pytest.mark.parametrize(
    ("env", "expected"),
    [({}, AUTO), ({"KDAGEN_INTRACARD_CP": ""}, AUTO),
     ({"KDAGEN_INTRACARD_CP": " 1024 ", "KDAGEN_OVERLAP": "OFF"},
      SchedulePolicy(intracard_cp=1024, overlap="off")),
     ({"KDAGEN_FUSED": "on", "KDAGEN_FUSED_PAIR": "off", "KDAGEN_SEQ_ORDER": "Length"},
      SchedulePolicy(fused="on", fused_pair="off", seq_order="length"))],
)
def test_from_env(env: dict, expected: SchedulePolicy):
    assert SchedulePolicy.from_env(env) == expected


@pytest.mark.parametrize(
    ("env", "match"),
    [({"KDAGEN_INTRACARD_CP": "100"}, "KDAGEN_INTRACARD_CP: expected 'auto', 'off' or a positive multiple"),
     ({"KDAGEN_INTRACARD_CP": "many"}, "KDAGEN_INTRACARD_CP: expected"),
     ({"KDAGEN_OVERLAP": "yes"}, "KDAGEN_OVERLAP: expected 'auto', 'on' or 'off', got 'yes'"),
     ({"KDAGEN_SEQ_ORDER": "sorted"},
      "KDAGEN_SEQ_ORDER: expected 'auto', 'length' or 'input', got 'sorted'")],
)
def test_from_env_names_the_variable(env: dict, match: str):
    with pytest.raises(ValueError, match=match):
        SchedulePolicy.from_env(env)


def test_default_policy_reads_the_environment_once(monkeypatch: pytest.MonkeyPatch):
    policy.default_policy.cache_clear()
    try:
        monkeypatch.setenv(paths.ENV_FUSED, "off")
        assert policy.default_policy() == SchedulePolicy(fused="off")
        monkeypatch.setenv(paths.ENV_FUSED, "on")  # later changes are not seen: no per-call reads
        assert policy.default_policy() == SchedulePolicy(fused="off")
        assert _kernel().policy == SchedulePolicy(fused="off")
    finally:
        monkeypatch.delenv(paths.ENV_FUSED)
        policy.default_policy.cache_clear()


# ---- kernels and their policy views ----


def test_kernel_policy_view_shares_the_loaded_stages():
    base = _kernel()
    view = base.with_policy({"intracard_cp": "off"})
    assert view.policy == SchedulePolicy(intracard_cp="off") and base.policy == policy.default_policy()
    assert view._forward is base._forward and view._cp is base._cp and view._dummies is base._dummies
    assert view.schedule(1, 65536, 4, SMS).seg_len is None
    assert base.schedule(1, 65536, 4, SMS, AUTO).seg_len == 2048
    # a call's own policy: cached apart from the kernel's
    assert view._schedule(1, 65536, 4, SMS, AUTO).seg_len == 2048
    assert view._schedule(1, 65536, 4, SMS, None).seg_len is None


def test_get_kernel_passes_the_policy(monkeypatch: pytest.MonkeyPatch):
    import kdagen
    import kdagen.build

    base = _kernel()
    monkeypatch.setattr(kdagen.build, "get_kernel", lambda spec, force=False: base)
    assert kdagen.get_kernel("x") is base
    view = kdagen.get_kernel("x", policy=SchedulePolicy(fused="off"))
    assert view.policy == SchedulePolicy(fused="off") and view._forward is base._forward


def test_autograd_call_of_a_view_carries_its_policy(monkeypatch: pytest.MonkeyPatch):
    # A call that records an autograd node runs the op, which loads the spec's kernel afresh: the view's
    # policy must travel with the call (the base kernel's default needs no word).
    import kdagen.ops

    seen: list[object] = []
    monkeypatch.setattr(kdagen.ops, "kda_forward", lambda *a, **kw: seen.append(kw["policy"]))
    base = _kernel()
    view = base.with_policy(SchedulePolicy(intracard_cp=64))
    q = torch.zeros(1, 16, 1, 128, requires_grad=True)
    v = torch.zeros(1, 16, 1, 128)
    view(q, q, v, v, torch.zeros(1, 16, 1))
    base(q, q, v, v, torch.zeros(1, 16, 1))
    view(q, q, v, v, torch.zeros(1, 16, 1), policy=SchedulePolicy(intracard_cp="off"))
    assert seen == [SchedulePolicy(intracard_cp=64), None, SchedulePolicy(intracard_cp="off")]


@pytest.mark.parametrize(("nseq", "total", "hv", "seg"), [(1, 65536, 4, 2048), (2, 16384, 64, None)])
def test_backward_scan_splits_where_the_forward_would(monkeypatch: pytest.MonkeyPatch, nseq: int, total: int,
                                                      hv: int, seg: int | None):
    # The reverse scan takes the forward's CP decision for the call: segment maps, the merge last to first
    # from dht, the segment pass; or the whole-sequence stage.
    calls: list[tuple] = []
    names = ("bwd_scan", "bwd_cp_prescan", "bwd_cp_merge", "bwd_cp_segments")
    s = KernelSpec(arch="sm_90a")
    plan = make_plan(s)
    stages = {n: (lambda *a, n=n: calls.append((n, a))) if n in names else (lambda *a: None)
              for n in plan.stage_names}
    kern = KDAKernel(s, plan, stages)
    monkeypatch.setattr(kern, "_sm_count", lambda device: SMS)
    kd = torch.empty(total, hv, 128, dtype=torch.bfloat16)
    do = torch.empty(total, hv, 128, dtype=torch.bfloat16)
    cu = torch.arange(0, total + 1, total // nseq, dtype=torch.int32)
    dht = torch.zeros(1, hv, 128, 128)
    args = (kd, kd, kd, kd[..., :16], torch.empty(1), do, cu, dht, torch.empty(1), torch.empty(1), 0)
    kern._run_reverse_scan(*args, None)
    if seg is None:
        assert [n for n, _ in calls] == ["bwd_scan"] and calls[0][1] == args
        return
    assert [n for n, _ in calls] == list(names[1:])
    (_, pre), (_, merge), (_, segs) = calls
    slots = total // seg + nseq + 1
    assert pre[-1] == merge[-1] == segs[-1] == seg
    assert pre[7].shape == (slots, hv, 256, 128) and merge[0] is pre[7]  # maps: B^T rows, then M's planes
    assert merge[2] is dht and merge[6] == 0 and merge[7] == 0  # from dht (has_dht = 0: zero), not pooled
    assert segs[7] is merge[5] and segs[7].shape == (slots, hv, 128, 128)  # the merged gradient per segment


# ---- intra-card CP ----


@pytest.mark.parametrize(
    ("tokens", "heads", "expected"),
    [(65536, 4, 2048), (65536, 2, 2048), (32768, 8, 1024), (16384, 16, 1024),
     (8192, 4, 1024),  # 0.151 ms against 0.328 for the serial chain (H100 sweep)
     (4096, 4, 1024), (4096, 1, 1024),
     (5000, 1, 1008),  # five equal segments, not 1024 + ... + 904
     (2048, 4, None), (2048, 1, None), (16384, 64, None), (16384, 33, None), (65536, 32, None)],
)
def test_cp_cost_model_choices(tokens: int, heads: int, expected: int | None):
    # One sequence on 132 SMs, the fitted constants: CP where its estimate beats the whole-sequence path's,
    # never where the recurrence grid (heads x 2 V-slices) covers half the SMs.
    assert cp_segment_len(1, tokens, heads, SMS, FUSED) == expected


def test_cp_forced_and_off():
    assert cp_segment_len(1, 65536, 4, SMS, FUSED, SchedulePolicy(intracard_cp="off")) is None
    assert cp_segment_len(8, 4096, 64, SMS, FUSED, SchedulePolicy(intracard_cp=256)) == 256


def test_cp_choice_is_the_longest_near_the_cheapest_estimate():
    seg = cp_segment_len(1, 65536, 4, SMS, FUSED)
    assert seg is not None
    costs = {s: cp_time_us(1, 65536, 4, SMS, s, FUSED) for s in policy.cp_candidates(1, 65536)}
    assert costs[seg] <= min(costs.values()) * (1 + COSTS.cp_tie)
    assert all(s <= seg for s, t in costs.items() if t <= min(costs.values()) * (1 + COSTS.cp_tie))
    assert costs[seg] <= COSTS.cp_margin * whole_time_us(1, 65536, 4, SMS, FUSED)
    assert policy.cp_candidates(1, 65536) == [1024, 2048, 4096, 8192, 16384]


def test_estimates_grow_with_the_work():
    for heads in (1, 4, 16, 64):
        whole = [whole_time_us(1, t, heads, SMS, FUSED) for t in (1024, 4096, 16384, 65536)]
        assert whole == sorted(whole)
    assert cp_time_us(1, 65536, 4, SMS, 2048, FUSED) < cp_time_us(1, 65536, 8, SMS, 2048, FUSED)


# ---- the fused kernel's arguments (the forward stage's allow_fused, sms, pair) ----


@pytest.mark.parametrize(
    ("fused", "nseq", "total", "expected"),
    [("auto", 1, 16384, (0, 132)),  # 64 chains: half the SMs
     ("auto", 2, 32768, (1, 132)),  # 128 chains of 1024 steps: the setup kernel decides
     ("auto", 20, 4096, (1, 132)),  # ten waves of ~13-step chains
     ("auto", 60, 4096, (1, 132)),
     ("auto", 3, 6144, (0, 132)),  # 192 chains: a second wave under half full
     ("auto", 2, 1024, (1, 132)),
     ("auto", 0, 0, (0, 132)),
     ("on", 1, 16, (2, 132)), ("off", 2, 32768, (0, 132))],
)
def test_fused_args_one_cta_a_chain(fused: str, nseq: int, total: int, expected: tuple[int, int]):
    p = SchedulePolicy(fused=fused, fused_pair="off")
    assert fused_args(nseq, 64, total, SMS, _facts(), p) == (*expected, 0)
    assert fused_args(nseq, 64, total, SMS, PLAIN, p) == ()  # no fused kernel: no such arguments


@pytest.mark.parametrize(
    ("fused", "pair", "nseq", "hv", "total", "expected"),
    [("auto", "auto", 1, 64, 16384, (1, 132, 1721)),  # 1024 steps; the pair form wins up to 1721
     ("auto", "on", 1, 64, 16384, (1, 132, 1721)),
     ("auto", "auto", 1, 32, 16384, (0, 132, 726)),  # 1024 steps past the limit: settled here
     ("auto", "auto", 1, 64, 512, (1, 132, 42)),
     ("auto", "auto", 1, 64, 256, (0, 132, 15)),  # 16 steps, one past the limit
     ("auto", "auto", 16, 2, 16384, (1, 132, 95)),  # 32 chains of 64 steps: prepare's work pays for pairs
     ("auto", "auto", 4, 1, 16384, (0, 132, 81)),
     ("auto", "auto", 2, 64, 32768, (1, 132, 0)),  # 128 chains: more than half the SMs, one CTA each
     ("auto", "off", 1, 64, 16384, (0, 132, 0)),
     ("on", "auto", 1, 66, 777, (2, 132, 76)), ("on", "auto", 1, 67, 777, (2, 132, 0)),
     ("off", "auto", 1, 64, 16384, (0, 132, 1721)), ("auto", "auto", 0, 64, 0, (0, 132, 0))],
)
def test_fused_args_pair_form(fused: str, pair: str, nseq: int, hv: int, total: int, expected: tuple):
    assert fused_args(nseq, hv, total, SMS, FUSED, SchedulePolicy(fused=fused, fused_pair=pair)) == expected


def test_pair_step_limit_is_where_the_estimates_meet():
    """At the limit, the pair form's estimate equals the two-stage path's (both take the longest chain)."""
    for nseq, hv, total in ((1, 64, 16384), (16, 2, 16384), (16, 4, 8192)):
        limit = pair_step_limit(nseq, total, hv, SMS, FUSED)
        c = COSTS
        step = c.step_us + c.step_load_us * min(2 * nseq * hv, SMS) / SMS
        wait = c.prepare_wait_sm_ns * (nseq - 1) / nseq
        prep = total * (-(-hv // 4) * 4) / SMS / 1000 * (c.prepare_sm_ns + wait)
        pair_us = c.pair_fixed_us + (limit + FUSED.fused_fill) * c.pair_step_us
        assert pair_us == pytest.approx(c.two_stage_fixed_us + limit * step + prep)


def test_setup_rule_in_pairs_takes_the_longest_chain():
    assert device_picks_fused((1600, 16), 2, SMS, FUSED, pair_steps=100)  # 100 steps: at the limit
    assert not device_picks_fused((1616, 16), 2, SMS, FUSED, pair_steps=100)
    assert device_picks_fused((160,) * 16, 2, SMS, FUSED, pair_steps=10)
    # one CTA a chain: the balanced rule, which 16 chains of two heads never meet
    assert not device_picks_fused((160,) * 16, 2, SMS, FUSED, pair_steps=0)


# ---- overlap and order ----


@pytest.mark.parametrize(("mode", "rec_ctas", "expected"),
                         [("auto", 132, True), ("auto", 133, False), ("on", 1000, True), ("off", 2, False)])
def test_overlap(mode: str, rec_ctas: int, expected: bool):
    assert overlap(rec_ctas, SMS, SchedulePolicy(overlap=mode)) is expected


@pytest.mark.parametrize(
    ("order", "nseq", "rec_ctas", "expected"),
    [("auto", 20, 2560, True), ("auto", 20, 132, False), ("auto", 1, 256, False),
     ("auto", 5000, 10**6, False), ("length", 2, 4, True), ("length", 1, 4, False),
     ("input", 20, 2560, False)],
)
def test_longest_first(order: str, nseq: int, rec_ctas: int, expected: bool):
    assert by_length(nseq, rec_ctas, SMS, SchedulePolicy(seq_order=order)) is expected


def test_schedule_under_cp_has_no_whole_sequence_arguments():
    s = schedule(1, 65536, 4, SMS, FUSED)
    assert s.seg_len == 2048 and s.fused_args == () and not s.by_length
    w = schedule(20, 20 * 4096, 64, SMS, FUSED)
    assert w.seg_len is None and w.by_length and not w.beside and w.fused_args[0] == 1


# ---- benchmarks/bench_policy.py: the pure parts ----


def test_point_grid_skips_big_points():
    run, skipped = bench_policy.point_grid()
    assert len(run) + len(skipped) == 7 * 8 * 3
    assert all(p.token_heads <= bench_policy.MAX_TOKEN_HEADS for p in run)
    assert all(p.token_heads > bench_policy.MAX_TOKEN_HEADS for p in skipped)
    assert bench_policy.Point(64, 65536, 16) in skipped and bench_policy.Point(4, 65536, 1) in run
    quick, _ = bench_policy.point_grid(bench_policy.QUICK_HEADS, bench_policy.QUICK_TOKENS,
                                       bench_policy.QUICK_SEQS)
    assert len(quick) < len(run)


def test_options_of_a_point():
    opts = bench_policy.options_for(bench_policy.Point(4, 4096, 1), FUSED, SMS)
    assert set(opts) == {"intracard_cp=off", "intracard_cp=1024", "intracard_cp=2048",
                         "intracard_cp=off,fused=off", "intracard_cp=off,fused=on,fused_pair=off",
                         "intracard_cp=off,fused=on,fused_pair=on"}
    assert all(SchedulePolicy.from_label(k) == v for k, v in opts.items())
    many = bench_policy.options_for(bench_policy.Point(64, 1024, 4), FUSED, SMS)
    assert "intracard_cp=off,fused=on,fused_pair=on" not in many  # 256 chains: no pair for each
    assert set(bench_policy.options_for(bench_policy.Point(4, 1024, 1), PLAIN, SMS)) == {"intracard_cp=off"}


def test_choice_label_resolves_the_setup_kernels_pick():
    point = bench_policy.Point(64, 16384, 1)
    label = bench_policy.choice_label(schedule(1, 16384, 64, SMS, FUSED), point, FUSED, SMS)
    assert label == "intracard_cp=off,fused=on,fused_pair=on"
    long_point = bench_policy.Point(4, 65536, 1)
    cp = bench_policy.choice_label(schedule(1, 65536, 4, SMS, FUSED), long_point, FUSED, SMS)
    assert cp == "intracard_cp=2048"


def test_falling_points():
    rows = [{"heads": 4, "seqs": 1, "tokens": t, "ms": ms} for t, ms in
            ((1024, 0.1), (8192, 0.516), (32768, 0.387), (65536, 0.66))]
    rows.append({"heads": 8, "seqs": 1, "tokens": 1024, "ms": 0.09})
    assert bench_policy.falling_points(rows, "ms") == {(4, 1, 32768)}
    rows[2]["ms"] = 0.510  # within 2%: noise, not a fall
    assert bench_policy.falling_points(rows, "ms") == set()


def test_parse_costs():
    c = bench_policy.parse_costs("cp_step_us=2.5,cp_tie=0,segment_lengths=512/1024")
    assert (c.cp_step_us, c.cp_tie, c.segment_lengths) == (2.5, 0.0, (512, 1024))
    with pytest.raises(SystemExit, match="not a CostModel constant"):
        bench_policy.parse_costs("nope=1")


def test_check_on_a_recorded_sweep():
    data = json.loads(FIXTURE.read_text())
    result = bench_policy.check(data)
    rows = {(r["heads"], r["seqs"], r["tokens"]): r for r in result["rows"]}
    # H=4, one sequence: every length within 10% of the best option, and no time falls as T grows (the
    # recorded auto, a first model, kept the serial chain at T=8192: 0.326 ms against 0.151)
    for t in (512, 1024, 2048, 4096, 8192, 16384, 32768, 65536):
        assert not rows[(4, 1, t)]["slow"] and not rows[(4, 1, t)]["falls"], rows[(4, 1, t)]
    assert rows[(4, 1, 8192)]["pick"] == "intracard_cp=1024"
    assert rows[(4, 1, 65536)]["pick"] == "intracard_cp=2048"
    assert rows[(64, 1, 16384)]["pick"] == "intracard_cp=off,fused=on,fused_pair=on"
    # 16 sequences at one and two heads: the CTA-pair form, ~1.3x faster than the two-stage path
    assert rows[(2, 16, 8192)]["pick"] == "intracard_cp=off,fused=on,fused_pair=on"
    assert not any(r["slow"] for r in rows.values())
    assert result["summary"]["falls"] == 0
    # a cost model that never takes CP is slow at every middle length
    never = bench_policy.check(data, bench_policy.parse_costs("cp_margin=0.2"))
    slow = {(r["heads"], r["seqs"], r["tokens"]) for r in never["rows"] if r["slow"]}
    assert {(4, 1, 4096), (4, 1, 8192), (1, 1, 4096)} <= slow


def test_check_cli(capsys: pytest.CaptureFixture[str]):
    assert bench_policy.main(["--check", str(FIXTURE)]) == 0
    out = capsys.readouterr().out
    assert "H4-N1-T8192" in out and "14 points: 0 over 1.10x best, 0 where time falls" in out


def test_markdown_and_summary_of_a_sweep():
    data = json.loads(FIXTURE.read_text())
    data["summary"] = bench_policy.summarize(data["points"], 1.10)
    # the recorded auto (the first model): slow at middle lengths, and H=4 T=16384 faster than T=8192
    assert data["summary"]["falls"] == 1 and data["summary"]["slow"] == 6
    md = bench_policy.markdown(data)
    row = "| 4 | 1 | 8192 | 0.326 | `intracard_cp=off,fused=off` | `intracard_cp=1024` | 0.151 | 2.16 | slow"
    assert row in md
    assert "| 4 | 1 | 16384 | 0.280 |" in md and "slow falls |" in md


def test_fit_ranks_constants_by_the_check():
    data = json.loads(FIXTURE.read_text())
    ranked = bench_policy.fit(data, "cp_margin=0.2/1.0,cp_tie=0/0.03")
    assert len(ranked) == 4
    best_key, best_costs, best_summary = ranked[0]
    assert best_costs.cp_margin == 1.0 and best_summary["slow"] == 0
    assert [r[0] for r in ranked] == sorted(r[0] for r in ranked)


@pytest.mark.parametrize(("has_stage", "toggle", "items", "v_first", "tokens", "expected"),
                         [(True, "auto", 1000, False, 1, True), (True, "auto", 132, False, 8, False),
                          (True, "auto", 133, False, 1, True), (True, "auto", 2112, True, 1, False),
                          (True, "auto", 2113, True, 1, True), (True, "auto", 2113, True, 0, True),
                          (True, "auto", 100000, True, 2, False), (True, "on", 1, False, 1, True),
                          (True, "on", 1, True, 8, True), (True, "off", 100000, True, 1, False),
                          (False, "auto", 1000, False, 1, False), (False, "on", 1000, True, 1, False),
                          (True, "auto", 264, False, 4, False), (True, "auto", 265, False, 4, True),
                          (True, "auto", 264, False, 3, True), (True, "auto", 133, False, 2, True)])
def test_decode_streams_where_the_variant_has_the_stage(has_stage: bool, toggle: str, items: int,
                                                        v_first: bool, tokens: int, expected: bool):
    # "auto" takes the streaming decode where the variant has it, but for K-first calls of at most one item
    # an SM (132 SMs here), or two with an fp32 state from four tokens a request, and V-first ones of at
    # most 16 items an SM at one token a request (0: packed) or of any size with more; "on" wherever the
    # variant has it; "off" the per-item stage.
    assert decode_streams(has_stage, items, 132, v_first, tokens, SchedulePolicy(decode_stream=toggle)) \
        is expected


@pytest.mark.parametrize(("items", "tokens", "expected"), [(132, 8, False), (133, 8, True), (264, 4, True)])
def test_decode_streams_a_bf16_state_from_one_item_an_sm(items: int, tokens: int, expected: bool):
    # A bf16 K-first state streams from one item an SM at any token count: there its grid was the faster.
    assert decode_streams(True, items, 132, False, tokens, state_bits=16) is expected


def test_decode_stream_override_is_read_from_the_environment():
    assert SchedulePolicy.from_env({"KDAGEN_DECODE_STREAM": "off"}) == SchedulePolicy(decode_stream="off")
    with pytest.raises(ValueError, match="KDAGEN_DECODE_STREAM: expected"):
        SchedulePolicy.from_env({"KDAGEN_DECODE_STREAM": "maybe"})


@pytest.mark.parametrize(("items", "sms", "v", "v_first", "tokens", "expected"), [
    (1, 132, 128, True, 1, 8),  # one request of one value head: 8 parts of 16 columns
    (32, 132, 128, True, 1, 4),  # 32 heads: 128 items fit 132 SMs
    (66, 132, 128, True, 1, 2),
    (67, 132, 128, True, 1, 1),
    (256, 132, 128, True, 1, 1),  # more items than SMs: whole states
    (1, 132, 64, True, 1, 4),  # V = 64: at most 4 parts of 16 columns
    (1, 132, 16, True, 1, 1),
    (32, 132, 128, False, 1, 1),  # K-first, one token: the whole slot in one copy
    (32, 132, 128, False, 0, 1),  # K-first, packed tokens (count unknown on the host)
    (32, 132, 128, False, 4, 4),  # K-first verify of 4 tokens
])
def test_decode_parts_spread_few_items_over_the_sms(items: int, sms: int, v: int, v_first: bool, tokens: int,
                                                    expected: int):
    assert decode_parts(items, sms, v, v_first, tokens) == expected


@pytest.mark.parametrize(("items", "ctas", "expected"), [
    (1024, 132, False),  # HV 32, 32 requests: under 8 items a CTA, the consumers store the states
    (2111, 132, False),
    (2112, 132, True),  # 16 items a CTA: final and verify states go back through the ring
    (8192, 132, True),
    (16, 1, True),
    (15, 1, False),
])
def test_decode_staged_store_from_sixteen_items_a_cta(items: int, ctas: int, expected: bool):
    assert decode_staged_store(items, ctas) is expected
