"""Reading files that may be hostile (a chain folder from someone else, a recipe, a request body): bounded size,
bounded nesting, UTF-8 only, YAML aliases that cannot multiply, and every problem one PolyspecError naming the file.

Python's JSON parser and PyYAML's composer recurse once per nesting level, so 100,000 ``[`` is a RecursionError deep
inside them; a YAML alias repeated under aliases ("billion laughs") is a few lines that expand to billions of values
once anything walks them. Both are refused here before they reach a parser or a validator: JSON by a linear scan of
its brackets, YAML while it is composed (depth and expanded size counted node by node).
"""

from __future__ import annotations

import json
import re
from itertools import accumulate
from pathlib import Path
from typing import Any

from polyspec.errors import PolyspecError

# A JSON string, or an unterminated one up to the end (so that a scan never restarts inside one: linear time)
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"?', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_DEPTH_STEP = [1 if b in b"[{" else -1 if b in b"]}" else 0 for b in range(256)]

# YAML: polyspec's recipes nest 4 mappings deep (data.regen.endpoint.url); 32 leaves room for lists of mappings and
# stays far below the composer's recursion limit.
MAX_YAML_DEPTH = 32
# YAML: values (scalars, lists, mappings) a document may expand to, aliases counted each time they are used: a full
# recipe is ~200; a billion-laughs document passes this after a few thousand.
MAX_YAML_NODES = 100_000


def json_depth(raw: bytes) -> int:
    """How deep arrays and objects nest in a JSON text, found without parsing it: strings are cut out, then the
    brackets left are counted (C-speed scans; 4 MiB of brackets takes a fraction of a second)."""
    brackets = _JSON_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    return max(accumulate(map(_DEPTH_STEP.__getitem__, brackets)), default=0)


def read_bytes(path: Path, max_bytes: int, what: str, fix: str = "") -> bytes:
    """The bytes of ``path``, refused (before reading) when it is larger than ``max_bytes``."""
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise PolyspecError(f"{path}: {size:,} bytes is over the {max_bytes:,} a {what} may have{fix}")
        with open(path, "rb") as f:
            raw = f.read(max_bytes + 1)
    except OSError as exc:
        raise PolyspecError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if len(raw) > max_bytes:  # it grew while being read
        raise PolyspecError(f"{path}: over the {max_bytes:,} bytes a {what} may have{fix}")
    return raw


def utf8_text(raw: bytes, where: str | Path) -> str:
    """``raw`` as UTF-8 text, or one error giving the offset of the first byte that is not UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        bad = raw[exc.start:exc.start + 1].hex()
        raise PolyspecError(f"{where}: byte 0x{bad} at offset {exc.start} is not UTF-8 text (the file is damaged or "
                            "in another encoding; save it as UTF-8)") from None


def parse_json(raw: bytes, where: str | Path, max_depth: int) -> Any:
    """A JSON document from untrusted bytes: UTF-8, nested at most ``max_depth`` deep, syntactically valid."""
    text = utf8_text(raw, where)
    depth = json_depth(raw)
    if depth > max_depth:
        raise PolyspecError(f"{where}: arrays/objects nest {depth} deep; at most {max_depth} levels are accepted")
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:  # ValueError: bad JSON, or an integer of over 4,300 digits
        raise PolyspecError(f"{where}: not valid JSON ({exc})") from None


def read_json(path: Path, *, max_bytes: int, max_depth: int, what: str = "JSON file") -> Any:
    """:func:`parse_json` of the file ``path``, refused first when it is over ``max_bytes``."""
    return parse_json(read_bytes(path, max_bytes, what), path, max_depth)


class YamlLimit(Exception):
    """A YAML document over :data:`MAX_YAML_DEPTH` or :data:`MAX_YAML_NODES` (``line`` is 1-based)."""

    def __init__(self, message: str, line: int):
        super().__init__(message)
        self.line = line


def bounded_loader(base: type) -> type:
    """A subclass of the PyYAML loader ``base`` that refuses, while composing, nesting deeper than MAX_YAML_DEPTH
    and a document that expands (aliases counted every time they are used) to more than MAX_YAML_NODES values."""

    class Bounded(base):
        def __init__(self, stream: Any):
            super().__init__(stream)
            self._depth = 0
            self._sizes: dict[int, int] = {}  # id(node) -> values it expands to (the nodes live as long as the loader)

        def compose_node(self, parent: Any, index: Any) -> Any:
            self._depth += 1
            try:
                if self._depth > MAX_YAML_DEPTH:
                    mark = self.peek_event().start_mark
                    raise YamlLimit(f"values nest more than {MAX_YAML_DEPTH} deep", mark.line + 1)
                node = super().compose_node(parent, index)
            finally:
                self._depth -= 1
            if id(node) not in self._sizes:
                self._sizes[id(node)] = size = 1 + sum(self._sizes.get(id(c), 1) for c in _children(node))
                if size > MAX_YAML_NODES:
                    raise YamlLimit(f"this value expands to more than {MAX_YAML_NODES:,} values (aliases counted "
                                    "each time they are used)", node.start_mark.line + 1)
            return node

    return Bounded


def _children(node: Any) -> list[Any]:
    value = node.value
    if isinstance(value, list):
        return [x for item in value for x in (item if isinstance(item, tuple) else (item,))]
    return []


def load_yaml(text: str, where: str | Path, loader: type | None = None) -> Any:
    """One YAML document through :func:`bounded_loader` (of ``loader``, default yaml.SafeLoader); over a limit is one
    PolyspecError naming ``where`` and the line. Other YAML errors propagate (callers word them)."""
    import yaml

    try:
        return yaml.load(text, Loader=bounded_loader(loader or yaml.SafeLoader))  # noqa: S506 - a SafeLoader
    except YamlLimit as exc:
        raise PolyspecError(f"{where}: line {exc.line}: {exc}; a recipe needs neither") from None
    except RecursionError:  # unreachable below MAX_YAML_DEPTH; kept so that no traceback ever escapes
        raise PolyspecError(f"{where}: values nest too deep to read") from None


__all__ = ["MAX_YAML_DEPTH", "MAX_YAML_NODES", "json_depth", "read_bytes", "utf8_text", "parse_json", "read_json",
           "bounded_loader", "load_yaml", "YamlLimit"]
