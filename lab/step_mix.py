"""What the half-width blocks' step (16 rows x G inputs x one pair of k, 256-bit vectors) is made of, on this core:
the step's instructions in inline assembly, then the same with parts taken out or NOPs added, each timed in one C
program (best of 7 alternated passes over L1-resident data). Needs gcc and AVX-512VL (32 vector registers). "step"
widens the weights as AVX512-BW builds do (two masked word loads, cpu_kernels.cpp's widen_pairs); "step, shift
widening" as the others do (a load, a mask and a 16-bit shift); "vpexpandw" by word expansions (VBMI2); "R rows x G
inputs" R / 8 weight vectors per step, each broadcast feeding all of them (R / 4 x G multiply-adds, "m-a").

    python lab/step_mix.py [--inputs 8]
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path

LOADS = ["vmovdqu32 (%[w]), %%ymm28", "vmovdqu32 32(%[w]), %%ymm29"]
WIDEN = ["vpandd %%ymm31, %%ymm28, %%ymm24", "vpandd %%ymm31, %%ymm29, %%ymm25",
         "vpslld $16, %%ymm28, %%ymm26", "vpslld $16, %%ymm29, %%ymm27"]
MASKED = ["vmovdqu16 (%[w]), %%ymm24%{%%k1%}%{z%}", "vmovdqu16 32(%[w]), %%ymm25%{%%k1%}%{z%}",
          "vmovdqu16 -2(%[w]), %%ymm26%{%%k1%}%{z%}", "vmovdqu16 30(%[w]), %%ymm27%{%%k1%}%{z%}"]
# AVX512-VBMI2: 8 consecutive words into the lanes' high halves (a layout with each vector's words side by side)
EXPAND = [f"vpexpandw {16 * i}(%[w]), %%ymm{24 + i}%{{%%k1%}}%{{z%}}" for i in range(4)]


def step(g: int, broadcasts: bool = True, loads: bool = True, nops: int = 0, shift: bool = False) -> list[str]:
    """The step's instructions (the kernel's order: even k for every input, then odd k); without broadcasts the
    multiplies read one fixed register, without loads the widening is dropped too; ``nops`` one-byte NOPs."""
    out = list(((LOADS + WIDEN) if shift else MASKED) if loads else [])  # a copy: MASKED had grown with each call
    for h in range(2):
        for i in range(g):
            x = f"%%ymm{16 + (2 * i + h) % 8}" if broadcasts else "%%ymm30"
            if broadcasts:
                out.append(f"vbroadcastss {4 * (2 * i + h)}(%[x]), {x}")
            a, b = ("%%ymm24", "%%ymm25") if h == 0 else ("%%ymm26", "%%ymm27")
            out += [f"vfmadd231ps {a}, {x}, %%ymm{2 * i}", f"vfmadd231ps {b}, {x}, %%ymm{2 * i + 1}"]
    return out + ["nop"] * nops


def wide_step(g: int, v: int) -> list[str]:
    """v 8-row weight vectors (v = 2: the 16-row step; 3: 24 rows; 4: two blocks) against g inputs, v * g <= 24:
    2vg multiply-adds per input pair of k, each widened vector used by g inputs and each broadcast by v vectors."""
    out = []
    for h in range(2):
        out += [f"vmovdqu16 {32 * j - 2 * h}(%[w]), %%ymm{24 + j}%{{%%k1%}}%{{z%}}" for j in range(v)]
        for i in range(g):
            out.append(f"vbroadcastss {4 * (2 * i + h)}(%[x]), %%ymm{28 + i % 2}")
            out += [f"vfmadd231ps %%ymm{24 + j}, %%ymm{28 + i % 2}, %%ymm{v * i + j}" for j in range(v)]
    return out


# the vector registers a step writes (the accumulators, broadcasts and weights), declared to the compiler
CLOBBERS = ", ".join(f'"xmm{r}"' for r in range(30)) + ', "memory"'


def program(variants: dict[str, list[str]]) -> str:
    lines = ["#include <stdio.h>", "#include <stdlib.h>", "#include <time.h>",
             "static double now(void) { struct timespec a; clock_gettime(CLOCK_MONOTONIC, &a);"
             " return a.tv_sec + a.tv_nsec * 1e-9; }",
             "int main(void) { float* x = aligned_alloc(64, 1 << 16); unsigned* w = aligned_alloc(64, 1 << 16);",
             "for (int i = 0; i < 16384; i++) { x[i] = 0.001f; w[i] = 0x3c003c00u; }",
             f"long n = 10000000; double t, s, best[{len(variants)}];",
             '__asm__ volatile("vpbroadcastd %0, %%ymm31\\n\\tvpxord %%ymm30, %%ymm30, %%ymm30" :: "r"(0xffff0000u));',
             '__asm__ volatile("kmovw %0, %%k1" :: "r"(0xaaaa));',
             "for (int rep = 0; rep < 7; rep++) {"]
    for j, body in enumerate(variants.values()):
        asm = "\\n\\t".join(body)
        lines += [f't = now(); for (long i = 0; i < n; i++) __asm__ volatile("{asm}" :: [x]"r"(x + (i & 63) * 16),'
                  f' [w]"r"(w + (i & 63) * 16) : {CLOBBERS});',
                  f"s = (now() - t) / n * 1e9; if (rep == 0 || s < best[{j}]) best[{j}] = s;"]
    lines.append("}")
    lines += [f'printf("%-28s %6.2f ns\\n", "{name}", best[{j}]);' for j, name in enumerate(variants)]
    return "\n".join(lines + ["return 0; }"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--inputs", type=int, default=8)
    g = p.parse_args().inputs
    variants = {"step": step(g), "step, shift widening": step(g, shift=True),
                "no broadcasts": step(g, broadcasts=False),
                "multiply-adds alone": step(g, broadcasts=False, loads=False),
                f"multiply-adds + {2 * g} NOPs": step(g, broadcasts=False, loads=False, nops=2 * g),
                "no multiply-adds (loads only)": [s for s in step(g) if not s.startswith("vfmadd")],
                "step + two prefetches": step(g) + ["prefetcht2 1024(%[w])", "prefetcht0 512(%[w])"],
                "24 rows x 8 inputs (48 m-a)": wide_step(8, 3), "32 rows x 6 inputs (48 m-a)": wide_step(6, 4),
                "32 rows x 2 inputs (16 m-a)": wide_step(2, 4)}
    if "avx512_vbmi2" in Path("/proc/cpuinfo").read_text():
        variants["step, vpexpandw widening"] = EXPAND + step(g)[4:]
    with tempfile.TemporaryDirectory() as d:
        src, exe = Path(d) / "mix.c", Path(d) / "mix"
        src.write_text(program(variants))
        subprocess.run(["gcc", "-O2", "-march=native", str(src), "-o", str(exe)], check=True)
        print(f"{g} inputs, {4 * g} multiply-adds per step, ns per step:")
        print(subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout, end="")


if __name__ == "__main__":
    main()
