"""Atomic folder writes: build under a temporary name next to the target, then swap it into place, so a killed
process never leaves a half-written artifact under the real name."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


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


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary file beside it and a rename: readers see the old file or the
    whole new one, never a part."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.chmod(tmp, 0o644)  # mkstemp makes it private; once in place it is an ordinary file
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
