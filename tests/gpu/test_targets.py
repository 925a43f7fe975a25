"""The sm_80 and sm_89 plans, run on the H100/H200: each variant of specs/sm80.yaml and specs/sm89.yaml is
planned for its own target (shared-memory budgets, tilings, no TMA, no programmatic dependent launch) and
compiled for sm_90a, whose features are a superset (`kdagen.build.check_target`), then checked against the
fp64 reference like the sm_90a matrix: the prefill, and the decode stage's wide CTAs. What this cannot show
is the speed or the machine code of those GPUs.
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


@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize(("name", "spec_obj"), VARIANTS, ids=[f"{s.arch}:{n}" for n, s in VARIANTS])
def test_wide_decode_runs_on_sm90a(name: str, spec_obj: KernelSpec, tokens: int) -> None:
    # The decode stage's wide CTAs (a whole value column a thread: the targets without the streaming stage)
    # on a pool with a padding slot, one and several tokens a request (the next token loaded ahead).
    kernel = kdagen.build.get_kernel(spec_obj, target="sm_90a")
    assert kernel._decode_stream is None
    assert {s.name: s for s in kernel.plan.stages}["decode"].params["key_split"] == 1
    spec = spec_obj.model_dump()
    n, h = 5, 2
    hv = h * spec["gva_ratio"]
    inp = cases.build_inputs(spec, cases.F(n, tokens, h, init=True, seed=21))
    pool = cases.decode_pool(spec, 8, hv)
    before = pool.clone()
    idx = torch.tensor([6, -1, 0, 3, 7], dtype=torch.int32, device="cuda")
    h0 = torch.stack([pool[max(int(i), 0)] for i in idx.tolist()])
    o = kernel.decode(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], A_log=inp["A_log"],
                      dt_bias=inp["dt_bias"], state_pool=pool, state_indices=idx)
    torch.cuda.synchronize()
    ref_o, ref_ht = cases.run_reference(spec, {**inp, "initial_state": h0})
    live = idx >= 0
    assert_close(f"o ({name})", ref_o[live], o[live], cases.GPU_TOL)
    assert torch.count_nonzero(o[~live]) == 0, "o of a padding slot is not zero"
    for row, slot in enumerate(idx.tolist()):
        if slot >= 0:
            assert_close(f"pool[{slot}] ({name})", ref_ht[row], pool[slot], cases.GPU_TOL)
    untouched = [s for s in range(8) if s not in idx.tolist()]
    assert torch.equal(pool[untouched], before[untouched]), "a slot no request names was written"
