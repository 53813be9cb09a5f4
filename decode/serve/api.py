"""The OpenAI wire format of ``polyspec serve``: strict request models, error bodies, response and stream-chunk objects,
and the text side of an answer (incremental detokenisation, stop strings). Pure functions; no web framework here.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from polyspec.safeload import json_depth

MAX_STOPS = 4  # OpenAI's limit on stop sequences
# A stream holds back the last (longest stop - 1) characters, so a stop's length bounds that delay: 128 characters
# fit any real stop marker (role headers, code fences) and hold back at most ~30 tokens of text.
MAX_STOP_CHARS = 128
MAX_TEMPERATURE = 2.0  # OpenAI's bound
# OpenAI bodies nest 4 deep ({"messages": [{"content": [{...}]}]}); a limit well above that, checked before parsing,
# keeps a hostile body (100k '[') away from the recursive JSON parser.
MAX_JSON_DEPTH = 32


class ApiError(Exception):
    """A request that gets an OpenAI-style error body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(message: str, *, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# --------------------------------------------------------------------------------------------------------------------
# requests


class _Strict(BaseModel):
    """Unknown fields, wrong JSON types (no "1" for 1, no true for 1) and NaN/inf are errors."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]  # a string, or OpenAI's content parts (text parts only; joined)

    def as_template_dict(self) -> dict[str, str]:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": self.role, "content": text}


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """Fields both endpoints take. None = the chain's decode default (from its manifest)."""

    model: str | None = None
    temperature: float | None = Field(None, ge=0, le=MAX_TEMPERATURE, description="0 = greedy")
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64, description="a 64-bit integer")
    n: int = Field(1, description="only 1 (batch-1 engine)")
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    @field_validator("n")
    @classmethod
    def _only_one(cls, v: int) -> int:
        if v != 1:
            raise ValueError("only n=1 is supported (one answer per request)")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        longest = max((len(s) for s in stops), default=0)
        if longest > MAX_STOP_CHARS:
            raise ValueError(f"a stop sequence may have at most {MAX_STOP_CHARS} characters, got one of {longest}")
        return v

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="newer name of max_tokens")

    def token_budget(self) -> int | None:
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise ApiError(400, "max_tokens and max_completion_tokens disagree; send one of them", param="max_tokens")
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Sampling):
    prompt: str = Field(min_length=1)

    def token_budget(self) -> int | None:
        return self.max_tokens


def parse_request(raw: bytes, model: type[_Sampling]) -> Any:
    """Body bytes -> a validated request, or an ApiError (400) naming the field and what is wrong with it."""
    depth = json_depth(raw)
    if depth > MAX_JSON_DEPTH:
        raise ApiError(400, f"the request body nests arrays/objects {depth} deep; at most {MAX_JSON_DEPTH} levels "
                       "are accepted", code="invalid_json")
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(data).__name__}", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(exc, model) from None


_UNION_TAGS = {"str": "a string", "list[str]": "a list of strings",
               "list[TextPart]": "a list of text parts ({'type': 'text', 'text': ...})"}


def _validation_error(exc: ValidationError, model: type[BaseModel]) -> ApiError:
    errors = exc.errors(include_url=False)
    first = errors[0]
    parts = [str(p) for p in first["loc"]]
    tag = next((i for i, p in enumerate(parts) if p in _UNION_TAGS), None)
    loc = ".".join(parts if tag is None else parts[:tag])
    if first["type"] == "extra_forbidden":
        known = ", ".join(sorted(model.model_fields))
        if len(parts) > 1:  # an unknown key inside a nested object (a message, stream_options)
            return ApiError(400, f"unknown field '{loc}'", param=loc, code="unknown_field")
        return ApiError(400, f"unknown field '{loc}'; supported fields: {known}", param=loc, code="unknown_field")
    if first["type"] == "missing" and tag is None:
        return ApiError(400, f"'{loc}' is required", param=loc, code="missing_field")
    if tag is not None:  # one value, several accepted forms: name them all
        forms = []
        for e in errors:
            ps = [str(p) for p in e["loc"]]
            if ps[:tag] == parts[:tag] and len(ps) > tag and ps[tag] in _UNION_TAGS:
                forms.append(_UNION_TAGS[ps[tag]])
        value = _value_at(exc, parts[:tag])
        msg = "expected " + " or ".join(dict.fromkeys(forms))
    else:
        msg = first["msg"]
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        value = first.get("input")
    shown = "" if isinstance(value, (dict, list)) or value is _NOTHING else f" (got {value!r})"
    return ApiError(400, f"invalid '{loc}': {msg}{shown}", param=loc, code="invalid_value")


_NOTHING = object()


def _value_at(exc: ValidationError, path: list[str]) -> object:
    """The offending value at ``path`` when pydantic reported it (only for scalar inputs), else _NOTHING."""
    for e in exc.errors(include_url=False):
        ps = [str(p) for p in e["loc"]]
        if ps[:len(path)] == path and len(ps) == len(path) + 1 and not isinstance(e.get("input"), (dict, list)):
            return e.get("input")
    return _NOTHING


# --------------------------------------------------------------------------------------------------------------------
# the text of an answer


class PieceDecoder:
    """Token ids to text pieces as they arrive: one piece per token ("" while a multi-byte character is incomplete,
    and for special tokens); the pieces (plus :meth:`tail`) concatenate to the decoded text. Decodes a short window
    per token (O(n)), never the whole prefix."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix, self.read = 0, 0  # window start, and the end of what has been emitted
        self.before = ""  # the window's text up to read (changes only when a piece is emitted)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, token_ids: list[int]) -> list[str]:
        pieces = []
        for t in token_ids:
            self.ids.append(int(t))
            now = self._decode(self.ids[self.prefix:])
            if len(now) > len(self.before) and not now.endswith("\ufffd"):
                pieces.append(now[len(self.before):])
                self.prefix, self.read = self.read, len(self.ids)
                self.before = self._decode(self.ids[self.prefix:self.read])
            else:
                pieces.append("")
        return pieces

    def tail(self) -> str:
        """What the tokenizer makes of an incomplete character at the very end ("" if none); it belongs to the last
        token's piece."""
        if self.read >= len(self.ids):
            return ""
        return self._decode(self.ids[self.prefix:])[len(self.before):]


def token_pieces(tokenizer: Any, token_ids: list[int]) -> list[str]:
    """One text piece per generated token (see :class:`PieceDecoder`); they concatenate to the decoded text."""
    dec = PieceDecoder(tokenizer)
    pieces = dec.push(list(token_ids))
    if pieces:
        pieces[-1] += dec.tail()
    return pieces


@dataclass
class Answer:
    """The text of one answer, cut at a stop string when one appears."""

    pieces: list[str]  # per emitted token (after the stop cut)
    finish_reason: Literal["stop", "length"]
    completion_tokens: int

    @property
    def text(self) -> str:
        return "".join(self.pieces)


class AnswerStream:
    """The answer's text while tokens arrive: :meth:`push` takes each token's piece and returns the text that can be
    sent now, holding back the last (longest stop - 1) characters that a stop string could still begin in, and
    reports a stop string as soon as one appears (:attr:`stopped`); :meth:`finish` returns the rest and the final
    :class:`Answer`. Fed all pieces at once it is :func:`make_answer`, so streamed and whole answers agree."""

    def __init__(self, stops: list[str]):
        self.stops = [x for x in stops if x]
        self.longest = max((len(x) for x in self.stops), default=0)
        self.text = ""
        self.pieces: list[str] = []
        self.sent = 0  # characters of text already returned
        self.stopped: tuple[int, int] | None = None  # (piece index that completed a stop string, where it starts)
        self._last_start = 0

    def _scan(self, start: int) -> None:
        hits = [h for h in (self.text.find(x, start) for x in self.stops) if h >= 0]
        if hits:
            self.stopped = (len(self.pieces) - 1, min(hits))

    def push(self, pieces: list[str], *, tail: str = "") -> str:
        """Add pieces (one per token, in order) and ``tail`` (the end of the last piece, known only at the end);
        returns the newly sendable text."""
        for piece in pieces:
            if self.stopped is not None:
                break
            self._last_start = max(0, len(self.text) - self.longest)  # a stop may straddle pieces
            self.text += piece
            self.pieces.append(piece)
            self._scan(self._last_start)
        if tail and self.stopped is None and self.pieces:
            self.text += tail
            self.pieces[-1] += tail
            self._scan(self._last_start)
        limit = self.stopped[1] if self.stopped is not None else len(self.text) - max(self.longest - 1, 0)
        delta = self.text[self.sent:limit] if limit > self.sent else ""
        self.sent = max(self.sent, limit)
        return delta

    def finish(self, token_ids: list[int], eos: set[int], max_tokens: int, *,
               cut: bool = False) -> tuple[str, Answer]:
        """(the text not sent yet, the final Answer): finish_reason "stop" for an EOS token or a stop string (the text
        ends before it), "length" for a full budget or a generation ``cut`` short (the server's deadline);
        completion_tokens counts the tokens up to and including the one that completed the stop string."""
        if self.stopped is not None:
            i, pos = self.stopped
            out, used = [], 0
            for piece in self.pieces[:i + 1]:
                take = piece[:max(0, pos - used)]
                out.append(take)
                used += len(take)
            answer = Answer(out, "stop", i + 1)
        else:
            ended = bool(token_ids) and token_ids[-1] in eos
            full = cut or len(token_ids) >= max_tokens
            reason: Literal["stop", "length"] = "stop" if ended or not full else "length"
            answer = Answer(list(self.pieces), reason, len(token_ids))
        rest = answer.text[self.sent:]
        self.sent = len(answer.text)
        return rest, answer


def make_answer(pieces: list[str], token_ids: list[int], eos: set[int], stops: list[str], max_tokens: int, *,
                cut: bool = False) -> Answer:
    """The whole answer from every token's piece (see :class:`AnswerStream`)."""
    stream = AnswerStream(stops)
    stream.push(pieces)
    return stream.finish(token_ids, eos, max_tokens, cut=cut)[1]


# --------------------------------------------------------------------------------------------------------------------
# response objects


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_object(kind: Literal["chat", "text"], rid: str, model: str, answer: Answer, prompt_tokens: int,
                      extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """A whole (non-streamed) chat.completion or text_completion object."""
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": answer.text}, "logprobs": None,
                  "finish_reason": answer.finish_reason}
    else:
        choice = {"index": 0, "text": answer.text, "logprobs": None, "finish_reason": answer.finish_reason}
    obj = {"id": rid, "object": "chat.completion" if kind == "chat" else "text_completion",
           "created": int(time.time()), "model": model, "choices": [choice],
           "usage": usage(prompt_tokens, answer.completion_tokens)}
    if extra:
        obj.update(extra)
    return obj


class ChunkMaker:
    """The chunk objects of a streamed answer, in OpenAI's order: (chat: a role chunk), content chunks, a last chunk
    carrying finish_reason, (include_usage: a chunk with empty choices and the usage)."""

    def __init__(self, kind: Literal["chat", "text"], rid: str, model: str, include_usage: bool = False):
        self.kind, self.rid, self.model, self.include_usage = kind, rid, model, include_usage
        self.created = int(time.time())
        self.obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

    def delta(self, delta: dict[str, Any] | str, finish: str | None = None) -> dict[str, Any]:
        key = "delta" if self.kind == "chat" else "text"
        choice = {"index": 0, key: delta, "logprobs": None, "finish_reason": finish}
        c = {"id": self.rid, "object": self.obj, "created": self.created, "model": self.model, "choices": [choice]}
        if self.include_usage:
            c["usage"] = None
        return c

    def usage(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        return {"id": self.rid, "object": self.obj, "created": self.created, "model": self.model, "choices": [],
                "usage": usage(prompt_tokens, completion_tokens)}


def sse(obj: dict[str, Any]) -> str:
    """One server-sent event carrying a JSON object."""
    return f"data: {json.dumps(obj, separators=(',', ':'), allow_nan=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def finite(x: float) -> float | None:
    """JSON has no inf/nan: report those as null."""
    return x if isinstance(x, (int, float)) and math.isfinite(x) else None
