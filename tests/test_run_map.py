"""The kept states' run map: the host's tensors (`kdagen.backward._run_map`, for the forward's rerun) and the
slots the states' recurrence derives on the device from the same formulas (`kdagen.kernels.run_map`, composed
as `kdagen.kernels.common.tile_runs` composes them) name the same slots, and no two runs share one."""

from __future__ import annotations

import random

import pytest
import torch

from kdagen.backward import _run_map
from kdagen.kernels import run_map
from kdagen.workspace import tile_slots

RUN = 64


def _device_slots(cu: list[int], run: int) -> tuple[list[int], list[list[int]]]:
    # tile_runs per sequence: the entering state at first - 1, checkpoint m at first + m for m < count.
    entering, checkpoints = [], []
    for seq in range(len(cu) - 1):
        bos, length = cu[seq], cu[seq + 1] - cu[seq]
        first = run_map.first_run(bos, seq, run) + 1
        count = max(run_map.runs_of(length, run) - 1, 0)
        entering.append(first - 1)
        checkpoints.append([first + m for m in range(count)])
    return entering, checkpoints


def _cases() -> list[list[int]]:
    rng = random.Random(7)
    cases = [[0, 64], [0, 63], [0, 65], [0, 0, 128, 128, 200], [0, 1, 2, 3], [0, 4096, 8192]]
    for _ in range(20):
        lengths = [rng.choice([0, 1, 15, 16, 63, 64, 65, 127, 128, rng.randrange(1, 700)]) for _ in
                   range(rng.randrange(1, 12))]
        cases.append([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return cases


@pytest.mark.parametrize("cu", _cases(), ids=lambda cu: f"N{len(cu) - 1}-T{cu[-1]}")
def test_device_slots_are_the_host_map(cu: list[int]) -> None:
    total = cu[-1]
    most = max(1, total // RUN)
    first, ck = _run_map(torch.tensor(cu, dtype=torch.int32), most, RUN)
    entering, checkpoints = _device_slots(cu, RUN)
    assert first.tolist() == entering
    for seq, row in enumerate(ck.tolist()):
        assert [s for s in row if s >= 0] == checkpoints[seq]
        assert all(s == -1 for s in row[len(checkpoints[seq]):])  # the written ones come first
    # Every non-empty sequence's runs get their own slots, inside the buffer's bound.
    used = [s for seq, row in enumerate(checkpoints) if cu[seq + 1] > cu[seq] for s in [entering[seq], *row]]
    assert len(used) == len(set(used))
    assert all(0 <= s < tile_slots(total, len(cu) - 1, RUN // 16) for s in used)
    # One slot a run of the sequence: its entering state and a checkpoint a later run.
    for seq in range(len(cu) - 1):
        length = cu[seq + 1] - cu[seq]
        if length:
            assert 1 + len(checkpoints[seq]) == -(-length // RUN)


@pytest.mark.parametrize("with_h0", [False, True])
def test_the_states_recurrence_takes_no_host_map(with_h0: bool) -> None:
    # `KDAKernel._run_states` launches bwd_states with ck_tiles 2 (slots from the offsets, the entering
    # state stored by the stage) and a one-element placeholder where checkpoint_indices would go.
    from kdagen import workspace
    from kdagen.plan import make_plan
    from kdagen.runtime import KDAKernel
    from kdagen.spec import KernelSpec

    calls: list[tuple] = []
    spec = KernelSpec(arch="sm_90a")
    plan = make_plan(spec)
    stages = {n: (lambda *a: calls.append(a)) if n == "bwd_states" else (lambda *a: None)
              for n in plan.stage_names}
    kern = KDAKernel(spec, plan, stages)
    total, hv, nseq = 200, 2, 3
    ws = workspace.layout(total, hv, nseq, 128, 2)
    buf = torch.empty((ws.size,), dtype=torch.uint8)
    kd = torch.empty(total, hv, 128, dtype=torch.bfloat16)
    cu = torch.tensor([0, 64, 64, 200], dtype=torch.int32)
    h0 = torch.zeros(nseq, hv, 128, 128) if with_h0 else None
    states = torch.empty(workspace.tile_slots(total, nseq, kern.bwd_state_tiles), hv, 128, 128,
                         dtype=torch.bfloat16)
    kern._run_states(kd, kd, kd, kd[..., :16], torch.empty(1), kd, cu, ws, buf, h0, states, kd)
    (args,) = calls
    ck, ts, has_h0, every, to_tiles = args[14], args[15], args[16], args[19], args[20]
    assert to_tiles == 2 and every == kern.bwd_state_tiles == RUN // 16
    assert ck.shape == (1, 1) and ck.item() == -1  # unread with ck_tiles 2
    assert ts is states and has_h0 == int(with_h0)
    assert (args[9] is h0) if with_h0 else args[9].shape[0] == 1  # the initial states, or the unused slot
