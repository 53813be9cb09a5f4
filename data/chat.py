"""Chat-template tokenisation with an assistant-only loss mask.

The tokenizer's own chat template renders the conversation; nothing here knows any separator. Assistant turns are
located by rendering conversation prefixes:

- ``before_k`` = render(messages[:k], add_generation_prompt=True): everything up to where the assistant's text
  starts (the assistant header is part of it);
- ``through_k`` = render(messages[:k + 1]): everything up to the end of assistant turn k, its end-of-turn token(s)
  included.

Both must be prefixes of the full render; then the characters ``[len(before_k), len(through_k))`` are assistant
text, minus trailing whitespace (the newline a template writes *after* an end-of-turn token is scaffolding between
turns, not something the model generates). The full render is tokenised once with character offsets, and a token
belongs to the side where it starts. Templates that rewrite earlier turns when later ones are added (so a prefix
render is not a prefix of the full render) are refused with a clear error.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from polyspec.errors import PolyspecError

Message = dict[str, str]


def _name(tokenizer: Any) -> str:
    return str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)


def render_chat(tokenizer: Any, messages: Sequence[Message], *, add_generation_prompt: bool = False) -> str:
    """The conversation as the tokenizer's chat template writes it (text, special tokens spelled out)."""
    if not getattr(tokenizer, "chat_template", None):
        raise PolyspecError(
            f"tokenizer {_name(tokenizer)} has no chat template; use the instruct/chat variant of the model or set "
            "tokenizer.chat_template"
        )
    try:
        text = tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except Exception as exc:  # jinja errors, raise_exception() in the template
        roles = "/".join(m.get("role", "?") for m in messages)
        raise PolyspecError(
            f"the chat template of {_name(tokenizer)} refused a conversation with roles {roles}: "
            f"{type(exc).__name__}: {exc}"
        ) from None
    if not isinstance(text, str):
        raise PolyspecError(f"the chat template of {_name(tokenizer)} did not render text (got {type(text).__name__})")
    return text


def assistant_char_spans(tokenizer: Any, messages: Sequence[Message], *, char_limit: int | None = None,
                         full: str | None = None) -> tuple[str, list[tuple[int, int]]]:
    """The full render and the ``[start, end)`` character spans of each assistant turn (with its end-of-turn marker).

    Spans starting at or after ``char_limit`` are not computed (they would be truncated away anyway). ``full``:
    the full render when the caller already has it.
    """
    if full is None:
        full = render_chat(tokenizer, messages)
    spans: list[tuple[int, int]] = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render_chat(tokenizer, messages[:k], add_generation_prompt=True)
        if char_limit is not None and len(before) >= char_limit:
            break
        through = render_chat(tokenizer, messages[: k + 1])
        if not (full.startswith(before) and full.startswith(through) and through.startswith(before)):
            raise PolyspecError(
                f"the chat template of {_name(tokenizer)} does not render conversation prefixes as prefixes of the "
                f"whole conversation (at message {k}), so assistant turns cannot be located for the loss mask. "
                "Templates that rewrite earlier turns (e.g. drop past reasoning) are not supported; use a template "
                "whose render of the first k messages is a prefix of the full render."
            )
        start, end = len(before), len(through)
        while end > start and full[end - 1].isspace():
            end -= 1
        if end > start:
            spans.append((start, end))
    return full, spans


def tokenize_conversation(tokenizer: Any, messages: Sequence[Message], max_length: int) -> dict[str, list[int]]:
    """Tokenise one conversation with the tokenizer's chat template.

    Returns ``input_ids`` and ``loss_mask`` (same length, at most ``max_length``): 1 on the tokens of assistant
    turns (their text and end-of-turn token(s)), 0 on system/user turns and template scaffolding.
    """
    ids, mask, _ = tokenize_with_length(tokenizer, messages, max_length)
    return {"input_ids": ids, "loss_mask": mask}


def tokenize_with_length(tokenizer: Any, messages: Sequence[Message], max_length: int
                         ) -> tuple[list[int], list[int], int]:
    """:func:`tokenize_conversation` as (input_ids, loss_mask, length before truncation)."""
    if max_length < 1:
        raise PolyspecError(f"max_length must be >= 1, got {max_length}")
    if not getattr(tokenizer, "is_fast", False):
        raise PolyspecError(
            f"tokenizer {_name(tokenizer)} is a slow (Python) tokenizer; the loss mask needs character offsets, "
            "which only fast tokenizers (tokenizer.json) provide"
        )
    full = render_chat(tokenizer, messages)
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    full_length = len(enc["input_ids"])
    ids: list[int] = list(enc["input_ids"][:max_length])
    offsets: list[tuple[int, int]] = [tuple(o) for o in enc["offset_mapping"][:max_length]]
    char_limit = offsets[-1][1] if full_length > max_length else None
    _, spans = assistant_char_spans(tokenizer, messages, char_limit=char_limit, full=full)

    mask = [0] * len(ids)
    j = 0  # spans and token starts both increase: one merge-like pass
    for i, (start, _end) in enumerate(offsets):
        while j < len(spans) and spans[j][1] <= start:
            j += 1
        if j < len(spans) and spans[j][0] <= start < spans[j][1]:
            mask[i] = 1
    return ids, mask, full_length


def masked_segments(tokenizer: Any, input_ids: Sequence[int], loss_mask: Sequence[int], *, value: int = 1
                    ) -> list[str]:
    """Decode each maximal run of tokens whose mask equals ``value`` (for inspection and tests)."""
    runs: list[list[int]] = []
    prev = None
    for tok, m in zip(input_ids, loss_mask, strict=True):
        if m == value:
            if prev != value:
                runs.append([])
            runs[-1].append(int(tok))
        prev = m
    return [tokenizer.decode(r, skip_special_tokens=False, clean_up_tokenization_spaces=False) for r in runs]
