"""The static step's attention op (polyspec.decode.step_attention): its visibility rule against the reference's block
mask, its reference implementation against torch's SDPA, the Triton kernels against both under Triton's interpreter
(a subprocess: the interpreter is chosen when the kernels are defined), a whole static step on the kernels against
the model's forward, and on CUDA (marked ``gpu``) the kernels in a CUDA graph replayed at other lengths."""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import pytest
import torch

from polyspec.decode import step_attention as A
from polyspec.decode.model import block_mask

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
needs_triton = pytest.mark.skipif(not A.TRITON, reason="needs triton (make install puts it in)")

# Shared by the interpreter scripts and the GPU test: random inputs of one call, an independent expected result (the
# reference layer's RoPE, a dense mask over the valid keys, torch's SDPA), and the check of the outputs and caches.
_CASE = r'''
import torch
import torch.nn.functional as F
from polyspec.decode import step_attention as A
from polyspec.decode.model import apply_rope, rope_cos_sin


def make_case(seed, kv, g, w, d, slots, start, earlier, dtype, tree, device="cpu", poison=float("nan")):
    """One call's inputs: q/k/v heads as views of one fused projection; caches with random history below ``start``
    and ``poison`` from ``start`` on (the block's slots must be written; NaN for the kernels: nothing past the block
    may be read; the reference reads the whole cache under its mask, so a finite value there); random positions."""
    gen = torch.Generator().manual_seed(seed)
    h = kv * g
    qkv = torch.randn(1, w, h + 2 * kv, d, generator=gen).to(dtype)
    kc = torch.randn(1, kv, slots, d, generator=gen).to(dtype)
    vc = torch.randn(1, kv, slots, d, generator=gen).to(dtype)
    kc[:, :, start:] = poison
    vc[:, :, start:] = poison
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    cos_t, sin_t = rope_cos_sin(inv, torch.arange(slots), dtype)
    pos = (start + torch.randint(0, w + 1, (w,), generator=gen)).int()
    cols = w + earlier + 5  # more columns than the block and the earlier nodes need, as a bucket's buffer has
    inner = torch.zeros(w, cols, dtype=torch.int32)
    if tree:
        inner[:, :earlier + w] = (torch.rand(w, earlier + w, generator=gen) < 0.5).int()
    else:
        inner[:, :earlier] = 1
        inner[:, earlier:earlier + w] = torch.ones(w, w).tril().int()
    inner[torch.arange(w), earlier + torch.arange(w)] = 1  # every row sees itself
    bounds = torch.tensor([start, start - earlier], dtype=torch.int32)
    dev = torch.device(device)
    return [t.to(dev) for t in (qkv[:, :, :h + kv], qkv[:, :, h + kv:], kc, vc, cos_t, sin_t, pos, bounds, inner)]


def expected(qk, v, kc, vc, cos_t, sin_t, pos, bounds, inner):
    """SDPA over the cache's valid slots and the block's rotated keys, under a dense mask built here."""
    h, w = qk.shape[2] - v.shape[2], qk.shape[1]
    start, prefix = int(bounds[0]), int(bounds[1])
    p = pos.long()
    rot = apply_rope(qk.transpose(1, 2).float(), cos_t[p].float(), sin_t[p].float()).to(qk.dtype)
    keys = torch.cat((kc[:, :, :start], rot[:, h:]), 2).float()
    vals = torch.cat((vc[:, :, :start], v.transpose(1, 2)), 2).float()
    mask = torch.zeros(w, start + w, dtype=torch.bool, device=qk.device)
    mask[:, :prefix] = True
    c = min(inner.shape[1], start + w - prefix)
    mask[:, prefix:prefix + c] = inner[:, :c] != 0
    out = F.scaled_dot_product_attention(rot[:, :h].float(), keys, vals, attn_mask=mask, enable_gqa=True)
    return out.transpose(1, 2), rot[:, h:], v.transpose(1, 2)


def check(run, case, tol):
    qk, v, kc, vc, cos_t, sin_t, pos, bounds, inner = case
    start, w = int(bounds[0]), qk.shape[1]
    want, k_new, v_new = expected(*case)
    before_k, before_v = kc.clone(), vc.clone()
    out = run(*case)
    assert out.shape == want.shape and out.dtype == qk.dtype, (out.shape, want.shape)
    err = (out.float() - want).abs().max().item()
    assert err <= tol, err
    for cache, before, new in ((kc, before_k, k_new), (vc, before_v, v_new)):
        got = cache[:, :, start:start + w].float()
        assert (got - new.float()).abs().max().item() <= tol
        for part in (slice(0, start), slice(start + w, None)):  # the history and the slots past the block: untouched
            torch.testing.assert_close(cache[:, :, part], before[:, :, part], rtol=0, atol=0, equal_nan=True)
    return err


# (seed, kv heads, group, width, head_dim, cache slots, start, earlier tree nodes, tree): lengths off the 64-key
# block, GQA groups of 1, 2 and 3, an empty cache, many splits (4096 slots: 32 splits of 128), trees over earlier nodes
CASES = [(0, 2, 2, 1, 32, 256, 70, 0, False), (1, 2, 3, 5, 64, 512, 133, 0, False), (2, 1, 1, 4, 32, 256, 100, 3, True),
         (3, 2, 2, 8, 16, 128, 0, 0, False), (4, 4, 1, 3, 32, 4096, 2500, 2, True), (5, 1, 4, 16, 128, 1024, 1, 0, False),
         (6, 2, 1, 2, 64, 1088, 1000, 7, True)]
'''

_INTERPRETED = _CASE + r'''
real_empty = torch.empty


def poisoned_empty(*size, **kw):  # every buffer the op allocates starts as NaN: an unwritten element shows
    t = real_empty(*size, **kw)
    return t.fill_(float("nan")) if t.is_floating_point() else t


torch.empty = poisoned_empty
for dtype, tol in ((torch.float32, 2e-5), (torch.float16, 4e-3)):  # the interpreter's bf16 dot is broken (3.6)
    for c in CASES:
        case = make_case(*c[:7], c[7], dtype, c[8])
        check(A.triton_step_attention, case, tol)
        check(A.reference, make_case(*c[:7], c[7], dtype, c[8], poison=1e4), tol)
print("parity ok")
'''


def _interpreted(script: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRITON_INTERPRET="1")
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.slow  # heavy (the fast tier stays under 6 minutes: README)
@needs_triton
def test_kernels_and_reference_match_sdpa_under_the_interpreter():
    out = _interpreted(_INTERPRETED)
    assert out.returncode == 0 and "parity ok" in out.stdout, out.stderr[-3000:]


_STEP = r'''
import copy
import torch
from conftest import make_tiny_llama
from polyspec.decode import cuda_graphs, step_attention
from polyspec.decode.model import Transformer
import tempfile, pathlib

calls = []
real = step_attention.triton_step_attention
step_attention.triton_step_attention = lambda *a: calls.append(1) or real(*a)
root = pathlib.Path(tempfile.mkdtemp())
make_tiny_llama(root, seed=0, tokenizer=None, hidden=64, heads=4, kv_heads=2, intermediate=128, layers=2)
for dtype, tol in ((torch.float32, 1e-4), (torch.float16, 2e-2)):
    ref = Transformer.from_pretrained(root).to(dtype).eval()
    twin = copy.deepcopy(ref)
    runner = cuda_graphs.enable(twin, graphs=False, compiled=False)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, ref.args.vocab_size, (40,), generator=g)
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    blocks = [(slice(0, 20), {}), (slice(20, 21), {}), (slice(21, 26), {}),
              (slice(26, 29), {"tree_mask": tree, "position_offsets": torch.tensor([0, 1, 1])}), (slice(29, 30), {})]
    for m in (ref, twin):
        m.setup_cache(48)
    with torch.inference_mode():
        for sl, kw in blocks:
            a, b = ref(ids[sl], **kw), twin(ids[sl], **kw)
            for x, y in zip(a, b):
                err = ((x.float() - y.float()).abs().max() / x.float().abs().max()).item()
                assert err <= tol, (dtype, sl, err)
    assert runner.replays == 4
assert len(calls) == 2 * 4 * 2, len(calls)  # 4 static forwards x 2 layers x 2 dtypes, all on the kernels
print("step ok")
'''


@pytest.mark.slow  # heavy (the fast tier stays under 6 minutes: README)
@needs_triton
def test_a_static_step_on_the_kernels_matches_the_models_forward_under_the_interpreter():
    """The op's kernels inside the whole static step (views of the fused projection, a bucket's buffers, padding rows,
    a tree): the model's own forward (the reference layer on its dynamic cache) gives the same outputs."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.path.dirname(__file__))
    out = subprocess.run([sys.executable, "-c", _STEP], env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0 and "step ok" in out.stdout, out.stderr[-3000:]


def _case_module():
    ns: dict = {}
    exec(compile(_CASE, "step_attention_case", "exec"), ns)  # the shared case code above
    return ns


@pytest.mark.parametrize("host_lengths", [True, False], ids=["valid-slots", "whole-cache"])
@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_matches_sdpa(dtype, tree, host_lengths):
    """Both ways the reference attends: over the valid slots (host-read lengths, the CPU's), and over the whole cache
    under step_mask (no host sync: the one a CUDA device without the kernels captures)."""
    ns = _case_module()
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    run = functools.partial(A.reference, host_lengths=host_lengths)
    for c in ns["CASES"]:
        ns["check"](run, ns["make_case"](*c[:7], c[7], dtype, tree, poison=1e4), tol)


@pytest.mark.parametrize("earlier,tree", [(0, None), (0, "tree"), (3, "tree")])
def test_visibility_rule_is_the_reference_block_mask(earlier, tree):
    """step_mask over the valid slots equals model.block_mask for the same block (causal, a tree, a tree that sees
    earlier nodes); nothing past the block is visible."""
    start, t, slots = 30, 4, 128
    g = torch.Generator().manual_seed(earlier)
    tm = None
    if tree:
        tm = torch.rand(t, earlier + t, generator=g) < 0.5
        tm[:, earlier:].diagonal().fill_(True)
    ref = block_mask(start, t, tm, torch.device("cpu"))
    if ref is None:
        ref = torch.ones(t, start + t, dtype=torch.bool)
    inner = torch.zeros(t, t + earlier + 2, dtype=torch.int32)
    inner[:, :earlier + t] = (torch.ones(t, t).tril() if tm is None else tm).int()
    got = A.step_mask(torch.tensor([start, start - earlier]), inner, slots)
    assert torch.equal(got[:, :start + t], ref) and not got[:, start + t:].any()


def test_supported_declares_what_the_kernels_take(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    qk, v, kc = torch.zeros(1, 2, 6, 32), torch.zeros(1, 2, 2, 32), torch.zeros(1, 2, 64, 32)
    assert not A.supported(qk, v, kc)  # CPU tensors outside the interpreter: the reference
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert A.supported(qk, v, kc) == A.TRITON
    assert not A.supported(torch.zeros(1, 2, 6, 48), torch.zeros(1, 2, 2, 48), torch.zeros(1, 2, 64, 48))  # D=48
    assert not A.supported(torch.zeros(1, 2, 32, 6).transpose(2, 3), v, kc)  # heads not packed
    monkeypatch.setenv(A.ENV, "0")
    assert not A.supported(qk, v, kc)
    assert A.splits_for(1024) == (16, 64) and A.splits_for(4096) == (32, 128) and A.splits_for(100) == (2, 64)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_kernels_match_sdpa_and_replay_at_any_length(dtype):
    """On CUDA: every case against SDPA; then one captured CUDA graph replayed at other lengths and positions (the
    integers changed in place, no re-capture) gives each length's own result."""
    ns = _case_module()
    tol = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    for c in ns["CASES"]:
        case = ns["make_case"](*c[:7], c[7], dtype, c[8], device="cuda")
        assert A.supported(*case[:3])
        ns["check"](A.step_attention, case, tol)
    case = ns["make_case"](7, 2, 2, 4, 64, 1024, 500, 0, dtype, False, device="cuda")
    static = [t.clone() for t in case]
    graph = torch.cuda.CUDAGraph()
    A.step_attention(*static)  # warm-up (compiles the kernels)
    with torch.cuda.graph(graph):
        out = A.step_attention(*static)
    for start in (3, 64, 500, 777, 1000):
        fresh = ns["make_case"](start, 2, 2, 4, 64, 1024, start, 0, dtype, False, device="cuda")
        for s, f in zip(static, fresh, strict=True):
            s.copy_(f)
        want, _, _ = ns["expected"](*fresh)
        graph.replay()
        assert (out.float() - want).abs().max().item() <= tol, start
