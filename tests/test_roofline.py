"""The batch-1 memory roofline: weight bytes count shared (tied) tensors once; bandwidth and bounds are sane."""

import pytest
import torch

from polyspec.bench.roofline import measure_bandwidth, roofline, weight_bytes


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


def test_bandwidth_and_roofline_are_consistent():
    bw = measure_bandwidth("cpu", mbytes=16, repeats=3)
    assert bw["best_GBps"] >= bw["median_GBps"] > 0 and bw["copy_median_GBps"] > 0
    model = torch.nn.Linear(1000, 1000, bias=False)  # 4 MB
    r = roofline(model, 8.0, measured_tokens_per_second=1000.0)
    assert r["weight_bytes"] == 4_000_000
    assert r["roofline_tokens_per_second"] == pytest.approx(2000.0)
    assert r["fraction_of_roofline"] == pytest.approx(0.5)
