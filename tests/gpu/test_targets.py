"""The sm_80 and sm_89 plans, run on the H100/H200: each variant of specs/sm80.yaml and specs/sm89.yaml is
planned for its own target (shared-memory budgets, tilings, no TMA, no programmatic dependent launch) and
compiled for sm_90a, whose features are a superset (`kdagen.build.check_target`), then checked against the
fp64 reference like the sm_90a matrix. What this cannot show is the speed or the machine code of those GPUs.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import kdagen.build
from kdagen.policy import SchedulePolicy
from kdagen.reference import assert_close
from kdagen.spec import KernelSpec, load_spec_file

try:  # tests/gpu is not a package: pytest puts this folder on sys.path (rootdir-relative import mode)
    from . import _cases as cases  # type: ignore[no-redef]
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import _cases as cases  # type: ignore[no-redef]

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (sm_90a)"),
]

REPO_ROOT = Path(__file__).resolve().parents[2]
VARIANTS = [
    (name, spec)
    for file in ("sm80.yaml", "sm89.yaml")
    for name, spec in load_spec_file(REPO_ROOT / "specs" / file).items()
]


def _cases_for(spec: dict) -> list[tuple[cases.Case, SchedulePolicy | None]]:
    reset = not spec["safe_gate"]
    return [
        (cases.F(2, 65, 2, init=True), None),
        (cases.VL(cases.CU_5, 2, init=True, mask_p=0.1, hard_reset=reset), None),
        (cases.VL(cases.CU_EDGE, 1, init=False), None),
        # One long sequence on a few heads, the intra-card CP path forced: prescan, merge (whose map prefetch
        # depth the target's shared memory sets) and the segment pass.
        (cases.F(1, 4096, 1, init=True, mask_p=0.1, hard_reset=reset), SchedulePolicy(intracard_cp=1024)),
    ]


@pytest.mark.parametrize(("name", "spec_obj"), VARIANTS, ids=[f"{s.arch}:{n}" for n, s in VARIANTS])
def test_plan_runs_on_sm90a(name: str, spec_obj: KernelSpec) -> None:
    assert spec_obj.arch in ("sm_80", "sm_89")
    kernel = kdagen.build.get_kernel(spec_obj, target="sm_90a")
    assert kernel.plan.family == "mma_sync"
    spec = spec_obj.model_dump()
    for case, policy in _cases_for(spec):
        k = kernel if policy is None else kernel.with_policy(policy)
        inp = cases.build_inputs(spec, case)
        o, ht = cases.run_kernel(k, inp, case.final)
        torch.cuda.synchronize()
        ref_o, ref_ht = cases.run_reference(spec, inp, case.final)
        assert_close(f"o ({name}, {case.id})", ref_o, o, cases.GPU_TOL)
        assert_close(f"ht ({name}, {case.id})", ref_ht, ht, cases.GPU_TOL)
