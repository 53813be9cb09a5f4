"""Exactly lossless n-level chain speculative decoding (polybasic speculative decoding, Wang et al. 2025, Alg. 1,
generalised to any number of levels).

Levels, top to bottom: L0 = the target, L1 .. L(n-2) = verifiers (e.g. the target's int4 copy), L(n-1) = the draft.
One level is plain autoregressive decoding ("ar"), two are classic speculative decoding ("dual"), three or more a
chain ("chain").

The whole algorithm is two mutually recursive functions on :class:`_Run`:

* ``_produce(i, ctx, need)``: level i continues ``ctx`` with at least ``min(need, room)`` tokens (fewer only when a
  token is an EOS id), each an exact sample from level i's warped distribution p_i given everything before it, and
  returns them with p_i at each of their positions. The draft (bottom) samples ``draft_k`` tokens autoregressively;
  a verifier runs ``_verify_round`` until it holds enough tokens (mu[i] for the level above's block).
* ``_verify_round(i, ctx)``: the level below produces a block (the draft: draft_k tokens; a verifier: >= mu tokens)
  with the distributions q it was drawn from; level i runs ONE forward over its unprocessed tokens of ctx plus the
  block and checks it with exact speculative sampling (:func:`~polyspec.decode.sampling.verify_block`): accepted
  prefix + one correction (or bonus) token. Then every level below rolls back (O(1) cache truncation) to what it
  shares with ctx + the emitted tokens.

Why it is lossless: by induction from the bottom, the tokens level i+1 hands up satisfy "token j ~ p_{i+1}(. | ctx,
tokens before j) given everything that happened before it" (true for the draft by construction). Exact speculative
sampling of such a sequence against p_i emits tokens with the same property for p_i (accepted tokens and the
residual/bonus token together have law p_i at every position). The block lengths are stopping times (whether position
j is in a block is decided before token j is drawn), and cutting a block at an EOS token or at the max_new_tokens budget
is too, so the property survives them. The target's emitted tokens are therefore exact samples of the warped target.

The generator passed around is the only randomness. Temperature 0 makes every warped row one-hot, so acceptance is
argmax matching and the output is greedy decoding of the target, token for token; the linear rounds then carry each
one-hot row as its hot index and verify by argmax matching (:func:`~polyspec.decode.sampling.greedy_verify`), without
building [k, V] rows (the tree keeps its own T = 0 rules).

Features for an EAGLE draft (a level with ``needs_features``, allowed only at the bottom): the input at position p
pairs token x_p with the feature f_{p-1} = hidden state at position p-1. Source, in order of preference: the nearest
level above (the one directly above first, then further up) whose cache holds position p-1 of the current context;
otherwise, for the first position of a forward only, the draft's own hidden output at p-1 (EAGLE's predicted feature:
how freshly drafted tokens get theirs); otherwise a catch-up forward of the level directly above over the missing
context (counted as ``catch_up_passes``; in practice only at the start, where nothing has processed the prompt). Draft
cache entries computed from a predicted feature are recomputed from true features once a level above has processed
those positions (as EAGLE does). None of this affects losslessness, only acceptance. A draft that needs features
proposes nothing for a one-token context (the level above then samples from its own distribution). For an EAGLE-3
draft (one with ``aux_layers``) every level above returns the head's fused auxiliary states as its hidden state
(:func:`_feed_aux`), so the features above stay H wide whichever level they come from.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from polyspec.decode.levels import Level
from polyspec.decode.ngram import RUN_PER_MATCH, lookup_run
from polyspec.decode.sampling import (
    accept_prefix,
    argmax_rows,
    check_sampling,
    sample,
    sample_without_replacement,
    verify_block,
    verify_candidates,
    warp,
)
from polyspec.errors import PolyspecError
from polyspec.modes import mode_of


@dataclass
class SamplingParams:
    """How every level's logits are warped before any comparison (the warped target distribution is preserved)."""

    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # 1 = off
    top_k: int = 0  # 0 = off

    def check(self) -> None:
        check_sampling(self.temperature, self.top_p, self.top_k)


@dataclass
class TreeParams:
    """EAGLE-2 dynamic draft tree at the bottom level (see :meth:`_Run._draft_tree`).

    top_k: children per expanded node, and nodes expanded per depth; depth: draft forwards per tree (the longest
    path); total_tokens: most draft tokens in one tree (the root, the last committed token, not counted); lookup:
    at T = 0, up to this many prompt-lookup tokens grafted onto the tree as one more path from the root (0: none;
    :func:`_graft_lookup`). At T > 0 the tree is the draft's alone: exact verification of a node's children
    needs them drawn from one draft distribution, which a lookup token is not. lookup_first (with lookup, T = 0):
    where the context's last 2+ tokens occurred before, the round verifies prompt lookup's continuation alone, cut
    as linear drafts' lookup blocks are (ngram.RUN_PER_MATCH; no draft forward, a narrower verification); elsewhere
    the draft's tree alone, nothing grafted (docs/DECODE.md, "Small trees on the CPU")."""

    top_k: int = 8
    depth: int = 5
    total_tokens: int = 32
    lookup: int = 0
    lookup_first: bool = False

    def check(self) -> None:
        for name, lo in (("top_k", 1), ("depth", 1), ("total_tokens", 1), ("lookup", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise PolyspecError(f"tree.{name} must be an integer >= {lo}, got {v!r}")
        if not isinstance(self.lookup_first, bool):
            raise PolyspecError(f"tree.lookup_first must be true or false, got {self.lookup_first!r}")
        if self.lookup_first and not self.lookup:
            raise PolyspecError("tree.lookup_first needs tree.lookup >= 1 (the most lookup tokens a round verifies)")


@dataclass
class _Tree:
    """A draft tree in topological order (parents before children). Node -1 is the root: the last context token."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]  # 1 for the root's children
    children: dict[int, list[int]]  # node -> children in the order they were drawn
    proposals: dict[int, torch.Tensor]  # node -> the draft distribution [V] its children were drawn from


def _kept_tree(keep: list[int], tokens: list[int], parents: list[int], depths: list[int],
               proposals: dict[int, torch.Tensor]) -> _Tree:
    """The drawn nodes ``keep`` (ascending, ancestor-closed) renumbered 0..len(keep) - 1 as a :class:`_Tree`."""
    new_id = {old: j for j, old in enumerate(keep)}
    new_id[-1] = -1
    children: dict[int, list[int]] = {}
    for old in keep:  # creation order keeps each node's children in their drawing order
        children.setdefault(new_id[parents[old]], []).append(new_id[old])
    return _Tree(tokens=[tokens[o] for o in keep], parents=[new_id[parents[o]] for o in keep],
                 depths=[depths[o] for o in keep], children=children,
                 proposals={new_id[o]: q for o, q in proposals.items() if o in new_id})


def _ancestor_rows(mask: torch.Tensor, first_row: int, nodes: list[int], parents: list[int],
                   col: dict[int, int]) -> None:
    """Let mask[first_row + r] see nodes[r] and every ancestor of it (column col[a] for tree node a; -1 is the root),
    in one indexed write (not one per cell: this runs every depth of every round)."""
    rows, cols = [], []
    for r, node in enumerate(nodes):
        while node != -1:
            rows.append(first_row + r)
            cols.append(col[node])
            node = parents[node]
    mask[torch.tensor(rows, dtype=torch.long), torch.tensor(cols, dtype=torch.long)] = True


def _graft_lookup(tree: _Tree, run: list[int], eos: set[int] | frozenset[int]) -> None:
    """Add ``run`` (prompt-lookup tokens after the root) to ``tree`` as a path from the root, sharing the nodes the
    draft already put there and appending the rest (up to an end-of-sequence token). Greedy verification accepts the
    longest path the target agrees with, so the round emits whichever of the draft's paths and this one goes further."""
    node, depth = -1, 0
    for x in run:
        depth += 1
        same = [c for c in tree.children.get(node, []) if tree.tokens[c] == x]
        if same:
            node = same[0]
        else:
            tree.tokens.append(x)
            tree.parents.append(node)
            tree.depths.append(depth)
            tree.children.setdefault(node, []).append(len(tree.tokens) - 1)
            node = len(tree.tokens) - 1
        if x in eos:
            break


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
    lookup_tokens: int = 0  # the draft: tokens of its rounds that prompt lookup proposed instead (draft_lookup)


@dataclass
class GenerationResult:
    token_ids: list[int]  # the new tokens only
    stats: dict[str, Any]  # mode, new_tokens, seconds, tokens_per_second, levels [{name, forward_passes, ...}], beta
    level_stats: list[LevelStats] = field(default_factory=list)


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


class ChainDecoder:
    """Lossless speculative decoding over ``levels`` (top = target first, bottom = draft last).

    draft_k: tokens the draft proposes per verification of the level above it (at most, with draft_stop).
    draft_stop: a linear draft's block ends early once the product of the draft's probabilities of the tokens it
        drew falls below this (0 = never; the first token is always drawn); see :meth:`_Run._draft`.
    draft_lookup: where prompt lookup continues the context from a suffix of >= 2 tokens seen before, up to this
        many of its tokens are the round's block instead of the draft's, or finish a block the draft began (0 = never;
        linear drafts only), and at most ngram.RUN_PER_MATCH per token of the suffix matched; see
        :meth:`_Run._lookup_block` and :meth:`_Run._lookup_tail`.
    mu: one entry per verifier below the target, top first (n - 2 entries; none for ar/dual): level i asks the level
        below for blocks of >= mu[i] tokens, so mu[0] is the size of the blocks the target verifies. Default 8 each.
    max_seq_len: the longest prompt + max_new_tokens; every level's cache is set up for it here.
    """

    def __init__(self, levels: list[Level], *, draft_k: int = 4, mu: list[int] | None = None,
                 max_seq_len: int = 2048, tree: TreeParams | None = None, draft_stop: float = 0.0,
                 draft_lookup: int = 0):
        levels = list(levels)
        if not levels:
            raise PolyspecError("ChainDecoder needs at least one level (the target)")
        for lv in levels:
            missing = [a for a in ("name", "needs_features", "forward", "truncate", "reset", "setup")
                       if not hasattr(lv, a)]
            if missing:
                raise PolyspecError(f"chain level {lv!r} lacks {missing}; wrap models in ModelLevel / HeadLevel")
        owners = [id(getattr(lv, "model", getattr(lv, "head", lv))) for lv in levels]
        if len(set(owners)) != len(owners):
            raise PolyspecError("the same model appears twice in the chain; every level owns its KV cache, so give "
                                "each level its own model object (a copy if they are the same weights)")
        if any(lv.needs_features for lv in levels[:-1]) or (len(levels) == 1 and levels[0].needs_features):
            names = [lv.name for lv in levels if lv.needs_features]
            raise PolyspecError(f"levels {names} read features of a level above; only the bottom (draft) level of a "
                                "chain with at least two levels may")
        if isinstance(draft_k, bool) or not isinstance(draft_k, int) or draft_k < 1:
            raise PolyspecError(f"draft_k must be an integer >= 1, got {draft_k!r}")
        if isinstance(draft_stop, bool) or not isinstance(draft_stop, int | float) or not 0 <= draft_stop < 1:
            raise PolyspecError(f"draft_stop must be a number in [0, 1), got {draft_stop!r}")
        if isinstance(draft_lookup, bool) or not isinstance(draft_lookup, int) or draft_lookup < 0:
            raise PolyspecError(f"draft_lookup must be an integer >= 0, got {draft_lookup!r}")
        n_mu = max(len(levels) - 2, 0)
        if mu is None:
            mu = [8] * n_mu
        mu = list(mu)
        if len(mu) != n_mu:
            raise PolyspecError(f"mu has {len(mu)} entries but a {len(levels)}-level chain takes {n_mu} (one per "
                                "verifier below the target, top first; none for ar and dual)")
        if any(isinstance(m, bool) or not isinstance(m, int) or m < 1 for m in mu):
            raise PolyspecError(f"mu entries must be integers >= 1, got {mu}")
        if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < 2:
            raise PolyspecError(f"max_seq_len must be an integer >= 2, got {max_seq_len!r}")
        if tree is not None:
            tree.check()
            if len(levels) < 2:
                raise PolyspecError("a draft tree needs a draft: use it with dual or chain, not ar")
            lacking = [lv.name for lv in levels[-2:] if not hasattr(lv, "forward_tree")]
            if lacking:
                raise PolyspecError(f"tree decoding needs forward_tree() on the draft and the level verifying it; "
                                    f"{lacking} lack it (ModelLevel, HeadLevel and TableLevel have it)")
        _feed_aux(levels)
        self.levels = levels
        self.draft_k = draft_k
        self.draft_stop = float(draft_stop)
        self.draft_lookup = draft_lookup if tree is None and len(levels) > 1 else 0  # linear drafts only
        self.mu = mu
        self.tree = tree
        self.max_seq_len = max_seq_len
        self.mode = mode_of(len(levels))
        # A tree sits in the draft's and its verifier's caches beyond the committed context before it is pruned.
        slack = max(tree.total_tokens, tree.top_k * tree.depth) + tree.lookup + 1 if tree is not None else 0
        for lv in levels:
            lv.setup(max_seq_len + slack)

    def generate(self, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingParams | None = None,
                 seed: int = 0, eos_token_ids: set[int] | frozenset[int] = frozenset(),
                 on_tokens: Callable[[list[int]], bool | None] | None = None) -> GenerationResult:
        """Up to ``max_new_tokens`` new tokens after ``prompt_ids``, stopping after the first EOS id; the output is an
        exact sample of the warped target (greedy: the target's greedy decoding). Deterministic given ``seed``.

        on_tokens: called with the tokens each target verification commits, as soon as they are final (streaming);
        a true return value stops generation there (e.g. a stop string appeared, or the client went away)."""
        sampling = sampling if sampling is not None else SamplingParams()
        sampling.check()
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise PolyspecError("generate needs a non-empty prompt (at least one token id)")
        if any(t < 0 for t in prompt):
            raise PolyspecError("prompt token ids must be >= 0")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise PolyspecError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        if len(prompt) + max_new_tokens > self.max_seq_len:
            raise PolyspecError(
                f"prompt ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) exceeds max_seq_len "
                f"{self.max_seq_len}; shorten the prompt, lower max_new_tokens or build the decoder with a larger "
                "max_seq_len"
            )
        for lv in self.levels:
            lv.reset()
        run = _Run(self, sampling, torch.Generator().manual_seed(int(seed)), frozenset(int(e) for e in eos_token_ids),
                   limit=len(prompt) + max_new_tokens)
        run.on_tokens = on_tokens
        t0 = time.perf_counter()
        seq = run.decode(prompt)
        seconds = time.perf_counter() - t0
        new = seq[len(prompt):]
        level_stats = run.finish_stats()
        stats = {
            "mode": self.mode,
            "new_tokens": len(new),
            "seconds": seconds,
            "tokens_per_second": len(new) / seconds if seconds > 0 else float("inf"),
            "levels": [{"name": s.name, "forward_passes": s.forward_passes, "mean_accepted": s.mean_accepted,
                        "tokens_emitted": s.tokens_emitted, "catch_up_passes": s.catch_up_passes,
                        "lookup_tokens": s.lookup_tokens}
                       for s in level_stats],
            "beta": run.beta(),
            "draft_k": self.draft_k,
            "draft_stop": self.draft_stop,
            "draft_lookup": self.draft_lookup,
            "mu": list(self.mu),
            "tree": asdict(self.tree) if self.tree is not None else None,
            "sampling": asdict(sampling),
        }
        return GenerationResult(token_ids=new, stats=stats, level_stats=level_stats)


def _feed_aux(levels: list[Level]) -> None:
    """An EAGLE-3 draft reads fc(aux layer states) of the levels above: have each return exactly that as its hidden
    state (so every feature the run stores is H wide); any other draft: the levels' ordinary hidden state."""
    if len(levels) < 2:
        return
    aux = getattr(levels[-1], "aux_layers", None)
    for lv in levels[:-1]:
        if hasattr(lv, "feed_aux"):
            lv.feed_aux(aux, levels[-1].fuse if aux else None)
        elif aux:
            raise PolyspecError(f"level {lv.name!r} cannot feed the EAGLE-3 head {levels[-1].name!r} its auxiliary "
                                "layer states (it has no feed_aux); use ModelLevel over polyspec's Transformer")


class _Run:
    """The state of one generate() call: what each level's cache holds, hidden-state buffers, stats."""

    def __init__(self, dec: ChainDecoder, sampling: SamplingParams, generator: torch.Generator,
                 eos: frozenset[int], limit: int):
        self.levels = dec.levels
        self.n = len(dec.levels)
        self.draft_k = dec.draft_k
        self.draft_stop = dec.draft_stop
        self.draft_lookup = dec.draft_lookup
        self.mu = dec.mu
        self.tree = dec.tree
        self.sampling = sampling
        self.gen = generator
        self.eos = eos
        self.limit = limit  # no sequence ever grows past this many positions
        self.vocab: int | None = None
        self.seen: list[list[int]] = [[] for _ in self.levels]  # the tokens each level's cache holds, by position
        # Per level: positions whose cache entry was computed from a predicted (not a level-above) feature.
        self.inexact: list[set[int]] = [set() for _ in self.levels]
        self.has_hidden: list[list[bool]] = [[] for _ in self.levels]  # hidden buffer row valid at that position
        self.hidden: list[torch.Tensor | None] = [None] * self.n  # [limit, H] per level that keeps hidden states
        self.uses_features = self.levels[-1].needs_features
        self.stats = [LevelStats(lv.name) for lv in self.levels]
        self.on_tokens: Callable[[list[int]], bool | None] | None = None
        self.noise: dict[torch.device, torch.Generator] = {}  # per accelerator: the Gumbel keys' generator (_noise)

    # -- the algorithm ---------------------------------------------------------------------------------------------

    def decode(self, prompt: list[int]) -> list[int]:
        """The target's loop: each round commits what one target verification emits.

        Every level that reads no features first prefills the prompt but its last token in a forward of its own, so
        each later position (from the prompt's last token on) is computed by a decode-width forward in every mode:
        with width-invariant kernels (polyspec.decode.cpu_kernels) its logits are then bitwise those of ``ar``."""
        if len(prompt) > 1:
            for i, lv in enumerate(self.levels):
                if lv.needs_features or (i > 0 and self._adopt_prompt(i, prompt[:-1])):
                    continue
                # (the vocabulary is known from here on: _lookup_block's rows need it)
                self._check_vocab(self._forward(i, prompt[:-1], first_row=len(prompt) - 2, prefill=True).shape[-1],
                                  i)
        seq = list(prompt)
        while len(seq) < self.limit and not (len(seq) > len(prompt) and seq[-1] in self.eos):
            out, _ = self._verify_round(0, seq)
            seq += out
            if self.on_tokens is not None and self.on_tokens(list(out)):
                break
        return seq

    def _adopt_prompt(self, i: int, ctx: list[int]) -> bool:
        """Level i (a quantised copy of the target: ModelLevel.adopt_prompt) holds ctx from the target's cache
        instead of a prefill; its hidden states of ctx stay unset (a draft below reads the target's)."""
        adopt = getattr(self.levels[i], "adopt_prompt", None)
        if adopt is None or self.seen[0] != list(ctx) or not adopt(self.levels[0], len(ctx)):
            return False
        self.seen[i] = list(ctx)
        self.has_hidden[i] = [False] * len(ctx)
        return True

    def _produce(self, i: int, ctx: list[int], need: int) -> tuple[list[int], torch.Tensor | None]:
        """Level i continues ctx with >= min(need, room) tokens (fewer only after an EOS); returns them and level i's
        distributions at their positions ([k, V]; at T = 0 their hot indices [k]: sampling.argmax_rows; None when
        k = 0)."""
        room = self.limit - len(ctx)
        if i == self.n - 1:
            return self._draft(ctx, min(need, room))
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        while len(tokens) < min(need, room) and not (tokens and tokens[-1] in self.eos):
            out, p = self._verify_round(i, ctx + tokens)
            tokens += out
            probs.append(p)
        return tokens, (torch.cat(probs) if probs else None)

    def _verify_round(self, i: int, ctx: list[int]) -> tuple[list[int], torch.Tensor]:
        """The level below proposes a block; level i verifies it in one forward. Returns the tokens level i emits
        (accepted prefix + correction or bonus, cut at the budget and after an EOS) and p_i at their positions."""
        if self.tree is not None and i == self.n - 2:
            return self._verify_tree_round(i, ctx)
        room = self.limit - len(ctx)
        block, q = self._produce(i + 1, ctx, self._block_size(i)) if i + 1 < self.n else ([], None)
        logits = self._forward(i, ctx + block, first_row=len(ctx) - 1)  # [len(block) + 1, V]
        self._check_vocab(logits.shape[-1], i)
        if self.sampling.temperature == 0:
            p = argmax_rows(logits)  # [m + 1]: the one-hot rows' hot indices, computed once
            n_acc, nxt = accept_prefix(p.tolist(), block)
        else:
            p = warp(logits, self.sampling.temperature, self.sampling.top_p, self.sampling.top_k)
            if q is None:
                q = p.new_zeros((0, p.shape[-1]))
            n_acc, nxt = verify_block(p, q, block, self.gen)
        out = self._cut(block[:n_acc] + [nxt], room)
        self._truncate(i, len(ctx) + n_acc)  # this level drops the rejected tokens ...
        for j in range(i + 1, self.n):  # ... and every level below rolls back to what it shares with the new context
            self._truncate(j, common_prefix(self.seen[j], ctx + out))
        self.stats[i].accept_lengths.append(len(out))
        return out, p[:len(out)]

    def _draft(self, ctx: list[int], k: int) -> tuple[list[int], torch.Tensor | None]:
        """The bottom level samples up to k tokens autoregressively (k forwards; stops after an EOS, and with
        draft_stop once the draft's probability of the block so far drops below it: an EAGLE-2-style confidence cut,
        since a block the draft itself doubts is mostly rejected and each verified position costs the level above).
        Where the block ends depends only on tokens already drawn, so it stays a stopping time (lossless)."""
        i = self.n - 1
        if k < 1 or (self.levels[i].needs_features and len(ctx) < 2):
            return [], None
        looked = self._lookup_block(ctx)
        if looked is not None:
            return looked
        full = list(ctx)
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        greedy = self.sampling.temperature == 0
        proposes = getattr(self.levels[i], "has_proposal", None)  # a level that may have nothing to propose (n-gram)
        path = 1.0  # the draft's probability of the block so far
        looked = 0  # tokens prompt lookup appended (not the draft's own: not in its tokens_emitted)
        for _ in range(k):
            if proposes is not None and not proposes(full):
                break
            logits = self._forward(i, full, first_row=len(full) - 1)  # [1, V]
            self._check_vocab(logits.shape[-1], i)
            if greedy:  # q's one-hot row, as its hot index (argmax_rows)
                q = argmax_rows(logits[-1:])[0]
                x = int(q)
            else:
                q = warp(logits[-1], self.sampling.temperature, self.sampling.top_p, self.sampling.top_k)  # [V]
                x = sample(q, self.gen)
            tokens.append(x)
            probs.append(q)
            if x in self.eos:
                break
            full.append(x)
            looked = self._lookup_tail(full, tokens, probs, q)
            if looked:
                break
            if self.draft_stop > 0 and len(tokens) < k:
                path *= self._draft_prob(logits[-1], q, x)
                if path < self.draft_stop:
                    break
        self.stats[i].tokens_emitted += len(tokens) - looked
        return tokens, (torch.stack(probs) if probs else None)

    def _lookup_tail(self, full: list[int], tokens: list[int], probs: list[torch.Tensor], q: torch.Tensor) -> int:
        """With draft_lookup, once the draft's tokens make the text end in a 2+ token suffix seen before: prompt
        lookup's continuation finishes the block (up to draft_lookup tokens in all), appended to tokens and probs
        with one-hot rows shaped like the draft's row q. Whether and what lookup appends depends only on the tokens
        before each position, as in _lookup_block, so the block stays exact. Returns how many it appended."""
        if not self.draft_lookup:
            return 0
        run = lookup_run(full, min(self.draft_lookup - len(tokens), self.limit - len(full)), min_n=2,
                         per_match=RUN_PER_MATCH)
        run = self._cut(run, len(run))
        if not run:
            return 0
        probs += list(self._lookup_rows(run, q.shape[-1] if q.dim() else 0, q.device, q.dtype))
        tokens += run
        self.stats[self.n - 1].lookup_tokens += len(run)
        return len(run)

    def _lookup_block(self, ctx: list[int]) -> tuple[list[int], torch.Tensor] | None:
        """With draft_lookup: prompt lookup's continuation of ctx (a suffix of 2+ tokens seen before; up to
        draft_lookup tokens, cut after an EOS) as the block, with one-hot draft rows (at T = 0 their hot indices);
        None where there is none (the draft proposes as usual). Which source proposes depends on ctx alone, so the
        block is still drawn from one well-defined distribution per position: exact at T = 0 and T > 0 (a one-hot
        row is kept with probability p(x), as for the n-gram level). The draft's cache skips these positions and
        catches up with true features in its next forward."""
        if not self.draft_lookup or self.vocab is None:  # vocab: known after the first verification
            return None
        run = lookup_run(ctx, min(self.draft_lookup, self.limit - len(ctx)), min_n=2, per_match=RUN_PER_MATCH)
        run = self._cut(run, len(run))
        if not run:
            return None
        self.stats[self.n - 1].lookup_tokens += len(run)
        greedy = self.sampling.temperature == 0
        return run, self._lookup_rows(run, self.vocab, torch.device("cpu"), torch.long if greedy else torch.float32)

    def _lookup_rows(self, run: list[int], vocab: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """The draft rows of prompt-lookup tokens: at T = 0 their hot indices [n], else one-hot rows [n, vocab]."""
        hot = torch.tensor(run, device=device)
        if self.sampling.temperature == 0:
            return hot.to(dtype)
        return torch.zeros(len(run), vocab, dtype=dtype, device=device).scatter_(1, hot[:, None], 1.0)

    def _draft_prob(self, logits: torch.Tensor, q: torch.Tensor, x: int) -> float:
        """The draft's probability of the token x it drew: under the warped distribution it was drawn from, or at
        T = 0 (where q is a one-hot index) under the plain softmax, as the tree ranks its nodes."""
        if self.sampling.temperature == 0:
            return float(torch.softmax(logits.float(), dim=-1)[x])
        return float(q[x])

    # -- the EAGLE-2 draft tree ------------------------------------------------------------------------------------

    def _proposal(self, logits: torch.Tensor) -> torch.Tensor:
        """The draft distribution a tree node's children are drawn from: the warped draft at T > 0 (what the
        verification's acceptance ratios need); at T = 0 the plain softmax, whose top-k are the candidates (argmax
        matching is lossless for any candidate set)."""
        if self.sampling.temperature == 0:
            return torch.softmax(logits.float(), dim=-1)
        return warp(logits, self.sampling.temperature, self.sampling.top_p, self.sampling.top_k)

    def _children(self, q: torch.Tensor, k: int) -> tuple[list[int], list[float]]:
        """T > 0: up to k candidate tokens from q [V], an ordered sample without replacement, and their probabilities
        under q, read in one transfer (T = 0: :meth:`_greedy_children`)."""
        return sample_without_replacement(q, k, self._noise(q.device))

    def _greedy_children(self, rows: torch.Tensor, k: int) -> list[tuple[torch.Tensor, list[int], list[float]]]:
        """T = 0: for each of one draft forward's rows [F, V] its proposal (:meth:`_proposal`), its top k tokens and
        their probabilities, all rows in one softmax, one top-k and one transfer (one per node cost ~1 ms per round
        on 2 CPU cores for a tree of 8 nodes over 4 depths)."""
        q = self._proposal(rows)  # [F, V]
        top = torch.topk(q, min(k, q.shape[-1]))
        tokens, probs = torch.stack([top.indices.double(), top.values.double()]).tolist()  # [2, F, k]
        return [(q[r], [int(x) for x in tokens[r]], probs[r]) for r in range(rows.shape[0])]

    def _noise(self, device: torch.device) -> torch.Generator:
        """The generator of the Gumbel keys on ``device``: the run's own on the CPU; elsewhere one made on that device
        and seeded once from the run's (drawing [V] uniforms on the host and copying them over would sync every
        node)."""
        if device.type == "cpu":
            return self.gen
        if device not in self.noise:
            seed = int(torch.randint(2 ** 62, (), generator=self.gen))
            self.noise[device] = torch.Generator(device=device).manual_seed(seed)
        return self.noise[device]

    def _draft_tree(self, ctx: list[int], room: int) -> _Tree | None:
        """EAGLE-2's dynamic tree from the bottom level, one draft forward per depth.

        The root's children are the top_k candidates of the draft after ctx; at each further depth the top_k nodes of
        the newest depth with the highest cumulative draft log-probability are run through the draft in one forward
        (each sees its ancestors through a tree mask) and each gets top_k children. At T = 0 the best total_tokens
        nodes of everything drawn are kept (EAGLE-2's re-ranking; the set is ancestor-closed because a child's score
        never exceeds its parent's). At T > 0 nothing is re-ranked: whether a node joins the tree must not depend on
        its own token, or the verification would no longer be exact, so every drawn child is kept and the budget
        caps how many children are drawn (fixed before drawing). The draft's cache is rolled back to ctx after."""
        i = self.n - 1
        level = self.levels[i]
        tp = self.tree
        if room < 1 or (level.needs_features and len(ctx) < 2):
            return None
        greedy = self.sampling.temperature == 0
        if greedy and tp.lookup_first:
            looked = self._lookup_path(ctx, min(tp.lookup, room))
            if looked is not None:
                return looked
        logits = self._forward(i, ctx, first_row=len(ctx) - 1)  # [1, V]
        self._check_vocab(logits.shape[-1], i)
        root_feature = self._tree_root_feature(i, ctx) if level.needs_features else None
        tokens: list[int] = []
        parents: list[int] = []
        depths: list[int] = []
        scores: list[float] = []
        proposals: dict[int, torch.Tensor] = {}
        budget = tp.total_tokens if not greedy else 10 ** 9  # T = 0: draw freely, re-rank below

        def expand(node: int, row: torch.Tensor, depth: int, score: float,
                   top: tuple[torch.Tensor, list[int], list[float]] | None = None) -> list[int]:
            if top is not None:  # T = 0: this node's row of its forward's batched top-k
                q, xs, qx = top
            else:
                q = self._proposal(row)  # [V]
                k = min(tp.top_k, budget - len(tokens))
                xs, qx = self._children(q, k) if k > 0 else ([], [])
            if xs:
                proposals[node] = q
            new = list(range(len(tokens), len(tokens) + len(xs)))
            tokens.extend(xs)
            parents.extend([node] * len(xs))
            depths.extend([depth] * len(xs))
            scores.extend(score + math.log(max(p, 1e-300)) for p in qx)  # cumulative draft log-probability
            return new

        newest = expand(-1, logits[-1], 1, 0.0, self._greedy_children(logits[-1:], tp.top_k)[0] if greedy else None)
        in_cache: list[int] = []  # tree nodes appended to the draft's cache, in cache order
        hidden_of: dict[int, torch.Tensor] = {}
        base_len = level.cache_len
        for depth in range(2, min(tp.depth, room) + 1):
            # At T > 0 expand only as many nodes as the budget can still give children (the rest would be wasted).
            width = min(tp.top_k, -(-(budget - len(tokens)) // tp.top_k)) if not greedy else tp.top_k
            frontier = sorted((n for n in newest if tokens[n] not in self.eos),
                              key=lambda n: -scores[n])[:width]
            if not frontier or len(tokens) >= budget:
                break
            col = {n: c for c, n in enumerate(in_cache + frontier)}
            mask = torch.zeros(len(frontier), len(in_cache) + len(frontier), dtype=torch.bool)
            _ancestor_rows(mask, 0, frontier, parents, col)  # the frontier's ancestors are all in the cache already
            feats = None
            if level.needs_features:
                feats = torch.stack([root_feature.to(logits.device) if parents[n] == -1 else hidden_of[parents[n]]
                                     for n in frontier])
            out, hid = level.forward_tree([tokens[n] for n in frontier], [len(ctx) - 1 + depths[n] for n in frontier],
                                          mask, feats)
            self.stats[i].forward_passes += 1
            in_cache += frontier
            newest = []
            tops = self._greedy_children(out[:len(frontier)], tp.top_k) if greedy else [None] * len(frontier)
            for r, n in enumerate(frontier):
                if hid is not None:
                    hidden_of[n] = hid[r]
                newest += expand(n, out[r], depth, scores[n], tops[r])
        if level.cache_len != base_len:
            level.truncate(base_len)  # drop the tree entries: the draft holds ctx only again

        keep = list(range(len(tokens)))
        if greedy and len(tokens) > tp.total_tokens:
            keep = sorted(sorted(keep, key=lambda n: (-scores[n], depths[n], n))[:tp.total_tokens])
        tree = _kept_tree(keep, tokens, parents, depths, proposals)
        if greedy and tp.lookup and not tp.lookup_first:
            _graft_lookup(tree, lookup_run(ctx, min(tp.lookup, room)), self.eos)
        self.stats[i].tokens_emitted += len(tree.tokens)
        return tree

    def _lookup_path(self, ctx: list[int], n: int) -> _Tree | None:
        """tree.lookup_first: prompt lookup's continuation of a repeated suffix of 2+ tokens (as _lookup_block finds it)
        as a one-path tree, or None where there is none. The draft's cache skips these positions and catches up
        with true features in its next forward."""
        run = lookup_run(ctx, n, min_n=2, per_match=RUN_PER_MATCH)
        if not run:
            return None
        tree = _Tree([], [], [], {}, {})
        _graft_lookup(tree, run, self.eos)
        self.stats[self.n - 1].lookup_tokens += len(tree.tokens)
        return tree

    def _tree_root_feature(self, i: int, ctx: list[int]) -> torch.Tensor:
        """The feature the draft level i reads at the tree's root: the nearest level above's state at the last
        position of ctx, else the head's own prediction of it."""
        shared = [common_prefix(self.seen[j], ctx) for j in range(i)]
        feature = self._feature_at(i, len(ctx) - 1, shared)
        return self.hidden[i][len(ctx) - 1] if feature is None else feature

    def _verify_tree_round(self, i: int, ctx: list[int]) -> tuple[list[int], torch.Tensor]:
        """The draft proposes a tree; level i (the one directly above the draft) runs ONE forward over its unprocessed
        context plus every tree node and walks the tree from the root: at each node the children are verified with
        :func:`~polyspec.decode.sampling.verify_candidates` (exact, so what level i emits is a sample of p_i); the
        walk goes down the accepted child, and ends with the correction token or, at a leaf, a bonus token from p_i.
        Level i's cache keeps the accepted path (compacted into place)."""
        room = self.limit - len(ctx)
        level = self.levels[i]
        tree = self._draft_tree(ctx, room)
        if tree is None or not tree.tokens:
            logits = self._forward(i, ctx, first_row=len(ctx) - 1)  # nothing proposed: level i samples itself
            self._check_vocab(logits.shape[-1], i)
            out, _, p = self._walk_tree(_Tree([], [], [], {}, {}), logits)  # the root alone: its bonus token
            out = self._cut(out, room)
            self.stats[i].accept_lengths.append(len(out))
            return out, p[:1]
        # One forward: the unprocessed context (causal) and the tree (each node sees the context and its ancestors).
        start = min(common_prefix(self.seen[i], ctx), len(ctx) - 1)
        self._truncate(i, start)
        if level.cache_len > start:
            level.truncate(start)
        lin = ctx[start:]
        n_lin, n_tree = len(lin), len(tree.tokens)
        mask = torch.zeros(n_lin + n_tree, n_lin + n_tree, dtype=torch.bool)
        mask[:n_lin, :n_lin] = torch.ones(n_lin, n_lin, dtype=torch.bool).tril()
        mask[n_lin:, :n_lin] = True
        cols = {j: n_lin + j for j in range(n_tree)}
        _ancestor_rows(mask, n_lin, list(range(n_tree)), tree.parents, cols)
        positions = list(range(start, len(ctx))) + [len(ctx) - 1 + d for d in tree.depths]
        logits, hidden = level.forward_tree(lin + tree.tokens, positions, mask)
        self.stats[i].forward_passes += 1
        self.seen[i] = list(ctx)
        self.has_hidden[i] += [False] * n_lin
        if hidden is not None and self._feeds(i):
            self._store_hidden(i, start, hidden[:n_lin])
        self._check_vocab(logits.shape[-1], i)
        # logits row n_lin - 1: the root (last context token); row n_lin + j: tree node j.
        out, path, p = self._walk_tree(tree, logits[n_lin - 1:])
        out = self._cut(out, room)
        # Keep the accepted path in level i's cache, right after ctx.
        path = path[:len(out)]
        if path and hasattr(level, "compact"):
            level.compact([len(ctx) + a for a in path], len(ctx))
            self.seen[i] = list(ctx) + [tree.tokens[a] for a in path]
            self.has_hidden[i] += [False] * len(path)
            if hidden is not None and self._feeds(i):
                self._store_hidden(i, len(ctx), hidden[[n_lin + a for a in path]])
        else:
            level.truncate(len(ctx))
        for j in range(i + 1, self.n):
            self._truncate(j, common_prefix(self.seen[j], ctx + out))
        self.stats[i].accept_lengths.append(len(out))
        return out, p[:len(out)]

    def _walk_tree(self, tree: _Tree, logits: torch.Tensor) -> tuple[list[int], list[int], torch.Tensor]:
        """Walk a verified tree down from the root (logits [1 + n_tree, V]: row 0 the root, row 1 + j node j): at
        each node its children are verified with :func:`~polyspec.decode.sampling.verify_candidates`, the walk goes
        down the accepted child and ends with the correction token or, at a leaf, a bonus token. Returns the tokens
        emitted, the accepted path (tree nodes) and the verifier's distributions at the emitted positions ([len, V];
        at T = 0 their hot indices [len], as the linear rounds hand them up)."""
        if self.sampling.temperature == 0:
            # One-hot rows make verify_candidates argmax matching, so every row's argmax, read once, walks the tree.
            best = argmax_rows(logits).tolist()  # [1 + n_tree]
            out, path, node = [], [], -1
            while True:
                out.append(best[node + 1])
                kept = [c for c in tree.children.get(node, []) if tree.tokens[c] == out[-1]]
                if not kept or out[-1] in self.eos:
                    return out, path, torch.tensor(out)
                node = kept[0]
                path.append(node)
        out, path, rows, node = [], [], [], -1
        while True:  # only the rows the walk visits are warped
            rows.append(warp(logits[node + 1], self.sampling.temperature, self.sampling.top_p, self.sampling.top_k))
            kids = tree.children.get(node, [])
            if not kids:
                out.append(sample(rows[-1], self.gen))  # a leaf (or nothing drawn): the bonus token
                return out, path, torch.stack(rows)
            j, x = verify_candidates(rows[-1], tree.proposals[node], [tree.tokens[c] for c in kids], self.gen)
            out.append(x)
            if j is None or x in self.eos:
                return out, path, torch.stack(rows)
            node = kids[j]
            path.append(node)

    # -- caches, features, bookkeeping -----------------------------------------------------------------------------

    def _block_size(self, i: int) -> int:
        """How many tokens level i asks the level below for per verification."""
        return self.draft_k if i + 1 == self.n - 1 else self.mu[i]

    def _cut(self, tokens: list[int], room: int) -> list[int]:
        """Keep at most ``room`` tokens and nothing after the first EOS."""
        tokens = tokens[:room]
        for j, t in enumerate(tokens):
            if t in self.eos:
                return tokens[:j + 1]
        return tokens

    def _feeds(self, i: int) -> bool:
        """Whether level i's hidden states may be read as features by the draft."""
        return self.uses_features and i < self.n - 1

    def _truncate(self, i: int, n: int) -> None:
        if n < len(self.seen[i]):
            self.levels[i].truncate(n)
            del self.seen[i][n:], self.has_hidden[i][n:]
            self.inexact[i] = {p for p in self.inexact[i] if p < n}

    def _forward(self, i: int, full: list[int], first_row: int, catch_up: bool = False,
                 prefill: bool = False) -> torch.Tensor:
        """One forward of level i so that its cache holds ``full``; returns logits [len(full) - first_row, V] for
        positions first_row .. len(full) - 1. Only tokens the level has not processed (for this context) are run,
        plus at least position first_row (its logits are not kept between calls)."""
        level = self.levels[i]
        start = min(common_prefix(self.seen[i], full), first_row)
        features = None
        if level.needs_features:
            # Recompute entries made from a predicted feature once a level above holds the true one.
            shared = [common_prefix(self.seen[j], full) for j in range(i)]
            redo = [p for p in self.inexact[i] if p < start and self._feature_at(i, p - 1, shared) is not None]
            start = max(min([start, *redo]), 1)
            features, exact = self._features(i, full, start)
        self._truncate(i, start)
        last_only = first_row == len(full) - 1 and not self._feeds(i)
        rows = len(full) - first_row  # the logits the caller reads; hidden states may be needed for every row
        logits, hidden = level.forward(full[start:], start, features, last_only=last_only, logit_rows=rows)
        t = len(full) - start
        pad = start - len(self.seen[i])  # 1 only for a feature level's first forward: position 0 needs no entry
        self.seen[i] = list(full)
        self.has_hidden[i] += [False] * (pad + t)
        if level.needs_features:
            self.inexact[i] |= {start + j for j, e in enumerate(exact) if not e}
        if hidden is not None and (self._feeds(i) or level.needs_features):
            self._store_hidden(i, len(full) - hidden.shape[0], hidden)
        if not prefill:  # a prompt prefill is not a decode or verification pass
            self.stats[i].forward_passes += 1
            self.stats[i].catch_up_passes += int(catch_up)
        if logits.shape[0] < rows:
            raise PolyspecError(f"level {level.name!r} returned {logits.shape[0]} logits rows, expected >= {rows}")
        return logits[logits.shape[0] - rows:]

    def _store_hidden(self, i: int, start: int, hidden: torch.Tensor) -> None:
        """Keep hidden [T, H] as the level's states at positions start .. start + T - 1."""
        if self.hidden[i] is None:
            self.hidden[i] = hidden.new_zeros((self.limit, hidden.shape[-1]))
        t = hidden.shape[0]
        self.hidden[i][start:start + t] = hidden
        self.has_hidden[i][start:start + t] = [True] * t

    def _feature_at(self, i: int, pos: int, shared: list[int]) -> torch.Tensor | None:
        """f_pos from the nearest level above level i that holds it for this context (shared[j] = positions level j
        shares with the context), else None."""
        for j in range(i - 1, -1, -1):
            if pos < shared[j] and self.has_hidden[j][pos]:
                return self.hidden[j][pos]
        return None

    def _features(self, i: int, full: list[int], start: int,
                  caught_up: bool = False) -> tuple[torch.Tensor, list[bool]]:
        """Features [len(full) - start, H] for level i's inputs at positions start .. (row j = f_{start + j - 1}),
        and per row whether it is a true feature from a level above (see the module docstring for the rules)."""
        shared = [common_prefix(self.seen[j], full) for j in range(i)]
        rows: list[torch.Tensor | None] = [self._feature_at(i, p - 1, shared) for p in range(start, len(full))]
        exact = [r is not None for r in rows]
        if rows[0] is None and start - 1 < len(self.seen[i]) and self.has_hidden[i][start - 1]:
            rows[0] = self.hidden[i][start - 1]  # the draft's own prediction of f_{start-1}
        missing = [start + j - 1 for j, r in enumerate(rows) if r is None]
        if missing:
            # Catch-up: the level directly above runs over the context up to the last missing position.
            if caught_up:
                raise PolyspecError(f"level {self.levels[i - 1].name!r} returns no hidden states, so the "
                                    f"feature-reading level {self.levels[i].name!r} below it cannot be fed")
            last = max(missing)
            self._forward(i - 1, full[:last + 1], first_row=last, catch_up=True)
            return self._features(i, full, start, caught_up=True)
        dev = rows[0].device
        return torch.stack([r.to(dev) for r in rows]), exact

    def _check_vocab(self, v: int, i: int) -> None:
        if self.vocab is None:
            self.vocab = v
        elif v != self.vocab:
            raise PolyspecError(f"level {self.levels[i].name!r} has a vocabulary of {v} tokens but the levels above "
                                f"have {self.vocab}; every level of a chain must share the target's vocabulary")

    # -- stats -----------------------------------------------------------------------------------------------------

    def finish_stats(self) -> list[LevelStats]:
        for i, s in enumerate(self.stats):
            if i < self.n - 1 or self.n == 1:
                s.tokens_emitted = sum(s.accept_lengths)
            s.mean_accepted = s.tokens_emitted / s.forward_passes if s.forward_passes else 0.0
        return self.stats

    def beta(self) -> float | None:
        """Draft forward passes per verification of the level directly above the draft (None for ar)."""
        if self.n < 2:
            return None
        verifications = len(self.stats[self.n - 2].accept_lengths)
        return self.stats[self.n - 1].forward_passes / verifications if verifications else 0.0
