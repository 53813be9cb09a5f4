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

import os
import shutil
import stat
from pathlib import Path, PurePosixPath
from typing import Any

from pydantic import ValidationError

from polyspec import __version__
from polyspec.chain_spec import SCHEMA_VERSION, ChainManifest, DecodeSpec, LevelEntry
from polyspec.errors import PolyspecError
from polyspec.fsutil import (
    check_replaceable,
    copy_tree,
    refused_write,
    sha256_file,
    swap_into_place,
    temp_folder,
    write_error,
    write_text,
)
from polyspec.modes import mode_of
from polyspec.safeload import read_json
from polyspec.shapes import Claims, chain_problems, level_problems
from polyspec.weights import (
    SAFETENSORS_SUFFIX,
    check_safetensors,
    content_problem,
    is_pickle_name,
    read_header,
    write_index,
)

MANIFEST = "manifest.json"
HEAD_MODEL_TYPE = "polyspec-eagle-head"  # decode.head.HEAD_MODEL_TYPE (not imported here: that loads torch)

# Limits on what a chain folder (which may come from anyone) can make validation do, checked before the work they bound
MAX_MANIFEST_BYTES = 8 << 20  # a profiled chain's manifest is tens of KB (measurements included); 8 MiB parse in ~0.1 s
MAX_JSON_DEPTH = 64  # a manifest nests ~6 deep, configs and tokenizer files ~5: far below the JSON parser's recursion
MAX_JSON_BYTES = 256 << 20  # a level's JSON file (tokenizer.json of a 256k vocabulary is ~35 MB)
MAX_LEVELS = 32  # each level is one more model per round; chains past a handful of levels never pay (docs/PROFILE.md)
MAX_FILES = 10_000  # files of all levels together: a 405B-parameter checkpoint has ~200 shards
MAX_LISTED_PROBLEMS = 20  # a refusal names this many problems, then counts the rest


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
    raw = read_json(path, max_bytes=MAX_MANIFEST_BYTES, max_depth=MAX_JSON_DEPTH, what="chain manifest")
    if isinstance(raw, dict) and raw.get("schema_version") not in (None, 1, SCHEMA_VERSION):
        raise PolyspecError(f"{path}: schema_version {raw.get('schema_version')} is not supported by polyspec "
                            f"{__version__} (reads 1 and {SCHEMA_VERSION})")
    levels = raw.get("levels") if isinstance(raw, dict) else None
    if isinstance(levels, list) and len(levels) > MAX_LEVELS:
        raise PolyspecError(f"{path}: {len(levels)} levels; a chain has at most {MAX_LEVELS} (each level is one more "
                            "model per decoding round)")
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
    files = sum(len(lv.files) for lv in manifest.levels)
    if files > MAX_FILES:
        raise PolyspecError(f"{path}: the levels list {files} files; a chain holds at most {MAX_FILES}")
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
    claims: list[Claims | None] = []
    for i, (lv, folder) in enumerate(zip(manifest.levels, folders, strict=True)):
        found, claim = _level_problems(i, lv, folder, hashes)
        problems += found
        claims.append(claim)
    problems += chain_problems([lv.name for lv in manifest.levels], claims,
                               [lv.reads_features_from for lv in manifest.levels])
    problems += _engine_problems(chain_dir, manifest, hashes)
    if problems:
        more = len(problems) - MAX_LISTED_PROBLEMS
        listed = problems[:MAX_LISTED_PROBLEMS] + ([f"... and {more} more problems"] if more > 0 else [])
        raise PolyspecError(f"chain {chain_dir} does not validate:\n  " + "\n  ".join(listed), exit_code=1)
    return manifest


def level_folders(chain_dir: Path, manifest: ChainManifest) -> list[Path]:
    """Each level's folder, top first, after refusing any manifest path (a level's or an engine folder's ``path`` or
    a file entry) that is not relative and normalised, or that resolves outside the chain folder. Nothing outside the chain folder is looked
    at: an escaping path is refused the same way whether its target exists or not."""
    chain_dir = Path(chain_dir)
    root = chain_dir.resolve()
    folders = []
    for i, lv in enumerate(manifest.levels):
        folders.append(_confined(chain_dir, root, lv.path, f"levels.{i}.path"))
        for rel in lv.files:
            key = f"levels.{i}.files[{rel!r}]"
            _check_relative(chain_dir, rel, key)
            _confined(chain_dir, root, f"{lv.path}/{rel}", key)
    for name, entry in manifest.engines.items():
        _confined(chain_dir, root, entry.path, f"engines.{name}.path")
        for rel in entry.files:
            _confined(chain_dir, root, f"{entry.path}/{rel}", f"engines.{name}.files[{rel!r}]")
    _check_disjoint(chain_dir, manifest)
    return folders


def _check_relative(chain_dir: Path, rel: str, key: str) -> None:
    """Refuse, by its text alone, a path that is absolute, climbs with '..' or is not written in normal form."""
    if "\\" in rel or "\0" in rel or any(part in ("", ".", "..") for part in rel.split("/")):
        raise PolyspecError(f"{chain_dir / MANIFEST}: {key} = {rel!r} must be a relative, normalised path inside the "
                            "chain folder (no leading '/', no '..', no empty or '.' parts, '/' between parts)")


def _confined(chain_dir: Path, root: Path, rel: str, key: str) -> Path:
    """``chain_dir / rel``, refused unless it resolves (symbolic links followed) strictly inside ``root`` (the chain
    folder, resolved)."""
    _check_relative(chain_dir, rel, key)
    if not _resolves_inside(root, rel):
        raise PolyspecError(f"{chain_dir / MANIFEST}: {key} = {rel!r} does not resolve inside the chain folder (a "
                            "symbolic link leads out of it, or loops); a chain folder must hold its own files")
    return chain_dir / rel


def _resolves_inside(root: Path, rel: str) -> bool:
    """Whether ``root / rel`` (``rel`` relative and normalised) resolves inside ``root``. Its parts are looked at one
    by one (one lstat each); only a path that goes through a symbolic link is resolved in full: a few system calls
    per file, not one per part of the chain folder's absolute path."""
    here = str(root)
    for part in rel.split("/"):
        here = os.path.join(here, part)
        try:
            if not stat.S_ISLNK(os.lstat(here).st_mode):
                continue
        except OSError:  # missing (so is the rest): what is left has no link to follow
            return True
        try:
            return root in (root / rel).resolve().parents
        except (OSError, RuntimeError):  # a symbolic link loop
            return False
    return True


def _check_disjoint(chain_dir: Path, manifest: ChainManifest) -> None:
    """Each level has a folder of its own: no two level paths are equal or nested. Linear in the levels: each path
    is looked up among the earlier paths and their parent folders."""
    owner: dict[str, int] = {}  # a level's folder -> its index
    above: dict[str, int] = {}  # a folder that holds a level's folder -> that level's index
    for j, lv in enumerate(manifest.levels):
        b = lv.path  # relative and normalised (checked): its parents are its prefixes up to a '/'
        parents = [b[:k] for k in range(len(b)) if b[k] == "/"]
        i, how = owner.get(b), "is"
        if i is None:
            i, how = next(((owner[p], "lies inside") for p in parents if p in owner), (above.get(b), "holds"))
        if i is not None:
            raise PolyspecError(f"{chain_dir / MANIFEST}: levels.{j}.path = {b!r} {how} levels.{i}.path "
                                f"{manifest.levels[i].path!r}; each level needs a folder of its own")
        owner[b] = j
        for p in parents:
            above.setdefault(p, j)


def _unlisted_files(chain_dir: Path, manifest: ChainManifest) -> list[str]:
    """Everything in the chain folder that the manifest does not list (links are never followed while looking: a
    symbolic link to a folder is one entry, and never a listed file)."""
    listed = {MANIFEST} | {f"{lv.path}/{rel}" for lv in manifest.levels for rel in lv.files}
    listed |= {f"{e.path}/{rel}" for e in manifest.engines.values() for rel in e.files}
    found = []
    for dirpath, dirnames, filenames in os.walk(chain_dir):
        here = Path(dirpath)
        found += [here / n for n in filenames] + [here / d for d in dirnames if (here / d).is_symlink()]
    return [f"file {f} is not in the manifest (a chain folder holds only the files its manifest lists)"
            for f in sorted(found) if f.relative_to(chain_dir).as_posix() not in listed]


def _level_problems(i: int, lv: LevelEntry, folder: Path, hashes: bool) -> tuple[list[str], Claims | None]:
    """What is wrong with one level (its file list; missing, hard-linked or changed files; files that are not what a
    level may hold; false claims; a config its tensors contradict) and the sizes its config claims (None when its
    config or weights could not be read)."""
    if not folder.is_dir():
        return [f"level {lv.name}: folder {folder} is missing"], None
    problems = _file_list_problems(i, lv, folder)
    found, intact = _listed_file_problems(f"level {lv.name}", folder, lv.files, hashes)
    problems += found
    headers: dict[str, Any] = {}
    weights_read = all(rel in intact for rel in lv.files if rel.endswith(SAFETENSORS_SUFFIX))
    for rel in intact:
        try:
            _check_content(f"level {lv.name}", folder / rel, rel, headers)
        except PolyspecError as exc:
            problems.append(str(exc))
            weights_read = weights_read and not rel.endswith(SAFETENSORS_SUFFIX)
    claims = None
    if "config.json" in intact:
        found, claims = _claim_problems(i, lv, folder, headers if weights_read else None)
        problems += found
    problems += [_index_problem(lv, folder, rel) for rel in intact if rel.endswith(SAFETENSORS_SUFFIX + ".index.json")]
    return [p for p in problems if p], claims


def _listed_file_problems(owner: str, folder: Path, files: dict[str, str],
                          hashes: bool) -> tuple[list[str], list[str]]:
    """(problems, the files that are intact) of the files a level or an engine folder (``owner``, for messages)
    lists: each is there, has no second hard link and (with ``hashes``) matches its sha256."""
    problems, intact = [], []
    for rel, digest in files.items():
        f = folder / rel
        if not f.is_file():
            problems.append(f"{owner}: file {f} is missing")
        elif (links := f.stat().st_nlink) > 1:
            problems.append(f"{owner}: {f} has {links} hard links: the same file is reachable from outside "
                            "the chain folder, where editing it would change the chain after validation; copy it "
                            "in (cp without -l) or export the chain again")
        elif hashes and sha256_file(f) != digest:
            problems.append(f"{owner}: file {f} does not match its sha256 in the manifest (changed)")
        else:
            intact.append(rel)
    return problems, intact


def _engine_problems(chain_dir: Path, manifest: ChainManifest, hashes: bool) -> list[str]:
    """What is wrong with the engine folders (``engines``): their listed files as a level's, and their content (no
    pickle; safetensors and JSON that parse)."""
    problems = []
    for name, entry in manifest.engines.items():
        folder = chain_dir / entry.path
        found, intact = _listed_file_problems(f"engine {name}", folder, entry.files, hashes)
        problems += found
        for rel in intact:
            try:
                _check_content(f"engine {name}", folder / rel, rel, {})
            except PolyspecError as exc:
                problems.append(str(exc))
    return problems


def _check_content(owner: str, path: Path, rel: str, headers: dict[str, Any]) -> None:
    """A listed file is what its level (or engine folder: ``owner``) may hold: safetensors whose header parses (its
    tensors' shapes go to ``headers``), JSON that parses within the limits, or other text / named binaries that are
    no pickle."""
    if rel.endswith(SAFETENSORS_SUFFIX):
        headers.update(read_header(path))
        return
    why = content_problem(path, rel)
    if why:
        raise PolyspecError(f"{owner}: {why}")
    if rel.endswith(".json"):
        _read_json(path, obj=False)


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


def _claim_problems(i: int, lv: LevelEntry, folder: Path,
                    headers: dict[str, Any] | None) -> tuple[list[str], Claims | None]:
    """The manifest's kind / quantization / dtype for a level against the level's own config.json, and that config
    against its tensors' shapes (``headers``; None when a weights file could not be read: nothing to compare)."""
    path = folder / "config.json"
    try:
        cfg = _read_json(path)
        kind, quant, dtype = _config_claims(cfg)
    except PolyspecError as exc:
        return [str(exc)], None
    says = f"level {lv.name}: the manifest (levels.{i}) says"
    problems = []
    if ("model" if lv.kind == "target" else lv.kind) != kind:
        problems.append(f"{says} kind {lv.kind!r}, its config.json makes it {kind!r} (int4: it has a "
                        f"quantization_config; head: model_type {HEAD_MODEL_TYPE!r}; else a model)")
    elif lv.quantization != quant:
        problems.append(f"{says} quantization {lv.quantization}, its config.json's quantization_config is {quant}")
    if dtype is not None and _dtype_name(dtype) != _dtype_name(lv.dtype):
        problems.append(f"{says} dtype {lv.dtype!r}, its config.json says {dtype!r}")
    if headers is None:
        return problems, None
    found, claims = level_problems(cfg, headers, f"level {lv.name}: {path}")
    return problems + found, claims


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _read_json(path: Path, obj: bool = True) -> Any:
    """A level's JSON file, read within the limits (size, nesting, UTF-8); a JSON object unless ``obj`` is False."""
    data = read_json(path, max_bytes=MAX_JSON_BYTES, max_depth=MAX_JSON_DEPTH)
    if obj and not isinstance(data, dict):
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
    parts: list[tuple[str, Path]] = [("target", Path(target))]
    for i, p in enumerate(intermediates):
        # the names export gives (stage.level_names): an intermediate need not be int4
        parts.append((f"intermediate{i + 1}" if len(intermediates) > 1 else "intermediate", Path(p)))
    if draft is not None:
        parts.append(("draft", Path(draft)))
    check_replaceable(out, flag="--out", overwrite=overwrite, own=not_a_chain, keep=[p for _, p in parts],
                      kept="the part folder")
    existed = out.exists()
    tmp = temp_folder(out)  # names this process, so a killed assemble's leftover is removed by the next write
    try:
        manifest = _assemble_into(tmp, parts, decode)
        swap_into_place(tmp, out)
        return manifest
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        refused = refused_write(exc)
        if refused is not None:
            raise write_error(refused, out, existed) from None
        if isinstance(exc, PolyspecError):  # name the output, not its temporary folder
            raise PolyspecError(str(exc).replace(str(tmp), str(out)), exit_code=exc.exit_code) from None
        raise


def _assemble_into(tmp: Path, parts: list[tuple[str, Path]], decode: DecodeSpec | None) -> ChainManifest:
    """The chain of ``parts`` written in the (temporary) folder ``tmp``, validated."""
    levels = [_copy_level(tmp, parts, i) for i in range(len(parts))]
    if levels[-1].kind == "head" and len(levels) == 1:
        raise PolyspecError("a head cannot be the only level")
    manifest = ChainManifest(levels=levels, decode=decode or DecodeSpec(mode=mode_of(len(levels))))
    write_manifest(tmp, manifest)
    validate_chain(tmp, hashes=False)  # what it wrote keeps every promise a reader checks
    return manifest


def not_a_chain(folder: Path) -> list[str]:
    """The entries of ``folder`` that show it is no chain folder ([] for a chain folder, which --overwrite may
    replace, and for an empty folder)."""
    if (folder / MANIFEST).is_file():
        return []
    return sorted(p.name for p in folder.iterdir())


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
    copy_tree(src, chain_dir / rel, ignore=_pickles)
    if kind == "target":
        write_index(chain_dir / rel)  # listed and hashed like its weights: EAGLE's loader finds the embedding by it
    return LevelEntry(name=name, kind=kind, path=rel, files=hash_folder(chain_dir / rel), dtype=dtype,
                      quantization=quant, reads_features_from=(parts[i - 1][0] if kind == "head" else None),
                      base_model=str(src.name))


def _pickles(_folder: str, names: list[str]) -> list[str]:
    """shutil.copytree's ignore: a part's pickle files (never read: safetensors are) stay out of the chain."""
    return [n for n in names if is_pickle_name(n)]
