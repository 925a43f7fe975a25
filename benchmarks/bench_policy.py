#!/usr/bin/env python
"""The automatic schedule against every forced option, over heads x tokens x sequences.

For each point (H value heads, N sequences of T tokens each, K=V=128, bf16, the spec of ``--spec``) the GPU
run times the call under ``auto`` and under each forced option (CP off; CP forced at a few segment lengths
where the sequence holds two segments at least; the fused kernel off and on, and in CTA pairs where the
variant has them and every chain gets a pair), each as the device time of one call by CUDA-graph replay
(``bench_fwd.graph_ms``). It writes JSON (every point: every option's time, auto's time and choice, the best
option) and a Markdown summary, and prints per point auto / best, flagging points where auto takes more
than ``--tolerance`` x best and where auto's time falls as T grows at fixed H and N.

``--check FILE.json`` (CPU only) re-evaluates the current decision functions of ``kdagen.policy`` against a
recorded sweep: the option the current rule picks at each point, its recorded time against the best, and
the same flags. ``--costs name=value,...`` replaces constants of `kdagen.policy.CostModel` for the check, so
a cost model is fitted on the CPU after one GPU sweep.

    PYTHONPATH=. python benchmarks/bench_policy.py [--quick] [--spec FILE:NAME] [--out DIR]
    PYTHONPATH=. python benchmarks/bench_policy.py --check benchmarks/out/policy-sweep.json [--costs ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import math
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
for _p in (str(REPO_ROOT), str(BENCH_DIR)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from kdagen.policy import (  # noqa: E402
    AUTO,
    COSTS,
    CostModel,
    PlanFacts,
    Schedule,
    SchedulePolicy,
    device_picks_fused,
    schedule,
)

DEFAULT_SPEC = "specs/sm90.yaml:k128"
HEADS = (1, 2, 4, 8, 16, 32, 64)
TOKENS = (512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
SEQS = (1, 4, 16)
QUICK_HEADS = (1, 4, 8, 32, 64)
QUICK_TOKENS = (1024, 4096, 8192, 16384, 32768, 65536)
QUICK_SEQS = (1, 4)
# Inputs (q, k, v, g, beta), o and two workspaces (the call outside the graph and the captured one) take
# ~3.3 KB per token and value head at K=V=128: 2^22 token-heads stay under ~14 GB.
MAX_TOKEN_HEADS = 1 << 22
CP_LENGTHS = (1024, 2048, 4096)
TOLERANCE = 1.10
FALL_TOLERANCE = 0.02  # a time counts as falling when it is more than 2% below the previous T's


@dataclass(frozen=True)
class Point:
    heads: int
    tokens: int  # per sequence
    seqs: int

    @property
    def total(self) -> int:
        return self.tokens * self.seqs

    @property
    def token_heads(self) -> int:
        return self.total * self.heads

    @property
    def name(self) -> str:
        return f"H{self.heads}-N{self.seqs}-T{self.tokens}"


def point_grid(heads: Iterable[int] = HEADS, tokens: Iterable[int] = TOKENS, seqs: Iterable[int] = SEQS,
               max_token_heads: int = MAX_TOKEN_HEADS) -> tuple[list[Point], list[Point]]:
    """(points to run, points skipped for memory), ordered by H, N, T."""
    run: list[Point] = []
    skipped: list[Point] = []
    for h in heads:
        for n in seqs:
            for t in tokens:
                p = Point(h, t, n)
                (run if p.token_heads <= max_token_heads else skipped).append(p)
    return run, skipped


def options_for(point: Point, facts: PlanFacts, sms: int,
                cp_lengths: Iterable[int] = CP_LENGTHS) -> dict[str, SchedulePolicy]:
    """The forced options of a point, by label (`SchedulePolicy.label`), without auto."""
    opts = [SchedulePolicy(intracard_cp="off")]
    opts += [SchedulePolicy(intracard_cp=seg) for seg in cp_lengths if 2 * seg <= point.tokens]
    if facts.fused_margin is not None:
        opts.append(SchedulePolicy(intracard_cp="off", fused="off"))
        opts.append(SchedulePolicy(intracard_cp="off", fused="on", fused_pair="off"))
        if facts.pair and 2 * point.seqs * point.heads <= sms:
            opts.append(SchedulePolicy(intracard_cp="off", fused="on", fused_pair="on"))
    return {p.label(): p for p in opts}


def choice_label(sched: Schedule, point: Point, facts: PlanFacts, sms: int) -> str:
    """The forced option whose run equals the schedule `sched` (the setup kernel's pick resolved for the
    point's equal lengths)."""
    if sched.seg_len is not None:
        return SchedulePolicy(intracard_cp=sched.seg_len).label()
    args = sched.fused_args
    if not args:
        return SchedulePolicy(intracard_cp="off").label()
    pair_steps = args[2] if len(args) > 2 else 0
    fused = args[0] == 2 or (args[0] == 1 and device_picks_fused((point.tokens,) * point.seqs, point.heads,
                                                                  sms, facts, pair_steps))
    if not fused:
        return SchedulePolicy(intracard_cp="off", fused="off").label()
    return SchedulePolicy(intracard_cp="off", fused="on", fused_pair="on" if pair_steps else "off").label()


def best_option(times: dict[str, float | None]) -> tuple[str | None, float | None]:
    timed = {k: v for k, v in times.items() if v is not None}
    if not timed:
        return None, None
    label = min(timed, key=lambda k: timed[k])
    return label, timed[label]


def falling_points(rows: list[dict[str, Any]], key: str,
                   tol: float = FALL_TOLERANCE) -> set[tuple[int, int, int]]:
    """(H, N, T) of the rows whose `key` time is more than `tol` below that of the previous T at the same
    H and N (a longer input that runs faster: the shorter one is scheduled badly)."""
    by_hn: dict[tuple[int, int], list[tuple[int, float]]] = {}
    for r in rows:
        if r.get(key) is not None:
            by_hn.setdefault((r["heads"], r["seqs"]), []).append((r["tokens"], r[key]))
    out: set[tuple[int, int, int]] = set()
    for (h, n), series in by_hn.items():
        series.sort()
        for (_, t0), (tok, t1) in zip(series, series[1:]):
            if t1 < t0 * (1 - tol):
                out.add((h, n, tok))
    return out


def nearest_cp(label: str, times: dict[str, float | None]) -> str | None:
    """The recorded CP option nearest (in log length) to the CP option `label`, or None."""
    seg = SchedulePolicy.from_label(label).intracard_cp
    if not isinstance(seg, int):
        return None
    recorded = [(k, SchedulePolicy.from_label(k).intracard_cp) for k, v in times.items() if v is not None]
    cps = [(k, s) for k, s in recorded if isinstance(s, int)]
    if not cps:
        return None
    return min(cps, key=lambda ks: abs(math.log(ks[1] / seg)))[0]


def parse_costs(text: str | None, base: CostModel = COSTS) -> CostModel:
    """`base` with the constants of ``name=value,...`` replaced (tuples as values joined by ``/``)."""
    if not text:
        return base
    changes: dict[str, Any] = {}
    for part in text.split(","):
        name, _, value = part.partition("=")
        name = name.strip()
        if name not in CostModel.__dataclass_fields__:
            raise SystemExit(f"--costs: {name!r} is not a CostModel constant "
                             f"({', '.join(CostModel.__dataclass_fields__)})")
        current = getattr(base, name)
        if isinstance(current, tuple):
            changes[name] = tuple(int(x) for x in value.split("/"))
        else:
            changes[name] = type(current)(value)
    return dataclasses.replace(base, **changes)


# ---------------------------------------------------------------------------------------------------------
# --check: the current rule against a recorded sweep (CPU)
# ---------------------------------------------------------------------------------------------------------


def facts_of(data: dict[str, Any]) -> PlanFacts:
    """The plan facts of the swept spec as the current planner gives them (the recorded ones where the spec
    cannot be planned here)."""
    try:
        from kdagen.plan import make_plan
        from kdagen.spec import KernelSpec

        spec = KernelSpec(**data["meta"]["spec_info"])
        return PlanFacts.from_plan(spec, make_plan(spec))
    except Exception:
        known = {f.name for f in dataclasses.fields(PlanFacts)}
        return PlanFacts(**{k: v for k, v in data["meta"]["facts"].items() if k in known})


def check(data: dict[str, Any], costs: CostModel = COSTS, tol: float = TOLERANCE,
          facts: PlanFacts | None = None) -> dict[str, Any]:
    """Each recorded point under the current rule: {"rows": [...], "summary": {...}}. A row holds the label
    the rule picks (`pick`), the recorded option that stands for it (`timed_as`: the same option, else auto's
    run when auto chose the same, else the nearest CP length, marked `approx`), its time, the best and the
    ratio."""
    meta = data["meta"]
    facts = facts or facts_of(data)
    sms = int(meta["sms"])
    rows: list[dict[str, Any]] = []
    for r in data["points"]:
        point = Point(r["heads"], r["tokens"], r["seqs"])
        sched = schedule(point.seqs, point.total, point.heads, sms, facts, AUTO, costs)
        pick = choice_label(sched, point, facts, sms)
        times: dict[str, float | None] = r["options"]
        timed_as, approx = pick, False
        if times.get(pick) is None:
            if r.get("auto_label") == pick and r.get("auto_ms") is not None:
                timed_as = "auto"
            else:
                timed_as, approx = nearest_cp(pick, times), True
        ms = r.get("auto_ms") if timed_as == "auto" else times.get(timed_as) if timed_as else None
        best, best_ms = best_option(times)
        ratio = ms / best_ms if ms is not None and best_ms else None
        rows.append({"heads": point.heads, "seqs": point.seqs, "tokens": point.tokens, "pick": pick,
                     "timed_as": timed_as, "approx": approx, "ms": ms, "best": best, "best_ms": best_ms,
                     "ratio": ratio, "slow": ratio is not None and ratio > tol})
    falls = falling_points(rows, "ms")
    for row in rows:
        row["falls"] = (row["heads"], row["seqs"], row["tokens"]) in falls
    ratios = [r["ratio"] for r in rows if r["ratio"] is not None]
    summary = {"points": len(rows), "slow": sum(r["slow"] for r in rows),
               "falls": sum(r["falls"] for r in rows), "approx": sum(r["approx"] for r in rows),
               "max_ratio": max(ratios) if ratios else None,
               "geomean_ratio": math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None}
    return {"rows": rows, "summary": summary}


def fit(data: dict[str, Any], grid: str, base: CostModel = COSTS, tol: float = TOLERANCE,
        top: int = 5) -> list[tuple[tuple[float, ...], CostModel, dict[str, Any]]]:
    """Every combination of the constants in `grid` (``name=v1/v2/...,name=...``) checked against the
    sweep, best first: fewest points over `tol` x best plus points where the time falls as T grows, then
    the lowest geomean of auto / best, then the lowest max."""
    import itertools

    facts = facts_of(data)
    axes = []
    for part in grid.split(","):
        name, _, values = part.partition("=")
        axes.append([f"{name.strip()}={v}" for v in values.split("/")])
    scored = []
    for combo in itertools.product(*axes):
        costs = parse_costs(",".join(combo), base)
        s = check(data, costs, tol, facts)["summary"]
        key = (s["slow"] + s["falls"], s["geomean_ratio"] or 0.0, s["max_ratio"] or 0.0)
        scored.append((key, costs, s))
    scored.sort(key=lambda x: x[0])
    return scored[:top]


def _f(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def print_check(result: dict[str, Any], tol: float) -> None:
    print(f"{'point':<18} {'current pick':<44} {'ms':>8} {'best':<44} {'best ms':>8} {'ratio':>6} flags")
    for r in result["rows"]:
        name = f"H{r['heads']}-N{r['seqs']}-T{r['tokens']}"
        flags = " ".join(f for f, on in ((f">{tol:.2f}x", r["slow"]), ("falls", r["falls"]),
                                         (f"~{r['timed_as']}", r["approx"])) if on)
        print(f"{name:<18} {r['pick']:<44} {_f(r['ms']):>8} {str(r['best']):<44} {_f(r['best_ms']):>8} "
              f"{_f(r['ratio'], '.2f'):>6} {flags}")
    s = result["summary"]
    print(f"{s['points']} points: {s['slow']} over {tol:.2f}x best, {s['falls']} where time falls as T "
          f"grows, {s['approx']} timed by the nearest recorded CP length; auto/best geomean "
          f"{_f(s['geomean_ratio'], '.3f')}, max {_f(s['max_ratio'], '.3f')}")


# ---------------------------------------------------------------------------------------------------------
# the GPU sweep
# ---------------------------------------------------------------------------------------------------------


def summarize(points: list[dict[str, Any]], tol: float) -> dict[str, Any]:
    """Flags (auto over `tol` x best, auto's time falling as T grows) set on `points` in place; counts."""
    falls = falling_points(points, "auto_ms")
    for p in points:
        p["slow"] = p.get("ratio") is not None and p["ratio"] > tol
        p["falls"] = (p["heads"], p["seqs"], p["tokens"]) in falls
    ratios = [p["ratio"] for p in points if p.get("ratio") is not None]
    return {"points": len(points), "slow": sum(p["slow"] for p in points),
            "falls": sum(p["falls"] for p in points), "max_ratio": max(ratios) if ratios else None,
            "geomean_ratio": math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None}


def markdown(data: dict[str, Any]) -> str:
    meta, s = data["meta"], data["summary"]
    tol = meta["tolerance"]
    lines = [f"# Scheduling policy sweep: {meta['device']}, {meta['date']}", "",
             f"Spec `{meta['spec']}`; {meta['sms']} SMs; device time by CUDA-graph replay; N sequences of T "
             f"tokens, H value heads. auto/best: auto's time over the best forced option's.", "",
             f"{s['points']} points: {s['slow']} with auto over {tol:.2f}x best, {s['falls']} where auto's "
             f"time falls as T grows; geomean auto/best {_f(s['geomean_ratio'])}, max {_f(s['max_ratio'])}. "
             f"Skipped for memory (over {meta['max_token_heads']} token-heads): "
             f"{', '.join(meta['skipped']) or 'none'}.", "",
             "| H | N | T | auto ms | auto's choice | best option | best ms | auto/best | flags |",
             "|---|---|---|---|---|---|---|---|---|"]
    for p in data["points"]:
        flags = " ".join(f for f, on in (("slow", p.get("slow")), ("falls", p.get("falls"))) if on)
        lines.append(f"| {p['heads']} | {p['seqs']} | {p['tokens']} | {_f(p.get('auto_ms'))} | "
                     f"`{p.get('auto_label')}` | `{p.get('best')}` | {_f(p.get('best_ms'))} | "
                     f"{_f(p.get('ratio'), '.2f')} | {flags} |")
    return "\n".join(lines) + "\n"


def _timer(budget_ms: float, max_replays: int) -> Callable[[Callable[[], Any]], float]:
    import bench_fwd
    import torch

    def timed(fn: Callable[[], Any]) -> float:
        fn()
        fn()
        torch.cuda.synchronize()
        first = bench_fwd.time_ms(fn, 0, 1)
        replays = max(3, min(max_replays, int(budget_ms / max(first, 1e-3))))
        return bench_fwd.graph_ms(fn, replays)

    return timed


def run_sweep(args: argparse.Namespace) -> int:
    import bench_fwd
    import torch

    if not torch.cuda.is_available():
        print("bench_policy: no CUDA GPU visible; nothing to run (--check works on the CPU)")
        return 2
    heads, tokens, seqs = (QUICK_HEADS, QUICK_TOKENS, QUICK_SEQS) if args.quick else (HEADS, TOKENS, SEQS)
    heads = args.heads or heads
    tokens = args.tokens or tokens
    seqs = args.seqs or seqs
    points, skipped = point_grid(heads, tokens, seqs, args.max_token_heads)
    print(f"{len(points)} points; skipped for memory (over {args.max_token_heads} token-heads): "
          f"{', '.join(p.name for p in skipped) or 'none'}", flush=True)
    target = bench_fwd.KdagenTarget(args.spec)
    t0 = time.time()
    target.load()
    if target.error:
        print(f"kdagen: could not get the kernel: {target.error}")
        return 1
    print(f"kernel ready in {time.time() - t0:.1f} s", flush=True)
    kernel = target.kernel
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    facts = PlanFacts.from_plan(kernel.spec, kernel.plan)
    timed = _timer(args.budget_ms, args.max_replays)
    out_points: list[dict[str, Any]] = []
    start = time.time()
    for i, point in enumerate(points, 1):
        cfg = bench_fwd.Config(point.name, "fixed", (point.tokens,) * point.seqs, point.heads)
        inp = bench_fwd.make_bench_inputs(cfg, device, target.problem)
        options = options_for(point, facts, sms, args.cp_lengths)
        times: dict[str, float | None] = {}
        errors: dict[str, str] = {}
        for label, pol in {"auto": AUTO, **options}.items():
            call = dataclasses.replace(target, kernel=kernel.with_policy(pol)).call(inp)
            try:
                times[label] = timed(call)
            except Exception as e:  # an option that fails (memory, launch) is recorded, not fatal
                times[label] = None
                errors[label] = f"{type(e).__name__}: {str(e)[:200]}"
                torch.cuda.synchronize()
        auto_ms = times.pop("auto")
        sched = kernel.schedule(point.seqs, point.total, point.heads, sms, AUTO)
        best, best_ms = best_option(times)
        row = {"heads": point.heads, "tokens": point.tokens, "seqs": point.seqs, "total": point.total,
               "options": times, "errors": errors, "auto_ms": auto_ms,
               "auto_choice": dataclasses.asdict(sched), "auto_label": choice_label(sched, point, facts, sms),
               "best": best, "best_ms": best_ms,
               "ratio": auto_ms / best_ms if auto_ms is not None and best_ms else None}
        out_points.append(row)
        del inp
        torch.cuda.empty_cache()
        flag = " SLOW" if row["ratio"] is not None and row["ratio"] > args.tolerance else ""
        prev = out_points[-2] if len(out_points) > 1 else None
        if (prev and (prev["heads"], prev["seqs"]) == (point.heads, point.seqs) and auto_ms is not None
                and prev["auto_ms"] is not None and auto_ms < prev["auto_ms"] * (1 - FALL_TOLERANCE)):
            flag += " FALLS"
        print(f"[{i}/{len(points)} {time.time() - start:5.0f}s] {point.name:<16} auto {_f(auto_ms)} ms "
              f"({row['auto_label']}), best {_f(best_ms)} ms ({best}), auto/best {_f(row['ratio'], '.2f')}"
              f"{flag}" + (f" errors: {errors}" if errors else ""), flush=True)
    now = dt.datetime.now()
    meta = {"date": now.isoformat(timespec="seconds"), "device": torch.cuda.get_device_name(), "sms": sms,
            "spec": args.spec, "spec_info": target.info, "facts": dataclasses.asdict(facts),
            "costs": dataclasses.asdict(COSTS), "torch": torch.__version__, "tolerance": args.tolerance,
            "max_token_heads": args.max_token_heads, "skipped": [p.name for p in skipped],
            "budget_ms": args.budget_ms, "quick": args.quick, "seconds": round(time.time() - start, 1)}
    data = {"meta": meta, "points": out_points}
    data["summary"] = summarize(out_points, args.tolerance)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"policy-sweep-{now:%Y%m%d-%H%M%S}"
    stem.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    stem.with_suffix(".md").write_text(markdown(data))
    s = data["summary"]
    print(f"{s['points']} points: {s['slow']} with auto over {args.tolerance:.2f}x best, {s['falls']} where "
          f"auto's time falls as T grows; geomean auto/best {_f(s['geomean_ratio'])}, "
          f"max {_f(s['max_ratio'])}")
    print(f"wrote {stem.with_suffix('.json')} and {stem.with_suffix('.md')}")
    return 0


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spec", default=DEFAULT_SPEC,
                   help=f'kdagen spec "file.yaml:name" (default {DEFAULT_SPEC})')
    p.add_argument("--out", type=Path, default=BENCH_DIR / "out",
                   help="output folder (default benchmarks/out)")
    p.add_argument("--quick", action="store_true", help="a smaller grid (H, T, N: "
                   f"{QUICK_HEADS}, {QUICK_TOKENS}, {QUICK_SEQS})")
    p.add_argument("--heads", type=_ints, help="value heads, comma-separated (overrides the grid's)")
    p.add_argument("--tokens", type=_ints, help="tokens per sequence, comma-separated")
    p.add_argument("--seqs", type=_ints, help="sequences per call, comma-separated")
    p.add_argument("--cp-lengths", type=_ints, default=CP_LENGTHS, help="forced CP segment lengths")
    p.add_argument("--max-token-heads", type=int, default=MAX_TOKEN_HEADS,
                   help="skip points with more tokens x heads (memory)")
    p.add_argument("--budget-ms", type=float, default=20.0, help="replayed device time per option")
    p.add_argument("--max-replays", type=int, default=50)
    p.add_argument("--tolerance", type=float, default=TOLERANCE, help="flag auto above this x best")
    p.add_argument("--check", type=Path, metavar="FILE.json",
                   help="re-evaluate the current policy against a recorded sweep (CPU)")
    p.add_argument("--costs", help="CostModel constants for --check, name=value,... (tuples as a/b/c)")
    p.add_argument("--fit", metavar="NAME=V1/V2,...",
                   help="with --check: try every combination of these CostModel values, print the best")
    p.add_argument("--json", action="store_true", help="with --check: print the result as JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.check is not None:
        data = json.loads(args.check.read_text())
        base = parse_costs(args.costs)
        if args.fit:
            for _, costs, s in fit(data, args.fit, base, args.tolerance):
                changed = {k: v for k, v in dataclasses.asdict(costs).items() if getattr(COSTS, k) != v}
                print(f"{s['slow']} slow, {s['falls']} falls, geomean {_f(s['geomean_ratio'])}, "
                      f"max {_f(s['max_ratio'])}: {changed}")
            return 0
        result = check(data, base, args.tolerance)
        if args.json:
            print(json.dumps(result, indent=1))
        else:
            print_check(result, args.tolerance)
        return 0
    return run_sweep(args)


if __name__ == "__main__":
    sys.exit(main())
