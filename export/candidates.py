"""Candidate levels for the chain search, made in memory from a loaded target (and the folders already built).

* ``int4`` (and ``int4_2`` ...): the int4 copies given as folders (the quantize stage's output), loaded as usual.
* ``int4_g<G>``: an RTN int4 copy of the target at another group size (:func:`rtn_copy`).
* ``exit<m>``: the target's first m decoder layers with its own final norm, embedding and lm_head (an early-exit,
  layer-skipped copy; :func:`early_exit_copy`).
* ``int8``: a bf16 target's W8A16 copy, 7-bit codes with one scale per row (decode.int8.int8_copy); none for
  targets in other dtypes.
* ``head``: the EAGLE head (folder); it reads the features of a level above, so it can only be the bottom level.
* ``ngram``: prompt lookup (:class:`~polyspec.decode.ngram.NgramLevel`), no model; bottom only.

The copies share every tensor they do not change with the target (embedding, norms, lm_head; the early exit also
its layers' weights): a candidate costs the memory of what is new in it, and owns its own KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from polyspec.errors import PolyspecError


@dataclass
class Candidate:
    """One level the search may place: ``bottom_only`` ones (head, n-gram) can only be the draft."""

    name: str
    kind: str  # int4, rtn_int4, early_exit, int8, head, ngram
    level: Any  # a chain level (ModelLevel, HeadLevel, NgramLevel)
    bottom_only: bool
    note: str = ""


@dataclass
class CandidateSettings:
    """What to make from the target: RTN int4 group sizes, the early exit's layer count (None: half), an int8 copy."""

    rtn_group_sizes: tuple[int, ...] = (64,)
    exit_layers: int | None = None
    ngram: bool = True
    int8: bool = True


def shared_copy(target: Any, num_layers: int) -> Any:
    """A new Transformer holding the target's first ``num_layers`` layers, final norm, embedding and lm_head: new
    modules over the target's own tensors (no copy), with a KV cache of its own."""
    import torch

    from polyspec.decode.model import Transformer

    with torch.device("meta"):
        model = Transformer(replace(target.args, num_layers=num_layers))
    keep = {f"layers.{i}." for i in range(num_layers)}
    state = {k: v for k, v in target.state_dict().items()
             if not k.startswith("layers.") or any(k.startswith(p) for p in keep)}
    model.load_state_dict(state, strict=True, assign=True)
    if target.args.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.inv_freq = target.inv_freq
    return model.eval()


def rtn_copy(target: Any, group_size: int) -> Any:
    """The target with every decoder linear RTN-quantised to int4 at ``group_size`` (decode.int4)."""
    from polyspec.decode.int4 import quantize_model_rtn

    bad = [n for n in (target.args.hidden_size, target.args.intermediate_size) if n % group_size]
    if bad:
        raise PolyspecError(f"RTN int4 group size {group_size} does not divide the target's widths {bad}; pick a "
                            "divisor (profile.search_group_sizes)")
    return quantize_model_rtn(shared_copy(target, target.args.num_layers), group_size)


def early_exit_copy(target: Any, layers: int) -> Any:
    """The target cut after ``layers`` decoder layers (its final norm and lm_head read that layer's output)."""
    total = target.args.num_layers
    if not 1 <= layers < total:
        raise PolyspecError(f"an early exit needs 1 <= layers < {total} (the target's layers), got {layers} "
                            "(profile.search_exit_layers)")
    return shared_copy(target, layers)


def _ready(model: Any, device: Any) -> Any:
    """As load_levels prepares a loaded model: CPU weights packed, CUDA graph runners attached."""
    from polyspec.decode import cpu_kernels, cuda_graphs
    from polyspec.decode.generate import GRAPH_WIDTH

    cpu_kernels.pack_weights(model)
    cuda_graphs.enable_for_device({"m": model}, device, max_width=GRAPH_WIDTH)
    return model


def make_candidates(target: Any, given: list[tuple[str, Any]], s: CandidateSettings) -> list[Candidate]:
    """The candidates from a loaded target level (a ModelLevel) and the levels loaded from folders (``given``:
    (tag, level) pairs, tags as :func:`~polyspec.export.stage.level_names` gives them: int4, head, model ...)."""
    import torch

    from polyspec.decode.levels import ModelLevel
    from polyspec.decode.ngram import NgramLevel

    out = []
    for tag, lv in given:
        kind = "head" if tag.startswith("head") else ("int4" if tag.startswith("int4") else "model")
        lv.name = tag
        out.append(Candidate(tag, kind, lv, bottom_only=kind == "head", note="folder"))
    model, dev = target.model, target.device
    for g in s.rtn_group_sizes:
        name = f"int4_g{g}"
        out.append(Candidate(name, "rtn_int4", ModelLevel(_ready(rtn_copy(model, g), dev), name), False,
                             note=f"RTN int4 g{g} of the target"))
    m = s.exit_layers or max(1, model.args.num_layers // 2)
    if m < model.args.num_layers:
        name = f"exit{m}"
        out.append(Candidate(name, "early_exit", ModelLevel(_ready(early_exit_copy(model, m), dev), name), False,
                             note=f"the target's first {m} of {model.args.num_layers} layers"))
    if s.int8 and next(model.parameters()).dtype == torch.bfloat16:
        from polyspec.decode.int8 import int8_copy

        out.append(Candidate("int8", "int8", ModelLevel(_ready(int8_copy(model), dev), "int8"), False,
                             note="int8 copy of the target (7-bit codes, one scale per row, bf16 activations)"))
    if s.ngram:
        out.append(Candidate("ngram", "ngram", NgramLevel(model.args.vocab_size), True, note="prompt lookup"))
    return out


def fits_head(level: Any, head: Any) -> bool:
    """Whether ``level`` may sit anywhere above the feature-reading ``head``: every model returns its hidden state,
    but an EAGLE-3 head reads given layers of every level above it (ModelLevel.feed_aux), which must exist there."""
    aux = getattr(head, "aux_layers", None)
    model = getattr(level, "model", None)
    return not aux or model is None or model.args.num_layers > max(aux)
