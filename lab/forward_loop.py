"""One level's forward at one width, repeated after a cached prefix: a steady loop to profile, e.g.

    perf record -e cpu-clock -F 4000 -o w8.data python lab/forward_loop.py CHAIN_DIR 8 1500
    perf report -i w8.data --no-children --sort symbol -F sample,symbol    # samples / 4000 / 1500 = ms per forward

(cpu-clock samples both threads, so a symbol's ms are CPU time summed over them; the loading before the loop is a
few percent of a 1,500-forward run). ``--level`` picks the chain's level (default: the target).
"""

from __future__ import annotations

import argparse
import time

import torch

from polyspec.decode.generate import load_chain


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("chain")
    p.add_argument("width", type=int)
    p.add_argument("repeats", type=int)
    p.add_argument("--level", default=None, help="a level name of the chain (default: its target)")
    p.add_argument("--prefix", type=int, default=128)
    a = p.parse_args()
    chain = load_chain(a.chain)
    model = chain.models[a.level or chain.order[0]]
    model.setup_cache(a.prefix + a.width + 1)
    ids = torch.randint(0, model.args.vocab_size, (a.prefix + a.width,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        model.forward(ids[:a.prefix])
        t0 = time.perf_counter()
        for _ in range(a.repeats):
            model.truncate(a.prefix)
            model.forward(ids[a.prefix:])
    print(f"width {a.width}: {(time.perf_counter() - t0) / a.repeats * 1e3:.2f} ms per forward")


if __name__ == "__main__":
    main()
