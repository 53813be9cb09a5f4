"""`polyspec serve`: the OpenAI-compatible API over a tiny assembled chain (target + RTN int4 copy + random EAGLE head).

Shapes of chat and text completions, SSE streaming, greedy answers equal to generate_text's, every bad input as a 4xx
OpenAI error body, a crash in generation as a 500 with the server still up, API keys, Prometheus metrics, the load
limits (bounded queue, deadline, prompt length), and a real uvicorn server on a loopback port answering 16 concurrent
clients and a mixed load of valid, malformed, oversize, streamed, dropped and over-queue requests.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from fastapi.testclient import TestClient  # noqa: E402

from polyspec.decode.serve import server as serve  # noqa: E402
from polyspec.decode.serve.api import (  # noqa: E402
    MAX_JSON_DEPTH,
    MAX_STOP_CHARS,
    json_depth,
    make_answer,
    token_pieces,
)
from polyspec.decode.serve.limits import ServeLimits  # noqa: E402
from polyspec.errors import PolyspecError  # noqa: E402

MODEL = "tiny"


@pytest.fixture(scope="module")
def loaded(tiny_chain):
    from polyspec.decode.generate import load_chain

    return load_chain(tiny_chain, device="cpu")


def _client(app) -> TestClient:
    """A test client that sends Host: 127.0.0.1, as a client of a loopback server does (the server refuses names it
    does not answer to, such as TestClient's default 'testserver')."""
    return TestClient(app, base_url="http://127.0.0.1")


def _app(loaded, **kw):
    from polyspec.decode.serve.app import create_app

    return create_app(loaded, mode=kw.pop("mode", "chain"), model_name=MODEL, **kw)


@pytest.fixture(scope="module")
def client(loaded):
    from polyspec.decode.serve.app import ServeDefaults

    with _client(_app(loaded, defaults=ServeDefaults(temperature=0.0, top_p=1.0, max_tokens=6))) as c:
        yield c


def _sse_events(text: str) -> list[str]:
    """The data payloads of a server-sent event stream; every event is one 'data: ...' line and a blank line."""
    assert text.endswith("\n\n")
    events = text[:-2].split("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in events), events
    return [e[len("data: "):] for e in events]


def _assert_error(resp, status: int, needle: str) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert needle in err["message"], err
    return err


# --------------------------------------------------------------------------------------------------------------------
# shapes and answers


def test_health_and_models(client):
    h = client.get("/health").json()
    assert h["status"] == "ok" and h["model"] == MODEL and h["mode"] == "chain" and h["queue_depth"] == 0
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["polyspec"]["levels"] == ["target", "intermediate", "draft"]
    assert client.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    _assert_error(client.get("/v1/models/other"), 404, "not served")


def test_chat_completion_is_generate_text_greedy(client, loaded):
    from polyspec.decode.generate import encode_prompt, generate_text

    ref = generate_text(loaded, "hello there", mode="chain", max_new_tokens=16, temperature=0.0, chat=True)
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hello there"}],
                                                  "max_tokens": 16, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-") and body["model"] == MODEL
    assert isinstance(body["created"], int)
    (choice,) = body["choices"]
    assert choice["index"] == 0 and choice["message"] == {"role": "assistant", "content": ref["text"]}
    ended = ref["token_ids"][-1] in {loaded.tokenizer.eos_token_id}
    assert choice["finish_reason"] == ("stop" if ended or len(ref["token_ids"]) < 16 else "length")
    n_prompt = len(encode_prompt(loaded.tokenizer, "hello there", chat=True))
    assert body["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": len(ref["token_ids"]),
                             "total_tokens": n_prompt + len(ref["token_ids"])}
    assert set(body["polyspec"]["mean_accepted"]) == {"target", "intermediate", "draft"}


def test_text_completion_is_generate_text_greedy_without_template(client, loaded):
    from polyspec.decode.generate import generate_text

    ref = generate_text(loaded, "hello there", mode="chain", max_new_tokens=12, temperature=0.0, chat=False)
    body = client.post("/v1/completions", json={"prompt": "hello there", "max_tokens": 12, "temperature": 0}).json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"][0]["text"] == ref["text"]
    assert body["usage"]["prompt_tokens"] == len(loaded.tokenizer("hello there")["input_ids"])
    assert body["usage"]["completion_tokens"] == len(ref["token_ids"])


def test_multi_message_chat_goes_through_the_template(client, loaded):
    from polyspec.decode.generate import build_decoder, eos_ids

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"}, {"role": "user", "content": "and now?"}]
    ids = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    text = loaded.tokenizer.decode(ids)
    assert "Be brief." in text and "and now?" in text and text.endswith("<|im_start|>assistant\n")
    dec = build_decoder(loaded, "chain", max_seq_len=len(ids) + 10 + 64)
    want = dec.generate(ids, 10, seed=0, eos_token_ids=eos_ids(loaded.tokenizer)).token_ids
    body = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 10, "temperature": 0}).json()
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert body["choices"][0]["message"]["content"] == loaded.tokenizer.decode(want, skip_special_tokens=True)
    # OpenAI's content parts (text only) are the same message
    parts = [{**m, "content": [{"type": "text", "text": m["content"][:2]}, {"type": "text", "text": m["content"][2:]}]}
             for m in messages]
    same = client.post("/v1/chat/completions", json={"messages": parts, "max_tokens": 10, "temperature": 0}).json()
    assert same["choices"] == body["choices"]


def test_seeded_sampling_repeats_and_defaults_apply(client):
    req = {"prompt": "once upon", "max_tokens": 10, "temperature": 0.9, "top_p": 0.9, "seed": 7}
    a = client.post("/v1/completions", json=req).json()["choices"][0]["text"]
    b = client.post("/v1/completions", json=req).json()["choices"][0]["text"]
    assert a == b
    # fields left out: the served defaults (greedy, max_tokens=6 for this app)
    body = client.post("/v1/completions", json={"prompt": "once upon"}).json()
    greedy = client.post("/v1/completions", json={"prompt": "once upon", "temperature": 0, "max_tokens": 6}).json()
    assert body["choices"] == greedy["choices"] and body["usage"] == greedy["usage"]
    assert body["usage"]["completion_tokens"] == 6 or body["choices"][0]["finish_reason"] == "stop"


# --------------------------------------------------------------------------------------------------------------------
# streaming and stop strings


@pytest.mark.parametrize("path, kind", [("/v1/chat/completions", "chat"), ("/v1/completions", "text")])
def test_streaming_sse_matches_the_whole_answer(client, path, kind):
    req = {"max_tokens": 14, "temperature": 0}
    req.update({"messages": [{"role": "user", "content": "hello there"}]} if kind == "chat" else {"prompt": "hi"})
    whole = client.post(path, json=req).json()
    r = client.post(path, json={**req, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    assert {c["object"] for c in chunks} == {obj} and len({c["id"] for c in chunks}) == 1
    *content, last, usage_chunk = chunks
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == whole["usage"]
    assert last["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert all(c["choices"][0]["finish_reason"] is None for c in content)
    if kind == "chat":
        assert content[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in content)
        assert text == whole["choices"][0]["message"]["content"]
    else:
        text = "".join(c["choices"][0]["text"] for c in content)
        assert text == whole["choices"][0]["text"]
    assert len(content) >= 2  # streamed in pieces, not one blob


def test_stop_string_cuts_the_answer(client):
    req = {"prompt": "hello there", "max_tokens": 20, "temperature": 0}
    full = client.post("/v1/completions", json=req).json()
    text = full["choices"][0]["text"]
    stop = text[len(text) // 2:len(text) // 2 + 2]
    cut = client.post("/v1/completions", json={**req, "stop": [stop]}).json()
    assert cut["choices"][0]["text"] == text[:text.find(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"
    assert cut["usage"]["completion_tokens"] <= full["usage"]["completion_tokens"]
    streamed = client.post("/v1/completions", json={**req, "stop": stop, "stream": True})
    chunks = [json.loads(e) for e in _sse_events(streamed.text)[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == text[:text.find(stop)]


def test_answer_text_pieces_and_stops():
    answer = make_answer(["ab", "cd", "ef"], [1, 2, 3], eos=set(), stops=["bc"], max_tokens=3)
    assert (answer.text, answer.finish_reason, answer.completion_tokens) == ("a", "stop", 2)
    answer = make_answer(["ab", "cd"], [1, 9], eos={9}, stops=[], max_tokens=5)
    assert (answer.text, answer.finish_reason) == ("abcd", "stop")
    answer = make_answer(["ab", "cd"], [1, 2], eos={9}, stops=["zz"], max_tokens=2)
    assert (answer.text, answer.finish_reason, answer.completion_tokens) == ("abcd", "length", 2)


@pytest.mark.parametrize("stops", [[], ["cd"], ["e", "zzz"], ["bcdefg"], ["xyz"]])
def test_answer_stream_sends_early_and_agrees_with_the_whole_answer(stops):
    """Fed piece by piece (any split), the streamed text equals make_answer's, no text that a stop string could still
    begin in is ever sent, and a stop string is reported on the piece that completes it."""
    from polyspec.decode.serve.api import AnswerStream

    pieces = ["ab", "", "cd", "e", "fg", "h", "ij"]
    ids = list(range(len(pieces)))
    whole = make_answer(pieces, ids, eos=set(), stops=stops, max_tokens=len(pieces))
    for split in (1, 2, 3):
        stream, sent = AnswerStream(stops), ""
        for k in range(0, len(pieces), split):
            sent += stream.push(pieces[k:k + split])
            longest = max((len(x) for x in stops), default=1)
            assert len(sent) <= max(len(stream.text) - (longest - 1), 0) or stream.stopped is not None
            if stream.stopped is not None:
                break
        rest, answer = stream.finish(ids[:len(stream.pieces)], set(), len(pieces))
        assert sent + rest == whole.text
        assert (answer.finish_reason, answer.completion_tokens) == (whole.finish_reason, whole.completion_tokens)
    if not stops or stops == ["xyz"]:
        first = AnswerStream(stops).push(pieces[:3])
        assert first == ("abcd" if not stops else "ab")  # sent at once; "xyz" holds back 2 characters


def test_streaming_stops_generating_at_a_stop_string(client):
    """The stop string ends the generation itself: the engine does not decode the rest of max_tokens."""
    req = {"prompt": "hello there", "max_tokens": 40, "temperature": 0}
    text = client.post("/v1/completions", json=req).json()["choices"][0]["text"]
    stop = text[4:6]
    engine = client.app.state.engine
    calls: list[int] = []
    original = engine.generate

    def counting(job, on_tokens=None):
        result = original(job, on_tokens)
        calls.append(len(result.token_ids))
        return result

    engine.generate = counting
    try:
        r = client.post("/v1/completions", json={**req, "stop": [stop], "stream": True,
                                                 "stream_options": {"include_usage": True}})
    finally:
        engine.generate = original
    chunks = [json.loads(e) for e in _sse_events(r.text)[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == text[:text.find(stop)]
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert calls and calls[0] < 40 and chunks[-1]["usage"]["completion_tokens"] <= calls[0]


def test_token_pieces_concatenate_to_the_decoded_text(loaded):
    tok = loaded.tokenizer
    ids = tok("héllo wörld, 你好 — ok", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    pieces = token_pieces(tok, ids)
    assert len(pieces) == len(ids)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)
    assert "\ufffd" not in "".join(pieces)


# --------------------------------------------------------------------------------------------------------------------
# bad input


CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("path, body, status, needle", [
    ("/v1/chat/completions", b'{"messages": [', 400, "not valid JSON"),
    ("/v1/chat/completions", b"[1, 2]", 400, "JSON object"),
    ("/v1/chat/completions", {**CHAT, "frequency_penalty": 0.5}, 400, "unknown field 'frequency_penalty'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "x": 1}]}, 400, "messages.0.x"),
    ("/v1/chat/completions", {**CHAT, "temperature": -0.5}, 400, "temperature"),
    ("/v1/chat/completions", {**CHAT, "temperature": "hot"}, 400, "temperature"),
    ("/v1/chat/completions", {**CHAT, "top_p": 0}, 400, "top_p"),
    ("/v1/chat/completions", {**CHAT, "top_p": 1.5}, 400, "top_p"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "n": 2}, 400, "n=1"),
    ("/v1/chat/completions", {**CHAT, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("/v1/chat/completions", {**CHAT, "temperature": 2.5}, 400, "temperature"),
    ("/v1/chat/completions", {**CHAT, "temperature": 1e9}, 400, "less than or equal to 2"),
    ("/v1/completions", {"prompt": "hi", "stop": ["ok", "x" * (MAX_STOP_CHARS + 1)]}, 400,
     f"at most {MAX_STOP_CHARS} characters"),
    ("/v1/completions", {"prompt": "hi", "stop": "y" * 100_000}, 400, f"at most {MAX_STOP_CHARS} characters"),
    ("/v1/chat/completions", b"[" * 100_000, 400, "nests arrays/objects 100000 deep"),
    ("/v1/completions", b'{"prompt": "hi", "user": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, "nests"),
    ("/v1/completions", b'{"prompt": "hi", "x": ' + b'{"a":' * 50_000 + b"1" + b"}" * 50_001, 400, "nests"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "hi"}]}, 400, "role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "content"),
    ("/v1/chat/completions", {}, 400, "'messages' is required"),
    ("/v1/chat/completions", {**CHAT, "model": "gpt-4"}, 404, "not served"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 100_000}, 400, "context"),
    ("/v1/completions", {"prompt": "hi " * 600}, 400, "context"),
    ("/v1/completions", {"prompt": "hi", "seed": 1.5}, 400, "seed"),
    ("/v1/completions", {"prompt": "hi", "seed": 2**70}, 400, "seed"),
    ("/v1/completions", {"prompt": "x" * (5 << 20)}, 413, "over"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream"),
])
def test_bad_requests_get_an_openai_error(client, path, body, status, needle):
    if isinstance(body, bytes):
        r = client.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = client.post(path, json=body)
    _assert_error(r, status, needle)


def test_unknown_route_and_method(client):
    _assert_error(client.get("/v1/nothing"), 404, "no route")
    _assert_error(client.get("/v1/completions"), 405, "no route")


def test_a_crash_in_generation_is_a_500_and_the_server_lives_on(client, monkeypatch):
    engine = client.app.state.engine

    def boom(job, on_tokens=None):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(engine, "generate", boom)
    _assert_error(client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4}), 500, "kernel exploded")
    # streamed: the 200 headers are out before the crash, so the error arrives as an event, then [DONE]
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "stream": True})
    events = _sse_events(r.text)
    assert r.status_code == 200 and events[-1] == "[DONE]"
    assert "kernel exploded" in json.loads(events[-2])["error"]["message"]
    monkeypatch.undo()
    assert client.get("/health").json()["status"] == "ok"
    assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4}).status_code == 200


# --------------------------------------------------------------------------------------------------------------------
# API key, CLI entry


def test_api_key_is_required_except_on_health(loaded):
    with _client(_app(loaded, api_key="s3cret")) as c:
        req = {"prompt": "hi", "max_tokens": 3}
        _assert_error(c.post("/v1/completions", json=req), 401, "API key")
        _assert_error(c.post("/v1/completions", json=req, headers={"Authorization": "Bearer nope"}), 401, "API key")
        _assert_error(c.get("/metrics"), 401, "API key")
        assert c.post("/v1/completions", json=req, headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert c.get("/health").status_code == 200
        m = c.get("/metrics", headers={"Authorization": "Bearer s3cret"}).text
        assert 'polyspec_requests_total{endpoint="/v1/completions",status="401"} 2' in m


def _args(*argv):
    import argparse

    p = argparse.ArgumentParser()
    serve.configure_parser(p)
    return p.parse_args(list(argv))


def test_bad_chain_fails_before_binding(tiny_chain, tmp_path, monkeypatch):
    broken = tmp_path / "chain"
    shutil.copytree(tiny_chain, broken)
    victim = broken / "levels" / "draft" / "model.safetensors"
    victim.write_bytes(victim.read_bytes()[:-8])
    monkeypatch.setattr(serve, "bind_socket", lambda *a: pytest.fail("bound a port for a bad chain"))
    with pytest.raises(PolyspecError) as exc:
        serve.run(_args(str(broken), "--device", "cpu", "--port", "0"))
    assert exc.value.exit_code != 0 and str(victim) in str(exc.value)


def test_a_busy_port_is_a_clear_error():
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    try:
        with pytest.raises(PolyspecError, match="cannot listen on 127.0.0.1"):
            serve.bind_socket("127.0.0.1", held.getsockname()[1])
    finally:
        held.close()


def test_mode_the_chain_cannot_run_fails_before_binding(tiny_llama_dir, tmp_path, monkeypatch):
    from polyspec.manifest import assemble_chain

    assemble_chain(tmp_path / "target_only", tiny_llama_dir)
    monkeypatch.setattr(serve, "bind_socket", lambda *a: pytest.fail("bound a port for an unusable mode"))
    with pytest.raises(PolyspecError, match="at least 3 levels"):
        serve.run(_args(str(tmp_path / "target_only"), "--device", "cpu", "--mode", "chain", "--port", "0"))


def test_run_warns_beyond_loopback_without_a_key(tiny_chain, monkeypatch, capsys):
    started = []

    class FakeServer:
        def run(self, sockets):
            started.append(sockets[0].getsockname())

    loopback = serve.bind_socket
    monkeypatch.setattr(serve, "bind_socket", lambda host, port: loopback("127.0.0.1", 0))  # tests stay on loopback
    monkeypatch.setattr(serve, "make_server", lambda app, log_level: FakeServer())
    monkeypatch.delenv(serve.API_KEY_ENV, raising=False)
    assert serve.run(_args(str(tiny_chain), "--device", "cpu", "--host", "0.0.0.0", "--port", "0")) == 0
    assert "warning" in capsys.readouterr().err and started
    monkeypatch.setenv(serve.API_KEY_ENV, "k")
    assert serve.run(_args(str(tiny_chain), "--device", "cpu", "--host", "0.0.0.0", "--port", "0")) == 0
    err = capsys.readouterr().err
    assert "warning" not in err and "API key required" in err
    assert serve.is_loopback("127.0.0.1") and serve.is_loopback("::1") and serve.is_loopback("localhost")
    assert not serve.is_loopback("0.0.0.0") and not serve.is_loopback("192.168.1.5")


# --------------------------------------------------------------------------------------------------------------------
# metrics, concurrency


_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?:[a-zA-Z_]+="(?:[^"\\]|\\.)*",?)*\})? (\S+)$')


def _parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value}; every line must be a comment or a well-formed sample whose metric
    family has a TYPE line."""
    typed, out = set(), {}
    for line in text.strip().split("\n"):
        if line.startswith("# TYPE "):
            typed.add(line.split()[2])
            continue
        if line.startswith("# HELP "):
            continue
        m = _SAMPLE.match(line)
        assert m, f"bad metrics line: {line!r}"
        family = re.sub(r"_(bucket|sum|count)$", "", m.group(1))
        assert m.group(1) in typed or family in typed, line
        out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def test_metrics_parse_and_count(loaded):
    with _client(_app(loaded)) as c:
        tokens = 0
        for _ in range(2):
            tokens += c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5}).json()["usage"][
                "completion_tokens"]
        c.post("/v1/completions", json={"prompt": "hi", "top_p": 2})
        m = _parse_metrics(c.get("/metrics").text)
    assert m['polyspec_requests_total{endpoint="/v1/completions",status="200"}'] == 2
    assert m['polyspec_requests_total{endpoint="/v1/completions",status="400"}'] == 1
    assert m["polyspec_generated_tokens_total"] == tokens and m["polyspec_generations_total"] == 2
    assert m['polyspec_tokens_per_second_bucket{le="+Inf"}'] == 2 and m["polyspec_last_tokens_per_second"] > 0
    assert m['polyspec_mean_accepted_tokens{level="target"}'] >= 1.0
    assert {'polyspec_mean_accepted_tokens{level="intermediate"}', 'polyspec_mean_accepted_tokens{level="draft"}'} \
        <= set(m)
    assert m["polyspec_queue_depth"] == 0 and m["polyspec_requests_running"] == 0


@contextlib.contextmanager
def _serving(app):
    """A real uvicorn server for ``app`` on a free loopback port, in a thread; yields its base URL."""
    sock = serve.bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    server = serve.make_server(app, log_level="warning")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        sock.close()
    assert not thread.is_alive()


def test_real_server_answers_16_concurrent_clients(loaded):
    import httpx

    with _serving(_app(loaded, mode="dual")) as base:
        def ask(i: int) -> tuple[int, str]:
            body = {"prompt": f"client {i}", "max_tokens": 8, "temperature": 0.7, "seed": i, "stream": i % 2 == 1}
            with httpx.Client(timeout=60) as h:
                r = h.post(f"{base}/v1/completions", json=body)
                return r.status_code, r.text

        with ThreadPoolExecutor(16) as pool:
            futures = [pool.submit(ask, i) for i in range(16)]
            t0 = time.monotonic()
            health = httpx.get(f"{base}/health", timeout=10)  # the event loop answers while generations queue
            health_s = time.monotonic() - t0
            results = [f.result(timeout=120) for f in futures]
        assert health.status_code == 200 and health_s < 5
        assert [s for s, _ in results] == [200] * 16
        for i, (_, text) in enumerate(results):
            if i % 2:
                assert _sse_events(text)[-1] == "[DONE]"
            else:
                assert json.loads(text)["choices"][0]["finish_reason"] in ("stop", "length")
        m = _parse_metrics(httpx.get(f"{base}/metrics", timeout=10).text)
        assert m['polyspec_requests_total{endpoint="/v1/completions",status="200"}'] == 16
        assert m["polyspec_generations_total"] == 16 and m["polyspec_queue_depth"] == 0
        assert m['polyspec_rejections_total{reason="queue_full"}'] == 0  # 15 waiting fit the default queue of 16


# --------------------------------------------------------------------------------------------------------------------
# hostile bodies and load limits


def test_json_depth_counts_brackets_outside_strings_only():
    assert json_depth(b'{"a": [1, {"b": []}]}') == 4
    assert json_depth(b'{"a": "[[[[{{{{", "b": "\\\\\\"[[[", "c": [1]}') == 2  # brackets in strings, escaped quotes
    assert json_depth(b"[" * 100_000) == 100_000 and json_depth(b"") == 0
    t0 = time.monotonic()  # an unterminated string of escaped quotes never makes the scan quadratic
    assert json_depth(b'"' + b'\\"[' * (1 << 20)) == 0
    assert json_depth(b"[]" * (1 << 20)) == 1
    assert time.monotonic() - t0 < 5


def test_limits_at_their_edges_are_accepted(client):
    deep = {"prompt": "hi", "max_tokens": 2, "user": "[" * 1000}  # brackets inside a string are text
    assert client.post("/v1/completions", json=deep).status_code == 200
    nested = b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "max_tokens": 2}'
    assert json_depth(nested) <= MAX_JSON_DEPTH
    assert client.post("/v1/chat/completions", content=nested,
                       headers={"content-type": "application/json"}).status_code == 200
    edge = {"prompt": "hi", "max_tokens": 2, "temperature": 2, "stop": ["z" * MAX_STOP_CHARS] * 4}
    assert client.post("/v1/completions", json=edge).status_code == 200


def test_prompt_token_limit_is_a_400_naming_it(loaded):
    with _client(_app(loaded, limits=ServeLimits(max_prompt_tokens=8))) as c:
        r = c.post("/v1/completions", json={"prompt": "hello " * 20, "max_tokens": 2})
        err = _assert_error(r, 400, "at most 8 (--max-prompt-tokens)")
        assert err["code"] == "prompt_too_long" and err["param"] == "prompt"
        chat = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hello " * 20}]})
        assert _assert_error(chat, 400, "at most 8")["param"] == "messages"
        assert c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2}).status_code == 200
        health = c.get("/health").json()
        m = _parse_metrics(c.get("/metrics").text)
    assert health["rejected"]["prompt_too_long"] == 2 and m['polyspec_rejections_total{reason="prompt_too_long"}'] == 2


def _rounds_advance(engine, now: list[float], seconds: float, rounds: list[int]) -> None:
    """Make every verification round of ``engine`` take ``seconds`` on a fake clock (``now[0]``), recording each
    round's token count in ``rounds``."""
    original = engine.generate

    def slow(job, on_tokens=None):
        def tick(tokens):
            now[0] += seconds
            rounds.append(len(tokens))
            return on_tokens(tokens)
        return original(job, tick)

    engine.generate = slow
    engine.clock = lambda: now[0]


@pytest.mark.parametrize("stream", [False, True])
def test_deadline_stops_a_running_generation(loaded, stream):
    """A generation that runs past the deadline stops at the next round: the answer so far, finish_reason 'length'."""
    req = {"prompt": "hello there", "max_tokens": 40, "temperature": 0}
    with _client(_app(loaded, limits=ServeLimits(request_timeout=25))) as c:
        full = c.post("/v1/completions", json=req).json()
        assert full["polyspec"]["deadline_exceeded"] is False
        now, rounds = [0.0], []
        _rounds_advance(c.app.state.engine, now, 10.0, rounds)  # rounds end at t = 10, 20, 30: past 25 on the third
        if stream:
            r = c.post("/v1/completions", json={**req, "stream": True, "stream_options": {"include_usage": True}})
            chunks = [json.loads(e) for e in _sse_events(r.text)[:-1]]
            text = "".join(ch["choices"][0]["text"] for ch in chunks[:-1])
            reason, used = chunks[-2]["choices"][0]["finish_reason"], chunks[-1]["usage"]["completion_tokens"]
        else:
            body = c.post("/v1/completions", json=req).json()
            assert body["polyspec"]["deadline_exceeded"] is True
            text, reason = body["choices"][0]["text"], body["choices"][0]["finish_reason"]
            used = body["usage"]["completion_tokens"]
        health = c.get("/health").json()
    assert len(rounds) == 3 and used == sum(rounds) < full["usage"]["completion_tokens"]
    assert reason == "length" and full["choices"][0]["text"].startswith(text)
    assert health["deadline_cut"] == 1 and health["status"] == "ok"


def test_serve_limits_options(tiny_chain, monkeypatch):
    apps = []

    class FakeServer:
        def run(self, sockets):
            pass

    monkeypatch.setattr(serve, "bind_socket", lambda host, port: socket.socket())
    monkeypatch.setattr(serve, "make_server", lambda app, log_level: apps.append(app) or FakeServer())
    argv = [str(tiny_chain), "--device", "cpu", "--max-queue", "3", "--request-timeout", "0", "--max-prompt-tokens",
            "0"]
    assert serve.run(_args(*argv)) == 0
    with _client(apps[0]) as c:
        assert c.get("/health").json()["queue_limit"] == 3
    assert serve.run(_args(str(tiny_chain), "--device", "cpu")) == 0
    assert apps[1].state.engine.max_queue == ServeLimits.max_queue
    for bad in (["--max-queue", "-1"], ["--request-timeout", "-5"], ["--max-prompt-tokens", "-2"]):
        monkeypatch.setattr(serve, "build_app", lambda *a, **k: pytest.fail("loaded a chain with bad limits"))
        with pytest.raises(PolyspecError, match=bad[0]):
            serve.run(_args(str(tiny_chain), *bad))


class _Gate:
    """Holds every generation of ``engine`` at its start until :meth:`open` (to fill the queue on purpose)."""

    def __init__(self, engine):
        self.event = threading.Event()
        original = engine.generate

        def gated(job, on_tokens=None):
            assert self.event.wait(timeout=60), "gate never opened"
            return original(job, on_tokens)

        engine.generate = gated

    def open(self):
        self.event.set()


def _wait_for(what, predicate, timeout=20.0):
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_deadline_passing_in_the_queue_is_a_503_and_frees_the_place(loaded):
    import httpx

    app = _app(loaded, limits=ServeLimits(request_timeout=1.0))
    gate, engine = _Gate(app.state.engine), app.state.engine
    url = "/v1/completions"
    with _serving(app) as base, httpx.Client(base_url=base, timeout=30) as h, ThreadPoolExecutor(2) as pool:
        first = pool.submit(h.post, url, json={"prompt": "hi", "max_tokens": 30})
        _wait_for("the first request to run", lambda: engine.depth() == (0, 1))
        t0 = time.monotonic()
        streamed = pool.submit(h.post, url, json={"prompt": "hi", "max_tokens": 4, "stream": True})
        r = h.post(url, json={"prompt": "hi", "max_tokens": 4})
        waited = time.monotonic() - t0
        err = _assert_error(r, 503, "deadline of 1 s")
        assert err["code"] == "deadline_exceeded" and int(r.headers["retry-after"]) >= 1
        assert 0.9 <= waited < 10  # answered at its deadline, not when the worker came free
        # streamed, the 200 headers are out: the error is the last event before [DONE]
        events = _sse_events(streamed.result(timeout=10).text)
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "deadline_exceeded"
        health = h.get("/health").json()
        assert (health["queue_depth"], health["running"], health["rejected"]["deadline"]) == (0, 1, 2)
        gate.open()  # the first one is past its deadline too: it stops after its first round
        body = first.result(timeout=30).json()
        assert body["choices"][0]["finish_reason"] == "length" and body["polyspec"]["deadline_exceeded"] is True
        assert body["usage"]["completion_tokens"] < 30


def _classify(status: int) -> str:
    return "2xx" if 200 <= status < 300 else "429" if status == 429 else "4xx" if 400 <= status < 500 else str(status)


def test_mixed_load_every_answer_in_its_class_and_the_server_healthy_after(loaded):
    """Valid, malformed, oversize, streamed, dropped and over-queue requests at once against a real server with a
    queue of 2: each gets the right class of answer, never a 5xx, and the server is healthy after."""
    import httpx

    app = _app(loaded, mode="dual", limits=ServeLimits(max_queue=2, max_prompt_tokens=64))
    engine, gate = app.state.engine, _Gate(app.state.engine)
    url = "/v1/completions"
    valid = {"prompt": "hello", "max_tokens": 6, "temperature": 0}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "stream": True}
    bad = [(url, b"[" * 100_000, 400), (url, {**valid, "temperature": 1e9}, 400),
           (url, {**valid, "stop": "s" * 100_000}, 400), (url, {"prompt": "x" * (5 << 20)}, 413),
           (url, {"prompt": "hello " * 200}, 400), (url, b'{"prompt": ', 400), (url, {**valid, "tools": []}, 400),
           ("/v1/chat/completions", {"messages": "hi"}, 400)]

    def post(h, path, body):
        kw = {"content": body} if isinstance(body, bytes) else {"json": body}
        r = h.post(path, headers={"content-type": "application/json"}, **kw)
        return r.status_code, r.headers, r.text

    with _serving(app) as base, httpx.Client(base_url=base, timeout=60) as h, ThreadPoolExecutor(8) as pool:
        # the worker is held: one runs, one streamed request waits, one dropped stream takes the last place
        running = pool.submit(post, h, url, valid)
        _wait_for("a running request", lambda: engine.depth() == (0, 1))
        streamed = pool.submit(post, h, "/v1/chat/completions", chat)
        _wait_for("a waiting request", lambda: engine.depth() == (1, 1))
        with httpx.Client(base_url=base, timeout=60) as dropper:
            with dropper.stream("POST", "/v1/chat/completions", json=chat) as r:
                lines = r.iter_lines()  # kept: a dropped iterator closes the connection
                assert r.status_code == 200 and next(lines).startswith("data: ")
                assert engine.depth() == (2, 1)
                over = [pool.submit(post, h, url, {**valid, "stream": i % 2 == 1}) for i in range(3)]
                malformed = [pool.submit(post, h, path, body) for path, body, _ in bad]
                for f in over:  # answered at once, while the worker is still held
                    status, headers, _ = f.result(timeout=30)
                    assert status == 429 and int(headers["retry-after"]) >= 1
                for f, (_, _, want) in zip(malformed, bad, strict=True):
                    assert f.result(timeout=30)[0] == want
                assert h.get("/health").json()["queue_depth"] == 2
        _wait_for("the dropped stream to leave the queue", lambda: engine.depth() == (1, 1))
        gate.open()
        assert running.result(timeout=30)[0] == 200
        status, _, text = streamed.result(timeout=30)
        assert status == 200 and _sse_events(text)[-1] == "[DONE]" and '"error"' not in text

        # and all at once with the worker free: valid ones get 200 or 429 (the queue is small), the rest their 4xx
        kinds = [("valid", url, valid), ("valid", "/v1/chat/completions", chat)] * 4
        kinds += [("bad", path, body) for path, body, _ in bad]
        results = list(pool.map(lambda k: (k[0], post(h, k[1], k[2])[0]), kinds))
        assert all(_classify(s) in (("2xx", "429") if kind == "valid" else ("4xx",)) for kind, s in results), results

        _assert_healthy_after(h, engine, 3 + sum(s == 429 for _, s in results), url, valid)


def _assert_healthy_after(h, engine, queue_full: int, url: str, valid: dict) -> None:
    """Once idle: health and metrics count the refusals (2 bodies too large, 2 prompts too long, ``queue_full``
    over the queue), no 5xx was answered, and a valid request is served."""
    _wait_for("an idle engine", lambda: engine.depth() == (0, 0))
    health = h.get("/health").json()
    assert health["status"] == "ok" and (health["queue_depth"], health["running"]) == (0, 0)
    assert health["rejected"]["queue_full"] == queue_full
    assert health["rejected"]["body_too_large"] == 2 and health["rejected"]["prompt_too_long"] == 2
    m = _parse_metrics(h.get("/metrics").text)
    assert m['polyspec_rejections_total{reason="queue_full"}'] == queue_full
    assert m["polyspec_queue_limit"] == 2
    assert not any(k.startswith("polyspec_requests_total") and 'status="5' in k for k in m)
    after = h.post(url, json=valid)
    assert after.status_code == 200 and after.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_a_prompt_far_over_the_limit_is_refused_before_tokenising(loaded, monkeypatch):
    """Megabytes of prompt are refused by their length alone (tokenising them would hold the event loop)."""
    from polyspec.decode.serve import app as app_module

    calls = []
    real = app_module.encode_text
    monkeypatch.setattr(app_module, "encode_text", lambda tok, prompt: calls.append(len(prompt)) or real(tok, prompt))
    with _client(_app(loaded, limits=ServeLimits(max_prompt_tokens=8))) as c:
        r = c.post("/v1/completions", json={"prompt": "x" * (8 * app_module.MAX_CHARS_PER_TOKEN + 1), "max_tokens": 2})
        assert _assert_error(r, 400, "characters")["code"] == "prompt_too_long"
        assert calls == []
        chat = c.post("/v1/chat/completions", json={"messages": [
            {"role": "user", "content": [{"type": "text", "text": "y" * (8 * app_module.MAX_CHARS_PER_TOKEN + 1)}]}]})
        assert _assert_error(chat, 400, "characters")["param"] == "messages"
        assert c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2}).status_code == 200
    assert calls == [5]
