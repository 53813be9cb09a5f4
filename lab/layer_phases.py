"""Where a decoder layer's time goes, phase by phase: builds a copy of decode/cpu_kernels.cpp whose layer() adds each
phase's wall time to a counter (steady_clock between the phases, on the calling thread), runs a chain level's layers
through it at each width after a cached prefix, and prints ms per forward (all layers) for each phase, their sum,
and the rest (outside layer(): the block's one call and its Python, the C between the layers); and the whole
forward's time (with the lm_head). For
each projection, the two threads' time in its parallel region (share_rows): waking, copying its input (own_input),
working on units of rows, and idle at the end (waiting for the other's last unit).

    POLYSPEC_PORTABLE_ROWS=half python lab/layer_phases.py CHAIN_DIR [--widths 1 8] [--level NAME]

The build takes the flags the library's own build takes (cpu_kernels._flags, so POLYSPEC_PORTABLE_ROWS applies).
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from polyspec.decode import cpu_kernels as ck

PHASES = ["norm", "q/k/v", "rope + cache", "attention", "o", "add + norm", "gate/up", "down", "add"]
# (anchor in layer()'s body, the phase it ends); each anchor must occur once
MARKS = [
    ("    {\n        const int64_t ns[3] = {nq, nk, nk};", 0),
    ("    rope(qkv, nqkv, cos_, sin_, T, nh + nkv, D);", 1),
    ("    attention(qkv, nqkv, kcache", 2),
    ("    run1(att, w.w[3]", 3),
    ("    for (int64_t i = 0; i < T * H; i++) x[i] += o[i];\n    rmsnorm(", 4),
    ("    gate_up(xn,", 5),
    ("    run1(act, w.w[6]", 6),
    ("    for (int64_t i = 0; i < T * H; i++) x[i] += o[i];\n    return 0;", 7),
    ("    return 0;\n}", 8),
]
PROJECTIONS = {1: "q/k/v", 4: "o", 6: "gate/up", 7: "down"}  # phase -> the projection whose region follows it
REGION = ["wake", "copy", "work", "idle"]
REGIONS = """#include <chrono>
static inline double now_s_() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
static int g_slot = 0;  // the phase running: share_rows' regions are counted under it
static double g_region[9][2][4];  // per phase, thread 0 and 1: waking, own_input, units, idle at the end (s)
extern "C" void polyspec_regions(double* out) { memcpy(out, g_region, sizeof(g_region)); memset(g_region, 0, sizeof(g_region)); }
static void region_done_(double r0, const double (&st)[2][3]) {
    const double r1 = now_s_();
    if (g_slot > 8) return;  // after a layer's last phase (the lm_head's region): no phase of layer() to count it under
    for (int t = 0; t < 2; t++) {
        const double s[4] = {st[t][0] - r0, st[t][1] - st[t][0], st[t][2] - st[t][1], r1 - st[t][2]};
        for (int i = 0; i < 4; i++) g_region[g_slot][t][i] += s[i];
    }
}
"""
# (anchor in share_rows, what replaces it); each anchor must occur once in the source
REGION_MARKS = [
    ("#pragma omp parallel num_threads(T)\n", "    double st_[2][3] = {};\n    const double r0_ = now_s_();\n"
     "#pragma omp parallel num_threads(T)\n"),
    ("#endif\n        const auto own = init();\n", "#endif\n        if (me < 2) st_[me][0] = now_s_();\n"
     "        const auto own = init();\n        if (me < 2) st_[me][1] = now_s_();\n"),
    ("(u + 1) * SPLIT_ROWS : N);\n        }\n    }\n}", "(u + 1) * SPLIT_ROWS : N);\n        }\n"
     "        if (me < 2) st_[me][2] = now_s_();\n    }\n    if (T == 2) region_done_(r0_, st_);\n}"),
]
COUNTERS = """static double g_phase[9];
#define PHASE(i) do { const auto now_ = std::chrono::steady_clock::now(); g_slot = (i) + 1; \\
    g_phase[i] += std::chrono::duration<double>(now_ - t_).count(); t_ = now_; } while (0)
extern "C" void polyspec_phases(double* out) { for (int i = 0; i < 9; i++) { out[i] = g_phase[i]; g_phase[i] = 0; } }
"""


def instrumented_source() -> str:
    """cpu_kernels.cpp with the phase counters in layer() and the region clocks in share_rows; a clear error where
    an anchor moved."""
    src = ck._SOURCE.read_text()
    for anchor, replacement in REGION_MARKS:
        if src.count(anchor) != 1:
            raise SystemExit(f"layer_phases: share_rows changed; update the anchor {anchor!r}")
        src = src.replace(anchor, replacement)
    at = src.index("template <typename Init, typename F>\nstatic void share_rows(")
    src = src[:at] + REGIONS + src[at:]
    start = src.index("template <typename WT, typename C>\nstatic int layer(")
    end = src.index("\n}\n", start) + 3
    body = src[start:end].replace("    rmsnorm(x, w.in_norm", "    auto t_ = std::chrono::steady_clock::now();\n"
                                  "    rmsnorm(x, w.in_norm", 1)
    for anchor, phase in MARKS:
        if body.count(anchor) != 1:
            raise SystemExit(f"layer_phases: layer() changed; update the anchor {anchor!r}")
        body = body.replace(anchor, f"    PHASE({phase});\n{anchor}")
    return src[:start] + COUNTERS + body + src[end:]


def build(workdir: Path) -> ctypes.CDLL:
    source, lib_path = workdir / "phases.cpp", workdir / "phases.so"
    source.write_text(instrumented_source())
    subprocess.run([ck._compiler() or "g++", *ck._flags(), str(source), "-o", str(lib_path)], check=True)
    lib = ctypes.CDLL(str(lib_path))
    ck._declare(lib)
    lib.polyspec_phases.argtypes, lib.polyspec_phases.restype = [ctypes.c_void_p], None
    lib.polyspec_regions.argtypes, lib.polyspec_regions.restype = [ctypes.c_void_p], None
    return lib


def measure(lib: ctypes.CDLL, model, width: int, prefix: int, repeats: int
            ) -> tuple[float, float, list[float], list[float]]:
    """ms per forward: the whole forward (model.forward: embedding, layers, final norm, lm_head), the layers alone
    (the model's own _run_layers), each phase inside them, and the regions' clocks (g_region's order)."""
    ids = torch.randint(0, model.args.vocab_size, (prefix + width,), generator=torch.Generator().manual_seed(0))
    counters, regions = (ctypes.c_double * 9)(), (ctypes.c_double * (9 * 2 * 4))()
    with torch.inference_mode():
        model.truncate(0)
        model.forward(ids[:prefix])
        x = model._embed(ids[None, prefix:], None)
        lib.polyspec_phases(counters)
        lib.polyspec_regions(regions)
        t0 = time.perf_counter()
        for _ in range(repeats):
            model.truncate(prefix)
            model._run_layers(x, list(model.layers), None, None)
        total = (time.perf_counter() - t0) / repeats * 1e3
        lib.polyspec_phases(counters)
        lib.polyspec_regions(regions)
        t0 = time.perf_counter()
        for _ in range(repeats):
            model.truncate(prefix)
            model.forward(ids[prefix:])
        forward = (time.perf_counter() - t0) / repeats * 1e3
    return forward, total, [c / repeats * 1e3 for c in counters], [r / repeats * 1e3 for r in regions]


def region_lines(regions: list[float]) -> list[str]:
    """Per projection, each thread's ms per forward in its region: waking, copying, working, idle."""
    lines = []
    for phase, name in PROJECTIONS.items():
        per = [regions[(phase * 2 + t) * 4:(phase * 2 + t) * 4 + 4] for t in range(2)]
        lines.append(f"    {name:8s}" + " | ".join(
            f"thread {t}: " + ", ".join(f"{k} {v:.3f}" for k, v in zip(REGION, per[t], strict=True)) for t in range(2)))
    return lines


def main() -> None:
    from polyspec.decode.generate import load_chain

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("chain")
    p.add_argument("--widths", type=int, nargs="+", default=[1, 8])
    p.add_argument("--level", default=None, help="a level name of the chain (default: its target)")
    p.add_argument("--prefix", type=int, default=128)
    p.add_argument("--repeats", type=int, default=300)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        lib = build(Path(tmp))
        chain = load_chain(a.chain)  # (loads the library's own build: the instrumented one replaces it after)
        model = chain.models[a.level or chain.order[0]]
        ck._lib = lib
        model.setup_cache(a.prefix + max(a.widths) + 1)
        for rep in range(2):  # every width twice, in turn: the second round is the one the machine's drift hit less
            for w in a.widths:
                forward, total, phases, regions = measure(lib, model, w, a.prefix, a.repeats)
                print(f"round {rep + 1} width {w}: forward {forward:.2f} ms, layers {total:.2f} = "
                      + ", ".join(f"{n} {t:.3f}" for n, t in zip(PHASES, phases, strict=True))
                      + f"; outside layer() {total - sum(phases):.2f}", *region_lines(regions), sep="\n", flush=True)


if __name__ == "__main__":
    main()
