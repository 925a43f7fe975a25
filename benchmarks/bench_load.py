#!/usr/bin/env python
"""How long a process takes to get kernels from the cache: the first variant, and each one after it.

Each of ``--processes`` fresh interpreters imports torch and initialises CUDA (timed apart: an engine has
done both already), then imports kdagen and calls ``kdagen.get_kernel`` for every variant of SPECFILE in file
order with ``KDAGEN_DISABLE_JIT=1`` (a miss is an error, never a compile), then again for the first one (a
repeated call, answered from memory). The variant names are read here, in the parent: the child reads no
spec file but through ``get_kernel``, so what the first call imports is timed. With a GPU it then makes one
small call of the first variant, which also loads its GPU code into the context (CUDA loads modules
lazily). Build the variants first: ``kdagen build SPECFILE``. Imports are part of the first load, so a
Python that cannot keep bytecode (a read-only site, or ``PYTHONDONTWRITEBYTECODE``) compiles every module
again in every process: point ``PYTHONPYCACHEPREFIX`` at a writable directory there, and unset
``PYTHONDONTWRITEBYTECODE``.

    PYTHONPATH=. python benchmarks/bench_load.py [SPECFILE] [--processes 5] [--bundle DIR]

``--bundle DIR`` sets ``KDAGEN_BUNDLE=DIR`` in each process, so the kernels come from a bundle written by
``kdagen build SPECFILE --bundle DIR`` (the first get_kernel then includes reading its manifest).

It prints its results and writes no file; a log of a run belongs in ``benchmarks/out/`` (git-ignored), e.g.
``... | tee benchmarks/out/bench_load.log``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

from kdagen.spec import load_spec_file

_CHILD = textwrap.dedent(
    """
    import json, sys, time
    t0 = time.perf_counter()
    import torch
    if torch.cuda.is_available():
        torch.cuda.init()  # an engine has its GPU up before it asks for kernels
    out = {"import_torch": time.perf_counter() - t0}
    t0 = time.perf_counter()
    import kdagen
    out["import_kdagen"] = time.perf_counter() - t0
    names = json.loads(sys.argv[2])
    loads, kernels = [], []
    for name in names:
        t0 = time.perf_counter()
        kernels.append(kdagen.get_kernel(f"{sys.argv[1]}:{name}"))
        loads.append(time.perf_counter() - t0)
    out["loads"] = loads
    out["names"] = names
    laps = []
    for _ in range(1000):
        t0 = time.perf_counter()
        kdagen.get_kernel(f"{sys.argv[1]}:{names[0]}")
        laps.append(time.perf_counter() - t0)
    out["repeat"] = sorted(laps)[len(laps) // 2]
    out["modules"] = sorted(m for m in ("pydantic", "yaml", "jinja2", "click", "rich") if m in sys.modules)
    if torch.cuda.is_available():
        first = kernels[0]
        spec, dev = first.spec, torch.device("cuda")
        dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
        h, hv = 2, 2 * spec.gva_ratio
        q = torch.randn(1, 64, h, spec.head_dim_k, device=dev, dtype=dt[spec.dtype])
        v = torch.randn(1, 64, hv, spec.head_dim_v, device=dev, dtype=dt[spec.dtype])
        g = -torch.rand(1, 64, hv, spec.head_dim_k, device=dev, dtype=dt[spec.g_dtype])
        beta = torch.rand(1, 64, hv, device=dev, dtype=dt[spec.beta_dtype])
        extra = {} if spec.gate == "precomputed" else {"A_log": torch.zeros(hv, device=dev)}
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        first(q, q.clone(), v, g, beta, **extra)
        torch.cuda.synchronize()
        out["first_call"] = time.perf_counter() - t0
    print("LOAD " + json.dumps(out))
    """
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("specfile", nargs="?", default="specs/sm90.yaml")
    p.add_argument("--processes", type=int, default=5)
    p.add_argument("--bundle", default=None, metavar="DIR", help="load the kernels from this bundle")
    args = p.parse_args(argv)
    names = list(load_spec_file(args.specfile))
    env = {**os.environ, "KDAGEN_DISABLE_JIT": "1"}
    if args.bundle:
        env["KDAGEN_BUNDLE"] = str(Path(args.bundle).resolve())
    runs = []
    for _ in range(args.processes):
        out = subprocess.run([sys.executable, "-c", _CHILD, str(Path(args.specfile)), json.dumps(names)],
                             capture_output=True, text=True, env=env)
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith("LOAD ")]
        if out.returncode != 0 or not lines:
            print(f"bench_load: the child process failed:\n{out.stdout}\n{out.stderr}")
            return 1
        runs.append(json.loads(lines[-1].removeprefix("LOAD ")))

    def ms(values: list[float]) -> str:
        return f"{1e3 * statistics.median(values):.1f} ms"

    source = f"bundle {args.bundle}" if args.bundle else "the cache"
    print(f"{args.specfile}: {len(names)} variants from {source}, {len(runs)} fresh processes "
          "(medians over them)")
    print("  import torch (and CUDA init with a GPU)".ljust(44) + ms([r["import_torch"] for r in runs]))
    print("  import kdagen".ljust(44) + ms([r["import_kdagen"] for r in runs]))
    firsts = [r["loads"][0] for r in runs]
    # The first process on a machine may compile the templates the key is rendered from (kept on disk after
    # it, per Python version), so each process's first load is shown.
    print(f"  first get_kernel ({names[0]})".ljust(44) + ms(firsts)
          + " (by process: " + ", ".join(f"{1e3 * x:.1f}" for x in firsts) + ")")
    print("  import kdagen + first get_kernel".ljust(44)
          + ms([r["import_kdagen"] + r["loads"][0] for r in runs]))
    print(f"  repeated get_kernel ({names[0]})".ljust(44)
          + f"{1e6 * statistics.median(r['repeat'] for r in runs):.1f} us")
    shown = ", ".join(runs[0]["modules"]) or "none of pydantic, yaml, jinja2, click, rich"
    print("  imported by then".ljust(44) + shown)
    later = [x for r in runs for x in r["loads"][1:]]
    if later:
        print(f"  each later get_kernel ({len(names) - 1} a process)".ljust(44) + ms(later)
              + f" (max {1e3 * max(later):.1f} ms)")
    if "first_call" in runs[0]:
        print(f"  first call of {names[0]} (loads its GPU code)".ljust(44)
              + ms([r["first_call"] for r in runs]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
