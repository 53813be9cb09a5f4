"""int4 folders every GPTQ loader reads: a layer whose K is not a multiple of the group size is stored with a
smaller group that divides K (each scale repeated), which must leave the weights and the logits exactly as they were."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from tests.conftest import make_tiny_llama

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def k192_folders(tmp_path_factory):
    """(source, int4 g128 with short last groups, the same stored portably) for a Llama with K = 192 and 384."""
    from polyspec.decode.int4 import save_int4_checkpoint

    root = tmp_path_factory.mktemp("k192")
    src = make_tiny_llama(root / "src", hidden=192, heads=3, kv_heads=1, intermediate=384)
    short = save_int4_checkpoint(src, root / "short", group_size=128, portable=False)
    portable = save_int4_checkpoint(src, root / "portable", group_size=128)
    return src, short, portable


def test_portable_group_size_is_the_largest_divisor_of_every_k():
    from polyspec.decode.int4 import portable_group_size

    assert portable_group_size({576, 1536}, 128) == 64  # SmolLM2-135M
    assert portable_group_size({4096, 11008}, 128) == 128  # Llama-2-7B: nothing to do
    assert portable_group_size({192, 320}, 128) == 64
    assert portable_group_size({200}, 128) == 128  # no group >= 32 divides 200: the short last group stays


def test_regroup_keeps_every_weight_bit_for_bit(k192_folders):
    from safetensors.torch import load_file

    from polyspec.decode.int4 import dequantize, unpack_gptq

    _, short, portable = k192_folders
    a, b = load_file(str(short / "model.safetensors")), load_file(str(portable / "model.safetensors"))
    layers = [k[: -len(".qweight")] for k in a if k.endswith(".qweight")]
    assert len(layers) == 14
    for name in layers:
        k = a[f"{name}.qweight"].shape[0] * 8
        pa, pb = ({p: t[f"{name}.{p}"] for p in ("qweight", "qzeros", "scales", "g_idx")} for t in (a, b))
        wa = dequantize(*unpack_gptq(pa, 128, k), 128)  # [N, K]
        wb = dequantize(*unpack_gptq(pb, 64, k), 64)
        assert torch.equal(wa, wb), name
        assert torch.equal(a[f"{name}.qweight"], b[f"{name}.qweight"])  # the codes are untouched
        assert b[f"{name}.scales"].shape[0] == k // 64  # whole groups: what vLLM allocates (K // group_size rows)
    for key in a:  # embeddings, norms, lm_head: the same tensors
        if key.rsplit(".", 1)[-1] not in ("qweight", "qzeros", "scales", "g_idx"):
            assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("reference", ["0", "1"])
def test_regrouped_folder_gives_the_same_logits(k192_folders, monkeypatch, reference):
    """Same logits before and after regrouping, on the fused kernels and on the dequantised reference path: the
    loader merges the repeated groups back, so the kernels even see the same groups."""
    from polyspec.decode.int4 import load_int4

    monkeypatch.setenv("POLYSPEC_INT4_REFERENCE", reference)
    _, short, portable = k192_folders
    ids = torch.arange(3, 40)
    a, b = load_int4(short), load_int4(portable)
    assert b.layers[0].self_attn.q_proj.group_size == 128  # merged back to the quantisation's groups
    with torch.no_grad():
        la, _ = a(ids)
        lb, _ = b(ids)
    assert torch.equal(la, lb)


def test_merge_equal_groups_only_merges_repeated_groups():
    from polyspec.decode.int4 import merge_equal_groups

    s = torch.tensor([[1.0, 1.0, 2.0, 2.0, 3.0]])  # [N=1, G=5] groups of 64 = groups of 128 repeated
    z = torch.full((1, 5), 8, dtype=torch.uint8)
    ms, mz, gs = merge_equal_groups(s, z, 64)
    assert gs == 128 and ms.tolist() == [[1.0, 2.0, 3.0]] and mz.shape == (1, 3)
    s2 = torch.tensor([[1.0, 1.5, 2.0, 2.0]])
    assert merge_equal_groups(s2, z[:, :4], 64)[2] == 64  # distinct scales: nothing merged
    z2 = torch.tensor([[8, 7, 8, 8]], dtype=torch.uint8)
    assert merge_equal_groups(torch.ones(1, 4), z2, 64)[2] == 64  # distinct zero points: nothing merged


def test_quantization_config_is_complete(k192_folders):
    """Every key vLLM's GPTQ configs, transformers' GPTQConfig and GPTQModel's QuantizeConfig read."""
    _, _, portable = k192_folders
    qc = json.loads((portable / "config.json").read_text())["quantization_config"]
    assert {k: qc[k] for k in ("quant_method", "bits", "group_size", "sym", "desc_act", "lm_head",
                               "checkpoint_format", "format", "pack_dtype")} == {
        "quant_method": "gptq", "bits": 4, "group_size": 64, "sym": True, "desc_act": False, "lm_head": False,
        "checkpoint_format": "gptq", "format": "gptq", "pack_dtype": "int32"}
    assert qc["meta"]["quantizer"][0].startswith("polyspec:") and qc["meta"]["polyspec_quantized_group_size"] == 128
    assert json.loads((portable / "quantize_config.json").read_text()) == qc


SMOL_LAYER = {f"model.layers.0.{n}": s for n, s in {
    "self_attn.q_proj": (576, 576), "self_attn.k_proj": (576, 192), "self_attn.v_proj": (576, 192),
    "self_attn.o_proj": (576, 576), "mlp.gate_proj": (576, 1536), "mlp.up_proj": (576, 1536),
    "mlp.down_proj": (1536, 576)}.items()}  # SmolLM2-135M's seven projections


def test_vllm_merges_qkv_and_gate_up():
    from polyspec.quantize.loaders import vllm_shapes

    assert vllm_shapes(SMOL_LAYER) == {"model.layers.0.self_attn.qkv_proj": (576, 960),
                                       "model.layers.0.self_attn.o_proj": (576, 576),
                                       "model.layers.0.mlp.gate_up_proj": (576, 3072),
                                       "model.layers.0.mlp.down_proj": (1536, 576)}
    with pytest.raises(ValueError, match="K = 512"):
        vllm_shapes({"a.q_proj": (576, 64), "a.k_proj": (512, 64)})


def test_loader_support_states_each_loader():
    from polyspec.quantize.loaders import loader_support

    short = loader_support(SMOL_LAYER, 128)
    assert short["vllm"].startswith("no:") and "576" in short["vllm"]
    assert "gptq_torch" in short["transformers+gptqmodel"]
    portable = loader_support(SMOL_LAYER, 64)
    assert portable["transformers+gptqmodel"] == "yes"
    vllm = portable["vllm"]
    assert vllm.startswith("yes:") and "K=576 N=960: Exllama (--dtype float16 only)" in vllm  # merged q/k/v
    assert "K=576 N=3072: Machete (Hopper (SM90) only) / Exllama" in vllm  # merged gate/up
    assert "N=192" not in vllm and "N=1536" not in vllm and "K=1536" not in vllm  # down_proj: Marlin
    llama7b = {"l.self_attn.q_proj": (4096, 4096), "l.self_attn.k_proj": (4096, 4096), "l.mlp.down_proj": (11008, 4096)}
    assert loader_support(llama7b, 128)["vllm"] == "yes (Marlin on every merged layer)"
    assert loader_support({"l.mlp.down_proj": (576, 100)}, 64)["vllm"].startswith("no: no vLLM GPTQ kernel")


def test_vllm_notes_record_merged_shapes_and_rules():
    from polyspec.quantize.loaders import vllm_notes

    notes = vllm_notes(SMOL_LAYER, 64)
    assert notes["merged_layers"] == {"down_proj K=1536 N=576": ["Marlin", "Exllama"],
                                      "gate_up_proj K=576 N=3072": ["Machete", "Exllama"],
                                      "o_proj K=576 N=576": ["Exllama"], "qkv_proj K=576 N=960": ["Exllama"]}
    assert len(notes["rules"]) == 2 and any("before" in k for k in notes["rules"])
    json.dumps(notes)  # it goes into config.json


def test_quantize_model_rtn_records_groups_and_loaders(tmp_path):
    from polyspec.quantize.gptq import quantize_model

    src = make_tiny_llama(tmp_path / "src", hidden=192, heads=3, kv_heads=1, intermediate=384)
    out = quantize_model(src, tmp_path / "rtn", method="rtn")
    rec = json.loads((out / "polyspec_quantization.json").read_text())
    assert (rec["quantized_group_size"], rec["stored_group_size"]) == (128, 64)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["meta"]["polyspec_loaders"] == rec["loaders"] and qc["group_size"] == 64
    assert qc["meta"]["quantizer"] == [qc["meta"]["quantizer"][0]]  # polyspec listed once
    merged = qc["meta"]["polyspec_vllm"]["merged_layers"]
    assert "qkv_proj K=192 N=320" in merged and "gate_up_proj K=192 N=768" in merged  # 192 + 64 + 64, 2 x 384


@pytest.mark.skipif(importlib.util.find_spec("optimum") is None or importlib.util.find_spec("gptqmodel") is None,
                    reason="transformers loads GPTQ folders through optimum + gptqmodel ([quant] extra)")
def test_transformers_default_kernel_loads_the_regrouped_folder(k192_folders):
    """GPTQModel's default CPU kernel refuses K % group_size != 0; the regrouped folder loads with it."""
    from transformers import AutoModelForCausalLM

    from polyspec.decode.int4 import load_int4

    _, _, portable = k192_folders
    hf = AutoModelForCausalLM.from_pretrained(str(portable), dtype=torch.float32).eval()
    ids = torch.arange(3, 30)
    with torch.no_grad():
        got = hf(ids[None]).logits[0]
        want, _ = load_int4(portable, embed_dtype=torch.float32)(ids)
    assert (got - want).abs().max() < 0.05 * want.abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9
