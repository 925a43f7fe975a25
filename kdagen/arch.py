"""Capability records of the targets kdagen compiles for, and of the template families.

Call sites ask these records ("has_wgmma?", "which families?") instead of comparing SM numbers, so adding a
target is one entry here. Nothing here imports `kdagen.spec`: spec validation consults this module, not the
other way round.
"""

from __future__ import annotations

from dataclasses import dataclass

from kdagen.errors import SpecError

__all__ = ["ArchInfo", "FamilyInfo", "ARCHS", "FAMILIES", "get_arch", "get_family", "arch_names"]


@dataclass(frozen=True)
class ArchInfo:
    """What one exact compile target offers. `name` is also the ``--gpu-arch`` value."""

    name: str  # "sm_90a": exact target; a binary for one target is refused on another
    sm: int  # 80, 89, 90, 100
    capability: tuple[int, int]  # what torch.cuda.get_device_capability() reports on such a GPU
    gpus: str  # marketing names, for tables and messages
    families: tuple[str, ...]  # template families that can target it, preferred first
    has_tma: bool
    has_wgmma: bool
    has_tcgen05: bool
    has_stmatrix: bool
    has_pdl: bool  # programmatic dependent launch (griddepcontrol): a kernel may start beside its predecessor
    smem_bytes_per_block: int  # opt-in maximum dynamic shared memory per block
    num_sms_hint: int  # of the usual part (grid sizing heuristics only; the runtime asks the device)
    can_run_here: bool  # False: compiled and inspected only, no such GPU in this project
    run_here: str  # short answer to "where does this run?", for `kdagen list`
    note: str

    @property
    def tag(self) -> str:
        """The compact form used in slugs: ``sm_90a`` -> ``sm90a``."""
        return self.name.replace("_", "")


@dataclass(frozen=True)
class FamilyInfo:
    """A template family: a set of templates and the spec values they implement."""

    name: str
    chunk_sizes: tuple[int, ...]
    head_dims: tuple[int, ...]
    description: str


FAMILIES: dict[str, FamilyInfo] = {
    "mma_sync": FamilyInfo(
        name="mma_sync",
        chunk_sizes=(16,),
        head_dims=(64, 128),
        description="portable: warp-level mma.sync, cp.async, ldmatrix",
    ),
    "wgmma": FamilyInfo(
        name="wgmma",
        chunk_sizes=(16,),
        head_dims=(64, 128),
        description="Hopper: warpgroup-MMA recurrence fed by TMA (prepare, intra-card CP stages: mma_sync)",
    ),
}

ARCHS: dict[str, ArchInfo] = {
    a.name: a
    for a in (
        ArchInfo(
            name="sm_80",
            sm=80,
            capability=(8, 0),
            gpus="A100",
            families=("mma_sync",),
            has_tma=False,
            has_wgmma=False,
            has_tcgen05=False,
            has_stmatrix=False,
            has_pdl=False,
            smem_bytes_per_block=163 * 1024,  # 164 KB per SM, 163 KB per block with opt-in
            num_sms_hint=108,
            can_run_here=True,
            run_here="on A100 only (none in this project)",
            note="Ampere; no sm_80 GPU in this project (an sm_80 binary is refused on H100/H200)",
        ),
        ArchInfo(
            name="sm_89",
            sm=89,
            capability=(8, 9),
            gpus="L40S/RTX 4090",
            families=("mma_sync",),
            has_tma=False,
            has_wgmma=False,
            has_tcgen05=False,
            has_stmatrix=False,
            has_pdl=False,
            smem_bytes_per_block=99 * 1024,  # 100 KB per SM, 99 KB per block with opt-in
            num_sms_hint=142,
            can_run_here=True,
            run_here="on L40S/4090 only (none in this project)",
            note="Ada; no sm_89 GPU in this project (an sm_89 binary is refused on H100/H200)",
        ),
        ArchInfo(
            name="sm_90a",
            sm=90,
            capability=(9, 0),
            gpus="H100/H200",
            # wgmma first: its recurrence is the faster one (plan._AUTO_REASONS has the numbers)
            families=("wgmma", "mma_sync"),
            has_tma=True,
            has_wgmma=True,
            has_tcgen05=False,
            has_stmatrix=True,
            has_pdl=True,
            smem_bytes_per_block=227 * 1024,
            num_sms_hint=132,
            can_run_here=True,
            run_here="yes: H100/H200",
            note="Hopper; run and tested on this project's H100/H200",
        ),
        ArchInfo(
            name="sm_100a",
            sm=100,
            capability=(10, 0),
            gpus="B200",
            families=("mma_sync",),
            has_tma=True,
            has_wgmma=False,
            has_tcgen05=True,
            has_stmatrix=True,
            has_pdl=True,
            smem_bytes_per_block=227 * 1024,
            num_sms_hint=148,
            can_run_here=False,
            run_here="compile-only: no Blackwell GPU",
            note="compiled and inspected only: no Blackwell GPU in this project",
        ),
    )
}


def arch_names() -> tuple[str, ...]:
    return tuple(ARCHS)


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
