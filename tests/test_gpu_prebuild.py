"""`tests/gpu/prebuild.py`, the GPU suite's parallel prebuild: its list holds every spec the GPU tests name,
once, and each plans for the target it is compiled for (run in a subprocess: the list imports the GPU test
modules by their file names, as pytest does)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

PROBE = """
import json, sys
sys.path.insert(0, "tests/gpu")
import prebuild
from kdagen.build import check_target
from kdagen.plan import make_plan
from kdagen.spec import resolve_spec
rows = []
for label, spec, target in prebuild.gpu_suite_jobs():
    ks = resolve_spec(spec)[1]
    check_target(ks, target)
    rows.append([label, ks.canonical_json(), target, len(make_plan(ks).stages)])
print(json.dumps(rows))
"""


def _rows() -> list[list]:
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_prebuild_lists_every_gpu_spec_once_and_each_plans() -> None:
    sys.path.insert(0, str(REPO / "tests" / "gpu"))
    try:
        import _cases as cases
    finally:
        sys.path.pop(0)
    rows = _rows()
    labels = [r[0] for r in rows]
    identities = [(r[1], r[2]) for r in rows]
    assert len(set(identities)) == len(identities), "a spec listed twice"
    assert set(cases.SPECS) <= set(labels)
    # the ones the GPU run had to build inside the tests before (the FLA drop-ins' specs), family-forced rows,
    # and the sm_80 / sm_89 plans compiled for sm_90a
    for label in ("frameworks:lb-safe-l2-vk-beta-logit_x2", "frameworks:pool-kv", "frameworks:pool-vk",
                  "lb_safe:mma_sync", "p_reset_vk_bbf16:wgmma", "sm_80:k128", "sm_89:k128-softplus"):
        assert label in labels, label
    assert all(r[2] == "sm_90a" for r in rows if r[0].startswith(("sm_80:", "sm_89:")))
    assert all(r[3] > 0 for r in rows)


def test_prebuild_list_option_compiles_nothing() -> None:
    out = subprocess.run([sys.executable, "tests/gpu/prebuild.py", "--list"], cwd=REPO, capture_output=True,
                         text=True, check=True)
    lines = out.stdout.strip().splitlines()
    assert len(lines) == len(_rows())
    assert "sm_80:k128 (compiled for sm_90a)" in lines
