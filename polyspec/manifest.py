"""The chain folder: ``manifest.json`` plus one folder per level. Everything about a chain lives in its manifest.

Layout::

    chain/
      manifest.json         # ChainManifest
      levels/target/        # M1: a plain Hugging Face folder (safetensors)
      levels/int4/          # M2: a GPTQ-format 4-bit folder (HF quantization_config)
      levels/head/          # the EAGLE-style draft head (config.json + model.safetensors)

Levels are listed top first (the target, then verifiers, then the draft). Every file of every level is hashed
(sha256). The folder is a trust boundary: :func:`validate_chain` refuses manifest paths that leave it, files it does
not list, pickles, level claims its configs contradict, and any missing, changed or damaged file (docs/DECODE.md).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path, PurePosixPath
from typing import Any

from pydantic import ValidationError

from polyspec import __version__
from polyspec.chain_spec import SCHEMA_VERSION, ChainManifest, DecodeSpec, LevelEntry
from polyspec.errors import PolyspecError
from polyspec.fsutil import sha256_file, temp_folder, write_text
from polyspec.modes import mode_of
from polyspec.weights import SAFETENSORS_SUFFIX, check_safetensors, is_pickle_name

MANIFEST = "manifest.json"
HEAD_MODEL_TYPE = "polyspec-eagle-head"  # decode.head.HEAD_MODEL_TYPE (not imported here: that loads torch)


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
    if isinstance(raw, dict) and raw.get("schema_version") not in (None, 1, SCHEMA_VERSION):
        raise PolyspecError(f"{path}: schema_version {raw.get('schema_version')} is not supported by polyspec "
                            f"{__version__} (reads 1 and {SCHEMA_VERSION})")
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


def validate_chain(chain_dir: Path, *, hashes: bool = True) -> ChainManifest:
    """Everything a chain folder promises (docs/DECODE.md, "The chain folder is a trust boundary"), or one
    PolyspecError naming each problem: every manifest path stays inside the folder (checked before any file is
    looked at); the manifest lists every file in the folder, and no pickle; each level lists its config.json and
    safetensors weights, and its kind / dtype / quantization agree with that config; every file matches its sha256
    (unless ``hashes`` is False: for a writer that has just hashed them) and every safetensors header parses."""
    chain_dir = Path(chain_dir)
    manifest = read_manifest(chain_dir)
    folders = level_folders(chain_dir, manifest)
    problems = _unlisted_files(chain_dir, manifest)
    for i, (lv, folder) in enumerate(zip(manifest.levels, folders, strict=True)):
        problems += _level_problems(i, lv, folder, hashes)
    if problems:
        raise PolyspecError(f"chain {chain_dir} does not validate:\n  " + "\n  ".join(problems), exit_code=1)
    return manifest


def level_folders(chain_dir: Path, manifest: ChainManifest) -> list[Path]:
    """Each level's folder, top first, after refusing any manifest path (a level's ``path`` or a file entry) that is
    not relative and normalised, or that resolves outside the chain folder. Nothing outside the chain folder is looked
    at: an escaping path is refused the same way whether its target exists or not."""
    chain_dir = Path(chain_dir)
    folders = []
    for i, lv in enumerate(manifest.levels):
        folders.append(_confined(chain_dir, lv.path, f"levels.{i}.path"))
        for rel in lv.files:
            key = f"levels.{i}.files[{rel!r}]"
            _check_relative(chain_dir, rel, key)
            _confined(chain_dir, f"{lv.path}/{rel}", key)
    _check_disjoint(chain_dir, manifest)
    return folders


def _check_relative(chain_dir: Path, rel: str, key: str) -> None:
    """Refuse, by its text alone, a path that is absolute, climbs with '..' or is not written in normal form."""
    p = PurePosixPath(rel)
    if rel in ("", ".") or "\\" in rel or "\0" in rel or p.is_absolute() or ".." in p.parts or p.as_posix() != rel:
        raise PolyspecError(f"{chain_dir / MANIFEST}: {key} = {rel!r} must be a relative, normalised path inside the "
                            "chain folder (no leading '/', no '..', no empty or '.' parts, '/' between parts)")


def _confined(chain_dir: Path, rel: str, key: str) -> Path:
    """``chain_dir / rel``, refused unless it resolves (symbolic links followed) strictly inside ``chain_dir``."""
    _check_relative(chain_dir, rel, key)
    root = chain_dir.resolve()
    try:
        inside = root in (chain_dir / rel).resolve().parents
    except (OSError, RuntimeError):  # a symbolic link loop
        inside = False
    if not inside:
        raise PolyspecError(f"{chain_dir / MANIFEST}: {key} = {rel!r} does not resolve inside the chain folder (a "
                            "symbolic link leads out of it, or loops); a chain folder must hold its own files")
    return chain_dir / rel


def _check_disjoint(chain_dir: Path, manifest: ChainManifest) -> None:
    """Each level has a folder of its own: no two level paths are equal or nested."""
    paths = [PurePosixPath(lv.path) for lv in manifest.levels]
    for i, a in enumerate(paths):
        for j, b in enumerate(paths):
            if i != j and (a == b or a in b.parents):
                raise PolyspecError(f"{chain_dir / MANIFEST}: levels.{j}.path = {str(b)!r} is levels.{i}.path "
                                    f"{str(a)!r} or lies inside it; each level needs a folder of its own")


def _unlisted_files(chain_dir: Path, manifest: ChainManifest) -> list[str]:
    """Everything in the chain folder that the manifest does not list (links are never followed while looking: a
    symbolic link to a folder is one entry, and never a listed file)."""
    listed = {MANIFEST} | {f"{lv.path}/{rel}" for lv in manifest.levels for rel in lv.files}
    found = []
    for dirpath, dirnames, filenames in os.walk(chain_dir):
        here = Path(dirpath)
        found += [here / n for n in filenames] + [here / d for d in dirnames if (here / d).is_symlink()]
    return [f"file {f} is not in the manifest (a chain folder holds only the files its manifest lists)"
            for f in sorted(found) if f.relative_to(chain_dir).as_posix() not in listed]


def _level_problems(i: int, lv: LevelEntry, folder: Path, hashes: bool) -> list[str]:
    """What is wrong with one level: its file list, missing or changed files, damaged headers, false claims."""
    if not folder.is_dir():
        return [f"level {lv.name}: folder {folder} is missing"]
    problems = _file_list_problems(i, lv, folder)
    intact = []
    for rel, digest in lv.files.items():
        f = folder / rel
        if not f.is_file():
            problems.append(f"level {lv.name}: file {f} is missing")
        elif hashes and sha256_file(f) != digest:
            problems.append(f"level {lv.name}: file {f} does not match its sha256 in the manifest (changed)")
        else:
            intact.append(rel)
    problems += [_header_problem(folder / rel) for rel in intact if rel.endswith(SAFETENSORS_SUFFIX)]
    if "config.json" in intact:
        problems += _claim_problems(i, lv, folder)
    problems += [_index_problem(lv, folder, rel) for rel in intact if rel.endswith(SAFETENSORS_SUFFIX + ".index.json")]
    return [p for p in problems if p]


def _index_problem(lv: LevelEntry, folder: Path, rel: str) -> str | None:
    """A sharded checkpoint's index names its shards: each must be a file this level lists (so it is relative,
    confined and hashed like every listed file); a loader opens exactly what the index says."""
    try:
        weight_map = _read_json(folder / rel).get("weight_map", {})
    except PolyspecError as exc:
        return f"level {lv.name}: {exc}"
    if not isinstance(weight_map, dict):
        return f"level {lv.name}: {folder / rel}: weight_map is not an object"
    base = PurePosixPath(rel).parent
    for shard in sorted({str(v) for v in weight_map.values()}):
        listed = str(base / shard) if str(base) != "." else shard
        if listed not in lv.files or not shard.endswith(SAFETENSORS_SUFFIX):
            return (f"level {lv.name}: {folder / rel} names shard {shard!r}, which is not a safetensors file this "
                    "level lists; an index may only name the level's own listed shards")
    return None


def _file_list_problems(i: int, lv: LevelEntry, folder: Path) -> list[str]:
    """A level lists its config.json and safetensors weights, and no pickle."""
    key = f"levels.{i}.files"
    if not lv.files:
        return [f"level {lv.name}: its file list ({key}) is empty; a level is a folder with config.json and "
                "safetensors weights"]
    problems = [f"level {lv.name}: file {folder / rel} is a pickle ({Path(rel).suffix}); a chain holds weights as "
                "safetensors only (convert with save_pretrained(..., safe_serialization=True))"
                for rel in lv.files if is_pickle_name(rel)]
    if "config.json" not in lv.files:
        problems.append(f"level {lv.name}: {key} lists no config.json")
    if not any(rel.endswith(SAFETENSORS_SUFFIX) for rel in lv.files):
        problems.append(f"level {lv.name}: {key} lists no {SAFETENSORS_SUFFIX} weights")
    return problems


def _header_problem(path: Path) -> str | None:
    try:
        check_safetensors(path)
    except PolyspecError as exc:
        return str(exc)
    return None


def _claim_problems(i: int, lv: LevelEntry, folder: Path) -> list[str]:
    """The manifest's kind / quantization / dtype for a level against the level's own config.json."""
    try:
        kind, quant, dtype = _config_claims(_read_json(folder / "config.json"))
    except PolyspecError as exc:
        return [str(exc)]
    says = f"level {lv.name}: the manifest (levels.{i}) says"
    problems = []
    if ("model" if lv.kind == "target" else lv.kind) != kind:
        problems.append(f"{says} kind {lv.kind!r}, its config.json makes it {kind!r} (int4: it has a "
                        f"quantization_config; head: model_type {HEAD_MODEL_TYPE!r}; else a model)")
    elif lv.quantization != quant:
        problems.append(f"{says} quantization {lv.quantization}, its config.json's quantization_config is {quant}")
    if dtype is not None and _dtype_name(dtype) != _dtype_name(lv.dtype):
        problems.append(f"{says} dtype {lv.dtype!r}, its config.json says {dtype!r}")
    return problems


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:  # ValueError: bad JSON or bytes that are not UTF-8
        raise PolyspecError(f"{path}: cannot read ({exc})") from None
    if not isinstance(data, dict):
        raise PolyspecError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _config_claims(cfg: dict[str, Any]) -> tuple[str, dict[str, Any] | None, str | None]:
    """(kind, quantization, dtype or None where the config names none) that a level's config.json makes."""
    if cfg.get("model_type") == HEAD_MODEL_TYPE:
        return "head", None, cfg.get("dtype")
    q = cfg.get("quantization_config") or None
    return ("int4" if q else "model"), q, cfg.get("torch_dtype") or cfg.get("dtype")


def _classify(folder: Path) -> tuple[str, dict[str, Any] | None, str]:
    """(kind, quantization, dtype) of a level folder, from its config.json."""
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise PolyspecError(f"{folder} has no config.json: a level must be a model, GPTQ or head folder")
    kind, quant, dtype = _config_claims(_read_json(cfg_path))
    return kind, quant, str(dtype or "float32")


def assemble_chain(out: Path, target: Path, intermediates: list[Path] = (), draft: Path | None = None,
                   decode: DecodeSpec | None = None, *, overwrite: bool = False) -> ChainManifest:
    """Make a chain folder from parts (copied), hash every file and write the manifest — atomically.

    ``intermediates`` are verifiers between the target and the draft, top first (usually one int4 folder).
    """
    out = Path(out)
    if out.exists() and not overwrite:
        raise PolyspecError(f"{out} exists; pass --overwrite or choose another --out")
    parts: list[tuple[str, Path]] = [("target", Path(target))]
    for i, p in enumerate(intermediates):
        # the names export gives (stage.level_names): an intermediate need not be int4
        parts.append((f"intermediate{i + 1}" if len(intermediates) > 1 else "intermediate", Path(p)))
    if draft is not None:
        parts.append(("draft", Path(draft)))
    tmp = temp_folder(out)  # names this process, so a killed assemble's leftover is removed by the next write
    try:
        levels = [_copy_level(tmp, parts, i) for i in range(len(parts))]
        if levels[-1].kind == "head" and len(levels) == 1:
            raise PolyspecError("a head cannot be the only level")
        manifest = ChainManifest(levels=levels, decode=decode or DecodeSpec(mode=mode_of(len(levels))))
        write_manifest(tmp, manifest)
        validate_chain(tmp, hashes=False)  # what it wrote keeps every promise a reader checks
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
        return manifest
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _copy_level(chain_dir: Path, parts: list[tuple[str, Path]], i: int) -> LevelEntry:
    """Copy part ``i`` (its pickle files left out) to ``levels/<name>`` in ``chain_dir``, hash it and describe it."""
    name, src = parts[i]
    if not src.is_dir():
        raise PolyspecError(f"{name} level: {src} is not a folder")
    for weights in sorted(src.rglob(f"*{SAFETENSORS_SUFFIX}")):  # a damaged file is named at its source
        check_safetensors(weights)
    kind, quant, dtype = _classify(src)
    if i == 0:
        if kind != "model":
            raise PolyspecError(f"the target {src} must be a plain model folder, got a {kind} folder")
        kind = "target"
    rel = f"levels/{name}"
    shutil.copytree(src, chain_dir / rel, ignore=_pickles)
    return LevelEntry(name=name, kind=kind, path=rel, files=hash_folder(chain_dir / rel), dtype=dtype,
                      quantization=quant, reads_features_from=(parts[i - 1][0] if kind == "head" else None),
                      base_model=str(src.name))


def _pickles(_folder: str, names: list[str]) -> list[str]:
    """shutil.copytree's ignore: a part's pickle files (never read: safetensors are) stay out of the chain."""
    return [n for n in names if is_pickle_name(n)]
