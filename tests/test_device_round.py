"""The device round (polyspec.decode.device_round): one host read per round (counted by a TorchDispatchMode), the
round compiled with fullgraph=True equal to the eager round, greedy tokens equal to ``ar`` and to the host-side
decoder's, the warped target's law at T > 0 (and a broken residual failing the same check), caches left as the host
path's bookkeeping says, the declared support; CUDA-graph replay is marked ``gpu``."""

from __future__ import annotations

import copy
import itertools
import math
from statistics import NormalDist

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from polyspec.chain_spec import DraftSpec, TreeShape
from polyspec.decode import cuda_graphs, device_round
from polyspec.decode.chain import ChainDecoder, SamplingParams
from polyspec.decode.levels import HeadLevel, ModelLevel, TableLevel
from polyspec.decode.model import ModelArgs, Transformer
from polyspec.decode.sampling import warp
from polyspec.errors import PolyspecError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = [5, 17, 230, 9, 77, 3]
T09 = SamplingParams(temperature=0.9, top_p=0.95)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The tiny random Llama target, a second one, its RTN int4 copy, a copy of itself, a random EagleHead and one
    with a draft vocabulary of 64 tokens."""
    from conftest import make_tiny_llama

    from polyspec.decode.head import EagleHead
    from polyspec.decode.int4 import quantize_model_rtn

    root = tmp_path_factory.mktemp("round_llamas")
    target = Transformer.from_pretrained(make_tiny_llama(root / "t", seed=0, tokenizer=None)).eval()
    other = Transformer.from_pretrained(make_tiny_llama(root / "o", seed=1, tokenizer=None)).eval()
    torch.manual_seed(0)
    head = EagleHead(target.args, target.embed_tokens, target.lm_head).eval()
    return {"target": target, "other": other, "twin": copy.deepcopy(target), "head": head,
            "head_vocab": _with_draft_vocab(copy.deepcopy(head), target, 64),
            "int4": quantize_model_rtn(Transformer.from_pretrained(root / "t").eval(), group_size=128)}


def _with_draft_vocab(head, target: Transformer, size: int):
    """``head`` on ``target``'s embedding and lm_head, its logits over ``size`` tokens of random training counts."""
    head.embed_tokens, head.lm_head = target.embed_tokens, target.lm_head
    head.token_counts = torch.randint(0, 100, (target.args.vocab_size,), generator=torch.Generator().manual_seed(1))
    head.set_draft_vocab(size)
    return head


def _dual(models, draft: str, k: int, device: bool | None = True, max_seq_len: int = 64,
          tree: DraftSpec | None = None) -> ChainDecoder:
    m = models[draft]
    bottom = HeadLevel(m, "head") if draft.startswith("head") else ModelLevel(m, draft)
    return ChainDecoder([ModelLevel(models["target"], "t"), bottom], draft=tree or DraftSpec(k=k),
                        max_seq_len=max_seq_len, device_round=device)


def _kv_close(model, ref, n: int, tol: float = 1e-4) -> None:
    for a, b, c, d in zip(model._cache.k, ref._cache.k, model._cache.v, ref._cache.v, strict=True):
        torch.testing.assert_close(a[:, :, :n], b[:, :, :n], atol=tol, rtol=tol)
        torch.testing.assert_close(c[:, :, :n], d[:, :, :n], atol=tol, rtol=tol)


def _check_caches(models, draft: str, seq: list[int]) -> None:
    """The target's cache holds seq but its last token and the draft's what its cache length says, each equal to a
    fresh forward over those tokens (a head's with the target's hidden states as its features)."""
    t, d = models["target"], models[draft]
    assert t.cache_len == len(seq) - 1
    fresh_t = copy.deepcopy(t)
    fresh_t.setup_cache(64)
    with torch.inference_mode():
        _, hidden = fresh_t(torch.tensor(seq[:-1]))
    _kv_close(t, fresh_t, len(seq) - 1)
    fresh = copy.deepcopy(d)
    fresh.setup_cache(64)
    n = d.cache_len
    assert 0 < n < len(seq)
    with torch.inference_mode():
        if draft.startswith("head"):  # head slot j holds (x_{j+1}, f_j)
            fresh(torch.tensor(seq[1:n + 1]), hidden[:n])
        else:
            fresh(torch.tensor(seq[:n]))
    _kv_close(d, fresh, n, tol=1e-2 if draft == "int4" else 1e-4)


# -- greedy: the tokens of ar and of the host path ---------------------------------------------------------------------


@pytest.mark.parametrize("draft", ["other", "twin", "int4", "head", "head_vocab"])
@pytest.mark.parametrize("k", [1, 4])
def test_greedy_device_round_equals_ar_and_the_host_path(models, draft, k):
    ar = ChainDecoder([ModelLevel(models["target"], "t")], max_seq_len=64).generate(PROMPT, 20).token_ids
    dec = _dual(models, draft, k)
    assert dec.device_round is not None
    r = dec.generate(PROMPT, 20)
    assert r.token_ids == ar, r.stats
    _check_caches(models, draft, PROMPT + r.token_ids)
    host = _dual(models, draft, k, device=False).generate(PROMPT, 20)
    assert host.token_ids == ar
    lens = r.level_stats[0].accept_lengths
    if not draft.startswith("head"):  # the same draft computations: the same accepted counts (a head reads other
        # features)
        assert lens == host.level_stats[0].accept_lengths
    assert r.level_stats[0].forward_passes == len(lens) and r.level_stats[1].forward_passes == k * len(lens)
    assert sum(lens) == 20 and max(lens) <= k + 1
    assert max(lens) == k + 1 if draft == "twin" else max(lens) < k + 1 or draft in ("int4", "head_vocab")
    assert r.stats["beta"] == k and r.stats["device_round"] and not host.stats["device_round"]


def test_greedy_round_stops_at_eos_and_budget_and_streams(models):
    ar = ChainDecoder([ModelLevel(models["target"], "t")], max_seq_len=64).generate(PROMPT, 20).token_ids
    dec = _dual(models, "twin", 4)
    assert dec.generate(PROMPT, 7).token_ids == ar[:7]  # the budget cuts a round of 5
    eos = ar[8]
    cut = ar[:ar.index(eos) + 1]
    assert dec.generate(PROMPT, 20, eos_token_ids={eos}).token_ids == cut
    seen: list[list[int]] = []
    r = dec.generate(PROMPT, 20, on_tokens=lambda toks: seen.append(toks) or len(seen) == 2)
    assert seen == [ar[:5], ar[5:10]] and r.token_ids == ar[:10]
    _check_caches(models, "twin", PROMPT + r.token_ids)


def test_a_head_with_a_one_token_prompt_takes_the_host_path(models):
    dec = _dual(models, "head", 3)
    ar = ChainDecoder([ModelLevel(models["target"], "t")], max_seq_len=64).generate([7], 10).token_ids
    calls = []
    dec.device_round.next_tokens = lambda: calls.append(1)
    r = dec.generate([7], 10)
    assert r.token_ids == ar and not calls and not r.stats["device_round"]


@pytest.mark.parametrize("draft", ["other", "twin", "int4", "head", "head_vocab"])
@pytest.mark.parametrize("shape", [(3, 4, 10), (2, 3, 6)], ids=["3x4x10", "2x3x6"])
def test_greedy_device_tree_equals_ar(models, draft, shape):
    """A draft tree on the device (decode/device_tree.py): the tokens of ar, the caches as a fresh forward leaves
    them, whole paths accepted from the target's copy; the host path for the same tree agrees."""
    ar = ChainDecoder([ModelLevel(models["target"], "t")], max_seq_len=64).generate(PROMPT, 20).token_ids
    tree = DraftSpec(tree=TreeShape(top_k=shape[0], depth=shape[1], total_tokens=shape[2]))
    dec = _dual(models, draft, 1, tree=tree)
    assert type(dec.device_round).__name__ == "TreeRound"
    r = dec.generate(PROMPT, 20)
    assert r.token_ids == ar and r.stats["device_round"], r.stats
    _check_caches(models, draft, PROMPT + r.token_ids)
    lens = r.level_stats[0].accept_lengths
    assert r.level_stats[1].forward_passes == shape[1] * len(lens)
    if draft == "twin":  # a perfect draft: paths accepted (re-ranking may drop the deep end of flat random rows)
        assert max(lens) > 2
    host = _dual(models, draft, 1, device=False, tree=tree).generate(PROMPT, 20)
    assert host.token_ids == ar
    if draft in ("twin", "other"):  # the same tree from the same draft computations
        assert lens == host.level_stats[0].accept_lengths
    sampled = dec.generate(PROMPT, 8, T09, seed=1)  # T > 0: the host path's tree
    assert not sampled.stats["device_round"] and len(sampled.token_ids) == 8


# -- host reads: one per round -----------------------------------------------------------------------------------------


SYNC_OPS = ("_local_scalar_dense", "item", "nonzero", "masked_select", "unique", "_unique2")


class HostReads(TorchDispatchMode):
    """Records every op that makes the host wait for a tensor's values: item / bool / int (aten._local_scalar_dense),
    ops whose output shape depends on values, and copies from a device to the CPU (on the CPU there are none)."""

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []
        self.quiet = False  # inside a read counted already (tolist: its own copy to the host is that read)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__.split(".")[0]
        if self.quiet:
            pass
        elif name in SYNC_OPS:
            self.reads.append(name)
        elif name in ("_to_copy", "copy_") and any(
                isinstance(a, torch.Tensor) and a.device.type != "cpu" for a in args) and (
                kwargs.get("device") == torch.device("cpu") or (name == "copy_" and args[0].device.type == "cpu")):
            self.reads.append(f"{name} to cpu")
        return func(*args, **kwargs)


def _count_round_reads(monkeypatch, rnd) -> list[list[str]]:
    """Per call of rnd.next_tokens: the host reads it made (the dispatch mode's, plus tolist / numpy / item calls,
    which read a CPU tensor's memory without dispatching an op)."""
    per_round: list[list[str]] = []
    run = rnd.next_tokens
    methods = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy")}

    mode = HostReads()

    def counted(*a, _name, **kw):
        per_round[-1].append(_name)
        mode.quiet = True
        try:
            return methods[_name](*a, **kw)
        finally:
            mode.quiet = False

    def next_tokens():
        per_round.append([])
        mode.reads = []
        with mode, monkeypatch.context() as m:
            for name in methods:
                m.setattr(torch.Tensor, name, lambda *a, _name=name, **kw: counted(*a, _name=_name, **kw))
            out = run()
        per_round[-1] += mode.reads
        return out

    monkeypatch.setattr(rnd, "next_tokens", next_tokens)
    return per_round


TREE = DraftSpec(tree=TreeShape(top_k=3, depth=4, total_tokens=10))


@pytest.mark.parametrize("draft, sp, tree", [("other", SamplingParams(), None), ("head", SamplingParams(), None),
                                             ("other", T09, None), ("head", T09, None), ("head", SamplingParams(), TREE),
                                             ("other", SamplingParams(), TREE)],
                         ids=["model-T0", "head-T0", "model-T0.9", "head-T0.9", "head-tree-T0", "model-tree-T0"])
def test_a_round_reads_the_host_once(monkeypatch, models, draft, sp, tree):
    dec = _dual(models, draft, 4, tree=tree)
    per_round = _count_round_reads(monkeypatch, dec.device_round)
    r = dec.generate(PROMPT, 24, sp, seed=0)
    assert len(per_round) == len(r.level_stats[0].accept_lengths) >= 5
    assert all(reads == ["tolist"] for reads in per_round), per_round


def test_the_counter_sees_a_host_read(monkeypatch, models):
    """The counter is not blind: a round that reads its accepted count with .item() is caught."""
    dec = _dual(models, "other", 2)
    rnd = dec.device_round
    per_round = _count_round_reads(monkeypatch, rnd)
    accept = rnd._accept
    monkeypatch.setattr(rnd, "_accept", lambda *a: (lambda acc_nxt: (acc_nxt[0].item(), acc_nxt)[1])(accept(*a)))
    dec.generate(PROMPT, 6)
    assert per_round and all(reads.count("item") + reads.count("_local_scalar_dense") == 1 for reads in per_round), per_round


# -- the compiled round ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("draft, sp, backend, tree", [
    ("head", T09, "aot_eager", None), ("other", SamplingParams(), "aot_eager", None),
    ("head_vocab", T09, "aot_eager", None),
    pytest.param("head", SamplingParams(), "aot_eager", TREE, marks=pytest.mark.slow),
    pytest.param("head", T09, "inductor", None, marks=pytest.mark.slow),
    pytest.param("head_vocab", SamplingParams(), "inductor", TREE, marks=pytest.mark.slow),
], ids=["head-T0.9", "model-T0", "head-vocab-T0.9", "head-tree-T0", "head-T0.9-inductor", "head-vocab-tree-T0-inductor"])
def test_the_round_compiles_with_fullgraph_and_equals_the_eager_round(models, draft, sp, backend, tree):
    """torch.compile(fullgraph=True) of the round (dynamo captures all of it: no data-dependent Python control flow,
    no host read in it) gives the eager round's tokens, round for round, and the same state. aot_eager traces and
    functionalises the whole round as CUDA would compile it, without inductor's C++ build (minutes on a loaded
    2-core machine; the inductor case is in the slow tier)."""
    torch._dynamo.reset()
    pairs = []
    for _ in range(2):
        ms = {name: copy.deepcopy(models[name]) for name in ("target", draft)}
        if draft.startswith("head"):
            ms[draft].embed_tokens, ms[draft].lm_head = ms["target"].embed_tokens, ms["target"].lm_head
        pairs.append(_dual(ms, draft, 3, tree=tree))
    eager, compiled = pairs
    rnd = compiled.device_round
    rnd.next_tokens = _compiled_next(rnd, backend)
    a, b = eager.generate(PROMPT, 16, sp, seed=5), compiled.generate(PROMPT, 16, sp, seed=5)
    assert rnd.compiled_rounds == len(b.level_stats[0].accept_lengths) > 2
    assert a.token_ids == b.token_ids and a.level_stats[0].accept_lengths == b.level_stats[0].accept_lengths
    sa, sb = eager.device_round.state, rnd.state
    assert torch.equal(sa.seq, sb.seq) and int(sa.n) == int(sb.n) and int(sa.rnd) == int(sb.rnd)
    torch.testing.assert_close(sa.feat, sb.feat, atol=1e-4, rtol=1e-4)


def _compiled_next(rnd, backend: str):
    fn = torch.compile(rnd.round, fullgraph=True, dynamic=False, backend=backend)
    rnd.compiled_rounds = 0

    def next_tokens():
        rnd.compiled_rounds += 1
        with torch.inference_mode():
            vals = fn().tolist()
        return vals[1:2 + vals[0]]

    return next_tokens


# -- T > 0: the warped target's law ------------------------------------------------------------------------------------


V = 4


@pytest.fixture(scope="module")
def small():
    """A 4-token vocabulary: target, an unrelated draft model and a random head (exact laws computable)."""
    from polyspec.decode.head import EagleHead

    args = ModelArgs(vocab_size=V, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                     head_dim=16)
    out = {}
    for name, seed in (("target", 0), ("other", 1)):
        torch.manual_seed(seed)
        out[name] = Transformer(args).eval()
        with torch.no_grad():
            out[name].lm_head.weight.mul_(4.0)  # peaked enough to be unlike the draft, no zero cell
    torch.manual_seed(2)
    out["head"] = EagleHead(args, out["target"].embed_tokens, out["target"].lm_head).eval()
    out["head_vocab"] = _with_draft_vocab(copy.deepcopy(out["head"]), out["target"], 2)  # half the tokens: q = 0
    return out


def _exact_joint(target: Transformer, prompt: list[int], sp: SamplingParams, depth: int = 3) -> torch.Tensor:
    """P(x1..x_depth | prompt) under the warped target, [V ** depth] in itertools.product order."""
    m = copy.deepcopy(target)
    m.setup_cache(16)
    rows = {}
    for n in range(depth):
        for xs in itertools.product(range(V), repeat=n):
            m.reset()
            with torch.inference_mode():
                logits, _ = m(torch.tensor(prompt + list(xs)))
            rows[xs] = warp(logits[-1].double(), sp.temperature, sp.top_p, sp.top_k)
    return torch.tensor([math.prod(float(rows[xs[:j]][xs[j]]) for j in range(depth))
                         for xs in itertools.product(range(V), repeat=depth)], dtype=torch.float64)


def _chi2(dec: ChainDecoder, target: Transformer, prompt: list[int], sp: SamplingParams, n: int) -> tuple[float, float]:
    """(Pearson statistic, critical value at alpha = 1e-3) of the first 3 tokens over n seeds; cells expected < 5
    pooled."""
    counts = torch.zeros(V ** 3, dtype=torch.float64)
    for s in range(n):
        a, b, c = dec.generate(prompt, 3, sp, seed=s).token_ids
        counts[(a * V + b) * V + c] += 1
    expected = _exact_joint(target, prompt, sp) * n
    big = expected >= 5
    e = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    o = torch.cat([counts[big], counts[~big].sum().reshape(1)])
    assert not (o[e == 0] > 0).any(), "a sequence of probability 0 under the warped target was generated"
    keep = e > 0
    stat = float(((o[keep] - e[keep]) ** 2 / e[keep]).sum())
    df = int(keep.sum()) - 1
    z = NormalDist().inv_cdf(1 - 1e-3)
    return stat, df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("draft, sp", [("other", SamplingParams(temperature=1.0)),
                                       ("head_vocab", SamplingParams(temperature=1.0)),
                                       pytest.param("head", SamplingParams(temperature=0.8, top_p=0.85, top_k=3),
                                                    marks=pytest.mark.slow)],
                         ids=["model-T1", "head-vocab-T1", "head-T0.8-top"])
def test_output_distribution_is_the_warped_target(small, draft, sp):
    dec = _dual(small, draft, 2, max_seq_len=16)
    assert dec.device_round is not None
    stat, crit = _chi2(dec, small["target"], [1, 2], sp, n=800)
    assert stat < crit, (stat, crit)


def test_a_broken_residual_fails_the_same_check(small, monkeypatch):
    """The same check catches a round that draws the correction from p instead of the residual."""
    monkeypatch.setattr(device_round, "residual", lambda p, q: p)
    dec = _dual(small, "other", 2, max_seq_len=16)
    stat, crit = _chi2(dec, small["target"], [1, 2], SamplingParams(temperature=1.0), n=800)
    assert stat > crit, (stat, crit)


def test_uniforms_are_uniform_and_differ_by_counter():
    seed = torch.tensor(12345)
    u = device_round.uniforms(seed, torch.tensor(7), 20000)
    assert 0 < float(u.min()) and float(u.max()) < 1
    counts = torch.histc(u.float(), bins=10, min=0, max=1)
    assert float(((counts - 2000) ** 2 / 2000).sum()) < 27.9  # chi-square(9) at alpha = 1e-3
    assert not torch.equal(u, device_round.uniforms(seed, torch.tensor(8), 20000))
    assert not torch.equal(u, device_round.uniforms(torch.tensor(12346), torch.tensor(7), 20000))
    assert torch.equal(u, device_round.uniforms(seed, torch.tensor(7), 20000))


# -- what it supports --------------------------------------------------------------------------------------------------


def test_declared_support_and_the_switches(models, monkeypatch):
    t = ModelLevel(models["target"], "t")
    assert _dual(models, "other", 3, device=None).device_round is None  # the CPU: off by default
    monkeypatch.setenv(device_round.ENV, "1")
    assert _dual(models, "other", 3, device=None).device_round is not None
    tables = [TableLevel(torch.randn(16, 4), "a", 2), TableLevel(torch.randn(4, 4), "b")]
    assert ChainDecoder(tables, draft=DraftSpec(k=2)).device_round is None  # the variable never raises
    monkeypatch.setenv(device_round.ENV, "0")
    assert _dual(models, "other", 3, device=None).device_round is None
    for levels, draft, why in [
        (tables, DraftSpec(k=2), "ModelLevel"),
        ([t, ModelLevel(models["other"], "o")], DraftSpec(tree=TreeShape(top_k=4, depth=3, total_tokens=64)), "fewer"),
        ([t, ModelLevel(models["other"], "o")], DraftSpec(k=2, lookup=4), "lookup"),
        ([t, ModelLevel(models["int4"], "q"), HeadLevel(models["head"], "h")], DraftSpec(k=2), "two levels"),
        ([t, ModelLevel(models["other"], "o")], DraftSpec(k=device_round.MAX_K + 1), "at most"),
    ]:
        with pytest.raises(PolyspecError, match=why):
            ChainDecoder(levels, draft=draft, mu=[2] * (len(levels) - 2), max_seq_len=64, device_round=True)


class _FakeGraph:
    """torch.cuda.CUDAGraph on the CPU with a graph's semantics for the round: replay re-runs the captured function
    on the same state tensors and writes into the output the capture returned."""

    rnd = None
    captures = replays = 0

    def __init__(self):
        _FakeGraph.captures += 1

    def replay(self):
        _FakeGraph.replays += 1
        self.rnd._out.copy_(self.rnd._fn())


class _Stream:
    def wait_stream(self, other):
        pass


def _fake_cuda(monkeypatch) -> None:
    """torch.cuda's stream and graph API replaced by fakes (_FakeGraph)."""
    ctx = type("Ctx", (), {"__init__": lambda self, *a: None, "__enter__": lambda self: self,
                           "__exit__": lambda self, *e: False})
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: _Stream())
    monkeypatch.setattr(torch.cuda, "stream", ctx)
    monkeypatch.setattr(torch.cuda, "graph", ctx)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)


def test_graph_capture_and_replay_control_flow_with_a_fake_cuda_api(models, monkeypatch):
    """The graph path on the CPU (first round eager, then warm-up, one capture with the state restored, replays;
    a second generation with the same sampling replays the same graph, new sampling captures anew), with torch.cuda's
    graph API replaced by a fake that re-runs the round on replay: the tokens of ar and of the eager round."""
    _fake_cuda(monkeypatch)
    ar = ChainDecoder([ModelLevel(models["target"], "t")], max_seq_len=64).generate(PROMPT, 20).token_ids
    eager = _dual(models, "int4", 3).generate(PROMPT, 20, T09, seed=2).token_ids
    ms = {n: copy.deepcopy(models[n]) for n in ("target", "int4")}  # their rounds are this test's alone
    for m in ms.values():  # as load_chain does on CUDA: caches kept between decoders (whose max_seq_len fits)
        cuda_graphs.enable(m, graphs=False)
    dec = _dual(ms, "int4", 3)
    rnd = dec.device_round
    rnd.graphs, _FakeGraph.rnd = True, rnd
    _FakeGraph.captures = _FakeGraph.replays = 0
    r = dec.generate(PROMPT, 20)
    rounds = len(r.level_stats[0].accept_lengths)
    assert r.token_ids == ar and _FakeGraph.captures == 1 and _FakeGraph.replays == rounds - 1 > 0
    graph = rnd._graph
    assert dec.generate(PROMPT, 20).token_ids == ar and rnd._graph is graph and _FakeGraph.captures == 1
    assert dec.generate(PROMPT, 20, T09, seed=2).token_ids == eager and _FakeGraph.captures == 2
    # a decoder per generation (bench, serve), of another max_seq_len: the same round, its graph replayed
    again = _dual(ms, "int4", 3, max_seq_len=48)
    assert again.device_round is rnd and again.generate(PROMPT, 20, T09, seed=2).token_ids == eager
    assert _FakeGraph.captures == 2 and _dual(ms, "int4", 2).device_round is not rnd
    assert "_device_rounds" in ms["target"].__dict__ and not any(copy.deepcopy(ms["target"])._device_rounds.values())


def test_a_new_draft_vocabulary_captures_the_round_anew(models, monkeypatch):
    """A captured round reads the head's draft-vocabulary rows by address: the same vocabulary replays the same
    graph, a new one (new rows) captures anew; the tokens of ar throughout."""
    _fake_cuda(monkeypatch)
    ms = {n: copy.deepcopy(models[n]) for n in ("target", "head_vocab")}
    ms["head_vocab"].embed_tokens, ms["head_vocab"].lm_head = ms["target"].embed_tokens, ms["target"].lm_head
    ar = ChainDecoder([ModelLevel(ms["target"], "t")], max_seq_len=64).generate(PROMPT, 20).token_ids
    dec = _dual(ms, "head_vocab", 3)
    rnd = dec.device_round
    rnd.graphs, _FakeGraph.rnd = True, rnd
    _FakeGraph.captures = 0
    assert dec.generate(PROMPT, 20).token_ids == ar and dec.generate(PROMPT, 20).token_ids == ar
    assert _FakeGraph.captures == 1
    ms["head_vocab"].set_draft_vocab(32)
    assert dec.generate(PROMPT, 20).token_ids == ar and _FakeGraph.captures == 2


# -- CUDA: compiled, captured, replayed --------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("draft, tree", [("other", None), ("head", None), ("head", TREE), ("twin", TREE),
                                         ("head_vocab", TREE)],
                         ids=["model", "head", "head-tree", "twin-tree", "head-vocab-tree"])
def test_cuda_round_is_one_graph_and_equals_ar(models, draft, tree, monkeypatch):
    """On CUDA (fp32) the default decoder takes the device round: one captured graph replayed every round after the
    first, one host read a round, the tokens of ar; a second generation replays the same graph."""
    ms = {n: copy.deepcopy(models[n]).cuda() for n in ("target", draft)}
    if draft.startswith("head"):
        ms[draft].embed_tokens, ms[draft].lm_head = ms["target"].embed_tokens, ms["target"].lm_head
    ar = ChainDecoder([ModelLevel(ms["target"], "t")], max_seq_len=64).generate(PROMPT, 24).token_ids
    dec = _dual(ms, draft, 4, device=None, tree=tree)
    rnd = dec.device_round
    assert rnd is not None
    assert dec.generate(PROMPT, 24).token_ids == ar
    graph = rnd._graph
    assert graph is not None
    per_round = _count_round_reads(monkeypatch, rnd)
    r = dec.generate(PROMPT, 24, seed=1)
    assert r.token_ids == ar and rnd._graph is graph
    assert all(reads == ["tolist"] for reads in per_round), per_round
    a, b = dec.generate(PROMPT, 24, T09, seed=3), dec.generate(PROMPT, 24, T09, seed=3)
    assert a.token_ids == b.token_ids and a.stats["device_round"] == (tree is None)
