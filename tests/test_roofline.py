"""The batch-1 memory roofline: weight bytes count shared (tied) tensors once; a step streams every matrix but the
embedding table (one row of it, unless it is the tied lm_head); the GEMV bandwidth and the bounds are consistent."""

import dataclasses

import pytest
import torch

from polyspec.bench.roofline import measure_bandwidth, roofline, streamed_bytes, weight_bytes
from polyspec.bench.shape_bench import random_model, shape_args


def test_weight_bytes_counts_tied_tensors_once():
    emb = torch.nn.Embedding(100, 16)
    head = torch.nn.Linear(16, 100, bias=False)
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    assert weight_bytes(model) == 2 * 100 * 16 * 4
    head.weight = emb.weight  # tied: one storage
    assert weight_bytes(model) == 100 * 16 * 4
    model.half()
    assert weight_bytes(model) == 100 * 16 * 2


def test_weight_bytes_of_a_packed_model():
    """cpu_kernels.pack_weights makes every tensor a view of one block: still each counted once, at its size."""
    from polyspec.decode import cpu_kernels

    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8, bias=False))
    model[1].weight = torch.nn.Parameter(model[1].weight.detach().clone())
    expected = (32 * 16 + 32 + 8 * 32) * 4
    assert weight_bytes(model) == expected
    if cpu_kernels.pack_weights(model):
        assert weight_bytes(model) == expected


def _layer_bytes(a, size: int) -> int:
    """One decoder layer's weights by hand: q, k, v, o, gate, up, down, two norms (no biases)."""
    h, i, d = a.hidden_size, a.intermediate_size, a.head_dim
    return size * (h * a.num_heads * d * 2 + h * a.num_kv_heads * d * 2 + 3 * h * i + 2 * h)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_streamed_bytes_of_a_tiny_model(dtype, tied):
    """Layers, final norm and lm_head whole; the embedding one row (or whole, once, as the tied lm_head); RoPE's
    inverse frequencies (fp32) too."""
    a = dataclasses.replace(shape_args("tiny"), tie_word_embeddings=tied)
    model = random_model(a, dtype=dtype, device="cpu")
    size = torch.tensor([], dtype=dtype).element_size()
    matrix = a.vocab_size * a.hidden_size * size
    rest = a.num_layers * _layer_bytes(a, size) + a.hidden_size * size + a.head_dim // 2 * 4
    assert weight_bytes(model) == rest + matrix * (1 if tied else 2)
    assert streamed_bytes(model) == rest + matrix + (0 if tied else a.hidden_size * size)
    r = roofline(model, 10.0, measured_tokens_per_second=1.0)
    assert r["streamed_bytes"] == streamed_bytes(model) and r["weight_bytes"] == weight_bytes(model)
    assert r["roofline_tokens_per_second"] == pytest.approx(10e9 / streamed_bytes(model))


def test_streamed_bytes_of_an_int4_model():
    """Packed int4 projections at their packed size; the (16-bit) embedding table still one row."""
    a = shape_args("tiny")
    model = random_model(a, dtype=torch.bfloat16, device="cpu", int4_group=32)
    emb = model.embed_tokens.weight
    assert streamed_bytes(model) == weight_bytes(model) - (a.vocab_size - 1) * a.hidden_size * emb.element_size()
    assert streamed_bytes(model) < weight_bytes(random_model(a, dtype=torch.bfloat16, device="cpu")) / 2


def test_bandwidth_and_roofline_are_consistent():
    bw = measure_bandwidth("cpu", mbytes=16, repeats=3)
    assert bw["best_GBps"] >= bw["median_GBps"] > 0 and bw["copy_median_GBps"] > 0 and bw["sum_median_GBps"] > 0
    assert bw["gemv"]["k"] * bw["gemv"]["rows"] * 4 == pytest.approx(16e6, rel=1e-3) and bw["gemv"]["dtype"] == "float32"
    model = torch.nn.Linear(1000, 1000, bias=False)  # 4 MB
    r = roofline(model, 8.0, measured_tokens_per_second=1000.0)
    assert r["weight_bytes"] == r["streamed_bytes"] == 4_000_000
    assert r["roofline_tokens_per_second"] == pytest.approx(2000.0)
    assert r["fraction_of_roofline"] == pytest.approx(0.5)
