"""Calibration prompts for the profile: MT-bench questions (the first turn, then the second after the target's own
answer to the first, as a chat's next turn) alternating with held-out ShareGPT conversations up to their second user
turn (history included; the first user turn where there is no second or the history is too long), each through the
tokenizer's chat template."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from polyspec.errors import PolyspecError

# What the prompts are made of; it keys stored profiles (2: MT-bench second turns after the target's answer and
# ShareGPT conversations up to their second user turn; before: first turns only).
CALIBRATION_FORMAT = 2


def calibration_prompts(tokenizer: Any, n: int, *, data_source: str | None = None,
                        max_conversations: int | None = None, heldout_fraction: float = 0.02, seed: int = 0,
                        max_prompt_tokens: int = 384,
                        answer: Callable[[list[int]], str] | None = None) -> list[dict[str, Any]]:
    """``n`` chat prompts, alternating MT-bench first turns and held-out ShareGPT conversations (split exactly as the
    data stage splits them) up to their second user turn (:func:`sharegpt_prompt`), each through the tokenizer's chat
    template. With ``answer`` (prompt ids -> the target's answer text) each MT-bench question with a second turn also
    gives that turn after the target's answer to the first (``source`` "mtbench-2"), right after its first. A later
    turn's history is what prompt lookup (decode.draft.lookup) copies from in served chats, so the
    profile weighs it on such prompts too.

    Returns ``[{"source": "mtbench" | "sharegpt", "id": ..., "input_ids": [...]}, ...]``; prompts longer than
    ``max_prompt_tokens`` are skipped. Sources that are not installed contribute nothing (the other fills in); none
    at all raises PolyspecError.
    """
    from polyspec.decode.generate import encode_messages

    def encode(messages: list[dict[str, str]]) -> list[int]:
        return encode_messages(tokenizer, messages)

    pools: list[list[tuple[str, Any, Callable[[], list[dict[str, str]]]]]] = []
    problems: list[str] = []
    try:
        from polyspec.data.prompts import mtbench_questions

        pools.append([entry for q in mtbench_questions() if q.turns for entry in _mtbench_turns(q, encode, answer)])
    except PolyspecError as exc:
        problems.append(f"MT-bench: {exc}")
    if data_source:
        try:
            from polyspec.data.prepare import split_indices
            from polyspec.data.sharegpt import load_conversations

            convs, _ = load_conversations(data_source, max_conversations=max_conversations)
            _, held = split_indices(len(convs), heldout_fraction, seed)
            pools.append([("sharegpt", i, lambda conv=convs[i]: conv) for i in held])
        except PolyspecError as exc:
            problems.append(f"ShareGPT ({data_source}): {exc}")
    out: list[dict[str, Any]] = []
    cursors = [0] * len(pools)
    while len(out) < n and any(c < len(p) for c, p in zip(cursors, pools, strict=True)):
        for j, pool in enumerate(pools):
            while cursors[j] < len(pool) and len(out) < n:
                src, qid, messages = pool[cursors[j]]
                cursors[j] += 1
                ids = sharegpt_prompt(messages(), encode, max_prompt_tokens)
                if ids is not None:
                    out.append({"source": src, "id": qid, "input_ids": ids})
                    break
    if not out:
        raise PolyspecError("no calibration prompts: " + ("; ".join(problems) or "the prompt sources are empty"))
    return out


def _mtbench_turns(q: Any, encode: Callable[[list[dict[str, str]]], list[int]],
                   answer: Callable[[list[int]], str] | None) -> list[tuple[str, Any, Callable[[], list]]]:
    """An MT-bench question's calibration entries: its first turn, and (with ``answer`` and a second turn) the second
    after the target's answer to the first, made only when the entry is used."""
    first = [{"role": "user", "content": q.turns[0]}]
    out = [("mtbench", q.question_id, lambda: first)]
    if answer is not None and len(q.turns) > 1:
        def second() -> list[dict[str, str]]:
            return [*first, {"role": "assistant", "content": answer(encode(first))},
                    {"role": "user", "content": q.turns[1]}]
        out.append(("mtbench-2", q.question_id, second))
    return out


def sharegpt_prompt(messages: list[dict[str, str]], encode: Any, max_tokens: int) -> list[int] | None:
    """A conversation's calibration prompt: its messages up to its second user turn (the first answer in the history),
    else up to its first user turn; the longest of the two that ``encode`` (messages -> token ids) keeps within
    ``max_tokens``; None when neither fits or there is no user turn. System messages before them are kept."""
    users = [j for j, m in enumerate(messages) if m.get("role") == "user" and m.get("content")]
    for end in reversed(users[:2]):  # the second user turn first
        ids = encode(list(messages[:end + 1]))
        if len(ids) <= max_tokens:
            return ids
    return None
