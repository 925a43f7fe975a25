"""The gate of one key and the beta of one token, as scalars (kda-math.md §1.1, §2.1). The decode step applies
the gate per token, where the prepare tile's fragment form (`kdagen.kernels.prepare_tile`) works on whole
16-token tiles in log2 units; beta's transform (`beta_value`) is applied where each kernel loads beta."""

import cutlass
import cutlass.cute as cute

__all__ = ["LOG2E", "log_decay", "decay", "beta_value"]

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


@cute.jit
def beta_value(x, mode: cutlass.Constexpr):
    """beta from its input `x` (fp32, as loaded) by the spec's `beta` mode: x itself (prob), sigmoid(x)
    (logit) or 2 sigmoid(x) (logit_x2, eigenvalues of I - beta k k^T in (-1, 1)). A kernel applies it to
    loaded values only: rows past a sequence's end keep beta = 0, which no sigmoid would give."""
    b = x
    if cutlass.const_expr(mode == "logit"):
        b = 1.0 / (1.0 + cute.math.exp(-x))
    elif cutlass.const_expr(mode == "logit_x2"):
        b = 2.0 / (1.0 + cute.math.exp(-x))
    return b
