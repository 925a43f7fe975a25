#!/usr/bin/env python
"""kdagen vs FLA ``chunk_kda``: the KDA training benchmark (forward + backward).

The problem, inputs and configs are bench_fwd.py's (H=64, K=V=128, bf16 q/k/v and raw gate, l2norm and the
lower-bound gate computed in the kernel, every input packed as [1, B*T] with int32 cu_seqlens; ``--spec`` sets
the operator, FLA called with the same options), with an fp32 initial state h0 [N, HV, K, V] and the final
state on, and the output gradients do (bf16, like o) and dht (fp32, like the final state). Every input that
has a gradient requires one: q, k, v, the raw gate g, beta, A_log, dt_bias and h0. Each library works on its
own leaf views of the shared inputs, so that each keeps its own gradients. Suites: bench_fwd's 28 headline
configs (fixed B in {1,2} x T in {512 ... 16384}; 18 varlen), ``--long`` adds one sequence of 65536 tokens
with H=4.

Two times per config and library, both the median over ``--iters`` calls of CUDA events, after ``--warmup``
untimed calls, in ``--rounds`` rounds in which FLA and kdagen take turns (a config's time is the median of its
rounds), after both ran for ``--warmup-s`` seconds on the first config:

- fwd+bwd: one Python call that sets every input's gradient to None, runs the forward and then
  ``torch.autograd.backward([o, ht], [do, dht])`` (fresh gradients, allocated by the backward), calls back to
  back as in bench_fwd.py;
- bwd: ``torch.autograd.backward`` alone, on a graph built by an untimed forward before each call. The graph
  is rebuilt every call rather than built once per round with ``retain_graph=True``: a second backward
  through a retained node is not part of either library's contract (a backward may free or overwrite the
  saved per-chunk states it reads), and a rebuilt graph is valid for both. The GPU is idle (synchronized)
  when each timed backward starts, so its time is its whole call, host and device, with no forward in flight
  to hide its host work.

Reported: ms for each, speedup = FLA / kdagen for both, their geomeans over the headline configs, the issue's
targets (fwd+bwd geomean >= 2.5x with no config below 1.5x; bwd geomean >= 2.0x), and kdagen's accuracy
against FLA on the first call: the relative RMSE of each gradient (dq, dk, dv, dg of the raw gate, dbeta,
dA_log, ddt_bias, dh0) and of o and the final state; the JSON also holds each side's rounds and the memory
its first call added at its peak. ``--no-recompute`` runs kdagen with ``recompute=False``
(the backward reads the forward's saved per-chunk states) and FLA with ``disable_recompute=True``. There is no
device-only (CUDA graph) time: the autograd call is not captured.

``--profile [CONFIG]`` instead runs torch.profiler over one kdagen backward on one config (default
B2-T8192) and prints the CUDA time per kernel name (the 15 largest), to see where the backward's time goes.

Run from the repository root on a GPU machine:

    PYTHONPATH=. python benchmarks/bench_bwd.py [--quick] [--only fixed|varlen] [--long] [--spec f.yaml:name]
                                                [--no-recompute] [--profile [CONFIG]]

It writes the JSON rows, a Markdown table and a PNG plot of the fwd+bwd speed-ups to ``benchmarks/out/``
(git-ignored). FLA (fla-core 0.6.0) is optional: without it kdagen runs alone. A config on which kdagen (or
FLA) raises shows the error in its row and the run goes on.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
for _path in (REPO_ROOT, Path(__file__).resolve().parent):  # run as a script: `import kdagen`, `bench_fwd`
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import bench_fwd  # noqa: E402
import torch  # noqa: E402

# bench_fwd's private helpers, shared rather than copied: the number formatting of its tables, the one-line
# error text of its rows, and its spec dtype names.
from bench_fwd import _TORCH_DTYPES as TORCH_DTYPES  # noqa: E402
from bench_fwd import _fmt, _short_error  # noqa: E402

from kdagen.reference import rel_rmse  # noqa: E402

Tensor = torch.Tensor

# The inputs that get a gradient, in the order the report lists them (the column is "d" + name).
GRADS = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "h0")
HEADLINE_COUNT = len(bench_fwd.FIXED_GRID) + len(bench_fwd.VARLEN_GRID)  # 28
PROFILE_CONFIG = "B2-T8192"
PROFILE_TOP = 15
# The issue's bars: fwd+bwd geomean and lowest config, backward-alone geomean (speed-up over FLA).
TARGET_STEP_GEOMEAN = 2.5
TARGET_STEP_MIN = 1.5
TARGET_BWD_GEOMEAN = 2.0


# ---------------------------------------------------------------------------------------------------------
# configs and inputs
# ---------------------------------------------------------------------------------------------------------


def find_config(name: str, gva_ratio: int = 1) -> bench_fwd.Config:
    """The config called `name` among every headline config and the long one."""
    configs = bench_fwd.build_configs(False, None, True, gva_ratio)
    for cfg in configs:
        if cfg.name == name:
            return cfg
    raise ValueError(f"unknown config {name!r}; one of: {', '.join(c.name for c in configs)}")


def make_train_inputs(cfg: bench_fwd.Config, device: torch.device,
                      problem: bench_fwd.Problem = bench_fwd.HEADLINE) -> dict[str, Tensor | None]:
    """bench_fwd's inputs, then from the same seeded generator h0 (randn fp32 [N, HV, K, V], FLA's layout),
    do (randn bf16 [1, total, HV, V], like o) and dht (randn fp32, like the final state)."""
    inp = bench_fwd.make_bench_inputs(cfg, device, problem)
    n, hv, kd, vd = len(cfg.lengths), cfg.heads, problem.head_dim_k, problem.head_dim_v
    inp["h0"] = torch.randn(n, hv, kd, vd, dtype=torch.float32, device=device)
    inp["do"] = torch.randn(1, cfg.total, hv, vd, dtype=torch.bfloat16, device=device)
    inp["dht"] = torch.randn(n, hv, kd, vd, dtype=torch.float32, device=device)
    return inp


def _leaf(t: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """A leaf that requires grad, viewing `t` (a copy only where `dtype` differs): its .grad is its own."""
    return t.detach().to(dtype or t.dtype).requires_grad_()


# ---------------------------------------------------------------------------------------------------------
# the two libraries' training calls
# ---------------------------------------------------------------------------------------------------------


def _same(t: Tensor) -> Tensor:
    return t


@dataclass
class Side:
    """One library's training call: `forward` on its `leaves` (GRADS name -> leaf) returns (o, final state),
    the backward takes `grad_outputs` (do, dht) in that library's dtypes and layout; `state_kv` maps a state
    in its layout to FLA's [K, V] one."""

    forward: Callable[[], tuple[Tensor, Tensor]]
    leaves: dict[str, Tensor]
    grad_outputs: tuple[Tensor, Tensor]
    state_kv: Callable[[Tensor], Tensor] = _same

    def clear(self) -> None:
        for t in self.leaves.values():
            t.grad = None

    def backward(self, out: tuple[Tensor, Tensor]) -> None:
        torch.autograd.backward(list(out), list(self.grad_outputs))

    def step(self) -> None:
        """Forward and backward with fresh gradients (the fwd+bwd call that is timed)."""
        self.clear()
        self.backward(self.forward())

    def grads(self) -> dict[str, Tensor | None]:
        """Each leaf's gradient, h0's in FLA's layout."""
        out = {name: t.grad for name, t in self.leaves.items()}
        if out.get("h0") is not None:
            out["h0"] = self.state_kv(out["h0"])
        return out


def fla_side(chunk_kda: Callable[..., Any], inp: dict[str, Tensor | None], problem: bench_fwd.Problem,
             recompute: bool = True) -> Side:
    """FLA's chunk_kda called as bench_fwd.fla_call calls it, plus scale, the initial state and (without
    recompute) disable_recompute."""
    leaves = {name: _leaf(t) for name in GRADS if (t := inp[name]) is not None}
    options = problem.fla_kwargs()
    if not recompute:
        options["disable_recompute"] = True
    scale = problem.head_dim_k ** -0.5
    cu = inp["cu_seqlens"]

    def forward() -> tuple[Tensor, Tensor]:
        x = leaves
        return chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=scale, A_log=x.get("A_log"),
                         dt_bias=x.get("dt_bias"), initial_state=x["h0"], output_final_state=True,
                         cu_seqlens=cu, **options)

    assert inp["do"] is not None and inp["dht"] is not None
    return Side(forward, leaves, (inp["do"], inp["dht"]))


@dataclass
class TrainTarget(bench_fwd.KdagenTarget):
    """bench_fwd's kdagen target (spec, kernel, problem, state layout) and the backward's recompute option."""

    recompute: bool = True

    def dtypes(self) -> dict[str, torch.dtype]:
        """The dtypes the spec asks for, per input name (the benchmark draws bf16 / fp32)."""
        info = self.info
        io = TORCH_DTYPES[info.get("dtype", "bf16")]
        state = TORCH_DTYPES[info.get("state_dtype", "fp32")]
        return {"q": io, "k": io, "v": io, "do": io, "g": TORCH_DTYPES[info.get("g_dtype", "bf16")],
                "beta": TORCH_DTYPES[info.get("beta_dtype", "fp32")], "h0": state, "dht": state}

    def side(self, inp: dict[str, Tensor | None]) -> Side:
        """kdagen's kernel on its own leaves; h0 and dht in the spec's state layout (a vk spec gets them
        transposed, and h0's gradient is transposed back)."""
        want = self.dtypes()
        # final_state_kv transposes for a vk spec; its own inverse, it also maps kv states to that layout.
        to_layout = self.final_state_kv
        leaves: dict[str, Tensor] = {}
        for name in GRADS:
            t = inp[name]
            if t is None:
                continue
            if name == "h0":
                t = to_layout(t).contiguous()
            leaves[name] = _leaf(t, want.get(name))
        do, dht = inp["do"], inp["dht"]
        assert do is not None and dht is not None
        grad_outputs = (do.to(want["do"]), to_layout(dht).contiguous().to(want["dht"]))
        kernel, recompute, cu = self.kernel, self.recompute, inp["cu_seqlens"]
        scale = self.problem.head_dim_k ** -0.5

        def forward() -> tuple[Tensor, Tensor]:
            x = leaves
            return kernel(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=scale, A_log=x.get("A_log"),
                          dt_bias=x.get("dt_bias"), initial_state=x["h0"], output_final_state=True,
                          cu_seqlens=cu, recompute=recompute)

        return Side(forward, leaves, grad_outputs, to_layout)


# ---------------------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------------------


def backward_ms(side: Side, warmup: int, iters: int) -> float:
    """Median CUDA-event time of `torch.autograd.backward` alone: before each call an untimed forward builds
    its graph (fresh gradients, as in the fwd+bwd call) and the GPU is synchronized, so the events hold the
    backward's whole call and nothing else."""
    for _ in range(warmup):
        side.step()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(iters)]
    for start, end in events:
        side.clear()
        out = side.forward()
        torch.cuda.synchronize()
        start.record()
        side.backward(out)
        end.record()
        del out
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def time_training_rounds(sides: dict[str, Side], rounds: int, warmup: int,
                         iters: int) -> tuple[dict[str, dict[str, list[float]]], dict[str, str]]:
    """Per-round medians (ms) of each side's fwd+bwd call ("step") and backward alone ("bwd"), the sides
    taking turns round by round, and the error of each side that raised (left out of the later rounds, its
    times dropped), as bench_fwd.time_rounds does for the forward."""
    times: dict[str, dict[str, list[float]]] = {name: {"step": [], "bwd": []} for name in sides}
    errors: dict[str, str] = {}
    for _ in range(rounds):
        for name, side in sides.items():
            if name in errors:
                continue
            try:
                times[name]["step"].append(bench_fwd.time_ms(side.step, warmup, iters))
                times[name]["bwd"].append(backward_ms(side, warmup, iters))
            except Exception as e:  # a failure on a later call: reported in the row, the run goes on
                torch.cuda.synchronize()
                errors[name] = _short_error(e)
    return {name: t for name, t in times.items() if name not in errors}, errors


def warm_up(sides: Iterable[Side], seconds: float) -> None:
    """Run each side's fwd+bwd call for its share of `seconds` before anything is timed (lazy loads, allocator
    pools, GPU clocks; see bench_fwd.warm_up). Errors are left to the timed calls to report."""
    sides = list(sides)
    for side in sides:
        end = time.perf_counter() + seconds / len(sides)
        try:
            while time.perf_counter() < end:
                for _ in range(4):
                    side.step()
                torch.cuda.synchronize()
        except Exception:
            torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------------------
# one config
# ---------------------------------------------------------------------------------------------------------


def first_step(side: Side) -> tuple[tuple[Tensor, Tensor] | None, float | None, str | None]:
    """The untimed first fwd+bwd call: ((o, final state), peak memory it added in GiB, error)."""
    try:
        side.clear()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = side.forward()
        side.backward(out)
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - before) / 2**30
        return (out[0].detach(), out[1].detach()), peak, None
    except Exception as e:
        torch.cuda.synchronize()
        return None, None, _short_error(e)


def accuracy(fla: Side, fla_out: tuple[Tensor, Tensor], kd: Side,
             kd_out: tuple[Tensor, Tensor]) -> dict[str, Any]:
    """kdagen's relative RMSE against FLA of o, the final state and every gradient (first call); gradients
    that one side did not produce are listed."""
    acc: dict[str, Any] = {"o_rel_rmse": rel_rmse(fla_out[0], kd_out[0]),
                           "ht_rel_rmse": rel_rmse(fla_out[1], kd.state_kv(kd_out[1]))}
    ref, got = fla.grads(), kd.grads()
    for who, grads in (("fla", ref), ("kdagen", got)):
        missing = [f"d{n}" for n in GRADS if n in fla.leaves and grads.get(n) is None]
        if missing:
            acc[f"{who}_missing_grads"] = missing
    for name in GRADS:
        r, g = ref.get(name), got.get(name)
        if r is not None and g is not None:
            acc[f"d{name}_rel_rmse"] = rel_rmse(r, g)
    return acc


def make_sides(inp: dict[str, Tensor | None], fla: Callable[..., Any] | None,
               target: TrainTarget) -> tuple[dict[str, Side], dict[str, str]]:
    """FLA's side (where installed) and kdagen's (where its kernel loaded) on `inp`, and each one's error
    where it could not be made."""
    sides: dict[str, Side] = {}
    errors: dict[str, str] = {}
    if fla is not None:
        try:
            sides["fla"] = fla_side(fla, inp, target.problem, target.recompute)
        except Exception as e:
            errors["fla"] = _short_error(e)
    if target.kernel is None:
        errors["kdagen"] = target.error or "no kernel"
        return sides, errors
    try:
        sides["kdagen"] = target.side(inp)
    except Exception as e:
        errors["kdagen"] = _short_error(e)
    return sides, errors


def run_config(cfg: bench_fwd.Config, args: argparse.Namespace, fla: Callable[..., Any] | None,
               target: TrainTarget) -> dict[str, Any]:
    inp = make_train_inputs(cfg, torch.device("cuda"), target.problem)
    row: dict[str, Any] = {
        "config": cfg.name, "kind": cfg.kind, "heads": cfg.heads, "num_seqs": len(cfg.lengths),
        "total_tokens": cfg.total, "max_len": cfg.max_len,
        "lengths": list(cfg.lengths) if len(cfg.lengths) <= 32 else None,
    }
    sides: dict[str, Side] = {}
    outs: dict[str, tuple[Tensor, Tensor]] = {}
    built, errors = make_sides(inp, fla, target)
    row.update({f"{who}_error": error for who, error in errors.items()})
    for who, side in built.items():
        out, peak, row[f"{who}_error"] = first_step(side)
        if out is not None:
            sides[who], outs[who], row[f"{who}_peak_gib"] = side, out, peak
    if len(outs) == 2:
        try:
            row.update(accuracy(sides["fla"], outs["fla"], sides["kdagen"], outs["kdagen"]))
        except Exception as e:
            row["accuracy_error"] = _short_error(e)
    outs.clear()
    for side in sides.values():
        side.clear()
    times, errors = time_training_rounds(sides, args.rounds, args.warmup, args.iters)
    for who, measures in times.items():
        for what, rounds in measures.items():
            row[f"{who}_{what}_rounds_ms"] = rounds
            row[f"{who}_{what}_ms"] = statistics.median(rounds)
    for who, error in errors.items():
        row[f"{who}_error"] = error
    if row.get("fla_step_ms") and row.get("kdagen_step_ms"):
        row["speedup"] = row["fla_step_ms"] / row["kdagen_step_ms"]  # "speedup": bench_fwd.write_png plots it
    if row.get("fla_bwd_ms") and row.get("kdagen_bwd_ms"):
        row["bwd_speedup"] = row["fla_bwd_ms"] / row["kdagen_bwd_ms"]
    del inp, sides, built
    gc.collect()
    torch.cuda.empty_cache()
    return row


# ---------------------------------------------------------------------------------------------------------
# profile
# ---------------------------------------------------------------------------------------------------------


def kernel_times(events: Iterable[Any], top: int = PROFILE_TOP) -> tuple[list[tuple[str, float, int]], float]:
    """([(kernel name, CUDA ms, launches)] of the `top` largest, largest first; the CUDA ms of all of them)
    from torch.profiler's key_averages(): GPU events only (a CPU op's device time is that of its kernels,
    which are counted themselves)."""
    by_name: dict[str, list[float]] = {}
    for ev in events:
        if str(getattr(ev, "device_type", "")).endswith("CPU") or ev.device_time_total <= 0:
            continue
        ms_count = by_name.setdefault(ev.key, [0.0, 0])
        ms_count[0] += ev.device_time_total / 1000.0
        ms_count[1] += ev.count
    ranked = sorted(((name, ms, int(n)) for name, (ms, n) in by_name.items()), key=lambda x: -x[1])
    return ranked[:top], sum(ms for _, ms, _ in ranked)


def format_kernel_times(ranked: list[tuple[str, float, int]], total_ms: float, width: int = 110) -> str:
    lines = [f"{'ms':>9} {'share':>6} {'calls':>5}  kernel"]
    for name, ms, n in ranked:
        short = name if len(name) <= width else name[: width - 3] + "..."
        lines.append(f"{ms:9.3f} {ms / total_ms:6.1%} {n:5d}  {short}")
    return "\n".join(lines)


def profile_backward(cfg: bench_fwd.Config, target: TrainTarget) -> str:
    """torch.profiler over one kdagen backward on `cfg` (after a few untimed fwd+bwd calls): CUDA time per
    kernel name."""
    from torch.profiler import ProfilerActivity, profile

    inp = make_train_inputs(cfg, torch.device("cuda"), target.problem)
    side = target.side(inp)
    for _ in range(3):
        side.step()
    side.clear()
    out = side.forward()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        side.backward(out)
        torch.cuda.synchronize()
    ranked, total = kernel_times(prof.key_averages())
    recompute = "on" if target.recompute else "off"
    head = (f"one kdagen backward, {cfg.name} (recompute {recompute}): {total:.3f} ms of CUDA time, "
            f"the {len(ranked)} largest kernels:")
    return head + "\n" + format_kernel_times(ranked, total or 1.0)


# ---------------------------------------------------------------------------------------------------------
# reporting
# ---------------------------------------------------------------------------------------------------------


COLUMNS = ("config", "seqs", "tokens", "FLA fwd+bwd ms", "kdagen fwd+bwd ms", "fwd+bwd speedup",
           "FLA bwd ms", "kdagen bwd ms", "bwd speedup") + tuple(f"d{n}" for n in GRADS)


def _ms(row: dict[str, Any], who: str, what: str) -> str:
    return "ERR" if row.get(f"{who}_error") else _fmt(row.get(f"{who}_{what}_ms"))


def _x(value: float | None) -> str:
    return _fmt(value, ".2f") + ("x" if value else "")


def table_cells(row: dict[str, Any]) -> list[str]:
    return [
        row["config"], str(row["num_seqs"]), str(row["total_tokens"]),
        _ms(row, "fla", "step"), _ms(row, "kdagen", "step"), _x(row.get("speedup")),
        _ms(row, "fla", "bwd"), _ms(row, "kdagen", "bwd"), _x(row.get("bwd_speedup")),
    ] + [_fmt(row.get(f"d{n}_rel_rmse"), ".1e") for n in GRADS]


def headline_speedups(rows: list[dict[str, Any]], key: str) -> list[tuple[str, float]]:
    """(config, speed-up under `key`) of the headline configs that have it (the long config excluded)."""
    return [(r["config"], r[key]) for r in rows if r.get(key) and r.get("kind") != "long"]


def _verdict(ok: bool, n: int) -> str:
    where = "" if n == HEADLINE_COUNT else f" (on {n} of the {HEADLINE_COUNT} headline configs)"
    return ("met" if ok else "missed") + where


def target_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The issue's targets against this run: fwd+bwd geomean and lowest config, backward-alone geomean."""
    lines = []
    step = headline_speedups(rows, "speedup")
    if step:
        gm = bench_fwd.geomean([s for _, s in step]) or 0.0
        low_name, low = min(step, key=lambda p: p[1])
        lines.append(f"fwd+bwd: geomean {gm:.2f}x (target >= {TARGET_STEP_GEOMEAN}x): "
                     f"{_verdict(gm >= TARGET_STEP_GEOMEAN, len(step))}")
        lines.append(f"fwd+bwd: lowest {low:.2f}x at {low_name} (target: none below {TARGET_STEP_MIN}x): "
                     f"{_verdict(low >= TARGET_STEP_MIN, len(step))}")
    else:
        lines.append("fwd+bwd: no headline config has both timings")
    bwd = headline_speedups(rows, "bwd_speedup")
    if bwd:
        gm = bench_fwd.geomean([s for _, s in bwd]) or 0.0
        lines.append(f"bwd alone: geomean {gm:.2f}x (target >= {TARGET_BWD_GEOMEAN}x): "
                     f"{_verdict(gm >= TARGET_BWD_GEOMEAN, len(bwd))}")
    else:
        lines.append("bwd alone: no headline config has both timings")
    return lines


def _title(card: str, date: str, spec_arg: str | None, recompute: bool) -> str:
    what = spec_arg or "headline spec"
    mode = "" if recompute else ", no recompute"
    return f"KDA forward+backward, kdagen vs FLA chunk_kda, {card} ({date}), {what}{mode}"


def footer_text(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """The line under the table, the plot's second title line and the Markdown file's footer."""
    geo = {key: bench_fwd.geomean([s for _, s in headline_speedups(rows, key)])
           for key in ("speedup", "bwd_speedup")}
    n = len(headline_speedups(rows, "speedup"))
    return (f"geomean speedup over {n} headline configs: fwd+bwd {_fmt(geo['speedup'], '.3f')}x, bwd "
            f"{_fmt(geo['bwd_speedup'], '.3f')}x; median of {meta['iters']} (warmup {meta['warmup']}), "
            f"median of {meta['rounds']} alternating rounds; bwd: backward alone after an untimed forward; "
            f"{meta['fla']}, torch {meta['torch']}; dq ... dh0: relative RMSE of kdagen's gradients against "
            f"FLA's (first call)" + _partial(meta))


def _partial(meta: dict[str, Any]) -> str:
    done, planned = meta.get("configs_done"), meta.get("configs_planned")
    if done is None or planned is None or done >= planned:
        return ""
    return f"; partial: the run ended after {done} of its {planned} configs"


def markdown(rows: list[dict[str, Any]], title: str, footer: str) -> str:
    lines = [f"# {title}", "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(table_cells(r)) + " |" for r in rows]
    lines += ["", footer, ""] + [f"- {line}" for line in target_lines(rows)]
    errors = error_lines(rows)
    if errors:
        lines += [""] + [f"- {line}" for line in errors]
    return "\n".join(lines) + "\n"


def error_lines(rows: list[dict[str, Any]]) -> list[str]:
    out = [f"{r['config']}: {who}: {r[f'{who}_error']}" for r in rows for who in ("kdagen", "fla")
           if r.get(f"{who}_error")]
    out += [f"{r['config']}: accuracy: {r['accuracy_error']}" for r in rows if r.get("accuracy_error")]
    out += [f"{r['config']}: {who} gave no {', '.join(r[f'{who}_missing_grads'])}" for r in rows
            for who in ("kdagen", "fla") if r.get(f"{who}_missing_grads")]
    return out


def markdown_from_json(path: Path) -> str:
    """Write the Markdown table of a result JSON beside it."""
    data = json.loads(path.read_text())
    meta, rows = data["meta"], data["rows"]
    title = _title(meta["card"]["name"], meta["date"][:10], meta.get("spec_arg"), meta.get("recompute", True))
    out = path.with_suffix(".md")
    text = markdown(rows, title, footer_text(meta, rows))
    if meta.get("source"):  # how a file not written by the run itself was made
        text += f"\nSource: {meta['source']}.\n"
    out.write_text(text)
    return f"wrote {out}"


def print_table(rows: list[dict[str, Any]], title: str, footer: str) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(markdown(rows, title, footer))
        return
    table = Table(title=title, caption=footer)
    for i, col in enumerate(COLUMNS):
        table.add_column(col, justify="left" if i == 0 else "right")
    for r in rows:
        table.add_row(*table_cells(r))
    console = Console(width=max(200, Console().width))
    console.print(table)
    for line in target_lines(rows):
        console.print(line, highlight=False)
    for line in error_lines(rows):
        console.print(f"[red]{line}[/red]", highlight=False)


# ---------------------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a handful of configs instead of the full suites")
    p.add_argument("--only", choices=("fixed", "varlen", "long"),
                   help="run one suite only (long: the T=65536 H=4 config of --long alone)")
    p.add_argument("--long", action="store_true", help="also run one sequence of T=65536 with H=4")
    p.add_argument("--iters", type=int, default=20, help="timed calls per config and measure (median)")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls before each round's timed calls")
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds per config, FLA and kdagen taking turns (median of the round medians)")
    p.add_argument("--warmup-s", type=float, default=2.0,
                   help="seconds both run fwd+bwd on the first config's inputs before anything is timed")
    p.add_argument("--spec", help='kdagen spec "file.yaml:name" (default: the headline spec dict)')
    p.add_argument("--no-recompute", action="store_true",
                   help="kdagen recompute=False and FLA disable_recompute=True (saved per-chunk states)")
    p.add_argument("--no-fla", action="store_true", help="do not run FLA even if it is installed")
    p.add_argument("--profile", nargs="?", const=PROFILE_CONFIG, metavar="CONFIG",
                   help=f"only profile one kdagen backward on CONFIG (default {PROFILE_CONFIG}) and print "
                   f"the CUDA time of its {PROFILE_TOP} largest kernels")
    p.add_argument("--json", type=Path, help="result file (default benchmarks/out/<card>-bwd-<date>.json)")
    p.add_argument("--png", type=Path, help="plot file (default: the JSON path with .png)")
    p.add_argument("--md-from", type=Path, help="only write the Markdown table of an existing result JSON")
    args = p.parse_args(argv)
    if args.iters < 1 or args.rounds < 1 or args.warmup < 0 or args.warmup_s < 0:
        p.error("--iters and --rounds must be >= 1, --warmup and --warmup-s >= 0")
    return args


def result_meta(now: dt.datetime, card: Any, fla_note: str, target: TrainTarget, args: argparse.Namespace,
                rows: list[dict[str, Any]], planned: int) -> dict[str, Any]:
    """The result file's meta: the run's setup, the headline geomeans and targets of `rows`, and how many of
    the `planned` configs they are (a run cut short leaves a file of the configs it finished)."""
    return {
        "date": now.isoformat(timespec="seconds"), "card": asdict(card), "torch": torch.__version__,
        "cuda": torch.version.cuda, "fla": fla_note, "FLA_USE_FAST_OPS": os.environ.get("FLA_USE_FAST_OPS"),
        "kdagen_spec": target.info or target.spec_arg, "spec_arg": args.spec, "kdagen_error": target.error,
        "recompute": target.recompute, "iters": args.iters, "warmup": args.warmup, "rounds": args.rounds,
        "fla_options": target.problem.fla_kwargs(), "seed": bench_fwd.SEED,
        "headline_geomean_speedup": bench_fwd.geomean([s for _, s in headline_speedups(rows, "speedup")]),
        "headline_geomean_bwd_speedup": bench_fwd.geomean(
            [s for _, s in headline_speedups(rows, "bwd_speedup")]),
        "targets": target_lines(rows),
        "configs_done": len(rows), "configs_planned": planned,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.md_from is not None:
        print(markdown_from_json(args.md_from))
        return 0
    if not torch.cuda.is_available():
        print("bench_bwd: no CUDA GPU visible (torch.cuda.is_available() is False); nothing to run")
        return 2
    target = TrainTarget(args.spec if args.spec else dict(bench_fwd.HEADLINE_SPEC),
                         recompute=not args.no_recompute)
    target.load()
    if target.error:
        print(f"kdagen: could not get the kernel: {target.error}")
    if args.profile:
        if target.kernel is None:
            return 1
        try:
            cfg = find_config(args.profile, target.problem.gva_ratio)
        except ValueError as e:
            print(e)
            return 2
        print(profile_backward(cfg, target))
        return 0

    card = bench_fwd.detect_card(None, None)
    fla, fla_note = (None, "FLA disabled (--no-fla)") if args.no_fla else bench_fwd.load_fla()
    print(f"{card.name}; {fla_note}")
    configs = bench_fwd.build_configs(args.quick, args.only, args.long or args.only == "long",
                                      target.problem.gva_ratio)
    if configs:
        inp = make_train_inputs(configs[0], torch.device("cuda"), target.problem)
        warm, _ = make_sides(inp, fla, target)  # a side that cannot be made: its rows report it
        warm_up(warm.values(), args.warmup_s)
        del inp, warm
        torch.cuda.empty_cache()
    now = dt.datetime.now()
    json_path = args.json or REPO_ROOT / "benchmarks" / "out" / f"{card.slug}-bwd-{now:%Y-%m-%d}.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    for i, cfg in enumerate(configs, 1):
        row = run_config(cfg, args, fla, target)
        rows.append(row)
        print(f"[{i}/{len(configs)}] {cfg.name}: fwd+bwd FLA {_fmt(row.get('fla_step_ms'))} ms, kdagen "
              f"{_fmt(row.get('kdagen_step_ms'))} ms; bwd FLA {_fmt(row.get('fla_bwd_ms'))} ms, kdagen "
              f"{_fmt(row.get('kdagen_bwd_ms'))} ms", flush=True)
        # Written after every config, so that a run cut short (a time limit) keeps the configs it finished.
        meta = result_meta(now, card, fla_note, target, args, rows, len(configs))
        json_path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")

    meta = result_meta(now, card, fla_note, target, args, rows, len(configs))
    title = _title(card.name, now.strftime("%Y-%m-%d"), args.spec, target.recompute)
    footer = footer_text(meta, rows)
    print_table(rows, title, footer)
    json_path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"wrote {json_path}")
    print(bench_fwd.write_png(rows, args.png or json_path.with_suffix(".png"), f"{title}\n{footer}"))
    print(markdown_from_json(json_path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
