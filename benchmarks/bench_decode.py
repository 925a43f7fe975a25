"""Decode and speculative-decode verify: kdagen `KDAKernel.decode` against FLA's `fused_recurrent_kda_fwd`,
both updating a slot-indexed state pool in place, in the same process on the same inputs. FLA's pool is
fp32; kdagen's has the spec's `state_dtype` (a bf16 state is compared with FLA's fp32 step).

Rows: HV in {32, 64} (H = HV, K = V = 128), N requests in {1, 8, 32, 128, 256}, S tokens a request in
{1, 2, 4, 8} (S > 1: one slot a token, FLA's verify semantics). Times are CUDA-graph replay device times
(`bench_fwd.graph_ms`), the best of `--rounds` rounds that time a row's calls in turn; the floor is the
pool's bytes read and written (S + 1 state copies a request for S > 1, two for S = 1) over the card's HBM
bandwidth.

    python benchmarks/bench_decode.py [--spec specs/sm90.yaml:k128] [--quick] [--paths] [--rounds 2]
        [--out DIR]

`kdagen us` is the automatic choice between the decode stages; `--paths` also times each of them forced
(one CTA an item; the streaming grid, where the variant has it).

Output: a table on stdout and JSON + Markdown in `benchmarks/out/` (git-ignored; commit a run by copying
it into benchmarks/results/<card>/).
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

HVS = (32, 64)
NS = (1, 8, 32, 128, 256)
SS = (1, 2, 4, 8)


def floor_us(hv: int, n: int, s: int, k: int, v: int, tbps: float, elem_bytes: int = 4) -> float:
    """Bytes of the state pool a step must move over the HBM bandwidth: one read and one write a request for
    S = 1, one read and S writes (the state after each token) for S > 1."""
    copies = 2 if s == 1 else 1 + s
    return n * hv * k * v * elem_bytes * copies / (tbps * 1e12) * 1e6


def make_inputs(spec: Any, hv: int, n: int, s: int, seed: int = 0) -> dict[str, Any]:
    torch.manual_seed(seed)
    dev, k, v = "cuda", spec.head_dim_k, spec.head_dim_v
    dt16 = torch.bfloat16 if spec.dtype == "bf16" else torch.float16
    h = hv // spec.gva_ratio
    slots = 2 * n * s + 1
    inner = (hv, k, v) if spec.state_layout == "kv" else (hv, v, k)
    idx = torch.randperm(slots - 1, device=dev)[: n * s].to(torch.int32).view(n, s)
    pool = torch.randn(slots, *inner, device=dev, dtype=torch.float32) * 0.1
    return {
        "q": torch.randn(n, s, h, k, device=dev, dtype=dt16),
        "k": torch.randn(n, s, h, k, device=dev, dtype=dt16),
        "v": torch.randn(n, s, hv, v, device=dev, dtype=dt16),
        "g": torch.randn(n, s, hv, k, device=dev, dtype=torch.float32),
        "beta": torch.rand(n, s, hv, device=dev, dtype=torch.float32),
        "A_log": torch.rand(hv, device=dev, dtype=torch.float32) - 2.0,
        "dt_bias": torch.randn(hv * k, device=dev, dtype=torch.float32) * 0.1,
        "pool": pool.to(getattr(torch, DTYPES[spec.state_dtype].torch)),
        "fla_pool": pool,
        "idx": idx[:, 0].contiguous() if s == 1 else idx,
        "accepted": torch.full((n,), s, dtype=torch.int32, device=dev),
    }


def launch_floor_us() -> float:
    """CUDA-graph device time of one one-element kernel, as the calls are timed: the floor under any call
    of one kernel in this harness (a decode call of one request is about its latency, not its bytes)."""
    x = torch.zeros(1, device="cuda")
    return min(bench_fwd.graph_ms(lambda: x.add_(1.0)) for _ in range(3)) * 1e3


def interleaved_us(calls: dict[str, Any], rounds: int) -> dict[str, float]:
    """Each call's CUDA-graph device time (us), the best of `rounds` rounds that time every call in turn:
    the first call timed after a row's inputs are made does not pay for coming first."""
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(rounds):
        for name, fn in calls.items():
            best[name] = min(best[name], bench_fwd.graph_ms(fn) * 1e3)
    return best


def kdagen_call(kernel: Any, inp: dict[str, Any], s: int):
    out = torch.empty_like(inp["v"])
    extra = {} if s == 1 else {"num_accepted_tokens": inp["accepted"]}

    def run():
        kernel.decode(
            inp["q"],
            inp["k"],
            inp["v"],
            inp["g"],
            inp["beta"],
            A_log=inp["A_log"],
            dt_bias=inp["dt_bias"],
            state_pool=inp["pool"],
            state_indices=inp["idx"],
            out=out,
            **extra,
        )

    return run


def fla_call(fla_fwd: Any, spec: Any, inp: dict[str, Any], s: int):
    out = torch.empty_like(inp["v"])
    gate = spec.gate != "precomputed"
    idx = inp["idx"].to(torch.int64)
    extra = {} if s == 1 else {"num_accepted_tokens": inp["accepted"].to(torch.int64)}

    def run():
        fla_fwd(
            inp["q"],
            inp["k"],
            inp["v"],
            inp["g"],
            inp["beta"],
            A_log=inp["A_log"] if gate else None,
            dt_bias=inp["dt_bias"] if gate else None,
            initial_state=inp["fla_pool"],
            inplace_final_state=True,
            state_v_first=spec.state_layout == "vk",
            ssm_state_indices=idx,
            use_qk_l2norm_in_kernel=spec.l2norm_qk,
            use_gate_in_kernel=gate,
            lower_bound=spec.lower_bound,
            out=out,
            **extra,
        )

    return run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--spec", default="specs/sm90.yaml:k128", help="kdagen spec reference (file.yaml:name)")
    ap.add_argument("--quick", action="store_true", help="N in {1, 32, 256}, S in {1, 4}")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    ap.add_argument("--paths", action="store_true", help="also time each decode stage forced")
    ap.add_argument("--rounds", type=int, default=2, help="rounds timing a row's calls in turn (the best)")
    ap.add_argument(
        "--hbm-tbps", type=float, default=None, help="HBM bandwidth for the floor (default: card)"
    )
    args = ap.parse_args(argv)

    import kdagen

    card = bench_fwd.detect_card(args.hbm_tbps, None)
    from kdagen.policy import SchedulePolicy

    kernel = kdagen.get_kernel(args.spec)
    spec = kernel.spec
    forced = {}
    if args.paths:
        forced["per-item"] = kernel.with_policy(SchedulePolicy(decode_stream="off"))
        if kernel._decode_stream is not None:
            forced["streaming"] = kernel.with_policy(SchedulePolicy(decode_stream="on"))
    try:
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd  # type: ignore[import-not-found]
    except Exception as e:  # ImportError, or a broken Triton install
        fused_recurrent_kda_fwd = None
        print(f"FLA not available ({type(e).__name__}: {e}); kdagen only")
    ns, ss = ((1, 32, 256), (1, 4)) if args.quick else (NS, SS)
    rows = []
    cols = (
        ("HV", 3),
        ("N", 4),
        ("S", 2),
        ("kdagen us", 10),
        *((f"{p} us", 13) for p in forced),
        ("FLA us", 9),
        ("speedup", 8),
        ("floor us", 9),
        ("x floor", 8),
    )
    head = " ".join(f"{name:>{width}}" for name, width in cols)
    floor_launch = launch_floor_us()
    print(
        f"{card.name}: {args.spec} ({spec.state_layout}, {spec.state_dtype} state; FLA: fp32), CUDA-graph "
        f"replay device time; one one-element kernel: {floor_launch:.1f} us\n{head}"
    )
    with torch.no_grad():
        for hv in HVS:
            for n in ns:
                for s in ss:
                    inp = make_inputs(spec, hv, n, s)
                    calls = {"kdagen": kdagen_call(kernel, inp, s),
                             **{p: kdagen_call(kv, inp, s) for p, kv in forced.items()}}
                    if fused_recurrent_kda_fwd is not None:
                        calls["FLA"] = fla_call(fused_recurrent_kda_fwd, spec, inp, s)
                    us = interleaved_us(calls, args.rounds)
                    ours = us.pop("kdagen")
                    theirs = us.pop("FLA", None)
                    paths = us
                    fl = floor_us(
                        hv,
                        n,
                        s,
                        spec.head_dim_k,
                        spec.head_dim_v,
                        card.hbm_tbps or 3.35,
                        DTYPES[spec.state_dtype].nbytes,
                    )
                    row = {
                        "hv": hv,
                        "n": n,
                        "s": s,
                        "kdagen_us": ours,
                        "paths_us": paths,
                        "fla_us": theirs,
                        "floor_us": fl,
                        "speedup": theirs / ours if theirs else None,
                        "x_floor": ours / fl,
                    }
                    rows.append(row)
                    sp = f"{row['speedup']:.2f}x" if row["speedup"] else "-"
                    fla_txt = f"{theirs:9.1f}" if theirs else f"{'-':>9}"
                    print(
                        f"{hv:>3} {n:>4} {s:>2} {ours:10.1f} "
                        + "".join(f"{us:13.1f} " for us in paths.values())
                        + f"{fla_txt} {sp:>8} {fl:9.1f} "
                        f"{row['x_floor']:7.2f}x",
                        flush=True,
                    )
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    meta = {
        "card": card.name,
        "spec": args.spec,
        "state_layout": spec.state_layout,
        "state_dtype": spec.state_dtype,
        "date": stamp,
        "launch_floor_us": floor_launch,
        "rounds": args.rounds,
    }
    (args.out / f"decode-{card.slug}-{stamp}.json").write_text(
        json.dumps({"meta": meta, "rows": rows}, indent=1)
    )
    lines = [
        f"# Decode: kdagen vs FLA fused_recurrent_kda_fwd ({card.name}, {args.spec})",
        "",
        f"kdagen's state: {spec.state_dtype}, {spec.state_layout}; FLA's: fp32. The floor: the kdagen pool's "
        "bytes read and written over the card's HBM bandwidth. A graph replay of one one-element kernel, "
        f"timed the same way: {floor_launch:.1f} us (the least any call of one kernel takes here).",
        "",
        "| HV | N | S | kdagen us | "
        + "".join(f"{p} us | " for p in forced)
        + "FLA us | speedup | floor us | x floor |",
        "|---|---|---|---|" + "---|" * len(forced) + "---|---|---|---|",
    ]
    for r in rows:
        fla_txt = f"{r['fla_us']:.1f}" if r["fla_us"] else "-"
        sp = f"{r['speedup']:.2f}x" if r["speedup"] else "-"
        lines.append(
            f"| {r['hv']} | {r['n']} | {r['s']} | {r['kdagen_us']:.1f} | "
            + "".join(f"{us:.1f} | " for us in r["paths_us"].values())
            + f"{fla_txt} | {sp} | "
            f"{r['floor_us']:.1f} | {r['x_floor']:.2f}x |"
        )
    (args.out / f"decode-{card.slug}-{stamp}.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}/decode-{card.slug}-{stamp}.json and .md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
