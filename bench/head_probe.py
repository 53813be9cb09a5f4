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
    equals the target's own argmax. Head row t reads (x_{t+1}, f_t) and predicts x_{t+2}; without a KV cache."""
    import torch

    seq = torch.tensor(prompt + answer)
    saved = (target.__dict__.get("_cache"), head.__dict__.get("_cache"))
    target._cache = head._cache = None
    try:
        with torch.no_grad():
            logits, hidden = target(seq)  # [L, V], [L, H]
            head_logits, _ = head(seq[1:], hidden[:-1])  # row t predicts x_{t+2}
    finally:
        target._cache, head._cache = saved
    rows = slice(len(prompt) - 1, len(seq) - 2)  # rows t predicting answer tokens 1..n-1 (x_{t+2}); token 0 is prefill
    hits = head_logits.argmax(-1)[rows] == logits.argmax(-1)[1:][rows]
    return int(hits.sum()), int(hits.numel())


def probe_category(target: Any, head: Any, tokenizer: Any, questions: list[Any], *, max_new_tokens: int,
                   draft_k: int) -> dict[str, Any]:
    """One category's numbers (module docstring)."""
    from polyspec.decode.acceptance import depth_acceptance
    from polyspec.decode.chain import ChainDecoder, SamplingParams
    from polyspec.decode.generate import KV_SLACK, encode_prompt, eos_ids
    from polyspec.decode.levels import HeadLevel, ModelLevel

    eos = frozenset(eos_ids(tokenizer))
    prompts = [encode_prompt(tokenizer, q.turns[0]) for q in questions]
    dec = ChainDecoder([ModelLevel(target, "target"), HeadLevel(head, "head")], draft_k=draft_k,
                       max_seq_len=max(len(p) for p in prompts) + max_new_tokens + KV_SLACK)
    lengths: list[int] = []
    new = hits = positions = 0
    for ids in prompts:
        res = dec.generate(list(ids), max_new_tokens, SamplingParams(), seed=0, eos_token_ids=eos)
        lengths += res.level_stats[0].accept_lengths
        new += len(res.token_ids)
        h, n = own_text_top1(target, head, list(ids), list(res.token_ids))
        hits, positions = hits + h, positions + n
    return {"prompts": len(prompts), "new_tokens": new,
            "tokens_per_verification": round(new / len(lengths), 4) if lengths else 0.0,
            "depth_accept": [round(a, 4) for a in depth_acceptance(lengths, draft_k)],
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
    head.set_draft_vocab(args.draft_vocab)
    tokenizer = load_tokenizer(args.target)
    for cat in args.categories.split(","):
        qs = builtin_questions(categories=[cat], limit=args.limit)
        row = probe_category(target, head, tokenizer, qs, max_new_tokens=args.max_new_tokens, draft_k=args.draft_k)
        print(json.dumps({"category": cat, **row}), flush=True)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
