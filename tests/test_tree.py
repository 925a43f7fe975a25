"""The generated tree: writing a variant, the expected tree, `check_tree` and `prune_tree` (CPU only)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import fake_plan

from kdagen import paths, tree
from kdagen.spec import KernelSpec

SPEC = KernelSpec(arch="sm_90a")
SPEC_FILE = """\
defaults: {arch: sm_90a}
variants:
  - name: a
  - name: b
    gva_ratio: 2
  - name: a-again
"""


def test_generated_dir_for(isolated_env: dict[str, Path], tmp_path: Path):
    assert tree.generated_dir_for(SPEC) == isolated_env["generated"] / "sm_90a" / SPEC.slug()
    assert tree.generated_dir_for(SPEC, tmp_path) == tmp_path / "sm_90a" / SPEC.slug()


def test_write_variant(isolated_env: dict[str, Path], fixture_templates: Path):
    written = tree.write_variant(SPEC, fake_plan(SPEC), templates=fixture_templates)
    d = isolated_env["generated"] / "sm_90a" / SPEC.slug()
    assert written == {"alpha.py": d / "alpha.py", "beta.py": d / "beta.py"}
    assert sorted(p.name for p in d.iterdir()) == ["alpha.py", "beta.py"]  # no temp files left
    assert (d / "alpha.py").stat().st_mode & 0o777 == 0o644
    mtime = (d / "alpha.py").stat().st_mtime_ns
    (d / "stale_stage.py").write_text("old\n")
    tree.write_variant(SPEC, fake_plan(SPEC), templates=fixture_templates)
    assert (d / "alpha.py").stat().st_mtime_ns == mtime  # unchanged file not rewritten
    assert not (d / "stale_stage.py").exists()  # a stage the plan dropped is removed


def _tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fixture_templates: Path) -> tuple[list[str], Path]:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "specs").mkdir()
    (tmp_path / "specs" / "x.yaml").write_text(SPEC_FILE)
    root = tmp_path / "generated"
    files = ["specs/x.yaml"]
    for path, text in tree.expected_tree(
        files, root, planner=fake_plan, templates=fixture_templates
    ).items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return files, root


def test_expected_tree_dedupes_same_spec(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fixture_templates: Path
):
    files, root = _tree(tmp_path, monkeypatch, fixture_templates)
    expected = tree.expected_tree(files, root, planner=fake_plan, templates=fixture_templates)
    assert len(expected) == 4  # a and a-again are the same spec: 2 directories x 2 stages
    assert {p.parent.parent for p in expected} == {root / "sm_90a"}


def test_check_tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fixture_templates: Path):
    files, root = _tree(tmp_path, monkeypatch, fixture_templates)

    def check() -> list[str]:
        return tree.check_tree(files, root, planner=fake_plan, templates=fixture_templates)

    assert check() == []
    # Bytecode and dotfiles are not "extra".
    (root / "sm_90a" / SPEC.slug() / "__pycache__").mkdir()
    (root / "sm_90a" / SPEC.slug() / "__pycache__" / "alpha.cpython-311.pyc").write_bytes(b"\0")
    (root / ".gitattributes").write_text("* -diff\n")
    assert check() == []

    alpha = root / "sm_90a" / SPEC.slug() / "alpha.py"
    alpha.write_text(alpha.read_text().replace("K = 128", "K = 64"))
    (root / "sm_90a" / SPEC.slug() / "beta.py").unlink()
    (root / "sm_90a" / "kda_fwd-old-variant").mkdir()
    (root / "sm_90a" / "kda_fwd-old-variant" / "alpha.py").write_text("x\n")
    (root / "sm_80").mkdir()
    (root / "notes.txt").write_text("hi\n")
    problems = check()
    rel = f"generated/sm_90a/{SPEC.slug()}"
    stale = problems[0]
    assert problems[1] == f"missing: {rel}/beta.py (from specs/x.yaml:a)"
    assert stale.startswith(f"stale: {rel}/alpha.py (from specs/x.yaml:a)\n--- {rel}/alpha.py (on disk)\n")
    assert "\n-K = 64\n+K = 128\n" in stale
    assert problems[2:] == [
        "extra file (no spec produces it): generated/notes.txt",
        "extra directory (no spec produces it): generated/sm_80/",
        "extra directory (no spec produces it): generated/sm_90a/kda_fwd-old-variant/",
    ]

    removed = tree.prune_tree(files, root, planner=fake_plan, templates=fixture_templates)
    assert [p.name for p in removed] == ["notes.txt", "sm_80", "kda_fwd-old-variant"]
    assert [p.split(":")[0] for p in check()] == ["stale", "missing"]


def test_check_tree_missing_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fixture_templates: Path
):
    files, root = _tree(tmp_path, monkeypatch, fixture_templates)
    other = SPEC.replace(gva_ratio=2)
    shutil.rmtree(root / "sm_90a" / other.slug())
    assert tree.check_tree(files, root, planner=fake_plan, templates=fixture_templates) == [
        f"missing directory: generated/sm_90a/{other.slug()}/ (from specs/x.yaml:b)"
    ]


def test_real_planner_renders_every_checked_in_spec():
    """Smoke test of the real templates: every variant under specs/ renders (what `kdagen check` needs)."""
    pytest.importorskip("kdagen.plan")
    files = sorted(paths.specs_dir().glob("*.yaml"))
    assert files, "no spec files under specs/"
    expected = tree.expected_tree(files, Path("/nonexistent-root"))
    assert expected and all(t.startswith("# GENERATED by kdagen") for t in expected.values())
