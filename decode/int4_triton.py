"""The Triton W4A16 kernel for int4 layers at verification widths on CUDA (1-64 rows).

Why: a batch-1 verification is memory-bound, so an int4 layer can take a quarter of the bf16 layer's time (the
paper's 0.318) only if its kernel streams the codes at close to full bandwidth; torch's int4 kernel (tinygemm) made a
Llama-2-7B-shaped int4 model *slower* than bf16 on an H200 (docs/GPU_RESULTS.md). At ~4.8 TB/s an H200 SM receives
~37 weights per cycle and issues 4 warp instructions per cycle, so the whole per-weight budget is ~3.5 warp
instructions per 32 weights; the dequantisation must cost a fraction of that.

What it computes: ``y = x @ dequantize(q, scales, zeros).T (+ bias)`` for :class:`polyspec.decode.int4.Int4Linear`
(w = (q - zero) * scale per row and group of ``group_size`` along K), in the activations' dtype (bf16 or fp16)
with fp32 accumulation. Each group's ``(q - zero)`` is exact in the 16-bit dtype and its scale (the checkpoint's
fp16 value) is applied in fp32 once per group after the group's MMAs, so no dequantised weight is rounded.

How (docs/KERNELS.md, "int4 at verification widths on CUDA"; the Triton source is decode/int4_kernel.py):

* Layout (:func:`kernel_tensors`, built once per device and dtype from the layer's codes; the on-disk GPTQ format
  and ``Int4Linear.qdata`` are unchanged): codes int16 [N, KU], K zero-padded to blocks of 4L values; in each block,
  unit u (0 <= u < L) holds k = j L + u in its nibble j. Two neighbouring units read as one 32-bit register give the
  pair (k, k + 1) of "plane" j in bits 4j and 16 + 4j, which is how an MMA operand register holds two neighbouring k.
  Meta int32 [G, N]: the fp16 scale's bits (high half) and -(MAGIC + zero) in the activation dtype (low half).
* Conversion: ``((r >> 4j) & 0x000F000F) | MAGIC2`` makes two 16-bit floats MAGIC + q (0x4300 = 128.0 in bf16,
  0x6400 = 1024.0 in fp16: the nibble fills the low mantissa bits), and one packed FMA with 1.0 and -(MAGIC + zero)
  gives q - zero exactly: per 8 weights 3 shifts, 4 LOP3, 4 HADD2/HFMA2, no int-to-float conversion
  (``tl.inline_asm_elementwise``, two elements per call; lane-wise, so its result does not depend on which elements
  Triton pairs). Under Triton's interpreter (no inline asm) the same bit trick runs as plain Triton ops.
* Swap AB: the weights are the MMA's A operand (rows = output columns, taken from registers) and the activations
  x^T its B operand, so 1-16 rows use one 16-wide MMA tile (wgmma 64xN16 on sm_90); four dots per block, plane j
  against x[:, jL:(j+1)L] (contiguous, copied to shared memory asynchronously by Triton's pipeliner).
* Split K only when the column blocks alone leave the GPU short of two programs per SM (:func:`plan`); the splits
  write fp32 partials, and the last split of each tile to arrive (an atomic counter per tile, reset by that program)
  sums them in split order and writes the output: one launch, deterministic run to run for a given plan.

A no-``tl.dot`` GEMV for 1-4 rows was measured and not kept: its fp32 multiply-adds cost one warp instruction per
weight per row on top of the conversion (>= 3 per 32 weights at one row, 5.9 as Triton compiles it), while the MMA
path costs the same ~2.3 at 1 or 16 rows (lab/int4/sm90_report.py prints both).

Supported (:func:`supported`): CUDA, 2-D bf16/fp16/fp32 activations (fp32 runs as bf16) with 1..MAX_ROWS rows,
group sizes 32/64/128/256, any N and K. Everything else keeps torch's kernels; ``POLYSPEC_INT4_TRITON=0`` turns it
off. Parity: tests/test_int4_triton.py (the interpreter, fp16: its bf16 arithmetic and ``tl.dot`` act on the raw
uint16 bits in triton 3.6; and CUDA bf16, marked ``gpu``); the sm_90 compile (registers, spills) is checked there too.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

ENV = "POLYSPEC_INT4_TRITON"
MAX_ROWS = 64  # wider blocks (prefill) stay on torch's kernel
GROUPS = (32, 64, 128, 256)
MAGIC = {torch.bfloat16: (0x4300, 128.0, 0x3F80, "bf16x2"), torch.float16: (0x6400, 1024.0, 0x3C00, "f16x2")}

TRITON = importlib.util.find_spec("triton") is not None  # CPU-only installs have no triton


def enabled() -> bool:
    return TRITON and os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def supported(x: torch.Tensor, group_size: int) -> bool:
    """Whether :func:`int4_mm` takes activations ``x`` [M, K] of a layer with ``group_size`` (see the module doc)."""
    return (x.device.type == "cuda" and x.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS and group_size in GROUPS
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32) and enabled())


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# ----------------------------------------------------------------------------------------------------------------
# Layout
# ----------------------------------------------------------------------------------------------------------------


def plane_units(group_size: int, k: int) -> int:
    """L, the K values one plane covers in a block of 4L: at most one group (a plane's MMA then needs one scale),
    64 where K is a multiple of 256, else whichever of 64 and 32 pads K least (the padding is streamed too)."""
    if group_size < 64 or -(-k // 256) * 256 > -(-k // 128) * 128:  # (plain arithmetic: dynamo traces it)
        return 32
    return 64


def padded_k(k: int, group_size: int) -> int:
    block = 4 * plane_units(group_size, k)
    return -(-k // block) * block


def kernel_codes(q: torch.Tensor, group_size: int) -> torch.Tensor:
    """Codes uint8 [N, K] -> int16 [N, Kp / 4] in the plane layout (module doc), on q's device."""
    n, k = q.shape
    units = plane_units(group_size, k)
    v = F.pad(q, (0, padded_k(k, group_size) - k)).view(n, -1, 4, units).to(torch.int32)  # [N, B, plane, L]
    packed = v[:, :, 0] | v[:, :, 1] << 4 | v[:, :, 2] << 8 | v[:, :, 3] << 12  # [N, B, L] in 0..65535
    return (packed - ((packed >> 15) << 16)).to(torch.int16).reshape(n, -1)  # the same 16 bits, signed


def kernel_meta(scales: torch.Tensor, zeros: torch.Tensor, group_size: int, k: int, dtype: torch.dtype
                ) -> torch.Tensor:
    """Scales f32 [N, G] (fp16-representable) and zeros [N, G] -> int32 [Gp, N]: fp16 scale bits << 16 |
    bits of -(MAGIC + zero) in ``dtype``; groups of the K padding get scale 0."""
    magic = MAGIC[dtype][1]
    hi = scales.to(torch.float16).view(torch.int16).to(torch.int32) << 16
    lo = (-(magic + zeros.float())).to(dtype).view(torch.int16).to(torch.int32) & 0xFFFF
    meta = (hi | lo).t()  # [G, N]
    gp = -(-padded_k(k, group_size) // group_size)
    return F.pad(meta, (0, 0, 0, gp - meta.shape[0])).contiguous()


@dataclass(frozen=True)
class Tensors:
    """One layer's device-side kernel tensors for one activation dtype."""

    codes: torch.Tensor  # int16 [N, Kp / 4]
    meta: torch.Tensor  # int32 [Gp, N]
    bias: torch.Tensor | None  # [N] in the activation dtype
    locks: torch.Tensor  # int32 split-K counters, one per tile, zero between launches
    sms: int  # the device's multiprocessors (:func:`plan`)


def kernel_tensors(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bias: torch.Tensor | None,
                   group_size: int, dtype: torch.dtype, device: torch.device, sms: int | None = None) -> Tensors:
    """The kernel's tensors for codes q [N, K], scales/zeros [N, G], built on ``device`` (``sms``: its
    multiprocessor count, read from the device when None)."""
    n, k = q.shape
    codes = kernel_codes(q.to(device), group_size)
    meta = kernel_meta(scales.to(device), zeros.to(device), group_size, k, dtype)
    locks = torch.zeros(-(-n // 16) * -(-MAX_ROWS // 16), dtype=torch.int32, device=device)  # the most tiles
    if sms is None:  # Triton's interpreter (CPU tensors): a nominal 8
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    return Tensors(codes, meta, None if bias is None else bias.to(device, dtype), locks, sms)


# ----------------------------------------------------------------------------------------------------------------
# Launch plans
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tile:
    """Block shape and schedule of one launch (``block_n`` output columns x ``block_m`` rows per program)."""

    block_m: int
    block_n: int
    warps: int
    stages: int


# (L, most rows) -> tile, chosen on the sm_90 compile (lab/int4/sm90_report.py --sweep): the fewest warp instructions
# per weight in the loop with no spills and >= 2 resident blocks per SM; not timed on a GPU yet. Registers, shared
# memory and the instruction mix of the 7B shapes are in docs/KERNELS.md and checked by tests/test_int4_triton.py.
TILES = {(64, 16): Tile(16, 128, 4, 3), (64, 32): Tile(32, 128, 4, 2), (64, MAX_ROWS): Tile(64, 64, 4, 2),
         (32, 16): Tile(16, 256, 4, 3), (32, 32): Tile(32, 128, 4, 2), (32, MAX_ROWS): Tile(64, 128, 4, 2)}


@dataclass(frozen=True)
class Plan:
    """A launch for one layer, row count bucket and device."""

    tile: Tile
    units: int  # L (see :func:`plane_units`)
    splits: int  # programs along K per tile
    blocks_per_split: int  # blocks of 4L K values per split (the last split may run past K: it adds zeros)


def tile_for(units: int, rows: int) -> Tile:
    return next(t for (u, most), t in TILES.items() if u == units and rows <= most)


def plan(n: int, k: int, group_size: int, rows: int, sms: int) -> Plan:
    """The launch for a layer [n, k] at ``rows`` rows on a device with ``sms`` multiprocessors: split K only when
    the column blocks leave the GPU short of two programs per SM, each split at least two blocks of K, preferring
    a split count that divides the blocks (no tail) up to twice the count needed."""
    units = plane_units(group_size, k)
    tile = tile_for(units, rows)
    tiles = -(-n // tile.block_n) * -(-rows // tile.block_m)
    blocks = padded_k(k, group_size) // (4 * units)
    most = max(1, blocks // 2)
    splits = min(-(-2 * sms // tiles), most)
    splits = next((s for s in range(splits, min(2 * splits, most) + 1) if blocks % s == 0), splits)
    per = -(-blocks // splits)
    return Plan(tile, units, -(-blocks // per), per)


# ----------------------------------------------------------------------------------------------------------------
# The kernel
# ----------------------------------------------------------------------------------------------------------------


def plane_asm(dtype: torch.dtype) -> tuple[str, str, str, str]:
    """PTX per plane j for two codes units packed in $1 and -(MAGIC + zero) twice in $2: $0 = both values q - zero
    (see the module doc). Lane-wise: the low and high halves never mix."""
    magic, _, one, op = MAGIC[dtype]

    def one_plane(j: int) -> str:
        shift = f"shr.u32 t, $1, {4 * j};" if j else "mov.b32 t, $1;"
        return (f"{{ .reg .b32 t, c; mov.b32 c, 0x{one:04X}{one:04X}; {shift} "
                f"lop3.b32 t, t, 0x000F000F, 0x{magic:04X}{magic:04X}, 0xEA; fma.rn.{op} $0, t, c, $2; }}")

    return tuple(one_plane(j) for j in range(4))


def _kernel() -> Any:
    from polyspec.decode import int4_kernel

    return int4_kernel.w4a16


def launch(x: torch.Tensor, t: Tensors, group_size: int, n: int, p: Plan, *, out: torch.Tensor | None = None,
           ws: torch.Tensor | None = None, compile_only: Any = None) -> Any:
    """Run the kernel: x [M, K] (bf16/fp16, contiguous) -> ``out`` [M, n] in x's dtype (``ws``: the split-K partials
    [splits, M, n] fp32; both allocated when None). ``compile_only``: a ``triton.backends.compiler.GPUTarget`` to
    compile for instead (returns Triton's compiled kernel; the tensors may then live anywhere, e.g. on the meta
    device)."""
    m, k = x.shape
    tile = p.tile
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if ws is None:
        ws = out if p.splits == 1 else torch.empty(p.splits, m, n, dtype=torch.float32, device=x.device)
    asm = ("",) * 4 if _interpreted() else plane_asm(x.dtype)
    grid = (-(-n // tile.block_n), p.splits, -(-m // tile.block_m))
    args = (x, t.codes, t.meta, t.bias if t.bias is not None else out, out, ws, t.locks, m, n, k, t.codes.shape[1],
            x.stride(0), t.codes.stride(0))
    meta = dict(GROUP=group_size, L=p.units, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, SPLITS=p.splits,
                BLOCKS=p.blocks_per_split, MASK_CODES=n % tile.block_n != 0, MASK_K=k % (4 * p.units) != 0,
                HAS_BIAS=t.bias is not None, MAGIC16=MAGIC[x.dtype][0], A0=asm[0], A1=asm[1], A2=asm[2], A3=asm[3],
                num_warps=tile.warps, num_stages=tile.stages)
    kernel = _kernel()
    if compile_only is not None:
        return _compile(kernel, args, meta, compile_only)
    kernel[grid](*args, **meta)
    return out


def _compile(kernel: Any, args: tuple, meta: dict, target: Any) -> Any:
    """Triton's compile of the kernel for ``args`` (specialised as a launch would be: 16-byte aligned pointers,
    ints divisible by 16 marked so, ints equal to 1 constant) on ``target``, without a GPU."""
    import triton
    from triton.compiler import ASTSource

    names = list(kernel.arg_names)
    sig, consts, attrs = {}, {}, {}
    for i, (name, a) in enumerate(zip(names, args + tuple(meta[nm] for nm in names[len(args):]), strict=True)):
        if name in meta:
            sig[name], consts[name] = "constexpr", a
        elif isinstance(a, torch.Tensor):
            sig[name] = "*" + {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
                               torch.int16: "i16", torch.int32: "i32"}[a.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif a == 1:
            sig[name], consts[name] = "constexpr", 1
        else:
            sig[name] = "i32"
            if a % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=target, options={"num_warps": meta["num_warps"],
                                                       "num_stages": meta["num_stages"]})


@functools.cache
def register() -> None:
    """Register the kernel as the torch op ``polyspec::int4_mm`` (once, eagerly: the layer does it when it builds
    its tensors). The op is opaque, with a fake implementation for shapes, so the compiled static step (dynamo,
    fullgraph) keeps it in one graph and calls it as it is; CUDA graphs capture its launch like any other. The split-K
    counters it takes are left at zero by every launch."""

    @torch.library.custom_op("polyspec::int4_mm", mutates_args=())
    def int4_mm_op(x: torch.Tensor, codes: torch.Tensor, meta: torch.Tensor, bias: torch.Tensor | None,
                   locks: torch.Tensor, group_size: int, n: int, block_m: int, block_n: int, warps: int, stages: int,
                   units: int, splits: int, blocks_per_split: int) -> torch.Tensor:
        p = Plan(Tile(block_m, block_n, warps, stages), units, splits, blocks_per_split)
        return launch(x, Tensors(codes, meta, bias, locks, 0), group_size, n, p)

    @int4_mm_op.register_fake
    def _(x, codes, meta, bias, locks, group_size, n, block_m, block_n, warps, stages, units, splits,
          blocks_per_split):
        return x.new_empty(x.shape[0], n)


def int4_mm(x: torch.Tensor, t: Tensors, group_size: int, n: int, p: Plan) -> torch.Tensor:
    """x [M, K] (bf16/fp16) -> [M, n] in x's dtype through ``polyspec::int4_mm`` (after :func:`register`); ``t``
    from :func:`kernel_tensors` for x's dtype, ``p`` from :func:`plan`. The caller checks :func:`supported`."""
    tile = p.tile
    return torch.ops.polyspec.int4_mm(x.contiguous(), t.codes, t.meta, t.bias, t.locks, group_size, n, tile.block_m,
                                      tile.block_n, tile.warps, tile.stages, p.units, p.splits, p.blocks_per_split)


# ----------------------------------------------------------------------------------------------------------------
# The sm_90 compile, read without a GPU (tests/test_int4_triton.py, lab/int4/sm90_report.py)
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Resources:
    registers: int
    spill_bytes: int  # spill stores + spill loads, as ptxas reports them
    shared_bytes: int  # Triton's dynamic shared memory

    def blocks_per_sm(self, warps: int, regs_per_sm: int = 65536, smem_per_sm: int = 233472) -> int:
        """Resident blocks by registers (allocated per warp in units of 256) and shared memory (1 KiB reserved per
        block), at sm_90's 64K registers and 228 KiB."""
        per_warp = math.ceil(self.registers * 32 / 256) * 256
        by_regs = regs_per_sm // (per_warp * warps)
        by_smem = smem_per_sm // (self.shared_bytes + 1024)
        return min(by_regs, by_smem)


def compile_sm90(n: int, k: int, group_size: int, rows: int, dtype: torch.dtype = torch.bfloat16,
                 sms: int = 132, plan_: Plan | None = None) -> tuple[Any, Plan]:
    """Compile the kernel for sm_90 at a layer shape [n, k] and ``rows`` (meta tensors: nothing is allocated)."""
    from triton.backends.compiler import GPUTarget

    p = plan_ or plan(n, k, group_size, rows, sms)
    meta_dev = torch.device("meta")
    kp = padded_k(k, group_size)
    t = Tensors(torch.empty(n, kp // 4, dtype=torch.int16, device=meta_dev),
                torch.empty(-(-kp // group_size), n, dtype=torch.int32, device=meta_dev), None,
                torch.empty(1, dtype=torch.int32, device=meta_dev), sms)
    x = torch.empty(rows, k, dtype=dtype, device=meta_dev)
    return launch(x, t, group_size, n, p, compile_only=GPUTarget("cuda", 90, 32)), p


def ptxas_resources(compiled: Any) -> Resources:
    """Registers and spills from ``ptxas -v`` (Triton's own ptxas) on the compiled kernel's PTX."""
    import re
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    ptx = compiled.asm["ptx"]
    arch = re.search(r"\.target\s+(\w+)", ptx).group(1)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        res = subprocess.run([get_ptxas(90).path, "-v", f"--gpu-name={arch}", path, "-o", path + ".o"],
                             capture_output=True, text=True, check=True)
    regs = int(re.search(r"Used (\d+) registers", res.stderr).group(1))
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", res.stderr)
    return Resources(regs, int(spills.group(1)) + int(spills.group(2)), compiled.metadata.shared)
