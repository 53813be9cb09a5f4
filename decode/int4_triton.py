"""A Triton W4A16 kernel for int4 layers at verification widths on CUDA (1-64 rows).

Why: torch's CUDA int4 kernel (``_weight_int4pack_mm``, tinygemm) made the int4 g128 copy of a Llama-2-7B-shaped
model *slower* than the bf16 target on an H200 at every verification width (0.74x at 1 row, 1.22x at 5, 1.80x at 9:
docs/BENCHMARKS.md, "GPU, first lease"), so no chain with an int4 level could pay there. A batch-1 verification is
memory-bound: the int4 weights are a quarter of the bf16 bytes, and that is the ratio (the paper's 0.318) a kernel
that streams them at full bandwidth reaches, whatever the width up to a few dozen rows.

What it computes: ``y = x @ dequantize(q, scales, zeros).T`` exactly as :class:`polyspec.decode.int4.Int4Linear`
stores it (``qdata`` uint8 [N, ceil(K/2)], even k in the low nibble; one fp32 scale and one zero per row and group of
``group_size`` along K; w = (q - zero) * scale), accumulated in fp32, the dequantised weights rounded to the
activations' dtype before each product (as a bf16 matmul of the dequantised weights would).

How: each program owns BLOCK_N output columns, BLOCK_M rows and a run of K groups (split-K, so that a 4,096-column
layer still fills every multiprocessor); per group it loads the [BLOCK_N, group/2] bytes once, splits the nibbles
into the even-k and odd-k halves, dequantises both with the group's scale and zero (stored transposed, [G, N], so the
loads are contiguous) and runs two ``tl.dot`` against the matching even and odd columns of x. The split-K partial
sums land in an fp32 [splits, M, N] buffer that one sum reduces.

Supported (:func:`supported`): CUDA tensors, 16-bit or fp32 activations with 1..MAX_ROWS rows, group sizes 32, 64,
128, 256, any N and K. Everything else keeps torch's kernels. ``POLYSPEC_INT4_TRITON=0`` turns it off (the ablation).
Parity: tests/test_int4_triton.py runs the kernel under Triton's interpreter on the CPU (fp32 and fp16 activations:
the interpreter's bf16 ``tl.dot`` is broken in triton 3.6) and on CUDA in bf16 (marked ``gpu``).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass
from typing import Any

import torch

ENV = "POLYSPEC_INT4_TRITON"
MAX_ROWS = 64  # wider blocks (prefill) stay on torch's kernel: each row block re-reads the weights
GROUPS = (32, 64, 128, 256)
BLOCK_N = 64


TRITON = importlib.util.find_spec("triton") is not None  # CPU-only installs have no triton


def enabled() -> bool:
    return TRITON and os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def supported(x: torch.Tensor, group_size: int) -> bool:
    """Whether :func:`int4_mm` takes activations ``x`` [M, K] of a layer with ``group_size`` (see the module doc)."""
    return (x.device.type == "cuda" and x.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS and group_size in GROUPS
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32) and enabled())


@dataclass(frozen=True)
class Plan:
    """The kernel's launch shape for one layer on one device (built once, eagerly, with the layer's tensors)."""

    splits: int  # programs along K
    groups_per_split: int


def plan(n: int, groups: int, sms: int) -> Plan:
    """Split K until the programs fill the device about four times over (rounded to whole groups per program; at
    least two groups per program)."""
    blocks = -(-n // BLOCK_N)
    splits = max(1, min(groups // 2, -(-4 * sms // blocks)))
    per = -(-groups // splits)
    return Plan(-(-groups // per), per)


def kernel_tensors(scales: torch.Tensor, zeros: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Scales and zeros transposed to [G, N] fp32 on ``device`` (contiguous loads along N)."""
    return (scales.float().t().contiguous().to(device), zeros.float().t().contiguous().to(device))


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def w4a16(x_ptr, q_ptr, s_ptr, z_ptr, out_ptr, M, N, K, G, stride_xm, stride_qn,
              GROUPS_PER_SPLIT: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        half = tl.arange(0, GROUP // 2)
        row_ok, col_ok = offs_m < M, offs_n < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # a compile-time trip count (a runtime one trips the interpreter under numpy 2); the last split's groups
        # past G load nothing
        for i in range(GROUPS_PER_SPLIT):
            g = pid_k * GROUPS_PER_SPLIT + i
            kb = g * (GROUP // 2) + half  # byte column: codes k = 2 kb (low nibble) and 2 kb + 1 (high)
            ke = 2 * kb
            q = tl.load(q_ptr + offs_n[:, None] * stride_qn + kb[None, :],
                        mask=col_ok[:, None] & (ke[None, :] < K), other=0)  # [BLOCK_N, GROUP/2] uint8
            g_ok = col_ok & (g < G)
            s = tl.load(s_ptr + g * N + offs_n, mask=g_ok, other=0.0)[:, None]  # [BLOCK_N, 1]
            z = tl.load(z_ptr + g * N + offs_n, mask=g_ok, other=0.0)[:, None]
            xe = tl.load(x_ptr + offs_m[:, None] * stride_xm + ke[None, :],
                         mask=row_ok[:, None] & (ke[None, :] < K), other=0.0)  # [BLOCK_M, GROUP/2]
            xo = tl.load(x_ptr + offs_m[:, None] * stride_xm + ke[None, :] + 1,
                         mask=row_ok[:, None] & (ke[None, :] + 1 < K), other=0.0)
            lo = (((q & 0xF).to(tl.float32) - z) * s).to(xe.dtype)
            hi = (((q >> 4).to(tl.float32) - z) * s).to(xo.dtype)
            acc += tl.dot(xe, tl.trans(lo))
            acc += tl.dot(xo, tl.trans(hi))
        out = out_ptr + pid_k * M * N + offs_m[:, None] * N + offs_n[None, :]
        tl.store(out, acc, mask=row_ok[:, None] & col_ok[None, :])

    return w4a16


@functools.cache
def register() -> None:
    """Register the kernel as the torch op ``polyspec::int4_mm`` (once, eagerly: the layer does it when it builds
    its tensors). The op is opaque, with a fake implementation for shapes, so the compiled static step (dynamo,
    fullgraph) keeps it in one graph and calls it as it is; CUDA graphs capture its launch like any other."""
    kernel = _kernel()

    @torch.library.custom_op("polyspec::int4_mm", mutates_args=())
    def int4_mm_op(x: torch.Tensor, qdata: torch.Tensor, scales_t: torch.Tensor, zeros_t: torch.Tensor,
                   group_size: int, n: int, splits: int, groups_per_split: int) -> torch.Tensor:
        m, k = x.shape
        block_m = max(16, 1 << (m - 1).bit_length())  # tl.dot wants at least 16 rows
        partial = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
        grid = (-(-n // BLOCK_N), splits, -(-m // block_m))
        kernel[grid](x, qdata, scales_t, zeros_t, partial, m, n, k, scales_t.shape[0], x.stride(0), qdata.stride(0),
                     GROUPS_PER_SPLIT=groups_per_split, GROUP=group_size, BLOCK_M=block_m, BLOCK_N=BLOCK_N)
        return partial.sum(0)

    @int4_mm_op.register_fake
    def _(x, qdata, scales_t, zeros_t, group_size, n, splits, groups_per_split):
        return x.new_empty(x.shape[0], n, dtype=torch.float32)


def int4_mm(x: torch.Tensor, qdata: torch.Tensor, scales_t: torch.Tensor, zeros_t: torch.Tensor, group_size: int,
            n: int, p: Plan) -> torch.Tensor:
    """x [M, K] -> fp32 [M, N] (``qdata`` [N, ceil(K/2)], ``scales_t``/``zeros_t`` [G, N] from
    :func:`kernel_tensors`, ``p`` from :func:`plan`), after :func:`register`. The caller checks :func:`supported`."""
    return torch.ops.polyspec.int4_mm(x.contiguous(), qdata, scales_t, zeros_t, group_size, n, p.splits,
                                      p.groups_per_split)
