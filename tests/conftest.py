"""Shared fixtures: an isolated environment, a fake planner and tiny templates.

The fake planner stands in for `kdagen.plan.make_plan`, so that render/check/CLI tests do not depend on the
real templates; test_render and test_import also exercise the real ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

FIXTURES = Path(__file__).parent / "fixtures"


@dataclass(frozen=True)
class FakeStage:
    name: str
    template: str
    params: dict[str, Any] = field(default_factory=dict)
    note: str = ""


@dataclass(frozen=True)
class FakePlan:
    family: str
    reason: str
    stages: tuple[FakeStage, ...]
    summary: str = ""

    @property
    def stage_names(self) -> list[str]:
        return [s.name for s in self.stages]


def fake_plan(spec: Any) -> FakePlan:
    """Two stages from the fixture template, with params derived from the spec."""
    params = {"head_dim_k": spec.head_dim_k, "gva_ratio": spec.gva_ratio, "l2norm_qk": spec.l2norm_qk}
    return FakePlan(
        family="fake",
        reason=f"fixture planner for {spec.arch}\nsecond line of the reason",
        stages=(
            FakeStage("alpha", "fake/stage.py.j2", dict(params), note="the alpha stage"),
            FakeStage("beta", "fake/stage.py.j2", {**params, "extra": 1}, note="the beta stage"),
        ),
        summary=f"fixture summary for {spec.arch}",
    )


@pytest.fixture
def fixture_templates() -> Path:
    return FIXTURES / "templates"


@pytest.fixture
def fake_planner():
    return fake_plan


@pytest.fixture
def isolated_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """Point the cache and the generated tree at temp directories (never the user's ~/.cache)."""
    cache = tmp_path / "cache"
    generated = tmp_path / "generated"
    monkeypatch.setenv("KDAGEN_CACHE_DIR", str(cache))
    monkeypatch.setenv("KDAGEN_GENERATED_DIR", str(generated))
    monkeypatch.delenv("KDAGEN_DISABLE_JIT", raising=False)
    return {"cache": cache, "generated": generated}


@pytest.fixture
def use_fakes(monkeypatch: pytest.MonkeyPatch, fixture_templates: Path) -> None:
    """Make kdagen.render and kdagen.tree (and the CLI through them) use the fixture templates and the fake
    planner."""
    import kdagen.paths
    import kdagen.tree

    monkeypatch.setattr(kdagen.paths, "templates_dir", lambda: fixture_templates)
    monkeypatch.setattr(kdagen.tree, "default_planner", lambda: fake_plan)


def write_spec_file(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path
