"""The sampling maths: warp (temperature / top-k / top-p), sample, residual, exact speculative verification."""

from __future__ import annotations

import math
from statistics import NormalDist

import pytest
import torch

from polyspec.decode import sampling
from polyspec.decode.sampling import check_sampling, residual, sample, verify_block, warp
from polyspec.errors import PolyspecError

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def chi2_critical(df: int, alpha: float) -> float:
    """Upper alpha quantile of chi-square(df) (Wilson-Hilferty approximation)."""
    z = NormalDist().inv_cdf(1 - alpha)
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2_stat(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson statistic of counts [K] against probs [K]; cells with expected count < 5 are pooled."""
    n = counts.sum().item()
    expected = probs.double() * n
    big = expected >= 5
    obs = counts.double()
    e = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    o = torch.cat([obs[big], obs[~big].sum().reshape(1)])
    keep = e > 0
    if (o[~keep] > 0).any():
        return float("inf"), 1
    e, o = e[keep], o[keep]
    return float(((o - e) ** 2 / e).sum()), int(keep.sum()) - 1


# -- warp -------------------------------------------------------------------------------------------------------


def test_warp_greedy_is_one_hot_lowest_index_on_ties():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, -1.0, 5.0, 5.0]])
    probs = warp(logits, 0.0)
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]


def test_warp_temperature_is_softmax_of_scaled_logits_and_keeps_float64():
    logits = torch.randn(3, 7, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(warp(logits, 0.7), torch.softmax(logits / 0.7, dim=-1))
    p64 = warp(logits.double(), 1.3)
    assert p64.dtype == torch.float64
    torch.testing.assert_close(p64.sum(-1), torch.ones(3, dtype=torch.float64))
    assert warp(logits.half(), 1.0).dtype == torch.float32


def test_warp_top_k_keeps_the_k_largest_and_ties_at_the_boundary():
    logits = torch.tensor([0.0, 2.0, 1.0, 3.0, 1.0])
    p = warp(logits, 1.0, top_k=2)
    assert (p > 0).tolist() == [False, True, False, True, False]
    torch.testing.assert_close(p[[1, 3]], torch.softmax(torch.tensor([2.0, 3.0]), 0))
    p3 = warp(logits, 1.0, top_k=3)  # the 3rd largest (1.0) is tied: both kept
    assert (p3 > 0).tolist() == [False, True, True, True, True]
    torch.testing.assert_close(warp(logits, 1.0, top_k=5), warp(logits, 1.0))


def test_warp_top_p_keeps_the_smallest_set_reaching_the_mass():
    probs = torch.tensor([0.1, 0.5, 0.15, 0.25])
    logits = probs.log()
    p = warp(logits, 1.0, top_p=0.7)  # 0.5 + 0.25 = 0.75 >= 0.7: keep tokens 1 and 3
    torch.testing.assert_close(p, torch.tensor([0.0, 0.5 / 0.75, 0.0, 0.25 / 0.75]))
    p = warp(logits, 1.0, top_p=0.75 + 1e-4)  # needs the third token too
    assert (p > 0).tolist() == [False, True, True, True]
    p = warp(logits, 1.0, top_p=0.01)  # the most likely token always stays
    assert p.tolist() == [0.0, 1.0, 0.0, 0.0]
    # top-k applies before top-p
    p = warp(logits, 1.0, top_k=3, top_p=0.6)  # renormalised top-3: 0.5/0.9=0.56, then 0.25/0.9 -> keep 2
    assert (p > 0).tolist() == [False, True, False, True]


@pytest.mark.parametrize("kwargs, what", [
    ({"temperature": -0.1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"temperature": 1.0, "top_p": 0.0}, "top_p"), ({"temperature": 1.0, "top_p": 1.5}, "top_p"),
    ({"temperature": 1.0, "top_k": -1}, "top_k"), ({"temperature": 1.0, "top_k": 2.5}, "top_k"),
])
def test_bad_sampling_parameters_raise(kwargs, what):
    with pytest.raises(PolyspecError, match=what):
        warp(torch.zeros(4), **kwargs)
    with pytest.raises(PolyspecError, match=what):
        check_sampling(**kwargs)


# -- sample / residual ------------------------------------------------------------------------------------------


def test_sample_is_deterministic_never_picks_zero_mass_and_matches_probs():
    probs = torch.tensor([0.0, 0.2, 0.0, 0.5, 0.3, 0.0])
    g = torch.Generator().manual_seed(0)
    draws = [sample(probs, g) for _ in range(4000)]
    g2 = torch.Generator().manual_seed(0)
    assert draws[:50] == [sample(probs, g2) for _ in range(50)]
    counts = torch.bincount(torch.tensor(draws), minlength=6)
    assert counts[[0, 2, 5]].sum() == 0
    stat, df = chi2_stat(counts, probs)
    assert stat < chi2_critical(df, 1e-3)
    assert sample(torch.tensor([0.0, 0.0, 1.0]), g) == 2


def test_sample_rounding_at_the_top_of_the_cdf_stays_on_support(monkeypatch):
    monkeypatch.setattr(sampling, "uniform", lambda gen, n=None: torch.tensor(1.0, dtype=torch.float64))
    assert sample(torch.tensor([0.3, 0.7, 0.0, 0.0]), torch.Generator()) == 1


def test_residual():
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    q = torch.tensor([0.2, 0.6, 0.1, 0.1])
    torch.testing.assert_close(residual(p, q), torch.tensor([0.75, 0.0, 0.25, 0.0]))
    torch.testing.assert_close(residual(p, p), p)  # p == q: falls back to p
    onehot_p, onehot_q = torch.tensor([0.0, 1.0, 0.0]), torch.tensor([1.0, 0.0, 0.0])
    assert residual(onehot_p, onehot_q).tolist() == [0.0, 1.0, 0.0]
    rows = residual(torch.stack([p, p]), torch.stack([q, p]))  # batched rows
    torch.testing.assert_close(rows, torch.stack([residual(p, q), p]))


# -- verify_block -----------------------------------------------------------------------------------------------


def test_verify_block_scripted_cases():
    g = torch.Generator().manual_seed(0)
    v = 5
    q = torch.full((3, v), 1.0 / v)
    # p == q: everything accepted, bonus from p[3] (one-hot -> token 4)
    p = torch.cat([q, torch.eye(v)[4:5]])
    for _ in range(20):
        assert verify_block(p, q, [0, 3, 2], g) == (3, 4)
    # p has no mass on the second token: rejected there, correction from residual = one-hot 1
    p = torch.tensor([[0.2] * 5, [0.0, 1.0, 0.0, 0.0, 0.0], [0.2] * 5, [0.2] * 5])
    for _ in range(20):
        assert verify_block(p, q, [0, 3, 2], g) == (1, 1)
    # greedy one-hot rows: acceptance is argmax matching
    eye = torch.eye(v)
    p = eye[[1, 2, 3, 0]]
    assert verify_block(p, eye[[1, 2, 4]], [1, 2, 4], g) == (2, 3)
    assert verify_block(p, eye[[1, 2, 3]], [1, 2, 3], g) == (3, 0)
    assert verify_block(p, eye[[4, 2, 3]], [4, 2, 3], g) == (0, 1)
    # empty block: one sample from p[0]
    assert verify_block(eye[[2]], torch.zeros(0, v), [], g) == (0, 2)
    with pytest.raises(ValueError, match="rows"):
        verify_block(eye[[1, 2]], eye[[1, 2]], [1, 2], g)


def test_verify_block_first_token_has_the_verifier_law_and_wrong_residual_does_not(monkeypatch):
    """One proposed token x ~ q; the emitted first token must be distributed as p exactly."""
    p = torch.tensor([0.1, 0.6, 0.25, 0.05])
    q = torch.tensor([0.4, 0.1, 0.2, 0.3])
    nxt = torch.full((4,), 0.25)

    def emitted(n: int, seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        counts = torch.zeros(4, dtype=torch.long)
        for _ in range(n):
            x = sample(q, g)
            n_acc, y = verify_block(torch.stack([p, nxt]), q[None], [x], g)
            counts[x if n_acc == 1 else y] += 1
        return counts

    stat, df = chi2_stat(emitted(3000, 1), p)
    assert stat < chi2_critical(df, 1e-3)
    monkeypatch.setattr(sampling, "residual", lambda p_, q_: p_)  # the classic bug: resample from p
    stat, df = chi2_stat(emitted(3000, 1), p)
    assert stat > chi2_critical(df, 1e-3)


def test_argmax_rows_is_torch_argmax_on_ties_nans_and_infinities():
    """argmax_rows (numpy's argmax on the CPU) returns exactly torch.argmax's indices, as Python ints: the first of
    equal maxima, the first NaN, +inf over finite values, 0 for a row of -inf; for bf16 and fp32 rows, one row or many,
    rows of any length, and strided views."""
    from polyspec.decode.sampling import argmax_rows

    nan, inf = float("nan"), float("inf")
    rows = torch.tensor([[1.0, 3.0, 3.0, 2.0], [nan, 1.0, nan, 5.0], [-inf] * 4, [1.0, inf, inf, 0.0],
                         [2.0, nan, 7.0, nan], [-1.0, -1.0, -2.0, -1.0]])
    g = torch.Generator().manual_seed(3)
    wide = torch.randint(0, 5, (7, 49152), generator=g).float()  # many ties among the maxima
    odd = torch.randn(6, 49157, generator=g)  # the maxima, NaNs and infinities far in, and in the rows' tails
    odd[0, 20001] = odd[0, 30000] = nan
    odd[1, 40000] = odd[1, 17] = inf
    odd[2, 49155] = 50.0
    odd[3, 49156] = nan
    odd[4] = 0.0
    odd[4, :3] = -1.0
    odd[4, 3] = -0.0  # equal to the +0.0 after it: the first zero wins
    odd[5, 33] = odd[5, 49150] = 60.0
    for x in (rows, rows[:1], rows[::2], rows.bfloat16(), wide, wide[:, ::3], wide.bfloat16(), odd, odd[1:, 5:]):
        got = argmax_rows(x)
        assert all(type(j) is int for j in got) and got == torch.argmax(x.float(), dim=-1).tolist(), x.shape


def test_top_log_probs_are_torch_topk_of_log_softmax():
    """top_log_probs (k argmax passes and one exp pass on the CPU up to k = 8, torch past it or where a row has fewer
    than k finite logits) gives torch.topk's indices of each row and torch.log_softmax's values there (to float32
    rounding), largest first, k cut to the row's length; rows of a draft vocabulary (mostly -inf) too; with ties,
    the same values."""
    from polyspec.decode.sampling import top_log_probs

    g = torch.Generator().manual_seed(5)
    inf = float("inf")
    vocab = torch.full((2, 49152), -inf)
    vocab[:, torch.randperm(49152, generator=g)[:4096]] = torch.randn(2, 4096, generator=g) * 3
    cases = [torch.randn(f, v, generator=g) * 4 for f, v in ((1, 49152), (3, 1000), (2, 1000), (2, 1000), (2, 5))]
    for x, k in zip([*cases, vocab], (2, 1, 8, 9, 7, 3), strict=True):
        ids, vals = top_log_probs(x, k)
        want = torch.topk(torch.log_softmax(x.double(), dim=-1), min(k, x.shape[-1]))
        assert ids == want.indices.tolist(), (x.shape, k)
        assert torch.allclose(torch.tensor(vals, dtype=torch.float64), want.values, rtol=0, atol=2e-5), (x.shape, k)
    tied = torch.tensor([[0.1, 0.3, 0.3, 0.2, 0.1]]).log()
    ids, vals = top_log_probs(tied, 3)
    assert sorted(ids[0][:2]) == [1, 2] and ids[0][2] == 3 and vals[0][0] == vals[0][1] > vals[0][2]
    masked = torch.tensor([[-inf, 2.0, -inf, -inf], [1.0, 0.0, -inf, -inf]])  # fewer finite entries than k
    ids, vals = top_log_probs(masked, 3)
    assert all(len(set(row)) == 3 for row in ids) and ids[0][0] == 1 and ids[1][:2] == [0, 1]
    assert vals[0][0] == 0.0 and vals[0][1] == vals[1][2] == -inf


def test_top_ids_are_top_log_probs_indices_and_leave_the_rows_alone():
    """top_ids (a greedy depth-1 tree's children: k argmax passes over the rows themselves, each pick put back) gives
    top_log_probs' indices, largest first; the rows come back bit for bit; torch.topk where a row has fewer than k
    finite logits or past k = 8."""
    from polyspec.decode.sampling import top_ids, top_log_probs

    g = torch.Generator().manual_seed(6)
    inf = float("inf")
    vocab = torch.full((2, 49152), -inf)
    vocab[:, torch.randperm(49152, generator=g)[:4096]] = torch.randn(2, 4096, generator=g) * 3
    cases = [torch.randn(f, v, generator=g) * 4 for f, v in ((1, 49152), (3, 1000), (2, 1000), (2, 5))]
    for x, k in zip([*cases, vocab], (2, 8, 9, 7, 3), strict=True):
        before = x.clone()
        assert top_ids(x, k) == top_log_probs(x, k)[0], (x.shape, k)
        assert torch.equal(x, before)
    masked = torch.tensor([[-inf, 2.0, -inf, -inf], [1.0, 0.0, -inf, -inf]])
    ids = top_ids(masked, 3)
    assert ids[0][0] == 1 and ids[1][:2] == [0, 1] and all(len(set(row)) == 3 for row in ids)
    assert torch.equal(masked, torch.tensor([[-inf, 2.0, -inf, -inf], [1.0, 0.0, -inf, -inf]]))


def test_greedy_rows_and_verification_equal_the_one_hot_maths():
    """T = 0 without full-vocabulary rows: argmax_rows is warp's hot index (ties: the first), and greedy_verify
    returns what verify_block returns on the warped rows, for blocks accepted fully, partly and not at all."""
    from polyspec.decode.sampling import argmax_rows, greedy_verify, verify_block, warp

    g = torch.Generator().manual_seed(7)
    for trial in range(60):
        m, v = int(torch.randint(0, 6, (1,), generator=g)), 11
        logits = torch.randint(0, 4, (m + 1, v), generator=g).float()  # many ties
        hot = torch.tensor(argmax_rows(logits))
        assert torch.equal(warp(logits, 0.0), torch.zeros(m + 1, v).scatter_(-1, hot[:, None], 1.0))
        # a block that follows the verifier's argmax for a random prefix, then (maybe) departs from it
        keep = int(torch.randint(0, m + 1, (1,), generator=g))
        block = [int(hot[j]) if j < keep else int((hot[j] + 1 + trial % (v - 1)) % v) for j in range(m)]
        q = torch.zeros(m, v).scatter_(-1, torch.tensor(block, dtype=torch.long)[:, None], 1.0)
        want = verify_block(warp(logits, 0.0), q, block, torch.Generator().manual_seed(trial))
        assert greedy_verify(logits, block) == want and want[0] == keep
