"""``polyspec chain export-head``: a chain's draft head in vLLM's (speculators), SGLang's and EAGLE's formats.

Each folder is read back the way its engine's loader reads it (tensor names, shapes, config keys, checked against
vllm-project/speculators, vLLM's llama_eagle3.py, SGLang's llama_eagle.py / llama_eagle3.py, SafeAILab/EAGLE's
ea_model.py / cnets1.py), and run: the exported weights, in the engine's layer structure, give the polyspec head's
logits. An EAGLE-1/2 head to speculators and an EAGLE-3 head that fuses other than 3 layers are refused before
anything is written; speculators' own classes load the speculators folder when the package is installed."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from polyspec.errors import PolyspecError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DRAFT_VOCAB = 100


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    from conftest import make_tiny_llama

    # 8 layers: polyspec's default EAGLE-3 layers [1, 3, 4] are distinct and EAGLE's fixed [1, N/2 - 1, N - 4]
    path = make_tiny_llama(tmp_path_factory.mktemp("xh") / "t", layers=8, tokenizer=None)
    cfg = json.loads((path / "config.json").read_text())  # a RoPE base other than the default: it must travel
    cfg.pop("rope_theta", None)
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 50000.0}
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="module")
def target(target_dir):
    from polyspec.decode.model import Transformer

    return Transformer.from_pretrained(target_dir).eval()


def _randomise(head: torch.nn.Module, seed: int) -> None:
    """Every saved tensor random (norm weights around 1): a dropped norm or bias changes the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            shared = ("embed_tokens",) if hasattr(head, "d2t") else ("embed_tokens", "lm_head")  # the target's
            if name.startswith(shared):
                continue
            noise = torch.randn(p.shape, generator=g) * 0.2
            p.copy_(1.0 + noise if "norm" in name else noise)


def _chain(root: Path, target_dir: Path, head: torch.nn.Module, counts: torch.Tensor | None) -> Path:
    from polyspec.chain_spec import DecodeSpec
    from polyspec.decode.head import save_head
    from polyspec.manifest import assemble_chain

    head_dir = save_head(head, root / "head", {"t": "tiny"}, token_counts=counts)
    out = root / "chain"
    assemble_chain(out, target_dir, [], head_dir, DecodeSpec(mode="dual", draft={"k": 3, "vocab": DRAFT_VOCAB}))
    return out


@pytest.fixture(scope="module")
def eagle1_chain(target_dir, target, tmp_path_factory):
    from polyspec.decode.head import EagleHead

    torch.manual_seed(0)
    head = EagleHead(target.args, target.embed_tokens, target.lm_head)
    _randomise(head, 1)
    counts = torch.randint(0, 1000, (target.args.vocab_size,), generator=torch.Generator().manual_seed(2))
    return _chain(tmp_path_factory.mktemp("e1"), target_dir, head, counts)


def _eagle3_head(target, aux: list[int] | None = None, qkv_bias: bool = False, head_type: str = "eagle3"):
    from polyspec.decode.head3 import Eagle3Head, default_aux_layers, draft_vocab_ids, init_from_target

    # qkv_bias: Qwen2's layer (q/k/v bias, no o_proj bias)
    args = dataclasses.replace(target.args, num_layers=1, attention_bias=qkv_bias, o_proj_bias=False if qkv_bias
                               else None)
    aux = aux if aux is not None else default_aux_layers(target.args.num_layers)
    head = Eagle3Head(args, target.embed_tokens, aux, DRAFT_VOCAB, head_type)
    counts = torch.randint(0, 1000, (target.args.vocab_size,), generator=torch.Generator().manual_seed(3))
    head = init_from_target(head, target, draft_vocab_ids(counts, DRAFT_VOCAB))
    _randomise(head, 4)
    return head.eval()


@pytest.fixture(scope="module")
def eagle3_chain(target_dir, target, tmp_path_factory):
    return _chain(tmp_path_factory.mktemp("e3"), target_dir, _eagle3_head(target), None)


@pytest.fixture(scope="module")
def eagle31_chain(target_dir, target, tmp_path_factory):
    """An EAGLE-3.1 head (fc_norm, norm_output) whose aux layers are not in layer order: its fc_norms move with fc's
    blocks."""
    return _chain(tmp_path_factory.mktemp("e31"), target_dir, _eagle3_head(target, [4, 1, 3], head_type="eagle3.1"),
                  None)


def _read(folder: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    return json.loads((folder / "config.json").read_text()), load_file(str(folder / "model.safetensors"))


def _polyspec_head(chain: Path, target):
    from polyspec.decode.head import load_head

    return load_head(chain / "levels" / "draft", target)


def _inputs(target, t: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, target.args.vocab_size, (t,), generator=g)
    return ids, torch.randn(t, target.args.hidden_size, generator=g)


def _run_layer(layer, x: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """One causal pass of a polyspec-shaped layer over x [1, T, .] at positions 0..T-1."""
    from polyspec.decode.model import rope_cos_sin

    t = x.shape[1]
    cos, sin = rope_cos_sin(inv_freq, torch.arange(t), x.dtype)
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    return layer(x, cos, sin, mask, None, 0, 0)


def _eagle1_engine_forward(folder: Path, target, ids, feats) -> torch.Tensor:
    """The EAGLE-1/2 draft as SGLang's LlamaForCausalLMEagle and EAGLE's cnets1 build it from the folder: fc (with
    bias) over [embed; feature], num_hidden_layers Llama layers of which layer 0 has no input norm, the target's
    lm_head on the sum; every tensor looked up by the engine's name."""
    from polyspec.decode.model import DecoderLayer, ModelArgs, rope_inv_freq

    cfg, w = _read(folder)
    args = ModelArgs.from_hf_config(cfg)
    assert args.rope_theta == target.args.rope_theta
    x = torch.nn.functional.linear(torch.cat((target.embed_tokens(ids), feats), -1), w["fc.weight"], w["fc.bias"])
    x = x[None]
    for i in range(cfg["num_hidden_layers"]):
        layer = DecoderLayer(args)
        own = {k.removeprefix(f"layers.{i}."): v for k, v in w.items() if k.startswith(f"layers.{i}.")}
        if i == 0:
            assert "input_layernorm.weight" not in own  # EAGLE / SGLang build layer 0 without one
            layer.input_layernorm = torch.nn.Identity()
        layer.load_state_dict(own, strict=True)
        x = _run_layer(layer, x, rope_inv_freq(args))
    return target.lm_head(x[0]).float()


@pytest.mark.parametrize("fmt", ["sglang", "eagle"])
def test_eagle1_head_exports_exactly(eagle1_chain, target, tmp_path, fmt):
    from polyspec.export.head_formats import TOKEN_MAP_FILE, export_head

    out = export_head(eagle1_chain, fmt, tmp_path / fmt)
    cfg, w = _read(out)
    a = target.args
    names = {f"layers.{i}.{k}" for i in (0, 1) for k in (
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
        "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "post_attention_layernorm.weight")}
    assert set(w) == names | {"fc.weight", "fc.bias", "layers.1.input_layernorm.weight"}
    assert w["fc.weight"].shape == (a.hidden_size, 2 * a.hidden_size) and w["fc.bias"].shape == (a.hidden_size,)
    assert (cfg["num_hidden_layers"], cfg["tie_word_embeddings"], cfg["rope_theta"]) == (2, False, a.rope_theta)
    assert cfg["architectures"] == (["LlamaForCausalLMEagle"] if fmt == "sglang" else ["LlamaForCausalLM"])
    assert cfg.get("bias") is (True if fmt == "eagle" else None)  # EAGLE's ea_model builds fc's bias from it

    ids, feats = _inputs(target)
    head = _polyspec_head(eagle1_chain, target)
    with torch.no_grad():
        ref, _ = head(ids, feats)
        got = _eagle1_engine_forward(out, target, ids, feats)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)

    token_map = out / TOKEN_MAP_FILE
    if fmt == "eagle":
        assert not token_map.exists()  # EAGLE-1/2 drafts over the full vocabulary
        return
    hot = torch.as_tensor(torch.load(token_map, weights_only=True), dtype=torch.int64)  # SGLang's load_token_map
    head.set_draft_vocab(DRAFT_VOCAB)
    with torch.no_grad():
        sub, _ = head(ids, feats)
    assert hot.shape == (DRAFT_VOCAB,) and torch.isfinite(sub[:, hot]).all()
    assert torch.isinf(sub).sum() == sub.shape[0] * (a.vocab_size - DRAFT_VOCAB)  # the map is the draft vocabulary
    # SGLang's draft lm_head is the target's rows of the hot ids: the same softmax as the head's draft vocabulary
    torch.testing.assert_close(torch.softmax(got[:, hot], -1), torch.softmax(sub, -1)[:, hot], rtol=1e-5, atol=1e-6)


EAGLE3_LAYER = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                "input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight")


@pytest.mark.parametrize("fmt,prefix", [("speculators", "layers.0."), ("sglang", "midlayer."),
                                        ("eagle", "midlayer.")])
def test_eagle3_head_exports_exactly(eagle3_chain, target, tmp_path, fmt, prefix):
    from polyspec.decode.head import load_head
    from polyspec.export.head_formats import SPECULATORS_VERSION, export_head

    out = export_head(eagle3_chain, fmt, tmp_path / fmt, verifier="org/tiny-target")
    cfg, w = _read(out)
    a = target.args
    assert set(w) == {prefix + k for k in EAGLE3_LAYER} | {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"}
    assert w[prefix + "self_attn.q_proj.weight"].shape == (a.num_heads * a.head_dim, 2 * a.hidden_size)
    assert w["fc.weight"].shape == (a.hidden_size, 3 * a.hidden_size)
    assert w["lm_head.weight"].shape == (DRAFT_VOCAB, a.hidden_size)
    assert (w["d2t"].dtype, w["t2d"].dtype, w["t2d"].shape) == (torch.int64, torch.bool, (a.vocab_size,))
    draft_ids = w["d2t"] + torch.arange(DRAFT_VOCAB)  # vLLM: draft id + d2t; SGLang: hot_token_id
    assert torch.equal(w["t2d"].nonzero().flatten(), draft_ids)
    aux = json.loads((eagle3_chain / "levels" / "draft" / "config.json").read_text())["aux_layers"]
    layer_cfg = cfg["transformer_layer_config"] if fmt == "speculators" else cfg
    assert (layer_cfg["num_hidden_layers"], layer_cfg["tie_word_embeddings"]) == (1, False)
    if fmt == "speculators":
        assert (cfg["speculators_model_type"], cfg["speculators_version"]) == ("eagle3", SPECULATORS_VERSION)
        assert cfg["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in aux]  # vLLM captures layer inputs
        assert (cfg["draft_vocab_size"], cfg["target_hidden_size"], cfg["norm_before_residual"]) == \
            (DRAFT_VOCAB, a.hidden_size, False)
        spec = cfg["speculators_config"]
        assert spec["verifier"] == {"name_or_path": "org/tiny-target", "architectures": ["LlamaForCausalLM"]}
        assert spec["proposal_methods"][0]["speculative_tokens"] == 3 == read_draft_k(eagle3_chain)
        assert spec["default_proposal_method"] == spec["proposal_methods"][0]["proposal_type"]
    elif fmt == "sglang":
        assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
        assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == aux  # SGLang adds the 1 itself
    else:
        assert cfg["draft_vocab_size"] == DRAFT_VOCAB
    # the same tensors under polyspec's names are the same head
    back = out.parent / f"{fmt}-back"
    back.mkdir()
    head_cfg = json.loads((eagle3_chain / "levels" / "draft" / "config.json").read_text())
    (back / "config.json").write_text(json.dumps(head_cfg))
    from safetensors.torch import save_file

    save_file({("layer." + k.removeprefix(prefix) if k.startswith(prefix) else k): v for k, v in w.items()},
              str(back / "model.safetensors"))
    ids, feats = _inputs(target)
    with torch.no_grad():
        torch.testing.assert_close(load_head(back, target)(ids, feats)[0],
                                   _polyspec_head(eagle3_chain, target)(ids, feats)[0], rtol=0, atol=0)


def read_draft_k(chain: Path) -> int:
    from polyspec.manifest import read_manifest

    return read_manifest(chain).decode.draft.k


@pytest.fixture(scope="module")
def qkv_bias_chain(target_dir, target, tmp_path_factory):
    return _chain(tmp_path_factory.mktemp("e3b"), target_dir, _eagle3_head(target, qkv_bias=True), None)


def test_a_qkv_bias_head_gets_a_zero_o_bias_for_vllm_and_is_refused_by_sglang(qkv_bias_chain, tmp_path):
    from polyspec.export.head_formats import export_head

    _, w = _read(export_head(qkv_bias_chain, "speculators", tmp_path / "spec"))
    assert {"layers.0.self_attn.q_proj.bias", "layers.0.self_attn.k_proj.bias", "layers.0.self_attn.v_proj.bias"} <= \
        set(w)
    assert not w["layers.0.self_attn.o_proj.bias"].any()  # vLLM and speculators give o_proj a bias with attention_bias
    for fmt in ("sglang", "eagle"):
        with pytest.raises(PolyspecError, match="biases"):
            export_head(qkv_bias_chain, fmt, tmp_path / fmt)


@pytest.mark.parametrize("chain_name", ["eagle3_chain", "qkv_bias_chain", "eagle31_chain"])
def test_speculators_loads_the_folder_and_computes_the_same_logits(request, chain_name, target, tmp_path):
    from polyspec.export.head_formats import export_head

    eagle3_chain = request.getfixturevalue(chain_name)
    out = export_head(eagle3_chain, "speculators", tmp_path / "spec", verifier=None)
    _speculators_logits_equal(out, eagle3_chain, target)


def _speculators_logits_equal(out: Path, eagle3_chain: Path, target, draft_vocab: int = DRAFT_VOCAB) -> None:
    """speculators' own Eagle3DraftModel loads ``out`` (every tensor into its module of that name) and its modules,
    in the order its forward runs them, give the polyspec head's draft logits and the state its next step reads
    (EAGLE-3.1: fc_norm per aux layer before fc; norm_output: the final norm's output fed back)."""
    pytest.importorskip("speculators.models", reason="speculators is not installed (docs/SERVE.md)")
    from speculators.models import Eagle3DraftModel

    model = Eagle3DraftModel.from_pretrained(str(out)).eval()
    c = model.config
    tl = c.transformer_layer_config
    tl._attn_implementation = "eager"  # its default is flex attention with block masks (training); same maths
    rope = getattr(tl, "rope_parameters", None) or {"rope_theta": tl.rope_theta}
    assert (c.draft_vocab_size, c.norm_before_residual, rope["rope_theta"]) == \
        (draft_vocab, False, target.args.rope_theta)
    assert c.speculators_config.verifier.name_or_path == str((eagle3_chain / "levels" / "target").resolve())
    _, w = _read(out)
    state = model.state_dict()
    for name, tensor in w.items():  # every written tensor landed in speculators' module of that name
        assert torch.equal(state[name], tensor), name

    head = _polyspec_head(eagle3_chain, target)
    eagle31 = head.head_type == "eagle3.1"
    assert (c.fc_norm, c.norm_output, c.norm_before_fc) == (eagle31, eagle31, False)
    assert (model.fc_norm is not None) == eagle31
    g = torch.Generator().manual_seed(6)
    t = 6
    ids = torch.randint(0, target.args.vocab_size, (1, t), generator=g)
    states = {i: torch.randn(1, t, target.args.hidden_size, generator=g) for i in head.aux_layers}
    with torch.no_grad():
        ref_state = head(ids[0], head.fuse(torch.cat([states[i] for i in head.aux_layers], -1)[0]))[1]
        ref = head.draft_logits(ref_state)
        aux = torch.cat([states[i] for i in sorted(states)], -1)  # engines concatenate in layer order
        if model.fc_norm is not None:
            aux = torch.cat([n(a) for n, a in zip(model.fc_norm, aux.chunk(3, -1), strict=True)], -1)
        x = torch.cat((target.embed_tokens(ids), model.fc(aux)), -1)  # [1, T, 2H]: the first layer splits it
        pos = torch.arange(t)[None]
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        h = model.layers[0](x, attention_mask=mask, position_ids=pos, position_embeddings=model.rotary_emb(x, pos))
        h = h[0] if isinstance(h, tuple) else h
        fed_back = model.norm(h) if c.norm_output else h  # what speculators' next TTT step reads
        got = model.lm_head(model.norm(h))[0]
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(fed_back[0], ref_state, rtol=1e-4, atol=1e-4)


def _with_engines(chain: Path, root: Path) -> tuple[Path, dict[str, str]]:
    """A copy of ``chain`` with its engine folders written and listed, as the export stage writes them."""
    import shutil

    from polyspec.export.head_formats import write_engines
    from polyspec.manifest import read_manifest, validate_chain, write_manifest

    copy = root / "chain"
    shutil.copytree(chain, copy)
    manifest = read_manifest(copy)
    manifest.engines, refused = write_engines(copy, str((copy / "levels" / "target").resolve()))
    write_manifest(copy, manifest)
    validate_chain(copy)
    return copy, refused


def test_an_eagle3_chain_carries_vllm_and_sglang_folders_that_load(eagle3_chain, target, tmp_path):
    chain, refused = _with_engines(eagle3_chain, tmp_path)
    manifest = json.loads((chain / "manifest.json").read_text())
    assert set(manifest["engines"]) == {"vllm", "sglang", "eagle"} and refused == {}
    assert manifest["engines"]["vllm"]["format"] == "speculators"
    assert set(manifest["engines"]["vllm"]["files"]) == {"config.json", "model.safetensors"}
    cfg, w = _read(chain / "engines" / "sglang")  # SGLang's LlamaForCausalLMEagle3 names (SpecForge's export)
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and {f"midlayer.{k}" for k in EAGLE3_LAYER} <= set(w)
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} <= set(w)
    _speculators_logits_equal(chain / "engines" / "vllm", chain, target)


def test_engine_folders_are_hashed_and_confined(eagle3_chain, tmp_path):
    from polyspec.manifest import validate_chain

    chain, _ = _with_engines(eagle3_chain, tmp_path)
    weights = chain / "engines" / "sglang" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1] + b"\0")
    with pytest.raises(PolyspecError, match="engine sglang: file .* does not match its sha256"):
        validate_chain(chain)
    manifest = json.loads((chain / "manifest.json").read_text())
    manifest["engines"]["sglang"]["path"] = "engines/../../x"
    (chain / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(PolyspecError, match="engines"):
        validate_chain(chain)


def test_an_eagle1_chain_has_no_vllm_folder_and_says_why_in_one_line(eagle1_chain, tmp_path):
    chain, refused = _with_engines(eagle1_chain, tmp_path)
    assert sorted(json.loads((chain / "manifest.json").read_text())["engines"]) == ["eagle", "sglang"]
    assert refused == {"vllm": "vLLM loads EAGLE-3 heads only (train.head: eagle3)"}
    assert not (chain / "engines" / "sglang" / "hot_token_map.pt").exists()  # a chain holds no pickle


def test_an_eagle1_head_is_refused_for_speculators_with_one_error_and_nothing_written(eagle1_chain, tmp_path, capsys):
    from polyspec.cli import main

    out = tmp_path / "spec"
    rc = main(["chain", "export-head", str(eagle1_chain), "--format", "speculators", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc != 0 and "Traceback" not in err
    assert "EAGLE-1/2 head (chain level 'draft')" in err and "--format sglang" in err and "train.head: eagle3" in err
    assert list(tmp_path.iterdir()) == []  # no folder, no temporary folder


@pytest.mark.parametrize("aux", [[1, 2], [1, 1, 0]], ids=["two-layers", "a-layer-twice"])
def test_an_eagle3_head_without_three_distinct_layers_is_refused_everywhere(target_dir, target, tmp_path, aux):
    from polyspec.export.head_formats import export_head

    chain = _chain(tmp_path / "c", target_dir, _eagle3_head(target, aux=aux), None)
    for fmt in ("speculators", "sglang", "eagle"):
        with pytest.raises(PolyspecError, match="exactly 3 distinct layers"):
            export_head(chain, fmt, tmp_path / fmt)
        assert not (tmp_path / fmt).exists()


def test_fc_follows_the_engines_layer_order(target_dir, target, tmp_path):
    """Engines concatenate the captured layers in layer order; a head listing them otherwise gets fc's blocks
    reordered, and the same fused feature."""
    from polyspec.export.head_formats import export_head

    head = _eagle3_head(target, aux=[4, 1, 3])
    chain = _chain(tmp_path / "c", target_dir, head, None)
    cfg, w = _read(export_head(chain, "sglang", tmp_path / "sg"))
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    states = {i: torch.randn(5, target.args.hidden_size) for i in (1, 3, 4)}  # each layer's output
    with torch.no_grad():
        ref = head.fuse(torch.cat([states[i] for i in head.aux_layers], -1))
        got = torch.nn.functional.linear(torch.cat([states[i] for i in (1, 3, 4)], -1), w["fc.weight"])
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)  # the same sum, added in another order


def test_the_cli_writes_the_folder_and_will_not_overwrite(eagle1_chain, tmp_path, capsys):
    from polyspec.cli import main

    out = tmp_path / "sg"
    args = ["chain", "export-head", str(eagle1_chain), "--format", "sglang", "--out", str(out), "--draft-vocab", "0"]
    assert main(args) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]  # --draft-vocab 0: no map
    assert main(args) == 2 and "exists; pass --overwrite" in capsys.readouterr().err
    assert main(args + ["--overwrite"]) == 0


def test_a_failed_write_leaves_nothing(eagle1_chain, tmp_path, monkeypatch):
    import safetensors.torch

    from polyspec.export.head_formats import export_head

    def boom(*_a, **_k):
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save", boom)
    with pytest.raises(OSError, match="disk full"):
        export_head(eagle1_chain, "eagle", tmp_path / "e")
    assert list(tmp_path.iterdir()) == []


def test_a_token_map_needs_the_heads_token_counts(target_dir, target, tmp_path):
    from polyspec.decode.head import EagleHead
    from polyspec.export.head_formats import TOKEN_MAP_FILE, export_head

    chain = _chain(tmp_path / "c", target_dir, EagleHead(target.args, target.embed_tokens, target.lm_head), None)
    with pytest.raises(PolyspecError, match="no token counts.*--draft-vocab 0"):
        export_head(chain, "sglang", tmp_path / "sg")
    assert not (tmp_path / "sg").exists()
    assert not (export_head(chain, "sglang", tmp_path / "sg", draft_vocab=0) / TOKEN_MAP_FILE).exists()
    export_head(chain, "eagle", tmp_path / "e")  # EAGLE has no token map: the counts are not needed


def _eagle_embedding(base_model_path: Path) -> torch.Tensor:
    """EAGLE's own path to the target's embedding (cnets.py / cnets1.py ``Model.__init__`` with load_emb): the
    index's weight_map names the file, joined to base_model_path, sliced by the tensor's name."""
    from safetensors import safe_open

    index = json.loads((base_model_path / "model.safetensors.index.json").read_text())
    emb_path = base_model_path / index["weight_map"]["model.embed_tokens.weight"]
    with safe_open(str(emb_path), framework="pt", device="cpu") as f:
        return f.get_slice("model.embed_tokens.weight")[:, :].float()


# EAGLE-1/2's draft model (cnets1.py Model, loaded with strict=False, so a name it lacks is silently dropped): fc with
# bias, layers.N with no input norm in layer 0, the embedding from the target
def _eagle1_parameter_names(cfg: dict) -> set[str]:
    layer = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
             "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
             "post_attention_layernorm.weight")
    names = {f"layers.{i}.{k}" for i in range(cfg["num_hidden_layers"]) for k in layer}
    names |= {f"layers.{i}.input_layernorm.weight" for i in range(1, cfg["num_hidden_layers"])}
    return names | {"fc.weight"} | ({"fc.bias"} if cfg.get("bias", True) else set())


def test_the_eagle_folder_finds_the_targets_embedding_through_the_index(eagle1_chain, target, tmp_path):
    from polyspec.export.head_formats import export_head, read_head_source

    out = export_head(eagle1_chain, "eagle", tmp_path / "eagle")
    base = Path(read_head_source(eagle1_chain).verifier)  # what the user passes as base_model_path
    assert base == (eagle1_chain / "levels" / "target").resolve()
    torch.testing.assert_close(_eagle_embedding(base), target.embed_tokens.weight.float())
    cfg, w = _read(out)
    assert set(w) == _eagle1_parameter_names(cfg)  # every exported tensor has a slot, every slot a tensor

    from polyspec.manifest import validate_chain

    validate_chain(eagle1_chain)  # the index is one of the target's listed, hashed files


def test_the_eagle_export_writes_the_index_into_a_verifier_folder(eagle1_chain, target_dir, tmp_path):
    import shutil

    from polyspec.export.head_formats import export_head

    verifier = tmp_path / "target_copy"
    shutil.copytree(target_dir, verifier)
    assert not (verifier / "model.safetensors.index.json").exists()
    export_head(eagle1_chain, "eagle", tmp_path / "eagle", verifier=str(verifier))
    assert _eagle_embedding(verifier).shape[0] == json.loads((verifier / "config.json").read_text())["vocab_size"]


def test_an_old_chain_without_the_index_gets_one_clear_error(eagle1_chain, tmp_path):
    import shutil

    from polyspec.export.head_formats import export_head

    old = tmp_path / "old"
    shutil.copytree(eagle1_chain, old)
    (old / "levels" / "target" / "model.safetensors.index.json").unlink()
    manifest = json.loads((old / "manifest.json").read_text())
    del manifest["levels"][0]["files"]["model.safetensors.index.json"]  # as polyspec before the index wrote it
    (old / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(PolyspecError, match="re-assemble the chain, or pass --verifier"):
        export_head(old, "eagle", tmp_path / "eagle")
    assert not (tmp_path / "eagle").exists()


# SGLang's LlamaForCausalLMEagle3 (srt/models/llama_eagle3.py), read from its source: its parameters, and the name
# map of its load_weights, which drops a name it cannot place without a word
SGLANG_EAGLE3_LAYER = ("self_attn.qkv_proj.weight", "self_attn.o_proj.weight", "mlp.gate_up_proj.weight",
                       "mlp.down_proj.weight", "input_layernorm.weight", "hidden_norm.weight",
                       "post_attention_layernorm.weight")
SGLANG_STACKED = ((".q_proj", ".qkv_proj"), (".k_proj", ".qkv_proj"), (".v_proj", ".qkv_proj"),
                  (".gate_proj", ".gate_up_proj"), (".up_proj", ".gate_up_proj"))


def _sglang_eagle3_parameters(cfg: dict) -> set[str]:
    params = {"model.embed_tokens.weight", "model.fc.weight", "model.norm.weight"}
    params |= {f"model.midlayer.{k}" for k in SGLANG_EAGLE3_LAYER}
    params |= {"model.fc.bias"} if cfg.get("bias") else set()
    params |= {f"model.fc_norm.{i}.weight" for i in range(3)} if cfg.get("fc_norm") else set()  # EAGLE-3.1
    return params | (set() if cfg["tie_word_embeddings"] else {"lm_head.weight"})


def _sglang_eagle3_places(names: set[str], params: set[str]) -> dict[str, str | None]:
    """{file tensor: the parameter SGLang loads it into, or None where it is dropped}; d2t / t2d are read aside."""
    out: dict[str, str | None] = {}
    for name in names:
        if "d2t" in name or "t2d" in name:
            out[name] = name
            continue
        mapped = next((name.replace(a, b) for a, b in SGLANG_STACKED if a in name), name)
        out[name] = next((p for p in (mapped, f"model.{mapped}") if p in params), None)
    return out


# SafeAILab/EAGLE's EAGLE-3 draft model (cnets.py Model, loaded with strict=False): its state dict's names
EAGLE3_EAGLE_NAMES = ({f"midlayer.{k}" for k in EAGLE3_LAYER}
                      | {"embed_tokens.weight", "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"})


def test_the_sglang_and_eagle_folders_fill_every_slot_of_their_loaders(eagle3_chain, tmp_path):
    """Emulations from the loaders' source (neither engine installs here): every tensor lands in a parameter, and
    every parameter but the embedding (the target's) gets one."""
    from polyspec.export.head_formats import export_head

    cfg, w = _read(export_head(eagle3_chain, "sglang", tmp_path / "sglang"))
    params = _sglang_eagle3_parameters(cfg)
    places = _sglang_eagle3_places(set(w), params)
    assert None not in places.values(), places
    assert set(places.values()) - {"d2t", "t2d"} == params - {"model.embed_tokens.weight"}
    _, w = _read(export_head(eagle3_chain, "eagle", tmp_path / "eagle"))
    assert set(w) == EAGLE3_EAGLE_NAMES - {"embed_tokens.weight"}


def test_an_eagle31_chain_carries_its_norms_for_vllm_and_sglang_and_eagle_refuses_it(eagle31_chain, tmp_path):
    """EAGLE-3.1's fc_norm weights (in layer order, as fc's blocks) and both flags reach vLLM's and SGLang's folders;
    SGLang's loader places every tensor; EAGLE's format, which has no such norms, is refused with one error."""
    from polyspec.export.head_formats import export_head

    chain, refused = _with_engines(eagle31_chain, tmp_path)
    manifest = json.loads((chain / "manifest.json").read_text())
    assert set(manifest["engines"]) == {"vllm", "sglang"} and "EAGLE-3.1" in refused["eagle"]
    cfg, w = _read(chain / "engines" / "sglang")
    assert (cfg["fc_norm"], cfg["norm_output"]) == (True, True)
    params = _sglang_eagle3_parameters(cfg)
    places = _sglang_eagle3_places(set(w), params)
    assert None not in places.values(), places
    assert set(places.values()) - {"d2t", "t2d"} == params - {"model.embed_tokens.weight"}
    _, head_w = _read(chain / "levels" / "draft")
    _, vllm_w = _read(chain / "engines" / "vllm")
    for j, i in enumerate((1, 2, 0)):  # the head fuses layers [4, 1, 3]; engines take them as [1, 3, 4]
        assert torch.equal(w[f"fc_norm.{j}.weight"], head_w[f"fc_norm.{i}.weight"])
        assert torch.equal(vllm_w[f"fc_norm.{j}.weight"], head_w[f"fc_norm.{i}.weight"])
    with pytest.raises(PolyspecError, match="EAGLE-3.1 head .* in the eagle format: .*fc_norm"):
        export_head(eagle31_chain, "eagle", tmp_path / "eagle")
    assert not (tmp_path / "eagle").exists()
