"""What the terminal shows: polyspec's own lines and progress bars; everything else goes to a log file.

Third-party libraries write to the process's stdout and stderr in many ways: logging handlers bound at import
(torch's pytree warnings, mlflow, transformers, Lightning), the ``warnings`` module (the ONNX exporter), print()
and their own progress bars (GPTQModel's per-row progress), bare messages through logging's last-resort handler
(torchao's failed library loads), native code and subprocesses (GPTQModel's extension build). Rather than chase each
one, :func:`quiet` points file descriptors 1 and 2 at ``<workdir>/logs/<name>-<UTC time>.log`` while a command runs
and keeps duplicates of the terminal's descriptors for polyspec itself: :func:`say` prints a line there,
:func:`stream` is the file polyspec's own progress bars and rich consoles write to, and :func:`activity` shows one
live bar for a long step that has no bar of its own. The log's path is printed when the command ends.

Nothing happens at import. ``POLYSPEC_CONSOLE=all`` turns the redirection off (everything on the terminal).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

_state: dict[str, Any] | None = None  # while quiet(): {"out", "err": terminal streams, "path": the log file}


def stream(kind: str = "err") -> TextIO:
    """The terminal's stderr (or stdout) for polyspec's own output: the saved one while :func:`quiet` is active."""
    if _state is not None:
        return _state[kind]
    return sys.stderr if kind == "err" else sys.stdout


def say(msg: str) -> None:
    """One polyspec line on the terminal (stderr)."""
    print(msg, file=stream(), flush=True)


def rich_console(stderr: bool = False) -> Any:
    """A rich Console on the terminal (stdout, or stderr), never on the log file."""
    from rich.console import Console

    return Console(file=stream("err" if stderr else "out"), highlight=False)


def log_path() -> Path | None:
    """The log file third-party output goes to now (None: not redirected)."""
    return _state["path"] if _state is not None else None


@contextmanager
def quiet(workdir: str | Path, name: str) -> Iterator[Path | None]:
    """Send the process's stdout / stderr (descriptors 1 and 2) to a new log file under ``<workdir>/logs`` for the
    block; polyspec writes to the terminal through :func:`stream`. Nested calls reuse the outer log. Yields the log
    file's path (None when ``POLYSPEC_CONSOLE=all``)."""
    global _state
    if _state is not None or os.environ.get("POLYSPEC_CONSOLE", "").strip().lower() == "all":
        yield log_path()
        return
    logs = Path(workdir) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    path = logs / f"{name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{os.getpid()}.log"
    sys.stdout.flush()
    sys.stderr.flush()
    streams = sys.stdout, sys.stderr
    # the terminal, for polyspec: duplicates of descriptors 1 and 2 taken before they are pointed at the log
    terminal = {kind: os.fdopen(os.dup(fd), "w", buffering=1, encoding="utf-8", errors="replace")
                for kind, fd in (("out", 1), ("err", 2))}
    with open(path, "ab") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    # Python-level writers on descriptors 1 and 2 as well, where sys.stdout / sys.stderr are not those (pytest,
    # notebooks). A library that keeps one (a handler made during the block) writes to the terminal afterwards.
    sys.stdout = open(1, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)  # noqa: SIM115
    _state = {**terminal, "path": path}
    try:
        yield path
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        sys.stdout, sys.stderr = streams
        os.dup2(terminal["out"].fileno(), 1)
        os.dup2(terminal["err"].fileno(), 2)
        _state = None
        if path.stat().st_size:
            print(f"third-party output (logs, warnings, their progress bars): {path}", file=terminal["err"])
        else:
            path.unlink()
        for f in terminal.values():
            f.close()


@contextmanager
def activity(description: str) -> Iterator[None]:
    """One live bar with the elapsed time on the terminal for a long step that reports no progress of its own (such
    as GPTQModel's quantisation, whose own per-row progress goes to the log); a plain line when not a terminal."""
    out = stream()
    if not out.isatty():
        say(f"{description} ...")
        yield
        return
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    # rich would point sys.stdout / sys.stderr at the terminal while the bar shows: a logging handler made then
    # (tokenicer's basicConfig when GPTQModel is imported) would print everything after it there, not in the log
    with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), transient=True,
                  console=rich_console(stderr=True), redirect_stdout=False, redirect_stderr=False) as bar:
        bar.add_task(description, total=None)
        yield
