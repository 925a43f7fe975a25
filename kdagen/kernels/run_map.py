"""The map from a sequence's runs of tiles to the backward's kept-state slots: a plain module, so that the
host (`kdagen.backward`) and the device code (`common.tile_runs`, the recurrence's checkpoints) take the
same formulas. Every name works on ints, on torch tensors and on the device's 32-bit integers."""

from __future__ import annotations

__all__ = ["first_run", "runs_of"]


def first_run(bos, seq, run):  # noqa: ANN001, ANN201 (ints, tensors or device integers alike)
    """The slot of the first run of `run` tokens of sequence `seq` starting at token `bos`:
    floor(bos / run) + seq, the injective map of the tiles' ids at the run's length (a sequence's runs take
    the slots after it, one each)."""
    return bos // run + seq


def runs_of(length, run):  # noqa: ANN001, ANN201
    """Runs of `run` tokens that cover `length` tokens (0 for an empty sequence): the state entering each is
    kept, the first being the sequence's initial state."""
    return (length + run - 1) // run
