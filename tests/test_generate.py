"""`polyspec generate` on a tiny assembled chain: target + RTN int4 copy + random EAGLE head.

Greedy ar, dual and chain outputs are identical token for token; bad input gives one clear error each."""

import json
import shutil

import pytest

from polyspec.cli import main


def _gen(capsys, chain, *extra):
    code = main(["generate", str(chain), "--prompt", "hello there", "--max-new-tokens", "24", "--json",
                 "--device", "cpu", *extra])
    captured = capsys.readouterr()
    return code, captured


def test_greedy_modes_agree_token_for_token(tiny_chain, capsys):
    outs = {}
    for mode in ("ar", "dual", "chain"):
        code, cap = _gen(capsys, tiny_chain, "--mode", mode)
        assert code == 0, cap.err
        outs[mode] = json.loads(cap.out)
    assert len(outs["ar"]["token_ids"]) == 24
    assert outs["dual"]["token_ids"] == outs["ar"]["token_ids"]
    assert outs["chain"]["token_ids"] == outs["ar"]["token_ids"]
    stats = outs["chain"]["stats"]
    assert stats["mode"] == "chain" and stats["new_tokens"] == 24
    assert [lv["name"] for lv in stats["levels"]] == ["target", "intermediate", "draft"]
    for key in ("seconds", "tokens_per_second"):
        assert stats[key] > 0
    for lv in stats["levels"]:
        assert set(lv) >= {"name", "forward_passes", "mean_accepted"}
    # the RTN int4 copy of the target agrees with it on most greedy tokens: the target verifies blocks
    assert stats["levels"][0]["mean_accepted"] > 1.0


def test_sampling_is_seeded(tiny_chain, capsys):
    a = json.loads(_gen(capsys, tiny_chain, "--temperature", "0.8", "--top-p", "0.9", "--seed", "3")[1].out)
    b = json.loads(_gen(capsys, tiny_chain, "--temperature", "0.8", "--top-p", "0.9", "--seed", "3")[1].out)
    assert a["token_ids"] == b["token_ids"]


def test_a_draft_vocabulary_keeps_greedy_output(tiny_chain, capsys):
    ar = json.loads(_gen(capsys, tiny_chain, "--mode", "ar")[1].out)["token_ids"]
    for mode in ("dual", "chain"):
        code, cap = _gen(capsys, tiny_chain, "--mode", mode, "--draft", "vocab=64")
        assert code == 0, cap.err
        assert json.loads(cap.out)["token_ids"] == ar


def test_lookup_drafts_keep_greedy_output(tiny_chain, capsys):
    ar = json.loads(_gen(capsys, tiny_chain, "--mode", "ar")[1].out)["token_ids"]
    for mode, spec in (("dual", "k=6,lookup=4"), ("chain", "k=6,lookup=4"), ("dual", "source=lookup,lookup=5"),
                       ("chain", "source=lookup,lookup=5")):
        code, cap = _gen(capsys, tiny_chain, "--mode", mode, "--draft", spec)
        assert code == 0, cap.err
        out = json.loads(cap.out)
        assert out["token_ids"] == ar and out["stats"]["draft"]["lookup"] in (4, 5), (mode, spec)
        assert out["stats"]["mode"] == mode


@pytest.mark.parametrize("args, needle", [
    (["--draft", "vocab=-1"], "vocab"),
    (["--draft", "k=0"], "k"),
    (["--draft", "lookup=-2"], "lookup"),
    (["--draft", "depth=3"], "key=value"),
    (["--draft", "vocab=100000"], "draft vocabulary size"),
    (["--mu", "0"], "--mu"),
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "0"], "top_p"),
    (["--top-p", "1.5"], "top_p"),
    (["--max-new-tokens", "100000"], "context"),
])
def test_bad_input_is_one_clear_error(tiny_chain, capsys, args, needle):
    code, cap = _gen(capsys, tiny_chain, *args)
    assert code == 2, cap.err
    assert needle in cap.err and "Traceback" not in cap.err


def test_chain_missing_level_file_is_refused(tiny_chain, tmp_path, capsys):
    broken = tmp_path / "chain"
    shutil.copytree(tiny_chain, broken)
    victim = broken / "levels" / "intermediate" / "model.safetensors"
    victim.unlink()
    code, cap = _gen(capsys, broken)
    assert code == 1 and str(victim) in cap.err


def test_chain_mode_needs_three_levels(tiny_llama_dir, tmp_path, capsys):
    from polyspec.manifest import assemble_chain

    assemble_chain(tmp_path / "c", tiny_llama_dir)
    code, cap = _gen(capsys, tmp_path / "c", "--mode", "chain")
    assert code == 2 and "use --mode dual or ar" in cap.err
    code, cap = _gen(capsys, tmp_path / "c", "--mode", "ar")
    assert code == 0 and len(json.loads(cap.out)["token_ids"]) == 24


def test_tree_flags_keep_greedy_output_and_report_the_tree(tiny_chain, capsys):
    code, cap = _gen(capsys, tiny_chain, "--mode", "ar")
    ar = json.loads(cap.out)["token_ids"]
    for mode, spec in (("dual", "tree=3x4x12,lookup=5"), ("chain", "tree=3x4x12,lookup=5"), ("dual", "tree=2x1x2")):
        code, cap = _gen(capsys, tiny_chain, "--mode", mode, "--draft", spec)
        assert code == 0, cap.err
        out = json.loads(cap.out)
        assert out["token_ids"] == ar
        assert out["stats"]["draft"]["tree"] == dict(zip(("top_k", "depth", "total_tokens"),
                                                         map(int, spec.split(",")[0][5:].split("x")), strict=True))
    code, cap = _gen(capsys, tiny_chain, "--mode", "dual", "--draft", "tree=none")
    assert code == 0 and json.loads(cap.out)["stats"]["draft"]["tree"] is None


@pytest.mark.parametrize("args, needle", [
    (["--draft", "tree=0x5x32"], "top_k"),
    (["--draft", "tree=3x4"], "TOPKxDEPTHxTOTAL"),
    (["--draft", "source=lookup,lookup=4,tree=2x2x2"], "tree"),
])
def test_bad_tree_flags_are_one_clear_error(tiny_chain, capsys, args, needle):
    code, cap = _gen(capsys, tiny_chain, *args)
    assert code == 2 and needle in cap.err and "Traceback" not in cap.err


def test_the_manifests_draft_is_the_default(tiny_chain, tmp_path, capsys):
    """A chain decodes with its manifest's decode.draft; --draft changes only the keys it names."""
    chain = tmp_path / "chain"
    shutil.copytree(tiny_chain, chain)
    manifest = json.loads((chain / "manifest.json").read_text())
    manifest["decode"]["draft"] = {"k": 3, "tree": {"top_k": 2, "depth": 3, "total_tokens": 6}, "lookup": 2}
    (chain / "manifest.json").write_text(json.dumps(manifest))
    code, cap = _gen(capsys, chain, "--mode", "dual")
    assert code == 0, cap.err
    draft = json.loads(cap.out)["stats"]["draft"]
    assert draft["tree"] == {"top_k": 2, "depth": 3, "total_tokens": 6} and draft["lookup"] == 2
    code, cap = _gen(capsys, chain, "--mode", "dual", "--draft", "tree=2x3x9")
    draft = json.loads(cap.out)["stats"]["draft"]
    assert draft["tree"]["total_tokens"] == 9 and draft["lookup"] == 2 and draft["k"] == 3
    code, cap = _gen(capsys, chain, "--mode", "dual", "--draft", "tree=none")
    assert json.loads(cap.out)["stats"]["draft"] == {"source": "model", "k": 3, "tree": None, "lookup": 2, "vocab": 0}


def test_a_schema_1_manifest_is_read_as_schema_2(tiny_chain, tmp_path, capsys):
    """Chains written before the DraftSpec keep working: their decode section is translated on reading."""
    chain = tmp_path / "chain"
    shutil.copytree(tiny_chain, chain)
    manifest = json.loads((chain / "manifest.json").read_text())
    manifest["schema_version"] = 1
    manifest["decode"] = {"mode": "dual", "draft_k": 2, "draft_stop": 0.0, "draft_lookup": 0, "mu": [6],
                          "tree": {"enabled": True, "top_k": 2, "depth": 1, "total_tokens": 2, "lookup": 6,
                                   "lookup_first": True}, "temperature": 0.0, "top_p": 1.0, "top_k": 0,
                          "max_new_tokens": 64, "draft_vocab": 0, "ngram": False}
    (chain / "manifest.json").write_text(json.dumps(manifest))
    code, cap = _gen(capsys, chain)
    assert code == 0, cap.err
    stats = json.loads(cap.out)["stats"]
    assert stats["mode"] == "dual" and stats["draft"] == {"source": "model", "k": 2, "lookup": 6, "vocab": 0,
                                                          "tree": {"top_k": 2, "depth": 1, "total_tokens": 2}}
