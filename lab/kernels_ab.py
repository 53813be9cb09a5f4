"""Two builds of decode/cpu_kernels.cpp against each other, alternated in one process (a VM's speed drifts by more
than most kernel changes between runs minutes apart).

    g++ -O3 -march=native -fopenmp -shared -fPIC -std=c++17 decode/cpu_kernels.cpp -o A.so     # each build
    python lab/kernels_ab.py layers TARGET_DIR bfloat16 A.so B.so 20,300,700   # the decoder layers' time by width
    python lab/kernels_ab.py layers CHAIN_DIR bfloat16 A.so B.so 128 intermediate  # the same for a chain's level
    python lab/kernels_ab.py decode CHAIN_DIR A.so B.so [REPEATS [module-head [MODES]]]  # whole generations
    python lab/kernels_ab.py rows A.so B.so                                    # bf16 weight rows, ns per row
    python lab/kernels_ab.py shapes A.so B.so [WIDTHS]    # SmolLM2's projections on 16-row blocks, ns per step
    python lab/kernels_ab.py attention A.so B.so          # the layer kernel's attention, T = 1, 2, 5, 8 rows
    python lab/kernels_ab.py torch A.so                   # A's bf16 rows against torch's F.linear (oneDNN), widths 1-16
    python lab/kernels_ab.py blocks CHAIN_DIR [LEVEL]     # one build, a level's forwards with and without 16-row blocks
    python lab/kernels_ab.py blocks-decode CHAIN_DIR [REPEATS [MODES]]  # whole generations, with and without them
    python lab/kernels_ab.py prompts CHAIN_DIR [REPEATS [MODES]]  # prompts on the blocks in 64-row forwards, or torch

``layers``: the target's decoder layers at widths 1..8 after each context length, 30 repetitions each running every
width with both builds, medians: the T(k)/T(1) a kernel change reports. ``rows``: one thread, bf16 weights of
K = 576 (6,144 rows, in L3) and K = 1,536 against 1..8 input rows, ns per weight row (median of 200 calls).
``decode``: MODES (default ``ar,default``: the chain's default) on non-bench builtin prompts (the 3rd-5th of
MT-bench, HumanEval and held-out ShareGPT), 96 new tokens, the builds alternated per generation; ``module-head``:
build A runs the draft head's step through the module path.
"""

import collections
import ctypes
import sys
import time
from pathlib import Path

import torch

from polyspec.decode import cpu_kernels as ck


def load_builds(paths: list[str]) -> dict[str, ctypes.CDLL]:
    """Each build with the argument types polyspec's own loader declares."""
    ref = ck._load()
    builds = {}
    for tag, path in zip("AB", paths, strict=True):
        lib = ctypes.CDLL(str(Path(path).resolve()))
        for name, fn in vars(ref).items():  # every entry point the loader declared (ctypes keeps them by name)
            if name.startswith("polyspec_") and hasattr(lib, name):  # an older build may lack the newest ones
                getattr(lib, name).argtypes, getattr(lib, name).restype = fn.argtypes, fn.restype
        builds[tag] = lib
    return builds


def layers(target: str, dtype: str, a: str, b: str, contexts: str, level: str = "") -> None:
    from polyspec.decode.generate import load_chain, load_model

    builds = load_builds([a, b])
    if level:  # TARGET is a chain folder: time that level (e.g. the int4 one), loaded as decoding loads it
        model = load_chain(Path(target), device="cpu", dtype=dtype).models[level]
    else:
        model = load_model(Path(target), dtype=getattr(torch, dtype), device=torch.device("cpu"))
        ck.pack_weights(model)
    model.setup_cache(1024)
    ids = torch.randint(100, 20000, (1000,), generator=torch.Generator().manual_seed(0))
    widths = tuple(range(1, 9))
    with torch.inference_mode():
        for ctx in (int(c) for c in contexts.split(",")):
            model.truncate(0)
            model(ids[:ctx])
            times: dict[tuple[str, int], list[float]] = collections.defaultdict(list)
            for rep in range(30):  # every width and build in every repetition: the machine's drift hits all alike
                for w in widths:
                    for tag in ("A", "B") if rep % 2 else ("B", "A"):
                        ck._lib = builds[tag]
                        t0 = time.perf_counter()
                        model._run_layers(model._embed(ids[None, ctx:ctx + w], None), list(model.layers), None, None)
                        times[tag, w].append(time.perf_counter() - t0)
                        model.truncate(ctx)
            for w in widths:
                ta, tb = (sorted(times[t, w])[15] * 1e3 for t in "AB")
                print(f"ctx {ctx:4d} width {w}: A {ta:6.2f} ms  B {tb:6.2f} ms  B/A {tb / ta:.3f}", flush=True)


def held_out_prompts() -> list[str]:
    """The 3rd-5th builtin prompts of MT-bench, HumanEval and ShareGPT (the bench's --limit 2 prompts stay out)."""
    from polyspec.bench.prompts import load_prompts

    seen: collections.Counter = collections.Counter()
    prompts = []
    for q in load_prompts("builtin", categories=["mt_bench", "humaneval", "sharegpt"], limit=5):
        seen[q.category] += 1
        if seen[q.category] > 2:
            prompts.append(q.turns[0])
    return prompts


def report(secs: dict, toks: dict, names: list[str]) -> None:
    for tag in "AB":
        speed = {m: toks[tag, m] / secs[tag, m] for m in names}
        print(f"{tag}: " + ", ".join(f"{m} {v:.1f} tok/s" for m, v in speed.items())
              + "".join(f", {m}/{names[0]} {speed[m] / speed[names[0]]:.3f}" for m in names[1:]))
    print("B/A speed: " + ", ".join(f"{m} {secs['A', m] / secs['B', m]:.3f}x" for m in names))


def alternate(prompts: list[str], modes: str, repeats: str, generate) -> dict:
    """Whole generations of every prompt in every mode, A and B in turns (the order flipped each repeat);
    ``generate(tag, prompt, mode)`` -> token ids. Prints the speeds; returns {(tag, mode, prompt index): token ids}."""
    secs: dict[tuple[str, str], float] = collections.defaultdict(float)
    toks: dict[tuple[str, str], int] = collections.defaultdict(int)
    outputs: dict[tuple[str, str, int], list[int]] = {}
    for rep in range(int(repeats)):
        for i, prompt in enumerate(prompts):
            for mode in modes.split(","):
                for tag in ("A", "B") if rep % 2 == 0 else ("B", "A"):
                    t0 = time.perf_counter()
                    ids = generate(tag, prompt, mode)
                    secs[tag, mode] += time.perf_counter() - t0
                    toks[tag, mode] += len(ids)
                    outputs[tag, mode, i] = ids
    report(secs, toks, modes.split(","))
    return outputs


def decode(chain_dir: str, a: str, b: str, repeats: str = "2", head_a: str = "", modes: str = "ar,default") -> None:
    from polyspec.decode.generate import generate_text, load_chain

    builds = load_builds([a, b])
    chain = load_chain(Path(chain_dir), device="cpu")
    head = chain.models[chain.order[-1]]
    one_call = getattr(head, "_kernel_step", None)

    def generate(tag: str, prompt: str, mode: str) -> list[int]:
        ck._lib = builds[tag]
        if head_a == "module-head" and one_call is not None:  # A: the head's step as ~25 torch ops
            head._kernel_step = one_call if tag == "B" else (lambda *a, **k: None)
        return generate_text(chain, prompt, mode=None if mode == "default" else mode, max_new_tokens=96)["token_ids"]

    alternate(held_out_prompts(), modes, repeats, generate)


def strip_blocks(model: torch.nn.Module) -> None:
    """Take the 16-row blocks away from a packed model (its bf16 weights go back to the widened rows)."""
    for mod in model.modules():
        w = getattr(mod, "weight", None)
        if isinstance(w, torch.Tensor) and hasattr(w, ck._BLOCKS):
            delattr(w, ck._BLOCKS)
    ck.drop_plans(model)
    for mod in model.modules():
        mod.__dict__.pop("_kernel_step_cache", None)


def blocks(chain_dir: str, level: str = "", prefix: str = "128") -> None:
    """One chain loaded twice, B without the 16-row blocks: one forward of LEVEL (default the target) at widths 1-8
    after PREFIX cached tokens, both copies and every width in each of 30 repetitions, medians."""
    from polyspec.decode.generate import load_chain

    chains = {tag: load_chain(Path(chain_dir), device="cpu") for tag in "AB"}
    name = level or chains["A"].order[0]
    models = {tag: c.models[name] for tag, c in chains.items()}
    strip_blocks(models["B"])
    ctx, widths = int(prefix), tuple(range(1, 9))
    ids = torch.randint(100, 20000, (ctx + 9,), generator=torch.Generator().manual_seed(0))
    times: dict[tuple[str, int], list[float]] = collections.defaultdict(list)
    with torch.inference_mode():
        for m in models.values():
            m.setup_cache(ctx + 16)
            m(ids[:ctx])
        for rep in range(30):
            for w in widths:
                for tag in ("A", "B") if rep % 2 else ("B", "A"):
                    t0 = time.perf_counter()
                    models[tag](ids[ctx:ctx + w])
                    times[tag, w].append(time.perf_counter() - t0)
                    models[tag].truncate(ctx)
    med = {k: sorted(v)[15] * 1e3 for k, v in times.items()}
    for tag, what in (("A", "with blocks"), ("B", "without")):
        print(f"{name} {what}: " + "  ".join(f"{w}: {med[tag, w]:.2f} ms ({med[tag, w] / med[tag, 1]:.2f})"
                                              for w in widths))


def blocks_decode(chain_dir: str, repeats: str = "1", modes: str = "ar,dual") -> None:
    """Whole generations (as ``decode``) of one chain loaded twice, B without the 16-row blocks on any level."""
    from polyspec.decode.generate import generate_text, load_chain

    chains = {tag: load_chain(Path(chain_dir), device="cpu") for tag in "AB"}
    for m in chains["B"].models.values():
        strip_blocks(m)
    outputs = alternate(held_out_prompts(), modes, repeats, lambda tag, prompt, mode: generate_text(
        chains[tag], prompt, mode=mode, max_new_tokens=96)["token_ids"])
    names = modes.split(",")
    for tag in "AB":
        same = all(ids == outputs[t, names[0], i] for (t, _, i), ids in outputs.items() if t == tag)
        print(f"{tag}: greedy outputs of every mode equal {names[0]}'s: {same}")


def prompts(chain_dir: str, repeats: str = "1", modes: str = "ar,dual") -> None:
    """A: prompts over blocked weights in forwards of VERIFY_ROWS (cpu_kernels.blocked_layers), B: torch's GEMM takes
    them whole. The target's prefill of 32-512 tokens (7 repetitions, both in each, medians), then whole generations
    of MODES on the bench's builtin prompts (--limit 2: 6 first turns, 96 new tokens), alternated per generation."""
    from polyspec.bench.prompts import load_prompts
    from polyspec.decode.generate import generate_text, load_chain

    chain = load_chain(Path(chain_dir), device="cpu")
    target = chain.models[chain.order[0]]
    on = ck.blocked_layers
    switch = {"A": on, "B": lambda layers: False}
    times: dict[tuple[str, int], list[float]] = collections.defaultdict(list)
    ids = torch.randint(100, 20000, (512,), generator=torch.Generator().manual_seed(0))
    target.setup_cache(520)
    with torch.inference_mode():
        for rep in range(7):
            for n in (32, 64, 128, 288, 512):
                for tag in ("A", "B") if rep % 2 else ("B", "A"):
                    ck.blocked_layers = switch[tag]
                    target.truncate(0)
                    t0 = time.perf_counter()
                    target(ids[:n], last_only=True)
                    times[tag, n].append(time.perf_counter() - t0)
    for n in (32, 64, 128, 288, 512):
        a, b = (sorted(times[t, n])[3] * 1e3 for t in "AB")
        print(f"prefill {n:3d} tokens: A {a:7.1f} ms ({a / n:.2f} per token)  B {b:7.1f} ms  B/A {b / a:.2f}")
    questions = load_prompts("builtin", categories=["mt_bench", "humaneval", "sharegpt"], limit=2)

    def generate(tag: str, prompt: str, mode: str) -> list[int]:
        ck.blocked_layers = switch[tag]
        return generate_text(chain, prompt, mode=None if mode == "default" else mode, max_new_tokens=96)["token_ids"]

    alternate([q.turns[0] for q in questions], modes, repeats, generate)
    ck.blocked_layers = on


def rows(a: str, b: str) -> None:
    builds = load_builds([a, b])
    torch.set_num_threads(1)
    for k, n in ((576, 6144), (1536, 2304)):
        w = torch.randn(n, k).to(torch.bfloat16)
        for g in range(1, 9):
            x = torch.randn(g, k).to(torch.bfloat16)
            med = {}
            for tag in "AB":
                ck._lib = builds[tag]
                ck.kernel_linear(x, w)
                times = []
                for _ in range(200):
                    t0 = time.perf_counter()
                    ck.kernel_linear(x, w)
                    times.append(time.perf_counter() - t0)
                med[tag] = sorted(times)[100] / n * 1e9
            print(f"K {k} inputs {g}: A {med['A']:.1f} ns/row  B {med['B']:.1f} ns/row  B/A {med['B'] / med['A']:.3f}",
                  flush=True)


# SmolLM2's projections (rows, K, weights timed per call: 30 of a layer shape, as many as its layers, and 1 lm_head)
SHAPES = {"q/k/v": (960, 576, 30), "o": (576, 576, 30), "gate/up": (3072, 576, 30), "down": (576, 1536, 30),
          "lm_head": (49152, 576, 1)}


def shapes(a: str, b: str, widths: str = "1,8") -> None:
    """Each projection shape's weights on their 16-row blocks against WIDTHS bf16 input rows, on one thread and on two,
    the builds alternated: ns per step (a 16-row block x a pair of k) per thread, median of 15. Finer than ``layers``,
    whose forwards the VM's drift moves by ~1 %."""
    builds = load_builds([a, b])
    g = torch.Generator().manual_seed(0)
    for name, (n, k, copies) in SHAPES.items():
        ws = [(torch.randn(n, k, generator=g) * 0.02).bfloat16() for _ in range(copies)]
        ck.make_blocks(ws, force=True)
        calls = [(w.data_ptr(), ck.blocks_ptr(w)) for w in ws]
        for m in (int(v) for v in widths.split(",")):
            x, y = torch.randn(m, k, generator=g).bfloat16().float(), torch.empty(m, n)  # bf16 values: flags 1
            for threads in (1, 2):
                secs: dict[str, list[float]] = {"A": [], "B": []}
                for rep in range(15):
                    for tag in ("A", "B") if rep % 2 else ("B", "A"):
                        fn = builds[tag].polyspec_linear3_bf16w
                        t0 = time.perf_counter()
                        for wp, bp in calls:  # the entry point itself: no Python around it but ctypes' ~2 us
                            fn(x.data_ptr(), wp, 0, 0, None, None, None, n, 0, 0, m, k, y.data_ptr(), threads, 1,
                               bp, None, None)
                        secs[tag].append(time.perf_counter() - t0)
                steps = copies * (n + 15) // 16 * ((k + 1) // 2) / threads
                ta, tb = (sorted(secs[t])[7] / steps * 1e9 for t in "AB")
                print(f"{name:8s} {m} rows, {threads} thread(s): A {ta:.3f} ns  B {tb:.3f} ns  B/A {tb / ta:.3f}",
                      flush=True)


def attention(a: str, b: str) -> None:
    """The layer kernel's attention alone (polyspec_attention_bf16, both threads): SmolLM2's 9 query and 3 K/V heads
    of 64, T rows after 128 cached positions under a causal mask, the builds alternated; us per call, and whether
    both give the same bits."""
    builds = load_builds([a, b])
    h, kv, d, cap = 9, 3, 64, 256
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(kv, cap, d, generator=g).bfloat16() for _ in range(2))
    for t in (1, 2, 5, 8):
        n = 128 + t
        q, mask = torch.randn(t, h * d, generator=g), torch.ones(t, n, dtype=torch.bool).tril(128).contiguous()
        outs, secs = {tag: torch.empty(t, h * d) for tag in "AB"}, collections.defaultdict(list)
        for _ in range(15):
            for tag in "AB":
                args = (q.data_ptr(), k.data_ptr(), v.data_ptr(), cap, n, t, h, kv, d, mask.data_ptr(),
                        torch.get_num_threads(), outs[tag].data_ptr())
                t0 = time.perf_counter()
                for _ in range(300):
                    builds[tag].polyspec_attention_bf16(*args)
                secs[tag].append((time.perf_counter() - t0) / 300)
        ta, tb = (sorted(secs[tag])[7] * 1e6 for tag in "AB")
        print(f"T={t}: A {ta:6.1f} us  B {tb:6.1f} us  B/A {tb / ta:.3f}  same bits {torch.equal(outs['A'], outs['B'])}")


def torch_rows(a: str) -> None:
    """Build A's bf16 rows against torch's F.linear (oneDNN) on gate/up-shaped weights streaming from memory (40 x
    3,072 x 576 bf16, 140 MB), widths 1-16, both in every repetition, best of 7."""
    import torch.nn.functional as F

    ck._lib = load_builds([a, a])["A"]
    ws = [torch.randn(3072, 576).bfloat16() for _ in range(40)]
    for m in (1, 2, 3, 4, 5, 6, 8, 12, 16):
        x = torch.randn(m, 576).bfloat16()
        best = {"rows": 1e9, "torch": 1e9}
        for _ in range(7):
            for name, fn in (("rows", ck.kernel_linear), ("torch", F.linear)):
                t0 = time.perf_counter()
                for w in ws:
                    fn(x, w)
                best[name] = min(best[name], time.perf_counter() - t0)
        print(f"width {m:2d}: rows {best['rows'] * 1e3:6.2f} ms  torch {best['torch'] * 1e3:6.2f} ms  "
              f"torch/rows {best['torch'] / best['rows']:.2f}", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(2)
    {"layers": layers, "decode": decode, "rows": rows, "torch": torch_rows, "blocks": blocks,
     "blocks-decode": blocks_decode, "prompts": prompts, "attention": attention, "shapes": shapes}[sys.argv[1]](
        *sys.argv[2:])
