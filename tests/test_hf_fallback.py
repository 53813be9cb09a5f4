"""Models polyspec's engine does not implement run through transformers behind the decoder's interface
(polyspec.decode.hf_fallback): a note on stderr, the same cache API, and chains of such levels stay exactly lossless."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import ASSETS, TINY_VOCAB

from polyspec.chain_spec import DraftSpec
from polyspec.cli import main
from polyspec.decode import hf_fallback
from polyspec.decode.chain import SamplingParams
from polyspec.decode.generate import build_decoder, load_chain, load_model_folder
from polyspec.decode.model import read_hf_config
from polyspec.errors import PolyspecError
from polyspec.manifest import assemble_chain


def make_tiny_gpt2(path: Path, *, seed: int = 0, layers: int = 2, width: int = 64) -> Path:
    """A random GPT-2 (an architecture the engine does not implement) with the tiny ChatML tokenizer."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=TINY_VOCAB, n_positions=256, n_embd=width, n_layer=layers, n_head=4,
                     bos_token_id=1, eos_token_id=2)
    GPT2LMHeadModel(cfg).eval().save_pretrained(path, safe_serialization=True)
    for f in (ASSETS / "tokenizers" / "chatml").iterdir():
        shutil.copy(f, path / f.name)
    return path


@pytest.fixture(scope="module")
def gpt2_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gpt2")
    return {"target": make_tiny_gpt2(root / "target", seed=0),
            "mid": make_tiny_gpt2(root / "mid", seed=0, layers=1),  # the target's first layer only: agrees often
            "draft": make_tiny_gpt2(root / "draft", seed=3, layers=1, width=32)}


def test_engine_refusal_names_what_the_engine_lacks(gpt2_dirs, tiny_llama_dir):
    why = hf_fallback.engine_refusal(read_hf_config(gpt2_dirs["target"]))
    assert why is not None and "gpt2" in why
    assert hf_fallback.engine_refusal(read_hf_config(tiny_llama_dir)) is None
    silly = dict(read_hf_config(tiny_llama_dir), hidden_act="gelu")  # a Llama the engine would compute wrongly
    assert "gelu" in hf_fallback.engine_refusal(silly)


def test_cache_api_matches_a_fresh_forward_after_rollback(gpt2_dirs):
    m = hf_fallback.load(gpt2_dirs["target"], dtype=torch.float32, device="cpu", reason="test", quiet=True)
    ids = torch.randint(0, TINY_VOCAB, (30,), generator=torch.Generator().manual_seed(1))
    m.setup_cache(64)
    full_logits, full_hidden = m(ids)
    assert full_logits.shape == (30, TINY_VOCAB) and full_logits.dtype == torch.float32
    m.reset()
    m(ids[:12])
    m(torch.tensor([7, 8, 9, 10]))  # a rejected block ...
    m.truncate(12)  # ... rolled back
    assert m.cache_len == 12
    logits, hidden = m(ids[12:])
    assert torch.allclose(logits, full_logits[12:], atol=1e-5)
    assert torch.allclose(hidden, full_hidden[12:], atol=1e-5)
    last, _ = m(torch.tensor([3]), last_only=True)
    assert last.shape == (1, TINY_VOCAB) and m.cache_len == 31
    m.truncate(0)
    assert m.cache_len == 0 and torch.allclose(m(ids[:5])[0], full_logits[:5], atol=1e-5)
    with pytest.raises(PolyspecError, match="max_seq_len"):
        m(torch.zeros(60, dtype=torch.long))
    with pytest.raises(PolyspecError, match="draft trees"):
        m(ids[:2], tree_mask=torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(PolyspecError, match="truncate"):
        m.truncate(40)


def test_a_plain_folder_falls_back_with_a_note_and_matches_transformers_greedy(gpt2_dirs, capsys):
    from transformers import AutoModelForCausalLM

    chain = load_model_folder(gpt2_dirs["target"], device="cpu")
    err = capsys.readouterr().err
    assert "gpt2" in err and "slower path" in err
    model = chain.models["target"]
    assert isinstance(model, hf_fallback.HFCausalLM)
    prompt = [5, 17, 99, 4, 250, 31]
    dec = build_decoder(chain, "ar", max_seq_len=64)
    ours = dec.generate(prompt, 20, SamplingParams()).token_ids
    hf = AutoModelForCausalLM.from_pretrained(gpt2_dirs["target"]).eval()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()
    assert ours == ref


def test_chains_of_transformers_levels_are_lossless(gpt2_dirs, tmp_path, capsys):
    out = tmp_path / "chain"
    assemble_chain(out, gpt2_dirs["target"], [gpt2_dirs["mid"]], gpt2_dirs["draft"])
    chain = load_chain(out, device="cpu")
    assert all(isinstance(m, hf_fallback.HFCausalLM) for m in chain.models.values())
    prompt = [5, 17, 99, 4, 250, 31, 8]
    greedy = {mode: build_decoder(chain, mode, max_seq_len=96, draft=DraftSpec(k=3), mu=[4]).generate(
        prompt, 40, SamplingParams()) for mode in ("ar", "dual", "chain")}
    assert greedy["dual"].token_ids == greedy["ar"].token_ids == greedy["chain"].token_ids
    assert len(greedy["ar"].token_ids) == 40
    assert greedy["chain"].stats["levels"][0]["mean_accepted"] > 1.0  # the 1-layer copy's blocks get accepted
    # The CLI: a note, and the same tokens.
    code = main(["generate", str(out), "--prompt", "hello there", "--max-new-tokens", "12", "--json", "--device",
                 "cpu", "--mode", "chain", "--draft", "k=2"])
    cap = capsys.readouterr()
    assert code == 0, cap.err
    assert "slower path" in cap.err and json.loads(cap.out)["stats"]["new_tokens"] == 12
    with pytest.raises(PolyspecError, match="draft trees"):
        build_decoder(chain, "dual", max_seq_len=96, draft=DraftSpec(tree={"top_k": 2, "depth": 2, "total_tokens": 4})
                      ).generate(prompt, 8, SamplingParams())


def test_a_head_on_a_transformers_target_is_one_clear_error(gpt2_dirs, tiny_parts, tmp_path):
    out = tmp_path / "chain"
    try:
        assemble_chain(out, gpt2_dirs["target"], [], tiny_parts["head"])
    except PolyspecError:
        return  # refused at assembly: also one clear error
    with pytest.raises(PolyspecError, match="polyspec's engine"):
        load_chain(out, device="cpu")


def test_bench_runs_a_transformers_chain_and_times_its_levels(gpt2_dirs, tmp_path, capsys):
    out = tmp_path / "chain"
    assemble_chain(out, gpt2_dirs["target"], [gpt2_dirs["mid"]], gpt2_dirs["draft"])
    prompts = tmp_path / "q.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "category": "writing", "turns": ["hello there", "and more"]})
                       + "\n")
    report = tmp_path / "bench.json"
    code = main(["bench", str(out), "--prompts", str(prompts), "--modes", "ar,dual,chain", "--max-new-tokens", "10",
                 "--device", "cpu", "--draft", "k=2", "--mu", "3", "--forward-times", "--forward-repeats", "2",
                 "--forward-prefix", "8", "--json", str(report)])
    cap = capsys.readouterr()
    assert code == 0, cap.err
    r = json.loads(report.read_text())
    assert r["mismatches"] == [] and set(r["overall"]) == {"ar", "dual", "chain"}
    assert all(r["overall"][m]["tokens_per_second"] > 0 for m in ("ar", "dual", "chain"))
    assert list(r["forward_times"]["levels"]) == ["target", "intermediate", "draft"]
