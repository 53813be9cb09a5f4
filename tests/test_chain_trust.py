"""The chain folder is a trust boundary (docs/DECODE.md): every manifest path stays inside it, it holds only the files
its manifest lists and no pickle, each level's claims match its own config, and a damaged safetensors file is one
clear error naming it — in validate-chain and in every reader (generate, the profile's loaders, the fallback, bench)."""

import json
import os
import shutil
from pathlib import Path

import pytest

from polyspec.cli import main
from polyspec.errors import PolyspecError
from polyspec.manifest import sha256_file, validate_chain


@pytest.fixture
def chain(tiny_chain, tmp_path):
    """A private copy of the tiny chain (target <- int4 <- head), next to an ``outside`` folder."""
    (tmp_path / "outside").mkdir()
    return Path(shutil.copytree(tiny_chain, tmp_path / "chain"))


def edit_manifest(chain: Path, change) -> None:
    raw = json.loads((chain / "manifest.json").read_text())
    change(raw)
    (chain / "manifest.json").write_text(json.dumps(raw))


def refused(chain: Path, match: str, capsys) -> str:
    """validate_chain and the CLI both refuse with ``match`` in the message, and no traceback."""
    with pytest.raises(PolyspecError, match=match) as ei:
        validate_chain(chain)
    assert main(["validate-chain", str(chain)]) != 0
    err = capsys.readouterr().err
    assert "Traceback" not in err and str(ei.value).splitlines()[0] in err
    return str(ei.value)


# 1. Paths escape the folder -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rel", ["../../outside/secret", "/etc/hostname", "sub/../../../outside/secret",
                                 "./config.json", "a//b", "..\\..\\outside\\secret", ""])
def test_a_file_entry_outside_or_not_normalised_is_refused_by_its_key(chain, rel, capsys):
    secret = chain.parent / "outside" / "secret"
    secret.write_text("not yours")
    edit_manifest(chain, lambda raw: raw["levels"][1]["files"].update({rel: sha256_file(secret)}))
    msg = refused(chain, r"levels\.1\.files\[", capsys)
    assert repr(rel) in msg


def test_an_escaping_path_says_nothing_about_whether_its_target_exists(chain, capsys):
    (chain.parent / "outside" / "there").write_text("x")
    messages = []
    for name in ("there", "not-there"):
        edit_manifest(chain, lambda raw, n=name: raw["levels"][0]["files"].update({f"../../../outside/{n}": "0" * 64}))
        messages.append(refused(chain, "relative, normalised", capsys).replace(name, "NAME"))
        edit_manifest(chain, lambda raw, n=name: raw["levels"][0]["files"].pop(f"../../../outside/{n}"))
    assert messages[0] == messages[1]
    assert "missing" not in messages[0] and "changed" not in messages[0]


@pytest.mark.parametrize("how", ["relative", "absolute", "symlink"])
def test_a_level_folder_outside_the_chain_is_refused(chain, how, capsys):
    evil = chain.parent / "outside" / "int4"
    shutil.copytree(chain / "levels" / "intermediate", evil)  # the same files and hashes: only the place differs
    if how == "symlink":
        shutil.rmtree(chain / "levels" / "intermediate")
        os.symlink(evil, chain / "levels" / "intermediate")
    else:
        path = "../outside/int4" if how == "relative" else str(evil)
        edit_manifest(chain, lambda raw: raw["levels"][1].update(path=path))
    refused(chain, r"levels\.1\.path", capsys)
    with pytest.raises(PolyspecError, match=r"levels\.1\.path"):
        from polyspec.decode.generate import load_chain

        load_chain(chain, device="cpu")


def test_a_listed_file_that_links_outside_is_refused_one_inside_is_fine(chain, capsys):
    target = chain / "levels" / "target"
    alias = target / "alias.json"
    os.symlink("config.json", alias)  # inside: a link is fine when it stays in the chain
    edit_manifest(chain, lambda raw: raw["levels"][0]["files"].update({"alias.json": sha256_file(alias)}))
    validate_chain(chain)
    copy = chain.parent / "outside" / "model.safetensors"
    shutil.copy(target / "model.safetensors", copy)
    (target / "model.safetensors").unlink()
    os.symlink(copy, target / "model.safetensors")  # same bytes, same hash, but outside
    refused(chain, r"levels\.0\.files\['model\.safetensors'\] = .* does not resolve inside", capsys)


def test_levels_need_folders_of_their_own(chain, capsys):
    edit_manifest(chain, lambda raw: raw["levels"][2].update(path="levels/intermediate"))
    refused(chain, r"levels\.2\.path = 'levels/intermediate' is levels\.1\.path", capsys)


# 2. Pickles never reach torch ----------------------------------------------------------------------------------------


def test_a_listed_pickle_is_refused(chain, capsys):
    pickle = chain / "levels" / "target" / "pytorch_model.bin"
    pickle.write_bytes(b"\x80\x04not really")
    edit_manifest(chain, lambda raw: raw["levels"][0]["files"].update({"pytorch_model.bin": sha256_file(pickle)}))
    msg = refused(chain, "is a pickle", capsys)
    assert str(pickle) in msg


def test_assemble_leaves_a_parts_pickles_out(tiny_parts, tmp_path):
    from polyspec.manifest import assemble_chain

    target = Path(shutil.copytree(tiny_parts["target"], tmp_path / "target"))
    (target / "training_args.bin").write_bytes(b"\x80\x04")
    m = assemble_chain(tmp_path / "chain", target, [tiny_parts["int4"]], tiny_parts["head"])
    assert "training_args.bin" not in m.levels[0].files
    assert not (tmp_path / "chain" / "levels" / "target" / "training_args.bin").exists()


def _pickled_llama(tiny_llama_dir: Path, folder: Path) -> Path:
    """The tiny Llama with its weights as pytorch_model.bin only (a pickle transformers would load)."""
    import torch

    from polyspec.weights import load_safetensors

    folder.mkdir(parents=True)
    torch.save(load_safetensors(tiny_llama_dir / "model.safetensors"), folder / "pytorch_model.bin")
    for f in tiny_llama_dir.glob("*.json"):
        shutil.copy(f, folder / f.name)
    assert (folder / "pytorch_model.bin").is_file() and not list(folder.glob("*.safetensors"))
    return folder


def test_the_transformers_paths_never_load_a_pickle(tiny_llama_dir, tmp_path, monkeypatch):
    import torch

    from polyspec.bench.bench import HFRunner
    from polyspec.decode import hf_fallback

    folder = _pickled_llama(tiny_llama_dir, tmp_path / "pickled")

    def no_unpickling(*_a, **_k):
        raise AssertionError("torch.load was called on a pickle")

    monkeypatch.setattr(torch, "load", no_unpickling)
    with pytest.raises(PolyspecError, match="transformers could not load it"):
        hf_fallback.load(folder, dtype=torch.float32, device="cpu", reason="test", quiet=True)
    with pytest.raises(OSError, match="safetensors"):
        HFRunner.load(folder, "cpu", torch.float32)


def test_the_bench_assistant_never_loads_a_pickle(tiny_llama_dir, tmp_path, monkeypatch):
    import torch

    from polyspec.bench.bench import NotApplicable, load_hf_assistant
    from polyspec.manifest import ChainManifest, LevelEntry, hash_folder, write_manifest
    from polyspec.sources import load_tokenizer

    chain = tmp_path / "chain"  # read by the bench's assistant loader through the manifest only
    shutil.copytree(tiny_llama_dir, chain / "levels" / "target")
    _pickled_llama(tiny_llama_dir, chain / "levels" / "mid")
    levels = [LevelEntry(name=n, kind=k, path=f"levels/{n}", files=hash_folder(chain / "levels" / n))
              for n, k in (("target", "target"), ("mid", "model"))]
    write_manifest(chain, ChainManifest(levels=levels))
    monkeypatch.setattr(torch, "load", lambda *_a, **_k: pytest.fail("torch.load was called on a pickle"))
    with pytest.raises(NotApplicable, match="mid"):
        load_hf_assistant(chain, "cpu", load_tokenizer(tiny_llama_dir))


# 3. Complete validation ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["notes.txt", "levels/notes.txt", "levels/extra/model.safetensors"])
def test_a_file_the_manifest_does_not_list_is_refused_anywhere(chain, where, capsys):
    extra = chain / where
    extra.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(chain / "levels" / "target" / "config.json", extra)
    msg = refused(chain, "is not in the manifest", capsys)
    assert str(extra) in msg


def test_a_link_to_a_folder_is_refused(chain, capsys):
    os.symlink(chain / "levels" / "target", chain / "levels" / "again")
    refused(chain, "again is not in the manifest", capsys)


@pytest.mark.parametrize("claim, match", [
    ({"kind": "model", "quantization": None}, "kind 'model', its config.json makes it 'int4'"),
    ({"quantization": {"quant_method": "gptq", "bits": 8, "group_size": 128}}, "quantization"),
    ({"dtype": "bfloat16"}, "dtype 'bfloat16', its config.json says 'float32'"),
])
def test_a_level_whose_claims_disagree_with_its_config_is_refused(chain, claim, match, capsys):
    edit_manifest(chain, lambda raw: raw["levels"][1].update(claim))
    msg = refused(chain, match, capsys)
    assert "level intermediate" in msg


def test_int4_without_a_quantization_config_and_a_head_that_is_not_one_are_refused(chain, capsys):
    def lie(raw):
        raw["levels"][0]["kind"] = "target"
        raw["levels"][2]["kind"] = "int4"
        raw["levels"][2]["quantization"] = {"bits": 4}

    edit_manifest(chain, lie)
    refused(chain, r"level draft: the manifest \(levels\.2\) says kind 'int4', its config.json makes it 'head'", capsys)


def test_a_level_with_an_empty_file_list_is_refused(chain, capsys):
    shutil.rmtree(chain / "levels" / "draft")
    (chain / "levels" / "draft").mkdir()
    edit_manifest(chain, lambda raw: raw["levels"][2].update(files={}))
    refused(chain, r"level draft: its file list \(levels\.2\.files\) is empty", capsys)


# 4. No raw tracebacks on damaged safetensors -------------------------------------------------------------------------


def _damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    path.write_bytes(b"<html>not a model</html>" if how == "foreign" else data[: len(data) // 2])


@pytest.mark.parametrize("how", ["foreign", "truncated"])
def test_a_damaged_safetensors_file_is_named_by_validate_and_generate(chain, how, capsys):
    victim = chain / "levels" / "intermediate" / "model.safetensors"
    _damage(victim, how)
    # the manifest re-made over the damaged file: the hashes match, the header does not
    edit_manifest(chain, lambda raw: raw["levels"][1]["files"].update({"model.safetensors": sha256_file(victim)}))
    msg = refused(chain, "not a readable safetensors file", capsys)
    assert str(victim) in msg
    assert main(["generate", str(chain), "--prompt", "hi", "--device", "cpu", "--max-new-tokens", "2"]) != 0
    err = capsys.readouterr().err
    assert str(victim) in err and "Traceback" not in err


@pytest.mark.parametrize("how", ["foreign", "truncated"])
def test_every_loader_names_a_damaged_safetensors_file(tiny_parts, tmp_path, how):
    """What the profile and a plain-folder generate read, without a chain's validation in front of them."""
    import torch

    from polyspec.decode import hf_fallback
    from polyspec.decode.head import load_head
    from polyspec.decode.model import Transformer

    target = Path(shutil.copytree(tiny_parts["target"], tmp_path / "target"))
    head = Path(shutil.copytree(tiny_parts["head"], tmp_path / "head"))
    good = Transformer.from_pretrained(tiny_parts["target"])
    for f in (head / "token_counts.safetensors", head / "model.safetensors", target / "model.safetensors"):
        _damage(f, how)
        with pytest.raises(PolyspecError, match="not a readable safetensors file") as ei:
            if f.parent == head:
                load_head(head, good)
            else:
                Transformer.from_pretrained(target)
        assert str(f) in str(ei.value)
        shutil.copy(tiny_parts[f.parent.name] / f.name, f)
    _damage(target / "model.safetensors", how)
    with pytest.raises(PolyspecError, match=str(target / "model.safetensors")):
        hf_fallback.load(target, dtype=torch.float32, device="cpu", reason="test", quiet=True)


def test_assemble_names_a_damaged_part_at_its_source(tiny_parts, tmp_path):
    from polyspec.manifest import assemble_chain

    head = Path(shutil.copytree(tiny_parts["head"], tmp_path / "head"))
    _damage(head / "model.safetensors", "truncated")
    with pytest.raises(PolyspecError, match=str(head / "model.safetensors")):
        assemble_chain(tmp_path / "chain", tiny_parts["target"], [tiny_parts["int4"]], head)
    assert not (tmp_path / "chain").exists() and not list(tmp_path.glob(".chain.*"))


def _shard_target(chain: Path, shard_ref: str) -> Path:
    """Turn the target level into a sharded checkpoint whose index names ``shard_ref``; manifest updated to match."""
    from safetensors import safe_open

    level = chain / "levels" / "target"
    (level / "model.safetensors").rename(level / "model-00001-of-00001.safetensors")
    with safe_open(str(level / "model-00001-of-00001.safetensors"), framework="pt") as f:
        names = list(f.keys())
    (level / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {n: shard_ref for n in names}}))

    def change(raw):
        files = raw["levels"][0]["files"]
        files.pop("model.safetensors")
        for rel in ("model-00001-of-00001.safetensors", "model.safetensors.index.json"):
            files[rel] = sha256_file(level / rel)

    edit_manifest(chain, change)
    return level


def test_a_shard_index_may_name_only_the_levels_own_listed_shards(chain, capsys):
    from polyspec.decode.model import load_safetensors_dir

    level = _shard_target(chain, "model-00001-of-00001.safetensors")
    validate_chain(chain)  # a sharded level is fine
    assert load_safetensors_dir(level)
    outside = chain.parent / "outside" / "evil.safetensors"
    shutil.copy(level / "model-00001-of-00001.safetensors", outside)
    for ref in (str(outside), "../../../outside/evil.safetensors"):
        index = json.loads((level / "model.safetensors.index.json").read_text())
        index["weight_map"] = {n: ref for n in index["weight_map"]}
        (level / "model.safetensors.index.json").write_text(json.dumps(index))
        edit_manifest(chain, lambda raw: raw["levels"][0]["files"].update(
            {"model.safetensors.index.json": sha256_file(level / "model.safetensors.index.json")}))
        refused(chain, "names shard", capsys)
        with pytest.raises(PolyspecError, match="outside"):
            load_safetensors_dir(level)
