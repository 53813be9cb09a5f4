"""polyspec.decode.head: the EAGLE-style draft head, its cache and its saved form."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_tiny_llama
from safetensors.torch import load_file

from polyspec.decode.head import HEAD_MODEL_TYPE, EagleHead, load_head, save_head
from polyspec.decode.model import DecoderLayer, ModelArgs, Transformer
from polyspec.errors import PolyspecError


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return Transformer.from_pretrained(make_tiny_llama(tmp_path_factory.mktemp("target"), tokenizer=None))


def _head(target: Transformer, seed: int = 0) -> EagleHead:
    torch.manual_seed(seed)
    return EagleHead(target.args, target.embed_tokens, target.lm_head).eval()


def _inputs(t: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 512, (t,), generator=g), torch.randn(t, 128, generator=g)


def test_architecture_and_shapes(target):
    head = _head(target)
    assert head.fc.in_features == 256 and head.fc.out_features == 128 and head.fc.bias is not None
    assert isinstance(head.layer, DecoderLayer)
    assert head.embed_tokens is target.embed_tokens and head.lm_head is target.lm_head  # shared, not copied
    trainable = {n for n, p in head.named_parameters() if p.requires_grad}
    assert trainable and all(n.startswith(("fc.", "layer.")) for n in trainable)
    ids, feats = _inputs(7)
    head.setup_cache(16)
    with torch.no_grad():
        logits, hidden = head(ids, feats)
    assert logits.shape == (7, 512) and logits.dtype == torch.float32 and hidden.shape == (7, 128)
    assert torch.allclose(target.lm_head(hidden).float(), logits, atol=1e-6)  # no extra norm before lm_head
    assert head.cache_len == 7
    head.reset()
    with torch.no_grad():
        last_logits, last_hidden = head(ids, feats, last_only=True)
    assert torch.allclose(last_logits, logits[-1:], atol=1e-6) and torch.allclose(last_hidden, hidden[-1:], atol=1e-6)


def test_cached_incremental_equals_full(target):
    head = _head(target)
    ids, feats = _inputs(10, 1)
    with torch.no_grad():
        full_logits, full_hidden = head(ids, feats)  # stateless causal pass
        head.setup_cache(16)
        rows = [head(ids[:4], feats[:4])] + [head(ids[i:i + 1], feats[i:i + 1]) for i in range(4, 10)]
    assert torch.allclose(torch.cat([r[0] for r in rows]), full_logits, atol=1e-5)
    assert torch.allclose(torch.cat([r[1] for r in rows]), full_hidden, atol=1e-5)
    with torch.no_grad():
        head.truncate(4)
        again = head(ids[4:], feats[4:])[0]
    assert torch.allclose(again, full_logits[4:], atol=1e-5)


def test_tree_forward_matches_branch(target):
    head = _head(target)
    ids, feats = _inputs(5, 2)
    mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    with torch.no_grad():
        head.setup_cache(16)
        head(ids[:2], feats[:2])
        tree_logits, _ = head(ids[2:5], feats[2:5], tree_mask=mask, position_offsets=torch.tensor([0, 1, 1]))
        head.setup_cache(16)
        branch = head(torch.cat([ids[:3], ids[4:5]]), torch.cat([feats[:3], feats[4:5]]))[0]
    assert torch.allclose(tree_logits[2], branch[-1], atol=1e-5)


def test_batched_training_forward_and_grads(target):
    head = _head(target).train()
    ids = torch.randint(0, 512, (2, 6))
    feats = torch.randn(2, 6, 128)
    logits, hidden = head(ids, feats)
    assert logits.shape == (2, 6, 512) and hidden.shape == (2, 6, 128)
    (logits.logsumexp(-1).mean() + hidden.pow(2).mean()).backward()
    assert head.fc.weight.grad is not None and head.layer.mlp.down_proj.weight.grad is not None
    assert target.embed_tokens.weight.grad is None and target.lm_head.weight.grad is None


def test_save_load_round_trip(target, tmp_path):
    head = _head(target, seed=3)
    info = {"base_model": "tiny", "sha256": "abc123"}
    out = save_head(head, tmp_path / "head", info)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == HEAD_MODEL_TYPE and cfg["target"] == info
    assert ModelArgs.from_dict(cfg["args"]) == target.args
    saved = load_file(str(out / "model.safetensors"))
    assert set(saved) == set(head.trainable_state_dict())
    assert not any("embed" in k or "lm_head" in k for k in saved)
    assert "fc.weight" in saved and "layer.self_attn.q_proj.weight" in saved

    loaded = load_head(out, target)
    assert loaded.embed_tokens is target.embed_tokens and loaded.lm_head is target.lm_head
    ids, feats = _inputs(6, 4)
    with torch.no_grad():
        assert torch.equal(loaded(ids, feats)[0], head(ids, feats)[0])
    assert not list(tmp_path.glob(".head.tmp-*"))  # the temporary folder was renamed away
    save_head(head, out, info)  # overwriting an existing head works


def test_load_head_refuses_other_targets(target, tmp_path):
    out = save_head(_head(target), tmp_path / "head", {})
    other = Transformer.from_pretrained(make_tiny_llama(tmp_path / "other", tokenizer=None, vocab=256))
    with pytest.raises(PolyspecError, match="vocab"):
        load_head(out, other)
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    with pytest.raises(PolyspecError, match="model_type"):
        load_head(out, target)
