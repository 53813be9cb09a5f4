"""polyspec.quantize: GPTQ through GPTQModel on tiny random Llamas, the GPTQ folder it writes (transformers and the
decoder load it with logits equal to the int4-dequantised reference), chat-formatted ShareGPT calibration, the
missing-extra error, the report maths and the whole stage on a tiny recipe."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from conftest import ASSETS, make_tiny_llama

from polyspec.errors import PolyspecError

SAMPLE = ASSETS / "sharegpt_sample.json"
HAS_GPTQMODEL = importlib.util.find_spec("gptqmodel") is not None
needs_gptqmodel = pytest.mark.skipif(not HAS_GPTQMODEL, reason="gptqmodel is not installed (pip install "
                                     "'polyspec[quant]'); the GPTQ tests need it")


def _tokenizer(folder: Path):
    from polyspec.sources import load_tokenizer

    return load_tokenizer(folder)


def _conversations():
    from polyspec.data.sharegpt import load_conversations

    return load_conversations(str(SAMPLE))[0]


# ---------------------------------------------------------------------------------------------------------------------
# Calibration


def test_calibration_samples_are_chat_formatted_sharegpt(tiny_llama_dir):
    from polyspec.quantize.calibration import calibration_samples, samples_digest

    tok = _tokenizer(tiny_llama_dir)
    convs = _conversations()
    samples = calibration_samples(tok, convs, 4, 48, seed=0)
    assert len(samples) == 4 and all(len(s) == 48 for s in samples)
    for s in samples:
        text = tok.decode(s, skip_special_tokens=False)
        assert text.startswith("<|im_start|>")  # every sample starts at a conversation's beginning
        assert "<|im_start|>user\n" in text and "<|im_end|>" in text
    joined = " ".join(tok.decode(s) for s in samples)
    assert any(m["content"][:20] in joined for c in convs for m in c)  # real ShareGPT text, not random tokens
    assert samples_digest(samples) == samples_digest(calibration_samples(tok, convs, 4, 48, seed=0))
    assert samples_digest(samples) != samples_digest(calibration_samples(tok, convs, 4, 48, seed=1))
    with pytest.raises(PolyspecError, match="calibration_samples x calibration_length"):
        calibration_samples(tok, convs, 1000, 256)


def test_data_conversations_split_like_the_data_stage(tmp_path):
    from polyspec.config import validate_tree
    from polyspec.data.prepare import split_indices
    from polyspec.quantize.calibration import data_conversations

    recipe = validate_tree({"workdir": str(tmp_path), "data": {"source": str(SAMPLE), "heldout_fraction": 0.3,
                                                               "seed": 3}}, "test")
    split = data_conversations(recipe.data)
    convs = _conversations()
    train_idx, held_idx = split_indices(len(convs), 0.3, 3)
    assert split.train == [convs[i] for i in train_idx] and split.heldout == [convs[i] for i in held_idx]
    assert not any(c in split.train for c in split.heldout)


# ---------------------------------------------------------------------------------------------------------------------
# Errors


def test_missing_gptqmodel_names_the_quant_extra(tiny_llama_dir, tmp_path, monkeypatch):
    from polyspec.quantize.gptq import quantize_model

    monkeypatch.setitem(sys.modules, "gptqmodel", None)  # makes `import gptqmodel` raise ImportError
    with pytest.raises(PolyspecError, match=r"polyspec\[quant\]"):
        quantize_model(tiny_llama_dir, tmp_path / "out", method="gptq", calibration=[[1, 2, 3, 4]])
    assert not (tmp_path / "out").exists()


def test_bad_settings_are_refused(tiny_llama_dir, tmp_path):
    from polyspec.quantize.gptq import parse_devices, quantize_model

    with pytest.raises(PolyspecError, match="calibration"):
        quantize_model(tiny_llama_dir, tmp_path / "o", method="gptq", calibration=None)
    with pytest.raises(PolyspecError, match="group_size"):
        quantize_model(tiny_llama_dir, tmp_path / "o", method="rtn", group_size=96)
    with pytest.raises(PolyspecError, match="4-bit"):
        quantize_model(tiny_llama_dir, tmp_path / "o", method="rtn", bits=8)
    with pytest.raises(PolyspecError, match="quantize.devices"):
        parse_devices("tpu")
    assert parse_devices("auto") == {"device": None, "pool": []}
    assert parse_devices("cpu") == {"device": "cpu", "pool": []}


# ---------------------------------------------------------------------------------------------------------------------
# GPTQ on tiny models


def _dequantized_reference(src: Path, qdir: Path):
    """The original HF model with every quantised linear's weight replaced by its int4-dequantised GPTQ weight."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from polyspec.decode.int4 import dequantize, unpack_gptq

    group = json.loads((qdir / "config.json").read_text())["quantization_config"]["group_size"]
    tensors = load_file(str(qdir / "model.safetensors"))
    ref = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    n_replaced = 0
    for name, module in ref.named_modules():
        if f"{name}.qweight" in tensors:
            parts = {k: tensors[f"{name}.{k}"] for k in ("qweight", "qzeros", "scales", "g_idx")}
            q, s, z = unpack_gptq(parts, group, module.in_features)
            with torch.no_grad():
                module.weight.copy_(dequantize(q, s, z, group))
            n_replaced += 1
    assert n_replaced == 7 * ref.config.num_hidden_layers
    return ref


@pytest.fixture(scope="module")
def gptq_pair(tmp_path_factory):
    """(source, GPTQ folder, RTN folder, calibration) for two tiny Llamas: all K multiples of 128, and K = 192 / 320
    (q/k/v/gate/up and down_proj get a short last group of 64)."""
    if not HAS_GPTQMODEL:
        pytest.skip("gptqmodel is not installed (pip install 'polyspec[quant]')")
    from polyspec.quantize.calibration import calibration_samples
    from polyspec.quantize.gptq import quantize_model

    out = {}
    root = tmp_path_factory.mktemp("quant")
    for label, kw in (("k128", {}), ("k192", {"hidden": 192, "heads": 4, "kv_heads": 2, "intermediate": 320})):
        src = make_tiny_llama(root / f"src_{label}", seed=1, **kw)
        cal = calibration_samples(_tokenizer(src), _conversations(), 8, 48, seed=0)
        gptq = quantize_model(src, root / f"gptq_{label}", method="gptq", calibration=cal, device="cpu")
        rtn = quantize_model(src, root / f"rtn_{label}", method="rtn")
        out[label] = (src, gptq, rtn, cal)
    return out


@needs_gptqmodel
@pytest.mark.parametrize("label", ["k128", "k192"])
def test_gptq_folder_is_standard_and_records_groups(gptq_pair, label):
    src, gptq, _, _ = gptq_pair[label]
    cfg = json.loads((gptq / "config.json").read_text())
    qc = cfg["quantization_config"]
    stored = 128 if label == "k128" else 64  # K = 192 / 320: stored with groups of 64, the same weights
    assert (qc["quant_method"], qc["bits"], qc["group_size"], qc["sym"], qc["desc_act"]) == ("gptq", 4, stored, True,
                                                                                          False)
    assert (qc.get("checkpoint_format") or qc.get("format")) == "gptq" and qc["lm_head"] is False
    assert "gptqmodel:" in qc["meta"]["quantizer"][0] and qc["meta"]["quantizer"][-1].startswith("polyspec:")
    assert json.loads((gptq / "quantize_config.json").read_text())["group_size"] == stored
    assert qc.get("meta", {}).get("offload_to_disk_path") is None  # no scratch path of this machine recorded
    from safetensors import safe_open

    with safe_open(str(gptq / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.float32  # not quantised, not downcast
        assert f.get_tensor("lm_head.weight").dtype == torch.float32
    assert not any(k.startswith(("model.embed_tokens.", "lm_head.")) and "qweight" in k for k in keys)
    assert sum(k.endswith(".qweight") for k in keys) == 14
    for f in ("tokenizer.json", "tokenizer_config.json"):
        assert (gptq / f).read_bytes() == (src / f).read_bytes()  # the target's tokenizer, unchanged
    rec = json.loads((gptq / "polyspec_quantization.json").read_text())
    layout = rec["group_layout"]
    assert (rec["quantized_group_size"], rec["stored_group_size"]) == (128, stored)
    assert rec["loaders"]["transformers+gptqmodel"] == "yes" and rec["loaders"]["vllm"].startswith("yes")
    assert layout["group_size"] == stored and layout["quantized_layers"] == 14 and layout["act_order_layers"] == 0
    assert rec["calibration"]["samples"] == 8 and rec["calibration"]["length"] == 48
    q_proj = layout["layers"]["model.layers.0.self_attn.q_proj"]
    down = layout["layers"]["model.layers.0.mlp.down_proj"]
    if label == "k128":
        assert layout["short_last_group_layers"] == 0
        assert (q_proj["groups"], q_proj["last_group"]) == (1, 128)
    else:
        assert layout["short_last_group_layers"] == 0 and qc["meta"]["polyspec_quantized_group_size"] == 128
        assert (q_proj["in_features"], q_proj["groups"], q_proj["last_group"]) == (192, 3, 64)
        assert (down["in_features"], down["groups"], down["last_group"]) == (320, 5, 64)


@needs_gptqmodel
@pytest.mark.parametrize("label", ["k128", "k192"])
def test_gptq_folder_loads_in_the_decoder_with_reference_logits(gptq_pair, label, monkeypatch):
    from polyspec.decode.int4 import Int4Linear
    from polyspec.decode.model import Transformer

    src, gptq, _, cal = gptq_pair[label]
    ref = _dequantized_reference(src, gptq)
    ids = torch.tensor(cal[0][:40])
    with torch.no_grad():
        want = ref(ids[None]).logits[0]  # [T, V]
    model = Transformer.from_pretrained(gptq)
    assert isinstance(model.layers[0].self_attn.q_proj, Int4Linear)
    with torch.no_grad():
        got, _ = model(ids)  # fused int4 kernels (bf16 activations)
    assert (got - want).abs().max() < 0.05 * want.abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9
    assert model.lm_head.weight.dtype == torch.bfloat16  # W4A16: the fp32 model's embedding / lm_head stay 16-bit
    monkeypatch.setenv("POLYSPEC_INT4_REFERENCE", "1")
    from polyspec.decode.int4 import load_int4

    wide = load_int4(gptq, embed_dtype=torch.float32)
    with torch.no_grad():
        exact, _ = wide(ids)  # float32 dequantised path and fp32 embedding: the same maths as the reference
    torch.testing.assert_close(exact, want, atol=1e-4, rtol=1e-4)


@needs_gptqmodel
@pytest.mark.parametrize("label", ["k128", "k192"])
def test_gptq_folder_loads_in_transformers(gptq_pair, label):
    """transformers (through optimum + gptqmodel) loads the folder with its default kernel. GPTQModel 7.6's default
    CPU kernel (ATen int4pack) needs K % group_size == 0, which the K = 192 folder meets by its groups of 64."""
    if importlib.util.find_spec("optimum") is None:
        pytest.skip("transformers loads GPTQ folders through optimum + gptqmodel; optimum is not installed")
    from transformers import AutoModelForCausalLM

    src, gptq, _, cal = gptq_pair[label]
    ref = _dequantized_reference(src, gptq)
    hf = AutoModelForCausalLM.from_pretrained(str(gptq), dtype=torch.float32).eval()
    assert type(hf.model.layers[0].self_attn.q_proj).__name__ != "Linear"  # a GPTQ kernel module
    ids = torch.tensor(cal[1][:32])[None]
    with torch.no_grad():
        want, got = ref(ids).logits[0], hf(ids).logits[0]
    assert (got - want).abs().max() < 0.05 * want.abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9


@needs_gptqmodel
@pytest.mark.parametrize("label", ["k128", "k192"])
def test_gptq_beats_rtn_on_calibration_data(gptq_pair, label):
    """GPTQ minimises the layer outputs' error on the calibration activations; RTN ignores them."""
    from transformers import AutoModelForCausalLM

    src, gptq, rtn, cal = gptq_pair[label]
    full = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    g_ref, r_ref = _dequantized_reference(src, gptq), _dequantized_reference(src, rtn)
    ids = torch.tensor(cal)  # [8, 48]
    with torch.no_grad():
        base = full(ids).logits
        err_g = (g_ref(ids).logits - base).pow(2).mean().item()
        err_r = (r_ref(ids).logits - base).pow(2).mean().item()
    assert err_g < err_r


@needs_gptqmodel
def test_rerun_with_same_inputs_is_skipped_and_new_inputs_rewrite(gptq_pair):
    from polyspec.quantize.gptq import quantize_model

    src, gptq, _, cal = gptq_pair["k128"]
    stamp = (gptq / "model.safetensors").stat().st_mtime_ns
    assert quantize_model(src, gptq, method="gptq", calibration=cal, device="cpu") == gptq
    assert (gptq / "model.safetensors").stat().st_mtime_ns == stamp
    key = json.loads((gptq / "polyspec_quantization.json").read_text())["key"]
    out = quantize_model(src, gptq.parent / "gptq_k128_other", method="gptq", calibration=cal[:4], device="cpu")
    assert json.loads((out / "polyspec_quantization.json").read_text())["key"] != key
    assert not [p for p in gptq.parent.iterdir() if ".tmp-" in p.name or ".offload" in p.name]


def test_group_layout_refuses_a_changed_group_size(tmp_path):
    from polyspec.quantize.gptq import group_layout, quantize_model

    src = make_tiny_llama(tmp_path / "src", hidden=192, intermediate=320)
    out = quantize_model(src, tmp_path / "rtn", method="rtn")  # quantised with 128, stored with 64 (K = 192, 320)
    assert group_layout(out, 64)["short_last_group_layers"] == 0
    with pytest.raises(PolyspecError, match="group size"):
        group_layout(out, 128)


# ---------------------------------------------------------------------------------------------------------------------
# Report maths


def test_logit_stats_known_values():
    from polyspec.quantize.report import logit_stats, summarize

    ref = torch.tensor([[0.0, 0.0], [2.0, 0.0]])  # [T=2, V=2]
    same = logit_stats(ref, ref.clone(), torch.tensor([0, 1]))
    assert same["kl"] == pytest.approx(0.0, abs=1e-7) and same["agree"] == 2 and same["nll_ref"] == same["nll_test"]
    ref = torch.tensor([[math.log(2.0), 0.0], [2.0, 0.0]])  # p_ref row 0 = (2/3, 1/3)
    test = torch.tensor([[math.log(3.0), 0.0], [0.0, 2.0]])  # p_test row 0 = (3/4, 1/4); row 1 flips the argmax
    s = logit_stats(ref, test, torch.tensor([0, 1]))
    kl0 = 2 / 3 * math.log((2 / 3) / (3 / 4)) + 1 / 3 * math.log((1 / 3) / (1 / 4))
    p = 1 / (1 + math.exp(-2))
    kl1 = p * math.log(p / (1 - p)) + (1 - p) * math.log((1 - p) / p)
    assert s["kl"] == pytest.approx(kl0 + kl1, rel=1e-5)
    assert s["agree"] == 1 and s["tokens"] == 2
    out = summarize(s)
    assert out["mean_kl"] == pytest.approx((kl0 + kl1) / 2, rel=1e-5)
    assert out["top1_agreement"] == 0.5
    assert out["ppl_target"] == pytest.approx(math.exp((-math.log(2 / 3) - math.log(1 - p)) / 2), rel=1e-5)
    assert out["ppl"] == pytest.approx(math.exp((-math.log(3 / 4) - math.log(p)) / 2), rel=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_logit_stats_takes_cpu_targets_beside_gpu_logits():
    # quality() builds the token ids on the CPU while the models (and their logits) sit on the GPU: the first GPU
    # run of the quantize stage stopped here (docs/GPU_RESULTS.md, "GPU, first lease")
    from polyspec.quantize.report import logit_stats

    gen = torch.Generator().manual_seed(0)
    ref, test = torch.randn(5, 11, generator=gen), torch.randn(5, 11, generator=gen)
    targets = torch.randint(0, 11, (5,), generator=gen)
    on_cpu = logit_stats(ref, test, targets)
    on_gpu = logit_stats(ref.cuda(), test.cuda(), targets)
    assert on_gpu == pytest.approx(on_cpu, rel=1e-5)


# ---------------------------------------------------------------------------------------------------------------------
# The stage


class _Tracker:
    def __init__(self):
        self.metrics, self.artifacts, self.params = {}, [], {}

    def log_metrics(self, m, step=None):
        self.metrics.update(m)

    def log_artifact(self, path, artifact_path=None):
        self.artifacts.append(Path(path))

    def log_params(self, p):
        self.params.update(p)


@pytest.mark.slow  # heavy (the fast tier stays under 6 minutes: README)
@needs_gptqmodel
def test_quantize_stage_on_a_tiny_recipe(tmp_path):
    from polyspec.config import validate_tree
    from polyspec.pipeline import run_quantize as quantize_stage

    src = make_tiny_llama(tmp_path / "target", seed=2)
    recipe = validate_tree({
        "workdir": str(tmp_path / "work"),
        "target": {"source": str(src), "device": "cpu"},
        "data": {"source": str(SAMPLE), "heldout_fraction": 0.3, "max_length": 64},
        "tracking": {"enabled": False},
        "quantize": {"calibration_samples": 4, "calibration_length": 32, "devices": "cpu"},
        "profile": {"prompts": 2, "max_new_tokens": 6, "kv_length": 16, "repeats": 1},
        "decode": {"draft": {"k": 3}},
    }, "test")
    tracker = _Tracker()
    out = quantize_stage(recipe, tracker=tracker)
    assert out.name == "model" and (out / "polyspec_quantization.json").is_file() and (out.parent / "rtn").is_dir()
    report = json.loads((out.parent / "report.json").read_text())
    for name in ("gptq", "rtn"):
        r = report[name]
        assert r["ppl"] > 1 and 0 <= r["top1_agreement"] <= 1 and r["mean_kl"] >= 0
        assert 1 <= r["L"] <= 3 + 1  # at most draft_k accepted + one bonus token per verification
    assert report["heldout"]["sequences"] >= 1 and report["ppl_target"] > 1
    assert set(report["speed"]) >= {"T1", "T3"} and report["speed"]["T3"]["int4_ms"] > 0
    assert report["speed"]["T1"]["int4_cpu_ms"] > 0 and report["speed"]["T3"]["int4_over_target_cpu"] > 0
    assert report["group_layout"]["group_size"] == 128
    assert report["calibration"]["samples"] == 4 and "gptq_beats_rtn" in report
    assert tracker.metrics["quantize.gptq.ppl"] == pytest.approx(report["gptq"]["ppl"])
    assert tracker.artifacts == [out.parent / "report.json"] and tracker.params["quantize.cached"] is False
    again = _Tracker()
    assert quantize_stage(recipe, tracker=again) == out  # same inputs: nothing recomputed
    assert again.params["quantize.cached"] is True

    # a truncated int4 weight file is found by its hash and the stage is redone, not reused
    weights = out / "model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole[: len(whole) // 2])
    redone = _Tracker()
    assert quantize_stage(recipe, tracker=redone) == out
    assert redone.params["quantize.cached"] is False
    assert weights.stat().st_size == len(whole)
    assert quantize_stage(recipe, tracker=_Tracker()) == out


@pytest.mark.slow  # heavy (the fast tier stays under 6 minutes: README)
@needs_gptqmodel
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads through Linux's /proc")
def test_gptq_runs_in_a_child_and_leaves_no_threads_here(tmp_path):
    """GPTQModel quantises from worker threads, each with an OpenMP team of its own; in the caller's process they made
    every later parallel region ~2x slower (polyspec/isolate.py). The quantisation runs in a spawned child, so this
    process has as many threads after it as before."""
    from polyspec.quantize.calibration import calibration_samples
    from polyspec.quantize.gptq import import_gptqmodel, quantize_model

    import_gptqmodel()  # its import starts threads of its own, before the count
    torch.ones(256, 256) @ torch.ones(256, 256)  # and torch's own OpenMP pool
    src = make_tiny_llama(tmp_path / "src", seed=2)
    cal = calibration_samples(_tokenizer(src), _conversations(), 4, 32, seed=0)
    before = len(list(Path("/proc/self/task").iterdir()))
    out = quantize_model(src, tmp_path / "gptq", method="gptq", calibration=cal, device="cpu")
    assert (out / "config.json").is_file()
    assert len(list(Path("/proc/self/task").iterdir())) == before
