"""Static-shape steps (polyspec.decode.cuda_graphs): the eager static path against the model's own forward on the CPU,
and CUDA-graph replay against both on a GPU (marked ``gpu``, skipped without CUDA)."""

from __future__ import annotations

import copy

import pytest
import torch

from polyspec.chain_spec import DraftSpec, TreeShape
from polyspec.decode import cuda_graphs
from polyspec.decode.chain import ChainDecoder
from polyspec.errors import PolyspecError

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from conftest import make_tiny_llama

    from polyspec.decode.head import EagleHead
    from polyspec.decode.int4 import quantize_model_rtn
    from polyspec.decode.model import Transformer

    root = tmp_path_factory.mktemp("static_llamas")
    make_tiny_llama(root / "t", seed=0, tokenizer=None)
    target = Transformer.from_pretrained(root / "t").eval()
    torch.manual_seed(0)
    head = EagleHead(target.args, target.embed_tokens, target.lm_head).eval()
    return {"target": target, "target-bf16": copy.deepcopy(target).to(torch.bfloat16),
            "int4": quantize_model_rtn(Transformer.from_pretrained(root / "t").eval(), 128),
            "head": head, "dir": root / "t"}


def _twin(model, compiled: bool = False):
    """A copy of ``model`` with an eager static runner (the copy's own cache; ``compiled``: the compiled step)."""
    twin = copy.deepcopy(model)
    assert cuda_graphs.runner_of(twin) is None
    runner = cuda_graphs.enable(twin, graphs=False, compiled=compiled)
    assert runner.compiled == compiled
    return twin, runner


def _call(model, ids, feats=None, **kw):
    with torch.inference_mode():
        return model(ids, feats, **kw) if feats is not None else model(ids, **kw)


def _same(a, b, tol=1e-4):
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, atol=tol, rtol=tol)


def _caches_equal(a, b, tol=1e-4):
    n = a.cache_len
    assert n == b.cache_len
    for ka, kb, va, vb in zip(a._cache.k, b._cache.k, a._cache.v, b._cache.v, strict=True):
        torch.testing.assert_close(ka[:, :, :n], kb[:, :, :n], atol=tol, rtol=tol)
        torch.testing.assert_close(va[:, :, :n], vb[:, :, :n], atol=tol, rtol=tol)


def _script(ref, twin, runner, *, head: bool, tol=1e-4):
    """Prefill, decode, verify, roll back, tree forwards with earlier-tree columns, compact: both must agree."""
    g = torch.Generator().manual_seed(3)
    hid = ref.args.hidden_size
    ids = torch.randint(0, ref.args.vocab_size, (64,), generator=g)
    feats = torch.randn(64, hid, generator=g) if head else None

    def both(sl, **kw):
        f = feats[sl] if head else None
        out_ref, out_twin = _call(ref, ids[sl], f, **kw), _call(twin, ids[sl], f, **kw)
        _same(out_ref, out_twin, tol)
        return out_twin

    for m in (ref, twin):
        m.setup_cache(48)
    both(slice(0, 20))  # wider than max_width: the ordinary path (same cache tensors)
    assert runner.replays == 0
    both(slice(20, 21))  # decode width: bucket 1
    both(slice(21, 26))  # a verification of 5: bucket 8 with 3 padding rows
    both(slice(26, 29), last_only=True)
    assert runner.replays == 3
    _caches_equal(ref, twin, tol)
    for m in (ref, twin):
        m.truncate(22)  # rollback: the padding rows' slots past 29 must not matter either
    both(slice(30, 31))
    # a tree: 4 nodes (root, two children, a grandchild) at depth offsets, then 2 more nodes that see 2 cached ones
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    both(slice(31, 35), tree_mask=tree, position_offsets=torch.tensor([0, 1, 1, 2]))
    more = torch.tensor([[1, 0, 1, 0], [0, 1, 1, 1]], dtype=torch.bool)  # [T=2, K=2 cached + 2 block]
    both(slice(35, 37), tree_mask=more, position_offsets=torch.tensor([1, 2]))
    for m in (ref, twin):
        m.compact(torch.tensor([23, 25, 27]), 24)
    both(slice(37, 38))
    _caches_equal(ref, twin, tol)
    assert runner.replays == 7 and runner.captures == 0


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "compiled"])
@pytest.mark.parametrize("kind", ["target", "target-bf16", "int4"])
def test_static_step_matches_the_models_forward(models, kind, compiled):
    ref = copy.deepcopy(models[kind])
    twin, runner = _twin(models[kind], compiled)
    _script(ref, twin, runner, head=False, tol={"target": 1e-4, "target-bf16": 3e-2, "int4": 1e-2}[kind])


def test_compiled_int4_step_first_in_a_generation_reads_packed_weights(models):
    """A generation whose first forward is already a static step (a short prompt): the int4 layers' packed weights
    are built by an eager step first, so the compiled graph only reads them; outputs match the model's forward."""
    from polyspec.decode.int4 import Int4Linear

    ref = copy.deepcopy(models["int4"])
    twin, runner = _twin(models["int4"], compiled=True)
    for m in (ref, twin):
        m.setup_cache(32)
    ids = torch.tensor([3, 9, 27, 81, 243])
    tol = 3e-2  # torch's int4 kernel rounds activations to bf16; the CPU streaming kernel keeps them fp32
    _same(_call(ref, ids), _call(twin, ids), tol)
    assert runner.replays == 1 and not runner._eager_first
    run = [m.__dict__["_fused"] for m in twin.modules() if "_fused" in m.__dict__]  # q/k/v, gate/up: Int4Linear.cat
    run += [lin for layer in twin.layers for lin in (layer.self_attn.o_proj, layer.mlp.down_proj)]
    assert len(run) == 4 * len(twin.layers) and all(isinstance(m, Int4Linear) and m._kernel is not None for m in run)
    _same(_call(ref, torch.tensor([7])), _call(twin, torch.tensor([7])), tol)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_static_step_matches_the_heads_forward(models, compiled):
    ref = copy.deepcopy(models["head"])
    twin, runner = _twin(models["head"], compiled)
    _script(ref, twin, runner, head=True)


def test_a_static_forward_copies_only_the_token_ids_outside_the_step(models, monkeypatch):
    """Positions, slots and visibility are written by the host into one buffer that the step itself copies (inside
    the graph on CUDA): around the step a decode forward dispatches one copy (the ids) and the two output clones."""
    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

    twin, runner = _twin(models["target"])
    twin.setup_cache(32)
    _call(twin, torch.tensor([1, 2, 3]))
    _call(twin, torch.tensor([4]))  # the width-1 bucket's buffers exist from here on
    seen = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view:
                seen.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    step = runner._step

    def unseen(bk):
        with _disable_current_modes():
            return step(bk)

    monkeypatch.setattr(runner, "_step", unseen)
    ids = torch.tensor([5])
    with torch.inference_mode(), Ops():
        twin(ids)
    assert runner.replays == 3 and sorted(seen) == ["clone", "clone", "copy_"], seen


def test_layers_or_trees_outside_the_declared_support_take_the_ordinary_path(models, monkeypatch):
    """A layer feature the step's attention op does not declare, or a tree that sees more earlier nodes than a
    bucket's mask holds: the ordinary forward runs (same results), the static step is not used."""
    ref = copy.deepcopy(models["target"])
    twin, runner = _twin(models["target"])
    for m in (ref, twin):
        m.setup_cache(32)
    _same(_call(ref, torch.tensor([1, 2, 3])), _call(twin, torch.tensor([1, 2, 3])))
    monkeypatch.setattr(cuda_graphs, "TREE_COLUMNS", 1)
    tree = torch.tensor([[1, 0, 1, 0], [0, 1, 1, 1]], dtype=torch.bool)  # sees 2 earlier nodes
    kw = {"tree_mask": tree, "position_offsets": torch.tensor([1, 2])}
    _same(_call(ref, torch.tensor([5, 6]), **kw), _call(twin, torch.tensor([5, 6]), **kw))
    assert runner.replays == 1
    twin.layers[1].features = twin.layers[1].features | {"a_new_feature"}
    runner.invalidate()
    _same(_call(ref, torch.tensor([7])), _call(twin, torch.tensor([7])))
    assert runner.replays == 1


def test_bucket_for():
    assert [cuda_graphs.bucket_for(t, 16) for t in (1, 2, 3, 5, 8, 9, 16, 17)] == [1, 2, 4, 8, 8, 16, 16, None]
    assert cuda_graphs.bucket_for(5, 4) is None and cuda_graphs.bucket_for(3, 4) == 4
    assert cuda_graphs.bucket_for(40, 64) == 64


def test_cache_is_reused_and_invalidated(models):
    twin, runner = _twin(models["target"])
    twin.setup_cache(40)
    k0 = twin._cache.k[0]
    assert k0.shape[2] == 1024 and twin.max_seq_len == 40  # capacity in 1024-slot steps, >= 40 + the slack
    _call(twin, torch.tensor([1, 2, 3]))
    assert runner._buckets and runner._cache_key is not None
    twin.setup_cache(32)  # fits: the same tensors (captured graphs would stay valid), emptied
    assert twin._cache.k[0] is k0 and twin.cache_len == 0 and twin.max_seq_len == 32
    with pytest.raises(PolyspecError, match="max_seq_len"):
        _call(twin, torch.arange(40) % 100)
    _call(twin, torch.tensor([4]))
    key = runner._cache_key
    twin.setup_cache(1010)  # larger than the capacity (1010 + 16 > 1024): new tensors, buffers rebuilt
    assert twin._cache.k[0] is not k0
    _call(twin, torch.tensor([5]))
    assert runner._cache_key != key
    twin.float()  # moving or casting weights drops everything
    assert not runner._buckets and runner._cache_key is None
    assert cuda_graphs.runner_of(copy.deepcopy(twin)) is None


def test_a_new_draft_vocabulary_rebuilds_what_the_steps_read(models):
    """A head's draft-vocabulary rows are read by address by a captured step: a new vocabulary re-syncs the runner,
    and the step's logits follow it (finite exactly on the kept tokens, equal to the module path's)."""
    v = models["target"].args.vocab_size
    twin, runner = _twin(models["head"])
    twin.embed_tokens, twin.lm_head = models["target"].embed_tokens, models["target"].lm_head
    twin.token_counts = torch.randint(0, 100, (v,), generator=torch.Generator().manual_seed(3))
    ref = copy.deepcopy(twin)
    cuda_graphs.disable(ref)
    ids, feats = torch.tensor([3, 9]), torch.randn(2, twin.args.hidden_size)
    key = None
    for size in (64, 32):
        for m in (twin, ref):
            m.set_draft_vocab(size)
            m.setup_cache(16)
        logits, _ = _call(twin, ids, feats)
        assert runner._cache_key != key and runner._buckets
        key = runner._cache_key
        assert torch.equal(torch.isfinite(logits).nonzero()[:, -1].unique(), twin.draft_ids.sort().values)
        _same((logits.masked_fill(~torch.isfinite(logits), 0),),
              (_call(ref, ids, feats)[0].masked_fill(~torch.isfinite(logits), 0),))


def test_ordinary_path_for_training_batches_and_wide_blocks(models):
    twin, runner = _twin(models["target"])
    twin.setup_cache(64, batch_size=2)
    with torch.inference_mode():
        twin(torch.tensor([[1, 2], [3, 4]]))
    assert runner.replays == 0
    twin.setup_cache(64)
    out = twin(torch.tensor([1, 2, 3]))  # autograd on: the ordinary path (the static one writes caches in place)
    assert out[0].requires_grad and runner.replays == 0
    with torch.inference_mode():
        twin(torch.tensor([4]))
    assert runner.replays == 1


def test_enable_checks_its_input(models, monkeypatch):
    with pytest.raises(PolyspecError, match="CUDA"):
        cuda_graphs.enable(copy.deepcopy(models["target"]), graphs=True)
    with pytest.raises(PolyspecError, match="Transformer or EagleHead"):
        cuda_graphs.enable(torch.nn.Linear(2, 2))
    with pytest.raises(PolyspecError, match="max_width"):
        cuda_graphs.enable(copy.deepcopy(models["target"]), graphs=False, max_width=65)
    assert not cuda_graphs.graphs_wanted("cpu")
    monkeypatch.setenv(cuda_graphs.ENV, "0")
    assert not cuda_graphs.graphs_wanted("cuda") and cuda_graphs.enable_for_device({}, "cuda") == 0
    monkeypatch.setenv(cuda_graphs.ENV, "1")
    assert cuda_graphs.graphs_wanted("cuda")


def _levels(t, q, h, static: bool, compiled: bool = False):
    from polyspec.decode.levels import HeadLevel, ModelLevel

    t, q, h = copy.deepcopy(t), copy.deepcopy(q), copy.deepcopy(h)
    h.embed_tokens, h.lm_head = t.embed_tokens, t.lm_head
    if static:
        for m in (t, q, h):
            cuda_graphs.enable(m, graphs=False, compiled=compiled)
    return ModelLevel(t, "t"), ModelLevel(q, "int4"), HeadLevel(h, "head")


@pytest.mark.parametrize("tree,compiled", [(None, False), (DraftSpec(tree=TreeShape(top_k=3, depth=3, total_tokens=8)), False),
                                           pytest.param(DraftSpec(tree=TreeShape(top_k=3, depth=3, total_tokens=8)), True,
                                                        marks=pytest.mark.slow)],
                         ids=["linear", "tree", "tree-compiled"])
def test_greedy_chain_on_static_steps_equals_ar(models, tree, compiled):
    t, q, h = models["target"], models["int4"], models["head"]
    prompt = [5, 17, 230, 9, 77, 3]
    ar = ChainDecoder([_levels(t, q, h, False)[0]], max_seq_len=64).generate(prompt, 20).token_ids
    lt, lq, lh = _levels(t, q, h, True, compiled)
    for levels, kw in [([lt], {}), ([lt, lh], {"draft": DraftSpec(k=4)}), ([lt, lq, lh], {"draft": DraftSpec(k=3), "mu": [4]})]:
        if tree is not None and len(levels) > 1:
            kw = {**kw, "draft": tree}
        r = ChainDecoder(levels, max_seq_len=64, **kw).generate(prompt, 20)
        assert r.token_ids == ar, (levels, r.stats)
    assert all(cuda_graphs.runner_of(lv.model if hasattr(lv, "model") else lv.head).replays > 0
               for lv in (lt, lq, lh))


# ---------------------------------------------------------------------------------------------------------------------
# GPU: the same checks with CUDA graphs captured and replayed


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_replay_matches_the_models_forward(models, dtype, compiled):
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    ref = copy.deepcopy(models["target"]).to("cuda", dtype)
    twin = copy.deepcopy(models["target"]).to("cuda", dtype)
    runner = cuda_graphs.enable(twin, compiled=compiled)
    assert runner.graphs and runner.compiled == compiled
    _script_cuda(ref, twin, runner, tol)
    assert runner.captures == 3  # buckets 1, 8 and 4, each captured once, then replayed


def _script_cuda(ref, twin, runner, tol):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, ref.args.vocab_size, (64,), generator=g).cuda()
    for m in (ref, twin):
        m.setup_cache(48)

    def both(sl, **kw):
        _same(_call(ref, ids[sl], **kw), _call(twin, ids[sl], **kw), tol)

    both(slice(0, 20))
    for step in range(3):  # replays of the captured buckets at moving positions
        both(slice(20 + 6 * step, 21 + 6 * step))
        both(slice(21 + 6 * step, 26 + 6 * step))
        both(slice(26 + 6 * step, 29 + 6 * step), last_only=True)
    _caches_equal(ref, twin, tol)
    for m in (ref, twin):
        m.truncate(22)
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    both(slice(31, 35), tree_mask=tree, position_offsets=torch.tensor([0, 1, 1, 2]))
    _caches_equal(ref, twin, tol)


def _cuda_chain(models):
    """The target, int4 copy and head on CUDA (the head sharing the target's embedding and lm_head), a prompt, and
    the target's greedy ar answer to it."""
    from polyspec.decode.levels import ModelLevel

    t = copy.deepcopy(models["target"]).cuda()
    q = copy.deepcopy(models["int4"]).cuda()
    h = copy.deepcopy(models["head"]).cuda()
    h.embed_tokens, h.lm_head = t.embed_tokens, t.lm_head
    prompt = [5, 17, 230, 9, 77, 3]
    ar = ChainDecoder([ModelLevel(copy.deepcopy(t), "t")], max_seq_len=64).generate(prompt, 20).token_ids
    return t, q, h, prompt, ar


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_chain_equals_ar_and_graphs_survive_generations(models):
    from polyspec.decode.levels import HeadLevel, ModelLevel

    t, q, h, prompt, ar = _cuda_chain(models)
    n = cuda_graphs.enable_for_device({"t": t, "q": q, "h": h}, "cuda")
    assert n == 3
    dec = ChainDecoder([ModelLevel(t, "t"), ModelLevel(q, "int4"), HeadLevel(h, "head")], draft=DraftSpec(k=3), mu=[4],
                       max_seq_len=64)
    assert dec.generate(prompt, 20).token_ids == ar
    captured = {m: cuda_graphs.runner_of(m).captures for m in (t, q, h)}
    assert dec.generate(prompt, 20).token_ids == ar  # the same cache tensors: no new captures
    assert {m: cuda_graphs.runner_of(m).captures for m in (t, q, h)} == captured


@pytest.mark.gpu
@needs_cuda
def test_cuda_prewarm_leaves_nothing_to_capture_or_compile(models):
    """On CUDA with the compiled step: after prewarm a chain generation captures no graph, compiles nothing and
    equals ar (fp32, where the GPU's speculation is exact)."""
    from torch._dynamo.utils import counters

    from polyspec.decode.levels import HeadLevel, ModelLevel

    t, q, h, prompt, ar = _cuda_chain(models)
    for m in (t, q, h):
        cuda_graphs.enable(m, graphs=True, max_width=16)
    assert cuda_graphs.prewarm([t, q, h]) == 3 * 5  # buckets 1, 2, 4, 8, 16 each
    captured = {m: cuda_graphs.runner_of(m).captures for m in (t, q, h)}
    graphs = counters["stats"]["unique_graphs"]
    dec = ChainDecoder([ModelLevel(t, "t"), ModelLevel(q, "int4"), HeadLevel(h, "head")], draft=DraftSpec(k=3), mu=[4],
                       max_seq_len=64)
    assert dec.generate(prompt, 20).token_ids == ar
    assert {m: cuda_graphs.runner_of(m).captures for m in (t, q, h)} == captured
    assert counters["stats"]["unique_graphs"] == graphs


class _FakeGraph:
    """Stands in for torch.cuda.CUDAGraph on the CPU with a graph's semantics: what ran during capture is recorded,
    and replay re-runs it reading the same input buffers and writing into the outputs the capture returned."""

    runner = None
    runners: tuple = ()  # several runners' graphs in one test: each replay finds its own bucket

    def replay(self):
        runner, bk = next((r, b) for r in (_FakeGraph.runner, *_FakeGraph.runners) if r is not None
                          for b in r._buckets.values() if b.graph is self)
        for static, fresh in zip(bk.out, runner._step(bk), strict=True):
            static.copy_(fresh)


class _Ctx:
    def __init__(self, *a, **k):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _fake_cuda_graph_api(monkeypatch):
    class _Stream:
        def wait_stream(self, other):
            pass

    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: _Stream())
    monkeypatch.setattr(torch.cuda, "stream", _Ctx)
    monkeypatch.setattr(torch.cuda, "graph", _Ctx)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_graph_capture_and_replay_control_flow_with_a_fake_cuda_api(models, monkeypatch, compiled):
    """The graph path (warm-up, capture once per bucket, replay into static outputs, clones handed out, no re-capture
    across generations) on the CPU, with torch.cuda's graph API replaced by a fake that re-runs the step on replay."""
    from polyspec.decode.levels import ModelLevel

    _fake_cuda_graph_api(monkeypatch)
    t = copy.deepcopy(models["target"])
    runner = cuda_graphs.StaticRunner(t, graphs=True, max_width=16, compiled=compiled)
    t.__dict__["_static_runner"] = runner
    _FakeGraph.runner = runner
    prompt = [5, 17, 230, 9, 77, 3]
    ar = ChainDecoder([ModelLevel(copy.deepcopy(models["target"]), "t")], max_seq_len=64).generate(prompt, 20)
    twin = copy.deepcopy(models["target"])
    dec = ChainDecoder([ModelLevel(t, "t"), ModelLevel(twin, "twin")], draft=DraftSpec(k=3), max_seq_len=64)
    for _ in range(2):
        assert dec.generate(prompt, 20).token_ids == ar.token_ids
    assert runner.captures == len(runner._buckets) >= 2  # bucket 1 (prefill-free steps) and 4 (verifications)
    assert runner.replays > runner.captures
    # outputs handed out are copies: a later replay does not change them
    t.setup_cache(64)
    with torch.inference_mode():
        t(torch.tensor(prompt))
        a, _ = t(torch.tensor([1]))
        kept = a.clone()
        t(torch.tensor([2]))
    assert torch.equal(a, kept)


def test_prewarm_captures_every_bucket_before_a_generation(models, monkeypatch):
    """After prewarm, a dual generation (target and head) captures nothing more and still equals ar."""
    from polyspec.decode.levels import HeadLevel, ModelLevel

    _fake_cuda_graph_api(monkeypatch)
    t, h = copy.deepcopy(models["target"]), copy.deepcopy(models["head"])
    h.embed_tokens, h.lm_head = t.embed_tokens, t.lm_head
    runners = []
    for m in (t, h):
        runners.append(cuda_graphs.StaticRunner(m, graphs=True, max_width=8))
        m.__dict__["_static_runner"] = runners[-1]
    monkeypatch.setattr(_FakeGraph, "runners", tuple(runners))
    assert cuda_graphs.prewarm([t, None, h, torch.nn.Linear(2, 2)]) == 2 * 4  # buckets 1, 2, 4, 8 each
    assert [r.captures for r in runners] == [4, 4] and t._cache.length == 0 and h._cache.length == 0
    prompt = [5, 17, 230, 9, 77, 3]
    ar = ChainDecoder([ModelLevel(copy.deepcopy(models["target"]), "t")], max_seq_len=64).generate(prompt, 20)
    dec = ChainDecoder([ModelLevel(t, "t"), HeadLevel(h, "head")], draft=DraftSpec(k=3), max_seq_len=64)
    assert dec.generate(prompt, 20).token_ids == ar.token_ids
    assert [r.captures for r in runners] == [4, 4]  # the cache was reused: every graph served the generation
    assert all(r.replays > 8 for r in runners)


def test_prewarm_compiles_every_bucket_before_a_generation(models):
    """With the compiled step, the generation after prewarm compiles nothing (dynamo makes no new graph)."""
    from torch._dynamo.utils import counters

    from polyspec.decode.levels import ModelLevel

    t = copy.deepcopy(models["target"])
    cuda_graphs.enable(t, graphs=False, max_width=4, compiled=True)
    assert cuda_graphs.prewarm([t]) == 3
    before = counters["stats"]["unique_graphs"]
    prompt = [5, 17, 230, 9, 77, 3]
    ar = ChainDecoder([ModelLevel(copy.deepcopy(models["target"]), "t")], max_seq_len=64).generate(prompt, 12)
    twin = copy.deepcopy(models["target"])
    got = ChainDecoder([ModelLevel(t, "t"), ModelLevel(twin, "twin")], draft=DraftSpec(k=3), max_seq_len=64).generate(prompt, 12)
    assert got.token_ids == ar.token_ids
    assert counters["stats"]["unique_graphs"] == before


def test_prewarm_sizes_the_cache_for_the_longest_run(models, monkeypatch):
    """prewarm(max_seq_len) allocates once for the longest generation to come, so a long one re-captures nothing."""
    from polyspec.decode.levels import ModelLevel

    _fake_cuda_graph_api(monkeypatch)
    t = copy.deepcopy(models["target"])
    runner = cuda_graphs.StaticRunner(t, graphs=True, max_width=4)
    t.__dict__["_static_runner"] = runner
    monkeypatch.setattr(_FakeGraph, "runners", (runner,))
    assert cuda_graphs.prewarm([t], max_seq_len=1500) == 3
    assert t._cache.k[0].shape[2] >= 1500 + runner.slack and runner.captures == 3
    ChainDecoder([ModelLevel(t, "t")], max_seq_len=1400).generate([5, 17, 230, 9, 77, 3], 8)
    assert runner.captures == 3
