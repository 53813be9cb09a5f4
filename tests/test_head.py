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


def test_count_tokens_counts_masked_positions_only():
    from polyspec.decode.head import count_tokens

    counts = count_tokens([[1, 2, 2, 5], [2, 7]], [[0, 1, 1, 1], [1, 0]], 8)
    assert counts.dtype == torch.int64 and counts.tolist() == [0, 0, 3, 0, 0, 1, 0, 0]


def test_draft_vocab_keeps_the_most_frequent_tokens_and_their_exact_logits(target, tmp_path):
    from polyspec.decode.head import TOKEN_COUNTS_FILE, read_token_counts

    head = _head(target, seed=5)
    v = target.args.vocab_size
    counts = torch.randint(0, 1000, (v,), generator=torch.Generator().manual_seed(0))
    counts[7] = counts[9] = 5000  # a tie: both kept
    out = save_head(head, tmp_path / "head", {}, token_counts=counts)
    assert torch.equal(read_token_counts(out, v), counts)
    loaded = load_head(out, target)
    assert torch.equal(loaded.token_counts, counts)
    ids, feats = _inputs(5, 1)
    with torch.inference_mode():
        full, hid_full = loaded(ids, feats)
    loaded.set_draft_vocab(40)
    kept = loaded.draft_ids
    assert kept.tolist() == sorted(kept.tolist()) and kept.numel() == 40 and {7, 9} <= set(kept.tolist())
    top = set(torch.sort(counts, descending=True, stable=True).indices[:40].tolist())
    assert set(kept.tolist()) == top
    with torch.inference_mode():
        logits, hid = loaded(ids, feats)
        last, _ = loaded(ids, feats, last_only=True)
    assert torch.equal(hid, hid_full) and torch.equal(last, logits[-1:])
    out_of = torch.ones(v, dtype=torch.bool)
    out_of[kept] = False
    assert bool(torch.isneginf(logits[:, out_of]).all())
    torch.testing.assert_close(logits[:, kept], full[:, kept], atol=1e-5, rtol=1e-5)
    probs = torch.softmax(logits, -1)  # a proper distribution over the kept tokens
    torch.testing.assert_close(probs.sum(-1), torch.ones(5))
    # training (autograd) sees the full vocabulary; moving the head keeps the subset
    with torch.enable_grad():
        assert not bool(torch.isinf(loaded(ids, feats)[0]).any())
    loaded.to(torch.float64)
    with torch.inference_mode():
        assert bool(torch.isneginf(loaded(ids, feats.double())[0][:, out_of]).all())
    loaded.to(torch.float32)
    loaded.set_draft_vocab(0)
    assert loaded.draft_ids is None
    with torch.inference_mode():
        assert torch.equal(loaded(ids, feats)[0], full)
    for bad in (-1, v + 1, 2.5, True):
        with pytest.raises(PolyspecError, match="draft vocabulary size"):
            loaded.set_draft_vocab(bad)
    (out / TOKEN_COUNTS_FILE).unlink()
    with pytest.raises(PolyspecError, match="no token counts"):
        load_head(out, target).set_draft_vocab(10)
    with pytest.raises(PolyspecError, match="token_counts"):
        save_head(head, tmp_path / "h2", {}, token_counts=torch.zeros(3, dtype=torch.int64))


def test_unroll_step_equals_a_cached_linear_draft(target):
    """Unroll step k at row t is exactly the head's k-th drafted step past row t with its KV cache (step 0 over rows
    0..t with the target's features, then its own outputs as features): the training-time test trains what decoding
    runs. Also over a draft vocabulary."""
    head = _head(target, seed=3)
    g = torch.Generator().manual_seed(4)
    ids, feats = torch.randint(0, 512, (1, 9), generator=g), torch.randn(1, 9, 128, generator=g)
    vocab = torch.arange(0, 512, 3)
    with torch.no_grad():
        steps = head.unroll(ids, feats, 3)
        sub = head.unroll(ids, feats, 3, vocab_ids=vocab)
    assert len(steps) == 3 and steps[0][0].shape == (1, 9, 512) and sub[2][0].shape == (1, 9, len(vocab))
    row = 5
    head.setup_cache(16)
    with torch.inference_mode():
        logits, h = head(ids[0, :row + 1], feats[0, :row + 1])
        torch.testing.assert_close(h, steps[0][1][0, :row + 1], atol=1e-5, rtol=1e-5)
        hid = h[-1:]
        for k in (1, 2):
            logits, hid = head(ids[0, row + k:row + k + 1], hid)
            torch.testing.assert_close(hid[0], steps[k][1][0, row], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(logits[0], steps[k][0][0, row], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(logits[0, vocab], sub[k][0][0, row], atol=1e-4, rtol=1e-4)
    head.setup_cache(16)
    with pytest.raises(PolyspecError, match="without a KV cache"):
        head.unroll(ids, feats, 2)
