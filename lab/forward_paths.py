"""A bf16 target's forward three ways, alternated in one process (the order rotating), at widths 1 and 8 after a
cached prefix: a kernel call per layer (``cpu_kernels.run_layers``, the final norm and the lm_head after it), the
layers in one call (``run_block``), and the whole forward in one call (``run_forward``: embedding, layers, final
norm, lm_head). The same arithmetic each way (tests/test_layer_parity.py); what differs is the Python between the
calls, which each forward's weight stream leaves cold (~20 us a layer).

    python lab/forward_paths.py CHAIN [--widths 1 8] [--repeats 45] [--prefix 128]
    python lab/forward_paths.py CHAIN --generate [--limit 2]   # whole generations of ar and the chain's default

``--generate``: builtin first turns (``--limit`` per category of MT-bench, HumanEval and held-out ShareGPT), 96 new
tokens, every path generating each prompt in both modes in turn (the order rotating), after one untimed pass; a
fourth path, the whole forward in one call with its layer block checked per forward (no ``weights_frozen`` span).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from polyspec.decode import cpu_kernels as ck
from polyspec.decode import model as M
from polyspec.decode.generate import build_decoder, cache_size, encode_prompt, eos_ids, load_chain


def _off(*args, **kwargs):
    return None


def generations(chain, paths: dict, limit: int) -> None:
    """Seconds and tokens per (path, mode) over whole generations; prints tokens/s and each mode's ratio to ar."""
    from polyspec.bench.prompts import load_prompts
    from polyspec.decode.chain import SamplingParams

    questions = load_prompts("builtin", categories=["mt_bench", "humaneval", "sharegpt"], limit=limit)
    runs = [(name, mode) for name in paths for mode in ("ar", chain.mode)]
    total = {run: [0.0, 0] for run in runs}
    for timed in (False, True):
        for i, q in enumerate(questions if timed else questions[:1]):
            ids = encode_prompt(chain.tokenizer, q.turns[0])
            for name, mode in runs[i % len(runs):] + runs[:i % len(runs)]:
                ck.layer_block, M.Transformer.decode_step, ck.weights_frozen = paths[name]
                dec = build_decoder(chain, mode, max_seq_len=cache_size(chain, len(ids), 96))
                t0 = time.perf_counter()
                r = dec.generate(ids, 96, SamplingParams(), eos_token_ids=eos_ids(chain.tokenizer))
                if timed:
                    total[name, mode][0] += time.perf_counter() - t0
                    total[name, mode][1] += len(r.token_ids)
    base = {mode: total["per layer", mode][1] / total["per layer", mode][0] for mode in ("ar", chain.mode)}
    for (name, mode), (sec, tok) in total.items():
        print(f"{name:20s} {mode:5s} {tok / sec:7.2f} tokens/s ({tok / sec / base[mode]:.3f}x per layer's), "
              f"{tok / sec / (total[name, 'ar'][1] / total[name, 'ar'][0]):.3f}x its ar")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("chain")
    p.add_argument("--widths", type=int, nargs="+", default=[1, 8])
    p.add_argument("--repeats", type=int, default=45)
    p.add_argument("--prefix", type=int, default=128)
    p.add_argument("--generate", action="store_true")
    p.add_argument("--limit", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(2)
    chain = load_chain(a.chain, device="cpu")
    model = chain.models[chain.order[0]]
    ids = torch.randint(0, model.args.vocab_size, (a.prefix + max(a.widths),), generator=torch.Generator().manual_seed(0))
    model.setup_cache(a.prefix + max(a.widths) + 1)
    layer_block, one_call, frozen = ck.layer_block, M.Transformer.decode_step, ck.weights_frozen
    paths = {"per layer": (_off, _off, frozen), "layers in one call": (layer_block, _off, frozen),
             "forward in one call": (layer_block, one_call, frozen)}
    if a.generate:
        paths["checked per forward"] = (layer_block, one_call, contextlib.nullcontext)
        generations(chain, paths, a.limit)
        ck.layer_block, M.Transformer.decode_step, ck.weights_frozen = layer_block, one_call, frozen
        return
    names, ms = list(paths), {name: {w: [] for w in a.widths} for name in paths}
    with torch.inference_mode():
        model(ids[:a.prefix])
        for rep in range(a.repeats):
            for name in names[rep % 3:] + names[:rep % 3]:
                ck.layer_block, M.Transformer.decode_step = paths[name][:2]
                for w in a.widths:
                    model.truncate(a.prefix)
                    t0 = time.perf_counter()
                    model(ids[a.prefix:a.prefix + w])
                    ms[name][w].append((time.perf_counter() - t0) * 1e3)
    ck.layer_block, M.Transformer.decode_step = layer_block, one_call
    med = {name: {w: statistics.median(v) for w, v in by_w.items()} for name, by_w in ms.items()}
    for w in a.widths:
        base = med["per layer"][w]
        print(f"width {w}: " + ", ".join(f"{n} {m[w]:.3f} ms ({m[w] / base:.3f}x)" for n, m in med.items()))
    if len(a.widths) > 1:
        lo, hi = min(a.widths), max(a.widths)
        print(f"T({hi})/T({lo}): " + ", ".join(f"{n} {m[hi] / m[lo]:.3f}" for n, m in med.items()))


if __name__ == "__main__":
    main()
