"""Candidate levels for the chain search, made in memory from a loaded target (and the folders already built), and
written as level folders once the search has chosen them (:func:`chosen_folders`).

* ``int4`` (and ``int4_2`` ...): the int4 copies given as folders (the quantize stage's output), loaded as usual.
* ``int4_g<G>``: an RTN int4 copy of the target at another group size (:func:`rtn_copy`); exported as the GPTQ
  folder ``decode.int4.save_int4_checkpoint`` writes (the same RTN codes, the format the quantize stage writes).
* ``head``: the EAGLE head (folder); it reads the features of a level above, so it can only be the bottom level.
* ``lookup``: prompt lookup alone drafting (no model, no level: ``draft.source: lookup``); bottom only.

A copy shares every tensor it does not change with the target (embedding, norms, lm_head): a candidate costs the
memory of what is new in it, and owns its own KV cache. (An int8 copy and an early-exit copy were candidates once and
never beat dual on any device measured: docs/PROFILE.md, "The chain search".)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from polyspec.errors import PolyspecError


@dataclass
class Candidate:
    """One level the search may place: ``bottom_only`` ones (head, prompt lookup) can only draft."""

    name: str
    kind: str  # int4, rtn_int4, model, head, lookup
    level: Any  # a chain level (ModelLevel, HeadLevel); None for prompt lookup (a drafter, not a level)
    bottom_only: bool
    note: str = ""
    group_size: int | None = None  # rtn_int4 only


@dataclass
class CandidateSettings:
    """What to make from the target (RTN int4 copies at these group sizes) and whether prompt lookup drafts too."""

    rtn_group_sizes: tuple[int, ...] = (64,)
    lookup: bool = True


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
                            "divisor")
    return quantize_model_rtn(shared_copy(target, target.args.num_layers), group_size)


def _ready(model: Any, device: Any) -> Any:
    """As load_chain prepares a level below the target: CPU weights packed, CUDA graph runners attached."""
    from polyspec.decode import cpu_kernels, cuda_graphs
    from polyspec.decode.generate import GRAPH_WIDTH

    cpu_kernels.pack_weights(model, int8_inputs=True)
    cuda_graphs.enable_for_device({"m": model}, device, max_width=GRAPH_WIDTH)
    return model


def make_candidates(target: Any, given: list[tuple[str, Any]], s: CandidateSettings) -> list[Candidate]:
    """The candidates from a loaded target level (a ModelLevel) and the levels loaded from folders (``given``:
    (tag, level) pairs, tags as :func:`~polyspec.export.stage.level_names` gives them: int4, head, model ...)."""
    from polyspec.decode.levels import ModelLevel

    out = []
    for tag, lv in given:
        kind = "head" if tag.startswith("head") else ("int4" if tag.startswith("int4") else "model")
        lv.name = tag
        out.append(Candidate(tag, kind, lv, bottom_only=kind == "head", note="folder"))
    model, dev = target.model, target.device
    for g in s.rtn_group_sizes:
        name = f"int4_g{g}"
        out.append(Candidate(name, "rtn_int4", ModelLevel(_ready(rtn_copy(model, g), dev), name), False,
                             note=f"RTN int4 g{g} of the target", group_size=g))
    if s.lookup:
        out.append(Candidate("lookup", "lookup", None, True, note="prompt lookup alone"))
    return out


def fits_head(level: Any, head: Any) -> bool:
    """Whether ``level`` may sit anywhere above the feature-reading ``head``: every model returns its hidden state,
    but an EAGLE-3 head reads given layers of every level above it (ModelLevel.feed_aux), which must exist there."""
    aux = getattr(head, "aux_layers", None)
    model = getattr(level, "model", None)
    return not aux or model is None or model.args.num_layers > max(aux)


def chosen_folders(levels: list[str], cands: list[Any], given: dict[str, Path], work: Path) -> list[Path]:
    """The level folders of a searched chain, top first: ``levels`` as the search names them (the target, then
    candidates; prompt lookup is no level and has no folder), ``cands`` the search's CandidateInfo list, ``given``
    the folders it loaded by tag ("target", "int4", "head" ...). A copy made in memory is written under ``work``."""
    by = {c.name: c for c in cands}
    out = []
    for name in (n for n in levels if n != "lookup"):
        if name in given:
            out.append(Path(given[name]))
        elif name in by and by[name].kind == "rtn_int4" and by[name].group_size:
            out.append(_write_rtn(Path(given["target"]), by[name].group_size, Path(work) / name))
        else:
            raise PolyspecError(f"the searched chain's level {name!r} is neither a given folder nor a copy export "
                                "can write; search again with this polyspec")
    return out


def _write_rtn(target_dir: Path, group_size: int, out: Path) -> Path:
    """The RTN int4 copy at ``group_size`` as a GPTQ folder (what :func:`rtn_copy` makes in memory)."""
    from polyspec.decode.int4 import save_int4_checkpoint

    return save_int4_checkpoint(target_dir, out, group_size=group_size, overwrite=True)
