"""``quantize_stage(recipe.quantize, ...)``: the pipeline's quantize stage (``polyspec quantize RECIPE``).

Draws the calibration samples from the recipe's ShareGPT training split through the target's
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from polyspec.console import activity, say
from polyspec.device import device_name
from polyspec.errors import PolyspecError
from polyspec.fsutil import damage_note, discard_folder, verify_output, write_file_hashes, write_json

HELDOUT_SEQUENCES = 32  # held-out conversations scored for perplexity / agreement / KL (bounded for CPU runs)
REPORT_FILE = "report.json"
BITS = 4  # W4A16: the one width the engine, the Triton/CPU kernels and GPTQ loaders share


@dataclass(frozen=True)
class ReportSettings:
    """How the quality report measures: on the target's device and dtype, held-out sequences up to the data's
    max_length, and (the profile's counts, the draft's k) the acceptance and speed of the int4 copy under the
    target."""

    device: str = "auto"
    dtype: str | None = None
    max_length: int = 2048
    prompts: int = 16
    max_new_tokens: int = 64
    draft_k: int = 4
    kv_length: int = 512
    repeats: int = 10

    @classmethod
    def of(cls, recipe: Any) -> ReportSettings:
        """A recipe's: its target, data, profile and decode sections."""
        p = recipe.profile
        return cls(device=recipe.target.device, dtype=recipe.target.dtype, max_length=recipe.data.max_length,
                   prompts=p.prompts, max_new_tokens=p.max_new_tokens, draft_k=recipe.decode.draft.k,
                   kv_length=p.kv_length, repeats=p.repeats)


def quantize_stage(q: Any, *, target_dir: Path, workdir: Path, data: Any, report: ReportSettings | None = None,
                   tracker: Any = None) -> Path:
    """Quantise the target in ``target_dir`` to W4A16 as the recipe's quantize section ``q`` says, under
    ``<workdir>/quantize``, calibrated on the training side of the ``data`` section's split, and report on it (see
    the module docstring); returns the int4 folder.

    tracker: a :class:`polyspec.tracking.Tracker` (or anything with log_metrics / log_artifact / log_params).
    """
    from polyspec.quantize.calibration import calibration_samples, data_conversations
    from polyspec.quantize.gptq import input_key, quantize_model, read_record
    from polyspec.sources import load_tokenizer

    target_dir = Path(target_dir)
    tokenizer = load_tokenizer(target_dir)
    split = data_conversations(data)
    t0 = time.perf_counter()
    calibration = calibration_samples(tokenizer, split.train, q.calibration_samples, q.calibration_length,
                                      seed=data.seed)
    calibration_s = time.perf_counter() - t0
    settings = {"method": q.method, "bits": BITS, "group_size": q.group_size, "sym": q.sym, "desc_act": q.desc_act,
                "damp_percent": q.damp_percent if q.method == "gptq" else None}
    key = input_key(target_dir, settings, calibration if q.method == "gptq" else None)
    root = Path(workdir) / "quantize" / key[:16]
    model_dir = root / "model"
    if _reused(root, key, tracker):
        return model_dir
    root.mkdir(parents=True, exist_ok=True)
    cal_info = {"source": split.source, "train_conversations": len(split.train), "seed": data.seed,
                "chat_template": True}
    with activity(f"quantize: {q.method.upper()} int4 g{q.group_size} on {len(calibration)} calibration samples"):
        quantize_model(target_dir, model_dir, method=q.method, bits=BITS, group_size=q.group_size, sym=q.sym,
                       desc_act=q.desc_act, damp_percent=q.damp_percent, calibration=calibration, device=q.devices,
                       calibration_info=cal_info)
    int4_dirs = {q.method: model_dir}
    if q.method == "gptq":
        int4_dirs["rtn"] = quantize_model(target_dir, root / "rtn", method="rtn", bits=BITS,
                                          group_size=q.group_size, sym=q.sym)
    report = _measure(report or ReportSettings(), target_dir, int4_dirs, tokenizer, split.heldout)
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
    report_path = root / REPORT_FILE
    write_json(report_path, report)
    write_file_hashes(root)  # last: the stage is complete (and checked on every reuse) once this record exists
    _log(tracker, report, report_path, cached=False)
    return model_dir


def _reused(root: Path, key: str, tracker: Any) -> bool:
    """Whether ``root`` holds this key's complete, intact output (then logged as cached); a damaged one is removed
    (its int4 folder would otherwise be reused by its recorded key)."""
    from polyspec.quantize.gptq import read_record

    record = read_record(root / "model")
    report_path = root / REPORT_FILE
    if record is None or record.get("key") != key or not report_path.is_file():
        return False
    damage = verify_output(root)
    if not damage:
        _log(tracker, json.loads(report_path.read_text(encoding="utf-8")), report_path, cached=True)
        return True
    say(f"quantize: {damage_note(root, damage)}")
    discard_folder(root)
    return False


def _measure(r: ReportSettings, target_dir: Path, int4_dirs: dict[str, Path], tokenizer: Any,
             heldout: list[Any]) -> dict[str, Any]:
    """The quality report (quality, acceptance, speed) of ``int4_dirs`` against the target on the held-out
    conversations."""
    from polyspec.quantize.report import build_report

    if not heldout:
        raise PolyspecError("the quality report needs held-out conversations: set data.heldout_fraction > 0")
    with activity("quantize: report (quality, acceptance, speed)"):
        return build_report(
            target_dir, int4_dirs, tokenizer, heldout, device=device_name(r.device), dtype=r.dtype,
            max_length=r.max_length, max_sequences=HELDOUT_SEQUENCES, prompts=r.prompts,
            max_new_tokens=r.max_new_tokens, draft_k=r.draft_k, kv_length=r.kv_length, repeats=r.repeats,
        )


def _log(tracker: Any, report: dict[str, Any], path: Path, cached: bool) -> None:
    if tracker is None:
        return
    from polyspec.quantize.report import flat_metrics

    metrics = flat_metrics(report)
    if report.get("quantize_seconds") is not None:
        metrics["quantize.seconds"] = float(report["quantize_seconds"])
    tracker.log_metrics(metrics)
    if hasattr(tracker, "log_params"):
        tracker.log_params({"quantize.key": report.get("key"), "quantize.cached": cached})
    tracker.log_artifact(path)
