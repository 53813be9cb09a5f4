"""Packaging: the chain folder (levels, the draft head also as ONNX, a manifest carrying the profile's measurements
and decision), written atomically and validated before it replaces the old one."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from polyspec.errors import PolyspecError
from polyspec.export.report import summary_L, verdict_json
from polyspec.export.results import Profile, Search, to_json
from polyspec.fsutil import FILE_HASHES, atomic_folder, copy_tree

Parts = Sequence[Path] | Mapping[str, Path]  # level folders, target first; or {"target", "int4", "head"}
MEASUREMENTS_SCHEMA = "polyspec.measurements/1"
SEARCH_MEASUREMENTS_SCHEMA = "polyspec.search-measurements/1"  # a searched chain's
_GRID_KEYS = ("label", "mode", "draft", "mu", "L", "beta", "predicted_time_per_token_s", "measured_tokens_per_second")
OPSET = 18  # ONNX opset of the head's export: torch's dynamo exporter's own, read by onnxruntime >= 1.14


def ordered_parts(parts: Parts) -> list[Path]:
    """Level folders top first: a list as given, or the three of a ``{"target", "int4", "head"}`` mapping."""
    if isinstance(parts, Mapping):
        missing = {"target", "int4", "head"} - set(parts)
        if missing:
            raise PolyspecError(f"level folders {sorted(missing)} are missing; give target, int4 and head")
        return [Path(parts["target"]), Path(parts["int4"]), Path(parts["head"])]
    if len(parts) < 3:
        raise PolyspecError(f"a profiled chain needs at least three level folders (target, ..., draft), got {parts}")
    return [Path(x) for x in parts]


def cost_table(costs: Mapping[str, Any]) -> dict[str, list[dict[str, float]]]:
    """The manifest's ``T``: per level, each measured width's median and p10 / p90 forward time."""
    return {name: [{"width": r.width, "median_s": r.median_s, "p10_s": r.p10_s, "p90_s": r.p90_s} for r in rows]
            for name, rows in costs.items()}


def measurements_for_manifest(p: Profile) -> dict[str, Any]:
    """What the manifest's ``measurements`` carries: T and L tables, verdicts (``verdict`` / ``candidates``: the first
    insertion's, ``insertions``: all), decision, speedups (:func:`export_chain` adds the ONNX parity)."""
    first = p.insertions[0]
    return {
        "schema": MEASUREMENTS_SCHEMA,
        "profile_key": p.key,
        "device": p.device,
        "dtype": p.dtype,
        "prompts": to_json(p.prompts),
        "kv_length": p.kv_length,
        "T": cost_table(p.costs),
        "L": summary_L(p),
        "acceptance_hist": {nm: {lv: to_json(d.accept_hist) for lv, d in c.per_level.items() if d.accept_hist}
                            for nm, c in p.final.items()},
        "grid": [{k: v for k, v in to_json(r).items() if k in _GRID_KEYS} for r in p.grid],
        "verdict": verdict_json(first),
        "candidates": to_json(first.candidates),
        "insertions": [verdict_json(v) | {"candidates": to_json(v.candidates)} for v in p.insertions],
        "decision": to_json(p.decision),
        "tokens_per_second": {nm: c.tokens_per_second for nm, c in p.final.items()},
        "speedup": to_json(p.speedup),
        "variance": to_json(p.variance),
        "lossless_greedy": p.lossless_greedy,
        "notes": p.notes,
    }


def decided(p: Profile, decode: Any) -> Any:
    """``decode`` (a DecodeSpec: its sampling defaults kept) with the profile's decision: the mode, what drafts (a
    recipe's tree is a candidate, not an order: it stays only where the profile chose it) and mu."""
    from polyspec.chain_spec import DraftSpec

    dec = p.decision
    return decode.model_copy(update={"mode": dec.mode, "draft": DraftSpec.model_validate(dec.draft),
                                     "mu": [int(m) for m in dec.mu] or list(decode.mu)})


def searched(s: Search, decode: Any) -> Any:
    """``decode`` (a DecodeSpec: its sampling defaults kept) with the search's decision: the mode, what drafts (ar:
    the recipe's, unused) and mu."""
    from polyspec.chain_spec import DraftSpec

    dec = s.decision
    draft = DraftSpec.parse(dec.draft) if dec.draft else decode.draft
    return decode.model_copy(update={"mode": dec.mode, "draft": draft, "mu": [int(m) for m in dec.mu] or list(decode.mu)})


def search_measurements(s: Search) -> dict[str, Any]:
    """What a searched chain's manifest ``measurements`` carries: the device and dtype it ran in, T tables, the
    candidates, the confirmed chains and ar, the decision (the whole search stays in its folder's search.json)."""
    return {
        "schema": SEARCH_MEASUREMENTS_SCHEMA,
        "search_key": s.notes.get("key"),
        "device": s.device,
        "dtype": s.dtype,
        "kv_length": s.settings.get("kv_length"),
        "T": cost_table(s.costs),
        "candidates": to_json(s.candidates),
        "confirmed": to_json(s.confirmed),
        "ar": to_json(s.ar),
        "decision": to_json(s.decision),
        "tokens_per_second": {"<-".join(c.levels): c.tokens_per_second for c in [*s.confirmed, s.ar]},
        "lossless_greedy": all(c.lossless_greedy for c in s.confirmed),
        "notes": s.notes,
    }


def export_chain(out: Path, levels: Sequence[Path], decode: Any, measurements: dict[str, Any], *,
                 onnx: bool = True, stamps: dict[str, Any] | None = None,
                 say: Callable[[str], None] = lambda _: None) -> Path:
    """Write the chain folder ``out`` atomically and validate it before it replaces ``out``: the level folders
    ``levels`` (top first; the last one drafts where ``decode.draft.source`` is model or it is a head; a draft head gets
    ``head.onnx`` when ``onnx``), the head in each serving engine's format (``engines/<engine>``: vLLM, SGLang, EAGLE,
    where the head can be written exactly; ``say`` names the others and why), a manifest with ``decode`` (a
    DecodeSpec) and ``measurements`` (its ``onnx`` entry added here); ``stamps``: those of the measurement (kept under
    the manifest's ``stamps.profile``)."""
    from polyspec.fsutil import check_replaceable
    from polyspec.manifest import not_a_chain

    out, levels = Path(out), [Path(x) for x in levels]
    if not levels:
        raise PolyspecError("a chain needs at least its target level")
    # an existing output is replaced whole: only a chain (or an empty folder) may be, never a folder holding the parts
    check_replaceable(out, flag="export.out", overwrite=True, own=not_a_chain, keep=levels, kept="the part folder")
    # the last level drafts where a model drafts, and always where it is a head (a head never verifies)
    drafts = len(levels) > 1 and (decode.draft.source == "model" or _is_head(levels[-1]))
    target = str((out / "levels" / "target").resolve())  # where the engines' configs find the verifier
    return atomic_folder(out, lambda tmp: _write_chain(tmp, levels, drafts, decode, measurements, onnx, stamps,
                                                       target, say))


def _is_head(folder: Path) -> bool:
    from polyspec.manifest import _classify

    return _classify(folder)[0] == "head"


def export_profiled(out: Path, parts: Parts, p: Profile, decode: Any, *, onnx: bool = True,
                    say: Callable[[str], None] = lambda _: None) -> Path:
    """:func:`export_chain` of a profiled chain: its ``parts``, ``decode`` (the recipe's DecodeSpec) with the
    profile's decision, the profile's measurements and stamps."""
    return export_chain(out, ordered_parts(parts), decided(p, decode), measurements_for_manifest(p), onnx=onnx,
                        stamps=p.stamps, say=say)


def _write_chain(tmp: Path, levels: list[Path], drafts: bool, decode: Any, measurements: dict[str, Any],
                 onnx: bool, stamps: dict[str, Any] | None, target: str, say: Callable[[str], None]) -> None:
    """The chain assembled in ``tmp`` (the head copied first, so its ONNX file is hashed with it)."""
    from polyspec.export.head_formats import write_engines
    from polyspec.manifest import assemble_chain, read_manifest, validate_chain, write_manifest
    from polyspec.stamp import hardware_stamp, software_stamp

    draft, onnx_info = (levels[-1] if drafts else None), None
    if draft is not None and _is_head(draft):
        draft = tmp / "parts" / "head"
        copy_tree(levels[-1], draft, ignore=shutil.ignore_patterns(FILE_HASHES))  # the manifest hashes
        onnx_info = _export_onnx(levels[0], draft, OPSET) if onnx else None
    chain = tmp / "chain"
    assemble_chain(chain, levels[0], levels[1:-1] if drafts else levels[1:], draft, decode=decode)
    manifest = read_manifest(chain)
    manifest.measurements = {**measurements, "onnx": onnx_info}
    sw = software_stamp()
    manifest.stamps = {"software": sw, "hardware": hardware_stamp(), "git_sha": sw.get("git_sha"),
                       "packages": sw.get("packages"), "profile": stamps or {}}
    manifest.engines, refused = write_engines(chain, target)
    write_manifest(chain, manifest)
    validate_chain(chain)
    for engine, why in refused.items():
        say(f"export: no engines/{engine}: {why}")
    for x in chain.iterdir():  # the chain's content becomes tmp's content
        os.replace(x, tmp / x.name)
    shutil.rmtree(tmp / "parts", ignore_errors=True)
    chain.rmdir()


def check_onnx_head(head_dir: Path) -> None:
    """Refuse (before any work) an ONNX export of a head that onnx_head cannot write (a head type it does not know).
    A bottom level that is no head (a model draft) has nothing to export."""
    from polyspec.chain_spec import HEAD_TYPES
    from polyspec.decode.head import HEAD_MODEL_TYPE, head_type, read_head_config
    from polyspec.decode.model import read_hf_config

    if read_hf_config(Path(head_dir)).get("model_type") != HEAD_MODEL_TYPE:
        return
    kind = head_type(read_head_config(head_dir))
    if kind not in HEAD_TYPES:
        raise PolyspecError(f"ONNX export of an {kind} head ({head_dir}) is not supported yet; set export.onnx=false",
                            exit_code=2)


def _export_onnx(target_dir: Path, head_dir: Path, opset: int) -> dict[str, Any]:
    """Export the head in ``head_dir`` (a copy being assembled) to ONNX next to its weights; parity-check it."""
    import torch

    from polyspec.decode.head import load_head
    from polyspec.decode.model import Transformer
    from polyspec.export.onnx_head import ONNX_FILE, export_head_onnx, onnx_parity

    t0 = time.perf_counter()
    target = Transformer.from_pretrained(target_dir, dtype=torch.float32, device="cpu")
    head = load_head(head_dir, target).eval()
    path = export_head_onnx(head, head_dir, opset=opset)
    parity = onnx_parity(head, path)
    files = sorted(x.name for x in head_dir.iterdir() if x.name.startswith(ONNX_FILE))
    return {"file": ONNX_FILE, "files": files, "opset": opset, "exporter": "torch.onnx.export(dynamo=True)",
            "inputs": {"input_ids": "int64 [batch, seq]", "features": "float32 [batch, seq, hidden]"},
            "outputs": {"logits": "float32 [batch, seq, vocab]", "hidden": "float32 [batch, seq, hidden]"},
            "seconds": time.perf_counter() - t0, **parity}
