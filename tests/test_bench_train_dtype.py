"""python -m polyspec.bench.train_dtype: float32 vs bf16 timings of the three head-training pieces on a tiny model."""

from __future__ import annotations

import json

import pytest
from conftest import make_tiny_llama

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_train_dtype_bench_times_both_dtypes(tmp_path, capsys):
    from polyspec.bench.train_dtype import main

    model = make_tiny_llama(tmp_path / "m", hidden=64, intermediate=128, heads=4, kv_heads=2)
    assert main([str(model), "--batch", "2", "--length", "8", "--vocab", "32", "--repeats", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["batch"], out["length"], out["vocab"]) == (2, 8, 32)
    for dtype in ("float32", "bfloat16"):
        parts = out[dtype]
        assert parts["matmul"]["gflops"] > 0
        assert parts["teacher_forward"]["tokens_per_second"] > 0
        assert parts["head_step"]["tokens_per_second"] > 0
