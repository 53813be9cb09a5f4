"""Batched decoding speed by batch size: what answering training conversations (``data.responses: target``) costs
once the prompts are in the cache.

``python -m polyspec.bench.batch_decode MODEL_DIR [--batches 16,64,128] [--prompt-tokens 8] [--new-tokens 64]
[--dtype bfloat16]`` runs :func:`polyspec.decode.batch.generate_batch` on equal prompts of ``--prompt-tokens``
tokens (short, so their prefills, one per row and inside the timing, cost little), one warm-up of 4 tokens and then
``--new-tokens`` tokens per row with no end-of-sequence token, and prints one JSON line per batch size: ms per decode
step and generated tokens/s.
docs/DATA.md ("Where the time goes") has this machine's numbers.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from polyspec.errors import PolyspecError


def time_batch(model: Any, batch: int, *, prompt_tokens: int, new_tokens: int) -> dict[str, float]:
    """One batch size: {batch, ms_per_step, tokens_per_second} over ``new_tokens`` steps (after a short warm-up)."""
    from polyspec.decode.batch import generate_batch
    from polyspec.decode.timing import timed

    prompts = [[1 + (i % 7)] * prompt_tokens for i in range(batch)]
    generate_batch(model, prompts, max_new_tokens=4, eos_token_ids=set())  # oneDNN picks its kernels once
    out, seconds = timed(lambda: generate_batch(model, prompts, max_new_tokens=new_tokens, eos_token_ids=set()),
                         "cpu")
    tokens = sum(len(r.token_ids) for r in out)
    return {"batch": batch, "ms_per_step": round(seconds / new_tokens * 1000, 3),
            "tokens_per_second": round(tokens / seconds, 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m polyspec.bench.batch_decode", description=__doc__.split("\n")[0])
    p.add_argument("model", type=Path, help="a Hugging Face folder polyspec's engine loads")
    p.add_argument("--batches", default="16,64,128", help="comma-separated batch sizes")
    p.add_argument("--prompt-tokens", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    args = p.parse_args(argv)
    try:
        batches = [int(b) for b in args.batches.split(",")]
        if min(batches) < 1 or args.prompt_tokens < 1 or args.new_tokens < 1:
            raise ValueError
    except ValueError:
        print("error: --batches takes positive integers (e.g. 16,64,128); --prompt-tokens and --new-tokens >= 1",
              file=sys.stderr)
        return 2
    try:
        _run(args, batches)
    except PolyspecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code or 2
    return 0


def _run(args: argparse.Namespace, batches: list[int]) -> None:
    import torch

    from polyspec.decode import cpu_kernels
    from polyspec.decode.generate import load_model

    model = load_model(args.model, dtype=getattr(torch, args.dtype), device=torch.device("cpu"))
    cpu_kernels.pack_weights(model)
    for b in batches:
        row = time_batch(model, b, prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens)
        print(json.dumps({"dtype": args.dtype, **row}), flush=True)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
