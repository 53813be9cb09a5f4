"""The state of one generation across a chain's levels: what each level's cache holds, the hidden states a draft
reads as features, the counters. :class:`RunState` is shared by the verification recursion (decode/chain.py) and the
drafters (decode/drafting/): both move a level's cache only through :meth:`RunState.forward` and
:meth:`RunState.truncate`, so ``seen[i]`` is always exactly the tokens level i's cache holds, by position.

Features for an EAGLE draft (a level with ``needs_features``, allowed only at the bottom): the input at position p
pairs token x_p with the feature f_{p-1} = hidden state at position p-1. Source, in order of preference: the nearest
level above (the one directly above first, then further up) whose cache holds position p-1 of the current context;
otherwise, for the first position of a forward only, the draft's own hidden output at p-1 (EAGLE's predicted feature:
how freshly drafted tokens get theirs); otherwise a catch-up forward of the level directly above over the missing
context (counted as ``catch_up_passes``; in practice only at the start, where nothing has processed the prompt). Draft
cache entries computed from a predicted feature are recomputed from true features once a level above has processed
those positions (as EAGLE does). None of this affects losslessness, only acceptance.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from polyspec.errors import PolyspecError


@dataclass
class LevelStats:
    """Per level. Verifiers: accept_lengths holds the tokens emitted per verification (accepted + correction/bonus);
    the draft: tokens it proposed. mean_accepted = tokens_emitted / forward_passes (the paper's L_i)."""

    name: str
    forward_passes: int = 0  # all forwards, catch-ups included
    tokens_emitted: int = 0
    mean_accepted: float = 0.0
    accept_lengths: list[int] = field(default_factory=list)
    catch_up_passes: int = 0  # forwards run only to give the draft features
    lookup_tokens: int = 0  # the draft: tokens of its rounds that prompt lookup proposed


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists (binary search over C-speed slice comparisons)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class RunState:
    """Per level: ``seen`` (the tokens its cache holds), ``has_hidden`` / ``hidden`` (its hidden states by position,
    for the draft), ``inexact`` (draft positions computed from a predicted feature); the run's sampling, generator,
    end-of-sequence ids and length limit; one :class:`LevelStats` per level (and one for a drafter without a level)."""

    def __init__(self, levels: list[Any], *, draft_level: int | None, sampling: Any, generator: torch.Generator,
                 eos: frozenset[int], limit: int, drafter_name: str | None = None):
        self.levels, self.n = levels, len(levels)
        self.draft_level = draft_level  # index of the level that drafts (None: the drafter has no model)
        self.sampling, self.gen, self.eos, self.limit = sampling, generator, eos, limit
        self.vocab: int | None = None
        self.seen: list[list[int]] = [[] for _ in levels]
        self.inexact: list[set[int]] = [set() for _ in levels]
        self.has_hidden: list[list[bool]] = [[] for _ in levels]
        self.hidden: list[torch.Tensor | None] = [None] * self.n  # [limit, H] per level that keeps hidden states
        self.uses_features = draft_level is not None and levels[draft_level].needs_features
        self.stats = [LevelStats(lv.name) for lv in levels]
        if drafter_name is not None:  # a drafter without a level (prompt lookup alone) counts its proposals here
            self.stats.append(LevelStats(drafter_name))
        self._noise: dict[torch.device, torch.Generator] = {}

    @property
    def greedy(self) -> bool:
        return self.sampling.temperature == 0

    @property
    def draft_stats(self) -> LevelStats:
        return self.stats[-1]

    def cut(self, tokens: list[int], room: int) -> list[int]:
        """Keep at most ``room`` tokens and nothing after the first EOS."""
        tokens = tokens[:room]
        for j, t in enumerate(tokens):
            if t in self.eos:
                return tokens[:j + 1]
        return tokens

    def check_vocab(self, v: int, i: int) -> None:
        if self.vocab is None:
            self.vocab = v
        elif v != self.vocab:
            raise PolyspecError(f"level {self.levels[i].name!r} has a vocabulary of {v} tokens but the levels above "
                                f"have {self.vocab}; every level of a chain must share the target's vocabulary")

    def noise(self, device: torch.device) -> torch.Generator:
        """The generator of a tree's Gumbel keys on ``device``: the run's own on the CPU; elsewhere one made on that
        device and seeded once from the run's (drawing [V] uniforms on the host and copying them over would sync
        every node)."""
        if device.type == "cpu":
            return self.gen
        if device not in self._noise:
            seed = int(torch.randint(2 ** 62, (), generator=self.gen))
            self._noise[device] = torch.Generator(device=device).manual_seed(seed)
        return self._noise[device]

    # -- caches ----------------------------------------------------------------------------------------------------

    def feeds(self, i: int) -> bool:
        """Whether level i's hidden states may be read as features by the draft."""
        return self.uses_features and i < self.draft_level

    def truncate(self, i: int, n: int) -> None:
        if n < len(self.seen[i]):
            self.levels[i].truncate(n)
            del self.seen[i][n:], self.has_hidden[i][n:]
            self.inexact[i] = {p for p in self.inexact[i] if p < n}

    def roll_back_below(self, i: int, ctx: list[int]) -> None:
        """Every level below i keeps only what it shares with ``ctx`` (O(1) cache truncations)."""
        for j in range(i + 1, self.n):
            self.truncate(j, common_prefix(self.seen[j], ctx))

    def forward(self, i: int, full: list[int], first_row: int, catch_up: bool = False,
                prefill: bool = False) -> torch.Tensor:
        """One forward of level i so that its cache holds ``full``; returns logits [len(full) - first_row, V] for
        positions first_row .. len(full) - 1. Only tokens the level has not processed (for this context) are run,
        plus at least position first_row (its logits are not kept between calls)."""
        level = self.levels[i]
        start = min(common_prefix(self.seen[i], full), first_row)
        features = exact = None
        if level.needs_features:
            # Recompute entries made from a predicted feature once a level above holds the true one.
            shared = [common_prefix(self.seen[j], full) for j in range(i)]
            redo = [p for p in self.inexact[i] if p < start and self.feature_at(i, p - 1, shared) is not None]
            start = max(min([start, *redo]), 1)
            features, exact = self._features(i, full, start)
        self.truncate(i, start)
        last_only = first_row == len(full) - 1 and not self.feeds(i)
        rows = len(full) - first_row  # the logits the caller reads; hidden states may be needed for every row
        logits, hidden = level.forward(full[start:], start, features, last_only=last_only, logit_rows=rows)
        pad = start - len(self.seen[i])  # 1 only for a feature level's first forward: position 0 needs no entry
        self.seen[i] = list(full)
        self.has_hidden[i] += [False] * (pad + len(full) - start)
        if exact is not None:
            self.inexact[i] |= {start + j for j, e in enumerate(exact) if not e}
        if hidden is not None and (self.feeds(i) or level.needs_features):
            self.store_hidden(i, len(full) - hidden.shape[0], hidden)
        if not prefill:  # a prompt prefill is not a decode or verification pass
            self.stats[i].forward_passes += 1
            self.stats[i].catch_up_passes += int(catch_up)
        if logits.shape[0] < rows:
            raise PolyspecError(f"level {level.name!r} returned {logits.shape[0]} logits rows, expected >= {rows}")
        return logits if logits.shape[0] == rows else logits[logits.shape[0] - rows:]  # a view op costs ~20 us here

    def store_hidden(self, i: int, start: int, hidden: torch.Tensor) -> None:
        """Keep hidden [T, H] as the level's states at positions start .. start + T - 1."""
        if self.hidden[i] is None:
            self.hidden[i] = hidden.new_zeros((self.limit, hidden.shape[-1]))
        t = hidden.shape[0]
        self.hidden[i][start:start + t] = hidden
        self.has_hidden[i][start:start + t] = [True] * t

    def feature_at(self, i: int, pos: int, shared: list[int]) -> torch.Tensor | None:
        """f_pos from the nearest level above level i that holds it for this context (shared[j] = positions level j
        shares with the context), else None."""
        j = self._feature_level(i, pos, shared)
        return None if j is None else self.hidden[j][pos]

    def _feature_level(self, i: int, pos: int, shared: list[int]) -> int | None:
        """The nearest level above level i that holds f_pos for this context, else None."""
        for j in range(i - 1, -1, -1):
            if pos < shared[j] and self.has_hidden[j][pos]:
                return j
        return None

    def root_feature(self, i: int, ctx: list[int]) -> torch.Tensor:
        """The feature the draft level i reads after ctx: the nearest level above's state at the last position of
        ctx, else the draft's own prediction of it."""
        shared = [common_prefix(self.seen[j], ctx) for j in range(i)]
        feature = self.feature_at(i, len(ctx) - 1, shared)
        return self.hidden[i][len(ctx) - 1] if feature is None else feature

    def _features(self, i: int, full: list[int], start: int,
                  caught_up: bool = False) -> tuple[torch.Tensor, list[bool]]:
        """Features [len(full) - start, H] for level i's inputs at positions start .. (row j = f_{start + j - 1}),
        and per row whether it is a true feature from a level above (see the module docstring for the rules). Rows
        that all come from one level are one view of its states (no op per row: each costs tens of microseconds
        after a target forward)."""
        shared = [common_prefix(self.seen[j], full) for j in range(i)]
        src = [self._feature_level(i, p - 1, shared) for p in range(start, len(full))]
        exact = [j is not None for j in src]
        if src[0] is None and start - 1 < len(self.seen[i]) and self.has_hidden[i][start - 1]:
            src[0] = i  # the draft's own prediction of f_{start-1}
        missing = [start + r - 1 for r, j in enumerate(src) if j is None]
        if missing:
            # Catch-up: the level directly above runs over the context up to the last missing position.
            if caught_up:
                raise PolyspecError(f"level {self.levels[i - 1].name!r} returns no hidden states, so the "
                                    f"feature-reading level {self.levels[i].name!r} below it cannot be fed")
            last = max(missing)
            self.forward(i - 1, full[:last + 1], first_row=last, catch_up=True)
            return self._features(i, full, start, caught_up=True)
        if len(set(src)) == 1:
            return self.hidden[src[0]][start - 1:len(full) - 1], exact
        rows = [self.hidden[j][start - 1 + r] for r, j in enumerate(src)]
        dev = rows[0].device
        return torch.stack([r.to(dev) for r in rows]), exact

    # -- the prompt ------------------------------------------------------------------------------------------------

    def prefill(self, prompt: list[int]) -> None:
        """Every level that reads no features prefills the prompt but its last token in a forward of its own, so each
        later position is computed by a decode-width forward in every mode: with width-invariant kernels
        (polyspec.decode.cpu_kernels) its logits are then bitwise those of ``ar``. The vocabulary is known from here on
        (prompt-lookup rows need it)."""
        if len(prompt) < 2:
            return
        for i, lv in enumerate(self.levels):
            if not lv.needs_features:
                self.check_vocab(self.forward(i, prompt[:-1], first_row=len(prompt) - 2, prefill=True).shape[-1], i)
