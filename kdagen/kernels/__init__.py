"""Device code shared by the rendered stages: `@cute.jit` building blocks with explicit parameters.

A rendered stage in ``generated/`` holds what is specific to its variant (constants, signature, kernel body)
and imports what it shares from here (``from kdagen.kernels import common``). Nothing in this package reads
names of the module that imports it: every variant-specific value arrives as an argument (a
`cutlass.Constexpr` where it shapes the code).

Importing the package is cheap: the submodules import cutlass, and only a stage file imports them.
`device_digest` hashes their sources, because a stage's machine code depends on them as much as on its own
text: the binary cache key carries it (`kdagen.keys`).
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

from kdagen.files import tree_digest

__all__ = ["device_digest"]

_ROOT = Path(__file__).resolve().parent


@functools.cache
def device_digest() -> str:
    """sha256 over the relative path and bytes of every ``*.py`` of this package (sorted; cached per
    process)."""
    h = hashlib.sha256()
    tree_digest(h, _ROOT, "*.py")
    return h.hexdigest()
