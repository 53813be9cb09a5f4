"""The Triton W4A16 kernel (polyspec.decode.int4_triton) against the dequantised reference: under Triton's
interpreter on the CPU (fp32 and fp16 activations; a subprocess, since the interpreter is chosen when the kernel is
defined), and on CUDA in bf16 through Int4Linear (marked ``gpu``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from polyspec.decode.int4 import Int4Linear, dequantize, quantize_rtn, select_backend

needs_triton = pytest.mark.skipif(not __import__("polyspec.decode.int4_triton", fromlist=["TRITON"]).TRITON,
                                  reason="needs triton (make install puts it in)")

_PARITY = r"""
import torch
from polyspec.decode import int4_triton as T
from polyspec.decode.int4 import Int4Linear, dequantize, quantize_rtn
T.register()
cases = [  # n, k, group, rows, activations, splits: odd K, K not a multiple of the group, a partial last split
    (24, 200, 64, 1, torch.float32, 2), (192, 576, 128, 5, torch.float32, 3), (64, 256, 32, 16, torch.float16, 1),
    (130, 384, 128, 33, torch.float32, 2), (64, 257, 64, 3, torch.float32, 2), (8, 512, 256, 64, torch.float16, 1)]
for seed, (n, k, g, m, dt, splits) in enumerate(cases):
    gen = torch.Generator().manual_seed(seed)
    q, s, z = quantize_rtn(torch.randn(n, k, generator=gen), g, sym=seed % 2 == 0)
    lin = Int4Linear(q, s, z, g)
    x = torch.randn(m, k, generator=gen).to(dt)
    st, zt = T.kernel_tensors(lin.scales, lin.zeros, x.device)
    per = -(-st.shape[0] // splits)
    y = T.int4_mm(x, lin.qdata, st, zt, g, n, T.Plan(-(-st.shape[0] // per), per))
    ref = x.double() @ dequantize(q, s, z, g).to(dt).double().t()
    err = ((y.double() - ref).norm() / ref.norm()).item()
    assert y.shape == (m, n) and y.dtype == torch.float32 and err < 1e-5, (n, k, g, m, dt, splits, err)
print("parity ok")
"""


def _interpreted(script: str) -> subprocess.CompletedProcess:
    """``script`` in a fresh Python under Triton's interpreter (chosen when a kernel is defined, so not in here)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)


@needs_triton
def test_triton_kernel_matches_the_reference_under_the_interpreter():
    out = _interpreted(_PARITY)
    assert out.returncode == 0 and "parity ok" in out.stdout, out.stderr[-3000:]


_COMPILED = r"""
import torch
from polyspec.decode import int4_triton as T
from polyspec.decode.int4 import Int4Linear, quantize_rtn
T.register()
q, s, z = quantize_rtn(torch.randn(192, 576), 128)
lin = Int4Linear(q, s, z, 128)
st, zt = T.kernel_tensors(lin.scales, lin.zeros, torch.device("cpu"))
p = T.plan(192, st.shape[0], 8)
f = lambda x: T.int4_mm(x, lin.qdata, st, zt, 128, 192, p).relu()
x = torch.randn(5, 576)
assert torch.equal(torch.compile(f, fullgraph=True, backend="aot_eager")(x), f(x))
print("compiled ok")
"""


@needs_triton
def test_triton_op_traces_in_one_graph():
    """The compiled static step is compiled with fullgraph: the op must not break the graph."""
    out = _interpreted(_COMPILED)
    assert out.returncode == 0 and "compiled ok" in out.stdout, out.stderr[-3000:]


def test_plan_fills_the_device_and_covers_every_group():
    from polyspec.decode.int4_triton import BLOCK_N, plan

    for n, groups, sms in [(4096, 32, 132), (11008, 32, 132), (4096, 86, 132), (576, 5, 132), (24, 1, 8)]:
        p = plan(n, groups, sms)
        assert p.splits * p.groups_per_split >= groups > (p.splits - 1) * p.groups_per_split  # no empty split
        assert p.groups_per_split >= min(2, groups)
        blocks = -(-n // BLOCK_N)
        assert blocks * p.splits >= min(3 * sms, blocks * max(1, groups // 2))  # about 4x the SMs, when K allows


def test_cpu_activations_never_take_the_triton_path():
    x = torch.randn(3, 256)
    assert select_backend(x, 128) in ("cpu", "reference")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@needs_triton
@pytest.mark.parametrize("m", [1, 5, 16, 64, 65])
@pytest.mark.parametrize("n,k,g", [(4096, 4096, 128), (192, 576, 128), (24, 200, 64)])
def test_cuda_int4_layer_on_the_triton_kernel(n, k, g, m, monkeypatch):
    gen = torch.Generator().manual_seed(m)
    q, s, z = quantize_rtn(torch.randn(n, k, generator=gen), g)
    layer = Int4Linear(q, s, z, g).cuda()
    x = torch.randn(m, k, generator=gen).to("cuda", torch.bfloat16)
    assert select_backend(x, g) == ("triton" if m <= 64 else "cuda")
    ref = x.double() @ dequantize(q, s, z, g).to("cuda", torch.bfloat16).double().t()
    y = layer(x)
    assert y.dtype == torch.bfloat16 and torch.isfinite(y).all()
    assert ((y.double() - ref).norm() / ref.norm()).item() < 1e-2
    monkeypatch.setenv("POLYSPEC_INT4_TRITON", "0")
    assert select_backend(x, g) == "cuda"
