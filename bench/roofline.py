"""The memory roofline of batch-1 decoding: how fast a decode step could possibly be on this device.

At batch 1 a decode step streams every weight matrix once: the layers' projections and the lm_head (a tied lm_head is
the embedding matrix, read whole), while the embedding lookup reads one row of its table. So tokens/s <= bandwidth /
:func:`streamed_bytes`. The bandwidth is a decode step's own access pattern: :func:`measure_bandwidth` times a
matrix-vector product over a weight far larger than the caches (bf16 on a GPU; on the CPU the dtype and kernel
``model.Linear`` takes there), weight bytes per second, median of repeats. A plain reduction and a copy are reported
beside it for reference; the reduction (fp32 ``sum``) reads slower than a GEMV on a GPU (3.55 against 4.06 TB/s on an
H200, docs/GPU_RESULTS.md), so a roofline from it would be too easy to reach.
``polyspec bench --roofline`` and ``polyspec shape-bench`` report the target's roofline and the fraction ``ar`` reaches.
"""

from __future__ import annotations

import statistics
from typing import Any

GEMV_K = 4096  # the GEMV's input width (a 7B model's hidden size)
PASS_BYTES = 2_000_000_000  # weight bytes streamed per timed pass: many GEMVs, so the timer's overhead is negligible


def _tensors(model: Any) -> dict[Any, Any]:
    """Every distinct parameter and buffer of ``model`` by (address, size) (shared tensors, e.g. a tied lm_head, once;
    a packed model's tensors (cpu_kernels.pack_weights) are views of one block, so storage alone would not do)."""
    seen: dict[Any, Any] = {}
    for t in list(model.parameters()) + list(model.buffers()):
        seen.setdefault(_key(t), t)
    return seen


def _key(t: Any) -> Any:
    return (t.data_ptr(), t.numel() * t.element_size()) if t.device.type != "meta" else id(t)


def weight_bytes(model: Any) -> int:
    """Bytes of every distinct parameter and buffer of ``model`` (int4 packed weights at their packed size)."""
    return sum(t.numel() * t.element_size() for t in _tensors(model).values())


def streamed_bytes(model: Any) -> int:
    """Bytes a batch-1 decode step reads from ``model``'s weights: :func:`weight_bytes`, but an embedding table that
    only embeddings use counts as the one row a token reads (one that is also the lm_head's weight is read whole)."""
    import torch

    tables = {_key(m.weight): m.weight for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    elsewhere = {_key(p) for m in model.modules() if not isinstance(m, torch.nn.Embedding)
                 for p in m.parameters(recurse=False)}
    total = weight_bytes(model)
    for key, w in tables.items():
        if key not in elsewhere:
            total -= (w.shape[0] - 1) * w.shape[1] * w.element_size()
    return total


def measure_bandwidth(device: Any = "cpu", *, mbytes: int = 512, repeats: int = 7,
                      dtype: Any = None) -> dict[str, Any]:
    """Memory bandwidth of ``device`` in GB/s (1e9 bytes), median and best of ``repeats`` timed passes (one warm-up):
    ``median_GBps`` / ``best_GBps`` = a GEMV's weight bytes per second (a [``mbytes`` MB / K, K] weight of ``dtype``
    (default bf16 on a GPU, fp32 on the CPU) times one row, through ``model.Linear``'s path: a decode step's stream);
    ``sum_median_GBps`` = a reduction over an fp32 tensor of the same size (bytes read); ``copy_median_GBps`` = a copy
    into a second tensor, bytes read + written (the figure usually quoted for HBM)."""
    import torch

    from polyspec.decode import cpu_kernels

    dev = torch.device(device)
    dtype = dtype or (torch.float32 if dev.type == "cpu" else torch.bfloat16)
    size = torch.tensor([], dtype=dtype).element_size()
    n = max(1, mbytes * 1_000_000 // (GEMV_K * size))
    weight = torch.randn(n, GEMV_K, device=dev).to(dtype)
    x = torch.randn(1, GEMV_K, device=dev).to(dtype)
    src = torch.ones(mbytes * 1_000_000 // 4, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)
    with torch.inference_mode():
        gemv = _rates(lambda: cpu_kernels.linear(x, weight), weight.numel() * size, dev, repeats)
        read = _rates(src.sum, src.numel() * 4, dev, repeats)
        copy = _rates(lambda: dst.copy_(src), 2 * src.numel() * 4, dev, repeats)
    return {"median_GBps": statistics.median(gemv), "best_GBps": max(gemv),
            "sum_median_GBps": statistics.median(read), "copy_median_GBps": statistics.median(copy),
            "gemv": {"rows": n, "k": GEMV_K, "dtype": str(dtype).removeprefix("torch.")}, "mbytes": mbytes,
            "threads": torch.get_num_threads()}


def _rates(fn: Any, nbytes: int, dev: Any, repeats: int) -> list[float]:
    """GB/s of ``repeats`` passes (after one warm-up), each calling ``fn`` enough times to move PASS_BYTES."""
    from polyspec.decode.timing import timed

    calls = max(1, -(-PASS_BYTES // nbytes))
    out = []
    for r in range(repeats + 1):
        _, seconds = timed(lambda: [fn() for _ in range(calls)], dev)
        if r:
            out.append(calls * nbytes / seconds / 1e9)
    return out


def roofline(model: Any, bandwidth_GBps: float, measured_tokens_per_second: float | None = None) -> dict[str, Any]:
    """Upper bound on batch-1 decode tokens/s from the bytes a step streams (:func:`streamed_bytes`), and the fraction
    a measurement reaches. ``weight_bytes`` is every weight's size, for reference."""
    b = streamed_bytes(model)
    bound = bandwidth_GBps * 1e9 / b if b else float("inf")
    out: dict[str, Any] = {"weight_bytes": weight_bytes(model), "streamed_bytes": b, "bandwidth_GBps": bandwidth_GBps,
                           "roofline_tokens_per_second": bound}
    if measured_tokens_per_second is not None:
        out["measured_tokens_per_second"] = measured_tokens_per_second
        out["fraction_of_roofline"] = measured_tokens_per_second / bound if bound else None
    return out
