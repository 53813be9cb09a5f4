"""Teacher features for head training: online (the teacher runs in the loop) or offline (a sharded cache).

The teacher is the target (or the int4 intermediate) loaded into polyspec's engine
(:class:`polyspec.decode.model.Transformer`); its ``hidden`` output (final-norm'd, lm_head's input) is the EAGLE
feature. Its next-token distribution is ``softmax(lm_head(hidden))``, so the offline cache stores only the features:
the token loss's targets are recomputed from them by the same frozen lm_head the head uses (no top-k or full logits
on disk; the only difference from online mode is the bf16 rounding of the features).

Offline cache layout (``<workdir>/cache/features/<key>/``): ``index.json`` plus shards ``<split>-NNNNN.safetensors``
holding, for the sequences of that shard concatenated, ``hidden`` bf16 [tokens, H], ``input_ids`` int32 [tokens],
``loss_mask`` int8 [tokens] and ``offsets`` int64 [rows + 1]. Bytes per token: ``2 H + 5`` (1,157 for SmolLM2's
H = 576) plus a few bytes of header per shard and 8 per sequence. For an EAGLE-3 head (``aux_layers`` in the index)
``hidden`` is the A fused layers' outputs [tokens, A H] and ``final`` [tokens, H] the final-norm'd state whose
logits are the token loss's targets: ``2 (A + 1) H + 5`` bytes per token. The folder is written under a temporary
name and renamed, so an interrupted extraction leaves nothing half-written.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from polyspec.errors import PolyspecError
from polyspec.fsutil import temp_folder
from polyspec.train.losses import padded_batch

INDEX = "index.json"
CACHE_FORMAT = 1
GB = 1e9  # cache_budget_gb counts decimal gigabytes


# ---------------------------------------------------------------------------------------------------------------------
# Teacher


def load_teacher(path: Path, dtype: torch.dtype, device: str | torch.device) -> torch.nn.Module:
    """The teacher as a frozen, eval-mode polyspec Transformer (GPTQ folders load with int4 layers)."""
    from polyspec.decode.model import Transformer

    model = Transformer.from_pretrained(path, dtype=dtype, device=device)
    model.requires_grad_(False)
    return model.eval()


@torch.no_grad()
def teacher_aux_and_final(teacher: torch.nn.Module, input_ids: torch.Tensor,
                          aux_layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids [B, T] -> (the aux layers' outputs concatenated [B, T, A H], the final-norm'd hidden [B, T, H]: the
    lm_head input, so lm_head(final) are the teacher's logits) from one pass that also captures the last layer."""
    last = teacher.args.num_layers - 1
    states = teacher_hidden(teacher, input_ids, (*aux_layers, last))  # [B, T, (A + 1) H]
    h = teacher.args.hidden_size
    return states[..., :len(aux_layers) * h], teacher.norm(states[..., len(aux_layers) * h:])


@torch.no_grad()
def teacher_outputs(teacher: torch.nn.Module, input_ids: torch.Tensor,
                    aux_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids [B, T] -> (logits [B, T, V] float32, hidden [B, T, H]) from one stateless causal pass; with
    ``aux_layers`` (an EAGLE-3 head) hidden is those layers' outputs concatenated [B, T, A H]."""
    logits, hidden = teacher(input_ids, aux_layers=aux_layers) if aux_layers else teacher(input_ids)
    if logits.dim() == 2:  # the engine squeezes a batch of one
        logits, hidden = logits[None], hidden[None]
    return logits, hidden


@torch.no_grad()
def teacher_hidden(teacher: torch.nn.Module, input_ids: torch.Tensor,
                   aux_layers: tuple[int, ...] = ()) -> torch.Tensor:
    """teacher_outputs' hidden [B, T, H] (or [B, T, A H]) alone, bitwise the same: feature extraction has no use for
    the logits, and the lm_head over every row (49,152 columns for SmolLM2) is a fifth of the pass."""
    _, hidden = teacher(input_ids, aux_layers=aux_layers, logits_from=input_ids.shape[-1] - 1)
    return hidden if hidden.dim() == 3 else hidden[None]  # the engine squeezes a batch of one


# ---------------------------------------------------------------------------------------------------------------------
# Datasets


class TokenDataset(torch.utils.data.Dataset):
    """Rows of a prepared Arrow split as {input_ids [T] long, loss_mask [T] long} (online mode)."""

    def __init__(self, split: Any):
        self.split = split

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        row = self.split[int(i)]
        return {"input_ids": torch.tensor(row["input_ids"], dtype=torch.long),
                "loss_mask": torch.tensor(row["loss_mask"], dtype=torch.long)}


def collate(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return padded_batch(rows)


class CachedFeatureDataset(torch.utils.data.Dataset):
    """One split of an offline cache: rows {input_ids [T], loss_mask [T], hidden [T, H] bf16}, read lazily
    (memory-mapped shards opened on first use in each process, so DataLoader workers work)."""

    def __init__(self, cache_dir: Path, split: str):
        self.cache_dir = Path(cache_dir)
        index = read_cache_index(self.cache_dir)
        if split not in index["splits"]:
            raise PolyspecError(f"feature cache {cache_dir} has no split {split!r}")
        self.shards = index["splits"][split]
        self.starts = [0]
        for s in self.shards:
            self.starts.append(self.starts[-1] + s["rows"])
        self._open: dict[int, Any] = {}
        self._offsets: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return self.starts[-1]

    def __getstate__(self) -> dict[str, Any]:  # DataLoader workers reopen the files themselves
        state = dict(self.__dict__)
        state["_open"], state["_offsets"] = {}, {}
        return state

    def _shard(self, k: int):
        if k not in self._open:
            from safetensors import safe_open

            f = safe_open(str(self.cache_dir / self.shards[k]["file"]), framework="pt")
            self._open[k] = f
            self._offsets[k] = f.get_tensor("offsets").tolist()
        return self._open[k], self._offsets[k]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        i = int(i)
        if not 0 <= i < len(self):
            raise IndexError(i)
        k = next(j for j in range(len(self.shards)) if i < self.starts[j + 1])
        f, offsets = self._shard(k)
        r = i - self.starts[k]
        a, b = offsets[r], offsets[r + 1]
        row = {"input_ids": f.get_slice("input_ids")[a:b].long(),
               "loss_mask": f.get_slice("loss_mask")[a:b].long(),
               "hidden": f.get_slice("hidden")[a:b]}
        if "final" in f.keys():  # an EAGLE-3 cache
            row["final"] = f.get_slice("final")[a:b]
        return row


# ---------------------------------------------------------------------------------------------------------------------
# Offline cache: estimate, build, read


def bytes_per_token(hidden_size: int, aux: int = 0) -> int:
    """Payload bytes per cached token: bf16 feature (2 H; an EAGLE-3 cache: 2 (aux + 1) H for the fused layers and
    the final state) + int32 token id + int8 loss mask."""
    return 2 * hidden_size * (aux + 1 if aux else 1) + 4 + 1


def estimate_cache_bytes(tokens: int, sequences: int, hidden_size: int, aux: int = 0) -> int:
    """Bytes the cache will take for ``tokens`` tokens in ``sequences`` rows (payload + offsets + headers, rounded
    up generously)."""
    return tokens * bytes_per_token(hidden_size, aux) + 8 * (sequences + 64) + 4096


def check_cache_budget(tokens: int, sequences: int, hidden_size: int, budget_gb: float, where: str,
                       aux: int = 0) -> int:
    """The estimate in bytes, or a PolyspecError when it exceeds ``budget_gb`` (decimal GB)."""
    est = estimate_cache_bytes(tokens, sequences, hidden_size, aux)
    if est > budget_gb * GB:
        raise PolyspecError(
            f"{where}: the offline feature cache would take about {est / GB:.3g} GB ({tokens:,} tokens x "
            f"{bytes_per_token(hidden_size, aux)} bytes per token, hidden size {hidden_size}), more than "
            f"train.cache_budget_gb={budget_gb:g}. Raise train.cache_budget_gb, use fewer conversations "
            "(data.max_conversations) or shorter ones (data.max_length), or use train.features=online "
            "(nothing on disk).",
            exit_code=2,
        )
    return est


def read_cache_index(cache_dir: Path) -> dict[str, Any]:
    path = Path(cache_dir) / INDEX
    if not path.is_file():
        raise PolyspecError(f"{cache_dir} is not a feature cache (no {INDEX}); delete it and run again")
    index = json.loads(path.read_text(encoding="utf-8"))
    if index.get("format") != CACHE_FORMAT:
        raise PolyspecError(f"{path}: feature cache format {index.get('format')!r} is not {CACHE_FORMAT}; delete "
                            "the folder and run again")
    return index


@contextmanager
def progress_bar(enabled: bool, description: str, total: int) -> Iterator[Callable[[int], None]]:
    """A rich progress bar with rate and ETA (``advance(n)``), or a no-op when disabled."""
    if not enabled:
        yield lambda n=1: None
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("ETA"), TimeRemainingColumn())
    with Progress(*columns, transient=False) as prog:
        task = prog.add_task(description, total=total)
        yield lambda n=1: prog.advance(task, n)


class _ShardWriter:
    """Accumulates rows of one split and writes a shard whenever ``shard_bytes`` is reached."""

    def __init__(self, folder: Path, split: str, shard_bytes: int):
        self.folder, self.split, self.shard_bytes = folder, split, shard_bytes
        self.rows: list[tuple[torch.Tensor, ...]] = []
        self.size = 0
        self.shards: list[dict[str, Any]] = []

    def add(self, ids: torch.Tensor, mask: torch.Tensor, hidden: torch.Tensor, final: torch.Tensor | None) -> None:
        row = (ids.to(torch.int32), mask.to(torch.int8), hidden.to(torch.bfloat16).contiguous())
        self.rows.append(row if final is None else (*row, final.to(torch.bfloat16).contiguous()))
        self.size += (hidden.numel() + (final.numel() if final is not None else 0)) * 2 + ids.numel() * 5
        if self.size >= self.shard_bytes:
            self.flush()

    def flush(self) -> None:
        if not self.rows:
            return
        from safetensors.torch import save_file

        lengths = torch.tensor([len(r[0]) for r in self.rows], dtype=torch.int64)
        offsets = torch.cat((torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)))  # [rows + 1]
        name = f"{self.split}-{len(self.shards):05d}.safetensors"
        tensors = {"input_ids": torch.cat([r[0] for r in self.rows]),
                   "loss_mask": torch.cat([r[1] for r in self.rows]),
                   "hidden": torch.cat([r[2] for r in self.rows]),
                   "offsets": offsets}
        if len(self.rows[0]) > 3:
            tensors["final"] = torch.cat([r[3] for r in self.rows])
        save_file(tensors, str(self.folder / name))
        (self.folder / name).chmod(0o644)
        self.shards.append({"file": name, "rows": len(self.rows), "tokens": int(offsets[-1])})
        self.rows, self.size = [], 0


def cache_damage(cache_dir: Path) -> str | None:
    """What is wrong with a finished cache folder (an unreadable index, a missing or damaged shard), or None."""
    from polyspec.weights import check_safetensors

    try:
        index = read_cache_index(cache_dir)
        for shards in index["splits"].values():
            for shard in shards:
                check_safetensors(Path(cache_dir) / shard["file"])
    except (PolyspecError, KeyError, TypeError, ValueError) as exc:
        return str(exc).splitlines()[0]
    return None


def build_feature_cache(teacher: torch.nn.Module, splits: dict[str, Any], out_dir: Path, *, info: dict[str, Any],
                        batch_size: int = 8, device: str | torch.device = "cpu", shard_bytes: int = 1 << 30,
                        progress: bool = False, aux_layers: tuple[int, ...] = ()) -> dict[str, Any]:
    """Run ``teacher`` over every row of ``splits`` ({name: prepared Arrow split}) and write the cache folder
    ``out_dir`` atomically; returns its index (with ``bytes_per_token`` measured on the written files). An existing
    complete cache is returned as is. ``aux_layers`` (an EAGLE-3 head): cache those layers' outputs and the final
    state (module docstring)."""
    out_dir = Path(out_dir)
    if (out_dir / INDEX).is_file():
        damage = cache_damage(out_dir)
        if damage is None:
            return read_cache_index(out_dir)
        from polyspec.console import say

        say(f"feature cache {out_dir} is damaged ({damage}); extracting it again")
        shutil.rmtree(out_dir)
    tmp = temp_folder(out_dir)
    total = sum(sum(len(r) for r in split["input_ids"]) for split in splits.values())
    hidden_size = None
    index: dict[str, Any] = {"format": CACHE_FORMAT, **info, "splits": {}}
    if aux_layers:
        index["aux_layers"] = list(aux_layers)
    try:
        with progress_bar(progress, "extracting teacher features (tokens)", total) as advance:
            for name, split in splits.items():
                writer = _ShardWriter(tmp, name, shard_bytes)
                ds = TokenDataset(split)
                for start in range(0, len(ds), batch_size):
                    batch = collate([ds[i] for i in range(start, min(start + batch_size, len(ds)))])
                    ids = batch["input_ids"].to(device)
                    if aux_layers:  # [B, T, A H], [B, T, H]
                        hidden, final = (t.to("cpu") for t in teacher_aux_and_final(teacher, ids, aux_layers))
                    else:
                        hidden, final = teacher_hidden(teacher, ids).to("cpu"), None  # [B, T, H]
                    hidden_size = teacher.args.hidden_size
                    for r, n in enumerate(batch["lengths"].tolist()):
                        writer.add(batch["input_ids"][r, :n], batch["loss_mask"][r, :n], hidden[r, :n],
                                   None if final is None else final[r, :n])
                    advance(int(batch["lengths"].sum()))
                writer.flush()
                index["splits"][name] = writer.shards
        tokens = sum(s["tokens"] for shards in index["splits"].values() for s in shards)
        on_disk = sum(p.stat().st_size for p in tmp.glob("*.safetensors"))
        index.update({"hidden_size": hidden_size, "tokens": tokens, "bytes": on_disk,
                      "bytes_per_token": on_disk / max(tokens, 1),
                      "payload_bytes_per_token": bytes_per_token(hidden_size or 0, len(aux_layers))})
        (tmp / INDEX).write_text(json.dumps(index, indent=1) + "\n", encoding="utf-8")
        tmp.chmod(0o755)
        try:
            os.rename(tmp, out_dir)
        except OSError:
            if not (out_dir / INDEX).is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return read_cache_index(out_dir)
