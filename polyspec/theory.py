"""Exact theory of polybasic speculative decoding (Wang et al., ICML 2025), as small pure functions.

The paper's printed forms have errors; these are derived anew and tested against known answers and Monte Carlo.

Notation (levels top first): M_1 is the target, M_n the draft. T_i is the forward cost of level i, L_i the mean number
of tokens accepted per forward of level i (i < n), beta the number of draft forwards per verification of M_{n-1}.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass


def _check_positive(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


def chain_time_per_token(costs: Sequence[float], accept: Sequence[float], beta: float = 1.0) -> float:
    """Lemma 3.1 divided by N: the expected time per generated token of an n-level chain.

    T/N = sum_{i<n} T_i / L_i + beta * T_n / L_{n-1}

    ``costs`` = [T_1, ..., T_n] (top first), ``accept`` = [L_1, ..., L_{n-1}]. A one-level chain is plain
    autoregressive decoding: T/N = T_1. The draft's T_n may be 0: a drafter without a model (prompt lookup) costs
    nothing the lemma counts.
    """
    n = len(costs)
    if n == 0:
        raise ValueError("a chain needs at least one level")
    if len(accept) != n - 1:
        raise ValueError(f"{n} levels need {n - 1} acceptance lengths, got {len(accept)}")
    for i, t in enumerate(costs[:-1] if n > 1 else costs, 1):
        _check_positive(f"T_{i}", t)
    if n > 1 and not (isinstance(costs[-1], (int, float)) and math.isfinite(costs[-1]) and costs[-1] >= 0):
        raise ValueError(f"T_{n} must be a finite number >= 0, got {costs[-1]!r}")
    for i, a in enumerate(accept, 1):
        _check_positive(f"L_{i}", a)
    if n == 1:
        return float(costs[0])
    _check_positive("beta", beta)
    verify = sum(t / a for t, a in zip(costs[:-1], accept, strict=True))
    return verify + beta * costs[-1] / accept[-1]


@dataclass(frozen=True)
class InsertionVerdict:
    """Whether inserting M_new between M_i and M_{i+1} (the draft, run beta times per verification) pays."""

    cond1_lhs: float  # T_new / T_i
    cond1_rhs: float  # L_new * (1/L_i - 1/L_i_new)
    cond1_holds: bool
    cond2_lhs: float  # T_new / T_{i+1}
    cond2_rhs: float  # beta * (L_new / L_i - 1)
    cond2_holds: bool
    valid_regime: bool  # L_i_new > L_new > L_i: where either condition alone is sufficient
    time_before: float  # Lemma 3.1 per token, chain [M_i, M_{i+1}]
    time_after: float  # Lemma 3.1 per token, chain [M_i, M_new, M_{i+1}]
    pays: bool  # time_after < time_before (exact, whatever the regime)
    speedup: float  # time_before / time_after

    def to_dict(self) -> dict[str, float | bool]:
        return asdict(self)


def insertion(
    t_i: float, t_new: float, t_next: float, l_i: float, l_new: float, l_i_new: float, beta: float = 1.0
) -> InsertionVerdict:
    """Theorem 3.2's two sufficient conditions and the exact Lemma 3.1 difference for one insertion.

    Before: M_i verifies M_{i+1}'s drafts, accepting l_i tokens per forward. After: M_i verifies blocks from M_new,
    accepting l_i_new per forward, and M_new verifies M_{i+1}, accepting l_new per forward.

    time_after - time_before = T_i (1/L_i_new - 1/L_i) + T_new / L_new + beta T_{i+1} (1/L_new - 1/L_i).
    In the regime L_i_new > L_new > L_i the first and last terms are negative, so it is sufficient that T_new / L_new
    is smaller than either one alone: condition 1 (T_new/T_i < L_new (1/L_i - 1/L_i_new)) or condition 2
    (T_new/T_{i+1} < beta (L_new/L_i - 1)). Outside that regime neither is sufficient; ``pays`` is always exact.
    """
    for name, v in (("t_i", t_i), ("t_new", t_new), ("t_next", t_next), ("l_i", l_i), ("l_new", l_new),
                    ("l_i_new", l_i_new), ("beta", beta)):
        _check_positive(name, v)
    c1l, c1r = t_new / t_i, l_new * (1.0 / l_i - 1.0 / l_i_new)
    c2l, c2r = t_new / t_next, beta * (l_new / l_i - 1.0)
    before = chain_time_per_token([t_i, t_next], [l_i], beta)
    after = chain_time_per_token([t_i, t_new, t_next], [l_i_new, l_new], beta)
    return InsertionVerdict(
        cond1_lhs=c1l, cond1_rhs=c1r, cond1_holds=c1l < c1r,
        cond2_lhs=c2l, cond2_rhs=c2r, cond2_holds=c2l < c2r,
        valid_regime=l_i_new > l_new > l_i,
        time_before=before, time_after=after, pays=after < before, speedup=before / after,
    )


def acceptance_length_moments(alpha: float, n: int) -> tuple[float, float]:
    """Exact mean and variance of X = min(G, n), G ~ Geometric(1 - alpha) on {1, 2, ...}.

    P(X = k) = alpha^(k-1) (1 - alpha) for k < n and P(X = n) = alpha^(n-1): each drafted token is accepted with
    probability alpha independently, a block holds at most n tokens, and the first token always counts.
    E[X] = sum_{k=0}^{n-1} alpha^k = (1 - alpha^n) / (1 - alpha);
    E[X^2] = sum_{k=1}^{n} (2k - 1) P(X >= k) = sum_{j=0}^{n-1} (2j + 1) alpha^j = 2 S + E[X],
    with S = sum_{j=0}^{n-1} j alpha^j = alpha (1 - n alpha^(n-1) + (n-1) alpha^n) / (1 - alpha)^2.
    Var[X] = E[X^2] - E[X]^2 (>= 0, and 0 at alpha in {0, 1} or n = 1). (Theorem 3.3's printed variance is wrong:
    it goes negative, e.g. at alpha = 0.5, n = 2.)
    """
    if not (0.0 <= alpha <= 1.0):
        raise ValueError(f"alpha must lie in [0, 1], got {alpha!r}")
    if int(n) != n or n < 1:
        raise ValueError(f"n must be an integer >= 1, got {n!r}")
    n = int(n)
    if alpha == 1.0:
        return float(n), 0.0
    mean = (1.0 - alpha**n) / (1.0 - alpha)
    s = alpha * (1.0 - n * alpha ** (n - 1) + (n - 1) * alpha**n) / (1.0 - alpha) ** 2
    var = 2.0 * s + mean - mean * mean
    return mean, max(var, 0.0)
