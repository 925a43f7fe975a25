"""The benchmark's physical floors and options (benchmarks/bench_fwd.py), on the CPU."""

from __future__ import annotations

import sys

import pytest

from kdagen import paths

sys.path.insert(0, str(paths.benchmarks_dir()))
import bench_fwd  # noqa: E402

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
