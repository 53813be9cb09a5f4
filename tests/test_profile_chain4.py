"""Profiling and deciding a four-level chain of tiny random models: target <- its RTN int4 copy <- a one-layer copy of
the target <- a random EAGLE head. Every adjacent insertion gets Theorem 3.2's conditions and the exact Lemma 3.1
times, and the decision is what the Lemma 3.1 numbers say."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from polyspec.theory import chain_time_per_token, insertion

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _one_layer_copy(target_dir: Path, out: Path) -> Path:
    """The target cut to its first decoder layer (same embedding, lm_head and tokenizer): a smaller, cheaper level."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(target_dir)
    model.model.layers = model.model.layers[:1]
    model.config.num_hidden_layers = 1
    model.save_pretrained(out, safe_serialization=True)
    for f in target_dir.iterdir():
        if "token" in f.name or f.name.endswith(".jinja"):
            shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="module")
def parts4(tiny_parts, tmp_path_factory):
    small = _one_layer_copy(tiny_parts["target"], tmp_path_factory.mktemp("small") / "model")
    return [tiny_parts["target"], tiny_parts["int4"], small, tiny_parts["head"]]


@pytest.fixture(scope="module")
def profile4(parts4, tmp_path_factory):
    from polyspec.export.profile import ProfileSettings
    from polyspec.export.stage import profile_folders

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (10 + 6 * i,), generator=g).tolist() for i in range(2)]
    s = ProfileSettings(max_new_tokens=10, kv_length=32, warmup=0, repeats=2, draft_ks=(2, 3), mus=(3,))
    return profile_folders(parts4, tmp_path_factory.mktemp("p4") / "p", s, device="cpu", prompt_ids=prompts,
                           threads=1, say=lambda _m: None)


def test_levels_runs_and_lossless(profile4):
    p = profile4
    assert p.names == ["target", "intermediate1", "intermediate2", "draft"]
    assert list(p.tags.values()) == ["target", "int4", "model", "head"]
    assert set(p.final) == {"ar", "dual", "chain", "dual_at_chain_k", "chain_without_int4",
                            "int4_over_model_over_head", "chain_without_model", "model_over_head"}
    assert p.final["chain"].levels == p.names and len(p.final["chain"].mu) == 2
    assert p.final["chain_without_int4"].levels == ["target", "intermediate2", "draft"]
    assert p.final["model_over_head"].levels == ["intermediate2", "draft"]
    assert p.lossless_greedy is True
    assert set(p.costs) == set(p.names)


def test_every_adjacent_insertion_has_its_verdict(profile4):
    p = profile4
    assert [(v.above, v.level, v.below) for v in p.insertions] == [
        ("target", "intermediate1", "intermediate2"), ("intermediate1", "intermediate2", "draft")]
    chain = p.final["chain"]
    for v in p.insertions:
        before, tail = p.final[v.before_run], p.final[v.tail_run]
        assert v.level not in before.levels and tail.levels[0] == v.level
        i = v.inputs
        assert i.L_i == before.per_level[v.above].L and i.L_i_new == chain.per_level[v.above].L
        assert i.L_new == tail.per_level[v.level].L
        assert i.beta == before.betas[before.levels.index(v.above)]
        # Theorem 3.2's conditions and the exact two-level Lemma 3.1 times are theory.insertion on these inputs
        again = insertion(i.T_i, i.T_new, i.T_next, i.L_i, i.L_new, i.L_i_new, i.beta)
        for key, value in again.to_dict().items():
            assert getattr(v, key) == (pytest.approx(value) if isinstance(value, float) else value), key
        # the exact Lemma 3.1 time of the whole chain with and without the level, as measured, decides
        for run, t in ((before, v.time_before_own_widths), (chain, v.time_after_own_widths)):
            pr = run.predicted
            assert t == pytest.approx(chain_time_per_token(pr.T, pr.L_eff, pr.beta))
            assert pr.L_eff == [run.per_level[nm].L_eff for nm in run.levels[:-1]] and pr.beta == run.beta
        assert v.pays_own_widths == (v.time_after_own_widths < v.time_before_own_widths)
        assert {f"chain_{v.level}", f"chain_{v.above}", v.tail_run} <= set(p.variance)


def test_decision_follows_lemma_3_1(profile4):
    p = profile4
    assert len(p.grid) == 2 + 2 + 1
    for r in p.grid:
        names = list(r.T_s)
        if len(names) > 1:
            expect = chain_time_per_token([r.T_s[n] for n in names], [r.L_eff[n] for n in names[:-1]], r.beta)
            assert r.predicted_time_per_token_s == pytest.approx(expect)
    best = min((r for r in p.grid if r.mode in ("chain", "dual")), key=lambda r: r.predicted_time_per_token_s)
    dec = p.decision
    assert (dec.speculative_mode, dec.draft, dec.predicted_time_per_token_s) == (
        best.mode, best.draft, best.predicted_time_per_token_s)
    assert dec.mu == [3, 3]
    pred = {nm: p.final[nm].predicted.time_per_token_s for nm in ("ar", "dual", "chain")}
    ar_faster = pred["ar"] < min(pred["dual"], pred["chain"])
    ar_measured = p.final["ar"].tokens_per_second >= p.final[best.mode].tokens_per_second
    assert dec.mode == ("ar" if ar_faster or ar_measured else best.mode)


def test_report_and_export_of_four_levels(profile4, parts4, tmp_path):
    from polyspec.chain_spec import DecodeSpec
    from polyspec.export.package import export_profiled
    from polyspec.manifest import validate_chain

    folder = Path(profile4.path)
    md = (folder / "verdict.md").read_text()
    assert "| insertion of int4 between target and model |" in md
    assert "| insertion of model between int4 and head |" in md
    assert md.count("| cond1: ") == 2 and md.count("| Lemma 3.1 ms/token before -> after |") == 2
    assert json.loads((folder / "profile.json").read_text())["format"] == 4
    out = export_profiled(tmp_path / "chain", parts4, profile4, DecodeSpec(), onnx=False)
    m = validate_chain(out)
    assert [lv.kind for lv in m.levels] == ["target", "int4", "model", "head"]
    assert len(m.measurements["insertions"]) == 2 and m.decode.mu == [3, 3]
    assert m.decode.mode == profile4.decision.mode
