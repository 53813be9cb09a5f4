"""What ran, where: package versions, git state, hardware and the command line, for manifests and MLflow runs.

Everything here is cheap and never raises on an ordinary machine: package versions come from
``importlib.metadata`` (the packages themselves are never imported), git is asked through a subprocess with a short
timeout, and CUDA is described only through an already importable ``torch``.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

# Distributions whose versions a stamp records when they are installed (both mlflow flavours, both onnxruntimes).
STAMPED_PACKAGES: tuple[str, ...] = (
    "torch",
    "transformers",
    "datasets",
    "accelerate",
    "safetensors",
    "huggingface_hub",
    "gguf",
    "lightning",
    "mlflow",
    "mlflow-skinny",
    "onnx",
    "onnxruntime",
    "onnxruntime-gpu",
    "onnxscript",
    "pydantic",
    "numpy",
    "gptqmodel",
    "deepspeed",
)


def package_versions(names: tuple[str, ...] = STAMPED_PACKAGES) -> dict[str, str]:
    """``{distribution: version}`` for each of ``names`` that is installed; the packages are not imported."""
    out: dict[str, str] = {}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def _git(args: list[str], cwd: Path) -> str | None:
    """stdout of ``git <args>`` run in ``cwd``, stripped; None when git is missing, times out or fails."""
    try:
        proc = subprocess.run(
            ["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10, check=False,
            env={**os.environ, "GIT_OPTIONAL_LOCKS": "0"},  # a read-only query must not take the index lock
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def _code_dir(path: str | Path | None) -> Path:
    """The folder git is asked about: ``path`` (or its parent for a file), default the polyspec sources."""
    p = Path(path) if path is not None else Path(__file__).resolve().parent
    return p if p.is_dir() else p.parent


def git_sha(path: str | Path | None = None) -> str | None:
    """The commit (40 hex digits) checked out where ``path`` lies (default: polyspec's own sources).

    None when that is not inside a git work tree, the repository has no commit yet, or git is not installed.
    """
    sha = _git(["rev-parse", "--verify", "HEAD"], _code_dir(path))
    return sha or None


def git_dirty(path: str | Path | None = None) -> bool | None:
    """True when the work tree holding ``path`` has uncommitted changes (untracked files count); None as for
    :func:`git_sha`."""
    cwd = _code_dir(path)
    if _git(["rev-parse", "--is-inside-work-tree"], cwd) != "true":
        return None
    status = _git(["status", "--porcelain"], cwd)
    return None if status is None else bool(status)


def software_stamp(path: str | Path | None = None) -> dict[str, Any]:
    """polyspec version, Python, platform, git state of the code (see :func:`git_sha`) and installed versions.

    Shape::

        {"polyspec": "0.1.0", "python": "3.11.2", "implementation": "CPython", "platform": "Linux-...",
         "git_sha": "ab12..." | None, "git_dirty": False | None, "packages": {"torch": "2.13.0+cpu", ...}}
    """
    from polyspec import __version__

    return {
        "polyspec": __version__,
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "git_sha": git_sha(path),
        "git_dirty": git_dirty(path),
        "packages": package_versions(),
    }


def _cpu_model() -> str | None:
    """The CPU model name from /proc/cpuinfo (Linux), else what ``platform`` knows, else None."""
    cpuinfo = Path("/proc/cpuinfo")
    try:
        for line in cpuinfo.read_text(encoding="utf-8", errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model", "cpu model") and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or None


def _memory_gib() -> float | None:
    """Physical memory in GiB (from sysconf; None where that is unavailable)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None
    return round(total / 2**30, 2) if total > 0 else None


def _cuda_stamp(import_torch: bool) -> dict[str, Any]:
    """CUDA devices as torch sees them; ``{"available": False, ...}`` on a CPU machine, never raises."""
    torch = sys.modules.get("torch")
    if torch is None and import_torch and importlib.util.find_spec("torch") is not None:
        import torch
    if torch is None:
        return {"available": None, "reason": "torch not imported"}
    try:
        if not torch.cuda.is_available():
            return {"available": False, "torch_cuda": torch.version.cuda}
        devices = []
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            devices.append({
                "name": props.name,
                "capability": f"{props.major}.{props.minor}",
                "memory_gib": round(props.total_memory / 2**30, 2),
            })
        return {"available": True, "torch_cuda": torch.version.cuda, "devices": devices}
    except Exception as exc:  # a broken driver must not stop a run from being recorded
        return {"available": False, "error": f"{type(exc).__name__}: {exc}"}


def hardware_stamp(import_torch: bool = True) -> dict[str, Any]:
    """CPU model, logical cores, memory and CUDA devices.

    CUDA is asked through torch: the one already imported, else (``import_torch=True``, the default) torch is
    imported when installed; with ``import_torch=False`` and torch not yet imported, ``cuda.available`` is None.
    Shape::

        {"machine": "x86_64", "cpu": "AMD EPYC ..." | None, "logical_cores": 2, "memory_gib": 7.76 | None,
         "cuda": {"available": True, "torch_cuda": "12.4",
                  "devices": [{"name": "NVIDIA H100", "capability": "9.0", "memory_gib": 79.1}]}}
    """
    return {
        "machine": platform.machine(),
        "cpu": _cpu_model(),
        "logical_cores": os.cpu_count(),
        "memory_gib": _memory_gib(),
        "cuda": _cuda_stamp(import_torch),
    }


def command_line(argv: list[str] | None = None) -> str:
    """The command that started this process (default ``sys.argv``), shell-quoted, program shown by name only.

    ``/venv/bin/polyspec run r.yaml`` -> ``polyspec run r.yaml``; ``python -m polyspec ...`` (argv[0] is the
    package's ``__main__.py``) -> ``python -m polyspec ...``, and ``python -m polyspec.bench ...`` likewise.
    """
    args = list(sys.argv if argv is None else argv)
    if not args:
        return ""
    prog = Path(args[0])
    if prog.name == "__main__.py":  # every polyspec __main__ is polyspec's own or a stage's (polyspec.train, ...)
        pkg = prog.parent.name
        head = ["python", "-m", pkg if pkg == "polyspec" else f"polyspec.{pkg}"]
    else:
        head = [prog.name or args[0]]
    return shlex.join(head + [str(a) for a in args[1:]])
