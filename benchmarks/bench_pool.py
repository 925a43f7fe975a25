#!/usr/bin/env python
"""Prefill on a state pool: kdagen's forward reading and writing the pool in place, against the same forward
on compact states with the engine's gather before and scatter after, and the cost of prefix-cache
checkpoints every 64 tokens.

Rows: HV value heads (H = HV), K = V = 128, N sequences of T tokens each (the pieces of a chunked prefill),
each continuing from a random slot of a pool of 2N + 1 slots. Columns (CUDA-graph replay device time, us):
- `pool`: ``kernel(..., state_pool=pool, state_indices=idx)``;
- `gather+scatter`: ``h0 = pool[idx]``, ``kernel(..., initial_state=h0, output_final_state=True)``,
  ``pool[idx] = ht`` (what an engine does without the pool form);
- `pool+ckpt`: the pool form with ``checkpoint_interval=64`` (T / 64 checkpoints a sequence, into slots of a
  second part of the pool) and its overhead over `pool`.

    PYTHONPATH=. python benchmarks/bench_pool.py [--spec specs/sm90.yaml:k128] [--quick] [--out DIR]
        [--policy fused=off ...]

``--policy KEY=VALUE`` sets a field of the kernel's `kdagen.policy.SchedulePolicy` for every call (e.g.
``fused=off`` times the two-stage path where the fused kernel would run).

Output: a table on stdout and JSON + Markdown in `benchmarks/out/` (git-ignored).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

import bench_fwd  # noqa: E402
import torch  # noqa: E402

from kdagen.dtypes import DTYPES  # noqa: E402
from kdagen.reference import make_inputs  # noqa: E402

CHECKPOINT_INTERVAL = 64
GRID = ((32, 1, 2048), (32, 1, 8192), (32, 8, 512), (32, 8, 2048), (32, 32, 512), (32, 32, 2048),
        (64, 8, 2048))
QUICK = ((32, 1, 2048), (32, 8, 2048), (32, 32, 512))


def make_case(spec: Any, hv: int, n: int, t: int, seed: int = 0) -> dict[str, Any]:
    """Inputs of N sequences of T tokens, a pool with a slot for each and room for their checkpoints."""
    inp = make_inputs(n, t, hv // spec.gva_ratio, hv, spec.head_dim_k, spec.head_dim_v, dtype=spec.dtype,
                      beta_dtype=spec.beta_dtype, g_dtype=spec.g_dtype, gate=spec.gate,
                      safe_gate=spec.safe_gate, lower_bound=spec.lower_bound, seed=seed, device="cuda",
                      l2norm_qk=spec.l2norm_qk, state_layout=spec.state_layout, beta_mode=spec.beta)
    inner = (hv, spec.head_dim_k, spec.head_dim_v) if spec.state_layout == "kv" else (
        hv, spec.head_dim_v, spec.head_dim_k)
    per_seq = t // CHECKPOINT_INTERVAL
    slots = 2 * n + 1 + n * per_seq
    sdt = getattr(torch, DTYPES[spec.state_dtype].torch)
    pool = (torch.randn(slots, *inner, device="cuda") * 0.1).to(sdt)
    perm = torch.randperm(2 * n + 1, device="cuda")
    idx = perm[:n].to(torch.int32)
    ckpt = (2 * n + 1 + torch.arange(n * per_seq, device="cuda", dtype=torch.int32)).view(n, per_seq)
    return {**inp, "pool": pool, "idx": idx, "ckpt": ckpt, "start": torch.zeros(n, dtype=torch.int32,
                                                                                device="cuda")}


def calls(kernel: Any, c: dict[str, Any]) -> dict[str, Any]:
    args = (c["q"], c["k"], c["v"], c["g"], c["beta"])
    gate = {"A_log": c["A_log"], "dt_bias": c["dt_bias"]}
    idx_long = c["idx"].long()

    def pool() -> None:
        kernel(*args, **gate, state_pool=c["pool"], state_indices=c["idx"])

    def gather_scatter() -> None:
        _, ht = kernel(*args, **gate, initial_state=c["pool"][idx_long], output_final_state=True)
        c["pool"][idx_long] = ht

    def pool_ckpt() -> None:
        kernel(*args, **gate, state_pool=c["pool"], state_indices=c["idx"],
               checkpoint_interval=CHECKPOINT_INTERVAL, start_positions=c["start"],
               checkpoint_indices=c["ckpt"])

    return {"pool": pool, "gather+scatter": gather_scatter, "pool+ckpt": pool_ckpt}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--spec", default="specs/sm90.yaml:k128", help="kdagen spec reference (file.yaml:name)")
    ap.add_argument("--quick", action="store_true", help="three rows")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    ap.add_argument("--policy", nargs="*", default=[], metavar="KEY=VALUE",
                    help="scheduling policy fields for every call, e.g. fused=off")
    args = ap.parse_args(argv)

    import kdagen

    card = bench_fwd.detect_card(None, None)
    kernel = kdagen.get_kernel(args.spec)
    policy = dict(kv.split("=", 1) for kv in args.policy)
    if policy:
        kernel = kernel.with_policy(policy)
    spec = kernel.spec
    rows = []
    shown = " ".join(args.policy) or "default policy"
    print(f"{card.name}: {args.spec} ({shown}), CUDA-graph replay device time (us)")
    print(f"{'HV':>3} {'N':>3} {'T':>5} {'pool':>9} {'gath+scat':>9} {'speedup':>8} {'pool+ckpt':>9} "
          f"{'ckpt +%':>8}")
    with torch.no_grad():
        for hv, n, t in (QUICK if args.quick else GRID):
            c = make_case(spec, hv, n, t)
            times = {name: bench_fwd.graph_ms(fn) * 1e3 for name, fn in calls(kernel, c).items()}
            row = {"hv": hv, "n": n, "t": t, **{f"{k}_us": v for k, v in times.items()},
                   "speedup": times["gather+scatter"] / times["pool"],
                   "ckpt_overhead": times["pool+ckpt"] / times["pool"] - 1.0}
            rows.append(row)
            print(f"{hv:>3} {n:>3} {t:>5} {times['pool']:9.1f} {times['gather+scatter']:9.1f} "
                  f"{row['speedup']:7.2f}x {times['pool+ckpt']:9.1f} {100 * row['ckpt_overhead']:7.1f}%",
                  flush=True)
            del c
            torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    meta = {"card": card.name, "spec": args.spec, "date": stamp, "checkpoint_interval": CHECKPOINT_INTERVAL,
            "policy": policy}
    (args.out / f"pool-{card.slug}-{stamp}.json").write_text(
        json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"# Prefill on a state pool ({card.name}, {args.spec}, {shown})", "",
             "| HV | N | T | pool us | gather+scatter us | speedup | pool+ckpt us | checkpoints |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['hv']} | {r['n']} | {r['t']} | {r['pool_us']:.1f} | {r['gather+scatter_us']:.1f} | "
              f"{r['speedup']:.2f}x | {r['pool+ckpt_us']:.1f} | +{100 * r['ckpt_overhead']:.1f}% |"
              for r in rows]
    (args.out / f"pool-{card.slug}-{stamp}.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}/pool-{card.slug}-{stamp}.json and .md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
