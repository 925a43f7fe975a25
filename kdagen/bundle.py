"""Bundles: built artifacts shipped to a serving host with a manifest, found without the build's state.

A cache hit recomputes its key from the rendered sources' digests, remembered under a name that hashes the
templates, kdagen's Python files and the Jinja and pydantic versions (`kdagen.source_memo`); a serving host
whose versions differ from the build box's renders every stage again before it finds the entry. A bundle
answers the question the key answers on the build box once, there, and writes the answer down:

    DIR/manifest.json                         format, kdagen version, toolchain, C compiler, variants
    DIR/<target>/<slug>-<key>/<stage>.so      (or <stage>.o where the build box had no C compiler)

Each variant of the manifest maps its canonical spec JSON (and the names it was built under) to its key,
its compile target, its stage names and each file's sha256 and size. `load_bundle(DIR)` (or
``KDAGEN_BUNDLE=DIR``, read at the first `kdagen.get_kernel`) reads and checks the manifest once and
registers it; `kdagen.get_kernel` then looks a spec up by its canonical JSON in the registered bundles
before anything else, and loads the stages without rendering, hashing sources or importing Jinja.

What is checked, and why:

- when loading the bundle, everything that is the same for all its variants and can make a binary unusable
  on this host: the manifest format, the kdagen version (the runtime's calling convention for the stages
  is kdagen's), the toolchain fingerprint (CuTe DSL and TVM-FFI versions and the cu12/cu13 libs flavour:
  the stages call into the DSL runtime library of the flavour they were built against) and, where a GPU is
  present, that at least one of the bundle's targets is this GPU's exact target (design.md: never a family
  fallback). Without a GPU nothing is refused on the target, so that a CPU box can load and test a bundle.
  The C compiler is recorded, not checked: the ``.so`` is already linked.
- when getting a variant: its target is this GPU's (a bundle may hold several targets for a mixed fleet),
  its stage names are what this kdagen plans for the spec, and each file exists with its recorded size.
  Sizes cost a ``stat``; the sha256 of every file is checked on request (``load_bundle(DIR, verify=True)``),
  since hashing megabytes of binaries is most of the time a serving host wants to save.

A bundle is read-only on the serving host: a bad file is an error naming it (`BundleError`), never a rebuild.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kdagen import paths
from kdagen.errors import LoadError
from kdagen.files import sha256_file
from kdagen.version import __version__

__all__ = [
    "FORMAT",
    "MANIFEST_NAME",
    "BundleError",
    "Bundle",
    "BundleEntry",
    "load_bundle",
    "write_bundle",
    "registered",
    "find",
    "find_in_file",
    "host_target",
    "unregister_all",
]

FORMAT = 1
MANIFEST_NAME = "manifest.json"


class BundleError(LoadError):
    """A bundle cannot be used on this host, or one of its files is missing or damaged; the message names
    the bundle (or the file) and what differs."""


# -- the host ---------------------------------------------------------------------------------------------


def host_target() -> str | None:
    """The exact compile target of this process's current GPU (``"sm_90a"`` for capability (9, 0)), or None
    without a GPU.

    Targets from sm_90 on carry the ``a`` suffix: kdagen compiles for the architecture-specific feature set
    there (wgmma, tcgen05), and a binary for it runs on that GPU only.
    """
    import torch  # the runtime needs it anyway; an engine has imported it already

    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}" + ("a" if major >= 9 else "")


# -- the manifest -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BundleEntry:
    """One variant of a bundle: where its files are and what they must be."""

    bundle: Path
    names: tuple[str, ...]
    spec_json: str
    key: str
    target: str
    stages: tuple[str, ...]
    directory: Path
    files: dict[str, dict[str, Any]]  # {file name: {"sha256", "bytes"}}

    def stage_file(self, stage: str) -> Path:
        """The file a stage loads from: its ``.so`` when the bundle has one, else its ``.o``."""
        so = f"{stage}.so"
        return self.directory / (so if so in self.files else f"{stage}.o")

    def check_sizes(self) -> None:
        """Every file exists with its recorded size (a truncated copy or a partial sync shows here)."""
        for name, info in self.files.items():
            path = self.directory / name
            try:
                size = path.stat().st_size
            except OSError as e:
                raise BundleError(f"bundle {self.bundle}: cannot read {path}: {e.strerror or e}") from e
            if size != info["bytes"]:
                raise BundleError(
                    f"bundle {self.bundle}: {path} has {size} bytes, the manifest says {info['bytes']}; "
                    "copy the bundle again"
                )

    def check_digests(self) -> None:
        """Every file's sha256 is the recorded one (`check_sizes` first)."""
        self.check_sizes()
        for name, info in self.files.items():
            path = self.directory / name
            if sha256_file(path) != info["sha256"]:
                raise BundleError(
                    f"bundle {self.bundle}: {path} does not match its sha256 in the manifest; "
                    "copy the bundle again"
                )

    def load(self) -> dict[str, Any]:
        """{stage: loaded function}, after the size check; a load failure names the file."""
        from kdagen import compile as _compile  # looked up at call time, so tests can fake the loader

        self.check_sizes()
        funcs: dict[str, Any] = {}
        for stage in self.stages:
            path = self.stage_file(stage)
            shared = path if path.suffix == ".so" else None
            try:
                funcs[stage] = _compile.load_object(path, shared)
            except Exception as e:  # TVM-FFI and the DSL raise many types; name the file
                raise BundleError(
                    f"bundle {self.bundle}: loading stage {stage!r} from {path} failed: "
                    f"{type(e).__name__}: {e}"
                ) from e
        return funcs


@dataclass(frozen=True)
class Bundle:
    """A loaded, checked manifest: its variants by canonical spec JSON."""

    root: Path
    manifest: dict[str, Any]
    entries: dict[str, BundleEntry]
    # {sha256 of a spec file's bytes: {variant name: canonical spec JSON}} for the files it was built from
    spec_files: dict[str, dict[str, str]] = field(default_factory=dict)

    @property
    def targets(self) -> list[str]:
        return sorted({e.target for e in self.entries.values()})


def _read_manifest(root: Path) -> dict[str, Any]:
    path = root / MANIFEST_NAME
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise BundleError(
            f"{root}: no {MANIFEST_NAME}, so not a kdagen bundle; write one with "
            "'kdagen build SPECFILE --bundle DIR'"
        ) from None
    except (OSError, ValueError) as e:
        raise BundleError(f"{path}: cannot read the manifest: {e}") from e
    if not isinstance(manifest, dict):
        raise BundleError(f"{path}: the manifest is not a JSON object")
    return manifest


def _check_format(root: Path, manifest: dict[str, Any]) -> None:
    found = manifest.get("format")
    if found != FORMAT:
        raise BundleError(
            f"bundle {root}: manifest format {found!r}, this kdagen ({__version__}) reads format {FORMAT}; "
            "build the bundle again with this kdagen"
        )
    if manifest.get("kdagen_version") != __version__:
        raise BundleError(
            f"bundle {root}: built by kdagen {manifest.get('kdagen_version')!r}, this is kdagen "
            f"{__version__} "
            "(the runtime's calling convention for the stages is kdagen's); build the bundle again with "
            "this kdagen"
        )


def _check_toolchain(root: Path, manifest: dict[str, Any]) -> None:
    from kdagen.keys import toolchain_fingerprint  # package metadata only: cutlass is not imported

    theirs = manifest.get("toolchain")
    ours = toolchain_fingerprint()
    if theirs == ours:
        return
    theirs = theirs if isinstance(theirs, dict) else {}
    diffs = [
        f"{name}: bundle {theirs.get(name)!r}, here {ours.get(name)!r}"
        for name in sorted(set(theirs) | set(ours))
        if theirs.get(name) != ours.get(name)
    ]
    raise BundleError(
        f"bundle {root}: built with another toolchain ({'; '.join(diffs)}); install the build box's "
        "nvidia-cutlass-dsl (same cu12/cu13 flavour) and apache-tvm-ffi versions here, or build the "
        "bundle with this host's"
    )


def _check_target(root: Path, targets: list[str], host: str | None) -> None:
    if host is not None and targets and host not in targets:
        raise BundleError(
            f"bundle {root}: built for {', '.join(targets)}, and this GPU is {host}; a binary runs on its "
            f"exact target only: build the bundle for {host}"
        )


def _entries(root: Path, manifest: dict[str, Any]) -> dict[str, BundleEntry]:
    variants = manifest.get("variants")
    if not isinstance(variants, list):
        raise BundleError(f"{root / MANIFEST_NAME}: 'variants' is not a list")
    out: dict[str, BundleEntry] = {}
    for i, v in enumerate(variants):
        try:
            entry = BundleEntry(
                bundle=root,
                names=tuple(v["names"]),
                spec_json=v["spec_json"],
                key=v["key"],
                target=v["target"],
                stages=tuple(v["stages"]),
                directory=root / v["dir"],
                files={n: {"sha256": f["sha256"], "bytes": int(f["bytes"])} for n, f in v["files"].items()},
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise BundleError(
                f"{root / MANIFEST_NAME}: variant {i} is malformed ({type(e).__name__}: {e})"
            ) from e
        out[entry.spec_json] = entry
    return out


def _spec_files(root: Path, manifest: dict[str, Any]) -> dict[str, dict[str, str]]:
    files = manifest.get("spec_files", [])
    try:
        out = {f["sha256"]: {str(n): str(j) for n, j in f["variants"].items()} for f in files}
    except (KeyError, TypeError, AttributeError) as e:
        raise BundleError(
            f"{root / MANIFEST_NAME}: 'spec_files' is malformed ({type(e).__name__}: {e})"
        ) from e
    return out


# -- registration -----------------------------------------------------------------------------------------

_registered: list[Bundle] = []
_env_read = False
_lock = threading.Lock()


def load_bundle(directory: str | os.PathLike[str], verify: bool = False) -> Bundle:
    """Read and check the bundle in `directory`, and make `kdagen.get_kernel` look there first.

    Refuses (`BundleError`, naming what differs) a bundle of another manifest format or kdagen version,
    one built with another toolchain, and, where a GPU is present, one with no variant for its target.
    `verify` also checks every file's sha256 now (otherwise sizes are checked when a variant is loaded).
    Loading the same directory again replaces its earlier registration; bundles loaded earlier are searched
    first.
    """
    root = Path(directory).expanduser().resolve()
    manifest = _read_manifest(root)
    _check_format(root, manifest)
    _check_toolchain(root, manifest)
    entries = _entries(root, manifest)
    bundle = Bundle(root, manifest, entries, _spec_files(root, manifest))
    _check_target(root, bundle.targets, host_target())
    if verify:
        for entry in entries.values():
            entry.check_digests()
    with _lock:
        for i, old in enumerate(_registered):
            if old.root == root:
                _registered[i] = bundle
                break
        else:
            _registered.append(bundle)
    return bundle


def registered() -> tuple[Bundle, ...]:
    """The bundles `get_kernel` searches, in order."""
    return tuple(_registered)


def unregister_all() -> None:
    """Forget every registered bundle, and read ``KDAGEN_BUNDLE`` again at the next lookup."""
    global _env_read
    with _lock:
        _registered.clear()
        _env_read = False


def _load_env_once() -> None:
    """Load the bundles ``KDAGEN_BUNDLE`` names, once per process (the first `get_kernel` calls this).

    A bundle there that is refused raises, and is tried again at the next call: a serving host must not go
    on without the kernels it was given.
    """
    global _env_read
    if _env_read:
        return
    for d in paths.bundle_dirs():
        load_bundle(d)
    _env_read = True


def find(canonical_json: str) -> BundleEntry | None:
    """The first registered bundle's entry for a spec (by its canonical JSON), or None.

    Reads ``KDAGEN_BUNDLE`` first if it has not been read yet. An entry for a target this GPU cannot run is
    an error rather than a miss: the cache path would only build another binary for the same target.
    """
    _load_env_once()
    for b in _registered:
        entry = b.entries.get(canonical_json)
        if entry is not None:
            _check_entry_target(entry)
            return entry
    return None


def find_in_file(file_sha256: str, name: str | None) -> tuple[str, BundleEntry] | None:
    """(variant name, entry) of the variant `name` of a spec file whose bytes have sha256 `file_sha256`, where
    a registered bundle was built from that file and holds the variant; None otherwise. Without a name the
    file must hold exactly one variant.

    The same bytes give the same variants under the same kdagen (the manifest's version is this one's), so
    a reference is resolved without reading the YAML or validating the spec. Reads ``KDAGEN_BUNDLE`` first
    if it has not been read yet.
    """
    _load_env_once()
    for b in _registered:
        variants = b.spec_files.get(file_sha256)
        if variants is not None:
            break  # the same bytes give the same variants in every bundle
    else:
        return None
    if name is None:
        if len(variants) != 1:
            return None
        (name,) = variants
    spec_json = variants.get(name)
    entry = None if spec_json is None else find(spec_json)
    return None if entry is None else (name, entry)


def _check_entry_target(entry: BundleEntry) -> None:
    host = host_target()
    if host is not None and entry.target != host:
        raise BundleError(
            f"bundle {entry.bundle}: variant {', '.join(entry.names) or entry.key} is built for "
            f"{entry.target}, and this GPU is {host}"
        )


def searched() -> str:
    """The registered bundles, for a message (``"none"`` when there are none)."""
    return ", ".join(str(b.root) for b in _registered) or "none"


# -- writing ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shipped:
    """One variant to write: the names it was built under, and its build (a `kdagen.build.BuildResult`)."""

    names: tuple[str, ...]
    result: Any


def _artifacts(result: Any) -> dict[str, Path]:
    """{file name in the bundle: source path}: each stage's ``.so`` where every stage has one, else ``.o``
    (a loader never mixes the two paths, as in the cache)."""
    stages = list(result.stages)
    if result.shared and set(result.shared) == set(stages):
        return {f"{s}.so": Path(result.shared[s]) for s in stages}
    return {f"{s}.o": Path(result.paths[s]) for s in stages}


def _entry_meta(result: Any) -> dict[str, Any]:
    entry = Path(next(iter(result.paths.values()))).parent
    try:
        meta = json.loads((entry / "meta.json").read_text())
    except (OSError, ValueError) as e:
        raise BundleError(f"cache entry {entry}: cannot read its meta.json ({e}); build it again") from e
    return meta


def _copy_variant(dest: Path, result: Any, target: str) -> tuple[str, dict[str, dict[str, Any]]]:
    """Copy one variant's files under `dest`; ({dir relative to the bundle}, {file: sha256, bytes})."""
    rel = f"{target}/{result.slug}-{result.key}"
    out_dir = dest / rel
    out_dir.mkdir(parents=True, exist_ok=True)
    files: dict[str, dict[str, Any]] = {}
    for name, src in _artifacts(result).items():
        data = src.read_bytes()
        (out_dir / name).write_bytes(data)
        files[name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    return rel, files


def _variant_record(dest: Path, shipped: Shipped) -> dict[str, Any]:
    r = shipped.result
    meta = _entry_meta(r)
    target = meta.get("target") or r.spec.arch
    rel, files = _copy_variant(dest, r, target)
    return {
        "names": list(shipped.names),
        "spec_json": r.spec.canonical_json(),
        "slug": r.slug,
        "key": r.key,
        "target": target,
        "stages": list(r.stages),
        "dir": rel,
        "files": files,
        "toolchain": meta.get("toolchain"),
        "key_parts": meta.get("key_parts"),
        "plan": meta.get("plan"),
    }


def _merge(shipped: Iterable[Shipped]) -> list[Shipped]:
    """One item per key, with every name it was asked for (two names may give one spec)."""
    by_key: dict[str, Shipped] = {}
    for s in shipped:
        old = by_key.get(s.result.key)
        names = (*old.names, *(n for n in s.names if n not in old.names)) if old else s.names
        by_key[s.result.key] = Shipped(names, s.result)
    return list(by_key.values())


def _spec_file_record(path: str | os.PathLike[str]) -> dict[str, Any]:
    """{sha256 of the file's bytes, {variant name: canonical spec JSON}} of every variant of a spec file."""
    from kdagen.spec import load_spec_file

    found = paths.find_spec_file(path)
    variants = load_spec_file(path)
    return {
        "sha256": sha256_file(found),
        "variants": {name: spec.canonical_json() for name, spec in variants.items()},
    }


def _manifest(variants: list[dict[str, Any]], spec_files: list[dict[str, Any]]) -> dict[str, Any]:
    from kdagen.compile import c_compiler_identity
    from kdagen.keys import toolchain_fingerprint

    toolchain = toolchain_fingerprint()
    for v in variants:
        if v["toolchain"] is not None and v["toolchain"] != toolchain:
            raise BundleError(
                f"cache entry {v['dir']} was built with another toolchain ({v['toolchain']}); "
                "build it again with this one before bundling"
            )
    return {
        "format": FORMAT,
        "kdagen_version": __version__,
        "toolchain": toolchain,
        "c_compiler": c_compiler_identity(),
        "targets": sorted({v["target"] for v in variants}),
        "variants": [{k: v[k] for k in v if k != "toolchain"} for v in variants],
        "spec_files": spec_files,
    }


def _is_replaceable(dest: Path) -> bool:
    """Whether `dest` may be replaced: absent, an empty directory, or a bundle (it has a manifest)."""
    if not dest.exists():
        return True
    return dest.is_dir() and ((dest / MANIFEST_NAME).is_file() or not any(dest.iterdir()))


def write_bundle(
    dest: str | os.PathLike[str],
    shipped: Sequence[Shipped],
    spec_files: Sequence[str | os.PathLike[str]] = (),
) -> Path:
    """Write the variants of `shipped` as a bundle at `dest`; returns the manifest's path.

    `spec_files` (the files the variants come from) are recorded by their bytes' sha256 with their
    variants' spec JSON, so that a serving host resolves ``"file.yaml:name"`` with the same bytes without
    reading the YAML (`find_in_file`).

    The bundle is made in a temp directory beside `dest` (manifest last) and renamed into place, so a
    reader sees the old bundle or the new one, never a half-written one (between the two renames, for a
    moment, no bundle). A bundle already at `dest` is replaced whole: one command writes one bundle. A
    directory that is not a bundle is refused, never overwritten.
    """
    dest = Path(dest).expanduser().resolve()
    if not shipped:
        raise BundleError(f"bundle {dest}: no variants to write")
    if not _is_replaceable(dest):
        raise BundleError(f"bundle {dest}: the directory exists and is not a kdagen bundle; name another one")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.tmp-"))
    try:
        variants = [_variant_record(tmp, s) for s in _merge(shipped)]
        files = [_spec_file_record(f) for f in dict.fromkeys(spec_files)]
        text = json.dumps(_manifest(variants, files), indent=2, sort_keys=True) + "\n"
        (tmp / MANIFEST_NAME).write_text(text)  # last: the bundle's commit marker
        os.chmod(tmp, 0o755)  # mkdtemp makes 0700; a bundle is read by the serving user
        _swap_in(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest / MANIFEST_NAME


def _swap_in(tmp: Path, dest: Path) -> None:
    old = None
    if dest.exists():
        old = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.old-"))
        os.replace(dest, old / "bundle")
    os.replace(tmp, dest)
    if old is not None:
        with contextlib.suppress(OSError):
            shutil.rmtree(old)
