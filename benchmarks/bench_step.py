"""Per-step latency of the recurrence: how long one 16-token step of the serial state update takes.

The recurrence is a chain of T/16 dependent steps per (sequence, head, V-slice), so its per-step latency
bounds every long-sequence config (fast-kda.md §C.6). This times each stage's kernels with the CUDA profiler
(device time, not host overhead) for one sequence of T tokens over a range of head counts, which moves the
recurrence from one CTA per few SMs to several CTAs per SM, with intra-card context parallelism off and on.
Where the setup kernel picks the fused prepare + recurrence kernel (`wgmma`, many heads), the chain runs
inside it: its time is reported in its own column and the step time is taken from it (prepare's work then
overlaps the chain, so that figure bounds the step latency from above). `--fused off` keeps the two-stage
path, to time the recurrence kernel alone.

    python benchmarks/bench_step.py [--tokens 16384] [--heads 1 4 16 64 128] [--fused auto|on|off]
                                    [--json benchmarks/out/step.json]

It prints the table; ``--json`` also writes the rows and a Markdown table beside them (``benchmarks/out/`` is
git-ignored; a reference run goes to ``benchmarks/results/<card>/recurrence-step-<family>.json``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

SPEC = {"arch": "sm_90a", "gate": "lower_bound", "lower_bound": -5.0, "safe_gate": True, "l2norm_qk": True,
        "g_dtype": "bf16", "beta_dtype": "fp32", "state_layout": "kv"}


def stage_times_ms(fn, iters: int) -> dict[str, float]:
    """Mean device time per call of every kernel launched by ``fn``, keyed by a short stage name."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for ev in prof.key_averages():
        if ev.device_time_total <= 0:
            continue
        name = stage_of(ev.key)
        out[name] = out.get(name, 0.0) + ev.device_time_total / iters / 1000.0
    return out


STAGES = ("setup", "prepare", "recurrence", "fused", "merge")


def stage_of(kernel_name: str) -> str:
    """The stage a kernel belongs to, from the `<stage>_kernel` function name inside its mangled symbol (the
    CP prescan and segment passes are recurrence kernels); any other kernel keeps its own name."""
    for stage in STAGES:
        if f"{stage}_kernel" in kernel_name:
            return stage
    return kernel_name


def chain_ms(times: dict[str, float]) -> tuple[str, float]:
    """The kernel that ran the serial chain of steps, and its time: the recurrence, or the fused kernel."""
    if times.get("fused", 0.0) > 0.0:
        return "fused", times["fused"]
    return "recurrence", times.get("recurrence", 0.0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--heads", type=int, nargs="+", default=[1, 4, 16, 64, 128])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", type=Path, help="write the rows here and the Markdown table beside them "
                    "(none by default; benchmarks/out/ is git-ignored)")
    ap.add_argument("--family", choices=("auto", "wgmma", "mma_sync"), default="auto",
                    help="template family of the recurrence (auto: the planner's choice, wgmma on sm_90a)")
    ap.add_argument("--fused", choices=("auto", "on", "off"), default="auto",
                    help="the policy's fused choice (auto: the setup kernel's, as in production)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_step: no CUDA GPU visible; nothing to run")
        return 2

    import kdagen
    from kdagen.policy import SchedulePolicy
    from kdagen.reference import make_inputs

    kernel = kdagen.get_kernel({**SPEC, "family": args.family})
    steps = -(-args.tokens // 16)
    rows = []
    print(f"{torch.cuda.get_device_name()}: one sequence of {args.tokens} tokens ({steps} steps), K=V=128, "
          f"family {kernel.plan.family}, fused {args.fused}")
    print(f"{'heads':>5} {'cp':>4} {'prepare ms':>11} {'recurrence ms':>14} {'fused ms':>9} {'merge ms':>9} "
          f"{'us/step':>8}")
    for heads in args.heads:
        inp = make_inputs(1, args.tokens, heads, heads, 128, 128, dtype="bf16", beta_dtype="fp32",
                          g_dtype="bf16", gate="lower_bound", safe_gate=True, lower_bound=-5.0, seed=0,
                          device="cuda", cu_seqlens=[0, args.tokens])
        kw = {"A_log": inp["A_log"], "dt_bias": inp["dt_bias"], "cu_seqlens": inp["cu_seqlens"],
              "output_final_state": True}
        for cp in ("off", "auto"):
            run = kernel.with_policy(SchedulePolicy(intracard_cp=cp, fused=args.fused))

            def call(inp=inp, kw=kw, run=run):
                return run(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], **kw)

            t = stage_times_ms(call, args.iters)
            chain, chain_t = chain_ms(t)
            # Without CP the chain kernel runs the steps one after another: its time per step is the step
            # latency (from above, where the fused kernel's prepare warps share it).
            per_step = chain_t * 1000.0 / steps if cp == "off" else None
            row = {"heads": heads, "cp": cp, "chain": chain, "us_per_step": per_step}
            row.update({f"{s}_ms": t.get(s, 0.0) for s in ("prepare", "recurrence", "fused", "merge")})
            rows.append(row)
            step_txt = f"{per_step:8.3f}" if per_step is not None else f"{'-':>8}"
            print(f"{heads:>5} {cp:>4} {row['prepare_ms']:11.3f} {row['recurrence_ms']:14.3f} "
                  f"{row['fused_ms']:9.3f} {row['merge_ms']:9.3f} {step_txt}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        data = {"device": torch.cuda.get_device_name(), "tokens": args.tokens, "family": kernel.plan.family,
                "fused": args.fused, "rows": rows}
        args.json.write_text(json.dumps(data, indent=2) + "\n")
        args.json.with_suffix(".md").write_text(markdown(data))
        print(f"wrote {args.json} and {args.json.with_suffix('.md')}")
    return 0


def markdown(data: dict) -> str:
    """The result table as Markdown, committed next to the JSON."""
    lines = [
        f"# Recurrence per-step latency, {data['device']}, family {data.get('family', 'wgmma')}", "",
        f"One sequence of {data['tokens']} tokens ({-(-data['tokens'] // 16)} steps of 16 tokens), K=V=128, "
        "bf16, headline spec; device time per call from the CUDA profiler (`benchmarks/bench_step.py`). "
        "With `cp=off` the recurrence is the serial chain, so its time per step is the step latency; "
        "`cp=auto` uses intra-card context parallelism where the runtime rule picks it "
        "(recurrence = prescan + segment pass). Where the fused prepare + recurrence kernel ran "
        f"(fused {data.get('fused', 'auto')}), the steps are timed from it: an upper bound, its "
        "prepare warps sharing the time.", "",
        "| heads | cp | prepare ms | recurrence ms | fused ms | merge ms | us/step |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in data["rows"]:
        step = "-" if r["us_per_step"] is None else f"{r['us_per_step']:.3f}"
        if r["us_per_step"] is not None and r.get("chain") == "fused":
            step += " (fused)"
        lines.append(f"| {r['heads']} | {r['cp']} | {r['prepare_ms']:.3f} | {r['recurrence_ms']:.3f} | "
                     f"{r.get('fused_ms', 0.0):.3f} | {r['merge_ms']:.3f} | {step} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
