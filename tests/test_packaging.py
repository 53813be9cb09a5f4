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


def _package_dirs() -> dict[str, Path]:
    """pyproject's package -> folder map (polyspec.decode -> decode/, polyspec.decode.serve -> decode/serve/)."""
    import tomllib

    cfg = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    dirs = cfg["package-dir"]
    out = {}
    for pkg in cfg["packages"]:
        parent, _, leaf = pkg.rpartition(".")
        out[pkg] = REPO / dirs[pkg] if pkg in dirs else out[parent] / leaf
    return out


def product_modules() -> dict[str, Path]:
    """Every module of the installed product: name -> file."""
    out = {}
    for pkg, folder in _package_dirs().items():
        for f in folder.glob("*.py"):
            out[pkg if f.stem == "__init__" else f"{pkg}.{f.stem}"] = f
    return out


def import_graph() -> dict[str, set[str]]:
    """Product module -> the product modules it imports, anywhere in the file (``from a import b``: b where b is a
    module, else a)."""
    mods = product_modules()
    graph = {}
    for name, path in mods.items():
        found = imported_modules(path)
        graph[name] = {m for m in found if m in mods} | {m.rsplit(".", 1)[0] for m in found
                                                         if m not in mods and m.rsplit(".", 1)[0] in mods}
    return graph


def test_the_engine_reaches_no_stage_above_it_through_any_import_chain():
    graph = import_graph()
    engine = [m for m in graph if m.startswith("polyspec.decode") and not m.startswith("polyspec.decode.serve")]
    assert len(engine) > 10, engine
    for start in engine:
        seen, todo = {start}, [start]
        while todo:
            for nxt in graph[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        above = sorted(m for m in seen if any(m == t or m.startswith(t + ".") for t in ABOVE_THE_ENGINE))
        assert not above, (start, above)


def test_no_import_cycle_among_the_core():
    """polyspec/'s own modules (the core: config, manifest, chain_spec, fsutil, sources ...) import each other
    without a circle, counting imports inside functions."""
    stages = set(_package_dirs()) - {"polyspec"}
    core = {m: {n for n in deps if n.startswith("polyspec.") and n.rpartition(".")[0] == "polyspec" and
                n not in stages} for m, deps in import_graph().items()
            if m.rpartition(".")[0] == "polyspec" and m not in stages}
    assert {"polyspec.config", "polyspec.manifest", "polyspec.chain_spec", "polyspec.fsutil"} <= set(core)
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1  # on the current path
        for n in sorted(core[m]):
            assert state.get(n) != 1, "import circle: " + " -> ".join(path + [m, n])
            if n not in state:
                visit(n, path + [m])
        state[m] = 2

    for m in sorted(core):
        if m not in state:
            visit(m, [])


def test_the_wheel_holds_no_measurement_script_or_probe(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), str(REPO)], check=True, capture_output=True)
    names = zipfile.ZipFile(next(tmp_path.glob("polyspec-*.whl"))).namelist()
    assert not [n for n in names if "/lab/" in n or n.startswith(("lab/", "scripts/")) or "/measure/" in n]
    bench = sorted(n.removeprefix("polyspec/bench/") for n in names if n.startswith("polyspec/bench/"))
    assert bench == ["__init__.py", "__main__.py", "bench.py", "prompts.py", "report.py", "roofline.py",
                     "shape_bench.py"], bench
