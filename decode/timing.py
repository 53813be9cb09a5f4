"""Wall-clock time of work on a device: the one way polyspec times a forward.

CUDA kernels run asynchronously, so the device's queue is drained before the clock starts and again before it stops;
on the CPU the call returns when the work is done.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def sync(device: Any) -> None:
    """Wait for the work queued on ``device`` (a no-op off CUDA)."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: Any) -> tuple[Any, float]:
    """``(fn(), seconds)``: the wall time of ``fn`` with ``device``'s queue drained before and after."""
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t0
