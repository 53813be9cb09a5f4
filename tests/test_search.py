"""The chain search (export/search.py) over candidates made from a tiny random target (export/candidates.py): every
insertion it tries carries Theorem 3.2's verdict and both chains' Lemma 3.1 times, the greedy loop stops exactly when
no insertion lowers the predicted time (cost tables forced so the outcome is known), the decision follows the stated
rule, and a four-level chain of candidates decodes losslessly (greedy = ar; sampled first tokens = the target's law)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import ASSETS
from test_chain import chi2_critical

from polyspec.export.results import CostRow
from polyspec.theory import insertion

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def loaded(tiny_parts):
    from polyspec.export.stage import load_levels

    return load_levels([tiny_parts["target"], tiny_parts["int4"], tiny_parts["head"]], device="cpu",
                       dtype="float32")


@pytest.fixture(scope="module")
def cands(loaded):
    from polyspec.export.candidates import CandidateSettings, make_candidates

    given = list(zip(loaded.tags[1:], loaded.levels[1:], strict=True))
    return make_candidates(loaded.levels[0], given, CandidateSettings(rtn_group_sizes=(64,)))


def _prompts(n: int = 2) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        x = torch.randint(3, 500, (8 + 4 * i,), generator=g).tolist()
        out.append(x + x[:5])  # a repeat, so prompt lookup has something to propose
    return out


def _settings(**kw):
    from polyspec.export.profile import ProfileSettings
    from polyspec.export.search import SearchSettings

    prof = ProfileSettings(max_new_tokens=8, kv_length=24, warmup=0, repeats=1, draft_ks=(2,), mus=(2,),
                           grid_prompts=1, lookups=(3,))
    return SearchSettings(profile=prof, **kw)


def _fake_costs(t_of: dict):
    """measure_costs as a table: T(width) = t_of[level] (a number, or a function of the width)."""

    def fake(levels, widths, kv_length, **_kw):
        def row(n, w):
            t = t_of[n](w) if callable(t_of[n]) else t_of[n]
            return CostRow(width=w, kv_length=kv_length, median_s=t, p10_s=t, p90_s=t, mean_s=t, min_s=t, repeats=1)

        return {n: [row(n, w) for w in sorted(set(widths[n]))] for n in levels}

    return fake


def test_candidates_share_the_targets_tensors(loaded, cands):
    target = loaded.levels[0].model
    by = {c.name: c for c in cands}
    assert [(c.name, c.kind, c.bottom_only) for c in cands] == [
        ("int4", "int4", False), ("head", "head", True), ("int4_g64", "rtn_int4", False), ("lookup", "lookup", True)]
    assert by["lookup"].level is None  # a drafter, not a level
    rtn = by["int4_g64"].level.model
    assert type(rtn.layers[1].mlp.down_proj).__name__ == "Int4Linear" and rtn.layers[1].mlp.down_proj.group_size == 64
    assert rtn.embed_tokens.weight.data_ptr() == target.embed_tokens.weight.data_ptr()
    assert type(target.layers[1].mlp.down_proj).__name__ != "Int4Linear"  # the target is untouched


@pytest.fixture(scope="module")
def measured(loaded, cands):
    from polyspec.export.search import search_chain

    return search_chain(loaded.levels[0], cands, _prompts(), _settings(max_levels=4))


def test_search_lists_every_insertion_with_both_predictions(measured):
    s = measured
    assert [(p.levels[-1], p.draft) for p in s.drafts] == [
        (c.name, "source=lookup,lookup=3") if c.kind == "lookup" else (c.name, "k=2") for c in s.candidates]
    best_draft = min(s.drafts, key=lambda p: p.predicted_time_per_token_s)
    first = [t for t in s.insertions if t.round == 1]
    assert first and all(t.before == best_draft.levels for t in first)
    assert {t.inserted for t in first} == {c.name for c in s.candidates if not c.bottom_only} - set(best_draft.levels)
    for t in s.insertions:
        lookup = t.before[-1] == "lookup"
        assert t.inserted not in t.before and 1 <= t.position <= len(t.before) - 1 + lookup
        assert t.pays == (t.time_after_s < t.time_before_s)
        before = next(p for p in s.drafts if p.levels == t.before and p.draft == t.draft) if t.round == 1 else None
        assert t.measured_tokens_per_second_after > 0
        assert before is None or t.measured_tokens_per_second_before == before.measured_tokens_per_second
        v = t.verdict
        if v is not None:
            assert (v.above, v.level, v.below) == (t.before[t.position - 1], t.inserted, t.before[t.position])
            i = v.inputs
            again = insertion(i.T_i, i.T_new, i.T_next, i.L_i, i.L_new, i.L_i_new, i.beta)
            assert (v.cond1_holds, v.cond2_holds, v.valid_regime, v.pays) == (
                again.cond1_holds, again.cond2_holds, again.valid_regime, again.pays)
    assert s.runs >= len(s.drafts) + len(s.insertions)


def test_decision_follows_the_rule_and_outputs_are_lossless(measured):
    s = measured
    assert 1 <= len(s.confirmed) <= 2 and len({tuple(c.levels) for c in s.confirmed}) == len(s.confirmed)
    preds = [c.predicted_grid_s for c in s.confirmed]
    assert preds == sorted(preds)
    assert all(c.lossless_greedy for c in s.confirmed)
    best = max(s.confirmed, key=lambda c: c.tokens_per_second)
    ar_pred = s.ar.predicted_s < best.predicted_s
    ar_meas = s.ar.tokens_per_second >= best.tokens_per_second
    assert s.decision.levels == (["target"] if ar_pred or ar_meas else best.levels)
    assert (s.decision.ar_predicted_faster, s.decision.ar_measured_faster) == (ar_pred, ar_meas)


def _search_with(monkeypatch, loaded, cands, t_of, **kw):
    from polyspec.export import search

    monkeypatch.setattr(search, "measure_costs", _fake_costs(t_of))
    return search.search_chain(loaded.levels[0], cands, _prompts(1), _settings(**kw))


def _clone(loaded):
    """A model candidate that computes exactly what the target does (the target's tensors, its own cache): the
    target accepts every token of its blocks."""
    from polyspec.decode.levels import ModelLevel
    from polyspec.export.candidates import Candidate, shared_copy

    target = loaded.levels[0].model
    return Candidate("clone", "model", ModelLevel(shared_copy(target, target.args.num_layers), "clone"), False)


def test_greedy_inserts_a_level_that_pays_and_stops_at_one_that_does_not(monkeypatch, loaded, cands):
    """Target T = 1, head T ~ 0; the clone dear as a draft (T(1) = 10) but nearly free verifying (T(w >= 2) ~ 0):
    the best draft is the head, and the clone between target and head must pay (the target's L_eff over the clone's
    blocks is > 1, over the random head about 1), then nothing is left to insert. The clone dear at every width: the
    insertion must not pay and the chain stays target <- head."""
    pick = [c for c in cands if c.name == "head"] + [_clone(loaded)]
    cheap = _search_with(monkeypatch, loaded, pick, {"target": 1.0, "head": 1e-6,
                                                      "clone": lambda w: 10.0 if w == 1 else 1e-6}, max_levels=4)
    assert min(cheap.drafts, key=lambda p: p.predicted_time_per_token_s).levels == ["target", "head"]
    assert [(t.round, t.inserted, t.position, t.pays) for t in cheap.insertions] == [(1, "clone", 1, True)]
    t = cheap.insertions[0]
    assert t.time_after_s < t.time_before_s == min(p.predicted_time_per_token_s for p in cheap.drafts)
    assert cheap.greedy_chain.levels == ["target", "clone", "head"]
    assert cheap.greedy_chain.predicted_time_per_token_s == t.time_after_s
    assert cheap.stop_reason == "no candidate left to insert"
    assert [c.levels for c in cheap.confirmed] == [["target", "clone", "head"], ["target", "head"]]
    dear = _search_with(monkeypatch, loaded, pick, {"target": 1.0, "head": 1e-6, "clone": 1e6}, max_levels=4)
    assert [(x.inserted, x.pays) for x in dear.insertions] == [("clone", False)]
    assert dear.greedy_chain.levels == ["target", "head"]
    assert dear.stop_reason == "no insertion lowers the predicted time"


def test_greedy_builds_four_levels_when_each_insertion_pays(monkeypatch, loaded, cands):
    """Lemma 3.1 forced by cost: the target dear, the rest free, so the time is T_target / L_eff(target), and a
    level whose blocks the target accepts more of pays. Whatever the measured L, the loop's record must hold: each
    accepted insertion lowered the best time, the last round's best did not (or max_levels was reached)."""
    t_of = {c.name: 1e-6 for c in cands} | {"target": 1.0}
    s = _search_with(monkeypatch, loaded, cands, t_of, max_levels=4)
    rounds = sorted({t.round for t in s.insertions})
    chain_time = min(p.predicted_time_per_token_s for p in s.drafts)
    for r in rounds:
        tried = [t for t in s.insertions if t.round == r]
        assert {t.time_before_s for t in tried} == {chain_time}
        best = min(t.time_after_s for t in tried if t.time_after_s is not None)
        if best < chain_time:
            chain_time = best
        else:
            assert r == rounds[-1] and s.stop_reason == "no insertion lowers the predicted time"
    assert s.greedy_chain.predicted_time_per_token_s == chain_time
    assert len(s.greedy_chain.levels) <= 4


def test_decide_search_rule():
    from polyspec.export.results import ConfirmedChain
    from polyspec.export.search import decide_search

    def c(levels, pred, tps):
        return ConfirmedChain(levels=levels, mode="chain", draft="k=2", mu=[2], predicted_grid_s=pred, predicted_s=pred,
                              predicted_tokens_per_second=1 / pred,
                              tokens_per_second=tps, tokens_per_second_steady=tps, lossless_greedy=True)

    a, b = c(["t", "x", "d"], 1.0, 50.0), c(["t", "d"], 2.0, 60.0)
    assert decide_search([a, b], c(["t"], 3.0, 40.0)).levels == ["t", "d"]  # measured-faster of the two
    assert decide_search([a, b], c(["t"], 1.5, 40.0)).levels == ["t"]  # ar predicted faster than the pick
    assert decide_search([a, b], c(["t"], 3.0, 60.0)).levels == ["t"]  # ar measured as fast
    assert decide_search([a, c(["t", "y"], 1.2, 50.0)], c(["t"], 3.0, 10.0)).levels == a.levels  # tie: first


def test_planned_runs_bounds_the_search(measured):
    from polyspec.export.search import planned_runs

    n_model = sum(not c.bottom_only for c in measured.candidates)
    assert measured.runs <= planned_runs(len(measured.candidates), n_model, 1, 1, 4)


def _chain4(cands, bottom: str):
    """target <- RTN int4 g64 <- the int4 folder <- the head (or prompt lookup drafting below the int4 folder)."""
    from polyspec.chain_spec import DraftSpec

    by = {c.name: c.level for c in cands}
    above = [by["int4_g64"], by["int4"]]
    if bottom == "lookup":
        return above, DraftSpec(source="lookup", lookup=3)
    return above + [by[bottom]], DraftSpec(k=2)


@pytest.mark.parametrize("bottom", ["head", "lookup"])
def test_four_level_chain_is_lossless_greedy(loaded, cands, bottom):
    from polyspec.decode.chain import ChainDecoder

    target = loaded.levels[0]
    below, draft = _chain4(cands, bottom)
    for ids in _prompts():
        ar = ChainDecoder([target], max_seq_len=64).generate(ids, 12).token_ids
        r = ChainDecoder([target, *below], draft=draft, mu=[2, 2], max_seq_len=64).generate(ids, 12)
        assert r.token_ids == ar
        assert len(r.level_stats) == 4 and r.level_stats[3].tokens_emitted > 0


def _pair_law(target, prompt: list[int], sp) -> dict[tuple[int, int], float]:
    """P(x1, x2 | prompt) under the warped target, on the pairs it gives probability > 0."""
    from polyspec.decode.sampling import warp

    target.setup(64)
    first = warp(target.forward(prompt, 0)[0][-1], sp.temperature, sp.top_p, sp.top_k).double()  # [V]
    law = {}
    for a in first.nonzero().flatten().tolist():
        row = warp(target.forward([a], len(prompt))[0][-1], sp.temperature, sp.top_p, sp.top_k).double()  # [V]
        law |= {(a, b): float(first[a] * row[b]) for b in row.nonzero().flatten().tolist()}
    return law


def _chi2_pairs(loaded, cands, bottom: str, n: int = 600) -> tuple[float, float]:
    """(Pearson statistic, critical value at alpha = 1e-3) of the four-level chain's first two sampled tokens at
    T = 1, top_k = 4 against the target's exact law; cells expected < 5 pooled."""
    from polyspec.decode.chain import ChainDecoder, SamplingParams

    target, sp, prompt = loaded.levels[0], SamplingParams(temperature=1.0, top_k=4), _prompts(1)[0]
    law = _pair_law(target, prompt, sp)
    below, draft = _chain4(cands, bottom)
    dec = ChainDecoder([target, *below], draft=draft, mu=[2, 2], max_seq_len=64)
    counts: dict[tuple[int, int], int] = {}
    for seed in range(n):
        a, b = dec.generate(prompt, 2, sp, seed=seed).token_ids[:2]
        counts[(a, b)] = counts.get((a, b), 0) + 1
    assert set(counts) <= set(law), "a pair the warped target gives probability 0 was generated"
    big = [k for k in law if law[k] * n >= 5]
    rest = [k for k in law if k not in big]
    obs = [counts.get(k, 0) for k in big] + [sum(counts.get(k, 0) for k in rest)]
    exp = [law[k] * n for k in big] + [sum(law[k] for k in rest) * n]
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp, strict=True) if e > 0)
    return stat, chi2_critical(sum(e > 0 for e in exp) - 1, 1e-3)


@pytest.mark.parametrize("bottom", [pytest.param("head", marks=pytest.mark.slow), "lookup"])
def test_four_level_chain_samples_the_targets_law(loaded, cands, bottom):
    stat, crit = _chi2_pairs(loaded, cands, bottom)
    assert stat < crit, (stat, crit)


@pytest.mark.parametrize("bottom", [pytest.param("head", marks=pytest.mark.slow), "lookup"])
def test_a_wrong_residual_fails_the_same_check(monkeypatch, loaded, cands, bottom):
    """Resampling from p instead of normalise(max(0, p - q)) at a rejection biases the output: the check has power."""
    from polyspec.decode import sampling

    monkeypatch.setattr(sampling, "residual", lambda p, q: p)
    stat, crit = _chi2_pairs(loaded, cands, bottom)
    assert stat > crit, (stat, crit)


def test_search_folder_is_written(tiny_parts, tmp_path):
    from polyspec.export.candidates import CandidateSettings
    from polyspec.export.stage import search_folders
    from polyspec.fsutil import verify_output

    out = tmp_path / "search"
    s = search_folders([tiny_parts["target"], tiny_parts["int4"], tiny_parts["head"]], out,
                       _settings(max_levels=3), CandidateSettings(rtn_group_sizes=(), lookup=False),
                       device="cpu", dtype="float32", prompt_ids=_prompts(1), threads=1, say=lambda _m: None)
    data = json.loads((out / "search.json").read_text())
    assert data["decision"]["rule"] == s.decision.rule and len(data["insertions"]) == len(s.insertions)
    md = (out / "search.md").read_text()
    assert md.count("| 1 | target<-") == len(s.insertions) and "Decision:" in md
    assert verify_output(out) == []


def test_cli_profile_search(tiny_parts, tmp_path, capsys):
    """`polyspec profile RECIPE --search --int4 DIR --head DIR`: the search over the given levels and the copies made
    from the target, written to <workdir>/profile/search and printed; the profile's own key ignores the search keys."""
    from polyspec.cli import main
    from polyspec.config import load_recipe
    from polyspec.export.stage import _settings

    recipe = tmp_path / "r.yaml"
    recipe.write_text(json.dumps({
        "workdir": str(tmp_path / "w"), "tracking": {"enabled": False},
        "data": {"source": str(ASSETS / "sharegpt_sample.json"), "heldout_fraction": 0.4},
        "target": {"source": str(tiny_parts["target"]), "device": "cpu", "dtype": "float32"},
        "profile": {"prompts": 1, "max_new_tokens": 4, "repeats": 1, "kv_length": 16,
                    "draft_k_grid": [2], "mu_grid": [2], "lookup_grid": [3]}}))
    rc = main(["profile", str(recipe), "profile.grid_prompts=1", "--search", "--int4", str(tiny_parts["int4"]),
               "--head", str(tiny_parts["head"]), "--threads", "1"])
    out = capsys.readouterr().out
    assert rc == 0 and "Decision:" in out and "search folder:" in out
    folder = tmp_path / "w" / "profile" / "search"
    saved = json.loads((folder / "search.json").read_text())
    assert [c["name"] for c in saved["candidates"]] == ["int4", "head", "int4_g64", "lookup"]
    plain, searched = (load_recipe(recipe, [f"profile.search={v}"]) for v in ("false", "true"))
    keyed = [_settings(r.profile, r.decode.draft, r.target.device, r.target.dtype, r.data, None)[1]
             for r in (plain, searched)]
    assert keyed[0] == keyed[1]


def test_an_eagle3_head_only_under_levels_with_the_layers_it_reads(cands):
    from types import SimpleNamespace

    from polyspec.export.candidates import fits_head

    by = {c.name: c.level for c in cands}
    layers = by["int4_g64"].model.args.num_layers
    assert fits_head(by["int4_g64"], SimpleNamespace(aux_layers=[0, layers - 1]))
    assert not fits_head(by["int4_g64"], SimpleNamespace(aux_layers=[0, layers]))  # a layer it does not have
    assert fits_head(by["int4_g64"], by["head"])  # an EAGLE-1/2 head reads the final state of any level


def test_run_with_search_exports_the_chain_it_chose(tmp_path, monkeypatch, capfd):
    """`polyspec run` with profile.search: the chain the search chose is the exported chain. Costs are forced (the
    target dear, the RTN g64 copy dear as a draft but free verifying, the int4 folder dear) so the greedy chain is
    target <- int4_g64 <- head, and the rule picks the best predicted chain (wall times on a tiny model say
    nothing): the RTN copy made in memory is written as a GPTQ folder, hashed and listed, and the chain validates
    and decodes greedy-identical to ar."""
    pytest.importorskip("lightning", reason="the train stage needs the [train] extra")
    from dataclasses import replace

    from conftest import make_tiny_llama

    from polyspec.cli import main
    from polyspec.decode.generate import generate_text, load_chain
    from polyspec.export import search

    decide = search.decide_search
    monkeypatch.setattr(search, "decide_search", lambda confirmed, ar: decide(
        confirmed[:1], replace(ar, tokens_per_second=0.0, predicted_s=None)))
    monkeypatch.setattr(search, "measure_costs", _fake_costs(
        {"target": 1.0, "head": 1e-6, "int4": 1e6, "int4_g64": lambda w: 10.0 if w == 1 else 1e-6}))
    target = make_tiny_llama(tmp_path / "target", seed=4)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(json.dumps({
        "workdir": str(tmp_path / "work"), "tracking": {"enabled": False},
        "target": {"source": str(target), "device": "cpu", "dtype": "float32"},
        "data": {"source": str(ASSETS / "sharegpt_sample.json"), "max_length": 96, "heldout_fraction": 0.25},
        "train": {"epochs": 1, "max_steps": 2, "batch_size": 2, "warmup_steps": 1},
        "quantize": {"method": "rtn", "calibration_samples": 2, "calibration_length": 32, "devices": "cpu"},
        "profile": {"search": True, "prompts": 2, "max_new_tokens": 8, "kv_length": 16, "repeats": 1,
                    "draft_k_grid": [2], "mu_grid": [2], "grid_prompts": 1, "lookup_grid": []},
        "export": {"onnx": False}, "decode": {"max_new_tokens": 8}}))
    assert main(["run", str(recipe)]) == 0
    out = capfd.readouterr().out
    assert "chain search" in out and "assistant:" in out
    chain = tmp_path / "work" / "chain"
    assert main(["validate-chain", str(chain)]) == 0
    manifest = json.loads((chain / "manifest.json").read_text())
    chosen = manifest["measurements"]["decision"]
    assert chosen["levels"] == ["target", "int4_g64", "head"]
    assert [lv["kind"] for lv in manifest["levels"]] == ["target", "int4", "head"]
    assert manifest["levels"][1]["quantization"]["group_size"] == 64
    assert manifest["decode"]["mode"] == "chain" and manifest["decode"]["mu"] == chosen["mu"]
    assert manifest["measurements"]["schema"] == "polyspec.search-measurements/1"
    loaded = load_chain(chain, device="cpu")
    for prompt in ("Name three colours.", "Count to five."):
        ar = generate_text(loaded, prompt, mode="ar", max_new_tokens=8)
        assert generate_text(loaded, prompt, max_new_tokens=8)["token_ids"] == ar["token_ids"]
    assert not list((tmp_path / "work").glob(".export-*"))  # the written copy's scratch folder is gone
