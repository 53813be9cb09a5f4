"""Kernels per decoder layer of the static decode step (polyspec.decode.cuda_graphs), eager against compiled.

- eager: the torch operators one layer's eager static step dispatches (view-only ones left out: they launch nothing;
  the step's attention op counts as one; the CPU's own kernels off), each a kernel launch on a GPU;
- compiled: the calls in the wrapper inductor generates for the whole compiled step (:func:`cuda_graphs.compiled_step`:
  its fused kernels, the matmuls it leaves to library kernels, the attention op), read from the generated code. The
  step is compiled for one and for two layers; a layer's kernels are the difference (outside the layers: the
  embedding, the last residual add with the final norm, the lm_head), and the calls listed are the second model's
  from just after its first attention op through its second.

Inductor's backend decides the fusion: its C++ backend on the CPU (``--codegen cpp``), or its Triton backend
(``--codegen triton``: the same Triton scheduling inductor's CUDA backend runs, here generating Triton code for the
CPU device; the code is read, not run, so no GPU or Triton CPU backend is needed). On CUDA the attention op is two
kernel launches (polyspec.decode.step_attention), counted as one call here.

``python lab/gpu/step_kernels.py llama2-7b --widths 1,5 --dtype bfloat16 --device cpu``
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import re
import sys
from typing import Any

# a kernel call in inductor's wrapper: a generated C++ kernel, a Triton kernel's launch, a library call, a fallback op
_LAUNCH = re.compile(r"^\s*(?:\w+ = )?(cpp_fused_\w+\(|triton_\w+\.run\(|extern_kernels\.\w+\(|torch\.ops\.\w+\.\w+)")
ATTENTION = "torch.ops.polyspec.step_attention"


def wrapper_launches(code: str) -> list[str]:
    """The kernel calls in the ``call`` function of one inductor-generated module, in order."""
    body = code[code.index("def call("):] if "def call(" in code else code
    return [m.group(1).rstrip("(") for line in body.splitlines() if (m := _LAUNCH.match(line))]


def _step_inputs(model: Any, width: int) -> tuple:
    """A static step's inputs at ``width`` rows: a causal block at cache slot 7 (cuda_graphs' own buffers)."""
    from polyspec.decode import cuda_graphs

    runner = cuda_graphs.StaticRunner(model, graphs=False, max_width=max(width, 1))
    model.__dict__["_static_runner"] = runner  # the cache gets the runner's spare slots
    model.setup_cache(64)
    cache = model._cache
    runner._sync_cache(cache)
    bk = runner._bucket(width, False)
    bk.fill(width, 7, 0, None, None, runner._cos.shape[0])
    bk.meta.copy_(bk.staging)  # (on the CPU the same tensor) what the runner's step copies first
    index = cuda_graphs.StepIndex(bk.pos, bk.bounds, bk.inner, runner._cos, runner._sin)
    return model, bk.ids, None, index, cache.k, cache.v


def eager_ops(model: Any, width: int) -> int:
    """Operators one layer's eager static step dispatches, view-only ones left out."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from polyspec.decode import cpu_kernels
    from polyspec.decode.cuda_graphs import LayerSlots

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view:
                Count.n += 1
            return func(*args, **(kwargs or {}))

    _, ids, _, index, ks, vs = _step_inputs(model, width)
    x = torch.randn(1, width, model.args.hidden_size, dtype=ks[0].dtype, device=ks[0].device)
    was = cpu_kernels.set_enabled(False)  # its ctypes calls are invisible here: count the torch ops a GPU runs
    try:
        with torch.inference_mode(), Count():
            model._layers()[0](x, None, None, None, LayerSlots(ks[0], vs[0], index), 0, 0)
    finally:
        cpu_kernels.set_enabled(was)
    return Count.n


class _CodeOnly(Exception):
    """Stops a compile once inductor has written the step's code (``--codegen triton``: nothing here runs it)."""


@contextlib.contextmanager
def _generated_code(backend: str):
    """Collect the modules inductor writes with its CPU codegen set to ``backend`` ("cpp" or "triton"); with "triton"
    the compile stops before loading the module (loading compiles its kernels for a device that cannot run them)."""
    from unittest import mock

    import torch._inductor.config as inductor_config
    from torch._inductor.codecache import PyCodeCache
    from torch._inductor.graph import GraphLowering

    codes: list[str] = []

    def stop(*args, **kwargs):
        raise _CodeOnly

    with inductor_config.patch(cpu_backend=backend), \
            mock.patch.object(GraphLowering, "save_output_code", codes.append), contextlib.ExitStack() as stack:
        if backend == "triton":
            stack.enter_context(mock.patch.object(PyCodeCache, "load_by_key_path", stop))
            stack.enter_context(_target_driver())
        yield codes


@contextlib.contextmanager
def _target_driver():
    """Triton's active driver for codegen on a machine without one: it only names the target (sm_90) that inductor
    asks Triton about while writing kernels (nothing is compiled or launched)."""
    from unittest import mock

    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    class CodegenTarget:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def is_active(self):
            return True

    with mock.patch.object(driver, "_active", CodegenTarget()):
        yield


def compiled_launches(model: Any, width: int, backend: str = "cpp") -> list[str]:
    """Kernel calls of the whole compiled step (projections fused first, as the compiled runner does)."""
    import torch

    from polyspec.decode.cuda_graphs import static_step
    from polyspec.decode.model import fuse_projections

    fuse_projections(model)
    torch._dynamo.reset()
    step = torch.compile(static_step, fullgraph=True, dynamic=False)  # its own: the count reads the code it makes
    inputs = _step_inputs(model, width)
    with torch.inference_mode(), _generated_code(backend) as codes:
        try:
            step(*inputs)
        except Exception as e:  # codegen only: the code was saved before the stop
            if not any(isinstance(x, _CodeOnly) for x in _chain(e)):
                raise
    return [c for code in codes for c in wrapper_launches(code)]


def _chain(e: BaseException) -> list[BaseException]:
    out = []
    while e is not None and len(out) < 32:
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


def layer_calls(calls: list[str]) -> list[str]:
    """One layer's calls in a two-layer step: from just after the first attention op through the second (the layer's
    o projection, MLP, the residual add with the next norm, its q/k/v projection, its attention)."""
    at = [i for i, c in enumerate(calls) if c == ATTENTION]
    return calls[at[0] + 1:at[1] + 1] if len(at) >= 2 else []


def count(args: Any, *, widths: list[int], dtype: Any, device: Any, codegen: str = "cpp") -> list[dict[str, Any]]:
    """Eager operators and compiled kernels per layer of ``args``'s shape at each width (random weights): the step is
    compiled for one layer and for two, a layer's kernels are the difference."""
    from polyspec.bench.shape_bench import random_model

    rows = []
    for width in widths:
        one, two = (random_model(dataclasses.replace(args, num_layers=n), dtype=dtype, device=device)
                    for n in (1, 2))
        eager = eager_ops(one, width)
        calls_one, calls_two = (compiled_launches(m, width, codegen) for m in (one, two))
        per_layer = len(calls_two) - len(calls_one)
        rows.append({"width": width, "codegen": codegen if str(device).startswith("cpu") else "cuda",
                     "eager_ops_per_layer": eager, "compiled_kernels_per_layer": per_layer,
                     "compiled_kernels_outside_layers": len(calls_one) - per_layer,
                     "layer_calls": layer_calls(calls_two), "step_calls_one_layer": calls_one})
    return rows


def main(argv: list[str] | None = None) -> int:
    import torch

    from polyspec.bench.shape_bench import SHAPES, shape_args
    from polyspec.device import resolve_device

    p = argparse.ArgumentParser(prog="python lab/gpu/step_kernels.py", description=__doc__.split("\n")[0])
    p.add_argument("shape", nargs="?", default="llama2-7b", choices=sorted(SHAPES))
    p.add_argument("--widths", default="1,5", help="step widths, comma-separated (default 1,5)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto")
    p.add_argument("--codegen", default="cpp", choices=["cpp", "triton"],
                   help="inductor's backend for a CPU device: its C++ kernels, or Triton code as its CUDA backend "
                        "schedules it (read, not run); a CUDA device always gets its own")
    p.add_argument("--json", default=None, help="write the counts here")
    a = p.parse_args(argv)
    dev = resolve_device(a.device)
    rows = count(shape_args(a.shape), widths=[int(w) for w in a.widths.split(",")], dtype=getattr(torch, a.dtype),
                 device=dev, codegen=a.codegen)
    for r in rows:
        print(f"{a.shape} {a.dtype} on {dev} ({r['codegen']} code), width {r['width']}: eager "
              f"{r['eager_ops_per_layer']} operators per layer, compiled {r['compiled_kernels_per_layer']} kernels per "
              f"layer ({r['compiled_kernels_outside_layers']} outside the layers): {', '.join(r['layer_calls'])}")
    if a.json:
        from polyspec.fsutil import write_json
        from polyspec.stamp import hardware_stamp, software_stamp

        write_json(a.json, {"shape": a.shape, "dtype": a.dtype, "device": str(dev), "rows": rows,
                            "stamp": {"hardware": hardware_stamp(), "software": software_stamp()}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
