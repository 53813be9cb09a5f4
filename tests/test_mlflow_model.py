"""The chain as an MLflow model: logged into a sqlite store, loaded with mlflow.pyfunc.load_model, predict decodes;
its folder carries polyspec as a wheel that installs without an index, and ``mlflow models serve`` answers."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from polyspec.errors import PolyspecError

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_requests_from_accepts_prompts_messages_and_frames():
    import pandas as pd

    from polyspec.export.mlflow_model import requests_from

    chat = [{"role": "user", "content": "hi"}]
    assert requests_from("a") == [{"prompt": "a"}]
    assert requests_from(["a", {"prompt": "b"}]) == [{"prompt": "a"}, {"prompt": "b"}]
    assert requests_from({"messages": chat}) == [{"messages": chat}]
    frame = pd.DataFrame({"prompt": ["a", None], "messages": [None, chat]})
    assert requests_from(frame) == [{"prompt": "a"}, {"messages": chat}]
    with pytest.raises(ValueError, match="'prompt' string or a 'messages' list"):
        requests_from([{"text": "a"}])
    with pytest.raises(ValueError, match="no request"):  # what MLflow's schema leaves of a bare string
        requests_from(pd.DataFrame({"prompt": []}))
    with pytest.raises(ValueError, match="must be a list"):
        requests_from([{"messages": {"role": "user", "content": "hi"}}])


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A recipe whose tracking goes to a fresh sqlite store in its workdir; MLflow's global URI restored after."""
    import mlflow

    from polyspec.config import validate_tree

    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        workdir = tmp_path_factory.mktemp("mlflow") / "w"
        recipe = validate_tree({"workdir": str(workdir), "tracking": {"register_as": "tiny-chain"}}, "test")
        before = mlflow.get_tracking_uri() if mlflow.is_tracking_uri_set() else None
        yield recipe
        mlflow.set_tracking_uri(before)


@pytest.fixture(scope="module")
def logged(tiny_chain, store):
    """(the model's URI, its folder downloaded, the chain) for the tiny chain logged and registered in ``store``."""
    import mlflow

    from polyspec.export.mlflow_model import log_chain_model
    from polyspec.tracking import start_run, tracking_uri

    with start_run(store, "export") as tracker:
        uri = log_chain_model(tracker, tiny_chain, register_as=store.tracking.register_as)
    assert uri
    mlflow.set_tracking_uri(tracking_uri(store))
    return uri, Path(mlflow.artifacts.download_artifacts(uri)), tiny_chain


def test_pyfunc_round_trip_decodes_like_the_chain(logged):
    import mlflow

    from polyspec.decode.generate import generate_text, load_chain

    uri, _, tiny_chain = logged
    model = mlflow.pyfunc.load_model(uri)
    chat = [{"role": "user", "content": "hello there"}]
    out = model.predict([{"prompt": "hello there"}, {"messages": chat}], params={"max_new_tokens": 6, "mode": "dual"})
    want = generate_text(load_chain(tiny_chain), "hello there", mode="dual", max_new_tokens=6)
    assert [o["text"] for o in out] == [want["text"]] * 2  # one user turn: the same prompt either way
    assert out[0]["new_tokens"] == want["stats"]["new_tokens"] and out[0]["mode"] == "dual"
    assert set(out[0]["mean_accepted"]) == {"target", "draft"} and out[0]["mean_accepted"]["target"] >= 1
    registered = mlflow.pyfunc.load_model("models:/tiny-chain/1")  # tracking.register_as
    got = registered.predict([{"prompt": "hello there"}], params={"max_new_tokens": 6, "mode": "dual"})
    assert got[0]["text"] == want["text"]


def test_the_model_has_an_input_signature_an_example_and_polyspec_as_a_wheel(logged):
    from mlflow.models import Model

    _, folder, _ = logged
    meta = Model.load(str(folder / "MLmodel"))
    assert [c["name"] for c in meta.signature.inputs.to_dict()] == ["prompt", "messages"]
    assert {p.name for p in meta.signature.params} >= {"max_new_tokens", "temperature", "mode"}
    example = json.loads((folder / meta.saved_input_example_info["artifact_path"]).read_text())
    assert "Hello" in json.dumps(example)
    reqs = (folder / "requirements.txt").read_text().split()
    wheel = folder / next(r for r in reqs if r.endswith(".whl"))  # pip runs in the model folder: relative to it
    assert wheel.name.startswith("polyspec-") and wheel.suffix == ".whl" and wheel.is_file()
    assert not any(r.startswith("polyspec==") for r in reqs)  # no index has it


def test_the_wheel_installs_without_an_index_and_imports(tmp_path):
    from polyspec.export.wheel import write_wheel

    wheel = write_wheel(tmp_path / "w")
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(target),
                    str(wheel)], check=True, timeout=120)
    code = "import polyspec, polyspec.decode.int4, polyspec.export.mlflow_model as m; print(polyspec.__file__)"
    env = {**os.environ, "PYTHONPATH": str(target)}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.strip().startswith(str(target))  # the wheel's copy, not the checkout's
    assert (target / "polyspec" / "decode" / "cpu_kernels.cpp").is_file()  # package data travels


def test_the_wheel_lists_the_packages_pyproject_installs():
    import tomllib

    from polyspec.export.wheel import PACKAGES

    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert set(PACKAGES) == set(pyproject["tool"]["setuptools"]["packages"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> object:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


@pytest.mark.slow  # heavy (the fast tier stays under 6 minutes: README)
def test_mlflow_models_serve_answers_a_scoring_request_on_loopback(logged, tmp_path):
    """``mlflow models serve --env-manager local`` (this environment) on 127.0.0.1 answers /invocations."""
    from polyspec.decode.generate import generate_text, load_chain

    _, folder, tiny_chain = logged
    port = _free_port()
    # MLflow execs `uvicorn` from PATH: this interpreter's, whatever the console scripts' shebangs say
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "uvicorn").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m uvicorn "$@"\n')
    (shim / "uvicorn").chmod(0o755)
    env = {**os.environ, "PATH": f"{shim}{os.pathsep}{os.environ.get('PATH', '')}"}
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "models", "serve", "-m", str(folder),
                             "--env-manager", "local", "-h", "127.0.0.1", "-p", str(port), "-w", "1"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=2).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "the server did not come up"
                time.sleep(0.5)
        body = {"dataframe_records": [{"prompt": "hello there"}], "params": {"max_new_tokens": 6, "mode": "dual"}}
        got = _post(f"http://127.0.0.1:{port}/invocations", body)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 15)
        proc.wait(timeout=30)
    want = generate_text(load_chain(tiny_chain), "hello there", mode="dual", max_new_tokens=6)
    assert got["predictions"][0]["text"] == want["text"]


def test_no_model_is_logged_without_tracking(tiny_chain):
    from polyspec.export.mlflow_model import log_chain_model
    from polyspec.tracking import Tracker

    assert log_chain_model(Tracker(), tiny_chain) is None and log_chain_model(None, tiny_chain) is None


def test_register_as_is_a_recipe_key():
    from polyspec.config import validate_tree

    assert validate_tree({"workdir": "w", "tracking": {"register_as": "m"}}, "t").tracking.register_as == "m"
    with pytest.raises(PolyspecError, match="register_as"):
        validate_tree({"workdir": "w", "tracking": {"register_as": ""}}, "t")
