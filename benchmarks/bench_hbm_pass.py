#!/usr/bin/env python
"""What the card's HBM reaches for the decode step's bytes, as a reference for `bench_decode.py`'s floors.

For N x HV states of K x V (the bytes a decode step reads once and writes once), times torch's own copy to
another buffer and an in-place pass (x *= 1) under CUDA-graph replay, against the floor (bytes over the
nominal bandwidth). Prints a table; writes no file.

    python benchmarks/bench_hbm_pass.py [--bandwidth-tbps 3.35]
"""

from __future__ import annotations

import argparse

import torch


def replay_us(fn, iters: int = 50) -> float:
    """Median CUDA-graph replay time of `fn` in microseconds (event-timed, after three eager warm-ups)."""
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return sorted(times)[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bandwidth-tbps", type=float, default=3.35,
                   help="nominal HBM bandwidth in TB/s (H100 SXM: 3.35)")
    args = p.parse_args()
    print(torch.cuda.get_device_name())
    print("| state | HV, N | floor us | copy us | in-place us |")
    print("|---|---|---|---|---|")
    for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        for hv, n in ((32, 32), (32, 256), (64, 256)):
            x = torch.randn(n, hv, 128, 128, device="cuda").to(dtype)
            y = torch.empty_like(x)
            floor = 2 * x.numel() * x.element_size() / (args.bandwidth_tbps * 1e12) * 1e6
            copy = replay_us(lambda x=x, y=y: y.copy_(x))
            inplace = replay_us(lambda x=x: x.mul_(1.0))
            print(f"| {name} | {hv}, {n} | {floor:.1f} | {copy:.1f} ({copy / floor:.2f}x) | "
                  f"{inplace:.1f} ({inplace / floor:.2f}x) |", flush=True)


if __name__ == "__main__":
    main()
