"""The chain as an MLflow model: logged into a sqlite store, loaded with mlflow.pyfunc.load_model, predict decodes."""

from __future__ import annotations

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


@pytest.fixture
def store(tmp_path, monkeypatch):
    """A recipe whose tracking goes to a fresh sqlite store in its workdir; MLflow's global URI restored after."""
    import mlflow

    from polyspec.config import validate_tree

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    recipe = validate_tree({"workdir": str(tmp_path / "w"), "tracking": {"register_as": "tiny-chain"}}, "test")
    before = mlflow.get_tracking_uri() if mlflow.is_tracking_uri_set() else None
    yield recipe
    mlflow.set_tracking_uri(before)


def test_pyfunc_round_trip_decodes_like_the_chain(tiny_chain, store):
    import mlflow

    from polyspec.decode.generate import generate_text, load_chain
    from polyspec.export.mlflow_model import log_chain_model
    from polyspec.tracking import start_run, tracking_uri

    with start_run(store, "export") as tracker:
        uri = log_chain_model(tracker, tiny_chain, register_as=store.tracking.register_as)
    assert uri
    mlflow.set_tracking_uri(tracking_uri(store))
    model = mlflow.pyfunc.load_model(uri)
    chat = [{"role": "user", "content": "hello there"}]
    out = model.predict([{"prompt": "hello there"}, {"messages": chat}], params={"max_new_tokens": 6, "mode": "dual"})
    want = generate_text(load_chain(tiny_chain), "hello there", mode="dual", max_new_tokens=6)
    assert [o["text"] for o in out] == [want["text"]] * 2  # one user turn: the same prompt either way
    assert out[0]["new_tokens"] == want["stats"]["new_tokens"] and out[0]["mode"] == "dual"
    assert set(out[0]["mean_accepted"]) == {"target", "draft"} and out[0]["mean_accepted"]["target"] >= 1
    registered = mlflow.pyfunc.load_model("models:/tiny-chain/1")  # tracking.register_as
    assert registered.predict("hello there", params={"max_new_tokens": 6, "mode": "dual"})[0]["text"] == want["text"]


def test_no_model_is_logged_without_tracking(tiny_chain):
    from polyspec.export.mlflow_model import log_chain_model
    from polyspec.tracking import Tracker

    assert log_chain_model(Tracker(), tiny_chain) is None and log_chain_model(None, tiny_chain) is None


def test_register_as_is_a_recipe_key():
    from polyspec.config import validate_tree

    assert validate_tree({"workdir": "w", "tracking": {"register_as": "m"}}, "t").tracking.register_as == "m"
    with pytest.raises(PolyspecError, match="register_as"):
        validate_tree({"workdir": "w", "tracking": {"register_as": ""}}, "t")
