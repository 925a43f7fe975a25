"""The training benchmark (benchmarks/bench_bwd.py) on the CPU: options, configs, inputs, the two libraries'
calls (with stand-ins for FLA and the kernel), the rounds, the report and the profile's kernel table."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kdagen import paths

sys.path.insert(0, str(paths.benchmarks_dir()))
import bench_bwd  # noqa: E402
import bench_fwd  # noqa: E402


def test_options_and_their_defaults():
    args = bench_bwd.parse_args([])
    assert (args.iters, args.warmup, args.rounds, args.warmup_s) == (20, 5, 3, 2.0)
    assert not args.no_recompute and args.profile is None and not args.long and args.only is None
    args = bench_bwd.parse_args(["--quick", "--only", "varlen", "--long", "--no-recompute", "--spec", "f:x"])
    assert args.quick and args.only == "varlen" and args.long and args.no_recompute and args.spec == "f:x"
    assert bench_bwd.parse_args(["--profile"]).profile == bench_bwd.PROFILE_CONFIG
    assert bench_bwd.parse_args(["--profile", "N20-T4096-skewed"]).profile == "N20-T4096-skewed"
    for bad in (["--iters", "0"], ["--rounds", "0"], ["--warmup", "-1"], ["--warmup-s", "-1"]):
        with pytest.raises(SystemExit):
            bench_bwd.parse_args(bad)


def test_the_configs_are_the_28_headline_ones_and_the_long_one():
    configs = bench_fwd.build_configs(False, None, True)
    headline = [c for c in configs if c.kind != "long"]
    assert bench_bwd.HEADLINE_COUNT == len(headline) == 28 and len(configs) == 29
    assert len({c.name for c in configs}) == 29
    assert (configs[-1].lengths, configs[-1].heads) == ((65536,), 4)
    assert bench_bwd.find_config(bench_bwd.PROFILE_CONFIG).lengths == (8192, 8192)
    assert bench_bwd.find_config("long-T65536-H8", gva_ratio=8).heads == 8
    with pytest.raises(ValueError, match="B1-T512"):
        bench_bwd.find_config("B3-T512")


def test_inputs_add_h0_and_the_output_gradients_to_the_forward_benchmarks():
    cfg = bench_fwd.Config("x", "varlen", (5, 11), heads=4)
    inp = bench_bwd.make_train_inputs(cfg, torch.device("cpu"))
    fwd = bench_fwd.make_bench_inputs(cfg, torch.device("cpu"))
    assert all(torch.equal(inp[n], fwd[n]) for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias"))
    assert inp["h0"].shape == inp["dht"].shape == (2, 4, 128, 128) and inp["h0"].dtype == torch.float32
    assert inp["do"].shape == inp["v"].shape and inp["do"].dtype == torch.bfloat16
    assert torch.equal(bench_bwd.make_train_inputs(cfg, torch.device("cpu"))["dht"], inp["dht"])


def _toy_kda(calls: list[dict[str, Any]]):
    """A differentiable stand-in for chunk_kda / the kernel: o and the final state depend on every input."""

    def kda(q, k, v, g, beta, *, scale, A_log, dt_bias, initial_state, output_final_state, cu_seqlens,
            **options):
        calls.append({"scale": scale, "h0": initial_state, "final": output_final_state, "cu": cu_seqlens,
                      **options})
        s = q.float().sum(-1) + k.float().sum(-1) + g.float().sum(-1) + beta + A_log.sum() + dt_bias.sum()
        return (v.float() * s[..., None]).to(v.dtype), initial_state * 2

    return kda


CFG = bench_fwd.Config("toy", "varlen", (3, 5), heads=2)


def test_fla_is_called_with_the_forward_options_the_initial_state_and_its_own_leaves():
    inp = bench_bwd.make_train_inputs(CFG, torch.device("cpu"))
    calls: list[dict[str, Any]] = []
    side = bench_bwd.fla_side(_toy_kda(calls), inp, bench_fwd.HEADLINE, recompute=False)
    side.step()
    (call,) = calls
    assert call["scale"] == 128 ** -0.5 and call["final"] is True and call["cu"] is inp["cu_seqlens"]
    assert call["disable_recompute"] is True
    assert {k: call[k] for k in bench_fwd.HEADLINE.fla_kwargs()} == bench_fwd.HEADLINE.fla_kwargs()
    grads = side.grads()
    assert set(grads) == set(bench_bwd.GRADS) and all(g is not None for g in grads.values())
    assert inp["q"].grad is None  # the shared inputs keep no gradient: each side has its own leaves
    assert torch.equal(grads["h0"], 2 * inp["dht"])
    calls.clear()
    bench_bwd.fla_side(_toy_kda(calls), inp, bench_fwd.HEADLINE).forward()
    assert "disable_recompute" not in calls[0]  # recompute on: FLA's default, not passed


def test_kdagen_gets_its_state_layout_and_recompute_and_agrees_with_the_same_math():
    inp = bench_bwd.make_train_inputs(CFG, torch.device("cpu"))
    calls: list[dict[str, Any]] = []
    info = dict(bench_fwd.HEADLINE_SPEC, state_layout="vk")
    target = bench_bwd.TrainTarget(info, kernel=_toy_kda(calls), info=info, recompute=False)
    kd = target.side(inp)
    kd_out = kd.forward()
    kd.backward(kd_out)
    assert calls[0]["recompute"] is False
    assert torch.equal(calls[0]["h0"], inp["h0"].transpose(-1, -2))  # vk
    assert torch.equal(kd.grads()["h0"], 2 * inp["dht"])  # dht went in as vk, dh0 comes back as kv
    fla = bench_bwd.fla_side(_toy_kda([]), inp, bench_fwd.HEADLINE)
    fla_out = fla.forward()
    fla.backward(fla_out)
    acc = bench_bwd.accuracy(fla, fla_out, kd, kd_out)
    assert {f"d{n}_rel_rmse" for n in bench_bwd.GRADS} <= set(acc)
    assert all(v == 0.0 for k, v in acc.items() if k.endswith("_rel_rmse"))
    kd.leaves["A_log"].grad = None  # a gradient the kernel did not produce is named, not compared
    acc = bench_bwd.accuracy(fla, fla_out, kd, kd_out)
    assert acc["kdagen_missing_grads"] == ["dA_log"] and "dA_log_rel_rmse" not in acc


def test_rounds_alternate_both_measures_and_a_failing_side_is_reported_alone(monkeypatch: pytest.MonkeyPatch):
    order: list[str] = []

    def side(name: str, fail_in_round: int | None = None) -> SimpleNamespace:
        def step() -> float:
            order.append(f"{name}:step")
            if fail_in_round is not None and order.count(f"{name}:step") == fail_in_round:
                raise RuntimeError("boom")
            return 2.0 if name == "fla" else 1.0

        return SimpleNamespace(name=name, step=step)

    def fake_backward_ms(s, warmup, iters):
        order.append(f"{s.name}:bwd")
        return 0.5

    monkeypatch.setattr(bench_fwd, "time_ms", lambda fn, warmup, iters: fn())
    monkeypatch.setattr(bench_bwd, "backward_ms", fake_backward_ms)
    monkeypatch.setattr(bench_bwd.torch.cuda, "synchronize", lambda: None)
    times, errors = bench_bwd.time_training_rounds({"fla": side("fla", 2), "kdagen": side("kdagen")}, 3, 0, 1)
    assert order == ["fla:step", "fla:bwd", "kdagen:step", "kdagen:bwd", "fla:step", "kdagen:step",
                     "kdagen:bwd", "kdagen:step", "kdagen:bwd"]
    assert times == {"kdagen": {"step": [1.0] * 3, "bwd": [0.5] * 3}}
    assert errors == {"fla": "RuntimeError: boom"}


def _row(name: str, kind: str, step: float | None, bwd: float | None, **extra: Any) -> dict[str, Any]:
    row: dict[str, Any] = {"config": name, "kind": kind, "num_seqs": 1, "total_tokens": 512}
    if step is not None:
        row.update(fla_step_ms=2.0 * step, kdagen_step_ms=2.0, speedup=step)
    if bwd is not None:
        row.update(fla_bwd_ms=bwd, kdagen_bwd_ms=1.0, bwd_speedup=bwd)
    return row | extra


def test_targets_are_judged_on_the_headline_configs():
    rows = [_row(f"c{i}", "fixed", 3.0, 2.5) for i in range(28)] + [_row("long", "long", 0.5, 0.5)]
    assert bench_bwd.target_lines(rows) == [
        "fwd+bwd: geomean 3.00x (target >= 2.5x): met",
        "fwd+bwd: lowest 3.00x at c0 (target: none below 1.5x): met",
        "bwd alone: geomean 2.50x (target >= 2.0x): met",
    ]
    rows[5] = _row("slow", "varlen", 1.2, 1.0)
    lines = bench_bwd.target_lines(rows)
    assert lines[1] == "fwd+bwd: lowest 1.20x at slow (target: none below 1.5x): missed"
    partial = bench_bwd.target_lines(rows[:3] + [_row("err", "fixed", None, None, kdagen_error="E")])
    assert partial[0].endswith("met (on 3 of the 28 headline configs)")
    assert bench_bwd.target_lines([]) == ["fwd+bwd: no headline config has both timings",
                                          "bwd alone: no headline config has both timings"]


def test_table_cells_show_both_times_speedups_gradient_errors_and_failures():
    row = _row("B1-T512", "fixed", 2.5, 2.0, dq_rel_rmse=1.2e-3, dh0_rel_rmse=4e-4)
    cells = bench_bwd.table_cells(row)
    assert len(cells) == len(bench_bwd.COLUMNS)
    assert cells[:9] == ["B1-T512", "1", "512", "5.000", "2.000", "2.50x", "2.000", "1.000", "2.00x"]
    assert cells[9] == "1.2e-03" and cells[-1] == "4.0e-04" and cells[10] == "-"
    failed = bench_bwd.table_cells(_row("x", "fixed", None, None, kdagen_error="RuntimeError: no"))
    assert failed[3:9] == ["-", "ERR", "-", "-", "ERR", "-"]


def test_markdown_from_a_result_json(tmp_path):
    rows = [_row("B1-T512", "fixed", 2.5, 2.0, dq_rel_rmse=1e-3),
            _row("N10-T4096-uniform", "varlen", None, None, kdagen_error="ValueError: bad"),
            _row("long-T65536-H4", "long", 1.0, 1.0)]
    meta = {"date": "2026-01-02T03:04:05", "card": {"name": "H100"}, "spec_arg": None,
            "recompute": True, "iters": 20, "warmup": 5, "rounds": 3, "fla": "FLA 0.6.0", "torch": "2.x"}
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"meta": meta, "rows": rows}))
    assert bench_bwd.markdown_from_json(path) == f"wrote {tmp_path / 'run.md'}"
    text = (tmp_path / "run.md").read_text()
    assert text.startswith("# KDA forward+backward, kdagen vs FLA chunk_kda, H100 (2026-01-02), headline")
    assert sum(line.startswith("| ") for line in text.splitlines()) == 1 + len(rows)
    assert "over 1 headline configs: fwd+bwd 2.500x, bwd 2.000x" in text  # the long config is not headline
    assert "- fwd+bwd: geomean 2.50x (target >= 2.5x): met (on 1 of the 28 headline configs)" in text
    assert "- N10-T4096-uniform: kdagen: ValueError: bad" in text


def test_a_partial_result_says_how_far_it_got(tmp_path):
    # The JSON is written after every config; a run cut short leaves the configs it finished, marked.
    meta = {"date": "2026-01-02T03:04:05", "card": {"name": "H200"}, "spec_arg": None, "recompute": True,
            "iters": 5, "warmup": 3, "rounds": 1, "fla": "FLA 0.6.0", "torch": "2.x", "configs_done": 1,
            "configs_planned": 29}
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"meta": meta, "rows": [_row("B1-T512", "fixed", 2.5, 2.0)]}))
    bench_bwd.markdown_from_json(path)
    assert "; partial: the run ended after 1 of its 29 configs" in (tmp_path / "run.md").read_text()
    meta["configs_done"] = 29
    assert "partial" not in bench_bwd.footer_text(meta, [])


def test_kernel_times_rank_gpu_kernels_by_name():
    def ev(key: str, us: float, count: int = 1, device_type: str = "DeviceType.CUDA") -> SimpleNamespace:
        return SimpleNamespace(key=key, device_time_total=us, count=count, device_type=device_type)

    events = [ev("dq_kernel", 300.0), ev("dh_kernel", 1000.0, 2), ev("aten::mm", 5000.0, 1, "DeviceType.CPU"),
              ev("cpu_only", 0.0), ev("dq_kernel", 200.0)] + [ev(f"k{i}", 1.0) for i in range(20)]
    ranked, total = bench_bwd.kernel_times(events)
    assert ranked[:2] == [("dh_kernel", 1.0, 2), ("dq_kernel", 0.5, 2)]
    assert len(ranked) == bench_bwd.PROFILE_TOP and total == pytest.approx(1.52)
    text = bench_bwd.format_kernel_times(ranked, total)
    assert "65.8%" in text.splitlines()[1] and "dh_kernel" in text.splitlines()[1]
