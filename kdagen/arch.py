"""Capability records of the targets kdagen compiles for, and of the template families.

Call sites ask these records ("has_wgmma?", "which families?") instead of comparing SM numbers, so adding a
target is one entry here. Nothing here imports `kdagen.spec`: spec validation consults this module, not the
other way round.
"""

from __future__ import annotations

from dataclasses import dataclass

from kdagen.errors import SpecError

__all__ = ["CHUNK", "ArchInfo", "FamilyInfo", "ARCHS", "FAMILIES", "get_arch", "get_family"]

# Tokens per recurrence step, in every family: the one chunk size the kernels are built for (the spec accepts
# no other). 16 keeps the chunk-start anchor 2^-b inside the fp32/bf16 exponent range under the safe-gate
# promise (fast-kda.md §B.2), and makes every intra-step product one m16n8k16 tile row.
CHUNK = 16


@dataclass(frozen=True)
class ArchInfo:
    """What one exact compile target offers. `name` is also the ``--gpu-arch`` value."""

    name: str  # "sm_90a": exact target; a binary for one target is refused on another
    gpus: str  # the GPUs of this target, for tables and messages
    families: tuple[str, ...]  # template families that can target it, preferred first
    has_pdl: bool  # programmatic dependent launch (griddepcontrol): a kernel may start beside its predecessor
    has_bulk_copy: bool  # cp.async.bulk: one thread streams a contiguous block between global and shared
    smem_bytes_per_block: int  # opt-in maximum dynamic shared memory per block
    smem_bytes_per_sm: int  # shared memory of an SM, which co-resident CTAs share (each with a 1 KB reserve)
    runs_here: bool  # False: compiled and inspected here, never run (this project has no such GPU)
    # Targets whose GPUs offer every feature this target's plans use, so that those plans, compiled for one of
    # them, run there: the test-only `target=` of `kdagen.build` (how the sm_80 and sm_89 plans are run on an
    # H100: shared-memory budgets, tilings and the absence of TMA and PDL, with sm_90a machine code).
    emulated_on: tuple[str, ...] = ()

    @property
    def runs(self) -> str:
        """One line for `kdagen list`: whether this project runs the target's binaries, and on what."""
        if self.runs_here:
            return f"yes: {self.gpus}"
        return f"no: compiled and inspected here, never run (no {self.gpus} GPU)"


@dataclass(frozen=True)
class FamilyInfo:
    """A template family: a set of templates and the head dims they implement (every family steps `CHUNK`
    tokens)."""

    name: str
    head_dims: tuple[int, ...]
    description: str


FAMILIES: dict[str, FamilyInfo] = {
    "mma_sync": FamilyInfo(
        name="mma_sync",
        head_dims=(64, 128),
        description="portable: warp-level mma.sync, cp.async, ldmatrix",
    ),
    "wgmma": FamilyInfo(
        name="wgmma",
        head_dims=(64, 128),
        description="Hopper: warpgroup-MMA recurrence fed by TMA (prepare, intra-card CP stages: mma_sync)",
    ),
}

ARCHS: dict[str, ArchInfo] = {
    a.name: a
    for a in (
        ArchInfo(
            name="sm_80",
            gpus="A100",
            families=("mma_sync",),
            has_pdl=False,
            has_bulk_copy=False,
            smem_bytes_per_block=163 * 1024,  # 164 KB per SM, 163 KB per block with opt-in
            smem_bytes_per_sm=164 * 1024,
            runs_here=False,
            emulated_on=("sm_90a",),
        ),
        ArchInfo(
            name="sm_89",
            gpus="L40S/RTX 4090",
            families=("mma_sync",),
            has_pdl=False,
            has_bulk_copy=False,
            smem_bytes_per_block=99 * 1024,  # 100 KB per SM, 99 KB per block with opt-in
            smem_bytes_per_sm=100 * 1024,
            runs_here=False,
            emulated_on=("sm_90a",),
        ),
        ArchInfo(
            name="sm_90a",
            gpus="H100/H200",
            # wgmma first: its recurrence is the faster one (plan._AUTO_REASONS)
            families=("wgmma", "mma_sync"),
            has_pdl=True,
            has_bulk_copy=True,
            smem_bytes_per_block=227 * 1024,
            smem_bytes_per_sm=228 * 1024,
            runs_here=True,
        ),
        ArchInfo(
            name="sm_100a",
            gpus="B200",
            families=("mma_sync",),
            has_pdl=True,
            has_bulk_copy=True,
            smem_bytes_per_block=227 * 1024,
            smem_bytes_per_sm=228 * 1024,
            runs_here=False,
        ),
    )
}


def get_arch(name: str) -> ArchInfo:
    """The record of an exact target; `SpecError` for a name kdagen does not know."""
    try:
        return ARCHS[name]
    except KeyError:
        raise SpecError(f"unknown arch {name!r}: expected one of {', '.join(ARCHS)}") from None


def get_family(name: str) -> FamilyInfo:
    try:
        return FAMILIES[name]
    except KeyError:
        raise SpecError(f"unknown family {name!r}: expected one of {', '.join(FAMILIES)}") from None
