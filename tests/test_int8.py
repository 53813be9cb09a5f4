"""polyspec.decode.int8: per-row int8 quantisation, Int8Linear's kernel rows against its reference (both builds), the
int8 copy of a bf16 model, and chains with an int8 level that stay exactly the target's greedy output."""

from __future__ import annotations

import pytest
import torch
from test_cpu_kernels import _with_portable_build

from polyspec.decode import cpu_kernels as ck
from polyspec.decode.chain import ChainDecoder
from polyspec.decode.head import EagleHead
from polyspec.decode.int8 import CODE_MAX, Int8Linear, int8_copy, quantize_rows
from polyspec.decode.levels import HeadLevel, ModelLevel
from polyspec.decode.model import ModelArgs, Transformer, rope_inv_freq
from polyspec.errors import PolyspecError

needs_kernels = pytest.mark.skipif(not ck.available(), reason=f"no CPU kernel library: {ck.failure()}")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_rows_round_to_nearest_with_one_symmetric_scale_each():
    w = torch.randn(40, 96, generator=_gen(1))
    w[3] = 0.0
    q, s = quantize_rows(w)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and q.shape == w.shape and s.shape == (40,)
    assert int(q.abs().max()) == CODE_MAX and torch.equal(q[3], torch.zeros(96, dtype=torch.int8)) and s[3] == 1.0
    err = (q.float() * s[:, None] - w).abs()
    assert (err <= s[:, None] / 2 + 1e-7).all()  # round to nearest: within half a step
    with pytest.raises(PolyspecError, match="2-D"):
        quantize_rows(torch.zeros(3))


def _layer(n: int, k: int, seed: int) -> Int8Linear:
    g = _gen(seed)
    lin = torch.nn.Linear(k, n, bias=True).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g))
        lin.bias.copy_(torch.randn(n, generator=g))
    return Int8Linear.from_linear(lin)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13])
def test_kernel_rows_equal_the_reference_to_one_rounding_and_are_batch_invariant(rows):
    """The codes are exact in bf16, so the kernel sums the same exact products as the reference (fp32 sums in another
    order): the two agree to one bf16 rounding of the output; a row's result does not depend on its neighbours."""
    mod = _layer(300, 576, 2)
    x = torch.randn(rows, 576, generator=_gen(3)).bfloat16()
    with torch.inference_mode():
        fast = ck.int8_linear(x, mod)
        old = ck.set_enabled(False)
        try:
            ref = mod(x)
        finally:
            ck.set_enabled(old)
        alone = torch.cat([ck.int8_linear(x[i:i + 1], mod) for i in range(rows)])
    assert fast is not None and fast.dtype == torch.bfloat16
    exact = (x.double() @ mod.qweight.double().t()) * mod.scale.double() + mod.bias.double()
    for y in (fast, ref):
        assert ((y.double() - exact).abs() <= 2 ** -7 * exact.abs() + 1e-2).all()
    assert torch.equal(fast, alone)


@needs_kernels
def test_both_int8_row_kernels_compute_the_same_sums(tmp_path, monkeypatch):
    """The AVX512-BF16 rows (where built) and the portable ones widen the codes exactly: same values to one bf16
    rounding of the output."""
    mod = _layer(200, 1536, 4)
    x = torch.randn(5, 1536, generator=_gen(5)).bfloat16()
    with torch.inference_mode():
        native, native_path = ck.int8_linear(x, mod), ck.dot_path()
        portable, portable_path = _with_portable_build(tmp_path, monkeypatch, lambda: ck.int8_linear(x, mod))
    assert portable_path == "fp32" and native_path in ("fp32", "avx512-bf16")
    assert ((native.double() - portable.double()).abs() <= 2 ** -7 * portable.double().abs() + 1e-2).all()


@needs_kernels
def test_the_kernel_declines_what_it_cannot_take():
    mod = _layer(64, 100, 6)  # in_features not a multiple of 32
    x = torch.randn(2, 100).bfloat16()
    assert ck.int8_linear(x, mod) is None and mod(x).shape == (2, 64)
    mod = _layer(64, 128, 7)
    assert ck.int8_linear(torch.randn(2, 128), mod) is None  # fp32 input: the reference
    assert ck.int8_linear(torch.randn(40, 128).bfloat16(), mod) is None  # wider than the rows the kernel takes


def _tiny_bf16(seed: int = 0) -> Transformer:
    args = ModelArgs.from_hf_config({"model_type": "llama", "vocab_size": 96, "hidden_size": 128,
                                     "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
                                     "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
                                     "hidden_act": "silu", "tie_word_embeddings": True})
    torch.manual_seed(seed)
    model = Transformer(args).eval().to(torch.bfloat16)
    model.inv_freq = rope_inv_freq(args)
    return model


def test_the_copy_is_int8_untied_and_leaves_the_model_alone():
    model = _tiny_bf16()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    copy = int8_copy(model)
    assert all(isinstance(getattr(layer.self_attn, n), Int8Linear) for layer in copy.layers for n in ("q_proj", "o_proj"))
    assert isinstance(copy.lm_head, Int8Linear) and copy.embed_tokens.weight.dtype == torch.bfloat16
    assert torch.equal(copy.embed_tokens.weight, model.embed_tokens.weight)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    with pytest.raises(PolyspecError, match="bf16 model"):
        int8_copy(model.float())


def _greedy(levels, prompt, n, **kw):
    return ChainDecoder(levels, max_seq_len=96, **kw).generate(prompt, n).token_ids


@pytest.mark.parametrize("kernels", [True, False])
def test_chains_with_an_int8_level_keep_the_targets_greedy_output(kernels):
    """target <- int8 copy (dual: the copy drafts) and target <- int8 copy <- head (the chain, prompt-lookup blocks
    at the bottom): the greedy output is the target's own, on the kernels and on the reference path."""
    old = ck.set_enabled(kernels)
    try:
        target = _tiny_bf16(1)
        low = int8_copy(target)
        head = EagleHead(target.args, target.embed_tokens, target.lm_head).eval().to(torch.bfloat16)
        prompt, n = [5, 17, 3, 5, 17], 30
        ar = _greedy([ModelLevel(target, "t")], prompt, n)
        assert _greedy([ModelLevel(target, "t"), ModelLevel(low, "i8")], prompt, n, draft_k=3) == ar
        chain = [ModelLevel(target, "t"), ModelLevel(low, "i8"), HeadLevel(head, "d")]
        starts = []
        real = low.forward
        low.forward = lambda ids, *a, **kw: (starts.append(low.cache_len), real(ids, *a, **kw))[1]
        assert _greedy(chain, prompt, n, draft_k=1, mu=[4], draft_lookup=4) == ar
        assert starts[0] == len(prompt) - 1  # the copy took the target's K/V of the prompt: no prefill of its own
    finally:
        ck.set_enabled(old)


def test_the_chain_search_offers_an_int8_copy_of_a_bf16_target_only():
    from polyspec.export.candidates import CandidateSettings, make_candidates

    target = _tiny_bf16(2)
    settings = CandidateSettings(rtn_group_sizes=(), ngram=False)
    by = {c.name: c for c in make_candidates(ModelLevel(target, "target"), [], settings)}
    assert by["int8"].kind == "int8" and not by["int8"].bottom_only
    assert isinstance(by["int8"].level.model.layers[0].mlp.down_proj, Int8Linear)
    fp32 = make_candidates(ModelLevel(_tiny_bf16(2).float(), "target"), [], settings)
    assert "int8" not in {c.name for c in fp32}
    off = make_candidates(ModelLevel(target, "target"), [], CandidateSettings(rtn_group_sizes=(), ngram=False,
                                                                              int8=False))
    assert "int8" not in {c.name for c in off}
