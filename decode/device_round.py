"""One speculative round as one fixed-shape function of device-resident state: one graph and one host read a round.

Why: on a GPU the verification recursion of decode/chain.py pays fixed costs every round that the arithmetic does not
need: each forward's inputs are filled from the host, each acceptance decision reads values back (a host sync), the
draft's k steps are k separate replays with host work between them. Here a whole linear round of a two-level chain
(the draft's k steps, the target's verification, acceptance or residual sampling, the K/V bookkeeping) is one function
of tensors that live on the device, so it can be compiled (``torch.compile(fullgraph=True)``) and captured as one CUDA
graph; the host reads the round's outcome once (``[accepted, tokens...]``, :meth:`DeviceRound.next_tokens`).

State (:class:`RoundState`, on the levels' device): ``seq`` the sequence (prompt and every emitted token; slots past
``n`` hold scratch), ``n`` the committed length, ``acc`` the last round's accepted count, ``feat`` the target's hidden
states of its last verification (an EAGLE head's features), ``rnd`` the round counter, ``seed``. Cache lengths are
not stored: they follow from ``n`` and ``acc``, which the round updates on the device. With ``base = n - acc - 2``:

* the target's cache holds positions ``0 .. n - 2``; it verifies ``[x_{n-1}, d_1 .. d_k]`` at positions
  ``n - 1 .. n + k - 1`` (width k + 1), so after accepting ``a`` tokens it holds ``0 .. n' - 2`` again
  (``n' = n + a + 1``: the entries past that are scratch, overwritten before anything reads them);
* the draft's first step re-runs positions ``base + 1 .. base + k + 1`` (width k + 1: the last round's accepted
  tokens and its correction, whichever number of them there is, with the target's true features for a head) and takes
  its row ``acc``; steps 2 .. k run one token each (a head: with its own predicted feature, as EAGLE drafts).
  Rows past ``acc`` attend only to earlier rows, so they write scratch slots and change nothing that is read.

Sampling (the rules of polyspec.decode.sampling, with every draw on the device): T = 0 is argmax matching (the
accepted count is the product-sum of matches); at T > 0 token j is kept when ``u_j q_j(x_j) < p_j(x_j)``, the next
token is drawn from ``residual(p_a, q_a)`` (``q_k`` = 0, so after k accepted it is the bonus token from ``p_k``), and
every draw is an exponential race (``argmax p / E``, E ~ Exp(1): an exact sample of p, no cumulative search, no host
branch). The uniforms come from a counter hash of (seed, round, stream, index) (:func:`uniforms`): the same numbers on
every device and in eager and compiled code, and no generator object inside the graph.

What it supports (:func:`unsupported` says why not, and the decoder then keeps decode/chain.py's path): two levels,
a polyspec Transformer target and a draft from a Transformer or an EAGLE-1/2 head (a draft vocabulary included; no
EAGLE-3 auxiliary layers): linear blocks of k <= MAX_K tokens, or an EAGLE-2 tree at T = 0 (decode/device_tree.py;
at T > 0 a tree takes the host path); no prompt lookup, batch 1, every layer within the static step's declared support
(decode.step_attention.SUPPORT); an EAGLE head needs a prompt of two tokens or more. Not yet: an int4 middle level
(three levels), the tree at T > 0, prompt lookup (it searches the token history on the host).

Where it runs: ``ChainDecoder(device_round=None)`` (the default) takes it on CUDA where it is supported, True forces it
wherever it is supported (the CPU tests), False never; ``POLYSPEC_DEVICE_ROUND=0`` keeps it off, ``=1`` forces it.
On CUDA the round is compiled (unless ``POLYSPEC_COMPILE_STEP=0``) and captured as one CUDA graph after a first eager
round (which builds any int4 packed weights); on the CPU it runs eagerly. The decoder keeps one round per draft model
and k or tree shape on the target model (decode/chain.py), so every generation on the same caches replays one graph
(:meth:`DeviceRound.start` re-syncs what changed). Attention is the static step's op (decode/step_attention.py) on
CUDA and its reference without host-read lengths elsewhere (:class:`RoundSlots`).

Tests (tests/test_device_round.py): a TorchDispatchMode counts host reads per round (one, at T = 0 and T > 0); the
round compiles with ``fullgraph=True`` on the CPU and equals the eager round; greedy tokens equal ``ar`` and the
host-side decoder's on the tiny chains; at T > 0 the output law is the warped target's (chi-square, and a broken
residual failing the same check); CUDA-graph replay is marked ``gpu``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from polyspec.decode.cuda_graphs import (
    RECOMPILE_LIMIT,
    LayerSlots,
    StepIndex,
    _none,
    compile_wanted,
    draft_rows_key,
    static_step,
)
from polyspec.decode.sampling import residual, warp
from polyspec.decode.step_attention import SUPPORT, reference, step_attention

ENV = "POLYSPEC_DEVICE_ROUND"
MAX_K = 32  # draft tokens per round (the round's random streams are numbered per draft step)
MAX_TREE = 64  # a tree's verification width and draft-cache entries (the static step's widest bucket)
_M32 = 0xFFFFFFFF
_STREAMS = 64  # random streams per round: 0 acceptance, 1 the next token, 2 + j draft step j


def wanted(device: torch.device | str, force: bool | None) -> bool:
    """Whether the decoder takes the device round where it is supported: ``force`` when given, else the
    POLYSPEC_DEVICE_ROUND variable when set (0 / 1), else on CUDA."""
    if force is not None:
        return force
    env = os.environ.get(ENV, "").strip().lower()
    if env:
        return env not in ("0", "false", "no", "off")
    return torch.device(device).type == "cuda"


# -- randomness: a counter hash ----------------------------------------------------------------------------------------


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2^32 for int64 x in [0, 2^32), in 16-bit halves of c so no product leaves int64."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixing function (xor-shift-multiply, "lowbias32") on int64 tensors, elementwise."""
    x = x & _M32
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniforms(seed: torch.Tensor, counter: torch.Tensor, n: int) -> torch.Tensor:
    """n uniforms in (0, 1) (float64, on seed's device) as a pure function of (seed, counter, index)."""
    key = hash32(hash32(seed) ^ (counter & _M32))  # []
    h = hash32(key ^ torch.arange(n, device=seed.device))  # [n]
    return (h.double() + 0.5) * 2.0 ** -32


def race(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token from each row of probs [..., V] given uniforms u [..., V]: argmax p / E with E = -log u ~ Exp(1)
    (the first of independent exponential clocks of rates p to ring: token i with probability p_i; zero-probability
    tokens never)."""
    return torch.argmax(probs.double() / -torch.log(u), dim=-1)


# -- the levels' static forwards ---------------------------------------------------------------------------------------


class RoundSlots(LayerSlots):
    """The static step's KV store without host-read lengths: on CUDA the step's op (its kernels read the lengths on the
    device), elsewhere its reference over the whole cache under the device-built mask (no ``tolist`` of the bounds)."""

    __slots__ = ()

    def attention(self, qk: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        i = self.index
        if qk.is_cuda:
            return step_attention(qk, v, self.k, self.v, i.cos, i.sin, i.pos, i.bounds, i.inner)
        return reference(qk, v, self.k, self.v, i.cos, i.sin, i.pos, i.bounds, i.inner, host_lengths=False)


class _Level:
    """One model's forwards in the round: a causal block at a sequence position held in a device tensor."""

    def __init__(self, model: Any, head: bool, widths: tuple[int, ...]):
        self.model, self.head = model, head
        cache = model._cache
        dev = cache.k[0].device
        from polyspec.decode.model import rope_cos_sin

        self.cos, self.sin = rope_cos_sin(model.inv_freq, torch.arange(cache.k[0].shape[2], device=dev),
                                          cache.k[0].dtype)
        self.rows = {w: torch.arange(w, device=dev) for w in widths}
        self.causal = {w: torch.ones(w, w, dtype=torch.int32, device=dev).tril() for w in widths}
        self.dtype = cache.k[0].dtype

    def forward(self, ids: torch.Tensor, feats: torch.Tensor | None,
                first: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [W] at sequence positions first .. first + W - 1 (first: [] long; a head's features [W, H]) ->
        (logits [W, V] float32, hidden [W, H])."""
        w = ids.shape[0]
        slot = self.slot(first)
        return self.step(ids, feats, slot, slot, slot + self.rows[w], self.causal[w])

    def slot(self, position: torch.Tensor) -> torch.Tensor:
        """The cache slot of a sequence position (a head's slot t holds position t + 1)."""
        return position - 1 if self.head else position

    def step(self, ids: torch.Tensor, feats: torch.Tensor | None, start: torch.Tensor, prefix: torch.Tensor,
             rope: torch.Tensor, inner: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The static step over ids [W] written at slots start .., each row seeing the slots before ``prefix`` and
        slot prefix + c where inner [W, C] says so, at RoPE positions ``rope`` [W] (slots, like ``start``)."""
        index = StepIndex(rope.int(), torch.stack((start, prefix)).int(), inner, self.cos, self.sin)
        cache = self.model._cache
        f = None if feats is None else feats.to(self.dtype)[None]
        logits, hidden = static_step(self.model, ids[None], f, index, cache.k, cache.v, store=RoundSlots)
        return logits[0], hidden[0]


@dataclass
class RoundState:
    """The round's device-resident state (see the module docstring)."""

    seq: torch.Tensor  # [capacity] long
    n: torch.Tensor  # [] long: committed tokens
    acc: torch.Tensor  # [] long: tokens the last round accepted
    feat: torch.Tensor  # [k + 1, H]: the target's hidden states at positions n - acc - 2 .. (a head's features)
    rnd: torch.Tensor  # [] long
    seed: torch.Tensor  # [] long

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.seq, self.n, self.acc, self.feat, self.rnd, self.seed


def unsupported(levels: list[Any], draft: Any) -> str | None:
    """Why the device round cannot run this chain and draft (None: it can; see the module docstring)."""
    if draft is None or draft.source != "model" or len(levels) != 2:
        return "it runs two levels (a target and its draft model)"
    if draft.lookup:
        return "prompt lookup searches the token history on the host"
    tree = draft.tree
    if not 1 <= (draft.k if tree is None else tree.depth) <= MAX_K:
        return f"it drafts at most {MAX_K} tokens (or tree depths) a round"
    if tree is not None and (tree.total_tokens >= MAX_TREE or (tree.depth - 1) * tree.top_k > MAX_TREE):
        return f"its trees verify fewer than {MAX_TREE} nodes and keep at most {MAX_TREE} in the draft's cache"
    target, bottom = levels
    models = [getattr(target, "model", None), getattr(bottom, "model", getattr(bottom, "head", None))]
    if getattr(target, "kind", None) != "model" or getattr(bottom, "kind", None) not in ("model", "head"):
        return "its levels are ModelLevel / HeadLevel"
    if getattr(target, "_aux", None) is not None or getattr(bottom, "aux_layers", None):
        return "EAGLE-3 heads (auxiliary layers) are not supported"
    for m in models:
        if not all(hasattr(m, a) for a in ("_embed", "_out", "_layers", "inv_freq", "_cache")):
            return f"{type(m).__name__} is not a polyspec Transformer or EagleHead"
        if not all(getattr(layer, "features", SUPPORT) <= SUPPORT for layer in m._layers()):
            return "a layer has features the static step does not declare"
    if len({next(m.parameters()).device for m in models}) != 1:
        return "its levels are on different devices"
    return None


class DeviceRound:
    """The round of a two-level linear chain (``target``, ``draft``: the models under the levels; ``head``: the draft
    reads features) and its state for one generation (:meth:`start`)."""

    def __init__(self, target: Any, draft: Any, *, head: bool, k: int):
        self.target, self.draft, self.head, self.k = target, draft, head, k
        self.levels: tuple[_Level, _Level] | None = None
        self._key: tuple | None = None  # the addresses the levels and a captured round were built on (start)
        self.state: RoundState | None = None
        self.sampling = (0.0, 1.0, 0)
        self.graphs: bool | None = None  # capture the round as a CUDA graph (None: on CUDA)
        self._fn: Any = None  # the round as compiled (or eager) code, captured into _graph
        self._graph: Any = None
        self._out: torch.Tensor | None = None  # the captured round's output

    @property
    def device(self) -> torch.device:
        return self.target.inv_freq.device

    # pickled / deep-copied models carry no round (its graph and buffers belong to this model's tensors)
    def __reduce__(self):
        return (_none, ())

    def widths(self) -> tuple[int, ...]:
        """The block widths the round's forwards use (causal masks and row indices are made once for each)."""
        return 1, self.k + 1

    @property
    def drafted(self) -> int:
        """Tokens the draft proposes a round (its stats' tokens_emitted)."""
        return self.k

    def applies(self, prompt: list[int], sampling: Any) -> bool:
        """Whether this generation runs on the device round: an EAGLE head reads a feature before its first token,
        so it needs a prompt of two tokens or more."""
        return not self.head or len(prompt) >= 2

    @torch.inference_mode()
    def start(self, seq: list[int], feat: torch.Tensor | None, sampling: Any, seed: int, capacity: int) -> None:
        """A generation's state after the prefill: ``seq`` the prompt, ``feat`` the target's hidden state at its
        second-last position (a head's feature; None for a model draft)."""
        dev, k = self.device, self.k
        # what a captured round reads by address: the caches and a draft vocabulary's lm_head rows
        key = (self.target._cache.k[0].data_ptr(), self.draft._cache.k[0].data_ptr(), draft_rows_key(self.draft))
        if self.levels is None or self._key != key:
            widths = self.widths()
            self.levels = (_Level(self.target, False, widths), _Level(self.draft, self.head, widths))
            self._graph = self._fn = None
            self._key = key
        new = (float(sampling.temperature), float(sampling.top_p), int(sampling.top_k))
        if new != self.sampling:
            self._graph = self._fn = None
        self.sampling = new
        # sized by the cache's slots, not this decoder's max_seq_len, so that every generation on these caches has
        # the state a captured round reads (the cache holds max_seq_len and more)
        buf = torch.zeros(max(capacity, self.target._cache.k[0].shape[2] + k + 2), dtype=torch.long, device=dev)
        buf[:len(seq)] = torch.tensor(seq, dtype=torch.long)
        hid = self.target.args.hidden_size
        rows = torch.zeros(k + 1, hid, dtype=self.levels[0].dtype, device=dev)
        if feat is not None:
            rows[0] = feat
        state = RoundState(buf, torch.tensor(len(seq), device=dev), torch.tensor(0, device=dev), rows,
                           torch.tensor(0, device=dev), torch.tensor(seed & _M32, device=dev))
        if self.state is not None and self._graph is not None:  # a captured graph reads the same tensors
            for dst, src in zip(self.state.tensors(), state.tensors(), strict=True):
                dst.copy_(src)
        else:
            self.state = state

    # -- the round -----------------------------------------------------------------------------------------------

    def round(self) -> torch.Tensor:
        """One round on the device -> [k + 2] long: the accepted count a, then the k + 1 tokens at positions n ..
        n + k, of which the first a + 1 are emitted (accepted drafts, then the correction or bonus token)."""
        s, k = self.state, self.k
        drafts, q = self._draft(s)  # [k], [k, V] or None
        target = self.levels[0]
        ids = torch.cat((s.seq.index_select(0, (s.n - 1).view(1)), drafts))  # [k + 1]
        logits, hidden = target.forward(ids, None, s.n - 1)  # [k + 1, V], [k + 1, H]
        acc, nxt = self._accept(logits, drafts, q, s)
        span = s.n + self.levels[0].rows[k + 1]  # positions n .. n + k
        s.seq.index_copy_(0, span[:k], drafts)
        s.seq.index_copy_(0, (s.n + acc).view(1), nxt.view(1))
        out = torch.cat((acc.view(1), s.seq.index_select(0, span)))
        s.n.add_(acc + 1)
        s.acc.copy_(acc)
        s.feat.copy_(hidden)
        s.rnd.add_(1)
        return out

    def _first_step(self, s: RoundState) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft's first step: the last round's accepted tokens and correction re-run at width k + 1 -> its
        logits [1, V] and hidden state [1, H] after the last committed token (row ``acc``)."""
        lv = self.levels[1]
        first = s.n - s.acc - 1  # base + 1
        ids = s.seq.index_select(0, first + lv.rows[self.k + 1])
        logits, hidden = lv.forward(ids, s.feat if self.head else None, first)
        row = s.acc.view(1)
        return logits.index_select(0, row), hidden.index_select(0, row)

    def _draft(self, s: RoundState) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The draft's k tokens [k] (and at T > 0 the distributions they were drawn from [k, V])."""
        k, lv = self.k, self.levels[1]
        logit, feat = self._first_step(s)  # [1, V], [1, H]
        tokens, rows = [], []
        for j in range(k):
            q, x = self._pick(logit[0], s, 2 + j)
            tokens.append(x)
            rows.append(q)
            if j + 1 < k:  # d_{j+1} at position n + j
                logit, feat = lv.forward(x.view(1), feat if self.head else None, s.n + j)
        q = torch.stack(rows) if rows[0] is not None else None
        return torch.stack(tokens), q

    def _pick(self, logit: torch.Tensor, s: RoundState, stream: int) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The draft's row [V] (None at T = 0) and its token []."""
        t, top_p, top_k = self.sampling
        if t == 0:
            return None, torch.argmax(logit.float())
        q = warp(logit, t, top_p, top_k)
        return q, race(q, uniforms(s.seed, s.rnd * _STREAMS + stream, q.shape[-1]))

    def _accept(self, logits: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor | None,
                s: RoundState) -> tuple[torch.Tensor, torch.Tensor]:
        """(accepted count [], next token []) from the target's logits [k + 1, V] and the drafts [k]."""
        k = self.k
        t, top_p, top_k = self.sampling
        if t == 0:
            best = torch.argmax(logits.float(), dim=-1)  # [k + 1]
            acc = torch.cumprod((best[:k] == drafts).long(), 0).sum()
            return acc, best.index_select(0, acc.view(1))[0]
        p = warp(logits, t, top_p, top_k)  # [k + 1, V]
        px = p[:k].gather(1, drafts[:, None])[:, 0].double()  # [k]
        qx = q.gather(1, drafts[:, None])[:, 0].double()
        kept = uniforms(s.seed, s.rnd * _STREAMS, k) * qx < px
        acc = torch.cumprod(kept.long(), 0).sum()
        qpad = torch.cat((q, q.new_zeros(1, q.shape[-1])))  # row k: nothing was drafted there (the bonus token)
        row = acc.view(1)
        r = residual(p.index_select(0, row)[0], qpad.index_select(0, row)[0].to(p.dtype))  # [V]
        return acc, race(r, uniforms(s.seed, s.rnd * _STREAMS + 1, r.shape[-1]))

    # -- running it ----------------------------------------------------------------------------------------------

    def next_tokens(self) -> list[int]:
        """Run one round and read its outcome in one transfer: the tokens it emits (a + 1 of them)."""
        with torch.inference_mode():
            out = self._run()
        vals = out.tolist()  # the round's one host read
        return vals[1:2 + vals[0]]

    def _run(self) -> torch.Tensor:
        if not (self.graphs if self.graphs is not None else self.device.type == "cuda"):
            return self.round()
        if self._fn is None:  # the first round eagerly: int4 layers build their packed weights outside any graph
            self._fn = self._compile()
            return self.round()
        if self._graph is None:
            self._capture()
        self._graph.replay()
        return self._out

    def _compile(self) -> Any:
        if not compile_wanted(self.device):
            return self.round
        import torch._dynamo.config as dynamo_config

        from polyspec.decode.model import fuse_projections

        # one code object serves every decoder, k and sampling setting: keep each compiled variant
        dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, RECOMPILE_LIMIT)
        for m in (self.target, self.draft):
            fuse_projections(m)
        return torch.compile(self.round, fullgraph=True, dynamic=False)

    def _capture(self) -> None:
        """Warm up on a side stream and capture one round as a CUDA graph; the state is restored after the warm-up
        rounds and the capture (their K/V writes land on slots the next round rewrites before reading)."""
        saved = [x.clone() for x in self.state.tensors()]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._out = self._fn()
        for dst, src in zip(self.state.tensors(), saved, strict=True):
            dst.copy_(src)
        self._graph = graph


# -- the target's loop -------------------------------------------------------------------------------------------------


def decode(rnd: DeviceRound, st: Any, prompt: list[int], capacity: int,
           on_tokens: Any = None) -> list[int]:
    """decode/chain.py's target loop on the device round: the prompt is prefilled on the host path (RunState), then
    each iteration is one round and one read; the run's stats are kept as the host path keeps them."""
    rnd.start(prompt, _prefill(rnd, st, prompt), st.sampling, st.gen.initial_seed(), capacity)
    seq, first = list(prompt), len(prompt)
    while len(seq) < st.limit and not (len(seq) > len(prompt) and seq[-1] in st.eos):
        first = len(seq)
        out = st.cut(rnd.next_tokens(), st.limit - len(seq))
        seq += out
        st.stats[0].forward_passes += 1
        st.stats[0].accept_lengths.append(len(out))
        st.stats[1].forward_passes += rnd.k
        st.stats[1].tokens_emitted += rnd.drafted
        if on_tokens is not None and on_tokens(list(out)):
            break
    _settle(rnd, st, seq, first)
    return seq


def _prefill(rnd: DeviceRound, st: Any, prompt: list[int]) -> torch.Tensor | None:
    """The host path's prefill (every level but the last prompt token); a head also gets positions 1 .. n - 2 with
    the target's features. Returns the target's hidden state at position n - 2 (a head's first feature) or None."""
    st.prefill(prompt)
    if not rnd.head:
        return None
    n = len(prompt)
    if n >= 3:
        st.forward(1, prompt[:-1], first_row=n - 2, prefill=True)
    return st.hidden[0][n - 2]


def _settle(rnd: DeviceRound, st: Any, seq: list[int], first: int) -> None:
    """Hand the caches back to the host path's bookkeeping: the target holds seq but its last token, the draft what
    its last round's first step re-ran (positions before ``first``, the last round's start); ``seen`` follows."""
    rnd.target._cache.length = len(seq) - 1
    st.seen[0] = seq[:len(seq) - 1]
    keep = min(first, len(seq) - 1)
    rnd.draft._cache.length = max(keep - 1, 0) if rnd.head else keep
    st.seen[1] = seq[:keep]
