"""The key covers what shapes a binary beyond the spec and the sources (CPU only): the compile layer, the C
compiler that links the ``.so``, and the shared device code the rendered stages import."""

from __future__ import annotations

import hashlib
import stat
from pathlib import Path

import pytest
from click.testing import CliRunner

import kdagen.build
from kdagen import compile as compile_mod
from kdagen import keys
from kdagen.cli import cli
from kdagen.kernels import device_digest
from kdagen.spec import KernelSpec

BASE = KernelSpec(arch="sm_90a")
RENDERED = {"prepare.py": "x = 1\n"}
OPTIONS = "--gpu-arch sm_90a --enable-tvm-ffi"
TOOLCHAIN = {"nvidia-cutlass-dsl": "4.8.1", "apache-tvm-ffi": "0.1", "cuda_flavour": "cu13"}
NEW_PARTS = ("device_code", "compile_layer", "c_compiler")


def _key(**parts: str) -> str:
    return keys.cache_key(BASE, RENDERED, OPTIONS, toolchain=TOOLCHAIN, **parts)[0]


def test_parts_hold_the_compile_layer_compiler_and_device_code():
    _, parts = keys.cache_key(BASE, RENDERED, OPTIONS, toolchain=TOOLCHAIN)
    assert list(parts) == [
        "spec", "sources", "device_code", "toolchain", "compile_options", "compile_layer", "c_compiler",
    ]
    assert parts["device_code"]["value"] == device_digest()
    compile_py = Path(compile_mod.__file__).read_bytes()
    assert parts["compile_layer"]["value"] == hashlib.sha256(compile_py).hexdigest()
    assert parts["c_compiler"]["value"] == compile_mod.c_compiler_identity()


@pytest.mark.parametrize("part", NEW_PARTS)
def test_each_new_part_changes_the_key(part: str):
    base = {"device_code": "d" * 64, "compile_layer": "c" * 64, "c_compiler": "/usr/bin/cc | cc 12"}
    k0 = _key(**base)
    assert _key(**{**base, part: base[part] + "x"}) != k0
    assert _key(**base) == k0


def test_c_compiler_identity_names_path_and_version(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    cc = tmp_path / "mycc"
    cc.write_text("#!/bin/sh\necho 'mycc version 9.9 (test)'\necho 'second line'\n")
    cc.chmod(cc.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CC", str(cc))
    compile_mod.c_compiler_identity.cache_clear()
    try:
        assert compile_mod.c_compiler_identity() == f"{cc.resolve()} | mycc version 9.9 (test)"
    finally:
        compile_mod.c_compiler_identity.cache_clear()


def test_no_c_compiler_is_none(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(compile_mod.shutil, "which", lambda name: None)
    compile_mod.c_compiler_identity.cache_clear()
    try:
        assert compile_mod.c_compiler_identity() == "none"
        assert compile_mod.link_shared(b"") is None
    finally:
        compile_mod.c_compiler_identity.cache_clear()


def test_key_explain_shows_the_new_parts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, isolated_env):
    (tmp_path / "s.yaml").write_text("defaults: {arch: sm_90a}\nvariants: [{name: k128}]\n")
    monkeypatch.chdir(tmp_path)

    def describe(spec: KernelSpec):
        key, parts = keys.cache_key(spec, RENDERED, OPTIONS)
        return None, RENDERED, key, parts

    monkeypatch.setattr(kdagen.build, "describe", describe)
    out = CliRunner().invoke(cli, ["key", "s.yaml:k128", "--explain"], catch_exceptions=False).output
    *_, parts = describe(BASE)
    for part in NEW_PARTS:
        assert f"{part:<16} {parts[part]['sha256']}  {parts[part]['value']}" in out
    assert device_digest() in out and compile_mod.c_compiler_identity() in out
