"""Where a generation's time goes: every level forward of a chain's mode timed by width, on the bench's builtin
prompts (2 per category: MT-bench, HumanEval, held-out ShareGPT; first turns; 96 new tokens; one warm-up pass).

    python scripts/measure/rounds.py CHAIN_DIR ar|default

Prints each level's calls, mean time per call and total per width (widths over 40: prefills), the decoder's time
outside the forwards, and for a speculative mode its rounds, tokens per round and prompt-lookup tokens.
docs/BENCHMARKS.md, stop 20.
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

PREFILL = 40  # wider forwards are prompt prefills
calls: dict[tuple[str, int], list[float]] = collections.defaultdict(lambda: [0, 0.0])


def timed(cls: type) -> None:
    forward = cls.forward

    def wrapper(self, tokens, start, features=None, **kw):
        t0 = time.perf_counter()
        out = forward(self, tokens, start, features, **kw)
        entry = calls[self.name, len(tokens)]
        entry[0] += 1
        entry[1] += time.perf_counter() - t0
        return out

    cls.forward = wrapper


def run(chain, mode: str, questions: list) -> tuple[float, int, list[tuple[int, int, int]]]:
    seconds, tokens, rounds = 0.0, 0, []
    for q in questions:
        ids = encode_prompt(chain.tokenizer, q.turns[0])
        dec = build_decoder(chain, "ar" if mode == "ar" else chain.mode, max_seq_len=cache_size(chain, len(ids), 96))
        t0 = time.perf_counter()
        res = dec.generate(ids, 96, SamplingParams(), seed=0, eos_token_ids=eos_ids(chain.tokenizer))
        seconds += time.perf_counter() - t0
        tokens += len(res.token_ids)
        st = res.level_stats
        rounds.append((len(st[0].accept_lengths), sum(st[0].accept_lengths), st[-1].lookup_tokens))
    return seconds, tokens, rounds


def main(chain_dir: str, mode: str) -> None:
    torch.set_num_threads(2)
    chain = load_chain(Path(chain_dir), device="cpu")
    questions = load_prompts("builtin", categories=["mt_bench", "humaneval", "sharegpt"], limit=2)
    timed(levels.ModelLevel)
    timed(levels.HeadLevel)
    run(chain, mode, questions)  # warm-up
    calls.clear()
    seconds, tokens, rounds = run(chain, mode, questions)
    print(f"{mode}: {tokens} tokens in {seconds:.3f} s = {tokens / seconds:.1f} tok/s")
    inside = prefill = 0.0
    for (name, width), (n, s) in sorted(calls.items()):
        if width > PREFILL:
            prefill += s
            continue
        inside += s
        print(f"  {name:12s} width {width:3d}: {n:5d} calls, {s / n * 1e3:6.3f} ms each, {s:6.3f} s")
    rest = seconds - inside - prefill
    print(f"  prefills {prefill:.3f} s; other forwards {inside:.3f} s; outside the forwards {rest:.3f} s")
    if mode != "ar":
        n, emitted, looked = (sum(r[i] for r in rounds) for i in range(3))
        print(f"  rounds {n}, tokens {emitted}, L {emitted / n:.3f}, lookup tokens {looked}, "
              f"outside the forwards per round {rest / n * 1e3:.3f} ms")


if __name__ == "__main__":
    main(*sys.argv[1:])
