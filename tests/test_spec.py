"""Spec model, spec files, capability checks, slugs and keys (CPU only)."""

from __future__ import annotations

import hashlib
import json
import pickle
import re
from dataclasses import replace
from pathlib import Path
from typing import Any, get_args

import pytest

from kdagen import arch as arch_mod
from kdagen import keys
from kdagen.errors import SpecError
from kdagen.spec import KernelSpec, load_spec_file, resolve_spec, validate_capabilities

BASE = KernelSpec(arch="sm_90a")


def _spec_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str, name: str = "sm90.yaml") -> str:
    """Write specs/<name> under tmp_path, chdir there, and return the relative path as a user types it."""
    (tmp_path / "specs").mkdir(exist_ok=True)
    (tmp_path / "specs" / name).write_text(text)
    monkeypatch.chdir(tmp_path)
    return f"specs/{name}"


def _err(fn, *args: Any, **kwargs: Any) -> str:
    with pytest.raises(SpecError) as ei:
        fn(*args, **kwargs)
    return str(ei.value)


# -- the model ----------------------------------------------------------------------------------------------


def test_defaults_match_architecture():
    assert BASE.model_dump() == {
        "arch": "sm_90a",
        "family": "auto",
        "head_dim_k": 128,
        "head_dim_v": 128,
        "chunk_size": 16,
        "gva_ratio": 1,
        "gate": "lower_bound",
        "lower_bound": -5.0,
        "safe_gate": True,
        "l2norm_qk": True,
        "dtype": "bf16",
        "g_dtype": "fp32",
        "beta_dtype": "fp32",
        "beta": "prob",
        "state_dtype": "fp32",
        "state_layout": "kv",
    }


def test_canonical_json_digest_and_slug():
    cj = BASE.canonical_json()
    assert " " not in cj
    # Every field, but beta at its default prob (an option whose default is the kernel without it).
    assert list(json.loads(cj)) == sorted(set(KernelSpec.model_fields) - {"beta"})
    assert BASE.digest() == hashlib.sha256(cj.encode()).hexdigest()
    assert (
        BASE.slug()
        == f"kda_fwd-sm90a-k128v128-c16-gva1-gate_lb5-safe-l2-bf16-g32-b32-kv-{BASE.digest()[:12]}"
    )
    sp = BASE.replace(gate="softplus", lower_bound=None, safe_gate=False, l2norm_qk=False, g_dtype="bf16")
    assert re.fullmatch(r"kda_fwd-sm90a-k128v128-c16-gva1-gate_sp-bf16-gbf16-b32-kv-[0-9a-f]{12}", sp.slug())
    pre = BASE.replace(gate="precomputed", lower_bound=-2.5, family="mma_sync", state_layout="vk")
    assert pre.slug().startswith("kda_fwd-sm90a-mma_sync-k128v128-c16-gva1-gate_pre_lb2p5-safe-l2-")


@pytest.mark.parametrize("mode", ["logit", "logit_x2"])
def test_beta_mode_in_canonical_json_and_slug(mode: str):
    # prob is the default and leaves the identity of a spec as it is without the field; the logit modes name
    # themselves in the canonical JSON (so in the digest) and in the readable slug.
    assert "beta" not in json.loads(BASE.canonical_json())
    assert KernelSpec(arch="sm_90a", beta="prob").canonical_json() == BASE.canonical_json()
    spec = BASE.replace(beta=mode)
    cj = json.loads(spec.canonical_json())
    assert list(cj) == sorted(KernelSpec.model_fields) and cj["beta"] == mode
    assert spec.digest() == hashlib.sha256(spec.canonical_json().encode()).hexdigest() != BASE.digest()
    assert spec.slug() == (
        f"kda_fwd-sm90a-k128v128-c16-gva1-gate_lb5-safe-l2-bf16-g32-b32-beta_{mode}-kv-{spec.digest()[:12]}"
    )
    # The canonical JSON reads back as the same spec, with or without the field.
    for s in (BASE, spec):
        assert KernelSpec.from_dict(json.loads(s.canonical_json())) == s


def test_int_and_float_lower_bound_are_the_same_spec():
    assert KernelSpec(arch="sm_90a", lower_bound=-5) == BASE
    assert KernelSpec(arch="sm_90a", lower_bound=-5).canonical_json() == BASE.canonical_json()


def test_frozen_hashable_picklable():
    with pytest.raises(Exception):  # noqa: B017 - pydantic's frozen error type is an implementation detail
        BASE.gva_ratio = 2  # type: ignore[misc]
    assert hash(BASE) == hash(KernelSpec(arch="sm_90a"))
    assert pickle.loads(pickle.dumps(BASE)) == BASE


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"gva_ratio": 3}, "KernelSpec: field 'gva_ratio': expected one of 1, 2, 4, 8, got 3"),
        ({"gva_ratio": True}, "field 'gva_ratio': expected one of 1, 2, 4, 8, got True"),
        ({"head_dim_k": 96}, "field 'head_dim_k': expected one of 64, 128, got 96"),
        ({"head_dim_v": "128"}, "field 'head_dim_v': expected one of 64, 128, got '128'"),
        (
            {"arch": "sm_90"},
            "field 'arch': expected one of 'sm_80', 'sm_89', 'sm_90a', 'sm_100a', got 'sm_90' "
            "(did you mean 'sm_90a'?)",
        ),
        (
            {"dtype": "bf61"},
            "field 'dtype': expected one of 'bf16', 'fp16', got 'bf61' (did you mean 'bf16'?)",
        ),
        ({"state_dtype": "fp16"}, "field 'state_dtype': expected one of 'fp32', 'bf16', got 'fp16'"),
        (
            {"beta": "sigmoid"},
            "field 'beta': expected one of 'prob', 'logit', 'logit_x2', got 'sigmoid'",
        ),
        ({"beta": "logit_X2"}, "field 'beta': expected one of 'prob', 'logit', 'logit_x2', got 'logit_X2' "
                               "(did you mean 'logit_x2'?)"),
        ({"beta": True}, "field 'beta': expected one of 'prob', 'logit', 'logit_x2', got True"),
        ({"hed_dim_k": 128}, "field 'hed_dim_k': unknown field (did you mean 'head_dim_k'?)"),
        ({"safe_gate": "yes"}, "field 'safe_gate': expected true or false, got 'yes'"),
        (
            {"chunk_size": 64},
            "field 'chunk_size': expected 16 (tokens per recurrence step, the only size built), got 64",
        ),
        ({"chunk_size": 16.0}, "field 'chunk_size': expected an integer, got 16.0"),
        ({"lower_bound": "x"}, "field 'lower_bound': expected a number or null, got 'x'"),
        ({"lower_bound": float("nan")}, "field 'lower_bound': expected a finite number, got nan"),
        (
            {"gate": "softplus"},
            "field 'lower_bound': gate 'softplus' is unbounded below: it needs lower_bound: "
            "null and safe_gate: false",
        ),
        ({"gate": "softplus", "lower_bound": None}, "field 'safe_gate': gate 'softplus' is unbounded below"),
        (
            {"safe_gate": False, "lower_bound": 0.5},
            "field 'lower_bound': gate 'lower_bound' needs a float < 0",
        ),
        (
            {"safe_gate": False, "lower_bound": None},
            "field 'lower_bound': gate 'lower_bound' needs a float < 0",
        ),
        ({"lower_bound": -6.0}, "field 'lower_bound': safe_gate needs lower_bound in [-5, 0)"),
        (
            {"gate": "precomputed", "safe_gate": False},
            "field 'lower_bound': gate 'precomputed' without safe_gate has no use for lower_bound",
        ),
    ],
)
def test_field_errors_name_the_field(fields: dict[str, Any], message: str):
    text = _err(KernelSpec, **{"arch": "sm_90a", **fields})
    assert message in text
    assert text.startswith("KernelSpec: field '")


def test_missing_arch():
    assert _err(KernelSpec) == "KernelSpec: field 'arch': required field is missing"


def test_valid_gate_combinations():
    KernelSpec(arch="sm_90a", gate="softplus", lower_bound=None, safe_gate=False)
    KernelSpec(arch="sm_90a", gate="precomputed", safe_gate=False, lower_bound=None)
    KernelSpec(arch="sm_90a", gate="precomputed", lower_bound=-1.0)  # safe promise with a bound
    KernelSpec(arch="sm_90a", gate="lower_bound", lower_bound=-8.0, safe_gate=False)  # unsafe: any bound < 0


def test_several_problems_are_reported_together():
    with pytest.raises(SpecError) as ei:
        KernelSpec(arch="sm_90a", gva_ratio=3, dtype="fp8")
    assert len(ei.value.problems) == 2
    assert str(ei.value).count("\n") == 1


# -- capabilities and arch records --------------------------------------------------------------------------


def test_arch_records():
    assert set(get_args(KernelSpec.model_fields["arch"].annotation)) == set(arch_mod.ARCHS)
    assert [a.name for a in arch_mod.ARCHS.values() if a.runs_here] == ["sm_90a"]
    assert arch_mod.get_arch("sm_90a").runs == "yes: H100/H200"
    for name, gpu in (("sm_80", "A100"), ("sm_89", "L40S/RTX 4090"), ("sm_100a", "B200")):
        assert arch_mod.get_arch(name).runs == f"no: compiled and inspected here, never run (no {gpu} GPU)"
    assert arch_mod.get_arch("sm_90a").smem_bytes_per_block == 227 * 1024
    assert arch_mod.get_arch("sm_80").smem_bytes_per_block == 163 * 1024
    for a in arch_mod.ARCHS.values():
        assert "mma_sync" in a.families
    assert (
        _err(arch_mod.get_arch, "sm_70")
        == "unknown arch 'sm_70': expected one of sm_80, sm_89, sm_90a, sm_100a"
    )


def test_chunk_size_is_the_built_one_only():
    # Every family steps arch.CHUNK tokens; any other chunk size is refused by the spec itself.
    assert KernelSpec(arch="sm_90a").chunk_size == arch_mod.CHUNK == 16
    for size in (8, 32, 64, 128):
        assert _err(BASE.replace, chunk_size=size) == (
            f"KernelSpec.replace: field 'chunk_size': expected 16 (tokens per recurrence step, "
            f"the only size built), got {size}"
        )
    validate_capabilities(BASE)


def test_capabilities_auto_names_every_family_tried(monkeypatch: pytest.MonkeyPatch):
    families = dict(arch_mod.FAMILIES)
    for name in families:
        families[name] = replace(families[name], head_dims=(128,))
    monkeypatch.setattr(arch_mod, "FAMILIES", families)
    msg = _err(validate_capabilities, BASE.replace(head_dim_k=64), source="specs/sm90.yaml", variant="k64")
    lines = msg.splitlines()
    tried = [line.split("field 'head_dim_k': the ")[1].split(" family")[0] for line in lines]
    assert tried == ["wgmma", "mma_sync"]
    assert all(line.endswith("(family 'auto' on sm_90a tried wgmma, mma_sync)") for line in lines)


def test_capabilities_refuse_family_not_available(monkeypatch: pytest.MonkeyPatch):
    archs = dict(arch_mod.ARCHS)
    archs["sm_89"] = replace(archs["sm_89"], families=())
    monkeypatch.setattr(arch_mod, "ARCHS", archs)
    msg = _err(
        validate_capabilities, KernelSpec(arch="sm_89", family="mma_sync"), source="f.yaml", variant="v"
    )
    assert (
        msg
        == "f.yaml: variant 'v': field 'family': family 'mma_sync' is not available for sm_89 (available: )"
    )


# -- spec files ---------------------------------------------------------------------------------------------

FILE = """\
description: test
defaults:
  arch: sm_90a
  head_dim_k: 128
variants:
  - name: k128
  - name: k128-vk
    state_layout: vk
  - name: "k{head_dim_k}-gva{gva_ratio}-{dtype}"
    dtype: fp16
    matrix:
      head_dim_k: [64, 128]
      gva_ratio: [2, 4]
  - name: sp
    gate: softplus
    lower_bound: null
    safe_gate: false
"""


def test_load_defaults_variants_matrix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    specs = load_spec_file(_spec_file(tmp_path, monkeypatch, FILE))
    assert list(specs) == [
        "k128",
        "k128-vk",
        "k64-gva2-fp16",
        "k64-gva4-fp16",
        "k128-gva2-fp16",
        "k128-gva4-fp16",
        "sp",
    ]
    assert specs["k128"] == BASE
    assert specs["k128-vk"] == BASE.replace(state_layout="vk")
    assert specs["k64-gva4-fp16"] == BASE.replace(head_dim_k=64, gva_ratio=4, dtype="fp16")
    assert specs["sp"].gate == "softplus" and specs["sp"].lower_bound is None


def test_file_error_names_file_variant_field(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    path = _spec_file(
        tmp_path,
        monkeypatch,
        "defaults: {arch: sm_90a}\nvariants:\n  - name: k128\n  - name: k128-gva2\n    gva_ratio: 3\n",
    )
    assert _err(load_spec_file, path) == (
        "specs/sm90.yaml: variant 'k128-gva2': field 'gva_ratio': expected one of 1, 2, 4, 8, got 3"
    )


def test_file_beta_mode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    path = _spec_file(
        tmp_path,
        monkeypatch,
        "defaults: {arch: sm_90a}\nvariants:\n  - name: k128\n  - {name: logit, beta: logit}\n"
        "  - {name: x2, beta: logit_x2, state_layout: vk}\n",
    )
    specs = load_spec_file(path)
    assert [s.beta for s in specs.values()] == ["prob", "logit", "logit_x2"]
    assert specs["x2"] == BASE.replace(beta="logit_x2", state_layout="vk")
    text = "defaults: {arch: sm_90a}\nvariants:\n  - {name: b, beta: sigm}\n"
    bad = _spec_file(tmp_path, monkeypatch, text, name="bad.yaml")
    assert _err(load_spec_file, bad) == (
        "specs/bad.yaml: variant 'b': field 'beta': expected one of 'prob', 'logit', 'logit_x2', got 'sigm'"
    )


def test_file_reports_every_problem(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    path = _spec_file(
        tmp_path,
        monkeypatch,
        "defaults: {arch: sm_90a}\nvariants:\n"
        "  - {name: a, gva_ratio: 3}\n  - {name: b, chunk_size: 64}\n  - {name: a}\n  - {name: ok}\n",
    )
    with pytest.raises(SpecError) as ei:
        load_spec_file(path)
    assert ei.value.problems == [
        "specs/sm90.yaml: variant 'a': field 'gva_ratio': expected one of 1, 2, 4, 8, got 3",
        "specs/sm90.yaml: variant 'b': field 'chunk_size': expected 16 (tokens per recurrence step, "
        "the only size built), got 64",
        "specs/sm90.yaml: variant 'a': duplicate name (first at variant #1)",
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("variants: [", "specs/sm90.yaml: invalid YAML: "),
        ("- a\n- b\n", "specs/sm90.yaml: expected a mapping with 'defaults:' and 'variants:', got a list"),
        ("defaults: {arch: sm_90a}\nvariant: []\n", "specs/sm90.yaml: unknown top-level key 'variant'"),
        ("defaults: {arch: sm_90a}\n", "specs/sm90.yaml: 'variants:' must be a non-empty list, got null"),
        (
            "defaults: {arch: sm_90a, hed: 1}\nvariants: [{name: a}]\n",
            "specs/sm90.yaml: defaults: field 'hed'",
        ),
        (
            "defaults: {arch: sm_90a}\nvariants: [{gva_ratio: 2}]\n",
            "specs/sm90.yaml: variant #1: missing 'name:'",
        ),
        ("defaults: {arch: sm_90a}\nvariants: [k128]\n", "specs/sm90.yaml: variant #1: expected a mapping"),
        ("defaults: {arch: sm_90a}\nvariants: [{name: 'a:b'}]\n", "variant #1: name 'a:b': expected letters"),
        (
            "defaults: {arch: sm_90a}\nvariants: [{name: same, matrix: {gva_ratio: [1, 2]}}]\n",
            "specs/sm90.yaml: variant #1 (matrix): name 'same': must use a matrix field such as "
            "'{gva_ratio}'",
        ),
        (
            "defaults: {arch: sm_90a}\nvariants: [{name: 'g{gva_ratio}', matrix: {gva_ratio: 2}}]\n",
            "specs/sm90.yaml: variant #1 (matrix): field 'gva_ratio': expected a non-empty list of values",
        ),
        (
            "defaults: {arch: sm_90a}\nvariants: [{name: 'g{gva_ratio}{x}', matrix: {gva_ratio: [2]}}]\n",
            "specs/sm90.yaml: variant #1 (matrix): name 'g{gva_ratio}{x}': bad placeholder 'x'",
        ),
        (
            "defaults: {arch: sm_90a}\nvariants: [{name: 'g{gva_ratio}', matrix: {gva_ratio: [3]}}]\n",
            "specs/sm90.yaml: variant 'g3': field 'gva_ratio': expected one of 1, 2, 4, 8, got 3",
        ),
    ],
)
def test_file_structure_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str, message: str):
    assert message in _err(load_spec_file, _spec_file(tmp_path, monkeypatch, text))


def test_missing_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path)
    assert _err(load_spec_file, "specs/nope.yaml") == "specs/nope.yaml: no such spec file"


def test_file_cache_sees_edits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    path = _spec_file(tmp_path, monkeypatch, "defaults: {arch: sm_90a}\nvariants: [{name: a}]\n")
    assert list(load_spec_file(path)) == ["a"]
    Path(path).write_text("defaults: {arch: sm_90a}\nvariants: [{name: a}, {name: bb}]\n")
    assert list(load_spec_file(path)) == ["a", "bb"]


# -- resolve_spec -------------------------------------------------------------------------------------------


def test_resolve_spec_three_forms(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    path = _spec_file(tmp_path, monkeypatch, FILE)
    assert resolve_spec(BASE) == (None, BASE)
    assert resolve_spec({"arch": "sm_90a"}) == (None, BASE)
    assert resolve_spec(f"{path}:k128-vk") == ("k128-vk", BASE.replace(state_layout="vk"))
    assert resolve_spec(Path(tmp_path / "specs" / "sm90.yaml").as_posix() + ":k128") == ("k128", BASE)


def test_resolve_spec_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    path = _spec_file(tmp_path, monkeypatch, FILE)
    assert "no variant 'k12' (did you mean 'k128'? variants: k128, k128-vk," in _err(
        resolve_spec, f"{path}:k12"
    )
    assert "holds 7 variants; name one as 'specs/sm90.yaml:<name>'" in _err(resolve_spec, path)
    assert _err(resolve_spec, {"arch": "sm_90a", "gva_ratio": 5}).startswith("spec dict: field 'gva_ratio'")
    assert "field 'chunk_size'" in _err(resolve_spec, {"arch": "sm_90a", "chunk_size": 32})
    assert "got int" in _err(resolve_spec, 3)


def test_resolve_single_variant_file_and_repo_relative(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    path = _spec_file(
        tmp_path, monkeypatch, "defaults: {arch: sm_80}\nvariants: [{name: only}]\n", "one.yaml"
    )
    assert resolve_spec(path) == ("only", KernelSpec(arch="sm_80"))
    # "specs/sm90.yaml:..." of the checkout is found from any working directory.
    monkeypatch.chdir(tmp_path / "specs")
    name, spec = resolve_spec("specs/sm90.yaml:k128")
    assert (name, spec.arch) == ("k128", "sm_90a")


# -- keys ---------------------------------------------------------------------------------------------------

TOOLCHAIN = {"nvidia-cutlass-dsl": "4.8.1", "apache-tvm-ffi": "0.1.15.post2", "cuda_flavour": "cu13"}
RENDERED = {"prepare.py": "x = 1\n", "recurrence.py": "y = 2\n"}
OPTIONS = "--gpu-arch sm_90a --enable-tvm-ffi"


def _key(spec: KernelSpec, rendered=RENDERED, options=OPTIONS, toolchain=TOOLCHAIN) -> str:
    return keys.cache_key(spec, rendered, options, toolchain=toolchain)[0]


def _alternatives(field: str) -> list[Any]:
    ann = KernelSpec.model_fields[field].annotation
    if field == "chunk_size":
        return [16]
    if field == "lower_bound":
        return [None, -5.0, -2.5, -1.0, -0.5, -8.0]
    if ann is bool:
        return [True, False]
    return list(get_args(ann))


def test_key_is_injective_in_every_field():
    """Changing any one field, to every other value that gives a valid spec, changes key, digest and slug."""
    bases = [
        BASE,
        BASE.replace(gate="softplus", lower_bound=None, safe_gate=False),
        BASE.replace(gate="precomputed", safe_gate=False, lower_bound=None),
    ]
    seen: dict[str, KernelSpec] = {}
    changed_fields: set[str] = set()
    for base in bases:
        k0 = _key(base)
        seen.setdefault(k0, base)
        for field in KernelSpec.model_fields:
            for value in _alternatives(field):
                if value == getattr(base, field):
                    continue
                try:
                    other = base.replace(**{field: value})
                except SpecError:
                    continue  # not valid as a single-field change from this base
                changed_fields.add(field)
                k = _key(other)
                assert k != k0, f"{field}: {getattr(base, field)!r} -> {value!r} kept the key"
                assert other.slug() != base.slug() and other.slug()[-12:] != base.slug()[-12:]
                assert other.digest() != base.digest()
                assert seen.setdefault(k, other) == other, "two different specs share a key"
    single_valued = {f for f in KernelSpec.model_fields if len(_alternatives(f)) == 1}
    assert single_valued == {"chunk_size"}  # extend _alternatives when a field gains a value
    assert changed_fields == set(KernelSpec.model_fields) - single_valued


def test_key_depends_on_sources_options_toolchain():
    k = _key(BASE)
    assert re.fullmatch(r"[0-9a-f]{24}", k)
    assert _key(BASE) == k  # deterministic
    assert _key(BASE, rendered={**RENDERED, "prepare.py": "x = 2\n"}) != k
    assert _key(BASE, rendered={**RENDERED, "extra.py": ""}) != k
    assert _key(BASE, options="--gpu-arch sm_90a") != k
    assert _key(BASE, toolchain={**TOOLCHAIN, "nvidia-cutlass-dsl": "4.9.0"}) != k
    assert _key(BASE, toolchain={**TOOLCHAIN, "cuda_flavour": "cu12"}) != k


def test_key_explain_parts():
    key, parts = keys.cache_key(BASE, RENDERED, OPTIONS, toolchain=TOOLCHAIN)
    assert list(parts) == [
        "spec", "sources", "device_code", "toolchain", "compile_options", "compile_layer", "c_compiler",
    ]
    assert parts["spec"]["value"] == BASE.canonical_json()
    assert parts["spec"]["sha256"] == BASE.digest()
    assert parts["sources"]["value"] == {
        n: hashlib.sha256(t.encode()).hexdigest() for n, t in RENDERED.items()
    }
    assert parts["compile_options"]["sha256"] == hashlib.sha256(OPTIONS.encode()).hexdigest()
    blob = json.dumps({n: p["sha256"] for n, p in parts.items()}, sort_keys=True, separators=(",", ":"))
    assert key == hashlib.sha256(blob.encode()).hexdigest()[:24]


def _site(root: Path, dists: dict[str, tuple[str, str]]) -> Path:
    """A directory of dist-info (or egg-info) directories: {directory name: (Name, Version)} in METADATA."""
    root.mkdir(parents=True, exist_ok=True)
    for dirname, (name, version) in dists.items():
        (root / dirname).mkdir()
        meta = "PKG-INFO" if dirname.endswith(".egg-info") else "METADATA"
        (root / dirname / meta).write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return root


def _fingerprint_on(monkeypatch: pytest.MonkeyPatch, path: list[str]) -> dict[str, str | None]:
    monkeypatch.setattr(keys.sys, "path", path)
    keys.toolchain_fingerprint.cache_clear()
    try:
        return keys.toolchain_fingerprint()
    finally:
        keys.toolchain_fingerprint.cache_clear()


def test_toolchain_fingerprint_selects_flavour(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    first = _site(tmp_path / "a", {
        "nvidia_cutlass_dsl-4.8.1.dist-info": ("nvidia-cutlass-dsl", "4.8.1"),
        "nvidia_cutlass_dsl_libs_base-4.8.1.dist-info": ("nvidia_cutlass_dsl_libs_base", "4.8.1"),
        "nvidia_cutlass_dsl_libs_cu12-4.8.1.dist-info": ("nvidia-cutlass-dsl-libs-cu12", "4.8.1"),
        "nvidia_cutlass_dsl_libs_cu13-4.8.1.dist-info": ("nvidia-cutlass-dsl-libs-cu13", "4.8.1"),
        "apache_tvm_ffi.egg-info": ("apache-tvm-ffi", "0.1.15.post2"),  # a develop install
        "torch-2.13.0.dist-info": ("torch", "2.13.0"),
    })
    shadowed = _site(tmp_path / "b", {"nvidia_cutlass_dsl-9.9.9.dist-info": ("nvidia-cutlass-dsl", "9.9.9")})
    fp = _fingerprint_on(monkeypatch, [str(first), str(tmp_path / "missing"), str(shadowed)])
    assert fp == {
        "apache-tvm-ffi": "0.1.15.post2",
        "cuda_flavour": "cu13",
        "nvidia-cutlass-dsl": "4.8.1",
        "nvidia-cutlass-dsl-libs-base": "4.8.1",
        "nvidia-cutlass-dsl-libs-cu13": "4.8.1",
    }


def test_toolchain_fingerprint_reads_only_relevant_directories(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    # A serving host's site holds hundreds of distributions: only those whose directory name is relevant
    # have their metadata read.
    site = _site(tmp_path, {
        **{f"pkg{i}-1.0.dist-info": (f"pkg{i}", "1.0") for i in range(50)},
        "nvidia_cutlass_dsl-4.8.1.dist-info": ("nvidia-cutlass-dsl", "4.8.1"),
        "apache_tvm_ffi-0.1.15.post2.dist-info": ("apache-tvm-ffi", "0.1.15.post2"),
    })
    read: list[str] = []
    real = keys._info_dist
    monkeypatch.setattr(keys, "_info_dist", lambda path: read.append(Path(path).name) or real(path))
    fp = _fingerprint_on(monkeypatch, [str(site)])
    assert fp == {"apache-tvm-ffi": "0.1.15.post2", "cuda_flavour": None, "nvidia-cutlass-dsl": "4.8.1"}
    assert sorted(read) == ["apache_tvm_ffi-0.1.15.post2.dist-info", "nvidia_cutlass_dsl-4.8.1.dist-info"]


def test_toolchain_fingerprint_reads_a_zip_on_the_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    import zipfile

    archive = tmp_path / "deps.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("apache_tvm_ffi-0.2.0.dist-info/METADATA",
                   "Metadata-Version: 2.1\nName: apache-tvm-ffi\nVersion: 0.2.0\n")
        z.writestr("torch-2.13.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: torch\nVersion: 2.13.0\n")
    fp = _fingerprint_on(monkeypatch, [str(archive)])
    assert fp == {"apache-tvm-ffi": "0.2.0", "cuda_flavour": None}


def test_toolchain_fingerprint_installed():
    fp = keys.toolchain_fingerprint()
    assert fp["nvidia-cutlass-dsl"] == "4.8.1"
    assert fp["apache-tvm-ffi"] is not None
    assert fp["cuda_flavour"] in ("cu12", "cu13")
    assert not any("python" in k.lower() for k in fp)


# -- the spec JSON without pydantic (the bundle lookup) -----------------------------------------------------

REPO = Path(__file__).resolve().parent.parent


def _model_json(fields: dict[str, Any]) -> str:
    """The canonical JSON as the pydantic model gives it: the model's dump, `_IMPLIED` values left out."""
    from kdagen import spec as spec_mod
    from kdagen.spec_model import KernelSpecModel

    dumped = KernelSpecModel(**fields).model_dump(mode="json")
    kept = {k: v for k, v in dumped.items() if spec_mod._IMPLIED.get(k, spec_mod._NOT_IMPLIED) != v}
    return json.dumps(kept, sort_keys=True, separators=(",", ":"))


def _raw_variants(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """Every variant of a spec file as the fields the file gives (defaults, overrides, matrix values), before
    any validation: what a user would pass as a dict."""
    import yaml

    from kdagen import spec as spec_mod

    doc = yaml.safe_load(path.read_text())
    out: list[tuple[str, dict[str, Any]]] = []
    for i, item in enumerate(doc["variants"], 1):
        out += spec_mod._expand(item, doc.get("defaults") or {}, str(path), i)
    return out


SPEC_FILES = sorted((REPO / "specs").glob("*.yaml"))


def test_the_model_declares_the_spec_fields():
    from kdagen.spec import FIELDS
    from kdagen.spec_model import KernelSpecModel

    model = KernelSpecModel.model_fields
    assert list(model) == list(FIELDS)
    for name, field in FIELDS.items():
        assert model[name].annotation == field.annotation, name
        assert model[name].is_required() == field.is_required(), name
        if not field.is_required():
            assert model[name].default == field.default, name


@pytest.mark.parametrize("path", SPEC_FILES, ids=lambda p: p.name)
def test_plain_json_equals_the_model_json_for_every_shipped_variant(path: Path):
    from kdagen.spec import canonical_json_of

    specs = load_spec_file(path)
    raw = _raw_variants(path)
    assert [name for name, _ in raw] == list(specs)
    for name, fields in raw:
        plain = canonical_json_of(fields)
        assert plain is not None, name  # the shipped files use each field's own type
        assert plain == _model_json(fields) == specs[name].canonical_json(), name
        assert canonical_json_of(specs[name].model_dump()) == plain, name


@pytest.mark.parametrize(
    "fields",
    [
        {"arch": "sm_90a"},  # every default left out
        {"arch": "sm_90a", "beta": "prob"},  # an implied value given
        {"arch": "sm_90a", "lower_bound": -5},  # an int bound: the model holds a float
        {"arch": "sm_90a", "lower_bound": -2, "gate": "precomputed"},
        {"arch": "sm_90a", "gate": "softplus", "lower_bound": None, "safe_gate": False, "beta": "logit_x2"},
        {"arch": "sm_80", "family": "mma_sync", "head_dim_k": 64, "head_dim_v": 64, "gva_ratio": 8},
        {"state_layout": "vk", "arch": "sm_100a", "state_dtype": "bf16", "chunk_size": 16, "dtype": "fp16"},
        BASE.model_dump(),  # every field given
    ],
)
def test_plain_json_equals_the_model_json_for_odd_valid_dicts(fields: dict[str, Any]):
    from kdagen.spec import canonical_json_of, plain_values

    assert canonical_json_of(fields) == _model_json(fields) == KernelSpec(**fields).canonical_json()
    assert KernelSpec._trusted(plain_values(fields)) == KernelSpec(**fields)


@pytest.mark.parametrize(
    "fields",
    [
        {"arch": "sm_90a", "head_dim_k": 128.0},
        {"arch": "sm_90a", "head_dim_k": "128"},
        {"arch": "sm_90a", "gva_ratio": True},
        {"arch": "sm_90a", "safe_gate": 1},
        {"arch": "sm_90a", "lower_bound": True},
        {"arch": "sm_90a", "lower_bound": float("nan")},
        {"arch": "sm_90a", "lower_bound": 10**400},
        {"arch": "sm_90a", "lower_bound": "-5"},
        {"arch": "sm_90a", "chunk_size": 16.0},
        {"arch": "sm_90a", "gate": "lowerbound"},
        {"arch": "sm_90a", "heads": 4},
        {"family": "auto"},
        {"arch": "sm_90a", 1: 2},
        [("arch", "sm_90a")],
    ],
)
def test_plain_values_leave_what_needs_the_model_to_it(fields: Any):
    from kdagen.spec import canonical_json_of, plain_values

    assert plain_values(fields) is None and canonical_json_of(fields) is None


def test_plain_values_are_the_model_values_wherever_both_read_a_dict():
    """Random dicts of odd and valid values: where `plain_values` reads one, the model holds the same values
    or refuses it on a rule between fields, never on a value's type."""
    import random

    from pydantic import ValidationError

    from kdagen.spec import FIELDS, plain_values
    from kdagen.spec_model import KernelSpecModel

    pools: dict[str, list[Any]] = {
        "arch": ["sm_80", "sm_90a", "sm_100a", "sm_90", 90],
        "lower_bound": [None, -5, -5.0, -2.5, -1, 0, 0.5, -6.0, True, "x", float("inf")],
        "chunk_size": [16, 32, 16.0, True],
    }
    rng = random.Random(0)
    checked = 0
    for _ in range(5000):
        fields: dict[str, Any] = {}
        for name, info in FIELDS.items():
            if name != "arch" and rng.random() < 0.6:
                continue
            pool = pools.get(name)
            if pool is None:
                choices = list(get_args(info.annotation)) or [True, False]
                pool = choices * 4 + [str(c) for c in choices] + [1, 1.0, None, True]
            fields[name] = rng.choice(pool)
        values = plain_values(fields)
        if values is None:
            continue
        try:
            held = KernelSpecModel(**fields).model_dump()
        except ValidationError as e:
            assert {err["type"] for err in e.errors()} == {"spec_rule"}, (fields, str(e))
            continue
        assert held == values, fields
        assert KernelSpec(**fields).canonical_json() == KernelSpec._trusted(values).canonical_json()
        checked += 1
    assert checked > 100
