"""Calibration and evaluation token sequences from the recipe's ShareGPT conversations, through the target's chat
template (never random text).

The conversations are split exactly as :func:`polyspec.data.prepare.prepare_dataset` splits them (same loader, same
:func:`~polyspec.data.prepare.split_indices` with ``data.heldout_fraction`` / ``data.seed``), so calibration draws
only from the training side and the quality report measures on the held-out side.

A calibration sample is exactly ``length`` tokens: a training conversation rendered by the chat template, continued
by the next conversations (also rendered) when it is shorter. Every sample therefore starts at the beginning of a
conversation and carries the template's markers; the order of conversations is a seeded shuffle.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from polyspec.errors import PolyspecError

Message = dict[str, str]


@dataclass
class SplitConversations:
    """The recipe's conversations, split as the data stage splits them."""

    train: list[list[Message]]
    heldout: list[list[Message]]
    source: str


def data_conversations(data: Any) -> SplitConversations:
    """Load a recipe's ``data`` section's source and split it into train / held-out conversations like the data
    stage does."""
    from polyspec.data.prepare import load_split

    cfg = data
    split = load_split(cfg.source, max_conversations=cfg.max_conversations, heldout_fraction=cfg.heldout_fraction,
                       seed=cfg.seed)
    convs = split.conversations
    return SplitConversations([convs[i] for i in split.train], [convs[i] for i in split.heldout], cfg.source)


def chat_token_ids(tokenizer: Any, messages: Sequence[Message], max_length: int) -> list[int]:
    """One conversation through the tokenizer's chat template, at most ``max_length`` tokens."""
    from polyspec.data.chat import tokenize_conversation

    return list(tokenize_conversation(tokenizer, messages, max_length)["input_ids"])


def calibration_samples(tokenizer: Any, conversations: Sequence[Sequence[Message]], n_samples: int, length: int,
                        seed: int = 0) -> list[list[int]]:
    """``n_samples`` chat-formatted token sequences of exactly ``length`` tokens (see the module docstring).

    Conversations are visited in a seeded shuffle and used at most once; raises PolyspecError when they hold fewer
    than ``n_samples * length`` tokens.
    """
    if n_samples < 1 or length < 2:
        raise PolyspecError(f"calibration needs samples >= 1 and length >= 2, got {n_samples} x {length}")
    if not conversations:
        raise PolyspecError("no training conversations to calibrate on; check data.source and data.heldout_fraction")
    order = list(range(len(conversations)))
    random.Random(seed).shuffle(order)
    samples: list[list[int]] = []
    current: list[int] = []
    for i in order:
        current.extend(chat_token_ids(tokenizer, conversations[i], length - len(current)))
        if len(current) >= length:
            samples.append(current[:length])
            current = []
            if len(samples) == n_samples:
                return samples
    have = sum(len(s) for s in samples) + len(current)
    raise PolyspecError(
        f"the {len(conversations)} training conversations hold only {have} tokens, fewer than quantize."
        f"calibration_samples x calibration_length = {n_samples} x {length}; lower those settings or raise "
        "data.max_conversations"
    )


def heldout_sequences(tokenizer: Any, conversations: Sequence[Sequence[Message]], max_length: int,
                      max_sequences: int | None = None, min_length: int = 8) -> list[list[int]]:
    """Held-out conversations through the chat template (each at most ``max_length`` tokens; ones shorter than
    ``min_length`` are skipped), for perplexity / agreement / KL."""
    out: list[list[int]] = []
    for messages in conversations:
        ids = chat_token_ids(tokenizer, messages, max_length)
        if len(ids) >= min_length:
            out.append(ids)
        if max_sequences is not None and len(out) >= max_sequences:
            break
    if not out:
        raise PolyspecError("no held-out conversation of at least "
                            f"{min_length} tokens; raise data.heldout_fraction or data.max_conversations")
    return out


def first_user_prompts(tokenizer: Any, conversations: Sequence[Sequence[Message]], n: int,
                       max_prompt_tokens: int = 192) -> list[list[int]]:
    """Up to ``n`` prompts: each conversation's messages before its first assistant turn, rendered with the
    generation prompt (what a chat user sends), skipping prompts longer than ``max_prompt_tokens``."""
    from polyspec.data.chat import render_chat

    prompts: list[list[int]] = []
    for messages in conversations:
        first = next((k for k, m in enumerate(messages) if m["role"] == "assistant"), None)
        if not first:
            continue
        text = render_chat(tokenizer, messages[:first], add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if 0 < len(ids) <= max_prompt_tokens:
            prompts.append(list(ids))
        if len(prompts) >= n:
            break
    if not prompts:
        raise PolyspecError(f"no held-out conversation has a first user turn of at most {max_prompt_tokens} tokens")
    return prompts


def samples_digest(samples: Sequence[Sequence[int]]) -> str:
    """SHA-256 of the calibration token ids (part of the quantised output's cache key)."""
    blob = json.dumps([list(map(int, s)) for s in samples], separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()
