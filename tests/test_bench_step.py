"""How the recurrence step benchmark (benchmarks/bench_step.py) attributes kernel time, on the CPU."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kdagen import paths

sys.path.insert(0, str(paths.benchmarks_dir()))
import bench_step  # noqa: E402

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "bench"

# Kernel symbols as the CUDA profiler names them: the function name inside CuTe DSL's mangled one.
MANGLED = "kernel_cutlass_{}_kernel_tensorptrf32gmemalign16o1234_Int32_0"


@pytest.mark.parametrize("stage", ["setup", "prepare", "recurrence", "fused", "merge"])
def test_each_stage_kernel_is_found_in_its_symbol(stage: str):
    assert bench_step.stage_of(MANGLED.format(stage)) == stage


def test_an_unknown_kernel_keeps_its_name():
    assert bench_step.stage_of("void at::native::fill_kernel<float>") == "void at::native::fill_kernel<float>"


def test_the_chain_is_timed_from_the_fused_kernel_when_it_ran():
    # The fused path: the recurrence kernel is launched but its CTAs exit at once (a few us).
    fused = {"setup": 0.002, "recurrence": 0.003, "fused": 1.19}
    assert bench_step.chain_ms(fused) == ("fused", 1.19)
    two_stage = {"setup": 0.002, "prepare": 0.8, "recurrence": 1.2}
    assert bench_step.chain_ms(two_stage) == ("recurrence", 1.2)


def test_markdown_marks_fused_steps_and_reads_runs_without_the_fused_column():
    new = {"device": "H100", "tokens": 16384, "family": "wgmma", "fused": "auto", "rows": [
        {"heads": 64, "cp": "off", "chain": "fused", "us_per_step": 1.162, "prepare_ms": 0.0,
         "recurrence_ms": 0.003, "fused_ms": 1.19, "merge_ms": 0.0}]}
    assert "| 64 | off | 0.000 | 0.003 | 1.190 | 0.000 | 1.162 (fused) |" in bench_step.markdown(new)
    # An H100 run's rows (1 and 64 heads), written before the fused column existed.
    old = json.loads((FIXTURES / "recurrence-step-without-fused-column.json").read_text())
    assert "| 1 | off | 0.043 | 0.581 | 0.000 | 0.000 | 0.568 |" in bench_step.markdown(old)
