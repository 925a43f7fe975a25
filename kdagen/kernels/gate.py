"""The gate of one key, as a scalar (kda-math.md §2.1): what the decode step applies per token, where the
prepare tile's fragment form (`kdagen.kernels.prepare_tile`) works on whole 16-token tiles in log2 units."""

import cutlass
import cutlass.cute as cute

__all__ = ["LOG2E", "log_decay", "decay"]

LOG2E = 1.4426950408889634


@cute.jit
def log_decay(x, dt, a_scale, gate: cutlass.Constexpr, lower_bound: cutlass.Constexpr):
    """g, the natural-log decay of one key, from the gate input `x` (fp32), its dt_bias `dt` and exp(A_log)
    `a_scale`: x itself (precomputed), -a softplus(x + dt) (softplus), or lb sigmoid(a (x + dt))
    (lower_bound)."""
    g = x
    if cutlass.const_expr(gate == "softplus"):
        y = x + dt
        # softplus(y) = max(y, 0) + log(1 + e^-|y|): exact in both tails, no overflow
        sp = cutlass.max(y, 0.0) + cute.math.log(1.0 + cute.math.exp(-cute.math.absf(y)))
        g = -a_scale * sp
    elif cutlass.const_expr(gate == "lower_bound"):
        g = lower_bound / (1.0 + cute.math.exp(-a_scale * (x + dt)))
    return g


@cute.jit
def decay(g):
    # exp(g) for g <= 0, flushing to zero below 2^-126 (a decay that small leaves nothing to keep).
    return cute.math.exp2(g * LOG2E, approx=True, ftz=True)
