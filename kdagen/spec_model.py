"""The pydantic model that validates a `kdagen.spec.KernelSpec`'s fields, and its errors as `SpecError` lines.

Imported when a spec must be validated (`KernelSpec(...)`, `from_dict`, `replace`, spec files), never by
`import kdagen` or a bundle hit: pydantic's import and the model's build are most of an import's time. The
fields, their types and their defaults are `kdagen.spec.FIELDS`; the model declares the same (a test compares
them) and adds the checks.
"""

from __future__ import annotations

import difflib
from typing import Any, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from kdagen import arch as _arch
from kdagen.spec import (
    FIELDS,
    SAFE_LOWER_BOUND_MIN,
    Arch,
    AuxDtype,
    BetaMode,
    Family,
    Gate,
    GvaRatio,
    HeadDim,
    IODtype,
    StateDtype,
    StateLayout,
    _spec_error,
)

__all__ = ["KernelSpecModel", "validate"]

_D = {name: f.default for name, f in FIELDS.items()}


def _rule(field: str, message: str) -> PydanticCustomError:
    # A cross-field rule is reported on the field the user has to change; the formatter reads ctx["field"].
    return PydanticCustomError("spec_rule", "{message}", {"field": field, "message": message})


class KernelSpecModel(BaseModel):
    """The checks of one KDA forward variant's fields: each field's type and the rules between fields."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    arch: Arch
    family: Family = _D["family"]
    head_dim_k: HeadDim = _D["head_dim_k"]
    head_dim_v: HeadDim = _D["head_dim_v"]
    chunk_size: int = _D["chunk_size"]
    gva_ratio: GvaRatio = _D["gva_ratio"]
    gate: Gate = _D["gate"]
    lower_bound: float | None = Field(default=_D["lower_bound"], allow_inf_nan=False)
    safe_gate: bool = _D["safe_gate"]
    l2norm_qk: bool = _D["l2norm_qk"]
    dtype: IODtype = _D["dtype"]
    g_dtype: AuxDtype = _D["g_dtype"]
    beta_dtype: AuxDtype = _D["beta_dtype"]
    beta: BetaMode = _D["beta"]
    state_dtype: StateDtype = _D["state_dtype"]
    state_layout: StateLayout = _D["state_layout"]

    @field_validator("head_dim_k", "head_dim_v", "gva_ratio", mode="before")
    @classmethod
    def _no_bool(cls, v: Any) -> Any:
        # Literal[1, 2, ...] would accept True as 1; a boolean here is always a typo.
        if isinstance(v, bool):
            raise PydanticCustomError("bool_for_int", "expected an integer, got a boolean")
        return v

    @field_validator("chunk_size")
    @classmethod
    def _chunk_size(cls, v: int) -> int:
        # The kernels step CHUNK tokens at a time; no other chunk size is built.
        if v != _arch.CHUNK:
            message = f"expected {_arch.CHUNK} (tokens per recurrence step, the only size built), got {v}"
            raise PydanticCustomError("spec_rule", "{message}", {"message": message})
        return v

    @model_validator(mode="after")
    def _gate_rules(self) -> KernelSpecModel:
        lb = self.lower_bound
        if self.gate == "softplus" and (lb is not None or self.safe_gate):
            # Name both fields at once: the defaults (lower_bound -5, safe_gate true) both need changing.
            field = "lower_bound" if lb is not None else "safe_gate"
            raise _rule(
                field,
                "gate 'softplus' is unbounded below: it needs lower_bound: null and safe_gate: false, "
                f"got lower_bound {lb} and safe_gate {str(self.safe_gate).lower()}",
            )
        if self.gate == "lower_bound" and (lb is None or lb >= 0):
            raise _rule("lower_bound", f"gate 'lower_bound' needs a float < 0, got {lb}")
        if self.safe_gate and (lb is None or not SAFE_LOWER_BOUND_MIN <= lb < 0):
            raise _rule(
                "lower_bound",
                f"safe_gate needs lower_bound in [{SAFE_LOWER_BOUND_MIN:g}, 0) "
                f"(kda-math §2.3: a bound below -5 overflows fp32 on the diagonal tiles), got {lb}",
            )
        if self.gate == "precomputed" and not self.safe_gate and lb is not None:
            raise _rule(
                "lower_bound",
                f"gate 'precomputed' without safe_gate has no use for lower_bound (set it to null), got {lb}",
            )
        return self


def validate(data: dict[str, Any]) -> dict[str, Any]:
    """The checked values of every field (defaults filled in, an int `lower_bound` as a float), in field
    order; a `SpecError` (source ``KernelSpec``) names each problem."""
    try:
        return KernelSpecModel(**data).model_dump()
    except ValidationError as e:
        raise _spec_error(_describe_all(e), source="KernelSpec", variant=None) from None


# -- error formatting -------------------------------------------------------------------------------------


def _choices(field: str) -> list[Any]:
    return list(get_args(FIELDS[field].annotation))


def _fmt_choices(values: list[Any]) -> str:
    return ", ".join(repr(v) for v in values)


def _describe(err: dict[str, Any]) -> tuple[str | None, str]:
    """(field or None, message) of one pydantic error."""
    loc = err.get("loc") or ()
    field = str(loc[0]) if loc else None
    ctx = err.get("ctx") or {}
    kind = err["type"]
    value = err.get("input")
    if kind == "spec_rule":
        return ctx.get("field", field), ctx["message"]
    if kind in ("literal_error", "bool_for_int") and field in FIELDS:
        choices = _choices(field)
        msg = f"expected one of {_fmt_choices(choices)}, got {value!r}"
        if isinstance(value, str):
            close = difflib.get_close_matches(value, [str(c) for c in choices], n=1)
            if close:
                msg += f" (did you mean {close[0]!r}?)"
        return field, msg
    if kind == "extra_forbidden":
        close = difflib.get_close_matches(field or "", list(FIELDS), n=1)
        hint = f"did you mean {close[0]!r}?" if close else "known fields: " + ", ".join(FIELDS)
        return field, f"unknown field ({hint})"
    if kind == "missing":
        return field, "required field is missing"
    if kind == "bool_type":
        return field, f"expected true or false, got {value!r}"
    if kind in ("int_type", "int_parsing", "int_from_float"):
        return field, f"expected an integer, got {value!r}"
    if kind in ("float_type", "float_parsing"):
        nullable = field == "lower_bound"
        return field, f"expected a number{' or null' if nullable else ''}, got {value!r}"
    if kind == "finite_number":
        return field, f"expected a finite number, got {value!r}"
    return field, f"{err['msg']}, got {value!r}"


def _describe_all(e: ValidationError) -> list[tuple[str | None, str]]:
    return [_describe(err) for err in e.errors(include_url=False)]
