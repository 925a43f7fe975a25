"""Compile every variant the GPU tests and the benchmarks' default specs ask for, in parallel processes.

The GPU tests build what they miss one spec at a time inside the test run (about a minute a spec on one core;
the suite asks for about fifty). Run this first, on the GPU machine or on any machine whose cache the GPU
machine then reads (CuTe DSL compiles for sm_90a without a GPU):

    python tests/gpu/prebuild.py -j 15        # then: python -m pytest -m gpu tests/gpu
    python tests/gpu/prebuild.py --list       # the variants, one a line, nothing compiled

The list is read from the test modules' own tables (`_cases.SPECS`, the family-forced rows, the sm_80 and
sm_89 plans that `test_targets` compiles for sm_90a, the FLA drop-ins' flag sets through
`kdagen.fla.choose_spec`), so a new row there is prebuilt without an edit here.
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
ARCH = "sm_90a"

# (label, spec: a dict or "file.yaml:name", target for check_target or None)
Job = tuple[str, Any, "str | None"]


def _family_rows() -> set[tuple[str, str]]:
    # (SPECS name, family) of every test that forces a family
    import test_families
    import test_pool_prefill
    import test_strided_inputs

    rows = {(name, family) for name in test_families.FAMILY_CASES for family in ("wgmma", "mma_sync")}
    for table in (test_pool_prefill.VARLEN, test_pool_prefill.CHECKPOINTS, test_pool_prefill.CHUNKED,
                  test_strided_inputs.PATHS):
        rows |= {(row[0], row[1]) for row in table if row[1] != "auto"}
    return rows


def _fla_specs() -> list[Job]:
    # The specs kdagen.fla picks in test_frameworks, from meta tensors of the tests' shapes and dtypes.
    import test_frameworks
    import torch

    from kdagen import fla

    def meta(*shape: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(*shape, dtype=dtype, device="meta")

    bf16, fp32 = torch.bfloat16, torch.float32  # as test_frameworks._inputs makes them
    jobs: list[Job] = [("frameworks:custom-op", dict(test_frameworks.OP_SPEC), None)]
    k = 128
    for name, heads, flags in test_frameworks.CASES:
        h, hv = heads["H"], heads["HV"]
        gate = {"A_log": meta(hv, dtype=torch.float32)} if flags.get("use_gate_in_kernel") else {}
        spec = fla.choose_spec(meta(1, 1, h, k, dtype=bf16), meta(1, 1, hv, k, dtype=bf16),
                               meta(1, 1, hv, k, dtype=fp32), meta(1, 1, hv, dtype=fp32), arch=ARCH, **flags,
                               **gate)
        jobs.append((f"frameworks:{name}", spec.model_dump(), None))
    for v_first in (False, True):  # fused_recurrent_kda_fwd: no safe gate (fla._recurrent_kernel)
        qv = meta(1, 1, 2, k, dtype=bf16)
        spec = fla.choose_spec(qv, qv, meta(1, 1, 2, k, dtype=fp32), meta(1, 1, 2, dtype=fp32), arch=ARCH,
                               safe_gate=False, state_v_first=v_first, A_log=meta(2, dtype=fp32),
                               **test_frameworks.POOL_FLAGS)
        jobs.append((f"frameworks:pool-{'vk' if v_first else 'kv'}", spec.model_dump(), None))
    return jobs


def gpu_suite_jobs() -> list[Job]:
    """Every variant the GPU tests and the benchmarks' default specs build, once each, in a fixed order."""
    sys.path.insert(0, str(HERE))
    import _cases as cases
    import test_targets

    from kdagen.spec import resolve_spec

    jobs: list[Job] = [(name, dict(spec), None) for name, spec in cases.SPECS.items()]
    jobs += [(f"{name}:{family}", {**cases.SPECS[name], "family": family}, None)
             for name, family in sorted(_family_rows())]
    jobs += [(f"{spec.arch}:{name}", spec, ARCH) for name, spec in test_targets.VARIANTS]
    jobs += _fla_specs()
    # test_serve_gpu and bench_decode's default spec, bench_pool's and bench_decode's other usual ones
    sm90 = REPO / "specs" / "sm90.yaml"
    jobs += [(f"sm90:{name}", f"{sm90}:{name}", None) for name in ("k128", "k128-vk", "k128-sbf16")]
    sys.path.insert(0, str(REPO / "benchmarks"))
    import bench_fwd  # the headline spec of bench_fwd and bench_bwd

    jobs.append(("bench:headline", dict(bench_fwd.HEADLINE_SPEC), None))
    seen: set[str] = set()
    unique: list[Job] = []
    for label, spec, target in jobs:
        identity = resolve_spec(spec)[1].canonical_json() + (target or "")
        if identity not in seen:
            seen.add(identity)
            unique.append((label, spec, target))
    return unique


def _build(job: Job) -> str:
    from kdagen.build import build_variant

    label, spec, target = job
    start = time.perf_counter()
    try:
        result = build_variant(spec, target=target)
    except Exception as exc:  # reported and counted by the caller; the other builds go on
        return f"FAILED {label}: {type(exc).__name__}: {exc}"
    how = "cached" if result.cached else "compiled"
    return f"{time.perf_counter() - start:6.1f} s  {label}  {how} {result.key}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-j", "--jobs", type=int, default=1, help="compile this many variants at once")
    parser.add_argument("--list", action="store_true", help="print the variants and compile nothing")
    args = parser.parse_args(argv)
    jobs = gpu_suite_jobs()
    if args.list:
        for label, _, target in jobs:
            print(label + (f" (compiled for {target})" if target else ""))
        return 0
    start = time.perf_counter()
    failed = 0
    with ProcessPoolExecutor(max(1, args.jobs)) as pool:
        for done in as_completed([pool.submit(_build, job) for job in jobs]):
            line = done.result()
            failed += line.startswith("FAILED")
            print(line, flush=True)
    print(f"{len(jobs) - failed} of {len(jobs)} variants in the cache ({time.perf_counter() - start:.0f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
