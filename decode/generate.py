"""Load a chain folder (or a plain model folder) into a :class:`ChainDecoder` and generate text.

``polyspec generate CHAIN --prompt TEXT`` is a thin wrapper over :func:`load_chain` and :func:`generate_text`.
Only chains that validate (schema and every sha256) are loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from polyspec.decode import cpu_kernels, cuda_graphs
from polyspec.decode.chain import ChainDecoder, SamplingParams, TreeParams
from polyspec.decode.hf_fallback import HFCausalLM
from polyspec.decode.levels import HeadLevel, ModelLevel
from polyspec.device import resolve_device, resolve_dtype
from polyspec.errors import PolyspecError
from polyspec.modes import AR, CHAIN, DUAL, MODES

GRAPH_WIDTH = 64  # widest block a CUDA graph serves: a verification of the default 32-token tree fits
# KV room beyond prompt + max_new_tokens for blocks that run past the committed end before the target cuts them.
KV_SLACK = 64


def cache_size(chain: LoadedChain, prompt_len: int, max_new_tokens: int) -> int:
    """KV positions to allocate for a generation: prompt + new tokens (within the chain's context) + KV_SLACK."""
    return min(chain.context, prompt_len + max_new_tokens) + KV_SLACK


@dataclass
class LoadedChain:
    """Every level of a chain, loaded (top first), plus what generation needs."""

    models: dict[str, Any]  # level name -> Transformer / EagleHead
    order: list[str]  # level names, top first
    kinds: dict[str, str]
    tokenizer: Any
    context: int  # the target's max_position_embeddings
    draft_k: int = 4
    draft_stop: float = 0.0  # the manifest's confidence cut of linear drafts (ChainDecoder's draft_stop)
    draft_lookup: int = 0  # the manifest's prompt-lookup blocks in place of the draft's (ChainDecoder's draft_lookup)
    mu: tuple[int, ...] = (8,)
    mode: str = "ar"  # the manifest's chosen decode mode
    tree: TreeParams | None = None  # the manifest's EAGLE-2 tree when it is on (None: linear drafts)
    tree_shape: TreeParams | None = None  # the manifest's tree shape, on or off (what --tree uses)
    ngram: bool = False  # the manifest's dual mode drafts by prompt lookup (decode/ngram.py)

    def levels_for(self, mode: str) -> list[str]:
        """ar = the target; dual = target + the bottom level; chain = all levels."""
        if mode == AR:
            return self.order[:1]
        if mode == DUAL:
            if len(self.order) < 2:
                raise PolyspecError("dual mode needs a draft level; this chain has only the target")
            return [self.order[0], self.order[-1]]
        if mode == CHAIN:
            if len(self.order) < 3:
                raise PolyspecError(f"chain mode needs at least 3 levels; this chain has {len(self.order)} "
                                    f"({', '.join(self.order)}): use --mode dual or ar")
            return list(self.order)
        raise PolyspecError(f"unknown mode {mode!r}; use {', '.join(MODES)}")


def _context(model_dir: Path) -> int:
    from polyspec.decode.model import read_hf_config

    cfg = read_hf_config(Path(model_dir))
    return int(cfg.get("max_position_embeddings") or cfg.get("n_positions") or 2048)


def load_model(folder: Path, *, dtype: torch.dtype, device: torch.device) -> Any:
    """A target or verifier folder: polyspec's engine where it reproduces the model (the Llama family, GPTQ int4
    folders), else transformers behind the same interface (polyspec.decode.hf_fallback, with a note on stderr)."""
    from polyspec.decode import hf_fallback
    from polyspec.decode.model import Transformer, read_hf_config

    why = hf_fallback.engine_refusal(read_hf_config(Path(folder)))
    if why is not None:
        return hf_fallback.load(folder, dtype=dtype, device=device, reason=why)
    return Transformer.from_pretrained(folder, dtype=dtype, device=device)


def load_chain(chain_dir: Path, *, device: str = "auto", dtype: str | None = None,
               draft_vocab: int | None = None) -> LoadedChain:
    """Validate a chain folder and load every level (target, verifiers, head) onto ``device``. ``draft_vocab``: the
    head's draft vocabulary size (None: the manifest's ``decode.draft_vocab``; 0: the full vocabulary). ``dtype``:
    None = the dtype the chain's profile measured in (``measurements.dtype``) when it ran on this kind of device,
    else the device's default."""
    from polyspec.decode.head import load_head
    from polyspec.manifest import validate_chain
    from polyspec.sources import load_tokenizer

    chain_dir = Path(chain_dir)
    manifest = validate_chain(chain_dir)
    dev = resolve_device(device)
    measured = manifest.measurements
    if dtype is None and str(measured.get("device", "")).split(":")[0] == dev.type:
        dtype = measured.get("dtype")
    tdtype = resolve_dtype(dtype, dev)
    top = manifest.levels[0]
    models: dict[str, Any] = {}
    for lv in manifest.levels:
        folder = chain_dir / lv.path
        if lv.kind == "head":  # shares the target's embedding and lm_head
            if isinstance(models[top.name], HFCausalLM):
                raise PolyspecError(f"{chain_dir}: the EAGLE head {lv.name!r} needs its target on polyspec's engine, "
                                    f"but the target runs on transformers ({models[top.name].why}); use a "
                                    "Llama-family target, or a chain without a head")
            models[lv.name] = load_head(folder, models[top.name]).to(dev)
            models[lv.name].set_draft_vocab(manifest.decode.draft_vocab if draft_vocab is None else draft_vocab)
        else:
            models[lv.name] = load_model(folder, dtype=tdtype, device=dev)
        if not isinstance(models[lv.name], HFCausalLM):
            cpu_kernels.pack_weights(models[lv.name])  # CPU: weights in read order, one block
    cuda_graphs.enable_for_device(models, dev, max_width=GRAPH_WIDTH)  # CUDA: static steps replayed as graphs
    return LoadedChain(
        models=models, order=[lv.name for lv in manifest.levels], kinds={lv.name: lv.kind for lv in manifest.levels},
        tokenizer=load_tokenizer(chain_dir / top.path), context=_context(chain_dir / top.path),
        draft_k=manifest.decode.draft_k, draft_stop=manifest.decode.draft_stop,
        draft_lookup=manifest.decode.draft_lookup, mu=tuple(manifest.decode.mu), mode=manifest.decode.mode,
        tree=tree_params(manifest.decode.tree) if manifest.decode.tree.enabled else None,
        tree_shape=tree_params(manifest.decode.tree), ngram=manifest.decode.ngram,
    )


def tree_params(cfg: Any = None, **overrides: int | bool | None) -> TreeParams:
    """TreeParams from a recipe/manifest ``decode.tree`` section or a TreeParams (None: the defaults), with the
    given top_k / depth / total_tokens / lookup / lookup_first overrides."""
    tp = TreeParams() if cfg is None else TreeParams(top_k=cfg.top_k, depth=cfg.depth, total_tokens=cfg.total_tokens,
                                                     lookup=cfg.lookup, lookup_first=cfg.lookup_first)
    tp = replace(tp, **{k: v for k, v in overrides.items() if v is not None})
    tp.check()
    return tp


def load_model_folder(model_dir: Path, *, device: str = "auto", dtype: str | None = None) -> LoadedChain:
    """A plain Hugging Face folder as a one-level chain (ar mode only)."""
    from polyspec.sources import load_tokenizer

    dev = resolve_device(device)
    model = load_model(Path(model_dir), dtype=resolve_dtype(dtype, dev), device=dev)
    if not isinstance(model, HFCausalLM):
        cpu_kernels.pack_weights(model)
    cuda_graphs.enable_for_device({"target": model}, dev, max_width=GRAPH_WIDTH)
    return LoadedChain(models={"target": model}, order=["target"], kinds={"target": "target"},
                       tokenizer=load_tokenizer(Path(model_dir)), context=_context(Path(model_dir)))


def eos_ids(tokenizer: Any) -> set[int]:
    ids = set()
    for attr in ("eos_token_id",):
        v = getattr(tokenizer, attr, None)
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, (list, tuple)):
            ids.update(int(x) for x in v)
    return ids


def chat_token_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The messages through the tokenizer's own chat template, ending with the assistant's generation prompt."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):  # a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def encode_messages(tokenizer: Any, messages: list[dict[str, str]], *, chat: bool = True) -> list[int]:
    """A conversation as prompt token ids: through the chat template when asked and the tokenizer has one, else the
    contents joined by blank lines (the tokenizer's own special tokens, e.g. BOS, added as it is configured)."""
    if chat and getattr(tokenizer, "chat_template", None):
        return chat_token_ids(tokenizer, messages)
    text = "\n\n".join(m["content"] for m in messages)
    return [int(t) for t in tokenizer(text, add_special_tokens=True)["input_ids"]]


def encode_prompt(tokenizer: Any, prompt: str, *, chat: bool = True) -> list[int]:
    """One user message as prompt token ids (see :func:`encode_messages`)."""
    if not prompt:
        raise PolyspecError("the prompt is empty")
    return encode_messages(tokenizer, [{"role": "user", "content": prompt}], chat=chat)


def resolve_tree(choice: bool | dict[str, int] | None, base: TreeParams | None) -> TreeParams | bool | None:
    """A CLI choice (see ``polyspec.cli.tree_choice``) against the manifest's tree: shape overrides apply on top of
    the manifest's shape (or the defaults)."""
    if isinstance(choice, dict):
        return tree_params(base, **choice)
    return choice


def build_decoder(chain: LoadedChain, mode: str, *, max_seq_len: int, draft_k: int | None = None,
                  mu: list[int] | None = None, tree: TreeParams | bool | None = None,
                  ngram: bool | None = None, draft_stop: float | None = None,
                  draft_lookup: int | None = None) -> ChainDecoder:
    """tree: None = the manifest's choice, False = linear drafts, True = a tree (the manifest's shape, else the
    defaults), or explicit TreeParams. ar mode never uses one. draft_stop, draft_lookup: None = the manifest's. ngram: prompt lookup (decode/ngram.py) replaces the
    bottom level (linear drafts only); None = the manifest's choice for dual mode."""
    from polyspec.decode.ngram import NgramLevel

    if ngram is None:
        ngram = chain.ngram and mode == DUAL and not tree

    names = chain.levels_for(mode)
    levels = [HeadLevel(chain.models[n], n) if chain.kinds[n] == "head" else ModelLevel(chain.models[n], n)
              for n in names]
    if ngram:
        if len(levels) < 2:
            raise PolyspecError("prompt lookup drafts for a level above it: use it with dual or chain, not ar")
        if tree:
            raise PolyspecError("prompt lookup proposes one token per position: use linear drafts (no tree)")
        levels[-1], tree = NgramLevel(chain.models[names[0]].args.vocab_size, name="ngram"), False
    n_mu = max(len(levels) - 2, 0)
    mu = list(mu if mu is not None else chain.mu)
    mu = (mu + [mu[-1] if mu else 8] * n_mu)[:n_mu]  # one entry per verifier below the target
    if tree is None:
        tree = chain.tree
    elif tree is True:
        tree = chain.tree or chain.tree_shape or TreeParams()
    elif tree is False:
        tree = None
    return ChainDecoder(levels, draft_k=draft_k or chain.draft_k, mu=mu, max_seq_len=max_seq_len,
                        draft_stop=chain.draft_stop if draft_stop is None else draft_stop,
                        draft_lookup=chain.draft_lookup if draft_lookup is None else draft_lookup,
                        tree=tree if len(levels) > 1 else None)


def generate_text(chain: LoadedChain, prompt: str | None, *, mode: str | None = None, max_new_tokens: int = 128,
                  temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0, chat: bool = True,
                  draft_k: int | None = None, mu: list[int] | None = None,
                  tree: TreeParams | bool | None = None, draft_stop: float | None = None,
                  draft_lookup: int | None = None, messages: list[dict[str, str]] | None = None) -> dict[str, Any]:
    """One generation: {"text", "token_ids" (new tokens), "stats"} — stats as :class:`ChainDecoder` reports them.
    ``mode`` None = the manifest's chosen mode. ``messages`` (a chat, instead of ``prompt``): the conversation
    so far, answered as the assistant's next turn."""
    mode = mode or chain.mode
    sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
    sampling.check()
    if messages is not None:
        if not messages or not all(isinstance(m, dict) and {"role", "content"} <= set(m) for m in messages):
            raise PolyspecError("messages must be a non-empty list of {role, content} objects")
        ids = encode_messages(chain.tokenizer, messages, chat=chat)
    else:
        ids = encode_prompt(chain.tokenizer, prompt or "", chat=chat)
    if len(ids) + max_new_tokens > chain.context:
        raise PolyspecError(f"the prompt has {len(ids)} tokens; with max_new_tokens={max_new_tokens} that exceeds "
                            f"the target's context of {chain.context} tokens: shorten the prompt or lower "
                            "--max-new-tokens")
    dec = build_decoder(chain, mode, max_seq_len=cache_size(chain, len(ids), max_new_tokens),
                        draft_k=draft_k, mu=mu, tree=tree, draft_stop=draft_stop, draft_lookup=draft_lookup)
    res = dec.generate(ids, max_new_tokens, sampling, seed=seed, eos_token_ids=eos_ids(chain.tokenizer))
    text = chain.tokenizer.decode(res.token_ids, skip_special_tokens=True)
    return {"text": text, "token_ids": list(res.token_ids), "stats": res.stats}


def generate_from_folder(model_dir: Path, prompt: str, *, max_new_tokens: int = 64, device: str = "auto") -> dict:
    """Greedy chat answer of a plain model folder through our engine (ar mode)."""
    chain = load_model_folder(model_dir, device=device)
    return generate_text(chain, prompt, mode="ar", max_new_tokens=max_new_tokens)
