"""The kdagen command line, through click's test runner, with the build layer faked (CPU only)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from conftest import fake_plan

import kdagen
import kdagen.build
from kdagen import cli as cli_mod
from kdagen import keys, render
from kdagen.build import BuildResult
from kdagen.cache import ArtifactCache
from kdagen.cli import cli
from kdagen.spec import KernelSpec, resolve_spec

SPECS = """\
defaults: {arch: sm_90a}
variants:
  - name: k128
  - name: k128-gva2
    gva_ratio: 2
"""
B200 = """\
defaults: {arch: sm_100a}
variants:
  - name: b200
"""
OPTIONS = "--gpu-arch {arch} --enable-tvm-ffi"


@pytest.fixture
def workdir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, isolated_env, use_fakes, fixture_templates
) -> Path:
    """A temp project: specs/ with two files, the fake planner and templates, build.describe faked."""
    (tmp_path / "specs").mkdir()
    (tmp_path / "specs" / "sm90.yaml").write_text(SPECS)
    (tmp_path / "specs" / "sm100.yaml").write_text(B200)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(kdagen.paths, "specs_dir", lambda: tmp_path / "specs")

    def describe(spec: KernelSpec):
        plan = fake_plan(spec)
        rendered = render.render_variant(spec, plan, templates=fixture_templates)
        key, parts = keys.cache_key(spec, rendered, OPTIONS.format(arch=spec.arch))
        return plan, rendered, key, parts

    monkeypatch.setattr(kdagen.build, "describe", describe)
    return tmp_path


def run(*args: str) -> Any:
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def test_version():
    r = run("--version")
    assert r.exit_code == 0 and kdagen.__version__ in r.output


def _rows(output: str) -> dict[str, str]:
    """Table rows by their first cell (continuation lines of wrapped cells have an empty first cell)."""
    lines = [line for line in output.splitlines() if line.startswith("│")]
    return {line.split("│")[1].strip(): line for line in lines if line.split("│")[1].strip()}


def test_list(workdir: Path):
    r = run("list")
    assert r.exit_code == 0, r.output
    rows = _rows(r.output)
    assert set(rows) == {"specs/sm100.yaml:b200", "specs/sm90.yaml:k128", "specs/sm90.yaml:k128-gva2"}
    assert "no: compiled and inspected here, never" in rows["specs/sm100.yaml:b200"]
    assert "yes: H100/H200" in rows["specs/sm90.yaml:k128"]
    assert "fixture summary for sm_90a" in rows["specs/sm90.yaml:k128"]  # the one-line reason
    assert "fixture planner" not in r.output  # the full reason is behind --why
    assert "alpha, beta" in rows["specs/sm90.yaml:k128"]
    assert all(line.rstrip(" │").endswith("no") for line in rows.values())

    # Publish k128 under the key the build layer computes: list now says it is cached.
    _, spec = resolve_spec("specs/sm90.yaml:k128")
    _, _, key, _ = kdagen.build.describe(spec)
    ArtifactCache().publish(spec, key, {"alpha": b"a", "beta": b"b"})
    rows = _rows(run("list", "specs/sm90.yaml").output)
    assert rows["specs/sm90.yaml:k128"].rstrip(" │").endswith("yes")
    assert rows["specs/sm90.yaml:k128-gva2"].rstrip(" │").endswith("no")


@pytest.mark.parametrize("arch", ["sm_80", "sm_89", "sm_100a"])
def test_list_says_compiled_never_run(workdir: Path, arch: str):
    (workdir / "specs" / "other.yaml").write_text(f"defaults: {{arch: {arch}}}\nvariants: [{{name: v}}]\n")
    r = CliRunner().invoke(cli, ["list", "specs/other.yaml"], catch_exceptions=False, env={"COLUMNS": "400"})
    assert r.exit_code == 0, r.output
    row = _rows(r.output)["specs/other.yaml:v"]
    gpu = {"sm_80": "A100", "sm_89": "L40S/RTX 4090", "sm_100a": "B200"}[arch]
    assert f"no: compiled and inspected here, never run (no {gpu} GPU)" in row


def test_list_why(workdir: Path):
    r = run("list", "--why", "specs/sm90.yaml", "specs/sm100.yaml")
    assert r.exit_code == 0, r.output
    _, spec = resolve_spec("specs/sm90.yaml:k128")
    text = r.output.split("\ncache: ", 1)[1]
    assert f"\nspecs/sm90.yaml:k128  ({spec.slug()})\n  family: fake\n  reason:\n" in text
    assert "    fixture planner for sm_90a\n    second line of the reason\n" in text
    stages = [
        "  stages:",
        "    alpha (fake/stage.py.j2): the alpha stage",
        "    beta (fake/stage.py.j2): the beta stage",
    ]
    assert "\n".join(stages) + "\n" in text
    assert "  runs: yes: H100/H200" in text
    assert "specs/sm100.yaml:b200  (" in text
    assert "  runs: no: compiled and inspected here, never run (no B200 GPU)" in text


def test_list_shows_spec_errors_cleanly(workdir: Path):
    (workdir / "specs" / "bad.yaml").write_text(
        "defaults: {arch: sm_90a}\nvariants: [{name: x, gva_ratio: 3}]\n"
    )
    r = run("list", "specs/bad.yaml")
    assert r.exit_code == 1
    assert (
        "Error: specs/bad.yaml: variant 'x': field 'gva_ratio': expected one of 1, 2, 4, 8, got 3" in r.output
    )
    assert "Traceback" not in r.output


def test_key_and_explain(workdir: Path):
    r = run("key", "specs/sm90.yaml:k128")
    assert r.exit_code == 0, r.output
    _, spec = resolve_spec("specs/sm90.yaml:k128")
    _, _, key, parts = kdagen.build.describe(spec)
    assert r.output.strip() == key

    r = run("key", "specs/sm90.yaml:k128", "--explain")
    assert r.exit_code == 0, r.output
    out = r.output
    assert f"key              {key}" in out and f"slug             {spec.slug()}" in out
    for name, part in parts.items():
        assert f"{name:<16} {part['sha256']}" in out
    assert spec.canonical_json() in out
    assert "--gpu-arch sm_90a --enable-tvm-ffi" in out
    for fname, sha in parts["sources"]["value"].items():
        assert f"  {fname:<30} {sha}" in out
    for pkg, version in keys.toolchain_fingerprint().items():
        assert f"  {pkg:<30} {version}" in out


def test_key_unknown_variant(workdir: Path):
    r = run("key", "specs/sm90.yaml:k129")
    assert r.exit_code == 1 and "no variant 'k129' (did you mean 'k128'?" in r.output


def test_render_and_check(workdir: Path, isolated_env: dict[str, Path]):
    gen = isolated_env["generated"]
    r = run("check")
    assert r.exit_code == 1 and "missing directory:" in r.output

    r = run("render", "specs/sm90.yaml", "--variant", "k128")
    assert r.exit_code == 0, r.output
    assert len(list(gen.glob("sm_90a/*/alpha.py"))) == 1
    assert run("render").exit_code == 0  # every spec file
    r = run("check")
    assert r.exit_code == 0, r.output
    assert "up to date with 2 spec file(s)" in r.output

    # A stale file: the diff is printed and the exit status is non-zero.
    target = next(gen.glob("sm_90a/*/beta.py"))
    target.write_text(target.read_text().replace("GVA = 1", "GVA = 3"))
    (gen / "sm_90a" / "kda_fwd-gone").mkdir()
    r = run("check", "specs", "--generated", str(gen))
    assert r.exit_code == 1
    assert "stale: " in r.output and "-GVA = 3\n+GVA = 1" in r.output
    assert "extra directory (no spec produces it): " in r.output and "kda_fwd-gone/" in r.output
    assert "2 problem(s)" in r.output

    r = run("render", "--prune")
    assert r.exit_code == 0 and "removed " in r.output
    assert run("check").exit_code == 0
    assert run("render", "specs/sm90.yaml", "--prune").exit_code == 2  # --prune renders everything


def _fake_build(calls: list[tuple[Any, bool]]):
    def build_variant(spec: Any, force: bool = False, name: str | None = None) -> BuildResult:
        calls.append((spec, force))
        vname, ks = resolve_spec(spec)
        if vname == "k128-gva2":
            raise kdagen.BuildError("compiling stage 'alpha' failed: boom")
        cached = not force and vname == "b200"
        path = Path("/cache") / ks.slug()
        return BuildResult(
            name=vname,
            spec=ks,
            slug=ks.slug(),
            key=hashlib.sha256(ks.canonical_json().encode()).hexdigest()[:24],
            stages=["alpha", "beta"],
            compile_seconds=0.0 if cached else 12.25,
            artifact_bytes=123456,
            cached=cached,
            paths={"alpha": path / "alpha.o", "beta": path / "beta.o"},
        )

    return build_variant


def test_build(workdir: Path, monkeypatch: pytest.MonkeyPatch):
    calls: list[tuple[Any, bool]] = []
    monkeypatch.setattr(kdagen.build, "build_variant", _fake_build(calls))
    r = run("build", "specs/sm100.yaml", "specs/sm90.yaml:k128")
    assert r.exit_code == 0, r.output
    assert calls == [("specs/sm100.yaml:b200", False), ("specs/sm90.yaml:k128", False)]
    _, spec = resolve_spec("specs/sm90.yaml:k128")
    row = next(line for line in r.output.splitlines() if "│ specs/sm90.yaml:k128 " in line)
    assert spec.slug() in row and "alpha, beta" in row and "12.2" in row and "123,456" in row
    assert hashlib.sha256(spec.canonical_json().encode()).hexdigest()[:12] in row
    b200 = next(line for line in r.output.splitlines() if "│ specs/sm100.yaml:b200 " in line)
    assert "cached" in b200
    assert f"cache: {ArtifactCache().root}" in r.output


def test_build_force_variant_and_failure(workdir: Path, monkeypatch: pytest.MonkeyPatch):
    calls: list[tuple[Any, bool]] = []
    monkeypatch.setattr(kdagen.build, "build_variant", _fake_build(calls))
    r = run("build", "specs/sm90.yaml", "--force")
    assert r.exit_code == 1
    assert calls == [("specs/sm90.yaml:k128", True), ("specs/sm90.yaml:k128-gva2", True)]
    assert "FAILED" in r.output
    assert "failed specs/sm90.yaml:k128-gva2: BuildError: compiling stage 'alpha' failed: boom" in r.output

    calls.clear()
    r = run("build", "specs/sm90.yaml", "--variant", "k128")
    assert r.exit_code == 0 and calls == [("specs/sm90.yaml:k128", False)]
    r = run("build", "specs/sm90.yaml", "--variant", "nope")
    assert r.exit_code == 1 and "--variant 'nope': no such variant in specs/sm90.yaml" in r.output


def test_clean(workdir: Path):
    cache = ArtifactCache()
    for arch in ("sm_90a", "sm_80"):
        cache.publish(KernelSpec(arch=arch), "0" * 24, {"alpha": b"x"})
    derived = [cache.root / "sources", cache.root / "templates" / "jinja3-py311"]
    for d in derived:
        d.mkdir(parents=True)
        (d / "x.json").write_text("{}")
    r = run("clean", "--arch", "sm_90a")
    assert r.exit_code == 0 and "removed 1 cache entry from" in r.output
    assert [e.arch for e in cache.entries()] == ["sm_80"]
    assert all(d.is_dir() for d in derived)  # one target's clean keeps what every target shares
    r = run("clean", "--arch", "sm_9")
    assert r.exit_code == 1 and "unknown arch 'sm_9'" in r.output
    assert run("clean").output.startswith("removed 1 cache entry and sources/ and templates/ from")
    assert not (cache.root / "sources").exists() and not (cache.root / "templates").exists()
    assert run("clean").output.startswith("removed 0 cache entries from")


def test_bench_without_script(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setattr(cli_mod.paths, "benchmarks_dir", lambda: tmp_path)
    r = run("bench", "--quick")
    assert r.exit_code == 1 and "bench_fwd.py not found" in r.output


def test_build_meta_json_is_plain(workdir: Path):
    # `kdagen list` reads only what ArtifactCache wrote; guard the file format it relies on.
    spec = KernelSpec(arch="sm_90a")
    paths = ArtifactCache().publish(spec, "1" * 24, {"alpha": b"x"})
    meta = json.loads((paths["alpha"].parent / "meta.json").read_text())
    assert meta["slug"] == spec.slug() and meta["arch"] == "sm_90a"
