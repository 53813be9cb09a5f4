"""The EAGLE-3 head (polyspec.decode.head3): the target's auxiliary layer states against Hugging Face's hidden states,
the training-time-test mask and unroll, the folder round trip (identical logits), and decoding through the chain:
greedy dual (linear and tree) equals ``ar`` token for token, and at T > 0 the output is the warped target's
distribution (chi-square on a tiny vocabulary)."""

from __future__ import annotations

import math
from statistics import NormalDist

import pytest
import torch

from polyspec.chain_spec import DraftSpec, TreeShape
from polyspec.decode.chain import ChainDecoder, SamplingParams
from polyspec.decode.head3 import Eagle3Head, default_aux_layers, draft_vocab_ids, init_from_target, ttt_mask
from polyspec.decode.levels import HeadLevel, ModelLevel
from polyspec.decode.model import Transformer
from polyspec.decode.sampling import warp
from polyspec.errors import PolyspecError

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    from conftest import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("t3") / "t", layers=4, tokenizer=None)


HEAD_TYPES = ["eagle3", "eagle3.1"]


def make_head(target: Transformer, draft_size: int, seed: int = 0, head_type: str = "eagle3") -> Eagle3Head:
    """A random EAGLE-3 head over ``target`` whose draft vocabulary is a random subset of ``draft_size`` tokens
    (eagle3.1: its fc_norm weights random around 1, so a norm left out changes the output)."""
    import dataclasses

    torch.manual_seed(seed)
    args = dataclasses.replace(target.args, num_layers=1)
    head = Eagle3Head(args, target.embed_tokens, default_aux_layers(target.args.num_layers), draft_size, head_type)
    counts = torch.randint(0, 1000, (target.args.vocab_size,), generator=torch.Generator().manual_seed(seed))
    if head.fc_norm is not None:
        with torch.no_grad():
            for norm in head.fc_norm:
                norm.weight.copy_(1.0 + 0.3 * torch.randn(norm.weight.shape))
    return init_from_target(head, target, draft_vocab_ids(counts, draft_size)).eval()


def test_aux_layers_are_hf_hidden_states_and_the_cache_is_unchanged(target_dir):
    from transformers import LlamaForCausalLM

    t = Transformer.from_pretrained(target_dir)
    hf = LlamaForCausalLM.from_pretrained(target_dir).eval()
    ids = torch.randint(0, t.args.vocab_size, (11,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hs = hf(ids[None], output_hidden_states=True).hidden_states  # [embeddings, layer 0 out, ...]
        logits, aux = t(ids, aux_layers=(2, 0, 1))
        torch.testing.assert_close(aux, torch.cat([hs[3], hs[1], hs[2]], -1)[0], atol=1e-5, rtol=1e-5)
        ref_logits, _ = t(ids)
        torch.testing.assert_close(logits, ref_logits)
    t.setup_cache(32)  # cached, in two blocks: the same states, and a cache that later plain forwards continue
    with torch.inference_mode():
        _, a1 = t(ids[:6], aux_layers=(2, 0, 1))
        l2, a2 = t(ids[6:], aux_layers=(2, 0, 1))
        torch.testing.assert_close(torch.cat([a1, a2]), aux, atol=1e-5, rtol=1e-5)
        t.truncate(6)
        l3, _ = t(ids[6:])
    torch.testing.assert_close(l3, l2)
    with pytest.raises(PolyspecError, match="auxiliary layer ids"):
        t(ids, aux_layers=(4,))


def test_default_aux_layers():
    assert default_aux_layers(30) == [1, 14, 26]  # SmolLM2-135M: SpecForge's [1, N/2 - 1, N - 4]
    assert default_aux_layers(32) == [1, 15, 28]
    assert default_aux_layers(2) == [0, 0, 0]
    with pytest.raises(PolyspecError):
        default_aux_layers(1)


def test_ttt_mask_sees_the_context_and_its_own_drafts_only():
    t = 5
    for step in range(4):
        m = ttt_mask(t, step)
        assert m.shape == (t, (step + 1) * t)
        for q in range(t):
            for col in range(m.shape[1]):
                s, key = divmod(col, t)
                want = key <= q if s == 0 else key == q  # step 0: the causal context; later steps: its own row
                assert bool(m[q, col]) == want, (step, q, col)


@pytest.mark.parametrize("head_type", HEAD_TYPES)
def test_unroll_step_equals_a_cached_draft(target_dir, head_type):
    """Unroll step k at row t is what the head computes when it drafts k tokens past row t with a cache: its cache
    holds rows 0..t (step 0) and then its own k entries. Checked against forward() with a real cache."""
    t = Transformer.from_pretrained(target_dir)
    head = make_head(t, 64, head_type=head_type)
    ids = torch.randint(0, t.args.vocab_size, (1, 9), generator=torch.Generator().manual_seed(1))
    aux = torch.randn(1, 9, 3 * t.args.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        steps = head.unroll(ids, aux, 3)
    row = 4
    head.setup_cache(16)
    with torch.inference_mode():
        _, h = head(ids[0, :row + 1], head.fuse(aux[0, :row + 1]))  # step 0 over rows 0..row
        torch.testing.assert_close(h, steps[0][1][0, :row + 1], atol=1e-5, rtol=1e-5)
        hid = h[-1:]
        for k in (1, 2):
            logits, hid = head(ids[0, row + k:row + k + 1], hid)  # its own hidden, the next ground-truth token
            torch.testing.assert_close(hid[0], steps[k][1][0, row], atol=1e-5, rtol=1e-5)
            want = steps[k][0][0, row]  # draft-vocabulary logits
            torch.testing.assert_close(logits[0, head.draft_ids], want, atol=1e-4, rtol=1e-4)
            assert torch.isinf(logits[0, ~head.t2d]).all()


def test_eagle31_normalises_each_fused_layer_and_feeds_back_the_normalised_state(target_dir):
    """EAGLE-3.1 against EAGLE-3 with the same weights: g = fc(concat(fc_norm_i(a_i))), the same logits from the same
    g, and the state returned (what the next draft step reads) is norm(the layer output), not the output itself."""
    t = Transformer.from_pretrained(target_dir)
    plain, h31 = make_head(t, 64), make_head(t, 64, head_type="eagle3.1")  # one seed: the same fc, layer, lm_head
    assert plain.fc_norm is None and len(h31.fc_norm) == 3
    aux = torch.randn(6, 3 * t.args.hidden_size, generator=torch.Generator().manual_seed(3))
    ids = torch.tensor([3, 9, 27, 81, 243, 7])
    with torch.no_grad():
        normed = torch.cat([n(a) for n, a in zip(h31.fc_norm, aux.chunk(3, -1), strict=True)], -1)
        g = h31.fuse(aux)
        torch.testing.assert_close(g, plain.fuse(normed), rtol=0, atol=0)
        assert not torch.allclose(g, plain.fuse(aux))
        logits, state = h31(ids, g)
        ref_logits, out = plain(ids, g)
    torch.testing.assert_close(logits, ref_logits)
    torch.testing.assert_close(state, plain.norm(out))
    assert not torch.allclose(state, out)


@pytest.mark.parametrize("head_type", HEAD_TYPES)
def test_save_load_round_trip_gives_identical_logits(target_dir, tmp_path, head_type):
    from safetensors.torch import load_file

    from polyspec.decode.head import load_head, read_head_config, save_head

    t = Transformer.from_pretrained(target_dir)
    head = make_head(t, 100, head_type=head_type)
    out = save_head(head, tmp_path / "h3", {"t": "tiny"})
    cfg = read_head_config(out)
    assert (cfg["head_type"], cfg["aux_layers"], cfg["draft_vocab_size"]) == (head_type, head.aux_layers, 100)
    names = set(load_file(str(out / "model.safetensors")))
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "layer.hidden_norm.weight",
            "layer.self_attn.q_proj.weight"} <= names
    fc_norms = {f"fc_norm.{i}.weight" for i in range(3)}
    assert (fc_norms <= names) == (head_type == "eagle3.1") and not any(n.startswith("embed_tokens") for n in names)
    loaded = load_head(out, t)
    assert type(loaded) is Eagle3Head and torch.equal(loaded.draft_ids, head.draft_ids)
    assert (loaded.head_type, loaded.norm_output) == (head_type, head_type == "eagle3.1")
    aux = torch.randn(5, 3 * t.args.hidden_size)
    with torch.no_grad():
        assert torch.equal(loaded.fuse(aux), head.fuse(aux))
    ids = torch.tensor([3, 9, 27, 81, 243])
    feats = torch.randn(5, t.args.hidden_size)
    with torch.no_grad():
        a, ha = head(ids, feats)
        b, hb = loaded(ids, feats)
    assert torch.equal(a, b) and torch.equal(ha, hb)
    loaded.set_draft_vocab(0)
    loaded.set_draft_vocab(100)
    with pytest.raises(PolyspecError, match="trained with a draft vocabulary"):
        loaded.set_draft_vocab(50)
    # the ONNX head: the same logits (scattered to target ids) and hidden as the head's own forward
    from polyspec.export.onnx_head import export_head_onnx, onnx_parity
    from polyspec.export.package import check_onnx_head

    check_onnx_head(out)
    parity = onnx_parity(loaded, export_head_onnx(loaded, tmp_path / "onnx"))
    assert parity["max_abs_diff_logits"] < 1e-4 and parity["max_abs_diff_hidden"] < 1e-4


@pytest.mark.parametrize("head_type", HEAD_TYPES)
@pytest.mark.parametrize("tree", [None, DraftSpec(tree=TreeShape(top_k=3, depth=4, total_tokens=12))], ids=["linear", "tree"])
def test_greedy_dual_and_chain_with_an_eagle3_head_equal_ar(target_dir, tree, head_type):
    from polyspec.decode.int4 import quantize_model_rtn

    t = Transformer.from_pretrained(target_dir).eval()
    q = quantize_model_rtn(Transformer.from_pretrained(target_dir).eval(), group_size=128)
    head = make_head(t, 200, head_type=head_type)
    prompt = [5, 17, 230, 9, 77, 3]
    ar = ChainDecoder([ModelLevel(t, "t")], max_seq_len=64).generate(prompt, 20).token_ids
    for levels, kw in [([ModelLevel(t, "t"), HeadLevel(head, "head")], {"draft": DraftSpec(k=4)}),
                       ([ModelLevel(t, "t"), ModelLevel(q, "int4"), HeadLevel(head, "head")],
                        {"draft": DraftSpec(k=3), "mu": [4]})]:
        r = ChainDecoder(levels, max_seq_len=64, **(kw | ({"draft": tree} if tree else {}))).generate(prompt, 20)
        assert r.token_ids == ar, r.stats
        assert r.stats["levels"][-1]["tokens_emitted"] > 0  # the head did propose
    # every level above an EAGLE-3 head must be able to return the aux states
    from polyspec.decode.levels import TableLevel

    with pytest.raises(PolyspecError, match="cannot feed the EAGLE-3 head"):
        ChainDecoder([TableLevel(torch.zeros(t.args.vocab_size, t.args.vocab_size), "tab"), HeadLevel(head, "h")])


def test_lookup_blocks_above_an_eagle3_head_keep_greedy_output(target_dir):
    """Rounds whose block prompt lookup proposed leave the head's cache behind; its next forward catches up with the
    fused target states of those positions, and the output stays greedy ar."""
    t = Transformer.from_pretrained(target_dir).eval()
    head = make_head(t, 200)
    prompt = [5, 17, 230, 9, 77, 3, 5, 17, 230, 9, 77, 3, 5, 17]  # repeats: lookup has blocks to propose
    ar = ChainDecoder([ModelLevel(t, "t")], max_seq_len=96).generate(prompt, 30).token_ids
    r = ChainDecoder([ModelLevel(t, "t"), HeadLevel(head, "head")], max_seq_len=96, draft=DraftSpec(k=2, lookup=3)).generate(prompt, 30)
    assert r.token_ids == ar, r.stats
    assert r.level_stats[-1].lookup_tokens > 0 and r.level_stats[-1].tokens_emitted > 0  # both sources proposed


def _chi2_critical(df: int, alpha: float) -> float:
    z = NormalDist().inv_cdf(1 - alpha)
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("tree", [None, pytest.param(DraftSpec(tree=TreeShape(top_k=2, depth=2, total_tokens=4)),
                                                  marks=pytest.mark.slow)], ids=["linear", "tree"])
def test_sampled_output_is_the_warped_target(tmp_path_factory, tree):
    """A tiny-vocabulary target (V = 8) and an EAGLE-3 head whose draft vocabulary leaves 3 target tokens out (they
    can only come from the residual): the first two tokens of many seeded runs against the exact joint."""
    from conftest import make_tiny_llama

    v = 8
    t = Transformer.from_pretrained(make_tiny_llama(tmp_path_factory.mktemp("v8") / "t", layers=4, vocab=v,
                                                    tokenizer=None, seed=3)).eval()
    with torch.no_grad():  # a peaked target, so a random draft is sometimes right and sometimes wrong
        t.lm_head.weight.mul_(8.0)
    head = make_head(t, 5, seed=1)
    sp = SamplingParams(temperature=1.0)
    prompt = [1, 2, 3]
    with torch.no_grad():
        p1 = warp(t(torch.tensor(prompt))[0][-1:], 1.0, 1.0, 0)[0]
        joint = torch.stack([p1[a] * warp(t(torch.tensor(prompt + [a]))[0][-1:], 1.0, 1.0, 0)[0]
                             for a in range(v)]).double().flatten()  # [V * V]
    dec = ChainDecoder([ModelLevel(t, "t"), HeadLevel(head, "head")], draft=tree or DraftSpec(k=2), max_seq_len=16)
    n = 1200
    counts = torch.zeros(v * v, dtype=torch.float64)
    proposed = 0
    for s in range(n):
        r = dec.generate(prompt, 2, sp, seed=s)
        a, b = r.token_ids
        counts[a * v + b] += 1
        proposed += r.stats["levels"][-1]["tokens_emitted"]
    assert proposed > 0
    expected = joint * n
    big = expected >= 5
    e = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    o = torch.cat([counts[big], counts[~big].sum().reshape(1)])
    keep = e > 0
    stat = float(((o[keep] - e[keep]) ** 2 / e[keep]).sum())
    assert stat < _chi2_critical(int(keep.sum()) - 1, 1e-3), stat
    assert int((~head.t2d).sum()) == 3


def test_the_chain_feeds_the_head_fused_target_states(target_dir):
    """The head's first forward reads fc(aux states of the target) for every context position, not the target's
    final hidden state."""
    t = Transformer.from_pretrained(target_dir).eval()
    head = make_head(t, 200)
    seen: list[torch.Tensor] = []
    plain = head.forward

    def spy(ids, feats, **kw):
        seen.append(feats.detach().clone())
        return plain(ids, feats, **kw)

    head.forward = spy
    prompt = [5, 17, 230, 9, 77, 3]
    ChainDecoder([ModelLevel(t, "t"), HeadLevel(head, "head")], draft=DraftSpec(k=2), max_seq_len=32).generate(prompt, 4)
    with torch.no_grad():
        _, aux = Transformer.from_pretrained(target_dir)(torch.tensor(prompt), aux_layers=tuple(head.aux_layers))
        want = head.fuse(aux)[:-1]  # head rows 1..5 read the features of positions 0..4
    torch.testing.assert_close(seen[0], want, atol=1e-4, rtol=1e-4)


def test_a_chain_with_an_eagle31_head_keeps_its_kind_and_decodes_like_ar(tmp_path):
    """The head folder's head_type travels through the chain (assemble, validate, load_chain): the loaded head has
    its norms and weights, and greedy dual decoding equals ar. A folder claiming eagle3.1 without an fc_norm tensor
    is named by the chain's shape check."""
    from conftest import make_tiny_llama
    from safetensors.torch import load_file

    from polyspec.chain_spec import DecodeSpec
    from polyspec.decode.generate import build_decoder, load_chain
    from polyspec.decode.head import read_head_config, save_head
    from polyspec.manifest import assemble_chain
    from polyspec.shapes import head_problems

    target_dir = make_tiny_llama(tmp_path / "t", layers=4)  # with a tokenizer: load_chain reads it
    head = make_head(Transformer.from_pretrained(target_dir), 200, head_type="eagle3.1")
    head_dir = save_head(head, tmp_path / "h", {"t": "tiny"})
    assemble_chain(tmp_path / "c", target_dir, [], head_dir, DecodeSpec(mode="dual", draft={"k": 3}))
    chain = load_chain(tmp_path / "c", device="cpu", dtype="float32")
    loaded = chain.models["draft"]
    assert (type(loaded), loaded.head_type, loaded.norm_output) == (Eagle3Head, "eagle3.1", True)
    mine = head.trainable_state_dict()
    assert all(torch.equal(v, mine[k]) for k, v in loaded.trainable_state_dict().items())
    prompt = [5, 17, 230, 9, 77, 3]
    ar = build_decoder(chain, "ar", max_seq_len=64).generate(prompt, 16)
    dual = build_decoder(chain, "dual", max_seq_len=64).generate(prompt, 16)
    assert dual.token_ids == ar.token_ids and dual.stats["levels"][-1]["tokens_emitted"] > 0
    headers = {k: ("F32", tuple(v.shape)) for k, v in load_file(str(head_dir / "model.safetensors")).items()}
    assert head_problems(read_head_config(head_dir), headers, "draft")[0] == []
    del headers["fc_norm.1.weight"]
    problems, _ = head_problems(read_head_config(head_dir), headers, "draft")
    assert problems == ["draft: the weights have no tensor fc_norm.1.weight (expected [128], from hidden_size 128, "
                        "aux_layers)"]
