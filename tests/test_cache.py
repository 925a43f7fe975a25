"""The artifact store: round trip, self-healing, locks and concurrent publishers (CPU only)."""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import time
from pathlib import Path

import pytest

from kdagen.cache import ArtifactCache
from kdagen.spec import KernelSpec

SPEC = KernelSpec(arch="sm_90a")
KEY = "0123456789abcdef01234567"
ARTIFACTS = {"prepare": b"\x7fELF prepare" * 100, "recurrence": b"\x7fELF recurrence" * 50}
STAGES = list(ARTIFACTS)


def test_round_trip(tmp_path: Path):
    cache = ArtifactCache(tmp_path)
    assert cache.lookup(SPEC, KEY, STAGES) is None
    paths = cache.publish(SPEC, KEY, ARTIFACTS, {"compile_seconds": 1.5, "key": "ignored"})
    entry = tmp_path / "sm_90a" / f"{SPEC.slug()}-{KEY}"
    assert paths == {s: entry / f"{s}.o" for s in STAGES}
    assert cache.lookup(SPEC, KEY, STAGES) == paths
    for stage, data in ARTIFACTS.items():
        assert paths[stage].read_bytes() == data
        assert paths[stage].stat().st_mode & 0o777 == 0o644
    meta = json.loads((entry / "meta.json").read_text())
    assert meta["key"] == KEY and meta["compile_seconds"] == 1.5
    assert meta["spec"] == json.loads(SPEC.canonical_json())
    assert meta["stages"] == STAGES
    assert meta["artifacts"]["prepare"] == {
        "file": "prepare.o",
        "bytes": len(ARTIFACTS["prepare"]),
        "sha256": hashlib.sha256(ARTIFACTS["prepare"]).hexdigest(),
    }
    assert sorted(p.name for p in entry.iterdir()) == ["meta.json", "prepare.o", "recurrence.o"]  # no temps


def test_default_root_is_env(isolated_env: dict[str, Path]):
    assert ArtifactCache().root == isolated_env["cache"]


def test_lookup_mismatches(tmp_path: Path):
    cache = ArtifactCache(tmp_path)
    cache.publish(SPEC, KEY, ARTIFACTS)
    assert cache.lookup(SPEC, KEY, ["prepare"]) is None
    assert cache.lookup(SPEC, KEY, ["recurrence", "prepare"]) is None
    assert cache.lookup(SPEC, "f" * 24, STAGES) is None
    assert cache.lookup(SPEC.replace(gva_ratio=2), KEY, STAGES) is None


@pytest.mark.parametrize(
    "damage", ["flip", "truncate", "delete", "meta_missing", "meta_corrupt", "meta_list"]
)
def test_damaged_entry_is_a_miss_and_heals(tmp_path: Path, damage: str):
    cache = ArtifactCache(tmp_path)
    paths = cache.publish(SPEC, KEY, ARTIFACTS)
    meta = paths["prepare"].parent / "meta.json"
    if damage == "flip":  # same size, different bytes: only the sha256 catches it
        data = bytearray(paths["prepare"].read_bytes())
        data[10] ^= 0xFF
        paths["prepare"].write_bytes(bytes(data))
    elif damage == "truncate":
        paths["recurrence"].write_bytes(ARTIFACTS["recurrence"][:-1])
    elif damage == "delete":
        paths["recurrence"].unlink()
    elif damage == "meta_missing":
        meta.unlink()
    elif damage == "meta_corrupt":
        meta.write_text('{"key": "0123')
    elif damage == "meta_list":
        meta.write_text("[]")
    assert cache.lookup(SPEC, KEY, STAGES) is None
    cache.publish(SPEC, KEY, ARTIFACTS)  # the caller rebuilds and republishes
    assert cache.lookup(SPEC, KEY, STAGES) == paths


def test_publish_rejects_bad_stage_names(tmp_path: Path):
    cache = ArtifactCache(tmp_path)
    for bad in ("../x", ".hidden", "a/b", ""):
        with pytest.raises(ValueError):
            cache.publish(SPEC, KEY, {bad: b"x"})
    with pytest.raises(ValueError):
        cache.publish(SPEC, KEY, {})


def test_entries_and_clean(tmp_path: Path):
    cache = ArtifactCache(tmp_path)
    cache.publish(SPEC, KEY, ARTIFACTS)
    sm80 = KernelSpec(arch="sm_80")
    cache.publish(sm80, KEY, ARTIFACTS)
    cache.lock(sm80, "a" * 24)  # an incomplete entry: lock taken, never published
    (tmp_path / "sm_90a" / "not-an-entry").mkdir()
    (tmp_path / "unrelated.txt").write_text("keep me\n")
    entries = cache.entries()
    assert [(e.arch, e.complete) for e in entries] == [("sm_80", True), ("sm_80", False), ("sm_90a", True)]
    assert entries[0].key == KEY and entries[0].bytes > sum(map(len, ARTIFACTS.values()))
    assert cache.clean("sm_80").entries == 2
    assert not (tmp_path / "sm_80").exists()
    assert cache.lookup(SPEC, KEY, STAGES) is not None
    assert cache.clean().entries == 1
    assert (tmp_path / "sm_90a" / "not-an-entry").is_dir()  # only entry-shaped directories are deleted
    assert (tmp_path / "unrelated.txt").read_text() == "keep me\n"
    assert ArtifactCache(tmp_path / "nowhere").clean().entries == 0


# -- concurrency --------------------------------------------------------------------------------------------
# Workers are module-level functions so that any start method can pickle them.


def _build_under_lock(root: str, log: str, hold: float, started: str | None = None) -> str:
    """What a builder does: lookup; lock; lookup again; build and publish only if still missing."""
    cache = ArtifactCache(root)
    if cache.lookup(SPEC, KEY, STAGES) is not None:
        return "hit"
    if started:  # tells the test that the first lookup missed and the lock comes next
        Path(started).touch()
    with cache.lock(SPEC, KEY):
        if cache.lookup(SPEC, KEY, STAGES) is not None:
            return "hit-after-lock"
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(hold)  # "compiling"
        cache.publish(SPEC, KEY, ARTIFACTS, {"builder": os.getpid()})
        return "built"


def _publish_blindly(root: str, n: int) -> None:
    cache = ArtifactCache(root)
    for _ in range(n):
        cache.publish(SPEC, KEY, ARTIFACTS)


def _ctx() -> mp.context.BaseContext:
    return mp.get_context("spawn")


def test_lock_recheck(tmp_path: Path):
    """A second builder that waits on the lock finds the first one's entry and does not build."""
    log = tmp_path / "builds.log"
    cache = ArtifactCache(tmp_path / "cache")
    started = tmp_path / "started"
    with _ctx().Pool(1) as pool:
        with cache.lock(SPEC, KEY):
            pending = pool.apply_async(_build_under_lock, (str(cache.root), str(log), 0.0, str(started)))
            # A spawned worker can take seconds to start on a loaded machine: wait until it has missed the
            # entry, then give it time to block on the lock.
            deadline = time.monotonic() + 60
            while not started.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert started.exists(), "the worker never started"
            time.sleep(0.5)
            assert not log.exists()
            cache.publish(SPEC, KEY, ARTIFACTS)  # we are the builder
        assert pending.get(timeout=60) == "hit-after-lock"
    assert not log.exists()


def test_concurrent_builders_build_once(tmp_path: Path):
    log = tmp_path / "builds.log"
    root = tmp_path / "cache"
    with _ctx().Pool(4) as pool:
        results = pool.starmap(_build_under_lock, [(str(root), str(log), 0.3)] * 4)
    assert results.count("built") == 1, results
    assert len(log.read_text().splitlines()) == 1
    assert ArtifactCache(root).lookup(SPEC, KEY, STAGES) is not None


def test_concurrent_publishers_leave_one_valid_entry(tmp_path: Path):
    """Even without the lock, racing publishers of the same artifacts leave an intact entry."""
    root = tmp_path / "cache"
    with _ctx().Pool(4) as pool:
        pool.starmap(_publish_blindly, [(str(root), 10)] * 4)
    cache = ArtifactCache(root)
    assert cache.lookup(SPEC, KEY, STAGES) is not None
    entry = cache.entry_dir(SPEC, KEY)
    assert sorted(p.name for p in entry.iterdir() if not p.name.startswith(".lock")) == [
        "meta.json",
        "prepare.o",
        "recurrence.o",
    ]
