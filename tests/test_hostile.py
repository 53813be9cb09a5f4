"""Hostile and careless inputs (issue 47): each one clear error (what, where, how to fix), a non-zero exit, no
traceback, fast, and nothing half-written. One test per row of the issue's table and per item it added; the whole
module runs in well under a minute on 2 cores (the kill -9 and full-disk exports of a profiled chain are in
tests/test_export.py, beside the profile they need)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pickle
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from polyspec.cli import main
from polyspec.errors import PolyspecError
from polyspec.manifest import sha256_file, validate_chain

pytestmark = pytest.mark.usefixtures("one_torch_thread")
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def chain(tiny_chain, tmp_path):
    """A private copy of the tiny chain (target <- int4 <- head)."""
    return Path(shutil.copytree(tiny_chain, tmp_path / "chain"))


def _cli(capsys, *argv) -> tuple[int, str]:
    """polyspec's exit code and stderr; an exception escaping main (a traceback) fails the test here."""
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


def _edit_json(path: Path, change) -> None:
    raw = json.loads(path.read_text())
    change(raw)
    path.write_text(json.dumps(raw))


def _rehash(chain: Path, level: str, rel: str) -> None:
    """The manifest records the file's current sha256, as a tamperer who updates the hash too would write it."""
    def change(raw):
        lv = next(x for x in raw["levels"] if x["name"] == level)
        lv["files"][rel] = sha256_file(chain / lv["path"] / rel)
    _edit_json(chain / "manifest.json", change)


def _timed(fn, *args):
    t0 = time.monotonic()
    out = fn(*args)
    return out, time.monotonic() - t0


# ---------------------------------------------------------------------------------------------------------------------
# The chain folder: manifest.json


def test_a_manifest_nested_100k_deep_is_one_error_exit_2(chain, capsys):
    path = chain / "manifest.json"
    raw = json.loads(path.read_text())
    raw["measurements"] = {"x": "@"}
    path.write_text(json.dumps(raw).replace('"@"', "[" * 100_000 + "]" * 100_000))
    (code, err), seconds = _timed(_cli, capsys, "validate-chain", chain)
    assert code == 2 and f"{path}: arrays/objects nest 100002 deep" in err and seconds < 1


def test_a_manifest_with_a_byte_that_is_not_utf8_is_one_error(chain, capsys):
    path = chain / "manifest.json"
    path.write_bytes(path.read_bytes().replace(b'"target"', b'"tar\xffget"', 1))
    code, err = _cli(capsys, "validate-chain", chain)
    assert code == 2 and "byte 0xff at offset" in err and "not UTF-8" in err


@pytest.mark.parametrize("levels, match", [(3_000, "3001 levels; a chain has at most 32"),
                                           (20_000, "bytes is over the 8,388,608 a chain manifest may have")])
def test_a_manifest_with_thousands_of_levels_is_refused_at_once(chain, capsys, levels, match):
    def many(raw):
        lv = raw["levels"][1]
        raw["levels"][1:] = [{**lv, "name": f"l{i}", "path": f"levels/l{i}"} for i in range(levels)]
    _edit_json(chain / "manifest.json", many)
    (code, err), seconds = _timed(_cli, capsys, "validate-chain", chain)
    assert code == 2 and match in err and seconds < 1
    from polyspec.decode.serve import server as serve  # `serve` runs the same check before anything else

    with pytest.raises(PolyspecError, match=match):
        serve.build_app(chain, device="cpu")


def test_a_manifest_over_its_size_limit_is_refused_unread(chain, capsys):
    from polyspec.manifest import MAX_MANIFEST_BYTES

    path = chain / "manifest.json"
    _edit_json(path, lambda raw: raw["measurements"].update(pad="x" * MAX_MANIFEST_BYTES))
    (code, err), seconds = _timed(_cli, capsys, "validate-chain", chain)
    assert code == 2 and f"bytes is over the {MAX_MANIFEST_BYTES:,}" in err and seconds < 1


def test_the_chain_checks_are_linear_in_levels(tiny_chain):
    """Folders and paths of 5,000 levels are checked in well under a second (an all-pairs check took minutes)."""
    from polyspec.manifest import ChainManifest, LevelEntry, level_folders

    levels = [LevelEntry(name=f"l{i}", kind="target" if i == 0 else "model", path=f"levels/l{i}",
                         files={"config.json": "0" * 64}) for i in range(5_000)]
    manifest = ChainManifest(levels=levels)
    folders, seconds = _timed(level_folders, tiny_chain, manifest)
    assert len(folders) == 5_000 and seconds < 1.5
    manifest.levels[4_000].path = "levels/l17/inner"
    with pytest.raises(PolyspecError, match=r"levels\.4000\.path = 'levels/l17/inner' lies inside levels\.17\.path"):
        level_folders(tiny_chain, manifest)


# ---------------------------------------------------------------------------------------------------------------------
# The chain folder: configs against tensors, levels against each other


@pytest.mark.parametrize("key, value, match", [
    ("hidden_size", 256, r"model\.embed_tokens\.weight is \[512, 128\]; config\.json \(vocab_size 512, hidden_size "
                         r"256\) makes it \[512, 256\]"),
    ("vocab_size", 100, r"model\.embed_tokens\.weight is \[512, 128\]; config\.json \(vocab_size 100, hidden_size "
                        r"128\) makes it \[100, 128\]"),
    ("num_attention_heads", 0, r"config\.json: num_attention_heads must be a positive integer, got 0"),
])
def test_a_target_config_that_contradicts_its_tensors_is_refused(chain, capsys, key, value, match, monkeypatch):
    _edit_json(chain / "levels" / "target" / "config.json", lambda cfg: cfg.update({key: value}))
    _rehash(chain, "target", "config.json")
    with pytest.raises(PolyspecError, match=match):
        validate_chain(chain)
    import polyspec.decode.generate as gen

    monkeypatch.setattr(gen, "load_model", lambda *a, **k: pytest.fail("a level was loaded"))
    code, err = _cli(capsys, "generate", chain, "--prompt", "hi", "--device", "cpu", "--max-new-tokens", "2")
    assert code != 0 and "level target" in err


def test_a_config_claiming_a_million_layers_is_refused_before_any_allocation(chain, monkeypatch):
    import polyspec.decode.generate as gen

    for level in ("target", "intermediate"):
        folder = chain / "levels" / level
        _edit_json(folder / "config.json", lambda cfg: cfg.update(num_hidden_layers=10**6))
        _rehash(chain, level, "config.json")
    monkeypatch.setattr(gen, "load_model", lambda *a, **k: pytest.fail("a level was built"))
    t0 = time.monotonic()
    with pytest.raises(PolyspecError) as exc:
        gen.load_chain(chain, device="cpu")
    assert time.monotonic() - t0 < 1
    msg = str(exc.value)
    for level in ("target", "intermediate"):
        assert f"level {level}: {chain / 'levels' / level / 'config.json'}: num_hidden_layers 1000000, but its " \
               "weights hold layers 0..1 (2 layers)" in msg


def test_levels_that_disagree_with_each_other_are_refused(tiny_parts, tmp_path, capsys):
    """A verifier with another vocabulary, a head made for another target, a head reading a level that is not there:
    refused when the chain is written and when it is read."""
    from conftest import make_tiny_llama, make_tiny_parts

    from polyspec.manifest import assemble_chain

    other = make_tiny_parts(tmp_path / "other", make_tiny_llama(tmp_path / "other_target", hidden=64, heads=2,
                                                                  kv_heads=1, intermediate=128, vocab=256))
    with pytest.raises(PolyspecError, match=r"level intermediate: vocab_size 256 differs from the target's 512"):
        assemble_chain(tmp_path / "a", tiny_parts["target"], [other["target"]], tiny_parts["head"])
    with pytest.raises(PolyspecError, match=r"level draft: the head is made for hidden size 64 and vocabulary 256, "
                                            r"its target \(level target\) has hidden size 128 and vocabulary 512"):
        assemble_chain(tmp_path / "b", tiny_parts["target"], [tiny_parts["int4"]], other["head"])
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    good = tmp_path / "good"
    assemble_chain(good, tiny_parts["target"], [tiny_parts["int4"]], tiny_parts["head"])
    _edit_json(good / "manifest.json", lambda raw: raw["levels"][2].update(reads_features_from="nope"))
    code, err = _cli(capsys, "validate-chain", good)
    assert code != 0 and "reads_features_from = 'nope' names no level above it" in err


def test_a_head_reading_a_verifier_of_another_width_is_refused(tiny_parts, tmp_path, capsys):
    """A head takes its features from the level above it; a verifier of another hidden size (same vocabulary, so a
    valid level on its own) cannot feed it: refused when written, and when read with the head pointed at it."""
    from conftest import make_tiny_llama

    from polyspec.manifest import assemble_chain

    narrow = make_tiny_llama(tmp_path / "narrow", hidden=64, heads=2, kv_heads=1, intermediate=128)
    want = r"level draft: reads features of hidden size 64 from level intermediate, the head is made for hidden size 128"
    with pytest.raises(PolyspecError, match=want):
        assemble_chain(tmp_path / "a", tiny_parts["target"], [narrow], tiny_parts["head"])
    assert not (tmp_path / "a").exists()
    chain = tmp_path / "b"
    assemble_chain(chain, tiny_parts["target"], [narrow, tiny_parts["int4"]], tiny_parts["head"])
    assert _cli(capsys, "validate-chain", chain)[0] == 0  # the head reads the int4 level above it
    _edit_json(chain / "manifest.json", lambda raw: raw["levels"][3].update(reads_features_from="intermediate1"))
    code, err = _cli(capsys, "validate-chain", chain)
    assert code != 0 and "reads features of hidden size 64 from level" in err


# ---------------------------------------------------------------------------------------------------------------------
# The chain folder: what its files are


def test_a_pickle_under_any_name_is_refused_by_its_content(chain, capsys):
    pt2 = chain / "levels" / "target" / "model.pt2"
    pt2.write_bytes(pickle.dumps({"weights": [1.0]}, protocol=4))
    _rehash(chain, "target", "model.pt2")
    code, err = _cli(capsys, "validate-chain", chain)
    assert code != 0 and f"{pt2} is a pickle (by its content)" in err
    pt2.write_bytes(b"\x00\x01binary of some kind")
    _rehash(chain, "target", "model.pt2")
    code, err = _cli(capsys, "validate-chain", chain)
    assert code != 0 and f"{pt2} is neither a safetensors file nor UTF-8 text" in err


def test_a_hard_link_is_refused(chain, tmp_path, capsys):
    inside = chain / "levels" / "target" / "generation_config.json"
    outside = tmp_path / "elsewhere.json"
    os.link(inside, outside)  # same bytes, same hash: editing `outside` would change the chain after validation
    code, err = _cli(capsys, "validate-chain", chain)
    assert code != 0 and f"{inside} has 2 hard links" in err


# ---------------------------------------------------------------------------------------------------------------------
# Recipes


def _recipe(tmp_path: Path, body: bytes | str, name: str = "r.yaml") -> Path:
    p = tmp_path / name
    p.write_bytes(body if isinstance(body, bytes) else body.encode())
    return p


@pytest.mark.parametrize("body, match", [
    (b"workdir: w\nprofile:\n  mu_grid: " + b"[" * 10_000 + b"]" * 10_000 + b"\n", r"line 3: values nest more than 32"),
    (b"workdir: w\ntrain:\n  lr: 0.1  # caf\xe9\n", r"byte 0xe9 at offset 34 is not UTF-8"),
])
def test_a_hostile_recipe_is_one_error_naming_the_file(tmp_path, capsys, body, match):
    p = _recipe(tmp_path, body)
    (code, err), seconds = _timed(_cli, capsys, "validate", p)
    assert code == 2 and re.search(f"{re.escape(str(p))}: {match}", err) and seconds < 1


def test_a_hostile_override_is_one_error(tmp_path, capsys):
    p = _recipe(tmp_path, f"workdir: {tmp_path / 'w'}\n")
    code, err = _cli(capsys, "validate", p, "profile.mu_grid=" + "[" * 10_000 + "]" * 10_000)
    assert code == 2 and "override 'profile.mu_grid=[[[" in err and "nest more than 32" in err


def test_a_50_mb_recipe_is_refused_by_size_and_many_unknown_keys_at_once(tmp_path, capsys):
    from polyspec.config import MAX_RECIPE_BYTES

    big = tmp_path / "big.yaml"
    with open(big, "w") as f:
        f.write("workdir: w\n")
        f.writelines(f"unknown_key_{i:07d}_{'x' * 24}: 1\n" for i in range(1_000_000))
    (code, err), seconds = _timed(_cli, capsys, "validate", big)
    assert code == 2 and f"bytes is over the {MAX_RECIPE_BYTES:,} a recipe may have" in err and seconds < 1
    keys = (MAX_RECIPE_BYTES - 100) // 20
    many = _recipe(tmp_path, "workdir: w\n" + "".join(f"k{i:07d}: 1\n" for i in range(keys)))
    (code, err), seconds = _timed(_cli, capsys, "validate", many)
    assert code == 2 and "unknown key 'k0000000'" in err and f"and {keys - 20} more" in err
    assert err.count("\n") < 30 and seconds < 2


@pytest.mark.parametrize("override", ["train.lr=inf", "train.lr=.inf", "train.lr=nan", "train.lr=-inf",
                                      "data.heldout_fraction=-inf", "decode.temperature=inf"])
def test_infinity_is_refused_like_nan(tmp_path, capsys, override):
    p = _recipe(tmp_path, f"workdir: {tmp_path / 'w'}\n")
    code, err = _cli(capsys, "validate", p, override)
    key = override.split("=")[0]
    assert code == 2 and f"bad value for '{key}'" in err


def test_a_yaml_alias_bomb_under_a_valid_key_fails_fast(tmp_path, capsys):
    levels = ["&a0 [1, 1, 1, 1, 1, 1, 1, 1, 1]"] + [f"&a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 10)]
    p = _recipe(tmp_path, f"workdir: {tmp_path / 'w'}\nprofile:\n  mu_grid: [{', '.join(levels)}]\n")
    (code, err), seconds = _timed(_cli, capsys, "validate", p)
    assert code == 2 and "line 3: this value expands to more than 100,000 values" in err and seconds < 1
    merged = _recipe(tmp_path, f"base: &b {{lr: 0.001}}\nworkdir: {tmp_path / 'w'}\ntrain:\n  <<: *b\n", "ok.yaml")
    code, err = _cli(capsys, "validate", merged)  # an anchor used once is fine (the unknown key is the error)
    assert code == 2 and "unknown key 'base'" in err


@pytest.mark.parametrize("where", ["root", "home", "above home", "unrelated"])
def test_a_workdir_that_is_not_polyspecs_is_refused(tmp_path, capsys, monkeypatch, where):
    home = tmp_path / "home" / "me"
    home.mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    project = tmp_path / "project"
    project.mkdir()
    (project / "main.py").write_text("print('mine')\n")
    (project / "logs").mkdir()  # one name polyspec also writes does not make it a polyspec workdir
    workdir = {"root": "/", "home": home, "above home": home.parent, "unrelated": project}[where]
    p = _recipe(tmp_path, "workdir: w\n")
    code, err = _cli(capsys, "validate", p, f"workdir={workdir}")
    assert code == 2 and f"'workdir' ({str(workdir)!r})" in err
    if where == "unrelated":
        assert "main.py" in err and (project / "main.py").is_file()


def test_a_new_an_empty_and_a_used_workdir_are_accepted(tmp_path, capsys):
    used = tmp_path / "used"
    for name in ("logs", "cache", "head", "chain", ".chain.tmp-1@host.x"):
        (used / name).mkdir(parents=True)
    (used / "recipe.resolved.yaml").write_text("workdir: used\n")
    (used / "mlflow.db").write_bytes(b"")
    (tmp_path / "empty").mkdir()
    p = _recipe(tmp_path, "workdir: w\n")
    for workdir in (tmp_path / "new", tmp_path / "empty", used):
        assert _cli(capsys, "validate", p, f"workdir={workdir}")[0] == 0


# ---------------------------------------------------------------------------------------------------------------------
# polyspec generate and chain export-head: arguments


@pytest.mark.parametrize("argv, match", [
    (["--prompt", ""], "--prompt is empty"),
    (["--prompt", "caf\udce9 au lait"], "--prompt is not valid UTF-8 (byte 0xe9 at character 3)"),
    (["--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--prompt", "hi", "--max-new-tokens", "-1"], "--max-new-tokens must be >= 1"),
    (["--prompt", "hi", "--temperature", "nan"], "finite number"),
    (["--prompt", "hi", "--temperature", "inf"], "finite number"),
])
def test_generate_refuses_bad_arguments_before_loading_anything(tiny_chain, capsys, monkeypatch, argv, match):
    import polyspec.decode.generate as gen

    monkeypatch.setattr(gen, "load_chain", lambda *a, **k: pytest.fail("the chain was loaded"))
    code, err = _cli(capsys, "generate", tiny_chain, "--device", "cpu", *argv)
    assert code == 2 and match in err


@pytest.mark.parametrize("argv, match", [
    (["--prompt", "word " * 20_000], r"the prompt has \d+ tokens; with max_new_tokens=4 that exceeds the target's "
                                     "context of 512 tokens"),
    (["--prompt", "hi", "--max-new-tokens", str(10**9)], "with max_new_tokens=1000000000 that exceeds the target's "
                                                         "context of 512 tokens"),
])
def test_generate_refuses_prompts_and_budgets_over_the_context(tiny_chain, capsys, argv, match):
    code, err = _cli(capsys, "generate", tiny_chain, "--device", "cpu", "--max-new-tokens", "4", *argv)
    assert code == 2 and re.search(match, err)


def test_export_head_refuses_an_out_that_is_a_file_unrelated_or_in_the_chain(chain, tmp_path, capsys):
    def export(out, *extra):
        return _cli(capsys, "chain", "export-head", chain, "--format", "eagle", "--out", out, *extra)

    file = tmp_path / "notes.txt"
    file.write_text("mine")
    code, err = export(file, "--overwrite")
    assert code == 2 and f"--out {file} is a file" in err and file.read_text() == "mine"
    project = tmp_path / "project"
    project.mkdir()
    (project / "main.py").write_text("mine")
    code, err = export(project, "--overwrite")
    assert code == 2 and "main.py" in err and (project / "main.py").read_text() == "mine"
    for inside in (chain / "eagle", chain / "levels" / "draft", chain, tmp_path):
        code, err = export(inside, "--overwrite")
        assert code == 2 and "the chain" in err, inside
    validate_chain(chain)  # untouched
    out = tmp_path / "eagle"
    assert export(out)[0] == 0 and export(out, "--overwrite")[0] == 0  # its own earlier output may be replaced
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]


# ---------------------------------------------------------------------------------------------------------------------
# Writing chains: a kill -9 midway, a full disk


_SLOW_ASSEMBLE = """
import shutil, sys, time
from pathlib import Path
copy = shutil.copyfile
def slow(src, dst, **kw):
    out = copy(src, dst, **kw)
    Path(sys.argv[2]).touch()  # the test kills this process once a file of the new chain is on disk
    time.sleep(30)
    return out
shutil.copyfile = slow
from polyspec.cli import main
main(["chain", "assemble", "--target", sys.argv[3], "--out", sys.argv[1], "--overwrite"])
"""


def test_a_chain_write_killed_with_sigkill_leaves_the_old_chain_and_a_rerun_finishes(chain, tiny_parts, tmp_path):
    before = validate_chain(chain).model_dump()
    started = tmp_path / "started"
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_ASSEMBLE, str(chain), str(started), str(tiny_parts["target"])],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not started.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the writer never started"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert validate_chain(chain).model_dump() == before  # the old chain, whole
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".chain.tmp-")]
    assert len(leftovers) == 1 and str(proc.pid) in leftovers[0]  # the dead writer's, named by its pid
    assert main(["chain", "assemble", "--target", str(tiny_parts["target"]), "--out", str(chain), "--overwrite"]) == 0
    assert [lv.name for lv in validate_chain(chain).levels] == ["target"]
    assert not any(p.name.startswith(".chain.") for p in tmp_path.iterdir())


def _full_disk_after(monkeypatch, files: int) -> None:
    """shutil copies ``files`` files, then every copy fails as on a full file system (ENOSPC)."""
    copy, done = shutil.copyfile, []

    def copyfile(src, dst, **kw):
        if len(done) >= files:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dst))
        done.append(dst)
        return copy(src, dst, **kw)

    monkeypatch.setattr(shutil, "copyfile", copyfile)


def test_a_chain_write_onto_a_full_disk_is_one_error_and_the_old_chain_stays(chain, tiny_parts, tmp_path, capsys,
                                                                            monkeypatch):
    before = validate_chain(chain).model_dump()
    _full_disk_after(monkeypatch, 3)
    code, err = _cli(capsys, "chain", "assemble", "--target", tiny_parts["target"], "--intermediate",
                     tiny_parts["int4"], "--out", chain, "--overwrite")
    assert code == 1 and f"no space left on the device of {chain}" in err and "the old one is intact" in err
    assert validate_chain(chain).model_dump() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chain"]  # nothing half-written beside it


def test_a_full_disk_under_export_head_is_one_error(chain, tmp_path, capsys, monkeypatch):
    from safetensors import torch as st_torch

    def save(*a, **k):  # export-head serialises with safetensors' save and writes the bytes itself
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(st_torch, "save", save)
    code, err = _cli(capsys, "chain", "export-head", chain, "--format", "eagle", "--out", tmp_path / "eagle")
    assert code == 1 and "no space left on the device of" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chain"]


@contextlib.contextmanager
def _tmpfs(where: Path, size: str):
    """A real small file system at ``where`` (root only), unmounted after."""
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode(errors='replace').strip()})")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_chain_write_onto_a_real_full_tmpfs(tiny_chain, tiny_parts, tmp_path, capsys):
    with _tmpfs(tmp_path / "small", "5M") as small:
        chain = Path(shutil.copytree(tiny_chain, small / "chain"))  # 3.2 MB: the new chain does not fit beside it
        before = validate_chain(chain).model_dump()
        code, err = _cli(capsys, "chain", "assemble", "--target", tiny_parts["target"], "--intermediate",
                         tiny_parts["int4"], "--draft", tiny_parts["head"], "--out", chain, "--overwrite")
        assert code == 1 and "no space left on the device" in err
        assert validate_chain(chain).model_dump() == before
        assert sorted(p.name for p in small.iterdir()) == ["chain"]


# ---------------------------------------------------------------------------------------------------------------------
# The server


@pytest.fixture(scope="module")
def loaded(tiny_chain):
    from polyspec.decode.generate import load_chain

    return load_chain(tiny_chain, device="cpu")


def _app(loaded, **kw):
    from polyspec.decode.serve.app import create_app

    return create_app(loaded, mode="dual", model_name="tiny", **kw)


def _client(app, host: str = "127.0.0.1:8000"):
    from fastapi.testclient import TestClient

    return TestClient(app, base_url=f"http://{host}")


BODY = {"prompt": "hi", "max_tokens": 2}


def test_a_foreign_host_header_is_refused(loaded):
    from polyspec.decode.serve.trust import ServeAccess

    with _client(_app(loaded)) as c:
        for host in ("127.0.0.1:8000", "localhost:8000", "[::1]:8000", "LOCALHOST.", "127.0.0.2"):
            assert c.get("/v1/models", headers={"host": host}).status_code == 200, host
        for host in ("evil.example.com", "evil.example.com:8000", "localhost.evil.example", "127.0.0.1.nip.io"):
            r = c.get("/v1/models", headers={"host": host})
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host", host
            assert "--allowed-host" in r.json()["error"]["message"]
    with _client(_app(loaded, access=ServeAccess(allowed_hosts=("chain.internal",))), "chain.internal:80") as c:
        assert c.get("/v1/models").status_code == 200
        assert c.get("/v1/models", headers={"host": "localhost"}).status_code == 200  # loopback names stay allowed


def test_a_web_page_cannot_drive_or_read_the_server(loaded):
    app = _app(loaded)
    ran = []
    original = app.state.engine.generate
    app.state.engine.generate = lambda job, on_tokens=None: ran.append(job) or original(job, on_tokens)
    with _client(app) as c:
        text = json.dumps(BODY)
        cross = c.post("/v1/completions", content=text, headers={"origin": "http://evil.example",
                                                                 "content-type": "text/plain"})
        assert cross.status_code == 403 and cross.json()["error"]["code"] == "origin_not_allowed"
        plain = c.post("/v1/completions", content=text, headers={"content-type": "text/plain"})
        assert plain.status_code == 415 and "application/json" in plain.json()["error"]["message"]
        form = c.post("/v1/completions", content=text, headers={"content-type": "application/x-www-form-urlencoded"})
        assert form.status_code == 415
        read = c.get("/v1/models", headers={"origin": "http://evil.example"})
        preflight = c.options("/v1/completions", headers={"origin": "http://evil.example",
                                                          "access-control-request-method": "POST"})
        assert read.status_code == 403 and preflight.status_code == 403
        for r in (cross, plain, read, preflight):
            assert not any(k.startswith("access-control-") for k in r.headers)
        assert ran == []
        ok = c.post("/v1/completions", json=BODY, headers={"content-type": "application/json; charset=utf-8"})
        assert ok.status_code == 200 and len(ran) == 1


def test_a_configured_cors_origin_may_use_it(loaded):
    from polyspec.decode.serve.trust import ServeAccess

    site = "http://app.example:3000"
    with _client(_app(loaded, api_key="k", access=ServeAccess(cors_origins=(site,)))) as c:
        pre = c.options("/v1/completions", headers={"origin": site, "access-control-request-method": "POST",
                                                    "access-control-request-headers": "authorization, content-type"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == site
        r = c.post("/v1/completions", json=BODY, headers={"origin": site, "authorization": "Bearer k"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == site
        assert c.post("/v1/completions", json=BODY, headers={"origin": "http://evil.example",
                                                             "authorization": "Bearer k"}).status_code == 403


@contextlib.contextmanager
def _serving(app):
    """A real uvicorn server (with the app's read timeout and connection cap) on a free loopback port."""
    from polyspec.decode.serve import server as serve

    sock = serve.bind_socket("127.0.0.1", 0)
    server = serve.make_server(app, log_level="critical")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        sock.close()


def _slow_client(port: int, sent: bytes) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(sent)
    return s


def _closed_within(s: socket.socket, seconds: float) -> bool:
    """Whether the server closes ``s`` within ``seconds`` (it may answer first: 408)."""
    s.settimeout(seconds)
    try:
        while s.recv(4096):
            pass
        return True
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_slow_header_clients_are_dropped_and_normal_ones_all_served(loaded):
    """300 connections that never finish their headers (or their body) beside 16 normal clients: every normal
    request is answered; each slow connection is closed at the read timeout; past the cap a connection is closed at
    once."""
    import httpx

    from polyspec.decode.serve.limits import ServeLimits

    # 2 s: a loaded 2-core CI machine can take over 1 s to read a normal client's body beside 300 connections
    app = _app(loaded, limits=ServeLimits(read_timeout=2.0, max_connections=400))
    with _serving(app) as port:
        partial = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "
        body = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n" \
               b"Content-Length: 100\r\n\r\n{\"prompt\""
        slow = [_slow_client(port, partial if i % 3 else body) for i in range(300)]
        t0 = time.monotonic()

        def ask(i: int) -> int:
            with httpx.Client(timeout=60) as h:
                return h.post(f"http://127.0.0.1:{port}/v1/completions", json={**BODY, "seed": i}).status_code

        with ThreadPoolExecutor(16) as pool:
            assert list(pool.map(ask, range(16))) == [200] * 16
        assert all(_closed_within(s, max(5.0 - (time.monotonic() - t0), 0.1)) for s in slow)
        for s in slow:
            s.close()

    app = _app(loaded, limits=ServeLimits(read_timeout=30.0, max_connections=8))
    with _serving(app) as port:
        held = [_slow_client(port, partial) for _ in range(8)]
        extra = _slow_client(port, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert _closed_within(extra, 2.0)  # over the cap: closed at once, not after the read timeout
        assert not _closed_within(held[0], 0.3)
        for s in held:
            s.close()


def test_a_long_prompt_with_the_queue_full_gets_429s_and_frees_the_worker_at_its_deadline(tmp_path):
    """An 8k-token prompt (over the default --max-prompt-tokens: a 400 at once; allowed here) holds the one worker:
    one request waits, the rest get 429 at once, and the long one is cut at its deadline, which frees the worker."""
    import httpx
    from conftest import make_tiny_llama

    from polyspec.decode.generate import load_chain
    from polyspec.decode.serve.limits import ServeLimits
    from polyspec.manifest import assemble_chain

    assemble_chain(tmp_path / "long", make_tiny_llama(tmp_path / "target", max_pos=16384))
    long_chain = load_chain(tmp_path / "long", device="cpu")
    prompt = "hello " * 2730
    with _client(_app_ar(long_chain)) as c:  # the default limits
        r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4})
        assert r.status_code == 400 and r.json()["error"]["code"] == "prompt_too_long"
    app = _app_ar(long_chain, limits=ServeLimits(max_queue=1, request_timeout=4.0, max_prompt_tokens=None))
    engine = app.state.engine
    with _serving(app) as port, httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as h, \
            ThreadPoolExecutor(4) as pool:
        assert h.post("/v1/completions", json=BODY).status_code == 200  # warm (a first forward may build kernels)
        t0 = time.monotonic()
        long = pool.submit(h.post, "/v1/completions", json={"prompt": prompt, "max_tokens": 8000})
        _wait_for(lambda: engine.depth() == (0, 1))
        waiting = pool.submit(h.post, "/v1/completions", json=BODY)
        _wait_for(lambda: engine.depth() == (1, 1))
        rest = [h.post("/v1/completions", json=BODY) for _ in range(3)]
        assert [r.status_code for r in rest] == [429] * 3 and time.monotonic() - t0 < 4
        # its own deadline, 4 s from its arrival, is about when the worker frees: answered either way, never held
        assert waiting.result(timeout=30).status_code in (200, 503)
        body = long.result(timeout=30).json()
        freed = time.monotonic() - t0
        assert body["choices"][0]["finish_reason"] == "length" and body["polyspec"]["deadline_exceeded"] is True
        assert body["usage"]["prompt_tokens"] > 8000 and body["usage"]["completion_tokens"] < 8000
        _wait_for(lambda: engine.depth() == (0, 0))
        assert freed < 4.0 + 4.0  # the deadline, one prefill that started before it, one round
        assert h.post("/v1/completions", json=BODY).status_code == 200


def test_serve_options_for_hosts_origins_and_connections(tiny_chain, monkeypatch):
    import argparse

    from polyspec.decode.serve import server as serve

    class Stop(Exception):
        pass

    built = []

    def build_app(chain, **kw):
        built.append(kw)
        raise Stop  # what a run was given is all this test needs

    monkeypatch.setattr(serve, "build_app", build_app)

    def run(*argv):
        p = argparse.ArgumentParser()
        serve.configure_parser(p)
        with pytest.raises(Stop):
            serve.run(p.parse_args([str(tiny_chain), *argv]))
        return built.pop()

    kw = run("--host", "192.168.1.5", "--allowed-host", "Chain.Internal:8000", "--cors-origin", "http://app.example/",
             "--read-timeout", "3", "--max-connections", "7")
    access, limits = kw["access"], kw["limits"]
    assert access.allowed_hosts == ("chain.internal", "192.168.1.5") and access.cors_origins == ("http://app.example",)
    assert access.host_allowed("192.168.1.5:8000") and not access.host_allowed("evil.example")
    assert (limits.read_timeout, limits.max_connections) == (3.0, 7)
    assert run("--host", "0.0.0.0")["access"].allowed_hosts == ()  # any address: loopback names unless told
    for bad in (["--read-timeout", "0"], ["--read-timeout", "nan"], ["--max-connections", "0"]):
        with pytest.raises(PolyspecError, match=bad[0]):
            p = argparse.ArgumentParser()
            serve.configure_parser(p)
            serve.run(p.parse_args([str(tiny_chain), *bad]))
    assert built == []


def _app_ar(chain, **kw):
    from polyspec.decode.serve.app import create_app

    return create_app(chain, mode="ar", model_name="long", **kw)


def _wait_for(predicate, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.02)
