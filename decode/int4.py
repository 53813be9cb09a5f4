"""W4A16 group-wise int4 linear layers, the GPTQ checkpoint format, and RTN quantisation.

Conventions (one for the whole package):

* ``q`` uint8 [N, K] holds codes 0..15, ``scales`` float32 [N, G], ``zeros`` uint8 [N, G] integer zero points,
  G = ceil(K / group_size) (a short last group when K % group_size != 0 — never a changed group size) and
  ``w[n, k] = (q[n, k] - zeros[n, k // gs]) * scales[n, k // gs]`` (:func:`dequantize`).
* Scales are always fp16-representable (:func:`quantize_rtn` rounds them), so a GPTQ checkpoint (fp16 scales)
  round-trips exactly.

GPTQ "gptq" (v1) checkpoint layout, as read and written by GPTQModel / transformers (followed from GPTQModel's
``PackableQuantLinear.pack_block`` / ``dequantize_weight`` in ``gptqmodel/nn_modules/qlinear/__init__.py``):
``qweight`` int32 [K/8, N], word ``qweight[j, n]`` holds ``q[n, 8j + i]`` in bits 4i..4i+3 (packed along K, lowest
nibble first); ``qzeros`` int32 [G, N/8], word ``qzeros[g, j]`` holds ``zeros[8j + i, g] - 1`` in bits 4i.. (v1 stores
zero - 1; "gptq_v2" stores the zero itself); ``scales`` fp16 [G, N]; ``g_idx`` int32 [K] = k // group_size
(anything else is act-order, refused here); dequant ``w[k, n] = scales[g, n] * (q - zero)``.

Loaders other than polyspec's need K % group_size == 0 (vLLM sizes ``scales`` as K // group_size rows; GPTQModel's
ATen CPU kernel refuses the rest), so a layer with a short last group (SmolLM2: K = 576, group 128) is stored with
a smaller group that divides every K (:func:`portable_group_size`: 64 there), each scale / zero row repeated
(:func:`regroup_gptq`): the same weights bit for bit. :func:`load_int4` merges such repeated groups back
(:func:`merge_equal_groups`), so polyspec runs the layer on the group it was quantised with.

Kernels (dispatched in :meth:`Int4Linear.forward` only): torch's tinygemm-style int4pack ops compute
``(q - 8) * scale + zero_float`` with a bf16 ``scales_and_zeros`` tensor [G, N, 2] (verified empirically against
:func:`dequantize`, and the same relation GPTQModel's ``torch_aten_kernel.py`` uses), so our integer zero becomes
``zero_float = (8 - zero) * scale``. CPU: ``_convert_weight_to_int4pack_for_cpu`` takes int32 [N, K] codes and needs
N % 16 == 0; CUDA: ``_convert_weight_to_int4pack`` takes uint8 [N, K/2] (even k in the high nibble) and needs
N % 8 == 0, K % (16 * inner_k_tiles) == 0. Both need a kernel group size in {32, 64, 128, 256} dividing K: a
group of 128 on K = 576 runs as kernel groups of 64 with each scale repeated twice (same maths, no padding); when no
such size divides K, K is padded with zero columns (and the activations with zeros).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from polyspec.decode import cpu_kernels, int4_triton
from polyspec.errors import PolyspecError
from polyspec.fsutil import swap_into_place, temp_folder

KERNEL_GROUPS = (256, 128, 64, 32)
QUANTIZED_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                     "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
_LINEAR_WEIGHT = re.compile(r"^model\.layers\.\d+\.(" + "|".join(re.escape(n) for n in QUANTIZED_LINEARS) + r")\.weight$")
# Not copied from the source folder: weights, the config (rewritten) and polyspec's source marker (it describes the
# unquantised folder; provenance of the int4 copy belongs in the chain manifest).
NOT_COPIED = re.compile(r".*\.(safetensors|bin|pt|pth|gguf)$|^model\.safetensors\.index\.json$|^config\.json$"
                        r"|^polyspec_source\.json$")


# ----------------------------------------------------------------------------------------------------------------
# Pure quantisation maths
# ----------------------------------------------------------------------------------------------------------------


def num_groups(in_features: int, group_size: int) -> int:
    _check_group_size(group_size)
    return math.ceil(in_features / group_size)


def _check_group_size(group_size: int) -> None:
    if group_size < 1:
        raise PolyspecError(f"group_size must be a positive integer (per-channel -1 is not supported), got "
                            f"{group_size}")


def _grouped(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """w [N, K] -> [N, G, group_size], zero-padded at the end of K."""
    n, k = w.shape
    g = num_groups(k, group_size)
    return F.pad(w, (0, g * group_size - k)).view(n, g, group_size)


def quantize_rtn(weight: torch.Tensor, group_size: int = 128, sym: bool = True, bits: int = 4
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest quantisation of weight [N, K] -> (q uint8 [N, K], scales f32 [N, G], zeros u8 [N, G]), 4-bit
    (8-bit: the CPU's copy of an int4 level's lm_head, cpu_kernels.make_q8_lm_head).

    As GPTQ does, each group's range includes 0. With L = 2^bits - 1 (15): sym: zero = 2^(bits - 1) (8), scale =
    2 * max|w| / L. Asymmetric: scale = (max - min) / L and zero = round(-min / scale) kept in 1..L (the v1 format
    stores zero - 1 in four bits). Scales are rounded to fp16 before the codes are computed, so fp16 checkpoints are
    exact.
    """
    if bits not in (4, 8):
        raise PolyspecError(f"quantize_rtn: bits must be 4 or 8, got {bits}")
    top = 2 ** bits - 1
    if weight.dim() != 2:
        raise PolyspecError(f"quantize_rtn expects a 2-D weight [N, K], got shape {list(weight.shape)}")
    w = weight.detach().float()
    n, k = w.shape
    grouped = _grouped(w, group_size)  # [N, G, gs]
    wmin = grouped.amin(-1).clamp(max=0)  # [N, G]
    wmax = grouped.amax(-1).clamp(min=0)  # [N, G]
    if sym:
        absmax = torch.maximum(wmax, -wmin)
        scales = 2 * absmax / top
        zeros = torch.full_like(scales, 2 ** (bits - 1))
    else:
        scales = (wmax - wmin) / top
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # all-zero group: any scale works
    scales = scales.clamp(min=1e-7).half().float()  # fp16-representable
    if not sym:
        zeros = torch.round(-wmin / scales).clamp(1, top)
    q = torch.round(grouped / scales[..., None]) + zeros[..., None]  # [N, G, gs]
    q = q.clamp(0, top).view(n, -1)[:, :k]
    return q.to(torch.uint8), scales, zeros.to(torch.uint8)


def dequantize(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """(q [N, K], scales [N, G], zeros [N, G]) -> float32 weight [N, K] = (q - zero) * scale per group."""
    n, k = q.shape
    g = num_groups(k, group_size)
    if tuple(scales.shape) != (n, g) or tuple(zeros.shape) != (n, g):
        raise PolyspecError(f"scales/zeros must be [N, G] = [{n}, {g}] for q {list(q.shape)} and group size "
                            f"{group_size}, got {list(scales.shape)} / {list(zeros.shape)}")
    grouped = _grouped(q.float(), group_size)  # [N, G, gs]
    w = (grouped - zeros.float()[..., None]) * scales.float()[..., None]
    return w.view(n, -1)[:, :k]


# ----------------------------------------------------------------------------------------------------------------
# GPTQ v1 checkpoint format
# ----------------------------------------------------------------------------------------------------------------


def _pack_nibbles_int32(v: torch.Tensor) -> torch.Tensor:
    """v [R, 8 * C] with values 0..15 -> int32 [R, C]; v[:, 8c + i] lands in bits 4i..4i+3 of word c."""
    r, c8 = v.shape
    shifts = torch.arange(8, dtype=torch.int64) * 4  # [8]
    words = (v.to(torch.int64).view(r, c8 // 8, 8) << shifts).sum(-1)  # [R, C] in 0..2^32-1
    words = torch.where(words >= 2**31, words - 2**32, words)  # reinterpret as signed int32
    return words.to(torch.int32)


def _unpack_nibbles_int32(words: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] -> uint8 [R, 8 * C] (inverse of _pack_nibbles_int32)."""
    r, c = words.shape
    shifts = torch.arange(8, dtype=torch.int64) * 4
    v = (words.to(torch.int64)[..., None] >> shifts) & 0xF  # [R, C, 8]
    return v.view(r, c * 8).to(torch.uint8)


def pack_gptq(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """Our (q [N, K], scales [N, G], zeros [N, G]) -> GPTQ v1 tensors {qweight, qzeros, scales, g_idx}."""
    n, k = q.shape
    g = num_groups(k, group_size)
    if k % 8 or n % 8:
        raise PolyspecError(f"the GPTQ format packs 8 values per int32: in_features ({k}) and out_features ({n}) "
                            "must be multiples of 8")
    if tuple(scales.shape) != (n, g) or tuple(zeros.shape) != (n, g):
        raise PolyspecError(f"scales/zeros must be [{n}, {g}], got {list(scales.shape)} / {list(zeros.shape)}")
    z = zeros.to(torch.int64)
    if int(z.min()) < 1 or int(z.max()) > 16:
        raise PolyspecError("the GPTQ v1 format stores zero - 1 in 4 bits, so zero points must lie in 1..16; "
                            "re-quantise with sym=True or with zero points clamped to 1..15")
    if int(q.min()) < 0 or int(q.max()) > 15:
        raise PolyspecError("int4 codes must lie in 0..15")
    return {
        "qweight": _pack_along_k(q.to(torch.int64)),  # [K/8, N]
        "qzeros": _pack_nibbles_int32((z - 1).t().contiguous()),  # [G, N] -> [G, N/8]
        "scales": scales.t().contiguous().to(torch.float16),  # [G, N]
        "g_idx": (torch.arange(k) // group_size).to(torch.int32),  # [K]
    }


def _pack_along_k(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] -> qweight int32 [K/8, N]: word [j, n] holds q[n, 8j + i] in bits 4i.."""
    n, k = q.shape
    per_row = q.view(n, k // 8, 8).permute(1, 0, 2).reshape(k // 8, n * 8)  # [K/8, N*8], 8 consecutive k per n
    return _pack_nibbles_int32(per_row)  # [K/8, N]


def portable_group_size(in_features: list[int] | set[int], group_size: int) -> int:
    """The group size a GPTQ folder is stored with so that every GPTQ loader reads it: ``group_size`` when it divides
    every K, else the largest power-of-two divisor of ``group_size`` (at least 32, the smallest group the GPTQ kernels
    take) that divides every K; ``group_size`` again when none does (the folder keeps a short last group)."""
    g = group_size
    while g >= 32 and group_size % g == 0:
        if all(k % g == 0 for k in in_features):
            return g
        g //= 2
    return group_size


def regroup_gptq(parts: dict[str, torch.Tensor], in_features: int, group_size: int, new_group: int
                 ) -> dict[str, torch.Tensor]:
    """GPTQ tensors quantised with ``group_size`` -> the same weights stored with ``new_group`` (which divides it).

    New group j covers k in [j * new_group, (j + 1) * new_group), inside old group j // r (r = group_size //
    new_group), so each old scale / zero row is repeated r times; qweight is untouched: the dequantised weight is
    bit for bit the same. A short last group (K % group_size != 0) becomes whole groups when new_group divides K.
    """
    if group_size % new_group:
        raise PolyspecError(f"cannot store group size {group_size} as {new_group}: it must divide it")
    r, g_new = group_size // new_group, num_groups(in_features, new_group)
    out = dict(parts)
    out["scales"] = parts["scales"].repeat_interleave(r, dim=0)[:g_new].contiguous()  # [G', N]
    out["qzeros"] = parts["qzeros"].repeat_interleave(r, dim=0)[:g_new].contiguous()  # [G', N/8]
    out["g_idx"] = (torch.arange(in_features) // new_group).to(torch.int32)  # [K]
    return out


def merge_equal_groups(scales: torch.Tensor, zeros: torch.Tensor, group_size: int, limit: int = KERNEL_GROUPS[0]
                       ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(scales [N, G], zeros [N, G], group_size) with neighbouring groups that share scale and zero merged, up to
    ``limit``: the inverse of :func:`regroup_gptq` (a g128 layer stored as g64 runs on g128 kernels again). Exact:
    merged groups had the same scale and zero, so the dequantised weight does not change."""
    while group_size * 2 <= limit and scales.shape[1] > 1:
        first = (torch.arange(scales.shape[1]) // 2) * 2  # [G]: the first group of each pair
        if not (torch.equal(scales, scales[:, first]) and torch.equal(zeros, zeros[:, first])):
            break
        scales, zeros, group_size = scales[:, 0::2], zeros[:, 0::2], group_size * 2
    return scales.contiguous(), zeros.contiguous(), group_size


def unpack_gptq(tensors: dict[str, torch.Tensor], group_size: int, in_features: int, *, zero_offset: int = 1
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ tensors {qweight, qzeros, scales[, g_idx]} -> (q uint8 [N, K], scales f32 [N, G], zeros u8 [N, G]).

    zero_offset is 1 for the v1 "gptq" checkpoint format (zero - 1 stored) and 0 for "gptq_v2".
    Act-order checkpoints (g_idx other than k // group_size) are refused.
    """
    for key in ("qweight", "qzeros", "scales"):
        if key not in tensors:
            raise PolyspecError(f"GPTQ layer is missing its {key!r} tensor")
    qweight, qzeros, scales = tensors["qweight"], tensors["qzeros"], tensors["scales"]
    k = qweight.shape[0] * 8
    n = qweight.shape[1]
    g = num_groups(in_features, group_size)
    if k != in_features:
        raise PolyspecError(f"qweight {list(qweight.shape)} packs {k} inputs but the layer has {in_features} "
                            "(only 4-bit GPTQ is supported)")
    if tuple(scales.shape) != (g, n) or tuple(qzeros.shape) != (g, n // 8):
        raise PolyspecError(f"GPTQ scales {list(scales.shape)} / qzeros {list(qzeros.shape)} do not match "
                            f"[{g}, {n}] / [{g}, {n // 8}] for group_size {group_size}, K {k}")
    g_idx = tensors.get("g_idx")
    if g_idx is not None and not torch.equal(g_idx.long().cpu(), torch.arange(k) // group_size):
        raise PolyspecError("this GPTQ checkpoint uses act-order (desc_act / a permuted g_idx), which polyspec's "
                            "int4 engine does not support yet; quantise with desc_act=false")
    per_row = _unpack_nibbles_int32(qweight.cpu())  # [K/8, N*8]
    q = per_row.view(k // 8, n, 8).permute(1, 0, 2).reshape(n, k)
    zeros = (_unpack_nibbles_int32(qzeros.cpu()).to(torch.int16) + zero_offset).t().contiguous()  # [N, G]
    return q.contiguous(), scales.float().t().contiguous().cpu(), zeros.to(torch.uint8)


# ----------------------------------------------------------------------------------------------------------------
# The layer
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KernelPlan:
    """How a layer runs on a fused kernel: kernel group size and padded N/K."""

    backend: str  # "cpu" | "cuda"
    kernel_group: int
    k_pad: int
    n_pad: int
    inner_k_tiles: int


def plan_kernel(n: int, k: int, group_size: int, backend: str) -> KernelPlan | None:
    """Pick the kernel group (a supported size dividing group_size, preferably K too) and paddings; None if none."""
    candidates = [g for g in KERNEL_GROUPS if group_size % g == 0]
    if not candidates:
        return None
    dividing = [g for g in candidates if k % g == 0]
    kg = dividing[0] if dividing else candidates[0]
    k_pad = math.ceil(k / kg) * kg
    if backend == "cpu":
        return KernelPlan("cpu", kg, k_pad, math.ceil(n / 16) * 16, 1)
    tiles = next(t for t in (8, 4, 2) if k_pad % (16 * t) == 0)  # kg >= 32 guarantees t = 2 works
    return KernelPlan("cuda", kg, k_pad, math.ceil(n / 8) * 8, tiles)


def _kernel_codes_and_scales(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                             plan: KernelPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded codes int32 [Np, Kp] and scales_and_zeros bf16 [Kp / kg, Np, 2] for the int4pack kernels."""
    n, k = q.shape
    codes = F.pad(q.to(torch.int32), (0, plan.k_pad - k, 0, plan.n_pad - n))  # [Np, Kp]
    kernel_groups = plan.k_pad // plan.kernel_group
    src_group = (torch.arange(kernel_groups) * plan.kernel_group) // group_size  # [Gk]
    src_group = src_group.clamp(max=scales.shape[1] - 1)  # padding past K reuses the last group (zero inputs)
    s = scales.float().cpu()[:, src_group]  # [N, Gk]
    z = (8 - zeros.float().cpu()[:, src_group]) * s  # [N, Gk]: (q - 8) * s + z == (q - zero) * s
    sz = torch.stack((s, z), dim=-1)  # [N, Gk, 2]
    sz = F.pad(sz, (0, 0, 0, 0, 0, plan.n_pad - n))  # [Np, Gk, 2]
    return codes, sz.transpose(0, 1).contiguous().to(torch.bfloat16)


def _has_op(name: str) -> bool:
    return hasattr(torch.ops.aten, name)


def select_backend(x: torch.Tensor, group_size: int = 0) -> str:
    """"cpu", "triton", "cuda" or "reference" for activations ``x`` [M, K] of a layer with ``group_size``
    (POLYSPEC_INT4_REFERENCE=1 forces the reference; POLYSPEC_INT4_REFERENCE=bf16 too, with the activations rounded
    to bf16 first, as the kernels round them). "triton": CUDA at verification widths (decode/int4_triton.py)."""
    if os.environ.get("POLYSPEC_INT4_REFERENCE", "") not in ("", "0"):
        return "reference"
    if x.requires_grad and torch.is_grad_enabled():
        return "reference"  # the fused kernels have no backward
    if x.device.type == "cpu" and _has_op("_weight_int4pack_mm_for_cpu"):
        return "cpu"
    if x.device.type == "cuda" and int4_triton.supported(x, group_size):
        return "triton"
    if x.device.type == "cuda" and _has_op("_weight_int4pack_mm") and torch.cuda.get_device_capability(x.device)[0] >= 8:
        return "cuda"
    return "reference"


class Int4Linear(nn.Module):
    """y = x @ dequantize(q, scales, zeros).T + bias, on torch's fused int4 kernels where available.

    Buffers: ``qdata`` uint8 [N, ceil(K/2)] (two codes per byte, even k in the low nibble), ``scales`` float32
    [N, G] (kept float32 whatever dtype the model is cast to), ``zeros`` uint8 [N, G], optional ``bias`` [N].
    Kernel-ready weights are built once per device on first use.
    """

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                 bias: torch.Tensor | None = None):
        super().__init__()
        n, k = q.shape
        g = num_groups(k, group_size)
        if tuple(scales.shape) != (n, g) or tuple(zeros.shape) != (n, g):
            raise PolyspecError(f"Int4Linear: scales/zeros must be [{n}, {g}], got {list(scales.shape)} / "
                                f"{list(zeros.shape)}")
        codes = F.pad(q.to(torch.uint8), (0, k % 2))  # [N, K + K%2]
        self._set(codes[:, 0::2] | (codes[:, 1::2] << 4), scales.detach().float().contiguous(),
                  zeros.detach().to(torch.uint8).contiguous(), None if bias is None else bias.detach().clone(), k,
                  group_size)

    def _set(self, qdata: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bias: torch.Tensor | None,
             in_features: int, group_size: int) -> None:
        self.in_features, self.out_features, self.group_size = in_features, qdata.shape[0], group_size
        self.register_buffer("qdata", qdata)  # [N, ceil(K/2)]
        self.register_buffer("scales", scales)
        self.register_buffer("zeros", zeros)
        self.register_buffer("bias", bias)
        self.reset_kernels()

    @classmethod
    def cat(cls, layers: list[Int4Linear]) -> Int4Linear | None:
        """One layer computing ``torch.cat([layer(x) for layer in layers], -1)``: codes, scales, zeros and biases
        concatenated along N (model.fuse_projections: one kernel for q/k/v, one for gate/up). Each layer's buffers
        become views of the fused ones, as fused bf16 projections do: no memory added, the same values. None where
        the layers differ in K, group size, device or bias presence."""
        first = layers[0]
        if len({(lin.in_features, lin.group_size, lin.qdata.device, lin.bias is None) for lin in layers}) != 1:
            return None
        parts = [(lin.qdata, lin.scales, lin.zeros, lin.bias) for lin in layers]
        qdata, scales, zeros = (torch.cat([p[i] for p in parts]) for i in range(3))
        bias = None if first.bias is None else torch.cat([p[3] for p in parts])
        fused = cls.__new__(cls)
        nn.Module.__init__(fused)
        fused._set(qdata, scales, zeros, bias, first.in_features, first.group_size)
        row = 0
        for lin in layers:
            rows = slice(row, row + lin.out_features)
            lin._set(qdata[rows], scales[rows], zeros[rows], None if bias is None else bias[rows], lin.in_features,
                     lin.group_size)
            row += lin.out_features
        return fused

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = 128, sym: bool = True) -> Int4Linear:
        q, s, z = quantize_rtn(linear.weight, group_size, sym)
        return cls(q, s, z, group_size, linear.bias)

    @property
    def q(self) -> torch.Tensor:
        """Codes uint8 [N, K]."""
        codes = torch.stack((self.qdata & 0xF, self.qdata >> 4), dim=-1).view(self.out_features, -1)
        return codes[:, : self.in_features]

    def dequantized_weight(self) -> torch.Tensor:
        """float32 [N, K]."""
        return dequantize(self.q, self.scales, self.zeros, self.group_size)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, "
                f"bias={self.bias is not None}")

    def _apply(self, fn, recurse=True):
        scales = self.scales
        super()._apply(fn, recurse)
        # dtype casts must not round the scales (a meta layer moved with to_empty gets empty float32 scales)
        self.scales = torch.empty_like(scales, device=self.qdata.device) if scales.is_meta \
            else scales.to(self.qdata.device)
        self.reset_kernels()
        return self

    def reset_kernels(self) -> None:
        """Forget the kernel-ready copies (after the codes, scales or device change): rebuilt on next use."""
        self._kernel: tuple | None = None  # torch's int4 kernels: ((backend, device), plan, packed, scales_and_zeros)
        self._triton: dict = {}  # the Triton kernel's tensors per (device, activation dtype)

    def _packed_for(self, backend: str, device: torch.device) -> tuple[KernelPlan, torch.Tensor, torch.Tensor] | None:
        if self._kernel is not None and self._kernel[0] == (backend, device):
            return self._kernel[1:]
        plan = plan_kernel(self.out_features, self.in_features, self.group_size, backend)
        if plan is None:
            return None
        codes, sz = _kernel_codes_and_scales(self.q.cpu(), self.scales, self.zeros, self.group_size, plan)
        if backend == "cpu":
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, plan.inner_k_tiles)
        else:
            pairs = (codes[:, 0::2] << 4 | codes[:, 1::2]).to(torch.uint8)  # [Np, Kp/2], even k high nibble
            packed = torch.ops.aten._convert_weight_to_int4pack(pairs.to(device), plan.inner_k_tiles)
        self._kernel = ((backend, device), plan, packed, sz.to(device))
        return self._kernel[1:]

    def _triton_mm(self, x2: torch.Tensor) -> torch.Tensor:
        """x2 [M, K] -> [M, N] + bias in x2's dtype on the Triton W4A16 kernel (fp32 activations run as bf16); the
        kernel's tensors are built once per device and dtype (int4_triton.kernel_tensors)."""
        dtype = x2.dtype if x2.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
        key = (x2.device, dtype)
        if key not in self._triton:
            int4_triton.register()
            self._triton[key] = int4_triton.kernel_tensors(self.q, self.scales, self.zeros, self.bias,
                                                           self.group_size, dtype, x2.device)
        t, n = self._triton[key], self.out_features
        p = int4_triton.plan(n, self.in_features, self.group_size, x2.shape[0], t.sms)
        return int4_triton.int4_mm(x2.to(dtype), t, self.group_size, n, p).to(x2.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N] in x's dtype (the one place that picks the kernel)."""
        fast = cpu_kernels.int4_linear(x, self)  # the CPU streaming kernel at decode widths (see dot_path())
        if fast is not None:
            return fast
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)  # [M, K]
        backend = select_backend(x2, self.group_size)
        kernel = self._packed_for(backend, x2.device) if backend not in ("reference", "triton") else None
        if backend == "triton":  # verification widths on CUDA (decode/int4_triton.py), the bias added there
            return self._triton_mm(x2).view(*lead, self.out_features)
        if kernel is None:
            w = self.dequantized_weight().to(device=x2.device, dtype=x2.dtype)  # [N, K]
            if os.environ.get("POLYSPEC_INT4_REFERENCE", "").strip().lower() == "bf16":
                x2 = x2.to(torch.bfloat16).to(x2.dtype)
            y = x2 @ w.t()
        else:
            plan, packed, sz = kernel
            xb = x2.to(torch.bfloat16)
            if plan.k_pad != self.in_features:
                xb = F.pad(xb, (0, plan.k_pad - self.in_features))  # [M, Kp]
            mm = torch.ops.aten._weight_int4pack_mm_for_cpu if backend == "cpu" else torch.ops.aten._weight_int4pack_mm
            y = mm(xb.contiguous(), packed, plan.kernel_group, sz)[:, : self.out_features].to(x2.dtype)  # [M, N]
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.view(*lead, self.out_features)


# ----------------------------------------------------------------------------------------------------------------
# Whole models
# ----------------------------------------------------------------------------------------------------------------


def _iter_quantizable(model: nn.Module):
    """(parent module, attribute name, full name) of every q/k/v/o/gate/up/down linear in model.layers."""
    for i, layer in enumerate(model.layers):
        for dotted in QUANTIZED_LINEARS:
            block_name, attr = dotted.split(".")
            block = getattr(layer, block_name)
            yield block, attr, f"model.layers.{i}.{dotted}"


def quantize_model_rtn(model: nn.Module, group_size: int = 128, sym: bool = True) -> nn.Module:
    """Swap every q/k/v/o/gate/up/down nn.Linear of a Transformer for an RTN Int4Linear (in place; returned).
    Embeddings, norms and lm_head stay as they are."""
    for block, attr, _ in _iter_quantizable(model):
        lin = getattr(block, attr)
        if isinstance(lin, nn.Linear):
            setattr(block, attr, Int4Linear.from_linear(lin, group_size, sym))
    return model


def gptq_quantization_config(group_size: int, sym: bool = True, checkpoint_format: str = "gptq",
                             quantized_group_size: int | None = None) -> dict[str, Any]:
    """The HF ``quantization_config`` of a W4A16 GPTQ folder, with every key GPTQModel, transformers and vLLM read
    (vLLM: bits, group_size, desc_act, sym, lm_head, checkpoint_format; GPTQModel: format, method, pack_dtype,
    meta.quantizer). ``quantized_group_size``: the group the weights were quantised with when they are stored with
    a smaller ``group_size`` (:func:`regroup_gptq`), recorded in ``meta``."""
    from polyspec import __version__

    meta: dict[str, Any] = {"quantizer": [f"polyspec:{__version__}"]}
    if quantized_group_size is not None and quantized_group_size != group_size:
        meta["polyspec_quantized_group_size"] = quantized_group_size
    return {"quant_method": "gptq", "method": "gptq", "bits": 4, "group_size": group_size, "sym": sym,
            "desc_act": False, "lm_head": False, "format": checkpoint_format, "checkpoint_format": checkpoint_format,
            "pack_dtype": "int32", "meta": meta}


def gptq_tensors_from_model(model: nn.Module) -> dict[str, torch.Tensor]:
    """HF-named tensors of a Transformer whose linears are Int4Linear: GPTQ tensors for those, plain weights
    (as stored, tied lm_head omitted) for the rest."""
    out: dict[str, torch.Tensor] = {}
    quantized_prefixes = set()
    for block, attr, name in _iter_quantizable(model):
        lin = getattr(block, attr)
        if not isinstance(lin, Int4Linear):
            raise PolyspecError(f"{name} is not an Int4Linear; quantise the model first (quantize_model_rtn)")
        for key, t in pack_gptq(lin.q.cpu(), lin.scales.cpu(), lin.zeros.cpu(), lin.group_size).items():
            out[f"{name}.{key}"] = t
        if lin.bias is not None:
            out[f"{name}.bias"] = lin.bias.detach().cpu().contiguous()
        quantized_prefixes.add(name[len("model."):] + ".")
    tied = model.args.tie_word_embeddings
    for key, t in model.state_dict().items():
        if any(key.startswith(p) for p in quantized_prefixes) or (tied and key == "lm_head.weight"):
            continue
        out[key if key.startswith("lm_head.") else f"model.{key}"] = t.detach().cpu().contiguous()
    return out


def write_gptq_folder(out_dir: str | Path, hf_config: dict[str, Any], tensors: dict[str, torch.Tensor],
                      group_size: int, sym: bool = True, copy_files_from: str | Path | None = None,
                      overwrite: bool = False, portable: bool = True) -> Path:
    """Atomically write a GPTQ-format HF folder: config.json (+ quantization_config), quantize_config.json (the
    same settings, which GPTQModel and vLLM read when config.json has none), model.safetensors, and every
    non-weight file (tokenizer, generation config, chat template) of ``copy_files_from``.

    ``tensors`` hold GPTQ tensors packed with ``group_size``. portable: when some K is not a multiple of it, store
    them with the group :func:`portable_group_size` picks (:func:`regroup_gptq`: the same weights) so that loaders
    which need K % group_size == 0 read the folder; False keeps ``group_size`` with a short last group."""
    from safetensors.torch import save_file

    quantized_group_size = group_size
    if portable:
        tensors, group_size = _regrouped(tensors, group_size)

    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise PolyspecError(f"{out_dir} already exists and is not empty; remove it or pass overwrite=True")
    tmp = temp_folder(out_dir)
    try:
        if copy_files_from is not None:
            for f in Path(copy_files_from).iterdir():
                if f.is_file() and not NOT_COPIED.match(f.name):
                    shutil.copy2(f, tmp / f.name)
        cfg = dict(hf_config)
        cfg["quantization_config"] = gptq_quantization_config(group_size, sym,
                                                              quantized_group_size=quantized_group_size)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        (tmp / "quantize_config.json").write_text(json.dumps(cfg["quantization_config"], indent=2) + "\n")
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        swap_into_place(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _regrouped(tensors: dict[str, torch.Tensor], group_size: int) -> tuple[dict[str, torch.Tensor], int]:
    """(tensors, group_size) stored with :func:`portable_group_size` (unchanged when every K is a multiple)."""
    ks = {t.shape[0] * 8 for key, t in tensors.items() if key.endswith(".qweight")}  # int32 words of 8 nibbles
    stored = portable_group_size(ks, group_size)
    return regroup_tensors(tensors, group_size, stored), stored


def regroup_tensors(tensors: dict[str, torch.Tensor], group_size: int, new_group: int) -> dict[str, torch.Tensor]:
    """Every GPTQ layer in a state dict (``<name>.qweight`` etc.) from ``group_size`` to ``new_group``
    (:func:`regroup_gptq`); other tensors as they are."""
    if new_group == group_size:
        return tensors
    out = dict(tensors)
    for key, qweight in tensors.items():
        if key.endswith(".qweight"):
            name = key[: -len(".qweight")]
            parts = {p: tensors[f"{name}.{p}"] for p in ("qweight", "qzeros", "scales")}
            k = qweight.shape[0] * 8
            out.update({f"{name}.{p}": t for p, t in regroup_gptq(parts, k, group_size, new_group).items()})
    return out


def save_int4_checkpoint(model_dir: str | Path, out_dir: str | Path, group_size: int = 128, method: str = "rtn",
                         sym: bool = True, overwrite: bool = False, portable: bool = True) -> Path:
    """Quantise the HF model in ``model_dir`` to 4-bit (RTN) and write a standard GPTQ v1 folder to ``out_dir``.

    portable: see :func:`write_gptq_folder`.

    Only method "rtn" lives here; GPTQ proper (calibrated) belongs to polyspec.quantize, which can write its result
    with :func:`gptq_tensors_from_model` + :func:`write_gptq_folder`.
    """
    from polyspec.decode.model import ModelArgs, load_safetensors_dir, read_hf_config

    if method != "rtn":
        raise PolyspecError(f"save_int4_checkpoint supports method 'rtn' only, got {method!r}; calibrated GPTQ "
                            "is done by polyspec.quantize")
    _check_group_size(group_size)
    cfg = read_hf_config(Path(model_dir))
    if cfg.get("quantization_config"):
        raise PolyspecError(f"{model_dir} is already quantised ({cfg['quantization_config'].get('quant_method')}); "
                            "start from the full-precision model")
    ModelArgs.from_hf_config(cfg)  # refuses unsupported architectures early
    tensors = load_safetensors_dir(Path(model_dir))
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if _LINEAR_WEIGHT.match(name):
            prefix = name[: -len(".weight")]
            q, s, z = quantize_rtn(t, group_size, sym)
            out.update({f"{prefix}.{k}": v for k, v in pack_gptq(q, s, z, group_size).items()})
        else:
            out[name] = t
    return write_gptq_folder(out_dir, cfg, out, group_size, sym, copy_files_from=model_dir, overwrite=overwrite,
                             portable=portable)


def load_int4(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", *,
              embed_dtype: torch.dtype | None = None):
    """Load a GPTQ 4-bit HF folder (desc_act false, "gptq" or "gptq_v2" format) into a Transformer with
    Int4Linear layers. ``Transformer.from_pretrained`` calls this when config.json has a quantization_config.

    ``embed_dtype``: the embedding's and lm_head's dtype (None: bf16 for an fp32 model, else ``dtype``). A W4A16
    model keeps those 16-bit, as GPTQ checkpoints store them; in an fp32 chain widening them would double the int4
    level's largest matrix (SmolLM2's tied 49,152 x 576 lm_head is two thirds of its bytes in fp32). Activations,
    norms and the residual stream stay in ``dtype`` (on the CPU fp32 also when bf16 is asked for: the int4 kernels'
    activations); the lm_head's output is fp32 either way."""
    from polyspec.decode.model import ModelArgs, Transformer, build_from_state, load_safetensors_dir, read_hf_config

    if torch.device(device).type == "cpu" and dtype == torch.bfloat16:
        # the CPU's int4 rows and layer kernel take fp32 activations (a bf16 one would run torch's dequantising path,
        # slower); levels exchange token ids and fp32 distributions, so the chain's dtype does not reach them
        dtype, embed_dtype = torch.float32, embed_dtype or torch.bfloat16
    path = Path(path)
    cfg = read_hf_config(path)
    qc = cfg.get("quantization_config") or {}
    method = qc.get("quant_method")
    if method != "gptq" or int(qc.get("bits", 0)) != 4:
        raise PolyspecError(f"{path}: only 4-bit GPTQ checkpoints load into polyspec's engine, found "
                            f"quant_method={method!r} bits={qc.get('bits')!r}")
    fmt = qc.get("checkpoint_format") or qc.get("format") or "gptq"
    if fmt not in ("gptq", "gptq_v2"):
        raise PolyspecError(f"{path}: GPTQ checkpoint_format {fmt!r} is not supported (gptq or gptq_v2)")
    group_size = int(qc.get("group_size", 128))
    _check_group_size(group_size)
    args = ModelArgs.from_hf_config(cfg)
    tensors = load_safetensors_dir(path)
    with torch.device("meta"):
        model = Transformer(args)
    for block, attr, name in _iter_quantizable(model):
        lin: nn.Linear = getattr(block, attr)
        parts = {k: tensors.pop(f"{name}.{k}") for k in ("qweight", "qzeros", "scales", "g_idx")
                 if f"{name}.{k}" in tensors}
        if "qweight" not in parts:
            raise PolyspecError(f"{path}: quantised tensors for {name} are missing (expected {name}.qweight)")
        q, s, z = unpack_gptq(parts, group_size, lin.in_features, zero_offset=1 if fmt == "gptq" else 0)
        if q.shape[0] != lin.out_features:
            raise PolyspecError(f"{path}: {name} has {q.shape[0]} outputs, the config implies {lin.out_features}")
        bias = tensors.pop(f"{name}.bias", None)
        if (bias is not None) != (lin.bias is not None):
            raise PolyspecError(f"{path}: {name} bias presence does not match the config")
        s, z, gs = merge_equal_groups(s, z, group_size)  # a regrouped folder runs on its quantisation's groups
        setattr(block, attr, Int4Linear(q, s, z, gs, None if bias is None else bias.to(dtype)))
    model = build_from_state(args, tensors, dtype=dtype, device=device, model=model)
    return set_embed_dtype(model, embed_dtype or (torch.bfloat16 if dtype == torch.float32 else dtype))


def set_embed_dtype(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Store ``model``'s embedding and lm_head (shared when tied) in ``dtype``, in place; returns the model."""
    emb, head = model.embed_tokens, model.lm_head
    tied = head.weight is emb.weight
    with torch.no_grad():
        emb.weight = nn.Parameter(emb.weight.detach().to(dtype), requires_grad=False)
        if tied:
            head.weight = emb.weight
        else:
            head.weight = nn.Parameter(head.weight.detach().to(dtype), requires_grad=False)
            if head.bias is not None:
                head.bias = nn.Parameter(head.bias.detach().to(dtype), requires_grad=False)
    return model
