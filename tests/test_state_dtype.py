"""`state_dtype: bf16`: the states (initial and final, pools) are stored in bf16 and the arithmetic stays
fp32. The spec, the plan's parameters, the stages' signatures and the runtime's checks (CPU only)."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from kdagen import ops
from kdagen.decode import validate_decode_inputs
from kdagen.errors import InputError
from kdagen.plan import make_plan
from kdagen.render import render_variant
from kdagen.runtime import validate_forward_inputs
from kdagen.spec import KernelSpec

BF16 = KernelSpec(arch="sm_90a", state_dtype="bf16")
STATEFUL = ("forward", "recurrence", "fused", "fused_pair", "cp_merge", "cp_segments", "decode",
            "decode_stream")


def _tokens(n: int, t: int, h: int) -> dict[str, torch.Tensor]:
    bf = torch.bfloat16
    return {"q": torch.zeros(n, t, h, 128, dtype=bf), "k": torch.zeros(n, t, h, 128, dtype=bf),
            "v": torch.zeros(n, t, h, 128, dtype=bf), "g": torch.zeros(n, t, h, 128),
            "beta": torch.zeros(n, t, h)}


def test_spec_slug_and_plan() -> None:
    assert "-sbf16-" in BF16.slug()
    assert BF16.digest() != KernelSpec(arch="sm_90a").digest()
    plan = make_plan(BF16)
    for stage in plan.stages:
        if stage.name in STATEFUL:
            assert stage.params["state_dtype"] == "BFloat16", stage.name


@pytest.mark.parametrize("spec", [BF16, BF16.replace(family="mma_sync", state_layout="vk")])
def test_stage_signatures_declare_bf16_states(spec: KernelSpec) -> None:
    files = render_variant(spec, make_plan(spec))
    declared = 0
    for name, text in files.items():
        if name == "bwd_cp_merge.py":  # the backward's merge: its "h0" is the final states' gradient, fp32
            assert '("h0", "tensor", "Float32"' in text
            continue
        for line in text.splitlines():
            if line.strip().startswith(('("h0", "tensor"', '("ht", "tensor"', '("state_pool", "tensor"')):
                assert '"BFloat16"' in line, (name, line)
                declared += 1
    assert declared >= 6


def test_runtime_wants_the_state_dtype() -> None:
    tok = _tokens(2, 4, 2)
    good = torch.zeros(2, 2, 128, 128, dtype=torch.bfloat16)
    assert validate_forward_inputs(BF16, **tok, initial_state=good, require_cuda=False)[4] == 2
    with pytest.raises(InputError, match="initial_state: expected dtype torch.bfloat16"):
        validate_forward_inputs(BF16, **tok, initial_state=good.float(), require_cuda=False)
    pool = torch.zeros(4, 2, 128, 128, dtype=torch.bfloat16)
    idx = torch.arange(2, dtype=torch.int32)
    validate_forward_inputs(BF16, **tok, state_pool=pool, state_indices=idx, require_cuda=False)
    with pytest.raises(InputError, match="state_pool: expected dtype torch.bfloat16"):
        validate_forward_inputs(BF16, **tok, state_pool=pool.float(), state_indices=idx, require_cuda=False)
    one = _tokens(2, 1, 2)
    validate_decode_inputs(BF16, *one.values(), None, None, pool, idx, require_cuda=False)
    with pytest.raises(InputError, match="state_pool: expected dtype torch.bfloat16"):
        validate_decode_inputs(BF16, *one.values(), None, None, pool.float(), idx, require_cuda=False)


def test_fake_forward_gives_a_bf16_final_state() -> None:
    with FakeTensorMode():
        tok = _tokens(2, 4, 2)
        o, ht = torch.ops.kdagen.forward(ops.spec_json(BF16), *tok.values(), None, None, None, None, True,
                                         None, None)
    assert ht.dtype == torch.bfloat16 and tuple(ht.shape) == (2, 2, 128, 128)
    assert o.dtype == torch.bfloat16
