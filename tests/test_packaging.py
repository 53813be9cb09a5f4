"""The wheel holds only the polyspec package tree: nothing generic (data, train, ...) lands in site-packages."""

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_wheel_has_only_polyspec(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), str(REPO)], check=True, capture_output=True)
    wheel = next(tmp_path.glob("polyspec-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"polyspec", next(t for t in tops if t.endswith(".dist-info"))}, tops
    for sub in ("data", "decode", "decode/serve", "train", "quantize", "export", "bench"):
        assert f"polyspec/{sub}/__init__.py" in names
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "polyspec = polyspec.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()


def test_wheel_ships_the_rooms_and_the_cpu_kernel_source(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), str(REPO)], check=True, capture_output=True)
    names = zipfile.ZipFile(next(tmp_path.glob("polyspec-*.whl"))).namelist()
    for module in ("bench/bench.py", "bench/__main__.py", "decode/serve/server.py", "decode/serve/app.py",
                   "train/__main__.py", "quantize/__main__.py"):
        assert f"polyspec/{module}" in names
    assert "polyspec/decode/cpu_kernels.cpp" in names  # compiled on first use: the wheel must carry the source


# The engine room (decode/, serving aside) sits below every stage: it imports none of these.
ABOVE_THE_ENGINE = ("polyspec.data", "polyspec.config", "polyspec.export", "polyspec.bench", "polyspec.pipeline",
                    "polyspec.train", "polyspec.quantize", "polyspec.decode.serve")


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at the top or inside functions (``from polyspec import data`` counts as
    ``polyspec.data``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def test_imported_modules_sees_imports_inside_functions(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("import os\ndef f():\n    from polyspec import config\n    import polyspec.bench.bench\n")
    assert {"os", "polyspec.config", "polyspec.bench.bench"} <= imported_modules(src)


def test_engine_imports_no_stage_above_it():
    engine = [p for p in (REPO / "decode").rglob("*.py") if "serve" not in p.relative_to(REPO / "decode").parts]
    assert len(engine) > 5, engine
    bad = {f"{p.relative_to(REPO)}: {m}" for p in engine for m in imported_modules(p)
           if any(m == top or m.startswith(top + ".") for top in ABOVE_THE_ENGINE)}
    assert not bad, sorted(bad)
