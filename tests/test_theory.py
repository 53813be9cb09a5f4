"""Exact theory: Lemma 3.1, Theorem 3.2's conditions (known answers from the paper's Table 1), exact variance."""

import json
import math

import numpy as np
import pytest

from polyspec.cli import main
from polyspec.theory import acceptance_length_moments, chain_time_per_token, insertion


def test_lemma31_time_per_token():
    # two levels: T1/L1 + beta*T2/L1
    assert chain_time_per_token([10.0, 1.0], [4.0], beta=4) == pytest.approx(10 / 4 + 4 * 1 / 4)
    # three levels: T1/L1 + T2/L2 + beta*T3/L2
    assert chain_time_per_token([20.0, 6.0, 1.0], [5.0, 3.0], beta=3) == pytest.approx(20 / 5 + 6 / 3 + 3 * 1 / 3)
    assert chain_time_per_token([7.0], []) == 7.0
    with pytest.raises(ValueError):
        chain_time_per_token([1.0, 2.0], [])
    with pytest.raises(ValueError):
        chain_time_per_token([1.0, 2.0], [0.0])
    # a drafter without a model (prompt lookup) costs nothing the lemma counts; a target always does
    assert chain_time_per_token([10.0, 0.0], [2.5], beta=1) == pytest.approx(4.0)
    for bad in ([0.0, 1.0], [10.0, -1.0], [10.0, math.inf], [0.0]):
        with pytest.raises(ValueError):
            chain_time_per_token(bad, [2.0] * (len(bad) - 1))


# The paper's Table 1 rows: (T_i, L_i-new, T_new, L_new, T_i+1, L_i) -> condition 1 (lhs, rhs).
@pytest.mark.parametrize(
    "row, lhs, rhs",
    [
        ((22, 6.26, 7.00, 4.67, 4, 4.34), 0.318, 0.330),
        ((22, 3.83, 17.61, 3.77, 4, 4.34), 0.80, -0.116),  # the paper prints 0.117, dropping the sign
        ((47.52, 3.50, 19.16, 3.02, 12.42, 2.28), 0.403, 0.462),
    ],
)
def test_table1_condition1(row, lhs, rhs):
    t_i, l_i_new, t_new, l_new, t_next, l_i = row
    v = insertion(t_i, t_new, t_next, l_i, l_new, l_i_new, beta=1.0)
    assert v.cond1_lhs == pytest.approx(lhs, abs=2e-3)
    assert v.cond1_rhs == pytest.approx(rhs, abs=2e-3)
    assert v.cond1_holds == (lhs < rhs)


def test_sufficient_conditions_imply_exact_gain():
    rng = np.random.default_rng(0)
    checked = 0
    for _ in range(5000):
        l_i = rng.uniform(1.0, 5.0)
        l_new = rng.uniform(l_i, 7.0)
        l_i_new = rng.uniform(l_new, 9.0)
        t_i, t_new, t_next = rng.uniform(0.1, 50.0, size=3)
        beta = rng.uniform(1.0, 8.0)
        v = insertion(t_i, t_new, t_next, l_i, l_new, l_i_new, beta)
        assert v.valid_regime
        if v.cond1_holds or v.cond2_holds:
            assert v.pays, v
            checked += 1
        # the exact difference, written out
        diff = t_i * (1 / l_i_new - 1 / l_i) + t_new / l_new + beta * t_next * (1 / l_new - 1 / l_i)
        assert v.time_after - v.time_before == pytest.approx(diff, rel=1e-9, abs=1e-12)
    assert checked > 100


def test_conditions_are_not_sufficient_outside_regime():
    # L_new < L_i: the draft-level term is positive, so cond1 alone can hold while the insertion does not pay.
    v = insertion(t_i=10, t_new=0.1, t_next=5, l_i=3.0, l_new=1.2, l_i_new=3.3, beta=6)
    assert v.cond1_holds and not v.valid_regime and not v.pays


def _pmf_moments(alpha, n):
    p = [alpha ** (k - 1) * (1 - alpha) for k in range(1, n)] + [alpha ** (n - 1)]
    ks = np.arange(1, n + 1)
    mean = float(np.dot(ks, p))
    return mean, float(np.dot(ks**2, p)) - mean**2


@pytest.mark.parametrize("alpha, n", [(0.5, 2), (0.8, 5), (0.3, 1), (0.0, 4), (1.0, 6), (0.95, 12), (0.999, 40)])
def test_exact_moments_match_pmf(alpha, n):
    mean, var = acceptance_length_moments(alpha, n)
    m2, v2 = _pmf_moments(alpha, n)
    assert mean == pytest.approx((1 - alpha**n) / (1 - alpha) if alpha < 1 else n)
    assert mean == pytest.approx(m2, rel=1e-9)
    assert var == pytest.approx(v2, rel=1e-6, abs=1e-9)
    assert var >= 0


@pytest.mark.parametrize("alpha, n", [(0.5, 2), (0.7, 4), (0.9, 8)])
def test_moments_against_monte_carlo(alpha, n):
    rng = np.random.default_rng(1)
    samples = np.minimum(rng.geometric(1 - alpha, size=400_000), n)
    mean, var = acceptance_length_moments(alpha, n)
    se_mean = math.sqrt(var / samples.size)
    assert abs(samples.mean() - mean) < 5 * se_mean + 1e-12
    assert samples.var() == pytest.approx(var, rel=0.02)


def test_moments_reject_bad_input():
    with pytest.raises(ValueError):
        acceptance_length_moments(1.5, 3)
    with pytest.raises(ValueError):
        acceptance_length_moments(0.5, 0)


def test_cli_insertion_json(capsys):
    assert main(["theory", "insertion", "--t-i", "22", "--t-new", "7", "--t-next", "4", "--l-i", "4.34",
                 "--l-new", "4.67", "--l-i-new", "6.26", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("cond1_lhs", "cond1_rhs", "cond1_holds", "cond2_lhs", "cond2_rhs", "cond2_holds", "valid_regime",
                "time_before", "time_after", "pays"):
        assert key in out
    assert out["cond1_holds"] is True and out["pays"] is True
    assert out["cond1_lhs"] == pytest.approx(0.318, abs=1e-3)


def test_cli_stability_json_and_bad_input(capsys):
    assert main(["theory", "stability", "--alpha", "0.5", "--n", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"alpha": 0.5, "n": 2, "mean": 1.5, "variance": 0.25}
    assert main(["theory", "stability", "--alpha", "2", "--n", "2"]) == 2
    assert "alpha" in capsys.readouterr().err
