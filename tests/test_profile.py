"""Profiling a tiny random chain (target <- RTN int4 <- random EAGLE head): forward costs, acceptance, verdicts,
the decision, stamped tables and plots; plus the pure verdict / interpolation maths."""

import dataclasses
import json
import math
import time
from pathlib import Path

import pytest
import torch

from polyspec.export.profile import ProfileSettings
from polyspec.export.results import CostRow, GridRow, Profile, from_json, to_json
from polyspec.export.timing import cost_at, mean_cost, summarize_times
from polyspec.export.verdict import choose_config, fit_alpha, lengths_from_hist, variance_check
from polyspec.theory import acceptance_length_moments, chain_time_per_token, insertion

ASSETS = Path(__file__).parent / "assets"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _prompts(n: int = 2) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 500, (10 + 6 * i,), generator=g).tolist() for i in range(n)]


@pytest.fixture(scope="module")
def profile(tiny_parts, tmp_path_factory):
    from polyspec.export.stage import profile_folders

    out = tmp_path_factory.mktemp("profile") / "p"
    s = ProfileSettings(max_new_tokens=10, kv_length=32, warmup=1, repeats=3, draft_ks=(2, 3), mus=(4,))
    return profile_folders(tiny_parts, out, s, device="cpu", prompt_ids=_prompts(), threads=1, say=lambda _m: None)


def test_costs_have_the_right_shape_and_are_positive(profile):
    costs = profile.costs
    assert set(costs) == {"target", "intermediate", "draft"}
    assert [(lv.name, lv.tag) for lv in profile.levels] == [("target", "target"), ("intermediate", "int4"),
                                                            ("draft", "head")]
    for name, rows in costs.items():
        widths = [r.width for r in rows]
        assert widths == sorted(set(widths)) and widths[0] == 1, name
        for r in rows:
            assert r.kv_length == 32 and r.repeats == 3
            assert 0 < r.min_s <= r.p10_s <= r.median_s <= r.p90_s
    # the verifiers were timed at the widths the decoder ran: draft_k + 1 for the target in dual mode
    assert {3, 4} <= {r.width for r in costs["target"]}


def test_acceptance_tables(profile):
    from polyspec.export.report import summary_L

    L = summary_L(profile)
    for key in ("L_i", "L_new", "L_i_new"):
        assert L[key] >= 1.0
    assert L["beta_dual"] > 0 and L["beta_chain"] > 0
    final = profile.final
    assert set(final) == {"ar", "dual", "chain", "dual_at_chain_k", "int4_over_head"}
    for name, run in final.items():
        assert run.new_tokens > 0 and run.tokens_per_second > 0, name
        assert len(run.betas) == len(run.levels) - 1 and run.beta == (run.betas[-1] if run.betas else None)
        for lv in run.per_level.values():
            if lv.accept_hist is not None:  # a full distribution: counts add up to the verifications, mean is L
                lengths = lengths_from_hist(lv.accept_hist)
                assert len(lengths) == lv.verifications > 0
                assert sum(lengths) / len(lengths) == pytest.approx(lv.L)
    # the RTN copy agrees with the target far more than a random head does
    assert L["L_i_new"] > L["L_i"]
    # greedy ar, dual and chain emit the same tokens
    assert profile.lossless_greedy is True


def test_verdict_is_theory_insertion_on_the_measured_numbers(profile):
    (v,) = profile.insertions
    assert (v.level, v.above, v.below) == ("intermediate", "target", "draft")
    i = v.inputs
    again = insertion(i.T_i, i.T_new, i.T_next, i.L_i, i.L_new, i.L_i_new, i.beta).to_dict()
    for key, value in again.items():
        assert getattr(v, key) == pytest.approx(value) if isinstance(value, float) else getattr(v, key) == value, key
    final = profile.final
    assert i.L_i == final["dual_at_chain_k"].per_level["target"].L
    assert i.L_new == final["int4_over_head"].per_level["intermediate"].L
    assert i.L_i_new == final["chain"].per_level["target"].L
    assert v.pays == (v.time_after < v.time_before)
    assert v.time_before_own_widths == final["dual_at_chain_k"].predicted.time_per_token_s
    assert v.pays_own_widths == (v.time_after_own_widths < v.time_before_own_widths)
    assert len(v.candidates) == 2  # one per grid chain point
    for c in v.candidates:
        assert c.label.startswith("k=") and c.pays == (c.time_after < c.time_before)


def test_decision_minimises_predicted_time(profile):
    rows = profile.grid
    assert len(rows) == 2 + 2 + 1  # dual per draft k, chain per (k, mu), ar
    for r in rows:
        names = list(r.T_s)
        if len(names) > 1:
            expect = chain_time_per_token([r.T_s[n] for n in names], [r.L_eff[n] for n in names[:-1]], r.beta)
            assert r.predicted_time_per_token_s == pytest.approx(expect)
    dec = profile.decision
    best = min((r for r in rows if r.mode in ("chain", "dual")), key=lambda r: r.predicted_time_per_token_s)
    assert (dec.speculative_mode, dec.draft) == (best.mode, best.draft)
    final = profile.final
    ar_faster = final["ar"].predicted.time_per_token_s < min(
        final[n].predicted.time_per_token_s for n in ("dual", "chain"))
    assert dec.ar_predicted_faster is ar_faster
    ar_measured = final["ar"].tokens_per_second >= final[best.mode].tokens_per_second
    assert dec.ar_measured_faster is ar_measured
    # the fastest predicted way to decode this chain, unless ar measured at least as fast
    assert dec.mode == ("ar" if ar_faster or ar_measured else best.mode)
    assert dec.predicted_time_per_token_s == best.predicted_time_per_token_s
    sp = profile.speedup["wall"].configs
    assert sp["dual"].predicted == pytest.approx(1.0) and sp["dual"].measured == pytest.approx(1.0)
    assert all(row.predicted > 0 and row.measured > 0 for row in sp.values())


def test_variance_check_uses_the_exact_formula(profile):
    assert list(profile.variance) == ["dual_target", "int4_over_head", "chain_intermediate", "chain_target"]
    assert [vc.approximate for vc in profile.variance.values()] == [False, False, False, True]
    for name, vc in profile.variance.items():
        if not vc.count:
            continue
        mean, var = acceptance_length_moments(vc.alpha, vc.n)
        assert mean == pytest.approx(min(max(vc.mean, 1.0), vc.n), abs=1e-6), name
        assert var == pytest.approx(vc.var_theory)


def test_tables_are_stamped_and_plots_written(profile):
    folder = Path(profile.path)
    for name in ("costs", "acceptance", "grid", "verdict", "speedup", "variance"):
        table = json.loads((folder / "tables" / f"{name}.json").read_text())
        assert table["stamps"]["software"]["polyspec"] and table["stamps"]["hardware"]["logical_cores"] >= 1
        assert "torch" in table["stamps"]["software"]["packages"]
    for png in ("insertion_region.png", "acceptance_hist.png"):
        assert (folder / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (folder / "verdict.md").read_text()
    for row in ("| T_target / T_int4 / T_head (ms, chain widths) |", "| L_i (target over head, dual k=",
                "| L_new (int4 over head, k=", "| L_i_new (target over int4 blocks, mu=4) |", "| beta (dual / chain) |",
                "| cond1: ", "| cond2: ", "| valid regime ", "| Lemma 3.1 ms/token before -> after |", "| chosen | ",
                "| tokens/s int4_over_head (int4<-head k=", "| Var[accept] chain_target (n=", "Hardware:"):
        assert row in md, row
    # the break-even L of dual against ar, from the same Lemma 3.1 terms the prediction used
    dual, ar = profile.final["dual"].predicted, profile.final["ar"].predicted
    need = (dual.T[0] + dual.beta * dual.T[1]) / ar.T[0]
    assert f"to match ar / to reach 1.5x ar (Lemma 3.1: (T_target + beta T_draft) / T_ar) | {need:.2f} / " \
           f"{1.5 * need:.2f} (measured L {dual.L_eff[0]:.2f}) |" in md
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")]  # no temp folders left


def test_profile_json_round_trips_and_old_formats_say_rerun(profile, tmp_path):
    from polyspec.errors import PolyspecError
    from polyspec.export.report import PROFILE_JSON, read_profile

    back = read_profile(Path(profile.path))
    assert isinstance(back, Profile) and back.format == 4
    assert to_json(back) == json.loads(json.dumps(to_json(profile)))
    assert back.final["chain"].per_level["target"].accept_hist == profile.final["chain"].per_level["target"].accept_hist
    assert from_json(CostRow, to_json(profile.costs["draft"][0])) == profile.costs["draft"][0]
    old = tmp_path / "old"
    old.mkdir()
    (old / PROFILE_JSON).write_text(json.dumps({"format": 2, "verdict": {}}))
    with pytest.raises(PolyspecError, match="rerun the profile stage"):
        read_profile(old)
    assert read_profile(tmp_path / "none") is None


def test_profile_stage_reads_prompts_and_caches(tiny_parts, tmp_path):
    from polyspec.config import validate_tree
    from polyspec.pipeline import run_profile as profile_stage

    recipe = validate_tree({"workdir": str(tmp_path / "w"), "tracking": {"enabled": False},
                            "data": {"source": str(ASSETS / "sharegpt_sample.json"), "heldout_fraction": 0.4},
                            "target": {"device": "cpu"},
                            "profile": {"prompts": 2, "max_new_tokens": 6, "repeats": 2,
                                        "kv_length": 16, "draft_k_grid": [2], "mu_grid": [4], "lookup_grid": []}},
                           "test")
    logged = []

    class Tracker:
        def log_metrics(self, m, step=None):
            logged.append(("metrics", m))

        def log_artifact(self, path, artifact_path=None):
            logged.append(("artifact", Path(path)))

    kw = {"parts": tiny_parts, "say": lambda _m: None, "threads": 1}
    first = profile_stage(recipe, Tracker(), **kw)
    assert first.prompts.count == 2 and first.torch_threads == 1
    assert {p["source"] for p in first.prompt_sources} <= {"mtbench", "sharegpt"}
    assert Path(first.path).parent == tmp_path / "w" / "profile"
    assert [lv.folder for lv in first.levels] == [str(tiny_parts[k]) for k in ("target", "int4", "head")]
    assert any(k == "artifact" and p == Path(first.path) for k, p in logged)
    metrics = next(m for k, m in logged if k == "metrics")
    assert metrics["profile/pays"] == float(first.insertions[0].pays)
    t0 = time.perf_counter()
    second = profile_stage(recipe, None, **kw)
    assert time.perf_counter() - t0 < 5 and second.key == first.key and second.path == first.path
    assert to_json(second) == json.loads(json.dumps(to_json(first)))

    # a damaged stored profile is named and measured again
    said = []
    table = next((Path(first.path) / "tables").iterdir())
    table.write_text(table.read_text()[:20])
    third = profile_stage(recipe, None, parts=tiny_parts, say=said.append, threads=1)
    assert any("is damaged" in m and table.name in m for m in said), said
    assert third.key == first.key and json.loads(table.read_text())


# ---------------------------------------------------------------------------------------------------------------------
# Pure functions


@pytest.mark.parametrize("alpha, n", [(0.0, 3), (0.3, 4), (0.8, 6), (0.95, 13)])
def test_fit_alpha_inverts_the_exact_mean(alpha, n):
    mean, _ = acceptance_length_moments(alpha, n)
    assert fit_alpha(mean, n) == pytest.approx(alpha, abs=1e-8)
    assert fit_alpha(0.5, n) == 0.0 and fit_alpha(n + 1.0, n) == 1.0


def test_variance_check_on_an_exact_distribution():
    # alpha = 0.5, n = 3: P(1) = .5, P(2) = .25, P(3) = .25 -> 8 samples in those proportions
    vc = variance_check([1, 1, 1, 1, 2, 2, 3, 3], 3)
    assert vc.alpha == pytest.approx(0.5, abs=1e-9)
    assert vc.var_measured == pytest.approx(vc.var_theory)
    assert vc.var_ratio == pytest.approx(1.0)


def test_cost_interpolation_and_summary():
    table = [CostRow(width=w, kv_length=8, median_s=t, p10_s=t, p90_s=t, mean_s=t, min_s=t, repeats=1)
             for w, t in ((1, 1.0), (3, 2.0), (7, 6.0))]
    assert cost_at(table, 2) == pytest.approx(1.5)
    assert cost_at(table, 5) == pytest.approx(4.0)
    assert cost_at(table, 9) == pytest.approx(8.0)  # extrapolated from the last segment
    assert cost_at(table, 0) == pytest.approx(1.0)  # never below the smallest measured time
    assert mean_cost(table, {1: 1, 3: 3}) == pytest.approx((1.0 + 6.0) / 4)
    s = summarize_times([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (s["median_s"], s["min_s"], s["repeats"]) == (3.0, 1.0, 5)
    assert s["p10_s"] == pytest.approx(1.4) and s["p90_s"] == pytest.approx(4.6)


def test_choose_config_picks_the_fastest_allowed_mode():
    def row(mode, t):
        return GridRow(label=mode, mode=mode, draft={"k": 2}, mu=[], L={}, L_eff={}, beta=1.0, T_s={},
                       predicted_time_per_token_s=t, measured_tokens_per_second=1.0,
                       measured_tokens_per_second_steady=1.0, new_tokens=1)

    rows = [row("ar", 0.1), row("dual", 0.3), row("chain", 0.2)]
    assert choose_config(rows).mode == "chain"
    assert choose_config(rows, ("dual",)).mode == "dual"


def test_region_boundaries_agree_with_theory():
    from polyspec.export.plots import region_lines

    inp = {"T_i": 10.0, "T_next": 1.0, "L_i": 2.0, "L_i_new": 5.0, "beta": 4.0}
    xs = [0.05, 0.2, 0.5]
    lines = region_lines(inp, xs)
    for x, y1, y2, y3 in zip(xs, lines["cond1"], lines["cond2"], lines["exact"], strict=True):
        for y, key in ((y1, "cond1_holds"), (y2, "cond2_holds")):
            for eps, expect in ((1e-6, True), (-1e-6, False)):
                v = insertion(inp["T_i"], x * inp["T_i"], inp["T_next"], inp["L_i"], y + eps, inp["L_i_new"],
                              inp["beta"])
                assert getattr(v, key) is expect, (x, key)
        if math.isfinite(y3):
            above = insertion(10.0, x * 10.0, 1.0, 2.0, y3 * 1.001, 5.0, 4.0)
            below = insertion(10.0, x * 10.0, 1.0, 2.0, y3 * 0.999, 5.0, 4.0)
            assert above.pays and not below.pays


def test_tree_joins_the_grid_and_the_decision(tiny_parts, tmp_path):
    """With a draft tree candidate the grid also holds dual and chain with the tree; the decision is the minimum over
    all of them, and an exported chain keeps the tree only when it was chosen."""
    from polyspec.chain_spec import DecodeSpec, DraftSpec
    from polyspec.export.package import export_profiled
    from polyspec.export.stage import profile_folders
    from polyspec.manifest import read_manifest

    tp = DraftSpec(tree={"top_k": 2, "depth": 3, "total_tokens": 6})
    s = ProfileSettings(max_new_tokens=10, kv_length=32, warmup=1, repeats=2, draft_ks=(2,), mus=(4,), tree=tp)
    prof = profile_folders(tiny_parts, tmp_path / "p", s, device="cpu", prompt_ids=_prompts(), threads=1,
                           say=lambda _m: None)
    rows = prof.grid
    tree_rows = [r for r in rows if r.draft and r.draft["tree"]]
    assert {r.mode for r in tree_rows} == {"dual", "chain"} and len(rows) == 1 + 1 + 2 + 1
    assert all(r.draft == tp.model_dump() for r in tree_rows)
    best = min((r for r in rows if r.mode in ("chain", "dual")), key=lambda r: r.predicted_time_per_token_s)
    dec = prof.decision
    assert (dec.speculative_mode, dec.draft) == (best.mode, best.draft)
    assert dec.grid["tree"] == "tree=2x3x6"
    assert prof.lossless_greedy
    decode = DecodeSpec.model_validate({"draft": {"tree": {"top_k": 2, "depth": 3, "total_tokens": 6}}})
    for chosen in (DraftSpec(k=2), tp):
        prof.decision.draft = chosen.model_dump()
        out = export_profiled(tmp_path / f"chain-{chosen.text()}", tiny_parts, prof, decode, onnx=False)
        assert read_manifest(out).decode.draft == chosen


def test_cli_profile_verb_with_given_and_rtn_levels(tiny_parts, tmp_path, capsys):
    """`polyspec profile RECIPE --head DIR --rtn-int4`: the CLI hands typed level folders to the stage, which makes
    the RTN copy under <workdir>/profile, notes it, and prints the verdict table."""
    from polyspec.cli import main

    recipe = tmp_path / "r.yaml"
    recipe.write_text(json.dumps({
        "workdir": str(tmp_path / "w"), "tracking": {"enabled": False},
        "data": {"source": str(ASSETS / "sharegpt_sample.json"), "heldout_fraction": 0.4},
        "target": {"source": str(tiny_parts["target"]), "device": "cpu"},
        "profile": {"prompts": 1, "max_new_tokens": 4, "repeats": 1, "kv_length": 16,
                    "draft_k_grid": [2], "mu_grid": [4], "lookup_grid": []}}))
    rc = main(["profile", str(recipe), "profile.grid_prompts=1", "--head", str(tiny_parts["head"]), "--rtn-int4",
               "--threads", "1"])
    out = capsys.readouterr().out
    assert rc == 0 and "| cond1: " in out and "profile folder:" in out
    folder = Path(out.strip().splitlines()[-1].split("profile folder: ")[1])
    saved = json.loads((folder / "profile.json").read_text())
    assert saved["notes"]["int4"].startswith("RTN int4") and saved["torch_threads"] == 1
    assert saved["levels"][1]["folder"] == str(tmp_path / "w" / "profile" / "rtn_int4")


def test_dtype_auto_times_the_candidates_and_the_chain_decodes_in_the_choice(tiny_parts, tmp_path, monkeypatch):
    """target.dtype auto: the profile times the target in every candidate dtype, profiles in the fastest by the
    measured sum, records the table, and the exported chain loads in that dtype unless one is asked for."""
    from polyspec.chain_spec import DecodeSpec
    from polyspec.decode.generate import load_chain
    from polyspec.device import decode_dtype_candidates, resolve_dtype
    from polyspec.export import stage
    from polyspec.export.package import export_profiled

    assert decode_dtype_candidates("cpu") == ("float32", "bfloat16")
    assert resolve_dtype("auto", "cpu") in (torch.float32, torch.bfloat16)
    s = ProfileSettings(max_new_tokens=6, kv_length=16, warmup=1, repeats=2, draft_ks=(2,), mus=(4,))
    name, table = stage.pick_dtype(tiny_parts["target"], "cpu", s, say=lambda _m: None)
    assert set(table) == {"float32", "bfloat16"} and all(set(r) == {1, 3} for r in table.values())
    assert name == min(table, key=lambda n: sum(table[n].values()))
    # which dtype wins on this machine is a measurement; make bf16 win to see it carried through
    monkeypatch.setattr(stage, "pick_dtype", lambda *a, **k: ("bfloat16", {"bfloat16": {1: 1.0}, "float32": {1: 2.0}}))
    prof = stage.profile_folders(tiny_parts, tmp_path / "p", s, device="cpu", dtype="auto", prompt_ids=_prompts(),
                                 threads=1, say=lambda _m: None)
    assert prof.dtype == "bfloat16" and prof.notes["dtype_probe"]["float32"] == {"1": 2.0}
    out = export_profiled(tmp_path / "chain", tiny_parts, prof, DecodeSpec(), onnx=False)
    assert load_chain(out, device="cpu").models["target"].embed_tokens.weight.dtype == torch.bfloat16
    assert load_chain(out, device="cpu", dtype="float32").models["target"].embed_tokens.weight.dtype == torch.float32


def test_prompt_lookup_joins_the_grid_and_a_chain_that_chose_it_decodes_with_it(tiny_parts, tmp_path):
    """With lookup sizes the grid holds dual with prompt-lookup blocks at every draft k and prompt lookup alone at
    every size (its T is none: a list search is the decoder's own work); the decision is the minimum over every
    speculative row, and a chain exported with either chosen decodes with it (greedy output equal to ar)."""
    from polyspec.bench.bench import EngineRunner
    from polyspec.chain_spec import DecodeSpec, DraftSpec
    from polyspec.decode.chain import SamplingParams
    from polyspec.decode.generate import build_decoder, load_chain
    from polyspec.export.package import export_profiled
    from polyspec.export.stage import profile_folders
    from polyspec.manifest import read_manifest

    s = ProfileSettings(max_new_tokens=12, kv_length=32, warmup=1, repeats=2, draft_ks=(1, 2), mus=(4,),
                        lookups=(3,))
    prof = profile_folders(tiny_parts, tmp_path / "p", s, device="cpu", prompt_ids=_prompts(), threads=1,
                           say=lambda _m: None)
    looked = [(r.mode, r.draft["source"], r.draft["k"], r.draft["lookup"]) for r in prof.grid
              if r.draft and r.draft["lookup"]]
    assert looked == [("dual", "model", 1, 3), ("dual", "model", 2, 3), ("dual", "lookup", 4, 3)]
    alone = next(r for r in prof.grid if r.draft and r.draft["source"] == "lookup")
    assert set(alone.T_s) == {"target", "lookup"} and alone.T_s["lookup"] == 0.0
    best = min((r for r in prof.grid if r.mode != "ar"), key=lambda r: r.predicted_time_per_token_s)
    assert (prof.decision.speculative_mode, prof.decision.draft) == (best.mode, best.draft)
    assert prof.decision.grid["lookup"] == [3] and prof.lossless_greedy
    chain = None
    for chosen in (DraftSpec(k=1, lookup=3), DraftSpec(source="lookup", lookup=3)):
        prof.decision.mode = prof.decision.speculative_mode = "dual"  # as when this one wins
        prof.decision.draft = chosen.model_dump()
        out = export_profiled(tmp_path / f"chain-{chosen.source}", tiny_parts, prof, DecodeSpec(), onnx=False)
        assert read_manifest(out).decode.draft == chosen
        chain = load_chain(out, device="cpu")
        prompt = _prompts()[1]
        ar = build_decoder(chain, "ar", max_seq_len=64).generate(prompt, 16)
        dual = build_decoder(chain, "dual", max_seq_len=64)
        assert dual.draft == chosen and len(dual.levels) == (1 if chosen.source == "lookup" else 2)
        assert dual.generate(prompt, 16).token_ids == ar.token_ids
        default = EngineRunner(chain, "default").generate(prompt, 16, SamplingParams(), 0, set())
        assert default.token_ids == ar.token_ids
    assert default.levels[-1]["name"] == "lookup"


def test_interleaved_runs_take_turns_and_measure_what_separate_runs_measure(tiny_parts, monkeypatch):
    """Final runs take turns prompt by prompt (so a machine slowing down for a while slows every configuration
    alike); each configuration's counts are those of running it alone."""
    from polyspec.chain_spec import DraftSpec
    from polyspec.export import acceptance
    from polyspec.export.package import ordered_parts
    from polyspec.export.stage import load_levels

    lv = load_levels(ordered_parts(tiny_parts), device="cpu")
    target, inter, draft = lv.levels
    prompts = _prompts(3)
    configs = [dict(levels=[target], draft=None, label="ar"),
               dict(levels=[target, draft], draft=DraftSpec(k=3), label="dual"),
               dict(levels=[target, inter, draft], draft=DraftSpec(k=2), mu=[4], label="chain"),
               dict(levels=[target], draft=DraftSpec(source="lookup", lookup=4), label="lookup")]
    alone = [acceptance.run_config(c["levels"], prompts, 12, draft=c["draft"], mu=c.get("mu"), label=c["label"])
             for c in configs]
    order = []
    step = acceptance.ConfigRun.step
    monkeypatch.setattr(acceptance.ConfigRun, "step", lambda self, ids: order.append(self.label) or step(self, ids))
    together = acceptance.run_interleaved(configs, prompts, 12)
    assert order == ["ar", "dual", "chain", "lookup"] * 3
    for a, t in zip(alone, together, strict=True):
        assert (t.label, t.levels, t.outputs, t.new_tokens, t.betas) == (a.label, a.levels, a.outputs, a.new_tokens,
                                                                          a.betas)
        assert {n: x.L for n, x in t.per_level.items()} == {n: x.L for n, x in a.per_level.items()}
    assert together[0].outputs == together[1].outputs == together[2].outputs == together[3].outputs  # lossless
    assert together[3].levels == ["target", "lookup"] and together[3].mode == "dual"


def test_forward_widths_take_turns_and_each_gets_its_repeats():
    """time_forwards runs one forward of each width in turn (a drifting machine slows them alike), each from the same
    filled cache at kv_length, with features of the block's width for a feature-reading level."""
    from polyspec.export.timing import time_forward, time_forwards

    class Level:
        name, needs_features = "fake", True

        def __init__(self):
            self.calls = []

        def setup(self, n):
            self.size = n

        def reset(self):
            pass

        def forward(self, tokens, start, feats=None):
            self.calls.append((len(tokens), start, None if feats is None else tuple(feats.shape)))
            return torch.zeros(len(tokens), 4), None

    lv = Level()
    rows = time_forwards(lv, [3, 1, 2], 8, warmup=1, repeats=2, hidden_size=5, vocab_size=10)
    assert [(r.width, r.kv_length, r.repeats) for r in rows] == [(3, 8, 2), (1, 8, 2), (2, 8, 2)]
    assert lv.calls[0] == (7, 1, (7, 5))  # the cache fill: positions 1..7 (a feature reader starts at 1)
    assert lv.calls[1:] == [(w, 8, (w, 5)) for _ in range(3) for w in (3, 1, 2)]
    assert time_forward(Level(), 2, 8, warmup=0, repeats=3, hidden_size=5).repeats == 3
    from polyspec.errors import PolyspecError

    with pytest.raises(PolyspecError, match="widths"):
        time_forwards(Level(), [], 8, hidden_size=5)


def _row(label, mode, predicted, tree=None, lookup=0, k=1):
    from polyspec.export.results import GridRow

    draft = {"source": "model", "k": k, "tree": tree, "lookup": lookup, "vocab": 0}
    return GridRow(label=label, mode=mode, draft=draft, mu=[], L={}, L_eff={}, beta=1.0, T_s={},
                   predicted_time_per_token_s=predicted, measured_tokens_per_second=0.0,
                   measured_tokens_per_second_steady=0.0, new_tokens=0)


def test_runners_up_and_the_fastest_measured_dual_is_kept():
    """The final runs measure the best predicted dual and its runner-ups; the fastest measured replaces the choice
    (the demo's 4 grid prompts once put k=2 ahead of k=1, which the bench then measured 9 % slower)."""
    from types import SimpleNamespace

    from polyspec.chain_spec import DraftSpec
    from polyspec.export.profile import _Choice, _keep_fastest_dual
    from polyspec.export.verdict import runners_up

    tree = {"top_k": 2, "depth": 1, "total_tokens": 2}
    rows = [_row("k=2 lookup=6", "dual", 1.0, lookup=6, k=2), _row("k=1 lookup=6", "dual", 1.1, lookup=6),
            _row("tree", "dual", 1.2, tree=tree), _row("chain", "chain", 0.9), _row("k=1", "dual", 1.5)]
    alts = runners_up(rows, rows[0], 2)
    assert [r.label for r in alts] == ["k=1 lookup=6", "tree"]
    assert runners_up(rows, rows[0], 0) == []
    # the grid's fastest measured dual joins them where the prediction ranks it lower (and only then)
    timed = [dataclasses.replace(r, measured_tokens_per_second=tps) for r, tps in zip(rows, (96, 97, 95, 50, 99), strict=True)]
    assert [r.label for r in runners_up(timed, timed[0], 2)] == ["k=1 lookup=6", "tree", "k=1"]
    assert [r.label for r in runners_up(timed, timed[4], 2)] == ["k=2 lookup=6", "k=1 lookup=6"]
    assert runners_up(timed, timed[0], 0) == []
    run = lambda label, tps: SimpleNamespace(label=label, tokens_per_second=tps)  # noqa: E731
    c = _Choice(chosen=rows[0], best_dual=rows[0], chain_draft=DraftSpec(k=1), mu=4, other_duals=alts)
    final = {"ar": run("ar", 100.0), "dual": run("dual k=2", 140.0), "dual_alt0": run("dual k=1", 150.0),
             "dual_alt1": run("dual tree", 145.0), "chain": run("chain", 90.0)}
    notes = _keep_fastest_dual(c, final, lambda _m: None)
    assert c.chosen is rows[1] and c.best_dual is rows[1]
    assert set(final) == {"ar", "dual", "chain"} and final["dual"].label == "dual k=1"
    assert notes["dual_kept"] == "k=1 lookup=6" and notes["duals_measured_tokens_per_second"]["k=2 lookup=6"] == 140.0
    # a chain choice stays; only the dual baseline moves (here to the tree, with its shape)
    c = _Choice(chosen=rows[3], best_dual=rows[0], chain_draft=DraftSpec(k=1), mu=4, other_duals=alts)
    final = {"ar": run("ar", 100.0), "dual": run("dual k=2", 140.0), "dual_alt0": run("dual k=1", 120.0),
             "dual_alt1": run("dual tree", 145.0)}
    _keep_fastest_dual(c, final, lambda _m: None)
    assert c.chosen is rows[3] and c.best_dual is rows[2] and c.best_dual.draft["tree"] == tree
