"""Chain folders: assemble, manifest round trip, tamper detection, atomic writes."""

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from polyspec.cli import main
from polyspec.errors import PolyspecError
from polyspec.manifest import ChainManifest, assemble_chain, read_manifest, validate_chain


def _fake_level(path, cfg, payload=b"weights"):
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file({"w": np.frombuffer(payload, dtype=np.uint8).copy()}, str(path / "model.safetensors"))
    return path


def _fake_head(path):
    """A head folder whose config.json (its layer's sizes: hidden 4, vocab 8) matches its tensors' shapes."""
    path.mkdir(parents=True)
    args = {"vocab_size": 8, "hidden_size": 4, "intermediate_size": 8, "num_layers": 1, "num_heads": 1,
            "num_kv_heads": 1, "head_dim": 4}
    (path / "config.json").write_text(json.dumps({"model_type": "polyspec-eagle-head", "args": args}))
    shapes = {"fc.weight": (4, 8), "fc.bias": (4,), "layer.input_layernorm.weight": (4,),
              "layer.post_attention_layernorm.weight": (4,), "layer.mlp.down_proj.weight": (4, 8),
              "layer.mlp.gate_proj.weight": (8, 4), "layer.mlp.up_proj.weight": (8, 4)}
    shapes.update({f"layer.self_attn.{p}_proj.weight": (4, 4) for p in "qkvo"})
    save_file({k: np.zeros(s, dtype=np.float32) for k, s in shapes.items()}, str(path / "model.safetensors"))
    return path


@pytest.fixture
def parts(tmp_path):
    target = _fake_level(tmp_path / "t", {"model_type": "llama"}, b"target")
    inter = _fake_level(tmp_path / "q", {"model_type": "llama", "quantization_config": {
        "quant_method": "gptq", "bits": 4, "group_size": 128}}, b"int4")
    return target, inter, _fake_head(tmp_path / "h")


def test_assemble_round_trip(tmp_path, parts):
    target, inter, head = parts
    out = tmp_path / "chain"
    m = assemble_chain(out, target, [inter], head)
    assert [lv.kind for lv in m.levels] == ["target", "int4", "head"]
    assert m.levels[1].quantization["group_size"] == 128
    assert m.levels[2].reads_features_from == "intermediate"
    again = read_manifest(out)
    assert again == m and isinstance(again, ChainManifest)
    assert validate_chain(out) == m
    assert not list(tmp_path.glob(".chain.*")), "no temp folder may be left behind"


@pytest.mark.parametrize("damage", ["change", "remove", "add"])
def test_tampering_is_named(tmp_path, parts, damage, capsys):
    target, inter, head = parts
    out = tmp_path / "chain"
    assemble_chain(out, target, [inter], head)
    victim = out / "levels" / "intermediate" / "model.safetensors"
    if damage == "change":
        victim.write_bytes(b"evil")
    elif damage == "remove":
        victim.unlink()
    else:
        victim = out / "levels" / "draft" / "extra.bin"
        victim.write_bytes(b"x")
    with pytest.raises(PolyspecError) as ei:
        validate_chain(out)
    assert str(victim) in str(ei.value)
    assert main(["validate-chain", str(out)]) == 1
    assert str(victim) in capsys.readouterr().err


def test_bad_manifests(tmp_path, parts):
    with pytest.raises(PolyspecError, match="manifest.json is missing"):
        read_manifest(tmp_path)
    target, inter, head = parts
    out = tmp_path / "chain"
    assemble_chain(out, target, [inter], head)
    raw = json.loads((out / "manifest.json").read_text())
    raw["schema_version"] = 99
    (out / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(PolyspecError, match="schema_version 99"):
        read_manifest(out)
    raw["schema_version"] = 1
    raw["levels"][0]["colour"] = "red"
    (out / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(PolyspecError, match="levels.0.colour"):
        read_manifest(out)
    (out / "manifest.json").write_text("{not json")
    with pytest.raises(PolyspecError, match="not valid JSON"):
        read_manifest(out)


def test_assemble_refuses_bad_parts(tmp_path, parts):
    target, inter, head = parts
    with pytest.raises(PolyspecError, match="must be a plain model folder"):
        assemble_chain(tmp_path / "c1", inter, [], head)
    with pytest.raises(PolyspecError, match="not a folder"):
        assemble_chain(tmp_path / "c2", target, [tmp_path / "missing"], head)
    assert not (tmp_path / "c2").exists() and not list(tmp_path.glob(".c2.*"))
    assemble_chain(tmp_path / "c3", target, [], head)
    with pytest.raises(PolyspecError, match="exists"):
        assemble_chain(tmp_path / "c3", target, [], head)


def test_cli_assemble(tmp_path, parts, capsys):
    target, inter, head = parts
    out = tmp_path / "chain"
    assert main(["chain", "assemble", "--target", str(target), "--intermediate", str(inter), "--draft", str(head),
                 "--out", str(out)]) == 0
    assert "target (target) <- intermediate (int4) <- draft (head)" in capsys.readouterr().out
    assert main(["validate-chain", str(out)]) == 0
