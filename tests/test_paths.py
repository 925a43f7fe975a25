"""kdagen.paths.load_module: importing a file by path (CPU only)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kdagen import paths


def test_load_module_registers_and_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    f = tmp_path / "stage.py"
    f.write_text("import sys\nSELF = sys.modules[__name__]\nX = 3\n")
    monkeypatch.setitem(sys.modules, "kdagen_test_stage", None)  # removed again after the test
    module = paths.load_module("kdagen_test_stage", f)
    assert module.X == 3 and module.SELF is module  # registered before its code runs
    assert sys.modules["kdagen_test_stage"] is module
    assert module.__file__ == str(f)


def test_load_module_refuses_a_non_python_file(tmp_path: Path):
    with pytest.raises(ImportError, match="cannot import"):
        paths.load_module("kdagen_test_none", tmp_path / "notes.txt")
