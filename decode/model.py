"""A compact Llama-family decoder (Llama, Mistral, Qwen2, SmolLM2) with a static KV cache.

This is the engine every level of the chain runs on: the target M1, its int4 copy M2 (the same class with
:class:`~polyspec.decode.int4.Int4Linear` layers swapped in) and, through :class:`DecoderLayer`, the draft head.

Cache API (shared with :class:`polyspec.decode.head.EagleHead` through :class:`CachedDecoder`):

* ``setup_cache(max_seq_len, batch_size=1)`` pre-allocates K/V of shape (B, kv_heads, max_seq_len, head_dim).
* ``forward`` appends its T tokens at positions ``cache_len .. cache_len + T - 1``.
* ``truncate(n)`` rolls back in O(1) (entries at positions >= n are overwritten by later forwards);
  ``compact(src_positions, dst_start)`` keeps a chosen set of entries (the accepted path of a verified tree).

Without ``setup_cache`` the model runs stateless: every forward sees only its own block (positions 0..T-1 plus
``position_offsets``), which is what training a head on whole sequences needs.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from polyspec.decode import cpu_kernels
from polyspec.errors import PolyspecError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "smollm2")
ROPE_TYPES = ("default", "linear", "llama3")


# ----------------------------------------------------------------------------------------------------------------
# Configuration
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class ModelArgs:
    """Architecture of a Llama-family decoder; ``from_hf_config`` reads a Hugging Face ``config.json`` dict."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v (Llama: also on o_proj unless o_proj_bias says otherwise)
    mlp_bias: bool = False
    rope_scaling: dict | None = None  # None/"default", {"rope_type": "linear"|"llama3", ...}
    model_type: str = "llama"
    o_proj_bias: bool | None = None  # None: same as attention_bias (Llama); Qwen2 has q/k/v bias only
    sliding_window: int | None = None  # Mistral: longer caches than this would not match the reference model
    extra: dict = field(default_factory=dict)  # informational, except hidden_act (silu only, see layer_features)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise PolyspecError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        rope_type = _rope_type(self.rope_scaling)
        if rope_type not in ROPE_TYPES:
            raise PolyspecError(
                f"rope scaling type {rope_type!r} is not supported by polyspec's engine (supported: "
                f"{', '.join(ROPE_TYPES)}); load this model with transformers instead"
            )
        if _hidden_act(self) != "silu":
            raise PolyspecError(f"hidden_act {self.extra['hidden_act']!r} is not supported by polyspec's engine (only "
                                "silu); load this model with transformers instead")

    @property
    def has_o_bias(self) -> bool:
        return self.attention_bias if self.o_proj_bias is None else self.o_proj_bias

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelArgs:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise PolyspecError(f"unknown ModelArgs keys {unknown}; known keys: {sorted(known)}")
        return cls(**d)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelArgs:
        """Map a Hugging Face config dict (llama, mistral, qwen2, smollm2) onto ModelArgs.

        Raises PolyspecError naming the model_type when it is not one of those (callers may fall back to
        transformers), or when the config uses a feature this engine does not reproduce exactly.
        """
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise PolyspecError(
                f"model_type {model_type!r} is not supported by polyspec's engine (supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}); load it with transformers instead"
            )
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise PolyspecError(f"hidden_act {act!r} in the {model_type} config is not supported (only silu)")
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            rope_theta, rope_scaling = _rope_from_hf(cfg)
            is_qwen2 = model_type == "qwen2"
            sliding = cfg.get("sliding_window")
            if is_qwen2 and not cfg.get("use_sliding_window", False):
                sliding = None
            return cls(
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rope_theta=rope_theta,
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=True if is_qwen2 else bool(cfg.get("attention_bias", False)),
                mlp_bias=bool(cfg.get("mlp_bias", False)),
                rope_scaling=rope_scaling,
                model_type=model_type,
                o_proj_bias=False if is_qwen2 else None,
                sliding_window=int(sliding) if sliding else None,
                extra={"hidden_act": act},
            )
        except KeyError as e:
            raise PolyspecError(
                f"the {model_type} config has no {e.args[0]!r} key; is it a complete config.json?"
            ) from e


def _rope_type(rope_scaling: dict | None) -> str:
    if not rope_scaling:
        return "default"
    return str(rope_scaling.get("rope_type") or rope_scaling.get("type") or "default")


def _rope_from_hf(cfg: dict[str, Any]) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either the transformers-5 ``rope_parameters`` or the older keys."""
    params = cfg.get("rope_parameters") or {}
    theta = cfg.get("rope_theta") or params.get("rope_theta") or 10000.0
    scaling = cfg.get("rope_scaling") or {k: v for k, v in params.items() if k != "rope_theta"}
    if _rope_type(scaling) == "default":
        scaling = None
    elif scaling is not None:
        scaling = dict(scaling)
        scaling["rope_type"] = _rope_type(scaling)
        scaling.pop("type", None)
    return float(theta), scaling


# Where each ModelArgs field enters a decoder layer's maths. A fast layer backend (cpu_kernels.LAYER_SUPPORT) runs a
# layer only when it declares every name layer_features gives; a new field must be placed here (tests/test_model.py
# checks that every field is), and one that changes what a layer computes must add a feature in layer_features.
LAYER_FIELDS = {
    # features: layer_features names what they switch on (extra: its hidden_act)
    "features": ("attention_bias", "o_proj_bias", "mlp_bias", "extra"),
    # sizes and constants every backend reads from the layer itself (its weights, its norms' eps)
    "sizes": ("hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim", "rms_norm_eps"),
    # outside the layer: embeddings, lm_head, the RoPE tables (computed once in Python and handed to every backend),
    # the cache length (setup_cache keeps it within sliding_window, so no layer ever masks by the window)
    "outside": ("vocab_size", "num_layers", "max_position_embeddings", "tie_word_embeddings", "model_type",
                "rope_theta", "rope_scaling", "sliding_window"),
}


def layer_features(args: ModelArgs) -> frozenset[str]:
    """The operations a :class:`DecoderLayer` built from ``args`` performs, by name (see LAYER_FIELDS): pre-norm
    RMSNorm, rotate-half RoPE over the whole head, softmax attention, a gated MLP, and the optional parts."""
    feats = {"rms_norm", "rope_rotate_half", "softmax_attention", f"{_hidden_act(args)}_glu_mlp"}
    if args.num_kv_heads != args.num_heads:
        feats.add("gqa")
    if args.attention_bias:
        feats.add("qkv_bias")
    if args.has_o_bias:
        feats.add("o_bias")
    if args.mlp_bias:
        feats.add("mlp_bias")
    return frozenset(feats)


def _hidden_act(args: ModelArgs) -> str:
    act = str(args.extra.get("hidden_act", "silu"))
    return "silu" if act == "swish" else act


# ----------------------------------------------------------------------------------------------------------------
# Rotary position embedding (the Hugging Face "rotate half" convention)
# ----------------------------------------------------------------------------------------------------------------


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] float32, with linear or Llama-3 scaling applied."""
    d = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    rope_type = _rope_type(args.rope_scaling)
    if rope_type == "linear":
        inv_freq = inv_freq / float(args.rope_scaling["factor"])
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, args.rope_scaling)
    return inv_freq


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama-3.1 frequency scaling: long wavelengths divided by ``factor``, short kept, a smooth ramp between."""
    factor = float(s["factor"])
    low, high = float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
    old_ctx = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """cos, sin [T, head_dim] for integer positions [T], computed in float32 then cast to ``dtype``."""
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, D] rotated by cos/sin [T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


# ----------------------------------------------------------------------------------------------------------------
# Layers
# ----------------------------------------------------------------------------------------------------------------


class Linear(nn.Linear):
    """nn.Linear (same parameters, same state-dict names) whose inference forward takes the CPU streaming kernel
    (:mod:`polyspec.decode.cpu_kernels`) at decode/verify widths; everything else is ``F.linear``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_kernels.linear(x, self.weight, self.bias)


cpu_kernels.register_linear_class(Linear)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class StaticKVCache:
    """Per-layer K/V tensors (B, kv_heads, max_seq_len, head_dim) plus the number of positions held.

    It is the dynamic path's KV store: :meth:`store` is what a :class:`DecoderLayer` calls with its block's K/V (the
    static step in polyspec.decode.cuda_graphs hands the layers a store of its own with the same method)."""

    def __init__(self, num_layers: int, batch_size: int, kv_heads: int, max_seq_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, slack: int = 0):
        # ``slack`` spare slots past max_seq_len: the padding rows of a static step (polyspec.decode.cuda_graphs)
        shape = (num_layers, batch_size, kv_heads, max_seq_len + slack, head_dim)
        # one tensor per store, each layer's a view of it: a verified tree's path moves in one copy for all layers
        self.k_all = torch.zeros(shape, dtype=dtype, device=device)
        self.v_all = torch.zeros(shape, dtype=dtype, device=device)
        self.k = [self.k_all[i] for i in range(num_layers)]  # single views (unbind's may not be written in grad mode)
        self.v = [self.v_all[i] for i in range(num_layers)]
        self.length = 0
        self.max_seq_len = max_seq_len
        self.batch_size = batch_size
        self.layer_blocks: dict = {}  # cpu_kernels.layer_block's tables over this cache (a segment's view shares it)

    def store(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write layer ``layer``'s block k/v [B, kv, T, D] at positions start .. start + T - 1; return the keys and
        values attention reads, positions 0 .. start + T - 1 ([B, kv, start + T, D] each)."""
        end = start + k.shape[2]
        self.k[layer][:, :, start:end] = k
        self.v[layer][:, :, start:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


SMALL_ATTENTION_ROWS = 16  # query rows per head up to which 16-bit CPU attention takes two matmuls (attend)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """softmax(q k^T / sqrt(D), masked) v with grouped K/V heads: q [B, h, T, D], k/v [B, kv, S, D], mask bool [T, S]
    or [B, 1, T, S] (True = visible; None: all) -> [B, h, T, D].

    torch's fused CPU attention takes ~10x the time of two batched matmuls for 16-bit inputs at decode widths (a few
    query rows per head: docs/KERNELS.md), so that case runs :func:`attend_matmul` (the same
    maths: fp32 scores and softmax); a prompt of one sequence on the CPU takes the layer kernel's attention
    (:func:`polyspec.decode.cpu_kernels.attention`); everything else, training and compiled steps included (inductor
    lowers it to one attention kernel), is ``F.scaled_dot_product_attention``."""
    small = q.is_cpu and q.dtype != torch.float32 and q.shape[2] <= SMALL_ATTENTION_ROWS
    if small and not (torch.is_grad_enabled() or torch.compiler.is_compiling()) and (
            mask is None or mask.dim() == 2 or mask.shape[1] == 1):
        return attend_matmul(q, k, v, mask)
    out = _kernel_attention(q, k, v, mask) if q.is_cpu and q.shape[2] > SMALL_ATTENTION_ROWS else None
    if out is not None:  # prompts on the CPU: the layer kernel's attention, a third of torch's fused one's time
        return out
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


def _kernel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      mask: torch.Tensor | None) -> torch.Tensor | None:
    """:func:`polyspec.decode.cpu_kernels.attention` one sequence at a time (it takes one): each prompt of a batch
    (the teacher's features for training, docs/TRAIN.md) gets the result it would get alone; None where the kernel
    does not apply. Stateless K/V are views into the fused projection, so they are copied into the kernel's layout
    first (a few percent of the attention's time); a KV cache's views already have it."""
    declined = torch.is_grad_enabled() or torch.jit.is_tracing() or torch.compiler.is_compiling()
    if q.shape[0] == 1:
        out = cpu_kernels.attention(q, k, v, mask)  # a KV cache's views are in the kernel's layout: no copy
        if out is not None or declined:
            return out
        return cpu_kernels.attention(q, k.contiguous(), v.contiguous(), mask)
    if declined or (mask is not None and mask.dim() != 2):
        return None
    k, v = k.contiguous(), v.contiguous()  # each row's slice of these is in the kernel's layout
    outs = []
    for i in range(q.shape[0]):
        out = cpu_kernels.attention(q[i:i + 1], k[i:i + 1], v[i:i + 1], mask)
        if out is None:
            return None
        outs.append(out)
    return torch.cat(outs)


def attend_matmul(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """:func:`attend` as two batched matmuls, each K/V head shared by its group of query heads without copying."""
    b, h, t, d = q.shape
    kv, s = k.shape[1], k.shape[2]
    g = h // kv
    scores = (q.reshape(b, kv, g * t, d) @ k.transpose(-1, -2)).float() * d ** -0.5  # [B, kv, g T, S]
    scores = scores.view(b, kv, g, t, s)
    if mask is not None:
        m = mask if mask.dim() == 2 else mask[:, :, None]  # [T, S] or [B, 1, 1, T, S]
        scores = scores.masked_fill(~m, float("-inf"))
    p = torch.softmax(scores, dim=-1).to(v.dtype).view(b, kv, g * t, s)
    return (p @ v).view(b, h, t, d)


def fused_projection(owner: nn.Module, x: torch.Tensor, linears: list[nn.Module]) -> torch.Tensor | None:
    """``torch.cat([lin(x) for lin in linears], -1)`` as one matmul where one is at hand: the CPU kernel's fused call,
    else the one weight :func:`fuse_projections` gave ``owner``'s projections; None: call the layers one by one."""
    y = cpu_kernels.fused_linears(x, linears)
    if y is not None:
        return y
    fused = owner.__dict__.get("_fused")
    if isinstance(fused, nn.Module):  # int4 projections concatenated along N (Int4Linear.cat)
        return fused(x)
    if fused is None or fused[0].dtype != x.dtype:
        return None
    return F.linear(x, fused[0], fused[1])


class FusableProjections(nn.Module):
    """A block (attention, MLP) whose parallel projections :func:`fuse_projections` may back by one weight; casting
    or moving the block gives each projection its own tensor again, so the fused weight is dropped then."""

    def _apply(self, fn, recurse=True):
        self.__dict__.pop("_fused", None)
        return super()._apply(fn, recurse)


def _fuse_group(owner: nn.Module, linears: list[nn.Module]) -> bool:
    """Back ``linears`` (plain Linear layers of one dtype and device, all with or all without bias) by one weight
    [sum of out_features, in] whose row blocks become their parameters' data (Int4Linear layers: one Int4Linear
    concatenated along N, Int4Linear.cat); False where they do not qualify."""
    from polyspec.decode.int4 import Int4Linear

    if all(isinstance(lin, Int4Linear) for lin in linears):
        fused = Int4Linear.cat(linears)
        if fused is not None:
            owner.__dict__["_fused"] = fused
        return fused is not None
    if not all(type(lin).forward is Linear.forward for lin in linears):
        return False
    ws = [lin.weight for lin in linears]
    biased = {lin.bias is not None for lin in linears}
    if len({(w.dtype, w.device, w.shape[1]) for w in ws}) != 1 or len(biased) != 1:
        return False
    weight = torch.cat([w.detach() for w in ws])
    bias = torch.cat([lin.bias.detach() for lin in linears]) if biased == {True} else None
    row = 0
    for lin in linears:
        n = lin.weight.shape[0]
        lin.weight.data = weight[row:row + n]
        if bias is not None:
            lin.bias.data = bias[row:row + n]
        row += n
    owner.__dict__["_fused"] = (weight, bias)
    return True


def fuse_projections(model: nn.Module) -> int:
    """Give every attention's q/k/v and every MLP's gate/up one weight tensor each, their own parameters becoming
    views of it (no extra memory; values, parameter identity and state-dict names unchanged), so a step runs one
    matmul where it ran three or two: fewer, larger kernels on a GPU (the compiled static step,
    polyspec.decode.cuda_graphs). Int4 projections fuse into one Int4Linear each; mixed ones stay separate. Returns
    the number of groups fused."""
    n = 0
    for mod in model.modules():
        if "_fused" in mod.__dict__:
            continue
        if isinstance(mod, Attention):
            n += _fuse_group(mod, [mod.q_proj, mod.k_proj, mod.v_proj])
        elif isinstance(mod, MLP):
            n += _fuse_group(mod, [mod.gate_proj, mod.up_proj])
    if n:
        cpu_kernels.drop_plans(model)  # the CPU kernels' plans hold the old weights' addresses
    return n


class Attention(FusableProjections):
    def __init__(self, args: ModelArgs):
        super().__init__()
        h, d = args.hidden_size, args.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, d
        self.q_proj = Linear(h, args.num_heads * d, bias=args.attention_bias)
        self.k_proj = Linear(h, args.num_kv_heads * d, bias=args.attention_bias)
        self.v_proj = Linear(h, args.num_kv_heads * d, bias=args.attention_bias)
        self.o_proj = Linear(args.num_heads * d, h, bias=args.has_o_bias)

    def projections(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, H] -> (qk [B, T, h + kv, D]: the query heads then the key heads, before RoPE; v [B, T, kv, D]).
        Fused projections give views of one matmul's output [B, T, (h + 2 kv) D]; separate ones a q/k concatenation,
        so RoPE is one call either way."""
        b, t, _ = x.shape
        h, kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = fused_projection(self, x, [self.q_proj, self.k_proj, self.v_proj])  # [B, T, (h + 2 kv) D]
        if qkv is not None:
            heads = qkv.view(b, t, h + 2 * kv, d)
            return heads[:, :, :h + kv], heads[:, :, h + kv:]
        qk = torch.cat((self.q_proj(x), self.k_proj(x)), dim=-1).view(b, t, h + kv, d)
        return qk, self.v_proj(x).view(b, t, kv, d)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [B, T, H]; cos/sin [T, D] -> q [B, h, T, D] and k [B, kv, T, D] (RoPE applied), v [B, kv, T, D]."""
        qk, v = self.projections(x)
        qk = apply_rope(qk.transpose(1, 2), cos, sin)  # [B, h + kv, T, D]
        return qk[:, :self.num_heads], qk[:, self.num_heads:], v.transpose(1, 2)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                cache: Any, layer_idx: int, start: int) -> torch.Tensor:
        """x [B, T, H]; cos/sin [T, D]; ``cache``: a KV store (``store(layer_idx, start, k, v)`` keeps the block's
        K/V and returns the [B, kv, S, D] keys/values to attend over; None: the block's own); mask bool [T, S]
        over those keys (None: all of them) -> [B, T, H]. A store with an ``attention(qk, v)`` method (the static
        step's, polyspec.decode.cuda_graphs) takes RoPE, its K/V write and attention over in one op instead: its
        positions and mask are its own, so cos, sin and mask are unused then."""
        b, t, _ = x.shape
        fused = getattr(cache, "attention", None)
        if fused is not None:
            out = fused(*self.projections(x))  # [B, T, h, D]
            return self.o_proj(out.view(b, t, self.num_heads * self.head_dim))
        q, k, v = self.qkv(x, cos, sin)
        if cache is not None:
            k, v = cache.store(layer_idx, start, k, v)  # [B, kv, S, D] each
        out = attend(q, k, v, mask)  # [B, h, T, D]
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))


class MLP(FusableProjections):
    def __init__(self, args: ModelArgs):
        super().__init__()
        h, i = args.hidden_size, args.intermediate_size
        self.gate_proj = Linear(h, i, bias=args.mlp_bias)
        self.up_proj = Linear(h, i, bias=args.mlp_bias)
        self.down_proj = Linear(i, h, bias=args.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = fused_projection(self, x, [self.gate_proj, self.up_proj])  # [..., 2 I]: one matmul
        if gate_up is not None:
            gate, up = gate_up.split(self.gate_proj.out_features, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm attention + SwiGLU MLP with residuals; parameter names match Hugging Face's Llama layer.

    The one reference definition of a layer's maths: the dynamic-cache forward, the stateless one (head training,
    ONNX export) and the static CUDA-graph step all call :meth:`forward`, each with its own KV store. A fast backend
    (cpu_kernels) takes the layer instead only when it declares every one of ``features`` (:func:`layer_features`).
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.features = layer_features(args)
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                cache: Any = None, layer_idx: int = 0, start: int = 0) -> torch.Tensor:
        """x [B, T, H] -> [B, T, H]; cos/sin [T, D]; ``cache`` the KV store (StaticKVCache, the static step's, or
        None: attend within the block), written for layer ``layer_idx`` at positions from ``start``; mask as in
        :meth:`Attention.forward`."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, layer_idx, start)
        return x + self.mlp(self.post_attention_layernorm(x))

    def _apply(self, fn, recurse=True):
        self.__dict__.pop("_cpu_plan", None)  # the CPU kernel's cached weight pointers (cpu_kernels.LayerPlan)
        return super()._apply(fn, recurse)


# ----------------------------------------------------------------------------------------------------------------
# Cache bookkeeping shared by the Transformer and the draft head
# ----------------------------------------------------------------------------------------------------------------


def block_mask(start: int, t: int, tree_mask: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """Bool attention mask [T, start + T]: all of the prefix, then causal (or ``tree_mask``) within the block.

    ``tree_mask`` is [T, T], or [T, K + T] when its first K columns cover the last K cached positions (tree nodes a
    draft appended in earlier forwards); every cached position before those is visible to every query.
    Returns None when every query may see every key (one token, no tree), so SDPA takes its fastest path.
    """
    if tree_mask is None:  # one op, not three: a verification builds one per forward
        return None if t == 1 else torch.ones(t, start + t, dtype=torch.bool, device=device).tril(start)
    inner = tree_mask.to(device=device, dtype=torch.bool)  # [T, K + T]
    prefix = torch.ones(t, start + t - inner.shape[1], dtype=torch.bool, device=device)  # [T, start - K]
    return torch.cat((prefix, inner), dim=1)


class CachedDecoder(nn.Module):
    """Static-KV-cache bookkeeping; subclasses set ``args``, ``inv_freq`` and ``_cache_layers``."""

    args: ModelArgs
    _cache_layers: int

    def __init__(self) -> None:
        super().__init__()
        self._cache: StaticKVCache | None = None

    def _compute_dtype(self) -> torch.dtype:
        """The activation (and KV cache) dtype: that of the never-quantised RMSNorm weights."""
        raise NotImplementedError

    def setup_cache(self, max_seq_len: int, batch_size: int = 1) -> None:
        """Pre-allocate the K/V cache for up to ``max_seq_len`` positions (and reset it)."""
        a = self.args
        if max_seq_len < 1 or batch_size < 1:
            raise PolyspecError(f"setup_cache needs max_seq_len >= 1 and batch_size >= 1, got {max_seq_len}, "
                                f"{batch_size}")
        if a.sliding_window is not None and max_seq_len > a.sliding_window:
            raise PolyspecError(
                f"max_seq_len {max_seq_len} exceeds this {a.model_type} model's sliding_window {a.sliding_window}; "
                "polyspec's engine attends to the whole cache, so keep max_seq_len <= sliding_window"
            )
        dtype = self._compute_dtype()
        device = self.inv_freq.device
        runner = self.__dict__.get("_static_runner")
        slack = runner.slack if runner is not None else 0
        old = self._cache
        if runner is not None and old is not None and old.batch_size == batch_size and old.k[0].dtype == dtype \
                and old.k[0].device == device and old.k[0].shape[2] >= max_seq_len + slack:
            old.length, old.max_seq_len = 0, max_seq_len  # same tensors: captured graphs stay valid
            return
        if runner is not None:  # room to grow in 1024-slot steps: fewer re-allocations, so fewer graph captures
            slack = -(-(max_seq_len + slack) // 1024) * 1024 - max_seq_len
        self._cache = StaticKVCache(self._cache_layers, batch_size, a.num_kv_heads, max_seq_len, a.head_dim,
                                    dtype, device, slack)

    @property
    def cache_len(self) -> int:
        """Positions currently held in the cache (0 without a cache)."""
        return self._cache.length if self._cache is not None else 0

    @property
    def max_seq_len(self) -> int:
        return self._cache.max_seq_len if self._cache is not None else 0

    def _require_cache(self, what: str) -> StaticKVCache:
        if self._cache is None:
            raise PolyspecError(f"{what} needs a KV cache: call setup_cache(max_seq_len) first")
        return self._cache

    def truncate(self, n: int) -> None:
        """Roll the cache back to its first ``n`` positions (O(1): later forwards overwrite the rest)."""
        cache = self._require_cache("truncate")
        if not 0 <= n <= cache.length:
            raise PolyspecError(f"truncate({n}) is outside 0..cache_len ({cache.length})")
        cache.length = n

    def reset(self) -> None:
        if self._cache is not None:
            self._cache.length = 0

    def compact(self, src_positions: torch.Tensor | list[int], dst_start: int) -> None:
        """Copy the K/V entries at absolute positions ``src_positions`` [n] to ``dst_start .. dst_start + n - 1``
        and set cache_len to ``dst_start + n`` (keeps the accepted path of a verified tree)."""
        cache = self._require_cache("compact")
        src = [int(p) for p in torch.as_tensor(src_positions).flatten().tolist()]
        n = len(src)
        if n and (min(src) < 0 or max(src) >= cache.length):
            raise PolyspecError(f"compact: source positions must lie in 0..{cache.length - 1}, got {src}")
        if dst_start < 0 or dst_start > cache.length or dst_start + n > cache.max_seq_len:
            raise PolyspecError(f"compact: dst_start {dst_start} with {n} entries does not fit the cache "
                                f"(cache_len {cache.length}, max_seq_len {cache.max_seq_len})")
        # A path already in place (a tree's first children, a lookup path) needs no copy: only the rest moves.
        same = next((j for j, pos in enumerate(src) if pos != dst_start + j), n)
        if same < n:
            moved = torch.tensor(src[same:], dtype=torch.long, device=cache.k[0].device)
            first = dst_start + same
            for store in (cache.k_all, cache.v_all):
                picked = store.index_select(3, moved)  # [layers, B, kv, n, D] (a copy: overlap is safe)
                store[:, :, :, first:first + n - same] = picked
        cache.length = dst_start + n

    def _positions(self, t: int, start: int, position_offsets: torch.Tensor | None,
                   device: torch.device) -> torch.Tensor:
        """Absolute positions [T] of the block: start + offsets (default 0..T-1)."""
        if position_offsets is None:
            return torch.arange(start, start + t, device=device)
        offsets = torch.as_tensor(position_offsets, device=device).long().flatten()
        if offsets.numel() != t:
            raise PolyspecError(f"position_offsets has {offsets.numel()} entries for a block of {t} tokens")
        return start + offsets

    def _apply(self, fn, recurse=True):
        runner = self.__dict__.get("_static_runner")
        if runner is not None:  # moved or cast weights: static buffers and graphs are stale
            runner.invalidate()
        self.__dict__.pop("_forward_args", None)  # the kernel's pointers into the old weights
        return super()._apply(fn, recurse)

    def _layers(self) -> list[nn.Module]:
        """The decoder layers, in cache order."""
        raise NotImplementedError

    def _check_block(self, b: int, t: int, start: int, tree_mask: torch.Tensor | None,
                     diagonal: bool = True) -> None:
        """One clear error for a block of ``b`` x ``t`` tokens at cache position ``start`` that cannot run
        (``diagonal=False``: the one-call kernels check a tree mask's diagonal themselves)."""
        cache = self._cache
        if cache is not None:
            if start + t > cache.max_seq_len:
                raise PolyspecError(
                    f"the KV cache holds {start} positions and this block adds {t}, more than max_seq_len "
                    f"{cache.max_seq_len}; call setup_cache with a larger max_seq_len (or truncate first)"
                )
            if b != cache.batch_size:
                raise PolyspecError(f"batch of {b} rows but the cache was set up for batch_size {cache.batch_size}")
        if tree_mask is not None:
            if tree_mask.dim() != 2 or tree_mask.shape[0] != t or not t <= tree_mask.shape[1] <= start + t:
                raise PolyspecError(f"tree_mask must be [T, K + T] with T = {t} and 0 <= K <= cache_len ({start}), "
                                    f"got {list(tree_mask.shape)}")
            if diagonal and not bool(tree_mask[:, tree_mask.shape[1] - t:].to(torch.bool).diagonal().all()):
                raise PolyspecError("tree_mask must let every token see itself (its diagonal must be all True)")

    def _run_layers(self, x: torch.Tensor, layers: list[nn.Module], tree_mask: torch.Tensor | None,
                    position_offsets: torch.Tensor | None, capture: tuple[int, ...] = ()
                    ) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        """x [B, T, H] through ``layers`` with the cache (if set up) -> [B, T, H]; advances cache_len.

        capture: layer indices whose outputs (the residual stream after that layer) are also returned, in the
        order given, as ``(x, [captured [B, T, H], ...])`` (an EAGLE-3 head's auxiliary features)."""
        if capture:
            return self._run_layers_capture(x, layers, tree_mask, position_offsets, capture)
        b, t, _ = x.shape
        cache = self._cache
        start = cache.length if cache is not None else 0
        self._check_block(b, t, start, tree_mask)
        plain = tree_mask is None and position_offsets is None
        blocked = plain and cache is not None and b == 1 and t > cpu_kernels.MAX_ROWS \
            and cpu_kernels.blocked_layers(layers)
        rows = cpu_kernels.rows_limit(start, tree_mask is not None, blocked)
        if blocked and t > rows:
            return self._run_chunks(x, layers, rows)
        block = cpu_kernels.layer_block(layers, cache, x.dtype, t, self.inv_freq, rows) \
            if cache is not None and b == 1 and x.is_cpu else None
        if block is not None:  # the common case on the CPU: every layer in one kernel call (a tree's too)
            at = None if plain else self._positions(t, start, position_offsets, x.device).tolist()
            x = cpu_kernels.run_block(block, x, cache, start, at, tree_mask)
            cache.length = start + t
            return x
        positions = self._positions(t, start, position_offsets, x.device)
        cos, sin = rope_cos_sin(self.inv_freq, positions, x.dtype)  # [T, D] each
        mask = block_mask(start, t, tree_mask, x.device)
        plans = [cpu_kernels.layer_plan(layer) for layer in layers] \
            if cpu_kernels.block_supported(x, cos, cache, mask, rows) else []
        if plans and all(p is not None for p in plans):  # every layer in one kernel call each
            x = cpu_kernels.run_layers(plans, x, cos, sin, mask, cache, start)
        else:
            for i, layer in enumerate(layers):
                plan = plans[i] if plans else None
                if plan is not None:
                    x = cpu_kernels.run_layers([plan], x, cos, sin, mask, cache, start, first=i)
                else:
                    x = layer(x, cos, sin, mask, cache, i, start)
        if cache is not None:
            cache.length = start + t
        return x

    def _run_chunks(self, x: torch.Tensor, layers: list[nn.Module], rows: int) -> torch.Tensor:
        """A causal block wider than one kernel call takes, as consecutive blocks of ``rows``: each attends to the
        cache the ones before it wrote, so the result is the whole block's (up to rounding, the same in every mode)."""
        return torch.cat([self._run_layers(x[:, s:s + rows], layers, None, None)
                          for s in range(0, x.shape[1], rows)], dim=1)

    # -- EAGLE-3 auxiliary features (begin) ------------------------------------------------------------------------

    def _run_layers_capture(self, x: torch.Tensor, layers: list[nn.Module], tree_mask: torch.Tensor | None,
                            position_offsets: torch.Tensor | None, capture: tuple[int, ...]
                            ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """_run_layers in segments that end at the captured layers (each segment keeps the one-call kernel path);
        every segment writes its layers' K/V at the same positions, so the cache ends as one call would leave it."""
        n = len(layers)
        if any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n for i in capture):
            raise PolyspecError(f"auxiliary layer ids {list(capture)} must lie in 0..{n - 1} (this model has {n} "
                                "layers)")
        cache = self._cache
        start = cache.length if cache is not None else 0
        outputs: dict[int, torch.Tensor] = {}
        lo = 0
        for hi in sorted(set(capture)):
            x = self._run_segment(x, layers, lo, hi + 1, start, tree_mask, position_offsets)
            outputs[hi], lo = x, hi + 1
        if lo < n:
            x = self._run_segment(x, layers, lo, n, start, tree_mask, position_offsets)
        if cache is not None:
            cache.length = start + x.shape[1]
        return x, [outputs[i] for i in capture]

    def _run_segment(self, x: torch.Tensor, layers: list[nn.Module], lo: int, hi: int, start: int,
                     tree_mask: torch.Tensor | None, position_offsets: torch.Tensor | None) -> torch.Tensor:
        """Layers lo .. hi - 1 (cache slots lo .. hi - 1) over a block at cache position ``start``."""
        cache = self._cache
        if cache is None:
            return self._run_layers(x, layers[lo:hi], tree_mask, position_offsets)
        # a view of the cache holding only this segment's layers, so _run_layers' layer i is cache slot lo + i
        view = StaticKVCache.__new__(StaticKVCache)
        view.__dict__.update(cache.__dict__, k=cache.k[lo:hi], v=cache.v[lo:hi], length=start)
        self._cache = view
        try:
            return self._run_layers(x, layers[lo:hi], tree_mask, position_offsets)
        finally:
            self._cache = cache

    # -- EAGLE-3 auxiliary features (end) --------------------------------------------------------------------------


# ----------------------------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------------------------


class Transformer(CachedDecoder):
    """Embeddings -> DecoderLayers -> final RMSNorm -> lm_head (tied to the embeddings when the config says so)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(args), persistent=False)
        self._cache_layers = args.num_layers

    def _compute_dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    def forward(self, input_ids: torch.Tensor, *, tree_mask: torch.Tensor | None = None,
                position_offsets: torch.Tensor | None = None, last_only: bool = False,
                aux_layers: tuple[int, ...] = (), logits_from: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Run T new tokens; returns (logits [T, V] float32, hidden [T, H]) — hidden is the final-norm'd state,
        i.e. exactly lm_head's input (the feature an EAGLE head reads).

        input_ids: [T] or [B, T] (B must equal the cache's batch size; B > 1 gives [B, T, ...] outputs).
        tree_mask: bool [T, T]; token j sees block token i iff tree_mask[j, i] (plus the whole cached prefix); or
            [T, K + T], whose first K columns say which of the last K cached positions token j sees.
        position_offsets: [T] RoPE positions relative to cache_len (default 0..T-1).
        last_only: return only the last row of each output ([1, V], [1, H]).
        logits_from: logits only for rows logits_from .. T - 1 ([T - logits_from, V]; hidden stays [T, H]): a
            prefill that feeds a draft head needs every row's hidden state but no logits before its last row, and
            the lm_head over a whole prompt costs as much as a tenth of the model.
        aux_layers: hidden is instead the concatenated outputs of these layers (0-based: the residual stream after
            layer i, Hugging Face's ``hidden_states[i + 1]``), [T, len(aux_layers) * H]: an EAGLE-3 head's input.
        """
        ids, squeeze = _as_batch(input_ids)
        start = self._cache.length if self._cache is not None else 0
        rows = cpu_kernels.rows_limit(start, tree_mask is not None) if ids.shape[0] == 1 else cpu_kernels.MAX_ROWS
        if aux_layers:
            x, aux = self._run_layers(self._embed(ids, None), list(self.layers), tree_mask, position_offsets,
                                      capture=tuple(aux_layers))
            logits, _ = self._out(x, last_only, logits_from, rows)
            hidden = torch.cat(aux, dim=-1)  # [B, T, A * H]
            out = logits, (hidden[:, -1:] if last_only else hidden)
        else:
            runner = self.__dict__.get("_static_runner")  # polyspec.decode.cuda_graphs: static steps / CUDA graphs
            out = runner.forward(ids, None, tree_mask, position_offsets, last_only) if runner is not None else None
        if out is None:
            out = self._forward_in_one_call(ids, last_only, logits_from, rows, tree_mask, position_offsets)
        if out is None:
            x = self._run_layers(self._embed(ids, None), list(self.layers), tree_mask, position_offsets)
            out = self._out(x, last_only, logits_from, rows)
        logits, hidden = out
        return (logits[0], hidden[0]) if squeeze else (logits, hidden)

    def _layers(self) -> list[nn.Module]:
        return list(self.layers)

    def _forward_in_one_call(self, ids: torch.Tensor, last_only: bool, logits_from: int, rows: int,
                             tree_mask: torch.Tensor | None, position_offsets: torch.Tensor | None
                             ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """forward's result for a block of one sequence at the cache's end (causal, or a draft tree's) from one
        kernel call (:meth:`decode_step`), or None where it does not apply (then the layers, the norm and the
        lm_head run one after another)."""
        if ids.shape[0] != 1 or not ids.is_cpu or not self.embed_tokens.weight.is_cpu or self._cache is None \
                or torch.compiler.is_compiling() or torch.jit.is_tracing():  # tolist() would sync a GPU, break a graph
            return None
        positions = None if position_offsets is None else \
            self._positions(ids.shape[1], self._cache.length, position_offsets, ids.device).tolist()
        out = self.decode_step(ids[0].tolist(), last_only, logits_from, rows, positions, tree_mask)
        return None if out is None else (out[0][None], out[1][None])

    def decode_step(self, tokens: list[int], last_only: bool = False, logits_from: int = 0,
                    rows: int | None = None, positions: list[int] | None = None,
                    tree_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """forward's result for a block of token ids at the cache's end ([n, V] logits, [T, H] hidden) from one
        kernel call (cpu_kernels.run_forward: embedding, layers, final norm and lm_head of a bf16 model on the CPU),
        without forward's tensor reshaping, or None where it does not apply (forward's other paths then run). The
        block is causal, or a draft tree's: its rows' absolute ``positions`` and ``tree_mask`` as forward takes it.
        Each torch op costs tens of microseconds here: the forward's weight stream leaves their code cold."""
        cache, t = self._cache, len(tokens)
        kept = self.__dict__.get("_forward_args")  # this generation's ForwardArgs (cpu_kernels.SpanKept)
        if kept is not None and rows is None and t > 0 and kept.current(cache) \
                and not torch.is_grad_enabled() and "_static_runner" not in self.__dict__ \
                and t <= cpu_kernels.step_rows(cache.length) \
                and cache.length + t <= cache.max_seq_len:
            return self._one_call(kept.value, tokens, last_only, logits_from, positions, tree_mask)
        emb, lm, norm = self.embed_tokens.weight, self.lm_head, self.norm
        if cache is None or t == 0 or "_static_runner" in self.__dict__ or type(lm) is not Linear \
                or lm.bias is not None or not (emb.dtype == lm.weight.dtype == norm.weight.dtype == torch.bfloat16) \
                or not (emb.is_cpu and emb.is_contiguous() and lm.weight.is_contiguous()):
            return None
        start = cache.length
        self._check_block(1, t, start, tree_mask, diagonal=False)
        rows = cpu_kernels.rows_limit(start, tree_mask is not None) if rows is None else rows
        block = cpu_kernels.layer_block(list(self.layers), cache, torch.bfloat16, t, self.inv_freq, rows)
        if block is None:
            return None
        args = cpu_kernels.ForwardArgs(block, emb, norm, lm.weight, cache)
        if cpu_kernels.frozen_scope() and tree_mask is None:  # weights and cache stay put through the span
            self.__dict__["_forward_args"] = cpu_kernels.SpanKept(cache, args)
        return self._one_call(args, tokens, last_only, logits_from, positions, tree_mask)

    def _one_call(self, args, tokens: list[int], last_only: bool, logits_from: int,
                  positions: list[int] | None = None, tree_mask: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """decode_step's block on checked arguments (those kept for this weights_frozen span hold through it: a
        kept call checks only the cache's room and the block's rows; a draft tree's mask and positions the kernel
        checks itself, refusing with the checked path's codes)."""
        cache, t = self._cache, len(tokens)
        start, first = cache.length, t - 1 if last_only else min(logits_from, t - 1)
        logits, hidden = cpu_kernels.run_forward(args, tokens, start, first, positions, tree_mask)
        cache.length = start + t
        return logits, (hidden[-1:] if last_only and t > 1 else hidden)

    def _embed(self, ids: torch.Tensor, features: torch.Tensor | None) -> torch.Tensor:
        """ids [B, T] -> layer input [B, T, H] in the compute dtype."""
        return self.embed_tokens(ids.to(self.embed_tokens.weight.device)).to(self._compute_dtype())

    def _out(self, x: torch.Tensor, last_only: bool, logits_from: int = 0,
             max_rows: int = cpu_kernels.MAX_ROWS) -> tuple[torch.Tensor, torch.Tensor]:
        """Last layer's output [B, T, H] -> (logits [B, T - logits_from, V] float32, final-norm'd hidden [B, T, H])
        (last_only: the last row of each). ``max_rows``: the forward's cpu_kernels.rows_limit."""
        hidden = cpu_kernels.final_norm(x, self.norm)  # a bf16 model on the CPU: as run_forward normalises
        hidden = self.norm(x) if hidden is None else hidden  # [B, T, H]
        if last_only:
            hidden = hidden[:, -1:]
        rows = hidden[:, min(logits_from, hidden.shape[1] - 1):] if logits_from > 0 else hidden
        head = self.lm_head
        if type(head) is Linear:
            return cpu_kernels.linear(rows, head.weight, head.bias, max_rows, fp32_out=True), hidden
        return head(rows).float(), hidden

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu") -> Transformer:
        """Load a Hugging Face folder (config.json + model.safetensors or a sharded index).

        A folder whose config carries a GPTQ ``quantization_config`` (4-bit) loads with Int4Linear layers
        (see :func:`polyspec.decode.int4.load_int4`). Unsupported model types raise PolyspecError.
        """
        path = Path(path)
        cfg = read_hf_config(path)
        if cfg.get("quantization_config"):
            from polyspec.decode.int4 import load_int4

            return load_int4(path, dtype=dtype, device=device)
        args = ModelArgs.from_hf_config(cfg)
        tensors = load_safetensors_dir(path)
        model = build_from_state(args, tensors, dtype=dtype, device=device)
        return model


def _as_batch(input_ids: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """[T] or [B, T] -> ([B, T] long, whether outputs are squeezed to [T, ...])."""
    ids = torch.as_tensor(input_ids).long()
    if ids.dim() == 1:
        return ids[None], True
    if ids.dim() == 2:
        return ids, ids.shape[0] == 1
    raise PolyspecError(f"input_ids must be [T] or [B, T], got shape {list(ids.shape)}")


# ----------------------------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------------------------


def read_hf_config(path: Path) -> dict[str, Any]:
    cfg_path = Path(path) / "config.json"
    if not cfg_path.is_file():
        raise PolyspecError(f"{path} has no config.json; point to a Hugging Face model folder")
    return read_json_object(cfg_path)


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON object file; anything else (bad JSON, bytes that are not UTF-8, a list) is a PolyspecError naming it."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PolyspecError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise PolyspecError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def load_safetensors_dir(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of model.safetensors, or of the shards listed in model.safetensors.index.json (no pickles)."""
    from polyspec.weights import load_safetensors

    path = Path(path)
    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    if single.is_file():
        return load_safetensors(single)
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map", {})
        tensors: dict[str, torch.Tensor] = {}
        for shard in sorted(set(weight_map.values())):
            shard_path = path / str(shard)
            if not shard_path.resolve().is_relative_to(path.resolve()) or not str(shard).endswith(".safetensors"):
                raise PolyspecError(f"{index} names shard {shard!r} outside {path} (or not a .safetensors file); an "
                                    "index may only name safetensors shards inside its own folder")
            if not shard_path.is_file():
                raise PolyspecError(f"{index} lists shard {shard} but {shard_path} does not exist")
            tensors.update(load_safetensors(shard_path))
        return tensors
    raise PolyspecError(
        f"{path} has neither model.safetensors nor model.safetensors.index.json; polyspec loads safetensors only "
        "(convert .bin checkpoints with transformers' save_pretrained(safe_serialization=True))"
    )


def hf_to_local_name(name: str) -> str | None:
    """Hugging Face parameter name -> ours (None for tensors we do not use, such as rotary inv_freq)."""
    if name.endswith("rotary_emb.inv_freq"):
        return None
    return name[len("model."):] if name.startswith("model.") else name


def build_from_state(args: ModelArgs, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
                     device: str | torch.device, model: nn.Module | None = None) -> Transformer:
    """Build a Transformer on the meta device and assign the HF-named ``tensors`` (cast to ``dtype``)."""
    if model is None:
        with torch.device("meta"):
            model = Transformer(args)
    state = {}
    for name, t in tensors.items():
        local = hf_to_local_name(name)
        if local is not None:
            state[local] = t.to(dtype) if t.is_floating_point() else t
    if args.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    # Still-empty (meta) entries are what the checkpoint must provide; pre-built layers (Int4Linear) are not.
    expected = {k for k, v in model.state_dict().items() if v.is_meta}
    if args.tie_word_embeddings:
        expected.discard("lm_head.weight")
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise PolyspecError(
            f"checkpoint does not match a {args.model_type} model with {args.num_layers} layers: "
            f"missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
            f"unexpected {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}"
        )
    model.load_state_dict(state, strict=False, assign=True)
    if args.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.inv_freq = rope_inv_freq(args)
    return model.to(device).eval()
