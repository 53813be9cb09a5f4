"""How long the chain's draft head takes for one step, depending on what ran just before it.

    [ENV=...] python scripts/measure/head_step.py CHAIN

One head step after 300 cached positions (median of 60) right after another, after sleeping 6 ms, after a target
forward of width 2, after streaming 64 MB with torch (a written buffer: stop 22's was never written, so all its
pages were one zero page), after busy-waiting 6 ms in Python, after 6 ms of vector sums over 32 KB, after touching the
head's weights; then the process's huge pages. THREADS=N sets torch's threads (default 2). Run it under
OMP_WAIT_POLICY=active or GOMP_SPINCOUNT=N to compare OpenMP's wait policies. docs/BENCHMARKS.md, stops 22 and 23.
"""

import os
import re
import sys
import time
from pathlib import Path

import torch

from polyspec.decode.generate import load_chain


def median_ms(step, before) -> float:
    times = []
    for _ in range(60):
        before()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return sorted(times)[30] * 1e3


def busy_wait() -> None:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 0.006:
        pass


def vector_wait(small: torch.Tensor) -> None:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 0.006:
        small.sum()


def main(chain_dir: str) -> None:
    torch.set_num_threads(int(os.environ.get("THREADS", "2")))
    chain = load_chain(Path(chain_dir), device="cpu")
    target, head = chain.models[chain.order[0]], chain.models[chain.order[-1]]
    ids = torch.randint(100, 20000, (400,), generator=torch.Generator().manual_seed(0))
    target.setup_cache(1024)
    head.setup_cache(1024)
    with torch.inference_mode():
        _, hidden = target(ids[:300])
        head(ids[1:300], hidden[:299])
        feature = hidden[299:300]
        big = torch.rand(64 * 2**20 // 4)  # written: torch.empty's untouched pages all read the one zero page
        small = torch.rand(32 * 2**10 // 4)
        weights = [*head.parameters(), head._draft_lm_weight()]

        def step():
            head.truncate(299)
            head(ids[300:301], feature, last_only=True)

        def target_step():
            target.truncate(300)
            target(ids[300:302])

        cases = {"back to back": lambda: None, "after sleeping 6 ms": lambda: time.sleep(0.006),
                 "after a target forward": target_step, "after reading 64 MB": big.sum,
                 "after busy-waiting 6 ms": busy_wait,
                 "after 6 ms of vector sums over 32 KB in L1": lambda: vector_wait(small),
                 "after a target forward, then touching the head's weights":
                     lambda: (target_step(), [w.sum() for w in weights]),
                 "after touching the head's weights": lambda: [w.sum() for w in weights]}
        for label, before in cases.items():
            print(f"{label}: {median_ms(step, before):.3f} ms", flush=True)
    print(re.findall(r"AnonHugePages:\s+\d+ kB", Path("/proc/self/smaps_rollup").read_text()))


if __name__ == "__main__":
    main(*sys.argv[1:])
