"""Verdicts from measured T and L with :mod:`polyspec.theory` (pure functions, no torch).

* :func:`predict`: Lemma 3.1's time per token of one measured run.
* :func:`insertion_verdict`: Theorem 3.2's two conditions and the exact Lemma 3.1 difference for inserting a level
  between two adjacent ones.
* :func:`choose_config` / :func:`decide`: the configuration (mode, draft, mu) with the smallest predicted time
  per token, or ar when plain decoding is predicted or measured faster.
* :func:`fit_alpha` / :func:`variance_check`: the measured acceptance-length variance against the exact one of
  X = min(G, n), G ~ Geometric(1 - alpha) (Theorem 3.3, corrected), alpha fitted from the measured mean through the
  exact mean formula.
* :func:`speedup_summary`: predicted vs measured speedups and their relative error.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from polyspec.errors import PolyspecError
from polyspec.export.results import (
    CostRow,
    Decision,
    GridRow,
    Insertion,
    InsertionInputs,
    Prediction,
    Run,
    SpeedupRow,
    Speedups,
    VarianceCheck,
)
from polyspec.modes import AR, CHAIN, DUAL
from polyspec.theory import acceptance_length_moments, chain_time_per_token, insertion

DECISION_RULE = ("min over the grid of the Lemma 3.1 time per token (measured T at the run's own forward widths, "
                 "measured L_eff and beta), modes chain and dual, linear drafts with and without prompt-lookup "
                 "blocks, (when given) the draft tree, and prompt lookup alone; the best predicted dual, the next "
                 "two and the grid's fastest measured dual measured on every prompt, the fastest kept; "
                 "mode ar when ar's predicted time beats the measured dual baseline and chosen chain, or when the "
                 "final runs measured ar at least as fast as the chosen configuration")


def predict(run: Run, costs: dict[str, list[CostRow]]) -> Prediction:
    """Lemma 3.1 for one measured run: T/N = sum_{i<n} T_i / L_eff_i + beta T_n / L_eff_{n-1}.

    T_i = the mean measured forward cost over the level's own (non-prefill) forward widths in that run, so blocks
    wider than draft_k + 1 or mu + 1 are charged what they cost."""
    from polyspec.export.acceptance import LOOKUP, steady_widths
    from polyspec.export.timing import mean_cost

    # prompt lookup's list search is the decoder's own work (microseconds), which Lemma 3.1 leaves out
    t = [0.0 if nm == LOOKUP else mean_cost(costs[nm], steady_widths(run, nm)) for nm in run.levels]
    if len(t) == 1:
        return Prediction(time_per_token_s=chain_time_per_token(t, []), T=t, L_eff=[], beta=None)
    ls = [float(run.per_level[nm].L_eff or 0.0) for nm in run.levels[:-1]]
    beta = run.beta or 1.0
    return Prediction(time_per_token_s=chain_time_per_token(t, ls, beta), T=t, L_eff=ls, beta=beta)


def grid_row(run: Run) -> GridRow:
    """A predicted run (see :func:`predict`) as a grid row."""
    if run.predicted is None:
        raise PolyspecError(f"run {run.label!r} has no prediction")
    verifiers = {nm: lv for nm, lv in run.per_level.items() if lv.L is not None}
    return GridRow(label=run.label, mode=run.mode, draft=run.draft, mu=list(run.mu),
                   L={nm: lv.L for nm, lv in verifiers.items()}, L_eff={nm: lv.L_eff for nm, lv in verifiers.items()},
                   beta=run.beta, T_s=dict(zip(run.levels, run.predicted.T, strict=True)),
                   predicted_time_per_token_s=run.predicted.time_per_token_s,
                   measured_tokens_per_second=run.tokens_per_second,
                   measured_tokens_per_second_steady=run.tokens_per_second_steady, new_tokens=run.new_tokens)


def insertion_verdict(inputs: InsertionInputs, *, level: str, above: str, below: str, label: str,
                      draft: str | None, mu: int | None) -> Insertion:
    """theory.insertion on ``inputs``, kept next to them (Theorem 3.2's conditions, exact Lemma 3.1 two-level form)."""
    i = inputs
    v = insertion(i.T_i, i.T_new, i.T_next, i.L_i, i.L_new, i.L_i_new, i.beta)
    return Insertion(level=level, above=above, below=below, label=label, draft=draft, mu=mu, inputs=inputs,
                     **v.to_dict())


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


def lengths_from_hist(hist: dict[Any, int]) -> list[int]:
    """{3: 2, 1: 1} (keys int or str) -> [1, 3, 3]."""
    out: list[int] = []
    for k in sorted(hist, key=int):
        out += [int(k)] * int(hist[k])
    return out


def variance_check(lengths: list[int], n: int, *, approximate: bool = False) -> VarianceCheck:
    """Measured mean/variance of acceptance lengths vs the exact variance of min(G, n) at the fitted alpha.

    ``approximate`` marks a check where blocks did not all have the same limit (a level verifying blocks of >= mu
    tokens; n is then their typical limit)."""
    if not lengths:
        return VarianceCheck(n=int(n), count=0, approximate=approximate)
    m = sum(lengths) / len(lengths)
    var = sum((x - m) ** 2 for x in lengths) / len(lengths)
    alpha = fit_alpha(m, n)
    mean_th, var_th = acceptance_length_moments(alpha, n)
    return VarianceCheck(n=int(n), count=len(lengths), approximate=approximate, mean=m, var_measured=var, alpha=alpha,
                         mean_theory=mean_th, var_theory=var_th, var_ratio=(var / var_th) if var_th > 0 else None)


def choose_config(rows: Sequence[GridRow], modes: tuple[str, ...] = ("chain", "dual")) -> GridRow:
    """The row with the smallest predicted time among ``modes``; ties go to the earlier row."""
    cands = [r for r in rows if r.mode in modes and r.predicted_time_per_token_s is not None]
    if not cands:
        raise PolyspecError(f"no measured configuration of mode {'/'.join(modes)} to choose from")
    return min(cands, key=lambda r: r.predicted_time_per_token_s)


def runners_up(rows: Sequence[GridRow], best: GridRow, n: int, modes: tuple[str, ...] = ("dual",)) -> list[GridRow]:
    """The ``n`` rows of ``modes`` predicted fastest after ``best``, then (with n > 0) the row the grid measured
    fastest where it is neither: the final runs measure them too. Lemma 3.1 leaves out the decoder's own work per
    round, which differs between drafts (a tree's rounds cost it twice a linear one's), so the measured best may rank
    low in the prediction."""
    cands = [r for r in rows if r.mode in modes and r.predicted_time_per_token_s is not None and r is not best]
    out = sorted(cands, key=lambda r: r.predicted_time_per_token_s)[:n]
    fastest = max(cands, key=lambda r: r.measured_tokens_per_second, default=None)
    if n > 0 and fastest is not None and fastest.measured_tokens_per_second > best.measured_tokens_per_second \
            and all(fastest is not r for r in out):
        out.append(fastest)
    return out


def decide(chosen: GridRow, final: dict[str, Run], *, mu: int, n_levels: int, grid: dict[str, Any]) -> Decision:
    """The decision: ``chosen`` (the grid's fastest predicted chain or dual), unless plain decoding is predicted faster
    than the final dual and chain runs or the final runs measured ar at least as fast as ``chosen``'s mode (Lemma 3.1
    leaves out the decoder's own per-round work); the tuned speculative settings stay for --mode dual / chain."""
    spec = [nm for nm in (DUAL, CHAIN) if nm in final]
    pred = {nm: final[nm].predicted.time_per_token_s for nm in (AR, *spec)}
    ar_faster = pred[AR] < min(pred[nm] for nm in spec)
    ar_measured = final["ar"].tokens_per_second >= final[chosen.mode].tokens_per_second
    return Decision(mode="ar" if ar_faster or ar_measured else chosen.mode, speculative_mode=chosen.mode,
                    draft=dict(chosen.draft), mu=[mu] * (n_levels - 2),
                    predicted_time_per_token_s=chosen.predicted_time_per_token_s, grid=grid,
                    ar_predicted_faster=ar_faster, ar_measured_faster=ar_measured, rule=DECISION_RULE)


def speedup_summary(predicted_s: dict[str, float], measured_tps: dict[str, float], baseline: str,
                    goal: float = 0.15) -> Speedups:
    """Per configuration: predicted speedup over ``baseline`` (ratio of Lemma 3.1 times per token), measured speedup
    (ratio of tokens/s) and |predicted / measured - 1| against ``goal``."""
    if baseline not in predicted_s or baseline not in measured_tps:
        raise PolyspecError(f"baseline {baseline!r} has no prediction or no measurement")
    rows: dict[str, SpeedupRow] = {}
    for name in predicted_s:
        if name not in measured_tps:
            continue
        pred = predicted_s[baseline] / predicted_s[name]
        meas = measured_tps[name] / measured_tps[baseline] if measured_tps[baseline] > 0 else float("nan")
        err = abs(pred / meas - 1.0) if meas and math.isfinite(meas) else float("nan")
        rows[name] = SpeedupRow(predicted=pred, measured=meas, rel_error=err, within_goal=err <= goal)
    return Speedups(baseline=baseline, goal_rel_error=goal, configs=rows)

