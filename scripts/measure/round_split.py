"""Where a round's time goes: whole generations of ``ar`` and the chain's default (builtin first turns, 2 per
category, 96 tokens, twice, alternated), each level's forward timed; the rest is the decoder's own (Python) work.

    python scripts/measure/round_split.py CHAIN

docs/BENCHMARKS.md, "CPU, stop 24".
"""

import collections
import sys
import time
from pathlib import Path

import torch

from polyspec.bench.prompts import load_prompts
from polyspec.decode import levels
from polyspec.decode.chain import SamplingParams
from polyspec.decode.generate import build_decoder, cache_size, encode_prompt, eos_ids, load_chain

spent: dict[tuple[str, str], float] = collections.defaultdict(float)
calls: collections.Counter = collections.Counter()
state = {"mode": ""}


def timed(fn, name: str):
    def wrapper(*args, **kw):
        t0 = time.perf_counter()
        out = fn(*args, **kw)
        spent[(state["mode"], name)] += time.perf_counter() - t0
        calls[(state["mode"], name)] += 1
        return out
    return wrapper


def main(chain_dir: str) -> None:
    torch.set_num_threads(2)
    levels.ModelLevel.forward = timed(levels.ModelLevel.forward, "target")
    levels.HeadLevel.forward = timed(levels.HeadLevel.forward, "head")
    chain = load_chain(Path(chain_dir), device="cpu")
    questions = load_prompts("builtin", categories=["mt_bench", "humaneval", "sharegpt"], limit=2)
    for rep in range(2):
        for i, q in enumerate(questions):
            ids = encode_prompt(chain.tokenizer, q.turns[0])
            for mode in ("ar", chain.mode) if (i + rep) % 2 == 0 else (chain.mode, "ar"):
                state["mode"] = mode
                dec = build_decoder(chain, mode, max_seq_len=cache_size(chain, len(ids), 96))
                t0 = time.perf_counter()
                r = dec.generate(ids, 96, SamplingParams(), eos_token_ids=eos_ids(chain.tokenizer))
                spent[(mode, "total")] += time.perf_counter() - t0
                calls[(mode, "tokens")] += len(r.token_ids)
    for mode in ("ar", chain.mode):
        total, target, head = (spent[(mode, k)] for k in ("total", "target", "head"))
        n, h = calls[(mode, "target")], calls[(mode, "head")]
        rest = total - target - head
        print(f"{mode}: {calls[(mode, 'tokens')]} tokens in {total:.3f} s; target {n} forwards {target:.3f} s; "
              f"head {h} steps {head:.3f} s ({head / max(h, 1) * 1e3:.2f} ms each); the rest {rest:.3f} s "
              f"({rest / n * 1e3:.3f} ms per target forward)")


if __name__ == "__main__":
    main(*sys.argv[1:])
