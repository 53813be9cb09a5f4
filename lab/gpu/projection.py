"""``python lab/gpu/projection.py``: the three-level chain at the 7B shape, by Lemma 3.1 and through the real decoder
(GPU check, call 1, step d; docs/GPU.md).

1. **T_i**: random-weight levels at the shape (the target, its int4 g128 copy, an EAGLE head: shape-bench's
   builders, CUDA graphs and the compiled step where the device has them, static-step buckets up to 16 compiled
   lazily, each in an untimed warm-up before its first timed use), each level's median forward at the widths the
   chain uses (``polyspec.bench.bench.forward_times``).
2. **Lemma 3.1 with the paper's acceptance**: ``theory.chain_time_per_token`` with these T_i, the paper's tokens per
   target verification over the int4 level (``--paper-l-target``, 9.5) and an EAGLE-2-level head (``--paper-l-int4``,
   3.5 and 4.5): the projected speedup over ``ar`` (T_target(1)).
3. **Replay**: the real ``ChainDecoder`` (target <- int4 <- head, linear drafts of ``--k``, ``mu = [--mu]``) decodes
   ``--new-tokens`` tokens, every level running its real forward (one untimed warm-up generation first, which
   compiles the static-step buckets the timed ones use), with the acceptance *recorded* rather than drawn
   from random weights: a level's logits are replaced after its forward by one-hot rows of a script keyed by
   position (the target predicts a fixed sequence S; the int4 level agrees with it except at its recorded miss
   positions; the head agrees with the int4 level except at its own). The miss positions are drawn once from
   ``--agree-int4`` / ``--agree-head`` with ``--seed`` and written into the JSON (``record``), so a rerun replays the
   same sequence. ``ar`` runs through the same decoder with the target alone. The measured time per token, against
   Lemma 3.1 with the T_i above and the acceptance lengths and beta this run measured, is the overhead the lemma leaves
   out (host work, syncs, catch-up passes, blocks wider than mu + 1).

The JSON is rewritten after each part, so a run cut off by its time limit keeps what it finished. ``--dry`` is the
CPU stand-in (the tiny shape, a few tokens).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

DRAFT_VOCAB = 8192  # part 4's head vocabulary (a quarter of Llama-2's 32,000 tokens; at most a quarter of any)
PAPER_L_TARGET = 9.5  # tokens per target verification over the int4 level (the paper's 7B chain)
PAPER_L_INT4 = (3.5, 4.5)  # tokens per int4 verification of an EAGLE-2-level head
MAX_WIDTH = 16  # static-step buckets: the target verifies mu + 1 .. mu + k + 1 tokens, <= 16 at the defaults


class Script:
    """What each level predicts at sequence position q (the token at q): the target S(q), the int4 level S(q) except
    at its misses, the head the int4 level's token except at its own misses."""

    def __init__(self, vocab: int, miss_int4: set[int], miss_head: set[int]):
        self.vocab, self.miss = vocab, {"intermediate": miss_int4, "draft": miss_head}

    def token(self, level: str, q: int) -> int:
        t = (q * 7919 + 17) % self.vocab
        if level == "target":
            return t
        t = (t + 1) % self.vocab if q in self.miss["intermediate"] else t
        if level == "draft" and q in self.miss["draft"]:
            t = (t + 2) % self.vocab
        return t


class ScriptedLevel:
    """A chain level that runs its real forward, then returns the script's one-hot rows as its logits (row r of a
    forward fed ``tokens`` from ``start_pos`` sits at position start_pos + len(tokens) - R + r and predicts the
    next); everything else is the wrapped level's."""

    def __init__(self, level: Any, role: str, script: Script):
        self._level, self._role, self._script = level, role, script

    def __getattr__(self, name: str) -> Any:
        return getattr(self._level, name)

    def forward(self, tokens: list[int], start_pos: int, features: Any = None, **kw: Any) -> tuple[Any, Any]:
        import torch

        logits, hidden = self._level.forward(tokens, start_pos, features, **kw)
        rows = logits.shape[0]
        first = start_pos + len(tokens) - rows
        ids = [self._script.token(self._role, first + r + 1) for r in range(rows)]
        out = torch.zeros_like(logits)
        out[torch.arange(rows, device=out.device), torch.tensor(ids, device=out.device)] = 1.0
        return out, hidden


def misses(n: int, agree: float, seed: int) -> list[int]:
    """Positions 0..n-1 where a level disagrees with the one above, each with probability 1 - agree."""
    rng = random.Random(seed)
    return [q for q in range(n) if rng.random() >= agree]


def lemma(costs: list[float], accept: list[float], beta: float) -> float:
    from polyspec.theory import chain_time_per_token

    return chain_time_per_token(costs, accept, beta)


def build(shape: str, device: Any, dtype: Any, say: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The shape's target, int4 copy and head (shape-bench's random builders). On CUDA each gets a static-step runner
    of buckets up to MAX_WIDTH, compiled lazily: the warm-up generation compiles exactly the buckets the timed ones
    use (a full prewarm would compile every bucket of every level, most of them never used here)."""
    from polyspec.bench.shape_bench import random_head, random_model, shape_args
    from polyspec.decode import cpu_kernels, cuda_graphs

    args = shape_args(shape)
    say(f"projection: random {shape} target, int4 g128 copy and head on {device}")
    target = random_model(args, dtype=dtype, device=device, seed=0)
    models = {"target": target, "intermediate": random_model(args, dtype=dtype, device=device, seed=1, int4_group=128),
              "draft": random_head(args, target, dtype=dtype)}
    graphs = cuda_graphs.graphs_wanted(device)
    for m in models.values():
        cpu_kernels.pack_weights(m)
        if graphs:
            cuda_graphs.enable(m, graphs=True, max_width=MAX_WIDTH)
    return models, {"graphs": graphs, "compiled": bool(graphs and cuda_graphs.compile_wanted(device)),
                    "max_width": MAX_WIDTH}


def forward_ms(models: dict[str, Any], widths: dict[str, list[int]], cache_len: int, repeats: int
               ) -> dict[str, dict[int, float]]:
    """Each level's median forward at its own widths (polyspec.bench.bench.forward_times, one level at a time: no
    bucket is compiled for a width its level never runs), after a prefix that makes its cache ``cache_len`` long:
    the decoder's own length, so the replay reuses the code compiled here (a cache of another length recompiles)."""
    from polyspec.bench.bench import forward_times
    from polyspec.bench.shape_bench import ShapeChain

    out = {}
    for name, ws in widths.items():
        kind = {"target": "target", "intermediate": "int4", "draft": "head"}[name]
        ft = forward_times(ShapeChain({name: models[name]}, [name], {name: kind}), widths=ws,
                           prefix=cache_len - max(ws) - 1, repeats=repeats)
        out[name] = {int(w): v for w, v in ft["levels"][name]["ms"].items()}
    return out


def vocab_part(models: dict[str, Any], cache_len: int, repeats: int, target_ms: float) -> dict[str, Any]:
    """Part 4: the head restricted to a draft vocabulary (random training counts; decode.draft.vocab), its forward at
    width 1 against the full-vocabulary head's and the target's: what the lm_head rows it skips are worth here."""
    import copy

    import torch

    from polyspec.decode import cuda_graphs

    full, target = models["draft"], models["target"]
    head = copy.deepcopy(full)  # the copy has no runner; it shares the target's embedding and lm_head again
    head.embed_tokens, head.lm_head = target.embed_tokens, target.lm_head
    vocab = target.args.vocab_size
    size = min(DRAFT_VOCAB, vocab // 4)
    head.token_counts = torch.randint(0, 1000, (vocab,), generator=torch.Generator().manual_seed(0))
    head.set_draft_vocab(size)
    if cuda_graphs.runner_of(full) is not None:
        cuda_graphs.enable(head, graphs=True, max_width=MAX_WIDTH)
    ms = forward_ms({"draft": head}, {"draft": [1]}, cache_len, repeats)["draft"][1]
    return {"size": size, "vocab": vocab, "T_ms": ms, "ratio_to_target": ms / target_ms}


def seq_len(prompt: int, new_tokens: int) -> int:
    """The decoder's max_seq_len, and the cache length the forward times are taken at."""
    return prompt + new_tokens + 8


def decode_run(models: dict[str, Any], script: Script | None, *, chain: bool, k: int, mu: int, prompt: list[int],
               new_tokens: int, repeats: int) -> dict[str, Any]:
    """Median seconds per token of ``repeats`` generations (after one warm-up) and the last one's level stats."""
    from polyspec.chain_spec import DraftSpec
    from polyspec.decode.chain import ChainDecoder
    from polyspec.decode.levels import HeadLevel, ModelLevel

    levels: list[Any] = [ModelLevel(models["target"], "target")]
    if chain:
        levels += [ModelLevel(models["intermediate"], "intermediate"), HeadLevel(models["draft"], "draft")]
    if script is not None:
        roles = ["target", "intermediate", "draft"]
        levels = [ScriptedLevel(lv, roles[i], script) for i, lv in enumerate(levels)]
    dec = ChainDecoder(levels, draft=DraftSpec(k=k) if chain else None, mu=[mu] if chain else None,
                       max_seq_len=seq_len(len(prompt), new_tokens))
    per_token, res = [], None
    for _ in range(repeats + 1):
        res = dec.generate(prompt, new_tokens)
        per_token.append(res.stats["seconds"] / max(res.stats["new_tokens"], 1))
    out: dict[str, Any] = {"warmup_seconds": per_token[0] * res.stats["new_tokens"],
                           "ms_per_token": statistics.median(per_token[1:]) * 1e3, "runs_ms_per_token":
                           [t * 1e3 for t in per_token[1:]], "new_tokens": res.stats["new_tokens"],
                           "levels": res.stats["levels"], "beta": res.stats["beta"]}
    if script is not None:
        want = [script.token("target", len(prompt) + j) for j in range(res.stats["new_tokens"])]
        out["follows_script"] = res.token_ids == want
    return out


def replay_part(report: dict[str, Any], models: dict[str, Any], ms: dict[str, dict[int, float]], a: Any,
                prompt: list[int], save: Any) -> None:
    """Part 3: ar and the chain through the decoder with the recorded acceptance, against Lemma 3.1."""
    span = len(prompt) + a.new_tokens + a.k + a.mu + 64
    miss_int4 = misses(span, a.agree_int4, a.seed)
    miss_head = misses(span, a.agree_head, a.seed + 1)
    report["record"] = {"agree_int4": a.agree_int4, "agree_head": a.agree_head, "seed": a.seed,
                        "miss_int4": miss_int4, "miss_head": miss_head}
    script = Script(models["target"].args.vocab_size, set(miss_int4), set(miss_head))
    ar = decode_run(models, script, chain=False, k=a.k, mu=a.mu, prompt=prompt, new_tokens=a.new_tokens,
                    repeats=a.repeats)
    report["replay"] = {"ar": ar}
    save()
    ch = decode_run(models, script, chain=True, k=a.k, mu=a.mu, prompt=prompt, new_tokens=a.new_tokens,
                    repeats=a.repeats)
    lv = ch["levels"]
    l_target, l_int4 = lv[0]["mean_accepted"], lv[1]["mean_accepted"]
    costs = [ms["target"][a.mu + 1], ms["intermediate"][a.k + 1], ms["draft"][1]]
    predicted = lemma(costs, [l_target, l_int4], ch["beta"] or 1.0)
    # Lemma 3.1 counts N / L passes per level; the decoder also runs the lower levels for tokens the level above
    # rejects. Its own passes at these T_i, against the measured time, leave the host's work between forwards.
    passes = sum(x["forward_passes"] * t for x, t in zip(lv, costs, strict=True)) / ch["new_tokens"]
    report["replay"]["chain"] = {
        **ch, "L_measured": [l_target, l_int4], "T_ms": costs, "lemma_ms_per_token": predicted,
        "measured_over_lemma": ch["ms_per_token"] / predicted,
        "overhead_ms_per_token": ch["ms_per_token"] - predicted,
        "passes_ms_per_token": passes, "host_ms_per_token": ch["ms_per_token"] - passes,
        "speedup_vs_ar_measured": ar["ms_per_token"] / ch["ms_per_token"],
        "speedup_vs_ar_lemma": ms["target"][1] / predicted,
        "ar_decoder_over_T1": ar["ms_per_token"] / ms["target"][1]}
    save()


def paper_part(ms: dict[str, dict[int, float]], k: int, mu: int) -> list[dict[str, Any]]:
    """Part 2: Lemma 3.1 with the paper's acceptance lengths and these T_i."""
    out = []
    costs = [ms["target"][mu + 1], ms["intermediate"][k + 1], ms["draft"][1]]
    for l_int4 in PAPER_L_INT4:  # beta: k head steps per int4 verification (linear drafts)
        t = lemma(costs, [PAPER_L_TARGET, l_int4], float(k))
        out.append({"L": [PAPER_L_TARGET, l_int4], "beta": k, "T_ms": costs, "ms_per_token": t,
                    "projected_speedup_vs_ar": ms["target"][1] / t})
    return out


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--dry", action="store_true", help="the CPU stand-in (tiny shape, a few tokens)")
    p.add_argument("--shape", default=None, help="default llama2-7b (dry: tiny)")
    p.add_argument("--k", type=int, default=5, help="head tokens drafted per int4 verification")
    p.add_argument("--mu", type=int, default=10, help="int4 tokens per target verification (at least)")
    p.add_argument("--agree-int4", type=float, default=0.93)
    p.add_argument("--agree-head", type=float, default=0.80)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--new-tokens", type=int, default=None, help="default 256 (dry 24)")
    p.add_argument("--repeats", type=int, default=None, help="timed generations (default 3, dry 1)")
    p.add_argument("--prompt-tokens", type=int, default=64)
    a = p.parse_args(argv)
    a.shape = a.shape or ("tiny" if a.dry else "llama2-7b")
    a.new_tokens = a.new_tokens or (24 if a.dry else 256)
    a.repeats = a.repeats or (1 if a.dry else 3)
    return a


def main(argv: list[str] | None = None) -> int:
    import torch

    from polyspec.device import resolve_device, resolve_dtype

    a = parse(argv)
    dev = torch.device("cpu") if a.dry else resolve_device("auto")
    dtype = resolve_dtype(None if not a.dry else "float32", dev)

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    report: dict[str, Any] = {"step": "d_projection", "shape": a.shape, "device": str(dev), "dry": a.dry,
                              "dtype": str(dtype).removeprefix("torch."), "k": a.k, "mu": a.mu,
                              "paper": {"L_target": PAPER_L_TARGET, "L_int4": list(PAPER_L_INT4)}}
    if dev.type == "cuda":
        report["gpu"] = torch.cuda.get_device_name(dev)

    def save() -> None:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(report, indent=1))

    if a.mu + a.k + 1 > MAX_WIDTH:
        raise SystemExit(f"projection: mu + k + 1 = {a.mu + a.k + 1} exceeds the static steps' {MAX_WIDTH}")
    t0 = time.perf_counter()
    models, report["build"] = build(a.shape, dev, dtype, say)
    report["build"]["seconds"] = time.perf_counter() - t0
    say(f"projection: forward times (target 1 and {a.mu + 1}, int4 {a.k + 1}, head 1), compiling as they go")
    t0 = time.perf_counter()
    ms = forward_ms(models, {"target": [1, a.mu + 1], "intermediate": [a.k + 1], "draft": [1]},
                    seq_len(a.prompt_tokens, a.new_tokens), 5 if a.dry else 20)
    report["build"]["forward_times_seconds"] = time.perf_counter() - t0
    report["T_ms"] = {n: {str(w): v for w, v in d.items()} for n, d in ms.items()}
    report["paper_projection"] = paper_part(ms, a.k, a.mu)
    save()
    say("projection: replay through the decoder (ar, then the chain)")
    prompt = [(7 * j + 3) % models["target"].args.vocab_size for j in range(a.prompt_tokens)]
    with torch.inference_mode():
        replay_part(report, models, ms, a, prompt, save)
    report["seconds"] = time.perf_counter() - t0
    save()
    say("projection: the head with a draft vocabulary (last: the replay's results are saved)")
    report["draft_vocab"] = vocab_part(models, seq_len(a.prompt_tokens, a.new_tokens), 5 if a.dry else 20,
                                       ms["target"][1])
    save()
    for c in report["paper_projection"]:
        print(f"Lemma 3.1, paper's L {c['L']}: {c['projected_speedup_vs_ar']:.2f}x ar")
    r = report["replay"]["chain"]
    print(f"replay: L {', '.join(f'{x:.2f}' for x in r['L_measured'])}, beta {r['beta']:.2f}: measured "
          f"{r['speedup_vs_ar_measured']:.2f}x ar, Lemma 3.1 {r['speedup_vs_ar_lemma']:.2f}x; measured / lemma "
          f"{r['measured_over_lemma']:.3f}; the decoder's passes {r['passes_ms_per_token']:.3f} ms a token, the host "
          f"{r['host_ms_per_token']:.3f}; follows the script: {r['follows_script']}")
    v = report["draft_vocab"]
    print(f"head at width 1: {ms['draft'][1]:.3f} ms, with a {v['size']}-token draft vocabulary {v['T_ms']:.3f} ms "
          f"({v['ratio_to_target']:.3f} of the target's step)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
