"""decode/ngram.py: prompt lookup as a chain level. Its proposals are the continuation of the latest earlier
occurrence of the longest suffix; verified exactly at T = 0 (greedy = ar) and T > 0 (chi-square against the warped
target); a round with nothing to propose is a plain step of the level above."""

from __future__ import annotations

import pytest
import torch
from test_chain import V_DIST, chi2_against, dist_levels, tables

from polyspec.decode.chain import ChainDecoder, SamplingParams
from polyspec.decode.levels import TableLevel
from polyspec.decode.ngram import MAX_SUFFIX, NgramLevel, lookup_match, lookup_next, lookup_run
from polyspec.errors import PolyspecError


def test_proposal_is_the_latest_continuation_of_the_longest_suffix():
    lv = NgramLevel(50, max_n=3)
    assert lv.proposal([1, 2, 3, 9, 1, 2, 3]) == 9  # the 3-gram [1, 2, 3] was followed by 9
    assert lv.proposal([1, 2, 7, 5, 2, 8, 1, 2]) == 7  # [1, 2] beats the more recent [2] -> 8
    assert lv.proposal([4, 2, 8, 2, 6, 2]) == 6  # only [2] matches: its latest continuation
    assert lv.proposal([1, 2, 3]) is None and not lv.has_proposal([1, 2, 3])
    assert NgramLevel(50, max_n=3, min_n=2).proposal([4, 2, 8, 2, 6, 2]) is None  # 1-grams not allowed
    with pytest.raises(PolyspecError, match="min_n"):
        NgramLevel(50, max_n=1, min_n=2)


def _reference_next(context: list[int], max_n: int, min_n: int) -> int | None:
    """The definition, spelled out: longest suffix first, then its most recent earlier occurrence."""
    for n in range(min(max_n, len(context) - 1), min_n - 1, -1):
        for end in range(len(context) - 1, n - 1, -1):
            if context[end - n:end] == context[-n:]:
                return context[end]
    return None


def test_lookup_matches_its_definition_on_random_text():
    gen = torch.Generator().manual_seed(0)
    for trial in range(3000):
        n, vocab = int(torch.randint(0, 40, (1,), generator=gen)), (2, 3, 5, 20)[trial % 4]
        context = torch.randint(vocab, (n,), generator=gen).tolist()
        for max_n, min_n in ((1, 1), (3, 1), (3, 2), (MAX_SUFFIX, 1), (MAX_SUFFIX, 2)):
            assert lookup_next(context, max_n, min_n) == _reference_next(context, max_n, min_n), (context, max_n)


def test_lookup_match_gives_the_length_of_the_suffix_it_matched():
    gen = torch.Generator().manual_seed(1)
    for _ in range(300):
        context = torch.randint(3, (int(torch.randint(2, 30, (1,), generator=gen)),), generator=gen).tolist()
        found = lookup_match(context, MAX_SUFFIX, 1)
        longest = max((n for n in range(1, min(MAX_SUFFIX, len(context) - 1) + 1)
                       if _reference_next(context, n, n) is not None), default=None)
        assert (found is None) == (longest is None), context
        if found is not None:
            assert found == (_reference_next(context, MAX_SUFFIX, 1), longest), context


def test_a_run_is_cut_at_per_match_tokens_per_matched_token():
    text = list(range(20)) + [50, 51, 0, 1]  # [0, 1] recurs (2 tokens matched): 0..19 would follow
    assert lookup_run(text, 12, min_n=2) == list(range(2, 14))
    assert lookup_run(text, 12, min_n=2, per_match=3) == list(range(2, 8))  # 3 per matched token: 6
    text = list(range(20)) + [50] + list(range(5))  # [0..4] recurs: 5 tokens matched
    assert lookup_run(text, 12, min_n=2, per_match=3) == list(range(5, 17))  # 15 allowed, 12 asked
    assert lookup_run(text, 12, min_n=2, per_match=2) == list(range(5, 15))
    with pytest.raises(PolyspecError, match="per_match"):
        lookup_run(text, 12, min_n=2, per_match=0)


def test_a_longer_match_beats_a_newer_one():
    # [5, 1, 2] recurs at two places; the older one is preceded by the same 6 tokens as the end of the text
    text = [7, 8, 9, 4, 6, 5, 1, 2, 3] + [0, 5, 1, 2, 4] + [7, 8, 9, 4, 6, 5, 1, 2]
    assert lookup_next(text, 3, 2) == 4  # three tokens tie: the newest
    assert lookup_next(text) == 3 and lookup_run(text, 2, min_n=2) == [3, 0]


def test_rows_are_one_hot_on_the_proposal_and_the_cache_rolls_back():
    lv = NgramLevel(10)
    lv.setup(32)
    logits, hidden = lv.forward([1, 2, 1], 0)
    assert hidden is None and logits.shape == (3, 10)
    assert int(logits[2].argmax()) == 2 and torch.isinf(logits[2]).sum() == 9  # after [1, 2, 1]: 2
    assert torch.equal(logits[0], torch.zeros(10))  # no proposal: a uniform row (never sampled)
    lv.forward([5], 1)  # rolled back to [1], then 5
    assert lv.tokens == [1, 5] and lv.cache_len == 2


def _cyclic_target(v: int) -> TableLevel:
    """A target whose greedy continuation of x is x + 1 (mod v): its text repeats every v tokens."""
    return TableLevel(torch.nn.functional.one_hot((torch.arange(v) + 1) % v, v).float() * 6.0, "t")


def test_greedy_equals_ar_and_repeated_text_is_accepted_whole():
    v, k = 7, 4
    target = _cyclic_target(v)
    ar = ChainDecoder([target], max_seq_len=64).generate([0], 30).token_ids
    target2 = _cyclic_target(v)
    r = ChainDecoder([target2, NgramLevel(v)], draft_k=k, max_seq_len=64).generate([0], 30)
    assert r.token_ids == ar
    lengths = r.level_stats[0].accept_lengths
    assert lengths[:v - 1] == [1] * (v - 1)  # nothing to look up during the first cycle: plain steps
    assert max(lengths) == k + 1 and sum(lengths) == 30  # later cycles: whole drafts accepted


def test_greedy_equals_ar_with_rejections():
    v = 8
    target, _, _ = tables(v, seed=5)
    prompt = [1, 2, 3, 1, 2]
    ar = ChainDecoder([TableLevel(target, "t", 2)], max_seq_len=64).generate(prompt, 25).token_ids
    r = ChainDecoder([TableLevel(target, "t", 2), NgramLevel(v)], draft_k=3, max_seq_len=64).generate(prompt, 25)
    assert r.token_ids == ar


@pytest.mark.parametrize("sp", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.9)])
def test_sampled_output_is_the_warped_target(sp):
    """One-hot proposals: kept with probability p(x), else a draw from p without x: the target's law (chi-square)."""
    t, _ = dist_levels(2)
    dec = ChainDecoder([t, NgramLevel(V_DIST, max_n=2)], draft_k=2, max_seq_len=16)
    stat, crit = chi2_against(dec, t, [1, 2, 1], sp, n=1000)
    assert stat < crit, (stat, crit)


def test_ngram_refuses_a_tree():
    from polyspec.decode.chain import TreeParams

    with pytest.raises(PolyspecError, match="forward_tree"):
        ChainDecoder([_cyclic_target(5), NgramLevel(5)], tree=TreeParams(top_k=2, depth=2, total_tokens=4))
