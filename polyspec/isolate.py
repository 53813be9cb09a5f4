"""Third-party work in a process of its own (``in_fresh_process``).

Why: a library that computes from worker threads leaves process-wide state behind. GPTQModel quantises from a pool of
threads, and each thread that runs a torch op gets an OpenMP team of its own; once libgomp manages more threads than
the machine has CPUs it shortens every barrier's spin, so every later parallel region in the same process (polyspec's
CPU kernels run ~5 per decoder layer) waits on a futex instead. Measured on the 2-core VM: `ar` on the demo chain
164 tok/s before a GPTQ run in the same process, 77-84 after it, 142-151 after it with ``OMP_WAIT_POLICY=active``
(docs/FINDINGS.md, 2026-11-24). ``polyspec run`` profiles the chain right after quantising, so it timed every
level at about half speed. A spawned child shares none of it and exits with it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from polyspec.errors import PolyspecError


def in_fresh_process(what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` in a spawned child process; its return value (both ways pickled: ``fn`` must be a
    module-level function). The child inherits the environment and file descriptors 0-2 (so a
    :func:`polyspec.console.quiet` redirection holds there too). An exception the child raises is raised here with
    its type and fields (a PolyspecError keeps its exit code); a child that dies (killed, out of memory) is one
    PolyspecError naming ``what``."""
    import concurrent.futures as cf
    import multiprocessing as mp

    with cf.ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("spawn")) as pool:
        try:
            return pool.submit(fn, *args, **kwargs).result()
        except cf.process.BrokenProcessPool:
            raise PolyspecError(f"{what}: its worker process died before it finished (killed, or out of memory: "
                                "see the log named on the last line, and the system log)", exit_code=1) from None


__all__ = ["in_fresh_process"]
