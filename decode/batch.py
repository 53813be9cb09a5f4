"""Batched generation with polyspec's engine: B prompts of different lengths prefilled and decoded together.

Used where throughput matters more than latency (the target answering training conversations, data/regen.py). The
prompts are left-padded to one length so that every row writes its K/V at the same cache slot; each row then gets

- a key padding mask: a query sees the cached positions of its own row from its first real token on (causally), and
  a padding query sees only itself (so no softmax row is empty and nothing becomes NaN);
- its own RoPE positions (slot - padding of that row), so a row's real tokens sit at 0, 1, 2, ... exactly as in a
  batch-1 run.

This runs the model's layers through their reference torch forward (``DecoderLayer(x, cos, sin, mask, cache,
layer_idx, start)`` with a [B, 1, T, S] bool mask and [B, 1, T, D] cos/sin, which broadcast against the [B, heads,
T, D] queries and keys); the fused C++ layer kernel is batch-1 only, its per-matrix linear kernel still applies.
Rows that reach an end-of-sequence token are dropped from the batch (their cache rows too), so they stop costing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from polyspec.errors import PolyspecError


@dataclass
class RowResult:
    """One prompt's answer: the new tokens (the end-of-sequence token included when one ended it)."""

    token_ids: list[int]
    stopped_at_eos: bool


def _row_mask(valid: torch.Tensor, start: int, t: int) -> torch.Tensor:
    """Bool mask [B, 1, T, start + T]: query i (slot start + i) sees the valid keys at slots <= its own, and itself.

    valid: [B, S] bool, True where a slot holds a real (not padding) token of that row.
    """
    end = start + t
    slots = torch.arange(end, device=valid.device)
    query_slots = torch.arange(start, end, device=valid.device)
    causal = slots[None, :] <= query_slots[:, None]  # [T, end]
    mask = causal[None] & valid[:, None, :end]  # [B, T, end]
    mask |= slots[None, None, :] == query_slots[None, :, None]  # every query sees itself
    return mask[:, None]


def _step(model, cache, ids: torch.Tensor, valid: torch.Tensor, pads: torch.Tensor) -> torch.Tensor:
    """Run ids [B, T] at slots cache.length.. through ``model``'s layers; returns last-position logits [B, V] fp32."""
    from polyspec.decode.model import rope_cos_sin

    b, t = ids.shape
    start = cache.length
    x = model._embed(ids, None)  # [B, T, H]
    positions = (torch.arange(start, start + t, device=ids.device)[None, :] - pads[:, None]).clamp_min(0)  # [B, T]
    cos, sin = rope_cos_sin(model.inv_freq, positions.flatten(), x.dtype)  # [B * T, D]
    cos, sin = cos.view(b, 1, t, -1), sin.view(b, 1, t, -1)  # [B, 1, T, D]
    mask = _row_mask(valid, start, t)
    for i, layer in enumerate(model.layers):
        x = layer(x, cos, sin, mask, cache, i, start)
    cache.length = start + t
    logits, _ = model._out(x, True)  # [B, 1, V]
    return logits[:, 0]


def _pick(logits: torch.Tensor, temperature: float, generators: list[torch.Generator] | None) -> torch.Tensor:
    """Next token per row [B] from logits [B, V]: argmax at temperature 0, else one draw per row's generator."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1).cpu()  # [B, V]; drawn on the CPU generators
    picks = [torch.multinomial(probs[r], 1, generator=generators[r])[0] for r in range(len(probs))]
    return torch.stack(picks).to(logits.device)


def _keep_rows(cache, keep: torch.Tensor) -> None:
    """Shrink the cache to the rows ``keep`` (indices [B'])."""
    for store in (cache.k, cache.v):
        for layer in range(len(store)):
            store[layer] = store[layer].index_select(0, keep)
    cache.batch_size = int(keep.numel())


def _check(model, prompts: list[list[int]], max_new_tokens: int, temperature: float, generators) -> None:
    from polyspec.decode.model import Transformer

    if not isinstance(model, Transformer):
        raise PolyspecError(f"batched generation needs a model on polyspec's engine, got {type(model).__name__}; "
                            "use an OpenAI-compatible endpoint for models that run on transformers")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise PolyspecError("batched generation needs at least one prompt and no empty prompt")
    if max_new_tokens < 1:
        raise PolyspecError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature > 0 and (generators is None or len(generators) != len(prompts)):
        raise PolyspecError("sampling (temperature > 0) needs one torch.Generator per prompt")


@torch.inference_mode()
def generate_batch(model, prompts: list[list[int]], *, max_new_tokens: int, eos_token_ids: set[int],
                   temperature: float = 0.0, generators: list[torch.Generator] | None = None,
                   pad_id: int = 0) -> list[RowResult]:
    """Answer every prompt (token ids) together; greedy rows equal their batch-1 ``ar`` output token for token.

    A row ends at a token in ``eos_token_ids`` (kept in its output) or after ``max_new_tokens`` tokens. At
    temperature > 0 row r draws from ``generators[r]``, so its tokens do not depend on the other rows.
    """
    from polyspec.decode.model import StaticKVCache

    _check(model, prompts, max_new_tokens, temperature, generators)
    a, device = model.args, model.inv_freq.device
    b, width = len(prompts), max(len(p) for p in prompts)
    pads = torch.tensor([width - len(p) for p in prompts], device=device)  # [B]
    ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in prompts], device=device)  # [B, width]
    slots = width + max_new_tokens
    valid = torch.arange(slots, device=device)[None, :] >= pads[:, None]  # [B, slots]
    cache = StaticKVCache(a.num_layers, b, a.num_kv_heads, slots, a.head_dim, model._compute_dtype(), device)
    out: list[list[int]] = [[] for _ in prompts]
    eos = [False] * b
    rows = list(range(b))  # original index of each live cache row
    gens = list(generators) if generators is not None else None
    logits = _step(model, cache, ids, valid, pads)  # [B, V]
    for _ in range(max_new_tokens):
        nxt = _pick(logits, temperature, gens).tolist()  # [B']
        keep = []
        for r, tok in enumerate(nxt):
            out[rows[r]].append(int(tok))
            if int(tok) in eos_token_ids:
                eos[rows[r]] = True
            elif len(out[rows[r]]) < max_new_tokens:
                keep.append(r)
        if not keep:
            break
        if len(keep) < len(rows):  # finished rows leave the batch
            idx = torch.tensor(keep, device=device)
            _keep_rows(cache, idx)
            valid, pads = valid.index_select(0, idx), pads.index_select(0, idx)
            nxt = [nxt[r] for r in keep]
            rows = [rows[r] for r in keep]
            gens = [gens[r] for r in keep] if gens is not None else None
        logits = _step(model, cache, torch.tensor(nxt, device=device)[:, None], valid, pads)
    return [RowResult(token_ids=o, stopped_at_eos=e) for o, e in zip(out, eos, strict=True)]
