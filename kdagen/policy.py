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
``KDAGEN_OVERLAP``, ``KDAGEN_FUSED``, ``KDAGEN_FUSED_PAIR`` and ``KDAGEN_SEQ_ORDER`` are an override for
experiments: `default_policy()` reads them once (at its first use in the process) and never again.

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
    "cp_time_us",
    "fused_args",
    "device_picks_fused",
    "by_length",
    "overlap",
]

_TOGGLE = ("auto", "on", "off")
_ORDER = ("auto", "length", "input")


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

    Validated on construction (`ValueError` naming the field). Frozen and hashable: a kernel caches its
    decisions per policy and call size.
    """

    intracard_cp: str | int = "auto"
    overlap: str = "auto"
    fused: str = "auto"
    fused_pair: str = "auto"
    seq_order: str = "auto"

    def __post_init__(self) -> None:
        cp = self.intracard_cp
        if isinstance(cp, bool) or not (
            cp in ("auto", "off") or (isinstance(cp, int) and cp > 0 and cp % CHUNK == 0)
        ):
            raise ValueError(f"intracard_cp: expected 'auto', 'off' or a positive multiple of {CHUNK} "
                             f"(a segment length in tokens), got {cp!r}")
        for name, allowed in (("overlap", _TOGGLE), ("fused", _TOGGLE), ("fused_pair", _TOGGLE),
                              ("seq_order", _ORDER)):
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
    fused_margin: float | None = None  # None: the variant has no fused kernel
    fused_fill: int = 0  # steps to fill the fused kernel's ring (the setup kernel's F)
    pair_step: float | None = None  # None: no CTA-pair form; else a pair's step in one-CTA steps
    pair_margin: float | None = None

    @classmethod
    def from_plan(cls, spec: KernelSpec, plan: Plan) -> PlanFacts:
        params = {s.name: s.params for s in plan.stages}
        fwd = params["forward"]
        fused, pair = bool(fwd.get("fused")), bool(fwd.get("fused_pair"))
        return cls(
            v_slices=spec.head_dim_v // params["recurrence"]["block_v"],
            head_dim_v=spec.head_dim_v,
            fused_margin=fwd["fused_margin"] if fused else None,
            fused_fill=fwd["fused_fill_steps"] if fused else 0,
            pair_step=fwd["fused_pair_step"] if fused and pair else None,
            pair_margin=fwd["fused_pair_margin"] if fused and pair else None,
        )


@dataclass(frozen=True)
class CostModel:
    """Estimated costs (microseconds unless named otherwise) of the paths of a call, for choosing among them.

    The two-stage recurrence's step slows from `step_us` with few CTAs to `step_loaded_us` when its CTAs
    fill the SMs (prepare beside it shares HBM and issue slots). Prepare costs `prepare_sm_ns` SM-nanoseconds
    per token and value head. Under CP, a prescan step plus a segment step cost `cp_step_us` with one CTA an
    SM and `cp_step_extra_us` more per further resident CTA (at most `cp_ctas_per_sm`; beyond that, waves),
    and the merge walks a sequence's segments at `merge_step_us` each. The fused kernel steps at
    `fused_step_us` (one CTA a chain; a pair's step is the plan's `pair_step` of it). Each path adds a fixed
    cost for its launches. CP is taken only when it is estimated at most `cp_margin` of the whole-sequence
    path's time; candidate segments hold at least `min_segment` tokens.
    (docs/experiments.md, 'Intra-card CP segment length', has the measurements behind the values.)
    """

    step_us: float = 0.6
    step_loaded_us: float = 1.15
    prepare_sm_ns: float = 103.0
    fused_step_us: float = 1.65
    whole_fixed_us: float = 8.0
    cp_step_us: float = 2.0
    cp_step_extra_us: float = 1.2
    cp_ctas_per_sm: int = 2
    merge_step_us: float = 2.0
    cp_fixed_us: float = 15.0
    cp_margin: float = 0.9
    min_segment: int = 2048
    segment_counts: tuple[int, ...] = field(default=(2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64))


COSTS = CostModel()


def _steps(tokens: float) -> int:
    return max(1, math.ceil(tokens / CHUNK))


def _prepare_us(total: int, hv: int, sms: int, costs: CostModel) -> float:
    return total * hv * costs.prepare_sm_ns / 1000.0 / sms


def whole_time_us(nseq: int, total: int, hv: int, sms: int, facts: PlanFacts, costs: CostModel = COSTS,
                  policy: SchedulePolicy = AUTO) -> float:
    """Estimated time of the whole-sequence path (the setup kernel's pick between the two-stage path and the
    fused kernel, for sequences of the mean length)."""
    mean = total / nseq
    steps = _steps(mean)
    prep = _prepare_us(total, hv, sms, costs)
    rec_ctas = nseq * hv * facts.v_slices
    waves = math.ceil(rec_ctas / sms)
    step = costs.step_us + (costs.step_loaded_us - costs.step_us) * min(1.0, rec_ctas / sms)
    two_stage = max(waves * steps * step, prep) + costs.whole_fixed_us
    args = fused_args(nseq, hv, total, sms, facts, policy)
    if not args or args[0] == 0:
        return two_stage
    pair = len(args) > 2 and bool(args[2])
    if args[0] == 1 and not device_picks_fused((total / nseq,) * nseq, hv, sms, facts, pair):
        return two_stage
    chains = nseq * hv
    fused_step = costs.fused_step_us * (facts.pair_step if pair and facts.pair_step else 1.0)
    return math.ceil(chains / sms) * (steps + facts.fused_fill) * fused_step + costs.whole_fixed_us


def cp_time_us(nseq: int, total: int, hv: int, sms: int, seg_len: int, facts: PlanFacts,
               costs: CostModel = COSTS) -> float:
    """Estimated time of intra-card CP with segments of `seg_len` tokens (sequences of the mean length):
    prepare alone, the prescan and segment passes, the merge."""
    segments = max(1, math.ceil(total / nseq / seg_len))
    ctas = nseq * segments * hv * facts.v_slices
    resident = min(costs.cp_ctas_per_sm, math.ceil(ctas / sms))
    waves = math.ceil(ctas / (resident * sms))
    passes = _steps(seg_len) * waves * (costs.cp_step_us + costs.cp_step_extra_us * (resident - 1))
    merge_ctas = nseq * hv * max(1, facts.head_dim_v // 16)
    merge = segments * costs.merge_step_us * math.ceil(merge_ctas / sms)
    return _prepare_us(total, hv, sms, costs) + passes + merge + costs.cp_fixed_us


def cp_candidates(nseq: int, total: int, costs: CostModel = COSTS) -> list[int]:
    """Segment lengths the cost model weighs: the mean sequence cut into each of `costs.segment_counts`
    pieces (rounded up to whole steps), at least `costs.min_segment` tokens each."""
    mean = total / nseq
    out: list[int] = []
    for count in costs.segment_counts:
        seg = math.ceil(mean / count / CHUNK) * CHUNK
        if seg >= costs.min_segment and seg not in out and seg < mean:
            out.append(seg)
    return out


def cp_segment_len(nseq: int, total: int, hv: int, sms: int, facts: PlanFacts,
                   policy: SchedulePolicy = AUTO, costs: CostModel = COSTS) -> int | None:
    """Segment length for intra-card CP, or None for whole sequences.

    Forced by the policy, else the cheapest of the whole-sequence path and CP at each candidate length by
    the cost model, CP only where it is estimated at most `costs.cp_margin` of the whole path. Calls whose
    recurrence grid already covers half the SMs or more keep whole sequences: CP repeats every step about
    2.5 times over, which only idle SMs repay.
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
    best = min(candidates, key=lambda s: cp_time_us(nseq, total, hv, sms, s, facts, costs))
    whole = whole_time_us(nseq, total, hv, sms, facts, costs, policy)
    return best if cp_time_us(nseq, total, hv, sms, best, facts, costs) <= costs.cp_margin * whole else None


# ---------------------------------------------------------------------------------------------------------
# the whole-sequence path: fused kernel, overlap, order
# ---------------------------------------------------------------------------------------------------------


def fused_args(nseq: int, hv: int, total: int, sms: int, facts: PlanFacts,
               policy: SchedulePolicy = AUTO) -> tuple[int, ...]:
    """The forward stage's (allow_fused, sms) arguments where the variant has a fused kernel, else none, and
    its `pair` argument where the variant has the CTA-pair form.

    allow_fused 0 runs prepare and the recurrence; 1 lets the setup kernel choose from the lengths; 2 runs
    the fused kernel. Under "auto", a call the setup kernel's rule could never give the fused kernel is
    settled here, which also spares the launch of its persistent grid. The setup kernel picks the fused
    kernel when max(longest, waves x mean) + F <= margin x sum x HV / SMs (steps, F the fill steps; in
    pairs, the left side times the pair step and the pair form's margin); with mean = sum / N that only gets
    truer as the sum grows, and the sum is at most (total + 15 N) // 16, so a "no" at that bound (with the
    smaller total / 16 / N on the left) is a "no" for the call. `pair` is 1 where every chain gets its two
    CTAs at once (the pair form has no chain counter).
    """
    if facts.fused_margin is None:
        return ()
    chains = nseq * hv
    pair: tuple[int, ...] = ()
    if facts.pair_step is not None:
        pair = (int(0 < 2 * chains <= sms and policy.fused_pair != "off"),)
    if policy.fused == "off":
        return (0, sms, *pair)
    if policy.fused == "on":
        return (2, sms, *pair)
    waves = -(-chains // sms)
    low = waves * total / CHUNK / max(nseq, 1) + facts.fused_fill
    margin = facts.fused_margin
    if pair and pair[0]:
        low *= facts.pair_step  # type: ignore[operator]
        margin = facts.pair_margin  # type: ignore[assignment]
    high = margin * ((total + (CHUNK - 1) * nseq) // CHUNK) * hv / sms  # the sum of steps at most
    return (int(nseq > 0 and low <= high), sms, *pair)


def device_picks_fused(lengths: tuple[float, ...], hv: int, sms: int, facts: PlanFacts, pair: bool) -> bool:
    """The setup kernel's rule (templates/common/forward.py.j2) for sequences of `lengths` tokens, evaluated
    on the host: what allow_fused=1 resolves to on the device."""
    if facts.fused_margin is None or not lengths:
        return False
    steps = [math.ceil(n / CHUNK) for n in lengths]
    waves = -(-(len(lengths) * hv) // sms)
    estimate = max(max(steps), waves * sum(steps) / len(steps)) + facts.fused_fill
    margin = facts.fused_margin
    if pair and facts.pair_step is not None:
        estimate *= facts.pair_step
        margin = facts.pair_margin  # type: ignore[assignment]
    return estimate <= margin * sum(steps) * hv / sms


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
                    fused_args(nseq, hv, total, sms, facts, policy))
