"""The FastAPI application of ``polyspec serve``: a batch-1 engine behind an OpenAI-compatible API.

Requests are validated and tokenised on the event loop, then queue for the one generation worker thread (a
single-thread executor: FIFO, one generation at a time), so the loop keeps answering /health, /metrics and new requests
while a generation runs. Importing this module imports fastapi and torch: ``polyspec.decode.serve`` imports it only
when a server is built.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import secrets
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
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
from polyspec.decode.serve.metrics import CONTENT_TYPE, Metrics
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


class Engine:
    """One chain, one generation at a time. ``submit`` queues a job for the worker thread and awaits its result."""

    def __init__(self, chain: LoadedChain, mode: str):
        chain.levels_for(mode)  # PolyspecError now if the chain cannot run in this mode
        self.chain = chain
        self.mode = mode
        self.eos = eos_ids(chain.tokenizer)
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
            return self.generate(job, on_tokens)
        finally:
            with self._lock:
                self._running -= 1

    async def submit(self, job: Job, on_tokens: Any = None) -> GenerationResult:
        """Queue ``job``; ``on_tokens`` (called on the worker thread with each round's committed tokens; a true
        return stops the generation) streams it."""
        with self._lock:
            self._pending += 1
        try:  # a cancelled await (client gone) also cancels the job if it has not started
            return await asyncio.wrap_future(self._executor.submit(self._work, job, on_tokens))
        finally:
            with self._lock:
                self._pending -= 1

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
    """What a request handler needs: the chain, its engine and counters, the served name and the defaults."""

    chain: LoadedChain
    engine: Engine
    metrics: Metrics
    model_name: str
    defaults: ServeDefaults


def create_app(chain: LoadedChain, *, mode: str, model_name: str, api_key: str | None = None,
               defaults: ServeDefaults | None = None) -> FastAPI:
    """An OpenAI-compatible app over a loaded chain. ``app.state.engine`` / ``app.state.metrics`` are the engine and
    counters (tests use them)."""
    engine = Engine(chain, mode)
    defaults = defaults or ServeDefaults()
    started = int(time.time())
    metrics = Metrics(model_name, mode, engine.levels)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        engine.close()

    app = FastAPI(title="polyspec", description="OpenAI-compatible API over a polyspec chain", docs_url=None,
                  redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.model_name = model_name

    @app.middleware("http")
    async def guard(request: Request, call_next):  # noqa: ANN202
        path = request.url.path
        endpoint = path if path in ENDPOINTS else "other"
        if api_key and path not in OPEN_PATHS and not _authorized(request.headers.get("authorization"), api_key):
            resp = _error(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                          code="invalid_api_key")
        else:
            try:
                resp = await call_next(request)
            except Exception as exc:  # the last line of defence: the server answers and stays up
                log.exception("unhandled error on %s", path)
                resp = _error(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")
        metrics.observe_request(endpoint, resp.status_code)
        return resp

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        msg = f"no route {request.method} {request.url.path}" if exc.status_code in (404, 405) else str(exc.detail)
        return _error(exc.status_code, msg, code="not_found" if exc.status_code == 404 else None)

    def model_card() -> dict[str, Any]:
        return {"id": model_name, "object": "model", "created": started, "owned_by": "polyspec",
                "polyspec": {"mode": mode, "levels": engine.levels, "context": chain.context}}

    @app.get("/health")
    async def health() -> dict[str, Any]:
        waiting, running = engine.depth()
        return {"status": "ok", "model": model_name, "mode": mode, "queue_depth": waiting, "running": running}

    @app.get("/metrics")
    async def metrics_text() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(*engine.depth()), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Any:
        if model_id != model_name:
            return _error(404, f"model '{model_id}' is not served here; this server serves '{model_name}'",
                          param="model", code="model_not_found")
        return model_card()

    served = _Served(chain, engine, metrics, model_name, defaults)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await _complete(served, request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await _complete(served, request, "text")

    return app


async def _complete(s: _Served, request: Request, kind: Literal["chat", "text"]) -> Any:
    """A chat or text completion request -> its JSON answer, or its event stream when it asks for one."""
    try:
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            raise ApiError(413, f"the request body is over {MAX_BODY_BYTES} bytes", code="body_too_large")
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            raise ApiError(413, f"the request body is over {MAX_BODY_BYTES} bytes", code="body_too_large")
        req = parse_request(raw, ChatCompletionRequest if kind == "chat" else CompletionRequest)
        if req.model is not None and req.model != s.model_name:
            raise ApiError(404, f"model '{req.model}' is not served here; this server serves '{s.model_name}' "
                           "(or leave 'model' out)", param="model", code="model_not_found")
        if kind == "chat":
            ids = encode_chat(s.chain.tokenizer, [m.as_template_dict() for m in req.messages])
            budget_name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        else:
            ids = encode_text(s.chain.tokenizer, req.prompt)
            budget_name = "max_tokens"
        max_new = token_budget(len(ids), req.token_budget(), s.defaults.max_tokens, s.chain.context, budget_name,
                               "messages" if kind == "chat" else "prompt")
        job = Job(prompt_ids=ids, max_new_tokens=max_new,
                  temperature=s.defaults.temperature if req.temperature is None else float(req.temperature),
                  top_p=s.defaults.top_p if req.top_p is None else float(req.top_p),
                  seed=secrets.randbits(63) if req.seed is None else int(req.seed))
        if req.stream:
            return _stream_response(s, kind, req, job, ids, max_new)
        result = await s.engine.submit(job)
    except ApiError as exc:
        return JSONResponse(exc.body(), status_code=exc.status)
    except PolyspecError as exc:  # bad input the decoder caught
        return _error(400, str(exc))
    except Exception as exc:  # the server answers and stays up
        log.exception("generation failed")
        return _error(500, f"generation failed: {type(exc).__name__}: {exc}", type="server_error")
    s.metrics.observe_generation(len(ids), result.stats)
    pieces = token_pieces(s.chain.tokenizer, result.token_ids)
    answer = make_answer(pieces, result.token_ids, s.engine.eos, req.stop_list(), max_new)
    rid = new_id("chatcmpl" if kind == "chat" else "cmpl")
    stats = result.stats
    extra = {"polyspec": {"mode": stats.get("mode"), "seconds": finite(stats.get("seconds", 0.0)),
                          "tokens_per_second": finite(stats.get("tokens_per_second", 0.0)),
                          "mean_accepted": {lv["name"]: lv["mean_accepted"] for lv in stats.get("levels", [])}}}
    return JSONResponse(completion_object(kind, rid, s.model_name, answer, len(ids), extra))


def _stream_response(s: _Served, kind: Literal["chat", "text"], req: Any, job: Job, ids: list[int],
                     max_new: int) -> StreamingResponse:
    """Server-sent events as the target commits tokens: each verification round's text goes out at once (minus
    the few characters a stop string could still begin in); a stop string ends the generation early."""
    rid = new_id("chatcmpl" if kind == "chat" else "cmpl")
    chunks = ChunkMaker(kind, rid, s.model_name, bool(req.stream_options and req.stream_options.include_usage))
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    halt = threading.Event()  # set when a stop string appeared or the client went away

    def on_tokens(tokens: list[int]) -> bool:  # the worker thread
        loop.call_soon_threadsafe(queue.put_nowait, tokens)
        return halt.is_set()

    task = asyncio.ensure_future(s.engine.submit(job, on_tokens))
    task.add_done_callback(lambda _t: queue.put_nowait(None))

    async def events():  # noqa: ANN202
        pieces, answer_stream, generated = PieceDecoder(s.chain.tokenizer), AnswerStream(req.stop_list()), []
        try:
            if kind == "chat":
                yield sse(chunks.delta({"role": "assistant", "content": ""}))
            while (tokens := await queue.get()) is not None:
                generated += tokens
                text = answer_stream.push(pieces.push(tokens))
                if answer_stream.stopped is not None:
                    halt.set()
                if text:
                    yield sse(chunks.delta({"content": text} if kind == "chat" else text))
            try:
                result = task.result()
            except Exception as exc:  # the headers are out: report in the stream, keep serving
                log.exception("generation failed")
                yield sse(error_body(f"generation failed: {type(exc).__name__}: {exc}", type="server_error"))
                yield SSE_DONE
                return
            s.metrics.observe_generation(len(ids), result.stats)
            text = answer_stream.push([], tail=pieces.tail())
            rest, answer = answer_stream.finish(generated, s.engine.eos, max_new)
            rest = text + rest
            if rest:
                yield sse(chunks.delta({"content": rest} if kind == "chat" else rest))
            yield sse(chunks.delta({} if kind == "chat" else "", answer.finish_reason))
            if chunks.include_usage:
                yield sse(chunks.usage(len(ids), answer.completion_tokens))
            yield SSE_DONE
        finally:
            halt.set()  # the client is gone (or we are done): stop generating at the next round

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
