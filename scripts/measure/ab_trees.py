"""ar, the chain's default and small draft trees (top k at depth d, prompt lookup first or grafted) in one process,
the modes rotated per prompt after an untimed first one: tok/s against ar and tokens per target verification.

    python scripts/measure/ab_trees.py CHAIN LIMIT TOKENS K/D/N/F [K/D/N/F ...]

K/D/N/F: tree top_k / depth / total_tokens / lookup_first (1: tree.lookup_first, 0: the lookup path grafted), with
prompt-lookup runs of up to 4 either way. Builtin first turns, LIMIT per category. docs/BENCHMARKS.md, "CPU, stop 27".
"""

import collections
import sys
import time
from pathlib import Path

import torch

from polyspec.bench.prompts import load_prompts
from polyspec.decode.chain import SamplingParams, TreeParams
from polyspec.decode.generate import build_decoder, cache_size, encode_prompt, eos_ids, load_chain


def main(chain_dir: str, limit: str, tokens: str, *shapes: str) -> None:
    torch.set_num_threads(2)
    chain = load_chain(Path(chain_dir), device="cpu")
    n = int(tokens)
    trees = {f"tree {s}": TreeParams(*(int(v) for v in s.split("/")[:3]), lookup=4,
                                     lookup_first=s.split("/")[3] == "1") for s in shapes}
    modes = ["ar", "default", *trees]
    secs: dict[str, float] = collections.defaultdict(float)
    toks: collections.Counter = collections.Counter()
    rounds: collections.Counter = collections.Counter()
    questions = load_prompts("builtin", categories=["mt_bench", "humaneval", "sharegpt"], limit=int(limit))
    for i, q in enumerate(questions):
        ids = encode_prompt(chain.tokenizer, q.turns[0])
        size = cache_size(chain, len(ids), n + 16)
        outs = {}
        for m in modes[i % len(modes):] + modes[:i % len(modes)]:
            dec = build_decoder(chain, "ar" if m == "ar" else ("dual" if m in trees else chain.mode),
                                max_seq_len=size, **({"tree": trees[m]} if m in trees else {}))
            t0 = time.perf_counter()
            r = dec.generate(ids, n, SamplingParams(), eos_token_ids=eos_ids(chain.tokenizer))
            outs[m] = r.token_ids
            if i:  # the first prompt warms every mode up
                secs[m] += time.perf_counter() - t0
                toks[m] += len(r.token_ids)
                rounds[m] += r.level_stats[0].forward_passes
        bad = [m for m in modes if outs[m] != outs["ar"]]
        if bad:
            print(f"answers differ from ar's on {q.question_id}: {bad}")
    ar = toks["ar"] / secs["ar"]
    for m in modes:
        print(f"{m:16s} {toks[m] / secs[m]:7.1f} tok/s  x{toks[m] / secs[m] / ar:.3f}  "
              f"tokens per target forward {toks[m] / rounds[m]:.2f}")


if __name__ == "__main__":
    main(*sys.argv[1:])
