"""The EAGLE-style draft head: the one definition of its architecture (decoding and training both use it).

    feature_in = fc(concat(embed(token), feature))        fc: Linear(2H -> H, bias=True)
    h          = DecoderLayer(feature_in)                  one Llama decoder layer (same class as the target's)
    logits     = lm_head(h)                                the target's lm_head; no extra final norm

Inputs at head position t are the pair (token x_{t+1}, feature f_t), where f_t is the target's final-norm'd hidden
state at position t (``Transformer.forward``'s ``hidden``, the input of lm_head) and x_{t+1} is the token that
followed (sampled from f_t's logits). The head's output at position t is its prediction of f_{t+1} (same space as
``hidden``) and its logits predict x_{t+2}. RoPE position of that row is t.

The embedding and lm_head are the target's modules, shared (not copied) and frozen; only ``fc`` and ``layer`` are
trained and saved (:func:`save_head`). The head has its own static KV cache with the Transformer's API.

**Draft vocabulary.** A head folder may carry ``token_counts.safetensors``: how often each token id occurred among
the assistant tokens the head was trained on (the train stage writes it). ``set_draft_vocab(n)`` then restricts the
head's logits to the ``n`` most frequent tokens at inference: only those rows of the lm_head are read (a full
vocabulary's lm_head is most of a head's cost), and every other token gets logit -inf. The draft still proposes from
a proper distribution (zero outside the subset), so the chain stays exactly lossless; a target token outside the
subset is simply never proposed and comes from the residual.

The EAGLE-3 head lives in :mod:`polyspec.decode.head3`; :func:`save_head` / :func:`load_head` write and read both
kinds (config ``head_type``: absent or "eagle" here, "eagle3" or "eagle3.1" there).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from polyspec.chain_spec import EAGLE3_TYPES, HEAD_TYPES
from polyspec.decode import cpu_kernels
from polyspec.decode.model import (
    CachedDecoder,
    DecoderLayer,
    Linear,
    ModelArgs,
    block_mask,
    read_json_object,
    rope_cos_sin,
    rope_inv_freq,
)
from polyspec.errors import PolyspecError
from polyspec.fsutil import atomic_folder

HEAD_MODEL_TYPE = "polyspec-eagle-head"
TOKEN_COUNTS_FILE = "token_counts.safetensors"
HEAD_FORMAT_VERSION = 1
TRAINABLE_PREFIXES = ("fc.", "layer.")


def ttt_mask(t: int, step: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Training-time-test attention mask bool [T, (step + 1) T] for unroll step ``step`` over T rows: row t sees the
    step-0 keys of rows <= t (the context, with true features) and its own entries of steps 1 .. step (the tokens
    it drafted itself), never another row's drafted entries: what the head's cache holds after drafting ``step``
    tokens beyond row t."""
    causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()  # [T, T]
    eye = torch.eye(t, dtype=torch.bool, device=device)  # [T, T]
    return torch.cat([causal] + [eye] * step, dim=1)


class ScratchKV:
    """The KV store of one unroll step: the earlier steps' K/V followed by this step's (new tensors each step, so
    autograd never sees an in-place write to something it saved)."""

    def __init__(self, past: ScratchKV | None):
        self.past = past
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def store(self, layer_idx: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [B, kv, T, D] -> the [B, kv, (steps so far) T, D] keys/values this step attends over."""
        if self.past is not None:
            k, v = torch.cat((self.past.k, k), dim=2), torch.cat((self.past.v, v), dim=2)
        self.k, self.v = k, v
        return k, v


def training_unroll(head: nn.Module, input_ids: torch.Tensor, hidden: torch.Tensor, steps: int,
                    logits_fn: Any, layer: Any = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The training-time test of an EAGLE head (either kind): ``steps`` passes over a batch without a cache.

    input_ids [B, T] (row t: x_{t+1}), hidden [B, T, H] (row t: the feature the head reads at t, already fused for
    an EAGLE-3 head) -> per step k (``logits_fn(out)``, or None without a logits_fn; out [B, T, H]). Step k row t reads token x_{t+1+k} (ground
    truth; 0 past the end) and the output row t had at step k - 1 (``hidden`` at step 0), at RoPE position t + k,
    attending as :func:`ttt_mask` says: exactly what the head computes when it drafts k tokens past row t.
    ``layer``: what runs ``head.layer``'s maths (training passes its compiled form: train.compile); None: the layer.
    """
    if head._cache is not None:
        raise PolyspecError("a head's training unroll runs without a KV cache (training); do not call setup_cache")
    b, t = input_ids.shape
    past: ScratchKV | None = None
    out = []
    for k in range(steps):
        ids_k = torch.cat((input_ids[:, k:], input_ids.new_zeros(b, min(k, t))), dim=1)  # [B, T]
        x = head._embed(ids_k, hidden)  # [B, T, H] (EAGLE-3: [B, T, 2H])
        cos, sin = rope_cos_sin(head.inv_freq, torch.arange(t, device=x.device) + k, x.dtype)  # [T, D]
        scratch = ScratchKV(past)
        hidden = (head.layer if layer is None else layer)(x, cos, sin, ttt_mask(t, k, x.device), scratch, 0, k * t)
        past = scratch
        out.append((logits_fn(hidden) if logits_fn is not None else None, hidden))
    return out


class EagleHead(CachedDecoder):
    """fc(concat(embed(x_{t+1}), f_t)) -> one DecoderLayer -> target lm_head."""

    def __init__(self, args: ModelArgs, embed_tokens: nn.Embedding, lm_head: nn.Module):
        super().__init__()
        h = args.hidden_size
        if embed_tokens.embedding_dim != h:
            raise PolyspecError(f"the target's embedding width {embed_tokens.embedding_dim} != head hidden size {h}")
        self.args = args
        self.fc = Linear(2 * h, h, bias=True)
        self.layer = DecoderLayer(args)
        # Shared with the target, frozen: registered so .to()/export see them, never saved with the head.
        self.embed_tokens = embed_tokens.requires_grad_(False)
        self.lm_head = lm_head.requires_grad_(False)
        self.register_buffer("inv_freq", rope_inv_freq(args), persistent=False)
        self.register_buffer("draft_ids", None, persistent=False)  # set_draft_vocab: the kept token ids, ascending
        self.token_counts: torch.Tensor | None = None  # int64 [V] from the head folder (load_head), if any
        self._cache_layers = 1

    def set_draft_vocab(self, size: int | None) -> None:
        """Keep the ``size`` most frequent tokens of ``token_counts`` in the inference logits (ties: lower id first);
        None or 0: the full vocabulary."""
        self.__dict__.pop("_draft_weight", None)
        self.__dict__.pop("_kernel_step_cache", None)  # its lm rows and vocabulary ids
        self.__dict__.pop("_kept_step_of", None)
        if not size:
            self.draft_ids = None
            return
        v = self.args.vocab_size
        if isinstance(size, bool) or not isinstance(size, int) or not 0 < size <= v:
            raise PolyspecError(f"draft vocabulary size must be an integer in 1..{v} (0 = the full vocabulary), got "
                                f"{size!r}")
        if self.token_counts is None:
            raise PolyspecError("this head has no token counts (token_counts.safetensors in its folder), so it cannot "
                                "pick a draft vocabulary; heads trained by this polyspec have them, or use "
                                "draft_vocab 0 (the full vocabulary)")
        self.draft_ids = top_token_ids(self.token_counts, size).to(self.inv_freq.device)

    def _draft_lm_weight(self) -> torch.Tensor:
        """The lm_head rows of the draft vocabulary [Vd, H], contiguous (cached; dropped when anything moves). Under
        torch.compile the rows an eager call cached (a compiled round or step runs one first): the cache's key reads
        addresses, which a graph cannot, and a captured graph reads the rows where they were at capture anyway."""
        if torch.compiler.is_compiling():
            return self._draft_weight[1]
        w = self.lm_head.weight
        key = (w.data_ptr(), w.device, w.dtype, self.draft_ids.data_ptr())
        cached = self.__dict__.get("_draft_weight")
        if cached is None or cached[0] != key:
            cached = (key, w.detach().index_select(0, self.draft_ids).contiguous())
            self.__dict__["_draft_weight"] = cached
        return cached[1]

    def _apply(self, fn, recurse=True):
        self.__dict__.pop("_draft_weight", None)
        self.__dict__.pop("_kernel_step_cache", None)
        self.__dict__.pop("_kept_step_of", None)
        return super()._apply(fn, recurse)

    def _compute_dtype(self) -> torch.dtype:
        return self.layer.input_layernorm.weight.dtype

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """fc.* and layer.* tensors only (what save_head writes)."""
        return {k: v for k, v in self.state_dict().items() if k.startswith(TRAINABLE_PREFIXES)}

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor, *, tree_mask: torch.Tensor | None = None,
                position_offsets: torch.Tensor | None = None, last_only: bool = False,
                vocab_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids [T] (tokens x_{t+1}) and features [T, H] (f_t) -> (logits [T, V] float32, hidden [T, H]).

        Batched training input: input_ids [B, T], features [B, T, H] -> [B, T, V], [B, T, H] (without a cache
        each call is a stateless causal pass over its block). tree_mask / position_offsets as in
        ``Transformer.forward``; last_only returns only the last row of each output. ``vocab_ids`` [Vd] (training
        on a draft vocabulary): the logits of those token ids only, [.., Vd], differentiable in the head's output.
        """
        ids = torch.as_tensor(input_ids).long()
        squeeze = ids.dim() == 1
        if squeeze:
            ids, features = ids[None], features[None]
        if ids.dim() != 2 or features.dim() != 3 or features.shape[:2] != ids.shape:
            raise PolyspecError(f"EagleHead.forward: input_ids [T] / [B, T] and features [T, H] / [B, T, H] must "
                                f"match, got {list(input_ids.shape)} and {list(features.shape)}")
        runner = self.__dict__.get("_static_runner")  # polyspec.decode.cuda_graphs: static steps / CUDA graphs
        out = runner.forward(ids, features, tree_mask, position_offsets, last_only) if runner is not None else None
        if out is None and vocab_ids is None:
            out = self._kernel_step(ids, features, last_only, tree_mask, position_offsets)
        if out is None:
            x = self._run_layers(self._embed(ids, features), [self.layer], tree_mask, position_offsets)
            out = self._out(x, last_only) if vocab_ids is None else (subset_logits(self.lm_head, x, vocab_ids), x)
        logits, x = out
        return (logits[0], x[0]) if squeeze else (logits, x)

    def unroll(self, input_ids: torch.Tensor, features: torch.Tensor, steps: int,
               vocab_ids: torch.Tensor | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The training-time test (:func:`training_unroll`): input_ids [B, T], features [B, T, H] (row t: f_t) ->
        per step (logits [B, T, V], or [B, T, Vd] over ``vocab_ids``; the head's output [B, T, H]). Step k's row t
        predicts x_{t+2+k} and f_{t+1+k}, as the head's k-th drafted token past row t does."""
        def logits(x: torch.Tensor) -> torch.Tensor:
            return self.lm_head(x).float() if vocab_ids is None else subset_logits(self.lm_head, x, vocab_ids)

        return training_unroll(self, input_ids, features, steps, logits)

    def unrolled_states(self, input_ids: torch.Tensor, features: torch.Tensor, steps: int,
                        layer: Any = None) -> list[torch.Tensor]:
        """:meth:`unroll`'s outputs [B, T, H] alone, one per step (training computes the logits of the rows that
        count itself: polyspec.train.losses.step_rows); one step is the plain causal pass. ``layer``: as in
        :func:`training_unroll` (its step 0 is that causal pass)."""
        if steps == 1 and layer is None:
            return [self._run_layers(self._embed(torch.as_tensor(input_ids).long(), features), [self.layer], None,
                                     None)]
        return [out for _, out in training_unroll(self, input_ids, features, steps, None, layer)]

    def _layers(self) -> list[nn.Module]:
        return [self.layer]

    def _embed(self, ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """fc(concat(embed(ids), features)) [B, T, H] in the compute dtype."""
        dtype = self._compute_dtype()
        emb = self.embed_tokens(ids.to(self.embed_tokens.weight.device)).to(dtype)  # [B, T, H]
        return self.fc(torch.cat((emb, features.to(dtype)), dim=-1))

    def _out(self, x: torch.Tensor, last_only: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [B, T, V] float32, the layer output [B, T, H]: the head's predicted feature). With a draft
        vocabulary (and no autograd) only its lm_head rows are computed; the other logits are -inf."""
        if last_only:
            x = x[:, -1:]
        if self.draft_ids is None or torch.is_grad_enabled():
            return self.lm_head(x).float(), x
        return self._full_logits(cpu_kernels.linear(x, self._draft_lm_weight(), None, fp32_out=True)), x

    def _full_logits(self, sub: torch.Tensor) -> torch.Tensor:
        """Logits [..., V] from the draft vocabulary's [..., Vd] (every other token -inf); without a draft
        vocabulary, ``sub`` is already all of them."""
        if self.draft_ids is None:
            return sub
        logits = torch.full((*sub.shape[:-1], self.args.vocab_size), float("-inf"), device=sub.device)
        return logits.index_copy_(-1, self.draft_ids, sub)

    def _kernel_step(self, ids: torch.Tensor, features: torch.Tensor, last_only: bool,
                     tree_mask: torch.Tensor | None = None, position_offsets: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A decode step of a bf16 head on the CPU in one kernel call (cpu_kernels.head_step: fc, the layer and
        the lm rows, bitwise the module path's result, which it replaces only for speed: ~25 torch ops and four
        kernel calls cost more than the head's arithmetic), or None where it does not apply (then the module path
        runs): ids [1, T] with T up to cpu_kernels.MAX_ROWS, a cache with room, no autograd. A draft tree's step
        (tree_mask, position_offsets as in ``Transformer.forward``) takes it too."""
        cache, t = self._cache, ids.shape[1]
        if cache is None or ids.shape[0] != 1 or not 0 < t <= cpu_kernels.MAX_ROWS or torch.is_grad_enabled():
            return None
        step, start = self._kept_step(cache), cache.length
        if step is None or start + t > step.rope.shape[1]:
            return None
        positions = mask = None
        if tree_mask is not None or position_offsets is not None:
            self._check_block(1, t, start, tree_mask)  # the module path's errors for a malformed tree
            positions = self._positions(t, start, position_offsets, torch.device("cpu"))
            if int(positions.min()) < 0 or int(positions.max()) >= step.rope.shape[1]:
                return None
            mask = block_mask(start, t, tree_mask, torch.device("cpu"))
        feats = features[0] if features.dtype == torch.bfloat16 and features.is_contiguous() else \
            features[0].to(torch.bfloat16).contiguous()
        hidden, logits = cpu_kernels.head_step(step, ids[0].tolist(), feats, cache, start, 1 if last_only else t,
                                               positions, None if mask is None else mask.contiguous())
        cache.length = start + t
        return logits[None], (hidden[-1:] if last_only else hidden)[None]

    def decode_step(self, tokens: list[int], features: torch.Tensor, last_only: bool
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """:meth:`forward` of a causal block at the cache's end (a draft step, a catch-up block) on the one-call
        kernel step without forward's tensor reshaping: token ids, features [T, H] bf16 -> (logits [T, V], hidden
        [T, H]; the last row of each with ``last_only``), or None where the kernel step does not apply (forward's
        own path then runs). Each torch op costs tens of microseconds here: a target forward between two draft
        steps leaves the interpreter's and torch's own data cold."""
        cache, t = self._cache, len(tokens)
        if cache is None or not 0 < t <= cpu_kernels.MAX_ROWS or "_static_runner" in self.__dict__ \
                or torch.is_grad_enabled() \
                or features.dtype != torch.bfloat16 or not features.is_cpu or not features.is_contiguous():
            return None
        step, start = self._kept_step(cache), cache.length
        if step is None or start + t > step.rope.shape[1] or features.shape != (t, step.fc_weight.shape[1] // 2):
            return None
        hidden, logits = cpu_kernels.head_step(step, tokens, features, cache, start, 1 if last_only else t)
        cache.length = start + t
        return logits, (hidden[-1:] if last_only else hidden)

    def _kept_step(self, cache) -> cpu_kernels.HeadStep | None:
        """:meth:`_head_step`, kept through a weights_frozen span (one generation): its key reads ~10 tensor
        attributes, each tens of microseconds after a target forward has left their code cold."""
        kept = self.__dict__.get("_kept_step_of")
        if kept is not None and kept.current(cache):
            return kept.value
        step = self._head_step(cache)
        if cpu_kernels.frozen_scope():
            self.__dict__["_kept_step_of"] = cpu_kernels.SpanKept(cache, step)
        return step

    def _head_step(self, cache) -> cpu_kernels.HeadStep | None:
        """The tensors cpu_kernels.head_step reads (cached while the weights, the draft vocabulary and the cache
        size stay), or None unless every one is a bf16 CPU tensor of the kind the kernel takes."""
        if not cpu_kernels.available() or torch.jit.is_tracing() or torch.compiler.is_compiling():
            return None
        lm = self._draft_lm_weight() if self.draft_ids is not None else \
            self.lm_head.weight if isinstance(self.lm_head, Linear) and self.lm_head.bias is None else None
        k, fc, emb = cache.k[0], self.fc, self.embed_tokens.weight
        plan = cpu_kernels.layer_plan(self.layer)  # rebuilt when a weight changed in place (its blocks are stale)
        key = (fc.weight.data_ptr(), None if lm is None else lm.data_ptr(), emb.data_ptr(), k.data_ptr(), k.shape,
               id(plan), cpu_kernels.version(fc.weight), None if lm is None else cpu_kernels.version(lm))
        cached = self.__dict__.get("_kernel_step_cache")
        if cached is not None and cached[0] == key:
            return cached[1]
        tensors = (fc.weight, lm, emb, k)
        ok = (plan is not None and plan.kind == "bf16" and fc.bias is not None and type(fc) is Linear
              and cache.batch_size == 1
              and all(x is not None and x.dtype == torch.bfloat16 and x.is_cpu and x.is_contiguous() for x in tensors))
        step = None
        if ok:
            cos, sin = rope_cos_sin(self.inv_freq, torch.arange(k.shape[2]), torch.bfloat16)
            vocab = None if self.draft_ids is None else self.draft_ids.to("cpu", torch.int64).contiguous()
            step = cpu_kernels.HeadStep(emb.detach(), fc.weight.detach(), fc.bias.detach().float().contiguous(),
                                        plan, lm.detach(), torch.stack((cos, sin)).float().contiguous(),
                                        cpu_kernels.blocks_of(fc.weight), cpu_kernels.blocks_of(lm), vocab,
                                        self.args.vocab_size)
        self.__dict__["_kernel_step_cache"] = (key, step)
        return step


def save_head(head: EagleHead, out_dir: str | Path, target_info: dict[str, Any],
              token_counts: torch.Tensor | None = None) -> Path:
    """Write ``out_dir`` atomically: config.json (model_type, format version, the layer's ModelArgs, the caller's
    target identity/hash; for an EAGLE-3 head also head_type, aux_layers and draft_vocab_size) and model.safetensors
    with the head's own tensors only (EAGLE-1/2: fc.* and layer.*; EAGLE-3: also norm, lm_head, d2t, t2d, and for
    EAGLE-3.1 fc_norm.*; never the
    target's embedding or lm_head);
    with ``token_counts`` (int64 [V]: occurrences of each token id in the training targets) also
    token_counts.safetensors, which :meth:`EagleHead.set_draft_vocab` reads."""
    from safetensors.torch import save_file

    config = {
        "model_type": HEAD_MODEL_TYPE,
        "format_version": HEAD_FORMAT_VERSION,
        "args": head.args.to_dict(),
        "target": dict(target_info),
    }
    if getattr(head, "head_type", "eagle") != "eagle":  # EAGLE-1/2 folders stay as they were (no head_type: eagle)
        config.update(head_type=head.head_type, aux_layers=list(head.aux_layers), draft_vocab_size=head.draft_size)
    try:
        config_text = json.dumps(config, indent=2, sort_keys=True) + "\n"
    except TypeError as e:
        raise PolyspecError(f"save_head: target_info must be JSON-serialisable: {e}") from e
    tensors = {k: v.detach().cpu().contiguous() for k, v in head.trainable_state_dict().items()}
    if token_counts is not None:
        token_counts = torch.as_tensor(token_counts).to("cpu", torch.int64).contiguous()
        if tuple(token_counts.shape) != (head.args.vocab_size,) or bool((token_counts < 0).any()):
            raise PolyspecError(f"save_head: token_counts must be non-negative int64 [{head.args.vocab_size}], got "
                                f"{list(token_counts.shape)}")

    def write(tmp: Path) -> None:
        (tmp / "config.json").write_text(config_text)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if token_counts is not None:
            save_file({"counts": token_counts}, str(tmp / TOKEN_COUNTS_FILE), metadata={"format": "pt"})

    return atomic_folder(Path(out_dir), write)


def read_head_config(head_dir: str | Path) -> dict[str, Any]:
    cfg_path = Path(head_dir) / "config.json"
    if not cfg_path.is_file():
        raise PolyspecError(f"{head_dir} has no config.json; is it a folder written by save_head?")
    cfg = read_json_object(cfg_path)
    if cfg.get("model_type") != HEAD_MODEL_TYPE:
        raise PolyspecError(f"{cfg_path}: model_type is {cfg.get('model_type')!r}, expected {HEAD_MODEL_TYPE!r}")
    if cfg.get("format_version") != HEAD_FORMAT_VERSION:
        raise PolyspecError(f"{cfg_path}: head format_version {cfg.get('format_version')!r} is not supported "
                            f"(this polyspec reads {HEAD_FORMAT_VERSION})")
    return cfg


def head_type(cfg: dict[str, Any]) -> str:
    """"eagle" (EAGLE-1/2, also every folder written before head types existed), "eagle3" or "eagle3.1"."""
    kind = cfg.get("head_type", "eagle")
    if kind not in HEAD_TYPES:
        raise PolyspecError(f"head_type {kind!r} in a head config is not one of {list(HEAD_TYPES)}")
    return kind


def load_head(head_dir: str | Path, target: nn.Module) -> EagleHead:
    """Load a saved head (EAGLE-1/2 or EAGLE-3, by its config's head_type) and attach ``target``'s embedding (and, for
    EAGLE-1/2, its lm_head), checked for matching sizes. The head takes the dtype and device of the target's
    embedding."""
    from polyspec.weights import load_safetensors

    head_dir = Path(head_dir)
    cfg = read_head_config(head_dir)
    args = ModelArgs.from_dict(cfg["args"])
    t_args = target.args
    if (args.hidden_size, args.vocab_size) != (t_args.hidden_size, t_args.vocab_size):
        raise PolyspecError(
            f"head in {head_dir} was built for hidden {args.hidden_size} / vocab {args.vocab_size}, the target has "
            f"hidden {t_args.hidden_size} / vocab {t_args.vocab_size}; train a head for this target"
        )
    weights_path = head_dir / "model.safetensors"
    if not weights_path.is_file():
        raise PolyspecError(f"{head_dir} has no model.safetensors")
    ref = target.embed_tokens.weight
    eagle3 = head_type(cfg) in EAGLE3_TYPES
    with torch.device("meta"):
        head = _empty_head3(cfg, args) if eagle3 else \
            EagleHead(args, nn.Embedding(args.vocab_size, args.hidden_size),
                      Linear(args.hidden_size, args.vocab_size, bias=False))
    state = load_safetensors(weights_path)
    expected = set(head.trainable_state_dict())
    if set(state) != expected:
        raise PolyspecError(f"{weights_path}: tensors {sorted(set(state) ^ expected)} do not match the head layout")
    head.load_state_dict({k: v.to(ref.dtype) if v.is_floating_point() else v for k, v in state.items()},
                         strict=False, assign=True)
    head.embed_tokens = target.embed_tokens.requires_grad_(False)
    if eagle3:
        head.sync_draft_ids()
        if len(head.aux_layers) * args.hidden_size != head.fc.weight.shape[1] or \
                max(head.aux_layers) >= t_args.num_layers:
            raise PolyspecError(f"{head_dir}: aux_layers {head.aux_layers} do not fit fc's input "
                                f"{head.fc.weight.shape[1]} or the target's {t_args.num_layers} layers")
    else:
        head.lm_head = target.lm_head.requires_grad_(False)
    head.inv_freq = rope_inv_freq(args)
    head.token_counts = read_token_counts(head_dir, args.vocab_size)
    return head.to(ref.device).eval()


def _empty_head3(cfg: dict[str, Any], args: ModelArgs) -> nn.Module:
    """An EAGLE-3 head of the config's shape (call under torch.device("meta"))."""
    from polyspec.decode.head3 import Eagle3Head

    aux, size = cfg.get("aux_layers"), cfg.get("draft_vocab_size")
    if not isinstance(aux, list) or not all(isinstance(i, int) for i in aux) or not isinstance(size, int):
        raise PolyspecError(f"an eagle3 head config needs aux_layers (a list of layer ids) and draft_vocab_size (an "
                            f"integer), got {aux!r} and {size!r}")
    return Eagle3Head(args, nn.Embedding(args.vocab_size, args.hidden_size), aux, size, head_type(cfg))


def read_token_counts(head_dir: str | Path, vocab_size: int) -> torch.Tensor | None:
    """int64 [V] from ``token_counts.safetensors`` in a head folder, or None when the folder has none."""
    from polyspec.weights import load_safetensors

    path = Path(head_dir) / TOKEN_COUNTS_FILE
    if not path.is_file():
        return None
    counts = load_safetensors(path).get("counts")
    if counts is None or tuple(counts.shape) != (vocab_size,) or counts.dtype != torch.int64:
        raise PolyspecError(f"{path}: expected an int64 'counts' tensor of [{vocab_size}] (one per token id)")
    return counts


def top_token_ids(counts: torch.Tensor, size: int) -> torch.Tensor:
    """The ``size`` most frequent ids of ``counts`` [V] (ties: lower id first), ascending: a draft vocabulary."""
    order = torch.sort(counts.to("cpu", torch.int64), descending=True, stable=True).indices
    return order[:size].sort().values


def subset_logits(lm_head: nn.Module, x: torch.Tensor, vocab_ids: torch.Tensor,
                  rows: torch.Tensor | None = None) -> torch.Tensor:
    """lm_head's logits of ``vocab_ids`` [Vd] only: x [.., H] -> [.., Vd] float32 (a frozen lm_head's rows; the
    gradient flows to x). Training on a draft vocabulary reads a sixth of SmolLM2's lm_head at 8,192 tokens.
    ``rows``: those rows of the weight [Vd, H] already gathered (:func:`subset_weight`; training keeps them)."""
    w = subset_weight(lm_head, vocab_ids) if rows is None else rows  # [Vd, H]
    return torch.nn.functional.linear(x.to(w.dtype), w).float()


def subset_weight(lm_head: nn.Module, vocab_ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The rows [Vd, H] of lm_head's weight for ``vocab_ids`` (in ``dtype``: default the weight's), detached."""
    w = lm_head.weight.detach().index_select(0, vocab_ids.to(lm_head.weight.device))
    return w if dtype is None else w.to(dtype)


def count_tokens(token_ids: Any, loss_masks: Any, vocab_size: int) -> torch.Tensor:
    """int64 [V]: how often each id occurs where the mask is 1 (the assistant tokens a head is trained to predict),
    over an iterable of (ids, mask) sequences."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for ids, mask in zip(token_ids, loss_masks, strict=True):
        ids_t = torch.as_tensor(ids, dtype=torch.int64)
        keep = torch.as_tensor(mask, dtype=torch.bool)
        counts += torch.bincount(ids_t[keep], minlength=vocab_size)[:vocab_size]
    return counts
