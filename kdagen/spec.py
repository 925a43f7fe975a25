"""The KDA forward spec: its fields, spec files, validation with readable messages, canonical JSON, digest
and slug.

No cutlass and no torch here: a spec is plain data that can be loaded, checked, hashed and pickled anywhere.
`KernelSpec` is a plain frozen class; its fields are checked by a pydantic model (`kdagen.spec_model`) that is
imported when a spec is validated, and spec files are read with PyYAML, imported when a file is read. A spec
found in a bundle needs neither (`plain_values`, `trusted_spec`).

Two levels of checks:

- `KernelSpec` itself checks each field and the rules between fields (gate / lower_bound / safe_gate). A spec
  that passes is meaningful, so it can be hashed and compared.
- `validate_capabilities` checks it against the target's record in `kdagen.arch` (is the family available for
  the arch, does it support these head dims). `load_spec_file` and `resolve_spec` run both, so what a user
  loads can be built.

Every message names where the value came from, the variant and the field, one problem per line:
``specs/sm90.yaml: variant 'k128-gva2': field 'gva_ratio': expected one of 1, 2, 4, 8, got 3``.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import json
import math
import os
import re
import string
from dataclasses import dataclass
from itertools import product
from pathlib import Path
from typing import Any, ClassVar, Literal, get_args

from kdagen import arch as _arch
from kdagen import paths
from kdagen.dtypes import DTYPES
from kdagen.errors import SpecError

__all__ = [
    "KernelSpec",
    "load_spec_file",
    "resolve_spec",
    "validate_capabilities",
    "parse_spec_ref",
    "FIELDS",
    "SpecField",
    "plain_values",
    "canonical_json_of",
    "trusted_spec",
    "SAFE_LOWER_BOUND_MIN",
]

Arch = Literal["sm_80", "sm_89", "sm_90a", "sm_100a"]
Family = Literal["auto", "mma_sync", "wgmma"]
HeadDim = Literal[64, 128]
GvaRatio = Literal[1, 2, 4, 8]
Gate = Literal["precomputed", "softplus", "lower_bound"]
IODtype = Literal["bf16", "fp16"]
AuxDtype = Literal["fp32", "bf16"]
BetaMode = Literal["prob", "logit", "logit_x2"]
StateDtype = Literal["fp32", "bf16"]
StateLayout = Literal["kv", "vk"]

# kda-math §2.3: with a first-row anchor over a 16-token tile the diagonal factor reaches 2^(15*|lb|*log2 e);
# lb = -5 gives 2^108, still below the fp32 exponent limit 2^127; lb ~ -5.9 would overflow.
SAFE_LOWER_BOUND_MIN = -5.0

# Options left out of the canonical JSON at these values (`KernelSpec.canonical_json`).
_IMPLIED: dict[str, Any] = {"beta": "prob"}
_NOT_IMPLIED = object()
_REQUIRED = object()  # the default of a field that has none

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")
_TOP_KEYS = ("description", "defaults", "variants")


@dataclass(frozen=True)
class SpecField:
    """One field of `KernelSpec`: its type (for a ``Literal``, the values it takes) and its default."""

    annotation: Any
    default: Any = _REQUIRED

    def is_required(self) -> bool:
        return self.default is _REQUIRED


# The fields of a spec, in order. `kdagen.spec_model.KernelSpecModel` declares the same and checks them.
FIELDS: dict[str, SpecField] = {
    "arch": SpecField(Arch),
    "family": SpecField(Family, "auto"),
    "head_dim_k": SpecField(HeadDim, 128),
    "head_dim_v": SpecField(HeadDim, 128),
    "chunk_size": SpecField(int, 16),
    "gva_ratio": SpecField(GvaRatio, 1),
    "gate": SpecField(Gate, "lower_bound"),
    "lower_bound": SpecField(float | None, -5.0),
    "safe_gate": SpecField(bool, True),
    "l2norm_qk": SpecField(bool, True),
    "dtype": SpecField(IODtype, "bf16"),
    "g_dtype": SpecField(AuxDtype, "fp32"),
    "beta_dtype": SpecField(AuxDtype, "fp32"),
    "beta": SpecField(BetaMode, "prob"),  # beta as given, sigmoid(beta) or 2 sigmoid(beta) (kda-math §1.1)
    "state_dtype": SpecField(StateDtype, "fp32"),
    "state_layout": SpecField(StateLayout, "kv"),
}


class KernelSpec:
    """One KDA forward variant. Frozen, hashable, picklable; unknown fields are errors.

    Constructing one validates its fields with the pydantic model of `kdagen.spec_model` (imported then), and
    a bad value raises `SpecError` (not pydantic's `ValidationError`) whose message names the field, e.g.
    ``KernelSpec: field 'gva_ratio': expected one of 1, 2, 4, 8, got 3``. The instance itself is plain
    Python: a spec found in a bundle (`_trusted`) needs no pydantic.
    """

    __slots__ = (*FIELDS, "_json")
    model_fields: ClassVar[dict[str, SpecField]] = FIELDS

    arch: Arch
    family: Family
    head_dim_k: HeadDim
    head_dim_v: HeadDim
    chunk_size: int
    gva_ratio: GvaRatio
    gate: Gate
    lower_bound: float | None
    safe_gate: bool
    l2norm_qk: bool
    dtype: IODtype
    g_dtype: AuxDtype
    beta_dtype: AuxDtype
    beta: BetaMode
    state_dtype: StateDtype
    state_layout: StateLayout

    def __init__(self, **data: Any) -> None:
        from kdagen.spec_model import validate  # pydantic: only when a spec is validated

        self._fill(validate(data))

    @classmethod
    def _trusted(cls, values: dict[str, Any]) -> KernelSpec:
        """A spec of values that passed validation already (every field, as the model holds them), e.g.
        those of a spec a bundle was built from; nothing is checked."""
        spec = object.__new__(cls)
        spec._fill(values)
        return spec

    def _fill(self, values: dict[str, Any]) -> None:
        for name in FIELDS:
            object.__setattr__(self, name, values[name])
        object.__setattr__(self, "_json", None)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"KernelSpec is frozen: cannot set {name!r} (use replace)")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"KernelSpec is frozen: cannot delete {name!r}")

    def _values(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in FIELDS)

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self._values() == other._values()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash(self._values())

    def __repr__(self) -> str:
        return "KernelSpec(" + ", ".join(f"{name}={getattr(self, name)!r}" for name in FIELDS) + ")"

    def __reduce__(self) -> tuple[Any, ...]:
        return (_unpickle, (self.model_dump(),))

    def __copy__(self) -> KernelSpec:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> KernelSpec:
        return self

    def model_dump(self, mode: str = "python") -> dict[str, Any]:
        """{field: value} in field order (every value is JSON already, so `mode` changes nothing)."""
        return {name: getattr(self, name) for name in FIELDS}

    @classmethod
    def from_dict(
        cls, data: dict[str, Any], *, source: str | None = None, variant: str | None = None
    ) -> KernelSpec:
        """Validate a mapping of fields; a `SpecError` names `source` (e.g. the file) and `variant`."""
        if not isinstance(data, dict):
            raise SpecError(_prefix(source, variant) + f"expected a mapping of fields, got {_kind(data)}")
        bad = [k for k in data if not isinstance(k, str)]
        if bad:
            items: list[tuple[str | None, str]] = [(str(k), "unknown field") for k in bad]
            raise _spec_error(items, source=source, variant=variant)
        try:
            return cls(**data)
        except SpecError as e:
            # Re-issue __init__'s problems under the caller's file and variant.
            raise _spec_error(e.items, source=source, variant=variant) from None

    def replace(self, **changes: Any) -> KernelSpec:
        """A copy with some fields changed, validated again."""
        return type(self).from_dict({**self.model_dump(), **changes}, source="KernelSpec.replace")

    # -- identity -----------------------------------------------------------------------------------------

    def canonical_json(self) -> str:
        """Every field, sorted keys, no whitespace: the identity of the variant. A field of `_IMPLIED` at its
        value there is left out: such an option's default is the kernel without it, so the variants that do
        not use it keep their digest, slug and generated path. Computed once per instance."""
        if self._json is None:
            object.__setattr__(self, "_json", _canonical(self.model_dump()))
        return self._json

    def digest(self) -> str:
        """sha256 hex of `canonical_json`."""
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()

    def slug(self) -> str:
        """Readable directory name ending in 12 hex of the digest, e.g.
        ``kda_fwd-sm90a-k128v128-c16-gva1-gate_lb5-safe-l2-bf16-g32-b32-kv-3f9c1e2b7d0a``.

        The readable part is a summary for people (it omits defaults such as ``family: auto``); the hash
        is what makes it unique.
        """
        parts = ["kda_fwd", self.arch.replace("_", "")]
        if self.family != "auto":
            parts.append(self.family)
        parts += [f"k{self.head_dim_k}v{self.head_dim_v}", f"c{self.chunk_size}", f"gva{self.gva_ratio}"]
        gate = {"lower_bound": "gate_lb", "softplus": "gate_sp", "precomputed": "gate_pre"}[self.gate]
        if self.lower_bound is not None:
            gate += ("" if self.gate == "lower_bound" else "_lb") + _num(self.lower_bound)
        parts.append(gate)
        if self.safe_gate:
            parts.append("safe")
        if self.l2norm_qk:
            parts.append("l2")
        parts += [self.dtype, "g" + _short(self.g_dtype), "b" + _short(self.beta_dtype)]
        if self.beta != "prob":
            parts.append("beta_" + self.beta)
        if self.state_dtype != "fp32":
            parts.append("s" + _short(self.state_dtype))
        parts += [self.state_layout, self.digest()[:12]]
        return "-".join(parts)

    @property
    def arch_info(self) -> _arch.ArchInfo:
        return _arch.get_arch(self.arch)



def _unpickle(values: dict[str, Any]) -> KernelSpec:
    return KernelSpec._trusted(values)


def _canonical(values: dict[str, Any]) -> str:
    """The canonical JSON of a spec's field values (`KernelSpec.canonical_json`, `canonical_json_of`)."""
    data = {k: v for k, v in values.items() if _IMPLIED.get(k, _NOT_IMPLIED) != v}
    return json.dumps(data, sort_keys=True, separators=(",", ":"))


def _exact(field: str, value: Any) -> Any:
    """`value` as the model holds it when the model takes it unchanged (or, for `lower_bound`, an int as a
    float), else `_NOT_IMPLIED`: a value of the field's own type, never one it could coerce."""
    ann = FIELDS[field].annotation
    if field == "lower_bound":
        if value is None:
            return None
        if type(value) in (int, float):
            try:
                x = float(value)
            except OverflowError:
                return _NOT_IMPLIED
            return x if math.isfinite(x) else _NOT_IMPLIED
        return _NOT_IMPLIED
    if ann in (int, bool):
        return value if type(value) is ann else _NOT_IMPLIED
    for choice in get_args(ann):
        if type(value) is type(choice) and value == choice:
            return value
    return _NOT_IMPLIED


def plain_values(data: Any) -> dict[str, Any] | None:
    """The field values a spec of the fields `data` holds (defaults filled in), read without pydantic, or
    None where that needs the model: not a dict, an unknown or missing field, or a value of another type
    than the field's own (``"128"``, ``True`` for an int, ``128.0``).

    Where it gives values, they are what `KernelSpec(**data)` holds, should `data` be valid; it checks no
    rule between fields and no capability, so the values are a lookup key (a bundle's spec JSON, which
    only a valid spec has), not a checked spec.
    """
    if not isinstance(data, dict) or "arch" not in data or any(name not in FIELDS for name in data):
        return None
    out: dict[str, Any] = {}
    for name, info in FIELDS.items():
        if name in data:
            value = _exact(name, data[name])
            if value is _NOT_IMPLIED:
                return None
            out[name] = value
        else:
            out[name] = info.default
    return out


def canonical_json_of(data: Any) -> str | None:
    """`KernelSpec(**data).canonical_json()` computed without pydantic where `plain_values` can read `data`
    (None otherwise); for a valid `data` the two are equal."""
    values = plain_values(data)
    return None if values is None else _canonical(values)


def trusted_spec(spec_json: str) -> KernelSpec | None:
    """The spec whose canonical JSON is `spec_json`, made without validation: for the JSON of a spec that
    passed it (a bundle's, written by the build). None where `spec_json` is no spec's canonical JSON."""
    try:
        data = json.loads(spec_json)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    values = plain_values({**{k: v for k, v in _IMPLIED.items() if k not in data}, **data})
    if values is None or _canonical(values) != spec_json:
        return None
    return KernelSpec._trusted(values)


def _num(x: float) -> str:
    # -5.0 -> "5", -2.5 -> "2p5": path-friendly, sign implied (bounds are negative).
    return f"{abs(x):g}".replace(".", "p").replace("-", "m")


def _short(dtype: str) -> str:
    return DTYPES[dtype].slug


# -- error formatting -------------------------------------------------------------------------------------


def _prefix(source: str | None, variant: str | None) -> str:
    out = f"{source}: " if source else ""
    if variant is not None:
        out += f"variant {variant!r}: "
    return out


def _kind(x: Any) -> str:
    return {dict: "a mapping", list: "a list", str: "a string", type(None): "null"}.get(
        type(x), type(x).__name__
    )


def _spec_error(items: list[tuple[str | None, str]], *, source: str | None, variant: str | None) -> SpecError:
    lines = [_prefix(source, variant) + (f"field {f!r}: " if f else "") + msg for f, msg in items]
    err = SpecError("\n".join(lines), lines)
    err.items = items  # (field, message) pairs, so that from_dict can re-prefix them
    return err


# -- capabilities -----------------------------------------------------------------------------------------


def validate_capabilities(spec: KernelSpec, *, source: str | None = None, variant: str | None = None) -> None:
    """Refuse what the target or the template family cannot do; `SpecError` names the field to change."""
    info = _arch.get_arch(spec.arch)
    pre = _prefix(source, variant)
    if spec.family != "auto" and spec.family not in info.families:
        raise SpecError(
            pre + f"field 'family': family {spec.family!r} is not available for {spec.arch} "
            f"(available: {', '.join(info.families)})"
        )
    candidates = info.families if spec.family == "auto" else (spec.family,)
    problems: list[str] = []
    for name in candidates:
        fam = _arch.get_family(name)
        if spec.head_dim_k not in fam.head_dims or spec.head_dim_v not in fam.head_dims:
            problems.append(
                f"field 'head_dim_k': the {name} family supports head dims "
                f"{', '.join(map(str, fam.head_dims))}, got k={spec.head_dim_k} v={spec.head_dim_v}"
            )
        else:
            return  # at least one family can build it
    suffix = "" if spec.family != "auto" else f" (family 'auto' on {spec.arch} tried {', '.join(candidates)})"
    lines = [pre + p + suffix for p in problems]
    raise SpecError("\n".join(lines), lines)


# -- spec files -------------------------------------------------------------------------------------------

_FILE_CACHE: dict[tuple[str, int, int], dict[str, KernelSpec]] = {}


def load_spec_file(path: str | os.PathLike[str]) -> dict[str, KernelSpec]:
    """Load a spec file: ``defaults:`` plus a list of ``variants:``, in file order.

    A variant is a mapping with ``name:`` and field overrides, or a ``matrix:`` mapping of field -> list of
    values that expands to the cross product (later fields vary fastest), its ``name:`` a format string over
    the fields, e.g. ``"k{head_dim_k}-gva{gva_ratio}"``: plain field names only (no ``{f.attr}`` or
    ``{f[i]}``), filled from every field's value, defaults included. A key given twice in one mapping is an
    error. Every variant is validated, capabilities included; all problems of the file are reported together
    in one `SpecError`.
    """
    shown = str(path)
    p = paths.find_spec_file(path)
    try:
        st = p.stat()
    except OSError:
        raise SpecError(f"{shown}: no such spec file") from None
    ck = (str(p.resolve()), st.st_mtime_ns, st.st_size)
    if ck not in _FILE_CACHE:
        _FILE_CACHE[ck] = _load(p, shown)
    return dict(_FILE_CACHE[ck])


@functools.cache
def _yaml_loader() -> tuple[type, type]:
    """(loader, duplicate-key error): `yaml.SafeLoader` that refuses a mapping key given twice, naming the
    key and both lines (the plain SafeLoader keeps the last one silently). Built at the first spec file:
    PyYAML is imported when a file is read, not with the package.

    Keys brought in by a merge (``<<: *anchor``) may be overridden by the mapping's own keys, as YAML says.
    """
    import yaml

    class DuplicateKeyError(yaml.YAMLError):
        def __init__(self, key: Any, line: int, first: int) -> None:
            super().__init__(f"line {line}: duplicate key {key!r} (first at line {first})")

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node: yaml.Node, deep: bool = False) -> dict[Any, Any]:
            if isinstance(node, yaml.MappingNode):
                seen: dict[Any, int] = {}
                for key_node, _ in node.value:
                    if key_node.tag == "tag:yaml.org,2002:merge":
                        continue
                    key = self.construct_object(key_node, deep=True)
                    line = key_node.start_mark.line + 1
                    try:
                        first = seen.get(key)
                    except TypeError:
                        continue  # an unhashable key: the base class reports it
                    if first is not None:
                        raise DuplicateKeyError(key, line, first)
                    seen[key] = line
            return super().construct_mapping(node, deep=deep)

    return UniqueKeyLoader, DuplicateKeyError


def _read_text(p: Path, shown: str) -> str:
    """The file's text; a directory, an unreadable file or bytes that are not UTF-8 are `SpecError`s."""
    if p.is_dir():
        raise SpecError(f"{shown}: is a directory, expected a YAML spec file")
    try:
        data = p.read_bytes()
    except OSError as e:
        raise SpecError(f"{shown}: cannot read the spec file: {e.strerror or e}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SpecError(
            f"{shown}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); "
            "save the spec file as UTF-8"
        ) from None


def _load(p: Path, shown: str) -> dict[str, KernelSpec]:
    import yaml

    text = _read_text(p, shown)
    loader, duplicate_key = _yaml_loader()
    try:
        doc = yaml.load(text, Loader=loader)  # noqa: S506 (a SafeLoader subclass)
    except duplicate_key as e:
        raise SpecError(f"{shown}: {e}") from None
    except yaml.YAMLError as e:
        raise SpecError(f"{shown}: invalid YAML: {e}") from None
    if not isinstance(doc, dict):
        raise SpecError(f"{shown}: expected a mapping with 'defaults:' and 'variants:', got {_kind(doc)}")
    unknown = [k for k in doc if k not in _TOP_KEYS]
    if unknown:
        raise SpecError(f"{shown}: unknown top-level key {unknown[0]!r} (expected {', '.join(_TOP_KEYS)})")
    defaults = doc.get("defaults") or {}
    if not isinstance(defaults, dict):
        raise SpecError(f"{shown}: defaults: expected a mapping of fields, got {_kind(defaults)}")
    problems = [
        f"{shown}: defaults: field {k!r}: unknown field" + _did_you_mean(k)
        for k in defaults
        if k not in KernelSpec.model_fields
    ]
    if problems:
        raise SpecError("\n".join(problems), problems)
    items = doc.get("variants")
    if not isinstance(items, list) or not items:
        raise SpecError(f"{shown}: 'variants:' must be a non-empty list, got {_kind(items)}")

    out: dict[str, KernelSpec] = {}
    where: dict[str, str] = {}
    for i, item in enumerate(items, 1):
        try:
            expanded = _expand(item, defaults, shown, i)
        except SpecError as e:
            problems += e.problems
            continue
        for name, fields in expanded:
            if name in out or name in where:
                problems.append(f"{shown}: variant {name!r}: duplicate name (first at {where[name]})")
                continue
            where[name] = f"variant #{i}"
            try:
                spec = KernelSpec.from_dict(fields, source=shown, variant=name)
                validate_capabilities(spec, source=shown, variant=name)
            except SpecError as e:
                problems += e.problems
                continue
            out[name] = spec
    if problems:
        raise SpecError("\n".join(problems), problems)
    return out


def _did_you_mean(key: str) -> str:
    close = difflib.get_close_matches(key, list(KernelSpec.model_fields), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _check_name(name: Any, shown: str, i: int) -> str:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise SpecError(
            f"{shown}: variant #{i}: name {name!r}: expected letters, digits and '_.+-' (no ':' or spaces)"
        )
    return name


def _expand(item: Any, defaults: dict[str, Any], shown: str, i: int) -> list[tuple[str, dict[str, Any]]]:
    if not isinstance(item, dict):
        raise SpecError(
            f"{shown}: variant #{i}: expected a mapping with 'name:' and fields, got {_kind(item)}"
        )
    if "name" not in item:
        raise SpecError(f"{shown}: variant #{i}: missing 'name:'")
    fixed = {k: v for k, v in item.items() if k not in ("name", "matrix")}
    if "matrix" not in item:
        name = _check_name(item["name"], shown, i)
        return [(name, {**defaults, **fixed})]

    matrix = item["matrix"]
    if not isinstance(matrix, dict) or not matrix:
        raise SpecError(f"{shown}: variant #{i} (matrix): expected a mapping of field -> list of values")
    for field, values in matrix.items():
        if field not in KernelSpec.model_fields:
            raise SpecError(
                f"{shown}: variant #{i} (matrix): field {field!r}: unknown field" + _did_you_mean(field)
            )
        if not isinstance(values, list) or not values:
            raise SpecError(
                f"{shown}: variant #{i} (matrix): field {field!r}: expected a non-empty list of values, "
                f"got {_kind(values)}"
            )
    fmt = item["name"]
    if not isinstance(fmt, str):
        raise SpecError(f"{shown}: variant #{i} (matrix): name: expected a format string, got {_kind(fmt)}")
    placeholders = _name_fields(fmt, shown, i)
    if not placeholders & set(matrix):
        raise SpecError(
            f"{shown}: variant #{i} (matrix): name {fmt!r}: must use a matrix field such as "
            f"'{{{next(iter(matrix))}}}' so that every expanded variant gets its own name"
        )
    out = []
    for combo in product(*matrix.values()):
        fields = {**defaults, **fixed, **dict(zip(matrix, combo))}
        # Every field's value, the model's defaults included, so a name may show a field the file leaves out.
        values = {f: info.default for f, info in KernelSpec.model_fields.items() if not info.is_required()}
        try:
            name = fmt.format_map({**values, **fields})
        except (KeyError, IndexError, ValueError, TypeError) as e:
            raise SpecError(f"{shown}: variant #{i} (matrix): name {fmt!r}: bad placeholder {e}") from None
        out.append((_check_name(name, shown, i), fields))
    return out


def _name_fields(fmt: str, shown: str, i: int) -> set[str]:
    """The field names a matrix name template uses; each placeholder must be a plain field name."""
    where = f"{shown}: variant #{i} (matrix): name {fmt!r}"
    try:
        parsed = list(string.Formatter().parse(fmt))
    except ValueError as e:
        raise SpecError(f"{where}: {e}") from None
    names: set[str] = set()
    for _, field, _, _ in parsed:
        if field is None:
            continue
        if not field.isidentifier():
            shown_field = "{}" if field == "" else field
            raise SpecError(
                f"{where}: placeholder {shown_field!r}: expected a plain field name such as '{{gva_ratio}}' "
                "(attribute and index forms are not supported)"
            )
        if field not in KernelSpec.model_fields:
            raise SpecError(f"{where}: bad placeholder {field!r} (not a spec field){_did_you_mean(field)}")
        names.add(field)
    return names


# -- resolving what users pass ----------------------------------------------------------------------------


def parse_spec_ref(ref: str) -> tuple[str, str | None]:
    """Split ``"path.yaml:name"`` into (path, name); a bare path gives (path, None)."""
    path, sep, name = ref.rpartition(":")
    if sep and path.endswith((".yaml", ".yml")) and name:
        return path, name
    return ref, None


def resolve_spec(obj: KernelSpec | dict[str, Any] | str | os.PathLike[str]) -> tuple[str | None, KernelSpec]:
    """Turn what a user passes into (variant name or None, checked `KernelSpec`).

    Accepts a `KernelSpec`, a dict of fields, or ``"path.yaml:name"`` (a bare path is accepted when the file
    holds exactly one variant). Capabilities are always checked.
    """
    if isinstance(obj, KernelSpec):
        validate_capabilities(obj, source="KernelSpec")
        return None, obj
    if isinstance(obj, dict):
        spec = KernelSpec.from_dict(obj, source="spec dict")
        validate_capabilities(spec, source="spec dict")
        return None, spec
    if isinstance(obj, (str, os.PathLike)):
        path, name = parse_spec_ref(os.fspath(obj))
        variants = load_spec_file(path)  # already capability-checked
        if name is None:
            if len(variants) == 1:
                return next(iter(variants.items()))
            raise SpecError(
                f"{path}: holds {len(variants)} variants; name one as '{path}:<name>' "
                f"(variants: {', '.join(variants)})"
            )
        if name not in variants:
            close = difflib.get_close_matches(name, list(variants), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise SpecError(f"{path}: no variant {name!r} ({hint}variants: {', '.join(variants)})")
        return name, variants[name]
    raise SpecError(f"expected a KernelSpec, a dict of fields or 'path.yaml:name', got {type(obj).__name__}")
