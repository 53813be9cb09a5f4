"""decode/drafting/lookup.py: prompt lookup. Its proposals are the continuation of the latest earlier occurrence of the
longest suffix; alone (draft.source lookup) it is verified exactly at T = 0 (greedy = ar) and T > 0 (chi-square
against the warped target), and a round with nothing to propose is a plain step of the level above."""

from __future__ import annotations

import pytest
import torch
from test_chain import chi2_against, dist_levels, tables

from polyspec.chain_spec import DraftSpec
from polyspec.decode.chain import ChainDecoder, SamplingParams
from polyspec.decode.drafting.lookup import MAX_SUFFIX, lookup_match, lookup_run
from polyspec.decode.levels import TableLevel
from polyspec.errors import PolyspecError


def lookup_next(context, max_n=MAX_SUFFIX, min_n=1):
    found = lookup_match(context, max_n, min_n)
    return None if found is None else found[0]


def alone(n: int) -> DraftSpec:
    return DraftSpec(source="lookup", lookup=n)


def test_proposal_is_the_latest_continuation_of_the_longest_suffix():
    assert lookup_next([1, 2, 3, 9, 1, 2, 3], 3) == 9  # the 3-gram [1, 2, 3] was followed by 9
    assert lookup_next([1, 2, 7, 5, 2, 8, 1, 2], 3) == 7  # [1, 2] beats the more recent [2] -> 8
    assert lookup_next([4, 2, 8, 2, 6, 2], 3) == 6  # only [2] matches: its latest continuation
    assert lookup_next([1, 2, 3], 3) is None
    assert lookup_next([4, 2, 8, 2, 6, 2], 3, 2) is None  # 1-grams not allowed
    assert lookup_match([1, 2, 3, 9, 1, 2, 3], 3) == (9, 3)


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


def test_lookup_alone_rows_are_one_hot_and_counted():
    """The drafter's block at T > 0: one-hot rows on the looked-up tokens; at T = 0 no rows."""
    from polyspec.decode.drafting.lookup import LookupDrafter
    from polyspec.decode.state import RunState

    for sp in (SamplingParams(), SamplingParams(temperature=1.0)):
        st = RunState([_cyclic_target(10)], draft_level=None, sampling=sp, generator=torch.Generator(),
                      eos=frozenset(), limit=32, drafter_name="lookup")
        st.vocab = 10
        tokens, rows = LookupDrafter(3).propose(st, [1, 2, 1, 2, 1], 8)
        assert tokens == [2, 1, 2] and st.draft_stats.lookup_tokens == 3
        if sp.temperature == 0:
            assert rows is None
        else:
            assert torch.equal(rows, torch.nn.functional.one_hot(torch.tensor([2, 1, 2]), 10).float())
        assert LookupDrafter(3).propose(st, [1, 2, 3], 8) == ([], None)  # no repeated suffix: nothing
    with pytest.raises(PolyspecError, match="lookup"):
        LookupDrafter(0)


def _cyclic_target(v: int) -> TableLevel:
    """A target whose greedy continuation of x is x + 1 (mod v): its text repeats every v tokens."""
    return TableLevel(torch.nn.functional.one_hot((torch.arange(v) + 1) % v, v).float() * 6.0, "t")


def test_greedy_equals_ar_and_repeated_text_is_accepted_whole():
    v, k = 7, 4
    target = _cyclic_target(v)
    ar = ChainDecoder([target], max_seq_len=64).generate([0], 30).token_ids
    target2 = _cyclic_target(v)
    r = ChainDecoder([target2], draft=alone(k), max_seq_len=64).generate([0], 30)
    assert r.token_ids == ar and r.stats["mode"] == "dual"
    lengths = r.level_stats[0].accept_lengths
    assert lengths[:v] == [1] * v  # nothing to look up until a 2-token suffix repeats: plain steps
    assert max(lengths) == k + 1 and sum(lengths) == 30  # later cycles: whole blocks accepted


def test_greedy_equals_ar_with_rejections():
    v = 8
    target, _, _ = tables(v, seed=5)
    prompt = [1, 2, 3, 1, 2]
    ar = ChainDecoder([TableLevel(target, "t", 2)], max_seq_len=64).generate(prompt, 25).token_ids
    r = ChainDecoder([TableLevel(target, "t", 2)], draft=alone(3), max_seq_len=64).generate(prompt, 25)
    assert r.token_ids == ar


@pytest.mark.parametrize("sp", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.9)])
def test_sampled_output_is_the_warped_target(sp):
    """One-hot proposals: kept with probability p(x), else a draw from p without x: the target's law (chi-square)."""
    t, _ = dist_levels(2)
    dec = ChainDecoder([t], draft=alone(2), max_seq_len=16)
    stat, crit = chi2_against(dec, t, [1, 2, 1], sp, n=1000)
    assert stat < crit, (stat, crit)


def test_lookup_alone_refuses_a_tree():
    with pytest.raises(ValueError, match="tree"):
        DraftSpec(source="lookup", lookup=4, tree={"top_k": 2, "depth": 2, "total_tokens": 4})
