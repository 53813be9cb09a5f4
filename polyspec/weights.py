"""Which weight files polyspec reads, and the one place it opens a safetensors file.

Weights are safetensors only: a pickle (``torch.load``) can run code, so no loader here or in transformers (called
with ``use_safetensors=True``) ever reads one. A file that claims to be safetensors but is not (another format, a
truncated copy, a damaged header) is one PolyspecError naming it, never a SafetensorError traceback.
"""

from __future__ import annotations

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


def header_problem(path: str | Path) -> str | None:
    """Why the header of ``path`` does not parse (its length, JSON, the tensors' offsets covering the file exactly),
    or None when it does. Reads the header only; needs no torch."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="np") as f:
            f.keys()
    except (SafetensorError, OSError) as exc:
        return str(exc)
    return None


def check_safetensors(path: str | Path) -> None:
    """A PolyspecError naming ``path`` when its safetensors header does not parse (:func:`header_problem`)."""
    problem = header_problem(path)
    if problem is not None:
        raise _unreadable(Path(path), problem)


def load_safetensors(path: str | Path, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors file ``path`` (no pickles), onto ``device``."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    try:
        return load_file(str(path), device=device)
    except (SafetensorError, OSError) as exc:
        raise _unreadable(path, exc) from None
