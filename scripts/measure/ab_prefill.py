"""A prompt's attention through the CPU kernel (cpu_kernels.attention) against torch's SDPA, alternated per question
in one process: default / ar on the bench's builtin prompts (the first LIMIT per category, both MT-bench turns with
the ar answer as history, 96 new tokens). The answers differ between the two (the prompts' last layers round
differently), so this measures how much the chain's speed rides on which answers come out.

    python scripts/measure/ab_prefill.py CHAIN [LIMIT [SKIP]]     # SKIP: leave out the first SKIP per category

docs/BENCHMARKS.md, "CPU, stop 23".
"""

import collections
import sys
import time
from pathlib import Path

import torch

from polyspec.bench.prompts import load_prompts
from polyspec.decode import cpu_kernels as ck
from polyspec.decode.generate import generate_text, load_chain

CATEGORIES = ("mt_bench", "humaneval", "sharegpt")


def main(chain_dir: str, limit: str = "10", skip: str = "0") -> None:
    torch.set_num_threads(2)
    chain = load_chain(Path(chain_dir), device="cpu")
    kernel = ck.attention
    secs: dict[tuple, float] = collections.defaultdict(float)
    toks: dict[tuple, int] = collections.defaultdict(int)
    passes: dict[tuple, int] = collections.defaultdict(int)
    generate_text(chain, "hi", mode=None, max_new_tokens=8)
    seen: collections.Counter = collections.Counter()
    for i, q in enumerate(load_prompts("builtin", categories=list(CATEGORIES), limit=int(skip) + int(limit))):
        seen[q.category] += 1
        if seen[q.category] <= int(skip):
            continue
        for tag in ("kernel", "sdpa") if i % 2 == 0 else ("sdpa", "kernel"):
            ck.attention = kernel if tag == "kernel" else (lambda *a, **k: None)
            msgs: list[dict[str, str]] = []
            for turn in q.turns[:2]:
                msgs.append({"role": "user", "content": turn})
                text = ""
                for mode in ("ar", "default"):
                    t0 = time.perf_counter()
                    r = generate_text(chain, None, messages=msgs, mode=None if mode == "default" else mode,
                                      max_new_tokens=96)
                    secs[tag, mode, q.category] += time.perf_counter() - t0
                    toks[tag, mode, q.category] += len(r["token_ids"])
                    passes[tag, mode] += r["stats"]["levels"][0]["forward_passes"]
                    text = text or r["text"]
                msgs.append({"role": "assistant", "content": text})
    ck.attention = kernel
    for tag in ("kernel", "sdpa"):
        parts = []
        for cat in (*CATEGORIES, None):
            cats = CATEGORIES if cat is None else (cat,)
            speed = {m: sum(toks[tag, m, c] for c in cats) / sum(secs[tag, m, c] for c in cats)
                     for m in ("ar", "default")}
            parts.append(f"{cat or 'all'} {speed['default'] / speed['ar']:.3f}")
        speeds = {m: sum(toks[tag, m, c] for c in CATEGORIES) / sum(secs[tag, m, c] for c in CATEGORIES)
                  for m in ("ar", "default")}
        tokens = sum(toks[tag, "default", c] for c in CATEGORIES)
        print(tag, "default / ar:", " ".join(parts), f"| ar {speeds['ar']:.1f} tok/s, default {speeds['default']:.1f}"
              f" tok/s, default's tokens per target forward {tokens / passes[tag, 'default']:.3f}")


if __name__ == "__main__":
    main(*sys.argv[1:])
