"""The target answers the conversations' user turns itself (``data.responses: target``; docs/DATA.md).

Turn by turn: the k-th user turn of every conversation is answered with the target's own earlier answers in the
history (rendered by the tokenizer's chat template, as :mod:`polyspec.data.chat` renders training data), then the
(k + 1)-th, until ``data.regen.max_turns`` turns are answered, the conversation has no user turn left, or its prompt
reaches ``data.max_length`` tokens (anything later would be truncated away from the training sequence anyway).

Who answers: the target in-process on polyspec's engine, continuously batched (:mod:`polyspec.decode.batch`), or an
OpenAI-compatible server (``data.regen.endpoint``; POST /v1/chat/completions, a few requests in flight).

Cache and resume: ``<workdir>/cache/regen/<key>/`` where the key hashes the target's identity (or the endpoint's URL
and model), every prompt (system and user turns) and the sampling settings. Conversations are stored in shards of
:data:`SHARD_SIZE` and answered a wave of shards at a time (:func:`shards_per_wave`); each shard of a finished wave is
written atomically as ``shard-NNNNNN.json``, so a killed run loses at most the wave in progress and a rerun skips the
shards already there. Sampling is seeded per conversation and turn, so a resumed run equals an uninterrupted one (also
at temperature > 0, and whatever the batch size or wave).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from polyspec.data.chat import render_chat
from polyspec.errors import PolyspecError
from polyspec.fsutil import write_text

if TYPE_CHECKING:  # pragma: no cover
    from polyspec.config import Recipe, RegenConfig

Message = dict[str, str]
FORMAT_VERSION = 1  # bump when the shard layout or the answering rules change
SHARD_SIZE = 64  # conversations per shard file
WAVE_PROMPTS_PER_ROW = 4  # conversations answered together per batch row (shards_per_wave): what a kill can lose


@dataclass
class Reply:
    """One generated answer: its text, how many tokens it took, and whether an end-of-sequence token ended it."""

    text: str
    tokens: int
    eos: bool


# ---------------------------------------------------------------------------------------------------------------------
# What is answered, and the cache key


def prompt_turns(messages: Sequence[Message], max_turns: int | None) -> tuple[list[Message], list[str]]:
    """(the system message if any, the user turns to answer in order, at most ``max_turns``)."""
    head = [dict(m) for m in messages[:1] if m["role"] == "system"]
    users = [m["content"] for m in messages if m["role"] == "user"]
    return head, users[:max_turns] if max_turns is not None else users


def sampling_identity(cfg: RegenConfig) -> dict[str, Any]:
    """The regen settings that change what is generated (batch size and concurrency only change how fast)."""
    return {"temperature": cfg.temperature, "max_new_tokens": cfg.max_new_tokens, "max_turns": cfg.max_turns,
            "seed": cfg.seed if cfg.temperature > 0 else None}


def generator_identity(recipe: Recipe, target_id: str) -> dict[str, Any]:
    """Who answers: the target (its content id and compute dtype) or the endpoint (URL and model name)."""
    ep = recipe.data.regen.endpoint
    if ep is not None:
        return {"endpoint": ep.url, "model": ep.model}
    return {"target": target_id, "dtype": recipe.target.dtype}


def regen_key(recipe: Recipe, target_id: str, conversations: Sequence[Sequence[Message]]) -> tuple[str, dict]:
    """(hex key, identity) of one regeneration: who answers, every prompt, the sampling settings, the turn limit."""
    cfg = recipe.data.regen
    h = hashlib.sha256()
    for conv in conversations:
        head, users = prompt_turns(conv, cfg.max_turns)
        h.update(json.dumps([head, users], ensure_ascii=False).encode("utf-8") + b"\n")
    identity = {"format_version": FORMAT_VERSION, "shard_size": SHARD_SIZE, "prompts_sha256": h.hexdigest(),
                "conversations": len(conversations), "generator": generator_identity(recipe, target_id),
                "sampling": sampling_identity(cfg), "max_length": recipe.data.max_length}
    blob = json.dumps(identity, sort_keys=True, ensure_ascii=False).encode("utf-8")
    return hashlib.sha256(blob).hexdigest(), identity


def turn_seed(seed: int, conversation: int, turn: int) -> int:
    """The sampling seed of one answer: fixed by (seed, conversation index, turn), never by batching or resuming."""
    digest = hashlib.sha256(f"{seed}/{conversation}/{turn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


# ---------------------------------------------------------------------------------------------------------------------
# Who answers


class InProcess:
    """The target on polyspec's engine: ``batch_size`` rows decoded together, each refilled with the next prompt when
    its answer ends (:func:`polyspec.decode.batch.generate_batch`)."""

    def __init__(self, model: Any, tokenizer: Any, cfg: RegenConfig):
        from polyspec.decode.generate import eos_ids

        self.model, self.tokenizer, self.cfg = model, tokenizer, cfg
        self.eos = eos_ids(tokenizer)
        self.context = int(model.args.max_position_embeddings)

    def max_new(self, prompt_len: int) -> int:
        return min(self.cfg.max_new_tokens, self.context - prompt_len)

    def answer(self, histories: list[list[Message]], prompts: list[list[int]], seeds: list[int],
               done: Callable[[int, int], None]) -> list[Reply]:
        import torch

        from polyspec.decode.batch import generate_batch

        gens = [torch.Generator().manual_seed(s) for s in seeds] if self.cfg.temperature > 0 else None
        out = generate_batch(self.model, prompts, max_new_tokens=self.max_new(max(map(len, prompts))),
                             eos_token_ids=self.eos, temperature=self.cfg.temperature, generators=gens,
                             batch_size=self.cfg.batch_size, on_done=lambda i, n: done(1, n))
        return [Reply(text=self.tokenizer.decode(row.token_ids, skip_special_tokens=True),
                      tokens=len(row.token_ids), eos=row.stopped_at_eos) for row in out]


class Endpoint:
    """An OpenAI-compatible server: POST <url>/v1/chat/completions, ``concurrency`` requests in flight."""

    def __init__(self, cfg: RegenConfig):
        self.cfg, self.ep = cfg, cfg.endpoint
        self.key = os.environ.get(self.ep.api_key_env, "") if self.ep.api_key_env else ""
        if self.ep.api_key_env and not self.key:
            raise PolyspecError(f"data.regen.endpoint.api_key_env names {self.ep.api_key_env}, which is not set; "
                                "export it or remove api_key_env")

    def max_new(self, prompt_len: int) -> int:
        return self.cfg.max_new_tokens

    def _post(self, messages: list[Message], seed: int) -> Reply:
        import urllib.error
        import urllib.request

        payload: dict[str, Any] = {"messages": messages, "temperature": self.cfg.temperature,
                                   "max_tokens": self.cfg.max_new_tokens}
        if self.ep.model is not None:
            payload["model"] = self.ep.model
        if self.cfg.temperature > 0:
            payload["seed"] = seed
        headers = {"Content-Type": "application/json"}
        if self.key:
            headers["Authorization"] = f"Bearer {self.key}"
        url = f"{self.ep.url}/v1/chat/completions"
        req = urllib.request.Request(url, data=json.dumps(payload).encode("utf-8"), headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=self.ep.timeout_s) as resp:
                body = json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:400].decode("utf-8", "replace")
            raise PolyspecError(f"{url} answered HTTP {exc.code}: {detail}") from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise PolyspecError(f"cannot get an answer from {url} ({exc}); is the server up, and is "
                                "data.regen.endpoint.url its base URL?") from None
        try:
            choice = body["choices"][0]
            text = choice["message"]["content"] or ""
            tokens = int((body.get("usage") or {}).get("completion_tokens") or 0)
            return Reply(text=text, tokens=tokens, eos=choice.get("finish_reason") == "stop")
        except (KeyError, IndexError, TypeError, ValueError):
            raise PolyspecError(f"{url} did not answer in the chat.completion format: {str(body)[:300]}") from None

    def answer(self, histories: list[list[Message]], prompts: list[list[int]], seeds: list[int],
               done: Callable[[int, int], None]) -> list[Reply]:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(self.ep.concurrency) as pool:
            futures = [pool.submit(self._post, h, s) for h, s in zip(histories, seeds, strict=True)]
            replies = []
            for fut in futures:
                replies.append(fut.result())
                done(1, replies[-1].tokens)
        return replies


# ---------------------------------------------------------------------------------------------------------------------
# Answering one shard


def _encode(tokenizer: Any, history: list[Message]) -> list[int]:
    """The prompt ids of ``history`` exactly as the training sequence will start (render, then tokenise)."""
    text = render_chat(tokenizer, history, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def answer_wave(conversations: Sequence[Sequence[Message]], first: int, answerer: Any, tokenizer: Any,
                recipe: Recipe, done: Callable[[int, int], None]) -> list[dict[str, Any]]:
    """Answer conversations ``first``, ``first + 1``, ... together, turn by turn; returns one shard object per
    :data:`SHARD_SIZE` of them (the wave's generation time split between its shards by their tokens)."""
    cfg = recipe.data.regen
    states = []
    for conv in conversations:
        head, users = prompt_turns(conv, cfg.max_turns)
        states.append({"messages": head, "users": users, "turns": [], "open": True, "skipped": 0})
    t0 = time.perf_counter()
    for k in range(max((len(s["users"]) for s in states), default=0)):
        live, histories, prompts = [], [], []
        for i, s in enumerate(states):
            if not s["open"] or k >= len(s["users"]):
                continue
            history = s["messages"] + [{"role": "user", "content": s["users"][k]}]
            ids = _encode(tokenizer, history)
            if len(ids) >= recipe.data.max_length or answerer.max_new(len(ids)) < 1:
                s["open"] = False  # its answer would start past the training sequence's end
                s["skipped"] = len(s["users"]) - k
                done(s["skipped"], 0)
                continue
            live.append(i)
            histories.append(history)
            prompts.append(ids)
        if not live:
            break
        seeds = [turn_seed(cfg.seed, first + i, k) for i in live]
        for i, history, reply in zip(live, histories, answerer.answer(histories, prompts, seeds, done), strict=True):
            states[i]["messages"] = history + [{"role": "assistant", "content": reply.text}]
            states[i]["turns"].append({"tokens": reply.tokens, "eos": reply.eos})
    return _shards(states, first, time.perf_counter() - t0)


def _shards(states: list[dict[str, Any]], first: int, seconds: float) -> list[dict[str, Any]]:
    def tokens(part: list[dict[str, Any]]) -> int:
        return sum(t["tokens"] for s in part for t in s["turns"])

    total = tokens(states)
    out = []
    for lo in range(0, len(states), SHARD_SIZE):
        part = states[lo:lo + SHARD_SIZE]
        share = tokens(part) / total if total else len(part) / len(states)
        out.append({"first": first + lo, "seconds": seconds * share,
                    "turns_skipped_too_long": sum(s["skipped"] for s in part),
                    "conversations": [{"index": first + lo + i, "messages": s["messages"], "turns": s["turns"]}
                                      for i, s in enumerate(part)]})
    return out


def waves(todo: list[int], shards_per_wave: int) -> list[list[int]]:
    """The missing shards' starts grouped into runs of consecutive shards, at most ``shards_per_wave`` each."""
    out: list[list[int]] = []
    for j in todo:
        if out and len(out[-1]) < shards_per_wave and out[-1][-1] + SHARD_SIZE == j:
            out[-1].append(j)
        else:
            out.append([j])
    return out


def shards_per_wave(cfg: RegenConfig) -> int:
    """Enough conversations answered together that every row (or request in flight) takes ~WAVE_PROMPTS_PER_ROW
    prompts: a wave ends with its rows draining one by one, and that tail is a smaller share of a longer wave."""
    rows = cfg.endpoint.concurrency if cfg.endpoint is not None else cfg.batch_size
    return max(1, -(-WAVE_PROMPTS_PER_ROW * rows // SHARD_SIZE))


# ---------------------------------------------------------------------------------------------------------------------
# Entry point


@contextmanager
def _bar(enabled: bool, total: int, completed: int):
    """A rich progress bar over user turns with tokens/s; a no-op callback when disabled or rich is missing."""
    if enabled:
        try:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
        except ImportError:  # rich is optional here
            enabled = False
    if not enabled:
        yield lambda turns, tokens: None
        return
    from polyspec.console import rich_console

    t0, made = time.perf_counter(), [0]
    columns = (TextColumn("regenerating answers"), BarColumn(), TextColumn("{task.completed}/{task.total} turns"),
               TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(*columns, transient=True, console=rich_console(stderr=True)) as prog:
        task = prog.add_task("regen", total=total, completed=completed, rate="")

        def advance(turns: int, tokens: int) -> None:
            made[0] += tokens
            rate = f"{made[0] / max(time.perf_counter() - t0, 1e-9):.0f} tok/s"
            prog.update(task, advance=turns, rate=rate)

        yield advance


def _answerer(recipe: Recipe, tokenizer: Any, target_dir: Path | None) -> Any:
    """The endpoint client, or the target loaded onto the recipe's device and dtype."""
    cfg = recipe.data.regen
    if cfg.endpoint is not None:
        return Endpoint(cfg)
    from polyspec.decode import cpu_kernels
    from polyspec.decode.generate import load_model
    from polyspec.decode.hf_fallback import HFCausalLM
    from polyspec.device import resolve_device, resolve_dtype
    from polyspec.sources import target_stage

    device = resolve_device(recipe.target.device)
    target_dir = target_dir if target_dir is not None else target_stage(recipe)
    model = load_model(Path(target_dir), dtype=resolve_dtype(recipe.target.dtype, device), device=device)
    if isinstance(model, HFCausalLM):
        raise PolyspecError(f"data.responses=target answers in-process on polyspec's engine, but this target runs on "
                            f"transformers ({model.why}); serve it with vLLM/SGLang and set data.regen.endpoint")
    cpu_kernels.pack_weights(model)
    return InProcess(model, tokenizer, cfg)


def summarize(shards: list[dict[str, Any]], resumed: int) -> dict[str, Any]:
    """What was generated: conversations, turns, tokens, tokens/s, answers ended by EOS vs by max_new_tokens."""
    turns = [t for sh in shards for c in sh["conversations"] for t in c["turns"]]
    seconds = sum(sh["seconds"] for sh in shards)
    tokens = sum(t["tokens"] for t in turns)
    return {
        "conversations": sum(1 for sh in shards for c in sh["conversations"] if c["turns"]),
        "turns": len(turns),
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_second": round(tokens / seconds, 2) if seconds > 0 else 0.0,
        "stopped_at_eos": sum(1 for t in turns if t["eos"]),
        "stopped_at_max_new_tokens": sum(1 for t in turns if not t["eos"]),
        "turns_skipped_too_long": sum(sh["turns_skipped_too_long"] for sh in shards),
        "shards": len(shards),
        "shards_resumed": resumed,
    }


def regenerate(recipe: Recipe, conversations: list[list[Message]], tokenizer: Any, *, target_id: str,
               target_dir: Path | None = None, progress: bool = False) -> tuple[list[list[Message]], dict[str, Any]]:
    """The conversations with the target's own answers (same order; a conversation whose first prompt is too long
    keeps no assistant turn), and the report of what was generated. Cached and resumable (module docstring)."""
    key, identity = regen_key(recipe, target_id, conversations)
    folder = Path(recipe.workdir) / "cache" / "regen" / key[:20]
    folder.mkdir(parents=True, exist_ok=True)
    write_text(folder / "identity.json", json.dumps(identity, indent=1, ensure_ascii=False) + "\n")
    starts = range(0, len(conversations), SHARD_SIZE)
    paths = [folder / f"shard-{j // SHARD_SIZE:06d}.json" for j in starts]
    shards: dict[int, dict[str, Any]] = {j: _read_shard(p) for j, p in zip(starts, paths, strict=True) if p.is_file()}
    resumed = len(shards)
    todo = [j for j in starts if j not in shards]
    if todo:
        cfg = recipe.data.regen
        answerer = _answerer(recipe, tokenizer, target_dir)
        turns = [len(prompt_turns(c, cfg.max_turns)[1]) for c in conversations]
        done_turns = sum(sum(turns[j:j + SHARD_SIZE]) for j in shards)
        with _bar(progress, sum(turns), done_turns) as advance:
            for wave in waves(todo, shards_per_wave(cfg)):
                part = conversations[wave[0]:wave[-1] + SHARD_SIZE]
                for shard in answer_wave(part, wave[0], answerer, tokenizer, recipe, advance):
                    write_text(paths[shard["first"] // SHARD_SIZE], json.dumps(shard, ensure_ascii=False) + "\n")
                    shards[shard["first"]] = shard
    ordered = [shards[j] for j in starts]
    out = [c["messages"] for sh in ordered for c in sh["conversations"]]
    report = {"cache_dir": str(folder), "cache_key": key, **identity["generator"], **identity["sampling"],
              **summarize(ordered, resumed)}
    return out, report


def _read_shard(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise PolyspecError(f"the regeneration shard {path} is damaged ({exc}); delete that file and run again "
                            "(only that shard is redone)") from None
