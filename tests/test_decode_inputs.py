"""The decode call's argument checks (kdagen.decode.validate_decode_inputs), on CPU tensors: every bad
argument gets an InputError naming it and what was expected."""

from typing import Any

import pytest
import torch

from kdagen.decode import MAX_TOKENS, validate_decode_inputs
from kdagen.errors import InputError
from kdagen.spec import KernelSpec

SPEC = KernelSpec(arch="sm_90a")  # K = V = 128, lower_bound gate, bf16, fp32 g and beta, kv layout


def _args(n: int = 3, s: int = 1, h: int = 2, slots: int = 8, **over: Any) -> dict[str, Any]:
    hv = h
    args: dict[str, Any] = {
        "q": torch.randn(n, s, h, 128, dtype=torch.bfloat16),
        "k": torch.randn(n, s, h, 128, dtype=torch.bfloat16),
        "v": torch.randn(n, s, hv, 128, dtype=torch.bfloat16),
        "g": torch.randn(n, s, hv, 128),
        "beta": torch.rand(n, s, hv),
        "A_log": torch.zeros(hv),
        "dt_bias": torch.zeros(hv * 128),
        "state_pool": torch.zeros(slots, hv, 128, 128),
        "state_indices": torch.arange(n, dtype=torch.int32),
    }
    args.update(over)
    return args


def _check(**kw: Any):
    a = _args(**{k: kw.pop(k) for k in ("n", "s", "h", "slots") if k in kw})
    a.update(kw)
    return validate_decode_inputs(
        SPEC,
        a.pop("q"),
        a.pop("k"),
        a.pop("v"),
        a.pop("g"),
        a.pop("beta"),
        a.pop("A_log"),
        a.pop("dt_bias"),
        a.pop("state_pool"),
        a.pop("state_indices"),
        require_cuda=False,
        **a,
    )


def test_valid_calls_pass():
    assert _check() == (3, 1, 2, 2, 3)
    base = torch.zeros(8, 3, 2, 128, 128)
    assert _check(state_pool=base[:, 1]) == (3, 1, 2, 2, 3)  # an interleaved pool
    assert (
        _check(
            s=4,
            state_indices=torch.zeros(3, 4, dtype=torch.int64),
            num_accepted_tokens=torch.ones(3, dtype=torch.int32),
            has_initial_state=torch.ones(3, dtype=torch.bool),
        )[1]
        == 4
    )


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"s": MAX_TOKENS + 1}, f"at most {MAX_TOKENS} tokens a request"),
        (
            {"state_pool": torch.zeros(8, 2, 128, 128, dtype=torch.bfloat16)},
            "state_pool: expected dtype torch.float32",
        ),
        (
            {"state_pool": torch.zeros(8, 3, 128, 128)},
            r"state_pool: expected \[P, HV, K, V\] = \[P, 2, 128, 128\]",
        ),
        (
            {"state_pool": torch.zeros(8, 2, 128, 128).transpose(2, 3)},
            "state_pool: expected each slot compact",
        ),
        (
            {
                "state_pool": torch.zeros(3 * 128 * 128 * 2).as_strided(
                    (3, 2, 128, 128), (128 * 128, 128 * 128, 128, 1)
                )
            },
            "state_pool: expected a slot stride of at least",
        ),
        ({"state_indices": torch.zeros(3, dtype=torch.float32)}, "state_indices: expected dtype"),
        (
            {"state_indices": torch.zeros(2, dtype=torch.int32)},
            r"state_indices: expected \[N\] or \[N, M\] with N = 3",
        ),
        (
            {"state_indices": torch.zeros(3, 2, dtype=torch.int32)},
            r"state_indices: expected \[N, S\] = \[3, 1\]",
        ),
        (
            {"num_accepted_tokens": torch.ones(3, dtype=torch.int32)},
            "num_accepted_tokens: given, but state_indices",
        ),
        (
            {"has_initial_state": torch.ones(3, dtype=torch.int32)},
            "has_initial_state: expected a bool tensor",
        ),
        ({"out": torch.zeros(3, 1, 2, 64, dtype=torch.bfloat16)}, r"out: expected a torch.bfloat16 tensor"),
        ({"state_pool": "pool"}, "state_pool: expected a torch.Tensor, got str"),
    ],
)
def test_bad_arguments_are_named(kw: dict[str, Any], message: str):
    with pytest.raises(InputError, match=message):
        _check(**kw)


def test_out_must_not_alias_an_input():
    a = _args()
    with pytest.raises(InputError, match="out: must not alias an input"):
        _check(out=a["v"], v=a["v"])


def test_checks_run_on_meta_and_fake_tensors():
    """What `kdagen::decode`'s fake implementation relies on: no check reads a value or an address."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with torch.device("meta"):
        assert _check() == (3, 1, 2, 2, 3)
        with pytest.raises(InputError, match="state_pool: expected dtype torch.float32"):
            _check(state_pool=torch.zeros(8, 2, 128, 128, dtype=torch.float16))
    with FakeTensorMode():
        cu = torch.zeros(4, dtype=torch.int32)  # on the CPU, values unknown: not read
        sizes = _check(n=1, s=5, state_indices=torch.zeros(3, dtype=torch.int32), cu_seqlens=cu,
                       out=torch.empty(1, 5, 2, 128, dtype=torch.bfloat16))
    assert sizes == (1, 5, 2, 2, 3)
