"""Where a generation's time goes: whole generations of ``ar`` and each draft setting given, every level's forward
timed by width; the rest is the decoder's own work (Python, sampling, bookkeeping). Builtin first turns, ``--limit``
per category of MT-bench, HumanEval and held-out ShareGPT, 96 new tokens; the settings take turns per prompt (the
order rotated), after one untimed pass.

    python lab/rounds.py CHAIN [--draft SPEC ...] [--limit 2]    # e.g. --draft default k=1,lookup=6 tree=2x1x2

``default`` is the chain's manifest decision; any other SPEC (a DraftSpec text over the manifest's draft) runs dual.
"""

from __future__ import annotations

import argparse
import collections
import functools
import time
from pathlib import Path

import torch

from polyspec.bench.prompts import load_prompts
from polyspec.chain_spec import DraftSpec
from polyspec.decode import levels
from polyspec.decode.chain import SamplingParams
from polyspec.decode.generate import build_decoder, cache_size, encode_prompt, eos_ids, load_chain

PREFILL = 40  # wider forwards are prompt prefills
TOKENS = 96
calls: dict[tuple[str, str, int], list[float]] = collections.defaultdict(lambda: [0, 0.0])
current = {"tag": ""}


def time_forwards(cls: type, method: str) -> None:
    """Count and time every ``method`` call of the level class, keyed by (setting, level, width)."""
    inner = getattr(cls, method)

    @functools.wraps(inner)
    def wrapper(self, tokens, *a, **kw):
        t0 = time.perf_counter()
        out = inner(self, tokens, *a, **kw)
        entry = calls[current["tag"], self.name, len(tokens)]
        entry[0] += 1
        entry[1] += time.perf_counter() - t0
        return out

    setattr(cls, method, wrapper)


def run_all(chain, settings: dict[str, tuple[str, DraftSpec | None]], questions: list) -> dict[str, list]:
    """Every question under every setting, rotated; per setting [seconds, tokens, rounds, lookup tokens]."""
    totals = {tag: [0.0, 0, 0, 0] for tag in settings}
    tags = list(settings)
    for i, q in enumerate(questions):
        ids = encode_prompt(chain.tokenizer, q.turns[0])
        for tag in tags[i % len(tags):] + tags[:i % len(tags)]:
            mode, draft = settings[tag]
            current["tag"] = tag
            dec = build_decoder(chain, mode, max_seq_len=cache_size(chain, len(ids), TOKENS), draft=draft)
            t0 = time.perf_counter()
            r = dec.generate(ids, TOKENS, SamplingParams(), eos_token_ids=eos_ids(chain.tokenizer))
            t = totals[tag]
            t[0] += time.perf_counter() - t0
            t[1] += len(r.token_ids)
            t[2] += len(r.level_stats[0].accept_lengths)
            t[3] += r.level_stats[-1].lookup_tokens
    return totals


def report(tag: str, total: list) -> None:
    seconds, tokens, rounds, looked = total
    inside = prefill = 0.0
    print(f"{tag}: {tokens} tokens in {seconds:.3f} s = {tokens / seconds:.1f} tok/s")
    for (t, name, width), (n, s) in sorted(calls.items()):
        if t != tag:
            continue
        if width > PREFILL:
            prefill += s
            continue
        inside += s
        print(f"  {name:12s} width {width:3d}: {n:5d} calls, {s / n * 1e3:6.3f} ms each, {s:6.3f} s")
    rest = seconds - inside - prefill
    print(f"  prefills {prefill:.3f} s; other forwards {inside:.3f} s; the decoder's own work {rest:.3f} s "
          f"({rest / rounds * 1e3:.3f} ms per round); rounds {rounds}, tokens per round {tokens / rounds:.3f}, "
          f"lookup tokens {looked}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("chain", type=Path)
    p.add_argument("--draft", nargs="*", default=["default"])
    p.add_argument("--limit", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(2)
    chain = load_chain(args.chain, device="cpu")
    settings: dict[str, tuple[str, DraftSpec | None]] = {"ar": ("ar", None)}
    for spec in args.draft:
        settings[spec] = (chain.mode, None) if spec == "default" else ("dual", DraftSpec.parse(spec, chain.decode.draft))
    for cls in (levels.ModelLevel, levels.HeadLevel):
        for method in ("forward", "forward_tree"):
            time_forwards(cls, method)
    questions = load_prompts("builtin", categories=["mt_bench", "humaneval", "sharegpt"], limit=args.limit)
    run_all(chain, settings, questions[:1])  # warm-up
    calls.clear()
    for tag, total in run_all(chain, settings, questions).items():
        report(tag, total)


if __name__ == "__main__":
    main()
