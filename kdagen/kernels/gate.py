"""The gate of one key and the beta of one token, as scalars (kda-math.md §1.1, §2.1). The decode step applies
the gate per token, where the prepare tile's fragment form (`kdagen.kernels.prepare_tile`) works on whole
16-token tiles in log2 units; beta's transform (`beta_value`) is applied where each kernel loads beta."""

import cutlass
import cutlass.cute as cute

__all__ = ["LOG2E", "log_decay", "decay", "beta_value", "sigmoid", "softplus"]

LOG2E = 1.4426950408889634


@cute.jit
def sigmoid(x, approx: cutlass.Constexpr = False):
    """1 / (1 + e^-x). `approx`: through ex2.approx and rcp.approx (a few ulp; no IEEE division, which
    takes a dozen instructions and a branch), as the prepare stage's gate."""
    if cutlass.const_expr(approx):
        s = cute.arch.rcp_approx(1.0 + cute.math.exp2(-x * LOG2E, approx=True, ftz=True))
    else:
        s = 1.0 / (1.0 + cute.math.exp(-x))
    return s


@cute.jit
def softplus(y, approx: cutlass.Constexpr = False):
    """max(y, 0) + log(1 + e^-|y|): exact in both tails, no overflow. `approx`: e^-|y| by ex2.approx."""
    m = cutlass.max(y, 0.0)
    if cutlass.const_expr(approx):
        e = cute.math.exp2(-cute.math.absf(y) * LOG2E, approx=True, ftz=True)
    else:
        e = cute.math.exp(-cute.math.absf(y))
    return m + cute.math.log(1.0 + e)


@cute.jit
def log_decay(x, dt, a_scale, gate: cutlass.Constexpr, lower_bound: cutlass.Constexpr,
              approx: cutlass.Constexpr = False):
    """g, the natural-log decay of one key, from the gate input `x` (fp32), its dt_bias `dt` and exp(A_log)
    `a_scale`: x itself (precomputed), -a softplus(x + dt) (softplus), or lb sigmoid(a (x + dt))
    (lower_bound). `approx`: the exponentials and the reciprocal by their hardware approximations."""
    g = x
    if cutlass.const_expr(gate == "softplus"):
        g = -a_scale * softplus(x + dt, approx)
    elif cutlass.const_expr(gate == "lower_bound"):
        if cutlass.const_expr(approx):
            g = lower_bound * sigmoid(a_scale * (x + dt), True)
        else:
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
