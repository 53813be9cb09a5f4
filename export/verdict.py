"""Verdicts from measured T and L with :mod:`polyspec.theory` (pure functions, no torch).

* :func:`insertion_verdict`: Theorem 3.2's two conditions and the exact Lemma 3.1 difference for inserting a level
  (the int4 copy) between the target and the draft head.
* :func:`choose_config`: the configuration (mode, draft_k, mu) with the smallest predicted time per token.
* :func:`fit_alpha` / :func:`variance_check`: the measured acceptance-length variance against the exact one of
  X = min(G, n) (Theorem 3.3, corrected) with alpha fitted from the measured mean through the exact mean formula.
* :func:`speedup_summary`: predicted vs measured speedups and their relative error.
"""

from __future__ import annotations

import math
from typing import Any

from polyspec.errors import PolyspecError
from polyspec.theory import acceptance_length_moments, insertion


def fit_alpha(mean: float, n: int, tol: float = 1e-12) -> float:
    """The alpha in [0, 1] whose exact E[min(G, n)] = (1 - alpha^n) / (1 - alpha) equals ``mean`` (bisection: the
    mean increases strictly from 1 at alpha = 0 to n at alpha = 1). Means outside [1, n] are clamped."""
    if int(n) != n or n < 1:
        raise PolyspecError(f"the block limit n must be an integer >= 1, got {n!r}")
    if not math.isfinite(mean):
        raise PolyspecError(f"cannot fit alpha to a mean of {mean!r}")
    if n == 1 or mean <= 1.0:
        return 0.0
    if mean >= n:
        return 1.0
    lo, hi = 0.0, 1.0
    while hi - lo > tol:
        mid = (lo + hi) / 2
        if acceptance_length_moments(mid, int(n))[0] < mean:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def lengths_from_hist(hist: dict[str, int]) -> list[int]:
    """{"3": 2, "1": 1} -> [1, 3, 3]."""
    out: list[int] = []
    for k in sorted(hist, key=int):
        out += [int(k)] * int(hist[k])
    return out


def variance_check(lengths: list[int], n: int, *, approximate: bool = False) -> dict[str, Any]:
    """Measured mean/variance of acceptance lengths vs the exact variance of min(G, n) at the fitted alpha.

    ``approximate`` marks a check where blocks did not all have the same limit (the chain's target verifies blocks
    of >= mu tokens; n is then their typical limit)."""
    if not lengths:
        return {"n": n, "count": 0, "approximate": approximate}
    m = sum(lengths) / len(lengths)
    var = sum((x - m) ** 2 for x in lengths) / len(lengths)
    alpha = fit_alpha(m, n)
    mean_th, var_th = acceptance_length_moments(alpha, n)
    return {"n": int(n), "count": len(lengths), "mean": m, "var_measured": var, "alpha": alpha,
            "mean_theory": mean_th, "var_theory": var_th, "var_ratio": (var / var_th) if var_th > 0 else None,
            "approximate": approximate}


def insertion_verdict(t_i: float, t_new: float, t_next: float, l_i: float, l_new: float, l_i_new: float,
                      beta: float, **context: Any) -> dict[str, Any]:
    """theory.insertion with its inputs kept next to its outputs (plus any ``context`` such as draft_k, mu)."""
    v = insertion(t_i, t_new, t_next, l_i, l_new, l_i_new, beta).to_dict()
    return {**context, "inputs": {"T_i": t_i, "T_new": t_new, "T_next": t_next, "L_i": l_i, "L_new": l_new,
                                  "L_i_new": l_i_new, "beta": beta}, **v}


def choose_config(rows: list[dict[str, Any]], modes: tuple[str, ...] = ("chain", "dual")) -> dict[str, Any]:
    """The row (``{"mode", "draft_k", "mu", "predicted_time_per_token_s", ...}``) with the smallest predicted time
    among ``modes``; ties go to the earlier row."""
    cands = [r for r in rows if r["mode"] in modes and r.get("predicted_time_per_token_s") is not None]
    if not cands:
        raise PolyspecError(f"no measured configuration of mode {'/'.join(modes)} to choose from")
    return min(cands, key=lambda r: r["predicted_time_per_token_s"])


def speedup_summary(predicted_s: dict[str, float], measured_tps: dict[str, float], baseline: str,
                    goal: float = 0.15) -> dict[str, Any]:
    """Per configuration: predicted speedup over ``baseline`` (ratio of Lemma 3.1 times per token), measured speedup
    (ratio of tokens/s) and |predicted / measured - 1| against ``goal``."""
    out: dict[str, Any] = {"baseline": baseline, "goal_rel_error": goal, "configs": {}}
    if baseline not in predicted_s or baseline not in measured_tps:
        raise PolyspecError(f"baseline {baseline!r} has no prediction or no measurement")
    for name in predicted_s:
        if name not in measured_tps:
            continue
        pred = predicted_s[baseline] / predicted_s[name]
        meas = measured_tps[name] / measured_tps[baseline] if measured_tps[baseline] > 0 else float("nan")
        err = abs(pred / meas - 1.0) if meas and math.isfinite(meas) else float("nan")
        out["configs"][name] = {"predicted": pred, "measured": meas, "rel_error": err, "within_goal": err <= goal}
    return out
