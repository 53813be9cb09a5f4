"""The chain folder: ``manifest.json`` plus one folder per level. Everything about a chain lives in its manifest.

Layout::

    chain/
      manifest.json         # ChainManifest
      levels/target/        # M1: a plain Hugging Face folder (safetensors)
      levels/int4/          # M2: a GPTQ-format 4-bit folder (HF quantization_config)
      levels/head/          # the EAGLE-style draft head (config.json + model.safetensors)

Levels are listed top first (the target, then verifiers, then the draft). Every file of every level is hashed
(sha256); :func:`validate_chain` re-hashes and names any missing, extra or tampered file.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from polyspec import __version__
from polyspec.config import DecodeConfig
from polyspec.errors import PolyspecError
from polyspec.fsutil import write_text

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"


class LevelEntry(BaseModel):
    """One level of a chain."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    kind: Literal["target", "int4", "model", "head"]
    path: str = Field(description="folder relative to the chain folder")
    files: dict[str, str] = Field(description="file (relative to the level folder) -> sha256")
    dtype: str = "float32"
    base_model: str | None = Field(None, description="identity of the model this level was made from")
    quantization: dict[str, Any] | None = Field(None, description="bits, group_size, sym, method, padding ...")
    reads_features_from: str | None = Field(None, description="heads: the level whose hidden states it reads")


class ChainManifest(BaseModel):
    """A self-describing chain."""

    model_config = ConfigDict(extra="forbid")

    schema_version: int = SCHEMA_VERSION
    polyspec_version: str = __version__
    created_at: str = Field(default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))
    levels: list[LevelEntry]
    decode: DecodeConfig = Field(default_factory=DecodeConfig)
    measurements: dict[str, Any] = Field(default_factory=dict)
    stamps: dict[str, Any] = Field(default_factory=dict)

    def level(self, name: str) -> LevelEntry:
        for lv in self.levels:
            if lv.name == name:
                return lv
        raise PolyspecError(f"the chain has no level named {name!r}; it has {[lv.name for lv in self.levels]}")


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def hash_folder(folder: Path) -> dict[str, str]:
    """sha256 of every file below ``folder`` (relative POSIX paths, sorted)."""
    folder = Path(folder)
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    return {p.relative_to(folder).as_posix(): sha256_file(p) for p in files}


def write_manifest(chain_dir: Path, manifest: ChainManifest) -> Path:
    """Write ``manifest.json`` atomically (temp file, then rename)."""
    return write_text(Path(chain_dir) / MANIFEST, manifest.model_dump_json(indent=2))


def read_manifest(chain_dir: Path) -> ChainManifest:
    """Read and schema-check ``manifest.json`` (does not hash files: see :func:`validate_chain`)."""
    path = Path(chain_dir) / MANIFEST
    if not path.is_file():
        raise PolyspecError(f"{chain_dir} is not a chain folder: {MANIFEST} is missing (make one with polyspec "
                            "export or polyspec chain assemble)")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise PolyspecError(f"{path}: not valid JSON ({exc})") from None
    if isinstance(raw, dict) and raw.get("schema_version") not in (None, SCHEMA_VERSION):
        raise PolyspecError(f"{path}: schema_version {raw.get('schema_version')} is not supported by polyspec "
                            f"{__version__} (expects {SCHEMA_VERSION})")
    try:
        manifest = ChainManifest.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        key = ".".join(str(p) for p in first["loc"])
        raise PolyspecError(f"{path}: bad manifest at '{key}': {first['msg']}") from None
    if not manifest.levels:
        raise PolyspecError(f"{path}: a chain needs at least one level")
    if manifest.levels[0].kind != "target":
        raise PolyspecError(f"{path}: the first level must be the target, got kind {manifest.levels[0].kind!r}")
    return manifest


def validate_chain(chain_dir: Path) -> ChainManifest:
    """Schema and every hash: a missing, extra or changed file raises a PolyspecError naming it."""
    chain_dir = Path(chain_dir)
    manifest = read_manifest(chain_dir)
    problems: list[str] = []
    for lv in manifest.levels:
        folder = chain_dir / lv.path
        if not folder.is_dir():
            problems.append(f"level {lv.name}: folder {folder} is missing")
            continue
        for rel, digest in lv.files.items():
            f = folder / rel
            if not f.is_file():
                problems.append(f"level {lv.name}: file {f} is missing")
            elif sha256_file(f) != digest:
                problems.append(f"level {lv.name}: file {f} does not match its sha256 in the manifest (changed)")
        extra = sorted(set(hash_folder_names(folder)) - set(lv.files))
        problems += [f"level {lv.name}: file {folder / e} is not in the manifest" for e in extra]
    if problems:
        raise PolyspecError(f"chain {chain_dir} does not validate:\n  " + "\n  ".join(problems), exit_code=1)
    return manifest


def hash_folder_names(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in Path(folder).rglob("*") if p.is_file())


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise PolyspecError(f"{path}: cannot read ({exc})") from None


def _classify(folder: Path) -> tuple[str, dict[str, Any] | None, str]:
    """(kind, quantization, dtype) of a level folder, from its config.json."""
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise PolyspecError(f"{folder} has no config.json: a level must be a model, GPTQ or head folder")
    cfg = _read_json(cfg_path)
    if cfg.get("model_type") == "polyspec-eagle-head":
        return "head", None, str(cfg.get("dtype", "float32"))
    q = cfg.get("quantization_config")
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32")
    if q:
        return "int4", q, dtype
    return "model", None, dtype


def assemble_chain(out: Path, target: Path, intermediates: list[Path] = (), draft: Path | None = None,
                   decode: DecodeConfig | None = None, *, overwrite: bool = False) -> ChainManifest:
    """Make a chain folder from parts (copied), hash every file and write the manifest — atomically.

    ``intermediates`` are verifiers between the target and the draft, top first (usually one int4 folder).
    """
    out = Path(out)
    if out.exists() and not overwrite:
        raise PolyspecError(f"{out} exists; pass --overwrite or choose another --out")
    parts: list[tuple[str, Path]] = [("target", Path(target))]
    for i, p in enumerate(intermediates):
        parts.append((f"int4_{i}" if len(intermediates) > 1 else "intermediate", Path(p)))
    if draft is not None:
        parts.append(("draft", Path(draft)))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        levels: list[LevelEntry] = []
        for i, (name, src) in enumerate(parts):
            if not src.is_dir():
                raise PolyspecError(f"{name} level: {src} is not a folder")
            kind, quant, dtype = _classify(src)
            if i == 0:
                if kind != "model":
                    raise PolyspecError(f"the target {src} must be a plain model folder, got a {kind} folder")
                kind = "target"
            rel = f"levels/{name}"
            shutil.copytree(src, tmp / rel)
            levels.append(LevelEntry(
                name=name, kind=kind, path=rel, files=hash_folder(tmp / rel), dtype=dtype, quantization=quant,
                reads_features_from=(parts[i - 1][0] if kind == "head" else None), base_model=str(src.name),
            ))
        if levels[-1].kind == "head" and len(levels) == 1:
            raise PolyspecError("a head cannot be the only level")
        manifest = ChainManifest(levels=levels, decode=decode or DecodeConfig(
            mode="chain" if len(levels) > 2 else ("dual" if len(levels) == 2 else "ar")))
        write_manifest(tmp, manifest)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
        return manifest
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
