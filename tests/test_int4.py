"""polyspec.decode.int4: RTN maths, the GPTQ v1 layout, the fused kernels vs the dequantised reference, and
int4 checkpoints of whole models."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import make_tiny_llama

from polyspec.decode.int4 import (
    Int4Linear,
    dequantize,
    load_int4,
    pack_gptq,
    plan_kernel,
    quantize_model_rtn,
    quantize_rtn,
    save_int4_checkpoint,
    select_backend,
    set_embed_dtype,
    unpack_gptq,
)
from polyspec.decode.model import Transformer
from polyspec.errors import PolyspecError


def _w(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------------------------
# Pure maths
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("k", [256, 576])
def test_quantize_rtn_shapes_and_error_bound(k, sym):
    w = _w(32, k)
    q, scales, zeros = quantize_rtn(w, 128, sym=sym)
    g = -(-k // 128)
    assert q.shape == (32, k) and q.dtype == torch.uint8 and int(q.max()) <= 15
    assert scales.shape == (32, g) and zeros.shape == (32, g)
    assert torch.equal(scales, scales.half().float())  # fp16-representable
    if sym:
        assert bool((zeros == 8).all())
    else:
        assert int(zeros.min()) >= 1
    err = (dequantize(q, scales, zeros, 128) - w).abs()  # [N, K]
    per_col_scale = scales.repeat_interleave(128, dim=1)[:, :k]
    assert bool((err <= per_col_scale * 1.0001).all())  # one step at most (the clipped top code)
    assert err.mean() < 0.3 * per_col_scale.mean()  # and half a step on average


def test_short_last_group_is_its_own_group():
    w = _w(16, 576)
    _, s, _ = quantize_rtn(w, 128)
    assert s.shape[1] == 5  # 4 full groups and one of 64, never a changed group size
    w2 = w.clone()
    w2[:, :512] *= 10  # the first four groups change...
    _, s2, _ = quantize_rtn(w2, 128)
    assert torch.equal(s[:, 4], s2[:, 4])  # ...the short last group does not see them
    assert torch.equal(s[:, 4], (2 * w[:, 512:].abs().amax(1) / 15).half().float())


def test_gptq_layout_known_words():
    q = torch.zeros(8, 8, dtype=torch.uint8)
    q[0] = torch.arange(1, 9)  # output 0, inputs 0..7 -> one word, lowest nibble first
    q[3, 5] = 15
    scales = torch.full((8, 1), 0.5)
    zeros = torch.full((8, 1), 8, dtype=torch.uint8)
    t = pack_gptq(q, scales, zeros, 128)
    assert t["qweight"].shape == (1, 8) and t["qweight"].dtype == torch.int32
    assert int(t["qweight"][0, 0]) == 0x87654321 - 2**32
    assert int(t["qweight"][0, 3]) == 15 << 20
    assert t["qzeros"].shape == (1, 1) and int(t["qzeros"][0, 0]) == 0x77777777  # v1: zero - 1 = 7 everywhere
    assert t["scales"].dtype == torch.float16 and t["scales"].shape == (1, 8)
    assert torch.equal(t["g_idx"], torch.zeros(8, dtype=torch.int32))


@pytest.mark.parametrize("n,k,sym", [(64, 256, True), (24, 576, False), (16, 320, True)])
def test_gptq_round_trip(n, k, sym):
    q, s, z = quantize_rtn(_w(n, k, 1), 128, sym=sym)
    t = pack_gptq(q, s, z, 128)
    assert t["qweight"].shape == (k // 8, n) and t["qzeros"].shape == (-(-k // 128), n // 8)
    assert torch.equal(t["g_idx"].long(), torch.arange(k) // 128)
    q2, s2, z2 = unpack_gptq(t, 128, k)
    assert torch.equal(q, q2) and torch.equal(s, s2) and torch.equal(z, z2)
    # read as the v2 format (zero stored as is), the same words mean zero - 1
    assert torch.equal(unpack_gptq(t, 128, k, zero_offset=0)[2], z - 1)


def test_gptq_refusals():
    q, s, z = quantize_rtn(_w(16, 256), 128)
    t = pack_gptq(q, s, z, 128)
    with pytest.raises(PolyspecError, match="act-order"):
        unpack_gptq(dict(t, g_idx=torch.randperm(256).int() // 128), 128, 256)
    with pytest.raises(PolyspecError, match="zero points"):
        pack_gptq(q, s, torch.zeros_like(z), 128)
    with pytest.raises(PolyspecError, match="multiples of 8"):
        pack_gptq(q[:12], s[:12], z[:12], 128)


# ---------------------------------------------------------------------------------------------------------------
# The layer and its kernels
# ---------------------------------------------------------------------------------------------------------------


def _relerr(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("m", [1, 8])
@pytest.mark.parametrize("n,k", [(64, 256), (192, 576), (24, 320)])
def test_kernel_matches_dequantised_matmul(n, k, m, monkeypatch):
    """torch's int4pack kernel (the CPU streaming kernel of cpu_kernels, tested in test_cpu_kernels.py, is off)."""
    from polyspec.decode import cpu_kernels

    monkeypatch.setattr(cpu_kernels, "_enabled", False)
    q, s, z = quantize_rtn(_w(n, k, 2), 128)
    bias = torch.randn(n)
    layer = Int4Linear(q, s, z, 128, bias)
    x = torch.randn(m, k)
    ref = x @ dequantize(q, s, z, 128).t() + bias  # fp32
    y = layer(x)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    if select_backend(x) == "cpu":
        assert layer._kernel is not None  # the fused kernel really ran
        assert _relerr(y, ref) < 1e-2  # bf16 activations
    monkeypatch.setenv("POLYSPEC_INT4_REFERENCE", "1")
    assert select_backend(x) == "reference"
    assert torch.allclose(layer(x), ref, atol=1e-4, rtol=1e-5)


def test_kernel_plan_avoids_padding_for_576():
    plan = plan_kernel(192, 576, 128, "cpu")
    assert (plan.kernel_group, plan.k_pad, plan.n_pad) == (64, 576, 192)
    plan = plan_kernel(24, 200, 128, "cuda")
    assert plan.k_pad == 256 and plan.n_pad == 24 and plan.k_pad % (16 * plan.inner_k_tiles) == 0
    assert plan_kernel(16, 64, 16, "cpu") is None  # no kernel group divides 16: reference path


def test_odd_shapes_and_dtype_cast():
    q, s, z = quantize_rtn(_w(24, 200, 3), 128)  # K padded to 256, N to 32 for the CPU kernel
    layer = Int4Linear(q, s, z, 128)
    x = torch.randn(3, 5, 200)
    ref = x @ dequantize(q, s, z, 128).t()
    assert layer(x).shape == (3, 5, 24)
    assert _relerr(layer(x), ref) < 1e-2
    layer.to(torch.bfloat16)
    assert layer.scales.dtype == torch.float32 and torch.equal(layer.scales, s)  # casts never round scales
    assert layer(x.bfloat16()).dtype == torch.bfloat16


def test_reference_path_when_grad_is_needed():
    q, s, z = quantize_rtn(_w(32, 128, 4), 128)
    layer = Int4Linear(q, s, z, 128)
    x = torch.randn(2, 128, requires_grad=True)
    layer(x).sum().backward()
    assert torch.allclose(x.grad, dequantize(q, s, z, 128).sum(0).expand(2, -1), atol=1e-5)


def test_cat_is_the_concatenation_and_shares_its_buffers():
    """Int4Linear.cat (model.fuse_projections' int4 q/k/v and gate/up): the concatenated output, column for column;
    the parts' buffers become views of the fused ones (no memory added), their values and own outputs unchanged."""
    parts = [Int4Linear(*quantize_rtn(_w(n, 256, n), 64, sym=n != 32), 64, torch.randn(n)) for n in (32, 16, 16)]
    before = [(p.q.clone(), p.scales.clone(), p.zeros.clone(), p.bias.clone()) for p in parts]
    x = torch.randn(3, 256)
    sep = [p(x) for p in parts]
    fused = Int4Linear.cat(parts)
    assert (fused.in_features, fused.out_features, fused.group_size) == (256, 64, 64)
    assert torch.equal(fused(x), torch.cat(sep, -1))
    for p, (q, s, z, b), y in zip(parts, before, sep, strict=True):
        assert torch.equal(p.q, q) and torch.equal(p.scales, s) and torch.equal(p.zeros, z) and torch.equal(p.bias, b)
        assert torch.equal(p(x), y)
    assert parts[1].qdata.data_ptr() == fused.qdata[32:].data_ptr()  # a view: no copy kept
    assert parts[2].scales.data_ptr() == fused.scales[48:].data_ptr()
    odd = Int4Linear(*quantize_rtn(_w(16, 256), 128), 128)
    assert Int4Linear.cat([parts[0], odd]) is None  # another group size: not fused


def test_fuse_projections_fuses_int4_groups_and_computes_the_same(tiny_dir):
    from polyspec.decode.model import fuse_projections

    model = quantize_model_rtn(Transformer.from_pretrained(tiny_dir), group_size=64)
    ids = torch.randint(0, 512, (9,), generator=torch.Generator().manual_seed(1))
    ref = _logits(model, ids)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert fuse_projections(model) == 2 * model.args.num_layers
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    assert isinstance(attn.__dict__["_fused"], Int4Linear) and attn.__dict__["_fused"].out_features == sum(
        lin.out_features for lin in (attn.q_proj, attn.k_proj, attn.v_proj))
    assert mlp.__dict__["_fused"].out_features == 2 * mlp.gate_proj.out_features
    assert model.state_dict().keys() == state.keys()
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert torch.allclose(_logits(model, ids), ref, atol=1e-5, rtol=1e-5)  # column blocks computed alike
    model.to(torch.float32)  # a cast gives each projection its own tensors again: the fused layer is dropped
    assert "_fused" not in attn.__dict__


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 8])
@pytest.mark.parametrize("n,k", [(64, 256), (192, 576), (24, 200)])
def test_cuda_kernel_matches_reference(n, k, m, monkeypatch):
    """torch's int4 kernel (the CUDA path past the Triton kernel's 64 rows; forced here at decode widths)."""
    monkeypatch.setenv("POLYSPEC_INT4_TRITON", "0")
    q, s, z = quantize_rtn(_w(n, k, 5), 128)
    layer = Int4Linear(q, s, z, 128).cuda()
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    assert select_backend(x, 128) == "cuda"
    y = layer(x).float()
    ref = x.float() @ dequantize(q, s, z, 128).cuda().t()
    assert layer._kernel is not None and _relerr(y, ref) < 1e-2


# ---------------------------------------------------------------------------------------------------------------
# Whole models
# ---------------------------------------------------------------------------------------------------------------


def _dequantised_copy(path, int4_model: Transformer) -> Transformer:
    """An fp32 Transformer whose linears hold int4_model's dequantised weights (the reference)."""
    ref = Transformer.from_pretrained(path)
    for layer, qlayer in zip(ref.layers, int4_model.layers, strict=True):
        for block in ("self_attn", "mlp"):
            for name, lin in getattr(layer, block).named_children():
                lin.weight.data = getattr(getattr(qlayer, block), name).dequantized_weight()
    return ref


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny"), tokenizer=None)


def _logits(model: Transformer, ids: torch.Tensor) -> torch.Tensor:
    model.setup_cache(64)
    with torch.no_grad():
        return model(ids)[0]


def test_rtn_model_close_to_dequantised_reference(tiny_dir, monkeypatch):
    model = quantize_model_rtn(Transformer.from_pretrained(tiny_dir), group_size=128)
    assert isinstance(model.layers[0].self_attn.q_proj, Int4Linear)
    assert isinstance(model.lm_head, torch.nn.Linear) and isinstance(model.embed_tokens, torch.nn.Embedding)
    ref = _dequantised_copy(tiny_dir, model)
    ids = torch.randint(0, 512, (16,), generator=torch.Generator().manual_seed(0))
    ref_logits = _logits(ref, ids)
    assert _relerr(_logits(model, ids), ref_logits) < 2e-2  # bf16 activations in the kernels
    monkeypatch.setenv("POLYSPEC_INT4_REFERENCE", "1")
    assert torch.allclose(_logits(model, ids), ref_logits, atol=1e-4)
    fp32 = _logits(Transformer.from_pretrained(tiny_dir), ids)
    assert not torch.allclose(fp32, ref_logits, atol=1e-3)  # quantisation did change the model


@pytest.mark.parametrize("hidden,inter,heads,kv", [(128, 256, 4, 2), (192, 320, 3, 1)])
def test_int4_checkpoint_round_trip(tmp_path, hidden, inter, heads, kv):
    src = make_tiny_llama(tmp_path / "src", hidden=hidden, intermediate=inter, heads=heads, kv_heads=kv)
    (src / "polyspec_source.json").write_text("{}")  # describes the source folder only: not copied
    out = save_int4_checkpoint(src, tmp_path / "int4", group_size=128)
    cfg = json.loads((out / "config.json").read_text())
    stored = 128 if hidden == 128 else 64  # K = 192 / 320: stored with groups of 64 (decode.int4.regroup_gptq)
    qc = cfg["quantization_config"]
    assert {k: qc[k] for k in ("quant_method", "bits", "group_size", "sym", "desc_act", "checkpoint_format")} == {
        "quant_method": "gptq", "bits": 4, "group_size": stored, "sym": True, "desc_act": False,
        "checkpoint_format": "gptq"}
    src_files = {p.name for p in src.iterdir()} - {"polyspec_source.json"}
    assert "tokenizer.json" in src_files
    assert {p.name for p in out.iterdir()} == src_files | {"quantize_config.json"}  # tokenizer etc. copied
    from safetensors.torch import load_file

    tensors = load_file(str(out / "model.safetensors"))
    assert "model.layers.0.mlp.down_proj.qweight" in tensors and "model.layers.0.mlp.down_proj.weight" not in tensors
    assert tensors["model.layers.1.self_attn.q_proj.scales"].dtype == torch.float16
    assert "model.embed_tokens.weight" in tensors and "lm_head.weight" in tensors

    loaded = Transformer.from_pretrained(out)  # dispatches to load_int4
    in_memory = quantize_model_rtn(Transformer.from_pretrained(src))
    for a, b in zip(loaded.layers, in_memory.layers, strict=True):
        for block in ("self_attn", "mlp"):
            for name, la in getattr(a, block).named_children():
                lb = getattr(getattr(b, block), name)
                assert isinstance(la, Int4Linear)
                assert torch.equal(la.q, lb.q) and torch.equal(la.scales, lb.scales) and torch.equal(la.zeros, lb.zeros)
    ids = torch.randint(0, 512, (12,), generator=torch.Generator().manual_seed(1))
    # an fp32 int4 model keeps its embedding / lm_head 16-bit (W4A16); asked for fp32 ones, it equals the in-memory
    # RTN model bitwise
    assert loaded.embed_tokens.weight.dtype == loaded.lm_head.weight.dtype == torch.bfloat16
    assert loaded.norm.weight.dtype == torch.float32 and _logits(loaded, ids).dtype == torch.float32
    assert torch.equal(_logits(loaded, ids), _logits(set_embed_dtype(copy.deepcopy(in_memory), torch.bfloat16), ids))
    wide = load_int4(out, embed_dtype=torch.float32)
    assert torch.equal(_logits(wide, ids), _logits(in_memory, ids))
    with pytest.raises(PolyspecError, match="already exists"):
        save_int4_checkpoint(src, out)
    with pytest.raises(PolyspecError, match="already quantised"):
        save_int4_checkpoint(out, tmp_path / "again")


def test_load_int4_refusals(tmp_path, tiny_dir):
    out = save_int4_checkpoint(tiny_dir, tmp_path / "int4")
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"]["bits"] = 8
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(PolyspecError, match="4-bit"):
        load_int4(out)
    with pytest.raises(PolyspecError, match="rtn"):
        save_int4_checkpoint(tiny_dir, tmp_path / "x", method="awq")


@pytest.mark.slow
def test_smollm2_int4_checkpoint_answers(smollm2_dir, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    out = save_int4_checkpoint(smollm2_dir, tmp_path / "int4")  # K = 576: a short last group of 64
    model = Transformer.from_pretrained(out)
    assert model.layers[0].self_attn.q_proj.scales.shape == (576, 5)
    tok = AutoTokenizer.from_pretrained(out)
    text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}], tokenize=False,
                                   add_generation_prompt=True)
    ids = torch.tensor(tok(text)["input_ids"])
    model.setup_cache(ids.numel() + 16)
    with torch.no_grad():
        logits, _ = model(ids)
        kernel_last = logits[-1]
        new = []
        for _ in range(8):
            new.append(int(logits[-1].argmax()))
            logits, _ = model(torch.tensor(new[-1:]))
    assert tok.decode(new).startswith("The capital of France is Paris")
    monkeypatch.setenv("POLYSPEC_INT4_REFERENCE", "1")
    model.setup_cache(ids.numel())
    with torch.no_grad():
        ref_last = model(ids)[0][-1]
    assert _relerr(kernel_last, ref_last) < 5e-2
