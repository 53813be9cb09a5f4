"""The GPU check's bookkeeping (lab/gpu/check.sh calls it after each step; stdlib only).

    python lab/gpu/step_json.py junit XML JSON            pytest's junit XML -> {counts, failed, skipped reasons, slowest}
    python lab/gpu/step_json.py close JSON NAME RC SECONDS LIMIT LOG
                                                          add {"check": {step, rc, seconds, limit, timed_out}} to the
                                                          step's JSON; where the step wrote none, write one holding
                                                          that and the end of the call's log
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

TAIL = 3000  # characters of the log kept in a failed step's JSON


def junit(xml: Path, out: Path) -> dict:
    cases = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (el.get("message") or el.text or "")[:500]
                break
        cases.append({"test": name, "outcome": outcome, "seconds": float(case.get("time") or 0), "message": message})
    counts: dict[str, int] = {}
    for c in cases:
        counts[c["outcome"]] = counts.get(c["outcome"], 0) + 1
    report = {"step": "a_tests", "counts": counts, "tests": len(cases),
              "failed": [c for c in cases if c["outcome"] in ("failed", "error")],
              "skipped": [{"test": c["test"], "reason": c["message"]} for c in cases if c["outcome"] == "skipped"],
              "slowest": sorted(({"test": c["test"], "seconds": c["seconds"]} for c in cases),
                                key=lambda c: -c["seconds"])[:10]}
    out.write_text(json.dumps(report, indent=1))
    return report


def close(path: Path, name: str, rc: int, seconds: int, limit: int, log: Path) -> dict:
    check = {"step": name, "rc": rc, "seconds": seconds, "limit": limit, "timed_out": rc in (124, 137)}
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError):
        tail = log.read_text(errors="replace")[-TAIL:] if log.is_file() else ""
        report = {"step": name, "error": "the step wrote no JSON", "log_tail": tail}
    report["check"] = check
    path.write_text(json.dumps(report, indent=1))
    return report


def main(argv: list[str]) -> int:
    if argv[:1] == ["junit"] and len(argv) == 3:
        r = junit(Path(argv[1]), Path(argv[2]))
        print(f"tests: {r['counts']}")
        return 0
    if argv[:1] == ["close"] and len(argv) == 7:
        close(Path(argv[1]), argv[2], int(argv[3]), int(argv[4]), int(argv[5]), Path(argv[6]))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
