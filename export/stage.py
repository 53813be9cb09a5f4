"""The pipeline's profile and export stages: level folders -> profile (or search) folder -> chain folder.

Each stage takes its recipe section and the few values it needs besides (the level folders, the workdir, the device
and dtype, the draft, the data section for calibration prompts); :mod:`polyspec.pipeline` reads them off a recipe.
``profile_stage(recipe.profile, ...)`` measures the chain (target first, draft last; see
:func:`polyspec.export.profile.profile_levels`) and writes ``<workdir>/profile/<key>/`` (:mod:`polyspec.export.report`).
``<key>`` hashes the level folders' contents, the profile section, the decode grid and the prompts setting, so a
rerun with the same inputs returns the stored profile at once (after checking its files against their hashes; a
damaged profile is measured again). ``search_stage(recipe.profile, ...)`` searches the chain instead
(:mod:`polyspec.export.search`), stored in ``<workdir>/profile/search/``. ``export_stage(recipe.export, ...)`` writes
the chain folder (default ``<workdir>/chain``; :mod:`polyspec.export.package`) from a profile or a search.

torch and every heavy module are imported inside functions: importing this module is cheap.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from polyspec.chain_spec import DecodeSpec, DraftSpec
from polyspec.errors import PolyspecError
from polyspec.export.package import Parts, ordered_parts
from polyspec.export.profile import ProfileSettings
from polyspec.export.prompts import CALIBRATION_FORMAT
from polyspec.export.results import PROFILE_FORMAT, Profile, Search

Say = Callable[[str], None]
WARMUP = 2  # untimed forwards before each level's timed ones
CONFIRM_DUALS = 2  # runner-up duals the final runs measure on every prompt (a few grid prompts do not separate them)


def _say(msg: str) -> None:
    from polyspec.console import say

    say(msg)


def level_names(folders: list[Path]) -> tuple[list[str], list[str]]:
    """(names, tags): names are target, intermediate (or intermediate1, 2, ...) and draft; tags are the folders'
    kinds (target, int4, model, head), numbered when repeated."""
    from polyspec.manifest import _classify

    n = len(folders)
    names = ["target", *(["intermediate"] if n == 3 else [f"intermediate{i}" for i in range(1, n - 1)]), "draft"]
    kinds = ["target", *(_classify(f)[0] for f in folders[1:])]
    tags = [k if kinds.count(k) == 1 else f"{k}_{kinds[:i + 1].count(k)}" for i, k in enumerate(kinds)]
    return names, tags


def folder_digest(folder: Path) -> str:
    """sha256 over the (relative path, sha256) pairs of every file below ``folder`` (its hash record left out, so a
    folder keeps its digest when the record is added on its first reuse)."""
    from polyspec.fsutil import file_hashes

    folder = Path(folder)
    if not folder.is_dir():
        raise PolyspecError(f"{folder} is not a folder")
    return hashlib.sha256(json.dumps(file_hashes(folder), sort_keys=True).encode()).hexdigest()


def stamps() -> dict[str, Any]:
    """Software and hardware stamps, the CPU kernels' build (its row kernels and prefetch hint are chosen per CPU),
    plus the machine's load average at this moment (other work skews timings)."""
    from polyspec.decode import cpu_kernels
    from polyspec.stamp import hardware_stamp, software_stamp

    try:
        load = list(os.getloadavg())
    except OSError:
        load = None
    return {"software": software_stamp(), "hardware": hardware_stamp(), "cpu_kernels": cpu_kernels.state(),
            "load_average": load}


# ---------------------------------------------------------------------------------------------------------------------
# Finding and loading the levels


def make_untrained_head(target_dir: Path, out_dir: Path, seed: int = 0) -> Path:
    """A randomly initialised (untrained) EAGLE head for ``target_dir`` — for measurements before training exists."""
    import torch

    from polyspec.decode.head import EagleHead, save_head
    from polyspec.decode.model import Transformer

    target = Transformer.from_pretrained(Path(target_dir))
    torch.manual_seed(seed)
    head = EagleHead(target.args, target.embed_tokens, target.lm_head)
    # no training targets: all counts 0, so a draft vocabulary (timing only, like the head) is the lowest ids
    return save_head(head, out_dir, target_info={"source": str(Path(target_dir).name), "untrained": True,
                                                 "seed": seed},
                     token_counts=torch.zeros(target.args.vocab_size, dtype=torch.int64))


@dataclass
class LoadedLevels:
    levels: list[Any]  # ModelLevel / HeadLevel, top first
    tags: list[str]
    tokenizer: Any
    device: str
    dtype: str


def load_levels(folders: list[Path], *, device: str = "auto", dtype: str | None = None,
                draft_vocab: int = 0) -> LoadedLevels:
    """Load ``folders`` (target first) as chain levels; a head reads the target's embedding and lm_head, and
    ``draft_vocab`` > 0 restricts its logits to that many tokens (EagleHead.set_draft_vocab)."""
    from polyspec.decode import cpu_kernels, cuda_graphs
    from polyspec.decode.generate import GRAPH_WIDTH
    from polyspec.decode.head import load_head
    from polyspec.decode.levels import HeadLevel, ModelLevel
    from polyspec.decode.model import Transformer
    from polyspec.device import resolve_device, resolve_dtype
    from polyspec.sources import load_tokenizer

    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    name = str(torch_dtype).removeprefix("torch.")
    names, tags = level_names(folders)
    models: dict[str, Any] = {}
    for nm, tag, folder in zip(names, tags, folders, strict=True):
        if tag.startswith("head"):
            models[nm] = load_head(folder, models["target"]).to(dev).eval()
            models[nm].set_draft_vocab(draft_vocab)
        else:
            models[nm] = Transformer.from_pretrained(folder, dtype=torch_dtype, device=dev).eval()
        cpu_kernels.pack_weights(models[nm], int8_inputs=nm != "target")  # as load_chain packs them
    cuda_graphs.enable_for_device(models, dev, max_width=GRAPH_WIDTH)
    levels = [HeadLevel(m, nm) if tg.startswith("head") else ModelLevel(m, nm)
              for (nm, m), tg in zip(models.items(), tags, strict=True)]
    return LoadedLevels(levels=levels, tags=tags, tokenizer=load_tokenizer(folders[0]), device=str(dev), dtype=name)


# ---------------------------------------------------------------------------------------------------------------------
# Profile


def profile_key(folders: list[Path], settings: dict[str, Any]) -> str:
    blob = {"format": PROFILE_FORMAT, "levels": [folder_digest(f) for f in folders], "settings": settings}
    return hashlib.sha256(json.dumps(blob, sort_keys=True, default=str).encode()).hexdigest()


def _prompts(lv: LoadedLevels, count: int, data: Mapping[str, Any] | None,
             prompt_ids: list[list[int]] | None, answer_tokens: int) -> tuple[list[list[int]], list[dict[str, Any]]]:
    """Calibration prompts as token ids and where each came from (``prompt_ids`` given: used as they are); an MT-bench
    second turn follows the target's own greedy answer of up to ``answer_tokens`` tokens to the first."""
    if prompt_ids is not None:
        return prompt_ids, [{"source": "given", "id": i, "tokens": len(x)} for i, x in enumerate(prompt_ids)]
    import torch

    from polyspec.decode.chain import ChainDecoder
    from polyspec.decode.generate import eos_ids
    from polyspec.export.prompts import calibration_prompts

    def answer(ids: list[int]) -> str:
        dec = ChainDecoder(lv.levels[:1], max_seq_len=len(ids) + answer_tokens + 8)
        with torch.inference_mode():
            new = dec.generate(ids, answer_tokens, eos_token_ids=eos_ids(lv.tokenizer)).token_ids
        return lv.tokenizer.decode(new, skip_special_tokens=True)

    d = data or {}
    cal = calibration_prompts(lv.tokenizer, count, data_source=d.get("source"),
                              max_conversations=d.get("max_conversations"),
                              heldout_fraction=d.get("heldout_fraction", 0.02), seed=d.get("seed", 0), answer=answer)
    return [c["input_ids"] for c in cal], [{"source": c["source"], "id": c["id"], "tokens": len(c["input_ids"])}
                                           for c in cal]


def pick_dtype(target: Path, device: str, settings: ProfileSettings, say: Say = _say) -> tuple[str, dict]:
    """``target.dtype: auto``: time the target's forward in each of :func:`~polyspec.device.decode_dtype_candidates`
    at width 1 (what ``ar`` and every draft step of the levels above run) and at the widest linear verification
    (max draft_k + 1); returns the dtype with the least summed time and the table {dtype: {width: median seconds}}."""
    import torch

    from polyspec.decode import cpu_kernels
    from polyspec.decode.generate import load_model
    from polyspec.decode.levels import ModelLevel
    from polyspec.device import decode_dtype_candidates, resolve_device
    from polyspec.export.timing import time_forwards

    dev = resolve_device(device)
    widths = sorted({1, max(settings.draft_ks, default=4) + 1})
    table: dict[str, dict[int, float]] = {}
    for name in decode_dtype_candidates(dev):
        model = load_model(Path(target), dtype=getattr(torch, name), device=dev).eval()
        cpu_kernels.pack_weights(model)
        level = ModelLevel(model, "target")
        with torch.inference_mode():
            rows = time_forwards(level, widths, settings.kv_length, warmup=settings.warmup, repeats=settings.repeats,
                                 vocab_size=model.args.vocab_size)
            table[name] = {r.width: r.median_s for r in rows}
        del model, level
    best = min(table, key=lambda n: sum(table[n].values()))
    say("profile: target dtype auto -> " + best + " (" + "; ".join(
        f"{n}: " + ", ".join(f"T({w}) {t * 1000:.1f} ms" for w, t in row.items()) for n, row in table.items()) + ")")
    return best, table


def profile_folders(parts: Parts, out_dir: Path, settings: ProfileSettings, *, prompts: int = 8,
                    device: str = "auto", dtype: str | None = None, data: Mapping[str, Any] | None = None,
                    prompt_ids: list[list[int]] | None = None, notes: dict[str, Any] | None = None,
                    key: str | None = None, threads: int | None = None, say: Say = _say,
                    draft_vocab: int = 0) -> Profile:
    """Profile the chain made of ``parts`` and write ``out_dir`` atomically (see :mod:`polyspec.export.report`).

    ``prompt_ids``: calibration prompts as token ids (tests); default: ``prompts`` from MT-bench and the held-out
    side of ``data`` ({"source", "max_conversations", "heldout_fraction", "seed"}). ``draft_vocab``: the head's draft
    vocabulary size (0: the full vocabulary). ``threads``: torch intra-op threads while profiling (None: leave as is;
    on a CPU shared with other work, 1 gives far steadier timings than oversubscribed threads).
    """
    import torch

    from polyspec.decode.generate import eos_ids
    from polyspec.export.profile import profile_levels
    from polyspec.export.report import write_profile

    t0, before = time.perf_counter(), stamps()
    old_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(int(threads))
    try:
        folders = ordered_parts(parts)
        if dtype == "auto":
            dtype, probe = pick_dtype(folders[0], device, settings, say)
            notes = {**(notes or {}), "dtype_probe": {n: {str(w): t for w, t in row.items()}
                                                      for n, row in probe.items()}}
        lv = load_levels(folders, device=device, dtype=dtype, draft_vocab=draft_vocab)
        ids, sources = _prompts(lv, prompts, data, prompt_ids, settings.max_new_tokens)
        say(f"profile: {len(ids)} calibration prompts, {settings.max_new_tokens} new tokens each, device {lv.device} "
            f"({lv.dtype}), torch threads {torch.get_num_threads()}")
        s = replace(settings, eos_ids=frozenset(eos_ids(lv.tokenizer)))
        with torch.inference_mode():
            p = profile_levels(lv.levels, ids, s, tags=lv.tags, say=say)
        threads_used = torch.get_num_threads()
    finally:
        torch.set_num_threads(old_threads)
    for info, folder in zip(p.levels, folders, strict=True):
        info.folder = str(folder)
    p.key, p.device, p.dtype, p.torch_threads = key, lv.device, lv.dtype, threads_used
    p.prompt_sources, p.notes, p.seconds = sources, {**p.notes, **(notes or {})}, time.perf_counter() - t0
    p.stamps = {**stamps(), "load_average_before": before["load_average"]}
    write_profile(out_dir, p)
    p.path = str(out_dir)
    return p


def search_folders(parts: Parts, out_dir: Path, settings: Any, cand: Any, *, prompts: int = 8,
                   device: str = "auto", dtype: str | None = None, data: Mapping[str, Any] | None = None,
                   prompt_ids: list[list[int]] | None = None, threads: int | None = None, say: Say = _say,
                   draft_vocab: int = 0, key: str | None = None) -> Search:
    """The chain search (:func:`polyspec.export.search.search_chain`) over the levels of ``parts`` (target first;
    the others are candidates) and those made from the target (``cand``: a CandidateSettings); writes ``out_dir``
    (search.json, search.md) atomically and returns the :class:`~polyspec.export.results.Search`. Arguments as
    :func:`profile_folders`; ``settings``: a SearchSettings; ``key``: what keys the stored search (its notes)."""
    import torch

    from polyspec.decode.generate import eos_ids
    from polyspec.export.candidates import make_candidates
    from polyspec.export.report import write_search
    from polyspec.export.search import search_chain

    t0, old_threads = time.perf_counter(), torch.get_num_threads()
    if threads:
        torch.set_num_threads(int(threads))
    try:
        folders = ordered_parts(parts)
        if dtype == "auto":
            dtype, _ = pick_dtype(folders[0], device, settings.profile, say)
        lv = load_levels(folders, device=device, dtype=dtype, draft_vocab=draft_vocab)
        ids, _ = _prompts(lv, prompts, data, prompt_ids, settings.profile.max_new_tokens)
        cands = make_candidates(lv.levels[0], list(zip(lv.tags[1:], lv.levels[1:], strict=True)), cand)
        say(f"search: {len(ids)} prompts, candidates " + ", ".join(c.name for c in cands))
        s = replace(settings, profile=replace(settings.profile, eos_ids=frozenset(eos_ids(lv.tokenizer))))
        with torch.inference_mode():
            result = search_chain(lv.levels[0], cands, ids, s, say=say)
    finally:
        torch.set_num_threads(old_threads)
    result.device, result.dtype, result.seconds = lv.device, lv.dtype, time.perf_counter() - t0
    result.stamps, result.notes = stamps(), {**result.notes, **({"key": key} if key else {})}
    write_search(Path(out_dir), result)
    return result


def search_stage(p: Any, *, levels: list[Path], workdir: Path, device: str, dtype: str | None, draft: DraftSpec,
                 data: Any, threads: int | None = None, say: Say = _say) -> Search:
    """The chain search (``profile.search``, ``polyspec profile --search``) over ``levels`` (target first; the
    others are candidates) at the recipe's profile section ``p``, on ``device`` / ``dtype``, the draft's vocabulary
    and the ``data`` section's held-out prompts; writes ``<workdir>/profile/search`` unless that folder already holds
    the search of these inputs (its files intact). Returns the search (its folder in ``path``)."""
    from polyspec.export.candidates import CandidateSettings
    from polyspec.export.search import SearchSettings

    levels = ordered_parts(levels)
    settings, keyed = _settings(p, draft, device, dtype, data, threads)
    ss = SearchSettings(profile=replace(settings, tree=None))
    cs = CandidateSettings(lookup=bool(settings.lookups))
    key = profile_key(levels, {**keyed, "search": repr((ss.max_levels, ss.mus, cs))})
    out = Path(workdir) / "profile" / "search"
    stored = _stored_search(out, say)
    if stored is not None and stored.notes.get("key") == key:
        say(f"search: the search of these inputs already exists: {out}")
        return stored
    s = search_folders(levels, out, ss, cs, prompts=p.prompts, device=device, dtype=dtype, threads=threads,
                       draft_vocab=draft.vocab, say=say, data=_calibration_data(data), key=key)
    s.path = str(out)
    return s


def _stored_search(out_dir: Path, say: Say) -> Search | None:
    """The search stored in ``out_dir`` when its files match their hashes (None: none, or damaged)."""
    from polyspec.export.report import read_search
    from polyspec.fsutil import damage_note, verify_output

    if not (out_dir / "search.json").is_file():
        return None
    damage = verify_output(out_dir)
    if damage:
        say(f"search: {damage_note(out_dir, damage)}")
        return None
    return read_search(out_dir)


def _calibration_data(d: Any) -> dict[str, Any]:
    return {"source": d.source, "max_conversations": d.max_conversations, "heldout_fraction": d.heldout_fraction,
            "seed": d.seed}


def _settings(p: Any, draft: DraftSpec, device: str, dtype: str | None, data: Any,
              threads: int | None) -> tuple[ProfileSettings, dict[str, Any]]:
    """The profile settings of the profile section ``p`` (and the draft, device, dtype and data they run with), and
    everything that keys the stored profile (on the CPU the kernels' build too)."""
    tree = draft.model_copy(update={"source": "model"}) if draft.tree is not None else None
    grid_prompts = p.grid_prompts or max(1, p.prompts // 4)
    s = ProfileSettings(max_new_tokens=p.max_new_tokens, kv_length=p.kv_length, warmup=WARMUP, repeats=p.repeats,
                        draft_ks=tuple(p.draft_k_grid), mus=tuple(p.mu_grid), grid_prompts=grid_prompts, tree=tree,
                        lookups=tuple(p.lookup_grid), confirm_duals=CONFIRM_DUALS, vocab=draft.vocab)
    keyed = {"profile": p.model_dump(mode="json", exclude={"search"}), "device": device, "dtype": dtype,
             "grid_prompts": grid_prompts, "warmup": WARMUP, "confirm_duals": CONFIRM_DUALS,
             "tree": tree.text() if tree is not None else None, "vocab": draft.vocab,
             "data": data.model_dump(mode="json"), "threads": threads, "calibration": CALIBRATION_FORMAT,
             "cpu_kernels": _kernel_build(device)}
    return s, keyed


def _kernel_build(device: str) -> str | None:
    """The CPU kernels' build and settings (they set the CPU's timings: a profile of another build is not reused)."""
    if not device.startswith("cpu"):
        return None
    from polyspec.decode import cpu_kernels

    return cpu_kernels.state()


def profile_stage(p: Any, *, levels: list[Path], workdir: Path, device: str, dtype: str | None, draft: DraftSpec,
                  data: Any, tracker: Any = None, notes: dict[str, Any] | None = None, threads: int | None = None,
                  say: Say = _say) -> Profile:
    """Profile the chain of ``levels`` (target first) at the recipe's profile section ``p`` (see the module
    docstring), on ``device`` / ``dtype``, with the recipe's ``draft`` (its tree a candidate, its vocabulary) and
    the ``data`` section's held-out prompts, under ``<workdir>/profile``; returns the profile (its folder in
    ``path``). ``threads``: torch threads while profiling (default: unchanged)."""
    levels = ordered_parts(levels)
    settings, keyed = _settings(p, draft, device, dtype, data, threads)
    key = profile_key(levels, keyed)
    out_dir = Path(workdir) / "profile" / key[:16]
    cached = _stored_profile(out_dir, say)
    if cached is not None and cached.key == key:
        say(f"profile: measurements for these inputs already exist: {out_dir}")
        _log_profile(tracker, cached, out_dir, cached=True)
        return cached
    prof = profile_folders(levels, out_dir, settings, prompts=p.prompts, device=device, dtype=dtype, notes=notes,
                           key=key, threads=threads, draft_vocab=draft.vocab, say=say, data=_calibration_data(data))
    _log_profile(tracker, prof, out_dir, cached=False)
    return prof


def _stored_profile(out_dir: Path, say: Say) -> Profile | None:
    """The profile stored in ``out_dir`` when its files match their hashes (None: none, or damaged: redo it)."""
    from polyspec.export.report import read_profile
    from polyspec.fsutil import damage_note, verify_output

    if not out_dir.is_dir():
        return None
    damage = verify_output(out_dir)
    if damage:
        say(f"profile: {damage_note(out_dir, damage)}")
        return None
    return read_profile(out_dir)


def profile_metrics(p: Profile) -> dict[str, float]:
    """Flat scalar metrics of a profile for MLflow (the first insertion unprefixed, later ones by level name)."""
    from polyspec.export.report import summary_L

    L = summary_L(p)
    m = {"profile/L_i": L["L_i"], "profile/L_new": L["L_new"], "profile/L_i_new": L["L_i_new"],
         "profile/beta_dual": L["beta_dual"] or 0.0}
    for i, v in enumerate(p.insertions):
        pre = "profile/" if i == 0 else f"profile/{v.level}/"
        m |= {f"{pre}time_before_ms": v.time_before * 1e3, f"{pre}time_after_ms": v.time_after * 1e3,
              f"{pre}cond1": float(v.cond1_holds), f"{pre}cond2": float(v.cond2_holds), f"{pre}pays": float(v.pays)}
    m |= {f"profile/tps_{name}": c.tokens_per_second for name, c in p.final.items()}
    for name, row in p.speedup["wall"].configs.items():
        m[f"profile/speedup_pred_{name}"] = row.predicted
        m[f"profile/speedup_meas_{name}"] = row.measured
    return {k: float(x) for k, x in m.items() if x is not None}


def _log_profile(tracker: Any, p: Profile, out_dir: Path, cached: bool) -> None:
    if tracker is None:
        return
    tracker.log_metrics(profile_metrics(p))
    if hasattr(tracker, "set_tags"):
        tracker.set_tags({"polyspec.profile.dir": str(out_dir), "polyspec.profile.cached": str(cached)})
    tracker.log_artifact(out_dir, "profile")


# ---------------------------------------------------------------------------------------------------------------------
# Export


def export_stage(e: Any, *, levels: list[Path], decode: DecodeSpec, workdir: Path, profile: Profile | None = None,
                 search: Search | None = None, tracker: Any = None, log_model: bool = False,
                 register_as: str | None = None, say: Say = _say) -> Path:
    """Write the chain folder as the recipe's export section ``e`` says (``out``, default ``<workdir>/chain``;
    ``onnx``) and log it to MLflow as artifacts (``log_model``: also as an MLflow model, ``register_as`` named):
    given a ``search``, the chain it chose; else the chain of ``levels`` (target first) with the ``profile``'s
    decision. ``decode``: the recipe's DecodeSpec (its sampling defaults kept). Returns the chain folder."""
    from polyspec.export.package import check_onnx_head, export_chain, export_profiled, search_measurements, searched

    if (profile is None) == (search is None):
        raise PolyspecError("export needs the measurements of one chain: a profile or a search")
    levels = ordered_parts(levels)
    if e.onnx:
        check_onnx_head(levels[-1])
    out = Path(e.out) if e.out else Path(workdir) / "chain"
    t0 = time.perf_counter()
    if search is not None:
        with _scratch(Path(workdir)) as work:
            export_chain(out, _searched_folders(search, levels, work), searched(search, decode),
                         search_measurements(search), onnx=e.onnx, stamps=search.stamps, say=say)
    else:
        export_profiled(out, levels, profile, decode, onnx=e.onnx, say=say)
    say(f"export: chain written to {out} ({time.perf_counter() - t0:.1f} s)")
    _log_export(tracker, out)
    if log_model and tracker is not None and getattr(tracker, "enabled", False):
        _log_model(tracker, out, register_as, say)
    return out


def _searched_folders(s: Search, folders: list[Path], work: Path) -> list[Path]:
    """The folders of the chain the search chose (copies it made in memory written under ``work``)."""
    from polyspec.export.candidates import chosen_folders

    return chosen_folders(s.decision.levels, s.candidates, dict(zip(level_names(folders)[1], folders, strict=True)),
                          work)


@contextmanager
def _scratch(workdir: Path) -> Iterator[Path]:
    """A folder under ``workdir`` removed afterwards (level folders written only to be copied into a chain)."""
    workdir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".export-", dir=workdir))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _log_model(tracker: Any, out: Path, register_as: str | None, say: Say) -> None:
    from polyspec.export.mlflow_model import log_chain_model

    t0 = time.perf_counter()
    uri = log_chain_model(tracker, out, register_as=register_as)
    named = f", registered as {register_as!r}" if register_as else ""
    say(f"export: MLflow model {uri}{named} ({time.perf_counter() - t0:.1f} s)")


def _log_export(tracker: Any, out: Path) -> None:
    if tracker is None:
        return
    from polyspec.manifest import read_manifest

    m = read_manifest(out)
    onnx = m.measurements.get("onnx") or {}
    if onnx.get("max_abs_diff") is not None:
        tracker.log_metrics({"export/onnx_max_abs_diff": float(onnx["max_abs_diff"])})
    if hasattr(tracker, "set_tags"):
        tracker.set_tags({"polyspec.export.chain": str(out)})
    tracker.log_artifact(out / "manifest.json", "chain")
    head = next((lv for lv in m.levels if lv.kind == "head"), None)
    if head is not None:
        tracker.log_artifact(out / head.path, "chain")


if __name__ == "__main__":  # the older entry point, kept as a thin shim: python -m polyspec.export.stage VERB ...
    from polyspec.cli import main

    raise SystemExit(main(sys.argv[1:]))
