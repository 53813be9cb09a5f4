"""The levels of a chain: what :class:`polyspec.decode.chain.ChainDecoder` needs from a model, and adapters.

A level is a causal next-token model with a rollback-able cache, addressed in *sequence positions*: position p holds
token x_p of (prompt + generated tokens). ``forward(tokens, start_pos)`` first rolls the cache back to ``start_pos``
positions, then appends ``tokens`` at positions start_pos.., and returns logits row j = next-token logits after token
start_pos + j, plus the level's hidden state per row (the feature an EAGLE head reads), or None.

A level with ``needs_features`` (an EAGLE head) also takes ``features`` [T, H]: row j is the feature of position
start_pos + j - 1, i.e. the hidden state of a level above at the token *before* tokens[j] (EAGLE pairs token x_{t+1}
with feature f_t). Such a level is never asked for position 0 (there is no feature before it): its first input is
x_1 paired with f_0, so its cache holds one entry fewer than the sequence positions it has processed.

Tree decoding (EAGLE-2) needs two optional methods. ``forward_tree(tokens, positions, mask, features=None)`` appends
``tokens`` [T] after everything cached (no rollback) at absolute sequence ``positions`` [T], where ``mask`` bool
[T, K + T] says which of the last K cached entries and which block tokens each token sees (all entries before those
are visible): the draft uses it to expand a tree one depth per forward, the level above it to verify a whole tree in
one forward. ``compact(src_positions, dst_start)`` keeps the cache entries at sequence positions ``src_positions``
(the accepted path of a verified tree) at ``dst_start ..``; a level without it is truncated and recomputes instead.

Adapters: :class:`ModelLevel` over ``polyspec.decode.model.Transformer`` (target, int4 copy, or any plain draft),
:class:`HeadLevel` over ``polyspec.decode.head.EagleHead`` or ``polyspec.decode.head3.Eagle3Head`` (whose levels above
return the head's fused auxiliary features as their hidden state: :meth:`ModelLevel.feed_aux`). :class:`TableLevel` is a tiny deterministic n-gram level for
tests and demos (exact distributions are computable by hand).
"""

from __future__ import annotations

import functools
import inspect
from typing import Protocol, runtime_checkable

import torch

from polyspec.errors import PolyspecError


def _inference(fn):
    """torch.inference_mode() around a level's forward unless it is on already (a decoder's generate turns it on
    once): entering it costs ~60 us after a forward's weight stream has left its code cold, on every forward."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if torch.is_inference_mode_enabled():
            return fn(*args, **kwargs)
        with torch.inference_mode():
            return fn(*args, **kwargs)

    return wrapper


@runtime_checkable
class Level(Protocol):
    """One model of the chain (see the module docstring for positions and features)."""

    name: str
    kind: str  # "model", "head", "table", ...
    needs_features: bool

    @property
    def cache_len(self) -> int:
        """Sequence positions the cache holds."""
        ...

    def setup(self, max_seq_len: int) -> None:
        """Allocate a cache for up to ``max_seq_len`` sequence positions (and reset it)."""
        ...

    def reset(self) -> None:
        """Empty the cache (O(1))."""
        ...

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` sequence positions of the cache (O(1) rollback); 0 <= n <= cache_len."""
        ...

    def forward(self, tokens: list[int], start_pos: int, features: torch.Tensor | None = None, *,
                last_only: bool = False, logit_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """truncate(start_pos), then append ``tokens`` [T]; returns (logits [T, V], hidden [T, H] or None).

        last_only: only the last row of logits and hidden is needed ([1, V], [1, H]); a level may still return all.
        logit_rows: only the last ``logit_rows`` rows of logits are needed (hidden: every row); None: all. A level may
        still return more.
        """
        ...


def _accepts(fn, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


class ModelLevel:
    """A ``polyspec.decode.model.Transformer`` (or anything with its cache API and forward) as a chain level."""

    kind = "model"
    needs_features = False

    def __init__(self, transformer, name: str = "model"):
        for attr in ("setup_cache", "truncate", "reset", "forward"):
            if not hasattr(transformer, attr):
                raise PolyspecError(f"ModelLevel {name!r}: {type(transformer).__name__} has no {attr}(); pass a "
                                    "polyspec.decode.model.Transformer")
        self.model = transformer
        self.name = name
        self._last_only = _accepts(transformer.forward, "last_only")
        self._logits_from = _accepts(transformer.forward, "logits_from")
        self._aux: tuple[tuple[int, ...], object] | None = None  # feed_aux: (layer ids, fuse) for an EAGLE-3 draft

    def feed_aux(self, aux_layers: list[int] | None, fuse=None) -> None:
        """Return ``fuse(concat of these layers' outputs)`` as the hidden state from now on (the feature an EAGLE-3
        head below reads, H wide); None: the final-norm'd hidden again. Set by the ChainDecoder for its draft."""
        if aux_layers and not _accepts(self.model.forward, "aux_layers"):
            raise PolyspecError(f"level {self.name!r} cannot return auxiliary layer states, so it cannot feed an "
                                "EAGLE-3 head; use polyspec's Transformer for the levels above the head")
        self._aux = (tuple(aux_layers), fuse) if aux_layers else None

    def _run(self, ids: torch.Tensor, **kw) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self._aux is None:
            return self.model.forward(ids, **kw)
        layers, fuse = self._aux
        logits, aux = self.model.forward(ids, aux_layers=layers, **kw)  # aux [T, A H]
        return logits, fuse(aux)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def cache_len(self) -> int:
        return int(self.model.cache_len)

    def setup(self, max_seq_len: int) -> None:
        self.model.setup_cache(max_seq_len)

    def reset(self) -> None:
        self.model.reset()

    def truncate(self, n: int) -> None:
        self.model.truncate(n)

    @_inference
    def forward(self, tokens: list[int], start_pos: int, features: torch.Tensor | None = None, *,
                last_only: bool = False, logit_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.model.truncate(start_pos)
        kw = {}
        if self._logits_from and logit_rows is not None and logit_rows < len(tokens):
            kw["logits_from"] = len(tokens) - logit_rows
        step = getattr(self.model, "decode_step", None) if self._aux is None else None
        out = step(tokens, last_only, **kw) if step is not None else None
        if out is not None:
            return out
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)  # [T]
        if self._last_only:
            return self._run(ids, last_only=last_only, **kw)
        return self._run(ids, **kw)

    @_inference
    def forward_tree(self, tokens: list[int], positions: list[int], mask: torch.Tensor,
                     features: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        step = getattr(self.model, "decode_step", None) if self._aux is None else None
        out = step(tokens, positions=positions, tree_mask=mask) if step is not None else None
        if out is not None:
            return out
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)  # [T]
        offsets = torch.tensor(positions, dtype=torch.long) - self.model.cache_len  # [T]
        return self._run(ids, tree_mask=mask, position_offsets=offsets)

    def compact(self, src_positions: list[int], dst_start: int) -> None:
        self.model.compact(src_positions, dst_start)


class HeadLevel:
    """A ``polyspec.decode.head.EagleHead`` as a chain level: head cache position t holds (x_{t+1}, f_t), so sequence
    position p maps to head position p - 1 and ``features[j]`` is f_{start_pos + j - 1}."""

    kind = "head"
    needs_features = True

    def __init__(self, head, name: str = "head"):
        for attr in ("setup_cache", "truncate", "reset", "forward"):
            if not hasattr(head, attr):
                raise PolyspecError(f"HeadLevel {name!r}: {type(head).__name__} has no {attr}(); pass a "
                                    "polyspec.decode.head.EagleHead")
        self.head = head
        self.name = name
        self._last_only = _accepts(head.forward, "last_only")

    @property
    def aux_layers(self) -> list[int] | None:
        """The target layers an EAGLE-3 head reads (the levels above must return them: ModelLevel.feed_aux);
        None for an EAGLE-1/2 head, which reads the final-norm'd hidden state."""
        return getattr(self.head, "aux_layers", None)

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """An EAGLE-3 head's fc: aux concatenation [T, A H] -> feature [T, H]."""
        return self.head.fuse(aux)

    @property
    def device(self) -> torch.device:
        return next(self.head.parameters()).device

    @property
    def cache_len(self) -> int:
        # Position 0 needs no cache entry, so a head that holds n entries has processed n + 1 sequence positions.
        n = int(self.head.cache_len)
        return n + 1 if n else 0

    def setup(self, max_seq_len: int) -> None:
        self.head.setup_cache(max_seq_len)

    def reset(self) -> None:
        self.head.reset()

    def truncate(self, n: int) -> None:
        self.head.truncate(max(n - 1, 0))

    @_inference
    def forward(self, tokens: list[int], start_pos: int, features: torch.Tensor | None = None, *,
                last_only: bool = False, logit_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        if start_pos < 1:
            raise PolyspecError(f"HeadLevel {self.name!r}: an EAGLE head cannot process position 0 (no feature "
                                "precedes it); start at position 1")
        if features is None or features.shape[0] != len(tokens):
            got = None if features is None else list(features.shape)
            raise PolyspecError(f"HeadLevel {self.name!r}: needs one feature row per token ({len(tokens)}), got {got}")
        self.head.truncate(start_pos - 1)
        step = getattr(self.head, "decode_step", None)
        out = step(tokens, features, last_only) if step is not None else None
        if out is not None:
            return out
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)  # [T]
        w = next(self.head.parameters())
        feats = features.to(device=w.device, dtype=w.dtype)  # [T, H]
        if self._last_only:
            return self.head.forward(ids, feats, last_only=last_only)
        return self.head.forward(ids, feats)

    @_inference
    def forward_tree(self, tokens: list[int], positions: list[int], mask: torch.Tensor,
                     features: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        if features is None or features.shape[0] != len(tokens):
            got = None if features is None else list(features.shape)
            raise PolyspecError(f"HeadLevel {self.name!r}: needs one feature row per token ({len(tokens)}), got {got}")
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)  # [T]
        w = next(self.head.parameters())
        # Head position of the input at sequence position p is p - 1 (see the class docstring).
        offsets = torch.tensor(positions, dtype=torch.long) - 1 - self.head.cache_len  # [T]
        return self.head.forward(ids, features.to(device=w.device, dtype=w.dtype), tree_mask=mask,
                                 position_offsets=offsets)


class TokenCache:
    """The "cache" of a level without a model (TableLevel): the list of tokens processed, by
    position, checked and rolled back like a KV cache."""

    name: str

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.max_seq_len = 0

    @property
    def cache_len(self) -> int:
        return len(self.tokens)

    def setup(self, max_seq_len: int) -> None:
        self.max_seq_len = max_seq_len
        self.tokens = []

    def reset(self) -> None:
        self.tokens = []

    def truncate(self, n: int) -> None:
        if not 0 <= n <= len(self.tokens):
            raise PolyspecError(f"{type(self).__name__} {self.name!r}: truncate({n}) outside 0..{len(self.tokens)}")
        del self.tokens[n:]

    def _check_room(self, more: int) -> None:
        if len(self.tokens) + more > self.max_seq_len:
            raise PolyspecError(f"{type(self).__name__} {self.name!r}: {len(self.tokens) + more} positions exceed "
                                f"max_seq_len {self.max_seq_len}")


class TableLevel(TokenCache):
    """A deterministic n-gram level: the next-token logits after position p are ``table[index]`` where index encodes
    the last ``order`` tokens (x_{p-order+1} .. x_p, missing ones before the sequence start count as 0) in base V.

    table: [V ** order, V] logits. Its hidden state at position p is that logits row (H = V), so it can feed a
    feature-reading level in tests. Its "cache" is the list of tokens processed, checked on every call like a KV cache.
    """

    kind = "table"
    needs_features = False

    def __init__(self, table: torch.Tensor, name: str = "table", order: int = 1):
        v = table.shape[-1]
        if table.dim() != 2 or table.shape[0] != v ** order:
            raise PolyspecError(f"TableLevel {name!r}: table must be [V**order, V] = [{v ** order}, {v}], "
                                f"got {list(table.shape)}")
        super().__init__()
        self.table = table.float()
        self.name = name
        self.order = order
        self.vocab_size = v
        self.forward_calls = 0

    def next_logits(self, context: list[int]) -> torch.Tensor:
        """Next-token logits [V] after ``context`` (a pure function of its last ``order`` tokens)."""
        idx = 0
        for t in ([0] * self.order + list(context))[-self.order:]:
            idx = idx * self.vocab_size + int(t)
        return self.table[idx]

    def forward_tree(self, tokens: list[int], positions: list[int], mask: torch.Tensor,
                     features: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        t = len(tokens)
        k = mask.shape[1] - t  # mask columns: the last k cached entries, then the block
        if mask.shape[0] != t or not 0 <= k <= len(self.tokens):
            raise PolyspecError(f"TableLevel {self.name!r}: mask {list(mask.shape)} does not fit {t} tokens over a "
                                f"cache of {len(self.tokens)}")
        self._check_room(t)
        self.forward_calls += 1
        base = len(self.tokens) - k
        keys = self.tokens[base:] + [int(x) for x in tokens]  # what the mask columns refer to
        visible = mask.tolist()  # [T][K + T], read once
        rows = [self.next_logits(self.tokens[:base] + [keys[c] for c in range(k + t) if visible[j][c]])
                for j in range(t)]
        self.tokens += [int(x) for x in tokens]
        logits = torch.stack(rows)  # [T, V]
        return logits, logits.clone()

    def compact(self, src_positions: list[int], dst_start: int) -> None:
        kept = [self.tokens[int(p)] for p in src_positions]
        self.tokens = self.tokens[:dst_start] + kept

    def forward(self, tokens: list[int], start_pos: int, features: torch.Tensor | None = None, *,
                last_only: bool = False, logit_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.truncate(start_pos)
        self._check_room(len(tokens))
        self.forward_calls += 1
        rows = []
        for t in tokens:
            self.tokens.append(int(t))
            rows.append(self.next_logits(self.tokens))
        logits = torch.stack(rows)  # [T, V]
        return logits, logits.clone()
