"""The n-level chain decoder: scripted accept/reject cases with exact stats, rollback state, greedy == AR token for
token (toy levels and tiny random Llamas through the engine adapters), the exact target distribution at T > 0 (and a
deliberately wrong residual failing the same check), features for EAGLE-style drafts, bad input."""

from __future__ import annotations

import copy
import functools
import importlib.util
import itertools
import math
import os
import sys
from statistics import NormalDist

import pytest
import torch

from polyspec.chain_spec import DraftSpec, TreeShape
from polyspec.decode import sampling
from polyspec.decode.chain import ChainDecoder, SamplingParams, common_prefix
from polyspec.decode.drafting import LinearDrafter
from polyspec.decode.drafting.lookup import RUN_PER_MATCH
from polyspec.decode.levels import TableLevel
from polyspec.decode.sampling import warp
from polyspec.errors import PolyspecError

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# -- toy levels -------------------------------------------------------------------------------------------------


class ScriptLevel:
    """Next-token logits = fn(context); the cache is the list of processed tokens (checked like a KV cache)."""

    kind = "script"
    needs_features = False

    def __init__(self, fn, name: str):
        self.fn, self.name = fn, name
        self.tokens: list[int] = []
        self.max_seq_len = 0

    @property
    def cache_len(self) -> int:
        return len(self.tokens)

    def setup(self, max_seq_len):
        self.max_seq_len, self.tokens = max_seq_len, []

    def reset(self):
        self.tokens = []

    def truncate(self, n):
        assert 0 <= n <= len(self.tokens)
        del self.tokens[n:]

    def forward(self, tokens, start_pos, features=None, *, last_only=False, logit_rows=None):
        self.truncate(start_pos)
        rows = []
        for t in tokens:
            self.tokens.append(t)
            rows.append(self.fn(self.tokens))
        assert len(self.tokens) <= self.max_seq_len
        logits = torch.stack(rows)
        return logits, logits


class FeatureLevel:
    """A toy EAGLE head: logits = table[token] + sin(features) @ w. Its "cache" holds (token, feature) per position
    from position 1 on; its hidden output is tanh(logits) + 1000 (so its own predicted features are recognisable)."""

    kind = "toy-head"
    needs_features = True

    def __init__(self, table: torch.Tensor, w: torch.Tensor, name: str = "head"):
        self.table, self.w, self.name = table, w, name
        self.entries: list[tuple[int, torch.Tensor]] = []  # head position t <-> sequence position t + 1
        self.first_token = -1  # position 0 (never fed to a head); set by the test
        self.calls: list[tuple[int, list[int], torch.Tensor]] = []

    @property
    def cache_len(self):
        return len(self.entries) + 1 if self.entries else 0

    def setup(self, max_seq_len):
        self.entries = []

    def reset(self):
        self.entries, self.calls = [], []

    def truncate(self, n):
        del self.entries[max(n - 1, 0):]

    def forward(self, tokens, start_pos, features=None, *, last_only=False, logit_rows=None):
        assert start_pos >= 1 and features is not None and features.shape[0] == len(tokens)
        assert start_pos - 1 <= len(self.entries)
        del self.entries[start_pos - 1:]
        context = [self.first_token] + [tok for tok, _ in self.entries] + list(tokens)  # positions 0 .. end
        self.calls.append((start_pos, context, features.clone()))
        for t, f in zip(tokens, features, strict=True):
            self.entries.append((t, f.clone()))
        logits = self.table[tokens] + torch.sin(features.float()) @ self.w  # [T, V]
        return logits, torch.tanh(logits) + 1000.0  # own predicted features: in (999, 1001), unlike true ones


def shift_fn(step: int, v: int = 8, wrong_at: frozenset[int] = frozenset()):
    """Greedy script: next token = last + step (mod v), or last + step + 1 when len(context) is in wrong_at."""
    def fn(ctx):
        nxt = (ctx[-1] + step + (len(ctx) in wrong_at)) % v
        return torch.nn.functional.one_hot(torch.tensor(nxt), v).float() * 5.0
    return fn


def tables(v: int, seed: int = 0):
    """A target (order 2), a verifier close to it (order 2) and a rougher draft (order 1) over vocabulary v."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(v * v, v, generator=g) * 2.0
    mid = target + torch.randn(v * v, v, generator=g) * 0.7
    draft = target.reshape(v, v, v).mean(0) + torch.randn(v, v, generator=g) * 0.7
    return target, mid, draft


def stats_of(result, i):
    return result.level_stats[i]


def D(k: int = 4, lookup: int = 0, tree: tuple[int, int, int] | None = None, **kw) -> DraftSpec:
    """A DraftSpec: k draft tokens (or a tree of (top_k, depth, total_tokens)), prompt-lookup blocks of ``lookup``."""
    shape = TreeShape(top_k=tree[0], depth=tree[1], total_tokens=tree[2]) if tree else None
    return DraftSpec(k=k, lookup=lookup, tree=shape, **kw)


# -- scripted accept / reject cases ----------------------------------------------------------------------------


def test_dual_all_accepted():
    t, d = ScriptLevel(shift_fn(1), "t"), ScriptLevel(shift_fn(1), "d")
    r = ChainDecoder([t, d], draft=D(3)).generate([0], 6)
    assert r.token_ids == [1, 2, 3, 4, 5, 6]
    assert stats_of(r, 0).accept_lengths == [4, 2]  # 3 accepted + bonus, then the 2 left of the budget
    assert stats_of(r, 0).forward_passes == 2
    assert stats_of(r, 1).forward_passes == 5  # 3 + min(3, room 2)
    assert r.stats["mode"] == "dual" and r.stats["beta"] == 2.5 and r.stats["new_tokens"] == 6
    assert r.stats["levels"][0]["mean_accepted"] == 3.0


def test_dual_none_accepted():
    t, d = ScriptLevel(shift_fn(1), "t"), ScriptLevel(shift_fn(2), "d")
    r = ChainDecoder([t, d], draft=D(3)).generate([0], 6)
    assert r.token_ids == [1, 2, 3, 4, 5, 6]
    assert stats_of(r, 0).accept_lengths == [1] * 6
    assert stats_of(r, 1).forward_passes == 3 + 3 + 3 + 3 + 2 + 1  # k = min(3, room)
    assert r.stats["levels"][0]["mean_accepted"] == 1.0


def test_draft_lookup_proposes_the_repeated_text_the_draft_misses():
    # the target counts 0..7 over and over; the draft is always wrong; once the text repeats, prompt lookup's
    # blocks (a suffix of 2+ tokens seen before) are the target's own continuation
    t, d = ScriptLevel(shift_fn(1), "t"), ScriptLevel(shift_fn(2), "d")
    r = ChainDecoder([t, d], draft=D(1, lookup=4), max_seq_len=64).generate([0], 40)
    assert r.token_ids == [i % 8 for i in range(1, 41)]
    lens = stats_of(r, 0).accept_lengths
    assert lens[:7] == [1] * 7 and max(lens) == 5 and len(lens) < 20  # 4 looked-up tokens + the bonus per round
    assert stats_of(r, 1).lookup_tokens > 0 and r.stats["levels"][1]["lookup_tokens"] == stats_of(r, 1).lookup_tokens
    r = ChainDecoder([t, d], draft=D(1), max_seq_len=64).generate([0], 40)
    assert stats_of(r, 0).accept_lengths == [1] * 40 and stats_of(r, 1).lookup_tokens == 0


def test_lookup_blocks_grow_with_the_suffix_they_match():
    # counting 0..7 over and over: the first repeat matches 2 tokens ([0, 1] after [7]: nothing before the first 0),
    # so its block is RUN_PER_MATCH * 2 tokens; later the text matches 8 tokens and the blocks reach draft_lookup
    t, d = ScriptLevel(shift_fn(1), "t"), ScriptLevel(shift_fn(2), "d")
    r = ChainDecoder([t, d], draft=D(1, lookup=20), max_seq_len=128).generate([0], 100)
    assert r.token_ids == [i % 8 for i in range(1, 101)]
    lens = stats_of(r, 0).accept_lengths
    looked = [n for n in lens if n > 1]
    assert looked[0] == 2 * RUN_PER_MATCH + 1 and max(lens) == 21  # the bonus token on top of each block


def test_draft_lookup_continues_the_drafts_block():
    # [7, 1] never occurred before, so the round starts with the draft; its token 2 makes the text end in [1, 2],
    # which the prompt holds, and prompt lookup finishes the block from there: 3, 4 (right), then 7 (wrong)
    t, d = ScriptLevel(shift_fn(1), "t"), ScriptLevel(shift_fn(1), "d")
    prompt = [1, 2, 3, 4, 7, 1]
    r = ChainDecoder([t, d], draft=D(1, lookup=4), max_seq_len=64).generate(prompt, 12)
    assert r.token_ids == [(2 + i) % 8 for i in range(12)]
    assert stats_of(r, 0).accept_lengths[0] == 4  # 2, 3, 4 accepted and the target's 5
    assert stats_of(r, 1).lookup_tokens >= 3
    r = ChainDecoder([t, d], draft=D(1), max_seq_len=64).generate(prompt, 12)
    assert stats_of(r, 0).accept_lengths[0] == 2 and stats_of(r, 1).lookup_tokens == 0


def test_lookup_finishing_a_block_stops_at_an_eos_and_the_budget():
    # as above: the draft's 2 lets lookup continue with 3, 4, 7; an EOS (4) or the end of the budget cuts that run
    t, d = ScriptLevel(shift_fn(1), "t"), ScriptLevel(shift_fn(1), "d")
    prompt = [1, 2, 3, 4, 7, 1]
    dec = ChainDecoder([t, d], draft=D(1, lookup=4), max_seq_len=64)
    r = dec.generate(prompt, 12, eos_token_ids={4})
    assert r.token_ids == [2, 3, 4] and stats_of(r, 1).lookup_tokens == 2  # 3 and the EOS, not the 7 after it
    r = dec.generate(prompt, 3)
    assert r.token_ids == [2, 3, 4] and stats_of(r, 1).lookup_tokens == 2  # room for 3 new tokens: 2, then 3, 4
    assert stats_of(r, 1).tokens_emitted == 1  # the draft's own token only


def test_dual_some_accepted_and_rollback_state():
    t = ScriptLevel(shift_fn(1), "t")
    d = ScriptLevel(shift_fn(1, wrong_at=frozenset({3})), "d")  # proposes 4 instead of 3 after [0, 1, 2]
    dec = ChainDecoder([t, d], draft=D(3))
    r = dec.generate([0], 6)
    assert r.token_ids == [1, 2, 3, 4, 5, 6]
    assert stats_of(r, 0).accept_lengths == [3, 3]
    assert (stats_of(r, 0).forward_passes, stats_of(r, 1).forward_passes) == (2, 6)
    # Stop right after the rejection: every cache holds exactly a prefix of the committed sequence.
    r = dec.generate([0], 3)
    seq = [0] + r.token_ids
    assert seq == [0, 1, 2, 3]
    assert t.tokens == [0, 1, 2]  # verified [0, 1, 2, 4], rolled back past the rejected 4
    assert d.tokens == [0, 1, 2]  # processed 0, 1, 2 to propose 1, 2, 4; nothing to roll back
    # A full acceptance: the target verified the whole block, the draft never processed its last proposal.
    r = dec.generate([5], 2)
    assert r.token_ids == [6, 7] and t.tokens == [5, 6, 7] and d.tokens == [5, 6]


def test_chain_scripted_stats():
    """target = mid = +1, draft = +2: the mid rejects every draft block, the target accepts the mid's blocks."""
    t, m, d = ScriptLevel(shift_fn(1), "t"), ScriptLevel(shift_fn(1), "m"), ScriptLevel(shift_fn(2), "d")
    r = ChainDecoder([t, m, d], draft=D(2), mu=[3]).generate([0], 4)
    assert r.token_ids == [1, 2, 3, 4]
    assert stats_of(r, 0).accept_lengths == [4]  # the mid's 3 tokens + the target's bonus
    assert stats_of(r, 1).accept_lengths == [1, 1, 1]
    assert stats_of(r, 2).forward_passes == 6
    assert r.stats["beta"] == 2.0 and r.stats["mode"] == "chain"
    assert t.tokens == [0, 1, 2, 3] and m.tokens[:3] == [0, 1, 2] and len(m.tokens) <= 4


def test_scripted_at_temperature_one():
    """Fixed distributions at T = 1: p == q always accepts; zero target mass on the draft's support never does."""
    spread = torch.tensor([-1e9, -1e9, 0.0, 0.0, 0.0, 0.0])  # draft mass on 2..5 only

    def target_fn(ctx):
        return torch.tensor([1.0, 0.5, -1e9, -1e9, -1e9, -1e9])  # target mass on 0, 1 only

    same = ChainDecoder([ScriptLevel(lambda c: spread, "t"), ScriptLevel(lambda c: spread, "d")], draft=D(3))
    r = same.generate([0], 8, SamplingParams(temperature=1.0), seed=3)
    assert r.level_stats[0].accept_lengths == [4, 4]
    assert all(2 <= x <= 5 for x in r.token_ids)
    never = ChainDecoder([ScriptLevel(target_fn, "t"), ScriptLevel(lambda c: spread, "d")], draft=D(3))
    r = never.generate([0], 8, SamplingParams(temperature=1.0), seed=3)
    assert r.level_stats[0].accept_lengths == [1] * 8
    assert all(x in (0, 1) for x in r.token_ids)


# -- greedy == AR ------------------------------------------------------------------------------------------------


def _greedy_ar(target_table, prompt, n, v, eos=frozenset()):
    return ChainDecoder([TableLevel(target_table, "ar", order=2)]).generate(prompt, n, eos_token_ids=eos).token_ids


@pytest.mark.parametrize("v, prompt, n", [(16, [3, 1, 4], 40), (5, [2], 25)])
def test_greedy_every_mode_equals_ar(v, prompt, n):
    target, mid, draft = tables(v, seed=v)
    ar = _greedy_ar(target, prompt, n, v)
    assert len(ar) == n
    g = torch.Generator().manual_seed(1)
    mid2 = target + torch.randn(v * v, v, generator=g) * 1.0
    configs = [
        ([TableLevel(target, "t", 2), TableLevel(draft, "d")], {"draft": D(4)}),
        ([TableLevel(target, "t", 2), TableLevel(draft, "d")], {"draft": D(1)}),
        ([TableLevel(target, "t", 2), TableLevel(draft, "d")], {"draft": D(5, lookup=0)}),
        ([TableLevel(target, "t", 2)], {"draft": D(source="lookup", lookup=4)}),
        ([TableLevel(target, "t", 2), TableLevel(draft, "d")], {"draft": D(1, lookup=4)}),
        ([TableLevel(target, "t", 2), TableLevel(mid, "m", 2), TableLevel(draft, "d")], {"draft": D(3), "mu": [5]}),
        ([TableLevel(target, "t", 2), TableLevel(mid, "m", 2), TableLevel(draft, "d")], {"draft": D(5), "mu": [1]}),
        ([TableLevel(target, "t", 2), TableLevel(mid, "m", 2)], {"draft": D(source="lookup", lookup=3), "mu": [3]}),
        ([TableLevel(target, "t", 2), TableLevel(mid, "m", 2), TableLevel(draft, "d")],
         {"draft": D(2, lookup=3), "mu": [3]}),
        ([TableLevel(target, "t", 2), TableLevel(mid, "m", 2), TableLevel(mid2, "m2", 2), TableLevel(draft, "d")],
         {"draft": D(2), "mu": [6, 3]}),
    ]
    some_rejected = some_multi = False
    for levels, kw in configs:
        r = ChainDecoder(levels, max_seq_len=64, **kw).generate(prompt, n)
        assert r.token_ids == ar, (kw, r.stats)
        lens = r.level_stats[0].accept_lengths
        some_multi |= max(lens) > 1
        some_rejected |= any(min(s.accept_lengths, default=99) == 1 for s in r.level_stats[:-1])
        for lv in levels:  # every cache holds a prefix of the committed sequence
            assert lv.tokens == (prompt + ar)[:lv.cache_len]
    assert some_multi and some_rejected  # the configurations do exercise acceptance and rejection


def test_greedy_stops_at_the_first_eos_including_it():
    v = 16
    target, mid, draft = tables(v, seed=16)
    prompt = [3, 1, 4]
    full = _greedy_ar(target, prompt, 40, v)
    eos = full[7]
    cut = full[:full.index(eos) + 1]
    assert _greedy_ar(target, prompt, 40, v, eos=frozenset({eos, 999})) == cut
    for levels, kw in [([TableLevel(target, "t", 2), TableLevel(draft, "d")], {"draft": D(4)}),
                       ([TableLevel(target, "t", 2), TableLevel(mid, "m", 2), TableLevel(draft, "d")],
                        {"draft": D(3), "mu": [4]})]:
        r = ChainDecoder(levels, **kw).generate(prompt, 40, eos_token_ids={eos})
        assert r.token_ids == cut
        assert r.stats["new_tokens"] == len(cut)


def test_on_tokens_streams_every_round_and_can_stop_early():
    v = 16
    target, mid, draft = tables(v, seed=16)
    dec = ChainDecoder([TableLevel(target, "t", 2), TableLevel(mid, "m", 2), TableLevel(draft, "d")], mu=[3])
    rounds: list[list[int]] = []
    r = dec.generate([3, 1, 4], 30, on_tokens=lambda toks: rounds.append(toks))
    assert [t for rd in rounds for t in rd] == r.token_ids
    assert [len(rd) for rd in rounds] == r.level_stats[0].accept_lengths  # one call per target verification
    seen: list[int] = []

    def stop_after_ten(toks):
        seen.extend(toks)
        return len(seen) >= 10

    cut = dec.generate([3, 1, 4], 30, on_tokens=stop_after_ten)
    assert 10 <= len(cut.token_ids) < 10 + max(len(rd) for rd in rounds) and cut.token_ids == r.token_ids[:len(seen)]


def test_sampling_is_deterministic_given_the_seed():
    v = 8
    target, mid, draft = tables(v)
    dec = ChainDecoder([TableLevel(target, "t", 2), TableLevel(mid, "m", 2), TableLevel(draft, "d")], mu=[3])
    sp = SamplingParams(temperature=1.0, top_p=0.9)
    a = dec.generate([1, 2], 30, sp, seed=7).token_ids
    assert dec.generate([1, 2], 30, sp, seed=7).token_ids == a
    assert any(dec.generate([1, 2], 30, sp, seed=s).token_ids != a for s in range(8, 11))


# -- the exact target distribution at T > 0 ------------------------------------------------------------------------


def chi2_critical(df: int, alpha: float) -> float:
    """Upper alpha quantile of chi-square(df) (Wilson-Hilferty approximation)."""
    z = NormalDist().inv_cdf(1 - alpha)
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def exact_joint(target: TableLevel, prompt: list[int], sp: SamplingParams, depth: int = 3) -> torch.Tensor:
    """P(x1..x_depth | prompt) under the warped target, flattened [V ** depth] in itertools.product order."""
    v = target.vocab_size
    out = []
    for xs in itertools.product(range(v), repeat=depth):
        prob = 1.0
        for j in range(depth):
            row = warp(target.next_logits(prompt + list(xs[:j])), sp.temperature, sp.top_p, sp.top_k)
            prob *= float(row[xs[j]])
        out.append(prob)
    return torch.tensor(out, dtype=torch.float64)


def chi2_against(dec: ChainDecoder, target: TableLevel, prompt, sp, n: int, seed0: int = 0) -> tuple[float, float]:
    """(Pearson statistic, critical value at alpha = 1e-3) of the first 3 generated tokens over n seeded runs;
    cells with expected count < 5 are pooled into one."""
    v = target.vocab_size
    counts = torch.zeros(v ** 3, dtype=torch.float64)
    for s in range(n):
        a, b, c = dec.generate(prompt, 3, sp, seed=seed0 + s).token_ids
        counts[(a * v + b) * v + c] += 1
    probs = exact_joint(target, prompt, sp)
    expected = probs * n
    big = expected >= 5
    e = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    o = torch.cat([counts[big], counts[~big].sum().reshape(1)])
    assert not (o[e == 0] > 0).any(), "a token sequence the warped target gives probability 0 was generated"
    keep = e > 0
    stat = float(((o[keep] - e[keep]) ** 2 / e[keep]).sum())
    return stat, chi2_critical(int(keep.sum()) - 1, 1e-3)


V_DIST = 4


def dist_levels(n_levels: int):
    """Target (order 2), a verifier near it, and a draft unrelated to both: plenty of rejections at every level."""
    target, mid, _ = tables(V_DIST, seed=11)
    draft = torch.randn(V_DIST, V_DIST, generator=torch.Generator().manual_seed(99)) * 2.0
    t = TableLevel(target, "t", 2)
    levels = {2: [t, TableLevel(draft, "d")],
              3: [t, TableLevel(mid, "m", 2), TableLevel(draft, "d")]}[n_levels]
    return t, levels


@pytest.mark.parametrize("n_levels, sp, mu", [
    (2, SamplingParams(temperature=1.0), None),
    (3, SamplingParams(temperature=1.0), [2]),
    (3, SamplingParams(temperature=0.8, top_p=0.85, top_k=3), [3]),
])
def test_output_distribution_is_the_warped_target(n_levels, sp, mu):
    t, levels = dist_levels(n_levels)
    dec = ChainDecoder(levels, draft=D(2), mu=mu, max_seq_len=16)
    stat, crit = chi2_against(dec, t, [1], sp, n=1000)
    assert stat < crit, (stat, crit)


@pytest.mark.parametrize("n_levels, sp, mu", [
    (2, SamplingParams(temperature=1.0), None),
    (3, SamplingParams(temperature=0.8, top_p=0.85, top_k=3), [2]),
])
def test_lookup_blocks_keep_the_distribution(n_levels, sp, mu):
    t, levels = dist_levels(n_levels)
    prompt = [1, 2, 1, 2, 1]  # its suffix repeats: the first round's block is prompt lookup's
    dec = ChainDecoder(levels, draft=D(2, lookup=2), mu=mu, max_seq_len=24)
    stat, crit = chi2_against(dec, t, prompt, sp, n=1000)
    assert stat < crit, (stat, crit)
    assert dec.generate(prompt, 6, sp, seed=3).level_stats[-1].lookup_tokens > 0


@pytest.mark.parametrize("n_levels, sp, mu", [
    (1, SamplingParams(temperature=1.0), None),
    (2, SamplingParams(temperature=0.8, top_p=0.85, top_k=3), [2]),
])
def test_prompt_lookup_alone_keeps_the_distribution(n_levels, sp, mu):
    """draft.source lookup: every level verifies and prompt lookup drafts below the last (no model)."""
    t, levels = dist_levels(n_levels + 1)
    prompt = [1, 2, 1, 2, 1]
    dec = ChainDecoder(levels[:n_levels], draft=D(source="lookup", lookup=3), mu=mu, max_seq_len=24)
    stat, crit = chi2_against(dec, t, prompt, sp, n=1000)
    assert stat < crit, (stat, crit)
    r = dec.generate(prompt, 6, sp, seed=3)
    assert r.level_stats[-1].name == "lookup" and r.level_stats[-1].lookup_tokens > 0
    assert r.stats["mode"] == ("dual" if n_levels == 1 else "chain")


@pytest.mark.parametrize("n_levels, sp, mu", [
    (2, SamplingParams(temperature=1.0), None),
    (3, SamplingParams(temperature=0.8, top_p=0.85, top_k=3), [2]),
])
def test_blocks_lookup_finishes_keep_the_distribution(n_levels, sp, mu, monkeypatch):
    t, levels = dist_levels(n_levels)
    # [2, 3] is new, so the round starts with the draft; its 0 or 1 makes [3, 0] or [3, 1], both in the prompt, and
    # prompt lookup finishes the block
    prompt = [3, 0, 3, 1, 2, 2, 3]
    tails = []  # whether prompt lookup finished the draft's block (LinearDrafter._tail)
    tail = LinearDrafter._tail
    monkeypatch.setattr(LinearDrafter, "_tail", lambda self, *a: tails.append(tail(self, *a)) or tails[-1])
    dec = ChainDecoder(levels, draft=D(1, lookup=3), mu=mu, max_seq_len=24)
    stat, crit = chi2_against(dec, t, prompt, sp, n=1000)
    assert stat < crit, (stat, crit)
    assert sum(tails) > 100


def test_lookup_rows_that_are_not_one_hot_fail_the_same_check(monkeypatch):
    """The lookup tokens verified against the draft's own row instead of their one-hot rows: the test has power."""
    t, levels = dist_levels(2)
    tail = LinearDrafter._tail

    def wrong(self, st, full, tokens, probs, q, room):
        n = tail(self, st, full, tokens, probs, q, room)
        probs[len(probs) - n:] = [q] * n
        return n

    monkeypatch.setattr(LinearDrafter, "_tail", wrong)
    dec = ChainDecoder(levels, draft=D(1, lookup=3), max_seq_len=24)
    stat, crit = chi2_against(dec, t, [3, 0, 3, 1, 2, 2, 3], SamplingParams(temperature=1.0), n=1000)
    assert stat > crit, (stat, crit)


@pytest.mark.parametrize("n_levels, mu", [(2, None), (3, [2])])
def test_wrong_residual_fails_the_same_check(monkeypatch, n_levels, mu):
    """Resampling from p instead of normalise(max(0, p - q)) at a rejection biases the output: the test has power."""
    t, levels = dist_levels(n_levels)
    monkeypatch.setattr(sampling, "residual", lambda p, q: p)
    dec = ChainDecoder(levels, draft=D(2), mu=mu, max_seq_len=16)
    stat, crit = chi2_against(dec, t, [1], SamplingParams(temperature=1.0), n=1000)
    assert stat > crit, (stat, crit)


@pytest.mark.parametrize("n_levels, mu, tree", [(2, None, None), (3, [2], None),
                                                 (2, None, D(tree=(3, 2, 5)))])
def test_a_draft_with_zero_probability_tokens_keeps_the_distribution(n_levels, mu, tree):
    """A draft restricted to part of the vocabulary (EagleHead.set_draft_vocab: logits -inf elsewhere) proposes only
    from that part; tokens outside it come from the residual, and the output is still the warped target."""
    t, levels = dist_levels(n_levels)
    sparse = levels[-1].table.clone()
    sparse[:, [0, 2]] = float("-inf")  # half of the vocabulary is never proposed
    levels[-1] = TableLevel(sparse, "d")
    dec = ChainDecoder(levels, draft=tree or D(2), mu=mu, max_seq_len=16)
    stat, crit = chi2_against(dec, t, [1], SamplingParams(temperature=1.0), n=1000)
    assert stat < crit, (stat, crit)


# -- the EAGLE-2 draft tree ----------------------------------------------------------------------------------------

TREES = [D(tree=(3, 4, 10)), D(tree=(1, 1, 1)), D(tree=(4, 6, 8)), D(tree=(2, 3, 40)),
         D(tree=(3, 4, 10), lookup=6), D(tree=(1, 1, 1), lookup=4), D(tree=(2, 1, 2), lookup=4)]


@pytest.mark.parametrize("tp", TREES, ids=lambda d: d.text())
@pytest.mark.parametrize("v, prompt, n", [(16, [3, 1, 4], 40), (5, [2], 25)])
def test_tree_greedy_equals_ar_and_caches_hold_the_sequence(tp, v, prompt, n):
    target, mid, draft = tables(v, seed=v)
    ar = _greedy_ar(target, prompt, n, v)
    for levels, kw in [([TableLevel(target, "t", 2), TableLevel(draft, "d")], {}),
                       ([TableLevel(target, "t", 2), TableLevel(mid, "m", 2), TableLevel(draft, "d")], {"mu": [4]})]:
        r = ChainDecoder(levels, max_seq_len=64, draft=tp, **kw).generate(prompt, n)
        assert r.token_ids == ar, (tp, r.stats)
        for lv in levels:  # tree entries are pruned: every cache holds a prefix of the committed sequence
            assert lv.tokens == (prompt + ar)[:lv.cache_len], lv.name
        assert r.stats["draft"] == tp.model_dump()
        verifier = r.level_stats[-2]
        assert verifier.forward_passes >= len(verifier.accept_lengths)
        assert max(verifier.accept_lengths) <= max(tp.tree.depth, tp.lookup) + 1


def test_lookup_accepts_what_a_tree_misses_when_the_text_repeats():
    """A greedy trigram target falls into a cycle; a draft that is mostly wrong then gains prompt lookup's blocks,
    which repeat the cycle: tokens per verification rise, the output stays ar's."""
    v = 12
    target, _, _ = tables(v, seed=5)
    g = torch.Generator().manual_seed(6)
    draft = torch.randn(v, v, generator=g) * 3.0  # unrelated to the target
    prompt, n = [3, 1, 4], 80
    ar = _greedy_ar(target, prompt, n, v)
    assert len(set(ar[-20:])) < 20  # the target's own text repeats

    def run(tp):
        dec = ChainDecoder([TableLevel(target, "t", 2), TableLevel(draft, "d")], max_seq_len=160, draft=tp)
        r = dec.generate(prompt, n)
        assert r.token_ids == ar
        return r.level_stats[0].mean_accepted

    plain = run(D(tree=(2, 3, 6)))
    assert run(D(tree=(2, 3, 6), lookup=8)) > plain + 1.0


def test_a_tree_round_verifies_the_repeated_text_alone_and_drafts_no_tree_for_it():
    """Where the last 2+ tokens occurred before, the round verifies prompt lookup's continuation without a draft
    forward; elsewhere the draft's tree alone. The output stays ar's, and the draft runs fewer forwards than the target
    verifies."""
    v = 12
    target, _, _ = tables(v, seed=5)
    draft = torch.randn(v, v, generator=torch.Generator().manual_seed(6)) * 3.0  # unrelated to the target
    prompt, n = [3, 1, 4], 80
    ar = _greedy_ar(target, prompt, n, v)

    def run(tp):
        levels = [TableLevel(target, "t", 2), TableLevel(draft, "d")]
        r = ChainDecoder(levels, max_seq_len=160, draft=tp).generate(prompt, n)
        assert r.token_ids == ar
        return len(r.level_stats[0].accept_lengths), r.level_stats[1]

    rounds, draft_stats = run(D(tree=(2, 1, 2), lookup=4))
    assert draft_stats.lookup_tokens > 0 and draft_stats.forward_passes < rounds - 10
    rounds, draft_stats = run(D(tree=(2, 1, 2)))  # no lookup: a tree every round
    assert draft_stats.lookup_tokens == 0 and draft_stats.forward_passes >= rounds


@pytest.mark.parametrize("n_lin", [0, 1, 3])
def test_a_tree_forwards_mask_lets_each_node_see_its_ancestors_and_the_context(n_lin):
    """ancestor_mask, cell by cell against its definition: the context rows causal, each node row the context, the
    node and its ancestors (columns through col), nothing else; the draft forward's case (no context rows, columns of
    nodes already in the cache) and the verification's."""
    from polyspec.decode.drafting.tree import ancestor_mask

    parents = [-1, -1, 0, 0, 2, 1, 4]
    nodes, col = [2, 4, 5, 6], {0: 7, 1: 6, 2: 5, 3: 4, 4: 3, 5: 2, 6: 1}
    width = n_lin + 8
    col = {n: n_lin + c for n, c in col.items()}
    want = torch.zeros(n_lin + len(nodes), width, dtype=torch.bool)
    want[:n_lin, :n_lin] = torch.ones(n_lin, n_lin, dtype=torch.bool).tril()
    for r, node in enumerate(nodes, start=n_lin):
        want[r, :n_lin] = True
        while node != -1:
            want[r, col[node]] = True
            node = parents[node]
    assert torch.equal(ancestor_mask(n_lin, width, nodes, parents, col), want)
    assert ancestor_mask(0, 3, [], parents, col).shape == (0, 3)


def test_tree_accepts_more_than_a_linear_draft_of_the_same_depth():
    """A draft whose top-1 is often wrong but whose top-3 holds the target's token: the tree keeps the right branch."""
    v = 16
    target, _, _ = tables(v, seed=21)
    g = torch.Generator().manual_seed(22)
    draft = target.reshape(v, v, v).mean(0) + torch.randn(v, v, generator=g) * 1.5
    prompt = [3, 1, 4]

    def mean_acc(tree):
        dec = ChainDecoder([TableLevel(target, "t", 2), TableLevel(draft, "d")], draft=tree or D(4), max_seq_len=128)
        return dec.generate(prompt, 60).level_stats[0].mean_accepted

    assert mean_acc(D(tree=(4, 4, 24))) > mean_acc(None) + 0.2


@pytest.mark.parametrize("n_levels, sp, mu, tp", [
    (2, SamplingParams(temperature=1.0), None, D(tree=(2, 3, 6))),
    (2, SamplingParams(temperature=0.7, top_k=3), None, D(tree=(3, 2, 12))),
    (3, SamplingParams(temperature=1.0), [2], D(tree=(3, 3, 8))),
    (3, SamplingParams(temperature=0.8, top_p=0.85, top_k=3), [3], D(tree=(3, 2, 5))),
    (2, SamplingParams(temperature=1.0), None, D(tree=(2, 3, 6), lookup=4)),
])
def test_tree_output_distribution_is_the_warped_target(n_levels, sp, mu, tp):
    t, levels = dist_levels(n_levels)
    dec = ChainDecoder(levels, mu=mu, max_seq_len=16, draft=tp)
    stat, crit = chi2_against(dec, t, [1], sp, n=1000)
    assert stat < crit, (stat, crit)


def _verify_without_renormalising(p, q, candidates, generator):
    """Broken on purpose: tries every candidate against the unchanged q (as if drawn with replacement)."""
    r = p.double()
    for j, x in enumerate(candidates):
        if float(sampling.uniform(generator)) * float(q[x]) < float(r[x]):
            return j, x
        r = sampling.residual(r, q.double())
    return None, sampling.sample(r, generator)


@pytest.mark.parametrize("n_levels, mu", [(2, None), (3, [2])])
@pytest.mark.parametrize("broken", ["candidates-q-unchanged", "top-k-candidates"])
def test_broken_tree_verification_fails_the_same_check(monkeypatch, n_levels, mu, broken):
    """The distribution test has power against the two classic mistakes of multi-candidate verification: keeping q
    after a rejected candidate, and deterministic top-k candidates at T > 0 (not a sample of q)."""
    from polyspec.decode.drafting import tree as tree_mod

    if broken == "candidates-q-unchanged":
        monkeypatch.setattr(tree_mod, "verify_candidates", _verify_without_renormalising)
    else:
        def top_k_children(q, k, generator):
            top = torch.topk(q, min(k, int((q > 0).sum())))
            return top.indices.tolist(), top.values.double().tolist()

        monkeypatch.setattr(tree_mod, "sample_without_replacement", top_k_children)
    t, levels = dist_levels(n_levels)
    dec = ChainDecoder(levels, mu=mu, max_seq_len=16, draft=D(tree=(3, 3, 8)))
    stat, crit = chi2_against(dec, t, [1], SamplingParams(temperature=1.0), n=1000)
    assert stat > crit, (stat, crit)


def test_sample_without_replacement_is_sequential_sampling():
    p = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0])
    g = torch.Generator().manual_seed(0)
    n = 20000
    pairs = torch.zeros(5, 5)
    for _ in range(n):
        (a, b), (pa, pb) = sampling.sample_without_replacement(p, 2, g)
        assert (pa, pb) == (float(p[a]), float(p[b]))  # each token with its probability
        pairs[a, b] += 1
    expected = torch.zeros(5, 5)
    for a in range(5):
        for b in range(5):
            if a != b and p[a] > 0:
                expected[a, b] = p[a] * p[b] / (1 - p[a]) * n
    assert pairs[4].sum() == 0 and pairs[:, 4].sum() == 0  # never a zero-probability token
    keep = expected > 0
    stat = float(((pairs[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    assert stat < chi2_critical(int(keep.sum()) - 1, 1e-3), stat
    tokens, probs = sampling.sample_without_replacement(p, 10, g)
    assert len(tokens) == len(probs) == 4 and 4 not in tokens  # the support bounds k


def test_verify_candidates_returns_an_exact_sample_of_p():
    g = torch.Generator().manual_seed(1)
    p = torch.tensor([0.05, 0.4, 0.3, 0.15, 0.1])
    q = torch.tensor([0.5, 0.1, 0.1, 0.2, 0.1])
    n = 20000
    counts = torch.zeros(5)
    for _ in range(n):
        cands, _ = sampling.sample_without_replacement(q, 3, g)
        j, x = sampling.verify_candidates(p, q, cands, g)
        assert j is None or cands[j] == x
        counts[x] += 1
    stat = float(((counts - p * n) ** 2 / (p * n)).sum())
    assert stat < chi2_critical(4, 1e-3), (counts / n, stat)
    one_hot = torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0])
    assert sampling.verify_candidates(one_hot, q, [0, 2, 3], g) == (1, 2)  # greedy: argmax matching
    assert sampling.verify_candidates(one_hot, q, [0, 3], g) == (None, 2)


def _verify_one_by_one(p, q, candidates, generator):
    """verify_candidates written as the textbook loop: read, test and update per candidate on the host."""
    r, qq = p.double(), q.double().clone()
    for j, x in enumerate(candidates):
        if float(sampling.uniform(generator)) * float(qq[x]) < float(r[x]):
            return j, x
        r = sampling.residual(r, qq)
        qq[x] = 0.0
        if float(qq.sum()) <= 0:
            break
        qq /= qq.sum()
    return None, sampling.sample(r, generator)


def test_verify_candidates_draws_what_the_one_by_one_loop_draws():
    """Computing the residual chain up front changes no decision and no draw: same result and generator state as the
    per-candidate loop, on random p, q and candidates (sparse rows, all-rejected and exhausted-q cases included)."""
    g = torch.Generator().manual_seed(5)
    for trial in range(300):
        v = int(torch.randint(2, 9, (), generator=g))
        p = torch.softmax(torch.randn(v, generator=g) * 3, -1) * (torch.rand(v, generator=g) > 0.3)
        q = torch.softmax(torch.randn(v, generator=g) * 3, -1) * (torch.rand(v, generator=g) > 0.2)
        p, q = (p / p.sum() if p.sum() > 0 else torch.eye(v)[0]), (q / q.sum() if q.sum() > 0 else torch.eye(v)[1])
        cands, _ = sampling.sample_without_replacement(q, int(torch.randint(1, v + 1, (), generator=g)), g)
        a, b = torch.Generator().manual_seed(trial), torch.Generator().manual_seed(trial)
        assert sampling.verify_candidates(p, q, cands, a) == _verify_one_by_one(p, q, cands, b), (p, q, cands)
        assert torch.equal(a.get_state(), b.get_state())


def test_draft_spec_bad_input():
    v = 8
    target, _, draft = tables(v)
    for bad in ("tree=0x5x32", "tree=8x0x32", "tree=8x5x0", "tree=8x5", "lookup=-1", "k=0", "k=1.5", "k=true",
                "source=lookup", "source=lookup,lookup=4,tree=2x2x2", "depth=3", "k"):
        with pytest.raises(PolyspecError, match="draft setting|tree=|draft settings"):
            DraftSpec.parse(bad)
    assert DraftSpec.parse("tree=2x1x2,lookup=6", D(7, vocab=99)).text() == "tree=2x1x2,lookup=6,vocab=99"
    assert DraftSpec.parse(DraftSpec.parse("k=3,lookup=5").text()) == D(3, lookup=5)
    with pytest.raises(PolyspecError, match="DraftSpec"):
        ChainDecoder([TableLevel(target, "t", 2), TableLevel(draft, "d")], draft={"k": 3})
    # one level and a model draft: plain decoding (there is no draft level)
    assert ChainDecoder([TableLevel(target, "t", 2)], draft=D(tree=(8, 5, 32))).mode == "ar"
    with pytest.raises(PolyspecError, match="forward_tree"):
        ChainDecoder([TableLevel(target, "t", 2), ScriptLevel(shift_fn(1), "d")], draft=D(tree=(8, 5, 32)))


# -- features for an EAGLE-style draft ---------------------------------------------------------------------------


def test_feature_draft_gets_true_features_and_matches_ar():
    v = 8
    target, mid, draft = tables(v, seed=3)
    g = torch.Generator().manual_seed(5)
    w = torch.randn(v, v, generator=g) * 0.3
    prompt = [1, 2, 3]
    ar = _greedy_ar(target, prompt, 30, v)
    for above in ([TableLevel(target, "t", 2)], [TableLevel(target, "t", 2), TableLevel(mid, "m", 2)]):
        head = FeatureLevel(draft, w)
        head.first_token = prompt[0]
        dec = ChainDecoder(above + [head], draft=D(3), mu=[4] if len(above) == 2 else None)
        r = dec.generate(prompt, 30)
        assert r.token_ids == ar
        stats = r.level_stats
        # the levels above prefilled the prompt (but its last token) before the first round: the head's first draft
        # finds their hidden states there, no catch-up pass needed
        assert sum(s.catch_up_passes for s in stats) == 0
        assert head.calls[0][0] == 1 and head.calls[0][1] == prompt  # the first forward covers the prompt
        n_own = n_true = n_redone = 0
        own_at: set[int] = set()  # positions whose current head entry was made from an own predicted feature
        for start, context, feats in head.calls:
            n_redone += sum(p >= start for p in own_at)  # entries rebuilt (from true features, checked below)
            own_at = {p for p in own_at if p < start}
            for j, f in enumerate(feats):
                p = start + j  # the input at position p pairs token context[p] with the feature of position p - 1
                if any(torch.equal(f, lv.next_logits(context[:p])) for lv in above):
                    n_true += 1  # a level above's hidden state for exactly this context
                    continue
                assert j == 0 and (f > 500).all(), (start, j)  # own predicted features only as a forward's first row
                n_own += 1
                own_at.add(p)
        assert n_true > 0 and n_redone > 0
        assert n_own > 0  # fresh drafts do run on the head's own predicted features


def test_catch_up_runs_the_level_above_when_a_feature_is_missing():
    """decode() prefills the levels above, so a generation never needs it; a draft asked for before the level above
    has seen the context makes that level catch up once, and then drafts from its true features."""
    from polyspec.decode.chain import _Run

    v = 8
    target, _, draft = tables(v, seed=3)
    prompt = [1, 2, 3]
    head = FeatureLevel(draft, torch.randn(v, v, generator=torch.Generator().manual_seed(5)) * 0.3)
    head.first_token = prompt[0]
    dec = ChainDecoder([TableLevel(target, "t", 2), head], draft=D(3))
    for lv in dec.levels:
        lv.reset()
    run = _Run(dec, SamplingParams(), torch.Generator().manual_seed(0), frozenset(), limit=20)
    tokens, q = run.drafter.propose(run.st, prompt, 3)
    assert len(tokens) == 3 and q is None  # T = 0: no rows (verification is argmax matching)
    assert run.st.stats[0].catch_up_passes == 1 and run.st.stats[0].forward_passes == 1
    assert run.st.seen[0] == prompt[:-1]  # the target caught up to the last feature the head needed


def test_feature_draft_with_one_token_prompt_proposes_nothing_first():
    v = 8
    target, _, draft = tables(v, seed=4)
    head = FeatureLevel(draft, torch.zeros(v, v))
    r = ChainDecoder([TableLevel(target, "t", 2), head], draft=D(3)).generate([5], 10)
    assert r.token_ids == _greedy_ar(target, [5], 10, v)
    assert r.level_stats[0].accept_lengths[0] == 1 and r.level_stats[0].catch_up_passes == 0


# -- bad input -----------------------------------------------------------------------------------------------------


def test_bad_input_raises():
    v = 8
    target, mid, draft = tables(v)
    dec = ChainDecoder([TableLevel(target, "t", 2), TableLevel(draft, "d")], max_seq_len=16)
    with pytest.raises(PolyspecError, match="temperature"):
        dec.generate([1], 4, SamplingParams(temperature=-1.0))
    with pytest.raises(PolyspecError, match="top_p"):
        dec.generate([1], 4, SamplingParams(temperature=1.0, top_p=0.0))
    with pytest.raises(PolyspecError, match="top_p"):
        dec.generate([1], 4, SamplingParams(temperature=1.0, top_p=1.01))
    with pytest.raises(PolyspecError, match="top_k"):
        dec.generate([1], 4, SamplingParams(top_k=-2))
    with pytest.raises(PolyspecError, match="max_seq_len"):
        dec.generate([1] * 10, 7)
    dec.generate([1] * 10, 6)  # exactly max_seq_len is fine
    with pytest.raises(PolyspecError, match="non-empty"):
        dec.generate([], 4)
    with pytest.raises(PolyspecError, match="max_new_tokens"):
        dec.generate([1], 0)
    with pytest.raises(PolyspecError, match="mu"):
        ChainDecoder([TableLevel(target, "t", 2), TableLevel(draft, "d")], mu=[4])
    with pytest.raises(PolyspecError, match="mu"):
        ChainDecoder([TableLevel(target, "t", 2), TableLevel(mid, "m", 2), TableLevel(draft, "d")], mu=[0])
    with pytest.raises(PolyspecError, match="read features"):
        ChainDecoder([TableLevel(target, "t", 2), FeatureLevel(draft, torch.zeros(v, v))], draft=D(source="lookup",
                                                                                                    lookup=2))
    with pytest.raises(PolyspecError, match="bottom"):
        ChainDecoder([TableLevel(target, "t", 2), FeatureLevel(draft, torch.zeros(v, v)), TableLevel(draft, "d")])
    with pytest.raises(PolyspecError, match="at least one"):
        ChainDecoder([])
    other = TableLevel(torch.zeros(5, 5), "small-vocab")
    with pytest.raises(PolyspecError, match="vocabulary"):
        ChainDecoder([TableLevel(target, "t", 2), other]).generate([1], 4)


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 3, 4]) == 3
    assert common_prefix([1, 2, 3], [1, 5, 3]) == 1
    assert common_prefix([], [1]) == 0
    a = list(range(100))
    b = a[:63] + [-1] + a[64:]
    assert common_prefix(a, b) == 63


# -- the engine adapters on tiny random Llamas ---------------------------------------------------------------------


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


needs_model = pytest.mark.skipif(not _has_module("polyspec.decode.model"),
                                 reason="polyspec.decode.model (the engine's Transformer) does not exist yet")
needs_head = pytest.mark.skipif(not _has_module("polyspec.decode.head"),
                                reason="polyspec.decode.head (EagleHead) does not exist yet")
needs_int4 = pytest.mark.skipif(not _has_module("polyspec.decode.int4"),
                                reason="polyspec.decode.int4 (quantize_model_rtn) does not exist yet")


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """A tiny random Llama target, its RTN int4 copy, a second random Llama (same vocab) and a random EagleHead."""
    from conftest import make_tiny_llama

    from polyspec.decode.model import Transformer

    root = tmp_path_factory.mktemp("chain_llamas")
    target = Transformer.from_pretrained(make_tiny_llama(root / "t", seed=0, tokenizer=None)).eval()
    other = Transformer.from_pretrained(make_tiny_llama(root / "o", seed=1, tokenizer=None)).eval()
    out = {"target": target, "other": other}
    if _has_module("polyspec.decode.int4"):
        from polyspec.decode.int4 import quantize_model_rtn

        out["int4"] = quantize_model_rtn(Transformer.from_pretrained(root / "t").eval(), group_size=128)
    if _has_module("polyspec.decode.head"):
        from polyspec.decode.head import EagleHead

        torch.manual_seed(0)
        out["head"] = EagleHead(target.args, target.embed_tokens, target.lm_head).eval()
    return out


def _kv_matches_fresh(model, tokens: list[int]) -> None:
    """The model's K/V cache up to cache_len equals a fresh run over the tokens it should hold (one token per
    forward, the decode-width path most live entries come from). An int4 level computes wide forwards (over 16
    positions: a wide tree) with torch's int4pack kernel, whose bf16 activations differ from the fp32 decode-width
    kernel by ~1e-3; its entries are compared at 1e-2 (a wrong rollback is off by O(1))."""
    from polyspec.decode.int4 import Int4Linear

    n = model.cache_len
    assert n <= len(tokens)
    tol = 1e-2 if any(isinstance(m, Int4Linear) for m in model.modules()) else 1e-4
    fresh = copy.deepcopy(model)
    fresh.setup_cache(64)
    with torch.inference_mode():
        for i in range(n):
            fresh(torch.tensor(tokens[i:i + 1]))
    for k_live, k_new, v_live, v_new in zip(model._cache.k, fresh._cache.k, model._cache.v, fresh._cache.v,
                                            strict=True):
        torch.testing.assert_close(k_live[:, :, :n], k_new[:, :, :n], atol=tol, rtol=tol)
        torch.testing.assert_close(v_live[:, :, :n], v_new[:, :, :n], atol=tol, rtol=tol)


@needs_model
def test_engine_greedy_dual_and_chain_equal_ar(tiny_models):
    from polyspec.decode.levels import ModelLevel

    t, o = tiny_models["target"], tiny_models["other"]
    prompt = [5, 17, 230, 9, 77]
    ar = ChainDecoder([ModelLevel(t, "t")], max_seq_len=64).generate(prompt, 24)
    assert len(ar.token_ids) == 24
    r = ChainDecoder([ModelLevel(t, "t"), ModelLevel(o, "o")], draft=D(3), max_seq_len=64).generate(prompt, 24)
    assert r.token_ids == ar.token_ids
    _kv_matches_fresh(t, prompt + r.token_ids)
    _kv_matches_fresh(o, prompt + r.token_ids)
    # A copy of the target as the draft: everything accepted (the cached block forward agrees with AR). The same
    # module cannot be two levels (each level owns its cache).
    with pytest.raises(PolyspecError, match="twice"):
        ChainDecoder([ModelLevel(t, "t"), ModelLevel(t, "t-again")])
    twin = copy.deepcopy(t)
    r = ChainDecoder([ModelLevel(t, "t"), ModelLevel(twin, "twin")], draft=D(3), max_seq_len=64).generate(prompt, 24)
    assert r.token_ids == ar.token_ids
    assert r.level_stats[0].accept_lengths == [4] * 6


@needs_model
@needs_int4
@needs_head
def test_engine_chain_with_int4_and_eagle_head_equals_ar(tiny_models):
    from polyspec.decode.levels import HeadLevel, ModelLevel

    t, q, o, h = (tiny_models[k] for k in ("target", "int4", "other", "head"))
    prompt = [5, 17, 230, 9, 77, 3]
    ar = ChainDecoder([ModelLevel(t, "t")], max_seq_len=64).generate(prompt, 20).token_ids
    for levels, kw in [
        ([ModelLevel(t, "t"), HeadLevel(h, "head")], {"draft": D(4)}),
        ([ModelLevel(t, "t"), ModelLevel(q, "int4"), HeadLevel(h, "head")], {"draft": D(3), "mu": [4]}),
        ([ModelLevel(t, "t"), ModelLevel(q, "int4"), ModelLevel(o, "other"), HeadLevel(h, "head")],
         {"draft": D(2), "mu": [4, 2]}),
    ]:
        r = ChainDecoder(levels, max_seq_len=64, **kw).generate(prompt, 20)
        assert r.token_ids == ar, r.stats
        seq = prompt + r.token_ids
        for lv in levels[:-1]:
            _kv_matches_fresh(lv.model, seq)
        assert h.cache_len <= len(seq) - 1
    # the int4 copy mostly agrees with its target: blocks do get accepted
    r = ChainDecoder([ModelLevel(t, "t"), ModelLevel(q, "int4")], draft=D(4), max_seq_len=64).generate(prompt, 20)
    assert r.token_ids == ar and max(r.level_stats[0].accept_lengths) > 1


@needs_model
@needs_head
def test_a_prefill_that_feeds_the_head_computes_its_last_logits_only(tiny_models, monkeypatch):
    from polyspec.decode.levels import HeadLevel, ModelLevel

    t, h = tiny_models["target"], tiny_models["head"]
    prompt = [5, 17, 230, 9, 77, 3, 41, 8]
    ar = ChainDecoder([ModelLevel(t, "t")], max_seq_len=64).generate(prompt, 16).token_ids
    rows: list[tuple[int, int]] = []  # (tokens in, logits rows out) of the target's forwards
    forward = type(t).forward

    @functools.wraps(forward)  # keeps the signature ModelLevel reads
    def spy(self, ids, **kw):
        out = forward(self, ids, **kw)
        rows.append((ids.shape[-1], out[0].shape[0]))
        return out

    monkeypatch.setattr(type(t), "forward", spy)
    r = ChainDecoder([ModelLevel(t, "t"), HeadLevel(h, "head")], draft=D(3), max_seq_len=64).generate(prompt, 16)
    assert r.token_ids == ar
    assert rows[0] == (len(prompt) - 1, 1)  # the prefill: every hidden state for the head, one row of logits
    assert all(n == m for n, m in rows[1:])  # a verification reads every row's logits


@needs_model
@needs_int4
@needs_head
@pytest.mark.parametrize("tp", [D(tree=(3, 4, 10)), D(tree=(4, 3, 40)),
                                D(tree=(3, 4, 10), lookup=6)],
                         ids=["budget-10", "budget-40", "lookup-6"])
def test_engine_tree_with_eagle_head_equals_ar(tiny_models, tp):
    """The tree through the engine: EagleHead expands depth by depth over its own tree-masked cache, the target (dual)
    or the int4 copy (chain) verifies the tree in one forward and compacts the accepted path into place."""
    from polyspec.decode.levels import HeadLevel, ModelLevel

    t, q, h = (tiny_models[k] for k in ("target", "int4", "head"))
    twin = copy.deepcopy(t)
    prompt = [5, 17, 230, 9, 77, 3]
    ar = ChainDecoder([ModelLevel(t, "t")], max_seq_len=64).generate(prompt, 20).token_ids
    for levels, kw in [
        ([ModelLevel(t, "t"), HeadLevel(h, "head")], {}),
        ([ModelLevel(t, "t"), ModelLevel(q, "int4"), HeadLevel(h, "head")], {"mu": [4]}),
        ([ModelLevel(t, "t"), ModelLevel(twin, "twin")], {}),  # a perfect draft: whole paths accepted
    ]:
        r = ChainDecoder(levels, max_seq_len=64, draft=tp, **kw).generate(prompt, 20)
        assert r.token_ids == ar, r.stats
        seq = prompt + r.token_ids
        for lv in levels[:-1]:
            _kv_matches_fresh(lv.model, seq)
        if levels[-1].name == "twin":
            lens = r.level_stats[0].accept_lengths
            shape = tp.tree
            if shape.total_tokens >= shape.top_k + (shape.depth - 1) * shape.top_k ** 2:  # nothing re-ranked away
                assert max(lens) == shape.depth + 1
            else:  # flat random-model distributions: re-ranking may drop the deep end of the argmax path
                assert max(lens) > 1
        else:
            assert h.cache_len <= len(seq) - 1
    sp = SamplingParams(temperature=0.9, top_p=0.95)
    dec = ChainDecoder([ModelLevel(t, "t"), ModelLevel(q, "int4"), HeadLevel(h, "head")], mu=[3], max_seq_len=64,
                       draft=tp)
    a, b = dec.generate(prompt, 16, sp, seed=4), dec.generate(prompt, 16, sp, seed=4)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 16


@needs_model
@needs_head
def test_engine_sampling_runs_and_is_deterministic(tiny_models):
    from polyspec.decode.levels import HeadLevel, ModelLevel

    t, o, h = tiny_models["target"], tiny_models["other"], tiny_models["head"]
    dec = ChainDecoder([ModelLevel(t, "t"), ModelLevel(o, "o"), HeadLevel(h, "head")], draft=D(3), mu=[3],
                       max_seq_len=64)
    sp = SamplingParams(temperature=0.9, top_p=0.95, top_k=50)
    a = dec.generate([1, 2, 3], 16, sp, seed=4)
    b = dec.generate([1, 2, 3], 16, sp, seed=4)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 16
    assert a.stats["tokens_per_second"] > 0 and a.stats["beta"] > 0


@needs_model
@needs_int4
@needs_head
def test_engine_with_a_draft_vocabulary_equals_ar(tiny_models):
    from polyspec.decode.levels import HeadLevel, ModelLevel

    t, q, h = (tiny_models[k] for k in ("target", "int4", "head"))
    head = copy.deepcopy(h)
    head.embed_tokens, head.lm_head = t.embed_tokens, t.lm_head
    head.token_counts = torch.randint(0, 100, (t.args.vocab_size,), generator=torch.Generator().manual_seed(1))
    head.set_draft_vocab(64)
    prompt = [5, 17, 230, 9, 77, 3]
    ar = ChainDecoder([ModelLevel(t, "t")], max_seq_len=64).generate(prompt, 20).token_ids
    kept = set(head.draft_ids.tolist())
    for levels, kw in [([ModelLevel(t, "t"), HeadLevel(head, "head")], {"draft": D(3)}),
                       ([ModelLevel(t, "t"), ModelLevel(q, "int4"), HeadLevel(head, "head")],
                        {"draft": D(3), "mu": [4]}),
                       ([ModelLevel(t, "t"), HeadLevel(head, "head")], {"draft": D(tree=(3, 3, 8))})]:
        r = ChainDecoder(levels, max_seq_len=64, **kw).generate(prompt, 20)
        assert r.token_ids == ar, r.stats
    sp = SamplingParams(temperature=0.9)
    dec = ChainDecoder([ModelLevel(t, "t"), HeadLevel(head, "head")], draft=D(3), max_seq_len=64)
    a, b = dec.generate(prompt, 16, sp, seed=2), dec.generate(prompt, 16, sp, seed=2)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 16
    assert len(kept) == 64


# -- host reads on the tree and sampling paths ----------------------------------------------------------------------

READS = ("tolist", "item", "__int__", "__float__", "__bool__", "__index__", "cpu", "numpy")
DECODE_LOOP = ("chain.py", "state.py", "linear.py", "tree.py", "lookup.py", "sampling.py", "levels.py")  # the loop


def _count_reads(monkeypatch) -> list[tuple[str, str, int]]:
    """Record every read of a tensor's values by Python (on an accelerator: a host sync) made from the decode loop's
    files, as (function, method, numel). Uniform draws of the run's CPU generator are host values, not device reads,
    and are skipped; model.py's reads (its checks of the host-built tree mask and compact indices) are not counted.
    sampling's reductions take the path they take on an accelerator (on the CPU they read numpy views instead)."""
    reads: list[tuple[str, str, int]] = []
    host: dict[int, torch.Tensor] = {}  # id -> tensor (kept alive so an id is never reused)
    draw = sampling.uniform

    def uniform(generator, n=None):
        u = draw(generator, n)
        host[id(u)] = u
        return u

    monkeypatch.setattr(sampling, "uniform", uniform)
    monkeypatch.setattr(sampling, "_host_array", lambda x: None)  # the reductions as on an accelerator
    for name in READS:
        method = getattr(torch.Tensor, name)

        def counted(self, *a, _method=method, _name=name, **kw):
            caller = sys._getframe(1).f_code
            if id(self) not in host and os.path.basename(caller.co_filename) in DECODE_LOOP:
                reads.append((caller.co_name, _name, self.numel()))
            return _method(self, *a, **kw)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return reads


@needs_model
@needs_head
@pytest.mark.parametrize("sp", [SamplingParams(), SamplingParams(temperature=0.9, top_p=0.95)], ids=["T0", "T0.9"])
def test_tree_reads_one_value_vector_per_node(monkeypatch, tiny_models, sp):
    """The tree path reads values back once per expanded draft node at T > 0 (its children and their
    probabilities, in one transfer), once per draft forward at T = 0 (all its rows' top-k at once), and, in the
    verification walk, once per visited node at T > 0 (the gathered acceptance values) plus the
    round's last sample, once per round at T = 0 (every row's argmax); nothing as wide as the vocabulary."""
    from polyspec.decode.drafting import tree as tree_mod
    from polyspec.decode.levels import HeadLevel, ModelLevel

    t, h = tiny_models["target"], tiny_models["head"]
    nodes = {"expanded": 0, "visited": 0, "calls": 0}
    children, expand, verify = tree_mod.sample_without_replacement, tree_mod._Drafting._expand, tree_mod.verify_candidates

    def counted_children(q, k, generator):
        nodes["calls"] += 1
        return children(q, k, generator)

    def counted_expand(self, nodes_, rows, depth):
        nodes["expanded"] += len(nodes_)
        nodes["calls"] += int(self.st.greedy)  # T = 0: one read for the whole forward's rows
        return expand(self, nodes_, rows, depth)

    def counted_verify(*a):
        nodes["visited"] += 1
        return verify(*a)

    monkeypatch.setattr(tree_mod, "sample_without_replacement", counted_children)
    monkeypatch.setattr(tree_mod._Drafting, "_expand", counted_expand)
    monkeypatch.setattr(tree_mod, "verify_candidates", counted_verify)
    dec = ChainDecoder([ModelLevel(t, "t"), HeadLevel(h, "head")], max_seq_len=96, draft=D(tree=(8, 5, 32)))
    reads = _count_reads(monkeypatch)
    r = dec.generate([5, 17, 230, 9, 77, 3], 32, sp, seed=0)
    monkeypatch.undo()
    rounds = len(r.level_stats[0].accept_lengths)
    in_draft = [x for x in reads if x[0] in ("_expand", "sample_without_replacement", "top_log_probs", "top_ids")]
    assert nodes["expanded"] > 2 * rounds and len(in_draft) == nodes["calls"], (nodes, reads)
    assert (nodes["calls"] < nodes["expanded"]) == (sp.temperature == 0), nodes
    per_round = len(reads) - len(in_draft) - nodes["visited"]
    assert 0 < per_round <= rounds, (rounds, nodes, reads)  # T = 0: the argmax rows; T > 0: the last sample
    assert nodes["visited"] == 0 if sp.temperature == 0 else nodes["visited"] >= rounds
    assert max(n for *_, n in reads) < t.args.vocab_size and not [x for x in reads if x[1] in ("cpu", "numpy")]


@needs_model
def test_linear_sampling_reads_once_per_drafted_token_and_twice_per_round(monkeypatch, tiny_models):
    """At T > 0 a linear round reads one sampled index per drafted token, then the block's gathered p(x), q(x) in one
    transfer and the correction or bonus token's index."""
    from polyspec.decode.levels import ModelLevel

    dec = ChainDecoder([ModelLevel(tiny_models["target"], "t"), ModelLevel(tiny_models["other"], "o")], draft=D(4),
                       max_seq_len=96)
    reads = _count_reads(monkeypatch)
    r = dec.generate([5, 17, 230, 9, 77, 3], 32, SamplingParams(temperature=0.9, top_p=0.95), seed=0)
    monkeypatch.undo()
    rounds, drafted = len(r.level_stats[0].accept_lengths), r.level_stats[1].tokens_emitted
    assert drafted > rounds and len(reads) <= drafted + 2 * rounds, (rounds, drafted, reads)
