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


class Store:
    """Per order (longest first) table_of's table, keeping the contexts whose next token followed them at least
    min_count times; a run follows the longest order with a context kept."""

    def __init__(self, seqs: list, orders: tuple[int, ...], min_count: int):
        self.tables = [(n, {k: v for k, v in table_of(seqs, n).items() if v[1] >= min_count})
                       for n in sorted(orders, reverse=True)]

    def run(self, ctx: list[int], size: int = 8) -> list[int]:
        out: list[int] = []
        while len(out) < size:
            nxt = next((r[0] for n, t in self.tables if (r := store_run(t, ctx + out, n, size=1))), None)
            if nxt is None:
                break
            out.append(nxt)
        return out

    def __len__(self) -> int:
        return sum(len(t) for _, t in self.tables)


def replay(records: list[dict], store_for, guesses: list | None = None, block: int = 8) -> dict:
    """Per category: at the positions where prompt lookup finds nothing, how often store_for(record) proposes, its
    first token's hits and the tokens a greedy verification accepts; with guesses (each record's head argmax per
    answer position) also the head's hits there and where the store proposes."""
    tot: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for j, r in enumerate(records):
        store, answer, c = store_for(r), r["answer"], tot[r["category"]]
        for i in range(len(answer)):
            ctx = r["prompt"] + answer[:i]
            c["positions"] += 1
            if lookup_run(ctx, 1, min_n=2):
                continue
            c["no_lookup"] += 1
            head = guesses is not None and guesses[j][i] == answer[i]
            c["head_right"] += head
            run = store.run(ctx, block)
            if run:
                a = accepted([run], answer, i)
                c["store"] += 1
                c["store_right"] += a > 0
                c["store_accepted"] += a
                c["head_right_there"] += head
                c["both_right"] += a > 0 and head
    return tot


def main(records_path: str, store: str, split: str, n: int) -> None:
    records = json.loads(open(records_path, encoding="utf-8").read())
    if store == "sharegpt":
        import datasets
        ds = datasets.load_from_disk(split)
        table = Store([(row["input_ids"], row["loss_mask"]) for row in ds], (n,), 2)
        per = replay(records, lambda r: table)
    else:  # leave one question out: the store holds the answers to every other question
        tables = {q: Store([(x["answer"], [1] * len(x["answer"])) for x in records if x["question_id"] != q], (n,), 1)
                  for q in {r["question_id"] for r in records}}
        per = replay(records, lambda r: tables[r["question_id"]])
    tot = sum(per.values(), collections.Counter())
    m = max(tot["store"], 1)
    print(json.dumps({"store": store, "n": n, "positions": tot["positions"], "no_lookup": tot["no_lookup"],
                      "matched": tot["store"], "first_right": tot["store_right"], "accepted": tot["store_accepted"],
                      "first_token_accuracy": round(tot["store_right"] / m, 3),
                      "mean_accepted": round(tot["store_accepted"] / m, 3)}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
