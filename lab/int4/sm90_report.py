"""Compile polyspec's int4 kernel for sm_90 on a machine without a GPU and print, per Llama-2-7B layer shape and row
count: registers and spills (ptxas -v), shared memory, resident blocks per SM, and the instruction mix of the SASS
(cuobjdump -sass, both shipped in Triton's wheel): the main loop's warp instructions per 32 weights and the
conversions, dequant ops, FMAs, MMAs and loads by width of the whole kernel.

    .venv/bin/python lab/int4/sm90_report.py                 # the kernel's plans (docs/KERNELS.md's table)
    .venv/bin/python lab/int4/sm90_report.py --sweep 16      # every (L, block_n, warps, stages) at 16 rows
    .venv/bin/python lab/int4/sm90_report.py --old dcbf133   # the kernel at a git revision before the rework
    .venv/bin/python lab/int4/sm90_report.py --gemv          # the no-tl.dot GEMV variant that was not kept
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import itertools
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from triton import knobs

from polyspec.decode import int4_triton as T

SHAPES = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008)}
SASS_KEEP_SUFFIX = ("LDG", "STG", "LDS", "STS", "LDSM", "LDGSTS", "HMMA", "HGMMA", "HADD2", "HFMA2", "HMUL2", "F2FP",
                    "I2F", "F2F", "ATOM", "RED")


def sass(compiled) -> list[tuple[int, str, str]]:
    """(address, opcode, operands) of the kernel's SASS."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "k.cubin"
        path.write_bytes(compiled.asm["cubin"])
        text = subprocess.run([knobs.nvidia.cuobjdump.path, "-sass", str(path)], capture_output=True, text=True,
                              check=True).stdout
    rows = re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)([^;]*);", text)
    return [(int(a, 16), op, rest) for a, op, rest in rows]


def opcode(op: str) -> str:
    base = op.split(".")[0]
    if base not in SASS_KEEP_SUFFIX:
        return base
    if base in ("HMMA", "HGMMA"):
        return ".".join(op.split(".")[:2])
    return op.replace(".E.BYPASS", "").replace(".E", "").replace(".CONSTANT", "")


def main_loop(ops: list[tuple[int, str, str]]) -> collections.Counter:
    """Opcodes between the target and the source of the longest backward branch (the K loop)."""
    loops = [(int(m.group(1), 16), a) for a, op, rest in ops if op.startswith("BRA")
             and (m := re.search(r"0x([0-9a-f]+)", rest)) and int(m.group(1), 16) < a]
    if not loops:
        return collections.Counter()
    lo, hi = max(loops, key=lambda r: r[1] - r[0])
    return collections.Counter(opcode(op) for a, op, _ in ops if lo <= a <= hi)


def mix(ops: list[tuple[int, str, str]]) -> str:
    """The whole kernel's conversions, dequant ops, FMAs, MMAs and memory ops."""
    c = collections.Counter(opcode(op) for _, op, _ in ops)
    groups = {"int->float cvt": ("I2F",), "float cvt": ("F2F", "F2FP", "HADD2.F32"), "LOP3": ("LOP3",),
              "SHF": ("SHF",), "PRMT": ("PRMT",), "packed 16-bit": ("HADD2", "HFMA2", "HMUL2"), "FFMA": ("FFMA",),
              "MMA": ("HGMMA", "HMMA")}
    parts = [f"{name} {sum(v for k, v in c.items() if any(k.startswith(p) for p in pre) and not (name == 'packed 16-bit' and k == 'HADD2.F32'))}"
             for name, pre in groups.items()]
    mem = sorted((k, v) for k, v in c.items() if k.split(".")[0] in ("LDG", "LDGSTS", "LDS", "LDSM", "STS", "STG"))
    return ", ".join(parts) + " | " + ", ".join(f"{k} {v}" for k, v in mem)


def report(name: str, compiled, warps: int, weights_per_iteration: int) -> None:
    r = T.ptxas_resources(compiled)
    ops = sass(compiled)
    loop = main_loop(ops)
    per32 = sum(loop.values()) / (weights_per_iteration / warps / 32)
    top = ", ".join(f"{k} {v}" for k, v in loop.most_common(8))
    print(f"{name:34s} regs {r.registers:3d}  spill {r.spill_bytes:4d} B  smem {r.shared_bytes // 1024:3d} KiB  "
          f"blocks/SM {r.blocks_per_sm(warps)}  loop {per32:.2f} instr/32 weights ({top})")
    print(f"{'':34s} {mix(ops)}")


def plans(rows_list: list[int]) -> None:
    for (layer, (n, k)), rows in itertools.product(SHAPES.items(), rows_list):
        compiled, p = T.compile_sm90(n, k, 128, rows)
        t = p.tile
        name = f"{layer} {n}x{k} rows {rows}: {t.block_m}x{t.block_n} L{p.units} w{t.warps} s{t.stages} split {p.splits}"
        report(name, compiled, t.warps, t.block_n * 4 * p.units)


def sweep(rows: int) -> None:
    block_m = min(m for m in (16, 32, 64) if m >= rows)
    for units, block_n, warps, stages in itertools.product((32, 64), (64, 128, 256), (4, 8), (2, 3, 4)):
        if warps == 8 and block_n < 128:
            continue
        p = T.Plan(T.Tile(block_m, block_n, warps, stages), units, 1, 4096 // (4 * units))
        compiled, _ = T.compile_sm90(4096, 4096, 128 if units == 64 else 32, rows, plan_=p)
        report(f"L{units} {block_m}x{block_n} w{warps} s{stages}", compiled, warps, block_n * 4 * units)


def old(rev: str, rows_list: list[int]) -> None:
    """The kernel file at ``rev`` (the pre-rework API: _kernel(), plan(n, groups, sms), BLOCK_N), compiled alike."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = subprocess.run(["git", "show", f"{rev}:decode/int4_triton.py"], capture_output=True, text=True,
                         check=True).stdout
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "old_int4_triton.py"
        path.write_text(src)
        spec = importlib.util.spec_from_file_location("old_int4_triton", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # its dataclasses look their module up
        spec.loader.exec_module(mod)
        kernel = mod._kernel()
        for (layer, (n, k)), rows in itertools.product(SHAPES.items(), rows_list):
            p = mod.plan(n, k // 128, 132)
            block_m = max(16, 1 << (rows - 1).bit_length())
            sig = {"x_ptr": "*bf16", "q_ptr": "*u8", "s_ptr": "*fp32", "z_ptr": "*fp32", "out_ptr": "*fp32",
                   "M": "i32", "N": "i32", "K": "i32", "G": "i32", "stride_xm": "i32", "stride_qn": "i32",
                   "GROUPS_PER_SPLIT": "constexpr", "GROUP": "constexpr", "BLOCK_M": "constexpr",
                   "BLOCK_N": "constexpr"}
            consts = {"GROUPS_PER_SPLIT": p.groups_per_split, "GROUP": 128, "BLOCK_M": block_m, "BLOCK_N": mod.BLOCK_N}
            if rows == 1:
                sig["M"], consts["M"] = "constexpr", 1
            attrs = {(i,): [["tt.divisibility", 16]] for i, nm in enumerate(sig) if nm.endswith("_ptr")
                     or nm in ("N", "K", "stride_xm", "stride_qn")}
            compiled = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs),
                                      target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 3})
            name = f"{layer} {n}x{k} rows {rows}: {block_m}x{mod.BLOCK_N} split {p.splits}"
            report(name, compiled, 4, mod.BLOCK_N * 128)  # one group per loop iteration


def gemv(rows_list: list[int]) -> None:
    """A GEMV without tl.dot on the same layout, for 1-4 rows: q - zero exact in fp32 by the bit trick, one fp32 FMA
    per weight and row, reduced along K in the loop (the variant that was measured and not kept)."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    @triton.jit
    def row(acc, w, x_ptr, stride_xm, r: tl.constexpr, k0, offs_u):
        return acc + tl.sum(w * tl.load(x_ptr + r * stride_xm + k0 + offs_u).to(tl.float32)[None, :], axis=1)

    @triton.jit
    def gemv_kernel(x_ptr, q_ptr, m_ptr, out_ptr, N, KU, stride_xm, stride_qn,
                    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, L: tl.constexpr, GROUP: tl.constexpr):
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_u = tl.arange(0, L)
        a0 = tl.zeros((BLOCK_N,), tl.float32)
        a1 = tl.zeros((BLOCK_N,), tl.float32)
        a2 = tl.zeros((BLOCK_N,), tl.float32)
        a3 = tl.zeros((BLOCK_N,), tl.float32)
        for ub in range(0, KU, L):
            codes = tl.load(q_ptr + offs_n[:, None] * stride_qn + (ub + offs_u)[None, :]).to(tl.int32)
            meta = tl.load(m_ptr + (ub * 4 // GROUP) * N + offs_n)
            nz = (meta & 0xFFFF).to(tl.int16).to(tl.bfloat16, bitcast=True).to(tl.float32) - (8388608.0 - 128.0)
            s = (meta >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            p0 = tl.zeros((BLOCK_N,), tl.float32)
            p1 = tl.zeros((BLOCK_N,), tl.float32)
            p2 = tl.zeros((BLOCK_N,), tl.float32)
            p3 = tl.zeros((BLOCK_N,), tl.float32)
            for j in tl.static_range(4):  # q - zero exact in fp32 by the same bit trick, then one FMA per row
                w = (((codes >> (4 * j)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) + nz[:, None]
                p0 = row(p0, w, x_ptr, stride_xm, 0, ub * 4 + j * L, offs_u)
                if ROWS > 1:
                    p1 = row(p1, w, x_ptr, stride_xm, 1, ub * 4 + j * L, offs_u)
                if ROWS > 2:
                    p2 = row(p2, w, x_ptr, stride_xm, 2, ub * 4 + j * L, offs_u)
                    p3 = row(p3, w, x_ptr, stride_xm, 3, ub * 4 + j * L, offs_u)
            a0, a1, a2, a3 = a0 + p0 * s, a1 + p1 * s, a2 + p2 * s, a3 + p3 * s
        tl.store(out_ptr + offs_n, a0)
        if ROWS > 1:
            tl.store(out_ptr + N + offs_n, a1)
        if ROWS > 2:
            tl.store(out_ptr + 2 * N + offs_n, a2)
            tl.store(out_ptr + 3 * N + offs_n, a3)

    for rows in rows_list:
        sig = {"x_ptr": "*bf16", "q_ptr": "*i16", "m_ptr": "*i32", "out_ptr": "*fp32", "N": "i32", "KU": "i32",
               "stride_xm": "i32", "stride_qn": "i32", "ROWS": "constexpr", "BLOCK_N": "constexpr", "L": "constexpr",
               "GROUP": "constexpr"}
        consts = {"ROWS": rows, "BLOCK_N": 128, "L": 32, "GROUP": 128}
        attrs = {(i,): [["tt.divisibility", 16]] for i in range(8)}
        compiled = triton.compile(ASTSource(fn=gemv_kernel, signature=sig, constexprs=consts, attrs=attrs),
                                  target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 3})
        report(f"gemv rows {rows}: 128 columns L32 w4 s3", compiled, 4, 128 * 4 * 32)


def cli() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 32, 64])
    ap.add_argument("--sweep", type=int, metavar="ROWS", help="sweep tiles at the o_proj shape and ROWS rows")
    ap.add_argument("--old", metavar="REV", help="the kernel file at git revision REV instead")
    ap.add_argument("--gemv", action="store_true", help="the no-tl.dot GEMV variant at 1, 2 and 4 rows")
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    if a.sweep:
        sweep(a.sweep)
    elif a.old:
        old(a.old, a.rows)
    elif a.gemv:
        gemv([1, 2, 4])
    else:
        plans(a.rows)


if __name__ == "__main__":
    cli()
