"""Where a round's time goes: whole generations of ``ar`` and the chain's default (builtin first turns, 2 per
category, 96 tokens, twice, alternated), each level's forward timed; the rest is the decoder's own (Python) work.

    python scripts/measure/round_split.py CHAIN [K/D/N/F]

With a tree shape (top_k / depth / total_tokens / lookup_first 0 or 1, prompt-lookup runs of up to 4) the dual
mode with that draft tree joins the rotation. docs/BENCHMARKS.md, "CPU, stop 24" and "CPU, stop 27".
"""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from head_in_loop import state, timed, times  # noqa: E402  (the forwards' timer, shared)

from polyspec.bench.prompts import load_prompts  # noqa: E402
from polyspec.decode import levels  # noqa: E402
from polyspec.decode.chain import SamplingParams, TreeParams  # noqa: E402
from polyspec.decode.generate import build_decoder, cache_size, encode_prompt, eos_ids, load_chain  # noqa: E402


def main(chain_dir: str, shape: str = "") -> None:
    torch.set_num_threads(2)
    for cls, level in ((levels.ModelLevel, "target"), (levels.HeadLevel, "head")):
        for name in ("forward", "forward_tree"):
            setattr(cls, name, timed(getattr(cls, name), lambda a, lv=level: (state["tag"], lv)))
    chain = load_chain(Path(chain_dir), device="cpu")
    questions = load_prompts("builtin", categories=["mt_bench", "humaneval", "sharegpt"], limit=2)
    modes = {"ar": ("ar", {}), chain.mode: (chain.mode, {})}
    if shape:
        k, d, n, first = (int(v) for v in shape.split("/"))
        modes["tree " + shape] = ("dual", {"tree": TreeParams(k, d, n, lookup=4, lookup_first=bool(first))})
    tokens = dict.fromkeys(modes, 0)
    for rep in range(2):
        for i, q in enumerate(questions):
            ids = encode_prompt(chain.tokenizer, q.turns[0])
            order = list(modes)[(i + rep) % len(modes):] + list(modes)[:(i + rep) % len(modes)]
            for tag in order:
                mode, kw = modes[tag]
                state["tag"] = tag
                dec = build_decoder(chain, mode, max_seq_len=cache_size(chain, len(ids), 96), **kw)
                t0 = time.perf_counter()
                r = dec.generate(ids, 96, SamplingParams(), eos_token_ids=eos_ids(chain.tokenizer))
                times[(tag, "total")].append(time.perf_counter() - t0)
                tokens[tag] += len(r.token_ids)
    for tag in modes:
        total, target, head = (sum(times[(tag, k)]) for k in ("total", "target", "head"))
        n, h = len(times[(tag, "target")]), len(times[(tag, "head")])
        rest = total - target - head
        print(f"{tag}: {tokens[tag]} tokens in {total:.3f} s; target {n} forwards {target:.3f} s; "
              f"head {h} steps {head:.3f} s ({head / max(h, 1) * 1e3:.2f} ms each); the rest {rest:.3f} s "
              f"({rest / n * 1e3:.3f} ms per target forward)")

if __name__ == "__main__":
    main(*sys.argv[1:])
