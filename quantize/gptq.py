"""W4A16 quantisation of a Llama-family HF folder into a standard GPTQ checkpoint folder.

``quantize_model(model_dir, out_dir, method="gptq" | "rtn", ...)``:

* ``gptq``: calibrated GPTQ through GPTQModel (``GPTQModel.load(dir, QuantizeConfig(...))`` ->
  ``model.quantize(calibration)`` -> ``model.save(dir)``), the maintained successor of auto-gptq. Embeddings and
  lm_head stay unquantised (``QuantizeConfig.lm_head=False``), so do the norms.
* ``rtn``: round to nearest with polyspec's own :func:`polyspec.decode.int4.save_int4_checkpoint` (no calibration),
  the baseline GPTQ must beat.

Both write the same format: ``config.json`` with an HF ``quantization_config`` (quant_method gptq, bits 4,
checkpoint_format gptq = v1), ``model.safetensors`` with ``qweight`` / ``qzeros`` / ``scales`` / ``g_idx`` per linear,
the target's tokenizer and chat-template files, and ``polyspec_quantization.json``: the settings, the cache key of
the inputs, and the group layout of every quantised layer. Layers whose K is not a multiple of the group size (e.g.
K = 576 with group 128) are quantised with group size 128 and a short last group (GPTQModel 7.6 quantises columns
512..575 as their own group of 64; checked on the written tensors), then stored with the largest group that divides
every K (64), each scale repeated: the same weights, readable by vLLM and GPTQModel's kernels
(:mod:`polyspec.quantize.loaders`; both group sizes and each loader's verdict are recorded). The folder is written under a temporary name and renamed into place, and a folder
whose recorded key matches the inputs is reused (the key hashes the model's content id, every setting, the
calibration token ids and the GPTQModel version).
"""

from __future__ import annotations

import csv
import hashlib
import importlib.metadata
import json
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from polyspec.errors import PolyspecError, missing_extra
from polyspec.fsutil import swap_into_place, temp_folder
from polyspec.isolate import in_fresh_process
from polyspec.quantize.loaders import make_portable

FORMAT_VERSION = 2  # 2: stored with a group size dividing every K (quantize/loaders.py)
RECORD_FILE = "polyspec_quantization.json"
GPTQMODEL_VERSION = "7.6.0"  # the version the [quant] extra pins (7.7 needs torch >= 2.14.1 CUDA builds)
_NOT_COPIED = {"config.json", "quantize_config.json", "quant_log.csv", RECORD_FILE, "model.safetensors.index.json"}
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".pkl")


# ---------------------------------------------------------------------------------------------------------------------
# GPTQModel import and devices


def import_gptqmodel() -> Any:
    """The ``gptqmodel`` module, or PolyspecError naming the [quant] extra when it is not installed."""
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", str(max(1, os.cpu_count() or 1)))
    try:
        import gptqmodel
    except ImportError:
        raise missing_extra("gptqmodel", "quant") from None
    return gptqmodel


def parse_devices(devices: str) -> dict[str, Any]:
    """``quantize.devices`` -> GPTQModel placement: {"device": str | None, "pool": list[str]}.

    auto -> GPTQModel's choice (CUDA when present, else CPU); cpu / cuda / cuda:N -> that device; a comma list such as
    ``cuda:0,cuda:1`` -> layers are quantised on the first and GPTQModel's dense-module pool is balanced over all.
    """
    text = (devices or "auto").strip()
    parts = [p.strip() for p in text.split(",") if p.strip()]
    ok = all(p in ("cpu", "cuda") or (p.startswith("cuda:") and p[5:].isdigit()) for p in parts)
    if text == "auto":
        return {"device": None, "pool": []}
    if not parts or not ok or (len(parts) > 1 and "cpu" in parts):
        raise PolyspecError(f"quantize.devices={devices!r} is not auto, cpu, cuda, cuda:N or a list of CUDA devices "
                            "such as 'cuda:0,cuda:1'", exit_code=2)
    if any(p.startswith("cuda") for p in parts):
        import torch

        if not torch.cuda.is_available():
            raise PolyspecError(f"quantize.devices={devices!r} asks for CUDA but torch sees no GPU; use cpu or auto",
                                exit_code=2)
    return {"device": parts[0], "pool": parts if len(parts) > 1 else []}


# ---------------------------------------------------------------------------------------------------------------------
# Cache key and group layout


def input_key(model_dir: Path, settings: dict[str, Any], calibration: Sequence[Sequence[int]] | None) -> str:
    """SHA-256 over the model's content id, the settings, the calibration token ids and the tool versions."""
    from polyspec.quantize.calibration import samples_digest
    from polyspec.sources import model_id

    identity = {
        "format_version": FORMAT_VERSION,
        "model": model_id("local", model_dir),
        "settings": settings,
        "calibration": samples_digest(calibration) if calibration is not None else None,
        "gptqmodel": _version("gptqmodel") if settings.get("method") == "gptq" else None,
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def _version(pkg: str) -> str | None:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def group_layout(folder: Path, group_size: int) -> dict[str, Any]:
    """Check the written GPTQ tensors and describe their groups: per quantised layer K, N, number of groups and the
    last group's size. Raises PolyspecError when any layer's scales or g_idx imply another group size."""
    from safetensors import safe_open

    layers: dict[str, Any] = {}
    short: dict[str, Any] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            names = [k[: -len(".qweight")] for k in f.keys() if k.endswith(".qweight")]
            for name in names:
                qweight = f.get_slice(f"{name}.qweight")
                k = qweight.get_shape()[0] * 8  # int32 words of 8 nibbles along K
                n = qweight.get_shape()[1]
                g_rows = f.get_slice(f"{name}.scales").get_shape()[0]
                expected = -(-k // group_size)
                if g_rows != expected:
                    raise PolyspecError(f"{folder}: {name} has {g_rows} scale groups for K={k}, but group size "
                                        f"{group_size} needs {expected}: the group size was changed")
                act_order = False
                if f"{name}.g_idx" in f.keys():
                    import torch

                    g_idx = f.get_tensor(f"{name}.g_idx").long()
                    act_order = not torch.equal(g_idx, torch.arange(k) // group_size)
                last = k - (expected - 1) * group_size
                layers[name] = {"in_features": k, "out_features": n, "groups": expected, "last_group": last,
                                "act_order": act_order}
                if last != group_size:
                    short[name] = {"in_features": k, "groups": expected, "last_group": last}
    if not layers:
        raise PolyspecError(f"{folder}: no quantised layer (no *.qweight tensor) was written")
    return {
        "group_size": group_size,
        "quantized_layers": len(layers),
        "short_last_group_layers": len(short),
        "k_not_multiple_of_group": sorted({v["in_features"] for v in short.values()}),
        "handling": ("short last group: columns from the last multiple of group_size to K form one smaller group "
                     "(its own scale/zero); g_idx = k // group_size; no padding, group size unchanged")
        if short else "every K is a multiple of group_size",
        "act_order_layers": sum(v["act_order"] for v in layers.values()),
        "layers": layers,
    }


def read_record(folder: Path) -> dict[str, Any] | None:
    p = Path(folder) / RECORD_FILE
    if not p.is_file():
        return None
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None


# ---------------------------------------------------------------------------------------------------------------------
# Writing


def _copy_side_files(src: Path, dst: Path) -> list[str]:
    """Copy the target's tokenizer / chat template / generation config (every non-weight file but config.json)."""
    copied = []
    for f in sorted(Path(src).iterdir()):
        if f.is_file() and f.name not in _NOT_COPIED and not f.name.endswith(_WEIGHT_SUFFIXES) \
                and f.name != "polyspec_source.json":
            shutil.copy2(f, dst / f.name)
            copied.append(f.name)
    return copied


def _quant_log(folder: Path) -> dict[str, Any] | None:
    """Summary of GPTQModel's quant_log.csv (per-module GPTQ loss)."""
    p = folder / "quant_log.csv"
    if not p.is_file():
        return None
    with p.open(encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    losses = [float(r["loss"]) for r in rows if r.get("loss") not in (None, "")]
    if not losses:
        return None
    return {"modules": len(rows), "mean_loss": sum(losses) / len(losses), "max_loss": max(losses),
            "samples": int(rows[0].get("samples") or 0)}


def _run_gptqmodel(model_dir: Path, tmp: Path, calibration: Sequence[Sequence[int]], settings: dict[str, Any],
                   device: str) -> dict[str, Any]:
    """Quantise with GPTQModel and save into ``tmp``; returns facts about the run."""
    import torch

    gm = import_gptqmodel()
    from gptqmodel import GPTQModel, QuantizeConfig

    place = parse_devices(device)
    qkw: dict[str, Any] = dict(bits=settings["bits"], group_size=settings["group_size"], sym=settings["sym"],
                               desc_act=settings["desc_act"], damp_percent=settings["damp_percent"], lm_head=False,
                               fallback=None, offload_to_disk_path=str(tmp.parent / f".{tmp.name}.offload"))
    if place["pool"]:
        qkw.update(dense_vram_strategy="balanced", dense_vram_strategy_devices=place["pool"])
    qcfg = QuantizeConfig(**qkw)
    on_cpu = place["device"] == "cpu" or (place["device"] is None and not torch.cuda.is_available())
    load_kw: dict[str, Any] = {"dtype": torch.float32} if on_cpu else {}
    if place["device"] is not None:
        load_kw["device"] = place["device"]
    t0 = time.perf_counter()
    model = GPTQModel.load(str(model_dir), qcfg, **load_kw)
    data = [{"input_ids": list(map(int, s)), "attention_mask": [1] * len(s)} for s in calibration]
    model.quantize(data, batch_size=1)
    model.save(str(tmp))
    seconds = time.perf_counter() - t0
    del model
    shutil.rmtree(tmp.parent / f".{tmp.name}.offload", ignore_errors=True)
    _scrub_offload_path(tmp)
    return {"gptqmodel_version": gm.__version__, "seconds": seconds, "device": place["device"] or "auto",
            "device_pool": place["pool"], "dtype": "float32" if on_cpu else "auto",
            "act_group_aware": bool(getattr(qcfg, "act_group_aware", False)),
            "quant_log": _quant_log(tmp)}


def _scrub_offload_path(folder: Path) -> None:
    """GPTQModel records its scratch folder (a machine path, deleted by now) in the saved configs: blank it."""
    for name in ("config.json", "quantize_config.json"):
        p = folder / name
        if not p.is_file():
            continue
        cfg = json.loads(p.read_text(encoding="utf-8"))
        qc = cfg.get("quantization_config", cfg) if name == "config.json" else cfg
        meta = qc.get("meta") if isinstance(qc, dict) else None
        if isinstance(meta, dict) and "offload_to_disk_path" in meta:
            meta["offload_to_disk_path"] = None
            p.write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")


def quantize_model(model_dir: str | Path, out_dir: str | Path, *, method: str = "gptq", bits: int = 4,
                   group_size: int = 128, sym: bool = True, desc_act: bool = False, damp_percent: float = 0.01,
                   calibration: list[list[int]] | None = None, device: str = "cpu",
                   calibration_info: dict[str, Any] | None = None) -> Path:
    """Quantise the HF folder ``model_dir`` to W4A16 GPTQ format in ``out_dir`` (see the module docstring).

    calibration: token-id sequences (required for gptq; e.g. from
    :func:`polyspec.quantize.calibration.calibration_samples`). device: ``quantize.devices`` syntax. Reuses
    ``out_dir`` when its recorded input key matches; otherwise writes a fresh folder atomically. Returns ``out_dir``.
    """
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    _check_request(model_dir, method, bits, group_size, desc_act, calibration)
    settings = {"method": method, "bits": bits, "group_size": group_size, "sym": sym, "desc_act": desc_act,
                "damp_percent": damp_percent if method == "gptq" else None}
    key = input_key(model_dir, settings, calibration if method == "gptq" else None)
    old = read_record(out_dir)
    if old is not None and old.get("key") == key:
        return out_dir

    tmp = temp_folder(out_dir)  # (removes the temporary folders of killed runs beside it)
    try:
        if method == "gptq":  # in a child: GPTQModel's threads would slow this process's kernels (polyspec/isolate.py)
            run = in_fresh_process("GPTQ quantisation", _run_gptqmodel, model_dir, tmp, calibration, settings, device)
        else:
            from polyspec.decode.int4 import save_int4_checkpoint

            t0 = time.perf_counter()
            shutil.rmtree(tmp)  # save_int4_checkpoint writes its own folder atomically
            save_int4_checkpoint(model_dir, tmp, group_size=group_size, method="rtn", sym=sym, portable=False)
            run = {"seconds": time.perf_counter() - t0, "tool": "polyspec.decode.int4.save_int4_checkpoint"}
        record = _finish_folder(model_dir, tmp, bits, group_size)
        record.update(key=key, settings=settings, run=run, calibration=(
            {"samples": len(calibration), "length": len(calibration[0]), "tokens": sum(len(s) for s in calibration),
             **(calibration_info or {})} if method == "gptq" else None))
        (tmp / RECORD_FILE).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
        tmp.chmod(0o755)
        swap_into_place(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(tmp.parent / f".{tmp.name}.offload", ignore_errors=True)
    return out_dir


def _check_request(model_dir: Path, method: str, bits: int, group_size: int, desc_act: bool,
                   calibration: list[list[int]] | None) -> None:
    """One clear error for a request quantize_model cannot do, before any work."""
    if method not in ("gptq", "rtn"):
        raise PolyspecError(f"quantize method must be gptq or rtn, got {method!r}")
    if bits != 4:
        raise PolyspecError(f"only 4-bit quantisation is supported (the decoder's int4 kernels), got bits={bits}")
    if group_size < 16 or group_size & (group_size - 1):
        raise PolyspecError(f"group_size must be a power of two >= 16, got {group_size}")
    if not (model_dir / "config.json").is_file():
        raise PolyspecError(f"{model_dir} is not a Hugging Face model folder (no config.json)")
    cfg = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    if cfg.get("quantization_config"):
        raise PolyspecError(f"{model_dir} is already quantised; start from the full-precision target")
    if method == "gptq":
        if not calibration:
            raise PolyspecError("GPTQ needs calibration samples (token-id lists); see "
                                "polyspec.quantize.calibration.calibration_samples")
        import_gptqmodel()  # fail early, before any work, when the extra is missing
    if desc_act and method == "gptq":
        raise PolyspecError("desc_act (act-order) checkpoints permute g_idx, which polyspec's int4 decoder does not "
                            "load; keep quantize.desc_act=false")


def _finish_folder(model_dir: Path, tmp: Path, bits: int, group_size: int) -> dict[str, Any]:
    """The written folder ``tmp`` checked, given the target's side files and stored portably; returns its record
    (without the key, settings, run and calibration the caller adds)."""
    copied = _copy_side_files(model_dir, tmp)
    qc = json.loads((tmp / "config.json").read_text(encoding="utf-8")).get("quantization_config") or {}
    if int(qc.get("group_size", -1)) != group_size or int(qc.get("bits", -1)) != bits:
        raise PolyspecError(f"the written quantization_config says bits={qc.get('bits')} group_size="
                            f"{qc.get('group_size')}, not the requested {bits} / {group_size}")
    group_layout(tmp, group_size)  # what was quantised: one scale row per group of group_size (short last)
    portable = make_portable(tmp, group_size)  # stored so that every GPTQ loader reads it (quantize/loaders.py)
    return {
        "format_version": FORMAT_VERSION,
        "source_model": model_id_safe(model_dir),
        "unquantized": ["model.embed_tokens", "lm_head", "norms"],
        "checkpoint_format": qc.get("checkpoint_format") or qc.get("format") or "gptq",
        **portable,
        "copied_from_target": copied,
        "group_layout": group_layout(tmp, portable["stored_group_size"]),
    }


def model_id_safe(model_dir: Path) -> str:
    from polyspec.sources import model_id

    return model_id("local", model_dir)
