"""Where a draft head loses acceptance: its first guess, or the later drafts that read its own features.

``python -m polyspec.bench.head_probe TARGET_DIR HEAD_DIR [--categories mt_bench,sharegpt] [--limit 8]
[--max-new-tokens 96] [--draft-k 4] [--draft-vocab 8192]`` decodes each category's first turns greedily in dual mode
(the target verifying linear drafts of the head) and prints one JSON line per category:

- ``tokens_per_verification``: what the chain's speed depends on (accepted drafts + the target's own token);
- ``depth_accept``: P(draft token j accepted | tokens 1..j-1 were), j = 1..k (:func:`depth_acceptance`): a fall
  after j = 1 is the drift of drafts that read the head's own predicted features;
- ``top1_own_text``: the head's teacher-forced top-1 agreement on the target's own greedy answer (the head reads the
  target's true features at every position): its first guess on the text the chain really drafts, against
  ``heldout/top1_agreement`` from training, which scores it on the data set's answers.

docs/TRAIN.md ("What limits acceptance") has this machine's numbers.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from polyspec.errors import PolyspecError


def own_text_top1(target: Any, head: Any, prompt: list[int], answer: list[int]) -> tuple[int, int]:
    """(agreements, positions): over the answer's tokens, whether the head's argmax from the target's true features
    equals the target's own argmax. Head row t reads (x_{t+1}, f_t) and predicts x_{t+2}. The engine prefills the
    target with the prompt but its last token, so the head drafts from row P - 2 on (P = prompt length): every answer
    token is a position. Without a KV cache (the models' caches are left as they were)."""
    import torch

    from polyspec.decode.acceptance import kept_caches

    seq = torch.tensor(prompt + answer)
    with kept_caches(target, head), torch.no_grad():
        target._cache = head._cache = None
        logits, hidden = target(seq)  # [L, V], [L, H]
        head_logits, _ = head(seq[1:], hidden[:-1])  # [L - 1, V]: row t predicts x_{t+2}
    rows = slice(max(len(prompt) - 2, 0), len(seq) - 2)  # the rows whose x_{t+2} is an answer token
    hits = head_logits.argmax(-1)[rows] == logits.argmax(-1)[1:][rows]
    return int(hits.sum()), int(hits.numel())


def probe_category(target: Any, head: Any, tokenizer: Any, questions: list[Any], *, max_new_tokens: int,
                   draft_k: int) -> dict[str, Any]:
    """One category's numbers (module docstring)."""
    from polyspec.decode.acceptance import decoder_acceptance
    from polyspec.decode.generate import encode_prompt, eos_ids

    prompts = [encode_prompt(tokenizer, q.turns[0]) for q in questions]
    res = decoder_acceptance(target, head, prompts, max_new_tokens=max_new_tokens, draft_k=draft_k,
                             eos_token_ids=frozenset(eos_ids(tokenizer)))
    hits = positions = 0
    for ids, answer in zip(prompts, res.outputs, strict=True):
        h, n = own_text_top1(target, head, list(ids), list(answer))
        hits, positions = hits + h, positions + n
    return {"prompts": res.prompts, "new_tokens": res.new_tokens,
            "tokens_per_verification": round(res.tokens_per_verification, 4),
            "depth_accept": [round(a, 4) for a in res.depth_accept],
            "top1_own_text": round(hits / positions, 4) if positions else 0.0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m polyspec.bench.head_probe", description=__doc__.split("\n")[0])
    p.add_argument("target", type=Path, help="the target's Hugging Face folder")
    p.add_argument("head", type=Path, help="an EAGLE head folder trained for that target")
    p.add_argument("--categories", default="mt_bench,sharegpt", help="builtin prompt categories (polyspec bench)")
    p.add_argument("--limit", type=int, default=8, help="first turns per category")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--draft-k", type=int, default=4)
    p.add_argument("--draft-vocab", type=int, default=8192, help="0: the full vocabulary")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="the target's dtype")
    args = p.parse_args(argv)
    try:
        _run(args)
    except PolyspecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code or 2
    return 0


def _run(args: argparse.Namespace) -> None:
    import torch

    from polyspec.bench.prompts import builtin_questions
    from polyspec.decode.generate import load_model
    from polyspec.decode.head import load_head
    from polyspec.sources import load_tokenizer

    target = load_model(args.target, dtype=getattr(torch, args.dtype), device=torch.device("cpu"))
    head = load_head(args.head, target)
    if getattr(head, "head_type", "eagle") != "eagle":
        raise PolyspecError(f"{args.head}: head_probe reads EAGLE-1/2 heads (the target's final hidden state as the "
                            "feature); this is an EAGLE-3 head")
    head.set_draft_vocab(args.draft_vocab)
    tokenizer = load_tokenizer(args.target)
    for cat in args.categories.split(","):
        notes: list[str] = []
        qs = builtin_questions(categories=[cat], limit=args.limit, notes=notes)
        if not qs:
            raise PolyspecError("; ".join(notes) or f"no prompts in category {cat!r}")
        row = probe_category(target, head, tokenizer, qs, max_new_tokens=args.max_new_tokens, draft_k=args.draft_k)
        print(json.dumps({"category": cat, **row}), flush=True)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
