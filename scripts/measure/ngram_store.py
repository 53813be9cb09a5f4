"""A draft from a store of n-grams instead of the head (REST-style retrieval), replayed on the target's own greedy
answers (first_guess.py records) at the positions where prompt lookup finds nothing: how often the store has a
continuation, its first token's accuracy and the tokens a greedy verification would accept.

    python scripts/measure/ngram_store.py RECORDS.json sharegpt DATA_SPLIT N   # the store: a prepared split's
                                                                               # assistant tokens (data cache)
    python scripts/measure/ngram_store.py RECORDS.json own - N                 # the store: the other records'
                                                                               # answers (other questions only)

docs/TRAIN.md, "Issue 15's goals re-measured (stop 29)".
"""

import collections
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from replay_policies import accepted  # noqa: E402

from polyspec.decode.ngram import lookup_run  # noqa: E402

Table = dict[tuple[int, ...], tuple[int, int]]


def table_of(sequences, n: int) -> Table:
    """Each n-token context -> (its most frequent next token, that count), over the sequences' scored tokens."""
    counts: dict[tuple[int, ...], collections.Counter] = collections.defaultdict(collections.Counter)
    for ids, mask in sequences:
        for j in range(n, len(ids)):
            if mask[j]:
                counts[tuple(ids[j - n:j])][ids[j]] += 1
    return {k: c.most_common(1)[0] for k, c in counts.items()}


def store_run(table: Table, ctx: list[int], n: int, size: int = 8, min_count: int = 1) -> list[int]:
    run: list[int] = []
    while len(run) < size:
        hit = table.get(tuple((ctx + run)[-n:]))
        if hit is None or hit[1] < min_count:
            break
        run.append(hit[0])
    return run


def replay(records: list[dict], table_for, n: int, min_count: int) -> collections.Counter:
    tot: collections.Counter = collections.Counter()
    for r in records:
        table, answer = table_for(r), r["answer"]
        for i in range(len(answer)):
            ctx = r["prompt"] + answer[:i]
            tot["positions"] += 1
            if lookup_run(ctx, 8, min_n=2):
                continue
            tot["no_lookup"] += 1
            run = store_run(table, ctx, n, min_count=min_count)
            if run:
                a = accepted([run], answer, i)
                tot["matched"] += 1
                tot["first_right"] += a > 0
                tot["accepted"] += a
    return tot


def main(records_path: str, store: str, split: str, n: int) -> None:
    records = json.loads(open(records_path, encoding="utf-8").read())
    if store == "sharegpt":
        import datasets
        ds = datasets.load_from_disk(split)
        table = table_of(((row["input_ids"], row["loss_mask"]) for row in ds), n)
        tot = replay(records, lambda r: table, n, min_count=2)
    else:  # leave one question out: the store holds the answers to every other question
        tables = {q: table_of([(x["answer"], [1] * len(x["answer"])) for x in records if x["question_id"] != q], n)
                  for q in {r["question_id"] for r in records}}
        tot = replay(records, lambda r: tables[r["question_id"]], n, min_count=1)
    m = max(tot["matched"], 1)
    print(json.dumps({"store": store, "n": n, **tot, "first_token_accuracy": round(tot["first_right"] / m, 3),
                      "mean_accepted": round(tot["accepted"] / m, 3)}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
