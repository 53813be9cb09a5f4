"""prepare_dataset: tokenised Arrow splits under <workdir>/cache/data/<key>/, the cache and what invalidates it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from polyspec.config import validate_tree
from polyspec.data.chat import tokenize_conversation
from polyspec.data.prepare import heldout_first_turns, load_split, split_indices
from polyspec.data.sharegpt import load_conversations
from polyspec.errors import PolyspecError

ASSETS = Path(__file__).parent / "assets"
SAMPLE = ASSETS / "sharegpt_sample.json"

def _prepare(recipe, tokenizer, **kw):
    """The data stage of ``recipe`` (its data section, under its workdir)."""
    from polyspec.data.prepare import prepare_dataset

    return prepare_dataset(recipe.data, tokenizer, workdir=recipe.workdir, **kw)



@pytest.fixture(scope="module")
def chatml():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ASSETS / "tokenizers" / "chatml")


def _recipe(workdir: Path, source: Path, **data):
    return validate_tree({"workdir": str(workdir), "data": {"source": str(source), **data}}, "test")


def test_prepare_sample_and_reload_from_cache(tmp_path, chatml):
    source = tmp_path / "sample.json"
    shutil.copy(SAMPLE, source)
    recipe = _recipe(tmp_path / "work", source, max_length=512, heldout_fraction=0.25, seed=3)
    first = _prepare(recipe, chatml, tokenizer_id="tiny-chatml")

    rep = first.report
    assert rep["cached"] is False
    assert first.path.parent == tmp_path / "work" / "cache" / "data"
    assert (first.path / "report.json").is_file()
    assert not [p for p in first.path.parent.iterdir() if p.name.startswith(".tmp")]  # temp dir renamed away
    assert rep["conversations_read"] == 13 and rep["conversations_kept"] == 9
    assert sum(rep["conversations_dropped"].values()) == 4
    assert rep["heldout_conversations"] == 2 and rep["train_conversations"] == 7  # round(0.25 * 9)
    assert len(first.train) == rep["train_sequences"] == 7
    assert len(first.heldout) == rep["heldout_sequences"] == 2
    assert first.train.column_names == ["input_ids", "loss_mask"]

    # rows are exactly tokenize_conversation of the conversations, split by conversation as split_indices says
    convs, _ = load_conversations(str(source))
    train_idx, held_idx = split_indices(len(convs), 0.25, 3)
    expected_held = [tokenize_conversation(chatml, convs[i], 512) for i in held_idx]
    assert [dict(r) for r in first.heldout] == expected_held
    expected_train = [tokenize_conversation(chatml, convs[i], 512) for i in train_idx]
    assert [dict(r) for r in first.train] == expected_train
    all_rows = expected_train + expected_held
    assert rep["total_tokens"] == sum(len(r["input_ids"]) for r in all_rows)
    assert rep["assistant_tokens"] == sum(sum(r["loss_mask"]) for r in all_rows)
    assert 0 < rep["assistant_tokens"] < rep["total_tokens"]

    second = _prepare(recipe, chatml, tokenizer_id="tiny-chatml")
    assert second.report["cached"] is True
    assert second.path == first.path
    assert second.report["total_tokens"] == rep["total_tokens"]
    assert [dict(r) for r in second.train] == [dict(r) for r in first.train]


def test_cache_key_changes_with_inputs(tmp_path, chatml):
    from transformers import AutoTokenizer

    source = tmp_path / "sample.json"
    shutil.copy(SAMPLE, source)
    work = tmp_path / "work"
    base = _prepare(_recipe(work, source, max_length=64), chatml, tokenizer_id="a").path

    other_setting = _prepare(_recipe(work, source, max_length=96), chatml, tokenizer_id="a")
    other_id = _prepare(_recipe(work, source, max_length=64), chatml, tokenizer_id="b")
    llama2 = AutoTokenizer.from_pretrained(ASSETS / "tokenizers" / "llama2")
    other_tok = _prepare(_recipe(work, source, max_length=64), llama2, tokenizer_id="a")
    records = json.loads(source.read_text(encoding="utf-8"))
    source.write_text(json.dumps(records[:-1]), encoding="utf-8")  # same name, different content
    other_data = _prepare(_recipe(work, source, max_length=64), chatml, tokenizer_id="a")

    paths = {base, other_setting.path, other_id.path, other_tok.path, other_data.path}
    assert len(paths) == 5
    assert not any(p.report["cached"] for p in (other_setting, other_id, other_tok, other_data))
    assert other_data.report["conversations_read"] == 12


def test_truncation_and_sequences_without_assistant_tokens(tmp_path, chatml):
    source = tmp_path / "long.json"
    long_question = "word " * 200
    records = [
        {"conversations": [{"from": "human", "value": long_question}, {"from": "gpt", "value": "short"}]},
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello " * 100}]},
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
    ]
    source.write_text(json.dumps(records), encoding="utf-8")
    prepared = _prepare(_recipe(tmp_path / "w", source, max_length=48, heldout_fraction=0.0), chatml,
                               tokenizer_id="t")
    rep = prepared.report
    assert rep["sequences_dropped_no_assistant_tokens"] == 1  # the long question eats all 48 tokens
    assert rep["sequences_truncated"] == 1  # the long answer (the dropped one is not counted)
    assert rep["train_sequences"] == 2 and rep["heldout_sequences"] == 0 and len(prepared.heldout) == 0
    assert sorted(len(r) for r in prepared.train["input_ids"]) == [33, 48]


def test_nothing_left_after_truncation(tmp_path, chatml):
    source = tmp_path / "long.json"
    source.write_text(json.dumps([{"conversations": [{"from": "human", "value": "word " * 200},
                                                     {"from": "gpt", "value": "ok"}]}]), encoding="utf-8")
    with pytest.raises(PolyspecError, match="max_length"):
        _prepare(_recipe(tmp_path / "w", source, max_length=16), chatml, tokenizer_id="t")


def test_missing_source_file(tmp_path, chatml):
    with pytest.raises(PolyspecError, match="does not exist"):
        _prepare(_recipe(tmp_path / "w", tmp_path / "nope.json"), chatml, tokenizer_id="t")


@pytest.mark.parametrize("n, fraction, expect_held", [(9, 0.25, 2), (9, 0.0, 0), (1, 0.3, 0), (2, 0.01, 1),
                                                      (1000, 0.02, 20)])
def test_split_indices(n, fraction, expect_held):
    train, held = split_indices(n, fraction, seed=0)
    assert len(held) == expect_held
    assert sorted(train + held) == list(range(n))
    assert split_indices(n, fraction, seed=0) == (train, held)
    if n >= 100:
        assert split_indices(n, fraction, seed=1) != (train, held)


def test_heldout_first_turns_are_the_held_out_conversations_first_user_messages():
    source = str(ASSETS / "sharegpt_sample.json")
    convs, _ = load_conversations(source)
    _, held = split_indices(len(convs), 0.5, 7)
    turns = heldout_first_turns(source, max_conversations=None, heldout_fraction=0.5, seed=7)
    assert turns and [i for i, _ in turns] == [i for i in held if any(m["role"] == "user" for m in convs[i])]
    for i, text in turns:
        assert text == next(m["content"] for m in convs[i] if m["role"] == "user")
    split = load_split(source, max_conversations=None, heldout_fraction=0.5, seed=7)
    assert split.heldout == held and not set(split.train) & set(held)
