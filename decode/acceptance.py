"""Acceptance as the decoder sees it: greedy dual decoding of a target with its draft head, counted per verification.

The train stage calls this at each validation (``heldout/accept_linear``, ``heldout/accept_tree`` in MLflow), so a
head is judged by the number the chain's speed depends on - the mean tokens each target verification commits - and
not only by its one-step, teacher-forced top-1 agreement. The models keep their state: a KV cache the decoder sets
up is dropped again afterwards (training passes are stateless and must not write into a cache).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from polyspec.errors import PolyspecError


@dataclass(frozen=True)
class AcceptanceResult:
    """Greedy dual decoding over some prompts: committed tokens per target verification."""

    tokens_per_verification: float
    new_tokens: int
    verifications: int
    prompts: int
    depth_accept: tuple[float, ...] = ()  # linear drafts: P(draft token j accepted | tokens 1..j-1 were), j = 1..k
    outputs: tuple[tuple[int, ...], ...] = ()  # each prompt's generated tokens


def depth_acceptance(lengths: list[list[int]], draft_k: int) -> tuple[float, ...]:
    """Per-depth conditional acceptance of linear drafts from the tokens each verification committed (accepted + 1),
    one list per prompt: entry j - 1 is the share of verifications that accepted draft token j among those that
    accepted tokens 1..j-1 (0.0 where none got that far). Each prompt's last verification is left out: the token
    budget or an end-of-sequence token may have cut it, which would read as a rejection. A fall after j = 1 is the
    drift of drafts that read the head's own features; a low j = 1 is a weak first guess."""
    counted = [n for per_prompt in lengths for n in per_prompt[:-1]]
    out = []
    for j in range(1, draft_k + 1):
        reached = sum(1 for n in counted if n >= j)  # draft tokens 1..j-1 accepted
        out.append(sum(1 for n in counted if n >= j + 1) / reached if reached else 0.0)
    return tuple(out)


@contextmanager
def kept_caches(*models: torch.nn.Module) -> Iterator[None]:
    """Whatever KV caches code inside sets up on ``models`` is dropped afterwards (their caches are put back as they
    were): training passes are stateless and must not write into a cache."""
    saved = [(m, m.__dict__.get("_cache")) for m in models]
    try:
        yield
    finally:
        for model, cache in saved:
            model._cache = cache


def prompt_prefix(input_ids: list[int], loss_mask: list[int]) -> list[int] | None:
    """A prepared row's prompt: its tokens before the first assistant (loss-masked) token, i.e. the first user turn
    with the assistant header already open; None when the row has no assistant token or an empty prefix."""
    first = next((j for j, m in enumerate(loss_mask) if m), None)
    if not first:
        return None
    return [int(t) for t in input_ids[:first]]


def decoder_acceptance(target: torch.nn.Module, head: torch.nn.Module, prompts: list[list[int]], *,
                       max_new_tokens: int, draft: Any, eos_token_ids: frozenset[int] = frozenset()) -> AcceptanceResult:
    """Decode each prompt greedily with ``target`` verifying ``head`` (an EAGLE head reading the target's features)
    as ``draft`` (a :class:`polyspec.chain_spec.DraftSpec`: linear drafts of draft.k tokens, or its EAGLE-2 tree).
    Returns the mean number of tokens committed per target verification (accepted drafts + the target's own), for
    linear drafts the per-depth acceptance (:func:`depth_acceptance`), and each prompt's generated tokens."""
    from polyspec.decode.chain import ChainDecoder, SamplingParams
    from polyspec.decode.generate import KV_SLACK
    from polyspec.decode.levels import HeadLevel, ModelLevel

    if not prompts:
        raise PolyspecError("decoder_acceptance needs at least one prompt")
    lengths, outputs = [], []
    with kept_caches(target, head):
        longest = max(len(p) for p in prompts)
        dec = ChainDecoder([ModelLevel(target, "target"), HeadLevel(head, "head")], draft=draft,
                           max_seq_len=longest + max_new_tokens + KV_SLACK)
        for ids in prompts:
            res = dec.generate(list(ids), max_new_tokens, SamplingParams(), seed=0, eos_token_ids=eos_token_ids)
            outputs.append(tuple(res.token_ids))
            lengths.append(list(res.level_stats[0].accept_lengths))
    new, verifications = sum(len(o) for o in outputs), sum(len(x) for x in lengths)
    depths = depth_acceptance(lengths, draft.k) if draft.tree is None else ()
    return AcceptanceResult(new / verifications if verifications else 0.0, new, verifications, len(prompts), depths,
                            tuple(outputs))
