"""Static-shape decode and verify steps, replayed as CUDA graphs on a GPU.

A decode step of a 7B model at batch 1 launches some 500 small kernels; on a GPU the launch overhead alone is a large
share of the step. Capturing the step once as a CUDA graph and replaying it removes that overhead, but a graph fixes
every tensor address and shape. :class:`StaticRunner` therefore runs a forward of T <= ``max_width`` tokens as a
*static* step of width W (the next bucket >= T, see :data:`BUCKETS`):

* token ids, RoPE positions, features and the attention mask live in pre-allocated buffers; rows T..W-1 are padding
  (token 0 at the positions after the block, each seeing only itself) whose outputs are dropped;
* K/V are written with ``index_copy_`` at the positions held in a tensor, and attention reads the *whole* cache
  (its physical length, ``max_seq_len + max_width``) under a bool mask [W, S] that hides everything not yet valid:
  no shape depends on the cache length;
* RoPE cos/sin come from a table over every cache position, gathered by the position tensor.

Each layer of the step is the model's own :class:`~polyspec.decode.model.DecoderLayer` (the one reference definition
of the maths), called with a :class:`LayerSlots` as its KV store and the static mask.

The same static step runs eagerly on any device (``graphs=False``): that is the pure-torch path the tests compare
with the model's own forward on the CPU. With ``graphs=True`` (CUDA only) each width bucket is captured on first use
(after two warm-up runs on a side stream, which also build the int4 kernels' packed weights) and replayed afterwards.
Graphs are dropped whenever the cache is re-allocated or the model is moved or cast.

With ``compiled=True`` (the default on CUDA, ``POLYSPEC_COMPILE_STEP=0`` turns it off) the step runs through
``torch.compile`` layer by layer with the projections fused (:func:`compiled_layer_step`); the graph then captures the compiled code.

Prefill blocks wider than ``max_width``, batches > 1, autograd and calls without a cache take the model's ordinary
forward; both paths share the cache tensors. ``POLYSPEC_CUDA_GRAPHS=0`` keeps :func:`enable_for_device` from
attaching runners (the ordinary forward then runs everywhere).
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from torch import nn

from polyspec.errors import PolyspecError

BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # static widths; a block of T tokens runs at the first bucket >= T
ENV = "POLYSPEC_CUDA_GRAPHS"
COMPILE_ENV = "POLYSPEC_COMPILE_STEP"
RECOMPILE_LIMIT = 64  # compiled static steps per code object: a width bucket x model (target, int4 copy, head) each


def _none() -> None:
    return None


def _env_on(name: str) -> bool:
    """An on-by-default switch: off only when the variable says 0 / false / no / off."""
    return os.environ.get(name, "1").strip().lower() not in ("0", "false", "no", "off")


def graphs_wanted(device: torch.device | str) -> bool:
    """CUDA graphs by default on a CUDA device unless ``POLYSPEC_CUDA_GRAPHS=0``."""
    dev = torch.device(device)
    return dev.type == "cuda" and _env_on(ENV)


def compile_wanted(device: torch.device | str) -> bool:
    """The compiled (fused) static step by default on a CUDA device unless ``POLYSPEC_COMPILE_STEP=0``."""
    dev = torch.device(device)
    return dev.type == "cuda" and _env_on(COMPILE_ENV)


def bucket_for(t: int, max_width: int) -> int | None:
    """The static width a block of ``t`` tokens runs at (None: wider than ``max_width``, take the ordinary path)."""
    for b in BUCKETS:
        if b > max_width:
            break
        if b >= t:
            return b
    return None


class LayerSlots:
    """The static step's KV store for one layer, handed to a :class:`~polyspec.decode.model.DecoderLayer` in place of
    the dynamic cache (same ``store`` method): the block's K/V [1, kv, W, D] go to the cache slots held in the tensor
    ``slots`` [W] (``index_copy_``: fixed addresses, no host sync), and attention reads the layer's whole cache
    [1, kv, S, D] under the step's mask [W, S], which hides every slot not yet valid. One store per layer, so the
    layer's step is the same code for every layer (one compiled graph serves them all)."""

    __slots__ = ("k", "v", "slots")

    def __init__(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor):
        self.k, self.v, self.slots = k, v, slots

    def store(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``layer`` and ``start`` are unused: this store is one layer's, its positions are in ``slots`` (a tensor,
        so a captured graph replays anywhere)."""
        self.k.index_copy_(2, self.slots, k)
        self.v.index_copy_(2, self.slots, v)
        return self.k, self.v


class _Bucket:
    """Input/output buffers of one static width, and its graph once captured."""

    def __init__(self, width: int, s: int, hidden: int, head_dim: int, dtype: torch.dtype, features: bool,
                 device: torch.device):
        self.width = width
        self.cos = torch.zeros(width, head_dim, dtype=dtype, device=device)  # RoPE rows of the block's positions
        self.sin = torch.zeros(width, head_dim, dtype=dtype, device=device)
        self.ids = torch.zeros(1, width, dtype=torch.long, device=device)
        self.positions = torch.arange(width, dtype=torch.long, device=device)
        self.mask = torch.zeros(width, s, dtype=torch.bool, device=device)
        self.feats = torch.zeros(1, width, hidden, dtype=dtype, device=device) if features else None
        self.graph: Any = None
        self.out: tuple[torch.Tensor, torch.Tensor] | None = None  # the graph's static outputs


class StaticRunner:
    """Runs a CachedDecoder's forwards of up to ``max_width`` tokens as static steps (see the module docstring).

    Attach with :func:`enable`; the model's ``forward`` then asks :meth:`forward` first and falls back to its own
    path when that returns None.
    """

    def __init__(self, model: nn.Module, *, graphs: bool, max_width: int = 16, compiled: bool = False):
        if max_width < 1 or max_width > BUCKETS[-1]:
            raise PolyspecError(f"max_width must lie in 1..{BUCKETS[-1]}, got {max_width}")
        self.model = model
        self.graphs = graphs
        self.compiled = compiled  # layers through torch.compile, projections fused (see compiled_layer_step)
        self._eager_first = compiled  # a compiled runner's first step after (re)syncing runs eagerly (see _step)
        self.max_width = max_width
        self._buckets: dict[int, _Bucket] = {}
        self._cache_key: tuple | None = None
        self._cos = self._sin = None
        self.replays = 0  # forwards served by a static step (graph replays or eager static runs)
        self.captures = 0

    # pickled / deep-copied models carry no runner (graphs and their buffers belong to this model's tensors)
    def __reduce__(self):
        return (_none, ())

    @property
    def slack(self) -> int:
        """Extra cache slots the padding rows may write past max_seq_len (no bucket is wider than max_width)."""
        return self.max_width

    def invalidate(self) -> None:
        """Forget buffers, graphs and RoPE tables (after the cache is re-allocated or the weights move)."""
        self._buckets.clear()
        self._cache_key = None
        self._cos = self._sin = None

    def _sync_cache(self, cache: Any) -> None:
        key = (cache.k[0].data_ptr(), cache.k[0].shape, cache.k[0].dtype)
        if key == self._cache_key:
            return
        self.invalidate()
        from polyspec.decode.model import fuse_projections, rope_cos_sin

        if self.compiled:  # after a cast or move the projections are separate tensors again
            fuse_projections(self.model)
            self._eager_first = True

        s = cache.k[0].shape[2]
        dev = cache.k[0].device
        self._cos, self._sin = rope_cos_sin(self.model.inv_freq, torch.arange(s, device=dev), cache.k[0].dtype)
        self._cache_key = key

    def applies(self, ids: torch.Tensor) -> bool:
        cache = self.model._cache
        return (cache is not None and ids.dim() == 2 and ids.shape[0] == 1 and cache.batch_size == 1
                and bucket_for(ids.shape[1], self.max_width) is not None
                and not (torch.is_grad_enabled() and any(p.requires_grad for p in self.model.parameters()))
                and cache.k[0].shape[2] >= cache.max_seq_len + self.slack)

    def forward(self, ids: torch.Tensor, features: torch.Tensor | None, tree_mask: torch.Tensor | None,
                position_offsets: torch.Tensor | None, last_only: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(logits [1, T, V] float32, hidden [1, T, H]) of ids [1, T] (and features [1, T, H] for a head) appended
        to the cache, or None when this call must take the ordinary path. Checks as the ordinary forward does."""
        if not self.applies(ids):
            return None
        model = self.model
        cache = model._cache
        t = ids.shape[1]
        start = cache.length
        model._check_block(1, t, start, tree_mask)
        self._sync_cache(cache)
        dev = cache.k[0].device
        width = bucket_for(t, self.max_width)
        bk = self._buckets.get(width)
        if bk is None:
            kc = cache.k[0]
            bk = self._buckets[width] = _Bucket(width, kc.shape[2], model.args.hidden_size, kc.shape[3], kc.dtype,
                                                features is not None, dev)
        # -- fill the static inputs (eager, outside any graph) --
        bk.ids[0, :t].copy_(ids[0])
        bk.ids[0, t:].zero_()
        offsets = torch.arange(width, device=dev)
        if position_offsets is not None:
            offsets[:t] = torch.as_tensor(position_offsets, device=dev).long().flatten()
        # RoPE positions of the block; cache slots are start.. in order (padding rows after it)
        rope_pos = start + offsets
        slots = torch.arange(start, start + width, device=dev)
        bk.positions.copy_(slots)
        bk.mask.zero_()
        if tree_mask is None:
            inner = torch.ones(t, t, dtype=torch.bool, device=dev).tril()
        else:
            inner = tree_mask.to(device=dev, dtype=torch.bool)
        k = inner.shape[1] - t
        bk.mask[:t, :start - k] = True
        bk.mask[:t, start - k:start + t] = inner
        pad = torch.arange(t, width, device=dev)
        bk.mask[pad, start + pad] = True  # a padding row sees only itself
        if bk.feats is not None:
            bk.feats[0, :t].copy_(features[0])
            bk.feats[0, t:].zero_()
        bk.cos.copy_(self._cos.index_select(0, rope_pos))
        bk.sin.copy_(self._sin.index_select(0, rope_pos))
        logits, hidden = self._run(bk)
        cache.length = start + t
        self.replays += 1
        rows = slice(t - 1, t) if last_only else slice(0, t)
        return logits[:, rows].clone(), hidden[:, rows].clone()

    def _step(self, bk: _Bucket) -> tuple[torch.Tensor, torch.Tensor]:
        """The static forward over bucket ``bk``'s buffers -> (logits [1, W, V] float32, hidden [1, W, H])."""
        args = (self.model, bk.ids, bk.feats, bk.cos, bk.sin, bk.mask, bk.positions)
        if self.compiled and self._eager_first:
            # int4 layers build their kernels' packed weights on first use: eagerly, so the compiled graph reads
            # them and never traces the packing (the step rewrites the same cache slots)
            static_step(*args)
            self._eager_first = False
        return static_step(*args, compiled=self.compiled)

    def _run(self, bk: _Bucket) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.graphs:
            return self._step(bk)
        if bk.graph is None:
            self._capture(bk)
        bk.graph.replay()
        return bk.out

    def prewarm(self, max_seq_len: int | None = None) -> int:
        """Run every width bucket once now, compiling and capturing it, so that no timed forward pays for that later
        (seconds per bucket and model on a GPU the first time). On the model's current cache, or on one for
        ``max_seq_len`` positions (default: a short generation's) where there is none or it is smaller: later
        generations up to that size keep the same tensors, hence the graphs and the compiled code (a cache of
        another physical length would recompile every bucket). The cache is left empty. Returns the buckets run."""
        from polyspec.decode.head import EagleHead

        model = self.model
        if model._cache is None or (max_seq_len and model._cache.k[0].shape[2] < max_seq_len + self.slack):
            model.setup_cache(max_seq_len or self.max_width)
        cache = model._cache
        dev, hidden = cache.k[0].device, model.args.hidden_size
        n = 0
        with torch.inference_mode():
            for width in BUCKETS:
                if width > min(self.max_width, cache.max_seq_len):
                    break
                cache.length = 0
                ids = torch.zeros(1, width, dtype=torch.long, device=dev)
                feats = (torch.zeros(1, width, hidden, dtype=cache.k[0].dtype, device=dev)
                         if isinstance(model, EagleHead) else None)
                n += self.forward(ids, feats, None, None, True) is not None
        cache.length = 0
        return n

    def _capture(self, bk: _Bucket) -> None:
        """Warm up on a side stream (runs the step for real: idempotent, it rewrites the same cache slots), then
        capture the step into a CUDA graph with a private memory pool."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._step(bk)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            bk.out = self._step(bk)
        bk.graph = graph
        self.captures += 1


def layer_step(layer: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """One reference layer of the static step: x [1, W, H] -> [1, W, H], its K/V written to ``slots`` [W] of its
    cache k/v [1, kv, S, D], attention over the whole cache under ``mask`` [W, S]."""
    return layer(x, cos, sin, mask, LayerSlots(k_cache, v_cache, slots), 0, 0)


def static_step(model: nn.Module, ids: torch.Tensor, feats: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, mask: torch.Tensor, slots: torch.Tensor, *,
                compiled: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One static forward: ids [1, W] (features [1, W, H] for a head) at cache slots ``slots`` [W], RoPE rows
    cos/sin [W, D], mask [W, S] over the whole cache -> (logits [1, W, V] float32, hidden [1, W, H]).
    ``compiled``: each layer through :func:`compiled_layer_step`."""
    run_layer = compiled_layer_step() if compiled else layer_step
    cache = model._cache
    x = model._embed(ids, feats)  # [1, W, H]
    for i, layer in enumerate(model._layers()):
        x = run_layer(layer, x, cos, sin, mask, cache.k[i], cache.v[i], slots)
    return model._out(x, last_only=False)


_compiled = None


def compiled_layer_step():
    """:func:`layer_step` through ``torch.compile`` (inductor, whole graph, static shapes): RMSNorm, RoPE with the
    K/V write, SwiGLU and the residual adds fuse into a few generated kernels around the matmuls, which the fused
    projections (model.fuse_projections) make four per layer. The layer, not the whole step, is what is compiled, so
    one compiled graph serves every layer of a model (compile time does not grow with depth); it is compiled once per
    kind of layer (plain, int4), dtype and width bucket, on first use. The same maths as the eager step
    (tests/test_cuda_graphs.py compares them)."""
    global _compiled
    if _compiled is None:
        import torch._dynamo.config as dynamo_config

        # one code object serves every model and width: keep each compiled variant instead of falling back to eager
        dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, RECOMPILE_LIMIT)
        _compiled = torch.compile(layer_step, fullgraph=True, dynamic=False)
    return _compiled


def enable(model: nn.Module, *, graphs: bool | None = None, max_width: int = 16,
           compiled: bool | None = None) -> StaticRunner:
    """Attach a :class:`StaticRunner` to a Transformer or EagleHead (``graphs`` None: on for a CUDA model;
    ``compiled`` None: the compiled step where :func:`compile_wanted` says so).

    Call before ``setup_cache`` or call ``setup_cache`` again: the cache needs ``max_width`` spare slots.
    """
    for attr in ("_embed", "_out", "_layers", "_check_block", "inv_freq", "args"):
        if not hasattr(model, attr):
            raise PolyspecError(f"static steps need a polyspec Transformer or EagleHead, got {type(model).__name__}")
    dev = model.inv_freq.device
    if graphs is None:
        graphs = dev.type == "cuda"
    if graphs and dev.type != "cuda":
        raise PolyspecError(f"CUDA graphs need a CUDA model; this one is on {dev}")
    if compiled is None:
        compiled = compile_wanted(dev)
    runner = StaticRunner(model, graphs=graphs, max_width=max_width, compiled=compiled)
    model.__dict__["_static_runner"] = runner
    return runner


def prewarm(models: Any, max_seq_len: int | None = None, say: Any = None) -> int:
    """:meth:`StaticRunner.prewarm` for each of ``models`` that has a runner (the others are skipped); returns the
    buckets run in all, and tells ``say`` how many and how long when there were any. The bench and the profile call
    it before they time anything, ``polyspec serve`` at start."""
    t0 = time.perf_counter()
    n = sum(r.prewarm(max_seq_len) for m in models if m is not None and (r := runner_of(m)) is not None)
    if n and say is not None:
        say(f"{n} static-step widths compiled and captured ({time.perf_counter() - t0:.1f} s)")
    return n


def disable(model: nn.Module) -> None:
    model.__dict__.pop("_static_runner", None)


def runner_of(model: nn.Module) -> StaticRunner | None:
    return model.__dict__.get("_static_runner")


def enable_for_device(models: dict[str, nn.Module], device: torch.device | str, *, max_width: int = 16) -> int:
    """Attach graph runners to every model on a CUDA ``device`` (unless POLYSPEC_CUDA_GRAPHS=0); returns how many."""
    if not graphs_wanted(device):
        return 0
    n = 0
    for m in models.values():
        if hasattr(m, "_embed"):
            enable(m, graphs=True, max_width=max_width)
            n += 1
    return n
