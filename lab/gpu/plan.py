"""``make gpu-check``: the two device calls of the GPU check, exactly as the device tool takes them (command, carry,
timeout_s), each checked against the limits of docs/GPU.md: <= 60 MiB carried (the tree that travels with every call
included), <= 8 carry paths, a command of <= 2,000 characters, and every carried path present (``make gpu-prep``).
Written to .gpu/calls.json too. Exit 1 when a call breaks a limit or lacks what it carries.

    python lab/gpu/plan.py [--json .gpu/calls.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

MIB = 1 << 20
CARRY_LIMIT = 60 * MIB  # the tool allows 64 MiB; 4 are left for the tree growing between prep and the call
CALLS = (
    {"call": 1, "command": "bash lab/gpu/check.sh 1", "carry": [".whl", ".gpu/smollm2.aa"], "timeout_s": 480,
     "what": "a gpu kernel tests, b kernel A/B, c shape-bench llama2-7b, d 7B projection, i int4 launch plans; "
             "stages SmolLM2's first half"},
    {"call": 2, "command": "bash lab/gpu/check.sh 2",
     "carry": [".whl", ".gpu/smollm2.ab", ".gpu/smollm2.sha256", ".gpu/kit"], "timeout_s": 300,
     "what": "SmolLM2's demo chain put together there, ar vs its default in fp32 (mismatches) and bf16; h the gpu "
             "tests that compile whole models; "
             "run within 30 s of call 1 (SmolLM2's first half waits in /tmp)"},
)
MISSING_HINT = {".gpu/kit": "make demo (polyspec run recipes/smollm2_demo.yaml), then make gpu-prep"}


def tree_bytes(repo: Path) -> int:
    """What every call sends besides its carry: tracked and untracked-not-ignored files."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=repo, check=True,
                           capture_output=True).stdout.split(b"\0")
    return sum((repo / f.decode()).stat().st_size for f in files if f and (repo / f.decode()).is_file())


def path_bytes(p: Path) -> int:
    if p.is_file():
        return p.stat().st_size
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def check_call(call: dict, repo: Path, tree: int) -> dict:
    sizes, problems = {}, []
    for c in call["carry"]:
        p = repo / c
        if not p.exists():
            problems.append(f"{c} is missing: {MISSING_HINT.get(c, 'make gpu-prep')}")
            continue
        sizes[c] = path_bytes(p)
    total = tree + sum(sizes.values())
    if total > CARRY_LIMIT:
        problems.append(f"carries {total / MIB:.1f} MiB, over {CARRY_LIMIT // MIB} MiB")
    if len(call["carry"]) > 8 or len(call["command"]) > 2000:
        problems.append("more than 8 carry paths or a command over 2,000 characters")
    return {**call, "tree_MiB": round(tree / MIB, 2), "carry_MiB": {c: round(b / MIB, 2) for c, b in sizes.items()},
            "total_MiB": round(total / MIB, 2), "problems": problems}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, default=Path(".gpu/calls.json"))
    a = p.parse_args(argv)
    repo = Path(os.getcwd())
    tree = tree_bytes(repo)
    calls = [check_call(c, repo, tree) for c in CALLS]
    for c in calls:
        print(f"call {c['call']} ({c['what']}): {c['total_MiB']} MiB carried "
              f"(tree {c['tree_MiB']} + {', '.join(f'{k} {v}' for k, v in c['carry_MiB'].items())})")
        print(f"  run(command={json.dumps(c['command'])}, carry={json.dumps(c['carry'])}, timeout_s={c['timeout_s']})")
        for problem in c["problems"]:
            print(f"  NOT READY: {problem}")
    if a.json.parent.is_dir():
        a.json.write_text(json.dumps(calls, indent=1))
    return 1 if any(c["problems"] for c in calls) else 0


if __name__ == "__main__":
    sys.exit(main())
