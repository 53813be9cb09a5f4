"""The product's functions stay short: none over MAX_LINES lines (decorators and docstring included) in the installed
packages' source folders (tests and lab/ are not the product)."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ROOMS = ("polyspec", "train", "quantize", "export", "decode", "data", "bench")
MAX_LINES = 60
ALLOWED: set[str] = set()  # "room/file.py:name" of a function allowed over the limit, with the reason beside it


def long_functions(root: Path, rooms: tuple[str, ...], limit: int) -> dict[str, int]:
    """{"room/file.py:name": lines} of every function or method longer than ``limit`` lines under ``rooms``."""
    found = {}
    for room in rooms:
        for path in sorted((root / room).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                    lines = node.end_lineno - first + 1
                    if lines > limit:
                        found[f"{path.relative_to(root).as_posix()}:{node.name}"] = lines
    return found


def test_no_function_over_the_limit():
    long = {k: n for k, n in long_functions(REPO, ROOMS, MAX_LINES).items() if k not in ALLOWED}
    assert not long, f"functions over {MAX_LINES} lines (split them into named steps): {long}"


def test_the_walk_finds_a_long_function(tmp_path):
    body = "\n".join(f"        x{i} = {i}" for i in range(MAX_LINES))
    (tmp_path / "room").mkdir()
    (tmp_path / "room" / "m.py").write_text(f"def short():\n    return 1\n\n\nclass C:\n    def long(self):\n{body}\n")
    assert long_functions(tmp_path, ("room",), MAX_LINES) == {"room/m.py:long": MAX_LINES + 1}
