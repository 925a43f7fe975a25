"""Shared helpers for the GPU tests: the spec matrix, the input cases, and the kernel/reference runners.

The matrix is a covering design, not a full product: each distinct spec is a separately compiled binary, so
the spec axes (gate mode, GVA, head dims, dtypes, l2norm, layout, beta mode, family) are spread over the specs
of `SPECS`, and the runtime axes (T, B, H, varlen, initial/final state, gate extremes) over the cases run
against each spec. Inputs follow the spec's beta mode: probabilities in (0, 1) for ``prob``, logits (randn)
for ``logit`` and ``logit_x2``.

Importing this module does not import kdagen (only ``kdagen.reference``), so collection works anywhere.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any

import torch

from kdagen.dtypes import DTYPES
from kdagen.reference import kda_recurrent_reference, make_inputs

GPU_TOL = 0.005  # relative RMSE for o and the final state, bf16/fp16 kernel vs fp64 reference (kda-math §4.2)
ARCH = "sm_90a"

# Gate presets (kda-math §2.1 and docs/architecture.md validation rules).
P_SAFE = {"gate": "precomputed", "safe_gate": True, "lower_bound": -5.0}  # caller clamps g to [-5, 0]
P_RESET = {"gate": "precomputed", "safe_gate": False, "lower_bound": None}  # unbounded, g = -1000 resets
SOFTPLUS = {"gate": "softplus", "safe_gate": False, "lower_bound": None}
LB_SAFE = {"gate": "lower_bound", "safe_gate": True, "lower_bound": -5.0}
LB = {"gate": "lower_bound", "safe_gate": False, "lower_bound": -5.0}


def make_spec(gate: dict[str, Any], **fields: Any) -> dict[str, Any]:
    """A KernelSpec dict: sm_90a, K=V=128, GVA 1, bf16, fp32 g/beta, l2norm, kv layout, beta given as a
    probability (the spec's default), unless overridden."""
    spec: dict[str, Any] = {
        "arch": ARCH,
        "head_dim_k": 128,
        "head_dim_v": 128,
        "gva_ratio": 1,
        "l2norm_qk": True,
        "dtype": "bf16",
        "g_dtype": "fp32",
        "beta_dtype": "fp32",
        "state_layout": "kv",
    }
    spec.update(gate)
    spec.update(fields)
    return spec


# fmt: off
SPECS: dict[str, dict[str, Any]] = {
    "lb_safe": make_spec(LB_SAFE),
    "lb_safe_gbf16": make_spec(LB_SAFE, g_dtype="bf16"),  # the benchmark's headline spec
    "p_safe": make_spec(P_SAFE, l2norm_qk=False),
    "p_reset_vk_bbf16": make_spec(P_RESET, l2norm_qk=False, beta_dtype="bf16", state_layout="vk"),
    "p_reset_gva4_l2": make_spec(P_RESET, gva_ratio=4),
    "softplus": make_spec(SOFTPLUS),
    "lb_vk_bbf16": make_spec(LB, beta_dtype="bf16", state_layout="vk"),
    "lb_safe_gva2_vk_bbf16": make_spec(LB_SAFE, gva_ratio=2, beta_dtype="bf16", state_layout="vk"),
    "lb_safe_gva4_k64v64": make_spec(LB_SAFE, gva_ratio=4, head_dim_k=64, head_dim_v=64),
    "p_reset_gva2_k64v128": make_spec(P_RESET, gva_ratio=2, head_dim_k=64, l2norm_qk=False),
    "softplus_gva4_k128v64_gbf16_bbf16": make_spec(SOFTPLUS, gva_ratio=4, head_dim_v=64, g_dtype="bf16",
                                                   beta_dtype="bf16"),
    "p_safe_fp16_k64v64": make_spec(P_SAFE, dtype="fp16", head_dim_k=64, head_dim_v=64, l2norm_qk=False),
    "lb_safe_fp16_gva2_vk_bbf16": make_spec(LB_SAFE, dtype="fp16", gva_ratio=2, beta_dtype="bf16",
                                            state_layout="vk"),
    "lb_safe_k64v128_nol2_bbf16": make_spec(LB_SAFE, head_dim_k=64, l2norm_qk=False, beta_dtype="bf16"),
    "lb_safe_k128v64_vk": make_spec(LB_SAFE, head_dim_v=64, state_layout="vk"),
    "p_safe_gva4_l2_vk": make_spec(P_SAFE, gva_ratio=4, state_layout="vk"),
    "lb_gva2_k64v64_fp16_gbf16": make_spec(LB, gva_ratio=2, head_dim_k=64, head_dim_v=64, dtype="fp16",
                                           g_dtype="bf16"),
    # V=128 safe-gate specs also get the fused kernel's CTA-pair form (kdagen.plan: four prepare warps a CTA
    # with a bf16 g, three with fp32); these three cover it beside lb_safe and lb_safe_gbf16
    # (tests/gpu/test_numerics.py, test_fused_pair_form).
    "lb_safe_gva2_vk_bbf16_gbf16": make_spec(LB_SAFE, gva_ratio=2, beta_dtype="bf16", state_layout="vk",
                                             g_dtype="bf16"),
    "lb_safe_k64v128_nol2_bbf16_gbf16": make_spec(LB_SAFE, head_dim_k=64, l2norm_qk=False, beta_dtype="bf16",
                                                  g_dtype="bf16"),
    "p_safe_gva4_l2_vk_gbf16": make_spec(P_SAFE, gva_ratio=4, state_layout="vk", g_dtype="bf16"),
    # beta as logits (sigmoid in the kernel) and doubled (2 sigmoid, FLA's allow_neg_eigval), in each family:
    # wgmma (the stand-alone prepare and the fused kernel, which load beta each in their own code) and
    # mma_sync (prepare with the safe gate and with the anchored tile of the softplus gate).
    "lb_safe_logit": make_spec(LB_SAFE, beta="logit"),
    "lb_safe_gva2_vk_bbf16_logit_x2": make_spec(LB_SAFE, gva_ratio=2, state_layout="vk", beta_dtype="bf16",
                                                beta="logit_x2"),
    "lb_safe_mma_sync_logit_x2": make_spec(LB_SAFE, family="mma_sync", beta="logit_x2"),
    "softplus_mma_sync_bbf16_logit": make_spec(SOFTPLUS, family="mma_sync", beta_dtype="bf16", beta="logit"),
    # a bf16 state (initial and final states, pools; fp32 arithmetic), in each family
    "lb_safe_sbf16": make_spec(LB_SAFE, state_dtype="bf16"),
    "lb_safe_mma_sync_vk_sbf16": make_spec(LB_SAFE, family="mma_sync", state_layout="vk", state_dtype="bf16"),
}
# fmt: on


@dataclass(frozen=True)
class Case:
    """Runtime arguments of one call: fixed length (B, T) or packed varlen (cu), H q/k heads."""

    H: int = 1
    B: int = 1
    T: int = 0  # ignored with cu (T = cu[-1])
    cu: tuple[int, ...] | None = None
    init: bool = False  # pass an initial state
    final: bool = True  # ask for the final state
    mask_p: float = 0.0  # fraction of masked gate elements (no decay, or a reset with hard_reset)
    hard_reset: bool = False
    gln: float = 1.0  # gate_logit_normalizer (precomputed gates): 0.1 = 10x stronger decay, 10 = weaker
    no_a_log: bool = False  # lower_bound gate called with A_log=None
    seed: int = 0

    @property
    def total(self) -> int:
        return self.cu[-1] if self.cu is not None else self.T

    @property
    def id(self) -> str:
        shape = f"B{self.B}-T{self.T}" if self.cu is None else "cu" + "_".join(map(str, self.cu))
        bits = [shape, f"H{self.H}", "h0" if self.init else "", "" if self.final else "noht"]
        if self.mask_p:
            bits.append(f"{'reset' if self.hard_reset else 'mask'}{self.mask_p:g}")
        bits += [f"gln{self.gln:g}" if self.gln != 1.0 else "", "noAlog" if self.no_a_log else ""]
        return "-".join(b for b in bits if b)


def F(B: int, T: int, H: int, **kw: Any) -> Case:  # noqa: N802 - short constructor for the table below
    return Case(H=H, B=B, T=T, **kw)


def VL(cu: tuple[int, ...], H: int, **kw: Any) -> Case:  # noqa: N802
    return Case(H=H, cu=cu, **kw)


CU_1 = (0, 1)
CU_15 = (0, 15)
CU_EDGE = (0, 1, 64, 65, 130)  # length-1 sequences around chunk boundaries
CU_3 = (0, 256, 500, 1000)
CU_5 = (0, 15, 100, 300, 1200, 2000)

# fmt: off
CASES: dict[str, tuple[Case, ...]] = {
    "lb_safe": (
        F(1, 1, 1, init=True), F(2, 63, 2), F(1, 65, 4, init=True, final=False), F(2, 500, 2, init=True),
        F(1, 1000, 2), F(2, 1500, 1, init=True),
        VL(CU_1, 2, init=True), VL(CU_15, 4), VL(CU_EDGE, 2, init=True), VL(CU_3, 4, init=True, final=False),
        VL(CU_5, 2, init=True), VL((0, 15, 100, 300), 1, no_a_log=True),
    ),
    "lb_safe_gbf16": (VL(CU_3, 4, init=True), F(2, 1000, 2)),
    "p_safe": (
        F(1, 63, 2, init=True, mask_p=0.5, gln=0.1), F(2, 500, 1, gln=10.0),
        VL(CU_EDGE, 2, init=True, mask_p=0.5),
    ),
    "p_reset_vk_bbf16": (
        F(2, 65, 2, init=True, mask_p=0.5, hard_reset=True),
        VL(CU_5, 2, init=True, mask_p=0.1, hard_reset=True),
        F(1, 1000, 4, final=False, mask_p=0.5, hard_reset=True, gln=0.1),
    ),
    "p_reset_gva4_l2": (
        F(1, 500, 2, init=True, mask_p=0.5, hard_reset=True),
        VL(CU_EDGE, 1, init=True, mask_p=0.3, hard_reset=True),
    ),
    "softplus": (
        F(2, 63, 2, init=True), VL(CU_3, 2, init=True, mask_p=0.1, hard_reset=True), F(1, 1500, 2),
    ),
    "lb_vk_bbf16": (F(1, 500, 2, init=True, mask_p=0.2, hard_reset=True), VL(CU_EDGE, 4, init=True)),
    "lb_safe_gva2_vk_bbf16": (F(2, 65, 2, init=True), VL(CU_5, 2, init=True), VL(CU_1, 1)),
    "lb_safe_gva4_k64v64": (F(1, 1, 1), F(2, 500, 2, init=True), VL(CU_3, 1, init=True)),
    "p_reset_gva2_k64v128": (
        F(2, 63, 2, init=True, mask_p=0.3, hard_reset=True),
        VL(CU_EDGE, 2, init=True, mask_p=0.3, hard_reset=True),
    ),
    "softplus_gva4_k128v64_gbf16_bbf16": (
        F(1, 65, 1, init=True), VL(CU_15, 2), VL(CU_3, 1, init=True, mask_p=0.1, hard_reset=True),
    ),
    "p_safe_fp16_k64v64": (F(2, 1000, 2, init=True, mask_p=0.5), VL(CU_5, 2, init=True)),
    "lb_safe_fp16_gva2_vk_bbf16": (F(1, 63, 2, init=True), VL(CU_EDGE, 2, init=True)),
    "lb_safe_k64v128_nol2_bbf16": (F(2, 65, 2, init=True), VL(CU_3, 2, init=True)),
    "lb_safe_k128v64_vk": (F(1, 500, 2, init=True), VL(CU_5, 1, init=True)),
    "p_safe_gva4_l2_vk": (F(2, 63, 1, init=True, gln=0.1), VL(CU_3, 1, init=True)),
    "lb_gva2_k64v64_fp16_gbf16": (F(1, 1500, 2, init=True), VL(CU_1, 2)),
    "lb_safe_logit": (F(1, 1, 1, init=True), F(2, 500, 2, init=True), VL(CU_EDGE, 2, init=True)),
    "lb_safe_gva2_vk_bbf16_logit_x2": (F(1, 65, 2, init=True), VL(CU_5, 2, init=True)),
    "lb_safe_mma_sync_logit_x2": (F(2, 63, 2, init=True), VL(CU_3, 2, init=True)),
    "softplus_mma_sync_bbf16_logit": (
        F(1, 500, 2, init=True), VL(CU_EDGE, 2, init=True, mask_p=0.1, hard_reset=True),
    ),
    # the last one long enough at one head for intra-card CP (the merge reads h0, the last segment writes ht)
    "lb_safe_sbf16": (F(2, 500, 2, init=True), VL(CU_EDGE, 2, init=True), F(1, 8192, 1, init=True)),
    "lb_safe_mma_sync_vk_sbf16": (F(2, 63, 2, init=True), VL(CU_5, 2, init=True), F(1, 8192, 1, init=True)),
}
# fmt: on

MATRIX: tuple[tuple[str, Case], ...] = tuple((name, c) for name, cases in CASES.items() for c in cases)


@functools.cache
def kernel_for(spec_name: str) -> Any:
    """The kdagen kernel of one spec, built (or loaded from the cache) once per test session."""
    import kdagen  # lazy: collection must not need kdagen's build dependencies

    return kdagen.get_kernel(dict(SPECS[spec_name]))


def build_inputs(spec: dict[str, Any], case: Case, device: str = "cuda") -> dict[str, Any]:
    """Inputs for ``case`` under ``spec``, from kdagen.reference.make_inputs (deterministic in case.seed)."""
    inp = make_inputs(
        case.B, case.total, case.H, case.H * spec["gva_ratio"], spec["head_dim_k"], spec["head_dim_v"],
        dtype=spec["dtype"], beta_dtype=spec["beta_dtype"], g_dtype=spec["g_dtype"], gate=spec["gate"],
        safe_gate=spec["safe_gate"], lower_bound=spec["lower_bound"], seed=case.seed, device=device,
        mask_p=case.mask_p, hard_reset=case.hard_reset, gate_logit_normalizer=case.gln,
        l2norm_qk=spec["l2norm_qk"], cu_seqlens=case.cu, with_initial_state=case.init,
        state_layout=spec["state_layout"], beta_mode=spec.get("beta", "prob"),
    )
    if case.no_a_log:
        inp["A_log"] = None
    if state_dtype(spec) != torch.float32 and inp["initial_state"] is not None:
        # the reference reads the same values
        inp["initial_state"] = inp["initial_state"].to(state_dtype(spec))
    return inp


def run_kernel(kernel: Any, inp: dict[str, Any], final: bool, scale: float | None = None) -> tuple[Any, Any]:
    return kernel(
        inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], scale=scale, A_log=inp["A_log"],
        dt_bias=inp["dt_bias"], initial_state=inp["initial_state"], output_final_state=final,
        cu_seqlens=inp["cu_seqlens"],
    )


def run_reference(
    spec: dict[str, Any], inp: dict[str, Any], final: bool = True, scale: float | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The fp64 token recurrence on the inputs' device."""
    return kda_recurrent_reference(
        **inp, scale=scale, output_final_state=final, gate=spec["gate"], lower_bound=spec["lower_bound"],
        l2norm_qk=spec["l2norm_qk"], state_layout=spec["state_layout"], beta_mode=spec.get("beta", "prob"),
    )


def with_seed(case: Case, seed: int) -> Case:
    return replace(case, seed=seed)


def copy_into(static: dict[str, Any], fresh: dict[str, Any]) -> None:
    """Copy new values into captured tensors (CUDA graph replay), keeping their storage."""
    for name, t in static.items():
        if t is not None:
            t.copy_(fresh[name])


# Row-strided inputs: the tokens' q, k, v, g, beta as slices of packed projections, as engines give them.
PAD = 24  # extra columns of each projection (a multiple of 8: 16-byte token strides in bf16 and fp32)
SENTINEL = 7.0


def packed_projections(inp: dict[str, Any], shift: int = 0) -> dict[str, Any]:
    """q, k, v as column slices of one [B, T, 3 H K + PAD (+ shift)] projection (q starting `shift` columns
    in), g and beta of one [B, T, HV K + 16 + PAD] gate projection in g's dtype where beta's dtype is g's
    (beta in the 16 columns after g's), else beta of its own [B, T, HV + PAD]."""
    q, k, v, g, beta = (inp[n] for n in ("q", "k", "v", "g", "beta"))
    b, t = q.shape[:2]
    wq, wv = q.shape[2] * q.shape[3], v.shape[2] * v.shape[3]
    qkv = torch.full((b, t, 2 * wq + wv + PAD + shift), SENTINEL, dtype=q.dtype, device=q.device)
    out: dict[str, Any] = {}
    for name, x, start in (("q", q, shift), ("k", k, shift + wq), ("v", v, shift + 2 * wq)):
        view = qkv[..., start:start + x.shape[2] * x.shape[3]].view(x.shape)
        view.copy_(x)
        out[name] = view
    wg, hv = g.shape[2] * g.shape[3], g.shape[2]
    same = beta.dtype == g.dtype
    gate = torch.full((b, t, wg + 16 + PAD), SENTINEL, dtype=g.dtype, device=g.device)
    out["g"] = gate[..., :wg].view(g.shape)
    out["g"].copy_(g)
    if same:
        out["beta"] = gate[..., wg:wg + hv]
    else:
        out["beta"] = torch.full((b, t, hv + PAD), SENTINEL, dtype=beta.dtype, device=beta.device)[..., :hv]
    out["beta"].copy_(beta)
    out["buffers"] = (qkv, gate)
    return out


def state_dtype(spec: dict[str, Any]) -> torch.dtype:
    """The torch dtype of the spec's state (a pool's, a kernel's initial and final states)."""
    return getattr(torch, DTYPES[spec.get("state_dtype", "fp32")].torch)


def decode_pool(spec: dict[str, Any], slots: int, hv: int, interleave: int = 1) -> torch.Tensor:
    """A random state pool in the spec's layout and state dtype whose slots are `interleave` slot sizes apart
    (as when layers share one allocation)."""
    k, v = spec["head_dim_k"], spec["head_dim_v"]
    inner = (hv, k, v) if spec["state_layout"] == "kv" else (hv, v, k)
    base = torch.randn(slots, interleave, *inner, device="cuda", dtype=state_dtype(spec))
    return base[:, 0]
