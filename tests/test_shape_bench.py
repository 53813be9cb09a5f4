"""polyspec shape-bench: random models at a named shape, the measurements it reports, the Lemma 3.1 projection."""

from __future__ import annotations

import json

import pytest
import torch

from polyspec.bench import shape_bench
from polyspec.cli import main
from polyspec.decode.int4 import Int4Linear
from polyspec.errors import PolyspecError
from polyspec.theory import chain_time_per_token


def test_shapes_have_the_published_sizes():
    from polyspec.decode.model import Transformer

    counts = {}
    for name in ("llama2-7b", "llama3-8b", "smollm2-135m"):
        with torch.device("meta"):
            m = Transformer(shape_bench.shape_args(name))
        counts[name] = sum(p.numel() for p in m.parameters())
    assert 6.73e9 < counts["llama2-7b"] < 6.75e9  # Llama-2-7B: 6,738,415,616 parameters
    assert 8.02e9 < counts["llama3-8b"] < 8.04e9  # Llama-3-8B: 8,030,261,248
    assert 134e6 < counts["smollm2-135m"] < 135e6  # SmolLM2-135M: 134,515,008 (tied)
    with pytest.raises(PolyspecError, match="unknown shape"):
        shape_bench.shape_args("gpt2")


def test_random_models_are_random_finite_and_int4_where_asked():
    args = shape_bench.shape_args("tiny")
    m = shape_bench.random_model(args, dtype=torch.float32, device="cpu", seed=0)
    q = shape_bench.random_model(args, dtype=torch.float32, device="cpu", seed=1, int4_group=128)
    h = shape_bench.random_head(args, m, dtype=torch.float32)
    w = m.layers[0].self_attn.q_proj.weight
    assert 0.015 < float(w.std()) < 0.025 and bool(torch.isfinite(w).all())
    assert torch.equal(m.norm.weight, torch.ones_like(m.norm.weight))
    lin = q.layers[1].mlp.down_proj
    assert isinstance(lin, Int4Linear) and lin.scales.dtype == torch.float32
    assert 0.015 < float(lin.dequantized_weight().std()) < 0.025
    assert q.lm_head.weight.dtype == torch.bfloat16 and not isinstance(q.lm_head, Int4Linear)  # W4A16: 16-bit head
    assert h.lm_head is m.lm_head and h.embed_tokens is m.embed_tokens
    m.setup_cache(16)
    q.setup_cache(16)
    h.setup_cache(16)
    with torch.inference_mode():
        lm, hid = m(torch.tensor([1, 2, 3]))
        lq, _ = q(torch.tensor([1, 2, 3]))
        lh, _ = h(torch.tensor([4, 5]), hid[:2])
    assert lm.shape == lq.shape == (3, args.vocab_size) and lh.shape == (2, args.vocab_size)
    assert all(bool(torch.isfinite(x).all()) for x in (lm, lq, lh))
    bf = shape_bench.random_model(args, dtype=torch.bfloat16, device="cpu", seed=0)
    assert bf.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16


MEASUREMENTS = {
    "decision": {"grid": {"tree": {"top_k": 4, "depth": 4, "total_tokens": 12}}},
    "grid": [
        {"label": "grid dual k=3", "mode": "dual", "draft_k": 3, "mu": [], "L": {"target": 2.0}, "beta": 3.0},
        {"label": "grid chain k=3 mu=8", "mode": "chain", "draft_k": 3, "mu": [8],
         "L": {"target": 4.0, "intermediate": 2.5}, "beta": 3.0},
        {"label": "grid dual tree 4x4/12", "mode": "dual", "draft_k": 4, "mu": [], "L": {"target": 3.0},
         "beta": 4.0},
        {"label": "grid ar", "mode": "ar", "draft_k": None, "mu": [], "L": {"target": 1.0}, "beta": None},
    ],
}


def test_projection_is_lemma_3_1_with_the_right_widths():
    ms = {"target": {1: 10.0, 4: 11.0, 9: 14.0, 13: 16.0},
          "intermediate": {4: 4.0}, "draft": {1: 1.0, 4: 1.5}}
    out = {c["label"]: c for c in shape_bench.project(MEASUREMENTS, ms)}
    assert set(out) == {"grid dual k=3", "grid chain k=3 mu=8", "grid dual tree 4x4/12"}
    chain = out["grid chain k=3 mu=8"]
    assert chain["widths"] == {"target": 9, "intermediate": 4, "draft": 1}
    t = chain_time_per_token([14.0, 4.0, 1.0], [4.0, 2.5], 3.0)  # 14/4 + 4/2.5 + 3*1/2.5 = 6.3
    assert chain["time_per_token_ms"] == pytest.approx(t) == pytest.approx(6.3)
    assert chain["projected_speedup_vs_ar"] == pytest.approx(10.0 / 6.3)
    dual = out["grid dual k=3"]
    assert dual["widths"] == {"target": 4, "draft": 1}
    assert dual["projected_speedup_vs_ar"] == pytest.approx(10.0 / (11.0 / 2 + 3 * 1.0 / 2))
    tree = out["grid dual tree 4x4/12"]
    assert tree["widths"] == {"target": 13, "draft": 4}
    assert tree["projected_speedup_vs_ar"] == pytest.approx(10.0 / (16.0 / 3 + 4 * 1.5 / 3))
    assert shape_bench.needed_widths(MEASUREMENTS, [5]) == [1, 4, 5, 9, 13]
    # a tree configuration without the tree's shape is left out rather than guessed
    no_tree = {"grid": MEASUREMENTS["grid"]}
    assert {c["label"] for c in shape_bench.project(no_tree, ms)} == {"grid dual k=3", "grid chain k=3 mu=8"}


@pytest.mark.slow  # heavy (the fast tier stays under 6 minutes: README)
def test_shape_bench_reports_roofline_ratios_and_times(tmp_path, capsys):
    out = tmp_path / "sb.json"
    rc = main(["shape-bench", "tiny", "--device", "cpu", "--new-tokens", "8", "--repeats", "1",
               "--forward-repeats", "2", "--forward-prefix", "16", "--widths", "1", "3", "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["shape"] == "tiny" and r["dtype"] == "float32" and r["cuda_graphs"] is False
    assert r["forward_times"]["widths"] == [1, 3]
    ms = r["forward_times"]["levels"]
    assert set(ms) == {"target", "intermediate", "draft"}
    assert r["int4_ratio"]["3"] == pytest.approx(ms["intermediate"]["ms"]["3"] / ms["target"]["ms"]["3"])
    roof = r["roofline"]
    assert roof["weight_bytes"] == r["weight_bytes"]["target"] > 0
    assert roof["fraction_of_roofline"] == pytest.approx(r["ar"]["tokens_per_second"]
                                                         / roof["roofline_tokens_per_second"])
    assert r["weight_bytes"]["intermediate"] < r["weight_bytes"]["target"]
    assert r["projection"] is None and r["ar"]["new_tokens"] == 8
    assert "of the roofline" in capsys.readouterr().out


def test_shape_bench_bad_input(tmp_path, capsys):
    # a --chain folder without a manifest (make gpu-prep found no CPU chain): one clear error before any model
    # is built, naming the folder and both ways out
    assert main(["shape-bench", "tiny", "--device", "cpu", "--chain", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"--chain {tmp_path} has no manifest.json" in err and "leave --chain out" in err
    assert "Traceback" not in err and "polyspec export" in err
    assert main(["shape-bench", "tiny", "--device", "cpu", "--chain", str(tmp_path / "absent")]) == 2
    assert "no such folder" in capsys.readouterr().err
    (tmp_path / "manifest.json").write_text("{}")
    assert main(["shape-bench", "tiny", "--device", "cpu", "--chain", str(tmp_path)]) == 2
    assert "error:" in capsys.readouterr().err
    assert main(["shape-bench", "tiny", "--device", "cpu", "--new-tokens", "0"]) == 2
    assert "--new-tokens must be >= 1" in capsys.readouterr().err
    assert main(["shape-bench", "tiny", "--device", "cpu", "--new-tokens", "2000"]) == 2
    assert "exceed the tiny context" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["shape-bench", "gpt2"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_shape_bench_on_cuda_with_graphs():
    r = shape_bench.run_shape_bench("tiny", device="cuda", new_tokens=16, repeats=1, widths=[1, 5],
                                    forward_prefix=32, forward_repeats=3)
    assert r["cuda_graphs"] is True and r["dtype"] == "bfloat16"
    assert r["ar"]["tokens_per_second"] > 0 and 0 < r["int4_ratio"]["1"]
