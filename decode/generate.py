"""Load a chain folder (or a plain model folder) into a :class:`ChainDecoder` and generate text.

``polyspec generate CHAIN --prompt TEXT`` is a thin wrapper over :func:`load_chain` and :func:`generate_text`.
Only chains that validate (schema and every sha256) are loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from polyspec.chain_spec import DecodeSpec, DraftSpec
from polyspec.decode import cpu_kernels, cuda_graphs
from polyspec.decode.chain import ChainDecoder, SamplingParams
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
    decode: DecodeSpec = field(default_factory=lambda: DecodeSpec(mode=AR))  # the manifest's decision

    @property
    def mode(self) -> str:
        return self.decode.mode

    def levels_for(self, mode: str, draft: DraftSpec | None = None) -> list[str]:
        """ar = the target; dual = the target and the bottom level (the target alone where prompt lookup drafts);
        chain = every level (but a draft model, where prompt lookup drafts)."""
        lookup = (draft or self.decode.draft).source == "lookup"
        models = [n for n in self.order if not (lookup and self.kinds[n] == "head")]
        if mode == AR:
            return self.order[:1]
        if mode == DUAL:
            if len(self.order) < 2 and not lookup:
                raise PolyspecError("dual mode needs a draft level; this chain has only the target (prompt lookup can "
                                    "draft: --draft source=lookup,lookup=8)")
            return models[:1] if lookup else [self.order[0], self.order[-1]]
        if mode == CHAIN:
            if len(models) + lookup < 3:  # prompt lookup drafting counts as the bottom level
                raise PolyspecError(f"chain mode needs at least 3 levels; this chain has {len(self.order)} "
                                    f"({', '.join(self.order)}): use --mode dual or ar")
            return models
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


def load_chain(chain_dir: Path, *, device: str = "auto", dtype: str | None = None) -> LoadedChain:
    """Validate a chain folder and load every level (target, verifiers, head) onto ``device``. ``dtype``: None = the
    dtype the chain's profile measured in (``measurements.dtype``) when it ran on this kind of device, else the
    device's default."""
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
            models[lv.name].set_draft_vocab(manifest.decode.draft.vocab)
        else:
            models[lv.name] = load_model(folder, dtype=tdtype, device=dev)
        if not isinstance(models[lv.name], HFCausalLM):
            # CPU: weights in read order, one block; a level below the target on int8 inputs where that pays
            cpu_kernels.pack_weights(models[lv.name], int8_inputs=lv is not top)
    cuda_graphs.enable_for_device(models, dev, max_width=GRAPH_WIDTH)  # CUDA: static steps replayed as graphs
    return LoadedChain(models=models, order=[lv.name for lv in manifest.levels],
                       kinds={lv.name: lv.kind for lv in manifest.levels},
                       tokenizer=load_tokenizer(chain_dir / top.path), context=_context(chain_dir / top.path),
                       decode=manifest.decode)


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


def _head_vocab(head: Any, vocab: int) -> None:
    """The draft head's logits over its ``vocab`` most frequent training tokens (0: all), changed only where it
    differs (a change drops the head's cached lm_head rows)."""
    ids = getattr(head, "draft_ids", None)
    if (0 if ids is None else int(ids.numel())) != vocab and hasattr(head, "set_draft_vocab"):
        head.set_draft_vocab(vocab)


def build_decoder(chain: LoadedChain, mode: str, *, max_seq_len: int, draft: DraftSpec | None = None,
                  mu: list[int] | None = None) -> ChainDecoder:
    """The decoder for ``mode`` (ar, dual, chain): ``draft`` (None: the manifest's) says what drafts; ``mu`` (None:
    the manifest's) one block size per verifier below the target."""
    draft = draft or chain.decode.draft
    names = chain.levels_for(mode, draft)
    levels = [HeadLevel(chain.models[n], n) if chain.kinds[n] == "head" else ModelLevel(chain.models[n], n)
              for n in names]
    if mode == AR:
        return ChainDecoder(levels, draft=None, max_seq_len=max_seq_len)
    if chain.kinds[names[-1]] == "head":
        _head_vocab(chain.models[names[-1]], draft.vocab)
    n_mu = max(len(levels) - (1 if draft.source == "model" else 0) - 1, 0)
    mu = list(mu if mu is not None else chain.decode.mu)
    mu = (mu + [mu[-1] if mu else 8] * n_mu)[:n_mu]  # one entry per verifier below the target
    return ChainDecoder(levels, draft=draft, mu=mu, max_seq_len=max_seq_len)


def generate_text(chain: LoadedChain, prompt: str | None, *, mode: str | None = None, max_new_tokens: int = 128,
                  temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0, chat: bool = True,
                  draft: DraftSpec | None = None, mu: list[int] | None = None,
                  messages: list[dict[str, str]] | None = None) -> dict[str, Any]:
    """One generation: {"text", "token_ids" (new tokens), "stats"} — stats as :class:`ChainDecoder` reports them.
    ``mode`` None = the manifest's chosen mode; ``draft`` / ``mu`` None = the manifest's. ``messages`` (a chat,
    instead of ``prompt``): the conversation so far, answered as the assistant's next turn."""
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
    dec = build_decoder(chain, mode, max_seq_len=cache_size(chain, len(ids), max_new_tokens), draft=draft, mu=mu)
    res = dec.generate(ids, max_new_tokens, sampling, seed=seed, eos_token_ids=eos_ids(chain.tokenizer))
    text = chain.tokenizer.decode(res.token_ids, skip_special_tokens=True)
    return {"text": text, "token_ids": list(res.token_ids), "stats": res.stats}


def generate_from_folder(model_dir: Path, prompt: str, *, max_new_tokens: int = 64, device: str = "auto") -> dict:
    """Greedy chat answer of a plain model folder through our engine (ar mode)."""
    chain = load_model_folder(model_dir, device=device)
    return generate_text(chain, prompt, mode="ar", max_new_tokens=max_new_tokens)
