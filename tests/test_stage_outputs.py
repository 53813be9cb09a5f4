"""Stage outputs can be trusted on reuse: each carries the hashes of its files and a damaged one is found; temporary
folders of killed writers are removed by the next write, and only theirs (polyspec.fsutil)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO

from polyspec.fsutil import (
    FILE_HASHES,
    STALE_AFTER_S,
    atomic_folder,
    file_hashes,
    hash_problems,
    remove_stale_temps,
    temp_folder,
    verify_output,
)


def _write_output(out: Path) -> Path:
    def write(tmp: Path) -> None:
        (tmp / "config.json").write_text('{"a": 1}\n')
        (tmp / "sub").mkdir()
        (tmp / "sub" / "w.bin").write_bytes(b"\x00" * 1000)

    return atomic_folder(out, write, hashes=True)


def test_an_output_carries_its_hashes_and_damage_is_named(tmp_path):
    from polyspec.manifest import sha256_file

    out = _write_output(tmp_path / "head")
    record = json.loads((out / FILE_HASHES).read_text())
    assert record["files"] == {"config.json": sha256_file(out / "config.json"),
                               "sub/w.bin": sha256_file(out / "sub" / "w.bin")}
    assert verify_output(out) == []
    with open(out / "sub" / "w.bin", "r+b") as f:  # truncated, as by a full disk or an interrupted copy
        f.truncate(10)
    (out / "config.json").unlink()
    (out / "notes.txt").write_text("x")
    problems = verify_output(out)
    assert any("sub/w.bin changed" in p for p in problems)
    assert any("config.json is missing" in p for p in problems)
    assert any("notes.txt is not in the record" in p for p in problems)


def test_an_output_from_before_hashes_is_checked_then_hashed_on_first_reuse(tmp_path):
    import torch
    from safetensors.torch import save_file

    old = tmp_path / "old_head"
    old.mkdir()
    save_file({"w": torch.zeros(64, 64)}, str(old / "model.safetensors"))
    (old / "config.json").write_text("{}\n")
    assert hash_problems(old) is None  # no record yet
    assert verify_output(old) == []
    assert json.loads((old / FILE_HASHES).read_text())["files"] == file_hashes(old)
    assert hash_problems(old) == []

    broken = tmp_path / "old_broken"
    broken.mkdir()
    save_file({"w": torch.zeros(64, 64)}, str(broken / "model.safetensors"))
    with open(broken / "model.safetensors", "r+b") as f:
        f.truncate(200)
    problems = verify_output(broken)
    assert len(problems) == 1 and "model.safetensors is not a readable safetensors file" in problems[0]
    assert not (broken / FILE_HASHES).exists(), "a damaged folder must not be certified"


def test_temp_folders_of_other_writers_are_not_listed_or_hashed(tmp_path):
    out = _write_output(tmp_path / "q")
    (out / f".model.tmp-{os.getpid()}@h.abc").mkdir()  # a writer at work inside the output (quantize's model/)
    (out / f".model.tmp-{os.getpid()}@h.abc" / "x").write_text("partial")
    assert verify_output(out) == []


def _writer(out: Path) -> subprocess.Popen:
    """A process that makes a temporary folder for ``out`` and then waits (to be killed like a real writer)."""
    code = ("import sys, time; from polyspec.fsutil import temp_folder; "
            "print(temp_folder(sys.argv[1]), flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(out)], stdout=subprocess.PIPE, text=True, cwd=REPO)
    return proc


def test_a_kill_9_leftover_is_removed_by_the_next_write_and_a_live_writer_is_not(tmp_path):
    out = tmp_path / "chain"
    killed, live = _writer(out), _writer(tmp_path / "other")
    try:
        dead_tmp = Path(killed.stdout.readline().strip())
        live_tmp = Path(live.stdout.readline().strip())
        assert dead_tmp.is_dir() and dead_tmp.name.startswith(".chain.tmp-") and live_tmp.is_dir()
        (dead_tmp / "levels").mkdir()
        os.kill(killed.pid, signal.SIGKILL)  # no cleanup runs
        killed.wait()
        assert dead_tmp.is_dir()
        _write_output(out)  # the next atomic write beside it
        assert not dead_tmp.exists(), "the killed writer's temporary folder must be removed"
        assert live_tmp.is_dir(), "a live writer's temporary folder must be left alone"
    finally:
        for p in (killed, live):
            p.kill()
            p.wait()
    assert remove_stale_temps(out) == [live_tmp]  # once its writer is gone


def test_only_polyspec_names_are_removed_and_old_names_by_age(tmp_path):
    out = tmp_path / "model"
    old_style = tmp_path / ".model.tmp-4194999-abc"  # quantize's earlier names: pid known, dead
    old_offload = tmp_path / "..model.tmp-4194999-abc.offload"
    mine = tmp_path / f".model.tmp-{os.getpid()}-xyz"
    unnamed_old = tmp_path / ".model.tmp-k2j3h4g5"  # no pid: removed once untouched for a day
    unnamed_new = tmp_path / ".model.tmp-a1b2c3d4"
    other_host = tmp_path / ".chain.tmp-4194999@elsewhere.abc"  # another host's pid means nothing here
    foreign = [tmp_path / ".other.tmp-4194999-abc", tmp_path / ".cache", tmp_path / "model.tmp-4194999@x.a"]
    for p in (old_style, old_offload, mine, unnamed_old, unnamed_new, other_host, *foreign):
        p.mkdir()
    day_ago = time.time() - STALE_AFTER_S - 60
    os.utime(unnamed_old, (day_ago, day_ago))
    assert sorted(remove_stale_temps(out)) == sorted([old_style, old_offload, unnamed_old])
    os.utime(other_host, (day_ago, day_ago))
    assert remove_stale_temps(out) == [other_host]
    assert all(p.is_dir() for p in (mine, unnamed_new, *foreign))


def test_temp_folder_names_record_the_writer(tmp_path):
    tmp = temp_folder(tmp_path / "head")
    assert tmp.parent == tmp_path and tmp.name.startswith(f".head.tmp-{os.getpid()}@")
    assert remove_stale_temps(tmp_path / "head") == []  # this process is alive


def test_export_removes_a_killed_exports_leftover_and_keeps_hash_records_out_of_the_chain(tiny_parts, tmp_path):
    import shutil

    import torch

    from polyspec.chain_spec import DecodeSpec
    from polyspec.export.package import export_profiled
    from polyspec.export.profile import ProfileSettings
    from polyspec.export.stage import profile_folders
    from polyspec.fsutil import write_file_hashes

    out = tmp_path / "work" / "chain"
    # a writer that stops without any cleanup, as under kill -9, leaves its partial chain beside the output
    code = "import sys; from polyspec.fsutil import temp_folder; print(temp_folder(sys.argv[1]))"
    done = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, cwd=REPO, check=True)
    leftover = Path(done.stdout.strip())
    (leftover / "levels").mkdir()
    (leftover / "levels" / "weights.bin").write_bytes(b"\x00" * 4096)

    head = tmp_path / "head"
    shutil.copytree(tiny_parts["head"], head)
    write_file_hashes(head)  # as the train stage writes heads
    parts = {**tiny_parts, "head": head}
    prompts = [torch.randint(3, 500, (8,), generator=torch.Generator().manual_seed(0)).tolist()]
    settings = ProfileSettings(max_new_tokens=4, kv_length=16, warmup=0, repeats=1, draft_ks=(2,), mus=(4,))
    p = profile_folders(parts, tmp_path / "profile", settings, device="cpu", prompt_ids=prompts, threads=1,
                        say=lambda _m: None)
    export_profiled(out, parts, p, DecodeSpec(), onnx=False)
    assert not leftover.exists()
    assert sorted(x.name for x in out.parent.iterdir()) == ["chain"]
    assert not any(f.endswith(FILE_HASHES) for lv in json.loads((out / "manifest.json").read_text())["levels"]
                   for f in lv["files"])


def test_chain_assemble_names_its_temporary_folder_and_removes_a_killed_ones(tmp_path):
    """`polyspec chain assemble` (assemble_chain, also export's writer) writes through fsutil.temp_folder: the
    leftover of a killed assemble of the same chain is removed, and a failed assemble leaves nothing behind."""
    from conftest import make_tiny_llama

    from polyspec.errors import PolyspecError
    from polyspec.manifest import assemble_chain

    model = make_tiny_llama(tmp_path / "m", hidden=32, intermediate=64, heads=2, kv_heads=1)
    out = tmp_path / "chain"
    killed = _writer(out)
    try:
        dead_tmp = Path(killed.stdout.readline().strip())
    finally:
        killed.kill()
        killed.wait()
    assert dead_tmp.is_dir()
    assemble_chain(out, model)
    assert not dead_tmp.exists() and (out / "manifest.json").is_file()
    with pytest.raises(PolyspecError):
        assemble_chain(tmp_path / "bad", tmp_path / "missing")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".bad.")] == []
