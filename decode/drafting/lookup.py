"""Prompt lookup: draft tokens copied from the text so far, no model.

Where the context's last 2+ tokens occurred before, the tokens that followed their latest earlier occurrence (the
longest matching suffix of up to ``MAX_SUFFIX`` tokens first) are proposed as a block, continued token by token and
cut at ``RUN_PER_MATCH`` tokens per matched suffix token. The block's draft rows are one-hot (at T = 0 none are
built), so warped at any temperature they stay one-hot and exact speculative sampling keeps each token with
probability p(x): the chain stays exactly lossless at T = 0 and T > 0. Whether lookup proposes, and what, depends
only on the context, so the block is a stopping time like any draft's.

It costs a list search per round and reads no features, so it suits summarisation, code editing and retrieval-style
prompts, where the answer repeats the prompt. :class:`LookupDrafter` is prompt lookup alone (``draft.source:
lookup``); the model drafters (decode/drafting/linear.py, tree.py) take its block first where it has one.
"""

from __future__ import annotations

from typing import Any

import torch

from polyspec.errors import PolyspecError

# The longest suffix matched. Where a 2-3 token suffix recurs at several places, the one whose preceding tokens match
# the context further back continues it more often: 8 raised replayed tokens per round by ~2 % over 3 on the target's
# own answers (docs/DECODE.md, "Prompt lookup: the longest suffix"); past 8 little changed.
MAX_SUFFIX = 8

# Where a lookup run is the whole block a verification reads (draft.lookup), its length is also
# capped at this many tokens per token of the suffix it starts from. A copy from a 2-token match is rejected at its
# first token about half the time, one from an 8-token match rarely, so short matches get short blocks (fewer rows to
# verify) and long ones long blocks: on the target's own answers to HumanEval and ShareGPT prompts, 3 (under a cap
# of 15) kept more tokens per verification than a flat cap of 8 in less estimated time per token (docs/DECODE.md,
# "Lookup runs as long as their match").
RUN_PER_MATCH = 3


def lookup_match(context: list[int], max_n: int = MAX_SUFFIX, min_n: int = 1) -> tuple[int, int] | None:
    """The token after the earlier occurrence of the longest suffix of ``context`` of ``max_n`` down to ``min_n``
    tokens (of equally long ones, the most recent), and that suffix's length; None where no such suffix occurs
    earlier."""
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


def lookup_block(st: Any, ctx: list[int], n: int) -> list[int]:
    """The round's prompt-lookup block after ``ctx``: up to ``n`` tokens (within the run's room), cut after an EOS;
    [] where the context's last 2+ tokens did not occur before."""
    run = lookup_run(ctx, min(n, st.limit - len(ctx)), min_n=2, per_match=RUN_PER_MATCH)
    return st.cut(run, len(run))


def lookup_rows(run: list[int], vocab: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The draft rows of prompt-lookup tokens at T > 0: one-hot rows [n, vocab]."""
    hot = torch.tensor(run, device=device)
    return torch.zeros(len(run), vocab, dtype=dtype, device=device).scatter_(1, hot[:, None], 1.0)


def proposed_block(st: Any, ctx: list[int], n: int) -> tuple[list[int], torch.Tensor | None] | None:
    """:func:`lookup_block` with its draft rows (None at T = 0), counted as lookup tokens of the run's drafter; None
    where lookup has nothing (or the vocabulary is not known yet: a one-token prompt's first round)."""
    if not n or st.vocab is None:
        return None
    run = lookup_block(st, ctx, n)
    if not run:
        return None
    st.draft_stats.lookup_tokens += len(run)
    return run, None if st.greedy else lookup_rows(run, st.vocab, torch.device("cpu"), torch.float32)


class LookupDrafter:
    """Prompt lookup alone drafts (``draft.source: lookup``): its block where it has one, else nothing (the round is
    a plain decoding step of the level above, not a wasted verification)."""

    has_level = False

    def __init__(self, lookup: int):
        if lookup < 1:
            raise PolyspecError(f"prompt lookup alone needs draft.lookup >= 1, got {lookup}")
        self.lookup = lookup

    def propose(self, st: Any, ctx: list[int], room: int) -> tuple[list[int], torch.Tensor | None]:
        found = proposed_block(st, ctx, min(self.lookup, room))
        if found is None:
            return [], None
        st.draft_stats.forward_passes += 1  # one proposal: Lemma 3.1's beta counts the drafter's rounds
        st.draft_stats.tokens_emitted += len(found[0])
        return found
