"""Where a round's time goes: whole generations of ``ar`` and the chain's default (builtin first turns, 2 per
category, 96 tokens, twice, alternated), each level's forward timed; the rest is the decoder's own (Python) work.

    python scripts/measure/round_split.py CHAIN

docs/BENCHMARKS.md, "CPU, stop 24".
"""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from head_in_loop import state, timed, times  # noqa: E402  (the forwards' timer, shared)

from polyspec.bench.prompts import load_prompts  # noqa: E402
from polyspec.decode import levels  # noqa: E402
from polyspec.decode.chain import SamplingParams  # noqa: E402
from polyspec.decode.generate import build_decoder, cache_size, encode_prompt, eos_ids, load_chain  # noqa: E402


def main(chain_dir: str) -> None:
    torch.set_num_threads(2)
    levels.ModelLevel.forward = timed(levels.ModelLevel.forward, lambda a: (state["tag"], "target"))
    levels.HeadLevel.forward = timed(levels.HeadLevel.forward, lambda a: (state["tag"], "head"))
    chain = load_chain(Path(chain_dir), device="cpu")
    questions = load_prompts("builtin", categories=["mt_bench", "humaneval", "sharegpt"], limit=2)
    tokens = {"ar": 0, chain.mode: 0}
    for rep in range(2):
        for i, q in enumerate(questions):
            ids = encode_prompt(chain.tokenizer, q.turns[0])
            for mode in ("ar", chain.mode) if (i + rep) % 2 == 0 else (chain.mode, "ar"):
                state["tag"] = mode
                dec = build_decoder(chain, mode, max_seq_len=cache_size(chain, len(ids), 96))
                t0 = time.perf_counter()
                r = dec.generate(ids, 96, SamplingParams(), eos_token_ids=eos_ids(chain.tokenizer))
                times[(mode, "total")].append(time.perf_counter() - t0)
                tokens[mode] += len(r.token_ids)
    for mode in ("ar", chain.mode):
        total, target, head = (sum(times[(mode, k)]) for k in ("total", "target", "head"))
        n, h = len(times[(mode, "target")]), len(times[(mode, "head")])
        rest = total - target - head
        print(f"{mode}: {tokens[mode]} tokens in {total:.3f} s; target {n} forwards {target:.3f} s; "
              f"head {h} steps {head:.3f} s ({head / max(h, 1) * 1e3:.2f} ms each); the rest {rest:.3f} s "
              f"({rest / n * 1e3:.3f} ms per target forward)")


if __name__ == "__main__":
    main(*sys.argv[1:])
