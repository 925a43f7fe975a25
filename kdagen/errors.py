"""The exceptions kdagen raises on purpose.

Everything derives from `KdagenError`, so a caller can catch the whole family. The two that describe bad
input also derive from `ValueError`, so code that already catches `ValueError` keeps working.
"""

from __future__ import annotations

__all__ = [
    "KdagenError",
    "SpecError",
    "InputError",
    "CacheMissError",
    "CacheError",
    "BuildError",
    "LoadError",
]


class KdagenError(Exception):
    """Base class of every error kdagen raises on purpose."""


class SpecError(KdagenError, ValueError):
    """A spec or spec file is invalid, or asks for something the target cannot do.

    The message names the file, the variant and the field, one problem per line, e.g.
    ``specs/sm90.yaml: variant 'k128-gva2': field 'gva_ratio': expected one of 1, 2, 4, 8, got 3``.
    `problems` holds the same lines as a list, for callers that want to show them one by one.
    """

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.problems: list[str] = list(problems) if problems else [message]
        self.items: list[tuple[str | None, str]] = []  # (field, message) pairs, when known


class InputError(KdagenError, ValueError):
    """A runtime argument is invalid; the message names the argument and what was expected."""


class CacheMissError(KdagenError):
    """`KDAGEN_DISABLE_JIT=1` is set and the artifact is not in the cache; the message names the spec."""


class CacheError(KdagenError):
    """The artifact store cannot be written where it must be; the message names the path and the remedy."""


class BuildError(KdagenError):
    """Compiling a stage failed."""


class LoadError(BuildError):
    """A cached stage whose digests checked out could not be loaded, even after one rebuild; the message
    names the cache entry."""
