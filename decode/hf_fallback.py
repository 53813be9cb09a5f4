"""The slower path: a model polyspec's engine does not implement, run through transformers behind the same interface.

polyspec's engine (:mod:`polyspec.decode.model`) covers the Llama family (Llama-2/3, Vicuna, Mistral without a
sliding window, Qwen2 with its q/k/v bias, SmolLM2) and reproduces them exactly. A checkpoint of another architecture
(GPT-2, Gemma, Phi, ...) or a config feature the engine does not reproduce (another activation, an unknown RoPE
scaling) is loaded with ``transformers.AutoModelForCausalLM`` instead and wrapped in :class:`HFCausalLM`, which has
the decoder's cache API (``setup_cache``, ``cache_len``, ``truncate``, ``reset``, ``forward``), so every level of a
chain can be one: ``ar``, ``dual`` with a model draft and ``chain`` all run, exactly lossless as before (losslessness
never depends on how a level computes its logits). What it does not have: the CPU kernels, CUDA graphs, draft trees
(they need a tree attention mask), and an EAGLE head on top of it (the head is built around the engine's embedding
and lm_head); those raise one clear error each. Loading one prints a note saying so.

The cache is transformers' ``DynamicCache``; a rollback crops it (O(1) per layer: a view of the kept positions).
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from polyspec.errors import PolyspecError

SLOWER_PATH = "transformers (slower path: no CPU kernels, CUDA graphs, draft trees or EAGLE head)"


def engine_refusal(cfg: dict[str, Any]) -> str | None:
    """Why polyspec's engine cannot run a model with this HF config (None: it can). GPTQ folders are the engine's
    int4 loader's business and are never refused here."""
    from polyspec.decode.model import ModelArgs

    if cfg.get("quantization_config"):
        return None
    try:
        ModelArgs.from_hf_config(cfg)
    except PolyspecError as exc:
        return str(exc)
    return None


class HFCausalLM(nn.Module):
    """A transformers causal LM with :class:`polyspec.decode.model.CachedDecoder`'s cache API and forward."""

    def __init__(self, hf_model: nn.Module, reason: str = ""):
        super().__init__()
        self.hf = hf_model.eval()
        self.reason = reason  # why the engine did not take it
        self._cache: Any = None
        self._len = 0
        self._max = 0
        cfg = hf_model.config
        # The sizes callers read off an engine model's ModelArgs (e.g. the bench's forward timing).
        self.args = SimpleNamespace(model_type=cfg.model_type, vocab_size=int(cfg.vocab_size),
                                    hidden_size=int(cfg.hidden_size), num_layers=int(cfg.num_hidden_layers))

    @property
    def config(self) -> Any:
        return self.hf.config

    @property
    def why(self) -> str:
        """The engine's refusal, without its advice to use transformers (that is what happens here)."""
        return self.reason.split("; load it with transformers")[0].rstrip(".")

    def setup_cache(self, max_seq_len: int, batch_size: int = 1) -> None:
        from transformers import DynamicCache

        if batch_size != 1:
            raise PolyspecError("the transformers fallback decodes one sequence at a time (batch_size 1)")
        limit = getattr(self.hf.config, "max_position_embeddings", None) or getattr(self.hf.config, "n_positions", None)
        if limit and max_seq_len > int(limit):
            raise PolyspecError(f"max_seq_len {max_seq_len} exceeds the model's {limit} positions")
        self._cache = DynamicCache(config=self.hf.config)
        self._len, self._max = 0, int(max_seq_len)

    @property
    def cache_len(self) -> int:
        return self._len

    @property
    def max_seq_len(self) -> int:
        return self._max

    def _require_cache(self) -> Any:
        if self._cache is None:
            raise PolyspecError("call setup_cache(max_seq_len) before decoding with a cache")
        return self._cache

    def truncate(self, n: int) -> None:
        """Keep the first n cached positions (n <= cache_len)."""
        cache = self._require_cache()
        if not 0 <= n <= self._len:
            raise PolyspecError(f"cannot truncate a cache of {self._len} positions to {n}")
        if n < self._len:
            if n == 0:
                cache.reset()
            else:
                cache.crop(n - self._len)  # a negative argument removes that many positions (every version)
            self._len = n

    def reset(self) -> None:
        if self._cache is not None:
            self._cache.reset()
        self._len = 0

    def compact(self, src_positions: torch.Tensor, dst_start: int) -> None:
        raise PolyspecError(f"draft trees need polyspec's engine; this level runs on {SLOWER_PATH}: use linear drafts "
                            "(--no-tree)")

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, *, tree_mask: torch.Tensor | None = None,
                position_offsets: torch.Tensor | None = None, last_only: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """T new tokens after the cached ones -> (logits [T, V] float32, last hidden state [T, H]) — the same
        contract as the engine's forward, for a 1-D ``input_ids``."""
        if tree_mask is not None or position_offsets is not None:
            self.compact(torch.empty(0), 0)  # the one error for trees
        if input_ids.dim() != 1:
            raise PolyspecError("the transformers fallback takes 1-D input_ids (one sequence)")
        cache = self._require_cache()
        t = int(input_ids.shape[0])
        if self._len + t > self._max:
            raise PolyspecError(f"the KV cache holds {self._len} positions and this block adds {t}, more than "
                                f"max_seq_len {self._max}; call setup_cache with a larger max_seq_len")
        dev = next(self.hf.parameters()).device
        ids = input_ids.to(dev)[None]
        pos = torch.arange(self._len, self._len + t, device=dev)
        out = self.hf(input_ids=ids, past_key_values=cache, use_cache=True, output_hidden_states=True,
                      cache_position=pos, position_ids=pos[None])
        self._len += t
        logits, hidden = out.logits[0].float(), out.hidden_states[-1][0]
        return (logits[-1:], hidden[-1:]) if last_only else (logits, hidden)


def load(path: str | Path, *, dtype: torch.dtype, device: torch.device | str, reason: str,
         quiet: bool = False) -> HFCausalLM:
    """Load the HF folder with transformers (local files only, safetensors only: never a pickle) and wrap it; prints
    one note (unless ``quiet``)."""
    from transformers import AutoModelForCausalLM

    from polyspec.weights import check_safetensors

    path = Path(path)
    for weights in sorted(path.glob("*.safetensors")):  # a damaged file is named here, not deep in transformers
        check_safetensors(weights)
    try:
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True, use_safetensors=True)
    except (OSError, ValueError, KeyError) as exc:
        raise PolyspecError(f"{path}: polyspec's engine cannot run this model ({reason}) and transformers could not "
                            f"load it either: {exc}") from exc
    model = HFCausalLM(hf.to(device), reason)
    if not quiet:
        print(f"note: {path.name}: {model.why}; running it through {SLOWER_PATH}", file=sys.stderr)
    return model
