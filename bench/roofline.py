"""The memory roofline of batch-1 decoding: how fast a decode step could possibly be on this device.

At batch 1 every decode step reads every weight once (the tied embedding / lm_head matrix once: the embedding lookup
reads one row), so tokens/s <= read bandwidth / weight bytes. :func:`measure_bandwidth` times a reduction over a
large tensor (bytes read per second, median of repeats) and, for reference, a copy (bytes read + written).
``polyspec bench --roofline`` reports the target's roofline and the fraction of it that ``ar`` reaches.
"""

from __future__ import annotations

import statistics
import time
from typing import Any


def weight_bytes(model: Any) -> int:
    """Bytes of every distinct parameter and buffer of ``model`` (shared tensors, e.g. a tied lm_head, counted once;
    int4 packed weights at their packed size). Distinct by address and size, not by storage: a packed model's
    tensors (cpu_kernels.pack_weights) are views of one shared block."""
    seen: set[Any] = set()
    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        key = (t.data_ptr(), t.numel() * t.element_size()) if t.device.type != "meta" else id(t)
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total


def measure_bandwidth(device: Any = "cpu", *, mbytes: int = 512, repeats: int = 7) -> dict[str, float]:
    """Memory bandwidth of ``device`` in GB/s (1e9 bytes) over a ``mbytes`` MB float32 tensor, median and best of
    ``repeats`` timed passes (one warm-up): ``median_GBps`` / ``best_GBps`` = **read** bandwidth (a sum over the
    tensor: what streaming weights through a GEMV needs), ``copy_median_GBps`` = a copy into a second tensor, bytes
    read + written (the figure usually quoted for HBM)."""
    import torch

    dev = torch.device(device)
    n = mbytes * 1_000_000 // 4
    src = torch.ones(n, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def rates(fn, bytes_moved: int) -> list[float]:
        out = []
        for r in range(repeats + 1):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            dt = time.perf_counter() - t0
            if r:
                out.append(bytes_moved / dt / 1e9)
        return out

    read = rates(lambda: src.sum(), n * 4)
    copy = rates(lambda: dst.copy_(src), 2 * n * 4)
    return {"median_GBps": statistics.median(read), "best_GBps": max(read),
            "copy_median_GBps": statistics.median(copy), "mbytes": mbytes, "threads": torch.get_num_threads()}


def roofline(model: Any, bandwidth_GBps: float, measured_tokens_per_second: float | None = None) -> dict[str, Any]:
    """Upper bound on batch-1 decode tokens/s from the weights alone, and the fraction a measurement reaches."""
    b = weight_bytes(model)
    bound = bandwidth_GBps * 1e9 / b if b else float("inf")
    out: dict[str, Any] = {"weight_bytes": b, "bandwidth_GBps": bandwidth_GBps, "roofline_tokens_per_second": bound}
    if measured_tokens_per_second is not None:
        out["measured_tokens_per_second"] = measured_tokens_per_second
        out["fraction_of_roofline"] = measured_tokens_per_second / bound if bound else None
    return out
