"""Building blocks of the streaming decode step (templates/common/decode_stream.py.j2): a persistent CTA takes
its (request, value head) items one after another, while two warps fill rings in shared memory ahead of it,
one with the items' states (bulk copies from the pool) and one with their tokens' inputs, ready to use.

A token's ring row holds, in fp32: q scaled (and l2-normalised), k (l2-normalised), the per-key decays
exp(g), v, and beta as the spec gives it transformed (`row_words` words, see `DecodeConfig`). Each value
column is two consumer threads, each holding half of the column's K state values in registers
(`column_token`); the token recurrence is kda-math.md §2.0's.
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute

from kdagen.kernels.decode_rows import key_vector_words, row_words
from kdagen.kernels.gate import beta_value, decay, log_decay

__all__ = [
    "DecodeConfig", "key_at", "stage_token_warp", "column_token", "rows_token", "warp_sum", "partial_sum",
]


@dataclass(frozen=True)
class DecodeConfig:
    """What shapes a decode token's code: head dims, the gate, beta's mode, l2norm, the dot products' ILP."""

    k: int  # key head dim
    v: int  # value head dim
    gate: str  # "precomputed", "softplus" or "lower_bound"
    lower_bound: float | None
    l2norm: bool
    beta: str  # how beta is given: "prob", "logit" or "logit_x2"
    partial_sums: int  # independent partial sums of each dot product over a thread's keys

    # Two threads a value column, each with half of its keys (adjacent lanes 16 apart): twice the warps to
    # hide shared-memory latency, half the state registers a thread. The second half of each key vector in
    # a row starts 4 words later, so that the halves' same-time reads fall in different banks.
    @property
    def half(self) -> int:
        return self.k // 2

    @property
    def vec(self) -> int:
        # words of one key vector in a row (q, k or the decays)
        return key_vector_words(self.k)

    @property
    def row_words(self) -> int:
        # q, k, decays, v (V), beta, padded to 16 bytes
        return row_words(self.k, self.v)

    @property
    def v_at(self) -> int:
        return 3 * self.vec

    @property
    def beta_at(self) -> int:
        return 3 * self.vec + self.v


def key_at(cfg: DecodeConfig, e):
    """Word of key e within a key vector of a row (trace-time for a constant e)."""
    return e + 4 * (e // cfg.half)


def partial_sum(parts: list) -> cutlass.Float32:
    """The partial sums added pairwise (trace-time: the list holds `partial_sums` values)."""
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] for i in range(0, len(parts), 2)]
    return parts[0]


@cute.jit
def warp_sum(x: cutlass.Float32, lanes: cutlass.Constexpr = 32) -> cutlass.Float32:
    """`x` summed over each group of `lanes` adjacent lanes (a power of 2; 32: the warp), in every lane of
    the group (butterflies)."""
    for off in cutlass.range_constexpr(lanes.bit_length() - 1):
        x = x + cute.arch.shuffle_sync_bfly(x, offset=1 << off)
    return x


@cute.jit
def stage_token_warp(
    mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mG: cute.Tensor, mBeta: cute.Tensor, mDtBias,
    t: cutlass.Int32, h: cutlass.Int32, hv: cutlass.Int32, lane: cutlass.Int32, a_scale: cutlass.Float32,
    scale: cutlass.Float32, sRow: cute.Tensor, free, free_parity: cutlass.Int32, cfg: cutlass.Constexpr,
):
    """One warp stages token t of (q/k head h, value head hv) into the ring row `sRow`: K / 32 keys and
    V / 32 values a lane. The global reads and the arithmetic come first; the warp then waits for the row
    to be free (mbarrier `free`, phase parity `free_parity`) and writes it. `mDtBias` is None for the
    precomputed gate."""
    kp = cfg.k // 32
    vp = cfg.v // 32
    rq = cute.make_rmem_tensor(cute.make_layout((kp,)), cutlass.Float32)
    rk = cute.make_rmem_tensor(cute.make_layout((kp,)), cutlass.Float32)
    rd = cute.make_rmem_tensor(cute.make_layout((kp,)), cutlass.Float32)
    rv = cute.make_rmem_tensor(cute.make_layout((vp,)), cutlass.Float32)
    ssq_q = cutlass.Float32(0.0)
    ssq_k = cutlass.Float32(0.0)
    for r in cutlass.range_constexpr(kp):
        e = lane + 32 * r
        qe = mQ[t, h, e].to(cutlass.Float32)
        ke = mK[t, h, e].to(cutlass.Float32)
        ssq_q = ssq_q + qe * qe
        ssq_k = ssq_k + ke * ke
        rq[r] = qe
        rk[r] = ke
        dt = cutlass.Float32(0.0)
        if cutlass.const_expr(cfg.gate != "precomputed"):
            dt = mDtBias[hv, e]
        rd[r] = decay(log_decay(mG[t, hv, e].to(cutlass.Float32), dt, a_scale, cfg.gate, cfg.lower_bound))
    for r in cutlass.range_constexpr(vp):
        rv[r] = mV[t, hv, lane + 32 * r].to(cutlass.Float32)
    b = beta_value(mBeta[t, hv].to(cutlass.Float32), cfg.beta)
    sq = scale
    sk = cutlass.Float32(1.0)
    if cutlass.const_expr(cfg.l2norm):
        sq = cute.math.rsqrt(warp_sum(ssq_q) + 1e-6) * scale
        sk = cute.math.rsqrt(warp_sum(ssq_k) + 1e-6)
    cute.arch.mbarrier_wait(free, free_parity)
    for r in cutlass.range_constexpr(kp):
        # lanes stage keys lane + 32 r: each r lies in one half (K / 2 is a multiple of 32)
        at = lane + key_at(cfg, 32 * r)
        sRow[at] = rq[r] * sq
        sRow[cfg.vec + at] = rk[r] * sk
        sRow[2 * cfg.vec + at] = rd[r]
    for r in cutlass.range_constexpr(vp):
        sRow[cfg.v_at + lane + 32 * r] = rv[r]
    if lane == 0:
        sRow[cfg.beta_at] = b


@cute.jit
def column_token(
    rS: cute.Tensor, sRow: cute.Tensor, j: cutlass.Int32, part: cutlass.Int32, cfg: cutlass.Constexpr
) -> cutlass.Float32:
    """One token on value column j, of whose state the thread holds keys part * K / 2 .. + K / 2 (`rS`, fp32)
    and its partner lane (16 away) the other half: S <- Diag(exp(g)) S, u = beta (v_j - k^T S),
    S <- S + k u; returns o_j = q^T S (both partners). Every thread of a half reads the row's q, k and decays
    at the same addresses (broadcasts)."""
    base = part * (cfg.half + 4)
    dots = [cutlass.Float32(0.0)] * cfg.partial_sums
    for i in cutlass.range_constexpr(cfg.half):
        rS[i] = rS[i] * sRow[2 * cfg.vec + base + i]
        dots[i % cfg.partial_sums] = dots[i % cfg.partial_sums] + sRow[cfg.vec + base + i] * rS[i]
    dot = partial_sum(dots)
    dot = dot + cute.arch.shuffle_sync_bfly(dot, offset=16)
    u = sRow[cfg.beta_at] * (sRow[cfg.v_at + j] - dot)
    accs = [cutlass.Float32(0.0)] * cfg.partial_sums
    for i in cutlass.range_constexpr(cfg.half):
        rS[i] = rS[i] + sRow[cfg.vec + base + i] * u
        accs[i % cfg.partial_sums] = accs[i % cfg.partial_sums] + sRow[base + i] * rS[i]
    acc = partial_sum(accs)
    return acc + cute.arch.shuffle_sync_bfly(acc, offset=16)


@cute.jit
def rows_token(
    rS: cute.Tensor, sRow: cute.Tensor, j0: cutlass.Int32, lane: cutlass.Int32, rows: cutlass.Constexpr,
    cfg: cutlass.Constexpr,
) -> cutlass.Float32:
    """One token on the V-first state rows j0 .. j0 + rows of a warp (a row is a value column's K keys,
    contiguous in the pool): lane l holds keys l * K / 32 .. of every row (`rS`, row-major), so that its
    shared-memory reads of the row ring and of the state are contiguous across the warp. Per row:
    S <- Diag(exp(g)) S, u = beta (v - k^T S) (the dot product summed over the warp), S <- S + k u,
    o = q^T S. Returns o of row j0 + l in lanes l < rows."""
    kl = cfg.k // 32
    e0 = key_at(cfg, lane * kl)  # a lane's keys lie in one half
    q = [sRow[e0 + c] for c in range(kl)]
    k = [sRow[cfg.vec + e0 + c] for c in range(kl)]
    d = [sRow[2 * cfg.vec + e0 + c] for c in range(kl)]
    b = sRow[cfg.beta_at]
    dots = []
    for r in cutlass.range_constexpr(rows):
        acc = cutlass.Float32(0.0)
        for c in cutlass.range_constexpr(kl):
            rS[r * kl + c] = rS[r * kl + c] * d[c]
            acc = acc + k[c] * rS[r * kl + c]
        dots.append(acc)
    dots = [warp_sum(x) for x in dots]
    out = cutlass.Float32(0.0)
    for r in cutlass.range_constexpr(rows):
        u = b * (sRow[cfg.v_at + j0 + r] - dots[r])
        acc = cutlass.Float32(0.0)
        for c in cutlass.range_constexpr(kl):
            rS[r * kl + c] = rS[r * kl + c] + k[c] * u
            acc = acc + q[c] * rS[r * kl + c]
        acc = warp_sum(acc)
        out = cutlass.select_(lane == r, acc, out)
    return out
