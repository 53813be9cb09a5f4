"""The Triton W4A16 kernel (polyspec.decode.int4_triton) against the dequantised reference: its layout and plans on
the CPU; every path under Triton's interpreter (fp16 activations: the interpreter's bf16 arithmetic and ``tl.dot``
act on the raw uint16 bits in triton 3.6; a subprocess, since the interpreter is chosen when a kernel is defined);
its sm_90 compile (Triton's own ptxas, no GPU needed): no spills, two resident blocks per SM; and on CUDA in bf16
through Int4Linear (marked ``gpu``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from polyspec.decode import int4_triton as T
from polyspec.decode.int4 import Int4Linear, dequantize, quantize_rtn, select_backend

needs_triton = pytest.mark.skipif(not T.TRITON, reason="needs triton (make install puts it in)")

LLAMA_7B = ((12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008))  # fused q/k/v, o, fused gate/up, down


def _interpreted(script: str) -> subprocess.CompletedProcess:
    """``script`` in a fresh Python under Triton's interpreter (chosen when a kernel is defined, so not in here)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900)


# ---------------------------------------------------------------------------------------------------------------
# Layout and plans (plain torch)
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k,group", [(256, 128), (576, 128), (200, 32), (1024, 256)])
def test_plane_layout_puts_k_at_its_nibble(k, group):
    """Unit u of block b holds k = b 4L + j L + u in nibble j; the padding holds code 0."""
    q = torch.randint(0, 16, (5, k), dtype=torch.uint8)
    codes = T.kernel_codes(q, group).to(torch.int32) & 0xFFFF  # [N, Kp / 4]
    units, kp = T.plane_units(group, k), T.padded_k(k, group)
    assert codes.shape == (5, kp // 4) and kp % (4 * units) == 0 and units <= group
    b, j, u = torch.meshgrid(torch.arange(kp // (4 * units)), torch.arange(4), torch.arange(units), indexing="ij")
    kk = (b * 4 * units + j * units + u).reshape(-1)  # [Kp] in (block, plane, unit) order
    nib = (codes.view(5, -1, 1, units) >> (4 * torch.arange(4).view(1, 1, 4, 1))) & 0xF  # [N, B, plane, L]
    padded = torch.nn.functional.pad(q.to(torch.int32), (0, kp - k))
    assert torch.equal(nib.reshape(5, -1), padded[:, kk])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_meta_holds_the_fp16_scale_and_minus_magic_plus_zero(dtype):
    q, s, z = quantize_rtn(torch.randn(6, 300), 64, sym=False)
    meta = T.kernel_meta(s, z, 64, 300, dtype)  # [Gp, N]
    gp = -(-T.padded_k(300, 64) // 64)
    assert meta.shape == (gp, 6) and meta.dtype == torch.int32
    hi = (meta >> 16).to(torch.int16).view(torch.float16).float()
    lo = (meta & 0xFFFF).to(torch.int32)
    lo = (lo - ((lo >> 15) << 16)).to(torch.int16).view(dtype).float()
    g = s.shape[1]
    assert torch.equal(hi[:g].t(), s) and bool((hi[g:] == 0).all())  # exact: scales are fp16 values
    assert torch.equal(lo[:g].t(), -(T.MAGIC[dtype][1] + z.float()))


def test_plan_splits_only_short_layers_and_covers_every_block():
    for (n, k), rows in [(s, r) for s in LLAMA_7B for r in (1, 5, 16, 17, 64)] + [((24, 200), 3), ((576, 576), 9)]:
        p = T.plan(n, k, 128, rows, 132)
        blocks = T.padded_k(k, 128) // (4 * p.units)
        assert p.splits * p.blocks_per_split >= blocks > (p.splits - 1) * p.blocks_per_split  # no empty split
        tiles = -(-n // p.tile.block_n) * -(-rows // p.tile.block_m)
        want, most = -(-2 * 132 // tiles), max(1, blocks // 2)  # two programs per SM; two blocks per split
        assert p.splits <= min(2 * want, most) and (p.splits > 1 or want == 1 or most == 1)
        assert p.splits == 1 or p.blocks_per_split >= 2
    # Llama-2-7B at 16 rows, 132 SMs: (splits, programs)
    plans = [(n, T.plan(n, k, 128, 16, 132)) for n, k in LLAMA_7B]
    got = [(p.splits, p.splits * -(-n // p.tile.block_n)) for n, p in plans]
    assert got == [(4, 384), (8, 256), (2, 344), (9, 288)]  # 3 splits would do for q/k/v; 4 divide its 16 blocks


def test_every_table_row_count_has_a_tile():
    for units in (32, 64):
        for rows in range(1, T.MAX_ROWS + 1):
            tile = T.tile_for(units, rows)
            assert tile.block_m >= min(rows, 16) and (tile.block_m >= rows or rows > 16)


def test_cpu_activations_never_take_the_triton_path():
    x = torch.randn(3, 256)
    assert select_backend(x, 128) in ("cpu", "reference")


# ---------------------------------------------------------------------------------------------------------------
# Every path under the interpreter
# ---------------------------------------------------------------------------------------------------------------

_PARITY = r"""
import os, torch
from polyspec.decode import int4_triton as T
from polyspec.decode.int4 import dequantize, quantize_rtn
seed = int.from_bytes(os.urandom(4), "little")  # fresh inputs each run; the seed is in any failure message
torch.manual_seed(seed)
cases = [  # n, k, group, rows, splits (None: the plan's), sym, bias
    (24, 200, 64, 1, None, True, False), (40, 200, 64, 2, 2, False, True), (130, 256, 32, 3, None, True, True),
    (64, 257, 64, 4, None, False, False),  # the rows a GEMV would take: the 16-row MMA tile
    (192, 576, 128, 5, None, False, True), (128, 1280, 128, 16, 2, True, False),  # a split's tail: 5 blocks in 2
    (72, 384, 256, 9, 3, False, True), (256, 512, 32, 17, 2, True, True), (96, 768, 128, 32, None, False, False),
    (130, 384, 128, 33, 2, True, True), (8, 1024, 256, 64, 4, False, False), (200, 520, 32, 64, None, True, True)]
done = set()
for n, k, g, m, splits, sym, has_bias in cases:
    q, s, z = quantize_rtn(torch.randn(n, k), g, sym=sym)
    bias = torch.randn(n).half() if has_bias else None
    t = T.kernel_tensors(q, s, z, bias, g, torch.float16, torch.device("cpu"), sms=4)
    p = T.plan(n, k, g, m, 4)
    if splits:
        blocks = T.padded_k(k, g) // (4 * p.units)
        per = -(-blocks // splits)
        p = T.Plan(p.tile, p.units, -(-blocks // per), per)
    x = torch.randn(m, k).half()
    out = torch.full((m, n), float("nan"), dtype=torch.float16)  # poisoned: an unwritten element shows
    ws = torch.full((p.splits, m, n), float("nan"))
    y = T.launch(x, t, g, n, p, out=out, ws=ws)
    ref = x.double() @ dequantize(q, s, z, g).double().t() + (0 if bias is None else bias.double())
    err = ((y.double() - ref).abs() - 2 ** -10 * ref.abs()).max().item() / ref.abs().max().item()
    where = (seed, n, k, g, m, p)
    assert y is out and torch.isfinite(y).all() and err < 2 ** -12, (where, err)
    assert not t.locks.any(), where  # every counter back at zero
    done.add((p.units, p.tile, p.splits > 1, p.splits * p.blocks_per_split > blocks if splits else False))
assert {u for u, *_ in done} == {32, 64} and {sp for _, _, sp, _ in done} == {True, False}
assert len({(u, tile) for u, tile, _, _ in done}) == len(T.TILES) and any(tail for *_, tail in done)
print("parity ok")
"""


@needs_triton
def test_every_path_matches_the_reference_under_the_interpreter():
    """Rows 1-64 (every tile of the table), split and unsplit (and a split's tail), group sizes 32-256, both plane
    widths, ragged N and K, with and without bias, fp16; outputs and partials poisoned with NaN beforehand."""
    out = _interpreted(_PARITY)
    assert out.returncode == 0 and "parity ok" in out.stdout, out.stderr[-3000:]


_FUSED = r"""
import torch
from polyspec.decode import int4_triton as T
from polyspec.decode.int4 import Int4Linear, quantize_rtn
T.register()
torch.manual_seed(0)
layers = []
for n in (64, 16, 16):
    q, s, z = quantize_rtn(torch.randn(n, 320), 64, sym=n != 64)
    layers.append(Int4Linear(q, s, z, 64, torch.randn(n)))
x = torch.randn(5, 320).half()
sep = torch.cat([lin._triton_mm(x) for lin in layers], -1)
fused = Int4Linear.cat(layers)
assert {T.plan(lin.out_features, 320, 64, 5, 8).splits for lin in layers + [fused]} == {1}  # one summation order
assert torch.equal(fused._triton_mm(x), sep)  # the same maths, column for column
f = lambda x: fused._triton_mm(x).float().relu()
assert torch.equal(torch.compile(f, fullgraph=True, backend="aot_eager")(x), f(x))  # the op stays in one graph
print("fused ok")
"""


@needs_triton
def test_fused_int4_projection_equals_the_separate_ones_and_traces_in_one_graph():
    """Int4Linear.cat (model.fuse_projections' int4 q/k/v and gate/up) through the kernel; the compiled static step
    is compiled with fullgraph, so the op must not break the graph."""
    out = _interpreted(_FUSED)
    assert out.returncode == 0 and "fused ok" in out.stdout, out.stderr[-3000:]


# ---------------------------------------------------------------------------------------------------------------
# The sm_90 compile (Triton's ptxas; no GPU)
# ---------------------------------------------------------------------------------------------------------------


def _compiled_configs():
    """Every tile of the table at a Llama-2-7B shape (split and unsplit epilogues, M = 1 specialised), fp16 once."""
    yield from ((n, k, rows, torch.bfloat16) for (n, k) in LLAMA_7B[:2] for rows in (1, 16))
    yield from ((n, k, rows, torch.bfloat16) for (n, k) in LLAMA_7B[2:] for rows in (32, 64))
    yield 4096, 4096, 16, torch.float16


@needs_triton
@pytest.mark.parametrize("n,k,rows,dtype", list(_compiled_configs()))
def test_sm90_compile_has_no_spills_and_two_blocks_per_sm(n, k, rows, dtype):
    """ptxas -v on the sm_90 PTX. Occupancy asserted: at least 2 resident blocks per SM, i.e. registers rounded to
    8 x 32 threads x warps <= 65536 / 2 and Triton's shared memory + 1 KiB <= 228 KiB / 2 (4 warps: <= 255 registers,
    <= 113 KiB); and no spill stores or loads."""
    compiled, p = T.compile_sm90(n, k, 128, rows, dtype)
    r = T.ptxas_resources(compiled)
    assert r.spill_bytes == 0, (p, r)
    assert r.blocks_per_sm(p.tile.warps) >= 2, (p, r)
    ptx = compiled.asm["ptx"]
    assert not re.search(r"cvt\.rn\.(f32|f16|bf16)\.[su]\d", ptx)  # no int -> float conversion: the bit trick
    assert ptx.count("lop3.b32") == ptx.count("fma.rn.bf16x2" if dtype == torch.bfloat16 else "fma.rn.f16x2") > 0
    assert "wgmma.mma_async" in ptx


# ---------------------------------------------------------------------------------------------------------------
# CUDA
# ---------------------------------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@cuda
@needs_triton
@pytest.mark.parametrize("m", [1, 4, 5, 16, 17, 33, 64, 65])
@pytest.mark.parametrize("n,k,g", [(4096, 4096, 128), (12288, 4096, 128), (4096, 11008, 128), (192, 576, 128),
                                   (24, 200, 64), (130, 384, 32)])
def test_cuda_int4_layer_on_the_triton_kernel(n, k, g, m, monkeypatch):
    gen = torch.Generator().manual_seed(m)
    q, s, z = quantize_rtn(torch.randn(n, k, generator=gen), g, sym=m % 2 == 0)
    bias = torch.randn(n, generator=gen)
    layer = Int4Linear(q, s, z, g, bias).cuda()
    x = torch.randn(m, k, generator=gen).to("cuda", torch.bfloat16)
    assert select_backend(x, g) == ("triton" if m <= 64 else "cuda")
    ref = x.double() @ dequantize(q, s, z, g).cuda().double().t() + bias.cuda().double()
    y = layer(x)
    assert y.dtype == torch.bfloat16 and torch.isfinite(y).all()
    if m <= 64:
        assert ((y.double() - ref).abs() - 2 ** -7 * ref.abs()).max() < 2 ** -10 * ref.abs().max()  # bf16 output
    else:  # torch's kernel: bf16 scales and zero points, each weight dequantized in bf16 (~2e-3 relative here)
        assert (y.double() - ref).norm() < 1e-2 * ref.norm()
    assert torch.equal(layer(x), y)  # deterministic, split K included
    assert not any(t.locks.any() for t in layer._triton.values())
    monkeypatch.setenv("POLYSPEC_INT4_TRITON", "0")
    assert select_backend(x, g) == "cuda"


@pytest.mark.gpu
@cuda
@needs_triton
def test_cuda_rows_up_to_16_give_each_row_the_same_result():
    """Widths 1-16 share one plan (16-row tile, the same splits), so a row's output does not depend on the width."""
    q, s, z = quantize_rtn(torch.randn(4096, 4096), 128)
    layer = Int4Linear(q, s, z, 128).cuda()
    x = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
    full = layer(x)
    for m in (1, 4, 9):
        assert torch.equal(layer(x[:m]), full[:m]), m


@pytest.mark.gpu
@cuda
@needs_triton
def test_cuda_fused_int4_projection_equals_the_separate_ones():
    layers = [Int4Linear(*quantize_rtn(torch.randn(n, 4096), 128), 128).cuda() for n in (4096, 1024, 1024)]
    x = torch.randn(7, 4096, device="cuda", dtype=torch.bfloat16)
    sep = torch.cat([lin(x) for lin in layers], -1).double()
    fused = Int4Linear.cat(layers)(x).double()  # its own plan: K may split otherwise, so within bf16 rounding
    assert ((fused - sep).abs() <= 2 ** -7 * sep.abs() + 1e-6).all()
