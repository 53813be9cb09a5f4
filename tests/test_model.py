"""polyspec.decode.model: parity with transformers, the static KV cache, tree attention, compaction."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_tiny_llama

from polyspec.decode.model import ModelArgs, Transformer, rope_inv_freq
from polyspec.errors import PolyspecError

TOL = 1e-4


def _hf_logits(path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return ref(ids[None]).logits[0].float()


def _make_tiny_qwen2(path, seed: int = 1):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      rms_norm_eps=1e-6, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # random init leaves biases at zero: make them matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("llama"), tokenizer=None)


@pytest.fixture(scope="module")
def llama(llama_dir):
    return Transformer.from_pretrained(llama_dir)


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed))


def _check_parity(path, n: int = 24) -> None:
    ids = _ids(n)
    ref = _hf_logits(path, ids)
    model = Transformer.from_pretrained(path)
    model.setup_cache(64)
    with torch.no_grad():
        logits, hidden = model(ids)
        assert logits.dtype == torch.float32 and logits.shape == (n, 512) and hidden.shape == (n, 128)
        assert (logits - ref).abs().max().item() <= TOL
        # incremental: a 5-token prompt, then one token at a time through the cache
        model.reset()
        rows = [model(ids[:5])[0]] + [model(ids[i:i + 1])[0] for i in range(5, n)]
    assert model.cache_len == n
    assert (torch.cat(rows) - ref).abs().max().item() <= TOL


def test_llama_parity_full_and_incremental(llama_dir):
    _check_parity(llama_dir)


def test_qwen2_with_qkv_bias_parity(tmp_path):
    path = _make_tiny_qwen2(tmp_path / "qwen2")
    cfg = json.loads((path / "config.json").read_text())
    args = ModelArgs.from_hf_config(cfg)
    assert args.attention_bias and not args.has_o_bias and args.tie_word_embeddings
    _check_parity(path)


def test_llama3_rope_scaling_parity(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
    path = make_tiny_llama(tmp_path / "l3", tokenizer=None, rope_scaling=scaling, head_dim=64, heads=2, kv_heads=1)
    args = ModelArgs.from_hf_config(json.loads((path / "config.json").read_text()))
    assert args.rope_scaling["rope_type"] == "llama3"
    plain = ModelArgs(**{**args.to_dict(), "rope_scaling": None})
    assert not torch.equal(rope_inv_freq(args), rope_inv_freq(plain))  # the scaling really changes something
    _check_parity(path, n=40)


def test_sharded_checkpoint_and_tied_embeddings(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      tie_word_embeddings=True)).eval()
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    model = Transformer.from_pretrained(tmp_path / "sharded")
    assert model.lm_head.weight is model.embed_tokens.weight
    ids = _ids(10)
    with torch.no_grad():
        assert (model(ids)[0] - hf(ids[None]).logits[0]).abs().max().item() <= TOL


def test_stateless_forward_equals_cached(llama):
    ids = _ids(12)
    with torch.no_grad():
        llama._cache = None
        stateless = llama(ids)[0]
        llama.setup_cache(32)
        cached = llama(ids)[0]
    assert torch.allclose(stateless, cached, atol=1e-6)


def test_last_only(llama):
    ids = _ids(9)
    llama.setup_cache(32)
    with torch.no_grad():
        full_logits, full_hidden = llama(ids)
        llama.reset()
        logits, hidden = llama(ids, last_only=True)
    assert logits.shape == (1, 512) and hidden.shape == (1, 128)
    assert torch.allclose(logits, full_logits[-1:], atol=1e-6) and torch.allclose(hidden, full_hidden[-1:], atol=1e-6)


def test_logits_from_keeps_every_hidden_row_and_the_last_logits(llama):
    ids = _ids(9)
    llama.setup_cache(32)
    with torch.no_grad():
        full_logits, full_hidden = llama(ids)
        for start in (1, 6, 8, 20):  # past the last row: the last row's logits
            llama.reset()
            logits, hidden = llama(ids, logits_from=start)
            assert logits.shape == (9 - min(start, 8), 512) and hidden.shape == (9, 128)
            assert torch.allclose(logits, full_logits[min(start, 8):], atol=1e-6)
            assert torch.allclose(hidden, full_hidden, atol=1e-6)


def test_hidden_is_lm_head_input(llama):
    llama.setup_cache(16)
    with torch.no_grad():
        logits, hidden = llama(_ids(5))
        assert torch.allclose(llama.lm_head(hidden).float(), logits, atol=1e-6)


def test_truncate_rollback_equals_fresh_run(llama):
    prefix, wrong, right = _ids(8, 1), _ids(5, 2), _ids(4, 3)
    with torch.no_grad():
        llama.setup_cache(32)
        llama(prefix)
        llama(wrong)
        llama.truncate(8)
        assert llama.cache_len == 8
        rolled = llama(right)[0]
        rolled_cache = [(k[:, :, :12].clone(), v[:, :, :12].clone())
                        for k, v in zip(llama._cache.k, llama._cache.v, strict=True)]
        llama.setup_cache(32)
        llama(prefix)
        fresh = llama(right)[0]
    assert torch.allclose(rolled, fresh, atol=1e-6)
    for (k, v), k2, v2 in zip(rolled_cache, llama._cache.k, llama._cache.v, strict=True):
        assert torch.allclose(k, k2[:, :, :12], atol=1e-6) and torch.allclose(v, v2[:, :, :12], atol=1e-6)
    with pytest.raises(PolyspecError, match="truncate"):
        llama.truncate(13)


def _tree():
    """Block tokens a, b, c, d: b and c are children of a, d a child of c (a follows the cached prefix)."""
    tokens = torch.tensor([11, 22, 33, 44])
    mask = torch.tensor([[1, 0, 0, 0],
                         [1, 1, 0, 0],
                         [1, 0, 1, 0],
                         [1, 0, 1, 1]], dtype=torch.bool)
    offsets = torch.tensor([0, 1, 1, 2])
    return tokens, mask, offsets


def test_tree_mask_matches_per_branch_causal_forwards(llama):
    prefix = _ids(6, 4)
    tokens, mask, offsets = _tree()
    with torch.no_grad():
        llama.setup_cache(32)
        llama(prefix)
        tree_logits, tree_hidden = llama(tokens, tree_mask=mask, position_offsets=offsets)
        assert llama.cache_len == 10
        for row, path in [(0, [11]), (1, [11, 22]), (2, [11, 33]), (3, [11, 33, 44])]:
            llama.setup_cache(32)
            branch_logits, branch_hidden = llama(torch.cat([prefix, torch.tensor(path)]))
            assert torch.allclose(tree_logits[row], branch_logits[-1], atol=1e-5), row
            assert torch.allclose(tree_hidden[row], branch_hidden[-1], atol=1e-5), row


def test_tree_expanded_depth_by_depth_matches_per_branch_forwards(llama):
    """How the draft grows a tree: one forward per depth, each node seeing its ancestors among the cached tree
    entries through the first K columns of a [T, K + T] mask (the rest of the cache is all visible)."""
    prefix = _ids(6, 7)
    with torch.no_grad():
        llama.setup_cache(32)
        llama(prefix)
        depth1, _ = llama(torch.tensor([11, 12]), tree_mask=torch.eye(2, dtype=torch.bool),
                          position_offsets=torch.tensor([0, 0]))  # a, b: both children of the last prefix token
        # depth 2: c under a, d under b, e under b; cached tree entries are [a, b]
        mask = torch.tensor([[1, 0, 1, 0, 0],
                             [0, 1, 0, 1, 0],
                             [0, 1, 0, 0, 1]], dtype=torch.bool)
        depth2, hidden2 = llama(torch.tensor([21, 22, 23]), tree_mask=mask,
                                position_offsets=torch.tensor([-1, -1, -1]))  # positions 7: two after 6 + 2 cached
        assert llama.cache_len == 11
        for logits, path in [(depth1[0], [11]), (depth1[1], [12]), (depth2[0], [11, 21]), (depth2[1], [12, 22]),
                             (depth2[2], [12, 23])]:
            llama.setup_cache(32)
            ref = llama(torch.cat([prefix, torch.tensor(path)]))[0]
            assert torch.allclose(logits, ref[-1], atol=1e-5), path
        llama.setup_cache(32)
        llama(prefix)
        llama(torch.tensor([11, 12]))
        with pytest.raises(PolyspecError, match="tree_mask"):
            llama(torch.tensor([21]), tree_mask=torch.ones(1, 10, dtype=torch.bool))  # K = 9 > cache_len 8


@pytest.mark.parametrize("src, kept", [([6, 8, 9], [11, 33, 44]), ([6, 7], [11, 22])],
                         ids=["a-c-d: moved", "a-b: already in place"])
def test_compact_keeps_accepted_path(llama, src, kept):
    """Accepting a path of the tree (a, c, d: c and d move back; a, b: nothing moves) leaves the cache a causal pass
    over prefix + path builds, and the next step's logits."""
    prefix = _ids(6, 5)
    tokens, mask, offsets = _tree()
    nxt = torch.tensor([55])
    n = 6 + len(kept)
    with torch.no_grad():
        llama.setup_cache(32)
        llama(prefix)
        llama(tokens, tree_mask=mask, position_offsets=offsets)
        llama.compact(torch.tensor(src), 6)
        assert llama.cache_len == n
        after = llama(nxt)[0]
        got = [(k[:, :, :n + 1].clone(), v[:, :, :n + 1].clone()) for k, v in zip(llama._cache.k, llama._cache.v,
                                                                                   strict=True)]
        llama.setup_cache(32)
        fresh = llama(torch.cat([prefix, torch.tensor(kept), nxt]))[0]
    assert torch.allclose(after[-1], fresh[-1], atol=1e-5)
    for (k, v), k2, v2 in zip(got, llama._cache.k, llama._cache.v, strict=True):
        assert torch.allclose(k, k2[:, :, :n + 1], atol=1e-5) and torch.allclose(v, v2[:, :, :n + 1], atol=1e-5)


def test_cache_overflow_and_bad_input_are_clear_errors(llama):
    llama.setup_cache(8)
    with torch.no_grad():
        llama(_ids(6))
        with pytest.raises(PolyspecError, match="max_seq_len"):
            llama(_ids(3))
        assert llama.cache_len == 6  # a refused block changes nothing
        with pytest.raises(PolyspecError, match="tree_mask"):
            llama(_ids(2), tree_mask=torch.ones(3, 3, dtype=torch.bool))
        with pytest.raises(PolyspecError, match="diagonal"):
            llama(_ids(2), tree_mask=torch.zeros(2, 2, dtype=torch.bool))
        with pytest.raises(PolyspecError, match="compact"):
            llama.compact(torch.tensor([7]), 0)


def test_unsupported_model_type_is_named():
    with pytest.raises(PolyspecError, match="gemma3"):
        ModelArgs.from_hf_config({"model_type": "gemma3", "hidden_size": 8})


def test_mistral_sliding_window_guard(llama_dir, tmp_path):
    cfg = json.loads((llama_dir / "config.json").read_text())
    args = ModelArgs.from_hf_config({**cfg, "model_type": "mistral", "sliding_window": 16})
    model = Transformer(args)
    with pytest.raises(PolyspecError, match="sliding_window"):
        model.setup_cache(32)
    model.setup_cache(16)


def test_missing_weights_are_reported(llama_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((llama_dir / "config.json").read_text())
    tensors = load_file(str(llama_dir / "model.safetensors"))
    tensors.pop("model.norm.weight")
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(PolyspecError, match="norm.weight"):
        Transformer.from_pretrained(broken)


# ---------------------------------------------------------------------------------------------------------------
# Slow tier: the real SmolLM2
# ---------------------------------------------------------------------------------------------------------------


CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.mark.slow
def test_smollm2_parity_and_greedy(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    text = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    ids = torch.tensor(tok(text)["input_ids"])
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    model = Transformer.from_pretrained(smollm2_dir)
    model.setup_cache(ids.numel() + 40)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
        logits, _ = model(ids)
        assert (logits - ref).abs().max().item() <= TOL
        hf_out = hf.generate(ids[None], max_new_tokens=32, do_sample=False)[0, ids.numel():]
        out = []
        nxt = int(logits[-1].argmax())
        for _ in range(32):
            out.append(nxt)
            nxt = int(model(torch.tensor([nxt]))[0][-1].argmax())
    assert len(hf_out) >= 8  # (generate stops early at the end-of-turn token)
    assert out[: len(hf_out)] == hf_out.tolist()


@pytest.mark.parametrize("t", [1, 3, 16])
@pytest.mark.parametrize("mask_kind", ["none", "2d", "4d"])
def test_attend_matmul_matches_sdpa(t, mask_kind):
    """The two-matmul attention that 16-bit CPU inputs at decode widths take equals torch's SDPA (fp32, K/V heads
    repeated per group) on the same bf16 inputs, with every mask shape the layers pass; it is what attend() picks."""
    import torch.nn.functional as F

    from polyspec.decode import model as m

    g = torch.Generator().manual_seed(t)
    b, h, kv, s, d = 3, 6, 2, 40, 32
    q = torch.randn(b, h, t, d, generator=g).bfloat16()
    k, v = (torch.randn(b, kv, s, d, generator=g).bfloat16() for _ in range(2))
    mask = {"none": None, "2d": torch.rand(t, s, generator=g) > 0.3,
            "4d": torch.rand(b, 1, t, s, generator=g) > 0.3}[mask_kind]
    if mask is not None:
        mask[..., 0] = True  # no empty row
    ref = F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(h // kv, 1),
                                         v.float().repeat_interleave(h // kv, 1), attn_mask=mask)
    with torch.inference_mode():
        got = m.attend(q, k, v, mask)
    assert got.dtype == torch.bfloat16 and (got.float() - ref).abs().max().item() < 2e-2
    assert torch.equal(got, m.attend_matmul(q, k, v, mask))  # the small 16-bit case takes the matmuls
    with torch.inference_mode():
        wide = m.attend(q.float(), k.float(), v.float(), mask)  # fp32 stays on SDPA
    assert (wide - ref).abs().max().item() < 1e-5
