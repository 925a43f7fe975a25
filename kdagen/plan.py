"""The planner: every structural and tuning choice for a variant, made once, before rendering.

Templates only express what the plan says; the runtime only launches the stages the plan lists.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kdagen.arch import CHUNK
from kdagen.dtypes import DTYPES, nbytes
from kdagen.kernels import bwd_grads_shape, bwd_tile_shape, staging_shape
from kdagen.kernels.decode_rows import row_words
from kdagen.spec import KernelSpec

__all__ = ["CHUNK", "StagePlan", "Plan", "bwd_state_tiles", "make_plan"]

# Value heads per prepare CTA, one warp each (the runtime sizes the persistent grid by it): four, or fewer
# without the safe gate where fewer put more warps on an SM (`_prepare_layout`).
PREPARE_HEADS_PER_CTA = 4
# Value rows per recurrence CTA: four warps of 16 rows each. At V=128 this splits every (sequence, head)
# in two CTAs, which doubles the parallelism of the serial chain (the V-split of fast-kda.md §C.2).
BLOCK_V = 64
# The per-item decode stage's CTA: (value columns, threads a column). Before sm_90 it takes every call, one
# thread a column holding the whole column: two CTAs a head at V=128. Where the streaming stage takes the
# large calls (targets with bulk copies), it serves the calls of few items, as narrow CTAs of 32 columns
# with 4 threads each (32 keys a thread): four CTAs a head, so that a single request's states pass through
# many SMs (docs/experiments.md, "Decode: narrow CTAs for few requests").
DECODE_WIDE_CTA = (64, 1)
DECODE_NARROW_CTA = (32, 4)
# Streaming decode (`decode_stream`): at most this many item states in its shared-memory ring; stager warps
# (each a global round trip a token in flight; three keep a V = 128 CTA at 256 threads, which ptxas gives
# all 255 registers: at 288 it allocates 32 and spills 17 KB) and the tokens each stages ahead.
DECODE_STREAM_MAX_STAGES = 8
DECODE_STAGERS = 3
DECODE_TOKEN_STAGES = 4
# Independent partial sums of each dot product over K in the decode step, so that its K multiply-adds are not
# one dependent chain (docs/experiments.md, "Decode").
DECODE_PARTIAL_SUMS = 4
# The fewest registers a thread the backward's bwd_grads stage is capped to (`_bwd_grads_ctas`): its phases
# are latency-bound, so it runs as many CTAs an SM as its shared memory allows, down to this; uncapped it
# takes 178 at K = 128 and two CTAs fit (docs/experiments.md, "Backward: the tile algebra as a stage").
BWD_GRADS_MIN_REGS = 128
# Most sequences the forward stage's setup kernel ranks (longest first for the recurrence's grid): it stages
# cu_seqlens in shared memory (16 KB at this bound) and each of its threads reads all of it; past the bound
# the runtime keeps the input order.
MAX_RANKED_SEQS = 4096
# A call's workspace is allocated as [bytes / WORKSPACE_ROW, WORKSPACE_ROW] uint8 (kdagen.workspace): TVM-FFI
# checks every dim of a tensor argument against the int32 range, and a flat byte tensor would cap a call's
# workspace at 2 GiB (B=2 T=16384 H=64 needs 1.8).
WORKSPACE_ROW = 256
# The fused prepare + recurrence kernel (templates/wgmma/fused.py.j2): four prepare warps beside the consumer
# warpgroups, a six-stage ring, the column-block loop rolled (one block a trip): the fastest shape measured.
# H100, B=2 T=16384 H=64: 1.71-1.73 ms rolled, 1.75-1.78 unrolled twice, 2.55-2.72 with 8 prepare warps
# (docs/experiments.md, "Fused kernel: shape and margin").
FUSED_PREP_WARPS = 4
FUSED_STAGES = 6
FUSED_UNROLL_KB = 1
# The setup kernel runs the fused kernel when max(longest, waves x mean) chain steps, plus FUSED_FILL_STEPS,
# are at most FUSED_MARGIN x the balanced steps per SM of the two-stage path. The fill is a CTA's first tile,
# prepared before its first step; the grid is persistent, so it is charged once a CTA, not once a chain.
# Forced on, the fused kernel won every measured call within 1.27 x balanced (docs/experiments.md,
# "Fused kernel: shape and margin", "Fused kernel: fill steps").
FUSED_MARGIN = 1.3
FUSED_FILL_STEPS = 3
# Its grid is persistent (one CTA per SM at most) and its CTAs take chains from a device counter through a
# queue of FUSED_QUEUE entries a CTA: the prepare warps may be a few short chains ahead of the consumers (the
# ring holds FUSED_STAGES steps), and the fetching consumer warp posts each chain before the current one ends.
FUSED_QUEUE = 4
# The CTA-pair form of the fused kernel (templates/wgmma/fused.py.j2 with `pair`): where one CTA a chain
# would leave half the SMs idle (B=1 at H=64: 64 chains on 132 SMs), a cluster of two CTAs runs each chain,
# each CTA the recurrence of half the value rows and the preparation of every other step, which it hands to
# the partner by bulk shared-memory copies. The two CTAs' prepare warps share one ring schedule, so the ring
# holds a step for each of them (FUSED_PAIR_STAGES >= 2 x prepare warps a CTA: `_pair_prep_warps`).
# Whether a call takes the pair form is the runtime's cost model (kdagen.policy.pair_step_limit): it passes
# the longest chain, in steps, for which a pair's chain beats prepare and the recurrence beside it.
FUSED_PAIR_STAGES = 8


@dataclass(frozen=True)
class StagePlan:
    name: str  # also the rendered file name (<name>.py) and the cache artifact name (<name>.o)
    template: str  # path under templates/
    params: dict[str, Any] = field(default_factory=dict)
    # False: a module other stages import (its kernels are compiled into theirs); rendered and checked like
    # every stage, but neither compiled on its own nor loaded by the runtime.
    compiled: bool = True
    note: str = ""  # what the stage does and its layout, in a line (`kdagen list --why`; not rendered)


@dataclass(frozen=True)
class Plan:
    family: str
    reason: str  # why this family and which kernels, in full (every rendered file's header)
    stages: tuple[StagePlan, ...]
    summary: str = ""  # the reason in a few words (`kdagen list`; not rendered)

    @property
    def stage_names(self) -> list[str]:
        """The compiled stages: the cache entry's artifacts and the runtime's callables."""
        return [s.name for s in self.stages if s.compiled]


# Why `auto` picks a target's first family, where there is a choice (shown in every rendered header). On
# sm_90a both families build every spec and pass the same tests; wgmma's recurrence is the faster one
# (docs/experiments.md, "Family choice on sm_90a").
_AUTO_REASONS = {
    ("sm_90a", "wgmma"): "Hopper: the recurrence on warpgroup MMA fed by TMA from a producer warp (0.57 vs "
    "0.72 us per step for mma_sync on an H100); prepare and the intra-card CP stages are the mma_sync ones",
}
_AUTO_SUMMARIES = {("sm_90a", "wgmma"): "the faster recurrence on Hopper"}


def _auto_reason(arch: str, family: str) -> tuple[str, str]:
    """(reason, summary) of `auto`'s choice of `family` for `arch`."""
    only = f"portable warp-MMA family: the only family implemented for {arch}"
    summary = _AUTO_SUMMARIES.get((arch, family), f"the only family for {arch}")
    return _AUTO_REASONS.get((arch, family), only), summary


def _count(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _choose_family(spec: KernelSpec) -> tuple[str, str, str]:
    """(family, reason, summary): the spec's family, or for `auto` the target's preferred one (validation has
    already checked that the families it lists can build the spec)."""
    if spec.family != "auto":
        return spec.family, f"requested in the spec ({spec.family})", "requested in the spec"
    family = spec.arch_info.families[0]
    return family, *_auto_reason(spec.arch, family)


def _common_params(spec: KernelSpec) -> dict[str, Any]:
    return {
        "head_dim_k": spec.head_dim_k,
        "head_dim_v": spec.head_dim_v,
        "chunk": CHUNK,
        "gva_ratio": spec.gva_ratio,
        "dtype": DTYPES[spec.dtype].dsl,
        "state_dtype": DTYPES[spec.state_dtype].dsl,  # the states' storage (h0, ht, pools); fp32 arithmetic
    }


def _prepare_warp_smem(spec: KernelSpec) -> int:
    """Shared memory of one prepare warp (templates/mma_sync/prepare.py.j2): its q and k tiles (16-bit,
    padded rows), the fold's kr, one 16-column block of g and beta (the small per-tile matrices reuse the q
    and k tiles). The anchored path (no safe gate) keeps its products in registers: the same bytes."""
    k = spec.head_dim_k
    per_warp = 2 * CHUNK * (k + 8) * 2  # q, k tiles (16-bit, padded rows)
    per_warp += CHUNK * k * 2  # kr (fp16, swizzled)
    per_warp += CHUNK * 16 * nbytes(spec.g_dtype) + CHUNK * 4  # a block of g, beta
    return per_warp


def _decode_stream_extra(spec: KernelSpec) -> int:
    # Shared memory of the streaming decode besides its state ring: the token ring (fp32 rows of q, k, decays,
    # v and beta), the per-stage slot records, the mbarriers, and alignment slack.
    row_bytes = row_words(spec.head_dim_k, spec.head_dim_v) * 4
    rows = DECODE_STAGERS * DECODE_TOKEN_STAGES
    return rows * row_bytes + DECODE_STREAM_MAX_STAGES * (16 + 16) + rows * 16 + 1024


# Tiles between the states the forward keeps for the backward (64 tokens, as FLA's chunk): the forward
# writes a quarter of the states a tile would need, and `bwd_tile` carries each through its run's tiles,
# S' = diag(gt) S + Akt^T R, one more 16-row product a tile.
BWD_STATE_TILES = 4


def bwd_state_tiles(spec: KernelSpec) -> int:
    """Tiles between the states the forward keeps for the spec's backward (`bwd_tile`'s runs)."""
    return BWD_STATE_TILES


def _bwd_tile_ring(spec: KernelSpec) -> int:
    """Tiles of rows in `bwd_tile`'s ring (2: the next tile's rows load during this one's products, 1: after
    its carry): the deeper ring unless it costs CTAs an SM (of those its registers are capped for) or does
    not fit a CTA (`kdagen.kernels.bwd_tile_shape`)."""
    k, v = spec.head_dim_k, spec.head_dim_v
    cap = spec.arch_info.smem_bytes_per_block

    def ctas(ring: int) -> int:
        smem = bwd_tile_shape.ring_smem_bytes(k, v, CHUNK, ring)
        return min((cap + 1024) // smem, bwd_tile_shape.min_ctas(k, v)) if smem <= cap else 0

    return 2 if ctas(2) >= max(1, ctas(1)) else 1


def _bwd_grads_ctas(spec: KernelSpec) -> int:
    """CTAs an SM the bwd_grads stage is compiled for: as many as its shared memory fits
    (`kdagen.kernels.bwd_grads_shape.smem_bytes`, plus the driver's 1 KB a CTA), but no more than leave
    BWD_GRADS_MIN_REGS registers a thread of its K threads."""
    k = spec.head_dim_k
    smem = bwd_grads_shape.smem_bytes(k, CHUNK) + 1024
    fit = (spec.arch_info.smem_bytes_per_block + 1024) // smem
    return max(1, min(fit, 65536 // (BWD_GRADS_MIN_REGS * k)))


def _prepare_layout(spec: KernelSpec) -> tuple[int, int]:
    """(value heads a prepare CTA, prepare CTAs an SM): the compiler caps registers to fit that many.

    The stage is latency-bound, so occupancy is what makes it fast, and shared memory per warp sets the
    ceiling. Four heads a CTA and at most four CTAs (16 warps, 128 registers a thread) is the most the
    register file allows without spilling the fragment-resident tile. Without the safe gate: the heads a CTA,
    of four, two or one, that put the most warps on an SM (four on sm_90a and sm_100a; more, smaller CTAs on
    sm_80 and sm_89, which are compiled here and never run: docs/experiments.md, "Prepare layout").
    """
    capacity = spec.arch_info.smem_bytes_per_block
    per_warp = _prepare_warp_smem(spec)
    # With the safe gate only four heads: the one layout measured with it.
    choices = (PREPARE_HEADS_PER_CTA,) if spec.safe_gate else (PREPARE_HEADS_PER_CTA, 2, 1)
    best = (0, PREPARE_HEADS_PER_CTA, 1)
    for heads in choices:
        ctas = min(16 // heads, capacity // (heads * per_warp + 1024))  # + the driver's reserve
        if heads * ctas > best[0]:
            best = (heads * ctas, heads, ctas)
    return best[1], best[2]


# Registers of the sequence-mode recurrence CTA, as ptxas reports them for the generated sm_90a code at
# K=V=128 (rounded up to the allocation unit of 8), and its warps. The planner needs them before anything is
# compiled to size prepare beside it; a template change that grows past them must update these.
_RECURRENCE_CTA = {"mma_sync": (4, 168), "wgmma": (5, 144)}  # (warps, registers a thread)
# A CTA's warps are spread over an SM's four sub-partitions and take their registers from that sub-partition's
# file (16384 of them), so what must fit is the busiest sub-partition, not the SM total.
_SUBPARTITIONS, _SUBPARTITION_REGS = 4, 16384


def _prepare_ctas_beside(family: str, ctas: int, prepare_regs: int) -> int:
    """Prepare CTAs per SM that leave room for one recurrence CTA on the same SM.

    What must fit is the busiest sub-partition: by SM totals, three prepare CTAs (96 registers x 128
    threads each) and one wgmma recurrence CTA (144 x 160) fit in 65536 registers, but the recurrence's fifth
    warp (its TMA producer) shares a sub-partition with a consumer warp, 2 x 144 x 32 + 3 x 96 x 32 = 18432 >
    16384, and the block scheduler then holds the recurrence until prepare ends (docs/experiments.md,
    "Prepare beside the recurrence").
    """
    warps, regs = _RECURRENCE_CTA[family]
    rec_busiest = -(-warps // _SUBPARTITIONS) * regs * 32
    prep_per_cta = -(-PREPARE_HEADS_PER_CTA // _SUBPARTITIONS) * prepare_regs * 32
    fit = (_SUBPARTITION_REGS - rec_busiest) // prep_per_cta
    return max(1, min(ctas - 1, fit))


def _ring_stage_bytes(k: int, v: int) -> int:
    """One stage of a wgmma ring (the fused kernel's and the recurrence's): kd, qd and Ak^T (CHUNK x K each),
    Aq (CHUNK x CHUNK) and the value rows (CHUNK x `v`) in 16 bits, gt (K, fp32)."""
    return 3 * CHUNK * k * 2 + CHUNK * CHUNK * 2 + CHUNK * v * 2 + k * 4


def _fused_smem_bytes(
    spec: KernelSpec, stages: int = FUSED_STAGES, prep_warps: int = FUSED_PREP_WARPS
) -> int:
    """Shared memory of one fused CTA (templates/wgmma/fused.py.j2): the ring (kd, qd, Ak, Aq, v, gt a stage)
    and each prepare warp's tiles (q and k in padded rows, fp16 kr, the whole g tile, beta, L, P^T, Mqk), plus
    the barriers, the chain queue (an entry of 8 words and the head's dt_bias and exp(A_log) a slot) and the
    1 KB alignment of the four wgmma images."""
    k, v = spec.head_dim_k, spec.head_dim_v
    stage = _ring_stage_bytes(k, v)
    per_warp = (2 * CHUNK * (k + 8) * 2 + CHUNK * k * 2 + CHUNK * (k + 8) * nbytes(spec.g_dtype) + CHUNK * 4
                + CHUNK * CHUNK * 10)  # L and Mqk (fp32), P^T (fp16)
    queue = FUSED_QUEUE * (2 * 8 + 9 * 4 + k * 4)
    return stages * stage + prep_warps * per_warp + 2 * stages * 8 + queue + 4 * 1024


# Staged state stores (`kdagen.kernels.state_copy`) in at most this many rounds: each round after the first
# waits for the tensor copy before it to have read the buffer, on the chain. An fp32 pool beside the
# six-stage ring takes four: checkpoints every 64 tokens +9.5-12.6% on an H200, against +17-18% stored from
# the accumulators (docs/experiments.md, "Checkpoints: where the time goes, one tensor copy a round").
STAGING_MAX_ROUNDS = 4


def _recurrence_smem_bytes(spec: KernelSpec, stages: int) -> int:
    """Shared memory of one wgmma recurrence CTA (templates/wgmma/recurrence.py.j2) but its staging buffer:
    the ring (kd, qd, Ak, Aq, the V-slice and gt a stage), the 1 KB alignment of its four wgmma images and the
    barriers."""
    stage = _ring_stage_bytes(spec.head_dim_k, min(BLOCK_V, spec.head_dim_v))
    return stages * stage + 4 * 1024 + 2 * stages * 8


def _recurrence_staging(spec: KernelSpec, stages: int, beside: int, heads: int) -> dict[str, Any]:
    """The wgmma recurrence's staged state stores: the pool's (checkpoints, final states) in `pool_rounds`
    rounds of one buffer (`_staging`), in the shared memory that an SM leaves it beside `beside` prepare CTAs
    of `heads` warps, so that staging never keeps it from running beside prepare. Tile states (the
    backward's, one every run) are stored from the accumulators: the recomputing backward takes them from
    `bwd_recurrence`, which stages nothing, and staging them in the forward that keeps them
    (recompute=False) is not measured (docs/experiments.md, "Checkpoints and tile states staged in the
    two-stage recurrence")."""
    arch = spec.arch_info
    prepare = beside * (heads * _prepare_warp_smem(spec) + 1024)
    free = min(arch.smem_bytes_per_sm - prepare, arch.smem_bytes_per_block + 1024)
    staging = _staging(spec, free - 1024 - _recurrence_smem_bytes(spec, stages), 1)
    return {"pool_rounds": staging["pool_rounds"]}


def _staging(spec: KernelSpec, free: int, buffers: int) -> dict[str, Any]:
    """A kernel's staged state stores (the fused kernel's, the wgmma recurrence's), with `free` bytes of
    shared memory left and `buffers` consumer warpgroups: the rounds of each kind of store, the pool's
    (checkpoints and final states, in the state dtype: `pool_rounds`) and the backward's tile states (in the
    MMA type: `tiles_rounds`), the fewest in which `buffers` boxes fit, up to STAGING_MAX_ROUNDS; 0: stored
    from the accumulators (also where the target has no TMA). The buffer takes the larger kind's box."""
    free -= 1024  # the buffer's alignment (the swizzle's pattern)
    bv, k, kv = min(BLOCK_V, spec.head_dim_v), spec.head_dim_k, spec.state_layout == "kv"

    def rounds(width: int) -> int:
        if not spec.arch_info.has_bulk_copy:
            return 0
        r = staging_shape.staging_rounds(free, buffers, width, bv, k, kv)
        return r if r <= STAGING_MAX_ROUNDS else 0

    return {"pool_rounds": rounds(8 * nbytes(spec.state_dtype)),
            "tiles_rounds": rounds(8 * nbytes(spec.dtype))}


def _staging_note(params: dict[str, Any]) -> str:
    """The stage note's words on its staged state stores (`_staging`)."""
    kinds = [f"{name} in {_count(params[key], 'round')}"
             for key, name in (("pool_rounds", "the pool's states"), ("tiles_rounds", "tile states"))
             if params.get(key)]
    if not kinds:
        return ""
    return f"; {' and '.join(kinds)} staged in shared memory and copied out by TMA"


def _has_fused(family: str, spec: KernelSpec) -> bool:
    """The fused kernel exists for the wgmma family with the safe gate, where one CTA fits the target's shared
    memory. Without the safe gate it builds and passes the GPU tests, but runs ~1.9x slower than the two-stage
    path: its four prepare warps a CTA set the pace, and the anchored tile is longer than the safe one
    (docs/experiments.md, "Fused kernel without the safe gate")."""
    return (family == "wgmma" and spec.safe_gate
            and _fused_smem_bytes(spec) <= spec.arch_info.smem_bytes_per_block)


def _pair_prep_warps(spec: KernelSpec) -> int | None:
    """Prepare warps a CTA of the pair form: four where the 8-stage ring fits beside them (bf16 g at K=128,
    224 KB), else three (fp32 g: 218 KB), which step a little slower (docs/experiments.md, "Pair form: prepare
    warps"); None where the form does not apply (it needs two 64-row value blocks to split, V = 128)."""
    if spec.head_dim_v != 2 * BLOCK_V:
        return None
    limit = spec.arch_info.smem_bytes_per_block
    for warps in (FUSED_PREP_WARPS, FUSED_PREP_WARPS - 1):
        if _fused_smem_bytes(spec, FUSED_PAIR_STAGES, warps) <= limit:
            return warps
    return None


def _merge_params(spec: KernelSpec) -> dict:
    """The CP merge walks the segment maps one after another, so its step latency is what counts.

    One m16 row block of S^T per CTA (V/16 CTAs per head walk the chain side by side), its K columns split
    16 to a warp, and each map M_j (bf16 hi and lo planes, 64 KB at K=128) prefetched into shared memory as
    many steps ahead as the target's shared memory holds, up to two: three buffers at K=128 on
    sm_90a/sm_100a, two on sm_80, one (no prefetch) on sm_89.
    """
    k = spec.head_dim_k
    rows = 16  # S^T rows per CTA: one m16 block
    map_bytes = k * k * 4  # bf16 hi and lo planes
    a_bytes = 2 * rows * k * 2 + 2048  # the bf16 hi/lo A operand, and alignment slack
    stages = max(1, min(3, (spec.arch_info.smem_bytes_per_block - a_bytes) // map_bytes))
    return {
        "head_dim_k": k,
        "head_dim_v": spec.head_dim_v,
        "state_layout": spec.state_layout,
        "state_dtype": DTYPES[spec.state_dtype].dsl,
        "block_v": rows,
        "warps": k // 16,  # two n8 column tiles a warp
        "stages": stages,
    }


def make_plan(spec: KernelSpec) -> Plan:
    family, reason, summary = _choose_family(spec)
    fused = _has_fused(family, spec)
    pair_warps = _pair_prep_warps(spec) if fused else None
    pair = pair_warps is not None
    if fused:
        reason += "; with a fused prepare + recurrence kernel, run when the chains fill the SMs (setup picks)"
        summary += "; fused kernel when the chains fill the SMs"
    if pair:
        reason += ", in CTA pairs when they fill half"
        summary += ", CTA pairs at half"
    common = _common_params(spec)
    heads, ctas = _prepare_layout(spec)
    # Programmatic dependent launch lets the recurrence start while prepare runs (sm_90 and later); without it
    # the recurrence starts when prepare ends, and the ready flags are then always set.
    pdl = spec.arch_info.has_pdl
    # Registers are capped for one prepare CTA more than fit alone when the recurrence may run beside it (96 a
    # thread at four CTAs; ptxas spills ~48 bytes); the cap is 65536 over the CTAs' threads, rounded down to
    # the allocation unit of 8.
    min_ctas = ctas + 1 if pdl else ctas
    prepare_regs = min(255, 65536 // (32 * heads * min_ctas)) // 8 * 8
    # Beside the recurrence, prepare leaves room for one recurrence CTA. Not with fewer heads a CTA: its CTAs
    # fill an SM's shared memory and registers, and a recurrence CTA could only start where most of them were
    # left out, so prepare keeps the SMs and the recurrence follows as they free up.
    beside = _prepare_ctas_beside(family, ctas, prepare_regs) if pdl and heads == PREPARE_HEADS_PER_CTA \
        else ctas
    # Templates of the stages both families share (prepare, intra-card CP): the wgmma family differs in the
    # recurrence only.
    shared = "mma_sync"
    prepare = StagePlan(
        name="prepare",
        template=f"{shared}/prepare.py.j2",
        params={
            **common,
            "gate": spec.gate,
            "lower_bound": spec.lower_bound,
            "safe_gate": spec.safe_gate,
            "l2norm_qk": spec.l2norm_qk,
            "g_dtype": DTYPES[spec.g_dtype].dsl,
            "beta_dtype": DTYPES[spec.beta_dtype].dsl,
            # How beta is given (prob, logit, logit_x2): `kernels.gate.beta_value` where beta is loaded.
            "beta": spec.beta,
            "heads_per_cta": heads,
            # The persistent grid: CTAs per SM when prepare runs alone (shared memory decides) ...
            "ctas_per_sm": ctas,
            # ... and when the recurrence runs beside it: fewer, which leave an SM the shared memory of one
            # recurrence CTA (~31 KB mma_sync, ~48 KB wgmma) and its registers (one prepare CTA fewer for
            # mma_sync, two for wgmma: `_prepare_ctas_beside`) ...
            "overlap_ctas_per_sm": beside,
            # ... for which registers are capped (`prepare_regs`).
            "min_ctas_per_sm": min_ctas,
            "pdl": pdl,
            # Column blocks per trip of the rolled block loop (1: smallest code; the instruction cache is the
            # limit at 16 warps per SM).
            "unroll_kb": 1,
            # With a fused kernel, forward's prepare exits at once when the setup kernel chose it.
            "fused": fused,
        },
        note=f"chunk-parallel, {CHUNK}-token steps: {_count(heads, 'value head')} a CTA (a warp each), "
        f"{_count(ctas, 'CTA')} an SM" + (f" alone, {beside} beside the recurrence" if pdl else ""),
    )
    block_v = min(BLOCK_V, spec.head_dim_v)
    rec_params = {
        **common,
        "block_v": block_v,
        # Two stages hide one step's loads behind the previous step's math; each is ~15 KB at K=128.
        "stages": 2,
        "state_layout": spec.state_layout,
    }
    # The recurrence runs beside prepare (programmatic dependent launch, per-tile ready flags) and checks the
    # flags of 8 steps at once: one flag wait (an L2 round trip on the serial chain) per 8 steps.
    seq_params = {**rec_params, "mode": "seq", "ready_group": 8, "pdl": pdl, "fused": fused}
    if family == "wgmma":
        # Its producer warp fills stages as soon as they are free: three keep two steps of loads in flight.
        seq_params["stages"] = 3
        # The pool's checkpoints and final states staged for a tensor copy, off the chain, as in the fused
        # kernel.
        seq_params.update(_recurrence_staging(spec, 3, beside, heads))
    # The recurrence is compiled into `forward` (below), not launched on its own.
    recurrence = StagePlan(
        "recurrence",
        f"{family}/recurrence.py.j2",
        seq_params,
        compiled=False,
        note=f"the serial chain per (sequence, head): {block_v} value rows a CTA, "
        f"a {seq_params['stages']}-stage load pipeline" + _staging_note(seq_params),
    )
    # The backward's states come from a recurrence run beside its reverse scan (`bwd_states`), where a
    # staging buffer slows it (docs/experiments.md, "Checkpoints and tile states staged in the two-stage
    # recurrence"): there the recurrence stages nothing, and it writes no pool checkpoints anyway.
    bwd_recurrence = None
    if seq_params.get("pool_rounds"):
        bwd_recurrence = StagePlan(
            "bwd_recurrence",
            f"{family}/recurrence.py.j2",
            {**seq_params, "pool_rounds": 0},
            compiled=False,
            note=f"the recurrence of `bwd_states`: {block_v} value rows a CTA, a "
            f"{seq_params['stages']}-stage load pipeline, its states stored from the accumulators",
        )
    # The whole-sequence path in one host call: the ready flags zeroed and, when the runtime asks for it
    # (KDAKernel._by_length), the sequences ranked longest first; then prepare and the recurrence beside it.
    forward = StagePlan(
        "forward",
        "common/forward.py.j2",
        {
            **common,
            "gate": spec.gate,
            "g_dtype": DTYPES[spec.g_dtype].dsl,
            "beta_dtype": DTYPES[spec.beta_dtype].dsl,
            "state_layout": spec.state_layout,
            "max_seqs": MAX_RANKED_SEQS,
            "workspace_row": WORKSPACE_ROW,  # bytes per row of the call's workspace
            "fused": fused,
            "fused_margin": FUSED_MARGIN,
            "fused_fill_steps": FUSED_FILL_STEPS,
            "fused_pair": pair,
        },
        note="the entry point: a setup kernel (ready flags, sequence order, path choice), then prepare and "
        + ("the recurrence beside it" if pdl else "the recurrence after it")
        + (", or the fused kernel" if fused else ""),
    )
    # The fused kernel, compiled into `forward` beside the two-stage path (its setup kernel picks one a call).
    fused_params = {
        **prepare.params,
        "block_v": BLOCK_V,
        "state_layout": spec.state_layout,
        "prep_warps": FUSED_PREP_WARPS,
        "stages": FUSED_STAGES,
        "queue": FUSED_QUEUE,
        "unroll_kb": FUSED_UNROLL_KB,
        "pair": False,
        # The state stores' staging: a buffer for each of its V / 64 consumer warpgroups, in the shared memory
        # the ring and the prepare warps leave.
        **_staging(spec, spec.arch_info.smem_bytes_per_block - _fused_smem_bytes(spec),
                   spec.head_dim_v // BLOCK_V),
    }
    fused_stage = StagePlan(
        "fused",
        "wgmma/fused.py.j2",
        fused_params,
        compiled=False,
        note=f"prepare and the recurrence in one persistent kernel: {FUSED_PREP_WARPS} prepare warps, "
        f"{FUSED_STAGES} ring stages" + _staging_note(fused_params),
    )
    # Its pair form (a CTA cluster a chain), compiled into `forward` too where the variant has it.
    pair_params = {**fused_params, "stages": FUSED_PAIR_STAGES, "pair": True, "prep_warps": pair_warps,
                   **_staging(spec, spec.arch_info.smem_bytes_per_block
                              - _fused_smem_bytes(spec, FUSED_PAIR_STAGES, pair_warps or 1), 1)}
    pair_stage = StagePlan(
        "fused_pair",
        "wgmma/fused.py.j2",
        pair_params,
        compiled=False,
        note=f"the fused kernel with a CTA pair a chain: {pair_warps} prepare warps a CTA, "
        f"{FUSED_PAIR_STAGES} ring stages" + _staging_note(pair_params),
    )
    # Intra-card context parallelism (fast-kda.md §D), used at run time when few long sequences leave most
    # SMs idle in the serial recurrence: segment maps, their merge, and the segment pass (after prepare).
    prescan = StagePlan(
        "cp_prescan", f"{shared}/recurrence.py.j2", {**rec_params, "mode": "prescan"},
        note="intra-card CP: each segment's affine state map",
    )
    merge_params = {**_merge_params(spec), "reverse": False}
    merge = StagePlan(
        "cp_merge", f"{shared}/cp_merge.py.j2", merge_params,
        note=f"intra-card CP: the maps combined in order, {_count(merge_params['stages'], 'map buffer')} in "
        "shared memory",
    )
    segments = StagePlan(
        "cp_segments", f"{shared}/recurrence.py.j2", {**rec_params, "mode": "segment"},
        note="intra-card CP: each segment's pass from its merged initial state",
    )
    fused_stages = ((fused_stage,) if fused else ()) + ((pair_stage,) if pair else ())
    # Decode and speculative-decode verify on a slot-indexed pool (templates/common/decode.py.j2): every
    # family's, since it uses no tensor cores (the state column in registers). Where the streaming stage
    # below exists (targets with bulk copies) the runtime takes this one for calls of few items only
    # (`kdagen.policy.decode_streams`), as narrow CTAs; elsewhere for every call, as wide ones.
    slot_bytes = spec.head_dim_k * spec.head_dim_v * DTYPES[spec.state_dtype].nbytes
    block_v, key_split = DECODE_NARROW_CTA if spec.arch_info.has_bulk_copy else DECODE_WIDE_CTA
    block_v = min(block_v, spec.head_dim_v)
    decode = StagePlan(
        "decode",
        "common/decode.py.j2",
        {
            **common,
            "gate": spec.gate,
            "lower_bound": spec.lower_bound,
            "l2norm_qk": spec.l2norm_qk,
            "g_dtype": DTYPES[spec.g_dtype].dsl,
            "beta_dtype": DTYPES[spec.beta_dtype].dsl,
            "beta": spec.beta,
            "state_layout": spec.state_layout,
            "block_v": block_v,
            "key_split": key_split,
            "partial_sums": DECODE_PARTIAL_SUMS,
            "state_bytes": DTYPES[spec.state_dtype].nbytes,
        },
        note=f"decode: a few tokens a request on a slot-indexed state pool, in place; {block_v} value "
        f"columns a CTA, {_count(key_split, 'thread')} a column"
        + (" (the calls of few requests)" if key_split > 1 else ""),
    )
    # Streaming decode (templates/common/decode_stream.py.j2), for calls with many (request, value head)
    # items: a persistent CTA an SM whose loader warp bulk-copies the items' states into a ring as deep as
    # shared memory allows while the consumers work on earlier ones. Targets with bulk copies; the runtime
    # takes it wherever it exists (`kdagen.policy.decode_streams`), the per-item stage otherwise.
    stream_stages = 0
    if spec.arch_info.has_bulk_copy:
        ring_bytes = spec.arch_info.smem_bytes_per_block - _decode_stream_extra(spec)
        stream_stages = min(DECODE_STREAM_MAX_STAGES, ring_bytes // slot_bytes)
    decode_stream = (StagePlan(
        "decode_stream",
        "common/decode_stream.py.j2",
        {
            **{key: val for key, val in decode.params.items() if key not in ("block_v", "key_split")},
            "stages": stream_stages,
            "stagers": DECODE_STAGERS,
            "token_stages": DECODE_TOKEN_STAGES,
        },
        note=f"decode, taken wherever it exists: a persistent grid streaming {stream_stages} states ahead "
        "through shared memory",
    ),) if stream_stages >= 2 else ()
    # The backward's prepare (templates/mma_sync/bwd_prepare.py.j2): the variant's prepare kernel, which also
    # writes every tile's Mqk and Akk for bwd_grads (formed once, on tensor cores, instead of again there).
    bwd_prepare = StagePlan(
        "bwd_prepare", f"{shared}/bwd_prepare.py.j2", {**common, "gate": spec.gate},
        note="backward: prepare, also writing every tile's intra-tile matrices (Mqk, Akk) for bwd_grads",
    )
    # The backward's reverse state scan (templates/mma_sync/bwd_scan.py.j2): the forward recurrence's shape
    # run last step to first on prepare's tiles and dO, in every family (it has the recurrence's products).
    bwd_scan = StagePlan(
        "bwd_scan", f"{shared}/bwd_scan.py.j2", {**rec_params, "mode": "seq"},
        note=f"backward: the reverse scan of the state's gradient, {block_v} value rows a CTA",
    )
    # The states entering bwd_tile's runs, recomputed by the variant's recurrence alone on bwd_prepare's tiles
    # (templates/common/bwd_states.py.j2), beside the reverse scan.
    bwd_states = StagePlan(
        "bwd_states", "common/bwd_states.py.j2",
        {**common, "recurrence": bwd_recurrence.name if bwd_recurrence else recurrence.name},
        note=f"backward: the recurrence alone on bwd_prepare's tiles, keeping the state entering every "
             f"{bwd_state_tiles(spec) * CHUNK} tokens, beside the reverse scan",
    )
    # Its intra-card CP, when the forward's schedule splits the sequences into segments (the scan's serial
    # chain is the forward's, step for step): each segment's map of the gradient, the maps combined last
    # segment to first (the forward's merge walking backward, from the final states' fp32 gradient), and each
    # segment's pass from its merged gradient.
    bwd_prescan = StagePlan(
        "bwd_cp_prescan", f"{shared}/bwd_scan.py.j2", {**rec_params, "mode": "prescan"},
        note="backward, intra-card CP: each segment's affine map of the state's gradient",
    )
    bwd_merge = StagePlan(
        "bwd_cp_merge", f"{shared}/cp_merge.py.j2",
        {**merge_params, "state_dtype": "Float32", "reverse": True},
        note="backward, intra-card CP: the maps combined last segment to first",
    )
    bwd_segments = StagePlan(
        "bwd_cp_segments", f"{shared}/bwd_scan.py.j2", {**rec_params, "mode": "segment"},
        note="backward, intra-card CP: each segment's reverse scan from its merged gradient",
    )
    # The backward's products with the states, one CTA a run of BWD_STATE_TILES tiles and head
    # (templates/mma_sync/bwd_tile.py.j2): the forward keeps the state entering every run, not every tile.
    bwd_tile = StagePlan(
        "bwd_tile", f"{shared}/bwd_tile.py.j2",
        {**common, "state_layout": spec.state_layout, "state_tiles": bwd_state_tiles(spec),
         "ring": _bwd_tile_ring(spec)},
        note=f"backward: {bwd_state_tiles(spec)} tiles' products with their states, carried from the one "
             "entering the first, one CTA a run and head",
    )
    # The backward's per-tile algebra after bwd_tile, down to the inputs' transforms
    # (templates/common/bwd_grads.py.j2): 16 x 16 and 16 x K products in fp32 on CUDA cores, every family.
    bwd_grads = StagePlan(
        "bwd_grads", "common/bwd_grads.py.j2",
        {
            **common,
            "gate": spec.gate,
            "lower_bound": spec.lower_bound,
            "l2norm_qk": spec.l2norm_qk,
            "g_dtype": DTYPES[spec.g_dtype].dsl,
            "beta_dtype": DTYPES[spec.beta_dtype].dsl,
            "beta": spec.beta,
            "safe_gate": spec.safe_gate,
            "min_ctas": _bwd_grads_ctas(spec),
        },
        note="backward: a tile's gradients of the inputs from its products, one CTA a tile and q/k head",
    )
    bwd_imported = (bwd_recurrence,) if bwd_recurrence else ()
    stages = (prepare, recurrence, *fused_stages, forward, prescan, merge, segments, decode, *decode_stream,
              bwd_prepare, *bwd_imported, bwd_states, bwd_scan, bwd_prescan, bwd_merge, bwd_segments,
              bwd_tile, bwd_grads)
    return Plan(family=family, reason=reason, stages=stages, summary=summary)
