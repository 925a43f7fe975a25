"""The test-only compile target: an sm_80 or sm_89 plan compiled for sm_90a, so that the GPU tests run the
plans those GPUs would run (shared-memory budgets, tilings, no TMA, no PDL) on an H100 or H200."""

from pathlib import Path
from typing import Any

import pytest

import kdagen.build
from kdagen.errors import BuildError
from kdagen.keys import cache_key
from kdagen.spec import KernelSpec

RENDERED = {"prepare.py": "a = 1\n", "forward.py": "b = 2\n"}


@pytest.mark.parametrize("arch", ["sm_80", "sm_89"])
def test_older_plans_may_target_sm90a(arch: str):
    spec = KernelSpec(arch=arch)
    assert kdagen.build.check_target(spec, "sm_90a") == "sm_90a"
    assert kdagen.build.check_target(spec, None) == arch
    assert kdagen.build.check_target(spec, arch) == arch


@pytest.mark.parametrize(("arch", "target"), [("sm_90a", "sm_80"), ("sm_100a", "sm_90a"), ("sm_80", "sm_89"),
                                              ("sm_89", "sm_100a")])
def test_other_targets_are_refused(arch: str, target: str):
    with pytest.raises(BuildError, match=rf"target='{target}': a {arch} plan can be compiled only for"):
        kdagen.build.check_target(KernelSpec(arch=arch), target)


def test_the_target_is_in_the_key():
    spec = KernelSpec(arch="sm_80")
    plain, _ = cache_key(spec, RENDERED, kdagen.build._options(spec))
    emulated, parts = cache_key(spec, RENDERED, kdagen.build._options(spec, "sm_90a"))
    assert plain != emulated
    assert "--gpu-arch sm_90a" in parts["compile_options"]["value"]


def test_build_compiles_the_plan_of_the_spec_for_the_target(isolated_env, monkeypatch: pytest.MonkeyPatch):
    seen: list[tuple[str, str, tuple[str, ...]]] = []

    def compile_all(spec: KernelSpec, plan: Any, rendered: dict[str, str], entry: Path, target: str):
        seen.append((spec.arch, target, tuple(s.name for s in plan.stages)))
        return {name: b"obj" for name in plan.stage_names}, 0.1

    monkeypatch.setattr(kdagen.build, "_compile_all", compile_all)
    spec = KernelSpec(arch="sm_89")
    emulated = kdagen.build.build_variant(spec, target="sm_90a")
    plain = kdagen.build.build_variant(spec)
    assert [t for _, t, _ in seen] == ["sm_90a", "sm_89"]
    assert seen[0][2] == seen[1][2]  # one plan, two targets
    assert emulated.key != plain.key
    assert kdagen.build.build_variant(spec, target="sm_90a").cached
