"""Kernels per decoder layer of the static decode step (polyspec.decode.cuda_graphs), eager against compiled.

- eager: the operators one layer's step dispatches (view-only ones left out: they launch nothing), each a kernel
  launch on a GPU;
- compiled: the calls in the wrapper inductor generates for one layer's step (:func:`cuda_graphs.compiled_layer_step`:
  its fused kernels, and the matmuls and the attention it leaves to library kernels), read from the generated code.

Outside the layers a step adds the embedding, the final norm and the lm_head (eager in both). Counted on the device
at hand: inductor's CPU fusion (C++ kernels) is not its CUDA fusion (Triton kernels), so a CPU count stands in for the
GPU's until a GPU counts it (docs/GPU.md, call 1).

``python -m polyspec.bench.step_kernels llama2-7b --widths 1,5 --dtype bfloat16``
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from typing import Any

# a kernel call in inductor's wrapper: a generated C++ kernel, a Triton kernel's launch, a library call, a fallback op
_LAUNCH = re.compile(r"^\s*(?:\w+ = )?(cpp_fused_\w+\(|triton_\w+\.run\(|extern_kernels\.\w+\(|torch\.ops\.\w+\.\w+)")


def wrapper_launches(code: str) -> list[str]:
    """The kernel calls in the ``call`` function of one inductor-generated module, in order."""
    body = code[code.index("def call("):] if "def call(" in code else code
    return [m.group(1).rstrip("(") for line in body.splitlines() if (m := _LAUNCH.match(line))]


def _layer_inputs(model: Any, width: int) -> tuple:
    """Layer 0's static-step inputs at ``width`` rows (a step at position 7, each row seeing the cache before it)."""
    import torch

    from polyspec.decode.model import rope_cos_sin

    model.setup_cache(64)
    dev, kc = model.inv_freq.device, model._cache.k[0]
    x = torch.randn(1, width, model.args.hidden_size, device=dev, dtype=kc.dtype)
    cos, sin = rope_cos_sin(model.inv_freq, torch.arange(7, 7 + width, device=dev), kc.dtype)
    mask = torch.ones(width, kc.shape[2], dtype=torch.bool, device=dev).tril(7)
    return (model._layers()[0], x, cos, sin, mask, kc, model._cache.v[0], torch.arange(7, 7 + width, device=dev))


def eager_ops(model: Any, width: int) -> int:
    """Operators one layer's eager static step dispatches, view-only ones left out."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from polyspec.decode.cuda_graphs import layer_step

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view:
                Count.n += 1
            return func(*args, **(kwargs or {}))

    inputs = _layer_inputs(model, width)
    with torch.inference_mode(), Count():
        layer_step(*inputs)
    return Count.n


def compiled_launches(model: Any, width: int) -> list[str]:
    """Kernel calls of one layer's compiled step (projections fused first, as the compiled runner does)."""
    import torch
    from torch._inductor.utils import run_and_get_code

    from polyspec.decode.cuda_graphs import layer_step
    from polyspec.decode.model import fuse_projections

    fuse_projections(model)
    step = torch.compile(layer_step, fullgraph=True, dynamic=False)  # its own: the count reads the code it makes
    inputs = _layer_inputs(model, width)
    with torch.inference_mode():
        _, codes = run_and_get_code(step, *inputs)
    return [c for code in codes for c in wrapper_launches(code)]


def count(args: Any, *, widths: list[int], dtype: Any, device: Any) -> list[dict[str, Any]]:
    """Eager operators and compiled kernels per layer of ``args``'s shape at each width (random weights)."""
    import torch

    from polyspec.bench.shape_bench import random_model

    rows = []
    for width in widths:
        torch._dynamo.reset()
        model = random_model(dataclasses.replace(args, num_layers=1), dtype=dtype, device=device)
        eager = eager_ops(model, width)
        calls = compiled_launches(model, width)
        rows.append({"width": width, "eager_ops_per_layer": eager, "compiled_kernels_per_layer": len(calls),
                     "compiled_calls": calls})
    return rows


def main(argv: list[str] | None = None) -> int:
    import torch

    from polyspec.bench.shape_bench import SHAPES, shape_args
    from polyspec.device import resolve_device

    p = argparse.ArgumentParser(prog="python -m polyspec.bench.step_kernels", description=__doc__.split("\n")[0])
    p.add_argument("shape", nargs="?", default="llama2-7b", choices=sorted(SHAPES))
    p.add_argument("--widths", default="1,5", help="step widths, comma-separated (default 1,5)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto")
    p.add_argument("--json", default=None, help="write the counts here")
    a = p.parse_args(argv)
    dev = resolve_device(a.device)
    rows = count(shape_args(a.shape), widths=[int(w) for w in a.widths.split(",")], dtype=getattr(torch, a.dtype),
                 device=dev)
    for r in rows:
        print(f"{a.shape} {a.dtype} on {dev}, width {r['width']}: eager {r['eager_ops_per_layer']} operators per "
              f"layer, compiled {r['compiled_kernels_per_layer']} kernels per layer")
    if a.json:
        from polyspec.fsutil import write_json
        from polyspec.stamp import hardware_stamp, software_stamp

        write_json(a.json, {"shape": a.shape, "dtype": a.dtype, "device": str(dev), "rows": rows,
                            "stamp": {"hardware": hardware_stamp(), "software": software_stamp()}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
