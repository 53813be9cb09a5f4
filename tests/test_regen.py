"""data.responses: target — the target answers the user turns itself (data/regen.py); the head trains on them.

The answers equal the target's own turn-by-turn greedy ``ar`` answers; the loss mask covers exactly them; the cache
key follows the target, the prompts and the sampling settings; a killed run resumes to the uninterrupted result; an
OpenAI-compatible endpoint (``polyspec serve`` on loopback) gives the same answers as the in-process engine.
"""

from __future__ import annotations

import json
import os
import re
import select
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from polyspec.config import validate_tree
from polyspec.errors import PolyspecError

ASSETS = Path(__file__).parent / "assets"
MAX_NEW = 6


class Killed(BaseException):
    """Stands for a kill in the middle of a shard (a BaseException, like KeyboardInterrupt)."""


def _recipe(workdir: Path, target: Path, **regen):
    regen = {"max_new_tokens": MAX_NEW, "max_turns": 2, "batch_size": 3, **regen}
    return validate_tree({
        "workdir": str(workdir),
        "target": {"source": str(target), "device": "cpu"},
        "data": {"source": str(ASSETS / "sharegpt_sample.json"), "max_conversations": 5, "max_length": 256,
                 "heldout_fraction": 0.0, "responses": "target", "regen": regen},
    }, "test")


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    from polyspec.sources import load_tokenizer

    return load_tokenizer(tiny_llama_dir)


@pytest.fixture(scope="module")
def target_id(tiny_llama_dir):
    from polyspec.sources import model_id

    return model_id(str(tiny_llama_dir), tiny_llama_dir)


def _conversations():
    from polyspec.data.sharegpt import load_conversations

    return load_conversations(str(ASSETS / "sharegpt_sample.json"), max_conversations=5)[0]


def _prepare(recipe, tokenizer, target_id, target_dir):
    from polyspec.data.prepare import prepare_dataset

    return prepare_dataset(recipe, tokenizer, tokenizer_id=target_id, target_dir=target_dir)


def _ar_answers(target_dir, tokenizer, conversation, max_turns: int, max_length: int) -> list[str]:
    """The reference: the target's batch-1 greedy ar answer to each user turn, its own answers in the history."""
    from polyspec.data.chat import render_chat
    from polyspec.data.regen import prompt_turns
    from polyspec.decode.chain import SamplingParams
    from polyspec.decode.generate import build_decoder, eos_ids, load_model_folder

    chain = load_model_folder(target_dir, device="cpu", dtype="float32")
    history, users = prompt_turns(conversation, max_turns)
    answers = []
    for user in users:
        history = history + [{"role": "user", "content": user}]
        ids = tokenizer(render_chat(tokenizer, history, add_generation_prompt=True), add_special_tokens=False)
        ids = list(ids["input_ids"])
        if len(ids) >= max_length:
            break
        dec = build_decoder(chain, "ar", max_seq_len=len(ids) + MAX_NEW + 8)
        out = dec.generate(ids, MAX_NEW, SamplingParams(), eos_token_ids=eos_ids(tokenizer)).token_ids
        answers.append(tokenizer.decode(out, skip_special_tokens=True))
        history = history + [{"role": "assistant", "content": answers[-1]}]
    return answers


def test_target_answers_are_its_own_greedy_answers_and_the_loss_covers_only_them(
        tmp_path, tiny_llama_dir, tokenizer, target_id):
    from polyspec.data.chat import masked_segments

    recipe = _recipe(tmp_path, tiny_llama_dir)
    prepared = _prepare(recipe, tokenizer, target_id, tiny_llama_dir)
    rep = prepared.report
    assert rep["responses"] == "target" and not rep["cached"]
    conversations = _conversations()
    expected = [_ar_answers(tiny_llama_dir, tokenizer, c, 2, 256) for c in conversations]
    end = tokenizer.eos_token  # the chat template's end-of-turn token closes every assistant turn
    for row, answers in zip(prepared.train, expected, strict=True):
        segments = masked_segments(tokenizer, row["input_ids"], row["loss_mask"])
        assert segments == [a + end for a in answers]
        dataset_answers = [m["content"] for m in conversations[0] if m["role"] == "assistant"]
        assert not set(segments) & {a + end for a in dataset_answers}
    regen = rep["regen"]
    assert regen["turns"] == sum(len(a) for a in expected) == regen["stopped_at_eos"] + regen[
        "stopped_at_max_new_tokens"]
    assert regen["conversations"] == 5 and regen["temperature"] == 0.0 and regen["target"] == target_id
    assert 0 < regen["tokens"] <= MAX_NEW * regen["turns"] and regen["tokens_per_second"] > 0
    assert Path(regen["cache_dir"]).parent == tmp_path / "cache" / "regen"
    again = _prepare(recipe, tokenizer, target_id, tiny_llama_dir)
    assert again.report["cached"] and again.report["regen"] == regen


def test_data_key_follows_mode_regen_settings_and_target(tmp_path, tiny_llama_dir, tokenizer, target_id):
    from polyspec.data.prepare import cache_key

    def key(recipe, tid=target_id):
        return cache_key(recipe, tokenizer, tid)[0]

    base = _recipe(tmp_path, tiny_llama_dir)
    dataset = base.model_copy(update={"data": base.data.model_copy(update={"responses": "dataset"})})
    assert key(dataset) != key(base)
    # under responses: dataset the regen settings play no part (and keys of earlier versions stay valid)
    other = dataset.model_copy(deep=True)
    other.data.regen.temperature = 0.7
    assert key(other) == key(dataset)
    for change in ({"temperature": 0.7}, {"max_new_tokens": 7}, {"max_turns": 1}):
        assert key(_recipe(tmp_path, tiny_llama_dir, **change)) != key(base), change
    assert key(_recipe(tmp_path, tiny_llama_dir, batch_size=9)) == key(base)  # speed only
    assert key(base, tid=target_id + "x") != key(base)
    ep = _recipe(tmp_path, tiny_llama_dir, endpoint={"url": "http://127.0.0.1:9/"})
    assert key(ep) != key(base) and ep.data.regen.endpoint.url == "http://127.0.0.1:9"


def test_killed_run_resumes_to_the_uninterrupted_result(tmp_path, tiny_llama_dir, tokenizer, target_id, monkeypatch):
    from polyspec.data import regen

    monkeypatch.setattr(regen, "SHARD_SIZE", 2)  # 5 conversations -> 3 shards
    convs = _conversations()
    sample = {"temperature": 1.0, "seed": 7}  # sampling too: seeds are per conversation and turn
    whole, whole_rep = regen.regenerate(_recipe(tmp_path / "a", tiny_llama_dir, **sample), convs, tokenizer,
                                        target_id=target_id, target_dir=tiny_llama_dir)

    assert whole_rep["shards"] == 3  # one wave of all three shards (batch 3: 4 x 3 prompts per wave), split on write

    real, calls, kill = regen.answer_wave, [], [True]

    def dies_on_the_second_shard(*args, **kw):
        calls.append(args[1])
        if kill[0] and len(calls) == 2:
            raise Killed
        return real(*args, **kw)

    monkeypatch.setattr(regen, "answer_wave", dies_on_the_second_shard)
    monkeypatch.setattr(regen, "WAVE_PROMPTS_PER_ROW", 1)  # batch 2 -> waves of one shard
    recipe = _recipe(tmp_path / "b", tiny_llama_dir, batch_size=2, **sample)  # another batch size, same answers
    with pytest.raises(Killed):
        regen.regenerate(recipe, convs, tokenizer, target_id=target_id, target_dir=tiny_llama_dir)
    folder = next((tmp_path / "b" / "cache" / "regen").iterdir())
    assert sorted(p.name for p in folder.iterdir()) == ["identity.json", "shard-000000.json"]  # nothing half-written
    calls.clear()
    kill[0] = False
    resumed, rep = regen.regenerate(recipe, convs, tokenizer, target_id=target_id, target_dir=tiny_llama_dir)
    assert calls == [2, 4] and rep["shards_resumed"] == 1 and rep["shards"] == 3
    assert resumed == whole
    assert {k: rep[k] for k in ("turns", "tokens", "stopped_at_eos")} == \
        {k: whole_rep[k] for k in ("turns", "tokens", "stopped_at_eos")}
    greedy, _ = regen.regenerate(_recipe(tmp_path / "c", tiny_llama_dir), convs, tokenizer, target_id=target_id,
                                 target_dir=tiny_llama_dir)
    assert greedy != whole  # it did sample


def test_waves_group_consecutive_missing_shards(monkeypatch):
    from polyspec.config import RegenConfig
    from polyspec.data import regen

    monkeypatch.setattr(regen, "SHARD_SIZE", 10)
    assert regen.waves([0, 10, 20, 40, 50, 60, 70], 3) == [[0, 10, 20], [40, 50, 60], [70]]
    assert regen.waves([], 3) == []
    monkeypatch.setattr(regen, "SHARD_SIZE", 64)
    assert regen.shards_per_wave(RegenConfig(batch_size=16)) == 1  # 4 prompts per row: 64 conversations, one shard
    assert regen.shards_per_wave(RegenConfig(batch_size=100)) == 7  # 400 conversations
    assert regen.shards_per_wave(RegenConfig(batch_size=1)) == 1
    assert regen.shards_per_wave(RegenConfig(batch_size=1, endpoint={"url": "http://h", "concurrency": 40})) == 3


def test_damaged_shard_is_one_clear_error(tmp_path, tiny_llama_dir, tokenizer, target_id):
    from polyspec.data import regen

    recipe = _recipe(tmp_path, tiny_llama_dir)
    regen.regenerate(recipe, _conversations(), tokenizer, target_id=target_id, target_dir=tiny_llama_dir)
    shard = next((tmp_path / "cache" / "regen").glob("*/shard-000000.json"))
    shard.write_text("{not json", encoding="utf-8")
    with pytest.raises(PolyspecError, match="delete that file"):
        regen.regenerate(recipe, _conversations(), tokenizer, target_id=target_id, target_dir=tiny_llama_dir)


def test_unreachable_endpoint_is_one_clear_error(tmp_path, tiny_llama_dir, tokenizer, target_id):
    from polyspec.data import regen

    recipe = _recipe(tmp_path, tiny_llama_dir, endpoint={"url": "http://127.0.0.1:9", "timeout_s": 5})
    with pytest.raises(PolyspecError, match="is the server up"):
        regen.regenerate(recipe, _conversations(), tokenizer, target_id=target_id)


def _serve(chain: Path) -> tuple[subprocess.Popen, str]:
    """`polyspec serve CHAIN --port 0` on loopback; (process, base URL) once /health answers (20 s at most)."""
    exe = Path(sys.executable).with_name("polyspec")
    cmd = [str(exe) if exe.exists() else sys.executable, *([] if exe.exists() else ["-m", "polyspec"]),
           "serve", str(chain), "--host", "127.0.0.1", "--port", "0", "--device", "cpu", "--mode", "ar",
           "--model-name", "tiny"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=dict(os.environ))
    deadline, base = time.monotonic() + 60, None
    while base is None:
        assert time.monotonic() < deadline and proc.poll() is None, "polyspec serve did not start"
        if select.select([proc.stderr], [], [], 1.0)[0]:
            m = re.search(r"on (http://127\.0\.0\.1:\d+)/v1", proc.stderr.readline())
            base = m.group(1) if m else None
    while True:
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
                if r.status == 200:
                    return proc, base
        except OSError:
            assert time.monotonic() < deadline and proc.poll() is None, "polyspec serve did not answer /health"
            time.sleep(0.2)


def test_endpoint_answers_equal_the_in_process_ones(tmp_path, tiny_chain, tokenizer, target_id):
    from polyspec.data import regen
    from polyspec.manifest import validate_chain

    target_dir = tiny_chain / validate_chain(tiny_chain).levels[0].path
    convs = _conversations()
    local, local_rep = regen.regenerate(_recipe(tmp_path / "a", target_dir), convs, tokenizer, target_id=target_id,
                                        target_dir=target_dir)
    proc, base = _serve(tiny_chain)
    try:
        recipe = _recipe(tmp_path / "b", target_dir,
                         endpoint={"url": base, "model": "tiny", "concurrency": 3, "timeout_s": 60})
        remote, remote_rep = regen.regenerate(recipe, convs, tokenizer, target_id=target_id)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert remote == local
    assert remote_rep["endpoint"] == base and remote_rep["model"] == "tiny"
    for k in ("turns", "tokens", "stopped_at_eos", "stopped_at_max_new_tokens"):
        assert remote_rep[k] == local_rep[k], k
    assert json.loads((Path(remote_rep["cache_dir"]) / "identity.json").read_text())["generator"]["endpoint"] == base


def test_run_summary_and_mlflow_metrics_carry_the_counts(monkeypatch):
    from polyspec import pipeline

    report = {"train_sequences": 4, "cached": False, "regen": {"turns": 7, "tokens": 40, "tokens_per_second": 12.5,
                                                                "stopped_at_eos": 5, "stopped_at_max_new_tokens": 2,
                                                                "cache_dir": "x"}}
    text = pipeline._fmt_counts(report)
    assert "7 turns, 40 tokens at 12.5 tok/s, 5 ended at EOS, 2 at max_new_tokens" in text

    class Tracker:
        logged: dict = {}

        def log_metrics(self, m):
            self.logged.update(m)

    monkeypatch.setattr(pipeline, "prepare_stage", lambda recipe, target_dir, progress=False: report)
    tracker = Tracker()
    pipeline._data_logged(None, Path("."), tracker)
    assert tracker.logged == {"data/train_sequences": 4.0, "data/regen_turns": 7.0, "data/regen_tokens": 40.0,
                              "data/regen_tokens_per_second": 12.5, "data/regen_stopped_at_eos": 5.0,
                              "data/regen_stopped_at_max_new_tokens": 2.0}


def test_turns_past_max_length_are_not_answered(tmp_path, tiny_llama_dir, tokenizer, target_id):
    from polyspec.data.chat import render_chat
    from polyspec.data.regen import prompt_turns

    def first_prompt_length(conv):
        head, users = prompt_turns(conv, None)
        text = render_chat(tokenizer, head + [{"role": "user", "content": users[0]}], add_generation_prompt=True)
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    lengths = sorted(first_prompt_length(c) for c in _conversations())
    assert lengths[-1] > lengths[0] >= 16
    recipe = _recipe(tmp_path, tiny_llama_dir, max_turns=None)
    recipe.data.max_length = lengths[-1]  # the longest first prompt reaches it: that conversation gets no answer
    rep = _prepare(recipe, tokenizer, target_id, tiny_llama_dir).report
    longest = sum(1 for n in lengths if n == lengths[-1])
    assert rep["sequences_dropped_no_assistant_tokens"] == longest == 5 - rep["regen"]["conversations"]
    assert rep["train_sequences"] == 5 - longest and rep["regen"]["turns_skipped_too_long"] >= longest
