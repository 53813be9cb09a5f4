"""The pipeline's profile and export stages, and ``python -m polyspec.export.stage profile|export RECIPE``.

``profile_stage(recipe)`` measures the chain target <- int4 <- head (T_i, L_i, verdicts, decision; see
:func:`polyspec.export.profile.profile_models`) and writes ``<workdir>/profile/<key>/``::

    profile.json            everything, with the software and hardware stamps
    tables/*.json           costs, acceptance, grid, verdict, speedup, variance: each with the same stamps
    verdict.md              the verdict table as Markdown (what ``make demo`` prints)
    insertion_region.png    cond1 / cond2 / exact boundaries with every candidate as a point
    acceptance_hist.png     acceptance-length distributions with the exact min(G, n) pmf at the fitted alpha

``<key>`` hashes the three level folders' contents, the profile section, the decode grid and the prompts setting,
so a rerun with the same inputs returns the stored profile at once. ``export_stage(recipe)`` profiles (or reuses the
profile), then writes the chain folder (default ``<workdir>/chain``) atomically: levels, the draft head also as ONNX
(inside the head's level folder, so the manifest hashes it), and a manifest carrying the measurements and verdicts.

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
from pathlib import Path
from typing import Any

from polyspec.errors import PolyspecError
from polyspec.fsutil import atomic_folder

PROFILE_FORMAT = 2  # 2: the decision also falls back to ar when ar measured at least as fast
MEASUREMENTS_SCHEMA = "polyspec.measurements/1"
DRAFT_KS: tuple[int, ...] = (2, 3, 4, 5)
MUS: tuple[int, ...] = (4, 6, 8, 12)
PROFILE_JSON = "profile.json"


# ---------------------------------------------------------------------------------------------------------------------
# Small helpers


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _write_json(path: Path, data: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(json.dumps(data, indent=1, sort_keys=False, default=_json_default) + "\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
    return path


def _json_default(o: Any) -> Any:
    if isinstance(o, Path):
        return str(o)
    if isinstance(o, set):
        return sorted(o)
    raise TypeError(f"not JSON-serialisable: {type(o).__name__}")


def folder_digest(folder: Path) -> str:
    """sha256 over the (relative path, sha256) pairs of every file below ``folder``."""
    from polyspec.manifest import hash_folder

    folder = Path(folder)
    if not folder.is_dir():
        raise PolyspecError(f"{folder} is not a folder")
    return hashlib.sha256(json.dumps(hash_folder(folder), sort_keys=True).encode()).hexdigest()


def stamps() -> dict[str, Any]:
    """Software and hardware stamps plus the machine's load average at this moment (other work skews timings)."""
    from polyspec.stamp import hardware_stamp, software_stamp

    try:
        load = list(os.getloadavg())
    except OSError:
        load = None
    return {"software": software_stamp(), "hardware": hardware_stamp(), "load_average": load}


# ---------------------------------------------------------------------------------------------------------------------
# Finding the levels


def resolve_parts(recipe: Any, tracker: Any = None) -> dict[str, Path]:
    """{"target", "int4", "head"} folders for a recipe, from the pipeline's target, quantize and train stages."""
    import importlib

    from polyspec.pipeline import target_stage

    parts = {"target": Path(target_stage(recipe))}
    for name, module, fn in (("int4", "polyspec.quantize", "quantize_stage"), ("head", "polyspec.train", "train_stage")):
        mod = importlib.import_module(module)
        if not hasattr(mod, fn):
            raise PolyspecError(f"profiling needs the {name} level, made by {module}.{fn}, which this polyspec does "
                                f"not provide yet; pass explicit folders (python -m polyspec.export.stage profile "
                                f"RECIPE --{name} DIR)")
        parts[name] = Path(getattr(mod, fn)(recipe))
    return parts


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


# ---------------------------------------------------------------------------------------------------------------------
# Profile


def profile_key(parts: dict[str, Path], settings: dict[str, Any]) -> str:
    blob = {"format": PROFILE_FORMAT, "levels": {k: folder_digest(v) for k, v in sorted(parts.items())},
            "settings": settings}
    return hashlib.sha256(json.dumps(blob, sort_keys=True, default=_json_default).encode()).hexdigest()


def _why_ar(dec: dict[str, Any]) -> str:
    why = [w for w, flag in (("predicted", dec.get("ar_predicted_faster")),
                             ("measured", dec.get("ar_measured_faster"))) if flag]
    return "plain decoding is " + " and ".join(why) + " faster here" if why else "plain decoding"


def load_levels(parts: dict[str, Path], *, device: str = "auto", dtype: str | None = None,
                draft_vocab: int = 0) -> dict[str, Any]:
    """{"target": Transformer, "int4": Transformer, "head": EagleHead, "tokenizer", "device", "dtype"};
    ``draft_vocab`` > 0 restricts the head's logits to that many tokens (EagleHead.set_draft_vocab)."""
    from polyspec.decode import cpu_kernels, cuda_graphs
    from polyspec.decode.generate import DTYPES, GRAPH_WIDTH, resolve_device
    from polyspec.decode.head import load_head
    from polyspec.decode.model import Transformer
    from polyspec.sources import load_tokenizer

    dev = resolve_device(device)
    name = dtype or ("bfloat16" if dev.type == "cuda" else "float32")
    if name not in DTYPES:
        raise PolyspecError(f"dtype {name!r} is not one of {sorted(DTYPES)}")
    target = Transformer.from_pretrained(parts["target"], dtype=DTYPES[name], device=dev).eval()
    int4 = Transformer.from_pretrained(parts["int4"], dtype=DTYPES[name], device=dev).eval()
    head = load_head(parts["head"], target).to(dev).eval()
    head.set_draft_vocab(draft_vocab)
    for model in (target, int4, head):  # as load_chain does: CPU weights in read order, one block each
        cpu_kernels.pack_weights(model)
    cuda_graphs.enable_for_device({"target": target, "int4": int4, "head": head}, dev, max_width=GRAPH_WIDTH)
    return {"target": target, "int4": int4, "head": head, "tokenizer": load_tokenizer(parts["target"]),
            "device": str(dev), "dtype": name}


def profile_folders(parts: dict[str, Path], out_dir: Path, *, prompts: int, max_new_tokens: int, kv_length: int,
                    warmup: int, repeats: int, device: str = "auto", dtype: str | None = None,
                    draft_ks: tuple[int, ...] = DRAFT_KS, mus: tuple[int, ...] = MUS, grid_prompts: int | None = None,
                    data: dict[str, Any] | None = None, prompt_ids: list[list[int]] | None = None,
                    notes: dict[str, Any] | None = None, key: str | None = None, threads: int | None = None,
                    tree: Any = None, say: Any = _say, draft_vocab: int = 0) -> dict[str, Any]:
    """Profile the chain made of ``parts`` and write ``out_dir`` atomically (see the module docstring).

    ``prompt_ids``: calibration prompts as token ids (tests); default: :func:`calibration_prompts` from MT-bench and
    the held-out side of ``data`` ({"source", "max_conversations", "heldout_fraction", "seed"}).
    ``tree``: TreeParams of an EAGLE-2 draft tree to weigh against linear drafts (None: linear drafts only).
    ``draft_vocab``: the head's draft vocabulary size (0: the full vocabulary).
    ``threads``: torch intra-op threads while profiling (None: leave as is). On a CPU shared with other work, 1 gives
    far steadier timings than oversubscribed threads; the number used is recorded.
    """
    import torch


    t0 = time.perf_counter()
    stamp_before = stamps()
    old_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(int(threads))
    try:
        return _profile_folders(parts, out_dir, t0, stamp_before, prompts=prompts, max_new_tokens=max_new_tokens,
                                kv_length=kv_length, warmup=warmup, repeats=repeats, device=device, dtype=dtype,
                                draft_ks=draft_ks, mus=mus, grid_prompts=grid_prompts, data=data,
                                prompt_ids=prompt_ids, notes=notes, key=key, tree=tree, say=say,
                                draft_vocab=draft_vocab)
    finally:
        torch.set_num_threads(old_threads)


def _profile_folders(parts: dict[str, Path], out_dir: Path, t0: float, stamp_before: dict[str, Any], *,
                     prompts: int, max_new_tokens: int, kv_length: int, warmup: int, repeats: int, device: str,
                     dtype: str | None, draft_ks: tuple[int, ...], mus: tuple[int, ...], grid_prompts: int | None,
                     data: dict[str, Any] | None, prompt_ids: list[list[int]] | None, notes: dict[str, Any] | None,
                     key: str | None, say: Any, tree: Any = None, draft_vocab: int = 0) -> dict[str, Any]:
    import torch

    from polyspec.decode.generate import eos_ids
    from polyspec.export.profile import calibration_prompts, profile_models

    lv = load_levels(parts, device=device, dtype=dtype, draft_vocab=draft_vocab)
    if prompt_ids is None:
        d = data or {}
        cal = calibration_prompts(lv["tokenizer"], prompts, data_source=d.get("source"),
                                  max_conversations=d.get("max_conversations"),
                                  heldout_fraction=d.get("heldout_fraction", 0.02), seed=d.get("seed", 0))
        prompt_ids = [c["input_ids"] for c in cal]
        prompt_info = [{"source": c["source"], "id": c["id"], "tokens": len(c["input_ids"])} for c in cal]
    else:
        prompt_info = [{"source": "given", "id": i, "tokens": len(p)} for i, p in enumerate(prompt_ids)]
    say(f"profile: {len(prompt_ids)} calibration prompts, {max_new_tokens} new tokens each, device {lv['device']} "
        f"({lv['dtype']}), torch threads {torch.get_num_threads()}")
    with torch.inference_mode():
        result = profile_models(lv["target"], lv["int4"], lv["head"], prompt_ids, max_new_tokens=max_new_tokens,
                                kv_length=kv_length, warmup=warmup, repeats=repeats, draft_ks=tuple(draft_ks),
                                mus=tuple(mus), grid_prompts=grid_prompts, eos_ids=eos_ids(lv["tokenizer"]), say=say,
                                tree=tree)
    st = stamps()
    st["load_average_before"] = stamp_before["load_average"]
    profile = {
        "format": PROFILE_FORMAT,
        "key": key,
        "parts": {k: str(v) for k, v in parts.items()},
        "device": lv["device"],
        "dtype": lv["dtype"],
        "torch_threads": torch.get_num_threads(),
        "prompt_sources": prompt_info,
        "notes": notes or {},
        **result,
        "seconds": time.perf_counter() - t0,
        "stamps": st,
    }
    write_profile(out_dir, profile)
    profile["path"] = str(out_dir)
    return profile


def verdict_markdown(profile: dict[str, Any]) -> str:
    """The verdict table: T, L, both conditions, predicted and measured speedups, with the stamps underneath."""
    v, dec, L = profile["verdict"], profile["decision"], profile["L"]
    inp = v["inputs"]
    sp = profile["speedup"]
    hw, sw = profile["stamps"]["hardware"], profile["stamps"]["software"]
    lines = [
        f"Chain profile ({profile['device']}, {profile['dtype']}, {profile['prompts']['count']} prompts x "
        f"{profile['prompts']['max_new_tokens']} tokens, KV length {profile['kv_length']})",
        "",
        "| quantity | value |",
        "|---|---|",
        f"| T_target / T_int4 / T_head (ms, chain widths) | {inp['T_i'] * 1e3:.2f} / {inp['T_new'] * 1e3:.2f} / "
        f"{inp['T_next'] * 1e3:.2f} |",
        f"| L_i (target over head, dual k={L['draft_k']}) | {L['L_i']:.3f} |",
        f"| L_new (int4 over head, k={L['draft_k']}) | {L['L_new']:.3f} |",
        f"| L_i_new (target over int4 blocks, mu={L['mu']}) | {L['L_i_new']:.3f} |",
        f"| beta (dual / chain) | {L['beta_dual']:.2f} / {(L['beta_chain'] or 0):.2f} |",
        f"| cond1: T_new/T_i < L_new(1/L_i - 1/L_i_new) | {v['cond1_lhs']:.3f} < {v['cond1_rhs']:.3f}: "
        f"{v['cond1_holds']} |",
        f"| cond2: T_new/T_next < beta(L_new/L_i - 1) | {v['cond2_lhs']:.3f} < {v['cond2_rhs']:.3f}: "
        f"{v['cond2_holds']} |",
        f"| valid regime L_i_new > L_new > L_i | {v['valid_regime']} |",
        f"| Lemma 3.1 ms/token before -> after | {v['time_before'] * 1e3:.2f} -> {v['time_after'] * 1e3:.2f} "
        f"(pays: {v['pays']}) |",
        f"| chosen | {dec['mode']}" + (f" ({_why_ar(dec)}); best speculative: "
                                        f"{dec.get('speculative_mode')}" if dec["mode"] == "ar" else "") + ", "
        + (f"tree {dec['tree']['top_k']}x{dec['tree']['depth']}/{dec['tree']['total_tokens']}" if dec.get("tree")
           else f"draft_k={dec['draft_k']}") + f", mu={dec['mu']} |",
    ]
    finals = profile["final"]
    for name, row in sp["wall"]["configs"].items():
        if name == "dual" or (name == "dual_at_chain_k" and finals.get(name, {}).get("label")
                              == finals.get("dual", {}).get("label")):
            continue  # dual over itself: 1 by definition
        steady = sp["steady"]["configs"].get(name, {})
        lines.append(f"| speedup {name} over dual: predicted / measured (wall) / measured (steady) | "
                     f"{row['predicted']:.3f} / {row['measured']:.3f} / {steady.get('measured', float('nan')):.3f} |")
    for name, c in finals.items():
        if name == "dual_at_chain_k" and c.get("label") == finals.get("dual", {}).get("label"):
            continue  # the same run as dual's
        lines.append(f"| tokens/s {name} ({c['label']}) | {c['tokens_per_second']:.2f} |")
    for name, vc in profile["variance"].items():
        if vc.get("count"):
            lines.append(f"| Var[accept] {name} (n={vc['n']}{', approx.' if vc['approximate'] else ''}): measured "
                         f"/ exact at alpha={vc['alpha']:.3f} | {vc['var_measured']:.3f} / {vc['var_theory']:.3f} |")
    lines += ["", f"Lossless (greedy outputs identical across ar/dual/chain): {profile['lossless_greedy']}",
              f"Hardware: {hw.get('cpu')}, {hw.get('logical_cores')} cores, CUDA "
              f"{'yes' if (hw.get('cuda') or {}).get('available') else 'no'}; load average "
              f"{profile['stamps'].get('load_average_before')} -> {profile['stamps'].get('load_average')}",
              f"Software: polyspec {sw.get('polyspec')} (git {str(sw.get('git_sha'))[:12]}"
              f"{', dirty' if sw.get('git_dirty') else ''}), torch {sw.get('packages', {}).get('torch')}"]
    return "\n".join(lines) + "\n"


def write_profile(out_dir: Path, profile: dict[str, Any]) -> Path:
    """profile.json, tables/*.json (each stamped), verdict.md and the two plots, written as one folder atomically."""
    from polyspec.export.plots import plot_acceptance_histograms, plot_insertion_region

    st = profile["stamps"]
    tables = {
        "costs": {"kv_length": profile["kv_length"], "warmup": profile["warmup"], "repeats": profile["repeats"],
                  "levels": profile["costs"]},
        "acceptance": {"L": profile["L"], "final": {k: {"label": c["label"], "per_level": c["per_level"],
                                                        "beta": c["beta"]} for k, c in profile["final"].items()}},
        "grid": {"rows": profile["grid"], "decision": profile["decision"]},
        "verdict": {"verdict": profile["verdict"], "candidates": profile["candidates"]},
        "speedup": profile["speedup"],
        "variance": profile["variance"],
    }

    def write(tmp: Path) -> None:
        _write_json(tmp / PROFILE_JSON, profile)
        for name, table in tables.items():
            _write_json(tmp / "tables" / f"{name}.json", {"stamps": st, **table})
        (tmp / "verdict.md").write_text(verdict_markdown(profile), encoding="utf-8")
        plot_insertion_region(profile["verdict"], profile["candidates"], tmp / "insertion_region.png")
        series = []
        for label, cfg, level in (("target over head (dual)", "dual_at_chain_k", "target"),
                                  ("int4 over head", "int4_over_head", "intermediate"),
                                  ("int4 over head (in chain)", "chain", "intermediate"),
                                  ("target over int4 (chain)", "chain", "target")):
            hist = profile["final"][cfg]["per_level"][level].get("accept_hist") or {}
            key = {"dual_at_chain_k": "dual_target", "int4_over_head": "int4_over_head"}.get(cfg) or (
                "chain_intermediate" if level == "intermediate" else "chain_target")
            vc = profile["variance"].get(key, {})
            series.append({"label": label, "hist": hist, "n": vc.get("n"), "alpha": vc.get("alpha")})
        plot_acceptance_histograms(series, tmp / "acceptance_hist.png")

    return atomic_folder(out_dir, write)


def read_profile(folder: Path) -> dict[str, Any] | None:
    path = Path(folder) / PROFILE_JSON
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None


def profile_stage(recipe: Any, tracker: Any = None, *, parts: dict[str, Path] | None = None,
                  draft_ks: tuple[int, ...] | None = None, mus: tuple[int, ...] | None = None,
                  grid_prompts: int | None = None, notes: dict[str, Any] | None = None, threads: int | None = None,
                  say: Any = _say) -> dict[str, Any]:
    """Profile the recipe's chain (see the module docstring); returns the profile dict (its folder under "path").

    ``parts``: explicit {"target", "int4", "head"} folders (default: from the target, quantize and train stages).
    ``grid_prompts``: prompts per grid point (default: a quarter of ``profile.prompts``, at least 1).
    """
    parts = {k: Path(v) for k, v in (parts or resolve_parts(recipe, tracker)).items()}
    p = recipe.profile
    device = p.device if p.device != "auto" else recipe.target.device
    draft_ks = tuple(draft_ks or p.draft_k_grid)
    mus = tuple(mus or p.mu_grid)
    threads = threads or p.threads
    grid_prompts = grid_prompts or p.grid_prompts or max(1, p.prompts // 4)
    tree = None
    if recipe.decode.tree.enabled:
        from polyspec.decode.generate import tree_params

        tree = tree_params(recipe.decode.tree)
    settings = {"profile": p.model_dump(mode="json"), "device": device, "dtype": recipe.target.dtype,
                "draft_ks": list(draft_ks), "mus": list(mus), "grid_prompts": grid_prompts,
                "tree": recipe.decode.tree.model_dump(mode="json") if tree is not None else None,
                "data": recipe.data.model_dump(mode="json"), "threads": threads}
    if recipe.decode.draft_vocab:  # (absent when 0, so profiles made before the setting keep their keys)
        settings["draft_vocab"] = recipe.decode.draft_vocab
    key = profile_key(parts, settings)
    out_dir = Path(recipe.workdir) / "profile" / key[:16]
    cached = read_profile(out_dir)
    if cached is not None and cached.get("key") == key:
        say(f"profile: measurements for these inputs already exist: {out_dir}")
        cached["path"] = str(out_dir)
        _log_profile(tracker, cached, out_dir, cached=True)
        return cached
    profile = profile_folders(
        parts, out_dir, prompts=p.prompts, max_new_tokens=p.max_new_tokens, kv_length=p.kv_length,
        warmup=p.warmup, repeats=p.repeats, device=device, dtype=recipe.target.dtype, draft_ks=draft_ks, mus=mus,
        grid_prompts=grid_prompts, notes=notes, key=key, threads=threads, tree=tree,
        draft_vocab=recipe.decode.draft_vocab,
        data={"source": recipe.data.source, "max_conversations": recipe.data.max_conversations,
              "heldout_fraction": recipe.data.heldout_fraction, "seed": recipe.data.seed}, say=say)
    _log_profile(tracker, profile, out_dir, cached=False)
    return profile


def profile_metrics(profile: dict[str, Any]) -> dict[str, float]:
    """Flat scalar metrics of a profile for MLflow."""
    v, L = profile["verdict"], profile["L"]
    m = {"profile/L_i": L["L_i"], "profile/L_new": L["L_new"], "profile/L_i_new": L["L_i_new"],
         "profile/beta_dual": L["beta_dual"] or 0.0, "profile/time_before_ms": v["time_before"] * 1e3,
         "profile/time_after_ms": v["time_after"] * 1e3, "profile/cond1": float(v["cond1_holds"]),
         "profile/cond2": float(v["cond2_holds"]), "profile/pays": float(v["pays"])}
    for name, c in profile["final"].items():
        m[f"profile/tps_{name}"] = c["tokens_per_second"]
    for name, row in profile["speedup"]["wall"]["configs"].items():
        m[f"profile/speedup_pred_{name}"] = row["predicted"]
        m[f"profile/speedup_meas_{name}"] = row["measured"]
    return {k: float(x) for k, x in m.items() if x is not None}


def _log_profile(tracker: Any, profile: dict[str, Any], out_dir: Path, cached: bool) -> None:
    if tracker is None:
        return
    tracker.log_metrics(profile_metrics(profile))
    if hasattr(tracker, "set_tags"):
        tracker.set_tags({"polyspec.profile.dir": str(out_dir), "polyspec.profile.cached": str(cached)})
    tracker.log_artifact(out_dir, "profile")


# ---------------------------------------------------------------------------------------------------------------------
# Export


def measurements_for_manifest(profile: dict[str, Any], onnx: dict[str, Any] | None) -> dict[str, Any]:
    """What the manifest's ``measurements`` carries: T and L tables, verdicts, decision, speedups, ONNX parity."""
    return {
        "schema": MEASUREMENTS_SCHEMA,
        "profile_key": profile.get("key"),
        "device": profile["device"],
        "dtype": profile["dtype"],
        "prompts": profile["prompts"],
        "kv_length": profile["kv_length"],
        "T": {name: [{k: r[k] for k in ("width", "median_s", "p10_s", "p90_s")} for r in rows]
              for name, rows in profile["costs"].items()},
        "L": profile["L"],
        "acceptance_hist": {nm: {lv: d.get("accept_hist") for lv, d in c["per_level"].items() if "accept_hist" in d}
                            for nm, c in profile["final"].items()},
        "grid": [{k: r[k] for k in ("label", "mode", "draft_k", "mu", "L", "beta", "predicted_time_per_token_s",
                                    "measured_tokens_per_second")} for r in profile["grid"]],
        "verdict": profile["verdict"],
        "candidates": profile["candidates"],
        "decision": profile["decision"],
        "tokens_per_second": {nm: c["tokens_per_second"] for nm, c in profile["final"].items()},
        "speedup": profile["speedup"],
        "variance": profile["variance"],
        "lossless_greedy": profile["lossless_greedy"],
        "notes": profile.get("notes", {}),
        "onnx": onnx,
    }


def export_chain(out: Path, parts: dict[str, Path], profile: dict[str, Any], decode: Any, *, onnx: bool = True,
                 opset: int = 18) -> Path:
    """Write the chain folder ``out`` atomically: target, int4 and head levels (the head with ``head.onnx``), and a
    manifest with the profile's measurements; the result is validated before it replaces ``out``.

    ``decode``: the DecodeConfig whose mode / draft_k / mu (and whether the tree is on) are replaced by the profile's
    decision.
    """
    from polyspec.manifest import assemble_chain, read_manifest, validate_chain, write_manifest
    from polyspec.stamp import hardware_stamp, software_stamp

    out = Path(out)
    dec = profile["decision"]
    # The tree stays on only when the profile chose it (a recipe's tree is a candidate, not an order).
    tree_cfg = decode.tree.model_copy(update={"enabled": bool(dec.get("tree"))})
    decode_cfg = decode.model_copy(update={"mode": dec["mode"], "draft_k": int(dec["draft_k"]),
                                           "mu": [int(m) for m in dec["mu"]], "tree": tree_cfg})

    def write(tmp: Path) -> None:
        head_dir = tmp / "parts" / "head"
        shutil.copytree(parts["head"], head_dir)
        onnx_info = None
        if onnx:
            onnx_info = _export_onnx(parts, head_dir, opset)
        chain = tmp / "chain"
        assemble_chain(chain, parts["target"], [parts["int4"]], head_dir, decode=decode_cfg)
        manifest = read_manifest(chain)
        manifest.measurements = measurements_for_manifest(profile, onnx_info)
        sw = software_stamp()
        manifest.stamps = {"software": sw, "hardware": hardware_stamp(), "git_sha": sw.get("git_sha"),
                           "packages": sw.get("packages"), "profile": profile.get("stamps")}
        write_manifest(chain, manifest)
        validate_chain(chain)
        for p in chain.iterdir():  # the chain's content becomes tmp's content
            os.replace(p, tmp / p.name)
        shutil.rmtree(tmp / "parts")
        chain.rmdir()

    return atomic_folder(out, write)


def check_onnx_head(head_dir: Path) -> None:
    """Refuse (before any work) an ONNX export of a head that onnx_head cannot write: an EAGLE-3 head."""
    from polyspec.decode.head import head_type, read_head_config

    kind = head_type(read_head_config(head_dir))
    if kind != "eagle":
        raise PolyspecError(f"ONNX export of an {kind} head ({head_dir}) is not supported yet; set export.onnx=false",
                            exit_code=2)


def _export_onnx(parts: dict[str, Path], head_dir: Path, opset: int) -> dict[str, Any]:
    """Export the head in ``head_dir`` (a copy being assembled) to ONNX next to its weights; parity-check it."""
    import torch

    from polyspec.decode.head import load_head
    from polyspec.decode.model import Transformer
    from polyspec.export.onnx_head import ONNX_FILE, export_head_onnx, onnx_parity

    t0 = time.perf_counter()
    target = Transformer.from_pretrained(parts["target"], dtype=torch.float32, device="cpu")
    check_onnx_head(head_dir)
    head = load_head(head_dir, target).eval()
    path = export_head_onnx(head, head_dir, opset=opset)
    parity = onnx_parity(head, path)
    files = sorted(p.name for p in head_dir.iterdir() if p.name.startswith(ONNX_FILE))
    return {"file": ONNX_FILE, "files": files, "opset": opset, "exporter": "torch.onnx.export(dynamo=True)",
            "inputs": {"input_ids": "int64 [batch, seq]", "features": "float32 [batch, seq, hidden]"},
            "outputs": {"logits": "float32 [batch, seq, vocab]", "hidden": "float32 [batch, seq, hidden]"},
            "seconds": time.perf_counter() - t0, **parity}


def export_stage(recipe: Any, tracker: Any = None, *, parts: dict[str, Path] | None = None,
                 profile: dict[str, Any] | None = None, say: Any = _say, **profile_kw: Any) -> Path:
    """Profile (or reuse the stored profile) and write the chain folder (``export.out``, default
    ``<workdir>/chain``); log it to MLflow as artifacts. Returns the chain folder."""
    parts = {k: Path(v) for k, v in (parts or resolve_parts(recipe, tracker)).items()}
    if recipe.export.onnx and "head" in parts:
        check_onnx_head(parts["head"])
    if profile is None:
        profile = profile_stage(recipe, tracker, parts=parts, say=say, **profile_kw)
    out = Path(recipe.export.out) if recipe.export.out else Path(recipe.workdir) / "chain"
    t0 = time.perf_counter()
    export_chain(out, parts, profile, recipe.decode, onnx=recipe.export.onnx, opset=recipe.export.opset)
    say(f"export: chain written to {out} ({time.perf_counter() - t0:.1f} s)")
    if tracker is not None:
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
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Entry point until the CLI wires `polyspec profile` / `polyspec export`


def _ints(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise PolyspecError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise PolyspecError(f"expected comma-separated integers >= 1, got {text!r}")
    return vals


def main(argv: list[str] | None = None) -> int:
    """``python -m polyspec.export.stage profile|export RECIPE [a.b=v ...] [--head DIR] [--int4 DIR] ...``"""
    import argparse

    from polyspec.config import load_recipe

    ap = argparse.ArgumentParser(prog="python -m polyspec.export.stage", description=__doc__.split("\n")[0])
    ap.add_argument("verb", choices=("profile", "export"))
    ap.add_argument("recipe")
    ap.add_argument("overrides", nargs="*", help="a.b=value recipe overrides")
    ap.add_argument("--head", help="draft head folder (default: the train stage's)")
    ap.add_argument("--int4", help="int4 GPTQ folder (default: the quantize stage's)")
    ap.add_argument("--untrained-head", action="store_true",
                    help="use a randomly initialised head (written under <workdir>/profile/untrained_head)")
    ap.add_argument("--rtn-int4", action="store_true",
                    help="use an RTN int4 copy of the target (written under <workdir>/profile/rtn_int4)")
    ap.add_argument("--draft-k", default=None, help="grid of draft_k values (default: profile.draft_k_grid)")
    ap.add_argument("--mu", default=None, help="grid of mu values (default: profile.mu_grid)")
    ap.add_argument("--grid-prompts", type=int, default=None, help="prompts per grid point")
    ap.add_argument("--threads", type=int, default=None, help="torch threads while profiling (1 on a busy CPU)")
    args = ap.parse_args(argv)
    try:
        recipe = load_recipe(args.recipe, args.overrides)
        parts, notes = _cli_parts(recipe, args)
        kw = {"draft_ks": _ints(args.draft_k) if args.draft_k else None,
              "mus": _ints(args.mu) if args.mu else None, "grid_prompts": args.grid_prompts,
              "notes": notes, "threads": args.threads}
        if args.verb == "profile":
            prof = profile_stage(recipe, parts=parts, **kw)
            print(Path(prof["path"], "verdict.md").read_text(encoding="utf-8"))
            print(f"profile folder: {prof['path']}")
        else:
            out = export_stage(recipe, parts=parts, **kw)
            print(f"chain folder: {out}")
    except PolyspecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code if hasattr(exc, "exit_code") else 1
    return 0


def _cli_parts(recipe: Any, args: Any) -> tuple[dict[str, Path] | None, dict[str, Any]]:
    notes: dict[str, Any] = {}
    if not (args.head or args.int4 or args.untrained_head or args.rtn_int4):
        return None, notes
    from polyspec.pipeline import target_stage

    target = Path(target_stage(recipe))
    work = Path(recipe.workdir) / "profile"
    if args.head:
        head = Path(args.head)
    elif args.untrained_head:
        head = work / "untrained_head"
        if not (head / "model.safetensors").is_file():
            make_untrained_head(target, head)
        notes["head"] = "untrained (random initialisation, seed 0)"
    else:
        head = Path(resolve_parts(recipe)["head"])
    if args.int4:
        int4 = Path(args.int4)
    elif args.rtn_int4:
        from polyspec.decode.int4 import save_int4_checkpoint

        int4 = work / "rtn_int4"
        if not (int4 / "config.json").is_file():
            save_int4_checkpoint(target, int4, group_size=recipe.quantize.group_size)
        notes["int4"] = f"RTN int4 g{recipe.quantize.group_size} (decode.int4.save_int4_checkpoint)"
    else:
        import importlib

        int4 = Path(importlib.import_module("polyspec.quantize").quantize_stage(recipe))
    return {"target": target, "int4": int4, "head": head}, notes


if __name__ == "__main__":
    raise SystemExit(main())
