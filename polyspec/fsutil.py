"""Atomic writes of folders and files: build under a temporary name next to the target, then swap it into place, so
a killed process never leaves a half-written artifact under the real name.

Temporary folders are named ``.<name>.tmp-<pid>@<host>.<random>`` (``.<name>.old-<pid>@<host>`` while a swap moves
the old folder aside), so a later run can tell a dead writer's leftovers from a live writer's work and remove them
(:func:`remove_stale_temps`). A finished stage output carries the sha256 of its files in ``polyspec-hashes.json``
(:func:`write_file_hashes`) and is checked against it before it is reused (:func:`verify_output`).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from polyspec.errors import PolyspecError

FILE_HASHES = "polyspec-hashes.json"
HASHES_FORMAT = "polyspec.file-hashes/1"
# leftovers without a pid in their name (written before names carried one) are removed after this long untouched;
# so are another host's (a shared file system: its pids mean nothing here)
STALE_AFTER_S = 24 * 3600
_OWNED = re.compile(r"^\.{1,2}(?P<name>.+?)\.(?:tmp|old)-(?P<pid>\d+)@(?P<host>[A-Za-z0-9-]+)(?:\.|$)")
_TEMP_NAME = re.compile(r"^\.{1,2}.+?\.(?:tmp|old)-")


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:40] or "host"


def _owner() -> str:
    return f"{os.getpid()}@{_host()}"


def temp_folder(out: str | Path) -> Path:
    """A fresh temporary folder beside ``out`` whose name records this process (after removing the stale temporary
    folders of dead writers there)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(out)
    return Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-{_owner()}.", dir=out.parent))


def swap_into_place(tmp: Path, out: Path) -> Path:
    """Rename the finished folder ``tmp`` to ``out``, replacing an existing ``out`` (moved aside, then removed)."""
    tmp, out = Path(tmp), Path(out)
    if out.exists():
        old = out.with_name(f".{out.name}.old-{_owner()}")
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)
    return out


def copy_tree(src: str | Path, dst: str | Path, ignore: Callable[..., Any] | None = None) -> Path:
    """shutil.copytree, but a file the file system refuses (a full disk, no permission) raises its own OSError (with
    its errno) rather than the shutil.Error copytree gathers after trying every other file."""
    refused: list[OSError] = []

    def copy(a: str, b: str) -> Any:
        try:
            return shutil.copy2(a, b)
        except OSError as exc:
            refused.append(exc)
            raise

    try:
        return Path(shutil.copytree(src, dst, ignore=ignore, copy_function=copy))
    except shutil.Error:
        if refused:
            raise refused[0] from None
        raise


def discard_folder(folder: str | Path) -> None:
    """Remove ``folder`` so that a kill midway leaves no half-deleted folder under its name (it is renamed to a
    temporary name first, which a later run cleans up)."""
    folder = Path(folder)
    if folder.exists():
        old = folder.with_name(f".{folder.name}.old-{_owner()}")
        os.replace(folder, old)
        shutil.rmtree(old, ignore_errors=True)


def atomic_folder(out: str | Path, write: Callable[[Path], object], *, hashes: bool = False) -> Path:
    """Call ``write(tmp)`` on a fresh temporary folder beside ``out``, then swap it into place; on any exception
    (KeyboardInterrupt included) the temporary folder is removed and ``out`` is left as it was. ``hashes``: record
    the sha256 of every written file in the folder (:func:`write_file_hashes`) before the swap."""
    out = Path(out)
    existed = out.exists()
    try:
        tmp = temp_folder(out)
    except OSError as exc:
        raise write_error(exc, out, existed) from None
    try:
        write(tmp)
        if hashes:
            write_file_hashes(tmp)
        return swap_into_place(tmp, out)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        refused = refused_write(exc)
        if refused is not None:
            raise write_error(refused, out, existed) from None
        raise


# what the file system answers when it will not take a write: one error naming the output, not a traceback
REFUSED_WRITES = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG})


class WriteRefused(PolyspecError):
    """A write the file system refused (:func:`write_error`); ``cause`` is its OSError, so that a writer around the
    one that failed (export around assemble) names its own output instead."""

    def __init__(self, message: str, cause: OSError):
        super().__init__(message, exit_code=1)
        self.cause = cause


def refused_write(exc: BaseException) -> OSError | None:
    """The OSError of a write the file system refused, when ``exc`` is one (or reports one), else None."""
    if isinstance(exc, WriteRefused):
        return exc.cause
    if isinstance(exc, OSError) and exc.errno in REFUSED_WRITES:
        return exc
    return None


def write_error(exc: OSError, out: str | Path, existed: bool) -> WriteRefused:
    """The error for a write of ``out`` that failed with ``exc`` after its temporary files were removed (exit 1):
    what failed, that nothing was left half-written, and what to do."""
    out = Path(out)
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        reason = f"no space left on the device of {out}" + (" (disk quota)" if exc.errno == errno.EDQUOT else "")
        fix = "free some space (or write elsewhere) and run again"
    else:
        reason = f"{exc.strerror or exc}" + (f" ({exc.filename})" if exc.filename else "")
        fix = "fix the permissions (or write elsewhere) and run again"
    kept = "the old one is intact" if existed else "nothing was written under that name"
    return WriteRefused(f"writing {out} failed: {reason}; {kept}, its temporary files are removed; {fix}", exc)


def check_replaceable(out: str | Path, *, flag: str, overwrite: bool, own: Callable[[Path], list[str]],
                      keep: Iterable[str | Path] = (), kept: str = "the chain") -> None:
    """Refuse, before any work, an output ``out`` (given as ``flag``) that would destroy something else when it is
    written atomically: one inside, equal to or holding a folder in ``keep`` (the inputs), a file, an existing
    folder without ``overwrite``, or a non-empty folder that is not an earlier output of the same command (``own``
    returns the entries of a folder that such an output would not hold)."""
    out = Path(out)
    where = out.resolve()
    for k in keep:
        k = Path(k).resolve()
        how = "is" if where == k else "is inside" if k in where.parents else "holds" if where in k.parents else None
        if how:
            raise PolyspecError(f"{flag} {out} {how} {kept} {k}; write it elsewhere (outside {kept})")
    if not out.exists() and not out.is_symlink():
        return
    if not out.is_dir() or out.is_symlink():
        raise PolyspecError(f"{flag} {out} is a file (or a link); {flag} names a folder to write: choose another")
    if not overwrite:
        raise PolyspecError(f"{out} exists; pass --overwrite or choose another {flag}")
    strangers = own(out)
    if strangers:
        shown = ", ".join(strangers[:5]) + (", ..." if len(strangers) > 5 else "")
        raise PolyspecError(f"{flag} {out} holds files this command does not write ({shown}); --overwrite replaces "
                            f"only a folder it wrote itself: choose an empty or new folder")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def _untouched_for(p: Path, now: float) -> float:
    try:
        return now - p.lstat().st_mtime
    except OSError:  # already gone
        return 0.0


def _is_stale(p: Path, out_name: str, now: float) -> bool:
    """Whether ``p`` (an entry beside an output named ``out_name``) is a temporary folder nobody is writing."""
    m = _OWNED.match(p.name)
    if m:
        if m.group("host") == _host():
            return not _alive(int(m.group("pid")))
        return _untouched_for(p, now) > STALE_AFTER_S
    # older names, only for this very output: ``.<name>.tmp-<pid>-<random>`` (pid known) or ``.<name>.tmp-<random>``
    legacy = re.match(r"^\.{1,2}" + re.escape(out_name) + r"\.(?:tmp|old)-(?:(\d+)-)?", p.name)
    if not legacy:
        return False
    if legacy.group(1) is not None:
        return not _alive(int(legacy.group(1)))
    return _untouched_for(p, now) > STALE_AFTER_S


def remove_stale_temps(out: str | Path) -> list[Path]:
    """Delete the temporary folders beside ``out`` that dead runs left (a kill -9 skips every cleanup): polyspec's
    own names only, of any output when the name records its writer, of ``out`` itself for older names. A folder whose
    writer is alive on this host is never touched. Returns what was removed."""
    out = Path(out)
    if not out.parent.is_dir():
        return []
    now, removed = time.time(), []
    for p in out.parent.iterdir():
        if p.name.startswith(".") and p.is_dir() and not p.is_symlink() and _is_stale(p, out.name, now):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


# ---------------------------------------------------------------------------------------------------------------------
# File hashes of a stage output


def _listed_files(folder: Path) -> list[str]:
    """Files below ``folder`` (relative POSIX paths, sorted) but the hash record and other writers' temporary
    folders."""
    files = []
    for p in folder.rglob("*"):
        rel = p.relative_to(folder)
        if rel.as_posix() == FILE_HASHES or _TEMP_NAME.match(rel.parts[0]) or not p.is_file():
            continue
        files.append(rel.as_posix())
    return sorted(files)


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    """The sha256 of a file's bytes (hex), read in chunks: the one hasher of stage outputs and chain manifests."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def file_hashes(folder: str | Path) -> dict[str, str]:
    """sha256 of every file of a stage output (the hash record and temporary folders left out)."""
    folder = Path(folder)
    return {rel: sha256_file(folder / rel) for rel in _listed_files(folder)}


def write_file_hashes(folder: str | Path) -> Path:
    """Record the sha256 of every file of ``folder`` in ``folder/polyspec-hashes.json`` (atomically)."""
    folder = Path(folder)
    return write_json(folder / FILE_HASHES, {"format": HASHES_FORMAT, "files": file_hashes(folder)}, sort_keys=True)


def hash_problems(folder: str | Path) -> list[str] | None:
    """Missing, changed and unlisted files of ``folder`` against its hash record ([] when intact); None when it has
    no record (written before outputs carried one)."""
    folder = Path(folder)
    try:
        record = json.loads((folder / FILE_HASHES).read_text(encoding="utf-8"))
        listed = dict(record["files"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return [f"{folder / FILE_HASHES} is unreadable ({type(exc).__name__})"]
    found = file_hashes(folder)
    problems = [f"{rel} is missing" for rel in listed if rel not in found]
    problems += [f"{rel} changed (its sha256 differs from the record)" for rel, h in found.items()
                 if rel in listed and listed[rel] != h]
    problems += [f"{rel} is not in the record" for rel in found if rel not in listed]
    return problems


def unreadable_weights(folder: str | Path) -> list[str]:
    """The safetensors files below ``folder`` whose header does not open or does not cover the file (truncated)."""
    from polyspec.weights import SAFETENSORS_SUFFIX, header_problem

    folder, problems = Path(folder), []
    for rel in _listed_files(folder):
        reason = header_problem(folder / rel) if rel.endswith(SAFETENSORS_SUFFIX) else None
        if reason is not None:
            problems.append(f"{rel} is not a readable safetensors file ({reason})")
    return problems


def verify_output(folder: str | Path) -> list[str]:
    """What is wrong with the finished stage output ``folder`` ([] when it may be reused), after removing the stale
    temporary folders beside it. A folder with a hash record is re-hashed against it; a folder from before records
    existed is checked for readable safetensors files and, when they are, hashed now (trusted from then on)."""
    folder = Path(folder)
    remove_stale_temps(folder)
    problems = hash_problems(folder)
    if problems is None:
        problems = unreadable_weights(folder)
        if not problems:
            try:
                write_file_hashes(folder)
            except OSError:  # a read-only folder: checked again (and hashed) on its next reuse
                pass
    return problems


def damage_note(folder: str | Path, problems: list[str]) -> str:
    """One message for a damaged stage output that is about to be redone."""
    return f"{folder} is damaged ({'; '.join(problems[:5])}{'; ...' if len(problems) > 5 else ''}); redoing it"


# ---------------------------------------------------------------------------------------------------------------------
# Files


def atomic_file(path: str | Path, write: Callable[[Path], object]) -> Path:
    """Call ``write(tmp)`` on a temporary file name beside ``path`` (same suffix, so writers that pick a format by
    it still do), then rename it to ``path``; on any exception the temporary file is removed and ``path`` is left as
    it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=path.suffix, dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    existed = path.exists()
    try:
        write(tmp)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600: the artifact should read like any other file
        os.replace(tmp, path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        refused = refused_write(exc)
        if refused is not None:
            raise write_error(refused, path, existed) from None
        raise
    return path


def write_text(path: str | Path, text: str) -> Path:
    """``path`` holds ``text`` (UTF-8), written atomically."""
    return atomic_file(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def write_json(path: str | Path, data: Any, *, indent: int = 1, default: Callable[[Any], Any] | None = None,
               sort_keys: bool = False) -> Path:
    """``path`` holds ``data`` as JSON plus a final newline, written atomically."""
    return write_text(path, json.dumps(data, indent=indent, default=default, sort_keys=sort_keys) + "\n")
