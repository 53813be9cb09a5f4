"""``python lab/gpu/compile_time.py``: seconds to compile the static step per width bucket, to budget the GPU check's
prewarm (docs/GPU.md, "Compile budget").

Each width's first forward through a compiled runner (``cuda_graphs.enable(graphs=False, compiled=True)``) compiles
that bucket; inductor's caches are off so every bucket pays in full, as on a fresh device machine. Layers are given
explicitly, so two runs (say 2 and 8 layers) give the per-layer slope and the fixed part.

    python lab/gpu/compile_time.py --shape tiny --layers 2 8 --widths 1 2 4 8 16 [--json F]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path


def compile_seconds(shape: str, layers: int, widths: list[int], dtype: str) -> dict[str, float]:
    import torch

    from polyspec.bench.shape_bench import random_model, shape_args
    from polyspec.decode import cuda_graphs

    args = dataclasses.replace(shape_args(shape), num_layers=layers)
    model = random_model(args, dtype=getattr(torch, dtype), device="cpu")
    cuda_graphs.enable(model, graphs=False, compiled=True, max_width=max(widths))
    model.setup_cache(64)
    out = {}
    with torch.inference_mode():
        for w in widths:
            model.truncate(0)
            ids = torch.zeros(w, dtype=torch.long)
            t0 = time.perf_counter()  # a bucket's first forward compiles it (the very first also runs eagerly)
            model(ids)
            out[str(w)] = time.perf_counter() - t0
    return out


def main(argv: list[str] | None = None) -> int:
    import torch._inductor.config as inductor_config

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="tiny")
    p.add_argument("--layers", type=int, nargs="+", default=[2, 8])
    p.add_argument("--widths", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    inductor_config.force_disable_caches = True
    report = {"shape": a.shape, "dtype": a.dtype, "widths": a.widths,
              "seconds": {str(n): compile_seconds(a.shape, n, a.widths, a.dtype) for n in a.layers}}
    print(json.dumps(report))
    if a.json is not None:
        a.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
