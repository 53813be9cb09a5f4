"""polyspec as a wheel, written from the installed package: what an MLflow model carries so that its environment
installs polyspec without a package index (no index has polyspec 0.1.0).

The files are the imported packages' own (an editable install maps ``polyspec.decode`` to ``decode/`` and so on),
so the wheel holds exactly the code that is running; no build backend or subprocess is involved.
"""

from __future__ import annotations

import base64
import hashlib
import importlib
import importlib.metadata
import zipfile
from pathlib import Path

# The packages pyproject.toml's [tool.setuptools] installs (tests/test_mlflow_model.py keeps the two lists equal)
PACKAGES = ("polyspec", "polyspec.data", "polyspec.decode", "polyspec.decode.drafting", "polyspec.decode.serve",
            "polyspec.train", "polyspec.quantize", "polyspec.export", "polyspec.bench")
SUFFIXES = (".py", ".cpp")  # the modules and the package data (decode/cpu_kernels.cpp)
TAG = "py3-none-any"


def package_files() -> dict[str, Path]:
    """{path inside the wheel: file on disk} of every module and data file of :data:`PACKAGES`."""
    out = {}
    for name in PACKAGES:
        folder = Path(importlib.import_module(name).__file__).parent
        for f in sorted(folder.iterdir()):
            if f.is_file() and f.suffix in SUFFIXES:
                out[f"{name.replace('.', '/')}/{f.name}"] = f
    return out


def write_wheel(out_dir: Path) -> Path:
    """Write ``polyspec-<version>-py3-none-any.whl`` into ``out_dir`` and return its path."""
    dist = importlib.metadata.distribution("polyspec")
    version = dist.version
    info = f"polyspec-{version}.dist-info"
    entries = {rel: path.read_bytes() for rel, path in package_files().items()}
    entries[f"{info}/METADATA"] = (dist.read_text("METADATA") or f"Metadata-Version: 2.1\nName: polyspec\n"
                                   f"Version: {version}\n").encode()
    entries[f"{info}/WHEEL"] = f"Wheel-Version: 1.0\nGenerator: polyspec\nRoot-Is-Purelib: true\nTag: {TAG}\n".encode()
    entries[f"{info}/entry_points.txt"] = b"[console_scripts]\npolyspec = polyspec.cli:main\n"
    record = [f"{rel},sha256={_digest(data)},{len(data)}" for rel, data in entries.items()] + [f"{info}/RECORD,,"]
    entries[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    out = Path(out_dir) / f"polyspec-{version}-{TAG}.whl"
    out.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        for rel, data in entries.items():
            z.writestr(rel, data)
    return out


def _digest(data: bytes) -> str:
    """RECORD's hash: urlsafe base64 of the sha256, without padding (PEP 376 / the wheel spec)."""
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


__all__ = ["PACKAGES", "package_files", "write_wheel"]
