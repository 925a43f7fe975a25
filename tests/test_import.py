"""`import kdagen` and the CPU-side commands stay light: no cutlass, no tvm_ffi, no torch (so no CUDA init),
and `import kdagen` none of the build side (pydantic, PyYAML, Jinja, click, rich).

Each check runs in a fresh interpreter: this test process may already hold those modules.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

HEAVY = ("cutlass", "tvm_ffi", "torch", "triton", "cuda")
REPO = Path(__file__).resolve().parent.parent


def _heavy_after(code: str, tops: tuple[str, ...] = HEAVY) -> list[str]:
    """The modules of the packages `tops` that a fresh interpreter holds after running `code`."""
    probe = (
        f"{code}\nimport json, sys\n"
        f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {tops!r})))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_kdagen_is_light():
    assert _heavy_after("import kdagen") == []


def test_public_names():
    code = (
        "import kdagen, inspect\n"
        "names = ['__version__', 'KernelSpec', 'load_spec_file', 'get_kernel', 'KdagenError', 'SpecError',"
        " 'InputError', 'CacheMissError', 'BuildError']\n"
        "assert all(hasattr(kdagen, n) for n in names)\n"
        "assert kdagen.__version__ == '0.1.0'\n"
        "assert 'from kdagen.build import get_kernel' in inspect.getsource(kdagen.get_kernel)\n"
    )
    assert _heavy_after(code) == []


def test_cpu_modules_are_light():
    code = (
        "import kdagen.spec, kdagen.arch, kdagen.keys, kdagen.cache, kdagen.render, kdagen.paths, "
        "kdagen.cli, kdagen.tree, kdagen.version, kdagen.dtypes, kdagen.plan, kdagen.workspace"
    )
    assert _heavy_after(code) == []


def test_key_command_does_not_import_the_compiler():
    # `kdagen key` / `kdagen list` render and hash only: they must not pay for (or need) the DSL.
    code = (
        "from click.testing import CliRunner\n"
        "from kdagen.cli import cli\n"
        "r = CliRunner().invoke(cli, ['key', 'specs/sm90.yaml:k128'])\n"
        "assert r.exit_code == 0, r.output\n"
    )
    assert [m for m in _heavy_after(code) if m.split(".")[0] in ("cutlass", "tvm_ffi", "torch")] == []


BUILD_ONLY = ("pydantic", "pydantic_core", "jinja2", "click", "rich", "yaml")


def test_import_kdagen_leaves_the_build_side_out():
    # The spec model (pydantic), spec files (PyYAML), the render (Jinja) and the CLI (click, rich) are
    # imported when they are used: a serving host that gets its kernels from a bundle needs none of them.
    assert _heavy_after("import kdagen", BUILD_ONLY) == []
    assert _heavy_after("import kdagen.build, kdagen.bundle, kdagen.plan", BUILD_ONLY) == []


def test_validating_a_spec_imports_the_model():
    code = "import kdagen\nkdagen.KernelSpec(arch='sm_90a')"
    assert {"pydantic", "pydantic_core"} <= {m.split(".")[0] for m in _heavy_after(code, BUILD_ONLY)}
