"""The default drafting policy replayed on the target's own greedy answers (first_guess.py's records) with a round
cost table per machine state: decode-only speedup over ar by prompt-lookup block size and two lookup filters.

    python scripts/measure/replay_costs.py CHAIN RECORDS.json [TRAIN_SPLIT_DIR]

With TRAIN_SPLIT_DIR (the data stage's Arrow cache, <workdir>/cache/data/<key>/train), also a REST-style datastore
as a third source where prompt lookup finds nothing: the training answers' 3-gram -> next-token counts (sequences
whose prompt is a replayed record's left out), followed
greedily for up to 4 tokens while the next token has count >= 2 and at least half the 3-gram's continuations
(always, or only where its first token is the head's guess).

Costs (ms): a target forward by width as measured by scripts/measure/rounds.py in this VM's fast state (width 1 at
4.08 ms: memory at ~66 GB/s, so wider verifications pay for their arithmetic) and slow state (width 1 at ~4.5 ms:
widths up to 3 cost about the same), and a projected panel-layout state (below); the head's step 0.32 ms, the
decoder's Python 0.19 ms per round.
docs/BENCHMARKS.md, "CPU, stop 23".
"""

import collections
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import first_guess  # noqa: E402
import replay_policies  # noqa: E402

from polyspec.decode.generate import load_chain  # noqa: E402
from polyspec.decode.ngram import lookup_run  # noqa: E402

COSTS = {"fast": {1: 4.08, 2: 4.41, 3: 4.9, 4: 5.4, 5: 5.95, 6: 6.45, 7: 6.95, 8: 7.45, 9: 7.95},
         "slow": {1: 4.5, 2: 4.55, 3: 4.7, 4: 4.95, 5: 5.2, 6: 5.5, 7: 5.8, 8: 6.1, 9: 6.4}}
# Projected, not measured: the fast state's width-1 cost times the weight rows' cost by width in a panel layout
# (scripts/measure/panel_rows.cpp, stop 25) plus 0.05 ms of attention per extra row.
PANEL_RATIO = {1: 1.0, 2: 1.0, 3: 1.02, 4: 1.04, 5: 1.06, 6: 1.09, 7: 1.12, 8: 1.15, 9: 1.2}
COSTS["panel (projected)"] = {w: 4.08 * r + 0.05 * (w - 1) for w, r in PANEL_RATIO.items()}
HEAD_MS, PYTHON_MS = 0.32, 0.19


def datastore(split_dir: str, n: int = 3, exclude: list[list[int]] = ()) -> dict:
    """The training answers' n-gram -> next-token counts, leaving out every sequence whose prompt ends like one of
    ``exclude`` (the replayed records' prompts: their own answers must not be in the store)."""
    import datasets

    tails = {tuple(p[-20:]) for p in exclude}
    table: dict = collections.defaultdict(collections.Counter)
    for r in datasets.load_from_disk(split_dir):
        ids, mask = r["input_ids"], r["loss_mask"]
        first = next((i for i, m in enumerate(mask) if m), len(ids))
        if tuple(ids[max(0, first - 20):first]) in tails:
            continue
        for i in range(n, len(ids)):
            if mask[i]:
                table[tuple(ids[i - n:i])][ids[i]] += 1
    return table


def from_store(store: dict, ctx: list[int], limit: int, n: int = 3) -> list[int]:
    out, c = [], list(ctx[-n:])
    while len(out) < limit:
        counts = store.get(tuple(c[-n:]))
        if not counts:
            break
        (x, k), = counts.most_common(1)
        if k < 2 or k / sum(counts.values()) < 0.5:
            break
        out.append(x)
        c.append(x)
    return out


def speedup(rows: list, guesses: list, block: int, cost: dict, policy: str = "lookup first",
            store: dict | None = None) -> float:
    seconds = 0.0
    for row, guess in zip(rows, guesses, strict=True):
        ctx, ans, i = list(row["prompt"]), row["answer"], 0
        while i < len(ans):
            run = lookup_run(ctx, min(block, len(ans) - i), min_n=2) if block else []
            if not run and store is not None:
                run = from_store(store, ctx, min(block, len(ans) - i))
                if run and policy == "datastore where the head agrees" and run[0] != guess[i]:
                    run = []
            if run and policy == "only where the head agrees" and run[0] != guess[i]:
                run = []
            if run and policy == "3-token suffixes only" and not lookup_run(ctx, 1, min_n=3):
                run = []
            if run:
                seconds += cost[len(run) + 1] + PYTHON_MS
            else:
                run = [guess[i]]
                seconds += cost[2] + HEAD_MS + PYTHON_MS
            n = 0
            while n < len(run) and i + n < len(ans) and run[n] == ans[i + n]:
                n += 1
            ctx += ans[i:i + n + 1]
            i += n + 1
    return sum(len(r["answer"]) for r in rows) * cost[1] / seconds


def top2(target, head, row: dict) -> list[list[int]]:
    """The head's two best first guesses at each answer position."""
    return first_guess.answer_logits(target, head, row).topk(2, -1).indices.tolist()


def two_candidates(rows: list, tops: list, cost: dict) -> float:
    """Where prompt lookup finds nothing, the head's top 2 as two one-token branches (a width-3 verification)."""
    seconds = 0.0
    for row, top in zip(rows, tops, strict=True):
        ctx, ans, i = list(row["prompt"]), row["answer"], 0
        while i < len(ans):
            run = lookup_run(ctx, min(4, len(ans) - i), min_n=2)
            paths = [run] if run else [[x] for x in top[i]]
            seconds += cost[len(run) + 1] + PYTHON_MS if run else cost[3] + HEAD_MS + PYTHON_MS
            n = replay_policies.accepted(paths, ans, i)
            ctx += ans[i:i + n + 1]
            i += n + 1
    return sum(len(r["answer"]) for r in rows) * cost[1] / seconds


def main(chain_dir: str, records: str, split_dir: str = "") -> None:
    torch.set_num_threads(2)
    chain = load_chain(Path(chain_dir), device="cpu")
    target, head = chain.models[chain.order[0]], chain.models[chain.order[-1]]
    rows = json.loads(Path(records).read_text())
    guesses = [first_guess.first_guesses(target, head, r) for r in rows]
    store = datastore(split_dir, exclude=[r["prompt"] for r in rows]) if split_dir else None
    tops = [top2(target, head, r) for r in rows]
    for state, cost in COSTS.items():
        print(state, "lookup block 0 (head only) / 2 / 3 / 4 / 5 / 6 / 8:",
              " ".join(f"{speedup(rows, guesses, b, cost):.3f}" for b in (0, 2, 3, 4, 5, 6, 8)))
        for policy in ("only where the head agrees", "3-token suffixes only"):
            print(state, f"blocks of 4, {policy}: {speedup(rows, guesses, 4, cost, policy):.3f}")
        print(state, f"blocks of 4, else the head's top 2 as two branches: {two_candidates(rows, tops, cost):.3f}")
        if store is not None:
            for policy in ("datastore", "datastore where the head agrees"):
                print(state, f"blocks of 4, {policy}: {speedup(rows, guesses, 4, cost, policy, store):.3f}")


if __name__ == "__main__":
    main(*sys.argv[1:])
