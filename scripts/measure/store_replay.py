"""An n-gram store of the target's own answers (REST-style retrieval: ngram_store.Store, backing off from the
longest order) replayed on the target's greedy answers (first_guess.py records) beside the head's first guess, per
category, at the positions where prompt lookup finds nothing: how often the store proposes, how often its first
token is right, the tokens a greedy verification of its run would accept, and the head's first-guess rate at the
same positions.

    python scripts/measure/store_replay.py CHAIN RECORDS.json SPLIT 'ORDERS/MIN_COUNT ...' [BLOCK]

SPLIT: a prepared data split (the data cache's train/ folder) of `data.responses: target` answers, or a regen
cache folder (its shards); ORDERS e.g. 4,3. docs/TRAIN.md, stop 30 (a store of the target's own answers).
"""

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from first_guess import first_guesses  # noqa: E402
from ngram_store import Store, replay  # noqa: E402

from polyspec.decode.generate import load_chain  # noqa: E402


def sequences(source: str, tokenizer) -> list:
    """(input_ids, loss_mask) pairs: a prepared split's rows, or a regen cache's shards tokenized here (while a run is
    still answering)."""
    shards = sorted(Path(source).glob("shard-*.json"))
    if not shards:
        import datasets
        return [(r["input_ids"], r["loss_mask"]) for r in datasets.load_from_disk(source)]
    from polyspec.data.chat import tokenize_conversation
    out = []
    for shard in shards:
        for conv in json.loads(shard.read_text())["conversations"]:
            if not conv["turns"]:
                continue
            row = tokenize_conversation(tokenizer, conv["messages"], 512)
            out.append((row["input_ids"], row["loss_mask"]))
    return out


def main(chain_dir: str, records_file: str, split: str, configs: str, block: str = "8") -> None:
    """configs: ORDERS/MIN_COUNT, several separated by spaces, e.g. '4,3/2 4/3'."""
    chain = load_chain(Path(chain_dir), device="cpu")
    target, head = chain.models[chain.order[0]], chain.models[chain.order[-1]]
    head.set_draft_vocab(8192)
    records = json.loads(Path(records_file).read_text())
    guesses = [first_guesses(target, head, row) for row in records]
    seqs = sequences(split, chain.tokenizer)
    print(f"{len(seqs)} conversations, {sum(sum(m) for _, m in seqs)} answer tokens", flush=True)
    for config in configs.split():
        orders, min_count = config.split("/")
        t0 = time.perf_counter()
        store = Store(seqs, tuple(int(n) for n in orders.split(",")), int(min_count))
        print(f"store {config}: {len(store)} contexts, built in {time.perf_counter() - t0:.1f} s", flush=True)
        for cat, c in sorted(replay(records, lambda r, s=store: s, guesses, int(block)).items()):
            m, n = max(c["store"], 1), max(c["no_lookup"], 1)
            print(" ", cat, json.dumps({**c, "store_share": round(c["store"] / n, 3),
                                        "store_first": round(c["store_right"] / m, 3),
                                        "store_mean_accepted": round(c["store_accepted"] / m, 3),
                                        "head_first_there": round(c["head_right_there"] / m, 3),
                                        "head_first_no_lookup": round(c["head_right"] / n, 3)}), flush=True)


if __name__ == "__main__":
    torch.set_num_threads(2)
    main(*sys.argv[1:])
