"""Where a model runs and in what precision (the one reading of ``device: auto`` and of a missing dtype), and
which process of a multi-process launch this is.

torch is imported inside the functions, so the CLI and the recipe schema can import this module for free.
"""

from __future__ import annotations

import os
from typing import Any

from polyspec.errors import PolyspecError

DTYPE_NAMES = ("float32", "bfloat16", "float16")  # the weight dtypes a level may be loaded in
DTYPE_CHOICES = (*DTYPE_NAMES, "auto")  # a recipe's target.dtype: auto = the profile measures and picks


def device_name(device: str) -> str:
    """``auto`` -> ``cuda`` when CUDA is available, else ``cpu``; any other name as given."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_device(device: str) -> Any:
    """The ``torch.device`` for ``auto``, ``cpu``, ``cuda`` or ``cuda:N``; PolyspecError when CUDA is asked for and
    absent (rather than a torch error deep inside a load)."""
    import torch

    name = device_name(device)
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise PolyspecError(f"device {device!r} asked for, but CUDA is not available here; use --device cpu")
    return torch.device(name)


def fast_bf16_matmul(device: Any) -> bool:
    """Whether bfloat16 matrix products are fast on ``device``: every CUDA GPU polyspec supports, and CPUs whose
    oneDNN has bf16 instructions (AVX512-BF16 or AMX). On a 2-core AVX512-BF16 VM a [1024, 576] x [576, 8192] product
    ran 5x faster in bf16 than in float32 (docs/TRAIN.md, "bf16 on the CPU"); head training and teacher feature
    extraction use it. Decoding is another question (GEMV, not GEMM): see :func:`resolve_dtype`."""
    import torch

    if torch.device(device).type == "cuda":
        return True
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def resolve_dtype(name: str | None, device: Any) -> Any:
    """The ``torch.dtype`` called ``name``; ``auto``: :func:`fast_decode_dtype`; without one, bfloat16 on a GPU and
    float32 on the CPU (a plain model folder's safe default)."""
    import torch

    if name == "auto":
        name = fast_decode_dtype(device)
    name = name or ("bfloat16" if torch.device(device).type == "cuda" else "float32")
    if name not in DTYPE_NAMES:
        raise PolyspecError(f"dtype {name!r} is not one of {', '.join(DTYPE_CHOICES)}")
    return getattr(torch, name)


def fast_decode_dtype(device: Any) -> str:
    """The dtype a target is expected to decode fastest in on ``device`` before anything is measured (the profile
    times :func:`decode_dtype_candidates` when ``target.dtype`` is auto, and the chain records what it measured):
    bfloat16 on a GPU and on a CPU whose kernel library has the AVX512-BF16 rows (half the bytes per decode step and
    bf16 dot products, docs/DECODE.md), else float32."""
    import torch

    if torch.device(device).type == "cuda":
        return "bfloat16"
    from polyspec.decode import cpu_kernels

    return "bfloat16" if cpu_kernels.dot_path() == "avx512-bf16" else "float32"


def decode_dtype_candidates(device: Any) -> tuple[str, ...]:
    """The dtypes the profile times the target in for ``target.dtype: auto``: float32 and bfloat16 on the CPU (either
    can win there, depending on the kernels this CPU builds), bfloat16 on a GPU."""
    import torch

    return ("bfloat16",) if torch.device(device).type == "cuda" else ("float32", "bfloat16")


def is_global_rank_zero() -> bool:
    """True unless the launcher environment says this process is another rank (RANK, LOCAL_RANK, NODE_RANK): only
    rank 0 writes outputs and opens tracking runs."""
    return all(int(os.environ.get(v, "0") or 0) == 0 for v in ("RANK", "LOCAL_RANK", "NODE_RANK"))
