"""The benchmark's physical floors and options (benchmarks/bench_fwd.py), on the CPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kdagen import paths

sys.path.insert(0, str(paths.benchmarks_dir()))
import bench_fwd  # noqa: E402

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "bench"

CARD = bench_fwd.Card("H100", "h100", 3.35, 989.0)
IO = {"qk": 2, "v": 2, "o": 2, "g": 2, "beta": 4}


def test_serial_floor_of_whole_sequences_is_one_step_per_chunk():
    cfg = bench_fwd.Config("T16384", "fixed", (16384, 16384))
    floors = bench_fwd.physical_floors(cfg, CARD, 1.0, 16, IO)
    assert floors.serial_ms == pytest.approx(1024 * 1e-3)
    assert floors.binding[0] in ("hbm", "serial")


def test_serial_floor_of_cp_segments_is_two_segment_chains_and_the_merge():
    # T=65536 in 32 segments of 2048 tokens: 128 steps for the maps, 32 merge steps, 128 for the pass. The
    # whole-sequence chain (4096 steps) is not a floor of that schedule.
    cfg = bench_fwd.Config("long-T65536-H4", "long", (65536,), heads=4)
    floors = bench_fwd.physical_floors(cfg, CARD, 1.0, 16, IO, segment=2048)
    assert floors.serial_ms == pytest.approx((128 + 32 + 128) * 1e-3)
    name, ms = floors.binding
    assert name == "serial-cp" and ms == floors.serial_ms


def test_warm_up_seconds_are_an_option_and_must_not_be_negative():
    assert bench_fwd.parse_args([]).warmup_s == 2.0
    assert bench_fwd.parse_args(["--warmup-s", "0"]).warmup_s == 0.0
    with pytest.raises(SystemExit):
        bench_fwd.parse_args(["--warmup-s", "-1"])


def _problem(name: str) -> bench_fwd.Problem:
    from kdagen.spec import resolve_spec

    _, spec = resolve_spec(f"specs/sm90.yaml:{name}")
    return bench_fwd.Problem.from_spec(spec.model_dump(mode="json"))


def test_fla_is_called_with_the_gate_of_the_spec_under_test():
    # The headline: the sigmoid form with its bound and the safe-gate promise.
    assert bench_fwd.Problem.from_spec(bench_fwd.HEADLINE_SPEC) == bench_fwd.HEADLINE
    assert bench_fwd.HEADLINE.fla_kwargs() == {"use_qk_l2norm_in_kernel": True, "use_gate_in_kernel": True,
                                               "safe_gate": True, "lower_bound": -5.0}
    # softplus: FLA selects it by the absence of lower_bound, and there is no promise.
    soft = _problem("k128-softplus").fla_kwargs()
    assert soft["use_gate_in_kernel"] and soft["lower_bound"] is None and not soft["safe_gate"]
    # precomputed: FLA takes g as the log-decay.
    pre = _problem("k128-pre").fla_kwargs()
    assert not pre["use_gate_in_kernel"] and pre["lower_bound"] is None and pre["safe_gate"]


def test_inputs_follow_the_spec_head_dims_gva_and_gate():
    import torch

    cfg = bench_fwd.Config("T100", "fixed", (100,), heads=8)
    inp = bench_fwd.make_bench_inputs(cfg, torch.device("cpu"), _problem("k128-gva2"))
    assert inp["q"].shape == (1, 100, 4, 128) and inp["v"].shape == (1, 100, 8, 128)
    assert inp["g"].shape == (1, 100, 8, 128) and inp["dt_bias"].shape == (8 * 128,)
    inp = bench_fwd.make_bench_inputs(cfg, torch.device("cpu"), _problem("k64"))
    assert inp["q"].shape == (1, 100, 8, 64) and inp["v"].shape == (1, 100, 8, 64)
    # precomputed: g is the bounded log-decay the safe-gate promise asks for, with no gate parameters
    inp = bench_fwd.make_bench_inputs(cfg, torch.device("cpu"), _problem("k128-pre"))
    assert inp["g"].dtype == torch.float32 and inp["A_log"] is None and inp["dt_bias"] is None
    assert float(inp["g"].min()) >= -5.0 and float(inp["g"].max()) < 0.0
    with pytest.raises(ValueError, match="gva_ratio"):
        bench_fwd.make_bench_inputs(bench_fwd.Config("x", "fixed", (8,), heads=3), torch.device("cpu"),
                                    _problem("k128-gva2"))


def test_floors_follow_head_dims_and_gva():
    cfg = bench_fwd.Config("T1024", "fixed", (1024,), heads=64)
    base = bench_fwd.physical_floors(cfg, CARD, 1.0, 16, IO)
    gva = bench_fwd.physical_floors(cfg, CARD, 1.0, 16, IO, problem=_problem("k128-gva2"))
    small = bench_fwd.physical_floors(cfg, CARD, 1.0, 16, IO, problem=_problem("k64"))
    assert base.flops == pytest.approx(1024 * 64 * 182954.67, rel=1e-6)  # landscape.md: ~183 kFLOP
    assert base.bytes - gva.bytes == 1024 * 64 * 128 * 2  # half of the q and k bytes (bf16)
    assert small.bytes < base.bytes / 2 and small.flops < base.flops / 2
    long_cfg = bench_fwd.build_configs(False, "fixed", True, gva_ratio=8)[-1]
    assert long_cfg.kind == "long" and long_cfg.heads == 8


def test_rounds_alternate_and_a_failing_side_is_reported_alone(monkeypatch: pytest.MonkeyPatch):
    # time_ms is replaced (it needs CUDA events): the callables themselves log their turns. FLA fails in the
    # second round; its error is its own, its times are dropped, and kdagen keeps all three rounds.
    order: list[str] = []

    def fake_time_ms(fn, warmup, iters):
        return fn()

    def kd():
        order.append("kdagen")
        return 1.0

    def fla():
        order.append("fla")
        if order.count("fla") == 2:
            raise RuntimeError("boom")
        return 2.0

    monkeypatch.setattr(bench_fwd, "time_ms", fake_time_ms)
    monkeypatch.setattr(bench_fwd.torch.cuda, "synchronize", lambda: None)
    times, errors = bench_fwd.time_rounds({"fla": fla, "kdagen": kd}, 3, 0, 1)
    assert order == ["fla", "kdagen", "fla", "kdagen", "kdagen"]
    assert times == {"kdagen": [1.0, 1.0, 1.0]}
    assert errors == {"fla": "RuntimeError: boom"}


def test_markdown_from_a_result_json_keeps_its_rows_and_headline_geomean(tmp_path):
    # --md-from rebuilds a result's table; its footer is the one the run printed (footer_text). The fixture is
    # an H100 run's JSON cut to three headline configs and the long one (meta geomeans recomputed for them).
    src = FIXTURES / "bench-fwd-result.json"
    copy = tmp_path / "run.json"
    copy.write_text(src.read_text())
    assert bench_fwd.markdown_from_json(copy) == f"wrote {tmp_path / 'run.md'}"
    text = (tmp_path / "run.md").read_text()
    data = bench_fwd.json.loads(src.read_text())
    table_rows = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(table_rows) == len(data["rows"]) + 1  # the header row, then one row per config
    gm, n = bench_fwd.headline_geomean(data["rows"])
    assert n == 3 and gm == pytest.approx(data["meta"]["headline_geomean_speedup"])
    footer = bench_fwd.footer_text(data["meta"], data["rows"])
    assert footer in text and f"geomean speedup {gm:.3f}x over the 3 headline configs (" in footer


def test_decode_floor_counts_the_state_bytes_moved():
    import bench_decode

    # one read and one write of a 64 KB fp32 state per (request, head) at S = 1; S + 1 copies for verify
    us = bench_decode.floor_us(32, 256, 1, 128, 128, 3.35)
    assert us == pytest.approx(256 * 32 * 128 * 128 * 4 * 2 / 3.35e12 * 1e6)
    assert bench_decode.floor_us(32, 256, 4, 128, 128, 3.35) == pytest.approx(us * 5 / 2)
    assert bench_decode.floor_us(32, 256, 1, 128, 128, 3.35, elem_bytes=2) == pytest.approx(us / 2)
