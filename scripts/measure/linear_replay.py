"""Linear drafts with prompt-lookup blocks, replayed on the target's own greedy answers: tokens per target
verification, rows verified per round, and decode time per token estimated from the target's forward cost by width.

    python scripts/measure/linear_replay.py records CHAIN PROMPTS OUT LIMIT [SKIP [CATEGORIES]]
    python scripts/measure/linear_replay.py replay CHAIN RECORDS [LOOKUP/PER_MATCH ...]   # e.g. 8/- 15/3 15/4
    python scripts/measure/linear_replay.py select CHAIN RECORDS A/B/MMAX ...                  # e.g. 0.05/0.4/4
    python scripts/measure/linear_replay.py matches RECORDS
    python scripts/measure/linear_replay.py widths CHAIN W [W ...]

``records``: `ar` answers (bf16, 96 new tokens, both turns) to PROMPTS ('builtin' or a Spec-Bench question.jsonl),
LIMIT per category after the first SKIP, CATEGORIES comma-separated (all by default). ``replay``: the chain's head
drafts k = 4 tokens from the training unroll (EagleHead.unroll: teacher-forced on the target's features, which is
what the decoder computes for every prefix the target accepts), on the chain's draft vocabulary; a round is
prompt lookup's run where the context ends in a 2+ token suffix seen before (ngram.lookup_run, up to LOOKUP tokens,
at most PER_MATCH per matched token; '-': no such cut), else the head's tokens, which lookup finishes once the text
ends in such a suffix, as decode/chain.py does. 'oracle' takes, per round, whichever of the two accepts more (and
counts, by matched length, the lookup rounds where the head's block won).
``select``: 15/3, except that where lookup's run starts from a match of at most MMAX tokens, the round takes the head's
block if the head's first draft gives lookup's first token probability < A and its own guess > B (stop 33).
``matches``: lookup runs of up to 32 (no cut) at every round start of a one-token walk over each answer, by the
length of the suffix they matched: how often the first token is rejected, how often 8+ are accepted.
``widths``: the target's forward (bf16) over W new tokens after 250 cached ones, medians of 8; the table COST_MS
below is its output on the 2-core VM. docs/DECODE.md, "Lookup runs as long as their match" (stop 32).
"""

import hashlib
import json
import pickle
import sys
import time
from pathlib import Path

import torch

from polyspec.bench.prompts import head_data_split, load_prompts
from polyspec.decode.acceptance import kept_caches
from polyspec.decode.generate import load_chain
from polyspec.decode.ngram import lookup_match, lookup_run

sys.path.insert(0, str(Path(__file__).parent))
from first_guess import write_answers  # noqa: E402

K = 4  # the linear draft of issue 15's goal
DRAFT_VOCAB = 8192  # issue 15's bench: --draft-vocab 8192
COST_MS = {1: 7.16, 2: 7.08, 4: 7.6, 5: 7.56, 8: 8.47, 9: 9.04, 12: 10.3, 13: 10.82, 16: 12.08, 17: 12.7,
           18: 12.97, 20: 14.19, 24: 16.34, 33: 22.06}  # `widths` on the idle VM, stop 32
HEAD_MS, ROUND_MS = 0.6, 0.2  # a head step; the decoder's own work per round (docs/BENCHMARKS.md, stop 27)


def records(chain_dir: str, prompts: str, out: str, limit: str, skip: str = "0", cats: str = "") -> None:
    chain = load_chain(Path(chain_dir), device="cpu", dtype="bfloat16")
    data_cfg, _ = head_data_split(Path(chain_dir))
    questions = load_prompts(prompts, categories=[c for c in cats.split(",") if c] or None,
                             limit=int(skip) + int(limit), data_cfg=data_cfg)
    write_answers(chain, questions, int(skip), out)


def unrolled(chain, row: dict, steps: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The head's unroll over one record (logits [T, Vd] per step; step k at row t drafts token t + 2 + k),
    teacher-forced on the target's features, and the draft vocabulary's ids."""
    target, head = chain.models[chain.order[0]], chain.models[chain.order[-1]]
    seq = torch.tensor(row["prompt"] + row["answer"])
    with kept_caches(target, head), torch.no_grad():
        target._cache = head._cache = None
        _, hidden = target(seq)
        out = head.unroll(seq[1:][None], hidden[:-1][None], steps, vocab_ids=head.draft_ids)
    ids = head.draft_ids if head.draft_ids is not None else torch.arange(out[0][0].shape[-1])
    return [logits[0] for logits, _ in out], ids


def head_drafts(chain, rows: list[dict]) -> list[list[list[int]]]:
    """Per record, per unroll step k, the head's token at every row t."""
    out = []
    for row in rows:
        steps, ids = unrolled(chain, row, K)
        out.append([ids[logits.argmax(-1)].tolist() for logits in steps])
    return out


def head_first(chain, rows: list[dict]) -> list[tuple[list[list[int]], list[list[float]]]]:
    """Per record, the head's first draft (step 0) at every row t as its 16 likeliest tokens and their probabilities
    (on the draft vocabulary)."""
    out = []
    for row in rows:
        (logits,), ids = unrolled(chain, row, 1)
        top = logits.float().softmax(-1).topk(16, -1)
        out.append((ids[top.indices].tolist(), top.values.tolist()))
    return out


def cost_ms(width: int) -> float:
    """COST_MS interpolated (the widest entry beyond it)."""
    keys = sorted(COST_MS)
    for a, b in zip(keys, keys[1:], strict=False):
        if a <= width <= b:
            return COST_MS[a] + (COST_MS[b] - COST_MS[a]) * (width - a) / (b - a)
    return COST_MS[keys[-1]]


def accepted(block: list[int], answer: list[int], i: int) -> int:
    n = 0
    while n < len(block) and i + n < len(answer) and block[n] == answer[i + n]:
        n += 1
    return n


def round_block(ctx: list[int], drafts: list[list[int]], p: int, lookup: int, per_match: int | None,
                answer: list[int], i: int, oracle: bool) -> tuple[list[int], int]:
    """The block a round verifies and the head steps it took."""
    run = lookup_run(ctx, min(lookup, len(answer) - i), min_n=2, per_match=per_match)
    if run and not oracle:
        return run, 0
    block, steps = head_block(ctx, drafts, p, lookup, per_match, answer, i)
    if run and accepted(run, answer, i) >= accepted(block, answer, i):
        return run, 0
    return block, steps


def head_block(ctx: list[int], drafts: list[list[int]], p: int, lookup: int, per_match: int | None,
               answer: list[int], i: int) -> tuple[list[int], int]:
    """The head's k = 4 tokens, finished by lookup once the text ends in a repeated suffix, and its head steps."""
    block: list[int] = []
    for k in range(K):
        block.append(drafts[k][p - 2])
        room = min(lookup, len(answer) - i) - len(block)  # as the decoder's budget cuts it
        tail = lookup_run(ctx + block, room, min_n=2, per_match=per_match)
        if tail:
            break
    return block + tail, len(block)


def replay_one(rows: list[dict], drafts: list, lookup: int, per_match: int | None, oracle: bool) -> dict:
    tokens = rounds = rows_verified = 0
    ms = 0.0
    wins: dict[int, list[int]] = {}  # oracle: by matched length (5 = 5+), [rounds the head's block won, lookup rounds]
    for row, dr in zip(rows, drafts, strict=True):
        ctx, answer, i = list(row["prompt"]), row["answer"], 0
        while i < len(answer):
            block, steps = round_block(ctx, dr, len(ctx), lookup, per_match, answer, i, oracle)
            found = lookup_match(ctx, min_n=2) if oracle else None
            if found is not None:
                tally = wins.setdefault(min(found[1], 5), [0, 0])
                tally[0], tally[1] = tally[0] + (steps > 0), tally[1] + 1
            n = accepted(block, answer, i)
            got = min(n + 1, len(answer) - i)
            ctx += answer[i:i + got]
            i, tokens, rounds = i + got, tokens + got, rounds + 1
            rows_verified += len(block) + 1
            ms += cost_ms(len(block) + 1) + HEAD_MS * steps + ROUND_MS
    out = {"tokens_per_verification": round(tokens / rounds, 3), "rows_per_round": round(rows_verified / rounds, 2),
           "est_ms_per_token": round(ms / tokens, 3)}
    return out | ({"head_won_by_match": dict(sorted(wins.items()))} if oracle else {})


def drafts_tag(chain_dir: str) -> str:
    """The head's caches are reused for the same head (its folder and training record)."""
    head_json = next(Path(chain_dir).glob("**/training.json"), None)
    tag = hashlib.sha256((str(Path(chain_dir).resolve()) + (head_json.read_text() if head_json else "")).encode())
    return tag.hexdigest()[:12]


def cached_drafts(chain_dir: str, records_file: str, rows: list[dict]) -> list:
    cache = Path(f"{records_file}.{drafts_tag(chain_dir)}.drafts.pkl")
    if not cache.is_file():
        chain = load_chain(Path(chain_dir), device="cpu", dtype="bfloat16", draft_vocab=DRAFT_VOCAB)
        cache.write_bytes(pickle.dumps(head_drafts(chain, rows)))
    return pickle.loads(cache.read_bytes())


def replay(chain_dir: str, records_file: str, *policies: str) -> None:
    rows = json.loads(Path(records_file).read_text())
    drafts = cached_drafts(chain_dir, records_file, rows)
    cats = sorted({r["category"] for r in rows})
    for spec in policies or ("8/-", "15/3", "oracle:8/-"):
        oracle = spec.startswith("oracle:")
        lookup, pm = spec.removeprefix("oracle:").split("/")
        for cat in [*cats, "all"] if len(cats) > 1 else cats:
            idx = [j for j, r in enumerate(rows) if cat in ("all", r["category"])]
            res = replay_one([rows[j] for j in idx], [drafts[j] for j in idx], int(lookup),
                             None if pm == "-" else int(pm), oracle)
            print(spec, cat, json.dumps(res), flush=True)


def select_one(rows: list[dict], drafts: list, firsts: list, rule: tuple[float, float, int]) -> dict:
    """15/3 lookup, except that a round whose run starts from a match of at most MMAX tokens takes the head's block
    where the head gives lookup's first token less than A and its own first guess more than B (one head step more
    where it is asked and not taken)."""
    a, b, mmax = rule
    tokens = rounds = taken = 0
    ms = 0.0
    for row, dr, (ids, probs) in zip(rows, drafts, firsts, strict=True):
        ctx, answer, i = list(row["prompt"]), row["answer"], 0
        while i < len(answer):
            p, asked, use_head = len(ctx), False, False
            run = lookup_run(ctx, min(15, len(answer) - i), min_n=2, per_match=3)
            if run and lookup_match(ctx, min_n=2)[1] <= mmax:
                asked = True
                first = dict(zip(ids[p - 2], probs[p - 2], strict=True))
                use_head = first.get(run[0], 0.0) < a and probs[p - 2][0] > b
            block, steps = head_block(ctx, dr, p, 15, 3, answer, i) if use_head or not run else (run, 0)
            got = min(accepted(block, answer, i) + 1, len(answer) - i)
            ctx += answer[i:i + got]
            i, tokens, rounds, taken = i + got, tokens + got, rounds + 1, taken + use_head
            ms += cost_ms(len(block) + 1) + HEAD_MS * (steps + (asked and not use_head)) + ROUND_MS
    return {"tokens_per_verification": round(tokens / rounds, 3), "head_taken": taken,
            "est_ms_per_token": round(ms / tokens, 3)}


def select(chain_dir: str, records_file: str, *rules: str) -> None:
    rows = json.loads(Path(records_file).read_text())
    drafts = cached_drafts(chain_dir, records_file, rows)
    cache = Path(f"{records_file}.{drafts_tag(chain_dir)}.first.pkl")
    if not cache.is_file():
        cache.write_bytes(pickle.dumps(head_first(
            load_chain(Path(chain_dir), device="cpu", dtype="bfloat16", draft_vocab=DRAFT_VOCAB), rows)))
    firsts = pickle.loads(cache.read_bytes())
    for spec in rules:
        a, b, mmax = spec.split("/")
        print(spec, json.dumps(select_one(rows, drafts, firsts, (float(a), float(b), int(mmax)))), flush=True)


def matches(records_file: str) -> None:
    by_len: dict[int, list[int]] = {}
    for row in json.loads(Path(records_file).read_text()):
        ctx, answer = list(row["prompt"]), row["answer"]
        for i in range(len(answer)):
            found = lookup_match(ctx + answer[:i], min_n=2)
            if found is not None:
                run = lookup_run(ctx + answer[:i], min(32, len(answer) - i), min_n=2)
                by_len.setdefault(found[1], []).append(accepted(run, answer, i))
    for m, acc in sorted(by_len.items()):
        print(f"matched {m}: {len(acc)} runs, first token rejected {sum(a == 0 for a in acc) / len(acc):.2f}, "
              f"8+ accepted {sum(a >= 8 for a in acc) / len(acc):.2f}")


def widths(chain_dir: str, *ws: str) -> None:
    chain = load_chain(Path(chain_dir), device="cpu", dtype="bfloat16")
    model = chain.models[chain.order[0]]
    prompt = torch.randint(0, model.args.vocab_size, (250,), generator=torch.Generator().manual_seed(0))
    model.setup_cache(512)
    times: dict[int, list[float]] = {}
    with torch.no_grad():
        model(prompt)
        for rep in range(9):
            for w in map(int, ws):
                ids = torch.randint(0, model.args.vocab_size, (w,))
                t0 = time.perf_counter()
                model(ids)
                dt = time.perf_counter() - t0
                model.truncate(250)
                if rep:  # the first pass warms up
                    times.setdefault(w, []).append(dt)
    for w, v in times.items():
        print(f"width {w}: {sorted(v)[len(v) // 2] * 1e3:.2f} ms")


if __name__ == "__main__":
    torch.set_num_threads(2)
    {"records": records, "replay": replay, "select": select, "matches": matches,
     "widths": widths}[sys.argv[1]](*sys.argv[2:])
