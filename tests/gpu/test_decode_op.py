"""GPU checks of the ``kdagen::decode`` custom op (`kdagen.ops.kda_decode`): under
`torch.compile(fullgraph=True)` (Inductor) it gives bitwise the o and the pool of `KDAKernel.decode` (plain
decode with a padding slot, speculative verify with FLA's slot semantics and fresh requests, an interleaved
pool written through a caller's `out`), and a compiled step captured in a CUDA graph updates the pool in
place across replays, bitwise as eager decode steps.

Every test needs a CUDA GPU (sm_90a); without one the whole module is skipped.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from kdagen import ops

try:  # tests/gpu is not a package: pytest puts this folder on sys.path (rootdir-relative import mode)
    from . import _cases as cases  # type: ignore[no-redef]
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import _cases as cases  # type: ignore[no-redef]

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (sm_90a)"),
]

SPEC_NAMES = ["lb_safe", "p_reset_vk_bbf16"]  # both layouts; built for tests/gpu/test_decode.py too
TOKEN_INPUTS = ("q", "k", "v", "g", "beta")


def _inputs(spec: dict[str, Any], n: int, s: int, h: int, seed: int) -> dict[str, Any]:
    # n requests of s tokens each, with the gate parameters the spec takes (None otherwise)
    inp = cases.build_inputs(spec, cases.F(n, s, h, seed=seed))
    return {name: inp[name] for name in (*TOKEN_INPUTS, "A_log", "dt_bias")}


def _pools(spec: dict[str, Any], slots: int, hv: int, interleave: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two equal pools (their buffers, and the pools as views whose slots are `interleave` slot sizes apart,
    as when layers share one allocation): one for the op, one for `KDAKernel.decode`."""
    k, v = spec["head_dim_k"], spec["head_dim_v"]
    inner = (hv, k, v) if spec["state_layout"] == "kv" else (hv, v, k)
    base = torch.randn(slots, interleave, *inner, device="cuda") * 0.1
    return base, base.clone()


def _step(spec_json: str):
    """A decode step as a model's layer calls it: the op through `kda_decode`, the keywords passed on."""

    def step(q, k, v, g, beta, A_log, dt_bias, pool, idx, kw):
        return ops.kda_decode(spec_json, q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, state_pool=pool,
                              state_indices=idx, **kw)

    return step


def _case(name: str) -> tuple[int, int, int, torch.Tensor, dict[str, Any]]:
    """(requests, tokens a request, interleave, state_indices, other keywords) of a named call; ``"out"`` is
    replaced by a buffer for o."""
    dev = "cuda"
    if name == "plain":
        return 6, 1, 1, torch.tensor([3, 9, -1, 0, 15, 7], device=dev), {}
    if name == "verify":
        kw = {"num_accepted_tokens": torch.tensor([1, 4, 2], dtype=torch.int32, device=dev),
              "has_initial_state": torch.tensor([True, False, True], device=dev)}
        return 3, 4, 1, torch.arange(12, dtype=torch.int32, device=dev).view(3, 4), kw
    assert name == "interleaved_out"
    return 4, 2, 3, torch.tensor([[0, 1], [2, 3], [4, 5], [14, 15]], device=dev), {"out": None}


@pytest.mark.parametrize("spec_name", SPEC_NAMES)
@pytest.mark.parametrize("case", ["plain", "verify", "interleaved_out"])
def test_compiled_op_matches_kernel_decode(spec_name: str, case: str) -> None:
    spec = cases.SPECS[spec_name]
    kernel = cases.kernel_for(spec_name)  # built outside the traced region
    h = 2
    hv = h * spec["gva_ratio"]
    n, s, interleave, idx, kw = _case(case)
    base, want_base = _pools(spec, 16, hv, interleave)
    pool, want_pool = base[:, 0], want_base[:, 0]
    torch._dynamo.reset()
    compiled = torch.compile(_step(ops.spec_json(spec)), fullgraph=True)
    for seed in (1, 2):  # two steps: the second reads the pool the first wrote
        inp = _inputs(spec, n, s, h, seed)
        if "out" in kw and kw["out"] is None:
            kw["out"] = torch.empty_like(inp["v"])  # one buffer for both steps, as an engine keeps it
        want_kw = {name: (t.clone() if name == "out" else t) for name, t in kw.items()}
        with torch.no_grad():
            want = kernel.decode(*(inp[x] for x in TOKEN_INPUTS), A_log=inp["A_log"], dt_bias=inp["dt_bias"],
                                 state_pool=want_pool, state_indices=idx, **want_kw)
            got = compiled(*(inp[x] for x in TOKEN_INPUTS), inp["A_log"], inp["dt_bias"], pool, idx, kw)
        torch.cuda.synchronize()
        assert got.shape == want.shape and got.dtype == want.dtype
        assert torch.equal(got, want), f"o of step {seed}"
        assert torch.equal(base, want_base), f"pool (and the buffer around it) after step {seed}"
        if "out" in kw:
            assert torch.equal(kw["out"], want_kw["out"]), f"out of step {seed}"


@pytest.mark.parametrize("spec_name", SPEC_NAMES)
@pytest.mark.parametrize("into_out", [False, True], ids=["returned", "out"])
def test_compiled_op_replays_in_a_cuda_graph(spec_name: str, into_out: bool) -> None:
    """A compiled decode step captured once, replayed over new tokens: the pool is updated in place by each
    replay (the next replay reads it), bitwise as eager `KDAKernel.decode` steps on a copy of the pool."""
    spec = cases.SPECS[spec_name]
    kernel = cases.kernel_for(spec_name)
    n, h, steps = 4, 2, 3
    hv = h * spec["gva_ratio"]
    full = _inputs(spec, n, steps, h, seed=7)
    tokens = [{x: full[x][:, t:t + 1].contiguous() for x in TOKEN_INPUTS} for t in range(steps)]
    static = {x: t.clone() for x, t in tokens[0].items()}  # the captured inputs, refilled before each replay
    idx = torch.tensor([5, 0, -1, 2], dtype=torch.int32, device="cuda")  # one padding request
    base, want_base = _pools(spec, 8, hv, interleave=2)
    pool, want_pool = base[:, 0], want_base[:, 0]
    start = base.clone()
    kw: dict[str, Any] = {"out": torch.empty_like(static["v"])} if into_out else {}
    torch._dynamo.reset()
    compiled = torch.compile(_step(ops.spec_json(spec)), fullgraph=True)

    def run() -> torch.Tensor:
        return compiled(*(static[x] for x in TOKEN_INPUTS), full["A_log"], full["dt_bias"], pool, idx, kw)

    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compile and warm up outside the capture
            for _ in range(2):
                run()
        torch.cuda.current_stream().wait_stream(side)
        base.copy_(start)  # the warm-up steps wrote the pool
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = run()
        torch.cuda.synchronize()
        assert torch.equal(base, start), "the capture ran the step instead of recording it"
        for t, token in enumerate(tokens):
            cases.copy_into(static, token)
            graph.replay()
            want = kernel.decode(*(token[x] for x in TOKEN_INPUTS), A_log=full["A_log"],
                                 dt_bias=full["dt_bias"], state_pool=want_pool, state_indices=idx)
            torch.cuda.synchronize()
            o = kw["out"] if into_out else captured
            assert torch.equal(o, want), f"o of replay {t}"
            assert torch.equal(base, want_base), f"pool after replay {t}"
    assert not torch.equal(base, start)
