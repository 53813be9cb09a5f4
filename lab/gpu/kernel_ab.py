"""``python lab/gpu/kernel_ab.py``: the int4 kernels against the bf16 matmul at the 7B projection shapes (GPU check,
call 1, step b; docs/GPU.md).

For each shape N x K (4096x4096: q/k/v/o, 11008x4096: gate/up, 4096x11008: down) and each row count M, every
backend computes ``x [M, K] @ W.T`` over ``--layers`` distinct weight sets, one after the other, the way a decode step
walks its layers, so that the L2 cache (60 MB on an H200) never holds the next layer's weights. On CUDA that walk is
captured once as a CUDA graph and its replays are timed (median of ``--repeats``); GB/s counts the bytes the backend
must read from memory (its weights, scales and zeros, the activations) per replay over the replay's time.

Backends (each one skipped with its reason where it cannot run):

* ``bf16``: ``F.linear`` on the bf16 weights (cuBLAS on CUDA);
* ``torch_int4``: torch's ``_weight_int4pack_mm`` (``Int4Linear`` with ``POLYSPEC_INT4_TRITON=0``; on the CPU its
  ``_for_cpu`` twin);
* ``polyspec_triton``: polyspec's Triton W4A16 kernel (``Int4Linear`` on its default CUDA path: decode/int4_triton.py);
* ``gemlite``: gemlite's A16W4 kernel, where the package is importable (carried as a wheel: ``make gpu-prep``).

The whole run stops starting new measurements after ``--budget`` seconds (what is done is written; the rest is
marked "skipped: budget"). ``--dry`` is the CPU stand-in: shapes divided by 16, 2 layers, rows 1 and 2.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

SHAPES_7B = ((4096, 4096), (11008, 4096), (4096, 11008))
ROWS = (1, 2, 4, 8, 16)
BACKENDS = ("bf16", "polyspec_triton", "torch_int4", "gemlite")  # the order they run in
GROUP = 128


@contextmanager
def env(name: str, value: str):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def int4_layers(n: int, k: int, count: int, device: Any, gen: Any) -> list[Any]:
    """``count`` Int4Linear layers N x K with random codes (group 128; drawn on ``gen``'s device), scales ~0.02/4.6,
    zeros 8."""
    import torch

    from polyspec.decode.int4 import Int4Linear

    g = -(-k // GROUP)
    return [Int4Linear(torch.randint(0, 16, (n, k), generator=gen, device=gen.device, dtype=torch.uint8),
                       torch.full((n, g), 0.02 / 4.6, device=gen.device),
                       torch.full((n, g), 8, dtype=torch.uint8, device=gen.device), GROUP).to(device)
            for _ in range(count)]


def int4_bytes(lin: Any) -> int:
    """Codes (half a byte per weight) plus one scale and one zero per group, as the kernels stream them."""
    return lin.qdata.numel() + lin.scales.numel() * 2 + lin.zeros.numel()


def make_backend(name: str, layers: list[Any], dtype: Any) -> tuple[Any, int] | str:
    """(fn(i, x) -> y for layer i, bytes per walk of all layers) or the reason the backend cannot run."""
    import torch.nn.functional as F

    dev = layers[0].qdata.device
    if name == "bf16":
        ws = [lin.dequantized_weight().to(device=dev, dtype=dtype) for lin in layers]
        return (lambda i, x: F.linear(x, ws[i])), sum(w.numel() * w.element_size() for w in ws)
    if name == "torch_int4":
        with env("POLYSPEC_INT4_TRITON", "0"):
            return _int4_call(layers, dtype, "torch int4 kernel", ("cpu", "cuda"))
    if name == "polyspec_triton":
        if dev.type != "cuda":
            return "not run: needs CUDA (its interpreter parity is tests/test_int4_triton.py)"
        return _int4_call(layers, dtype, "Triton kernel", ("triton",))
    if name == "gemlite":
        return _gemlite(layers, dtype)
    return f"unknown backend {name}"


def _int4_call(layers: list[Any], dtype: Any, what: str, want: tuple[str, ...]) -> tuple[Any, int] | str:
    """Int4Linear's own forward, checked to take the backend asked for (select_backend decides per call)."""
    import torch

    from polyspec.decode.int4 import select_backend

    x = torch.zeros(1, layers[0].in_features, device=layers[0].qdata.device, dtype=dtype)
    got = select_backend(x, layers[0].group_size)
    if got not in want:
        return f"not run: Int4Linear takes the {got!r} path here, not the {what}"
    triton_off = os.environ.get("POLYSPEC_INT4_TRITON")

    def fn(i: int, x: Any) -> Any:
        if triton_off is None:
            return layers[i](x)
        with env("POLYSPEC_INT4_TRITON", triton_off):
            return layers[i](x)

    return fn, sum(int4_bytes(lin) for lin in layers)


def _gemlite(layers: list[Any], dtype: Any) -> tuple[Any, int] | str:
    import importlib.util

    import torch

    if importlib.util.find_spec("gemlite") is None:
        return "not carried: gemlite is not importable (make gpu-prep puts its wheel in .whl)"
    if layers[0].qdata.device.type != "cuda":
        return "not run: gemlite needs CUDA"
    try:
        from gemlite import DType, GemLiteLinear

        mods = []
        for lin in layers:
            n, k = lin.out_features, lin.in_features
            m = GemLiteLinear(4, group_size=lin.group_size, in_features=k, out_features=n,
                              input_dtype=DType.BF16, output_dtype=DType.BF16)
            m.pack(lin.q.to(torch.uint8), lin.scales.to(dtype), lin.zeros.to(dtype), None)
            mods.append(m)
    except Exception as exc:  # a third-party kernel's refusal is a result of the A/B, not a failure of it
        return f"failed: {type(exc).__name__}: {str(exc)[:200]}"
    return (lambda i, x: mods[i](x)), sum(int4_bytes(lin) for lin in layers)


def walk_ms(fn: Any, xs: list[Any], device: Any, repeats: int) -> float:
    """Median ms of one walk over every layer: a CUDA graph's replay on CUDA, the eager walk elsewhere."""
    import torch

    from polyspec.decode.timing import timed

    def walk() -> None:
        for i, x in enumerate(xs):
            fn(i, x)

    with torch.inference_mode():
        for _ in range(2):  # kernel builds, packing, autotuning
            walk()
        if device.type == "cuda":
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                walk()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                walk()
            run = graph.replay
        else:
            run = walk
        run()
        return statistics.median(timed(run, device)[1] for _ in range(repeats)) * 1e3


def run_ab(shapes: list[tuple[int, int]], rows: list[int], layers: int, repeats: int, budget: float,
           device: Any, dtype: Any, backends: list[str], save: Any) -> dict[str, Any]:
    """Backend by backend (the most important first, gemlite, which may autotune, last), each over every shape and
    row count; ``save(partial report)`` after each measurement, so a run cut off keeps what it measured."""
    import torch

    t0 = time.perf_counter()
    gen = torch.Generator(device=device).manual_seed(0)
    lins = {shape: int4_layers(*shape, layers, device, gen) for shape in shapes}
    xs = {(shape, m): [torch.randn(m, shape[1], generator=gen, device=device).to(dtype) for _ in range(layers)]
          for shape in shapes for m in rows}
    report: dict[str, Any] = {"results": [], "not_run": {}}
    for b in backends:
        for shape in shapes:
            if time.perf_counter() - t0 > budget:
                report["results"] += [{"n": shape[0], "k": shape[1], "rows": m, "backend": b, "skipped": "budget"}
                                      for m in rows]
                continue
            made = make_backend(b, lins[shape], dtype)
            if isinstance(made, str):
                report["not_run"][b] = made
                break
            for m in rows:
                report["results"].append(measure(made, xs[shape, m], shape, m, b, device, repeats, layers))
                report["seconds"] = time.perf_counter() - t0
                ratios(report["results"])
                save(report)
    return report


def measure(made: tuple[Any, int], xs: list[Any], shape: tuple[int, int], m: int, backend: str, device: Any,
            repeats: int, layers: int) -> dict[str, Any]:
    fn, nbytes = made
    n, k = shape
    row: dict[str, Any] = {"n": n, "k": k, "rows": m, "backend": backend}
    try:
        ms = walk_ms(fn, xs, device, repeats)
    except Exception as exc:  # one backend's failure at one shape leaves the rest of the A/B standing
        return {**row, "error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    moved = nbytes + layers * (m * k + m * n) * 2
    return {**row, "ms_per_layer": ms / layers, "GBps": moved / (ms * 1e-3) / 1e9}


def ratios(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each measured row with its time relative to bf16 at the same shape and rows (the issue's int4 / target)."""
    base = {(r["n"], r["k"], r["rows"]): r["ms_per_layer"] for r in results
            if r["backend"] == "bf16" and "ms_per_layer" in r}
    for r in results:
        b = base.get((r["n"], r["k"], r["rows"]))
        if b and "ms_per_layer" in r:
            r["vs_bf16"] = r["ms_per_layer"] / b
    return results


def print_table(report: dict[str, Any]) -> None:
    rows = sorted((r for r in report["results"] if "ms_per_layer" in r), key=lambda r: (r["n"], r["k"], r["rows"]))
    print(f"kernel A/B on {report['device']} ({report.get('gpu') or 'cpu'}), {report['layers']} layers per walk")
    print(f"{'N x K':>12} {'rows':>4} {'backend':>16} {'us/layer':>9} {'GB/s':>7} {'/bf16':>6}")
    for r in rows:
        print(f"{r['n']:>6}x{r['k']:<5} {r['rows']:>4} {r['backend']:>16} {r['ms_per_layer'] * 1e3:9.1f} "
              f"{r['GBps']:7.0f} {r.get('vs_bf16', float('nan')):6.3f}")
    for b, why in report["not_run"].items():
        print(f"  {b}: {why}")


def main(argv: list[str] | None = None) -> int:
    import torch

    from polyspec.device import resolve_device

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--dry", action="store_true", help="the CPU stand-in at shapes / 16")
    p.add_argument("--layers", type=int, default=None, help="distinct weight sets per walk (default 8; dry 2)")
    p.add_argument("--repeats", type=int, default=None, help="timed replays (default 20; dry 3)")
    p.add_argument("--budget", type=float, default=50.0, help="seconds after which no measurement starts")
    p.add_argument("--rows", type=int, nargs="+", default=None)
    a = p.parse_args(argv)
    dev = torch.device("cpu") if a.dry else resolve_device("auto")
    if dev.type == "cpu":  # torch's int4 kernel, not polyspec's own CPU streaming kernel, is the CPU stand-in
        from polyspec.decode import cpu_kernels

        cpu_kernels.set_enabled(False)
    dtype = torch.bfloat16
    shapes = [(n // 16, k // 16) for n, k in SHAPES_7B] if a.dry else list(SHAPES_7B)
    rows = a.rows or ([1, 2] if a.dry else list(ROWS))
    layers = a.layers or (2 if a.dry else 8)
    repeats = a.repeats or (3 if a.dry else 20)
    report: dict[str, Any] = {"step": "b_kernel_ab", "device": str(dev), "dry": a.dry, "dtype": "bfloat16",
                              "group_size": GROUP, "layers": layers, "repeats": repeats, "rows": rows,
                              "shapes": shapes, "backends": list(BACKENDS)}
    if dev.type == "cuda":
        report["gpu"] = torch.cuda.get_device_name(dev)
    a.json.parent.mkdir(parents=True, exist_ok=True)

    def save(part: dict[str, Any]) -> None:
        report.update(part)
        a.json.write_text(json.dumps(report, indent=1))

    save(run_ab(shapes, rows, layers, repeats, a.budget, dev, dtype, list(BACKENDS), save))
    print_table(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
