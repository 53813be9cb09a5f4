"""A draft level with no model: prompt lookup (n-gram) proposals from the text so far.

At each position the level finds the earlier occurrence of the longest suffix of the sequence (prompt + generated
tokens) of ``max_n`` down to ``min_n`` tokens (of equally long ones, the most recent) and proposes the token that
followed it. Its distribution is one-hot on that token (logits 0 there, -inf elsewhere), so warped at any
temperature it stays one-hot and exact speculative sampling keeps it with probability p(x) and otherwise draws from p
without x: the chain stays exactly lossless at T = 0 and T > 0 (``tests/test_ngram.py``).

Where the sequence has no such suffix the level has no proposal (:meth:`NgramLevel.has_proposal` is False): the
decoder's draft loop stops there, so a round with nothing to propose is a plain decoding step of the level above,
not a wasted verification. It costs a list search per proposed token and reads no features, so it suits
summarisation, code editing and retrieval-style prompts, where the answer repeats the prompt (the paper's chain gains
least there).
"""

from __future__ import annotations

import torch

from polyspec.decode.levels import TokenCache
from polyspec.errors import PolyspecError

# The longest suffix matched. Where a 2-3 token suffix recurs at several places, the one whose preceding tokens match
# the context further back continues it more often: 8 raised replayed tokens per round by ~2 % over 3 on the target's
# own answers (docs/DECODE.md, "Prompt lookup: the longest suffix"); past 8 little changed.
MAX_SUFFIX = 8

# Where a lookup run is the whole block a verification reads (linear drafts, tree.lookup_first), its length is also
# capped at this many tokens per token of the suffix it starts from. A copy from a 2-token match is rejected at its
# first token about half the time, one from an 8-token match rarely, so short matches get short blocks (fewer rows to
# verify) and long ones long blocks: on the target's own answers to HumanEval and ShareGPT prompts, 3 (under a cap
# of 15) kept more tokens per verification than a flat cap of 8 in less estimated time per token (docs/DECODE.md,
# "Lookup runs as long as their match").
RUN_PER_MATCH = 3


def lookup_next(context: list[int], max_n: int = MAX_SUFFIX, min_n: int = 1) -> int | None:
    """The token after the earlier occurrence of the longest suffix of ``context`` of ``max_n`` down to ``min_n``
    tokens (of equally long ones, the most recent); None where no such suffix occurs earlier."""
    found = lookup_match(context, max_n, min_n)
    return None if found is None else found[0]


def lookup_match(context: list[int], max_n: int = MAX_SUFFIX, min_n: int = 1) -> tuple[int, int] | None:
    """:func:`lookup_next`'s token and the length of the suffix it matched, or None."""
    n = len(context)
    if n < 2 or max_n < max(min_n, 1):
        return None
    # earlier positions of the last token, found by list.index (C speed): a decoding round calls this on every
    # round, and most rounds find nothing
    last, ends, i = context[-1], [], 0
    try:
        while True:
            i = context.index(last, i, n - 1)
            ends.append(i + 1)  # an occurrence of the suffix ending here would be followed by context[i + 1]
            i += 1
    except ValueError:
        pass
    best, best_len = None, min_n - 1
    for end in reversed(ends):  # newest first: a later one must match strictly longer to replace it
        m = 1  # context[end - 1] is the last token
        while m < max_n and m < end and context[end - 1 - m] == context[n - 1 - m]:
            m += 1
        if m > best_len:
            best, best_len = end, m
            if m == max_n:
                break
    return None if best is None else (int(context[best]), best_len)


def lookup_run(context: list[int], n_tokens: int, max_n: int = MAX_SUFFIX, min_n: int = 1,
               per_match: int | None = None) -> list[int]:
    """Up to ``n_tokens`` tokens of prompt lookup continuing ``context``, each looked up after the ones before it.
    ``per_match``: also at most this many tokens per token of the suffix the run starts from (RUN_PER_MATCH where
    the run is the block a verification reads: a copy that starts from a longer match goes on longer)."""
    if per_match is not None and per_match < 1:
        raise PolyspecError(f"lookup_run: per_match must be >= 1 (or None: no cut), got {per_match}")
    run: list[int] = []
    while len(run) < n_tokens:
        found = lookup_match(context + run, max_n, min_n)
        if found is None:
            break
        if per_match is not None and not run:
            n_tokens = min(n_tokens, per_match * found[1])
        run.append(found[0])
    return run


class NgramLevel(TokenCache):
    """Prompt-lookup drafting as a chain level (see the module docstring); ``vocab_size``: the target's logits width."""

    kind = "ngram"
    needs_features = False

    def __init__(self, vocab_size: int, *, max_n: int = MAX_SUFFIX, min_n: int = 1, name: str = "ngram"):
        if not 1 <= min_n <= max_n:
            raise PolyspecError(f"NgramLevel {name!r}: need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        super().__init__()
        self.vocab_size, self.max_n, self.min_n, self.name = int(vocab_size), max_n, min_n, name
        self._last: tuple[list[int], int | None] = ([], None)  # the last context searched and its proposal

    def proposal(self, context: list[int]) -> int | None:
        """The token after the earlier occurrence of the longest matching suffix of ``context`` (lookup_next). The
        draft loop asks twice per position (has_proposal, then forward), so the last answer is kept: a list
        comparison instead of a second search."""
        if context == self._last[0]:
            return self._last[1]
        found = self._search(context)
        self._last = (list(context), found)
        return found

    def _search(self, context: list[int]) -> int | None:
        return lookup_next(context, self.max_n, self.min_n)

    def has_proposal(self, context: list[int]) -> bool:
        """Whether :meth:`proposal` finds one: the decoder's draft loop stops where it does not."""
        return self.proposal(context) is not None

    def _row(self, context: list[int]) -> torch.Tensor:
        """One-hot logits [V] on the proposal; a row without one is uniform (the draft loop never samples it)."""
        x = self.proposal(context)
        if x is None:
            return torch.zeros(self.vocab_size)
        if not 0 <= x < self.vocab_size:
            raise PolyspecError(f"NgramLevel {self.name!r}: token id {x} is outside the vocabulary of "
                                f"{self.vocab_size}")
        return torch.full((self.vocab_size,), float("-inf")).index_fill_(0, torch.tensor([x]), 0.0)

    def forward(self, tokens: list[int], start_pos: int, features: torch.Tensor | None = None, *,
                last_only: bool = False, logit_rows: int | None = None) -> tuple[torch.Tensor, None]:
        self.truncate(start_pos)
        self._check_room(len(tokens))
        first = len(self.tokens)
        self.tokens += [int(t) for t in tokens]
        rows = range(len(self.tokens) - 1, len(self.tokens)) if last_only else range(first, len(self.tokens))
        return torch.stack([self._row(self.tokens[:p + 1]) for p in rows]), None  # [T or 1, V]
