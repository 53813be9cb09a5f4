"""Drafting policies replayed on the target's own greedy answers (first_guess.py records): tokens per round and the
decode-only speedup over ar with a table of round costs, for the default (prompt-lookup blocks of up to 4 where a
suffix of 2+ tokens recurs, else the head's first guess) and its variants.

    python scripts/measure/replay_policies.py CHAIN RECORDS.json               # stop 27's policies
    python scripts/measure/replay_policies.py CHAIN RECORDS.json suffix CATEGORY 8192    # stop 30's (stop30())

Costs (ms): the bf16 SmolLM2 target's forward by width in this VM's slow memory state (scripts/measure/
int8_level.py forward, stop 27), the head's step 0.6, the decoder 0.2 per round. docs/BENCHMARKS.md, "CPU, stop 27".
"""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import first_guess  # noqa: E402

from polyspec.decode.generate import load_chain  # noqa: E402
from polyspec.decode.ngram import lookup_run  # noqa: E402

COST = {1: 6.69, 2: 6.86, 3: 7.01, 4: 7.70, 5: 7.70, 6: 8.10, 7: 8.12, 8: 8.48, 9: 8.8, 10: 9.1}
HEAD_MS, PYTHON_MS = 0.6, 0.2


def _paths(ctx: list[int], top: list[int], prob: float, room: int, policy: dict) -> tuple[list[list[int]], bool]:
    """The round's candidate paths and whether the head ran."""
    suffix = {"max_n": policy.get("suffix", 3), "min_n": policy.get("min_n", 2)}  # 3: lookup before stop 30
    run = lookup_run(ctx, min(policy.get("lookup", 4), room), **suffix)
    if run and not (prob > policy.get("override", 2.0) and top[0] != run[0]):
        return [run], False
    paths = []
    for g in top[:policy.get("k", 1)]:
        ext = lookup_run(ctx + [g], min(policy.get("ext", 0), room - 1), **suffix) if room > 1 else []
        paths.append([g] + ext)
    return paths, True


def accepted(paths: list[list[int]], answer: list[int], i: int) -> int:
    """Greedy verification of paths that all start at answer position i: the longest prefix any of them shares with
    the answer."""
    best = 0
    for path in paths:
        m = 0
        while m < len(path) and i + m < len(answer) and path[m] == answer[i + m]:
            m += 1
        best = max(best, m)
    return best


def replay(rows: list, tops: list, probs: list, policy: dict) -> tuple[float, float]:
    seconds = tokens = rounds = 0
    for row, top, prob in zip(rows, tops, probs, strict=True):
        ctx, ans, i = list(row["prompt"]), row["answer"], 0
        while i < len(ans):
            paths, head = _paths(ctx, top[i], prob[i], len(ans) - i, policy)
            seconds += COST[1 + sum(len(p) for p in paths)] + (HEAD_MS if head else 0.0) + PYTHON_MS
            n = accepted(paths, ans, i)
            ctx += ans[i:i + n + 1]
            i += n + 1
            rounds += 1
        tokens += len(ans)
    return tokens / rounds, tokens * COST[1] / seconds


def stop27() -> dict[str, dict]:
    return {"the head's first guess (the default)": {}, "+ lookup after the head's guess": {"ext": 4},
            "the head's top 2 as two branches": {"k": 2}, "the head's top 3": {"k": 3},
            **{f"the head over a lookup block where its top-1 p > {t}": {"override": t} for t in (0.5, 0.7, 0.9)},
            **{f"lookup blocks of up to {n}": {"lookup": n} for n in (2, 3, 6, 8)}}


def stop30() -> dict[str, dict]:
    """Lookup blocks of up to 8: by the longest suffix of up to N tokens, of 3+ matched tokens, the head's guess over
    any block it disagrees with, and lookup finishing the head's block."""
    out = {}
    for n in (3, 4, 6, 8, 12):
        out[f"longest suffix {n}"] = {"lookup": 8, "suffix": n}
        out[f"longest suffix {n}, 3+ tokens matched"] = {"lookup": 8, "suffix": n, "min_n": 3}
    out["longest suffix 3, the head's guess where it disagrees"] = {"lookup": 8, "override": 0.0}
    out["longest suffix 8, lookup after the head's guess (up to 7)"] = {"lookup": 8, "suffix": 8, "ext": 7}
    return out


def main(chain_dir: str, records: str, which: str = "stop27", category: str = "all", draft_vocab: str = "") -> None:
    """which: stop27 or suffix (stop 30's policies); category: the records' category replayed (all: every one);
    draft_vocab: the head's draft vocabulary (empty: the chain manifest's)."""
    torch.set_num_threads(2)
    chain = load_chain(Path(chain_dir), device="cpu", draft_vocab=int(draft_vocab) if draft_vocab else None)
    target, head = chain.models[chain.order[0]], chain.models[chain.order[-1]]
    rows = [r for r in json.loads(Path(records).read_text()) if category in ("all", r["category"])]
    logits = [first_guess.answer_logits(target, head, r) for r in rows]
    tops = [x.topk(4, -1).indices.tolist() for x in logits]
    probs = [torch.softmax(x, -1).max(-1).values.tolist() for x in logits]
    for name, policy in (stop30() if which == "suffix" else stop27()).items():
        per_round, speedup = replay(rows, tops, probs, policy)
        print(f"{name}: tokens per round {per_round:.3f}, decode-only speedup {speedup:.3f}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
