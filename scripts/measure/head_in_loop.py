"""The draft head level's forward timed inside decoding (the chain's default mode, builtin prompts 2 per category,
first turns, 96 tokens, twice), the one-call kernel step (EagleHead._kernel_step) alternated per generation with
the module path; then the kernel call alone. Medians by width.

    python scripts/measure/head_in_loop.py CHAIN

docs/BENCHMARKS.md, "CPU, stop 23".
"""

import collections
import sys
import time
from pathlib import Path

import torch

from polyspec.bench.prompts import load_prompts
from polyspec.decode import cpu_kernels as ck
from polyspec.decode import levels
from polyspec.decode.chain import SamplingParams
from polyspec.decode.generate import build_decoder, cache_size, encode_prompt, eos_ids, load_chain

times: dict[tuple, list[float]] = collections.defaultdict(list)
state = {"tag": ""}


def timed(fn, key):
    def wrapper(*args, **kw):
        t0 = time.perf_counter()
        out = fn(*args, **kw)
        times[key(args)].append(time.perf_counter() - t0)
        return out
    return wrapper


def main(chain_dir: str) -> None:
    torch.set_num_threads(2)
    chain = load_chain(Path(chain_dir), device="cpu")
    head = chain.models[chain.order[-1]]
    one_call = head._kernel_step
    levels.HeadLevel.forward = timed(levels.HeadLevel.forward, lambda a: (state["tag"], len(a[1])))
    ck.head_step = timed(ck.head_step, lambda a: ("kernel call alone", a[1].numel()))
    questions = load_prompts("builtin", categories=["mt_bench", "humaneval", "sharegpt"], limit=2)
    for _ in range(2):
        for q in questions:
            ids = encode_prompt(chain.tokenizer, q.turns[0])
            for tag in ("module path", "one call"):
                state["tag"] = tag
                head._kernel_step = one_call if tag == "one call" else (lambda *a, **k: None)
                dec = build_decoder(chain, chain.mode, max_seq_len=cache_size(chain, len(ids), 96))
                dec.generate(ids, 96, SamplingParams(), seed=0, eos_token_ids=eos_ids(chain.tokenizer))
    for key in sorted(times):
        v = sorted(times[key])
        if len(v) >= 20:
            print(f"{key[0]}, width {key[1]}: {len(v)} calls, median {v[len(v) // 2] * 1e3:.3f} ms")


if __name__ == "__main__":
    main(*sys.argv[1:])
