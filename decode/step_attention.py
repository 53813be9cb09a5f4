"""A static step's attention: RoPE, the block's K/V write and length-aware attention in one op.

Why: the static step (polyspec.decode.cuda_graphs) has fixed shapes so that a CUDA graph can replay it, and before
this op its attention read every slot of the cache (1,024 or more) under a [W, S] mask, whatever the sequence's
length, with RoPE, the two K/V writes and the mask's conversion as separate kernels around it (13 kernels a layer in
inductor's CUDA code on an H200). Here the valid length lives on the device, so one captured graph replays at any
length and reads only the keys that exist.

What it computes (``torch.ops.polyspec.step_attention``, per layer, batch 1): the block's W rows ``qk`` [1, W, h + kv,
D] (query heads then key heads, before RoPE) and ``v`` [1, W, kv, D] at RoPE positions ``pos`` [W]; the rotated keys
and the values are written to cache slots ``start .. start + W - 1`` of ``k_cache``/``v_cache`` [1, kv, S, D]; row w
attends over the keys it sees: every slot before ``prefix``, and slot ``prefix + c`` where ``inner[w, c]`` is non-zero
(c < C; the block's own keys are columns ``start - prefix ..``: a causal block, a draft tree, or a tree that also sees
its K earlier nodes, ``prefix = start - K``). ``bounds`` [2] holds (start, prefix). The output is [1, W, h, D], the
layout the o projection reads. The maths is the reference layer's (decode/model.py: ``apply_rope`` over the whole head,
``attend``'s scaled softmax with grouped K/V heads): :func:`reference` *is* those functions (over the valid slots on
the CPU; over the whole cache under the equivalent mask elsewhere, which needs no host sync) and runs wherever the
Triton kernels do not (the CPU, where the compiled step counts kernels).

How, on CUDA (:func:`supported`): flash-decoding. One program per (kv head, block of query rows, split of the keys):
each split covers CHUNK cache slots below ``start`` and returns at once when its slots start past it, so the work
scales with the length, not the cache; the extra last split takes the block's W keys from registers (rotating them,
and writing them and the values to the cache: no program reads a slot another one writes). A GQA group's query heads
share their kv head's program, so K/V are read once per group. Each split keeps an online softmax (fp32) and stores
its unnormalised output, max and sum; a second kernel combines the active splits. Two launches a layer; the
partial buffers are the op's own (a CUDA graph keeps them in its pool).

Supported by the kernels: CUDA tensors (CPU ones under Triton's interpreter), bf16 / fp16 / fp32, head_dim a power of two 16..256, ``qk``/``v`` with unit
stride within a head and heads adjacent (views of the fused q/k/v projection are). Parity: tests/test_step_attention.py
(the kernels under Triton's interpreter against torch's SDPA and :func:`reference`, on CUDA marked ``gpu``).
``POLYSPEC_STEP_ATTENTION=0`` keeps :func:`reference` on CUDA too (the ablation).
"""

from __future__ import annotations

import importlib.util
import os

import torch

ENV = "POLYSPEC_STEP_ATTENTION"
TRITON = importlib.util.find_spec("triton") is not None
BLOCK_N = 64  # keys per inner iteration of a split
MAX_SPLITS = 32  # splits over the cache slots (more slots: longer splits)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# What a layer may need for this op to stand in for its RoPE, K/V store and attention (model.layer_features); the
# static step runs a model only where every layer's features lie in this set (the rest of the layer is the reference
# code itself, whose features are listed too: a new feature anywhere keeps the static step off until it is checked).
SUPPORT = frozenset({"rms_norm", "rope_rotate_half", "softmax_attention", "silu_glu_mlp", "gqa", "qkv_bias", "o_bias",
                     "mlp_bias"})


def enabled() -> bool:
    return TRITON and os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def splits_for(slots: int) -> tuple[int, int]:
    """(splits, slots per split) over a cache of ``slots`` slots: up to MAX_SPLITS, each a whole number of BLOCK_N."""
    blocks = -(-slots // BLOCK_N)
    splits = min(MAX_SPLITS, blocks)
    return splits, -(-blocks // splits) * BLOCK_N


def interpreting() -> bool:
    """Triton's interpreter runs the kernels on CPU tensors (the parity tests)."""
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def supported(qk: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the Triton kernels take this call (see the module docstring); otherwise :func:`reference` does."""
    d = qk.shape[-1]
    return ((qk.is_cuda or interpreting()) and enabled() and qk.dtype in DTYPES and qk.dtype == v.dtype == k_cache.dtype
            and 16 <= d <= 256 and d & (d - 1) == 0 and qk.shape[0] == 1 and _heads_packed(qk)
            and _heads_packed(v) and k_cache.is_contiguous())


def _heads_packed(x: torch.Tensor) -> bool:
    return x.stride(3) == 1 and x.stride(2) == x.shape[3]


def step_mask(bounds: torch.Tensor, inner: torch.Tensor, slots: int) -> torch.Tensor:
    """The bool mask [W, S] the op's visibility rule gives (True = visible), built on the device from ``bounds``
    (start, prefix) and ``inner`` [W, C]: every slot before prefix, and slot prefix + c where inner[:, c]."""
    j = torch.arange(slots, device=inner.device)
    col = j - bounds[1]
    inside = (col >= 0) & (col < inner.shape[1])
    seen = inner.index_select(1, col.clamp(0, inner.shape[1] - 1)) != 0  # [W, S]
    return (col < 0)[None, :] | (inside[None, :] & seen)


def reference(qk: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cos_t: torch.Tensor,
              sin_t: torch.Tensor, pos: torch.Tensor, bounds: torch.Tensor, inner: torch.Tensor,
              host_lengths: bool | None = None) -> torch.Tensor:
    """The op through the reference layer's own functions: RoPE (model.apply_rope), the K/V write at slots start..,
    attention (model.attend). ``host_lengths`` (default: on the CPU, where reading them is free): slices at the read
    lengths, attention over the valid slots only; otherwise an ``index_copy_`` and attention over the whole cache under
    :func:`step_mask`, with no host sync (a CUDA graph can capture it)."""
    from polyspec.decode.model import apply_rope, attend

    h = qk.shape[2] - v.shape[2]
    w = qk.shape[1]
    rot = apply_rope(qk.transpose(1, 2), cos_t.index_select(0, pos), sin_t.index_select(0, pos))  # [1, h+kv, W, D]
    if host_lengths if host_lengths is not None else qk.is_cpu:
        start, prefix = bounds.tolist()
        end = start + w
        k_cache[:, :, start:end] = rot[:, h:]
        v_cache[:, :, start:end] = v.transpose(1, 2)
        mask = None  # one row that sees every slot (a decode step): SDPA's unmasked path
        if w > 1 or prefix != start:
            seen = torch.ones(w, prefix, dtype=torch.bool, device=qk.device)
            mask = torch.cat((seen, inner[:, :end - prefix] != 0), dim=1)  # [W, end]
        out = attend(rot[:, :h], k_cache[:, :, :end], v_cache[:, :, :end], mask)
    else:
        slots = bounds[0].long() + torch.arange(w, device=qk.device)
        k_cache.index_copy_(2, slots, rot[:, h:])
        v_cache.index_copy_(2, slots, v.transpose(1, 2))
        out = attend(rot[:, :h], k_cache, v_cache, step_mask(bounds, inner, k_cache.shape[2]))  # [1, h, W, D]
    return out.transpose(1, 2).contiguous()


def triton_step_attention(qk: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          cos_t: torch.Tensor, sin_t: torch.Tensor, pos: torch.Tensor, bounds: torch.Tensor,
                          inner: torch.Tensor) -> torch.Tensor:
    """The op on the Triton kernels (the caller checks :func:`supported`; the parity tests call it directly)."""
    from polyspec.decode.step_attention_triton import combine_kernel, split_kernel

    _, w, hk, d = qk.shape
    kv, slots = v.shape[2], k_cache.shape[2]
    g = (hk - kv) // kv
    rows = g * w
    splits, chunk = splits_for(slots)
    block_m = min(32, max(16, 1 << (rows - 1).bit_length()))  # 64 rows spill registers on sm_90
    part_o = torch.empty(kv, splits + 1, rows, d, dtype=torch.float32, device=qk.device)
    part_ml = torch.empty(kv, splits + 1, 2, rows, dtype=torch.float32, device=qk.device)
    precision = "ieee" if qk.dtype == torch.float32 else "tf32"  # fp32 exact as the reference; 16-bit: unused
    split_kernel[(kv, -(-rows // block_m), splits + 1)](
        qk, v, cos_t, sin_t, k_cache, v_cache, pos, bounds, inner, part_o, part_ml, d ** -0.5,
        qk.stride(1), v.stride(1), k_cache.stride(1), k_cache.stride(2),
        KV=kv, G=g, W=w, D=d, C=inner.shape[1], SPLITS=splits, CHUNK=chunk, BLOCK_M=block_m, BLOCK_N=BLOCK_N,
        BLOCK_W=max(16, 1 << (w - 1).bit_length()), PRECISION=precision, num_warps=8)  # 4 spill at 64 rows
    out = torch.empty(1, w, hk - kv, d, dtype=qk.dtype, device=qk.device)
    block_r = min(16, 1 << (rows - 1).bit_length())
    combine_kernel[(kv, -(-rows // block_r))](part_o, part_ml, bounds, out, KV=kv, G=g, W=w, D=d, SPLITS=splits,
                                               CHUNK=chunk, BLOCK_R=block_r)
    return out


@torch.library.custom_op("polyspec::step_attention", mutates_args=("k_cache", "v_cache"))
def _step_attention_op(qk: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       cos_t: torch.Tensor, sin_t: torch.Tensor, pos: torch.Tensor, bounds: torch.Tensor,
                       inner: torch.Tensor) -> torch.Tensor:
    run = triton_step_attention if supported(qk, v, k_cache) else reference
    return run(qk, v, k_cache, v_cache, cos_t, sin_t, pos, bounds, inner)


@_step_attention_op.register_fake
def _(qk, v, k_cache, v_cache, cos_t, sin_t, pos, bounds, inner):
    return qk.new_empty(1, qk.shape[1], qk.shape[2] - v.shape[2], qk.shape[3])


def step_attention(qk: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   cos_t: torch.Tensor, sin_t: torch.Tensor, pos: torch.Tensor, bounds: torch.Tensor,
                   inner: torch.Tensor) -> torch.Tensor:
    """``torch.ops.polyspec.step_attention`` (see the module docstring): one opaque op, so the compiled step keeps it
    whole (one call in inductor's code) and declares the two caches it writes."""
    return torch.ops.polyspec.step_attention(qk, v, k_cache, v_cache, cos_t, sin_t, pos, bounds, inner)
