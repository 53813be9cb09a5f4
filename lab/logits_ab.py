"""A bf16 target's logits four ways, alternated in one process (the order rotating), bitwise equal: through
``polyspec.decode.cpu_kernels.linear``, the kernel's bf16 result widened (``linear(...).float()``, before fb67b86)
and ``fp32_out=True``; through the bare entry point, the kernel's fp32 sums then rounded by a pass of their own
(``polyspec_round_bf16``, fb67b86 until f28e3c0) and rounded by each thread as it computes its rows (flags bit 1,
what ``fp32_out`` does since f28e3c0).

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


def bare(x: torch.Tensor, w: torch.Tensor, fused: bool) -> torch.Tensor:
    """The entry point itself on a bf16 input: rounded inside (``fused``) or by one pass after, on this thread."""
    xf, n = x.float().contiguous(), w.shape[0]
    y = torch.empty(*x.shape[:-1], n)
    ck._lib.polyspec_linear3_bf16w(xf.data_ptr(), w.data_ptr(), 0, 0, None, None, None, n, 0, 0,
                                   xf.numel() // w.shape[1], w.shape[1], y.data_ptr(), torch.get_num_threads(),
                                   3 if fused else 1, ck.blocks_ptr(w), None, None)
    if not fused:
        ck._lib.polyspec_round_bf16(y.data_ptr(), y.numel())
    return y


WAYS = {"widened": lambda x, w: ck.linear(x, w, None).float(),
        "fp32_out": lambda x, w: ck.linear(x, w, None, fp32_out=True),
        "bare, a pass after": lambda x, w: bare(x, w, False), "bare, fused": lambda x, w: bare(x, w, True)}


def alternate(w: torch.Tensor, width: int, repeats: int) -> dict[str, float]:
    """Median ms of each way over ``repeats`` alternations at ``width`` rows."""
    x = torch.randn(1, width, w.shape[1]).bfloat16()
    outs = [way(x, w) for way in WAYS.values()]
    if not all(torch.equal(outs[0], o) for o in outs[1:]):
        raise SystemExit("the ways differ")
    secs: dict[str, list[float]] = {name: [] for name in WAYS}
    names = list(WAYS)
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:  # each way after each other in turn
            t0 = time.perf_counter()
            WAYS[name](x, w)
            secs[name].append(time.perf_counter() - t0)
    return {name: statistics.median(s) * 1e3 for name, s in secs.items()}


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
            ms = alternate(w, width, args.repeats)
            print(f"width {width}: " + ", ".join(f"{name} {t:.3f} ms" for name, t in ms.items()), flush=True)


if __name__ == "__main__":
    main()
