"""The per-item decode CTA's key split (`kdagen.kernels.decode_item`) and the planner's choice of it: every
key of a value column held by exactly one of its threads, in 16-byte groups, with the column's threads
reading different banks at the same time; every planned decode stage a shape the template can run (CPU)."""

from __future__ import annotations

import pytest

from kdagen import paths
from kdagen.kernels.decode_item import ItemConfig, key_of
from kdagen.plan import make_plan
from kdagen.spec import load_spec_file

# key_of is a cute.jit function of plain integers; its Python body gives the same keys at trace time.
_key = getattr(key_of, "__wrapped__", key_of)


def _config(k: int, block_v: int, key_split: int) -> ItemConfig:
    return ItemConfig(k=k, v=128, block_v=block_v, key_split=key_split, gate="lower_bound", lower_bound=-5.0,
                      l2norm=True, partial_sums=4, kv_layout=True)


@pytest.mark.parametrize(("k", "block_v", "key_split"),
                         [(128, 32, 4), (128, 64, 1), (64, 32, 4), (128, 32, 2), (128, 16, 8), (64, 64, 1)])
def test_every_key_of_a_column_has_one_thread(k: int, block_v: int, key_split: int) -> None:
    cfg = _config(k, block_v, key_split)
    assert cfg.threads == block_v * key_split and cfg.keys * key_split == k
    held = [[_key(r, p, cfg) for r in range(cfg.keys)] for p in range(key_split)]
    assert sorted(key for keys in held for key in keys) == list(range(k))
    for keys in held:  # groups of 4 adjacent keys (one 16-byte vector of an fp32 V-first row)
        for g in range(0, cfg.keys, 4):
            assert keys[g:g + 4] == list(range(keys[g], keys[g] + 4)) and keys[g] % 4 == 0
    for r in range(cfg.keys):  # the column's threads read q, k and the decays in different banks
        assert len({held[p][r] % 32 for p in range(key_split)}) == key_split


def test_rounds_cover_the_keys_when_the_cta_has_more_threads_than_keys() -> None:
    assert _config(64, 32, 4).rounds == 1 and _config(128, 64, 1).rounds == 2
    assert _config(64, 64, 4).rounds == 1


SPECS = [(f"{f.name}:{name}", spec) for f in sorted(paths.specs_dir().glob("*.yaml"))
         for name, spec in load_spec_file(f).items()]


@pytest.mark.parametrize(("name", "spec"), SPECS, ids=[name for name, _ in SPECS])
def test_planned_decode_ctas_fit_the_template(name: str, spec) -> None:
    stages = {s.name: s.params for s in make_plan(spec).stages}
    p = stages["decode"]
    block_v, key_split = p["block_v"], p["key_split"]
    assert spec.head_dim_v % block_v == 0, name
    assert (block_v * key_split) % 32 == 0 and block_v * key_split <= 1024, name  # whole warps
    assert key_split & (key_split - 1) == 0 and key_split <= 32, name  # butterflies within a warp
    assert spec.head_dim_k % (4 * key_split) == 0, name  # whole groups of 4 keys a thread
    # narrow CTAs exactly where the streaming stage takes the large calls
    assert (key_split > 1) == ("decode_stream" in stages), name
