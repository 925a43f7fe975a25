#!/usr/bin/env python
"""kdagen vs FLA ``chunk_kda``: the KDA forward benchmark of design.md "Benchmarks" (inputs: kda-math §4.4).

Both run in this process on the same GPU, on the same inputs: H=64, K=V=128, bf16 q/k/v and raw gate,
l2norm and the lower-bound gate (-5, safe_gate) computed in the kernel, final state on, every input packed as
[1, B*T] with int32 cu_seqlens. With ``--spec``, the spec's head dims, GVA ratio (64 value heads), gate,
bound, safe-gate promise and l2norm flag set the problem, and FLA is called with the same options. Suites:
fixed B in {1,2} x T in {512 ... 16384}; 18 varlen configs (10/20 sequences x 4096/8192/16384 tokens x
uniform/random/skewed); ``--long``: one sequence of 65536 tokens, H=4.

Time is the median over ``--iters`` calls of CUDA events recorded around the whole Python call (gate, l2norm,
every launch, allocations), after one untimed call and ``--warmup`` more, taken in ``--rounds`` rounds in
which FLA and kdagen take turns; a config's time is the median of its rounds (a slow spell of the host then
lands on both sides, not on whichever ran during it). Before the first config, both run for ``--warmup-s``
seconds on its inputs, so that the process and the GPU are in their steady state (in one H200 run without it,
the first rows took ~1.6x as long as the same calls in a later process on that machine). Reported: ms for
each, speedup = FLA / kdagen, the geometric mean, kdagen's device time alone (the call captured in a CUDA
graph and replayed: no host time; kdagen only, since FLA's varlen path derives its chunk indices on the host
with .tolist()), kdagen's accuracy against FLA (relative RMSE of o and the final state), and per config the
physical floors: HBM bytes / bandwidth, FLOPs / peak bf16 dense, and the serial chain x ``--step-us``; "of
floor" is the binding (largest) floor over the measured time. The serial chain is max_len / chunk steps,
except where kdagen cuts sequences into segments (intra-card CP, the ``--long`` config): then a segment's
steps twice (its map, then its pass) plus one merge step per segment, bound "serial-cp".

Run from the repository root on a GPU machine:

    PYTHONPATH=. python benchmarks/bench_fwd.py [--quick] [--only fixed|varlen] [--long] [--spec f.yaml:name]

It writes the JSON rows, a Markdown table and a PNG plot to ``benchmarks/out/`` (git-ignored); a run that
becomes a reference is written with ``--json benchmarks/results/<card>/<spec>.json`` or copied there.

FLA (fla-core 0.6.0) is optional: without it kdagen runs alone. A config on which kdagen (or FLA) raises
shows the error in its row and the run goes on.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import re
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script: make `import kdagen` work from a checkout
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from kdagen.reference import cu_seqlens_from_lengths, kda_gate, rel_rmse, varlen_lengths  # noqa: E402

HEADLINE_SPEC: dict[str, Any] = {
    "arch": "sm_90a",
    "gate": "lower_bound",
    "lower_bound": -5.0,
    "safe_gate": True,
    "l2norm_qk": True,
    "g_dtype": "bf16",
    "beta_dtype": "fp32",
    "state_layout": "kv",
}
HEADS = 64
SEED = 42
FIXED_GRID = [(b, t) for b in (1, 2) for t in (512, 1024, 4096, 8192, 16384)]
VARLEN_GRID = [(n, total, dist) for total in (4096, 8192, 16384) for n in (10, 20)
               for dist in ("uniform", "random", "skewed")]
QUICK_FIXED = [(1, 512), (2, 4096), (1, 16384)]
QUICK_VARLEN = [(20, 4096, "uniform"), (10, 8192, "random"), (20, 16384, "skewed")]
_TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# ---------------------------------------------------------------------------------------------------------
# configs, card, floors
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    name: str
    kind: str  # "fixed" | "varlen" | "long"
    lengths: tuple[int, ...]
    heads: int = HEADS

    @property
    def total(self) -> int:
        return sum(self.lengths)

    @property
    def max_len(self) -> int:
        return max(self.lengths)


@dataclass(frozen=True)
class Problem:
    """The operator both implementations compute, read from the kdagen spec under test (the headline spec's
    by default), so that FLA is called with the same gate, bound, safe-gate promise, l2norm and head dims."""

    head_dim_k: int = 128
    head_dim_v: int = 128
    gva_ratio: int = 1
    gate: str = "lower_bound"
    lower_bound: float | None = -5.0
    safe_gate: bool = True
    l2norm_qk: bool = True

    @classmethod
    def from_spec(cls, info: dict[str, Any]) -> Problem:
        """From a spec's fields (`KernelSpec.model_dump`); fields it lacks keep the headline's values."""
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in info.items() if k in names})

    def qk_heads(self, heads: int) -> int:
        """q/k heads H for `heads` value heads HV (the benchmark's head counts are value heads)."""
        if heads % self.gva_ratio:
            raise ValueError(f"heads: {heads} value heads are not a multiple of gva_ratio {self.gva_ratio}")
        return heads // self.gva_ratio

    def flop_per_token_head(self) -> float:
        """landscape.md's count for FLA's 64-token chunks: 6 K V on the state path, 6 C K + 4 C V + 2 C^2 / 3
        intra-chunk (183 kFLOP at K = V = 128), per token and value head."""
        k, v, c = self.head_dim_k, self.head_dim_v, 64
        return 6 * k * v + 6 * c * k + 4 * c * v + 2 * c * c / 3

    def fla_kwargs(self) -> dict[str, Any]:
        """chunk_kda's options for this operator (fla-core 0.6.0): the gate in the kernel unless precomputed,
        the sigmoid form selected by `lower_bound`, the softplus form by its absence."""
        in_kernel = self.gate != "precomputed"
        return {"use_qk_l2norm_in_kernel": self.l2norm_qk, "use_gate_in_kernel": in_kernel,
                "safe_gate": self.safe_gate,
                "lower_bound": self.lower_bound if self.gate == "lower_bound" else None}


HEADLINE = Problem()


@dataclass(frozen=True)
class Card:
    name: str
    slug: str
    hbm_tbps: float | None  # TB/s
    bf16_tflops: float | None  # dense TFLOP/s


_KNOWN_CARDS = (  # (pattern in torch.cuda.get_device_name, slug, TB/s, bf16 dense TFLOP/s)
    (r"H200", "h200", 4.8, 989.0),
    (r"H100.*PCIe", "h100-pcie", 2.0, 756.0),
    (r"H100", "h100-sxm", 3.35, 989.0),
)


def detect_card(hbm_tbps: float | None, peak_tflops: float | None) -> Card:
    name = torch.cuda.get_device_name()
    slug, bw, peak = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-"), None, None
    for pattern, known_slug, known_bw, known_peak in _KNOWN_CARDS:
        if re.search(pattern, name):
            slug, bw, peak = known_slug, known_bw, known_peak
            break
    return Card(name, slug, hbm_tbps if hbm_tbps is not None else bw,
                peak_tflops if peak_tflops is not None else peak)


def build_configs(quick: bool, only: str | None, long: bool, gva_ratio: int = 1) -> list[Config]:
    configs: list[Config] = []
    if only in (None, "fixed"):
        for b, t in QUICK_FIXED if quick else FIXED_GRID:
            configs.append(Config(f"B{b}-T{t}", "fixed", (t,) * b))
    if only in (None, "varlen"):
        for n, total, dist in QUICK_VARLEN if quick else VARLEN_GRID:
            configs.append(Config(f"N{n}-T{total}-{dist}", "varlen", tuple(varlen_lengths(n, total, dist))))
    if long:
        heads = max(4, gva_ratio)  # value heads: at least one q/k head
        configs.append(Config(f"long-T65536-H{heads}", "long", (65536,), heads=heads))
    return configs


@dataclass(frozen=True)
class Floors:
    hbm_ms: float | None
    flop_ms: float | None
    serial_ms: float
    bytes: int
    flops: float
    cp: bool = False  # the serial chain is that of intra-card CP segments

    @property
    def binding(self) -> tuple[str, float]:
        serial = "serial-cp" if self.cp else "serial"
        options = {"hbm": self.hbm_ms, "flop": self.flop_ms, serial: self.serial_ms}
        name = max((k for k, v in options.items() if v is not None), key=lambda k: options[k] or 0.0)
        return name, float(options[name] or 0.0)


def physical_floors(cfg: Config, card: Card, step_us: float, chunk: int, io_bytes: dict[str, int],
                    segment: int | None = None, problem: Problem = HEADLINE) -> Floors:
    """Lower bounds on the time of one call: every byte moved once, every FLOP at peak, and the serial chain
    of ceil(max_len / chunk) dependent state updates per (sequence, head). Cut into segments of `segment`
    tokens (intra-card CP) the chain is a segment's steps for its map, the merge's one step per segment, and
    the segment's steps again for its pass."""
    th = cfg.total * cfg.heads  # token x value head
    K, V = problem.head_dim_k, problem.head_dim_v
    # q and k are read once per q/k head, shared by gva_ratio value heads
    per_token_head = (2 * K * io_bytes["qk"] / problem.gva_ratio + V * io_bytes["v"] + K * io_bytes["g"]
                      + io_bytes["beta"] + V * io_bytes["o"])  # ~1.3 KB for bf16 q/k/v/g/o and fp32 beta
    nbytes = round(th * per_token_head) + len(cfg.lengths) * cfg.heads * K * V * 4  # + the fp32 final state
    flops = problem.flop_per_token_head() * th
    hbm_ms = nbytes / (card.hbm_tbps * 1e12) * 1e3 if card.hbm_tbps else None
    flop_ms = flops / (card.bf16_tflops * 1e12) * 1e3 if card.bf16_tflops else None
    if segment:
        steps = 2 * math.ceil(min(segment, cfg.max_len) / chunk) + math.ceil(cfg.max_len / segment)
    else:
        steps = math.ceil(cfg.max_len / chunk)
    serial_ms = steps * step_us * 1e-3
    return Floors(hbm_ms, flop_ms, serial_ms, nbytes, flops, cp=bool(segment))


# ---------------------------------------------------------------------------------------------------------
# inputs, implementations, timing
# ---------------------------------------------------------------------------------------------------------


def make_bench_inputs(
    cfg: Config, device: torch.device, problem: Problem = HEADLINE
) -> dict[str, torch.Tensor | None]:
    """kda-math §4.4 (cuLA prepare_safe_gate_inputs): seed 42, q/k/v/g_raw randn bf16, beta sigmoid(randn)
    fp32, A_log randn(HV) fp32, dt_bias randn(HV*K) fp32; packed [1, total] with int32 cu_seqlens. With a
    precomputed gate, g is the fp32 log-decay of that raw g (the sigmoid form with the spec's bound under
    safe_gate, else softplus), and A_log and dt_bias are None."""
    torch.manual_seed(SEED)
    hv, kd, vd = cfg.heads, problem.head_dim_k, problem.head_dim_v
    h = problem.qk_heads(hv)
    q, k = (torch.randn((1, cfg.total, h, kd), dtype=torch.bfloat16, device=device) for _ in range(2))
    v = torch.randn((1, cfg.total, hv, vd), dtype=torch.bfloat16, device=device)
    g = torch.randn((1, cfg.total, hv, kd), dtype=torch.bfloat16, device=device)
    beta = torch.randn(1, cfg.total, hv, dtype=torch.float32, device=device).sigmoid()
    A_log: torch.Tensor | None = torch.randn(hv, dtype=torch.float32, device=device)
    dt_bias: torch.Tensor | None = torch.randn(hv * kd, dtype=torch.float32, device=device)
    if problem.gate == "precomputed":
        bounded = problem.safe_gate and problem.lower_bound is not None
        g = kda_gate(g, gate="lower_bound" if bounded else "softplus", A_log=A_log, dt_bias=dt_bias,
                     lower_bound=problem.lower_bound if bounded else None)
        A_log = dt_bias = None
    cu = cu_seqlens_from_lengths(cfg.lengths, device, dtype=torch.int32)
    return {"q": q, "k": k, "v": v, "g": g, "beta": beta, "A_log": A_log, "dt_bias": dt_bias,
            "cu_seqlens": cu}


def time_ms(fn: Callable[[], Any], warmup: int, iters: int) -> float:
    """Median of per-call CUDA-event times around the whole Python call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(iters)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def graph_ms(fn: Callable[[], Any], replays: int = 100) -> float:
    """Device time of one call: the call captured in a CUDA graph, replayed back to back (no host work between
    launches), mean per replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # allocations of the first call happen outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    torch.cuda.synchronize()
    for _ in range(10):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    del graph
    return start.elapsed_time(end) / replays


def load_fla() -> tuple[Callable[..., Any] | None, str]:
    try:
        import fla  # type: ignore[import-not-found]
        from fla.ops.kda import chunk_kda  # type: ignore[import-not-found]
    except Exception as e:  # ImportError, or a broken Triton install
        return None, f"FLA not available ({type(e).__name__}: {e}); running kdagen only"
    version = getattr(fla, "__version__", "?")
    note = f"FLA {version}" + ("" if version == "0.6.0" else " (the reference baseline is fla-core 0.6.0)")
    return chunk_kda, note


def fla_call(chunk_kda: Callable[..., Any], inp: dict[str, torch.Tensor],
             problem: Problem = HEADLINE) -> Callable[[], Any]:
    options = problem.fla_kwargs()

    def call() -> Any:
        return chunk_kda(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], A_log=inp["A_log"],
                         dt_bias=inp["dt_bias"], output_final_state=True, cu_seqlens=inp["cu_seqlens"],
                         **options)

    return call


@dataclass
class KdagenTarget:
    """The kdagen kernel under test and what the benchmark needs to know of its spec."""

    spec_arg: Any
    kernel: Any = None
    error: str | None = None
    info: dict[str, Any] = field(default_factory=dict)

    def load(self) -> None:
        try:
            import kdagen

            _, spec = kdagen.resolve_spec(self.spec_arg)
            self.info = spec.model_dump(mode="json")
            self.kernel = kdagen.get_kernel(self.spec_arg)
        except Exception as e:  # report in every row, keep benchmarking FLA
            self.error = _short_error(e)

    @property
    def problem(self) -> Problem:
        """The operator of the spec (the headline's where the spec could not be read)."""
        return Problem.from_spec(self.info) if self.info else Problem.from_spec(HEADLINE_SPEC)

    @property
    def chunk(self) -> int:
        return int(self.info.get("chunk_size", 16))

    def cp_segment_len(self, cfg: Config) -> int | None:
        """The intra-card CP segment length kdagen picks for this config (None: whole sequences)."""
        if self.kernel is None:
            return None
        return self.kernel.cp_segment_len(len(cfg.lengths), cfg.total, cfg.heads)

    def io_bytes(self) -> dict[str, int]:
        size = {"bf16": 2, "fp16": 2, "fp32": 4}
        d = size[self.info.get("dtype", "bf16")]
        return {"qk": d, "v": d, "o": d, "g": size[self.info.get("g_dtype", "bf16")],
                "beta": size[self.info.get("beta_dtype", "fp32")]}

    def call(self, inp: dict[str, torch.Tensor]) -> Callable[[], Any]:
        # The benchmark inputs are bf16 / fp32; cast where a --spec variant wants other dtypes.
        want = {n: _TORCH_DTYPES[self.info.get(key, default)] for n, key, default in
                (("q", "dtype", "bf16"), ("k", "dtype", "bf16"), ("v", "dtype", "bf16"),
                 ("g", "g_dtype", "bf16"), ("beta", "beta_dtype", "fp32"))}
        x = {n: (t.to(want[n]) if n in want and t.dtype != want[n] else t) for n, t in inp.items()}
        kernel = self.kernel

        def call() -> Any:
            return kernel(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=x["A_log"], dt_bias=x["dt_bias"],
                          output_final_state=True, cu_seqlens=x["cu_seqlens"])

        return call

    def final_state_kv(self, ht: torch.Tensor) -> torch.Tensor:
        return ht.transpose(-1, -2) if self.info.get("state_layout") == "vk" else ht


def _short_error(e: BaseException, limit: int = 160) -> str:
    text = f"{type(e).__name__}: {e}".strip().splitlines()[0]
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------------------------------------------------
# one config
# ---------------------------------------------------------------------------------------------------------


def _first_call(fn: Callable[[], Any]) -> tuple[Any, str | None]:
    """(outputs of an untimed first call, error)."""
    try:
        out = fn()
        torch.cuda.synchronize()
        return out, None
    except Exception as e:
        torch.cuda.synchronize()
        return None, _short_error(e)


def time_rounds(fns: dict[str, Callable[[], Any]], rounds: int, warmup: int,
                iters: int) -> tuple[dict[str, list[float]], dict[str, str]]:
    """Per-round medians (ms) of each callable, the callables taking turns round by round, and the error of
    each one that raised (it is left out of the later rounds; its times so far are dropped).

    Alternating keeps a slow spell of the host or the GPU (clocks, a background process) from landing on one
    side only; the reported time is the median of the rounds."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    errors: dict[str, str] = {}
    for _ in range(rounds):
        for name, fn in fns.items():
            if name in errors:
                continue
            try:
                times[name].append(time_ms(fn, warmup, iters))
            except Exception as e:  # a failure on a later call: reported in the row, the run goes on
                torch.cuda.synchronize()
                errors[name] = _short_error(e)
    return {name: t for name, t in times.items() if name not in errors}, errors


def warm_up(cfg: Config, seconds: float, fla: Callable[..., Any] | None, target: KdagenTarget) -> None:
    """Call FLA and kdagen on `cfg`'s inputs for `seconds` (half each) before anything is timed: the first
    calls of a fresh process (lazy loads, allocator pools) and of an idle GPU (clocks) are slower than the
    steady state the benchmark reports. Errors are left to the timed calls to report."""
    inp = make_bench_inputs(cfg, torch.device("cuda"), target.problem)
    calls = [target.call(inp)] if target.kernel is not None else []
    if fla is not None:
        calls.append(fla_call(fla, inp, target.problem))
    for fn in calls:
        end = time.perf_counter() + seconds / len(calls)
        try:
            while time.perf_counter() < end:
                for _ in range(16):  # back to back, as the timed calls run
                    fn()
                torch.cuda.synchronize()
        except Exception:
            torch.cuda.synchronize()


def run_config(cfg: Config, args: argparse.Namespace, card: Card, fla: Callable[..., Any] | None,
               target: KdagenTarget) -> dict[str, Any]:
    inp = make_bench_inputs(cfg, torch.device("cuda"), target.problem)
    segment = target.cp_segment_len(cfg)
    floors = physical_floors(cfg, card, args.step_us, target.chunk, target.io_bytes(), segment,
                             target.problem)
    row: dict[str, Any] = {
        "config": cfg.name, "kind": cfg.kind, "heads": cfg.heads, "num_seqs": len(cfg.lengths),
        "total_tokens": cfg.total, "max_len": cfg.max_len,
        "lengths": list(cfg.lengths) if len(cfg.lengths) <= 32 else None,
        "hbm_bytes": floors.bytes, "flops": floors.flops, "hbm_floor_ms": floors.hbm_ms,
        "flop_floor_ms": floors.flop_ms, "serial_floor_ms": floors.serial_ms,
        "binding_floor": floors.binding[0], "binding_floor_ms": floors.binding[1], "cp_segment_len": segment,
    }
    fla_out = kd_out = None
    timed: dict[str, Callable[[], Any]] = {}
    if fla is not None:
        fla_fn = fla_call(fla, inp, target.problem)
        fla_out, row["fla_error"] = _first_call(fla_fn)
        if row["fla_error"] is None:
            timed["fla"] = fla_fn
    if target.kernel is not None:
        kd_fn = target.call(inp)
        kd_out, row["kdagen_error"] = _first_call(kd_fn)
        if row["kdagen_error"] is None:
            timed["kdagen"] = kd_fn
    else:
        row["kdagen_error"] = target.error
    times, errors = time_rounds(timed, args.rounds, args.warmup, args.iters)
    for who, rounds in times.items():
        row[f"{who}_rounds_ms"] = rounds
        row[f"{who}_ms"] = statistics.median(rounds)
    for who, error in errors.items():
        row[f"{who}_error"] = error
    if "kdagen" in timed and not row.get("kdagen_error"):
        try:
            row["kdagen_graph_ms"] = graph_ms(timed["kdagen"])
        except Exception as e:
            torch.cuda.synchronize()
            row["kdagen_graph_error"] = _short_error(e)
    if row.get("fla_ms") and row.get("kdagen_ms"):
        row["speedup"] = row["fla_ms"] / row["kdagen_ms"]
    for who in ("kdagen", "fla"):
        if row.get(f"{who}_ms"):
            row[f"{who}_of_floor"] = floors.binding[1] / row[f"{who}_ms"]
    if fla_out is not None and kd_out is not None:
        try:
            row["o_rel_rmse"] = rel_rmse(fla_out[0], kd_out[0])
            row["ht_rel_rmse"] = rel_rmse(fla_out[1], target.final_state_kv(kd_out[1]))
        except Exception as e:
            row["accuracy_error"] = _short_error(e)
    del inp, fla_out, kd_out
    torch.cuda.empty_cache()
    return row


# ---------------------------------------------------------------------------------------------------------
# reporting
# ---------------------------------------------------------------------------------------------------------


def geomean(values: list[float]) -> float | None:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


# "o vs FLA", "ht vs FLA": relative RMSE between the two kernels' outputs, not the error against fp64 (that
# is the GPU tests' <= 0.005 bar; two bf16 results that each meet it can differ by a little more).
COLUMNS = ("config", "seqs", "tokens", "FLA ms", "kdagen ms", "speedup", "kdagen device ms", "o vs FLA",
           "ht vs FLA", "HBM ms", "FLOP ms", "serial ms", "bound", "kdagen/floor", "FLA/floor")


def table_cells(row: dict[str, Any]) -> list[str]:
    fla = "ERR" if row.get("fla_error") else _fmt(row.get("fla_ms"))
    kd = "ERR" if row.get("kdagen_error") else _fmt(row.get("kdagen_ms"))
    return [
        row["config"], str(row["num_seqs"]), str(row["total_tokens"]), fla, kd,
        _fmt(row.get("speedup"), ".2f") + ("x" if row.get("speedup") else ""),
        _fmt(row.get("kdagen_graph_ms")),
        _fmt(row.get("o_rel_rmse"), ".1e"), _fmt(row.get("ht_rel_rmse"), ".1e"),
        _fmt(row["hbm_floor_ms"]), _fmt(row["flop_floor_ms"]), _fmt(row["serial_floor_ms"]),
        row["binding_floor"], _fmt(row.get("kdagen_of_floor"), ".0%"), _fmt(row.get("fla_of_floor"), ".0%"),
    ]


def print_table(rows: list[dict[str, Any]], title: str, footer: str) -> None:
    errors = [f"{r['config']}: {who}: {r[f'{who}_error']}" for r in rows for who in ("kdagen", "fla")
              if r.get(f"{who}_error")]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        print(" | ".join(COLUMNS))
        for r in rows:
            print(" | ".join(table_cells(r)))
        print(footer)
        print("\n".join(errors))
        return
    table = Table(title=title, caption=footer)
    for i, col in enumerate(COLUMNS):
        table.add_column(col, justify="left" if i == 0 or col == "bound" else "right")
    for r in rows:
        table.add_row(*table_cells(r))
    console = Console(width=max(160, Console().width))
    console.print(table)
    for line in errors:
        console.print(f"[red]{line}[/red]", highlight=False)


def write_markdown(rows: list[dict[str, Any]], path: Path, title: str, footer: str) -> str:
    """The table as Markdown, committed next to the JSON and the PNG."""
    lines = [f"# {title}", "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(table_cells(r)) + " |" for r in rows]
    lines += ["", footer, ""]
    path.write_text("\n".join(lines))
    return f"wrote {path}"


def headline_geomean(rows: list[dict[str, Any]]) -> tuple[float | None, int]:
    """Geomean speed-up over the 28-config headline suite (the extra long-sequence section excluded)."""
    speedups = [r["speedup"] for r in rows if r.get("speedup") and r.get("kind") != "long"]
    return geomean(speedups), len(speedups)


def _title(card: str, date: str, spec_arg: str | None, with_fla: bool = True) -> str:
    what = "headline spec"
    if spec_arg:
        what = spec_arg + (" (FLA with the same gate and flags)" if with_fla else "")
    return f"KDA forward, kdagen vs FLA chunk_kda, {card} ({date}), {what}"


_AGREEMENT = "o/ht vs FLA: relative RMSE of kdagen's outputs against FLA's (against fp64: the GPU tests)"


def _timing(meta: dict[str, Any]) -> str:
    # Runs before --rounds existed timed one round per config.
    rounds = meta.get("rounds", 1)
    median = f"median of {meta['iters']} (warmup {meta['warmup']})"
    return median if rounds == 1 else f"{median}, median of {rounds} alternating rounds"


def footer_text(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """The line under the table, the plot's second title line and the Markdown file's footer: one text."""
    # The headline geomean (the bar) is over the 28 headline configs only; the long section is extra.
    gm, n = headline_geomean(rows)
    speedups = [r["speedup"] for r in rows if r.get("speedup")]
    every = f" ({_fmt(geomean(speedups), '.3f')}x over all {len(speedups)} run)" if len(speedups) != n else ""
    step = f"{meta['chunk']}-token step" if "chunk" in meta else "step"  # runs before "chunk" was recorded
    card = meta["card"]
    return (f"geomean speedup {_fmt(gm, '.3f')}x over the {n} headline configs{every}; {_timing(meta)}; "
            f"{meta['fla']}, torch {meta['torch']}; floors: HBM {_fmt(card['hbm_tbps'], 'g')} TB/s, "
            f"{_fmt(card['bf16_tflops'], 'g')} TFLOP/s, serial {meta['step_us']:g} us per {step}; "
            f"{_AGREEMENT}")


def markdown_from_json(path: Path) -> str:
    data = json.loads(path.read_text())
    meta, rows = data["meta"], data["rows"]
    title = _title(meta["card"]["name"], meta["date"][:10], meta.get("spec_arg"),
                   any(r.get("fla_ms") for r in rows))
    return write_markdown(rows, path.with_suffix(".md"), title, footer_text(meta, rows))


def write_png(rows: list[dict[str, Any]], path: Path, title: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not importable: no PNG written"
    pts = [(r["config"], r["speedup"]) for r in rows if r.get("speedup")]
    if not pts:
        return "no config has both timings: no PNG written"
    fig, ax = plt.subplots(figsize=(max(8.0, 0.45 * len(pts)), 4.5))
    ax.bar(range(len(pts)), [s for _, s in pts], color=["tab:green" if s >= 1 else "tab:red" for _, s in pts])
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(pts)), [n for n, _ in pts], rotation=60, ha="right", fontsize=8)
    ax.set_ylabel("speedup over FLA chunk_kda (x)")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"wrote {path}"


# ---------------------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a handful of configs instead of the full suites")
    p.add_argument("--only", choices=("fixed", "varlen"), help="run one suite only")
    p.add_argument("--long", action="store_true", help="also run one sequence of T=65536 with H=4")
    p.add_argument("--iters", type=int, default=30, help="timed calls per config (median reported)")
    p.add_argument("--warmup", type=int, default=10, help="untimed calls before each round's timed calls")
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds per config, FLA and kdagen taking turns (median of the round medians)")
    p.add_argument("--warmup-s", type=float, default=2.0,
                   help="seconds both run on the first config's inputs before anything is timed")
    p.add_argument("--spec", help='kdagen spec "file.yaml:name" (default: the headline spec dict)')
    p.add_argument("--step-us", type=float, default=1.0, help="latency of one serial chunk step, in us")
    p.add_argument("--hbm-tbps", type=float, help="HBM bandwidth in TB/s (default: from the card name)")
    p.add_argument("--peak-tflops", type=float, help="peak bf16 dense TFLOP/s (default: from the card name)")
    p.add_argument("--no-fla", action="store_true", help="do not run FLA even if it is installed")
    p.add_argument("--json", type=Path, help="result file (default benchmarks/out/<card>-<date>.json, "
                   "git-ignored; a reference run goes to benchmarks/results/<card>/<spec>.json)")
    p.add_argument("--png", type=Path, help="plot file (default: the JSON path with .png)")
    p.add_argument("--md-from", type=Path, help="only write the Markdown table of an existing result JSON")
    args = p.parse_args(argv)
    if args.iters < 1 or args.rounds < 1 or args.warmup < 0 or args.warmup_s < 0:
        p.error("--iters and --rounds must be >= 1, --warmup and --warmup-s >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.md_from is not None:
        print(markdown_from_json(args.md_from))
        return 0
    if not torch.cuda.is_available():
        print("bench_fwd: no CUDA GPU visible (torch.cuda.is_available() is False); nothing to run")
        return 2
    card = detect_card(args.hbm_tbps, args.peak_tflops)
    if card.hbm_tbps is None or card.bf16_tflops is None:
        print(f"note: unknown card {card.name!r}: pass --hbm-tbps and --peak-tflops for the HBM/FLOP floors")
    fla, fla_note = (None, "FLA disabled (--no-fla)") if args.no_fla else load_fla()
    print(f"{card.name}: {_fmt(card.hbm_tbps, 'g')} TB/s, {_fmt(card.bf16_tflops, 'g')} TFLOP/s; {fla_note}")
    target = KdagenTarget(args.spec if args.spec else dict(HEADLINE_SPEC))
    target.load()
    if target.error:
        print(f"kdagen: could not get the kernel: {target.error}")

    rows = []
    configs = build_configs(args.quick, args.only, args.long, target.problem.gva_ratio)
    if configs:
        warm_up(configs[0], args.warmup_s, fla, target)
    for i, cfg in enumerate(configs, 1):
        row = run_config(cfg, args, card, fla, target)
        rows.append(row)
        print(f"[{i}/{len(configs)}] {cfg.name}: FLA {_fmt(row.get('fla_ms'))} ms, "
              f"kdagen {_fmt(row.get('kdagen_ms'))} ms", flush=True)

    now = dt.datetime.now()
    meta = {
        "date": now.isoformat(timespec="seconds"), "card": asdict(card),
        "torch": torch.__version__, "cuda": torch.version.cuda, "fla": fla_note,
        "FLA_USE_FAST_OPS": os.environ.get("FLA_USE_FAST_OPS"), "kdagen_spec": target.info or target.spec_arg,
        "spec_arg": args.spec, "kdagen_error": target.error, "iters": args.iters, "warmup": args.warmup,
        "rounds": args.rounds, "step_us": args.step_us, "chunk": target.chunk,
        "flop_per_token_head": target.problem.flop_per_token_head(),
        "fla_options": target.problem.fla_kwargs(), "seed": SEED,
        "geomean_speedup": geomean([r["speedup"] for r in rows if r.get("speedup")]),
        "headline_geomean_speedup": headline_geomean(rows)[0],
    }
    title = _title(card.name, now.strftime("%Y-%m-%d"), args.spec, fla is not None)
    footer = footer_text(meta, rows)
    print_table(rows, title, footer)

    json_path = args.json or REPO_ROOT / "benchmarks" / "out" / f"{card.slug}-{now:%Y-%m-%d}.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"wrote {json_path}")
    print(write_png(rows, args.png or json_path.with_suffix(".png"), f"{title}\n{footer}"))
    print(markdown_from_json(json_path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
