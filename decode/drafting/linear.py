"""Linear drafts: the chain's bottom level (a draft head, or a small model) samples up to ``k`` tokens
autoregressively, one forward each, and stops after an EOS. With prompt lookup (``draft.lookup``): where the context
already ends in a repeat, lookup's block replaces the draft's (no draft forward); and once the draft's own tokens make
the text end in one, lookup finishes the block (up to ``lookup`` tokens in all). Which source proposes each position
depends only on the tokens before it, so the block stays a stopping time and its rows one distribution per position:
exact at T = 0 and T > 0.
"""

from __future__ import annotations

from typing import Any

import torch

from polyspec.decode.drafting.lookup import RUN_PER_MATCH, lookup_rows, lookup_run, proposed_block
from polyspec.decode.sampling import argmax_rows, sample, warp


class LinearDrafter:
    """``k`` draft tokens per round from level ``st.draft_level``, with prompt-lookup blocks of up to ``lookup``."""

    has_level = True

    def __init__(self, k: int, lookup: int = 0):
        self.k, self.lookup = k, lookup

    def propose(self, st: Any, ctx: list[int], room: int) -> tuple[list[int], torch.Tensor | None]:
        """The round's block and the draft's distributions at its positions ([k, V]; None at T = 0)."""
        i = st.draft_level
        if room < 1 or (st.levels[i].needs_features and len(ctx) < 2):
            return [], None
        found = proposed_block(st, ctx, min(self.lookup, room))
        if found is not None:
            return found
        full, tokens, probs = list(ctx), [], []
        looked = 0  # tokens prompt lookup appended (not the draft's own: not in its tokens_emitted)
        for _ in range(min(self.k, room)):
            logits = st.forward(i, full, first_row=len(full) - 1)  # [1, V]
            st.check_vocab(logits.shape[-1], i)
            q, x = self._draw(st, logits)
            tokens.append(x)
            probs += [] if q is None else [q]
            if x in st.eos:
                break
            full.append(x)
            looked = self._tail(st, full, tokens, probs, q, room)
            if looked:
                break
        st.draft_stats.tokens_emitted += len(tokens) - looked
        return tokens, torch.stack(probs) if probs else None

    @staticmethod
    def _draw(st: Any, logits: torch.Tensor) -> tuple[torch.Tensor | None, int]:
        """The draft's row for the last position of logits [n, V] and the token drawn (at T = 0 no row: its argmax,
        sampling.argmax_rows)."""
        if st.greedy:
            return None, argmax_rows(logits)[-1]
        q = warp(logits[-1], st.sampling.temperature, st.sampling.top_p, st.sampling.top_k)  # [V]
        return q, sample(q, st.gen)

    def _tail(self, st: Any, full: list[int], tokens: list[int], probs: list[torch.Tensor],
              q: torch.Tensor | None, room: int) -> int:
        """Once the draft's tokens make the text end in a 2+ token suffix seen before, lookup's continuation finishes
        the block (up to ``lookup`` tokens in all), with one-hot rows shaped like the draft's row q (none at T = 0).
        Returns how many tokens it appended."""
        if not self.lookup:
            return 0
        run = lookup_run(full, min(self.lookup, room) - len(tokens), min_n=2, per_match=RUN_PER_MATCH)
        run = st.cut(run, len(run))
        if not run:
            return 0
        if q is not None:
            probs += list(lookup_rows(run, q.shape[-1], q.device, q.dtype))
        tokens += run
        st.draft_stats.lookup_tokens += len(run)
        return len(run)
