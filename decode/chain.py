"""Exactly lossless n-level chain speculative decoding (polybasic speculative decoding, Wang et al. 2025, Alg. 1,
generalised to any number of levels).

Levels, top to bottom: L0 = the target, L1 .. L(n-2) = verifiers (e.g. the target's int4 copy), L(n-1) = the draft.
One level is plain autoregressive decoding ("ar"), two are classic speculative decoding ("dual"), three or more a
chain ("chain").

The whole algorithm is two mutually recursive functions on :class:`_Run`:

* ``_produce(i, ctx, need)``: level i continues ``ctx`` with at least ``min(need, room)`` tokens (fewer only when a
  token is an EOS id), each an exact sample from level i's warped distribution p_i given everything before it, and
  returns them with p_i at each of their positions: it runs ``_verify_round`` until it holds enough tokens (mu[i]
  for the level above's block).
* ``_verify_round(i, ctx)``: the level below produces a block (a verifier: >= mu tokens; below the bottom verifier,
  the drafter: a block or a tree, decode/drafting/) with the distributions q it was drawn from; level i runs ONE forward over its unprocessed tokens of ctx plus the
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
argmax matching and the output is greedy decoding of the target, token for token; the rounds then carry no rows at
all (a verifier at T = 0 reads only the tokens: ``q`` and ``p`` are None) and verify by argmax matching
(:func:`~polyspec.decode.sampling.accept_prefix`), without building [k, V] rows or tensors of hot indices.

Drafting (what the bottom proposes: linear, a tree, prompt lookup) lives in decode/drafting/, the per-level cache
and feature bookkeeping in decode/state.py; this module is the verification recursion. For an EAGLE-3 draft (one
with ``aux_layers``) every level above returns the head's fused auxiliary states as its hidden state
(:func:`_feed_aux`), so the features above stay H wide whichever level they come from.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from polyspec.chain_spec import DraftSpec
from polyspec.decode import cpu_kernels, device_round
from polyspec.decode.device_round import DeviceRound
from polyspec.decode.device_tree import TreeRound
from polyspec.decode.drafting import Tree, make_drafter
from polyspec.decode.drafting.tree import verify_tree
from polyspec.decode.levels import Level
from polyspec.decode.sampling import accept_prefix, argmax_rows, check_sampling, verify_block, warp
from polyspec.decode.state import LevelStats, RunState, common_prefix
from polyspec.errors import PolyspecError
from polyspec.modes import mode_of

__all__ = ["ChainDecoder", "GenerationResult", "LevelStats", "SamplingParams", "common_prefix"]


@dataclass
class SamplingParams:
    """How every level's logits are warped before any comparison (the warped target distribution is preserved)."""

    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # 1 = off
    top_k: int = 0  # 0 = off

    def check(self) -> None:
        check_sampling(self.temperature, self.top_p, self.top_k)


@dataclass
class GenerationResult:
    token_ids: list[int]  # the new tokens only
    stats: dict[str, Any]  # mode, new_tokens, seconds, tokens_per_second, levels [{name, forward_passes, ...}], beta,
    # device_round (whether the rounds ran on decode/device_round.py)
    level_stats: list[LevelStats] = field(default_factory=list)


class ChainDecoder:
    """Lossless speculative decoding over ``levels`` (top = target first).

    draft: what drafts (:class:`~polyspec.chain_spec.DraftSpec`); None = nothing (ar: one level). With
        ``draft.source`` model the bottom level is the draft (a head or a small model); with lookup every level
        verifies and prompt lookup drafts below the last.
    mu: one entry per verifier below the target, top first: level i asks the level below for blocks of >= mu[i]
        tokens, so mu[0] is the size of the blocks the target verifies. Default 8 each.
    max_seq_len: the longest prompt + max_new_tokens; every level's cache is set up for it here.
    device_round: run each round as one device function with one host read (decode/device_round.py) where it
        supports the chain: None (default) on CUDA (``POLYSPEC_DEVICE_ROUND=0`` / ``1``: off / wherever supported),
        True wherever supported (an error where it is not: the CPU tests force it so), False never.
    """

    def __init__(self, levels: list[Level], *, draft: DraftSpec | None = None, mu: list[int] | None = None,
                 max_seq_len: int = 2048, device_round: bool | None = None):
        levels = list(levels)
        _check_levels(levels)
        if draft is not None and not isinstance(draft, DraftSpec):
            raise PolyspecError(f"draft must be a polyspec.chain_spec.DraftSpec, got {type(draft).__name__}")
        if draft is None and len(levels) > 1:
            draft = DraftSpec()
        if draft is not None and draft.source == "model" and len(levels) == 1:
            draft = None  # one level: plain decoding
        self.draft, self.drafter = draft, make_drafter(draft) if draft is not None else None
        self.verifiers = len(levels) - (1 if self.drafter is not None and self.drafter.has_level else 0)
        _check_features(levels, self.verifiers)
        self.mu = _check_mu(mu, self.verifiers)
        if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < 2:
            raise PolyspecError(f"max_seq_len must be an integer >= 2, got {max_seq_len!r}")
        tree = draft.tree if draft is not None and draft.source == "model" else None
        if tree is not None:
            _check_tree_levels(levels)
        _feed_aux(levels)
        self.levels, self.max_seq_len = levels, max_seq_len
        self.mode = mode_of(self.verifiers + (self.drafter is not None))
        # A tree sits in the draft's and its verifier's caches beyond the committed context before it is pruned.
        slack = max(tree.total_tokens, tree.top_k * tree.depth) + 1 if tree is not None else 0
        self.device_round = _device_round(levels, draft, device_round)
        if self.device_round is not None:  # a round writes k + 1 positions past the committed ones
            slack = max(slack, self.device_round.k + 2)
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
        prompt = self._checked_prompt(prompt_ids, max_new_tokens)
        for lv in self.levels:
            lv.reset()
        run = _Run(self, sampling, torch.Generator().manual_seed(int(seed)), frozenset(int(e) for e in eos_token_ids),
                   limit=len(prompt) + max_new_tokens, on_tokens=on_tokens)
        t0 = time.perf_counter()
        # once, not per level forward (decode/levels.py, _inference); no weight changes while it runs
        with torch.inference_mode(), cpu_kernels.weights_frozen():
            seq = run.decode(prompt)
        seconds = time.perf_counter() - t0
        new = seq[len(prompt):]
        level_stats = run.finish_stats()
        stats = {"mode": self.mode, "new_tokens": len(new), "seconds": seconds,
                 "tokens_per_second": len(new) / seconds if seconds > 0 else float("inf"),
                 "levels": [{"name": s.name, "forward_passes": s.forward_passes, "mean_accepted": s.mean_accepted,
                             "tokens_emitted": s.tokens_emitted, "catch_up_passes": s.catch_up_passes,
                             "lookup_tokens": s.lookup_tokens} for s in level_stats],
                 "beta": run.beta(), "draft": self.draft.model_dump() if self.draft is not None else None,
                 "mu": list(self.mu), "sampling": vars(sampling).copy(), "device_round": run.on_device}
        return GenerationResult(token_ids=new, stats=stats, level_stats=level_stats)

    def _checked_prompt(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise PolyspecError("generate needs a non-empty prompt (at least one token id)")
        if any(t < 0 for t in prompt):
            raise PolyspecError("prompt token ids must be >= 0")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise PolyspecError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        if len(prompt) + max_new_tokens > self.max_seq_len:
            raise PolyspecError(f"prompt ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                                f"max_seq_len {self.max_seq_len}; shorten the prompt, lower max_new_tokens or build "
                                "the decoder with a larger max_seq_len")
        return prompt


def _device_round(levels: list[Level], draft: DraftSpec | None, force: bool | None) -> DeviceRound | None:
    """The device round for this chain where it is wanted (device_round.wanted) and supported, else None."""
    device = getattr(levels[0], "device", torch.device("cpu"))
    if not device_round.wanted(device, force):
        return None
    reason = device_round.unsupported(levels, draft)
    if reason is not None:
        if force:
            raise PolyspecError(f"device_round=True, but the device round cannot run this chain: {reason}")
        return None
    bottom = levels[-1]
    target, low = levels[0].model, getattr(bottom, "model", getattr(bottom, "head", None))
    # kept on the target between decoders (one a generation in bench and serve): its compiled code and captured graph
    # serve every generation, DeviceRound.start re-syncing what changed
    tree = draft.tree
    key = (id(low), bottom.needs_features, draft.k if tree is None else (tree.top_k, tree.depth, tree.total_tokens))
    kept = target.__dict__.setdefault("_device_rounds", {})
    rnd = kept.get(key)
    if rnd is None or rnd.draft is not low:
        rnd = TreeRound(target, low, head=bottom.needs_features, shape=tree) if tree is not None else \
            DeviceRound(target, low, head=bottom.needs_features, k=draft.k)
        kept[key] = rnd
    return rnd


def _check_levels(levels: list[Level]) -> None:
    if not levels:
        raise PolyspecError("ChainDecoder needs at least one level (the target)")
    for lv in levels:
        missing = [a for a in ("name", "needs_features", "forward", "truncate", "reset", "setup") if not hasattr(lv, a)]
        if missing:
            raise PolyspecError(f"chain level {lv!r} lacks {missing}; wrap models in ModelLevel / HeadLevel")
    owners = [id(getattr(lv, "model", getattr(lv, "head", lv))) for lv in levels]
    if len(set(owners)) != len(owners):
        raise PolyspecError("the same model appears twice in the chain; every level owns its KV cache, so give "
                            "each level its own model object (a copy if they are the same weights)")


def _check_features(levels: list[Level], verifiers: int) -> None:
    """Only a draft level (the bottom, below at least one verifier) may read the features of a level above."""
    readers = [lv.name for i, lv in enumerate(levels) if lv.needs_features and i < verifiers]
    if readers:
        raise PolyspecError(f"levels {readers} read features of a level above; only the bottom (draft) level of a "
                            "chain with at least two levels may")


def _check_mu(mu: list[int] | None, verifiers: int) -> list[int]:
    n_mu = max(verifiers - 1, 0)
    mu = list(mu) if mu is not None else [8] * n_mu
    if len(mu) != n_mu:
        raise PolyspecError(f"mu has {len(mu)} entries but this chain takes {n_mu} (one per verifier below the "
                            "target, top first; none for ar and dual)")
    if any(isinstance(m, bool) or not isinstance(m, int) or m < 1 for m in mu):
        raise PolyspecError(f"mu entries must be integers >= 1, got {mu}")
    return mu


def _check_tree_levels(levels: list[Level]) -> None:
    if len(levels) < 2:
        raise PolyspecError("a draft tree needs a draft: use it with dual or chain, not ar")
    lacking = [lv.name for lv in levels[-2:] if not hasattr(lv, "forward_tree")]
    if lacking:
        raise PolyspecError(f"tree decoding needs forward_tree() on the draft and the level verifying it; {lacking} "
                            "lack it (ModelLevel, HeadLevel and TableLevel have it)")


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
    """One generate() call: the verification recursion over the run's :class:`~polyspec.decode.state.RunState`."""

    def __init__(self, dec: ChainDecoder, sampling: SamplingParams, generator: torch.Generator,
                 eos: frozenset[int], limit: int, on_tokens: Callable[[list[int]], bool | None] | None = None):
        self.drafter, self.mu, self.on_tokens = dec.drafter, dec.mu, on_tokens
        self.device = dec.device_round
        self.capacity = dec.max_seq_len + (self.device.k + 2 if self.device is not None else 0)
        self.on_device = False  # whether decode() ran on the device round
        self.bottom = dec.verifiers - 1  # the level that verifies the drafter's proposals
        has_level = self.drafter is not None and self.drafter.has_level
        self.st = RunState(dec.levels, draft_level=len(dec.levels) - 1 if has_level else None, sampling=sampling,
                           generator=generator, eos=eos, limit=limit,
                           drafter_name="lookup" if self.drafter is not None and not has_level else None)

    def decode(self, prompt: list[int]) -> list[int]:
        """The target's loop: each round commits what one target verification emits."""
        st = self.st
        self.on_device = self.device is not None and self.device.applies(prompt, st.sampling)
        if self.on_device:
            return device_round.decode(self.device, st, prompt, self.capacity, self.on_tokens)
        st.prefill(prompt)
        seq = list(prompt)
        while len(seq) < st.limit and not (len(seq) > len(prompt) and seq[-1] in st.eos):
            out, _ = self._verify_round(0, seq)
            seq += out
            if self.on_tokens is not None and self.on_tokens(list(out)):
                break
        return seq

    def _produce(self, i: int, ctx: list[int], need: int) -> tuple[list[int], torch.Tensor | None]:
        """Level i continues ctx with >= min(need, room) tokens (fewer only after an EOS); returns them and level i's
        distributions at their positions ([k, V]; None at T = 0, where no verifier reads them)."""
        room = self.st.limit - len(ctx)
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        while len(tokens) < min(need, room) and not (tokens and tokens[-1] in self.st.eos):
            out, p = self._verify_round(i, ctx + tokens)
            tokens += out
            probs.append(p)
        return tokens, (torch.cat(probs) if probs and probs[0] is not None else None)

    def _verify_round(self, i: int, ctx: list[int]) -> tuple[list[int], torch.Tensor | None]:
        """The level below (or the drafter) proposes; level i verifies in one forward. Returns the tokens level i
        emits (accepted prefix + correction or bonus, cut at the budget and after an EOS) and p_i at their
        positions (None at T = 0)."""
        room = self.st.limit - len(ctx)
        if i < self.bottom:
            proposal = self._produce(i + 1, ctx, self.mu[i])
        elif self.drafter is not None and room > 0:
            proposal = self.drafter.propose(self.st, ctx, room)
        else:
            proposal = ([], None)
        if isinstance(proposal, Tree):
            if proposal.tokens:
                out, p = verify_tree(self.st, i, ctx, proposal, room)
                self.st.stats[i].accept_lengths.append(len(out))
                return out, p
            proposal = ([], None)  # nothing drawn: level i samples on its own
        return self._verify_block(i, ctx, *proposal, room)

    def _verify_block(self, i: int, ctx: list[int], block: list[int], q: torch.Tensor | None,
                      room: int) -> tuple[list[int], torch.Tensor | None]:
        st = self.st
        logits = st.forward(i, ctx + block, first_row=len(ctx) - 1)  # [len(block) + 1, V]
        st.check_vocab(logits.shape[-1], i)
        p = None
        if st.greedy:  # the one-hot rows' hot indices, as ints: no tensor for a verifier that would not read it
            n_acc, nxt = accept_prefix(argmax_rows(logits), block)
        else:
            s = st.sampling
            p = warp(logits, s.temperature, s.top_p, s.top_k)
            n_acc, nxt = verify_block(p, q if q is not None else p.new_zeros((0, p.shape[-1])), block, st.gen)
        out = st.cut(block[:n_acc] + [nxt], room)
        st.truncate(i, len(ctx) + n_acc)  # this level drops the rejected tokens ...
        st.roll_back_below(i, ctx + out)  # ... and every level below keeps what it shares with the new context
        st.stats[i].accept_lengths.append(len(out))
        return out, None if p is None else p[:len(out)]

    def finish_stats(self) -> list[LevelStats]:
        stats = self.st.stats
        for i, s in enumerate(stats):
            if i <= self.bottom or len(stats) == 1:
                s.tokens_emitted = sum(s.accept_lengths)
            s.mean_accepted = s.tokens_emitted / s.forward_passes if s.forward_passes else 0.0
        return stats

    def beta(self) -> float | None:
        """Drafter forward passes per verification of the level directly above it (None for ar)."""
        if self.drafter is None:
            return None
        verifications = len(self.st.stats[self.bottom].accept_lengths)
        return self.st.stats[-1].forward_passes / verifications if verifications else 0.0
