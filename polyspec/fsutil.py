"""Atomic writes of folders and files: build under a temporary name next to the target, then swap it into place, so
a killed process never leaves a half-written artifact under the real name."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def swap_into_place(tmp: Path, out: Path) -> Path:
    """Rename the finished folder ``tmp`` to ``out``, replacing an existing ``out`` (moved aside, then removed)."""
    tmp, out = Path(tmp), Path(out)
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)
    return out


def atomic_folder(out: str | Path, write: Callable[[Path], object]) -> Path:
    """Call ``write(tmp)`` on a fresh temporary folder beside ``out``, then swap it into place; on any exception
    (KeyboardInterrupt included) the temporary folder is removed and ``out`` is left as it was."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        write(tmp)
        return swap_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def atomic_file(path: str | Path, write: Callable[[Path], object]) -> Path:
    """Call ``write(tmp)`` on a temporary file name beside ``path`` (same suffix, so writers that pick a format by
    it still do), then rename it to ``path``; on any exception the temporary file is removed and ``path`` is left as
    it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=path.suffix, dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600: the artifact should read like any other file
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_text(path: str | Path, text: str) -> Path:
    """``path`` holds ``text`` (UTF-8), written atomically."""
    return atomic_file(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def write_json(path: str | Path, data: Any, *, indent: int = 1, default: Callable[[Any], Any] | None = None,
               sort_keys: bool = False) -> Path:
    """``path`` holds ``data`` as JSON plus a final newline, written atomically."""
    return write_text(path, json.dumps(data, indent=indent, default=default, sort_keys=sort_keys) + "\n")
