"""kdagen: a compiler for KDA (Kimi Delta Attention) kernels: prefill, decode, backward.

YAML spec -> planner -> Jinja templates rendered into ``generated/`` -> CuTe DSL compile -> binary cache ->
``kdagen.get_kernel(spec)``.

Importing this package is cheap and touches no GPU: it loads the spec's plain class only. pydantic (the spec
model) is imported when a spec is validated, PyYAML when a spec file is read, Jinja when sources are
rendered, and cutlass, tvm_ffi and torch when a kernel is built or loaded.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from kdagen.errors import (
    BuildError,
    CacheError,
    CacheMissError,
    InputError,
    KdagenError,
    LoadError,
    SpecError,
)
from kdagen.spec import KernelSpec, load_spec_file, resolve_spec
from kdagen.version import __version__

if TYPE_CHECKING:
    from kdagen.bundle import Bundle
    from kdagen.policy import SchedulePolicy
    from kdagen.runtime import KDAKernel

__all__ = [
    "__version__",
    "KernelSpec",
    "load_spec_file",
    "resolve_spec",
    "get_kernel",
    "load_bundle",
    "KdagenError",
    "SpecError",
    "InputError",
    "CacheMissError",
    "CacheError",
    "BuildError",
    "LoadError",
]

# Submodules that import torch, loaded on first attribute access so that `import kdagen` stays light:
# `kdagen.ops` (the torch.library custom ops) and `kdagen.fla` (FLA drop-ins).
_LAZY_SUBMODULES = ("ops", "fla")


def __getattr__(name: str) -> Any:
    if name in _LAZY_SUBMODULES:
        import importlib

        return importlib.import_module(f"kdagen.{name}")
    raise AttributeError(f"module 'kdagen' has no attribute {name!r}")


def load_bundle(directory: str | os.PathLike[str], verify: bool = False) -> Bundle:
    """Make `get_kernel` load the variants of the bundle in `directory` (written by ``kdagen build SPECFILE
    --bundle DIR``) from it, before looking in the cache: no render, no hashing of sources, no Jinja.

    Reads and checks the manifest now, and refuses (`kdagen.bundle.BundleError`, a `LoadError`) a bundle of
    another format or kdagen version, one built with another CuTe DSL / TVM-FFI / libs flavour, and, where a
    GPU is present, one with no variant for its target. `verify` also checks every file's sha256 now.
    ``KDAGEN_BUNDLE=DIR`` does the same at the first `get_kernel`. See `kdagen.bundle`.
    """
    from kdagen.bundle import load_bundle as _load  # lazy, like the build layer

    return _load(directory, verify=verify)


def get_kernel(
    spec: KernelSpec | dict[str, Any] | str,
    policy: SchedulePolicy | dict[str, Any] | None = None,
    force: bool = False,
) -> KDAKernel:
    """A ready KDA forward for `spec` (a `KernelSpec`, a dict of fields, or ``"specs/sm90.yaml:<name>"``).

    Builds into the cache on a miss (or raises `CacheMissError` under ``KDAGEN_DISABLE_JIT=1``), then loads.
    Call it as ``o, final_state = kernel(q, k, v, g, beta, *, scale=None, A_log=None, dt_bias=None,
    initial_state=None, output_final_state=False, cu_seqlens=None, policy=None)``. A repeated call with the
    same argument returns the kernel loaded before from memory; `force` rebuilds and reloads.

    `policy` (a `kdagen.policy.SchedulePolicy` or a dict of its fields) schedules the kernel's calls; without
    it they follow `kdagen.policy.default_policy()` (every choice automatic unless the ``KDAGEN_*``
    scheduling variables, read once per process, say otherwise). The kernel with a policy is a view of the
    one loaded for the spec (`KDAKernel.with_policy`): nothing is loaded twice.
    """
    # Lazy: the build layer imports cutlass and tvm_ffi, which `import kdagen` must not.
    from kdagen.build import get_kernel as _g

    kernel = _g(spec, force=force)
    return kernel if policy is None else kernel.with_policy(policy)
