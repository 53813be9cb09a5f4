"""A bf16 target's logits two ways, alternated in one process: the kernel's bf16 result widened
(``linear(...).float()``, before fb67b86) against ``fp32_out=True`` (rounded in place, no copies); bitwise equal.

    python lab/logits_ab.py CHAIN [--widths 1 3 5 8] [--repeats 40]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from polyspec.decode import cpu_kernels as ck
from polyspec.decode.generate import load_chain


def alternate(w: torch.Tensor, width: int, repeats: int) -> tuple[float, float]:
    """Median ms of each way over ``repeats`` alternations at ``width`` rows."""
    x = torch.randn(1, width, w.shape[1]).bfloat16()
    if not torch.equal(ck.linear(x, w, None).float(), ck.linear(x, w, None, fp32_out=True)):
        raise SystemExit("the two ways differ")
    old, new = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        ck.linear(x, w, None).float()
        t1 = time.perf_counter()
        ck.linear(x, w, None, fp32_out=True)
        old.append(t1 - t0)
        new.append(time.perf_counter() - t1)
    return statistics.median(old) * 1e3, statistics.median(new) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("chain", type=Path)
    p.add_argument("--widths", type=int, nargs="+", default=[1, 3, 5, 8])
    p.add_argument("--repeats", type=int, default=40)
    args = p.parse_args()
    torch.set_num_threads(2)
    chain = load_chain(args.chain, device="cpu")
    w = chain.models[chain.order[0]].lm_head.weight
    with torch.inference_mode():
        for width in args.widths:
            old, new = alternate(w, width, args.repeats)
            print(f"width {width}: widened {old:.3f} ms, fp32_out {new:.3f} ms, saved {old - new:.3f} ms")


if __name__ == "__main__":
    main()
