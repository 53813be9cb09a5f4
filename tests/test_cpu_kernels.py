"""polyspec.decode.cpu_kernels: the CPU fast path (streaming linear kernel, whole decoder layers) against the
pure-torch path it sits beside: parity, batch invariance, fallbacks."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from conftest import make_tiny_llama

from polyspec.chain_spec import DraftSpec
from polyspec.decode import cpu_kernels as ck
from polyspec.decode.int4 import Int4Linear, dequantize, quantize_model_rtn, quantize_rtn
from polyspec.decode.model import Transformer
from polyspec.errors import PolyspecError

pytestmark = pytest.mark.skipif(not ck.available(), reason=f"no CPU kernel library: {ck.failure()}")


@pytest.fixture
def torch_path():
    """Run the body with the fast path off; restore afterwards."""
    old = ck.set_enabled(False)
    yield
    ck.set_enabled(old)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("k", [576, 100, 577, 48, 1536])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_matches_f_linear_and_is_batch_invariant(k, dtype):
    n = 301  # not a multiple of the 16-row thread slices
    g = _gen(k)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 16):  # every pass width, and passes after a full one
        x = torch.randn(m, k, generator=g).to(dtype)
        with torch.inference_mode():
            got = ck.kernel_linear(x, w, b)
            assert got.dtype == dtype and got.shape == (m, n)
            ref = F.linear(x.double(), w.double(), b.double())
            tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: one rounding of the fp32 result
            assert ((got.double() - ref).abs().max() / ref.abs().max()).item() < tol, (m, k)
            # a row's result does not depend on the rows computed with it (bitwise)
            for i in range(m):
                assert torch.equal(ck.kernel_linear(x[i:i + 1], w, b)[0], got[i]), (m, i)


def test_three_weights_in_one_call_equal_three_calls():
    g = _gen(3)
    ws = [torch.randn(n, 64, generator=g) for n in (96, 32, 32)]
    bs = [torch.randn(96, generator=g), None, torch.randn(32, generator=g)]
    x = torch.randn(1, 4, 64, generator=g)
    with torch.inference_mode():
        fused = ck.kernel_linear(x, ws[0], bs[0], (ws[1], bs[1]), (ws[2], bs[2]))
        apart = torch.cat([ck.kernel_linear(x, w, b) for w, b in zip(ws, bs, strict=True)], dim=-1)
    assert fused.shape == (1, 4, 160) and torch.equal(fused, apart)



def test_fp32_out_is_the_bf16_result_widened_ties_infinities_and_nans_included():
    g = _gen(5)
    w = torch.randn(200, 64, generator=g).bfloat16()
    b = torch.randn(200, generator=g).bfloat16()
    x = torch.randn(3, 64, generator=g).bfloat16()
    with torch.inference_mode():
        got = ck.kernel_linear(x, w, b, fp32_out=True)
        assert got.dtype == torch.float32 and torch.equal(got, ck.kernel_linear(x, w, b).float())
        big = torch.full((1, 64), 1e38).bfloat16()  # sums past fp32's range: +-inf
        assert torch.equal(ck.linear(big, w.abs(), None, fp32_out=True), ck.linear(big, w.abs(), None).float())
        assert ck.linear(big, w.abs(), None, fp32_out=True).isinf().all()
        nan = x.clone()
        nan[1, 3] = float("nan")
        y = ck.linear(nan, w, b, fp32_out=True)
        assert y[1].isnan().all() and torch.equal(y[0], got[0]) and torch.equal(y[2], got[2])
    # every rounding case of the kernel's pass, against torch's own: ties to even both ways, carries into the
    # exponent, subnormals, the largest finites, infinities and NaNs
    bits = torch.tensor([0x3F808000, 0x3F818000, 0x3F80FFFF, 0x3F7FFFFF, 0x00018000, 0x7F7FFFFF, 0xFF7F8000,
                         0x7F800000, 0xFF800000, 0x7FC00001, 0xFFFFFFFF, 0x00000000, 0x80000000], dtype=torch.int64)
    vals = bits.to(torch.int32).view(torch.float32).clone()
    want = vals.bfloat16().float()
    ck._lib.polyspec_round_bf16(vals.data_ptr(), vals.numel())
    assert torch.equal(vals.isnan(), want.isnan())
    keep = ~want.isnan()
    assert torch.equal(vals[keep].view(torch.int32), want[keep].view(torch.int32))

def test_fp32_out_on_the_torch_path(torch_path):
    g = _gen(6)
    w, x = torch.randn(40, 32, generator=g).bfloat16(), torch.randn(3, 32, generator=g).bfloat16()
    y = ck.linear(x, w, None, fp32_out=True)
    assert y.dtype == torch.float32 and torch.equal(y, F.linear(x, w).float())


def test_linear_falls_back_where_the_kernel_does_not_apply():
    g = _gen(4)
    w = torch.randn(40, 32, generator=g, requires_grad=True)
    x = torch.randn(3, 32, generator=g)
    # autograd: the kernel has no backward, so F.linear runs and gradients flow
    y = ck.linear(x, w)
    y.sum().backward()
    assert w.grad is not None and torch.allclose(w.grad, x.sum(0).expand(40, 32))
    with torch.inference_mode():
        wide = torch.randn(ck.MAX_ROWS + 1, 32, generator=g)  # prefill widths: torch's GEMM
        assert not ck.supports(wide, w.detach())
        assert torch.equal(ck.linear(wide, w.detach()), F.linear(wide, w.detach()))
        assert not ck.supports(x.double(), w.detach().double())  # other dtypes
        assert not ck.supports(x.bfloat16(), w.detach())  # mixed dtypes
        assert ck.supports(x, w.detach())
        old = ck.set_enabled(False)
        try:
            assert ck.fused_linears(x, [torch.nn.Linear(32, 8)]) is None
        finally:
            ck.set_enabled(old)


def test_a_failed_build_leaves_torch_in_charge(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(ck, "_lib", None)
    monkeypatch.setattr(ck, "_tried", False)
    monkeypatch.setattr(ck, "_failure", None)
    monkeypatch.setenv("POLYSPEC_KERNEL_CACHE", str(tmp_path / "fresh"))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    x, w = torch.randn(2, 16), torch.randn(8, 16)
    with torch.inference_mode():
        assert torch.equal(ck.linear(x, w), F.linear(x, w))
    assert not ck.available() and ck.failure()
    assert "using torch's F.linear" in capsys.readouterr().err
    assert not list((tmp_path / "fresh").glob("*.so"))  # nothing half-written


def test_build_is_cached_and_atomic(tmp_path, monkeypatch):
    monkeypatch.setenv("POLYSPEC_KERNEL_CACHE", str(tmp_path))
    path = ck.build()
    assert path.parent == tmp_path and path.exists()
    mtime = path.stat().st_mtime_ns
    assert ck.build() == path and path.stat().st_mtime_ns == mtime  # a second call reuses it
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary files left


@pytest.fixture(scope="module")
def other_builds(tmp_path_factory):
    """One kernel cache for this module's portable build: compiled once (~15 s), not once per test."""
    return tmp_path_factory.mktemp("other_builds")


_NATIVE_PATHS = ("fp32", "fp32/8-lane", "avx512-bf16", "avx512-bf16 (emulated)")  # what dot_path() may say


def _with_portable_build(cache, monkeypatch, fn, kind="1"):
    """fn() run against the portable build (POLYSPEC_PORTABLE_ROWS=kind: fp32 rows for int4 and bf16 weights; "avx2":
    and no AVX-512) kept in ``cache``, the loaded library restored afterwards; returns (fn's result, that build's
    dot_path())."""
    saved = ck._lib, ck._tried, ck._failure, ck._bf16_choice
    monkeypatch.setenv("POLYSPEC_PORTABLE_ROWS", kind)
    monkeypatch.setenv("POLYSPEC_KERNEL_CACHE", str(cache))
    ck._lib, ck._tried, ck._failure = None, False, None
    try:
        return fn(), ck.dot_path()
    finally:
        ck._lib, ck._tried, ck._failure, ck._bf16_choice = saved


@pytest.mark.parametrize("k", [576, 100, 1536])
def test_both_bf16_row_kernels_compute_the_bf16_matmul(k, other_builds, monkeypatch):
    """A bf16 input against bf16 weights: the vdpbf16ps rows (where AVX512-BF16 is built) and the portable widened
    rows both compute the exact bf16 products summed in fp32 (to fp32 rounding), so they agree with each other and
    with the fp64 matmul to the one bf16 rounding of the output."""
    g = _gen(40 + k)
    w = torch.randn(300, k, generator=g).bfloat16()
    b = torch.randn(300, generator=g).bfloat16()
    x = torch.randn(6, k, generator=g).bfloat16()
    with torch.inference_mode():
        native, native_path = ck.kernel_linear(x, w, b), ck.dot_path()
        portable, portable_path = _with_portable_build(other_builds, monkeypatch, lambda: ck.linear(x, w, b))
    assert portable_path.startswith("fp32") and native_path in _NATIVE_PATHS
    ref = F.linear(x.double(), w.double(), b.double())
    for y in (native, portable):
        assert y.dtype == torch.bfloat16 and ((y.double() - ref).abs().max() / ref.abs().max()).item() < 1e-2
    # both sum exact products in fp32: they differ by at most one bf16 rounding step of the output
    assert ((native.double() - portable.double()).abs() <= 2 ** -7 * portable.double().abs() + 1e-3).all()


def test_the_8_lane_builds_compute_what_the_16_lane_one_does(other_builds, monkeypatch):
    """The portable rows with 256-bit vectors: without AVX-512 (an AVX2 CPU's -march=native: 16 registers, single
    rows) and the half-width build (AVX-512's 32 registers, the 16-lane build's blocks). Every (row, input) pair runs
    the same 8-lane arithmetic in both, so they agree bitwise and stay batch-invariant; against the 16-lane build only
    the summation order differs (to fp32 rounding, then one bf16 rounding of the output). Weights in 16-row blocks
    give bitwise one result in all three builds."""
    if "avx512f" not in (ck._cpu_flags() or ""):
        pytest.skip("compares against this CPU's AVX-512 builds")
    monkeypatch.delenv("POLYSPEC_INT4_REFERENCE", raising=False)
    g = _gen(77)
    w = torch.randn(301, 577, generator=g).bfloat16()
    q, s, z = quantize_rtn(torch.randn(77, 640, generator=g), 128, sym=False)
    layer = Int4Linear(q, s, z, 128, torch.randn(77, generator=g))
    xs = [torch.randn(m, 577, generator=g).bfloat16() for m in (1, 3, 5, 6, 8, 9)]
    x4 = torch.randn(8, 640, generator=g)
    blocked = _blocked(w.clone())

    def run():
        assert ck._load() is not None, ck.failure()
        with torch.inference_mode():
            full = [ck.kernel_linear(x, w) for x in xs]
            alone = [ck.kernel_linear(x[-1:], w)[0] for x in xs]  # each width's last row on its own
            blocks = [ck.kernel_linear(x, blocked) for x in xs]
            return full, alone, ck.int4_linear(x4, layer), ck.int4_linear(x4[2:3], layer)[0], blocks

    (bf_a, _, i4_a, _, bl_a), path_a = _with_portable_build(other_builds, monkeypatch, run)
    (bf_h, alone_h, i4_h, one_h, bl_h), path_h = _with_portable_build(other_builds / "half", monkeypatch, run,
                                                                      kind="half")
    (bf_b, alone_b, i4_b, one_b, bl_b), path_b = _with_portable_build(other_builds / "avx2", monkeypatch, run,
                                                                      kind="avx2")
    assert (path_a, path_h, path_b) == ("fp32", "fp32/8-lane", "fp32/8-lane")
    # the 16-row blocks sum in input order in every build: bitwise one result
    assert all(torch.equal(a, h) and torch.equal(a, b) for a, h, b in zip(bl_a, bl_h, bl_b, strict=True))
    assert all(torch.equal(h, b) for h, b in zip(bf_h, bf_b, strict=True)) and torch.equal(i4_h, i4_b)
    for ys, alone, i4, one in ((bf_h, alone_h, i4_h, one_h), (bf_b, alone_b, i4_b, one_b)):
        assert all(torch.equal(y[-1], r) for y, r in zip(ys, alone, strict=True)) and torch.equal(one, i4[2])
    assert not all(torch.equal(a, h) for a, h in zip(bf_a, bf_h, strict=True))  # a different order of sums
    for a, h in zip(bf_a, bf_h, strict=True):
        assert ((a.double() - h.double()).abs() <= 2 ** -7 * a.double().abs() + 1e-3).all()
    assert torch.allclose(i4_a, i4_h, rtol=1e-5, atol=1e-5 * i4_a.abs().max().item())


@pytest.mark.parametrize("d", [32, 64, 128])
def test_every_build_attends_alike_over_a_bf16_cache(d, other_builds, monkeypatch):
    """Attention over a bf16 cache (its K/V rows widened by unpacks, the query's dims permuted to match, the output's
    put back: load_row): the AVX2 build (two 256-bit unpacks per 32 values) and the half-width build give bitwise the
    16-lane build's result, which is close to SDPA's."""
    if "avx512f" not in (ck._cpu_flags() or ""):
        pytest.skip("compares against this CPU's AVX-512 builds")
    from polyspec.decode.model import block_mask

    h, kv, start, t, cap = 4, 2, 23, 6, 64
    q = torch.randn(1, h, t, d, generator=_gen(90 + d)).bfloat16()
    kc, vc = (torch.randn(1, kv, cap, d, generator=_gen(91 + i + d)).bfloat16() for i in range(2))
    k, v = kc[:, :, :start + t], vc[:, :, :start + t]
    mask = block_mask(start, t, None, q.device)
    with torch.inference_mode():
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True)
        wide = ck.attention(q, k, v, mask)
        for kind in ("avx2", "half"):
            out = _with_portable_build(other_builds / kind, monkeypatch, lambda: ck.attention(q, k, v, mask), kind)[0]
            assert torch.equal(out, wide), kind
    torch.testing.assert_close(wide.float(), ref, atol=2e-2, rtol=1e-2)


def _blocked(w: torch.Tensor) -> torch.Tensor:
    """w with its 16-row blocks (as pack_weights gives a packed model's bf16 weights)."""
    assert ck.make_blocks([w], force=True) > 0 and ck.blocks_of(w) is not None
    return w


def _in_input_order(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """Each output as the 16-row blocks compute it: one fp32 multiply-add per input k = 0, 1, ... (the product of a
    bf16 weight and an fp32 input is exact in fp64, so fp64's sum rounded to fp32 is the fused step), bias last."""
    xd, wd = x.double(), w.double()
    acc = torch.zeros(x.shape[0], w.shape[0], dtype=torch.float32)
    for k in range(w.shape[1]):
        acc = (acc.double() + xd[:, k:k + 1] * wd[:, k]).float()
    return acc if b is None else acc + b


def test_16_row_blocks_sum_in_input_order_at_every_width_and_slice():
    """A bf16 weight's 16-row blocks: every output is its sum over k in input order (one fused multiply-add each),
    whatever the width (passes of 8 and the rest), the thread count (1-3: the threads' runs of rows), or where a run
    over three weights side by side starts (row counts that are not multiples of 16, an odd K); with fp32 inputs
    too."""
    g = _gen(81)
    ws = [_blocked(torch.randn(n, 37, generator=g).bfloat16()) for n in (100, 19, 50)]
    bs = [torch.randn(n, generator=g).bfloat16() for n in (100, 19, 50)]
    x = torch.randn(20, 37, generator=g).bfloat16()
    want = torch.cat([_in_input_order(x.float(), w, b.float()) for w, b in zip(ws, bs, strict=True)], -1)
    with torch.inference_mode():
        for threads in (1, 2, 3) if ck.bf16_rows() != "dot" else ():  # there bf16 inputs take vdpbf16ps rows
            torch.set_num_threads(threads)
            try:
                for m in (1, 3, 8, 9, 20):
                    got = ck.kernel_linear(x[:m], ws[0], bs[0], (ws[1], bs[1]), (ws[2], bs[2]))
                    assert torch.equal(got, want[:m].bfloat16()), (threads, m)
            finally:
                torch.set_num_threads(2)
        xf = torch.randn(5, 37, generator=g)  # fp32 inputs against bf16 weights (a 16-bit lm_head in an fp32 model)
        assert torch.equal(ck.kernel_linear(xf, ws[0]), _in_input_order(xf, ws[0], None))


def test_a_linear_over_16_row_blocks_takes_any_number_of_rows_on_the_kernel(monkeypatch):
    """linear() over bf16 weights in 16-row blocks takes inputs of more rows than a verification (an EAGLE head's fc
    over a prompt) on the kernel, VERIFY_ROWS at a time: each output is its sum in input order, as in one row's call;
    torch's F.linear is not reached. Without blocks the rows past max_rows stay on torch."""
    g = _gen(83)
    w, b = _blocked(torch.randn(40, 37, generator=g).bfloat16()), torch.randn(40, generator=g).bfloat16()
    x = torch.randn(2, 75, 37, generator=g).bfloat16()
    want = _in_input_order(x.reshape(150, 37).float(), w, b.float()).bfloat16().reshape(2, 75, 40)
    plain = w.clone()  # no blocks
    torch_calls = []
    real = F.linear
    monkeypatch.setattr(F, "linear", lambda *a, **k: torch_calls.append(1) or real(*a, **k))
    with torch.inference_mode():
        if ck.bf16_rows() != "dot":  # there bf16 inputs take vdpbf16ps rows
            assert torch.equal(ck.linear(x, w, b), want) and not torch_calls
        ck.linear(x, plain, b)
    assert torch_calls == [1]


def test_16_row_blocks_follow_in_place_changes_and_can_be_switched_off(tmp_path, monkeypatch):
    """pack_weights gives a bf16 model's Linear weights (the tied lm_head too) their blocks and its layer plans read
    them; a weight changed in place is repacked before its next use, so a packed model keeps computing what an
    unpacked copy of it does; POLYSPEC_ROW_BLOCKS=0 packs without blocks, and any other value is one clear error."""
    if ck.bf16_rows() == "dot":
        pytest.skip("a bf16 model's weights take the vdpbf16ps rows here: pack_weights makes no blocks")
    d = make_tiny_llama(tmp_path / "m", tokenizer=None, seed=6)
    model = Transformer.from_pretrained(d, dtype=torch.bfloat16).eval()
    model.lm_head.weight = model.embed_tokens.weight
    ck.pack_weights(model)
    lins = [m for m in model.modules() if type(m).__name__ == "Linear"]
    assert lins and all(ck.blocks_of(m.weight) is not None for m in lins)
    ids = torch.randint(0, 512, (6,), generator=_gen(11))
    with torch.inference_mode():
        model.setup_cache(16)
        model(ids[:3])
        plan = ck.layer_plan(model.layers[1])
        assert plan.ptrs[16] == ck.blocks_ptr(model.layers[1].self_attn.q_proj.weight)
    with torch.no_grad():
        model.layers[1].mlp.down_proj.weight.mul_(-2)
        model.lm_head.weight[:5].zero_()
    twin = Transformer.from_pretrained(d, dtype=torch.bfloat16).eval()
    twin.load_state_dict(model.state_dict())
    ck.pack_weights(twin)
    with torch.inference_mode():
        for m in (model, twin):
            m.setup_cache(16)
        assert torch.equal(model(ids)[0], twin(ids)[0])
    bare = Transformer.from_pretrained(d, dtype=torch.bfloat16).eval()
    monkeypatch.setenv("POLYSPEC_ROW_BLOCKS", "0")
    ck.pack_weights(bare)
    assert all(ck.blocks_of(m.weight) is None for m in bare.modules() if type(m).__name__ == "Linear")
    monkeypatch.setenv("POLYSPEC_ROW_BLOCKS", "yes")
    with pytest.raises(PolyspecError, match="POLYSPEC_ROW_BLOCKS must be 0 or 1"):
        ck.pack_weights(Transformer.from_pretrained(d, dtype=torch.bfloat16))


def test_the_portable_rows_setting_names_its_build_and_refuses_anything_else(monkeypatch):
    """POLYSPEC_PORTABLE_ROWS picks the build's flags (each its own cached library); a value it does not know is one
    clear error, not a silent native build."""
    flags = {}
    for kind in ("", "1", "avx2", "half", "bf16-emulated"):
        monkeypatch.setenv("POLYSPEC_PORTABLE_ROWS", kind)
        flags[kind] = ck._flags()
    assert "-DPOLYSPEC_PORTABLE_ROWS" not in flags[""] and "-DPOLYSPEC_PORTABLE_ROWS" in flags["1"]
    assert "-mno-avx512f" in flags["avx2"] and "-DPOLYSPEC_HALF_WIDTH" in flags["half"]
    assert "-DPOLYSPEC_HALF_WIDTH" not in flags["avx2"] and "-mno-avx512f" not in flags["half"]
    emulated = flags["bf16-emulated"]
    assert "-DPOLYSPEC_EMULATE_DPBF16" in emulated and "-DPOLYSPEC_PORTABLE_ROWS" not in emulated
    monkeypatch.setenv("POLYSPEC_PORTABLE_ROWS", "ymm")
    with pytest.raises(PolyspecError, match="POLYSPEC_PORTABLE_ROWS must be 1, avx2, half or bf16-emulated"):
        ck._flags()


def test_the_prefetch_hint_follows_the_cpu_vendor_and_the_environment(monkeypatch):
    """Non-temporal prefetches on AMD (measured best there), prefetcht2 elsewhere (prefetchnta made an Intel Xeon's
    layers 2.6x slower); POLYSPEC_PREFETCH_LOCALITY overrides, a bad value is one clear error; the hint is in the
    build's flags, so each hint is its own cached library."""
    from polyspec import device

    monkeypatch.delenv("POLYSPEC_PREFETCH_LOCALITY", raising=False)
    for vendor, hint in (("AuthenticAMD", 0), ("GenuineIntel", 1), ("", 1)):
        monkeypatch.setattr(device, "cpu_vendor", lambda v=vendor: v)
        assert ck.prefetch_locality() == hint
        assert f"-DPOLYSPEC_PREFETCH_LOCALITY={hint}" in ck._flags()
    paths = set()
    for env in ("0", "3"):
        monkeypatch.setenv("POLYSPEC_PREFETCH_LOCALITY", env)
        assert ck.prefetch_locality() == int(env)
        paths.add(ck.library_path())
    assert len(paths) == 2
    monkeypatch.setenv("POLYSPEC_PREFETCH_LOCALITY", "nta")
    with pytest.raises(PolyspecError, match="POLYSPEC_PREFETCH_LOCALITY must be 0, 1, 2 or 3"):
        ck.prefetch_locality()


def test_the_cpu_vendor_is_read_from_cpuinfo():
    from pathlib import Path

    from polyspec.device import cpu_vendor

    info = Path("/proc/cpuinfo")
    text = info.read_text() if info.exists() else ""
    if "vendor_id" in text:
        assert cpu_vendor() and cpu_vendor() in text
    else:
        assert cpu_vendor() == ""


def test_an_fp32_input_against_bf16_weights_is_not_rounded():
    """A 16-bit lm_head in an fp32 model: the fp32 activations reach the weights unrounded (fp32 result)."""
    g = _gen(41)
    w = torch.randn(200, 576, generator=g).bfloat16()
    x = torch.randn(3, 576, generator=g) * (1 + 2 ** -12)  # values bf16 cannot hold
    with torch.inference_mode():
        y = ck.kernel_linear(x, w)
    ref = x.double() @ w.double().t()
    assert y.dtype == torch.float32 and ((y.double() - ref).abs().max() / ref.abs().max()).item() < 1e-6


# -- int4 -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k,gs", [(576, 128), (256, 64), (96, 32), (640, 128)])
def test_int4_linear_matches_dequantised_matmul_and_is_batch_invariant(k, gs, monkeypatch):
    monkeypatch.delenv("POLYSPEC_INT4_REFERENCE", raising=False)
    n = 77
    g = _gen(k + gs)
    q, s, z = quantize_rtn(torch.randn(n, k, generator=g), gs, sym=False)  # asymmetric: zeros vary
    for bias in (None, torch.randn(n, generator=g)):
        layer = Int4Linear(q, s, z, gs, bias)
        w = dequantize(q, s, z, gs).double()
        for m in (1, 2, 5, 8, 11, 16):
            x = torch.randn(m, k, generator=g)
            with torch.inference_mode():
                y = ck.int4_linear(x, layer)
                assert y is not None and y.shape == (m, n) and y.dtype == torch.float32
                ref = _int4_input(x) @ w.t() + (0 if bias is None else bias.double())
                assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5, (m, bias is None)
                assert torch.equal(layer(x), y)  # Int4Linear.forward takes the kernel
                for i in range(m):
                    assert torch.equal(ck.int4_linear(x[i:i + 1], layer)[0], y[i])


def _int4_input(x: torch.Tensor) -> torch.Tensor:
    """x as the loaded library's int4 rows take it, in fp64: rounded to bf16 on the AVX512-BF16 path."""
    return (x.bfloat16() if (ck.dot_path() or "").startswith("avx512-bf16") else x).double()


def _int4_reference_mode() -> str:
    """The POLYSPEC_INT4_REFERENCE value whose dequantised matmul takes the activations as the kernel does."""
    return "bf16" if (ck.dot_path() or "").startswith("avx512-bf16") else "1"


def test_both_int4_row_kernels_compute_the_dequantised_matmul(other_builds, monkeypatch):
    """The portable build (fp32 activations) and this machine's build (bf16 activations where AVX512-BF16 is
    there): each equals the dequantised matmul on its own input, and the two agree to bf16 rounding of the input."""
    monkeypatch.delenv("POLYSPEC_INT4_REFERENCE", raising=False)
    k, gs, n = 576, 128, 300  # K not a multiple of 128: a 64-code last group (the masked load)
    g = _gen(31)
    q, s, z = quantize_rtn(torch.randn(n, k, generator=g), gs, sym=False)
    layer = Int4Linear(q, s, z, gs, torch.randn(n, generator=g))
    w = dequantize(q, s, z, gs).double()
    x = torch.randn(5, k, generator=g)
    with torch.inference_mode():
        native, native_path = ck.int4_linear(x, layer), ck.dot_path()
        portable, portable_path = _with_portable_build(other_builds, monkeypatch, lambda: ck.int4_linear(x, layer))
    assert portable_path.startswith("fp32") and native_path in _NATIVE_PATHS
    bias = layer.bias.double()
    for y, xin in ((portable, x.double()), (native, _int4_input(x))):
        ref = xin @ w.t() + bias
        assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5
    assert ((native - portable).abs().max() / portable.abs().max()).item() < (1e-2 if native_path != "fp32" else 1e-6)


def test_int4_linear_declines_what_it_cannot_do(monkeypatch):
    q, s, z = quantize_rtn(torch.randn(16, 100, generator=_gen(1)), 32)  # K % 32 != 0
    layer = Int4Linear(q, s, z, 32)
    x = torch.randn(2, 100)
    with torch.inference_mode():
        assert ck.int4_linear(x, layer) is None
        ref = x @ dequantize(q, s, z, 32).t()
        assert ((layer(x) - ref).abs().max() / ref.abs().max()).item() < 1e-2  # torch's path still answers
        q2, s2, z2 = quantize_rtn(torch.randn(16, 128, generator=_gen(2)), 64)
        ok = Int4Linear(q2, s2, z2, 64)
        x2 = torch.randn(2, 128)
        assert ck.int4_linear(x2, ok) is not None
        assert ck.int4_linear(x2.bfloat16(), ok) is None  # fp32 activations only
        assert ck.int4_linear(torch.randn(ck.MAX_ROWS + 1, 128), ok) is None  # prefill widths
        monkeypatch.setenv("POLYSPEC_INT4_REFERENCE", "1")  # the dequantised reference was asked for
        assert ck.int4_linear(x2, ok) is None


def _a8_reference(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, z: torch.Tensor, gs: int,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """The int8-input blocks' maths (cpu_kernels.cpp, rows_qv) in fp64 for codes q [N, K]: per input row and group a =
    max |x| / 127 and xq = x / a rounded half to even (both in fp32, as the kernel takes them), the group's exact sum
    of q xq scaled by a s, less z s a sum(xq); plus the bias."""
    k = q.shape[1]
    y = torch.zeros(x.shape[0], q.shape[0], dtype=torch.float64)
    for g in range((k + gs - 1) // gs):
        xg = x[:, g * gs:(g + 1) * gs]
        a = xg.abs().amax(1, keepdim=True) / 127.0
        xq = torch.where(a > 0, torch.round(xg / torch.where(a > 0, a, 1.0)), 0.0).clamp(-127, 127).double()
        sg, zs = s[:, g].double(), z[:, g].double() * s[:, g].double()
        dots = xq @ q[:, g * gs:(g + 1) * gs].double().t()
        y += dots * a.double() * sg - zs * (a.double() * xq.sum(1, keepdim=True))
    return y + (0 if bias is None else bias.double())


def _w4a8_reference(x: torch.Tensor, layer: Int4Linear) -> torch.Tensor:
    n, k = layer.out_features, layer.in_features
    q = torch.stack([layer.qdata & 15, layer.qdata >> 4], -1).reshape(n, -1)[:, :k]
    return _a8_reference(x, q, layer.scales, layer.zeros, layer.group_size, layer.bias)


def _i4_blocks_built() -> bool:
    return ck.available() and ck._lib.polyspec_i4_vnni() == 1


@pytest.mark.parametrize("n,k,gs", [(77, 576, 128), (40, 320, 128), (33, 96, 32), (16, 256, 64)])
def test_int4_blocks_compute_w4a8_bitwise_alike_at_every_width(n, k, gs, monkeypatch):
    """Int4 weights in 16-row blocks against int8 inputs (AVX512-VNNI): each output is the W4A8 reference's to fp32
    rounding (rows past N dropped, a short last group, passes of up to 8 rows), close to the W4A16 matmul, and bitwise
    the same whatever the width and thread count."""
    if not _i4_blocks_built():
        pytest.skip("this build has no AVX512-VNNI int4 blocks")
    monkeypatch.delenv("POLYSPEC_INT4_REFERENCE", raising=False)
    g = _gen(n + k + gs)
    q, s, z = quantize_rtn(torch.randn(n, k, generator=g), gs, sym=False)
    layer = Int4Linear(q, s, z, gs, torch.randn(n, generator=g))
    assert ck.make_i4_blocks([layer]) > 0 and ck.i4_blocks_of(layer) is not None
    w16 = dequantize(q, s, z, gs).double()
    for m in (1, 2, 5, 8, 11, 16):
        x = torch.randn(m, k, generator=g)
        x[0, :7] *= 40  # an outlier: its group's scale is coarse, the others' are not
        with torch.inference_mode():
            y = ck.int4_linear(x, layer)
            ref = _w4a8_reference(x, layer)
            assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 1e-6, m
            w4a16 = x.double() @ w16.t() + layer.bias.double()
            assert ((y.double() - w4a16).abs().max() / w4a16.abs().max()).item() < 3e-2, m
            assert torch.equal(layer(x), y)  # Int4Linear.forward takes the blocks
            for i in range(m):
                assert torch.equal(ck.int4_linear(x[i:i + 1], layer)[0], y[i])
            torch.set_num_threads(1)
            try:
                assert torch.equal(ck.int4_linear(x, layer), y)
            finally:
                torch.set_num_threads(2)


def test_int4_blocks_follow_in_place_changes_and_can_be_switched_off(monkeypatch):
    """Buffers changed in place are repacked before the next use; POLYSPEC_INT4_A8=0 makes no blocks (the W4A16
    rows), and any other value is one clear error."""
    if not _i4_blocks_built():
        pytest.skip("this build has no AVX512-VNNI int4 blocks")
    q, s, z = quantize_rtn(torch.randn(48, 256, generator=_gen(40)), 128, sym=False)
    layer = Int4Linear(q, s, z, 128)
    ck.make_i4_blocks([layer])
    x = torch.randn(3, 256, generator=_gen(41))
    with torch.inference_mode():
        before = ck.int4_linear(x, layer)
    with torch.no_grad():
        layer.scales.mul_(-2)
        layer.zeros[:5] = 3
    with torch.inference_mode():
        after = ck.int4_linear(x, layer)
    ref = _w4a8_reference(x, layer)
    assert not torch.equal(before, after) and ((after.double() - ref).abs().max() / ref.abs().max()).item() < 1e-6
    monkeypatch.setenv("POLYSPEC_INT4_A8", "0")
    bare = Int4Linear(q, s, z, 128)
    assert ck.make_i4_blocks([bare]) == 0 and ck.i4_blocks_of(bare) is None and "int4 x int8 blocks off" in ck.state()
    with torch.inference_mode():
        w16 = _int4_input(x) @ dequantize(q, s, z, 128).double().t()  # (bf16 activations on the vdpbf16ps rows)
        assert ((ck.int4_linear(x, bare).double() - w16).abs().max() / w16.abs().max()).item() < 1e-5
    monkeypatch.setenv("POLYSPEC_INT4_A8", "yes")
    with pytest.raises(PolyspecError, match="POLYSPEC_INT4_A8 must be 0 or 1"):
        ck.make_i4_blocks([Int4Linear(q, s, z, 128)])


def test_an_int4_levels_lm_head_takes_8_bit_codes_against_int8_inputs(monkeypatch):
    """make_q8_lm_head gives a 16-bit lm_head 8-bit codes (RTN, groups of 128, a short last one) in int8-input blocks:
    its logits are the W8A8 reference's to fp32 rounding, close to the bf16 product, bitwise alike at every width, and
    remade after an in-place change; POLYSPEC_INT4_A8=0 makes none."""
    if not _i4_blocks_built():
        pytest.skip("this build has no AVX512-VNNI blocks")
    from polyspec.decode.model import Linear

    class Level(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = Linear(576, 300, bias=False).to(torch.bfloat16)

    level = Level()
    assert ck.make_q8_lm_head(level) > 0
    w = level.lm_head.weight
    x = torch.randn(5, 576, generator=_gen(46))
    for change in (False, True):
        if change:
            with torch.no_grad():
                w[:7].mul_(-3)
        q, s, z = quantize_rtn(w, 128, sym=False, bits=8)
        with torch.inference_mode():
            y = ck.linear(x, w)
            ref = _a8_reference(x, q, s, z, 128)
            assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 1e-6
            w16 = x.double() @ w.double().t()
            assert ((y.double() - w16).abs().max() / w16.abs().max()).item() < 2e-2
            assert all(torch.equal(ck.linear(x[i:i + 1], w)[0], y[i]) for i in range(5))
    monkeypatch.setenv("POLYSPEC_INT4_A8", "0")
    assert ck.make_q8_lm_head(Level()) == 0


def test_the_half_width_build_computes_the_int4_blocks_bitwise(other_builds, monkeypatch):
    """The int4 blocks on 8-lane vectors (the half-width build): exact integer sums and the same float sequence per
    lane, so bitwise the 16-lane build's outputs."""
    if not _i4_blocks_built() or ck._lib.polyspec_row_lanes() != 16:
        pytest.skip("needs the 16-lane build with AVX512-VNNI to compare against")
    q, s, z = quantize_rtn(torch.randn(70, 576, generator=_gen(42)), 128, sym=False)
    layer = Int4Linear(q, s, z, 128, torch.randn(70, generator=_gen(43)))
    x = torch.randn(7, 576, generator=_gen(44))

    def run():
        layer.__dict__.pop(ck._I4_BLOCKS, None)
        assert ck.make_i4_blocks([layer]) > 0
        with torch.inference_mode():
            return ck.int4_linear(x, layer)

    full = run()
    half, path = _with_portable_build(other_builds / "half", monkeypatch, run, kind="half")
    assert path == "fp32/8-lane" and torch.equal(full, half)


# -- whole decoder layers --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny Llama (GQA, untied) and a tiny Qwen2-style model with q/k/v biases, loaded twice: one copy for each
    path (the copies share nothing)."""
    out = {}
    d = make_tiny_llama(tmp_path_factory.mktemp("kl"), tokenizer=None, seed=3)
    out["llama"] = d
    dq = make_tiny_llama(tmp_path_factory.mktemp("kq"), tokenizer=None, seed=4, attention_bias=True)
    out["bias"] = dq
    return out


def _run(model: Transformer, ids: torch.Tensor, blocks: list[int], tree: bool = False):
    """Prefill ids[:blocks[0]], then blocks of the given sizes through the cache; logits of every block."""
    model.setup_cache(128)
    rows = []
    pos = 0
    with torch.inference_mode():
        for t in blocks:
            mask = None
            if tree and t > 1:  # a branching block: token j sees itself and the even tokens before it
                mask = torch.eye(t, dtype=torch.bool)
                mask[:, 0] = True
                for j in range(t):
                    mask[j, :j:2] = True
            rows.append(model(ids[pos:pos + t], tree_mask=mask)[0])
            if tree and t > 1:
                model.truncate(pos)
                model(ids[pos:pos + t])
            pos += t
    return torch.cat(rows), [k.clone() for k in model._cache.k], [v.clone() for v in model._cache.v]


@pytest.mark.parametrize("kind", ["llama", "bias", "int4"])
@pytest.mark.parametrize("tree", [False, True], ids=["causal", "tree"])
def test_decoder_layer_kernel_matches_torch_path(models, kind, tree, monkeypatch):
    """fp32 layers against the torch layer; int4 layers against the torch layer on dequantised weights (the
    reference matmul that POLYSPEC_INT4_REFERENCE selects, with the activations rounded as the kernel rounds them:
    exact up to fp32 rounding)."""
    fast = Transformer.from_pretrained(models["bias" if kind == "bias" else "llama"]).eval()
    if kind == "int4":
        quantize_model_rtn(fast, group_size=64, sym=False)
    if kind == "bias":  # random init leaves biases at zero: make them matter
        with torch.no_grad():
            for layer in fast.layers:
                att = layer.self_attn
                for proj in (att.q_proj, att.k_proj, att.v_proj, att.o_proj):
                    assert proj.bias is not None
                    proj.bias.copy_(torch.randn(proj.bias.shape, generator=_gen(9)) * 0.5)
    ref_model = copy.deepcopy(fast)
    ids = torch.randint(0, 512, (60,), generator=_gen(7))
    # fp32: a prefill on the torch path, then decode/verify widths on the kernel; int4: kernel widths only (a wider
    # prefill would take torch's int4pack kernel, which rounds activations to bf16)
    blocks = [16 if kind == "int4" else 20, 1, 1, 5, 1, 4, 16, 1, 3]
    got, gk, gv = _run(fast, ids, blocks, tree)
    assert all(ck.layer_plan(layer) is not None for layer in fast.layers)
    if kind == "int4":
        assert {(ck.layer_plan(layer).kind, ck.layer_plan(layer).group_size) for layer in fast.layers} == {("i4", 64)}
    old = ck.set_enabled(False)
    try:
        monkeypatch.setenv("POLYSPEC_INT4_REFERENCE", _int4_reference_mode())
        ref, rk, rv = _run(ref_model, ids, blocks, tree)
    finally:
        ck.set_enabled(old)
        monkeypatch.delenv("POLYSPEC_INT4_REFERENCE")
    # bf16 activations (the AVX512-BF16 int4 rows): a last-bit fp32 difference upstream can move an activation's
    # bf16 rounding by one step (2^-8 relative) in a later layer, so the models agree to ~1e-3, not ~1e-6; a wrong
    # code layout, scale or zero point is off by O(1). Each linear is held to 1e-5 on its own input above.
    tol = 1e-2 if kind == "int4" and _int4_reference_mode() == "bf16" else 1e-4
    assert (got - ref).abs().max().item() < tol
    for a, b in zip(gk + gv, rk + rv, strict=True):
        assert (a - b).abs().max().item() < tol


def test_int4_layers_take_their_blocks_bitwise_alike_at_every_width(models, monkeypatch):
    """An int4 model packed as a level below the target reads the int4 blocks (W4A8) and its lm_head 8-bit codes (one
    packed as a target does not): each layer computes what the torch layer does with the same blocked projections,
    and a verification's logits are bitwise the decode steps'."""
    if not _i4_blocks_built():
        pytest.skip("this build has no AVX512-VNNI int4 blocks")
    monkeypatch.delenv("POLYSPEC_INT4_REFERENCE", raising=False)
    fast = quantize_model_rtn(Transformer.from_pretrained(models["llama"]).eval(), group_size=64, sym=False)
    as_target = copy.deepcopy(fast)
    ck.pack_weights(as_target)  # a target keeps its W4A16 rows: its distribution is the one a chain reproduces
    assert ck.i4_blocks_of(as_target.layers[0].mlp.up_proj) is None
    assert ck.q8_lm_head_of(as_target.lm_head.weight) is None
    ck.pack_weights(fast, int8_inputs=True)  # a level below the target
    ref_model = copy.deepcopy(fast)
    for lin in (m for m in ref_model.modules() if isinstance(m, Int4Linear)):  # the same blocks, packed again
        ck.make_i4_blocks([lin])
    assert ck.q8_lm_head_of(fast.lm_head.weight) is not None and ck.make_q8_lm_head(ref_model) > 0
    ids = torch.randint(0, 512, (40,), generator=_gen(45))
    blocks = [16, 1, 1, 5, 1, 8, 3]
    got, gk, gv = _run(fast, ids, blocks)
    plan = ck.layer_plan(fast.layers[0])
    assert plan.kind == "i4" and plan.ptrs[30] == ck.i4_blocks_of(fast.layers[0].self_attn.q_proj).data_ptr()
    monkeypatch.setattr(ck, "_plan_kind", lambda layer: None)  # the torch layer; its linears still take the blocks
    ck.drop_plans(ref_model)
    ref, rk, rv = _run(ref_model, ids, blocks)
    # a last-bit fp32 difference upstream (the layer kernel's attention against torch's) can move an input's int8
    # rounding by one step (1/127 of its group's largest), so ~1e-3, not ~1e-6; a wrong layout or scale is O(1)
    for a, b in zip([got, *gk, *gv], [ref, *rk, *rv], strict=True):
        assert (a - b).abs().max().item() < 1e-2
    monkeypatch.undo()
    with torch.inference_mode():
        fast.truncate(20)
        wide = fast(ids[20:28])[0]
        fast.truncate(20)
        steps = torch.cat([fast(ids[i:i + 1])[0] for i in range(20, 28)])
    assert torch.equal(wide, steps)


def test_decoder_layer_kernel_is_width_invariant(models):
    """A token's logits are bitwise the same from a one-token decode step and from inside a wider verification."""
    model = Transformer.from_pretrained(models["llama"]).eval()
    ids = torch.randint(0, 512, (40,), generator=_gen(8))
    model.setup_cache(64)
    with torch.inference_mode():
        model(ids[:30])
        wide = model(ids[30:38])[0]  # [8, V]
        model.truncate(30)
        steps = torch.cat([model(ids[i:i + 1])[0] for i in range(30, 38)])
    assert torch.equal(wide, steps)


def test_plan_follows_the_module(models):
    model = Transformer.from_pretrained(models["llama"]).eval()
    layer = model.layers[0]
    plan = ck.layer_plan(layer)
    assert plan is not None and ck.layer_plan(layer) is plan  # cached
    model.to(torch.float32)  # _apply: the plan is dropped and rebuilt on use
    assert "_cpu_plan" not in layer.__dict__
    assert copy.deepcopy(model).layers[0].__dict__.get("_cpu_plan") is None
    model.to(torch.bfloat16)
    assert ck.layer_plan(model.layers[0]).kind == "bf16"
    model.to(torch.float16)
    assert ck.layer_plan(model.layers[0]) is None  # other dtypes: the torch layer
    ck.drop_plans(model)
    assert "_cpu_plan" not in model.layers[0].__dict__


def test_pack_weights_keeps_values_sharing_and_outputs(tmp_path):
    from polyspec.decode.head import EagleHead

    d = make_tiny_llama(tmp_path / "m", tokenizer=None, seed=5)
    model = Transformer.from_pretrained(d).eval()
    model.lm_head.weight = model.embed_tokens.weight  # tied, as SmolLM2's are
    head = EagleHead(model.args, model.embed_tokens, model.lm_head)
    ids = torch.randint(0, 512, (12,), generator=_gen(10))
    with torch.inference_mode():
        model.setup_cache(32)
        before = model(ids)[0]
        ck.layer_plan(model.layers[0])  # a cached plan must not survive the move
    state = {k: v.clone() for k, v in model.state_dict().items()}
    moved = ck.pack_weights(model)
    assert moved >= sum(t.numel() * t.element_size() for t in state.values()) - model.embed_tokens.weight.numel() * 4
    assert "_cpu_plan" not in model.layers[0].__dict__
    assert model.lm_head.weight is model.embed_tokens.weight  # tying survives
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k
    # one block, layers first, in module order
    ptrs = [p.data_ptr() for layer in model.layers for p in layer.parameters()]
    assert ptrs == sorted(ptrs) and model.embed_tokens.weight.data_ptr() > ptrs[-1]
    with torch.inference_mode():
        model.setup_cache(32)
        assert torch.equal(model(ids)[0], before)
    # the head's own weights get their own block; the shared lm_head stays in the target's
    lm = model.lm_head.weight.data_ptr()
    assert ck.pack_weights(head) > 0 and model.lm_head.weight.data_ptr() == lm
    assert ck.pack_weights(model) == 0  # already packed
    old = ck.set_enabled(False)
    try:
        assert ck.pack_weights(Transformer.from_pretrained(d)) == 0
    finally:
        ck.set_enabled(old)


def test_layers_without_a_plan_take_the_torch_layer_in_the_same_forward(models, monkeypatch):
    """A layer the kernel cannot run (here: one int4 projection among fp32 ones) falls back alone; its neighbours
    keep the kernel, and the forward still matches the torch path."""
    model = Transformer.from_pretrained(models["llama"]).eval()
    att = model.layers[1].self_attn
    att.q_proj = Int4Linear.from_linear(att.q_proj, group_size=64)
    ref_model = copy.deepcopy(model)
    assert ck.layer_plan(model.layers[0]) is not None and ck.layer_plan(model.layers[1]) is None
    ids = torch.randint(0, 512, (30,), generator=_gen(11))
    blocks = [16, 1, 5, 1]  # kernel widths only: the int4 projection takes the int4 kernel (reference: dequantised)
    got = _run(model, ids, blocks)[0]
    old = ck.set_enabled(False)
    try:
        monkeypatch.setenv("POLYSPEC_INT4_REFERENCE", _int4_reference_mode())
        ref = _run(ref_model, ids, blocks)[0]
    finally:
        ck.set_enabled(old)
    assert (got - ref).abs().max().item() < 1e-4


def test_results_do_not_depend_on_the_thread_count(models):
    """Threads split the weight rows, never a dot product: 1, 2 and 3 threads give bitwise the same outputs."""
    model = Transformer.from_pretrained(models["llama"]).eval()
    ids = torch.randint(0, 512, (24,), generator=_gen(12))
    w = torch.randn(1000, 192, generator=_gen(13))
    x = torch.randn(5, 192, generator=_gen(14))
    old = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            with torch.inference_mode():
                outs.append((_run(model, ids, [8, 1, 5, 1, 9])[0], ck.kernel_linear(x, w)))
    finally:
        torch.set_num_threads(old)
    for logits, y in outs[1:]:
        assert torch.equal(logits, outs[0][0]) and torch.equal(y, outs[0][1])


def test_bf16_layers_match_the_fp32_maths_and_are_width_invariant(models):
    """A bf16 model's layers run with bf16 weights and K/V cache and an fp32 residual stream inside the block:
    close to the fp32 torch path on the same (bf16-rounded) weights, and bitwise width-invariant, so greedy
    speculative decoding equals ar in bf16 too."""
    fp32 = Transformer.from_pretrained(models["llama"]).eval()
    with torch.no_grad():
        for p in fp32.parameters():
            p.copy_(p.bfloat16().float())  # the same values in both models
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    assert all(ck.layer_plan(layer).kind == "bf16" for layer in bf16.layers)
    ids = torch.randint(0, 512, (40,), generator=_gen(15))
    blocks = [16, 1, 1, 5, 1, 4, 3]
    got = _run(bf16, ids, blocks)[0]
    old = ck.set_enabled(False)
    try:
        ref = _run(fp32, ids, blocks)[0]
    finally:
        ck.set_enabled(old)
    assert got.dtype == torch.float32 and (got - ref).abs().max().item() < 0.03 * ref.abs().max().item()
    bf16.setup_cache(64)
    with torch.inference_mode():
        bf16(ids[:16])
        wide = bf16(ids[16:24])[0]
        bf16.truncate(16)
        steps = torch.cat([bf16(ids[i:i + 1])[0] for i in range(16, 24)])
    assert torch.equal(wide, steps)


def test_bf16_greedy_speculation_equals_ar(models):
    from polyspec.decode.chain import ChainDecoder
    from polyspec.decode.levels import ModelLevel

    t = Transformer.from_pretrained(models["llama"]).eval().to(torch.bfloat16)
    twin = copy.deepcopy(t)  # a perfect draft: whole blocks accepted, so every verification is wide
    other = Transformer.from_pretrained(models["bias"]).eval().to(torch.bfloat16)
    prompt = [5, 17, 230, 9, 77]
    ar = ChainDecoder([ModelLevel(t, "t")], max_seq_len=64).generate(prompt, 24).token_ids
    for draft in (twin, other):
        r = ChainDecoder([ModelLevel(t, "t"), ModelLevel(draft, "d")], draft=DraftSpec(k=4),
                         max_seq_len=64).generate(prompt, 24)
        assert r.token_ids == ar
    r = ChainDecoder([ModelLevel(t, "t"), ModelLevel(twin, "d")], draft=DraftSpec(k=4),
                     max_seq_len=64).generate(prompt, 24)
    assert max(r.level_stats[0].accept_lengths) == 5


def _packed_bf16_run(model_dir, ids):
    """A fresh bf16 model packed as load_chain packs a target: its logits over ids as a prefill, a 7-row
    verification and 7 decode steps of the same positions; ar's greedy tokens and a perfect draft's under k = 4; and
    a blocked bf16 weight's outputs against a bf16 input of 11 rows with their sums in input order."""
    from polyspec.decode.chain import ChainDecoder
    from polyspec.decode.levels import ModelLevel

    t = Transformer.from_pretrained(model_dir).eval().to(torch.bfloat16)
    ck.pack_weights(t)
    wide = _run(t, ids, [8, 7])[0][-7:]
    steps = _run(t, ids, [8] + [1] * 7)[0][-7:]
    prompt = ids[:5].tolist()
    ar = ChainDecoder([ModelLevel(t, "t")], max_seq_len=64).generate(prompt, 16).token_ids
    twin = Transformer.from_pretrained(model_dir).eval().to(torch.bfloat16)
    spec = ChainDecoder([ModelLevel(t, "t"), ModelLevel(twin, "d")], draft=DraftSpec(k=4),
                        max_seq_len=64).generate(prompt, 16).token_ids
    g = _gen(62)
    w = _blocked(torch.randn(50, 37, generator=g).bfloat16())
    x = torch.randn(11, 37, generator=g).bfloat16()
    with torch.inference_mode():
        rows = [ck.kernel_linear(x[:m], w) for m in (1, 8, 11)]
    return wide, steps, ar, spec, rows, _in_input_order(x.float(), w, None).bfloat16()


@pytest.mark.parametrize("choice", ["dot", "blocks"])
def test_a_vdpbf16ps_build_keeps_one_bf16_kernel_at_every_width(choice, other_builds, models, monkeypatch):
    """On a build with the vdpbf16ps rows (emulated here, POLYSPEC_PORTABLE_ROWS=bf16-emulated, where the CPU lacks
    the instruction) bf16 inputs take the kernel POLYSPEC_BF16_ROWS names at every width: a verification is bitwise
    its decode steps and greedy speculation equals ar; the logits agree with the widened build's to rounding. On the
    blocks (vdpbf16ps over pack_nk16's pairs) each output is its sum over k in input order, as the widened blocks'."""
    monkeypatch.setenv("POLYSPEC_BF16_ROWS", choice)
    ids = torch.randint(0, 512, (15,), generator=_gen(61))
    got, path = _with_portable_build(other_builds, monkeypatch, lambda: _packed_bf16_run(models["llama"], ids),
                                     kind="bf16-emulated")
    if not path.startswith("avx512-bf16"):
        pytest.skip(f"this CPU builds no vdpbf16ps rows, emulated or not (no AVX512-BW): {path}")
    wide, steps, ar, spec, rows, ordered = got
    assert torch.equal(wide, steps) and spec == ar
    widened = _with_portable_build(other_builds, monkeypatch, lambda: _packed_bf16_run(models["llama"], ids))[0]
    assert (wide - widened[0]).abs().max().item() < 0.02 * widened[0].abs().max().item()
    assert all(torch.equal(r, ordered[:len(r)]) for r in widened[4])  # the widened blocks, on a bf16 input
    if choice == "blocks":
        assert all(torch.equal(r, ordered[:len(r)]) for r in rows)


def test_the_bf16_rows_are_measured_once_per_library(other_builds, monkeypatch):
    """POLYSPEC_BF16_ROWS=auto on a vdpbf16ps build: the first load times both kinds and keeps the choice beside the
    library (with the times), a later load reads it; the choice is the smaller sum over the timed widths; a bad
    setting is one clear error."""
    assert ck.pick_bf16_rows({"dot": [1.0, 1.2, 1.6, 2.4], "blocks": [1.1, 1.2, 1.4, 1.8]}) == "blocks"
    assert ck.pick_bf16_rows({"dot": [1.0, 1.0, 1.0, 1.0], "blocks": [1.0, 1.0, 1.0, 1.0]}) == "dot"
    monkeypatch.setenv("POLYSPEC_BF16_ROWS", "auto")
    timed = []
    real = ck._time_bf16_rows
    monkeypatch.setattr(ck, "_time_bf16_rows", lambda lib: timed.append(1) or real(lib, repeats=1))
    state, path = _with_portable_build(other_builds, monkeypatch, ck.state, kind="bf16-emulated")
    if not path.startswith("avx512-bf16"):
        pytest.skip(f"this CPU builds no vdpbf16ps rows, emulated or not (no AVX512-BW): {path}")
    record = json.loads(next(other_builds.glob("*.bf16-rows.json")).read_text())
    assert timed == [1] and record["choice"] in ("dot", "blocks") and f"bf16 inputs on the {record['choice']} rows " \
        "(measured)" in state
    assert sorted(record["seconds"]) == ["blocks", "dot"] and all(len(v) == 4 for v in record["seconds"].values())
    again = _with_portable_build(other_builds, monkeypatch, ck.state, kind="bf16-emulated")[0]
    assert again == state and timed == [1]
    kept = next(other_builds.glob("*.bf16-rows.json"))
    kept.write_text('{"choice": "fastest"}')  # not a choice: measured again
    _with_portable_build(other_builds, monkeypatch, ck.state, kind="bf16-emulated")
    assert timed == [1, 1] and json.loads(kept.read_text())["choice"] in ("dot", "blocks")
    monkeypatch.setenv("POLYSPEC_BF16_ROWS", "fastest")
    with pytest.raises(PolyspecError, match="POLYSPEC_BF16_ROWS must be auto, dot or blocks"):
        _with_portable_build(other_builds, monkeypatch, ck.state, kind="bf16-emulated")


def test_the_final_norm_is_the_modules_up_to_one_rounding():
    """cpu_kernels.final_norm (a bf16 model's final RMSNorm whenever the kernels are on) rounds like the module (to
    bf16 after normalising, again after the weight) and differs from it only where its 1 / sqrt in fp32 from a
    double sum of squares lands the rounding on the other side: at most one bf16 step, on few values."""
    from polyspec.decode.model import RMSNorm

    norm = RMSNorm(576, 1e-5).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(576, generator=_gen(50)))
    x = (3 * torch.randn(2, 7, 576, generator=_gen(51))).to(torch.bfloat16)
    with torch.inference_mode():
        got, ref = ck.final_norm(x, norm), norm(x)
        assert ck.final_norm(x.float(), norm) is None  # fp32 activations: the module
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    step = ref.float().abs() * 2 ** -7
    assert bool(((got.float() - ref.float()).abs() <= step * 1.01).all())
    assert (got != ref).float().mean().item() < 0.02


def test_a_token_id_outside_the_embedding_is_one_clear_error(tmp_path):
    """The one-call forward and head step read embedding rows by token id in C: an id past the vocabulary is refused
    there (no read outside the table) with one clear error, not an IndexError from deep inside."""
    fast, _, target = _twin_bf16_heads(tmp_path, 52, 0)
    target.setup_cache(32)
    vocab = target.args.vocab_size
    with torch.inference_mode():
        with pytest.raises(PolyspecError, match=f"0..{vocab - 1}"):
            target(torch.tensor([3, vocab]))
        with pytest.raises(PolyspecError, match=f"0..{vocab - 1}"):
            fast.decode_step([vocab + 5], torch.zeros(1, target.args.hidden_size, dtype=torch.bfloat16), True)
        assert target._cache.length == 0 and fast._cache.length == 0


def _spy_layer_kernel(monkeypatch, widths: list[int]) -> None:
    """Record the width of every block the layer kernel runs (a bf16 model's whole forward in one call, run_forward;
    a causal block's layers in one call, run_block; or layer by layer, run_layers)."""
    run, block, forward = ck.run_layers, ck.run_block, ck.run_forward
    monkeypatch.setattr(ck, "run_layers", lambda plans, x, *a, **k: widths.append(x.shape[1]) or run(plans, x, *a, **k))
    monkeypatch.setattr(ck, "run_block", lambda b, x, *a, **k: widths.append(x.shape[1]) or block(b, x, *a, **k))
    monkeypatch.setattr(ck, "run_forward", lambda b, ids, *a, **k: widths.append(len(ids)) or forward(b, ids, *a, **k))


def test_which_forwards_take_the_kernels_by_width(models, monkeypatch):
    """cpu_kernels.rows_limit: a prompt at an empty cache takes the kernels up to MAX_ROWS rows, a verification (a
    block at a non-empty cache) up to VERIFY_ROWS; a batched forward's rows are sequences and keep MAX_ROWS."""
    t = Transformer.from_pretrained(models["llama"]).eval().to(torch.bfloat16)
    widths: list[int] = []
    _spy_layer_kernel(monkeypatch, widths)
    ids = torch.randint(0, 512, (60,), generator=_gen(40))
    with torch.inference_mode():
        t.setup_cache(128)
        t(ids[:20])  # a prompt of 20 rows: torch
        t(ids[20:40])  # a verification of 20 rows: the kernels
        t(ids[40:41])
        assert widths == [20, 1]
        t.setup_cache(16, batch_size=4)
        t(ids[:20].view(4, 5))
        lm = []
        linear = ck.kernel_linear
        monkeypatch.setattr(ck, "kernel_linear", lambda x, *a, **k: lm.append(x.shape) or linear(x, *a, **k))
        t(ids[20:40].view(4, 5))  # 20 rows of 4 sequences at a non-empty cache: the lm_head stays on torch
        assert lm == []
    assert ck.rows_limit(0, False) == ck.MAX_ROWS and ck.rows_limit(0, True) == ck.rows_limit(5, False) == \
        ck.VERIFY_ROWS


def test_a_prompt_over_blocked_weights_takes_the_kernels_in_verification_blocks(tmp_path, monkeypatch):
    """Over bf16 weights in 16-row blocks a prompt wider than MAX_ROWS runs on the kernels too, in forwards of
    VERIFY_ROWS (cpu_kernels.blocked_layers): its hidden states and cache are bitwise those of the prompt fed in such
    blocks by hand and close to torch's whole-block forward (the same model without blocks); the decode step after it
    takes the kernels as before. A wide block under a tree mask, and a prompt over weights without blocks, do not
    split."""
    d = make_tiny_llama(tmp_path / "m", tokenizer=None, seed=8)
    model = Transformer.from_pretrained(d, dtype=torch.bfloat16).eval()
    bare = copy.deepcopy(model)
    assert ck.make_blocks([m.weight for m in model.modules() if type(m).__name__ == "Linear"], force=True) > 0
    if (ck.dot_path() or "").startswith("avx512-bf16"):  # torch's bf16 GEMM has the instruction: prompts stay on it
        assert not ck.blocked_layers(list(model.layers))
        return
    assert ck.blocked_layers(list(model.layers)) and not ck.blocked_layers(list(bare.layers))
    widths: list[int] = []
    _spy_layer_kernel(monkeypatch, widths)
    ids = torch.randint(0, 512, (2 * ck.VERIFY_ROWS + 23,), generator=_gen(12))
    with torch.inference_mode():
        model.setup_cache(192)
        whole = model(ids)[1]  # the final-norm'd hidden states: the layers' work (an lm_head's rows may go either way)
        cache = torch.stack(model._cache.k + model._cache.v).clone()
        step = model(ids[:1])[1]
        assert widths == [ck.VERIFY_ROWS, ck.VERIFY_ROWS, 23, 1]
        model.setup_cache(192)
        by_hand = torch.cat([model(ids[s:s + ck.VERIFY_ROWS])[1] for s in range(0, len(ids), ck.VERIFY_ROWS)])
        assert torch.equal(whole, by_hand) and torch.equal(cache, torch.stack(model._cache.k + model._cache.v))
        assert torch.equal(step, model(ids[:1])[1])
        widths.clear()
        bare.setup_cache(192)
        torch.testing.assert_close(whole, bare(ids)[1], atol=0.1, rtol=0.05)
        assert widths == []  # no blocks: torch's GEMM takes the prompt whole
        model.setup_cache(192)
        tree = torch.ones(40, 40, dtype=torch.bool).tril()
        model(ids[:40], tree_mask=tree)
        assert widths == [40]  # under a mask it is a verification: one call of the kernels, never split
        widths.clear()
        for m in (model, bare):  # an EAGLE-3 head's features: each segment of layers splits the same way
            m.setup_cache(192)
        aux = [0, len(model.layers) - 1]
        torch.testing.assert_close(model(ids, aux_layers=aux)[1], bare(ids, aux_layers=aux)[1], atol=0.1, rtol=0.05)
        assert widths.count(ck.VERIFY_ROWS) == 4  # two segments (layer 0, then the rest), each 64 + 64 + 23 rows
    assert ck.rows_limit(0, False, blocked=True) == ck.VERIFY_ROWS


def test_bf16_greedy_tree_wider_than_a_prompt_block_equals_ar(models, monkeypatch):
    """A draft tree of more than MAX_ROWS nodes (the bench's 32-token trees, plus a lookup path) is verified on the
    kernels too (cpu_kernels.rows_limit), so each node gets a decode step's logits and the output is ar's, in bf16;
    the verification really is that wide and really takes the layer kernel."""
    from polyspec.chain_spec import TreeShape
    from polyspec.decode.chain import ChainDecoder
    from polyspec.decode.levels import ModelLevel

    t = Transformer.from_pretrained(models["llama"]).eval().to(torch.bfloat16)
    twin = copy.deepcopy(t)
    calls: list[int] = []
    _spy_layer_kernel(monkeypatch, calls)
    tp = DraftSpec(tree=TreeShape(top_k=4, depth=3, total_tokens=40))
    for prompt in ([5, 17, 230, 9, 77], [3, 8, 400, 12], [44, 2, 9, 310, 7, 21]):
        ar = ChainDecoder([ModelLevel(t, "t")], max_seq_len=96).generate(prompt, 24).token_ids
        r = ChainDecoder([ModelLevel(t, "t"), ModelLevel(twin, "d")], max_seq_len=96, draft=tp).generate(prompt, 24)
        assert r.token_ids == ar
    assert max(calls) > ck.MAX_ROWS


@pytest.mark.parametrize("nodes", [10, 40], ids=["10-nodes", "40-nodes"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("hidden,heads,kv_heads", [(128, 4, 2), (192, 3, 1), (192, 4, 2)],
                         ids=["head32-group2", "head64-group3", "head48-scalar"])
def test_a_tree_node_equals_its_branch_decoded_token_by_token(tmp_path, dtype, hidden, heads, kv_heads, nodes):
    """A key's score does not depend on where the key sits in the cache, and the softmax's sums run over the visible
    keys in key order: a draft-tree node whose ancestors sit at other cache positions than when the same tokens are
    decoded one by one gets bitwise the same logits (greedy tree speculation equals ar). Head sizes 32 and 64 take
    the vector path (K/V rows shared by a group's heads), 48 the per-(head, row) loop."""
    d = make_tiny_llama(tmp_path, tokenizer=None, seed=21, hidden=hidden, heads=heads, kv_heads=kv_heads)
    model = Transformer.from_pretrained(d).eval().to(dtype)
    assert all(ck.layer_plan(layer) is not None for layer in model.layers)
    prefix = torch.randint(0, 512, (37,), generator=_gen(22))  # the tree's keys straddle 16-key blocks
    if nodes == 10:
        parents = [-1, -1, 0, 0, 1, 2, 3, 5, 7, 4]  # -1: a child of the prefix's last token
    else:  # wider than MAX_ROWS: a verification still takes the kernels (cpu_kernels.rows_limit)
        parents = [-1] + [int(torch.randint(-1, i, (1,), generator=_gen(24 + i))) for i in range(1, nodes)]
    tokens = torch.randint(0, 512, (len(parents),), generator=_gen(23))
    paths = []
    for i, p in enumerate(parents):
        paths.append((paths[p] if p >= 0 else []) + [i])
    mask = torch.zeros(len(parents), len(parents), dtype=torch.bool)
    for i, path in enumerate(paths):
        mask[i, path] = True
    offsets = torch.tensor([len(path) - 1 for path in paths])
    with torch.inference_mode():
        model.setup_cache(96)
        model(prefix)
        tree = model(tokens, tree_mask=mask, position_offsets=offsets)[0]
        for i, path in enumerate(paths):
            model.truncate(len(prefix))
            for j in path:
                step = model(tokens[j:j + 1])[0]
            assert torch.equal(tree[i], step[0]), (i, path)


def _twin_bf16_heads(tmp_path, seed: int, draft_vocab: int):
    """Two identical bf16 EagleHeads (cache of 64) over a tiny bf16 target built with ``seed``, and that target."""
    from polyspec.decode.head import EagleHead

    d = make_tiny_llama(tmp_path, tokenizer=None, seed=seed)
    target = Transformer.from_pretrained(d).eval().to(torch.bfloat16)
    heads = []
    for _ in range(2):
        torch.manual_seed(seed + 1)
        head = EagleHead(target.args, target.embed_tokens, target.lm_head).eval().to(torch.bfloat16)
        head.token_counts = torch.arange(target.args.vocab_size).flip(0)
        head.set_draft_vocab(draft_vocab)
        head.setup_cache(64)
        heads.append(head)
    return heads[0], heads[1], target


@pytest.mark.parametrize("draft_vocab", [0, 100], ids=["full-vocab", "draft-vocab"])
def test_the_head_step_in_one_call_equals_the_module_path(tmp_path, draft_vocab):
    """EagleHead's one-call kernel step (fc, layer, lm rows) gives bitwise the module path's logits, predicted
    features and cache, at widths 1-5 (a step, and the catch-up blocks after accepted tokens), last row only or all,
    and is really taken (a bf16 head on the CPU); an fp32 head keeps the module path."""
    fast, module, target = _twin_bf16_heads(tmp_path, 31, draft_vocab)
    module._kernel_step = lambda *a, **k: None  # the module path
    taken = []
    real = ck.head_step
    ids = torch.randint(0, 512, (40,), generator=_gen(33))
    feats = torch.randn(40, target.args.hidden_size, generator=_gen(34)).to(torch.bfloat16)
    with torch.inference_mode(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(ck, "head_step", lambda *a, **k: taken.append(1) or real(*a, **k))
        pos = 0
        for t, last in [(7, False), (1, True), (2, True), (1, True), (3, False), (5, True), (1, False)]:
            a, b = (h(ids[pos:pos + t], feats[pos:pos + t], last_only=last) for h in (fast, module))
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), (pos, t, last)
            pos += t
        assert len(taken) == 7
        caches = (fast._cache.k + fast._cache.v, module._cache.k + module._cache.v)
        assert all(torch.equal(x, y) for x, y in zip(*caches, strict=True))
        fast.truncate(3)
        module.truncate(3)
        assert torch.equal(fast(ids[3:4], feats[3:4])[0], module(ids[3:4], feats[3:4])[0])
        fp32 = copy.deepcopy(fast).float()
        fp32.setup_cache(64)
        fp32(ids[:2], feats[:2].float())
        assert len(taken) == 8  # the fp32 copy took the module path


def test_within_a_frozen_span_the_head_step_is_looked_up_once(tmp_path, monkeypatch):
    """Inside a weights_frozen span a bf16 head's decode_step looks its kernel step up (ck.HeadStep, keyed on ~10
    tensor attributes) at its first step and keeps it, with the bits of looking it up per step; a new cache or a new
    draft vocabulary looks it up anew, and a copy of the head keeps nothing."""
    fast, module, target = _twin_bf16_heads(tmp_path, 35, 100)
    looked = []
    real = type(fast)._head_step
    monkeypatch.setattr(type(fast), "_head_step", lambda self, c: looked.append(1) or real(self, c))
    ids = torch.randint(0, 512, (24,), generator=_gen(36)).tolist()
    feats = torch.randn(24, target.args.hidden_size, generator=_gen(37)).to(torch.bfloat16)
    blocks = [(0, 5, False), (5, 1, True), (6, 2, True), (8, 1, True)]

    def steps(h) -> list[torch.Tensor]:
        outs = []
        for _ in range(2):  # the second time on a new cache
            h.setup_cache(32)
            for start, t, last in blocks:
                outs += h.decode_step(ids[start:start + t], feats[start:start + t], last)
        return outs

    with torch.inference_mode():
        with ck.weights_frozen():
            kept = steps(fast)
            assert len(looked) == 2 and copy.deepcopy(fast).__dict__.get("_kept_step_of") is None
            fast.set_draft_vocab(50)
            fast.decode_step(ids[9:10], feats[9:10], True)
            assert len(looked) == 3 and fast._kept_step_of.value.vocab_ids.shape[0] == 50
        looked.clear()
        fresh = steps(module)
        assert len(looked) == 2 * len(blocks)
    assert all(torch.equal(a, b) for a, b in zip(kept, fresh, strict=True))


@pytest.mark.parametrize("draft_vocab", [0, 100], ids=["full-vocab", "draft-vocab"])
def test_a_draft_level_step_takes_the_kernel_step_and_equals_the_module_path(tmp_path, draft_vocab):
    """A HeadLevel's forwards (a prompt's catch-up, draft steps, the blocks after accepted tokens, a rewind) go to the
    head's decode_step, straight to the one-call kernel step, and give bitwise the module path's logits, predicted
    features and cache; fp32 features (which the kernel step does not take) get forward's path and its result."""
    from polyspec.decode.levels import HeadLevel

    fast, module, target = _twin_bf16_heads(tmp_path, 41, draft_vocab)
    module._kernel_step = module.decode_step = lambda *a, **k: None  # the module path
    levels = (HeadLevel(fast, "fast"), HeadLevel(module, "module"))
    ids = torch.randint(0, 512, (40,), generator=_gen(43)).tolist()
    feats = torch.randn(40, target.args.hidden_size, generator=_gen(44)).to(torch.bfloat16)
    taken = []
    real = ck.head_step
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ck, "head_step", lambda *a, **k: taken.append(1) or real(*a, **k))
        pos = 1
        for t, last, rewind in [(9, False, 0), (1, True, 0), (1, True, 0), (3, True, 2), (1, False, 0)]:
            pos -= rewind
            a, b = (lv.forward(ids[pos:pos + t], pos, feats[pos:pos + t], last_only=last) for lv in levels)
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), (pos, t, last)
            pos += t
        assert len(taken) == 5
        a, b = (lv.forward(ids[pos:pos + 2], pos, feats[pos:pos + 2].float()) for lv in levels)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and len(taken) == 6
    caches = (fast._cache.k + fast._cache.v, module._cache.k + module._cache.v)
    assert all(torch.equal(x[..., :pos + 1, :], y[..., :pos + 1, :]) for x, y in zip(*caches, strict=True))


def test_a_target_level_step_takes_the_one_call_forward_and_equals_forward(tmp_path):
    """A bf16 ModelLevel's forwards (a prompt, steps, verifications with logit_rows, a rewind) go to the model's
    decode_step (one kernel call, no tensor reshaping) and give bitwise what Transformer.forward's other paths give a
    twin (decode_step off: the layers in one call, then the norm and the lm_head), cache included."""
    from polyspec.decode.levels import ModelLevel

    _, _, target = _twin_bf16_heads(tmp_path, 45, 0)
    twin = copy.deepcopy(target)
    twin.decode_step = lambda *a, **k: None
    levels = (ModelLevel(target, "one call"), ModelLevel(twin, "forward"))
    for lv in levels:
        lv.setup(64)
    ids = torch.randint(0, 512, (40,), generator=_gen(46)).tolist()
    taken = []
    real = ck.run_forward
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ck, "run_forward", lambda *a, **k: taken.append(1) or real(*a, **k))
        pos = 0
        for t, last, rows, rewind in [(9, True, None, 0), (1, True, None, 0), (5, False, 5, 0), (3, False, 2, 2),
                                      (1, False, None, 0)]:
            pos -= rewind
            a, b = (lv.forward(ids[pos:pos + t], pos, last_only=last, logit_rows=rows) for lv in levels)
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), (pos, t, last, rows)
            pos += t
    assert len(taken) == 5
    caches = (target._cache.k + target._cache.v, twin._cache.k + twin._cache.v)
    assert all(torch.equal(x[..., :pos, :], y[..., :pos, :]) for x, y in zip(*caches, strict=True))


def test_the_head_step_under_a_draft_trees_mask_equals_the_module_path(tmp_path):
    """A draft tree's head forwards (tree_mask, position_offsets; a later depth's mask also covering the nodes an
    earlier forward appended) take the one-call kernel step and give bitwise the module path's logits, predicted
    features and cache; a malformed tree mask gets the module path's error."""
    fast, module, target = _twin_bf16_heads(tmp_path, 35, 100)
    module._kernel_step = lambda *a, **k: None
    taken = []
    real = ck.head_step
    ids = torch.randint(0, 512, (30,), generator=_gen(37))
    feats = torch.randn(30, target.args.hidden_size, generator=_gen(38)).to(torch.bfloat16)
    depth1 = torch.tensor([[1, 0, 0], [0, 1, 0], [0, 0, 1]], dtype=torch.bool)  # three siblings
    depth2 = torch.tensor([[1, 0, 0, 1, 0], [1, 0, 0, 0, 1]], dtype=torch.bool)  # two children of the first sibling
    with torch.inference_mode(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(ck, "head_step", lambda *a, **k: taken.append(1) or real(*a, **k))
        for h in (fast, module):
            h(ids[:9], feats[:9])
        for mask, offsets, lo in ((depth1, [0, 0, 0], 9), (depth2, [1, 1], 12)):
            t = mask.shape[0]
            a, b = (h(ids[lo:lo + t], feats[lo:lo + t], tree_mask=mask, position_offsets=torch.tensor(offsets))
                    for h in (fast, module))
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), lo
        assert len(taken) == 3
        caches = (fast._cache.k + fast._cache.v, module._cache.k + module._cache.v)
        assert all(torch.equal(x, y) for x, y in zip(*caches, strict=True))
        with pytest.raises(PolyspecError, match="tree_mask"):
            fast(ids[:2], feats[:2], tree_mask=torch.ones(3, 3, dtype=torch.bool), position_offsets=torch.zeros(2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("d", [64, 48], ids=["vector", "scalar"])
def test_prompt_attention_matches_torch_and_a_decode_step(dtype, d):
    """cpu_kernels.attention (a prompt's attention on the CPU, model.attend) against torch's SDPA over a cache view
    with a cached prefix and a causal block; each row's output is bitwise what that row alone (a decode step) gets."""
    from polyspec.decode.model import block_mask

    h, kv, start, t, cap = 6, 2, 19, 40, 96
    q = torch.randn(1, h, t, d, generator=_gen(40)).to(dtype)
    kc = torch.randn(1, kv, cap, d, generator=_gen(41)).to(dtype)
    vc = torch.randn(1, kv, cap, d, generator=_gen(42)).to(dtype)
    k, v = kc[:, :, :start + t], vc[:, :, :start + t]  # views of the cache, as KV caches hand them out
    mask = block_mask(start, t, None, q.device)
    with torch.inference_mode():
        out = ck.attention(q, k, v, mask)
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True)
        assert out is not None and out.dtype == dtype
        torch.testing.assert_close(out.float(), ref, atol=2e-2 if dtype == torch.bfloat16 else 1e-5, rtol=1e-2)
        for row in (0, 17, t - 1):
            n = start + row + 1
            one = ck.attention(q[:, :, row:row + 1], kc[:, :, :n], vc[:, :, :n], None)
            assert torch.equal(one[:, :, 0], out[:, :, row]), row
    with torch.enable_grad():
        assert ck.attention(q.requires_grad_(), k, v, mask) is None  # training keeps torch's attention


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_batch_of_prompts_attends_row_by_row_through_the_kernel(dtype):
    """model.attend on a batch of stateless prompts (the teacher's feature extraction): the kernel once per row, each
    row bitwise the kernel's result for that row alone, close to torch's SDPA; under autograd, SDPA itself."""
    from polyspec.decode import model

    b, h, kv, t, d = 3, 6, 2, 40, 64
    qkv = torch.randn(b, t, (h + 2 * kv) * d, generator=_gen(43)).to(dtype)  # one projection, as Attention.qkv
    q = qkv[..., :h * d].view(b, t, h, d).transpose(1, 2)
    k = qkv[..., h * d:(h + kv) * d].view(b, t, kv, d).transpose(1, 2)  # views: not the kernel's layout
    v = qkv[..., (h + kv) * d:].view(b, t, kv, d).transpose(1, 2)
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    calls = []
    real = ck.attention
    with torch.inference_mode(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(ck, "attention", lambda *a: calls.append(1) or real(*a))
        out = model.attend(q, k, v, mask)
        assert len(calls) == b
        for i in range(b):
            one = real(q[i:i + 1], k[i:i + 1].contiguous(), v[i:i + 1].contiguous(), mask)
            assert torch.equal(out[i:i + 1], one), i
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True)
        torch.testing.assert_close(out.float(), ref, atol=2e-2 if dtype == torch.bfloat16 else 1e-5, rtol=1e-2)
        assert torch.equal(model.attend(q[:1], k[:1], v[:1], mask), out[:1])  # a batch of one: the same kernel
    calls.clear()
    with torch.enable_grad(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(ck, "attention", lambda *a: calls.append(1) or real(*a))
        model.attend(q.clone().requires_grad_(), k, v, mask)
        assert not calls  # training keeps torch's attention
