"""The serving example (examples/serve.py) on its fp64 reference backend: the engine's pool, chunked prefill
with prefix-cache checkpoints, restores, decode with padding rows and speculative verify with rollback pass
the example's own checks, and backends that get one piece of the pool semantics wrong fail them (so the
checks can fail), as does the script's exit status.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from kdagen.spec import resolve_spec

REPO = Path(__file__).resolve().parents[1]
SPEC_K64 = f"{REPO / 'specs' / 'sm90.yaml'}:k64"


def _load_example() -> ModuleType:
    name = "kdagen_serve_example"  # tests/gpu/test_serve_gpu.py loads the same module under this name
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / "examples" / "serve.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while they build the classes
    spec.loader.exec_module(module)
    return module


serve = _load_example()
SPEC = resolve_spec(SPEC_K64)[1]
WORKLOAD = serve.Workload(requests=6, heads=1, vocab=128, system=100, tail=(5, 40), new_tokens=(4, 10))
CONFIG = serve.Config(slots=40)


class DropsCheckpoints(serve.ReferenceBackend):
    """Writes no prefix-cache checkpoint."""

    def prefill(self, x: dict[str, torch.Tensor], **pool: Any) -> torch.Tensor:
        pool["checkpoint_indices"] = torch.full_like(pool["checkpoint_indices"], serve.PAD)
        return super().prefill(x, **pool)


class CountsFromThePiece(serve.ReferenceBackend):
    """Places checkpoints at multiples of C counted from each piece's first token (start_positions lost)."""

    def prefill(self, x: dict[str, torch.Tensor], **pool: Any) -> torch.Tensor:
        pool["start_positions"] = torch.zeros_like(pool["start_positions"])
        return super().prefill(x, **pool)


class CheckpointsThePieceEnd(serve.ReferenceBackend):
    """Writes the state at the end of the piece into its checkpoint slots, wherever the boundaries fall."""

    def prefill(self, x: dict[str, torch.Tensor], **pool: Any) -> torch.Tensor:
        ck = pool["checkpoint_indices"]
        o = super().prefill(x, **{**pool, "checkpoint_indices": torch.full_like(ck, serve.PAD)})
        states = pool["state_pool"]
        for slot, row in zip(pool["state_indices"].tolist(), ck.tolist()):
            for dst in row:
                if dst >= 0:
                    states[dst].copy_(states[slot])
        return o


class IgnoresAccepted(serve.ReferenceBackend):
    """Reads a verify step's state from its first slot, whatever the last step accepted (no rollback)."""

    def decode(self, x: dict[str, torch.Tensor], **pool: Any) -> torch.Tensor:
        pool["num_accepted_tokens"] = None
        return super().decode(x, **pool)


class IgnoresFresh(serve.ReferenceBackend):
    """Starts a fresh request from whatever its slot holds (has_initial_state lost)."""

    def prefill(self, x: dict[str, torch.Tensor], **pool: Any) -> torch.Tensor:
        pool["has_initial_state"] = torch.ones_like(pool["has_initial_state"])
        return super().prefill(x, **pool)


def test_engine_passes_on_the_reference_backend() -> None:
    result = serve.serve(SPEC, "cpu", WORKLOAD, CONFIG)
    assert result.ok, result.report()
    s = result.stats
    # The run exercises what the example claims to show.
    assert s.prefix_hits >= 2 and s.restored_tokens >= 2 * CONFIG.checkpoint_interval
    assert s.checkpoints >= 3 and s.prefill_pieces > s.prefill_calls
    assert s.decode_steps > 0 and s.padding_rows > 0 and s.padding_nonzero == 0
    assert s.verify_steps > 0 and any(1 < a for a in s.accepted) and any(a < CONFIG.draft for a in s.accepted)
    assert not result.captured and result.backend == "reference"
    counts = {c.what: int(c.count.split()[0]) for c in result.checks}
    assert counts["o of the rejected draft tokens"] > 0 and counts["checkpoints in the cache"] > 0


def test_engine_under_slot_pressure() -> None:
    """A pool too small for every request at once: requests wait for slots and checkpoints are evicted."""
    result = serve.serve(SPEC, "cpu", WORKLOAD, serve.Config(slots=10, cache_entries=2))
    assert result.ok, result.report()
    assert result.stats.evictions > 0


@pytest.mark.parametrize(("backend", "fails"), [
    (DropsCheckpoints, "o of the prompt tokens prefilled"),
    (CountsFromThePiece, "checkpoints in the cache"),
    (CheckpointsThePieceEnd, "checkpoints in the cache"),
    (IgnoresAccepted, "o of the tokens decoded and accepted"),
    (IgnoresFresh, "o of the prompt tokens prefilled"),
], ids=lambda p: p.__name__ if isinstance(p, type) else "")
def test_a_wrong_backend_is_caught(backend: type, fails: str) -> None:
    result = serve.serve(SPEC, "cpu", WORKLOAD, CONFIG, make_backend=backend)
    assert not result.ok
    failing = {c.what for c in result.checks if not c.ok}
    assert fails in failing, result.report()
    assert result.report().endswith("FAIL")


def test_script_exit_status(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--device", "cpu", "--spec", SPEC_K64, "--requests", "4", "--heads", "1"]
    assert serve.main(argv) == 0
    assert capsys.readouterr().out.rstrip().endswith("PASS")
    monkeypatch.setattr(serve, "ReferenceBackend", IgnoresAccepted)
    assert serve.main(argv) == 1
    assert capsys.readouterr().out.rstrip().endswith("FAIL")
