"""Run-time scheduling of a forward call: the policy object and the decisions made from it.

A whole-sequence call runs prepare and the recurrence (side by side or one after the other), or the fused
prepare + recurrence kernel (one CTA a chain, or a CTA pair a chain), or intra-card context parallelism (CP:
sequences cut into segments whose affine state maps are merged). Which one, and in what order the sequences
are taken, is decided here, per call, from what the host knows without reading the device: the number of
sequences N, the total tokens, the value heads HV, the device's SM count, and facts of the variant's plan
(`PlanFacts`). Every function below is pure, so the choices are unit-tested on the CPU and re-evaluated
against a recorded GPU sweep (`benchmarks/bench_policy.py --check`).

`SchedulePolicy` says, per switch, "auto" (the decision functions choose) or a forced choice. A kernel holds
one (`KDAKernel.policy`, default `default_policy()`); `KDAKernel.with_policy(p)` returns a view with another,
and a call takes ``policy=`` for itself. The environment variables ``KDAGEN_INTRACARD_CP``,
``KDAGEN_OVERLAP``, ``KDAGEN_FUSED``, ``KDAGEN_FUSED_PAIR``, ``KDAGEN_SEQ_ORDER`` and
``KDAGEN_DECODE_STREAM`` are an override for experiments: `default_policy()` reads them once (at its first
use in the process) and never again.

The intra-card CP choice is a cost model (`CostModel`): the estimated time of the whole-sequence path and of
CP at each candidate segment length, from the sizes; the cheapest wins. Its constants are per-step costs in
microseconds, fitted to a sweep (docs/experiments.md, 'Intra-card CP segment length').
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

from kdagen import paths
from kdagen.plan import CHUNK, MAX_RANKED_SEQS

if TYPE_CHECKING:
    from kdagen.plan import Plan
    from kdagen.spec import KernelSpec

__all__ = [
    "SchedulePolicy",
    "AUTO",
    "default_policy",
    "PlanFacts",
    "CostModel",
    "COSTS",
    "Schedule",
    "schedule",
    "cp_segment_len",
    "cp_candidates",
    "whole_time_us",
    "two_stage_time_us",
    "fused_time_us",
    "cp_time_us",
    "fused_args",
    "pair_step_limit",
    "device_picks_fused",
    "by_length",
    "overlap",
    "decode_parts",
    "decode_streams",
]

_TOGGLE = ("auto", "on", "off")
_ORDER = ("auto", "length", "input")
# Most value parts a streaming-decode item splits into (`decode_parts`): 16 value columns a part at V = 128.
DECODE_MAX_PARTS = 8
# Where "auto" takes the per-item decode stage's narrow CTAs over the streaming grid (`decode_streams`): a
# K-first state up to this many items (request, value head) an SM, and an fp32 one up to
# DECODE_PER_ITEM_KV_LONG items an SM from DECODE_LONG_TOKENS tokens a request; a V-first one up to
# DECODE_PER_ITEM_VK items an SM at one token a request, and at every size from two tokens.
DECODE_PER_ITEM_KV = 1
DECODE_PER_ITEM_KV_LONG = 2
DECODE_LONG_TOKENS = 4
DECODE_PER_ITEM_VK = 16
# The streaming decode returns a request's final state, or a verify token's states, through its ring stage
# (bulk copies) from this many items a CTA; below, the consumers store them word by word
# (`decode_staged_store`).
DECODE_STAGED_MIN_ITEMS = 16


def _choices(values: tuple[str, ...]) -> str:
    return ", ".join(repr(c) for c in values[:-1]) + f" or {values[-1]!r}"


@dataclass(frozen=True)
class SchedulePolicy:
    """How a forward call is scheduled; every field "auto" lets the decision functions choose.

    - ``intracard_cp``: "auto", "off" (whole sequences), or a segment length in tokens (a positive multiple
      of 16) that forces intra-card context parallelism with that length.
    - ``overlap``: "auto" (the recurrence starts beside prepare when its grid fits one CTA per SM), "on"
      (always, except under CP), "off" (the recurrence waits for prepare's CTAs to leave the SMs).
    - ``fused``: "auto" (where the variant has the fused kernel, the setup kernel picks it from the lengths
      when the host's bound allows), "on" (on every whole-sequence call), "off" (prepare and the recurrence).
    - ``fused_pair``: "auto" and "on" (the fused kernel runs in CTA pairs on calls whose chains get a pair
      each at once, where the variant has the pair form), "off" (one CTA a chain always).
    - ``seq_order``: "auto" (longest first when the recurrence grid does not fit the SMs at once), "length"
      (longest first whenever there are 2 to 4096 sequences), "input" (the order of ``cu_seqlens``).
    - ``decode_stream``: "auto" (a decode call runs the streaming decode stage where the variant has it,
      but for calls of few items; `decode_streams`), "on" (the streaming stage where the variant has it),
      "off" (the one-CTA-an-item decode stage).

    Validated on construction (`ValueError` naming the field). Frozen and hashable: a kernel caches its
    decisions per policy and call size.
    """

    intracard_cp: str | int = "auto"
    overlap: str = "auto"
    fused: str = "auto"
    fused_pair: str = "auto"
    seq_order: str = "auto"
    decode_stream: str = "auto"

    def __post_init__(self) -> None:
        cp = self.intracard_cp
        if isinstance(cp, bool) or not (
            cp in ("auto", "off") or (isinstance(cp, int) and cp > 0 and cp % CHUNK == 0)
        ):
            raise ValueError(f"intracard_cp: expected 'auto', 'off' or a positive multiple of {CHUNK} "
                             f"(a segment length in tokens), got {cp!r}")
        for name, allowed in (("overlap", _TOGGLE), ("fused", _TOGGLE), ("fused_pair", _TOGGLE),
                              ("seq_order", _ORDER), ("decode_stream", _TOGGLE)):
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"{name}: expected {_choices(allowed)}, got {value!r}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> SchedulePolicy:
        """The policy the ``KDAGEN_*`` scheduling variables describe (unset or empty: "auto"); `ValueError`
        names the variable whose value is invalid. Reads `environ` (default ``os.environ``) now."""
        raw = paths.schedule_env(os.environ if environ is None else environ)
        values: dict[str, Any] = {}
        for name, var in paths.SCHEDULE_ENV.items():
            value = raw.get(name)
            if value is None:
                continue
            if name == "intracard_cp" and value.isdigit():
                values[name] = int(value)
            else:
                values[name] = value
            try:
                cls(**{name: values[name]})
            except ValueError as e:
                raise ValueError(f"{var}: {str(e).split(': ', 1)[1]}") from None
        return cls(**values)

    @classmethod
    def coerce(cls, value: SchedulePolicy | Mapping[str, Any] | None) -> SchedulePolicy | None:
        """`value` as a policy: a policy as is, a mapping of fields as ``SchedulePolicy(**value)``."""
        if value is None or isinstance(value, SchedulePolicy):
            return value
        if isinstance(value, Mapping):
            return cls(**value)
        raise TypeError(
            f"policy: expected a SchedulePolicy or a dict of its fields, got {type(value).__name__}")

    def replace(self, **changes: Any) -> SchedulePolicy:
        """A copy with `changes` (validated)."""
        return replace(self, **changes)

    def label(self) -> str:
        """The forced fields as ``name=value`` joined by commas, or ``auto`` when every field is "auto"."""
        values = ((f.name, getattr(self, f.name)) for f in fields(self))
        forced = [f"{name}={value}" for name, value in values if value != "auto"]
        return ",".join(forced) or "auto"

    @classmethod
    def from_label(cls, label: str) -> SchedulePolicy:
        """The inverse of `label`: ``auto`` or ``name=value[,name=value...]``."""
        if label.strip() in ("", "auto"):
            return cls()
        values: dict[str, Any] = {}
        for part in label.split(","):
            name, sep, value = part.partition("=")
            name, value = name.strip(), value.strip()
            if not sep or name not in cls.__dataclass_fields__:
                raise ValueError(
                    f"policy label: expected name=value with a field of SchedulePolicy, got {part!r}")
            values[name] = int(value) if name == "intracard_cp" and value.isdigit() else value
        return cls(**values)


AUTO = SchedulePolicy()


@functools.cache
def default_policy() -> SchedulePolicy:
    """The policy of kernels that are given none: the ``KDAGEN_*`` scheduling variables if set, else all
    "auto". Read once per process, at the first call (``default_policy.cache_clear()`` re-reads them)."""
    return SchedulePolicy.from_env()


# ---------------------------------------------------------------------------------------------------------
# facts of a variant's plan, the cost model
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlanFacts:
    """What the decisions need of a variant's plan."""

    v_slices: int = 2  # recurrence CTAs per (sequence, value head): V / block_v
    head_dim_v: int = 128
    prepare_heads_per_cta: int = 4  # prepare's CTAs cover this many heads (a call's heads round up to it)
    fused_margin: float | None = None  # None: the variant has no fused kernel
    fused_fill: int = 0  # steps to fill the fused kernel's ring (the setup kernel's F)
    pair: bool = False  # the fused kernel has its CTA-pair form

    @classmethod
    def from_plan(cls, spec: KernelSpec, plan: Plan) -> PlanFacts:
        params = {s.name: s.params for s in plan.stages}
        fwd = params["forward"]
        fused, pair = bool(fwd.get("fused")), bool(fwd.get("fused_pair"))
        return cls(
            v_slices=spec.head_dim_v // params["recurrence"]["block_v"],
            head_dim_v=spec.head_dim_v,
            prepare_heads_per_cta=params["prepare"]["heads_per_cta"],
            fused_margin=fwd["fused_margin"] if fused else None,
            fused_fill=fwd["fused_fill_steps"] if fused else 0,
            pair=fused and pair,
        )


@dataclass(frozen=True)
class CostModel:
    """Estimated times (microseconds) of the paths of a call, for choosing among them; the constants are
    least-squares fits to a sweep of `benchmarks/bench_policy.py` on an H100 (K=V=128, bf16, 132 SMs).

    Sizes: steps = mean tokens per sequence / 16; `load` = a grid's CTAs / SMs; prepare's work = tokens x
    value heads rounded up to prepare's heads a CTA, per SM (`_prepare_k`, thousands).
    - Two-stage path (prepare beside the recurrence): fixed + waves x steps x (step + step_load x load)
      + prepare, plus the wait of the sequences that prepare reaches late ((N - 1) / N of prepare).
    - Fused kernel: fixed + waves x (steps + fill) x step, one CTA a chain; in CTA pairs, one wave.
    - Intra-card CP with segments of L tokens: fixed + L / 16 x (step + step_load x min(load, 1)
      + step_wave x (load - 1 where over 1)) over the segment CTAs + merge step x segments per sequence (in
      waves of the merge grid) + prepare alone.
    CP is taken where its estimate is at most `cp_margin` of the whole-sequence path's, at candidate lengths
    near `segment_lengths` (the lengths the sweep measures); among candidates within `cp_tie` of the
    cheapest, the longest (fewer segments: less map memory, and the estimates are good to a few percent)
    (docs/experiments.md, 'Intra-card CP segment length').
    """

    step_us: float = 0.548
    step_load_us: float = 0.1265
    prepare_sm_ns: float = 75.8
    prepare_wait_sm_ns: float = 11.8
    two_stage_fixed_us: float = 11.9
    fused_step_us: float = 1.66
    fused_fixed_us: float = 9.0
    pair_step_us: float = 1.018
    pair_fixed_us: float = 13.0
    cp_step_us: float = 1.129
    cp_step_load_us: float = 1.665
    cp_step_wave_us: float = 1.965
    merge_step_us: float = 1.509
    cp_prepare_sm_ns: float = 22.53
    cp_fixed_us: float = 14.4
    cp_margin: float = 1.0
    cp_tie: float = 0.03
    segment_lengths: tuple[int, ...] = field(default=(1024, 2048, 4096, 8192, 16384))


COSTS = CostModel()


def _steps(tokens: float) -> float:
    return max(1.0, tokens / CHUNK)


def _prepare_k(total: int, hv: int, sms: int, facts: PlanFacts) -> float:
    """Prepare's work per SM in thousands of token-heads (heads rounded up to prepare's heads a CTA)."""
    per_cta = facts.prepare_heads_per_cta
    return total * (-(-hv // per_cta) * per_cta) / sms / 1000.0


def two_stage_time_us(nseq: int, total: int, hv: int, sms: int, facts: PlanFacts,
                      costs: CostModel = COSTS) -> float:
    """Estimated time of prepare and the recurrence beside it (sequences of the mean length)."""
    steps = _steps(total / nseq)
    ctas = nseq * hv * facts.v_slices
    waves = math.ceil(ctas / sms)
    load = min(ctas, sms) / sms
    prep = _prepare_k(total, hv, sms, facts)
    return (costs.two_stage_fixed_us + waves * steps * (costs.step_us + costs.step_load_us * load)
            + prep * (costs.prepare_sm_ns + costs.prepare_wait_sm_ns * (nseq - 1) / nseq))


def fused_time_us(nseq: int, total: int, hv: int, sms: int, facts: PlanFacts, pair: bool,
                  costs: CostModel = COSTS) -> float:
    """Estimated time of the fused kernel, one CTA a chain or (`pair`) a CTA pair a chain."""
    steps = _steps(total / nseq) + facts.fused_fill
    if pair:
        return costs.pair_fixed_us + steps * costs.pair_step_us
    return costs.fused_fixed_us + math.ceil(nseq * hv / sms) * steps * costs.fused_step_us


def whole_time_us(nseq: int, total: int, hv: int, sms: int, facts: PlanFacts, costs: CostModel = COSTS,
                  policy: SchedulePolicy = AUTO) -> float:
    """Estimated time of the whole-sequence path the call takes (the setup kernel's pick resolved for
    sequences of the mean length)."""
    args = fused_args(nseq, hv, total, sms, facts, policy, costs)
    pair_steps = args[2] if len(args) > 2 else 0
    if args and (args[0] == 2 or (args[0] == 1 and device_picks_fused(
            (total / nseq,) * nseq, hv, sms, facts, pair_steps))):
        return fused_time_us(nseq, total, hv, sms, facts, pair_steps > 0, costs)
    return two_stage_time_us(nseq, total, hv, sms, facts, costs)


def cp_time_us(nseq: int, total: int, hv: int, sms: int, seg_len: int, facts: PlanFacts,
               costs: CostModel = COSTS) -> float:
    """Estimated time of intra-card CP with segments of `seg_len` tokens (sequences of the mean length):
    prepare alone, the prescan and segment passes, the merge."""
    segments = max(1, math.ceil(total / nseq / seg_len))
    load = nseq * segments * hv * facts.v_slices / sms
    passes = _steps(seg_len) * (costs.cp_step_us + costs.cp_step_load_us * min(load, 1.0)
                                + costs.cp_step_wave_us * max(load - 1.0, 0.0))
    merge_waves = math.ceil(nseq * hv * max(1, facts.head_dim_v // 16) / sms)
    return (costs.cp_fixed_us + passes + segments * merge_waves * costs.merge_step_us
            + _prepare_k(total, hv, sms, facts) * costs.cp_prepare_sm_ns)


def cp_candidates(nseq: int, total: int, costs: CostModel = COSTS) -> list[int]:
    """Segment lengths the cost model weighs: for each of `costs.segment_lengths` shorter than the mean
    sequence, the mean cut into as many equal pieces as that length needs (rounded up to whole steps; the
    length itself where it divides the mean)."""
    mean = total / nseq
    out: list[int] = []
    for length in costs.segment_lengths:
        if length < mean:
            seg = math.ceil(mean / math.ceil(mean / length) / CHUNK) * CHUNK
            if seg not in out:
                out.append(seg)
    return out


def cp_segment_len(nseq: int, total: int, hv: int, sms: int, facts: PlanFacts,
                   policy: SchedulePolicy = AUTO, costs: CostModel = COSTS) -> int | None:
    """Segment length for intra-card CP, or None for whole sequences.

    Forced by the policy, else by the cost model: CP where its cheapest candidate is estimated at most
    `costs.cp_margin` of the whole-sequence path, with the longest candidate within `costs.cp_tie` of that
    cheapest. Calls whose recurrence grid already covers half the SMs or more keep whole sequences: CP
    repeats every step about 2.5 times over, which only idle SMs repay.
    """
    if policy.intracard_cp == "off":
        return None
    if isinstance(policy.intracard_cp, int):
        return policy.intracard_cp
    if nseq <= 0 or 2 * nseq * hv * facts.v_slices > sms:
        return None
    candidates = cp_candidates(nseq, total, costs)
    if not candidates:
        return None
    est = {seg: cp_time_us(nseq, total, hv, sms, seg, facts, costs) for seg in candidates}
    cheapest = min(est.values())
    if cheapest > costs.cp_margin * whole_time_us(nseq, total, hv, sms, facts, costs, policy):
        return None
    return max(seg for seg, t in est.items() if t <= cheapest * (1.0 + costs.cp_tie))


# ---------------------------------------------------------------------------------------------------------
# the whole-sequence path: fused kernel, overlap, order
# ---------------------------------------------------------------------------------------------------------


def pair_step_limit(nseq: int, total: int, hv: int, sms: int, facts: PlanFacts,
                    costs: CostModel = COSTS) -> float:
    """The longest chain, in steps, for which the fused kernel's CTA-pair form is estimated to beat prepare
    and the recurrence beside it, on a call whose chains all run at once on either path.

    Both paths then take the longest chain's steps: the pair form at `pair_step_us` a step plus its fill,
    the two-stage path at its loaded step plus prepare's work, which grows with the call's `total` tokens:
    pair_fixed + (L + F) pair_step <= two_stage_fixed + L step + prepare(total), solved for L.
    """
    ctas = nseq * hv * facts.v_slices  # the recurrence's CTAs
    step = costs.step_us + costs.step_load_us * min(ctas, sms) / sms
    prep = _prepare_k(total, hv, sms, facts) * (costs.prepare_sm_ns
                                                + costs.prepare_wait_sm_ns * (nseq - 1) / max(nseq, 1))
    extra = costs.pair_step_us - step  # a step of the pair form over a two-stage step
    spare = costs.two_stage_fixed_us - costs.pair_fixed_us + prep - facts.fused_fill * costs.pair_step_us
    return math.inf if extra <= 0 else spare / extra


def fused_args(nseq: int, hv: int, total: int, sms: int, facts: PlanFacts,
               policy: SchedulePolicy = AUTO, costs: CostModel = COSTS) -> tuple[int, ...]:
    """The forward stage's (allow_fused, sms) arguments where the variant has a fused kernel, else none, and
    its `pair_steps` argument where the variant has the CTA-pair form.

    allow_fused 0 runs prepare and the recurrence; 1 lets the setup kernel choose from the lengths; 2 runs
    the fused kernel. One CTA a chain, the setup kernel picks the fused kernel when max(longest, waves x
    mean) + F <= margin x sum x HV / SMs (steps, F the fill steps); with mean = sum / N that only gets truer
    as the sum grows, and the sum is at most (total + 15 N) // 16, so a "no" at that bound (with the smaller
    total / 16 / N on the left) is a "no" for the call, settled here (which also spares the launch of the
    persistent grid). `pair_steps` is non-zero where every chain gets its two CTAs at once (the pair form
    has no chain counter): the longest chain, in steps, for which the pair form wins (`pair_step_limit`),
    and the setup kernel takes it for calls whose longest chain is no longer; a call whose mean chain is
    already longer is a "no" here.
    """
    if facts.fused_margin is None:
        return ()
    chains = nseq * hv
    pair: tuple[int, ...] = ()
    if facts.pair:
        limit = 0
        if 0 < 2 * chains <= sms and policy.fused_pair != "off":
            limit = int(min(max(pair_step_limit(nseq, total, hv, sms, facts, costs), 1.0), 2**31 - 1))
        pair = (limit,)
    if policy.fused == "off":
        return (0, sms, *pair)
    if policy.fused == "on":
        return (2, sms, *pair)
    if pair and pair[0]:
        return (int(nseq > 0 and total / CHUNK / nseq <= pair[0]), sms, *pair)
    waves = -(-chains // sms)
    low = waves * total / CHUNK / max(nseq, 1) + facts.fused_fill
    high = facts.fused_margin * ((total + (CHUNK - 1) * nseq) // CHUNK) * hv / sms  # the sum of steps at most
    return (int(nseq > 0 and low <= high), sms, *pair)


def device_picks_fused(lengths: tuple[float, ...], hv: int, sms: int, facts: PlanFacts,
                       pair_steps: int = 0) -> bool:
    """The setup kernel's rule (templates/common/forward.py.j2) for sequences of `lengths` tokens, evaluated
    on the host: what allow_fused=1 resolves to on the device."""
    if facts.fused_margin is None or not lengths:
        return False
    steps = [math.ceil(n / CHUNK) for n in lengths]
    if pair_steps:
        return max(steps) <= pair_steps
    waves = -(-(len(lengths) * hv) // sms)
    estimate = max(max(steps), waves * sum(steps) / len(steps)) + facts.fused_fill
    return estimate <= facts.fused_margin * sum(steps) * hv / sms


def by_length(nseq: int, rec_ctas: int, sms: int, policy: SchedulePolicy = AUTO) -> bool:
    """Whether the recurrence takes sequences longest first (the setup kernel ranks them on the device).

    Its CTAs start in grid order, so when the grid does not fit the SMs at once a long sequence late in
    `cu_seqlens` starts late and runs alone at the end; ranking costs the setup kernel O(N) work a sequence,
    so it is skipped where it cannot help (one sequence, a grid that fits one CTA per SM) and past
    MAX_RANKED_SEQS sequences. (docs/experiments.md, 'Longest first'.)
    """
    if not 2 <= nseq <= MAX_RANKED_SEQS:
        return False
    return policy.seq_order == "length" or (policy.seq_order == "auto" and rec_ctas > sms)


def overlap(rec_ctas: int, sms: int, policy: SchedulePolicy = AUTO) -> bool:
    """Whether prepare leaves room for the recurrence to run beside it: when the recurrence grid fits one
    CTA per SM (otherwise its CTAs take the SMs as prepare's leave)."""
    return policy.overlap == "on" or (policy.overlap == "auto" and rec_ctas <= sms)


@dataclass(frozen=True)
class Schedule:
    """The decisions of one call: `seg_len` (None: whole sequences), whether the recurrence runs beside
    prepare, whether sequences are ranked longest first, and the forward stage's fused-kernel arguments."""

    seg_len: int | None
    beside: bool
    by_length: bool
    fused_args: tuple[int, ...]


def schedule(nseq: int, total: int, hv: int, sms: int, facts: PlanFacts, policy: SchedulePolicy = AUTO,
             costs: CostModel = COSTS) -> Schedule:
    """Every decision of a call of `nseq` sequences, `total` tokens and `hv` value heads on `sms` SMs."""
    seg = cp_segment_len(nseq, total, hv, sms, facts, policy, costs)
    if seg is not None:
        return Schedule(seg, False, False, ())
    rec_ctas = nseq * hv * facts.v_slices
    return Schedule(None, overlap(rec_ctas, sms, policy), by_length(nseq, rec_ctas, sms, policy),
                    fused_args(nseq, hv, total, sms, facts, policy, costs))


def decode_parts(items: int, sms: int, head_dim_v: int, v_first: bool, tokens: int,
                 max_parts: int = DECODE_MAX_PARTS) -> int:
    """Value parts each (request, value head) item of the streaming decode splits into, so that with fewer
    items than SMs a state's bytes pass through several SMs' load and store streams: the largest power of 2
    (up to `max_parts`, each part a multiple of 16 value columns) that keeps items x parts within the SMs.
    V-first states only, or K-first ones with `tokens` >= 4 a request ([N, S] calls; 0: unknown, packed): a
    K-first part is a strided copy, a bulk copy per key row, slower than one copy of the whole slot for a
    single token. Measured on an H100 (docs/experiments.md, "Decode: value parts"): V-first 1.07-1.24x at 1-2
    requests, K-first 0.82-0.91x for one token and 1.15-1.28x for four."""
    if not v_first and tokens < 4:
        return 1
    parts = 1
    while 2 * parts <= max_parts and head_dim_v % (16 * 2 * parts) == 0 and items * 2 * parts <= sms:
        parts *= 2
    return parts


def decode_staged_store(items: int, ctas: int) -> bool:
    """Whether the streaming decode's CTAs, `items` (request, value head, value part) items over `ctas`,
    return states through their ring stages by bulk copy rather than by the consumers' stores from
    registers: from `DECODE_STAGED_MIN_ITEMS` items a CTA. With one slot a request, the final state,
    bulk-copied by the loader (H200: 3-4% faster at 128-256 requests of HV 32 or 64, 1-3% slower at 8 items
    a CTA, where holding the stage until the copy has read it delays the next load into it;
    docs/experiments.md, "Decode: the final state by bulk copy"); with one slot a token (speculative verify)
    and whole states, each token's state, bulk-copied by a consumer while the next token runs (H200, fp32
    state: 2-4% faster at 128-256 requests of 2-8 tokens, within 2% either way at 8-32 requests; "Decode: a
    verify token's state by bulk copy")."""
    return items >= DECODE_STAGED_MIN_ITEMS * ctas


def decode_streams(has_stage: bool, items: int, sms: int, v_first: bool, tokens: int,
                   policy: SchedulePolicy = AUTO, state_bits: int = 32) -> bool:
    """Whether a decode call of `items` (request, value head) items on `sms` SMs runs the streaming decode
    stage (a persistent grid) rather than one CTA an item; `has_stage`: the variant has it (targets with
    bulk copies, whose per-item stage has narrow CTAs); `tokens`: a request's tokens ([N, S] calls; 0:
    packed, taken as one); `state_bits`: the state dtype's width. "auto" streams where the variant can, but
    where the per-item stage's narrow CTAs were faster on an H200 (docs/experiments.md, "Decode: narrow CTAs
    for few requests"): a K-first state at most `DECODE_PER_ITEM_KV` items an SM (one request: its state
    spread over many SMs, a short chain of round trips; the streaming grid's bulk copies win from there),
    an fp32 one at most `DECODE_PER_ITEM_KV_LONG` from `DECODE_LONG_TOKENS` tokens a request (there the
    per-item chain was still the faster at two items an SM, a bf16 state's streaming grid far ahead of
    it); a V-first one at most `DECODE_PER_ITEM_VK` items an SM for a token a request and at every size
    for more (its rows load as vectors, where the streaming grid's consumers read them across banks)."""
    if not has_stage or policy.decode_stream == "off":
        return False
    if policy.decode_stream == "on":
        return True
    if v_first:
        return tokens <= 1 and items > DECODE_PER_ITEM_VK * sms
    if state_bits == 32 and tokens >= DECODE_LONG_TOKENS:
        return items > DECODE_PER_ITEM_KV_LONG * sms
    return items > DECODE_PER_ITEM_KV * sms
