"""W8A16 int8 linear layers, one scale per output row: a middle level for a bf16 target's chain on the CPU.

Convention: ``qweight`` int8 [N, K] holds 7-bit codes in -CODE_MAX..CODE_MAX (63), ``scale`` float32 [N], and
``w[n, k] = qweight[n, k] * scale[n]`` (round to nearest, symmetric: ``scale[n] = max_k |w[n, k]| / 63``). The
activations stay bf16; the codes are exact in bf16, so a dot product is a sum of exact products, and the kernel's
result differs from the reference only in the order of its fp32 sums.

Why 7 bits: the AVX512-BF16 rows widen a code v to the bf16 number v + 192 (bits 0x4300 | (v + 64)) in three
integer instructions and take 192 times the input's sum back off; full 8-bit codes need a float conversion (seven
instructions per 32 weights), which made the level compute-bound in this VM's fast memory state. Greedy agreement
with the bf16 SmolLM2 target on its own answers: 0.951 (8-bit codes 0.974, the GPTQ int4 g128 level 0.817;
docs/KERNELS.md, "An int8 level").

:func:`int8_copy` makes such a level from a loaded bf16 model in memory; in a chain it takes the target's K/V of the
prompt instead of a prefill of its own. The fast path is ``cpu_kernels.int8_linear`` (whole layers:
``polyspec_layer_i8`` through ``cpu_kernels.run_layers``); the reference (:meth:`Int8Linear.forward` without the
kernel) is what tests hold it to. Not yet a pipeline stage: ``polyspec run`` still quantises M2 to GPTQ int4
(docs/KERNELS.md, "An int8 level").
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from polyspec.decode import cpu_kernels
from polyspec.errors import PolyspecError

CODE_MAX = 63  # 7-bit codes: the kernel widens 32 of them to bf16 in three integer instructions (cpu_kernels.cpp)


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes int8 [N, K] in -CODE_MAX..CODE_MAX, scales float32 [N]) of ``weight`` [N, K]: round to nearest, one
    symmetric scale per row (an all-zero row gets scale 1 and codes 0)."""
    if weight.dim() != 2:
        raise PolyspecError(f"int8 quantisation takes a 2-D weight, got shape {list(weight.shape)}")
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / CODE_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(w / scale[:, None]).clamp(-CODE_MAX, CODE_MAX).to(torch.int8)
    return codes.contiguous(), scale.contiguous()


class Int8Linear(nn.Module):
    """``y = x W^T + b`` with ``W = qweight * scale[:, None]`` (see the module docstring); ``bias`` in the model's
    dtype. Inference only."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scale", torch.ones(out_features, dtype=torch.float32))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        """The int8 copy of ``linear`` (its weight quantised per row, its bias kept)."""
        mod = cls(linear.in_features, linear.out_features, linear.bias is not None, linear.weight.dtype)
        mod.qweight, mod.scale = quantize_rows(linear.weight)
        if linear.bias is not None:
            mod.bias.data = linear.bias.detach().clone()
        return mod

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = cpu_kernels.int8_linear(x, self)
        if y is not None:
            return y
        # the codes times the input (exact codes in x's dtype, fp32 sums), then the row scales, rounded once
        out = F.linear(x, self.qweight.to(x.dtype)).float() * self.scale
        if self.bias is not None:
            out = out + self.bias.float()
        return out.to(x.dtype)


def int8_copy(model: nn.Module) -> nn.Module:
    """A copy of the bf16 decoder ``model`` (decode.model.Transformer) whose decoder-layer projections and lm_head are
    :class:`Int8Linear` (round to nearest, one scale per output row); the embedding stays bf16 (a lookup reads one row
    per token), so a tied lm_head is untied in the copy. The copy's weights are packed for streaming
    (cpu_kernels.pack_weights); the model itself is unchanged. In a chain the copy takes the target's K/V of the
    prompt instead of a prefill of its own (``prompt_from_target``)."""
    if next(model.parameters()).dtype != torch.bfloat16:
        raise PolyspecError("an int8 level is made from a bf16 model (W8A16: its activations stay bf16); load the "
                            "target in bfloat16 first")
    from polyspec.decode.int4 import _iter_quantizable  # the one list of a layer's quantised projections

    out = copy.deepcopy(model)  # (a copied layer has no kernel plan: LayerPlan.__deepcopy__)
    out._cache = None
    for block, attr, _ in _iter_quantizable(out):
        setattr(block, attr, Int8Linear.from_linear(getattr(block, attr)))
    out.lm_head = Int8Linear.from_linear(out.lm_head)
    out.prompt_from_target = True  # a chain gives it the target's K/V of a prompt (levels.ModelLevel.adopt_prompt)
    cpu_kernels.pack_weights(out)
    return out.eval()
