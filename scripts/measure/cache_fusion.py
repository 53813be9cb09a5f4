"""The head's first guess re-ranked by a cache of the context's own continuations (a "neural cache": every earlier
occurrence of the last token, scored by how long a suffix it matches), replayed on the target's greedy answers
(first_guess.py records), split into the positions where prompt lookup (a suffix of 2+ tokens) proposes and those
where it does not: how often the head's argmax is right, how often a re-ranked guess is.

    python scripts/measure/cache_fusion.py CHAIN RECORDS.json CATEGORY DRAFT_VOCAB

Re-rankings: ``bonus L`` adds L * min(match, 3) / 3 to the head's probability of each cached continuation;
``top K below P`` takes the first of the head's top K that the cache holds where the head's top-1 probability is
below P. docs/TRAIN.md, "Logits on the rows that count" (stop 31): neither beats the head where lookup is silent.
"""

import collections
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from first_guess import answer_logits  # noqa: E402

from polyspec.decode.generate import load_chain  # noqa: E402
from polyspec.decode.ngram import lookup_next  # noqa: E402

BONUS = (0.1, 0.2, 0.3, 0.5)
TOP = ((2, 0.5), (4, 0.5), (8, 0.5), (4, 0.7))


def continuations(ctx: list[int], max_n: int = 8) -> dict[int, int]:
    """Token -> the longest suffix (up to max_n) after whose earlier occurrence it followed the last token."""
    n, out = len(ctx), {}
    for end in range(n - 1):
        if ctx[end] != ctx[-1]:
            continue
        m = 1
        while m < max_n and m <= end and ctx[end - m] == ctx[n - 1 - m]:
            m += 1
        out[ctx[end + 1]] = max(out.get(ctx[end + 1], 0), m)
    return out


def guesses(p: torch.Tensor, cache: dict[int, int]) -> dict[str, int]:
    """Each re-ranking's guess from the head's probabilities p [V] and the cache."""
    top = p.topk(8)
    first, p1 = int(top.indices[0]), float(top.values[0])
    out = {"head": first}
    for lam in BONUS:
        scored = [(p1, first)] + [(float(p[t]) + lam * min(m, 3) / 3, t) for t, m in cache.items()]
        out[f"bonus {lam}"] = max(scored)[1]
    for k, below in TOP:
        cached = [t for t in top.indices[:k].tolist() if t in cache] if p1 < below else []
        out[f"top {k} below {below}"] = cached[0] if cached else first
    return out


def main(chain_dir: str, records: str, category: str, draft_vocab: str) -> None:
    torch.set_num_threads(2)
    chain = load_chain(Path(chain_dir), device="cpu", draft_vocab=int(draft_vocab))
    target, head = chain.models[chain.order[0]], chain.models[chain.order[-1]]
    hits: dict[str, collections.Counter] = {"lookup proposes": collections.Counter(),
                                            "lookup silent": collections.Counter()}
    for row in json.loads(Path(records).read_text()):
        if row["category"] != category:
            continue
        probs = torch.softmax(answer_logits(target, head, row), -1)  # [A, V]
        for i, token in enumerate(row["answer"]):
            ctx = row["prompt"] + row["answer"][:i]
            where = hits["lookup proposes" if lookup_next(ctx, min_n=2) is not None else "lookup silent"]
            where["positions"] += 1
            for name, guess in guesses(probs[i], continuations(ctx)).items():
                where[name] += guess == token
    for where, c in hits.items():
        n = c.pop("positions")
        print(f"{where}: {n} positions; " + ", ".join(f"{k} {v / max(n, 1):.3f}" for k, v in c.items()))


if __name__ == "__main__":
    main(*sys.argv[1:])
