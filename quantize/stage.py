"""``quantize_stage(recipe)``: the pipeline's quantize stage (``polyspec quantize RECIPE``).

Resolves the target, draws the calibration samples from the recipe's ShareGPT training split through the target's
chat template, quantises (``quantize.method``; with gptq also the RTN baseline), measures the report and writes,
under ``<workdir>/quantize/<key>/``::

    model/         the int4 intermediate M2 (GPTQ format, polyspec_quantization.json inside)
    rtn/           the round-to-nearest baseline (method gptq only)
    report.json    quality + acceptance + speed (:mod:`polyspec.quantize.report`)
    polyspec-hashes.json  the sha256 of every file above, written last (polyspec.fsutil.write_file_hashes)

``<key>`` hashes the target's content id, the quantize settings and the calibration token ids, so a rerun with the
same inputs returns at once (after re-hashing the folder: a damaged one is removed and quantised again) and any
change makes a new folder. Returns the ``model/`` folder.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from polyspec.console import activity, say
from polyspec.device import device_name
from polyspec.errors import PolyspecError
from polyspec.fsutil import damage_note, discard_folder, verify_output, write_file_hashes, write_json

HELDOUT_SEQUENCES = 32  # held-out conversations scored for perplexity / agreement / KL (bounded for CPU runs)
REPORT_FILE = "report.json"
BITS = 4  # W4A16: the one width the engine, the Triton/CPU kernels and GPTQ loaders share


def quantize_stage(recipe: Any, tracker: Any = None, target_dir: Path | None = None) -> Path:
    """Quantise the recipe's target to W4A16 and report on it (see the module docstring); returns the int4 folder.

    tracker: a :class:`polyspec.tracking.Tracker` (or anything with log_metrics / log_artifact / log_params).
    target_dir: the resolved target folder when the caller already has it.
    """
    from polyspec.quantize.calibration import calibration_samples, recipe_conversations
    from polyspec.quantize.gptq import input_key, quantize_model, read_record
    from polyspec.quantize.report import build_report, flat_metrics
    from polyspec.sources import load_tokenizer, target_stage

    q = recipe.quantize
    target_dir = Path(target_dir) if target_dir is not None else target_stage(recipe)
    tokenizer = load_tokenizer(target_dir)
    split = recipe_conversations(recipe)
    t0 = time.perf_counter()
    calibration = calibration_samples(tokenizer, split.train, q.calibration_samples, q.calibration_length,
                                      seed=recipe.data.seed)
    calibration_s = time.perf_counter() - t0
    settings = {"method": q.method, "bits": BITS, "group_size": q.group_size, "sym": q.sym, "desc_act": q.desc_act,
                "damp_percent": q.damp_percent if q.method == "gptq" else None}
    key = input_key(target_dir, settings, calibration if q.method == "gptq" else None)
    root = Path(recipe.workdir) / "quantize" / key[:16]
    model_dir = root / "model"
    report_path = root / REPORT_FILE
    record = read_record(model_dir)
    if record is not None and record.get("key") == key and report_path.is_file():
        damage = verify_output(root)
        if not damage:
            _log(tracker, json.loads(report_path.read_text(encoding="utf-8")), report_path, flat_metrics, cached=True)
            return model_dir
        say(f"quantize: {damage_note(root, damage)}")
        discard_folder(root)  # the int4 folder would otherwise be reused by its recorded key

    root.mkdir(parents=True, exist_ok=True)
    cal_info = {"source": split.source, "train_conversations": len(split.train), "seed": recipe.data.seed,
                "chat_template": True}
    with activity(f"quantize: {q.method.upper()} int4 g{q.group_size} on {len(calibration)} calibration samples"):
        quantize_model(target_dir, model_dir, method=q.method, bits=BITS, group_size=q.group_size, sym=q.sym,
                       desc_act=q.desc_act, damp_percent=q.damp_percent, calibration=calibration, device=q.devices,
                       calibration_info=cal_info)
    int4_dirs = {q.method: model_dir}
    if q.method == "gptq":
        int4_dirs["rtn"] = quantize_model(target_dir, root / "rtn", method="rtn", bits=BITS,
                                          group_size=q.group_size, sym=q.sym)
    if not split.heldout:
        raise PolyspecError("the quality report needs held-out conversations: set data.heldout_fraction > 0")
    with activity("quantize: report (quality, acceptance, speed)"):
        report = build_report(
            target_dir, int4_dirs, tokenizer, split.heldout, device=device_name(recipe.target.device),
            dtype=recipe.target.dtype, max_length=recipe.data.max_length, max_sequences=HELDOUT_SEQUENCES,
            prompts=recipe.profile.prompts, max_new_tokens=recipe.profile.max_new_tokens,
            draft_k=recipe.decode.draft.k, kv_length=recipe.profile.kv_length, repeats=recipe.profile.repeats,
        )
    record = read_record(model_dir) or {}
    report.update({
        "key": key,
        "target_dir": str(target_dir),
        "int4_dirs": {k: str(v) for k, v in int4_dirs.items()},
        "settings": settings,
        "calibration": {"samples": len(calibration), "length": q.calibration_length, "seconds": calibration_s,
                        **cal_info},
        "quantize_seconds": (record.get("run") or {}).get("seconds"),
        "group_layout": {k: v for k, v in (record.get("group_layout") or {}).items() if k != "layers"},
    })
    write_json(report_path, report)
    write_file_hashes(root)  # last: the stage is complete (and checked on every reuse) once this record exists
    _log(tracker, report, report_path, flat_metrics, cached=False)
    return model_dir


def _log(tracker: Any, report: dict[str, Any], path: Path, flat_metrics: Any, cached: bool) -> None:
    if tracker is None:
        return
    metrics = flat_metrics(report)
    if report.get("quantize_seconds") is not None:
        metrics["quantize.seconds"] = float(report["quantize_seconds"])
    tracker.log_metrics(metrics)
    if hasattr(tracker, "log_params"):
        tracker.log_params({"quantize.key": report.get("key"), "quantize.cached": cached})
    tracker.log_artifact(path)
