"""How often a draft head's first guess is the target's own greedy token: exact for a one-token draft (the demo's
default drafts one token per round), measured teacher-forced on the target's greedy answers, without decoding.

    python scripts/measure/first_guess.py records CHAIN OUT.json [PER_CATEGORY [RECIPE [SKIP]]]
    python scripts/measure/first_guess.py heads CHAIN RECORDS.json DRAFT_VOCAB HEAD_DIR [HEAD_DIR ...]

``records``: the target's greedy answers (96 new tokens, both MT-bench turns) to builtin prompts that ``polyspec
bench --limit 2`` does not ask (the 3rd to the (2 + PER_CATEGORY)th of each category, default 10; SKIP 0 takes the
bench's own); ShareGPT prompts held out from the split the chain's head records (bench.prompts.head_data_split), or
RECIPE's ('-': the head's). ``heads``: per category, each head folder's hit rate on those records and the tokens per
round of the default drafting policy replayed on them (prompt-lookup blocks of up to LOOKUP tokens where a 2-3 token
suffix recurs, else the head's one token: docs/DECODE.md), the chain's target giving the features ('-' = the chain's
own head). A head is swapped in for the chain's, so every head is read by the same target in the chain's dtype.
docs/TRAIN.md, stop 21.
"""

import collections
import json
import sys
from pathlib import Path

import torch

from polyspec.bench.prompts import head_data_split, load_prompts
from polyspec.decode.acceptance import kept_caches
from polyspec.decode.generate import encode_messages, generate_text, load_chain
from polyspec.decode.head import load_head
from polyspec.decode.ngram import lookup_run

SKIP = 2  # the bench's own --limit 2 prompts stay out
LOOKUP = 4  # the demo's decode.draft_lookup


def records(chain_dir: str, out: str, per_category: str = "10", recipe: str = "-", skip: str = str(SKIP)) -> None:
    from polyspec.config import load_recipe

    chain = load_chain(Path(chain_dir), device="cpu")
    data_cfg, note = (load_recipe(Path(recipe)).data, None) if recipe != "-" else head_data_split(Path(chain_dir))
    if note:
        print(f"note: {note}", file=sys.stderr)
    questions = load_prompts("builtin", categories=["mt_bench", "humaneval", "sharegpt"],
                             limit=int(skip) + int(per_category), data_cfg=data_cfg)
    write_answers(chain, questions, int(skip), out)


def write_answers(chain, questions: list, skip: int, out: str) -> None:
    """The target's greedy answers (``ar``, 96 new tokens, each question's first two turns, its own earlier answer in
    the history) to ``questions`` past the first ``skip`` of each category, written to ``out`` as records."""
    seen: collections.Counter = collections.Counter()
    rows = []
    for q in questions:
        seen[q.category] += 1
        if seen[q.category] <= skip:
            continue
        messages: list[dict[str, str]] = []
        for turn in q.turns[:2]:
            messages.append({"role": "user", "content": turn})
            ids = encode_messages(chain.tokenizer, messages)
            r = generate_text(chain, None, messages=messages, mode="ar", max_new_tokens=96)
            rows.append({"category": q.category, "question_id": q.question_id, "prompt": ids,
                         "answer": r["token_ids"]})
            messages.append({"role": "assistant", "content": r["text"]})
    Path(out).write_text(json.dumps(rows))
    print(f"{len(rows)} answers, {sum(len(r['answer']) for r in rows)} tokens -> {out}")


def answer_logits(target, head, row: dict) -> torch.Tensor:
    """The head's logits at each answer position [A, V], reading the target's own features (rows P-2 .. end-2 of
    the head's pass over tokens 1.. with features 0..: the guess for answer token i is row P-2+i)."""
    seq = torch.tensor(row["prompt"] + row["answer"])
    p = len(row["prompt"])
    with kept_caches(target, head), torch.no_grad():
        target._cache = head._cache = None
        _, hidden = target(seq)
        logits, _ = head(seq[1:], hidden[:-1])
    return logits[p - 2:len(seq) - 2].float()


def first_guesses(target, head, row: dict) -> list[int]:
    """The head's argmax at each answer position (answer_logits)."""
    return answer_logits(target, head, row).argmax(-1).tolist()


def default_rounds(row: dict, guesses: list[int]) -> int:
    """Verification rounds the default policy takes over the answer: a lookup block where prompt lookup continues the
    context, else the head's first guess; each round commits the accepted prefix plus the target's own token."""
    ctx, answer, i, rounds = list(row["prompt"]), row["answer"], 0, 0
    while i < len(answer):
        block = lookup_run(ctx, min(LOOKUP, len(answer) - i), min_n=2) or [guesses[i]]
        n = 0
        while n < len(block) and i + n < len(answer) and block[n] == answer[i + n]:
            n += 1
        ctx += answer[i:i + n + 1]
        i += n + 1
        rounds += 1
    return rounds


def heads(chain_dir: str, records_file: str, draft_vocab: str, *head_dirs: str) -> None:
    chain = load_chain(Path(chain_dir), device="cpu")
    target = chain.models[chain.order[0]]
    rows = json.loads(Path(records_file).read_text())
    for folder in head_dirs:
        head = chain.models[chain.order[-1]] if folder == "-" else load_head(Path(folder), target)
        head.set_draft_vocab(int(draft_vocab))
        hits: collections.Counter = collections.Counter()
        counts: collections.Counter = collections.Counter()
        rounds: collections.Counter = collections.Counter()
        for row in rows:
            guesses = first_guesses(target, head, row)
            hits[row["category"]] += sum(g == a for g, a in zip(guesses, row["answer"], strict=True))
            counts[row["category"]] += len(row["answer"])
            rounds[row["category"]] += default_rounds(row, guesses)
        rates = {c: round(hits[c] / counts[c], 4) for c in sorted(counts)}
        rates["all"] = round(sum(hits.values()) / sum(counts.values()), 4)
        per_round = {c: round(counts[c] / rounds[c], 3) for c in sorted(counts)}
        per_round["all"] = round(sum(counts.values()) / sum(rounds.values()), 3)
        print(folder, "first guess", json.dumps(rates), "default tokens/round", json.dumps(per_round), flush=True)


if __name__ == "__main__":
    torch.set_num_threads(2)
    {"records": records, "heads": heads}[sys.argv[1]](*sys.argv[2:])
