"""An int8 middle level for a bf16 target on the CPU (decode/int8.py), made in memory from a chain's target: its
forward time by width against the target's, and whole generations of ar, the chain's default and the three-level
chain target <- int8 <- head in one process.

    python scripts/measure/int8_level.py forward CHAIN [REPEATS]          # widths 1, 2, 3, 5, 7, 9 at 200 positions
    python scripts/measure/int8_level.py bench CHAIN LIMIT TOKENS MU [MU ...]
    python scripts/measure/int8_level.py agree CHAIN RECORDS.json           # first_guess.py records
    python scripts/measure/int8_level.py parts CHAIN                        # layers / lm_head / rest per forward

``agree``: how often a copy's argmax is the target's own greedy token, teacher-forced on the target's answers (the
target's weights rounded in place per row to 8-bit and 7-bit codes, and with int8 activations too; the chain's own
int4 level for scale).

``bench``: builtin first turns (MT-bench, HumanEval, held-out ShareGPT; LIMIT per category), the modes rotated per
prompt after an untimed first prompt; the chain drafts as the default does (k = 1, prompt-lookup blocks of 4) and the
target verifies blocks of >= MU. Prints tok/s, the ratio to ar, each level's mean accepted tokens per forward and
whether every answer equals ar's. docs/BENCHMARKS.md, "CPU, stop 27".
"""

import collections
import sys
import time
from pathlib import Path

import torch

from polyspec.bench.prompts import load_prompts
from polyspec.decode.chain import ChainDecoder, SamplingParams
from polyspec.decode.generate import build_decoder, cache_size, encode_prompt, eos_ids, load_chain
from polyspec.decode.int8 import int8_copy
from polyspec.decode.levels import HeadLevel, ModelLevel

WIDTHS = (1, 2, 3, 5, 7, 9)


def forward(chain_dir: str, repeats: str = "15") -> None:
    chain = load_chain(Path(chain_dir), device="cpu")
    models = {"target": chain.models[chain.order[0]]}
    models["int8"] = int8_copy(models["target"])
    prompt = torch.randint(0, models["target"].args.vocab_size, (200,), generator=torch.Generator().manual_seed(0))
    times: dict[tuple[str, int], list[float]] = collections.defaultdict(list)
    with torch.inference_mode():
        for m in models.values():
            m.setup_cache(256)
            m(prompt)
        for rep in range(int(repeats)):
            for name, m in models.items():
                for w in WIDTHS if rep % 2 else WIDTHS[::-1]:
                    ids = torch.randint(0, m.args.vocab_size, (w,))
                    t0 = time.perf_counter()
                    m(ids)
                    if rep:
                        times[(name, w)].append(time.perf_counter() - t0)
                    m._cache.length = 200
    med = {k: sorted(v)[len(v) // 2] * 1e3 for k, v in times.items()}
    for name in models:
        print(name, " ".join(f"w{w} {med[(name, w)]:.2f}" for w in WIDTHS), "ms")
    print("int8 / target", " ".join(f"w{w} {med[('int8', w)] / med[('target', w)]:.2f}" for w in WIDTHS))


def parts(chain_dir: str) -> None:
    """Per forward at widths 1 and 2 (200 cached positions, medians of 18): the 30 layers' kernel calls, the lm_head's
    and the rest, the target against the int8 copy alternated."""
    from polyspec.decode import cpu_kernels

    torch.set_num_threads(2)
    chain = load_chain(Path(chain_dir), device="cpu")
    models = {"target": chain.models[chain.order[0]]}
    models["int8"] = int8_copy(models["target"])
    times: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    tag = {"now": ""}
    for fn in ("run_layers", "kernel_linear", "int8_linear"):
        real = getattr(cpu_kernels, fn)

        def timed(*a, _real=real, _fn=fn, **kw):
            t0 = time.perf_counter()
            out = _real(*a, **kw)
            times[(tag["now"], "layers" if _fn == "run_layers" else "lm_head")].append(time.perf_counter() - t0)
            return out

        setattr(cpu_kernels, fn, timed)
    prompt = torch.randint(0, models["target"].args.vocab_size, (200,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        for m in models.values():
            m.setup_cache(256)
            m(prompt)
        for _ in range(20):
            for name, m in models.items():
                for w in (1, 2):
                    tag["now"] = f"{name} w{w}"
                    t0 = time.perf_counter()
                    m(torch.randint(0, m.args.vocab_size, (w,)))
                    times[(tag["now"], "total")].append(time.perf_counter() - t0)
                    m._cache.length = 200
    med = {k: sorted(v[2:])[len(v[2:]) // 2] * 1e3 for k, v in times.items()}
    for now in sorted({k[0] for k in med if k[0]}):  # ("": the prompts' prefill)
        lay, lm, tot = med[(now, "layers")], med[(now, "lm_head")], med[(now, "total")]
        print(f"{now}: layers {lay:.2f} ms, lm_head {lm:.2f}, the rest {tot - lay - lm:.2f}, total {tot:.2f}")


def _decoders(chain, low, mus: list[int], size: int) -> dict[str, ChainDecoder]:
    target, head = chain.models[chain.order[0]], chain.models[chain.order[-1]]
    out = {"ar": build_decoder(chain, "ar", max_seq_len=size), "default": build_decoder(chain, chain.mode,
                                                                                         max_seq_len=size)}
    for mu in mus:
        levels = [ModelLevel(target, "target"), ModelLevel(low, "int8"), HeadLevel(head, "draft")]
        out[f"chain mu={mu}"] = ChainDecoder(levels, max_seq_len=size, draft_k=1, mu=[mu], draft_lookup=4)
    return out


def bench(chain_dir: str, limit: str, tokens: str, *mus: str) -> None:
    torch.set_num_threads(2)
    chain = load_chain(Path(chain_dir), device="cpu")
    low = int8_copy(chain.models[chain.order[0]])
    n = int(tokens)
    secs: dict[str, float] = collections.defaultdict(float)
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    same: collections.Counter = collections.Counter()
    questions = load_prompts("builtin", categories=["mt_bench", "humaneval", "sharegpt"], limit=int(limit))
    for i, q in enumerate(questions):
        ids = encode_prompt(chain.tokenizer, q.turns[0])
        decs = _decoders(chain, low, [int(m) for m in mus], cache_size(chain, len(ids), n))
        names = list(decs)
        outs = {}
        for name in names[i % len(names):] + names[:i % len(names)]:
            t0 = time.perf_counter()
            r = decs[name].generate(ids, n, SamplingParams(), eos_token_ids=eos_ids(chain.tokenizer))
            outs[name] = r.token_ids
            if i == 0:
                continue  # the first prompt warms every mode up
            secs[name] += time.perf_counter() - t0
            counts[name]["tokens"] += len(r.token_ids)
            for ls in r.level_stats:
                counts[name][f"{ls.name} emitted"] += ls.tokens_emitted if ls is not r.level_stats[-1] else 0
                counts[name][f"{ls.name} forwards"] += ls.forward_passes
        for name, out in outs.items():
            same[name] += out == outs["ar"]
    ar = counts["ar"]["tokens"] / secs["ar"]
    for name, c in counts.items():
        tps = c["tokens"] / secs[name]
        levels = [k.split()[0] for k in c if k.endswith("forwards")]
        acc = " ".join(f"{lv} {c[f'{lv} emitted'] / c[f'{lv} forwards']:.2f}" for lv in levels[:-1] or levels)
        print(f"{name:12s} {tps:7.1f} tok/s  x{tps / ar:.3f}  mean accepted: {acc}  forwards: "
              + " ".join(f"{lv} {c[f'{lv} forwards']}" for lv in levels))
    print(f"answers equal to ar's, of {len(questions)}:", dict(same))


def _agreement(model, rows: list) -> float:
    hit = n = 0
    with torch.inference_mode():
        for r in rows:
            model._cache = None
            seq = torch.tensor(r["prompt"] + r["answer"])
            p = len(r["prompt"])
            guess = model(seq)[0][p - 1:len(seq) - 1].float().argmax(-1)
            hit += int((guess == torch.tensor(r["answer"])).sum())
            n += len(r["answer"])
    return hit / n


def _rounded(model, code_max: int, activations: bool):
    """The model's linear weights rounded per row to codes in -code_max..code_max, in place; with ``activations``
    also each linear's input per row to int8 (through cpu_kernels.linear, which every projection calls)."""
    from polyspec.decode import cpu_kernels

    for mod in model.modules():
        if isinstance(mod, torch.nn.Linear):
            w = mod.weight.data
            s = w.float().abs().amax(1, keepdim=True).clamp_min(1e-12) / code_max
            w.copy_(((w.float() / s).round().clamp(-code_max, code_max) * s).to(w.dtype))
    if not activations:
        return None
    real = cpu_kernels.linear

    def rounded_input(x, weight, bias=None, max_rows=cpu_kernels.MAX_ROWS):
        s = x.float().abs().amax(-1, keepdim=True).clamp_min(1e-12) / 127
        return real(((x.float() / s).round().clamp(-127, 127) * s).to(x.dtype), weight, bias, max_rows)

    cpu_kernels.linear = rounded_input
    return real


def agree(chain_dir: str, records: str) -> None:
    import json

    from polyspec.decode import cpu_kernels

    torch.set_num_threads(2)
    rows = json.loads(Path(records).read_text())
    chain = load_chain(Path(chain_dir), device="cpu")
    print("the target (its torch path)", round(_agreement(chain.models[chain.order[0]], rows), 4))
    print("the chain's middle level", round(_agreement(chain.models[chain.order[1]], rows), 4))
    for label, code_max, act in (("8-bit codes", 127, False), ("7-bit codes", 63, False),
                                 ("8-bit codes, int8 activations", 127, True)):
        model = load_chain(Path(chain_dir), device="cpu").models[chain.order[0]]
        real = _rounded(model, code_max, act)
        try:
            print(label, round(_agreement(model, rows), 4))
        finally:
            if real is not None:
                cpu_kernels.linear = real


if __name__ == "__main__":
    {"forward": forward, "bench": bench, "agree": agree, "parts": parts}[sys.argv[1]](*sys.argv[2:])
