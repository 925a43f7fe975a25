"""Compile one rendered stage file for its exact target, without a GPU.

The generated module declares ``SIGNATURE`` (argument table) and ``ENTRY`` (the ``@cute.jit`` host
function); this module turns the table into fake tensors with symbolic dims, runs ``cute.compile`` with
``--gpu-arch`` and ``--enable-tvm-ffi`` and exports the result as a C-ABI object. It never launches anything.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.util
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from kdagen import paths

# The argument alignment every tensor is compiled for. The runtime copies misaligned inputs (rare: a view
# with an odd storage offset) so the compiled 16-byte cp.async paths stay valid.
TENSOR_ALIGN = 16
EXPORT_FUNCTION = "fn"


def compile_options(arch: str) -> str:
    return f"--gpu-arch {arch} --enable-tvm-ffi"


@functools.cache
def layer_digest() -> str:
    """sha256 of this module's source: the fake tensors, alignment, export name and link step it fixes shape
    every binary, so the cache key carries it (`kdagen.keys`). Cached per process."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()


def find_c_compiler() -> str | None:
    """The C compiler `link_shared` uses: ``$CC`` (default ``cc``), else ``gcc``; None when there is none."""
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


@functools.cache
def c_compiler_identity() -> str:
    """``"<path> | <first line of --version>"`` of the C compiler that links the ``.so``, or ``"none"``.

    Part of the cache key: a different linker may give a different shared library. Cached per process.
    """
    cc = find_c_compiler()
    if cc is None:
        return "none"
    try:
        done = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
        lines = (done.stdout or done.stderr).strip().splitlines()
        version = lines[0].strip() if lines else "unknown version"
    except (OSError, subprocess.SubprocessError):
        version = "unknown version"
    return f"{os.path.realpath(cc)} | {version}"


@dataclass(frozen=True)
class CompiledStage:
    name: str
    object_bytes: bytes
    seconds: float


def _import_generated(path: Path):
    # A unique module name per file: several variants are compiled in one process.
    name = "kdagen_gen_" + path.parent.name.replace("-", "_") + "_" + path.stem
    return paths.load_module(name, path)  # the DSL re-reads the source from this file when compiling


def _pin_arch(arch: str) -> None:
    # Without a GPU the DSL defaults to sm_100a; pin the session arch so trace-time checks and the
    # export agree with --gpu-arch (cutedsl.md §1, "Choosing the target").
    from cutlass.cutlass_dsl import CuTeDSL

    CuTeDSL._get_dsl().envar.arch = arch


def fake_arguments(signature) -> list:
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor

    symbols: dict[str, object] = {}

    def dim(d):
        if isinstance(d, int):
            return d
        if d not in symbols:
            symbols[d] = cute.sym_int32(symbol=d)
        return symbols[d]

    args = []
    for _name, kind, dtype, shape, *layout in signature:
        if kind == "stream":
            # Not an argument of the exported function: TVM-FFI passes its environment stream, which the
            # runtime points at torch's current stream (so launches order with torch work and graph capture).
            args.append(make_fake_stream(use_tvm_ffi_env_stream=True))
        elif kind == "tensor" and layout:
            # Explicit strides (a fifth entry): ints are static, a name or (name, divisor) a dynamic 64-bit
            # stride, e.g. a state pool whose slots are further apart than a slot's size (the divisor lets
            # the compiler prove vector alignment).
            stride = tuple(
                s if isinstance(s, int)
                else cute.sym_int64(symbol=s[0], divisibility=s[1]) if isinstance(s, tuple)
                else cute.sym_int64(symbol=s)
                for s in layout[0]
            )
            args.append(make_fake_tensor(getattr(cutlass, dtype), tuple(dim(d) for d in shape), stride,
                                         assumed_align=TENSOR_ALIGN))
        elif kind == "tensor":
            dims = tuple(dim(d) for d in shape)
            order = tuple(range(len(dims) - 1, -1, -1))  # row-major: last dim innermost
            args.append(
                make_fake_compact_tensor(
                    getattr(cutlass, dtype), dims, stride_order=order, assumed_align=TENSOR_ALIGN
                )
            )
        else:
            args.append(getattr(cutlass, kind)(0))
    return args


def compile_stage_file(path: Path, arch: str, extra_options: str = "") -> CompiledStage:
    """Compile the generated stage at ``path`` for ``arch`` and return the exported object bytes.

    ``extra_options`` is appended to the `compile_options` string (e.g. ``"--keep-ptx --dump-dir DIR"`` to
    inspect the PTX). It is not part of the cache key: `kdagen.build` never passes it, only tests and
    diagnostics do.
    """
    import cutlass.cute as cute

    _pin_arch(arch)
    start = time.perf_counter()
    module = _import_generated(path)
    entry = getattr(module, module.ENTRY)
    options = compile_options(arch) + (f" {extra_options}" if extra_options else "")
    compiled = cute.compile(entry, *fake_arguments(module.SIGNATURE), options=options)
    fd, tmp = tempfile.mkstemp(suffix=".o")
    os.close(fd)
    try:
        compiled.export_to_c(tmp, function_name=EXPORT_FUNCTION)
        data = Path(tmp).read_bytes()
    finally:
        os.unlink(tmp)
    return CompiledStage(path.stem, data, time.perf_counter() - start)


def link_shared(object_bytes: bytes) -> bytes | None:
    """Link an exported object into a shared library, or None when no C compiler is at hand.

    A shared library loads through TVM-FFI alone (a few ms); the object needs the DSL's JIT linker, whose
    import costs about a second. Undefined symbols resolve at load time against the DSL runtime library.
    """
    cc = find_c_compiler()
    if cc is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        obj, lib = Path(tmp) / "stage.o", Path(tmp) / "stage.so"
        obj.write_bytes(object_bytes)
        done = subprocess.run([cc, "-shared", "-o", str(lib), str(obj)], capture_output=True, text=True)
        return lib.read_bytes() if done.returncode == 0 and lib.is_file() else None


@functools.cache
def _runtime_library() -> Path | None:
    # libcute_dsl_runtime.so of the installed libs flavour, found without importing cutlass (its import is
    # the slow part of a first load). The flavour is the one the cache key records.
    from kdagen.keys import toolchain_fingerprint

    spec = importlib.util.find_spec("nvidia_cutlass_dsl")
    flavour = toolchain_fingerprint().get("cuda_flavour")
    if spec is None or not spec.submodule_search_locations or not flavour:
        return None
    for root in spec.submodule_search_locations:
        lib = Path(root) / flavour / "lib" / "libcute_dsl_runtime.so"
        if lib.is_file():
            return lib
    return None


_preloaded: set[Path] = set()


def load_object(path: Path, shared: Path | None = None):
    """Load an exported stage: its shared library `shared` where given (fast path), else the object `path`;
    returns the raw ``tvm_ffi.Function``.

    Only the files named are read (callers pass paths whose digests the cache checked). The function is
    positional-only and launches on TVM-FFI's environment stream.
    """
    runtime = _runtime_library() if shared is not None else None
    if runtime is not None:
        import tvm_ffi

        if runtime not in _preloaded:  # its symbols must be global before the stage library is opened
            ctypes.CDLL(str(runtime), mode=ctypes.RTLD_GLOBAL)
            _preloaded.add(runtime)
        return tvm_ffi.load_module(str(shared))[EXPORT_FUNCTION]
    import cutlass.cute as cute

    return getattr(cute.runtime.load_module(str(path), enable_tvm_ffi=True), EXPORT_FUNCTION)
