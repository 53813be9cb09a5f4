"""The EAGLE-3 draft head (Li et al. 2025): fused multi-layer target features, its own lm_head over a reduced draft
vocabulary, trained with a training-time test. Beside :class:`polyspec.decode.head.EagleHead` (EAGLE-1/2).

    g          = fc(concat(a_low, a_mid, a_high))                 fc: Linear(3H -> H, no bias); no input norm
    h_out      = Eagle3Layer(embed(token), g)                      one decoder layer whose attention reads 2H:
                   r = g + Attn(concat(input_layernorm(embed), hidden_norm(g)))
                   h_out = r + MLP(post_attention_layernorm(r))
    logits_d   = lm_head(norm(h_out))                              [Vd]: the draft vocabulary, its own trained rows
    target id  = draft id + d2t[draft id];  t2d[target id] = whether the target token is in the draft vocabulary

EAGLE-3.1 (``head_type`` "eagle3.1"; vllm-project/speculators' and SpecForge's ``fc_norm`` + ``norm_output``) adds two
norms and nothing else:

    g          = fc(concat(fc_norm_0(a_low), fc_norm_1(a_mid), fc_norm_2(a_high)))    one RMSNorm per aux layer
    s          = norm(h_out);  logits_d = lm_head(s)                                 s, not h_out, is fed back

so the state the head returns and its next draft step reads is ``norm(h_out)`` (:meth:`Eagle3Head.state`); ``norm``
is the same tensor, ``fc_norm.{i}.weight`` [H] the only new ones (speculators' names).

a_i are the target's residual-stream outputs of the ``aux_layers`` (0-based layer i: Hugging Face's
``hidden_states[i + 1]``; default [1, N/2 - 1, N - 4] as SpecForge's). Positions follow the EAGLE head: head row t
reads (token x_{t+1}, g_t) and its logits predict x_{t+2}; RoPE position t. At later draft steps the head's own
``h_out`` (H wide, not normalised; EAGLE-3.1: normalised) takes g's place, without fc. In a chain the level above the
head returns the aux concatenation and :meth:`Eagle3Head.fuse` turns it into g (see
:class:`polyspec.decode.levels.ModelLevel`), so every feature the chain stores is H wide, whether it came from a level
above or from the head itself.

Tensor names map 1:1 onto the engines' formats: ``fc.weight``, ``layer.*`` (SpecForge ``midlayer.*``, speculators
``layers.0.*``), ``norm.weight``, ``lm_head.weight`` [Vd, H], ``d2t`` int64 [Vd], ``t2d`` bool [V]. Speculators'
``eagle_aux_hidden_state_layer_ids`` count the layer *inputs* (vLLM's convention): ours + 1.

Inference logits are over the full target vocabulary ([V], -inf outside the draft vocabulary), so the chain's
verification and residual rule are unchanged and stay exactly lossless.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from polyspec.chain_spec import EAGLE3_TYPES
from polyspec.decode.head import training_unroll, ttt_mask
from polyspec.decode.model import (
    MLP,
    Attention,
    CachedDecoder,
    Linear,
    ModelArgs,
    RMSNorm,
    StaticKVCache,
    rope_inv_freq,
)
from polyspec.errors import PolyspecError

HEAD_TYPE = "eagle3"
TRAINABLE_PREFIXES = ("fc.", "fc_norm.", "layer.", "norm.", "lm_head.")
VOCAB_BUFFERS = ("d2t", "t2d")


def default_aux_layers(num_layers: int) -> list[int]:
    """SpecForge's low / middle / high layers [1, N/2 - 1, N - 4], clamped into 0 .. N - 2 (the last layer's output
    is not a layer input, so engines that capture layer inputs could not feed it)."""
    if num_layers < 2:
        raise PolyspecError(f"an EAGLE-3 head needs a target with at least 2 layers, this one has {num_layers}")
    top = num_layers - 2
    return [min(max(i, 0), top) for i in (1, num_layers // 2 - 1, num_layers - 4)]


def draft_vocab_ids(token_counts: torch.Tensor, size: int) -> torch.Tensor:
    """The ``size`` most frequent token ids of ``token_counts`` int64 [V] (ties: lower id first), ascending [size]."""
    v = token_counts.shape[0]
    if isinstance(size, bool) or not isinstance(size, int) or not 0 < size <= v:
        raise PolyspecError(f"draft vocabulary size must be an integer in 1..{v}, got {size!r}")
    from polyspec.decode.head import top_token_ids  # head.py loads this module lazily: no cycle at import

    return top_token_ids(token_counts, size)


def vocab_maps(draft_ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t int64 [Vd]: target id - draft id, t2d bool [V]: in the draft vocabulary) for ascending ``draft_ids``."""
    d2t = draft_ids.long() - torch.arange(draft_ids.shape[0])
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[draft_ids.long()] = True
    return d2t, t2d


class Eagle3Layer(nn.Module):
    """A Llama decoder layer whose attention reads concat(input_layernorm(embeds), hidden_norm(hidden)) [2H] and
    whose residual is the hidden half (SpecForge / speculators' first EAGLE-3 layer); parameter names match theirs."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        h, d = args.hidden_size, args.head_dim
        self.self_attn = Attention(args)
        # the same attention maths with 2H-wide q/k/v inputs; o_proj still writes H
        self.self_attn.q_proj = Linear(2 * h, args.num_heads * d, bias=args.attention_bias)
        self.self_attn.k_proj = Linear(2 * h, args.num_kv_heads * d, bias=args.attention_bias)
        self.self_attn.v_proj = Linear(2 * h, args.num_kv_heads * d, bias=args.attention_bias)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(h, args.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, args.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                cache: StaticKVCache | None, layer_idx: int, start: int) -> torch.Tensor:
        """x [B, T, 2H] = concat(embeds, hidden) -> [B, T, H] (the model.DecoderLayer call signature)."""
        emb, hidden = x.chunk(2, dim=-1)  # [B, T, H] each
        attn_in = torch.cat((self.input_layernorm(emb), self.hidden_norm(hidden)), dim=-1)  # [B, T, 2H]
        r = hidden + self.self_attn(attn_in, cos, sin, mask, cache, layer_idx, start)
        return r + self.mlp(self.post_attention_layernorm(r))


class Eagle3Head(CachedDecoder):
    """fc(aux) -> Eagle3Layer(embed(x_{t+1}), .) -> norm -> lm_head over the draft vocabulary (module docstring);
    ``head_type`` "eagle3.1" adds EAGLE-3.1's fc_norm and norm_output."""

    def __init__(self, args: ModelArgs, embed_tokens: nn.Embedding, aux_layers: list[int], draft_size: int,
                 head_type: str = HEAD_TYPE):
        super().__init__()
        h = args.hidden_size
        if embed_tokens.embedding_dim != h:
            raise PolyspecError(f"the target's embedding width {embed_tokens.embedding_dim} != head hidden size {h}")
        if not aux_layers or not 0 < draft_size <= args.vocab_size:
            raise PolyspecError(f"an EAGLE-3 head needs aux layers (got {aux_layers}) and a draft vocabulary in "
                                f"1..{args.vocab_size} (got {draft_size})")
        if head_type not in EAGLE3_TYPES:
            raise PolyspecError(f"an EAGLE-3 head's type is one of {list(EAGLE3_TYPES)}, got {head_type!r}")
        self.args = args
        self.head_type = head_type
        self.aux_layers = [int(i) for i in aux_layers]
        self.norm_output = head_type == "eagle3.1"
        # EAGLE-3.1: each fused layer normalised on its own before fc (speculators' fc_norm.{i}.weight)
        self.fc_norm = nn.ModuleList(RMSNorm(h, args.rms_norm_eps) for _ in self.aux_layers) \
            if head_type == "eagle3.1" else None
        self.fc = Linear(len(self.aux_layers) * h, h, bias=False)
        self.layer = Eagle3Layer(args)
        self.norm = RMSNorm(h, args.rms_norm_eps)
        self.lm_head = Linear(h, draft_size, bias=False)
        self.embed_tokens = embed_tokens.requires_grad_(False)  # shared with the target, frozen, never saved
        self.register_buffer("d2t", torch.zeros(draft_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(args.vocab_size, dtype=torch.bool))
        self.register_buffer("draft_ids", torch.arange(draft_size), persistent=False)  # d2t + arange: target ids
        self.register_buffer("inv_freq", rope_inv_freq(args), persistent=False)
        self.token_counts: torch.Tensor | None = None
        self._cache_layers = 1

    @property
    def draft_size(self) -> int:
        return self.lm_head.weight.shape[0]

    def set_vocab(self, draft_ids: torch.Tensor) -> None:
        """Set d2t / t2d from the ascending target ids [Vd] of the draft vocabulary."""
        if tuple(draft_ids.shape) != (self.draft_size,):
            raise PolyspecError(f"draft vocabulary of {draft_ids.shape[0]} ids for a head of {self.draft_size}")
        d2t, t2d = vocab_maps(draft_ids.cpu(), self.args.vocab_size)
        self.d2t, self.t2d = d2t.to(self.d2t.device), t2d.to(self.t2d.device)
        self.sync_draft_ids()

    def sync_draft_ids(self) -> None:
        """draft_ids (the target id of each draft id, [Vd]) from d2t, after loading or setting the maps."""
        self.draft_ids = self.d2t + torch.arange(self.draft_size, device=self.d2t.device)

    def set_draft_vocab(self, size: int | None) -> None:
        """An EAGLE-3 head's draft vocabulary is fixed by its training: 0/None or its own size are accepted."""
        if size and size != self.draft_size:
            raise PolyspecError(f"this EAGLE-3 head was trained with a draft vocabulary of {self.draft_size} tokens "
                                f"(train.draft_vocab); decode.draft.vocab {size} cannot change it: use 0")

    def _compute_dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """What save_head writes: the trained tensors and the vocabulary maps (never the shared embedding)."""
        return {k: v for k, v in self.state_dict().items()
                if k.startswith(TRAINABLE_PREFIXES) or k in VOCAB_BUFFERS}

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's aux concatenation [..., A H] -> the head's input feature g [..., H] (EAGLE-3.1: each of the A
        blocks through its own fc_norm first)."""
        aux = aux.to(self._compute_dtype())
        if self.fc_norm is not None:
            blocks = aux.chunk(len(self.fc_norm), dim=-1)  # A x [..., H]
            aux = torch.cat([norm(b) for norm, b in zip(self.fc_norm, blocks, strict=True)], dim=-1)
        return self.fc(aux)

    def state(self, x: torch.Tensor) -> torch.Tensor:
        """The layer output [..., H] -> the state the head returns and its next draft step reads: the output itself,
        or with norm_output (EAGLE-3.1) its final norm."""
        return self.norm(x) if self.norm_output else x

    def _layers(self) -> list[nn.Module]:
        return [self.layer]

    def _embed(self, ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """concat(embed(ids), features) [B, T, 2H] in the compute dtype (the layer splits it again)."""
        dtype = self._compute_dtype()
        emb = self.embed_tokens(ids.to(self.embed_tokens.weight.device)).to(dtype)  # [B, T, H]
        return torch.cat((emb, features.to(dtype)), dim=-1)

    def draft_logits(self, s: torch.Tensor) -> torch.Tensor:
        """A state [..., H] (:meth:`state` of a layer output) -> logits over the draft vocabulary [..., Vd]; the final
        norm is applied once, here or (norm_output) in the state already."""
        return self.lm_head(s if self.norm_output else self.norm(s))

    def _out(self, x: torch.Tensor, last_only: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [B, T, V] float32, -inf outside the draft vocabulary; the state [B, T, H]) of layer outputs x."""
        if last_only:
            x = x[:, -1:]
        x = self.state(x)
        sub = self.draft_logits(x).float()  # [B, T, Vd]
        logits = torch.full((*sub.shape[:-1], self.args.vocab_size), float("-inf"), device=sub.device)
        return logits.index_copy(-1, self.draft_ids.to(sub.device), sub), x

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor, *, tree_mask: torch.Tensor | None = None,
                position_offsets: torch.Tensor | None = None, last_only: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids [T] (x_{t+1}) and features [T, H] (g_t, or the head's own output at t - 1) -> (logits [T, V]
        float32, hidden [T, H]); batched [B, T] / [B, T, H] too. Arguments as :meth:`EagleHead.forward`."""
        ids = torch.as_tensor(input_ids).long()
        squeeze = ids.dim() == 1
        if squeeze:
            ids, features = ids[None], features[None]
        h = self.args.hidden_size
        if ids.dim() != 2 or features.dim() != 3 or features.shape[:2] != ids.shape or features.shape[-1] != h:
            raise PolyspecError(f"Eagle3Head.forward: input_ids [T] / [B, T] and fused features [T, {h}] / "
                                f"[B, T, {h}] must match, got {list(input_ids.shape)} and {list(features.shape)}")
        x = self._run_layers(self._embed(ids, features), [self.layer], tree_mask, position_offsets)
        logits, x = self._out(x, last_only)
        return (logits[0], x[0]) if squeeze else (logits, x)

    def unroll(self, input_ids: torch.Tensor, aux: torch.Tensor, steps: int) -> list[tuple[torch.Tensor, ...]]:
        """The training-time test (:func:`polyspec.decode.head.training_unroll`) from g = fuse(aux): input_ids
        [B, T], aux [B, T, A H] (row t: the target's aux states at t) -> per step (draft logits [B, T, Vd], state
        [B, T, H])."""
        return training_unroll(self, input_ids, self.fuse(aux), steps, self.draft_logits, self._step(None))

    def unrolled_states(self, input_ids: torch.Tensor, aux: torch.Tensor, steps: int,
                        layer: Any = None) -> list[torch.Tensor]:
        """:meth:`unroll`'s states [B, T, H] alone, one per step (training computes the logits of the rows that count
        itself: polyspec.train.losses.step_rows); ``layer`` as in :func:`training_unroll`."""
        return [out for _, out in training_unroll(self, input_ids, self.fuse(aux), steps, None, self._step(layer))]

    def _step(self, layer: Any) -> Any:
        """What one unroll step runs: the layer (or ``layer``, its compiled form), then :meth:`state`, so the next
        step reads what a draft step feeds back."""
        run = self.layer if layer is None else layer
        if not self.norm_output:
            return run
        return lambda *a: self.state(run(*a))


def init_from_target(head: Eagle3Head, target: nn.Module, draft_ids: torch.Tensor) -> Eagle3Head:
    """Start a new head from its target: the vocabulary maps from ``draft_ids``, lm_head = the target's rows of those
    tokens, norm = the target's final norm (so the head's first logits read like the target's)."""
    head.set_vocab(draft_ids)
    with torch.no_grad():
        w = target.lm_head.weight.detach().index_select(0, draft_ids.to(target.lm_head.weight.device))
        head.lm_head.weight.copy_(w.to(head.lm_head.weight))
        head.norm.weight.copy_(target.norm.weight.detach().to(head.norm.weight))
    return head


__all__ = ["Eagle3Head", "Eagle3Layer", "default_aux_layers", "draft_vocab_ids", "vocab_maps", "ttt_mask",
           "init_from_target", "HEAD_TYPE"]
