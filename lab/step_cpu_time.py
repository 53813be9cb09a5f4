"""CPU time of one batch-1 decode forward at a named shape (random weights): the ordinary path (the CPU kernels: what
``ar`` runs on the CPU) and the eager static step (polyspec.decode.cuda_graphs with graphs off: the step a GPU captures,
here run op by op), medians of ``--repeats`` forwards at a cache length of ``--prefix``; with ``--compile``, the
compiled static step's compile time (its first three forwards, inductor's caches off) and its median after.

    python lab/step_cpu_time.py smollm2-135m --dtype float32 --prefix 200 --repeats 30 [--clock cpu] [--compile]

Runs against any checkout whose ``polyspec`` is importable (an A/B alternates two checkouts' processes).
"""

import argparse
import copy
import json
import statistics
import time

import torch

CLOCK = time.perf_counter


def forward_ms(model, prefix: int, repeats: int) -> float:
    """Median ms of a one-token forward appended at cache length ``prefix`` (rolled back after each), in the
    process's CPU time (``--clock cpu``: steadier than the wall clock on a shared machine at one thread) or wall."""
    model.setup_cache(prefix + 8)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.args.vocab_size, (prefix + 1,), generator=g)
    times = []
    with torch.inference_mode():
        model(ids[:prefix])  # one prompt wider than any static bucket: the ordinary path
        for _ in range(repeats + 2):
            t0 = CLOCK()
            model(ids[prefix:prefix + 1])
            times.append(CLOCK() - t0)
            model.truncate(prefix)
    return statistics.median(times[2:]) * 1e3


def main() -> None:
    from polyspec.bench.shape_bench import random_model, shape_args
    from polyspec.decode import cuda_graphs

    p = argparse.ArgumentParser()
    p.add_argument("shape")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--prefix", type=int, default=200)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--clock", default="wall", choices=["wall", "cpu"])
    a = p.parse_args()
    global CLOCK
    CLOCK = time.process_time if a.clock == "cpu" else time.perf_counter
    model = random_model(shape_args(a.shape), dtype=getattr(torch, a.dtype), device="cpu")
    out = {"shape": a.shape, "dtype": a.dtype, "prefix": a.prefix, "threads": torch.get_num_threads(), "clock": a.clock,
           "ordinary_ms": forward_ms(model, a.prefix, a.repeats)}
    static = copy.deepcopy(model)
    cuda_graphs.enable(static, graphs=False, compiled=False)
    out["static_eager_ms"] = forward_ms(static, a.prefix, a.repeats)
    if a.compile:
        import torch._inductor.config as inductor_config

        inductor_config.force_disable_caches = True
        compiled = copy.deepcopy(model)
        cuda_graphs.enable(compiled, graphs=False, compiled=True)
        t0 = time.perf_counter()
        forward_ms(compiled, a.prefix, 1)  # the first of its three forwards compiles the width-1 step
        out["compile_s"] = time.perf_counter() - t0
        out["static_compiled_ms"] = forward_ms(compiled, a.prefix, a.repeats)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
