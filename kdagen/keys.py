"""The binary cache key: what is hashed, and how it is explained.

key = sha256 over the sha256 of seven parts (design.md "Keys"), cut to 24 hex:

- ``spec``: the canonical spec JSON;
- ``sources``: the sha256 of every rendered stage file (so a template edit is a new key);
- ``device_code``: the digest of `kdagen.kernels`, the shared device code the rendered stages import;
- ``toolchain``: the CuTe DSL distributions, apache-tvm-ffi, and the libs flavour (cu12/cu13);
- ``compile_options``: the options string given to ``cute.compile``;
- ``compile_layer``: the sha256 of ``kdagen/compile.py``, which fixes what the options string does not
  (fake tensor strides and alignment, the export name, the link step);
- ``c_compiler``: the C compiler that links the ``.so`` (path and ``--version`` line, or ``none``).

Not the Python version: a TVM-FFI ``.o`` is a C-ABI object, and building on a CPU box for a GPU fleet is a
use this project exists for. Nothing here imports cutlass: versions come from package metadata.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import json
import os
import re
import sys
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any

from kdagen import compile as _compile  # no cutlass import: compile imports it lazily
from kdagen.kernels import device_digest as _device_digest
from kdagen.spec import KernelSpec

__all__ = [
    "KEY_HEX",
    "toolchain_fingerprint",
    "cache_key",
    "key_from_digests",
    "source_digests",
    "sha256_text",
]

KEY_HEX = 24
_DSL = "nvidia-cutlass-dsl"
_FLAVOUR_RE = re.compile(r"^nvidia-cutlass-dsl-libs-cu(\d+)$")


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _canon(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _relevant(name: str) -> bool:
    """Whether a (normalised) distribution name belongs in the toolchain fingerprint."""
    return name.startswith(_DSL) or name == "apache-tvm-ffi"


_INFO_SUFFIXES = (".dist-info", ".egg-info")


def _info_dist(path: str) -> tuple[str, str] | None:
    """(normalised name, version) from one dist-info or egg-info directory's metadata, read once."""
    meta = md.PathDistribution(Path(path)).metadata
    name = meta["Name"] if meta is not None else None
    return (_normalize(name), meta["Version"]) if name else None


def _relevant_dists() -> Iterator[tuple[str, str]]:
    """(normalised name, version) of every installed distribution whose name may be relevant, in
    ``sys.path`` order (the first of a name is the one imported), others possibly among them.

    A directory on ``sys.path`` is listed and only the entries whose directory name is relevant are read:
    ``md.distributions()`` builds, names and (where the directory name is not enough) parses every
    distribution of a site, ~300 on a serving host, and that scan was a first ``get_kernel``'s largest part
    after the import of tvm_ffi. An entry that is not a directory (a zip) goes through importlib.metadata."""
    for entry in sys.path:
        root = entry or "."
        try:
            names = sorted(os.listdir(root))
        except OSError:
            if os.path.isfile(root):
                for dist in md.distributions(path=[root]):
                    name = dist.metadata["Name"]
                    if name:
                        yield _normalize(name), dist.version
            continue
        for fn in names:
            suffix = next((x for x in _INFO_SUFFIXES if fn.endswith(x)), None)
            if suffix is None or not _relevant(_normalize(fn[: -len(suffix)].split("-", 1)[0])):
                continue
            found = _info_dist(os.path.join(root, fn))
            if found is not None:
                yield found


@lru_cache(maxsize=1)
def toolchain_fingerprint() -> dict[str, str | None]:
    """The compiler stack that shapes an artifact, read from package metadata (cutlass is not imported).

    Returns a flat, sorted mapping: each relevant ``nvidia-cutlass-dsl*`` distribution -> version,
    ``apache-tvm-ffi`` -> version (None if absent), and ``cuda_flavour`` -> ``"cuNN"`` (None if absent).

    The flavour is the newest installed ``nvidia-cutlass-dsl-libs-cuNN``: what the DSL loads without a driver,
    and with a CUDA 13 driver when cu13 is installed (cutedsl.md §6). Flavours that are installed but not
    selected are left out: ``nvidia-cutlass-dsl`` always pulls ``-libs-cu12`` even when cu13 is the one in
    use, and an unused library must not split the key between a build box and a GPU host. Cached per
    process; call ``toolchain_fingerprint.cache_clear()`` after changing installed packages.
    """
    found: dict[str, str] = {}
    for name, version in _relevant_dists():
        # First one wins, as for imports: sys.path order.
        if _relevant(name) and name not in found:
            found[name] = version
    flavours = sorted((int(m.group(1)), n) for n in found if (m := _FLAVOUR_RE.match(n)))
    selected = flavours[-1][1] if flavours else None
    out: dict[str, str | None] = {
        n: v for n, v in found.items() if n.startswith(_DSL) and not (_FLAVOUR_RE.match(n) and n != selected)
    }
    out["apache-tvm-ffi"] = found.get("apache-tvm-ffi")
    out["cuda_flavour"] = "cu" + _FLAVOUR_RE.match(selected).group(1) if selected else None
    return dict(sorted(out.items()))


def source_digests(rendered: dict[str, str]) -> dict[str, str]:
    """{file name: sha256 of its text}, sorted by name: the ``sources`` part of a key."""
    return {name: sha256_text(text) for name, text in sorted(rendered.items())}


def cache_key(
    spec: KernelSpec,
    rendered: dict[str, str],
    compile_options: str,
    *,
    toolchain: dict[str, Any] | None = None,
    device_code: str | None = None,
    compile_layer: str | None = None,
    c_compiler: str | None = None,
) -> tuple[str, dict[str, dict[str, Any]]]:
    """(24-hex key, explained parts) for one variant.

    `rendered` maps file name -> rendered text (what `kdagen.render.render_variant` returns). The parts map
    ``spec``, ``sources``, ``device_code``, ``toolchain``, ``compile_options``, ``compile_layer`` and
    ``c_compiler`` to ``{"value": ..., "sha256": ...}``; the key is the sha256 of the JSON of
    ``{part: sha256}``. The keyword parts default to this process's values (`key_from_digests`).
    """
    return key_from_digests(
        spec,
        source_digests(rendered),
        compile_options,
        toolchain=toolchain,
        device_code=device_code,
        compile_layer=compile_layer,
        c_compiler=c_compiler,
    )


def key_from_digests(
    spec: KernelSpec,
    digests: dict[str, str],
    compile_options: str,
    *,
    toolchain: dict[str, Any] | None = None,
    device_code: str | None = None,
    compile_layer: str | None = None,
    c_compiler: str | None = None,
) -> tuple[str, dict[str, dict[str, Any]]]:
    """`cache_key` from the sha256 of each rendered file (`source_digests`) instead of the texts.

    The keyword parts default to this process's values: `toolchain_fingerprint()`,
    `kdagen.kernels.device_digest()`, `kdagen.compile.layer_digest()` and `c_compiler_identity()`.
    """
    tc = toolchain_fingerprint() if toolchain is None else toolchain
    values: dict[str, Any] = {
        "spec": spec.canonical_json(),
        "sources": dict(sorted(digests.items())),
        "device_code": device_code if device_code is not None else _device_digest(),
        "toolchain": dict(sorted(tc.items())),
        "compile_options": compile_options,
        "compile_layer": compile_layer if compile_layer is not None else _compile.layer_digest(),
        "c_compiler": c_compiler if c_compiler is not None else _compile.c_compiler_identity(),
    }
    parts = {
        name: {"value": value, "sha256": sha256_text(value if isinstance(value, str) else _canon(value))}
        for name, value in values.items()
    }
    key = sha256_text(_canon({name: part["sha256"] for name, part in parts.items()}))[:KEY_HEX]
    return key, parts
