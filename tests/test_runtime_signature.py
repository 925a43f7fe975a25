"""KDAKernel's validated-signature fast path (CPU only): what a signature holds, and when there is none."""

from __future__ import annotations

import torch

from kdagen.runtime import _signature


def _args(**over):
    t = torch.zeros(1, 8, 2, 4, dtype=torch.bfloat16)
    args = {"q": t, "k": t, "v": t, "g": t, "beta": torch.zeros(1, 8, 2), "A_log": torch.zeros(2),
            "dt_bias": torch.zeros(8), "initial_state": None, "cu_seqlens": None}
    args.update(over)
    return args


def test_same_properties_give_the_same_signature():
    assert _signature(**_args()) == _signature(**_args())
    assert _signature(**_args()) is not None


def test_every_checked_property_changes_the_signature():
    base = _signature(**_args())
    t = torch.zeros(1, 8, 2, 4, dtype=torch.bfloat16)
    variants = [
        _args(q=t.float()),  # dtype
        _args(k=torch.zeros(1, 7, 2, 4, dtype=torch.bfloat16)),  # shape
        _args(v=torch.nn.Parameter(t, requires_grad=False)),  # type
        _args(beta=torch.zeros(1, 8, 2, dtype=torch.bfloat16)),
        _args(A_log=None),  # presence
        _args(dt_bias=torch.zeros(2, 4)),
        _args(initial_state=torch.zeros(1, 2, 4, 4)),
        _args(g=torch.zeros(1, 8, 2, 4, dtype=torch.bfloat16, device="meta")),  # device
    ]
    sigs = [_signature(**a) for a in variants]
    assert all(s is not None and s != base for s in sigs)
    assert len(set(sigs)) == len(sigs)


def test_cpu_cu_seqlens_and_non_tensors_take_the_full_checks():
    # cu_seqlens on the CPU has its values checked on every call; a non-tensor argument must reach the
    # check that names it.
    assert _signature(**_args(cu_seqlens=torch.tensor([0, 8], dtype=torch.int32))) is None
    assert _signature(**_args(q=[[1.0]])) is None
    assert _signature(**_args(cu_seqlens=torch.tensor([0, 8], dtype=torch.int32, device="meta"))) is not None
