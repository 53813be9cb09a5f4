"""Static-shape decode and verify steps, replayed as CUDA graphs on a GPU.

A decode step of a 7B model at batch 1 launches some 300 small kernels; on a GPU the launch overhead alone is a large
share of the step. Capturing the step once as a CUDA graph and replaying it removes that overhead, but a graph fixes
every tensor address and shape. :class:`StaticRunner` therefore runs a forward of T <= ``max_width`` tokens as a
*static* step of width W (the next bucket >= T, see :data:`BUCKETS`):

* what changes from one forward to the next is a few integers: the RoPE positions, the block's first cache slot and
  the start of the part of the cache every row sees, and which of the last slots each row sees (a causal block, a
  draft tree, padding rows that see only themselves). The host writes them into one small buffer (pinned on CUDA);
  the step's first operation copies it to the device, inside the graph, and everything else is derived there. Token
  ids (and a head's features) are copied into their buffers before the replay; rows T..W-1 are padding whose outputs
  are dropped;
* each layer's RoPE, K/V write and attention are one op (:mod:`polyspec.decode.step_attention`) that reads the
  length from the device: it attends over the valid slots only, so no shape depends on the cache length and no
  replay reads the whole cache.

Each layer of the step is the model's own :class:`~polyspec.decode.model.DecoderLayer` (the one reference definition
of the maths), called with a :class:`LayerSlots` as its KV store: the layer hands such a store its projections and the
store runs the op.

The same static step runs eagerly on any device (``graphs=False``): that is the path the tests compare with the
model's own forward on the CPU. With ``graphs=True`` (CUDA only) each width bucket is captured on first use (after two
warm-up runs on a side stream, which also build the int4 kernels' packed weights) and replayed afterwards. Graphs are
dropped whenever the cache is re-allocated or the model is moved or cast.

With ``compiled=True`` (the default on CUDA, ``POLYSPEC_COMPILE_STEP=0`` turns it off) the whole step (embedding,
every layer, the final norm and the lm_head) runs as one ``torch.compile`` graph with the projections fused
(:func:`compiled_step`); the CUDA graph then captures the compiled code.

Prefill blocks wider than ``max_width``, batches > 1, autograd, calls without a cache, trees that see more than
TREE_COLUMNS earlier nodes and layers with a feature the op does not declare take the model's ordinary forward; both
paths share the cache tensors. ``POLYSPEC_CUDA_GRAPHS=0`` keeps :func:`enable_for_device` from attaching runners (the
ordinary forward then runs everywhere).
"""

from __future__ import annotations

import os
import time
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn

from polyspec.decode.step_attention import SUPPORT, step_attention
from polyspec.errors import PolyspecError

BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # static widths; a block of T tokens runs at the first bucket >= T
ENV = "POLYSPEC_CUDA_GRAPHS"
COMPILE_ENV = "POLYSPEC_COMPILE_STEP"
RECOMPILE_LIMIT = 64  # compiled static steps per code object: a width bucket x model (target, int4 copy, head) each
TREE_COLUMNS = 64  # earlier draft-tree nodes a step's rows may see beyond its own block (a larger tree: ordinary path)


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


class StepIndex(NamedTuple):
    """Where a static step reads its positions: device tensors filled from the host buffer inside the step, and the
    RoPE tables over every cache slot (see polyspec.decode.step_attention for the visibility rule)."""

    pos: torch.Tensor  # [W] int32: RoPE positions
    bounds: torch.Tensor  # [2] int32: the block's first slot (start), and prefix: every row sees the slots before it
    inner: torch.Tensor  # [W, C] int32: row w sees slot prefix + c where inner[w, c] != 0
    cos: torch.Tensor  # [S, D] in the compute dtype
    sin: torch.Tensor


class LayerSlots:
    """The static step's KV store for one layer, handed to a :class:`~polyspec.decode.model.DecoderLayer` in place of
    the dynamic cache: the layer's attention calls :meth:`attention` with its projections, and the store runs RoPE,
    the K/V write into the layer's cache [1, kv, S, D] and attention over the valid slots as one op, at the positions
    in the step's :class:`StepIndex` (tensors: a captured graph replays at any position)."""

    __slots__ = ("k", "v", "index")

    def __init__(self, k: torch.Tensor, v: torch.Tensor, index: StepIndex):
        self.k, self.v, self.index = k, v, index

    def attention(self, qk: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """qk [1, W, h + kv, D] and v [1, W, kv, D] before RoPE -> attention output [1, W, h, D]."""
        i = self.index
        return step_attention(qk, v, self.k, self.v, i.cos, i.sin, i.pos, i.bounds, i.inner)


class _Bucket:
    """Input/output buffers of one static width, and its graph once captured. ``meta`` holds the StepIndex integers
    ([W] positions, [2] bounds, [W, C] visibility) on the device; ``staging`` is what the host writes (pinned on CUDA,
    ``meta`` itself on the CPU) and ``host`` its numpy view."""

    def __init__(self, width: int, hidden: int, dtype: torch.dtype, features: bool, device: torch.device):
        self.width = width
        self.columns = width + TREE_COLUMNS
        n = 2 + width * (1 + self.columns)
        self.meta = torch.zeros(n, dtype=torch.int32, device=device)
        self.staging = self.meta if device.type == "cpu" else torch.zeros(n, dtype=torch.int32, pin_memory=True)
        self.host = self.staging.numpy()
        self.pos, self.bounds = self.meta[:width], self.meta[width:width + 2]
        self.inner = self.meta[width + 2:].view(width, self.columns)
        self.rows = np.arange(width)
        self.causal = np.tril(np.ones((width, width), dtype=np.int32))
        self.ids = torch.zeros(1, width, dtype=torch.long, device=device)
        self.feats = torch.zeros(1, width, hidden, dtype=dtype, device=device) if features else None
        self.graph: Any = None
        self.out: tuple[torch.Tensor, torch.Tensor] | None = None  # the graph's static outputs
        self.done: Any = None  # CUDA: an event after the last step that read ``staging``

    def fill(self, t: int, start: int, earlier: int, tree_mask: Any, offsets: Any, slots: int) -> bool:
        """Write a block of ``t`` tokens at cache slot ``start`` into the staging buffer: positions (start + offsets,
        padding rows after the block), bounds, and visibility (the tree mask's [T, earlier + T] or causal; a padding
        row sees itself). False (nothing written) where a position falls outside the RoPE table's ``slots``."""
        w, a = self.width, self.host
        pos = start + self.rows
        if offsets is not None:
            pos[:t] = start + offsets
        if pos.min() < 0 or pos.max() >= slots:
            return False
        if self.done is not None:
            self.done.synchronize()  # the last step's copy has read the staging buffer
        a[:w] = pos
        a[w], a[w + 1] = start, start - earlier
        inner = a[w + 2:].reshape(w, self.columns)
        inner[:] = 0
        inner[:t, :earlier + t] = self.causal[:t, :t] if tree_mask is None else tree_mask
        inner[self.rows[t:], earlier + self.rows[t:]] = 1
        return True


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
        self.compiled = compiled  # the whole step through torch.compile, projections fused (see compiled_step)
        self._eager_first = compiled  # a compiled runner's first step after (re)syncing runs eagerly (see _step)
        self.max_width = max_width
        self._buckets: dict[int, _Bucket] = {}
        self._cache_key: tuple | None = None
        self._cos = self._sin = None
        self._layers_ok: bool | None = None
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
        self._layers_ok = None

    def _sync_cache(self, cache: Any) -> None:
        # what a captured step reads by address and shape: the cache and a draft vocabulary's lm_head rows
        key = (cache.k[0].data_ptr(), cache.k[0].shape, cache.k[0].dtype, draft_rows_key(self.model))
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
        if self._layers_ok is None:  # every layer within what the step's attention op declares
            self._layers_ok = all(getattr(layer, "features", SUPPORT) <= SUPPORT for layer in self.model._layers())
        return (self._layers_ok and cache is not None and ids.dim() == 2 and ids.shape[0] == 1
                and cache.batch_size == 1 and bucket_for(ids.shape[1], self.max_width) is not None
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
        earlier = 0 if tree_mask is None else tree_mask.shape[1] - t
        if earlier > TREE_COLUMNS:
            return None
        offsets = None if position_offsets is None else _host_offsets(position_offsets, t)
        self._sync_cache(cache)
        bk = self._bucket(bucket_for(t, self.max_width), features is not None)
        mask = None if tree_mask is None else tree_mask.detach().to("cpu", torch.int32).numpy()
        if not bk.fill(t, start, earlier, mask, offsets, self._cos.shape[0]):
            return None
        # the only copies outside the step: the token ids (and a head's features), from wherever the caller has them;
        # padding rows keep earlier ids and features (any values do: their outputs are dropped)
        bk.ids[0, :t].copy_(ids[0])
        if bk.feats is not None:
            bk.feats[0, :t].copy_(features[0])
        logits, hidden = self._run(bk)
        cache.length = start + t
        self.replays += 1
        rows = slice(t - 1, t) if last_only else slice(0, t)
        return logits[:, rows].clone(), hidden[:, rows].clone()

    def _bucket(self, width: int, features: bool) -> _Bucket:
        bk = self._buckets.get(width)
        if bk is None:
            kc = self.model._cache.k[0]
            bk = self._buckets[width] = _Bucket(width, self.model.args.hidden_size, kc.dtype, features, kc.device)
        return bk

    def _step(self, bk: _Bucket) -> tuple[torch.Tensor, torch.Tensor]:
        """The static forward over bucket ``bk``'s buffers -> (logits [1, W, V] float32, hidden [1, W, H])."""
        if bk.staging is not bk.meta:  # captured with the step: a replay reads the pinned buffer as it is then
            bk.meta.copy_(bk.staging, non_blocking=True)
        cache = self.model._cache
        args = (self.model, bk.ids, bk.feats, StepIndex(bk.pos, bk.bounds, bk.inner, self._cos, self._sin),
                cache.k, cache.v)
        if not self.compiled:
            return static_step(*args)
        if self._eager_first:
            # int4 layers build their kernels' packed weights on first use: eagerly, so the compiled graph reads
            # them and never traces the packing (the step rewrites the same cache slots)
            static_step(*args)
            self._eager_first = False
        if _out_traceable(self.model):
            return compiled_step()(*args)
        return self.model._out(compiled_step()(*args, out=False), last_only=False)

    def _run(self, bk: _Bucket) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.graphs:
            out = self._step(bk)
        else:
            if bk.graph is None:
                self._capture(bk)
            bk.graph.replay()
            out = bk.out
        if bk.meta.is_cuda:
            bk.done = bk.done or torch.cuda.Event()
            bk.done.record()
        return out

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


def static_step(model: nn.Module, ids: torch.Tensor, feats: torch.Tensor | None, index: StepIndex,
                ks: list[torch.Tensor], vs: list[torch.Tensor], *, out: bool = True,
                store: type = LayerSlots) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
    """One static forward: ids [1, W] (features [1, W, H] for a head) at the positions in ``index``, layer i's K/V in
    ks[i], vs[i] [1, kv, S, D] -> (logits [1, W, V] float32, hidden [1, W, H]); ``out=False``: the last layer's
    output [1, W, H] instead (the caller runs ``model._out``). ``store``: the layers' KV store class (the device
    round's reads no length on the host: polyspec.decode.device_round.RoundSlots)."""
    x = model._embed(ids, feats)  # [1, W, H]
    for i, layer in enumerate(model._layers()):
        x = layer(x, None, None, None, store(ks[i], vs[i], index), i, 0)
    return model._out(x, last_only=False) if out else x


def draft_rows_key(model: nn.Module) -> tuple | None:
    """Where a head's draft-vocabulary lm_head rows lie (address and shape; None without a draft vocabulary): a graph
    captured on them reads them there. The head caches the rows, rebuilds them for a new vocabulary or after a move,
    maybe at the same address; the eager call here also fills that cache before anything is compiled."""
    if getattr(model, "draft_ids", None) is None:
        return None
    rows = model._draft_lm_weight()
    return rows.data_ptr(), rows.shape


def _out_traceable(model: nn.Module) -> bool:
    """Whether the compiled step includes ``model._out``: a head with a draft vocabulary runs it eagerly, so the
    compiled code never depends on the rows the head caches."""
    return getattr(model, "draft_ids", None) is None


def _host_offsets(position_offsets: Any, t: int) -> np.ndarray:
    offsets = torch.as_tensor(position_offsets).detach().to("cpu", torch.int64).flatten().numpy()
    if offsets.size != t:
        raise PolyspecError(f"position_offsets has {offsets.size} entries for a block of {t} tokens")
    return offsets


_compiled = None


def compiled_step():
    """:func:`static_step` through ``torch.compile`` (inductor, whole graph, static shapes): the embedding, every
    layer, the final norm and the lm_head in one graph, so each layer's residual add fuses into the next layer's
    RMSNorm and the layer is its four matmuls (the projections fused by model.fuse_projections), the attention op,
    two norms and SwiGLU (lab/gpu/step_kernels.py counts them). Compiled once per model, dtype and width bucket, on first
    use (compile time grows with depth: docs/DECODE.md). The same maths as the eager step (tests/test_cuda_graphs.py
    compares them)."""
    global _compiled
    if _compiled is None:
        import torch._dynamo.config as dynamo_config

        # one code object serves every model and width: keep each compiled variant instead of falling back to eager
        dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, RECOMPILE_LIMIT)
        _compiled = torch.compile(static_step, fullgraph=True, dynamic=False)
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
