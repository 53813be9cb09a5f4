"""The FastAPI application of ``polyspec serve``: a batch-1 engine behind an OpenAI-compatible API.

Requests are validated and tokenised on the event loop, then queue for the one generation worker thread (a
single-thread executor: FIFO, one generation at a time), so the loop keeps answering /health, /metrics and new requests
while a generation runs. The queue is bounded (429 beyond it) and every request has a deadline (see
:class:`~polyspec.decode.serve.limits.ServeLimits`). Importing this module imports fastapi and torch:
``polyspec.decode.serve`` imports it only when a server is built.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import math
import secrets
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from polyspec.decode.chain import GenerationResult, SamplingParams
from polyspec.decode.generate import LoadedChain, build_decoder, cache_size, chat_token_ids, eos_ids
from polyspec.decode.serve.api import (
    SSE_DONE,
    AnswerStream,
    ApiError,
    ChatCompletionRequest,
    ChunkMaker,
    CompletionRequest,
    PieceDecoder,
    completion_object,
    error_body,
    finite,
    make_answer,
    new_id,
    parse_request,
    sse,
    token_pieces,
)
from polyspec.decode.serve.limits import ServeLimits
from polyspec.decode.serve.metrics import CONTENT_TYPE, Metrics
from polyspec.decode.serve.trust import ServeAccess
from polyspec.errors import PolyspecError

log = logging.getLogger("polyspec.serve")

MAX_BODY_BYTES = 4 << 20
OPEN_PATHS = frozenset({"/health"})  # answered without the API key
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")


@dataclass
class ServeDefaults:
    """What a request that leaves a field out gets (the chain manifest's decode section)."""

    temperature: float = 0.0
    top_p: float = 1.0
    max_tokens: int = 128


@dataclass
class Job:
    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int
    deadline: float | None = None  # Engine.clock() time by which the answer must end
    halt: threading.Event = field(default_factory=threading.Event)  # no more tokens wanted (stop string, client gone)
    cut: bool = False  # set by the worker when the deadline stopped the generation
    queued: bool = False  # holds a place in the engine's count (Engine bookkeeping)


class QueueFull(Exception):
    """``waiting`` requests already wait for the engine, as many as it takes."""

    def __init__(self, waiting: int):
        super().__init__(f"{waiting} requests wait")
        self.waiting = waiting


class JobDropped(Exception):
    """A queued job that was not run: its deadline passed, or its client went away, before its turn."""


class Engine:
    """One chain, one generation at a time. ``submit`` queues a job for the worker thread and awaits its result."""

    def __init__(self, chain: LoadedChain, mode: str, max_queue: int = ServeLimits.max_queue):
        chain.levels_for(mode)  # PolyspecError now if the chain cannot run in this mode
        self.chain = chain
        self.mode = mode
        self.eos = eos_ids(chain.tokenizer)
        self.max_queue = max_queue
        self.clock = time.monotonic  # deadlines are on this clock (tests replace it)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="polyspec-gen")
        self._lock = threading.Lock()
        self._pending = 0  # submitted, not finished (waiting + running)
        self._running = 0

    @property
    def levels(self) -> list[str]:
        return self.chain.levels_for(self.mode)

    def depth(self) -> tuple[int, int]:
        """(waiting, running)."""
        with self._lock:
            return self._pending - self._running, self._running

    def generate(self, job: Job, on_tokens: Any = None) -> GenerationResult:
        """Runs on the worker thread: a decoder sized for this request, then one generation (``on_tokens``: see
        :meth:`ChainDecoder.generate`)."""
        dec = build_decoder(self.chain, self.mode,
                            max_seq_len=cache_size(self.chain, len(job.prompt_ids), job.max_new_tokens))
        sampling = SamplingParams(temperature=job.temperature, top_p=job.top_p)
        return dec.generate(job.prompt_ids, job.max_new_tokens, sampling, seed=job.seed, eos_token_ids=self.eos,
                            on_tokens=on_tokens)

    def _work(self, job: Job, on_tokens: Any = None) -> GenerationResult:
        with self._lock:
            self._running += 1
        try:
            if job.halt.is_set():
                raise JobDropped("the client went away before its turn")
            if job.deadline is not None and self.clock() >= job.deadline:
                raise JobDropped("the deadline passed before its turn")
            return self.generate(job, self._watch(job, on_tokens))
        finally:
            with self._lock:  # both at once, so that a finished job never counts as waiting
                self._running -= 1
                self._pending -= 1
                job.queued = False

    def _watch(self, job: Job, on_tokens: Any) -> Any:
        """``on_tokens`` plus the deadline: the generation stops at the first round that ends past it."""
        def watch(tokens: list[int]) -> bool:
            if on_tokens is not None and on_tokens(tokens):
                return True
            if job.deadline is not None and self.clock() >= job.deadline:
                job.cut = True
                return True
            return False
        return watch

    def _unqueue(self, job: Job) -> None:
        """A job cancelled before it ran gives its place back (one that ran gave it back in _work)."""
        with self._lock:
            if job.queued:
                self._pending -= 1
                job.queued = False

    def submit(self, job: Job, on_tokens: Any = None) -> Future:
        """Queue ``job`` now (its Future's result is the GenerationResult), or QueueFull when ``max_queue`` jobs
        already wait. ``on_tokens`` (called on the worker thread with each round's committed tokens; a true return
        stops the generation) streams it. Cancelling the Future before the job starts takes it out of the queue."""
        with self._lock:
            waiting = self._pending - self._running
            if waiting >= self.max_queue:
                raise QueueFull(waiting)
            self._pending += 1
            job.queued = True
        fut = self._executor.submit(self._work, job, on_tokens)
        fut.add_done_callback(lambda _f: self._unqueue(job))
        return fut

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


# --------------------------------------------------------------------------------------------------------------------
# prompt encoding


def encode_chat(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """All messages through the tokenizer's own chat template, ending with the assistant's generation prompt."""
    if not getattr(tokenizer, "chat_template", None):
        raise ApiError(400, "this chain's tokenizer has no chat template; use /v1/completions with a raw prompt",
                       param="messages")
    from jinja2.exceptions import TemplateError

    try:
        return chat_token_ids(tokenizer, messages)
    except (TemplateError, ValueError, TypeError) as exc:
        raise ApiError(400, f"the chat template rejected these messages: {exc}", param="messages") from None


def encode_text(tokenizer: Any, prompt: str) -> list[int]:
    """A raw prompt, no template (the tokenizer's own special tokens, e.g. BOS, are added as it is configured)."""
    ids = [int(t) for t in tokenizer(prompt, add_special_tokens=True)["input_ids"]]
    if not ids:
        raise ApiError(400, "the prompt encodes to no tokens", param="prompt")
    return ids


def token_budget(prompt_len: int, asked: int | None, default: int, context: int, param: str,
                 prompt_param: str) -> int:
    """max_tokens for this request; a prompt (plus the tokens asked for) over the context is a 400."""
    room = context - prompt_len
    if asked is None:
        if room < 1:
            raise ApiError(400, f"the prompt has {prompt_len} tokens, which fills the model's context of {context} "
                           "tokens; shorten it", param=prompt_param,
                           code="context_length_exceeded")
        return min(default, room)
    if prompt_len + asked > context:
        raise ApiError(400, f"this model's context is {context} tokens, but the prompt has {prompt_len} tokens and "
                       f"{param}={asked} asks for {prompt_len + asked}; shorten the prompt or lower {param}",
                       param=param, code="context_length_exceeded")
    return asked


# --------------------------------------------------------------------------------------------------------------------
# the app


def _error(status: int, message: str, **kw: Any) -> JSONResponse:
    return JSONResponse(error_body(message, **kw), status_code=status)


def _authorized(header: str | None, key: str) -> bool:
    if not header or not header.startswith("Bearer "):
        return False
    return hmac.compare_digest(header[len("Bearer "):].strip().encode(), key.encode())


@dataclass
class _Served:
    """What a request handler needs: the chain, its engine and counters, the served name, defaults and limits."""

    chain: LoadedChain
    engine: Engine
    metrics: Metrics
    model_name: str
    defaults: ServeDefaults
    limits: ServeLimits


def _refusal(request: Request, access: ServeAccess, api_key: str | None) -> JSONResponse | None:
    """The answer to a request this server does not take (docs/SERVE.md, "Trust model"), or None: a Host it does
    not answer (400), an Origin it does not let in (403), no or a wrong API key (401), a POST body that is not
    declared JSON (415)."""
    host = request.headers.get("host")
    if not access.host_allowed(host):
        return _error(400, f"Host {host!r} is not a name this server answers to (loopback names, and --allowed-host); "
                      "a web page cannot reach it through a domain of its own", code="invalid_host")
    origin = request.headers.get("origin")
    if not access.origin_allowed(origin):
        return _error(403, f"requests from web pages of origin {origin!r} are refused; let an origin in with "
                      "--cors-origin", code="origin_not_allowed")
    preflight = request.method == "OPTIONS" and origin is not None  # a browser asking first: it sends no key
    if api_key and request.url.path not in OPEN_PATHS and not preflight \
            and not _authorized(request.headers.get("authorization"), api_key):
        return _error(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                      code="invalid_api_key")
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if request.method == "POST" and media != "application/json":
        return _error(415, f"the request body must be sent as 'Content-Type: application/json', got {media or 'none'!r}"
                      " (curl: -H 'Content-Type: application/json')", code="unsupported_media_type")
    return None


def _guard(app: FastAPI, access: ServeAccess, api_key: str | None, metrics: Metrics) -> None:
    """Every request passes :func:`_refusal` first (then CORS, when origins are configured), is counted, and an
    unexpected exception is a 500 with the server still up."""
    if access.cors_origins:  # inside the guard: only allowed origins reach it
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(access.cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["authorization", "content-type"], max_age=600)

    @app.middleware("http")
    async def guard(request: Request, call_next):  # noqa: ANN202
        path = request.url.path
        endpoint = path if path in ENDPOINTS else "other"
        refused = _refusal(request, access, api_key)
        if refused is not None:
            resp = refused
        else:
            try:
                resp = await call_next(request)
            except Exception as exc:  # the last line of defence: the server answers and stays up
                log.exception("unhandled error on %s", path)
                resp = _error(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")
        metrics.observe_request(endpoint, resp.status_code)
        return resp


def create_app(chain: LoadedChain, *, mode: str, model_name: str, api_key: str | None = None,
               defaults: ServeDefaults | None = None, limits: ServeLimits | None = None,
               access: ServeAccess | None = None) -> FastAPI:
    """An OpenAI-compatible app over a loaded chain. ``app.state.engine`` / ``app.state.metrics`` are the engine and
    counters (tests use them); ``app.state.limits`` the limits (the server's read timeout and connection cap come
    from it)."""
    limits = limits or ServeLimits()
    access = access or ServeAccess()
    engine = Engine(chain, mode, max_queue=limits.max_queue)
    defaults = defaults or ServeDefaults()
    metrics = Metrics(model_name, mode, engine.levels, queue_limit=limits.max_queue)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        engine.close()

    app = FastAPI(title="polyspec", description="OpenAI-compatible API over a polyspec chain", docs_url=None,
                  redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.model_name = model_name
    app.state.limits = limits
    _guard(app, access, api_key, metrics)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        msg = f"no route {request.method} {request.url.path}" if exc.status_code in (404, 405) else str(exc.detail)
        return _error(exc.status_code, msg, code="not_found" if exc.status_code == 404 else None)

    served = _Served(chain, engine, metrics, model_name, defaults, limits)
    _info_routes(app, served, mode, started=int(time.time()))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await _complete(served, request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await _complete(served, request, "text")

    return app


def _info_routes(app: FastAPI, s: _Served, mode: str, started: int) -> None:
    """/health, /metrics and the model list (one model: the served chain)."""
    engine, metrics, name = s.engine, s.metrics, s.model_name

    def model_card() -> dict[str, Any]:
        return {"id": name, "object": "model", "created": started, "owned_by": "polyspec",
                "polyspec": {"mode": mode, "levels": engine.levels, "context": s.chain.context}}

    @app.get("/health")
    async def health() -> dict[str, Any]:
        waiting, running = engine.depth()
        return {"status": "ok", "model": name, "mode": mode, "queue_depth": waiting,
                "queue_limit": s.limits.max_queue, "running": running, **metrics.refusals()}

    @app.get("/metrics")
    async def metrics_text() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(*engine.depth()), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Any:
        if model_id != name:
            return _error(404, f"model '{model_id}' is not served here; this server serves '{name}'",
                          param="model", code="model_not_found")
        return model_card()


# --------------------------------------------------------------------------------------------------------------------
# a request's way through: read and check it, queue it, await it under its deadline


async def _read_body(s: _Served, request: Request) -> bytes:
    """The body, refused when it is over MAX_BODY_BYTES (413) or arrives slower than the read timeout (408; the
    connection is closed: what is left of the body would be read as the next request)."""
    declared = request.headers.get("content-length", "")
    too_big = declared.isdigit() and int(declared) > MAX_BODY_BYTES
    try:
        raw = b"" if too_big else await asyncio.wait_for(request.body(), s.limits.read_timeout)
    except asyncio.TimeoutError:
        s.metrics.observe_rejection("read_timeout")
        raise ApiError(408, f"the request body did not arrive within {s.limits.read_timeout:g} s (--read-timeout)",
                       code="request_timeout", headers={"Connection": "close"}) from None
    if too_big or len(raw) > MAX_BODY_BYTES:
        s.metrics.observe_rejection("body_too_large")
        raise ApiError(413, f"the request body is over {MAX_BODY_BYTES} bytes", code="body_too_large")
    return raw


MAX_CHARS_PER_TOKEN = 32  # a prompt longer than this many characters per allowed token is refused untokenised


def _prompt_ids(s: _Served, req: Any, kind: Literal["chat", "text"]) -> list[int]:
    """The prompt's token ids; over the server's prompt limit is a 400 naming the limit. A prompt whose text alone
    is far over it (MAX_CHARS_PER_TOKEN characters per allowed token) is refused before tokenising: tokenising
    megabytes takes seconds."""
    limit = s.limits.max_prompt_tokens
    chars = sum(len(m.as_template_dict()["content"]) for m in req.messages) if kind == "chat" else len(req.prompt)
    if limit is not None and chars > limit * MAX_CHARS_PER_TOKEN:
        s.metrics.observe_rejection("prompt_too_long")
        raise ApiError(400, f"the prompt has {chars} characters, far over the {limit} tokens this server accepts "
                       "(--max-prompt-tokens); shorten it", param="messages" if kind == "chat" else "prompt",
                       code="prompt_too_long")
    if kind == "chat":
        ids = encode_chat(s.chain.tokenizer, [m.as_template_dict() for m in req.messages])
    else:
        ids = encode_text(s.chain.tokenizer, req.prompt)
    if limit is not None and len(ids) > limit:
        s.metrics.observe_rejection("prompt_too_long")
        raise ApiError(400, f"the prompt has {len(ids)} tokens; this server accepts at most {limit} "
                       "(--max-prompt-tokens); shorten it", param="messages" if kind == "chat" else "prompt",
                       code="prompt_too_long")
    return ids


async def _prepare(s: _Served, request: Request, kind: Literal["chat", "text"]) -> tuple[Any, list[int], int, Job]:
    """A request -> (its parsed body, prompt ids, token budget, the job to run), or an ApiError."""
    arrived = s.engine.clock()
    req = parse_request(await _read_body(s, request), ChatCompletionRequest if kind == "chat" else CompletionRequest)
    if req.model is not None and req.model != s.model_name:
        raise ApiError(404, f"model '{req.model}' is not served here; this server serves '{s.model_name}' "
                       "(or leave 'model' out)", param="model", code="model_not_found")
    ids = _prompt_ids(s, req, kind)
    budget_name = "max_completion_tokens" if kind == "chat" and req.max_completion_tokens is not None else "max_tokens"
    max_new = token_budget(len(ids), req.token_budget(), s.defaults.max_tokens, s.chain.context, budget_name,
                           "messages" if kind == "chat" else "prompt")
    timeout = s.limits.request_timeout
    job = Job(prompt_ids=ids, max_new_tokens=max_new,
              temperature=s.defaults.temperature if req.temperature is None else float(req.temperature),
              top_p=s.defaults.top_p if req.top_p is None else float(req.top_p),
              seed=secrets.randbits(63) if req.seed is None else int(req.seed),
              deadline=None if timeout is None else arrived + timeout)
    return req, ids, max_new, job


def _retry_after(s: _Served, waiting: int) -> dict[str, str]:
    """A Retry-After header: about the time the requests ahead take (at least 1 s)."""
    seconds = math.ceil(s.metrics.mean_generation_seconds() * (waiting + 1))
    return {"Retry-After": str(min(max(seconds, 1), 3600))}


def _submit(s: _Served, job: Job, on_tokens: Any = None) -> Future:
    """Queue ``job`` on the engine, or a 429 with Retry-After when the queue is full."""
    try:
        return s.engine.submit(job, on_tokens)
    except QueueFull as exc:
        s.metrics.observe_rejection("queue_full")
        raise ApiError(429, f"the server is busy: {exc.waiting} requests already wait for its one generation "
                       f"worker (--max-queue {s.engine.max_queue}); retry later", type="rate_limit_error",
                       code="queue_full", headers=_retry_after(s, exc.waiting)) from None


async def _result(s: _Served, job: Job, fut: Future) -> GenerationResult:
    """Await a queued job. When its deadline passes while it still waits, it leaves the queue at once (503); while it
    runs, the worker stops it at the next round (``job.cut``). A cancelled await (client gone) cancels the job too."""
    wrapped = asyncio.wrap_future(fut)
    try:
        if job.deadline is not None:
            try:
                return await asyncio.wait_for(asyncio.shield(wrapped), max(job.deadline - s.engine.clock(), 0.0))
            except asyncio.TimeoutError:
                if fut.cancel():  # not started: give the place back now
                    raise JobDropped("the deadline passed before its turn") from None
        return await wrapped
    except JobDropped:
        if job.halt.is_set():  # its client went away first: nobody to answer, nothing to count
            raise asyncio.CancelledError from None
        s.metrics.observe_rejection("deadline")
        waiting, _ = s.engine.depth()
        raise ApiError(503, f"the server is busy: this request waited past its deadline of "
                       f"{s.limits.request_timeout:g} s (--request-timeout) for its turn and was not run; retry later",
                       type="server_error", code="deadline_exceeded", headers=_retry_after(s, waiting)) from None
    except asyncio.CancelledError:
        job.halt.set()
        fut.cancel()
        raise


def _json_error(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _complete(s: _Served, request: Request, kind: Literal["chat", "text"]) -> Any:
    """A chat or text completion request -> its JSON answer, or its event stream when it asks for one."""
    try:
        req, ids, max_new, job = await _prepare(s, request, kind)
        if req.stream:
            return _stream_response(s, kind, req, job, ids, max_new)
        result = await _result(s, job, _submit(s, job))
    except ApiError as exc:
        return _json_error(exc)
    except PolyspecError as exc:  # bad input the decoder caught
        return _error(400, str(exc))
    except Exception as exc:  # the server answers and stays up
        log.exception("generation failed")
        return _error(500, f"generation failed: {type(exc).__name__}: {exc}", type="server_error")
    s.metrics.observe_generation(len(ids), result.stats, cut=job.cut)
    pieces = token_pieces(s.chain.tokenizer, result.token_ids)
    answer = make_answer(pieces, result.token_ids, s.engine.eos, req.stop_list(), max_new, cut=job.cut)
    rid = new_id("chatcmpl" if kind == "chat" else "cmpl")
    stats = result.stats
    extra = {"polyspec": {"mode": stats.get("mode"), "seconds": finite(stats.get("seconds", 0.0)),
                          "tokens_per_second": finite(stats.get("tokens_per_second", 0.0)),
                          "mean_accepted": {lv["name"]: lv["mean_accepted"] for lv in stats.get("levels", [])},
                          "deadline_exceeded": job.cut}}
    return JSONResponse(completion_object(kind, rid, s.model_name, answer, len(ids), extra))


def _stream_response(s: _Served, kind: Literal["chat", "text"], req: Any, job: Job, ids: list[int],
                     max_new: int) -> StreamingResponse:
    """Server-sent events as the target commits tokens: each verification round's text goes out at once (minus
    the few characters a stop string could still begin in); a stop string ends the generation early. The job is
    queued before the headers go out, so a full queue is still a plain 429."""
    rid = new_id("chatcmpl" if kind == "chat" else "cmpl")
    chunks = ChunkMaker(kind, rid, s.model_name, bool(req.stream_options and req.stream_options.include_usage))
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    def on_tokens(tokens: list[int]) -> bool:  # the worker thread
        loop.call_soon_threadsafe(queue.put_nowait, tokens)
        return job.halt.is_set()

    def done(t: asyncio.Future) -> None:
        if not t.cancelled():
            t.exception()  # read here: when the client is gone, nobody else reads it
        queue.put_nowait(None)

    fut = _submit(s, job, on_tokens)
    task = asyncio.ensure_future(_result(s, job, fut))
    task.add_done_callback(done)

    async def events():  # noqa: ANN202
        pieces, answer_stream, generated = PieceDecoder(s.chain.tokenizer), AnswerStream(req.stop_list()), []
        try:
            if kind == "chat":
                yield sse(chunks.delta({"role": "assistant", "content": ""}))
            while (tokens := await queue.get()) is not None:
                generated += tokens
                text = answer_stream.push(pieces.push(tokens))
                if answer_stream.stopped is not None:
                    job.halt.set()
                if text:
                    yield sse(chunks.delta({"content": text} if kind == "chat" else text))
            tail = answer_stream.push([], tail=pieces.tail())
            for event in _last_events(s, task, chunks, job, answer_stream, generated, tail, (len(ids), max_new)):
                yield event
        finally:
            job.halt.set()  # the client is gone (or we are done): stop generating at the next round
            fut.cancel()  # and give the queue place back at once if it has not started

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _last_events(s: _Served, task: asyncio.Future, chunks: ChunkMaker, job: Job, answer_stream: AnswerStream,
                 generated: list[int], tail: str, sizes: tuple[int, int]) -> list[str]:
    """The events after the last round: the rest of the text, the finish reason, the usage and [DONE]; or, the
    headers being out, the error as the last event. ``tail``: the text the piece decoder still held; ``sizes``:
    (prompt tokens, max new tokens)."""
    try:
        result = task.result()
    except ApiError as exc:
        return [sse(exc.body()), SSE_DONE]
    except Exception as exc:
        log.exception("generation failed")
        return [sse(error_body(f"generation failed: {type(exc).__name__}: {exc}", type="server_error")), SSE_DONE]
    prompt_len, max_new = sizes
    s.metrics.observe_generation(prompt_len, result.stats, cut=job.cut)
    rest, answer = answer_stream.finish(generated, s.engine.eos, max_new, cut=job.cut)
    rest = tail + rest
    chat = chunks.kind == "chat"
    out = [sse(chunks.delta({"content": rest} if chat else rest))] if rest else []
    out.append(sse(chunks.delta({} if chat else "", answer.finish_reason)))
    if chunks.include_usage:
        out.append(sse(chunks.usage(prompt_len, answer.completion_tokens)))
    return out + [SSE_DONE]
