"""Calibration prompts for the profile: MT-bench first turns alternating with first user turns of the recipe's
held-out ShareGPT split, each through the tokenizer's chat template."""

from __future__ import annotations

from typing import Any

from polyspec.errors import PolyspecError


def calibration_prompts(tokenizer: Any, n: int, *, data_source: str | None = None,
                        max_conversations: int | None = None, heldout_fraction: float = 0.02, seed: int = 0,
                        max_prompt_tokens: int = 384) -> list[dict[str, Any]]:
    """``n`` chat prompts, alternating MT-bench first turns and first user turns of held-out ShareGPT conversations
    (split exactly as the data stage splits them), each through the tokenizer's chat template.

    Returns ``[{"source": "mtbench" | "sharegpt", "id": ..., "input_ids": [...]}, ...]``; prompts longer than
    ``max_prompt_tokens`` are skipped. Sources that are not installed contribute nothing (the other fills in); none
    at all raises PolyspecError.
    """
    from polyspec.decode.generate import encode_prompt

    pools: list[list[tuple[str, Any, str]]] = []
    problems: list[str] = []
    try:
        from polyspec.data.prompts import mtbench_questions

        pools.append([("mtbench", q.question_id, q.turns[0]) for q in mtbench_questions() if q.turns])
    except PolyspecError as exc:
        problems.append(f"MT-bench: {exc}")
    if data_source:
        try:
            from polyspec.data.prepare import split_indices
            from polyspec.data.sharegpt import load_conversations

            convs, _ = load_conversations(data_source, max_conversations=max_conversations)
            _, held = split_indices(len(convs), heldout_fraction, seed)
            firsts = []
            for i in held:
                user = next((m["content"] for m in convs[i] if m["role"] == "user"), None)
                if user:
                    firsts.append(("sharegpt", i, user))
            pools.append(firsts)
        except PolyspecError as exc:
            problems.append(f"ShareGPT ({data_source}): {exc}")
    out: list[dict[str, Any]] = []
    cursors = [0] * len(pools)
    while len(out) < n and any(c < len(p) for c, p in zip(cursors, pools, strict=True)):
        for j, pool in enumerate(pools):
            while cursors[j] < len(pool) and len(out) < n:
                src, qid, text = pool[cursors[j]]
                cursors[j] += 1
                ids = encode_prompt(tokenizer, text)
                if len(ids) <= max_prompt_tokens:
                    out.append({"source": src, "id": qid, "input_ids": ids})
                    break
    if not out:
        raise PolyspecError("no calibration prompts: " + ("; ".join(problems) or "the prompt sources are empty"))
    return out
