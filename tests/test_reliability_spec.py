"""Spec files that are not what they should be: clear `SpecError`s, never a traceback (CPU only)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kdagen.errors import SpecError
from kdagen.spec import KernelSpec, load_spec_file


def _write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, data: str | bytes, name: str = "x.yaml") -> str:
    (tmp_path / "specs").mkdir(exist_ok=True)
    target = tmp_path / "specs" / name
    if isinstance(data, bytes):
        target.write_bytes(data)
    else:
        target.write_text(data)
    monkeypatch.chdir(tmp_path)
    return f"specs/{name}"


def _err(path: str) -> str:
    with pytest.raises(SpecError) as ei:
        load_spec_file(path)
    return str(ei.value)


# -- file that cannot be read as text --------------------------------------------------------------------


def test_non_utf8_file_is_a_spec_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    data = b"defaults: {arch: sm_90a}\nvariants: [{name: \xff\xfe}]\n"
    msg = _err(_write(tmp_path, monkeypatch, data))
    assert msg.startswith("specs/x.yaml: not UTF-8 text")
    assert f"byte 0xff at offset {data.index(0xFF)}" in msg


def test_directory_is_a_spec_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    (tmp_path / "specs" / "dir.yaml").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert _err("specs/dir.yaml") == "specs/dir.yaml: is a directory, expected a YAML spec file"


# -- matrix name templates --------------------------------------------------------------------------------


def _matrix(name: str) -> str:
    return f"defaults: {{arch: sm_90a}}\nvariants: [{{name: '{name}', matrix: {{gva_ratio: [1, 2]}}}}]\n"


@pytest.mark.parametrize("placeholder", ["{gva_ratio.real}", "{arch.upper}", "{gva_ratio[0]}", "{arch[0]}"])
def test_matrix_name_attribute_or_index_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, placeholder: str
):
    msg = _err(_write(tmp_path, monkeypatch, _matrix("g{gva_ratio}-" + placeholder)))
    assert f"placeholder '{placeholder[1:-1]}'" in msg
    assert "attribute and index forms are not supported" in msg
    assert "plain field name" in msg


def test_matrix_name_positional_placeholder_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    msg = _err(_write(tmp_path, monkeypatch, _matrix("g{gva_ratio}-{}")))
    assert "placeholder '{}'" in msg and "plain field name" in msg


def test_matrix_name_uses_defaults_of_every_field(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    # head_dim_k is neither in the file's defaults nor in the matrix: the model's default fills it, and
    # arch comes from the file's defaults.
    path = _write(tmp_path, monkeypatch, _matrix("{arch}-k{head_dim_k}-{dtype}-g{gva_ratio}"))
    specs = load_spec_file(path)
    assert list(specs) == ["sm_90a-k128-bf16-g1", "sm_90a-k128-bf16-g2"]
    assert specs["sm_90a-k128-bf16-g2"] == KernelSpec(arch="sm_90a", gva_ratio=2)


def test_matrix_name_format_spec_still_works(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    specs = load_spec_file(_write(tmp_path, monkeypatch, _matrix("g{gva_ratio:02d}")))
    assert list(specs) == ["g01", "g02"]


# -- duplicate keys ---------------------------------------------------------------------------------------


def test_duplicate_key_in_a_mapping_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    text = "defaults: {arch: sm_90a}\nvariants:\n  - name: a\n    gva_ratio: 2\n    gva_ratio: 4\n"
    msg = _err(_write(tmp_path, monkeypatch, text))
    assert msg == "specs/x.yaml: line 5: duplicate key 'gva_ratio' (first at line 4)"


def test_variants_twice_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    text = "defaults: {arch: sm_90a}\nvariants:\n  - name: a\nvariants:\n  - name: b\n"
    msg = _err(_write(tmp_path, monkeypatch, text))
    assert msg == "specs/x.yaml: line 4: duplicate key 'variants' (first at line 2)"


def test_merge_keys_may_be_overridden(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    # A YAML merge (<<) followed by an explicit key is an override, not a duplicate.
    text = (
        "defaults: &d {arch: sm_90a, gva_ratio: 1}\n"
        "variants:\n  - {<<: *d, name: a, gva_ratio: 2}\n"
    )
    specs = load_spec_file(_write(tmp_path, monkeypatch, text))
    assert specs["a"].gva_ratio == 2
