"""Where a model runs and in what precision (the one reading of ``device: auto`` and of a missing dtype), and
which process of a multi-process launch this is.

torch is imported inside the functions, so the CLI and the recipe schema can import this module for free.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Iterator
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


def _cpuinfo(*keys: str) -> str:
    """The first /proc/cpuinfo line's value whose name is one of ``keys``; "" where there is none (or no such file)."""
    from pathlib import Path

    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            name, _, value = line.partition(":")
            if name.strip() in keys:
                return value.strip()
    except OSError:
        pass
    return ""


def cpu_flags() -> str:
    """The CPU's feature flags as the kernel lists them (/proc/cpuinfo's ``flags``, ``Features`` on Arm); "" where
    there is no such file."""
    return _cpuinfo("flags", "Features")


def cpu_vendor() -> str:
    """/proc/cpuinfo's ``vendor_id`` (x86: "AuthenticAMD", "GenuineIntel"); "" elsewhere."""
    return _cpuinfo("vendor_id")


# bf16 in hardware: x86's AVX512-BF16 and AMX, Arm's BF16 extension
BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def fast_bf16_matmul(device: Any) -> bool:
    """Whether bfloat16 matrix products are fast on ``device``: every CUDA GPU polyspec supports, and CPUs with bf16
    instructions (AVX512-BF16, AMX, Arm BF16). On a 2-core AVX512-BF16 VM a [1024, 576] x [576, 8192] product ran 5x
    faster in bf16 than in float32 (docs/TRAIN.md, "bf16 on the CPU"); head training and teacher feature extraction
    use it. oneDNN also calls bf16 "supported" on AVX-512 CPUs without it (Skylake / Cascade Lake Xeons), where it
    emulates it: that product ran 3.4x *slower* than float32 on one. Decoding is another question (GEMV, not GEMM):
    see :func:`resolve_dtype`."""
    import torch

    if torch.device(device).type == "cuda":
        return True
    flags = set(cpu_flags().split())
    if flags and not flags & BF16_FLAGS:
        return False
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
    bf16 dot products, docs/KERNELS.md), else float32."""
    import torch

    if torch.device(device).type == "cuda":
        return "bfloat16"
    from polyspec.decode import cpu_kernels

    return "bfloat16" if (cpu_kernels.dot_path() or "").startswith("avx512-bf16") else "float32"


def decode_dtype_candidates(device: Any) -> tuple[str, ...]:
    """The dtypes the profile times the target in for ``target.dtype: auto``: float32 and bfloat16 on the CPU (either
    can win there, depending on the kernels this CPU builds), bfloat16 on a GPU."""
    import torch

    return ("bfloat16",) if torch.device(device).type == "cuda" else ("float32", "bfloat16")


def is_global_rank_zero() -> bool:
    """True unless the launcher environment says this process is another rank (RANK, LOCAL_RANK, NODE_RANK): only
    rank 0 writes outputs and opens tracking runs."""
    return all(int(os.environ.get(v, "0") or 0) == 0 for v in ("RANK", "LOCAL_RANK", "NODE_RANK"))


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4
# restored on exit: glibc's default mmap count, and the thresholds its dynamic rule reaches once blocks of 32 MB have
# been freed (any torch workload gets there); setting a threshold turns that rule off, so these are set explicitly
_GLIBC_MMAP_MAX, _GLIBC_MMAP_THRESHOLD, _GLIBC_TRIM_THRESHOLD = 65536, 32 << 20, 64 << 20


@contextlib.contextmanager
def heap_kept() -> Iterator[bool]:
    """Within the block, the C heap serves large allocations and keeps what is freed (glibc: no mmap per
    allocation, no trimming); afterwards glibc's adapted defaults are back and the heap is trimmed. Yields whether it
    applied (False where the C library is not glibc).

    Why: a CPU training step allocates and frees the same buffers every step (logits over the loss vocabulary are
    ~34 MB, above glibc's largest mmap threshold, 32 MB), and each mmap'd one is faulted in page by page again: on
    the 2-core CPU the fit ran 1.14-1.24x faster with the heap kept, bitwise the same head (docs/TRAIN.md,
    "Logits on the rows that count")."""
    libc = _glibc()
    if libc is None:
        yield False
        return
    libc.mallopt(_M_MMAP_MAX, 0)
    libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)
    try:
        yield True
    finally:
        libc.mallopt(_M_MMAP_MAX, _GLIBC_MMAP_MAX)
        libc.mallopt(_M_MMAP_THRESHOLD, _GLIBC_MMAP_THRESHOLD)
        libc.mallopt(_M_TRIM_THRESHOLD, _GLIBC_TRIM_THRESHOLD)
        libc.malloc_trim(0)


@functools.cache
def _glibc() -> Any:
    """The process's C library when it is glibc (it has mallopt and malloc_trim), else None; looked up once
    (``find_library`` runs ldconfig)."""
    import ctypes
    import ctypes.util

    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        if not (hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") and hasattr(libc, "gnu_get_libc_version")):
            return None
    except OSError:
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    return libc
