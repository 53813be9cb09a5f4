"""One decoder layer, three ways to run it: every architecture ModelArgs.from_hf_config accepts x {the reference
Python layer, the C++ CPU kernel, the static (CUDA-graph) step}, on tiny random models at fp32, bf16 and int4 and as an
EAGLE head's layer; and the CPU kernel's declared support (cpu_kernels.LAYER_SUPPORT) deciding which layers it
may take."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from polyspec.decode import cpu_kernels as ck
from polyspec.decode import cuda_graphs
from polyspec.decode.head import EagleHead
from polyspec.decode.int4 import quantize_model_rtn
from polyspec.decode.model import LAYER_FIELDS, ModelArgs, Transformer, layer_features, rope_inv_freq
from polyspec.errors import PolyspecError

needs_kernels = pytest.mark.skipif(not ck.available(), reason=f"no CPU kernel library: {ck.failure()}")

VOCAB = 256
_BASE = {"vocab_size": VOCAB, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
         "hidden_act": "silu"}

# Tiny configs of every model type from_hf_config accepts, and the optional layer features each brings.
ARCHS = {
    "llama": {"model_type": "llama"},  # GQA, no biases
    "llama-mha": {"model_type": "llama", "num_key_value_heads": 4},
    "llama-biases": {"model_type": "llama", "attention_bias": True, "mlp_bias": True},  # q/k/v/o and MLP biases
    # an MLP width that is no multiple of the threads' 32-row units nor of 16 (the activations' tail)
    "llama-odd-mlp": {"model_type": "llama", "intermediate_size": 200, "mlp_bias": True},
    "llama3-rope": {"model_type": "llama", "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                            "original_max_position_embeddings": 16}},
    "qwen2": {"model_type": "qwen2", "tie_word_embeddings": True, "rms_norm_eps": 1e-6},  # q/k/v bias, no o bias
    "mistral": {"model_type": "mistral", "sliding_window": 64},
    # SmolLM2's proportions: 3 query heads per kv head, head_dim 64, tied embeddings
    "smollm2": {"model_type": "smollm2", "hidden_size": 192, "intermediate_size": 512, "num_attention_heads": 3,
                "num_key_value_heads": 1, "tie_word_embeddings": True},
}

# (tokens, tree mask, position offsets) per forward: a prefill that fits the kernel's and the static step's widths,
# two decode steps, a causal verification of 5 (a static bucket of 8 with 3 padding rows), a draft tree, a decode step
_TREE = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
BLOCKS = [(12, None, None), (1, None, None), (1, None, None), (5, None, None),
          (4, _TREE, torch.tensor([0, 1, 1, 2])), (1, None, None)]


def _args(arch: str) -> ModelArgs:
    return ModelArgs.from_hf_config({**_BASE, **ARCHS[arch]})


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Random init leaves norms at 1 and biases small: make every parameter matter."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))


def _model(arch: str, level: str) -> torch.nn.Module:
    """A tiny random model of ``arch`` at ``level``: fp32, bf16, int4 (RTN, group 64) or an fp32 EAGLE
    head."""
    args = _args(arch)
    torch.manual_seed(0)
    target = Transformer(args).eval()
    _randomise(target, 1)
    if level == "head":
        torch.manual_seed(2)
        head = EagleHead(args, target.embed_tokens, target.lm_head).eval()
        _randomise(head, 3)
        return head
    if level == "int4":
        quantize_model_rtn(target, group_size=64, sym=False)
    if level == "bf16":
        target.to(torch.bfloat16)
        target.inv_freq = rope_inv_freq(args)  # as from_pretrained keeps it: float32
    return target


def _script(model: torch.nn.Module) -> tuple[torch.Tensor, ...]:
    """Run BLOCKS through a fresh cache: (logits, hidden of every row, K and V of every position held)."""
    g = torch.Generator().manual_seed(5)
    n = sum(t for t, _, _ in BLOCKS)
    ids = torch.randint(0, VOCAB, (n,), generator=g)
    feats = torch.randn(n, model.args.hidden_size, generator=g) if isinstance(model, EagleHead) else None
    model.setup_cache(48)
    logits, hidden, pos = [], [], 0
    with torch.inference_mode():
        for t, mask, offsets in BLOCKS:
            extra = () if feats is None else (feats[pos:pos + t].to(model._compute_dtype()),)
            out = model(ids[pos:pos + t], *extra, tree_mask=mask, position_offsets=offsets)
            logits.append(out[0].float())
            hidden.append(out[1].float())
            pos += t
        cache = model._cache
        k = torch.cat([k[:, :, :cache.length].float() for k in cache.k])
        v = torch.cat([v[:, :, :cache.length].float() for v in cache.v])
    return torch.cat(logits), torch.cat(hidden), k, v


def _int4_reference_mode() -> str:
    """The POLYSPEC_INT4_REFERENCE value whose dequantised matmul takes the activations as the kernel does."""
    return "bf16" if (ck.dot_path() or "").startswith("avx512-bf16") else "1"


def _reference(model, monkeypatch, static: bool = False) -> tuple[torch.Tensor, ...]:
    """The reference layer's outputs (the fast path off; int4 as the dequantised matmul), on the dynamic cache or,
    with ``static``, on static steps (each BLOCKS forward must be one)."""
    model = copy.deepcopy(model)
    runner = cuda_graphs.enable(model, graphs=False) if static else None
    old = ck.set_enabled(False)
    monkeypatch.setenv("POLYSPEC_INT4_REFERENCE", _int4_reference_mode())
    try:
        out = _script(model)
    finally:
        ck.set_enabled(old)
        monkeypatch.delenv("POLYSPEC_INT4_REFERENCE")
    if static:
        assert runner.replays == len(BLOCKS)
    return out


def _kernel(model, monkeypatch) -> tuple[torch.Tensor, ...]:
    """The outputs with every layer of every forward on the C++ layer kernel (asserted, not assumed)."""
    model = copy.deepcopy(model)
    layers = model._layers()
    assert all(ck.layer_plan(layer) is not None for layer in layers)
    calls = []
    real, block = ck.run_layers, ck.run_block
    monkeypatch.setattr(ck, "run_layers", lambda plans, *a, **k: calls.append(len(plans)) or real(plans, *a, **k))
    monkeypatch.setattr(ck, "run_block", lambda b, *a, **k: calls.append(len(b.plans)) or block(b, *a, **k))
    forward = ck.run_forward
    monkeypatch.setattr(ck, "run_forward", lambda b, *a, **k: calls.append(len(b.plans)) or forward(b, *a, **k))
    out = _script(model)
    assert calls == [len(layers)] * len(BLOCKS)
    return out


def _close(got, ref, rtol: float) -> None:
    """Each output within rtol of the largest magnitude of its reference (logits, hidden, K, V)."""
    for name, a, b in zip(("logits", "hidden", "k", "v"), got, ref, strict=True):
        err = ((a - b).abs().max() / b.abs().max()).item()
        assert err <= rtol, (name, err)


# Tolerances, relative to each output's largest magnitude. fp32: 1e-5 — the paths differ only in summation order (the
# kernel's dot products, torch's GEMM and SDPA), ~1e-7 per op, through 2 layers; a missing bias, a wrong RoPE or mask
# is off by O(1e-2) or more. bf16: the reference rounds every intermediate to bf16, the kernel keeps an fp32 residual
# stream inside a block, so they differ by bf16 roundings (2^-8 each): 3e-2. int4 on the kernel: with the
# AVX512-BF16 rows the activations are rounded to bf16 per linear (the reference rounds them likewise), and a last-bit
# fp32 difference upstream can move a rounding step, hence 1e-2; on the portable rows fp32's 1e-5. The static step
# runs the reference layer itself, its RoPE, K/V write and attention through the step's op (on the CPU the op's
# reference form: model.apply_rope and model.attend over the valid slots), so fp32's 1e-5 everywhere but bf16 (3e-2).
def _tol(level: str, path: str) -> float:
    if level == "bf16":
        return 3e-2
    if level == "int4" and path == "kernel" and (ck.dot_path() or "").startswith("avx512-bf16"):
        return 1e-2
    return 1e-5


# every arch at every level but the odd MLP width in int4, whose rows need K (down's K: the MLP width) a multiple of 32
_CASES = [(a, lv) for a in ARCHS for lv in ("fp32", "bf16", "int4", "head") if (a, lv) != ("llama-odd-mlp", "int4")]


@needs_kernels
@pytest.mark.parametrize(("arch", "level"), _CASES, ids=[f"{a}-{lv}" for a, lv in _CASES])
def test_reference_kernel_and_static_step_agree(arch, level, monkeypatch):
    model = _model(arch, level)
    ref = _reference(model, monkeypatch)
    _close(_kernel(model, monkeypatch), ref, _tol(level, "kernel"))
    _close(_reference(model, monkeypatch, static=True), ref, _tol(level, "static"))


@needs_kernels
@pytest.mark.parametrize("level", ["fp32", "bf16", "int4"])
def test_a_causal_blocks_layers_in_one_call_equal_them_one_by_one(level, monkeypatch):
    """A block's layers in one kernel call (cpu_kernels.run_block: RoPE from a table, the mask made in C; for a bf16
    model run_forward, with the embedding, the final norm and the lm_head) give bitwise the logits, hidden states and
    cache of a kernel call per layer (run_layers) and the norm and lm_head after it, and every forward at a cache
    takes them, a draft tree's (its positions and mask) too. Over bf16 weights in 16-row blocks, a weight changed in
    place between two forwards on one cache is seen by both paths alike (the block is rebuilt, not stale)."""
    model = _model("smollm2", level)
    by_layer = copy.deepcopy(model)
    if level == "bf16":
        for m in (model, by_layer):
            assert ck.make_blocks([w.weight for w in m.modules() if type(w).__name__ == "Linear"], force=True) > 0
    taken = []
    for name in ("run_block", "run_forward"):  # the layers alone, or (a bf16 model) its whole forward
        real = getattr(ck, name)
        monkeypatch.setattr(ck, name, lambda b, *a, real=real, **k: taken.append(len(b.plans)) or real(b, *a, **k))
    one_call = _script(model)
    assert taken == [len(model.layers)] * len(BLOCKS)
    with monkeypatch.context() as mp:
        mp.setattr(ck, "layer_block", lambda *a, **k: None)
        assert all(torch.equal(a, b) for a, b in zip(one_call, _script(by_layer), strict=True))
        if level != "bf16":
            return
        outs = [_changed_between_forwards(by_layer)]
    outs.append(_changed_between_forwards(model))
    assert torch.equal(*outs) and len(taken) == len(BLOCKS) + 2


@needs_kernels
@pytest.mark.parametrize("level", ["fp32", "bf16", "int4"])
def test_a_tree_that_sees_earlier_nodes_runs_in_one_call_bitwise(level, monkeypatch):
    """A draft model's tree forward under a mask [T, K + T] that reaches K cached positions (earlier tree nodes, some
    hidden from some rows; tree.py's drafting) runs in one kernel call and gives bitwise the per-layer path's logits,
    hidden states and cache. A mask hiding a row from itself is refused before anything is written: in a bf16 model's
    one-call forward by the kernel (decode_step skips the Python check's torch ops), elsewhere before the call."""
    model = _model("smollm2", level)
    by_layer = copy.deepcopy(model)
    taken = []
    for name in ("run_block", "run_forward"):
        real = getattr(ck, name)
        monkeypatch.setattr(ck, name, lambda b, *a, real=real, **k: taken.append(len(b.plans)) or real(b, *a, **k))
    one_call = _tree_script(model)
    assert taken == [len(model.layers)] * 3
    with monkeypatch.context() as mp:
        mp.setattr(ck, "layer_block", lambda *a, **k: None)
        assert all(torch.equal(a, b) for a, b in zip(one_call, _tree_script(by_layer), strict=True))
    model.setup_cache(32)
    with torch.inference_mode():
        model(torch.arange(4))
        bad = torch.ones(2, 3, dtype=torch.bool)
        bad[1, 2] = False
        with pytest.raises(PolyspecError, match="itself"):
            model(torch.arange(2), tree_mask=bad, position_offsets=torch.tensor([0, 1]))
    assert model.cache_len == 4 and len(taken) == (5 if level == "bf16" else 4)


def _tree_script(model: torch.nn.Module) -> tuple[torch.Tensor, ...]:
    """A prompt, two tree nodes (a root and its child), three more whose mask [3, 5] sees those two in part:
    (logits, hidden, K and V of every position held)."""
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(0, VOCAB, (14,), generator=g)
    sees = torch.tensor([[1, 0, 1, 0, 0], [1, 1, 1, 1, 0], [0, 0, 1, 0, 1]], dtype=torch.bool)
    model.setup_cache(32)
    with torch.inference_mode():
        outs = [model(ids[:9]),
                model(ids[9:11], tree_mask=torch.tensor([[1, 0], [1, 1]], dtype=torch.bool),
                      position_offsets=torch.tensor([0, 1])),
                model(ids[11:], tree_mask=sees, position_offsets=torch.tensor([1, 2, 1]))]
        cache = model._cache
        k = torch.cat([k[:, :, :cache.length].float() for k in cache.k])
        v = torch.cat([v[:, :, :cache.length].float() for v in cache.v])
    return torch.cat([o[0].float() for o in outs]), torch.cat([o[1].float() for o in outs]), k, v


def _changed_between_forwards(model: torch.nn.Module) -> torch.Tensor:
    """A prompt, a weight of layer 1 scaled in place, a decode step on the same cache: that step's logits."""
    ids = torch.arange(9) * 7 % VOCAB
    model.setup_cache(32)
    with torch.inference_mode():
        model(ids[:8])
    with torch.no_grad():
        model.layers[1].mlp.down_proj.weight.mul_(1.5)
    with torch.inference_mode():
        return model(ids[8:])[0]


@needs_kernels
def test_within_a_frozen_span_the_one_call_arguments_are_built_once(monkeypatch):
    """Inside a weights_frozen span a bf16 model's one-call forward builds its kernel arguments (ck.ForwardArgs: ~15
    tensor attributes read, each cold after a forward) at its first forward and reuses them, a draft tree's call too,
    with the bits of building them per forward; a new cache builds them anew; a block past the cache's room still
    gets the checked path's error, and with the kernels turned off the one-call path is left."""
    model = _model("smollm2", "bf16")
    assert ck.make_blocks([w.weight for w in model.modules() if type(w).__name__ == "Linear"], force=True) > 0
    twin = copy.deepcopy(model)
    built = []
    real = ck.ForwardArgs
    monkeypatch.setattr(ck, "ForwardArgs", lambda *a: built.append(1) or real(*a))
    ids = (torch.arange(40) * 7 % VOCAB).tolist()
    blocks = [(0, 8, False), (8, 1, True), (9, 3, False), (12, 2, True)]

    def steps(m: Transformer) -> list[torch.Tensor]:
        outs = []
        for _ in range(2):  # the second time on a new cache
            m.setup_cache(16)
            for start, t, last in blocks:
                outs += m.decode_step(ids[start:start + t], last)
            siblings = torch.eye(2, dtype=torch.bool)  # a depth-1 draft tree: two children of position 13
            outs += m.decode_step(ids[14:16], positions=[14, 14], tree_mask=siblings)
            m.truncate(14)
        return outs

    with torch.inference_mode():
        with ck.weights_frozen():
            kept = steps(model)
            assert len(built) == 2
            with pytest.raises(PolyspecError, match="max_seq_len"):
                model.decode_step(ids[14:17])
            old = ck.set_enabled(False)
            try:
                assert model.decode_step(ids[14:15]) is None
            finally:
                ck.set_enabled(old)
        built.clear()
        fresh = steps(twin)
        assert len(built) == 2 * (len(blocks) + 1)
    assert all(torch.equal(a, b) for a, b in zip(kept, fresh, strict=True))


@needs_kernels
def test_within_a_frozen_span_a_block_is_checked_once(monkeypatch):
    """Inside cpu_kernels.weights_frozen (a generation) a cached block is checked against its layers once, not per
    forward; outside one every forward checks it, so a weight changed in place after the span is seen (the block is
    rebuilt). ChainDecoder.generate runs inside one span."""
    model = _model("smollm2", "bf16")  # in 16-row blocks: a weight changed in place makes the block stale
    assert ck.make_blocks([w.weight for w in model.modules() if type(w).__name__ == "Linear"], force=True) > 0
    checks = []
    real = ck._block_current
    monkeypatch.setattr(ck, "_block_current", lambda *a: checks.append(1) or real(*a))
    ids = torch.arange(12) * 5 % VOCAB
    model.setup_cache(32)
    with torch.inference_mode(), ck.weights_frozen():
        for i in range(6):  # the first forward builds the block: current by construction
            model(ids[i:i + 1])
    assert checks == []
    with torch.inference_mode():
        model(ids[6:7])
        model(ids[7:8])
    assert len(checks) == 2
    block = next(iter(model._cache.layer_blocks.values()))
    with torch.no_grad():
        model.layers[1].mlp.down_proj.weight.mul_(1.5)
    with torch.inference_mode():
        model(ids[8:9])
    assert next(iter(model._cache.layer_blocks.values())) is not block

    from polyspec.decode.chain import ChainDecoder
    from polyspec.decode.levels import ModelLevel

    spans = []
    monkeypatch.setattr(ck, "weights_frozen", lambda real=ck.weights_frozen: spans.append(1) or real())
    checks.clear()
    result = ChainDecoder([ModelLevel(model, "t")], max_seq_len=64).generate([1, 2, 3], 8)
    assert len(result.token_ids) == 8 and spans == [1] and checks == []


def test_every_model_type_is_covered():
    from polyspec.decode.model import SUPPORTED_MODEL_TYPES

    assert {cfg["model_type"] for cfg in ARCHS.values()} == set(SUPPORTED_MODEL_TYPES)
    feats = set().union(*(layer_features(_args(a)) for a in ARCHS))
    assert feats == ck.LAYER_SUPPORT.features  # every feature the kernel declares is exercised above


# ---------------------------------------------------------------------------------------------------------------
# Declared support: what decides that a layer may run on the kernel


def test_every_model_args_field_is_placed():
    """A new ModelArgs field must say where it enters the layer (LAYER_FIELDS); a feature field must change
    layer_features, so a backend that does not declare it stops taking the layer."""
    placed = [f for group in LAYER_FIELDS.values() for f in group]
    assert sorted(placed) == sorted(f.name for f in dataclasses.fields(ModelArgs))
    base = _args("llama")
    for name in LAYER_FIELDS["features"]:
        if name == "extra":
            continue
        flipped = dataclasses.replace(base, **{name: True})
        assert layer_features(flipped) != layer_features(base), name


def test_an_unsupported_activation_is_refused():
    with pytest.raises(PolyspecError, match="hidden_act 'gelu'"):
        ModelArgs.from_hf_config({**_BASE, "model_type": "llama", "hidden_act": "gelu"})
    with pytest.raises(PolyspecError, match="hidden_act 'gelu'"):
        dataclasses.replace(_args("llama"), extra={"hidden_act": "gelu"})


@needs_kernels
def test_a_feature_the_kernel_does_not_declare_takes_the_reference_layer(monkeypatch):
    """A kernel without MLP biases never runs a layer that has them (layer_plan None, run_layers not called), and
    the forward still equals the reference; a layer naming a feature nobody declared (a new flag) likewise."""
    model = _model("llama-biases", "fp32")
    ref = _reference(model, monkeypatch)
    no_mlp_bias = dataclasses.replace(ck.LAYER_SUPPORT, features=ck.LAYER_SUPPORT.features - {"mlp_bias"})
    with monkeypatch.context() as mp:
        mp.setattr(ck, "LAYER_SUPPORT", no_mlp_bias)
        fast = copy.deepcopy(model)
        assert all(ck.layer_plan(layer) is None for layer in fast.layers)
        assert no_mlp_bias.missing(fast.layers[0]) == {"mlp_bias"}
        for name in ("run_layers", "run_block", "run_forward"):
            mp.setattr(ck, name, lambda *a, **k: pytest.fail("the kernel ran an undeclared layer"))
        _close(_script(fast), ref, 1e-5)
    fresh = copy.deepcopy(model)
    assert ck.layer_plan(fresh.layers[0]) is not None
    fresh.layers[1].features = fresh.layers[1].features | {"qk_norm"}
    assert ck.layer_plan(fresh.layers[1]) is None and ck.LAYER_SUPPORT.missing(fresh.layers[1]) == {"qk_norm"}


@needs_kernels
@pytest.mark.parametrize("level", ["fp32", "bf16", "int4"])
def test_smollm2_shaped_layers_take_the_kernel(level):
    """The performance case: a layer of SmolLM2-135M's real shape (its config.json values) runs on the kernel."""
    cfg = {"model_type": "llama", "vocab_size": 512, "hidden_size": 576, "intermediate_size": 1536,
           "num_hidden_layers": 1, "num_attention_heads": 9, "num_key_value_heads": 3, "rms_norm_eps": 1e-5,
           "rope_theta": 100000, "tie_word_embeddings": True, "hidden_act": "silu", "max_position_embeddings": 8192}
    model = Transformer(ModelArgs.from_hf_config(cfg)).eval()
    if level == "int4":
        quantize_model_rtn(model, group_size=128)
    if level == "bf16":
        model.to(torch.bfloat16)
    plan = ck.layer_plan(model.layers[0])
    assert plan is not None and plan.kind == {"fp32": "f32", "bf16": "bf16", "int4": "i4"}[level]
