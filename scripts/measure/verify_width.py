"""What keeping wide verifications on the kernels costs (cpu_kernels.rows_limit): the target's verification forward
through the kernels against torch's GEMM path at the given widths, and whole dual-tree generations either way.

    python scripts/measure/verify_width.py forward CHAIN WIDTH [WIDTH ...]   # 200 cached positions, medians
    python scripts/measure/verify_width.py trees CHAIN                       # 8 / 5 / 32 + lookup 8, builtin prompts

``trees`` alternates the two per prompt (first turns, 2 per category, 96 tokens) and says which answers equal ``ar``:
with torch's path above 16 rows a bf16 tree's answers differ. docs/BENCHMARKS.md, "CPU, stop 24".
"""

import collections
import sys
import time
from pathlib import Path

import torch

from polyspec.bench.prompts import load_prompts
from polyspec.decode import cpu_kernels as ck
from polyspec.decode.chain import SamplingParams, TreeParams
from polyspec.decode.generate import build_decoder, cache_size, encode_prompt, eos_ids, load_chain

KERNELS = ck.rows_limit


def torch_above_16(start: int, tree: bool) -> int:
    return ck.MAX_ROWS  # the rule before stop 24: every forward wider than 16 rows on torch's path


def forward(chain_dir: str, *widths: str) -> None:
    chain = load_chain(Path(chain_dir), device="cpu")
    model = chain.models[chain.order[0]]
    prompt = torch.randint(0, model.args.vocab_size, (200,), generator=torch.Generator().manual_seed(0))
    for w in map(int, widths):
        times: dict[str, list[float]] = collections.defaultdict(list)
        ids = torch.randint(0, model.args.vocab_size, (w,), generator=torch.Generator().manual_seed(w))
        for rep in range(7):
            for tag in ("kernels", "torch") if rep % 2 else ("torch", "kernels"):
                ck.rows_limit = KERNELS if tag == "kernels" else torch_above_16
                model.setup_cache(512)
                with torch.no_grad():
                    model(prompt[:-1])
                    t0 = time.perf_counter()
                    model(ids)
                    if rep:  # the first round warms up
                        times[tag].append(time.perf_counter() - t0)
        k, t = (sorted(times[x])[len(times[x]) // 2] for x in ("kernels", "torch"))
        print(f"width {w}: kernels {k * 1e3:.2f} ms, torch {t * 1e3:.2f} ms, kernels / torch {k / t:.2f}", flush=True)
    ck.rows_limit = KERNELS


def trees(chain_dir: str) -> None:
    chain = load_chain(Path(chain_dir), device="cpu")
    tp = TreeParams(top_k=8, depth=5, total_tokens=32, lookup=8)
    secs: dict[str, float] = collections.defaultdict(float)
    same: collections.Counter = collections.Counter()
    questions = load_prompts("builtin", categories=["mt_bench", "humaneval", "sharegpt"], limit=2)
    for i, q in enumerate(questions):
        ids = encode_prompt(chain.tokenizer, q.turns[0])
        size = cache_size(chain, len(ids), 96)
        ck.rows_limit = KERNELS
        ar = build_decoder(chain, "ar", max_seq_len=size).generate(ids, 96, SamplingParams(),
                                                                     eos_token_ids=eos_ids(chain.tokenizer))
        for tag in ("kernels", "torch") if i % 2 == 0 else ("torch", "kernels"):
            ck.rows_limit = KERNELS if tag == "kernels" else torch_above_16
            dec = build_decoder(chain, "dual", max_seq_len=size, tree=tp)
            t0 = time.perf_counter()
            r = dec.generate(ids, 96, SamplingParams(), eos_token_ids=eos_ids(chain.tokenizer))
            secs[tag] += time.perf_counter() - t0
            same[tag] += r.token_ids == ar.token_ids
    ck.rows_limit = KERNELS
    n = len(questions)
    print(f"answers equal to ar: kernels {same['kernels']} of {n}, torch {same['torch']} of {n}; "
          f"time kernels / torch {secs['kernels'] / secs['torch']:.3f} (answers differ, so indicative only)")


if __name__ == "__main__":
    torch.set_num_threads(2)
    {"forward": forward, "trees": trees}[sys.argv[1]](*sys.argv[2:])
