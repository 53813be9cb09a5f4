"""polyspec.tracking against a real sqlite MLflow store (one per module: creating one runs migrations, ~1-2 s)."""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

import pytest
import yaml

from polyspec.config import Recipe, recipe_to_yaml, validate_tree
from polyspec.errors import PolyspecError
from polyspec.stamp import git_sha
from polyspec.tracking import Tracker, artifact_location, flatten, sqlite_path, start_run, tracking_uri

mlflow = pytest.importorskip("mlflow")


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory) -> Path:
    """A workdir whose default sqlite store (workdir/mlflow.db) is shared by this module's tests."""
    return tmp_path_factory.mktemp("mlflow_store")


@pytest.fixture
def client(store_dir):
    return mlflow.MlflowClient(f"sqlite:///{store_dir / 'mlflow.db'}")


@pytest.fixture(autouse=True)
def _clean_mlflow_globals():
    """Each test starts and ends with no active run and no global tracking URI."""
    yield
    while mlflow.active_run() is not None:
        mlflow.end_run()
    mlflow.set_tracking_uri(None)
    os.environ.pop("MLFLOW_TRACKING_URI", None)


def _recipe(workdir: Path, request, **tracking) -> Recipe:
    """A default recipe writing to ``workdir``, with an experiment of its own per test."""
    return Recipe(workdir=workdir, tracking={"experiment": f"t-{request.node.name}", **tracking})


def _download_text(client, run_id: str, name: str, tmp_path: Path) -> str:
    return Path(client.download_artifacts(run_id, name, str(tmp_path))).read_text()


# ---------------------------------------------------------------------------------------------------------------------
# pure helpers


def test_tracking_uri_resolution(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = Recipe(workdir="rel/work")
    expected_db = (tmp_path / "rel" / "work" / "mlflow.db").resolve()
    assert tracking_uri(r) == f"sqlite:///{expected_db.as_posix()}"  # absolute, four slashes
    assert tracking_uri(r).startswith("sqlite:////")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://tracking.example:5000")
    assert tracking_uri(r) == "http://tracking.example:5000"
    r2 = Recipe(workdir="rel/work", tracking={"uri": "sqlite:////elsewhere/x.db"})
    assert tracking_uri(r2) == "sqlite:////elsewhere/x.db"  # the recipe beats the environment


def test_artifact_location_and_sqlite_path(tmp_path, monkeypatch):
    db = tmp_path / "w" / "mlflow.db"
    assert sqlite_path(f"sqlite:///{db}") == db.resolve()
    assert artifact_location(f"sqlite:///{db}") == (tmp_path / "w" / "mlartifacts").resolve().as_uri()
    monkeypatch.chdir(tmp_path)
    assert sqlite_path("sqlite:///rel.db") == (tmp_path / "rel.db").resolve()
    assert sqlite_path("http://host:5000") is None and artifact_location("http://host:5000") is None
    assert sqlite_path("sqlite:///:memory:") is None


def test_flatten():
    assert flatten({"a": {"b": 1, "c": {"d": [1, 2]}}, "e": None, "f": {}}) == {
        "a.b": 1, "a.c.d": [1, 2], "e": None, "f": {},
    }


# ---------------------------------------------------------------------------------------------------------------------
# runs


def test_run_records_recipe_command_and_stamp(store_dir, client, request, tmp_path):
    r = _recipe(store_dir, request)
    cmd = ["polyspec", "run", "my recipe.yaml", "train.lr=1e-4"]
    with start_run(r, "run", command=cmd) as t:
        assert t.enabled and t.run_id and t.uri == f"sqlite:///{(store_dir / 'mlflow.db').resolve()}"
        assert mlflow.active_run().info.run_id == t.run_id
        t.log_params({"custom": 3, "nested_list": [1, 2]})
        t.log_metrics({"loss": 2.5, "acc": 0.25}, step=1)
        t.log_metrics({"loss": 1.5}, step=2)
        t.set_tags({"note": "hello"})
        t.log_text("some text", "notes/a.txt")
        f = tmp_path / "file.json"
        f.write_text("{}")
        t.log_artifact(f)
        folder = tmp_path / "folder"
        folder.mkdir()
        (folder / "x.txt").write_text("x")
        t.log_artifact(folder)
        with pytest.raises(PolyspecError, match="no such file"):
            t.log_artifact(tmp_path / "missing")
    assert mlflow.active_run() is None

    assert (store_dir / "mlflow.db").is_file()  # the default store: <workdir>/mlflow.db
    run = client.get_run(t.run_id)
    assert run.info.status == "FINISHED"
    exp = client.get_experiment(run.info.experiment_id)
    assert exp.name == r.tracking.experiment
    assert exp.artifact_location == (store_dir / "mlartifacts").resolve().as_uri()
    assert (store_dir / "mlartifacts" / t.run_id / "artifacts" / "recipe.yaml").is_file()

    p, tags = run.data.params, run.data.tags
    assert p["custom"] == "3" and p["nested_list"] == "[1, 2]"
    assert p["train.lr"] == str(r.train.lr) and p["decode.mu"] == "[8]" and p["target.source"] == r.target.source
    assert run.data.metrics == {"loss": 1.5, "acc": 0.25}
    assert [(m.step, m.value) for m in client.get_metric_history(t.run_id, "loss")] == [(1, 2.5), (2, 1.5)]
    assert tags["note"] == "hello"
    assert tags["polyspec.stage"] == "run" and tags["mlflow.runName"] == "run"
    assert tags["polyspec.command"] == "polyspec run 'my recipe.yaml' train.lr=1e-4"
    assert tags["version.torch"] == importlib.metadata.version("torch")
    assert tags["version.pydantic"] == importlib.metadata.version("pydantic")
    assert tags.get("polyspec.git_sha") == git_sha()
    assert "mlflow.parentRunId" not in tags

    text = _download_text(client, t.run_id, "recipe.yaml", tmp_path / "dl")
    assert text == recipe_to_yaml(r)
    assert validate_tree(yaml.safe_load(text), "recipe.yaml") == r
    stamp = yaml.safe_load(_download_text(client, t.run_id, "stamp.json", tmp_path / "dl2"))
    assert stamp["command"] == tags["polyspec.command"] and "packages" in stamp["software"]
    names = {a.path for a in client.list_artifacts(t.run_id)}
    assert {"recipe.yaml", "stamp.json", "file.json", "folder", "notes"} <= names
    assert [a.path for a in client.list_artifacts(t.run_id, "folder")] == ["folder/x.txt"]

    # the global tracking URI is put back as it was (unset)
    assert not mlflow.is_tracking_uri_set() and "MLFLOW_TRACKING_URI" not in os.environ


def test_nested_stage_runs(store_dir, client, request):
    r = _recipe(store_dir, request)
    with start_run(r, "run", command=["polyspec", "run", "r.yaml"]) as parent:
        with start_run(r, "train", nested=True) as train:
            train.log_metrics({"loss": 1.0}, step=0)
        with pytest.raises(RuntimeError, match="boom"):
            with start_run(r, "quantize", nested=True) as quant:
                raise RuntimeError("boom")
        assert mlflow.active_run().info.run_id == parent.run_id  # the failed child did not end the parent
    runs = {rid: client.get_run(rid) for rid in (parent.run_id, train.run_id, quant.run_id)}
    assert runs[parent.run_id].info.status == "FINISHED"
    assert runs[train.run_id].info.status == "FINISHED"
    assert runs[quant.run_id].info.status == "FAILED"
    for child in (train.run_id, quant.run_id):
        assert runs[child].data.tags["mlflow.parentRunId"] == parent.run_id
        assert runs[child].info.experiment_id == runs[parent.run_id].info.experiment_id
        assert "recipe.yaml" in {a.path for a in client.list_artifacts(child)}
    assert runs[quant.run_id].data.tags["polyspec.stage"] == "quantize"
    assert mlflow.active_run() is None


def test_failed_top_level_run(store_dir, client, request):
    r = _recipe(store_dir, request)
    with pytest.raises(ValueError, match="bad"):
        with start_run(r, "train") as t:
            raise ValueError("bad")
    assert client.get_run(t.run_id).info.status == "FAILED"
    assert mlflow.active_run() is None and not mlflow.is_tracking_uri_set()
    with pytest.raises(KeyboardInterrupt):
        with start_run(r, "train") as t2:
            raise KeyboardInterrupt
    assert client.get_run(t2.run_id).info.status == "KILLED"


def test_nests_under_users_active_run(store_dir, client, request, tmp_path):
    uri = f"sqlite:///{store_dir / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    exp_id = client.create_experiment(f"user-{request.node.name}", artifact_location=(tmp_path / "art").as_uri())
    user_run = mlflow.start_run(experiment_id=exp_id)
    other_db = tmp_path / "other" / "mlflow.db"
    r = _recipe(tmp_path / "work", request, uri=f"sqlite:///{other_db}")
    with start_run(r, "train") as t:  # nested=False, yet a notebook's run is active
        t.log_metrics({"x": 1.0})
    assert mlflow.active_run().info.run_id == user_run.info.run_id  # the user's run is still open ...
    assert client.get_run(user_run.info.run_id).info.status == "RUNNING"
    assert mlflow.get_tracking_uri() == uri  # ... in the user's store
    child = client.get_run(t.run_id)
    assert child.data.tags["mlflow.parentRunId"] == user_run.info.run_id
    assert child.info.experiment_id == exp_id and child.info.status == "FINISHED"
    assert not other_db.exists() and not (tmp_path / "work" / "mlflow.db").exists()
    assert (tmp_path / "art" / t.run_id / "artifacts" / "recipe.yaml").is_file()
    mlflow.end_run()


def test_disabled_tracking_is_a_noop(tmp_path, request):
    r = _recipe(tmp_path / "w", request, enabled=False)
    with start_run(r, "run") as t:
        assert t.run_id is None and not t.enabled
        assert mlflow.active_run() is None
        t.log_params({"a": 1})
        t.log_metrics({"b": 2.0}, step=3)
        t.set_tags({"c": "d"})
        t.log_text("x", "x.txt")
        t.log_artifact(tmp_path / "does-not-matter")
        with start_run(r, "train", nested=True) as c:
            assert c.run_id is None
    assert not (tmp_path / "w").exists()
    with pytest.raises(ValueError):
        with start_run(r, "run"):
            raise ValueError("still raised")
    assert isinstance(Tracker(), Tracker) and Tracker().run_id is None


def test_env_tracking_uri_is_used(store_dir, client, request, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{store_dir / 'mlflow.db'}")
    r = _recipe(tmp_path / "w", request)
    with start_run(r, "profile") as t:
        pass
    run = client.get_run(t.run_id)
    assert run.data.tags["polyspec.stage"] == "profile" and run.info.status == "FINISHED"
    assert not (tmp_path / "w" / "mlflow.db").exists()
    assert os.environ["MLFLOW_TRACKING_URI"] == f"sqlite:///{store_dir / 'mlflow.db'}"  # restored, not removed


def test_recipe_uri_is_used(store_dir, client, request, tmp_path):
    r = _recipe(tmp_path / "w", request, uri=f"sqlite:///{store_dir / 'mlflow.db'}")
    with start_run(r, "export") as t:
        pass
    assert client.get_run(t.run_id).data.tags["polyspec.stage"] == "export"
    assert not (tmp_path / "w").exists()


def test_unusable_store(tmp_path, request):
    r = _recipe(tmp_path / "w", request, uri="nosuchscheme://x")
    with pytest.raises(PolyspecError, match="could not open the MLflow tracking store"):
        with start_run(r, "run"):
            pass
    assert mlflow.active_run() is None and not mlflow.is_tracking_uri_set()
