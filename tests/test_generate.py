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
        code, cap = _gen(capsys, tiny_chain, "--mode", mode, "--draft-vocab", "64")
        assert code == 0, cap.err
        assert json.loads(cap.out)["token_ids"] == ar


def test_confidence_cut_and_lookup_drafts_keep_greedy_output(tiny_chain, capsys):
    ar = json.loads(_gen(capsys, tiny_chain, "--mode", "ar")[1].out)["token_ids"]
    for mode in ("dual", "chain"):
        code, cap = _gen(capsys, tiny_chain, "--mode", mode, "--draft-k", "6", "--draft-stop", "0.3",
                         "--draft-lookup", "4")
        assert code == 0, cap.err
        out = json.loads(cap.out)
        assert out["token_ids"] == ar and out["stats"]["draft_stop"] == 0.3 and out["stats"]["draft_lookup"] == 4


@pytest.mark.parametrize("args, needle", [
    (["--draft-vocab", "-1"], "--draft-vocab"),
    (["--draft-stop", "1.5"], "--draft-stop"),
    (["--draft-lookup", "-2"], "--draft-lookup"),
    (["--draft-vocab", "100000"], "draft vocabulary size"),
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "0"], "top_p"),
    (["--top-p", "1.5"], "top_p"),
    (["--max-new-tokens", "100000"], "context"),
])
def test_bad_input_is_one_clear_error(tiny_chain, capsys, args, needle):
    code, cap = _gen(capsys, tiny_chain, *args)
    assert code == 2
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
    for mode in ("dual", "chain"):
        code, cap = _gen(capsys, tiny_chain, "--mode", mode, "--tree", "--tree-top-k", "3", "--tree-depth", "4",
                         "--tree-tokens", "12", "--tree-lookup", "5")
        assert code == 0, cap.err
        out = json.loads(cap.out)
        assert out["token_ids"] == ar
        assert out["stats"]["tree"] == {"top_k": 3, "depth": 4, "total_tokens": 12, "lookup": 5, "lookup_first": False}
    code, cap = _gen(capsys, tiny_chain, "--mode", "dual", "--tree-top-k", "2", "--tree-depth", "1", "--tree-tokens",
                     "2", "--tree-lookup", "4", "--tree-lookup-first")
    assert code == 0 and json.loads(cap.out)["token_ids"] == ar
    assert json.loads(cap.out)["stats"]["tree"]["lookup_first"] is True
    code, cap = _gen(capsys, tiny_chain, "--mode", "dual", "--no-tree")
    assert code == 0 and json.loads(cap.out)["stats"]["tree"] is None


@pytest.mark.parametrize("args, needle", [
    (["--no-tree", "--tree-depth", "3"], "--no-tree"),
    (["--tree-top-k", "0"], "top_k=0"),
    (["--tree-lookup", "-1"], "lookup=-1"),
])
def test_bad_tree_flags_are_one_clear_error(tiny_chain, capsys, args, needle):
    code, cap = _gen(capsys, tiny_chain, *args)
    assert code == 2 and needle in cap.err and "Traceback" not in cap.err


def test_manifest_tree_is_the_default(tiny_chain, tmp_path, capsys):
    """A chain whose manifest enables decode.tree decodes with it unless --no-tree says otherwise."""
    chain = tmp_path / "chain"
    shutil.copytree(tiny_chain, chain)
    manifest = json.loads((chain / "manifest.json").read_text())
    manifest["decode"]["tree"] = {"enabled": True, "top_k": 2, "depth": 3, "total_tokens": 6}
    (chain / "manifest.json").write_text(json.dumps(manifest))
    code, cap = _gen(capsys, chain, "--mode", "dual")
    assert code == 0, cap.err
    assert json.loads(cap.out)["stats"]["tree"] == {"top_k": 2, "depth": 3, "total_tokens": 6, "lookup": 0,
                                                    "lookup_first": False}
    code, cap = _gen(capsys, chain, "--mode", "dual", "--tree-tokens", "9")
    assert json.loads(cap.out)["stats"]["tree"] == {"top_k": 2, "depth": 3, "total_tokens": 9, "lookup": 0,
                                                    "lookup_first": False}
    # a manifest whose tree is off still gives --tree its shape (the profile's candidate)
    manifest["decode"]["tree"]["enabled"] = False
    (chain / "manifest.json").write_text(json.dumps(manifest))
    code, cap = _gen(capsys, chain, "--mode", "dual")
    assert json.loads(cap.out)["stats"]["tree"] is None
    code, cap = _gen(capsys, chain, "--mode", "dual", "--tree")
    assert json.loads(cap.out)["stats"]["tree"] == {"top_k": 2, "depth": 3, "total_tokens": 6, "lookup": 0,
                                                    "lookup_first": False}
