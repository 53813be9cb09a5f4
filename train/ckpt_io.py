"""Training checkpoints without pickles: one safetensors file per checkpoint.

A Lightning checkpoint is a tree of dicts, lists and tuples whose leaves are tensors or plain values (ints, floats,
strings, bools, None). :func:`encode_tree` moves every tensor into a flat ``{"t<N>": tensor}`` map and writes the rest
as JSON with small markers (``{"__tensor__": "t3"}``, ``{"__tuple__": [...]}``, ``{"__dict__": [[key, value], ...]}``
for dicts with non-string keys such as an optimizer's per-parameter state). :func:`save_tree` stores both in one
safetensors file (tensors as tensors, the JSON as the file's metadata), written to a temporary name and renamed;
:func:`load_tree` reads it back. Anything else in the tree (a module, a function) is an error, never pickled.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from polyspec.errors import PolyspecError
from polyspec.fsutil import atomic_file

TREE_KEY = "polyspec_checkpoint_tree"
FORMAT_KEY = "polyspec_checkpoint_format"
FORMAT = "1"


def encode_tree(tree: Any, tensors: dict[str, torch.Tensor] | None = None, where: str = "checkpoint"
                ) -> tuple[Any, dict[str, torch.Tensor]]:
    """(JSON-able tree with tensor references, {name: tensor}) for a nested dict/list/tuple ``tree``."""
    tensors = {} if tensors is None else tensors

    def enc(x: Any, path: str) -> Any:
        if isinstance(x, torch.Tensor):
            name = f"t{len(tensors)}"
            tensors[name] = x.detach().to("cpu").contiguous().clone()
            return {"__tensor__": name}
        if x is None or isinstance(x, (bool, int, str)):
            return x
        if isinstance(x, float):
            return x if math.isfinite(x) else {"__float__": repr(x)}
        if isinstance(x, tuple):
            return {"__tuple__": [enc(v, f"{path}[{i}]") for i, v in enumerate(x)]}
        if isinstance(x, list):
            return [enc(v, f"{path}[{i}]") for i, v in enumerate(x)]
        if isinstance(x, dict):
            if all(isinstance(k, str) for k in x) and not any(k.startswith("__") and k.endswith("__") for k in x):
                return {k: enc(v, f"{path}.{k}") for k, v in x.items()}
            return {"__dict__": [[enc(k, path), enc(v, f"{path}[{k!r}]")] for k, v in x.items()]}
        if isinstance(x, torch.dtype):
            return {"__dtype__": str(x).removeprefix("torch.")}
        raise PolyspecError(f"{where}: cannot store {type(x).__name__} at {path} without pickling; only tensors, "
                            "numbers, strings, None, lists, tuples and dicts are allowed", exit_code=1)

    return enc(tree, "$"), tensors


def decode_tree(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of :func:`encode_tree`."""
    if isinstance(tree, list):
        return [decode_tree(v, tensors) for v in tree]
    if isinstance(tree, dict):
        if "__tensor__" in tree:
            return tensors[tree["__tensor__"]]
        if "__tuple__" in tree:
            return tuple(decode_tree(v, tensors) for v in tree["__tuple__"])
        if "__dict__" in tree:
            return {_hashable(decode_tree(k, tensors)): decode_tree(v, tensors) for k, v in tree["__dict__"]}
        if "__float__" in tree:
            return float(tree["__float__"])
        if "__dtype__" in tree:
            return getattr(torch, tree["__dtype__"])
        return {k: decode_tree(v, tensors) for k, v in tree.items()}
    return tree


def _hashable(k: Any) -> Any:
    return tuple(_hashable(v) for v in k) if isinstance(k, list) else k


def save_tree(tree: Any, path: str | Path) -> Path:
    """Write ``tree`` to one safetensors file at ``path`` (atomically)."""
    from safetensors.torch import save_file

    path = Path(path)
    encoded, tensors = encode_tree(tree, where=str(path))
    metadata = {TREE_KEY: json.dumps(encoded), FORMAT_KEY: FORMAT}
    return atomic_file(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))


def load_tree(path: str | Path, device: str | torch.device = "cpu") -> Any:
    """Read a file written by :func:`save_tree`."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise PolyspecError(f"checkpoint {path} does not exist", exit_code=1)
    try:
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
    except Exception as exc:  # safetensors raises its own error types for damaged files
        raise PolyspecError(f"checkpoint {path} is not a readable safetensors file ({exc}); delete it to start "
                            "that training run again", exit_code=1) from None
    if meta.get(FORMAT_KEY) != FORMAT or TREE_KEY not in meta:
        raise PolyspecError(f"{path} is not a polyspec training checkpoint (format {meta.get(FORMAT_KEY)!r})",
                            exit_code=1)
    return decode_tree(json.loads(meta[TREE_KEY]), tensors)
