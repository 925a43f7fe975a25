#!/usr/bin/env python
"""One small call, timed again and again: how much of its benchmark time is the host's.

A call such as B=1 T=512 H=64 takes ~0.05 ms on the GPU, about as long as its Python side (checks,
allocations, the launch), so its per-call time in ``bench_fwd.py`` moves with the host and with where it falls
in the run. This script times one config of ``bench_fwd.py`` (same inputs, same ``time_ms``: CUDA events
around each whole call, median of ``--iters``) in ``--rounds`` rounds, for kdagen and FLA, and then kdagen's
device time alone by CUDA-graph replay (no host work between launches).

    PYTHONPATH=. python benchmarks/bench_small.py [--batch 1] [--tokens 512] [--heads 64] [--spec f.yaml:name]

It prints its results and writes no file; a log of a run belongs in ``benchmarks/out/`` (git-ignored), e.g.
``... | tee benchmarks/out/bench_small.log``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_fwd  # noqa: E402
import torch  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--tokens", type=int, default=512, help="tokens per sequence")
    p.add_argument("--heads", type=int, default=bench_fwd.HEADS, help="value heads")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--spec", help='kdagen spec "file.yaml:name" (default: the headline spec dict)')
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_small: no CUDA GPU visible; nothing to run")
        return 2
    target = bench_fwd.KdagenTarget(args.spec if args.spec else dict(bench_fwd.HEADLINE_SPEC))
    target.load()
    if target.error:
        print(f"kdagen: could not get the kernel: {target.error}")
        return 1
    cfg = bench_fwd.Config(f"B{args.batch}-T{args.tokens}", "fixed", (args.tokens,) * args.batch, args.heads)
    inp = bench_fwd.make_bench_inputs(cfg, torch.device("cuda"), target.problem)
    fla, note = bench_fwd.load_fla()
    calls = {"kdagen": target.call(inp)}
    if fla is not None:
        calls["FLA"] = bench_fwd.fla_call(fla, inp, target.problem)
    print(f"{torch.cuda.get_device_name()}; {note}; {cfg.name} H={cfg.heads}")
    for name, fn in calls.items():
        for _ in range(200):  # steady state: clocks, allocator, lazy loads
            fn()
        torch.cuda.synchronize()
        rounds = [bench_fwd.time_ms(fn, 10, args.iters) for _ in range(args.rounds)]
        print(f"{name}: per-call medians (ms) " + " ".join(f"{x:.3f}" for x in rounds)
              + f"; their median {statistics.median(rounds):.3f}")
    print(f"kdagen: device time by CUDA-graph replay {bench_fwd.graph_ms(calls['kdagen'], 200):.4f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
