"""``python lab/gpu/probe.py``: what a device machine gives the decode path, in one short run (docs/GPU.md, call 1).

* **Versions**: Python, torch (and its CUDA), triton, transformers, the GPU's name; and whether every requirement
  of the wheels carried in ``--wheels`` (``make gpu-prep``'s ``.whl``) is met by what is installed there, since
  those wheels are installed without their dependencies.
* **SDPA backends**: the attention call of the static decode step at this shape (q [1, h, W, D], k/v [1, kv, S, D],
  a bool mask [W, S]; W in ``--widths``), tried under each of torch's SDPA backends alone: which accept it, and the
  median time of each that does, beside the unrestricted call's.
* **Kernels of one decode step**: a random-weight model of the shape (built as ``shape-bench`` builds it), one
  static decode step (the step a CUDA graph captures, run eagerly) under torch.profiler: device kernels per step and
  per layer, split into matmul / attention / other by name and time. On the CPU the same counts are of leaf CPU ops.
  Per layer = (ops of the full model - ops of a one-layer copy) / (layers - 1), so the embedding, final norm,
  lm_head and the step's input staging (token ids, mask, RoPE rows: eager work outside a graph's replay) are counted
  apart, as "outside".

``--tiny`` is the test shape on the CPU (what the tests run); the default is Llama-2-7B in bfloat16 on a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.metadata
import json
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

from polyspec.device import DTYPE_NAMES
from polyspec.errors import PolyspecError

# Kernel / op names by what they do (lower-cased substrings; the first family that matches wins)
FAMILIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", ("attention", "flash", "fmha", "sdpa", "softmax", "attend")),
    ("matmul", ("gemm", "gemv", "matmul", "cutlass", "xmma", "cublas", "_mm", "aten::mm", "aten::bmm", "addmm",
                "linear", "int4", "tinygemm", "weight_int4", "splitk")),
)


def family(name: str) -> str:
    low = name.lower()
    for fam, keys in FAMILIES:
        if any(k in low for k in keys):
            return fam
    return "other"


def versions() -> dict[str, Any]:
    """Python, torch/CUDA/cuDNN, triton, transformers and the GPU's name (None where absent)."""
    import torch

    def dist(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    cuda = torch.cuda.is_available()
    return {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version() if cuda else None, "triton": dist("triton"),
            "transformers": dist("transformers"), "cuda_available": cuda,
            "gpu": torch.cuda.get_device_name(0) if cuda else None}


def wheel_requirements(wheels: Path) -> dict[str, list[str]]:
    """{distribution: unmet requirements} for each wheel file in ``wheels`` as installed here (an empty list: all met;
    "not installed": the wheel itself is not importable here)."""
    from packaging.requirements import Requirement

    out: dict[str, list[str]] = {}
    for whl in sorted(Path(wheels).glob("*.whl")):
        name = whl.name.split("-")[0]
        try:
            reqs = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            out[name] = ["not installed"]
            continue
        unmet = []
        for text in reqs:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            try:
                have = importlib.metadata.version(req.name)
            except importlib.metadata.PackageNotFoundError:
                unmet.append(f"{req} (missing)")
                continue
            if req.specifier and not req.specifier.contains(have, prereleases=True):
                unmet.append(f"{req} (have {have})")
        out[name] = unmet
    return out


def sdpa_backends(*, heads: int, kv_heads: int, head_dim: int, cache_len: int, widths: list[int], dtype: Any,
                  device: Any, repeats: int = 20) -> dict[str, Any]:
    """{W: {backend: median ms, or the refusal's first line}} for the static step's attention call at width W."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = [b for n, b in SDPBackend.__members__.items() if n not in ("ERROR", "OVERRIDEABLE")]
    gen = torch.Generator(device=device).manual_seed(0)
    out: dict[str, Any] = {}
    for w in widths:
        q = torch.randn(1, heads, w, head_dim, generator=gen, device=device).to(dtype)  # [1, h, W, D]
        k = torch.randn(1, kv_heads, cache_len, head_dim, generator=gen, device=device).to(dtype)  # [1, kv, S, D]
        v = torch.randn_like(k)
        mask = torch.zeros(w, cache_len, dtype=torch.bool, device=device)  # [W, S], as the static step's
        mask[:, : cache_len // 2] = True
        call = functools.partial(F.scaled_dot_product_attention, q, k, v, attn_mask=mask,
                                 enable_gqa=heads != kv_heads)
        row: dict[str, Any] = {"default": _median_ms(call, device, repeats)}
        for b in backends:
            try:
                with sdpa_kernel([b]):
                    row[b.name.lower()] = _median_ms(call, device, repeats)
            except RuntimeError as exc:  # the backend refuses these inputs
                row[b.name.lower()] = "refused: " + (str(exc).strip().splitlines() or ["?"])[0][:160]
        out[str(w)] = row
    return out


def _median_ms(fn: Any, device: Any, repeats: int) -> float:
    from polyspec.decode.timing import timed

    fn()  # warm-up (and the refusal, if any, before any timing)
    return statistics.median(timed(fn, device)[1] for _ in range(repeats)) * 1e3


def _decode_step_ops(args: Any, *, dtype: Any, device: Any, prompt: int,
                     compiled: bool = False) -> list[tuple[str, float]]:
    """(name, microseconds) of each device kernel (leaf CPU op on the CPU) of one static decode step (``compiled``:
    the whole step torch.compile'd with fused projections, decode/cuda_graphs.compiled_step)."""
    from polyspec.bench.shape_bench import random_model
    from polyspec.decode import cpu_kernels, cuda_graphs

    model = random_model(args, dtype=dtype, device=device)
    # the captured step, run without a graph: its kernels one by one
    runner = cuda_graphs.enable(model, graphs=False, compiled=compiled)
    # polyspec's own CPU kernels (ctypes calls, invisible to the profiler) stay off: the step runs the torch ops a
    # GPU would run, so the CPU count stands in for the kernel count
    was = cpu_kernels.set_enabled(False)
    try:
        return _profile_step(model, runner, args, device=device, prompt=prompt)
    finally:
        cpu_kernels.set_enabled(was)


def _profile_step(model: Any, runner: Any, args: Any, *, device: Any, prompt: int) -> list[tuple[str, float]]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from polyspec.decode.timing import sync

    model.setup_cache(prompt + 8)
    one = torch.tensor([1], device=device)
    with torch.inference_mode():
        model(torch.arange(prompt, device=device) % args.vocab_size)
        for _ in range(2):  # warm-up steps (allocations, lazy inits)
            model(one)
        replays = runner.replays
        sync(device)
        cuda = device.type == "cuda"
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=acts) as prof:
            model(one)
            sync(device)
    if runner.replays != replays + 1:
        raise PolyspecError("gpu-probe: the decode step did not take the static path; nothing to count")
    return _kernel_times(prof.events(), cuda)


# CPU ops that only allocate or re-view memory: no kernel of their own on a device
NO_KERNEL = frozenset(f"aten::{n}" for n in (
    "empty", "empty_strided", "empty_like", "as_strided", "view", "reshape", "_reshape_alias", "_unsafe_view",
    "resize_", "expand", "slice", "select", "t", "transpose", "unsqueeze", "squeeze", "permute", "detach", "alias",
    "lift_fresh", "to", "_to_copy", "contiguous", "unflatten", "flatten", "split", "chunk", "narrow", "unbind",
    "view_as", "expand_as", "numpy_T", "matrix_H", "result_type", "is_nonzero", "item", "_local_scalar_dense",
    "resolve_conj", "resolve_neg", "conj", "_conj"))


def _computes(e: Any) -> bool:
    """Whether ``e`` or an op under it does arithmetic (or copies) rather than only allocating or viewing."""
    return e.name not in NO_KERNEL or any(_computes(c) for c in e.cpu_children)


def _kernel_times(events: Any, cuda: bool) -> list[tuple[str, float]]:
    """CUDA: every device kernel (and memcpy / memset) with its device time. CPU: the lowest ops that compute (an op
    that computes with no computing op under it), each with its CPU time, allocation and view ops left out."""
    from torch.autograd import DeviceType

    if cuda:
        return [(e.name, float(e.time_range.elapsed_us())) for e in events if e.device_type == DeviceType.CUDA]
    return [(e.name, float(e.cpu_time_total)) for e in events
            if e.device_type == DeviceType.CPU and e.name.startswith("aten::") and e.name not in NO_KERNEL
            and not any(_computes(c) for c in e.cpu_children)]


def kernel_split(args: Any, *, dtype: Any, device: Any, prompt: int = 16, top: int = 12,
                 compiled: bool = False) -> dict[str, Any]:
    """Kernels (CPU: leaf ops) per decode step and per layer, and their time by family and by name."""
    ops = _decode_step_ops(args, dtype=dtype, device=device, prompt=prompt, compiled=compiled)
    layers = args.num_layers
    one_layer = _decode_step_ops(dataclasses.replace(args, num_layers=1), dtype=dtype, device=device, prompt=prompt,
                                 compiled=compiled)
    per_layer = (len(ops) - len(one_layer)) / (layers - 1) if layers > 1 else float(len(one_layer))
    fams: dict[str, dict[str, float]] = {}
    names: dict[str, list[float]] = {}
    for name, us in ops:
        f = fams.setdefault(family(name), {"count": 0, "us": 0.0})
        f["count"] += 1
        f["us"] += us
        names.setdefault(name, []).append(us)
    total_us = sum(us for _, us in ops)
    top_rows = sorted(names.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {"unit": "cuda kernels" if device.type == "cuda" else "cpu leaf ops", "layers": layers,
            "per_step": len(ops), "per_layer": per_layer, "outside_layers": len(one_layer) - per_layer,
            "step_us": total_us, "families": fams,
            "top": [{"name": n[:120], "family": family(n), "count": len(v), "us": sum(v)} for n, v in top_rows]}


def run_probe(shape: str, *, device: str = "auto", dtype: str | None = None, cache_len: int = 1024,
              widths: list[int] | None = None, wheels: Path | None = None, say: Any = None) -> dict[str, Any]:
    from polyspec.bench.shape_bench import shape_args
    from polyspec.device import resolve_device, resolve_dtype

    say = say or (lambda msg: print(msg, file=sys.stderr))
    dev = resolve_device(device)
    tdtype = resolve_dtype(dtype, dev)
    args = shape_args(shape)
    if args.num_layers < 1:
        raise PolyspecError(f"shape {shape} has no layers to count")
    report: dict[str, Any] = {"shape": shape, "device": str(dev), "dtype": str(tdtype).removeprefix("torch."),
                              "versions": versions()}
    if wheels is not None:
        if not Path(wheels).is_dir():
            raise PolyspecError(f"--wheels {wheels} is not a folder; pass the folder of carried wheels (.whl)")
        report["carried_wheels"] = wheel_requirements(Path(wheels))
    say(f"gpu-probe: SDPA backends at widths {widths or [1, 5]}, cache {cache_len}")
    report["sdpa"] = sdpa_backends(heads=args.num_heads, kv_heads=args.num_kv_heads, head_dim=args.head_dim,
                                   cache_len=cache_len, widths=widths or [1, 5], dtype=tdtype, device=dev)
    say(f"gpu-probe: profiling one static decode step of a random {shape} ({report['dtype']}) on {dev}")
    report["decode_step"] = kernel_split(args, dtype=tdtype, device=dev)
    if dev.type == "cuda":  # the step CUDA runs by default: compiled, projections fused (POLYSPEC_COMPILE_STEP)
        say("gpu-probe: the same step compiled (torch.compile, fused projections)")
        report["decode_step_compiled"] = kernel_split(args, dtype=tdtype, device=dev, compiled=True)
    return report


def print_report(r: dict[str, Any], out: Any = None) -> None:
    out = out or sys.stdout
    v = r["versions"]
    print(f"python {v['python']}, torch {v['torch']} (CUDA {v['torch_cuda']}, cuDNN {v['cudnn']}), triton "
          f"{v['triton']}, transformers {v['transformers']}; GPU: {v['gpu'] or 'none'}", file=out)
    for name, unmet in (r.get("carried_wheels") or {}).items():
        print(f"  carried {name}: {'requirements met' if not unmet else 'UNMET ' + '; '.join(unmet)}", file=out)
    for w, row in r["sdpa"].items():
        print(f"  SDPA W={w}: " + ", ".join(f"{b} {t:.3f} ms" if isinstance(t, float) else f"{b} refused"
                                            for b, t in row.items()), file=out)
    for key, how in (("decode_step", "eager"), ("decode_step_compiled", "compiled")):
        if key in r:
            _print_split(r, r[key], how, out)


def _print_split(r: dict[str, Any], d: dict[str, Any], how: str, out: Any) -> None:
    print(f"  one {how} decode step of {r['shape']} ({r['dtype']}, {r['device']}): {d['per_step']} {d['unit']}, "
          f"{d['per_layer']:.1f} per layer x {d['layers']} + {d['outside_layers']:.0f} outside, "
          f"{d['step_us'] / 1e3:.3f} ms in them", file=out)
    for fam, f in d["families"].items():
        print(f"    {fam:<9} {f['count']:5d}  {f['us'] / 1e3:8.3f} ms  ({f['us'] / max(d['step_us'], 1e-9):.0%})",
              file=out)
    for row in d["top"]:
        print(f"    {row['us'] / 1e3:8.3f} ms  x{row['count']:<4} {row['family']:<9} {row['name']}", file=out)


def configure_parser(p: argparse.ArgumentParser) -> None:
    from polyspec.bench.shape_bench import SHAPES

    p.add_argument("shape", nargs="?", default="llama2-7b", choices=sorted(SHAPES),
                   help="architecture of the random model (default llama2-7b)")
    p.add_argument("--tiny", action="store_true", help="the tiny test shape on the CPU (what the tests run)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default=None, help="default: bfloat16 on a GPU, float32 on the CPU")
    p.add_argument("--cache-len", type=int, default=1024, help="K/V length S of the SDPA probe (default 1024)")
    p.add_argument("--widths", type=int, nargs="+", default=None, help="query widths W of the SDPA probe (1 5)")
    p.add_argument("--wheels", type=Path, default=None,
                   help="folder of carried wheels whose requirements to check against what is installed (.whl)")
    p.add_argument("--json", type=Path, default=None, help="write the report here")
    p.add_argument("--versions-only", action="store_true",
                   help="only the versions, the carried wheels' requirements and the hardware stamp (seconds)")


def versions_report(wheels: Path | None) -> dict[str, Any]:
    """The device stamp a GPU check's results are recorded with (docs/GPU.md)."""
    from polyspec.stamp import hardware_stamp

    report: dict[str, Any] = {"versions": versions(), "stamp": {"hardware": hardware_stamp()}}
    if wheels is not None and Path(wheels).is_dir():
        report["carried_wheels"] = wheel_requirements(Path(wheels))
    return report


def run(args: argparse.Namespace) -> int:
    if args.cache_len < 8:
        raise PolyspecError("--cache-len must be >= 8")
    if args.widths and min(args.widths) < 1:
        raise PolyspecError("--widths must be >= 1")
    if args.versions_only:
        report = versions_report(args.wheels)
        print(json.dumps(report["versions"]))
        if args.json is not None:
            args.json.write_text(json.dumps(report, indent=1, default=str))
        return 0
    shape, device = ("tiny", "cpu") if args.tiny else (args.shape, args.device)
    report = run_probe(shape, device=device, dtype=args.dtype, cache_len=args.cache_len, widths=args.widths,
                       wheels=args.wheels)
    from polyspec.stamp import command_line, hardware_stamp

    report["command"] = command_line(getattr(args, "command", None))
    report["stamp"] = {"hardware": hardware_stamp()}
    print_report(report)
    if args.json is not None:
        from polyspec.bench.report import write_json

        write_json(report, args.json)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python lab/gpu/probe.py", description=__doc__.split("\n")[0])
    configure_parser(p)
    try:
        return run(p.parse_args(argv))
    except PolyspecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
