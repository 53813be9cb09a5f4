"""Batched generation with polyspec's engine: many prompts answered ``batch_size`` rows at a time, each row refilled
with the next prompt as soon as its answer ends (continuous batching).

Used where throughput matters more than latency (the target answering training conversations, data/regen.py). Every
cache row holds one prompt's tokens at slots 0, 1, 2, ... (its RoPE positions), so nothing is padded:

- a new prompt is prefilled alone (batch 1, only its own tokens) into the row it takes;
- a decode step runs every live row's next token at once; row r writes its K/V at its own slot ``pos[r]`` and its
  query sees slots 0..pos[r] of its own row (a [B, 1, 1, S] key mask), so a row's earlier occupant is never read;
- a row whose answer ended takes the next prompt; when none is left it leaves the batch (its cache row too).

The batch therefore stays full until the prompts run out, instead of draining to its longest answer while padding
to its longest prompt. Layers run through their reference torch forward (``DecoderLayer(x, cos, sin, mask, cache,
layer_idx, start)`` with [B, 1, 1, D] cos/sin); the fused C++ layer kernel is batch-1 only, its per-matrix linear
kernel still applies. Greedy rows equal their batch-1 ``ar`` output in float32 (tests/test_batch.py); at temperature
> 0 each row draws from its own generator, so its tokens do not depend on its neighbours.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from polyspec.errors import PolyspecError


@dataclass
class RowResult:
    """One prompt's answer: the new tokens (the end-of-sequence token included when one ended it)."""

    token_ids: list[int]
    stopped_at_eos: bool


class RowKVCache:
    """Per-layer K/V [B, kv_heads, S, head_dim] where row r holds its prompt's positions at slots 0..pos[r].

    :meth:`store` is what a :class:`polyspec.decode.model.DecoderLayer` calls in a decode step (one token per row,
    written at that row's slot); :meth:`row` is the batch-1 store that prefills one row."""

    def __init__(self, num_layers: int, batch_size: int, kv_heads: int, slots: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (batch_size, kv_heads, slots, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.pos = torch.zeros(batch_size, dtype=torch.long, device=device)  # the slot each row writes next

    def store(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k/v [B, kv, 1, D]: row r's at slot pos[r]; returns every slot of every row (the decode step's mask hides
        the ones past each row's own position). All S slots, not the used prefix: a slice of the slot dimension is
        not dense, and the batched matmul copies it first (2.6x the time at B = 64, 500 of 564 slots)."""
        rows = torch.arange(k.shape[0], device=k.device)
        self.k[layer][rows, :, self.pos] = k[:, :, 0]
        self.v[layer][rows, :, self.pos] = v[:, :, 0]
        return self.k[layer], self.v[layer]

    def row(self, r: int) -> _RowStore:
        return _RowStore(self, r)

    def keep(self, rows: torch.Tensor) -> None:
        """Shrink the cache to ``rows`` (indices [B'])."""
        for store in (self.k, self.v):
            for layer in range(len(store)):
                store[layer] = store[layer].index_select(0, rows)
        self.pos = self.pos.index_select(0, rows)


class _RowStore:
    """Row r of a :class:`RowKVCache` as a batch-1 store: a block of T tokens written at slots start..start+T-1."""

    def __init__(self, cache: RowKVCache, r: int):
        self.cache, self.r = cache, r

    def store(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end, r = start + k.shape[2], self.r
        self.cache.k[layer][r:r + 1, :, start:end] = k
        self.cache.v[layer][r:r + 1, :, start:end] = v
        return self.cache.k[layer][r:r + 1, :, :end], self.cache.v[layer][r:r + 1, :, :end]


def _run_layers(model, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, store) -> torch.Tensor:
    """ids [B, T] at RoPE positions [B, T] through ``model``'s layers; returns last-position logits [B, V] fp32."""
    from polyspec.decode.model import rope_cos_sin

    b, t = ids.shape
    x = model._embed(ids, None)  # [B, T, H]
    cos, sin = rope_cos_sin(model.inv_freq, positions.flatten(), x.dtype)  # [B * T, D]
    cos, sin = cos.view(b, 1, t, -1), sin.view(b, 1, t, -1)  # [B, 1, T, D]
    for i, layer in enumerate(model.layers):
        x = layer(x, cos, sin, mask, store, i, 0)
    logits, _ = model._out(x, True)  # [B, 1, V]
    return logits[:, 0]


def _prefill(model, cache: RowKVCache, r: int, prompt: Sequence[int]) -> torch.Tensor:
    """Prompt into row r alone (slots 0..len-1); returns its last logits [1, V]."""
    device = model.inv_freq.device
    t = len(prompt)
    mask = torch.ones(t, t, dtype=torch.bool, device=device).tril()  # [T, T]: causal within the prompt
    positions = torch.arange(t, device=device)[None]
    cache.pos[r] = t
    return _run_layers(model, torch.tensor([list(prompt)], device=device), positions, mask, cache.row(r))


def _decode(model, cache: RowKVCache, ids: torch.Tensor) -> torch.Tensor:
    """Every row's next token ids [B] at its own slot; returns logits [B, V]."""
    pos = cache.pos
    mask = torch.arange(cache.k[0].shape[2], device=pos.device)[None, :] <= pos[:, None]  # [B, S]: own slots so far
    logits = _run_layers(model, ids[:, None], pos[:, None], mask[:, None, None, :], cache)
    cache.pos = pos + 1
    return logits


def _pick(logits: torch.Tensor, temperature: float, generators: list[torch.Generator] | None) -> torch.Tensor:
    """Next token per row [B] from logits [B, V]: argmax at temperature 0, else one draw per row's generator."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1).cpu()  # [B, V]; drawn on the CPU generators
    picks = [torch.multinomial(probs[r], 1, generator=generators[r])[0] for r in range(len(probs))]
    return torch.stack(picks).to(logits.device)


def _check(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float, generators,
           batch_size: int | None) -> None:
    from polyspec.decode.model import Transformer

    if not isinstance(model, Transformer):
        raise PolyspecError(f"batched generation needs a model on polyspec's engine, got {type(model).__name__}; "
                            "use an OpenAI-compatible endpoint for models that run on transformers")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise PolyspecError("batched generation needs at least one prompt and no empty prompt")
    if max_new_tokens < 1:
        raise PolyspecError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if batch_size is not None and batch_size < 1:
        raise PolyspecError(f"batch_size must be >= 1, got {batch_size}")
    if temperature > 0 and (generators is None or len(generators) != len(prompts)):
        raise PolyspecError("sampling (temperature > 0) needs one torch.Generator per prompt")


@torch.inference_mode()
def generate_batch(model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, eos_token_ids: set[int],
                   temperature: float = 0.0, generators: list[torch.Generator] | None = None,
                   batch_size: int | None = None, on_done: Callable[[int, int], None] | None = None
                   ) -> list[RowResult]:
    """Answer every prompt (token ids), ``batch_size`` rows at a time (None: all at once), each freed row refilled
    with the next prompt in order. Greedy rows equal their batch-1 ``ar`` output token for token.

    A row ends at a token in ``eos_token_ids`` (kept in its output) or after ``max_new_tokens`` tokens; then
    ``on_done(prompt index, tokens)`` is called. At temperature > 0 prompt i draws from ``generators[i]``.
    """
    _check(model, prompts, max_new_tokens, temperature, generators, batch_size)
    n = len(prompts)
    b = min(batch_size or n, n)
    a, device = model.args, model.inv_freq.device
    slots = max(len(p) for p in prompts) + max_new_tokens
    cache = RowKVCache(a.num_layers, b, a.num_kv_heads, slots, a.head_dim, model._compute_dtype(), device)
    out: list[list[int]] = [[] for _ in prompts]
    eos = [False] * n
    waiting = iter(range(n))
    rows: list[int | None] = [None] * b  # the prompt each cache row answers (None: free, nothing left to take)
    nxt = [0] * b  # the token each row feeds next

    def goes_on(i: int, tok: int) -> bool:
        out[i].append(tok)
        eos[i] = tok in eos_token_ids
        if eos[i] or len(out[i]) >= max_new_tokens:
            if on_done is not None:
                on_done(i, len(out[i]))
            return False
        return True

    def fill(r: int) -> None:  # row r takes the next prompt that goes on past its first token
        rows[r] = None
        for i in waiting:
            gen = [generators[i]] if generators is not None else None
            tok = int(_pick(_prefill(model, cache, r, prompts[i]), temperature, gen)[0])
            if goes_on(i, tok):
                rows[r], nxt[r] = i, tok
                return

    for r in range(b):
        fill(r)
    while True:
        live = [r for r, i in enumerate(rows) if i is not None]
        if len(live) < len(rows):  # nothing left to take: finished rows leave the batch
            cache.keep(torch.tensor(live, dtype=torch.long, device=device))
            rows, nxt = [rows[r] for r in live], [nxt[r] for r in live]
        if not rows:
            break
        gens = [generators[i] for i in rows] if generators is not None else None
        toks = _pick(_decode(model, cache, torch.tensor(nxt, device=device)), temperature, gens).tolist()
        for r, tok in enumerate(toks):
            if goes_on(rows[r], int(tok)):
                nxt[r] = int(tok)
            else:
                fill(r)
    return [RowResult(token_ids=o, stopped_at_eos=e) for o, e in zip(out, eos, strict=True)]
