"""polyspec.stamp: versions, git state, hardware and command line, shape and robustness."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

import polyspec
from polyspec import stamp


def test_software_stamp_shape():
    s = stamp.software_stamp()
    assert s["polyspec"] == polyspec.__version__
    assert s["python"] == ".".join(str(v) for v in sys.version_info[:3])
    assert isinstance(s["platform"], str) and s["platform"]
    assert s["git_sha"] is None or (len(s["git_sha"]) == 40 and int(s["git_sha"], 16) >= 0)
    assert s["git_dirty"] in (None, True, False)
    pk = s["packages"]
    # installed hard dependencies are found with their real versions
    import importlib.metadata as md

    for name in ("torch", "transformers", "pydantic"):
        assert pk[name] == md.version(name)
    assert "mlflow" in pk or "mlflow-skinny" in pk
    json.dumps(s)  # goes into manifests and MLflow as JSON


def test_package_versions_skips_missing_and_imports_nothing():
    before = set(sys.modules)
    got = stamp.package_versions(("pydantic", "no-such-distribution-polyspec-test", "lightning"))
    assert "no-such-distribution-polyspec-test" not in got
    assert got["pydantic"]
    assert "lightning" not in set(sys.modules) - before  # version read from metadata, module not imported


@pytest.mark.skipif(shutil.which("git") is None, reason="git not installed")
def test_git_sha_and_dirty(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    assert stamp.git_sha(repo) is None and stamp.git_dirty(repo) is None  # not a repository
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.org", "-c", "commit.gpgsign=false"]
    subprocess.run([*git, "init", "-q"], cwd=repo, check=True)
    assert stamp.git_sha(repo) is None  # no commit yet
    (repo / "a.txt").write_text("one")
    subprocess.run([*git, "add", "a.txt"], cwd=repo, check=True)
    subprocess.run([*git, "commit", "-q", "-m", "first"], cwd=repo, check=True)
    expected = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
    assert stamp.git_sha(repo) == expected
    assert stamp.git_sha(repo / "a.txt") == expected  # a file resolves to its folder
    assert stamp.git_dirty(repo) is False
    (repo / "a.txt").write_text("two")
    assert stamp.git_dirty(repo) is True
    assert stamp.software_stamp(repo)["git_sha"] == expected


def test_git_missing_folder_does_not_raise(tmp_path):
    assert stamp.git_sha(tmp_path / "nope" / "deeper") is None


def test_hardware_stamp_shape():
    h = stamp.hardware_stamp()
    assert h["logical_cores"] is None or h["logical_cores"] >= 1
    assert h["memory_gib"] is None or h["memory_gib"] > 0
    assert h["cpu"] is None or isinstance(h["cpu"], str)
    cuda = h["cuda"]
    import torch

    assert cuda["available"] == torch.cuda.is_available()
    if cuda["available"]:
        assert len(cuda["devices"]) == torch.cuda.device_count()
        d = cuda["devices"][0]
        assert d["name"] and d["memory_gib"] > 0 and "." in d["capability"]
    json.dumps(h)


def test_hardware_stamp_without_torch(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    h = stamp.hardware_stamp(import_torch=False)
    assert h["cuda"]["available"] is None
    assert "torch" not in sys.modules


def test_command_line():
    assert stamp.command_line(["/some/venv/bin/polyspec", "run", "my recipe.yaml", "train.lr=1e-4"]) == (
        "polyspec run 'my recipe.yaml' train.lr=1e-4"
    )
    assert stamp.command_line(["/x/polyspec/__main__.py", "validate", "r.yaml"]) == "python -m polyspec validate r.yaml"
    assert stamp.command_line(["/x/bench/__main__.py", "c", "--limit", "1"]) == "python -m polyspec.bench c --limit 1"
    assert stamp.command_line([]) == ""
    assert isinstance(stamp.command_line(), str) and stamp.command_line()
