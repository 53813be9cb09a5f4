"""Drafting policies replayed on the target's own greedy answers: tokens per target verification, rows verified per
round, and time per token estimated from this machine's measured forward costs, without decoding.

    python lab/replay.py records CHAIN OUT.json [--prompts builtin|FILE] [--limit 10] [--skip 2]
    python lab/replay.py replay CHAIN RECORDS.json [SPEC ...]      # e.g. k=1 k=1,lookup=6 k=4,lookup=15

``records``: the target's greedy answers (``ar``, 96 new tokens, each question's first two turns with its own earlier
answer in the history) to the prompts past the first ``--skip`` of each category (the bench's own ``--limit 2``
prompts stay out by default). ``replay``: each SPEC (a DraftSpec text; linear drafts: k, lookup, vocab) walked over
every record as the decoder would round by round: prompt lookup's block where the context ends in a repeat (the
decoder's own lookup code), else the head's k tokens (its training unroll, teacher-forced on the target's features,
which is what the decoder computes for every prefix the target accepts), finished by lookup once the text ends in a
repeat. The estimate charges each round the target's measured forward at the round's width, the head's measured step
per drafted token and the decoder's measured overhead per round, all timed here first (bench.forward_times and one
real dual generation), never a table from another machine.

What it answered (docs/DECODE.md): the lookup block size and per-match cut, k = 1 on 2 CPU cores, and that choosing
lookup or the head per round by the head's confidence gains too little to pay for its extra head step.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import pickle
import sys
from pathlib import Path

import torch

from polyspec.bench.bench import forward_times
from polyspec.bench.prompts import head_data_split, load_prompts
from polyspec.chain_spec import DraftSpec
from polyspec.decode.acceptance import kept_caches
from polyspec.decode.drafting.lookup import RUN_PER_MATCH, lookup_run
from polyspec.decode.generate import build_decoder, encode_messages, generate_text, load_chain

ANSWER_TOKENS = 96
WIDTHS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32)


def records(chain_dir: Path, out: Path, prompts: str, limit: int, skip: int) -> None:
    """The target's greedy answers to the prompts (see the module docstring), written to ``out``."""
    chain = load_chain(chain_dir, device="cpu")
    data_cfg, _ = head_data_split(chain_dir)
    questions = load_prompts(prompts, limit=skip + limit, data_cfg=data_cfg)
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
            r = generate_text(chain, None, messages=messages, mode="ar", max_new_tokens=ANSWER_TOKENS)
            rows.append({"category": q.category, "question_id": q.question_id, "prompt": ids,
                         "answer": r["token_ids"]})
            messages.append({"role": "assistant", "content": r["text"]})
    out.write_text(json.dumps(rows))
    print(f"{len(rows)} answers, {sum(len(r['answer']) for r in rows)} tokens -> {out}")


def head_drafts(chain, rows: list[dict], k: int) -> list[list[list[int]]]:
    """Per record, per unroll step j < k, the head's token at every row t (step j at row t drafts token t + 2 + j)."""
    target, head = chain.models[chain.order[0]], chain.models[chain.order[-1]]
    out = []
    for row in rows:
        seq = torch.tensor(row["prompt"] + row["answer"])
        with kept_caches(target, head), torch.no_grad():
            target._cache = head._cache = None
            _, hidden = target(seq)
            steps = head.unroll(seq[1:][None], hidden[:-1][None], k, vocab_ids=head.draft_ids)
        ids = head.draft_ids if head.draft_ids is not None else torch.arange(steps[0][0].shape[-1])
        out.append([ids[logits[0].argmax(-1)].tolist() for logits, _ in steps])
    return out


def cached_drafts(chain_dir: Path, chain, records_file: Path, rows: list[dict], k: int) -> list:
    """head_drafts, cached beside the records for this head, vocabulary and k."""
    head = chain.models[chain.order[-1]]
    tag = hashlib.sha256(repr((sorted(chain_dir.glob("**/model.safetensors")), head.draft_ids is None
                               or head.draft_ids.numel(), k)).encode() + (chain_dir / "manifest.json").read_bytes())
    cache = records_file.with_name(f"{records_file.name}.{tag.hexdigest()[:12]}.drafts.pkl")
    if not cache.is_file():
        cache.write_bytes(pickle.dumps(head_drafts(chain, rows, k)))
    return pickle.loads(cache.read_bytes())


def round_block(spec: DraftSpec, ctx: list[int], drafts: list[list[int]], room: int) -> tuple[list[int], int]:
    """The block a round verifies after ``ctx`` and the head steps it took (as decode/drafting/linear.py drafts)."""
    n = min(spec.lookup, room)
    run = lookup_run(ctx, n, min_n=2, per_match=RUN_PER_MATCH) if n else []
    if run:
        return run, 0
    block: list[int] = []
    for j in range(min(spec.k, room)):
        block.append(drafts[j][len(ctx) - 2])
        tail = lookup_run(ctx + block, n - len(block), min_n=2, per_match=RUN_PER_MATCH) if n > len(block) else []
        if tail:
            return block + tail, len(block)
    return block, len(block)


def replay_spec(spec: DraftSpec, rows: list[dict], drafts: list, costs: dict[str, float | dict]) -> dict:
    """One policy over every record: tokens per verification, rows per round, estimated ms per token."""
    tokens = rounds = rows_verified = 0
    ms = 0.0
    for row, dr in zip(rows, drafts, strict=True):
        ctx, answer, i = list(row["prompt"]), row["answer"], 0
        while i < len(answer):
            block, steps = round_block(spec, ctx, dr, len(answer) - i)
            n = next((j for j, (a, b) in enumerate(zip(block, answer[i:], strict=False)) if a != b), len(block))
            got = min(n + 1, len(answer) - i)
            ctx += answer[i:i + got]
            i, tokens, rounds, rows_verified = i + got, tokens + got, rounds + 1, rows_verified + len(block) + 1
            ms += target_ms(costs, len(block) + 1) + costs["head_ms"] * steps + costs["round_ms"]
    return {"spec": spec.text(), "tokens_per_verification": round(tokens / rounds, 3),
            "rows_per_round": round(rows_verified / rounds, 2), "est_ms_per_token": round(ms / tokens, 3),
            "est_speedup_vs_ar": round(target_ms(costs, 1) / (ms / tokens), 3)}


def target_ms(costs: dict, width: int) -> float:
    """The target's measured forward at ``width`` (linear between measured widths, the widest beyond them)."""
    table = costs["target_ms"]
    ws = sorted(table)
    if width >= ws[-1]:
        return table[ws[-1]]
    hi = next(w for w in ws if w >= width)
    lo = max(w for w in ws if w <= width)
    return table[lo] if hi == lo else table[lo] + (table[hi] - table[lo]) * (width - lo) / (hi - lo)


def measure_costs(chain, rows: list[dict]) -> dict:
    """This machine's costs: the target's forward by width and the head's step (bench.forward_times), and the
    decoder's own work per round (a real dual generation's wall time less its timed forwards)."""
    ft = forward_times(chain, widths=list(WIDTHS), prefix=250, repeats=8)
    top, head = chain.order[0], chain.order[-1]
    levels = ft["levels"]
    costs = {"target_ms": {int(w): ms for w, ms in levels[top]["ms"].items()}, "head_ms": levels[head]["ms"]["1"]}
    dec = build_decoder(chain, "dual", max_seq_len=len(rows[0]["prompt"]) + ANSWER_TOKENS + 64,
                        draft=DraftSpec(k=1, vocab=chain.decode.draft.vocab))
    res = dec.generate(rows[0]["prompt"], ANSWER_TOKENS)
    rounds = len(res.level_stats[0].accept_lengths)
    passes = res.level_stats[0].forward_passes, res.level_stats[1].forward_passes
    forwards_ms = passes[0] * target_ms(costs, 2) + passes[1] * costs["head_ms"]
    costs["round_ms"] = max(res.stats["seconds"] * 1e3 - forwards_ms, 0.0) / max(rounds, 1)
    return costs


def replay(chain_dir: Path, records_file: Path, specs: list[str]) -> None:
    chain = load_chain(chain_dir, device="cpu")
    rows = json.loads(records_file.read_text())
    parsed = [DraftSpec.parse(s, chain.decode.draft.model_copy(update={"tree": None})) for s in specs or ["k=1"]]
    drafts = cached_drafts(chain_dir, chain, records_file, rows, max(p.k for p in parsed))
    costs = measure_costs(chain, rows)
    print(json.dumps({"costs": costs}))
    cats = sorted({r["category"] for r in rows})
    for spec in parsed:
        for cat in [*cats, "all"]:
            idx = [j for j, r in enumerate(rows) if cat in ("all", r["category"])]
            res = replay_spec(spec, [rows[j] for j in idx], [drafts[j] for j in idx], costs)
            print(json.dumps({"category": cat, **res}), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="verb", required=True)
    r = sub.add_parser("records")
    r.add_argument("chain", type=Path)
    r.add_argument("out", type=Path)
    r.add_argument("--prompts", default="builtin")
    r.add_argument("--limit", type=int, default=10)
    r.add_argument("--skip", type=int, default=2)
    s = sub.add_parser("replay")
    s.add_argument("chain", type=Path)
    s.add_argument("records", type=Path)
    s.add_argument("specs", nargs="*")
    args = p.parse_args(argv)
    torch.set_num_threads(2)
    if args.verb == "records":
        records(args.chain, args.out, args.prompts, args.limit, args.skip)
    else:
        replay(args.chain, args.records, args.specs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
