"""Which weight files polyspec reads, and the one place it opens a safetensors file.

Weights are safetensors only: a pickle (``torch.load``) can run code, so no loader here or in transformers (called
with ``use_safetensors=True``) ever reads one. A file that claims to be safetensors but is not (another format, a
truncated copy, a damaged header) is one PolyspecError naming it, never a SafetensorError traceback.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

from polyspec.errors import PolyspecError

if TYPE_CHECKING:
    import torch

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
SAFETENSORS_SUFFIX = ".safetensors"


def is_pickle_name(name: str) -> bool:
    """Whether a file name has a suffix that pickled torch / Python objects use."""
    return Path(name).suffix.lower() in PICKLE_SUFFIXES


def _unreadable(path: Path, exc: object) -> PolyspecError:
    return PolyspecError(f"{path} is not a readable safetensors file ({exc}); it is damaged or another format under "
                         "a .safetensors name: replace it with the file that was written, or, if polyspec wrote it "
                         f"under a workdir, delete {path.parent} and run again (a rerun writes it anew)")


def _read_header(path: str | Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (dtype, shape) of every tensor, from the header alone (safetensors checks its length, its JSON and that
    the tensors' offsets cover the file exactly); raises SafetensorError / OSError."""
    from safetensors import safe_open

    with safe_open(str(path), framework="np") as f:
        return {k: (s.get_dtype(), tuple(s.get_shape())) for k in f.keys() for s in (f.get_slice(k),)}


def header_problem(path: str | Path) -> str | None:
    """Why the header of ``path`` does not parse (its length, JSON, the tensors' offsets covering the file exactly),
    or None when it does. Reads the header only; needs no torch."""
    from safetensors import SafetensorError

    try:
        _read_header(path)
    except (SafetensorError, OSError) as exc:
        return str(exc)
    return None


def read_header(path: str | Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (dtype, shape) of every tensor of the safetensors file ``path``, read from its header without loading
    a tensor; a PolyspecError naming ``path`` when the header does not parse (:func:`header_problem`)."""
    from safetensors import SafetensorError

    try:
        return _read_header(path)
    except (SafetensorError, OSError) as exc:
        raise _unreadable(Path(path), exc) from None


def check_safetensors(path: str | Path) -> None:
    """A PolyspecError naming ``path`` when its safetensors header does not parse (:func:`header_problem`)."""
    read_header(path)


# Binary files a level may hold besides safetensors, by name: SentencePiece models and ONNX graphs (+ their external
# data). Neither is ever unpickled; every other file of a level is safetensors or UTF-8 text.
BINARY_NAMES = re.compile(r"(^|/)([^/]*\.model|[^/]*\.onnx([._]data)?)$")
_PICKLE = re.compile(rb"^\x80[\x02-\x05]")  # PROTO opcode of pickle protocols 2-5 (what torch.save and pickle write)
_ZIP = b"PK\x03\x04"  # torch.save's default format: a zip archive holding data.pkl


def content_problem(path: Path, rel: str) -> str | None:
    """Why the file ``path`` (``rel`` in its level) is not a file a level may hold, judged by its bytes: a pickle or a
    zip archive (torch.save) under any name, or, outside :data:`BINARY_NAMES`, anything that is not UTF-8 text.
    Safetensors files are judged by their header (:func:`read_header`), not here."""
    if rel.endswith(SAFETENSORS_SUFFIX):
        return None
    with open(path, "rb") as f:
        head = f.read(8)
        kind = "pickle" if _PICKLE.match(head) else "zip archive (torch.save format)" if head.startswith(_ZIP) else ""
        if kind:
            return f"{path} is a {kind} (by its content); a chain holds weights as safetensors only"
        if BINARY_NAMES.search(rel):
            return None
        data = head + f.read()
    if b"\0" in data or not _is_utf8(data):
        return (f"{path} is neither a safetensors file nor UTF-8 text; a level holds safetensors weights, JSON/text "
                "files (config, tokenizer) and SentencePiece / ONNX files by name only")
    return None


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def load_safetensors(path: str | Path, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors file ``path`` (no pickles), onto ``device``."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    try:
        return load_file(str(path), device=device)
    except (SafetensorError, OSError) as exc:
        raise _unreadable(path, exc) from None


SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def write_index(folder: Path) -> Path | None:
    """Write ``model.safetensors.index.json`` naming ``model.safetensors`` for each of its tensors, when a folder has
    that one file and no index (else None). SafeAILab/EAGLE's draft model finds the target's embedding only through
    this index (cnets.py: ``weight_map["model.embed_tokens.weight"]``) and asks the hub for it when it is missing;
    transformers, vLLM and polyspec still read the single file."""
    import json

    folder = Path(folder)
    single, index = folder / SINGLE_FILE, folder / INDEX_FILE
    if not single.is_file() or index.exists():
        return None
    names = sorted(read_header(single))
    # the data bytes: the file less its 8-byte length prefix and JSON header
    with single.open("rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
    body = {"metadata": {"total_size": single.stat().st_size - 8 - header_len},
            "weight_map": {name: SINGLE_FILE for name in names}}
    index.write_text(json.dumps(body, indent=2) + "\n", encoding="utf-8")
    return index
