"""The spec's dtype names, and what each one is wherever kdagen needs it: one table."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DType", "DTYPES", "nbytes"]


@dataclass(frozen=True)
class DType:
    nbytes: int  # bytes an element
    dsl: str  # the CuTe DSL numeric type the templates use (cutlass.<dsl>)
    torch: str  # the torch dtype's attribute name (torch.<torch>)
    slug: str  # the tag in spec slugs


DTYPES: dict[str, DType] = {
    "bf16": DType(nbytes=2, dsl="BFloat16", torch="bfloat16", slug="bf16"),
    "fp16": DType(nbytes=2, dsl="Float16", torch="float16", slug="16"),
    "fp32": DType(nbytes=4, dsl="Float32", torch="float32", slug="32"),
}


def nbytes(name: str) -> int:
    """Bytes an element of the spec dtype `name`."""
    return DTYPES[name].nbytes
