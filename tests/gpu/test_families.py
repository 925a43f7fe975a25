"""The two template families on the same inputs: on sm_90a `auto` picks `wgmma` (its recurrence step is
the faster one) and `mma_sync` stays selectable per spec. Both must match the fp64 reference (the
matrix of test_numerics runs the `auto` family) and each other, over specs that cover the axes where the
recurrences differ: head dims (the wgmma tile shapes), state layouts, initial/final state, varlen runs
that end inside a 16-token step (masked rows), and hard resets.

Every test needs a CUDA GPU (sm_90a); without one the whole module is skipped.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from kdagen.reference import assert_close, rel_rmse

try:  # tests/gpu is not a package: pytest puts this folder on sys.path (rootdir-relative import mode)
    from . import _cases as cases  # type: ignore[no-redef]
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import _cases as cases  # type: ignore[no-redef]

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA GPU (kdagen kernels target sm_90a); torch.cuda.is_available() is False",
    ),
]

# Spec of the numerics matrix -> a case that exercises it (partial last steps, h0, several heads).
FAMILY_CASES = {
    "lb_safe": cases.VL(cases.CU_5, 2, init=True),
    "p_reset_vk_bbf16": cases.VL(cases.CU_5, 2, init=True, mask_p=0.1, hard_reset=True),
    "lb_safe_gva4_k64v64": cases.VL(cases.CU_3, 1, init=True),
    "softplus_gva4_k128v64_gbf16_bbf16": cases.VL(cases.CU_3, 1, init=True, mask_p=0.1, hard_reset=True),
    "lb_safe_k64v128_nol2_bbf16": cases.F(2, 65, 2, init=True),
    "p_safe_fp16_k64v64": cases.VL(cases.CU_5, 2, init=True, mask_p=0.5),
}
# Two families that round differently may differ by about their own error against the reference.
FAMILY_TOL = cases.GPU_TOL


def test_auto_family_on_sm90a() -> None:
    import kdagen

    kernel = kdagen.get_kernel(dict(cases.SPECS["lb_safe"]))
    assert kernel.plan.family == "wgmma", f"auto on sm_90a picked {kernel.plan.family!r}"


@pytest.mark.parametrize("spec_name", list(FAMILY_CASES))
def test_families_agree(spec_name: str) -> None:
    import kdagen

    spec = cases.SPECS[spec_name]
    case = FAMILY_CASES[spec_name]
    inp = cases.build_inputs(spec, case)
    ref_o, ref_ht = cases.run_reference(spec, inp, final=True)
    outs = {}
    for family in ("wgmma", "mma_sync"):
        kernel = kdagen.get_kernel({**spec, "family": family})
        assert kernel.plan.family == family
        o, ht = cases.run_kernel(kernel, inp, final=True)
        torch.cuda.synchronize()
        assert_close(f"o ({family})", ref_o, o, cases.GPU_TOL)
        assert_close(f"ht ({family})", ref_ht, ht, cases.GPU_TOL)
        outs[family] = (o, ht)
    (o_w, ht_w), (o_m, ht_m) = outs["wgmma"], outs["mma_sync"]
    assert rel_rmse(o_m.double(), o_w.double()) <= FAMILY_TOL, "o: the families disagree"
    assert rel_rmse(ht_m.double(), ht_w.double()) <= FAMILY_TOL, "ht: the families disagree"
