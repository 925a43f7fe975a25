"""The planner: every structural and tuning choice for a variant, made once, before rendering.

Templates only express what the plan says; the runtime only launches the stages the plan lists.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kdagen.spec import KernelSpec

# The DSL numeric type names the templates use for each spec dtype.
_DSL_DTYPE = {"bf16": "BFloat16", "fp16": "Float16", "fp32": "Float32"}

# Tokens per recurrence step. 16 keeps the chunk-start anchor 2^-b inside the fp32/bf16 exponent range
# under the safe-gate promise (fast-kda.md §B.2), and makes every intra-step product one m16n8k16 tile row.
CHUNK = 16
# Value rows per recurrence CTA: four warps of 16 rows each. At V=128 this splits every (sequence, head)
# in two CTAs, which doubles the parallelism of the serial chain (the V-split of fast-kda.md §C.2).
BLOCK_V = 64


@dataclass(frozen=True)
class StagePlan:
    name: str  # also the rendered file name (<name>.py) and the cache artifact name (<name>.o)
    template: str  # path under templates/
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Plan:
    family: str
    reason: str
    stages: tuple[StagePlan, ...]

    @property
    def stage_names(self) -> list[str]:
        return [s.name for s in self.stages]


def _choose_family(spec: KernelSpec) -> tuple[str, str]:
    if spec.family != "auto":
        return spec.family, f"requested in the spec ({spec.family})"
    return "mma_sync", f"portable warp-MMA family: the only family implemented for {spec.arch} so far"


def _common_params(spec: KernelSpec) -> dict[str, Any]:
    return {
        "head_dim_k": spec.head_dim_k,
        "head_dim_v": spec.head_dim_v,
        "chunk": CHUNK,
        "gva_ratio": spec.gva_ratio,
        "dtype": _DSL_DTYPE[spec.dtype],
    }


def make_plan(spec: KernelSpec) -> Plan:
    family, reason = _choose_family(spec)
    common = _common_params(spec)
    prepare = StagePlan(
        name="prepare",
        template=f"{family}/prepare.py.j2",
        params={
            **common,
            "gate": spec.gate,
            "lower_bound": spec.lower_bound,
            "safe_gate": spec.safe_gate,
            "l2norm_qk": spec.l2norm_qk,
            "g_dtype": _DSL_DTYPE[spec.g_dtype],
            "beta_dtype": _DSL_DTYPE[spec.beta_dtype],
        },
    )
    block_v = min(BLOCK_V, spec.head_dim_v)
    recurrence = StagePlan(
        name="recurrence",
        template=f"{family}/recurrence.py.j2",
        params={
            **common,
            "block_v": block_v,
            # Two stages hide one step's loads behind the previous step's math; each stage is ~15 KB at K=128.
            "stages": 2,
            "state_layout": spec.state_layout,
        },
    )
    return Plan(family=family, reason=reason, stages=(prepare, recurrence))
