"""The ``kdagen`` command: build / render / check / list / key / clean / bench.

Thin by design: each command parses arguments, calls the library and prints. Anything worth doing from
Python is in the library (`kdagen.build`, `kdagen.tree`, `kdagen.cache`, `kdagen.spec`).

SPEC arguments accept ``file.yaml`` (every variant, or those named by ``--variant``) and ``file.yaml:name``.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path
from typing import Any, TypeVar

import click
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from kdagen import paths
from kdagen.arch import FAMILIES, get_arch
from kdagen.errors import KdagenError, SpecError
from kdagen.spec import KernelSpec, load_spec_file, parse_spec_ref, resolve_spec
from kdagen.version import __version__

F = TypeVar("F", bound=Callable[..., Any])


def _console(stderr: bool = False) -> Console:
    # Created per command so that it writes to the sys.stdout of the moment (click's test runner swaps it).
    # Off a terminal (CI logs, pipes) use a wide line so slugs and keys are not folded.
    tty = (sys.stderr if stderr else sys.stdout).isatty()
    width = None if tty or os.environ.get("COLUMNS") else 200
    return Console(stderr=stderr, width=width, highlight=False)


def _errors(fn: F) -> F:
    """Show kdagen's own errors as a one-paragraph message and exit 1, without a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except KdagenError as e:
            raise click.ClickException(str(e)) from e

    return wrapper  # type: ignore[return-value]


# -- selecting variants -----------------------------------------------------------------------------------


def _spec_files(dir_or_files: Iterable[str | Path]) -> list[Path]:
    out: list[Path] = []
    for item in dir_or_files:
        p = Path(item)
        if p.is_dir():
            out += sorted(f for f in p.iterdir() if f.suffix in (".yaml", ".yml") and f.is_file())
        else:
            out.append(p)
    return out


def _default_spec_files() -> list[str]:
    d = paths.specs_dir()
    if not d.is_dir():
        raise SpecError(f"no spec directory at {d}; name spec files explicitly")
    return [_rel(f) for f in _spec_files([d])]


def _select(refs: Iterable[str], variants: tuple[str, ...]) -> list[tuple[str, str, KernelSpec]]:
    """[(file as given, variant name, spec)] for SPEC arguments, filtered by ``--variant`` names."""
    out: list[tuple[str, str, KernelSpec]] = []
    for ref in refs:
        path, name = parse_spec_ref(ref)
        if name is not None:
            _, spec = resolve_spec(ref)
            out.append((path, name, spec))
            continue
        out += [(path, n, s) for n, s in load_spec_file(path).items() if not variants or n in variants]
    if variants:
        missing = [v for v in variants if v not in {n for _, n, _ in out}]
        if missing:
            raise SpecError(f"--variant {missing[0]!r}: no such variant in {', '.join(refs)}")
    if not out:
        raise SpecError(f"no variants selected from {', '.join(refs)}")
    return out


# -- the command group ------------------------------------------------------------------------------------


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kdagen")
def cli() -> None:
    """kdagen: compile KDA (Kimi Delta Attention) kernels (prefill, decode, backward) from YAML specs."""


def _build_one(ref: str, force: bool) -> Any:
    # Top level so that a process pool can pickle it. The ref carries the variant name into the result.
    from kdagen import build

    return build.build_variant(ref, force=force)


@cli.command()
@click.argument("specfiles", nargs=-1, required=True)
@click.option(
    "--variant", "variants", multiple=True, metavar="NAME", help="Only these variants (repeatable)."
)
@click.option(
    "--jobs",
    "-j",
    default=1,
    show_default=True,
    type=click.IntRange(min=1),
    help="Compile this many variants in parallel (one process each).",
)
@click.option("--force", is_flag=True, help="Compile even when the cache has the artifacts.")
@click.option(
    "--bundle",
    "bundle_dir",
    default=None,
    metavar="DIR",
    type=click.Path(file_okay=False, path_type=Path),
    help="Also write the variants' artifacts and a manifest to DIR, for kdagen.load_bundle / KDAGEN_BUNDLE "
    "on a serving host (replaces a bundle already there).",
)
@_errors
def build(
    specfiles: tuple[str, ...], variants: tuple[str, ...], jobs: int, force: bool, bundle_dir: Path | None
) -> None:
    """Compile variants into the artifact cache (no GPU needed), and optionally bundle them."""
    selected = _select(specfiles, variants)
    refs = [f"{path}:{name}" for path, name, _ in selected]
    results: dict[str, Any] = {}
    failures: dict[str, str] = {}
    console = _console()
    start = time.perf_counter()
    columns = (
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("building", total=len(refs))
        if jobs == 1 or len(refs) == 1:
            for ref in refs:
                progress.update(task, description=f"building {ref}")
                try:
                    results[ref] = _build_one(ref, force)
                except Exception as e:  # report every variant, then fail
                    failures[ref] = f"{type(e).__name__}: {e}"
                progress.advance(task)
        else:
            # spawn, not fork: the compiler holds threads and global MLIR state that fork would copy broken.
            with ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn")) as pool:
                futures = {pool.submit(_build_one, ref, force): ref for ref in refs}
                for fut in as_completed(futures):
                    ref = futures[fut]
                    try:
                        results[ref] = fut.result()
                    except Exception as e:
                        failures[ref] = f"{type(e).__name__}: {e}"
                    progress.update(task, description=f"built {ref}")
                    progress.advance(task)

    table = Table(title=f"kdagen build: {len(refs)} variant(s) in {time.perf_counter() - start:.1f} s")
    for col, just in (
        ("variant", "left"),
        ("slug", "left"),
        ("key", "left"),
        ("stages", "left"),
        ("compile s", "right"),
        ("artifact bytes", "right"),
    ):
        table.add_column(col, justify=just, overflow="fold")  # type: ignore[arg-type]
    several_files = len({path for path, _, _ in selected}) > 1
    for (path, name, spec), ref in zip(selected, refs):
        label = f"{path}:{name}" if several_files else name
        r = results.get(ref)
        if r is None:
            table.add_row(label, spec.slug(), "-", "-", "[red]FAILED[/red]", "-")
            continue
        secs = "cached" if r.cached else f"{r.compile_seconds:.1f}"
        table.add_row(label, r.slug, r.key[:12], ", ".join(r.stages), secs, f"{r.artifact_bytes:,}")
    console.print(table)
    from kdagen.cache import ArtifactCache

    console.print(f"cache: {ArtifactCache().root}")
    if failures:
        err = _console(stderr=True)
        for ref, msg in failures.items():
            err.print(f"[red]failed[/red] {ref}: {msg}", markup=True, soft_wrap=True)
        if bundle_dir is not None:
            err.print(f"no bundle written to {bundle_dir}: every variant must build", soft_wrap=True)
        sys.exit(1)
    if bundle_dir is not None:
        built = [(name, results[ref]) for (_, name, _), ref in zip(selected, refs)]
        _write_bundle(bundle_dir, built, [path for path, _, _ in selected], console)


def _write_bundle(dest: Path, built: list[tuple[str, Any]], spec_files: list[str], console: Console) -> None:
    from kdagen.bundle import Shipped, write_bundle

    manifest = write_bundle(dest, [Shipped((name,), result) for name, result in built], spec_files)
    data = json.loads(manifest.read_text())
    size = sum(f["bytes"] for v in data["variants"] for f in v["files"].values())
    console.print(
        f"bundle: {manifest.parent} ({len(data['variants'])} variant(s), {size:,} bytes, "
        f"for {', '.join(data['targets'])})",
        soft_wrap=True,
    )


@cli.command()
@click.argument("specfiles", nargs=-1)
@click.option(
    "--variant", "variants", multiple=True, metavar="NAME", help="Only these variants (repeatable)."
)
@click.option(
    "--prune", is_flag=True, help="With no SPECFILE: also delete what no spec under specs/ produces any more."
)
@_errors
def render(specfiles: tuple[str, ...], variants: tuple[str, ...], prune: bool) -> None:
    """Render variants into generated/ (default: every spec file under specs/)."""
    from kdagen import tree

    if prune and (specfiles or variants):
        raise click.UsageError("--prune renders every spec under specs/; give no SPECFILE and no --variant")
    files = _default_spec_files() if not specfiles else list(specfiles)
    console = _console()
    for path, name, spec in _select(files, variants):
        written = tree.write_variant(spec, tree.default_planner()(spec))
        console.print(f"{path}:{name} -> {_rel(tree.generated_dir_for(spec))}/ ({', '.join(written)})")
    if prune:
        for removed in tree.prune_tree(files):
            console.print(f"removed {_rel(removed)}")


def _rel(p: Path) -> str:
    try:
        return str(p.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(p)


@cli.command()
@click.argument("specdir", required=False, type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option(
    "--generated",
    "generated",
    type=click.Path(file_okay=False, path_type=Path),
    help="The generated tree to check (default: $KDAGEN_GENERATED_DIR or <repo>/generated).",
)
@_errors
def check(specdir: Path | None, generated: Path | None) -> None:
    """Fail when generated/ differs from what the specs render to now (stale, missing or extra files)."""
    from kdagen.tree import check_tree

    files = [_rel(f) for f in _spec_files([specdir])] if specdir is not None else _default_spec_files()
    if not files:
        raise SpecError(f"no *.yaml spec files in {specdir or paths.specs_dir()}")
    root = generated if generated is not None else paths.generated_dir()
    problems = check_tree(files, root)
    if problems:
        click.echo("\n".join(problems))
        click.echo(
            f"kdagen check: {len(problems)} problem(s) in {_rel(root)}: run `kdagen render --prune` "
            "and commit the result",
            err=True,
        )
        sys.exit(1)
    click.echo(f"kdagen check: {_rel(root)} is up to date with {len(files)} spec file(s)")


def _describe(spec: KernelSpec) -> tuple[Any, str | None, dict[str, Any] | None]:
    """(plan, key, key parts) through the build layer, which owns the compile options."""
    from kdagen.build import describe

    plan, _rendered, key, parts = describe(spec)
    return plan, key, parts


def _why(ref: str, spec: KernelSpec, plan: Any) -> list[str]:
    """The long explanation of one variant for ``kdagen list --why``: the plan's full reason, each stage's
    note, and where the variant runs."""
    fam = FAMILIES.get(plan.family)
    lines = [f"{ref}  ({spec.slug()})", f"  family: {plan.family}" + (f" ({fam.description})" if fam else "")]
    lines.append("  reason:")
    lines += [f"    {line}" for line in plan.reason.splitlines()]
    lines.append("  stages:")
    for stage in plan.stages:
        built = "" if getattr(stage, "compiled", True) else ", imported by another stage, not compiled alone"
        note = getattr(stage, "note", "")
        lines.append(f"    {stage.name} ({stage.template}{built})" + (f": {note}" if note else ""))
    lines.append(f"  runs: {spec.arch_info.runs}")
    return lines


@cli.command(name="list")
@click.argument("specfiles", nargs=-1)
@click.option("--why", is_flag=True, help="Also print each plan's full reason and what each stage does.")
@_errors
def list_(specfiles: tuple[str, ...], why: bool) -> None:
    """Show variants: target, family, why in a line, stages, where they run, and whether they are cached."""
    from kdagen.build import lookup_built
    from kdagen.cache import ArtifactCache

    files = _default_spec_files() if not specfiles else list(specfiles)
    cache = ArtifactCache()
    table = Table(title="kdagen variants")
    for col in ("variant", "arch", "family", "why", "stages", "runs", "cached"):
        table.add_column(col, overflow="fold")
    explained: list[str] = []
    for path, name, spec in _select(files, ()):
        ref = f"{path}:{name}"
        try:
            plan, key, _ = _describe(spec)
            stages = plan.stage_names
            cached = "yes" if lookup_built(cache, spec, key, list(stages)) is not None else "no"
            family, summary = plan.family, plan.summary
            if why:
                explained += ["", *_why(ref, spec, plan)]
        except Exception as e:  # a broken template must not hide the other rows
            family, summary, stages, cached = "?", f"[red]{type(e).__name__}: {e}[/red]", [], "?"
        table.add_row(ref, spec.arch, family, summary, ", ".join(stages), spec.arch_info.runs, cached)
    console = _console()
    console.print(table)
    console.print(f"cache: {cache.root}")
    for line in explained:
        console.print(line, markup=False, highlight=False, soft_wrap=True)


@cli.command()
@click.argument("spec")
@click.option("--explain", is_flag=True, help="Print every part of the key and its sha256.")
@_errors
def key(spec: str, explain: bool) -> None:
    """Print the cache key of SPEC (file.yaml:name)."""
    name, ks = resolve_spec(spec)
    _, k, parts = _describe(ks)
    if not explain:
        click.echo(k)
        return
    click.echo(f"variant          {name or '-'}")
    click.echo(f"slug             {ks.slug()}")
    click.echo(f"key              {k}")
    click.echo("")
    for part, info in (parts or {}).items():
        value = info["value"]
        if isinstance(value, dict):
            click.echo(f"{part:<16} {info['sha256']}")
            for sub, v in value.items():
                click.echo(f"  {sub:<30} {v}")
        else:
            click.echo(f"{part:<16} {info['sha256']}  {value}")
    shas = json.dumps({p: "<sha256>" for p in sorted(parts or {})}, separators=(",", ":"))
    click.echo(f"\nkey = sha256({shas})[:24], each <sha256> that of the part above")


@cli.command()
@click.option("--arch", default=None, help="Only this target (e.g. sm_90a).")
@_errors
def clean(arch: str | None) -> None:
    """Delete cached artifacts (all, or one target's); without --arch also the remembered source digests
    and compiled templates kept beside them."""
    from kdagen.cache import ArtifactCache

    if arch is not None:
        get_arch(arch)  # refuse a typo instead of silently removing nothing
    cache = ArtifactCache()
    cleaned = cache.clean(arch)
    n = cleaned.entries
    derived = "".join(f" and {d}/" for d in cleaned.derived)
    click.echo(
        f"removed {n} cache entr{'y' if n == 1 else 'ies'}{derived} from {cache.root}"
        + (f"/{arch}" if arch else "")
    )


@cli.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def bench(args: tuple[str, ...]) -> None:
    """Run benchmarks/bench_fwd.py with ARGS (needs a GPU and the bench extra)."""
    d = paths.benchmarks_dir()
    script = d / "bench_fwd.py" if d is not None else None
    if script is None or not script.is_file():
        raise click.ClickException("benchmarks/bench_fwd.py not found: run from a kdagen checkout")
    os.execv(sys.executable, [sys.executable, str(script), *args])


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
