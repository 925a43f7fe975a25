"""The serving example (examples/serve.py) on the kdagen kernels: chunked prefill on the pool with
prefix-cache checkpoints, restores, decode replayed from a CUDA graph with padding rows, and speculative
verify with rollback, every output and state within 0.005 of the fp64 reference run of each request's token
stream; and the documented command's exit status.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from kdagen.spec import resolve_spec

try:  # tests/gpu is not a package: pytest puts this folder on sys.path (rootdir-relative import mode)
    from . import _cases as cases  # type: ignore[no-redef]
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import _cases as cases  # type: ignore[no-redef]

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (sm_90a)"),
]

REPO = Path(__file__).resolve().parents[2]
SPEC_K128 = f"{REPO / 'specs' / 'sm90.yaml'}:k128"


def _load_example() -> ModuleType:
    name = "kdagen_serve_example"  # the CPU test loads the same module under this name
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / "examples" / "serve.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while they build the classes
    spec.loader.exec_module(module)
    return module


serve = _load_example()


def test_documented_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert serve.main(["--device", "cuda", "--spec", SPEC_K128]) == 0
    out = capsys.readouterr().out
    assert "CUDA graph replays" in out and out.rstrip().endswith("PASS"), out


@pytest.mark.parametrize("spec_ref", [SPEC_K128, cases.SPECS["lb_safe_gva2_vk_bbf16"]],
                         ids=["k128", "gva2-vk"])
def test_engine_on_the_kernels(spec_ref: str | dict) -> None:
    """More requests than a decode graph's rows (two replays a step), GVA and the V-first layout."""
    spec = resolve_spec(spec_ref)[1]
    workload = serve.Workload(requests=12, heads=2, seed=1)
    result = serve.serve(spec, "cuda", workload, serve.Config(slots=40, graph_rows=4, seed=1))
    assert result.ok, result.report()
    assert result.backend == "kdagen" and result.captured
    s = result.stats
    assert s.prefix_hits > 0 and s.checkpoints > 0 and s.prefill_pieces > s.prefill_calls
    assert s.decode_steps > 0 and s.padding_rows > 0 and s.verify_steps > 0
