"""The remembered source digests (`kdagen.source_memo`): what invalidates them, and that a build trusts them
only as far as a complete cache entry under the key they give (CPU only, nothing compiled)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import kdagen.build
from kdagen import paths, source_memo
from kdagen.errors import CacheMissError
from kdagen.keys import source_digests
from kdagen.spec import load_spec_file, resolve_spec

SPEC_JSON = '{"arch":"sm_90a"}'
DIGESTS = {"alpha.py": "a" * 64, "beta.py": "b" * 64}


@pytest.fixture
def trees(tmp_path: Path, fixture_templates: Path) -> tuple[Path, Path]:
    """Private copies of a template tree and of the kdagen package sources, free to edit."""
    templates = tmp_path / "templates"
    shutil.copytree(fixture_templates, templates)
    package = tmp_path / "package"
    shutil.copytree(paths.package_dir(), package, ignore=shutil.ignore_patterns("__pycache__"))
    return templates, package


def test_generator_digest_is_stable(trees: tuple[Path, Path]):
    templates, package = trees
    first = source_memo.generator_digest(templates, package)
    assert source_memo.generator_digest(templates, package) == first
    assert len(first) == 64
    # Bytecode beside the sources is not a source.
    (package / "__pycache__").mkdir()
    (package / "__pycache__" / "plan.cpython-311.pyc").write_bytes(b"\0" * 16)
    assert source_memo.generator_digest(templates, package) == first


@pytest.mark.parametrize(
    "edit",
    ["template edited", "template added", "template renamed", "planner edited", "module added"],
)
def test_generator_digest_follows_every_input(trees: tuple[Path, Path], edit: str):
    templates, package = trees
    before = source_memo.generator_digest(templates, package)
    template = next(p for p in sorted(templates.rglob("*")) if p.is_file())
    if edit == "template edited":
        template.write_text(template.read_text() + "\n")
    elif edit == "template added":
        (template.parent / "extra.j2").write_text("{# nothing #}\n")
    elif edit == "template renamed":
        template.rename(template.with_name("z" + template.name))
    elif edit == "planner edited":
        plan = package / "plan.py"
        plan.write_text(plan.read_text().replace("def ", "def  ", 1))
    else:
        (package / "extra_rules.py").write_text("X = 1\n")
    assert source_memo.generator_digest(templates, package) != before


def test_store_and_load(tmp_path: Path):
    assert source_memo.load_digests(SPEC_JSON, "g" * 64, tmp_path) is None
    source_memo.store_digests(SPEC_JSON, "g" * 64, DIGESTS, tmp_path)
    assert source_memo.load_digests(SPEC_JSON, "g" * 64, tmp_path) == DIGESTS
    # Another spec or another generator is another memo.
    assert source_memo.load_digests('{"arch":"sm_100a"}', "g" * 64, tmp_path) is None
    assert source_memo.load_digests(SPEC_JSON, "h" * 64, tmp_path) is None
    (memo,) = (tmp_path / source_memo.MEMO_DIR).iterdir()
    assert memo.name == f"{source_memo.memo_id(SPEC_JSON, 'g' * 64)}.json"
    assert oct(memo.stat().st_mode & 0o777) == oct(0o644)


@pytest.mark.parametrize(
    "damage",
    ["truncated", "not an object", "no sources", "short digest", "other spec inside"],
)
def test_a_damaged_memo_is_ignored(tmp_path: Path, damage: str):
    source_memo.store_digests(SPEC_JSON, "g" * 64, DIGESTS, tmp_path)
    (memo,) = (tmp_path / source_memo.MEMO_DIR).iterdir()
    text = memo.read_text()
    data = json.loads(text)
    if damage == "truncated":
        memo.write_text(text[: len(text) // 2])
    elif damage == "not an object":
        memo.write_text("[1, 2]")
    elif damage == "no sources":
        memo.write_text(json.dumps({**data, "sources": {}}))
    elif damage == "short digest":
        memo.write_text(json.dumps({**data, "sources": {"alpha.py": "abc"}}))
    else:
        memo.write_text(json.dumps({**data, "spec": '{"arch":"sm_100a"}'}))
    assert source_memo.load_digests(SPEC_JSON, "g" * 64, tmp_path) is None


def test_a_read_only_cache_is_skipped(tmp_path: Path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    source_memo.store_digests(SPEC_JSON, "g" * 64, DIGESTS, blocker)  # no error
    assert source_memo.load_digests(SPEC_JSON, "g" * 64, blocker) is None


# ---- the build path ----------------------------------------------------------------------------------------

SPEC_REFS = [
    (f.name, name) for f in sorted(paths.specs_dir().glob("*.yaml")) for name in load_spec_file(f)
]


@pytest.mark.parametrize("file_name,name", SPEC_REFS, ids=[f"{f}:{n}" for f, n in SPEC_REFS])
def test_remembered_key_equals_the_rendered_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, file_name: str, name: str
):
    monkeypatch.setenv("KDAGEN_CACHE_DIR", str(tmp_path))
    _, spec = resolve_spec(f"specs/{file_name}:{name}")
    plan, rendered, key, _ = kdagen.build.describe(spec)
    generator = source_memo.generator_digest()
    assert kdagen.build._remembered_key(spec, plan, generator) is None  # describe alone remembers nothing
    source_memo.store_digests(spec.canonical_json(), generator, source_digests(rendered))
    remembered = kdagen.build._remembered_key(spec, plan, generator)
    assert remembered is not None
    assert remembered == key
    assert set(source_memo.load_digests(spec.canonical_json(), generator)) == {
        f"{stage.name}.py" for stage in plan.stages
    }


def test_a_wrong_memo_costs_a_render_not_a_wrong_kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Digests that do not match the sources give a key with no entry: the build renders and finds the truth
    (here, with the JIT off and nothing built, the miss names the rendered key, not the memo's)."""
    monkeypatch.setenv("KDAGEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("KDAGEN_DISABLE_JIT", "1")
    _, spec = resolve_spec("specs/sm90.yaml:k64")
    plan, rendered, key, _ = kdagen.build.describe(spec)
    wrong = {name: "0" * 64 for name in source_digests(rendered)}
    source_memo.store_digests(spec.canonical_json(), source_memo.generator_digest(), wrong)
    remembered = kdagen.build._remembered_key(spec, plan, source_memo.generator_digest())
    assert remembered is not None and remembered != key
    with pytest.raises(CacheMissError) as info:
        kdagen.build.build_variant(spec)
    assert f"key {key}" in str(info.value)
    # A refused build leaves the memo as it was.
    assert source_memo.load_digests(spec.canonical_json(), source_memo.generator_digest()) == wrong
