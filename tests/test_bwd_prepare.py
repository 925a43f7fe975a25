"""The `bwd_prepare` stage: the variant's prepare kernel with the backward's extra output. Its signature is
prepare's with the matrices between the tensors and the scalars, the order in which
`KDAKernel._run_prepare` passes them; its launch goes through prepare's `launch_mats` entry."""

from pathlib import Path

import pytest

import kdagen.build
import kdagen.compile
from kdagen.spec import KernelSpec

SPECS = {
    "sm90-lower_bound": KernelSpec(arch="sm_90a"),
    "sm80-precomputed": KernelSpec(arch="sm_80", gate="precomputed"),
}


@pytest.mark.parametrize("name", list(SPECS))
def test_signature_is_prepare_with_the_matrices(tmp_path: Path, name: str):
    spec = SPECS[name]
    plan, rendered, _key, _parts = kdagen.build.describe(spec)
    assert "bwd_prepare" in plan.stage_names and "prepare" in plan.stage_names
    src = tmp_path / spec.slug()
    src.mkdir()
    for fname, text in rendered.items():
        (src / fname).write_text(text)
    prepare = kdagen.compile._import_generated(src / "prepare.py")
    bwd = kdagen.compile._import_generated(src / "bwd_prepare.py")
    names = [entry[0] for entry in prepare.SIGNATURE]
    assert names[-4:] == ["scale", "num_ctas", "early", "stream"]
    assert [entry[0] for entry in bwd.SIGNATURE] == names[:-4] + ["mats"] + names[-4:]
    mats = dict((entry[0], entry) for entry in bwd.SIGNATURE)["mats"]
    assert mats[2] == "Float32" and mats[3] == ("NTB", "HV", 2, 16, 16)
    assert "prepare.launch_mats(" in rendered["bwd_prepare.py"]
    assert "def launch_mats(" in rendered["prepare.py"]
