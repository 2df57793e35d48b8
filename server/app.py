"""The OpenAI-compatible ASGI app: Starlette routing, msgspec schemas, one AsyncEngine.

``create_app(engine, config)`` returns a Starlette app serving:

* ``POST /v1/chat/completions`` and ``POST /v1/completions`` (streaming as SSE, ``n``,
  logprobs, tools), ``GET /v1/models``, ``GET /health``, ``POST /tokenize``,
  ``POST /detokenize``, ``GET /metrics`` (Prometheus, a registry per app).

Errors always have OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: 400 for
a bad request (a malformed body, a wrong type, an out-of-range value: the engine's
``InvalidRequestError`` / ``PromptTooLongError``, naming the request field in ``param``),
404 for an unknown model or route, 429 when the engine's waiting queue is full, 503 when the
engine is dead. Anything unexpected is a 500 whose message names the exception, never a
traceback. A client that disconnects (streaming or not) aborts its engine request: its blocks
and slots are freed at the next step boundary.

Why Starlette and not FastAPI: the schemas are msgspec structs (the engine's own types are
msgspec, and msgspec decodes/validates and encodes several times faster than pydantic);
FastAPI would add pydantic models duplicating them, and its dependency injection, for
nothing this API needs. Starlette gives routing, request/response objects and lifespan with
a thin layer over ASGI.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from deltaserve.engine.errors import (
    EngineDeadError,
    EngineOverloadedError,
    InvalidRequestError,
    PromptTooLongError,
)
from deltaserve.engine.outputs import RequestOutput, TokenLogprob
from deltaserve.engine.sampling_params import SamplingParams
from deltaserve.logs import get_logger
from deltaserve.server import protocol as p
from deltaserve.server.config import ServerConfig
from deltaserve.server.metrics import CONTENT_TYPE, ServerMetrics
from deltaserve.server.tool_parser import ParsedToolCall, StreamingToolParser, parse_tool_calls

log = get_logger("deltaserve.server")

_encode = msgspec.json.Encoder().encode
_JSON = "application/json"


# ============================================================================ errors
class APIError(Exception):
    def __init__(
        self, status: int, message: str, type_: str, param: str | None = None, code: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def _error_body(e: APIError) -> bytes:
    return _encode(
        p.ErrorResponse(error=p.ErrorInfo(message=e.message, type=e.type, param=e.param, code=e.code))
    )


_SP_FIELD = re.compile(r"^SamplingParams\.(\w+)=")
_MISSING = re.compile(r"missing required field `([^`]+)`")
_JSON_PATH = re.compile(r"at `\$\.?([^`]*)`")


def _param_of(message: str, renames: dict[str, str]) -> str | None:
    """The request field an engine error message is about."""
    m = _SP_FIELD.match(message)
    if m:
        return renames.get(m.group(1), m.group(1))
    low = message.lower()
    for prefix, param in (
        ("stop token id", "stop_token_ids"),
        ("cache_salt", "cache_salt"),
        ("request_id", "request_id"),
        ("priority", "priority"),
    ):
        if low.startswith(prefix):
            return param
    return renames.get("prompt", "prompt")


def translate_error(exc: BaseException, renames: dict[str, str] | None = None) -> APIError:
    """Map an exception raised while handling a request to the API error the client sees."""
    renames = renames or {}
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, PromptTooLongError):
        return APIError(
            400, str(exc), "invalid_request_error", renames.get("prompt", "prompt"), "prompt_too_long"
        )
    if isinstance(exc, InvalidRequestError):
        msg = str(exc)
        return bad_request(msg, _param_of(msg, renames))
    if isinstance(exc, msgspec.ValidationError):
        msg = str(exc)
        m = _JSON_PATH.search(msg)
        param = re.sub(r"\[\d+\]", "", m.group(1)).split(".")[0] if m and m.group(1) else None
        missing = _MISSING.search(msg)
        if missing and param is None:
            param = missing.group(1)
        inner = exc.__cause__ or exc.__context__
        if isinstance(inner, InvalidRequestError):  # a struct __post_init__ (SamplingParams)
            return translate_error(inner, renames)
        return bad_request(msg, param)
    if isinstance(exc, msgspec.DecodeError):
        return bad_request(f"request body is not valid JSON: {exc}", None, "invalid_json")
    if isinstance(exc, EngineOverloadedError):
        return APIError(429, str(exc), "rate_limit_error", None, "engine_overloaded")
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), "service_unavailable_error", None, "engine_dead")
    return APIError(
        500, f"internal error: {type(exc).__name__}: {exc}", "internal_error", None, "internal_error"
    )


# ============================================================================ SSE with disconnect watch
async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class SSEResponse(Response):
    """Server-sent events from an async iterator of ready-made ``data: ...`` frames.

    The body is pumped while a watcher reads ``receive()``: a client disconnect cancels the pump
    at once (even while the request still waits in the engine's queue), and closing the frame
    iterator closes the engine stream, which aborts the request."""

    media_type = "text/event-stream"

    def __init__(self, frames: AsyncIterator[bytes], on_close: Callable[[], None] | None = None) -> None:
        self.status_code = 200
        self.background = None
        self.raw_headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
        ]
        self.frames = frames
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def pump() -> None:
            await send(
                {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
            )
            async with contextlib.aclosing(self.frames) as frames:  # type: ignore[type-var]
                async for frame in frames:
                    await send({"type": "http.response.body", "body": frame, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        pump_task = asyncio.ensure_future(pump())
        watch = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await asyncio.wait({pump_task, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not pump_task.done():
                pump_task.cancel()  # the client is gone (or we are cancelled): close the stream
            try:
                await pump_task
            except (asyncio.CancelledError, OSError):  # cancelled, or the client went away mid-write
                pass
            except Exception:
                log.exception("server.sse_failed")
            if self.on_close is not None:
                self.on_close()


async def run_or_disconnect(request: Request, work: Awaitable[Any]) -> tuple[bool, Any]:
    """Run ``work`` unless the client disconnects first (then cancel it: that aborts its
    engine requests). ``(True, result)`` or ``(False, None)``."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        watch.cancel()
        raise
    watch.cancel()
    if task.done():
        return True, task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return False, None


# ============================================================================ per-request bookkeeping
@dataclass
class _Choice:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None


class _Tracker:
    """Latency metrics of one HTTP request (its n completions)."""

    def __init__(self, metrics: ServerMetrics, n: int) -> None:
        self.metrics = metrics
        self.t0 = time.perf_counter()
        self.first: float | None = None
        self.choices = [_Choice(i) for i in range(n)]
        self.num_prompt_tokens = 0
        self.num_cached_tokens = 0

    def observe(self, out: RequestOutput) -> _Choice:
        c = self.choices[out.index]
        now = time.perf_counter()
        if out.token_ids:
            if self.first is None:
                self.first = now
                self.metrics.ttft.observe(now - self.t0)
            if c.last_token_at is not None:
                self.metrics.itl.observe(now - c.last_token_at)
            c.first_token_at = c.first_token_at or now
            c.last_token_at = now
            c.token_ids.extend(out.token_ids)
        if out.index == 0 or not self.num_prompt_tokens:
            self.num_prompt_tokens = out.num_prompt_tokens or self.num_prompt_tokens
            self.num_cached_tokens = out.num_cached_tokens
        if out.logprobs:
            c.logprobs.extend(out.logprobs)
        c.text += out.text
        if out.finished:
            c.finish_reason = out.finish_reason
            c.error = out.error
            self.metrics.e2e.observe(now - self.t0)
            self.metrics.generation_tokens.observe(len(c.token_ids))
            if out.index == 0:
                self.metrics.prompt_tokens.observe(out.num_prompt_tokens)
        return c

    def count_finish(self, reason: str | None) -> None:
        self.metrics.request_success.labels(reason or "abort").inc()

    def usage(self) -> p.Usage:
        completion = sum(len(c.token_ids) for c in self.choices)
        return p.Usage(
            prompt_tokens=self.num_prompt_tokens,
            completion_tokens=completion,
            total_tokens=self.num_prompt_tokens + completion,
            prompt_tokens_details=p.PromptTokensDetails(cached_tokens=self.num_cached_tokens),
        )


# ============================================================================ the serving object
class OpenAIServer:
    """The handlers of one app over one engine (tests reach it as ``app.state.server``)."""

    def __init__(self, engine: Any, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.metrics = ServerMetrics(self._stats)
        self.created = int(time.time())
        self._token_text: dict[int, str] = {}

    # ------------------------------------------------------------------ helpers
    def _stats(self) -> dict[str, Any]:
        try:
            return dict(self.engine.stats())
        except Exception:  # a scrape must not fail because the engine is gone
            return {}

    @property
    def core(self) -> Any:
        return self.engine.core

    @property
    def model_names(self) -> list[str]:
        if self.config.served_model_names:
            return list(self.config.served_model_names)
        return [str(self.engine.config.model.path)]

    def _check_model(self, model: str | None) -> str:
        names = self.model_names
        if model is None or model == "":
            return names[0]
        if model not in names:
            raise APIError(
                404, f"the model {model!r} does not exist; this server serves {names}", "not_found_error",
                "model", "model_not_found",
            )  # fmt: skip
        return model

    def _healthy(self) -> bool:
        check = getattr(self.engine, "is_healthy", None)
        if check is not None:
            return bool(check())
        return self.engine.core is not None and getattr(self.engine, "_dead", None) is None

    def _require_healthy(self) -> None:
        if not self._healthy():
            raise EngineDeadError("the engine is not running")

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self.core.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_text[token_id] = text
        return text

    async def _decode(self, request: Request, type_: type) -> Any:
        body = await request.body()
        return msgspec.json.decode(body or b"{}", type=type_)

    def _sampling_params(
        self, req: p._SamplingFields, *, max_tokens: int, logprobs: int | None
    ) -> SamplingParams:
        if req.logit_bias:
            raise bad_request("logit_bias is not supported", "logit_bias", "unsupported")
        if req.response_format and req.response_format.get("type", "text") != "text":
            raise bad_request(
                "response_format other than text is not supported (no constrained decoding)",
                "response_format",
                "unsupported",
            )
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        kwargs: dict[str, Any] = {
            "max_tokens": max_tokens,
            "n": req.n,
            "stop": stop,
            "stop_token_ids": list(req.stop_token_ids or []),
            "ignore_eos": req.ignore_eos,
            "min_tokens": req.min_tokens,
            "seed": req.seed,
            "logprobs": logprobs,
        }
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):  # fmt: skip
            value = getattr(req, name)
            if value is not None:
                kwargs[name] = value
        return SamplingParams(**kwargs)

    # ------------------------------------------------------------------ endpoints
    async def health(self, request: Request) -> Response:
        self._require_healthy()
        return Response(b"{}", media_type=_JSON)

    async def models(self, request: Request) -> Response:
        root = str(self.engine.config.model.path)
        max_len = getattr(self.core, "max_model_len", None)
        cards = [
            p.ModelCard(id=n, created=self.created, root=root, max_model_len=max_len)
            for n in self.model_names
        ]
        return Response(_encode(p.ModelList(data=cards)), media_type=_JSON)

    async def metrics_endpoint(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    async def tokenize(self, request: Request) -> Response:
        self._require_healthy()
        req = await self._decode(request, p.TokenizeRequest)
        self._check_model(req.model)
        if req.messages is not None:
            prompt: Any = _messages_to_dicts(req.messages)
            tokens = self.core.tokenize(prompt, **_template_extras(req.tools, req.chat_template_kwargs))
        elif req.prompt is not None:
            tokens = self.core.tokenize(req.prompt)
        else:
            raise bad_request("give either 'prompt' or 'messages'", "prompt")
        body = {"tokens": tokens, "count": len(tokens), "max_model_len": self.core.max_model_len}
        return Response(_encode(body), media_type=_JSON)

    async def detokenize(self, request: Request) -> Response:
        self._require_healthy()
        req = await self._decode(request, p.DetokenizeRequest)
        self._check_model(req.model)
        vocab = self.core.vocab_size
        for i, t in enumerate(req.tokens):
            if not 0 <= t < vocab:
                raise bad_request(f"token {i} = {t} is outside the vocabulary [0, {vocab})", "tokens")
        text = self.core.tokenizer.decode(req.tokens, skip_special_tokens=False)
        return Response(_encode({"prompt": text}), media_type=_JSON)

    # ------------------------------------------------------------------ chat
    async def chat(self, request: Request) -> Response:
        renames = {"logprobs": "top_logprobs", "prompt": "messages"}
        try:
            req: p.ChatCompletionRequest = await self._decode(request, p.ChatCompletionRequest)
            renames["max_tokens"] = (
                "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
            )
            model = self._check_model(req.model)
            self._require_healthy()
            max_tokens = (
                req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
            )
            if max_tokens is None:
                max_tokens = self.core.max_model_len  # until the context is full (the engine stops there)
            top = None
            if req.logprobs:
                top = req.top_logprobs or 0
            elif req.top_logprobs is not None and req.top_logprobs > 0:
                raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
            params = self._sampling_params(req, max_tokens=max_tokens, logprobs=top)
            parse_tools = bool(req.tools) and req.tool_choice != "none"
            messages = _messages_to_dicts(req.messages)
            extra = _template_extras(req.tools, req.chat_template_kwargs)
            stream = self.engine.generate(
                messages,
                params,
                request_id=req.request_id,
                priority=req.priority,
                cache_salt=req.cache_salt,
                **extra,
            )
        except Exception as e:
            raise translate_error(e, renames) from e
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        tracker = _Tracker(self.metrics, req.n)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            frames = self._chat_stream(
                stream, tracker, rid, model, req.logprobs, parse_tools, include_usage, req.return_token_ids
            )
            return SSEResponse(frames)
        ok, result = await run_or_disconnect(
            request, self._chat_full(stream, tracker, rid, model, parse_tools, req.return_token_ids)
        )
        if not ok:
            return Response(status_code=499)
        return Response(_encode(result), media_type=_JSON)

    async def _collect(self, stream: Any, tracker: _Tracker) -> None:
        async for out in stream:
            tracker.observe(out)
            if out.finished:
                tracker.count_finish(out.finish_reason)

    async def _chat_full(
        self, stream: Any, tracker: _Tracker, rid: str, model: str, parse_tools: bool, return_ids: bool
    ) -> p.ChatCompletionResponse:
        await self._collect(stream, tracker)
        choices = []
        for c in tracker.choices:
            _raise_if_failed(c)
            content: str | None = c.text
            tool_calls = None
            reason = c.finish_reason
            if parse_tools:
                content, calls = parse_tool_calls(c.text)
                if calls:
                    tool_calls = [_tool_call(call) for call in calls]
                    reason = "tool_calls"
            choices.append(
                p.ChatChoice(
                    index=c.index,
                    message=p.ResponseMessage(content=content, tool_calls=tool_calls),
                    finish_reason=reason,
                    logprobs=self._chat_logprobs(c.logprobs) if c.logprobs else None,
                    token_ids=list(c.token_ids) if return_ids else msgspec.UNSET,
                )
            )
        return p.ChatCompletionResponse(
            id=rid, created=int(time.time()), model=model, choices=choices, usage=tracker.usage()
        )

    def _chat_logprobs(self, entries: list[TokenLogprob]) -> p.ChatLogprobs:
        content = []
        for e in entries:
            text = self.token_text(e.token_id)
            top = [p.TopLogprob(token=(t := self.token_text(tid)), logprob=lp, bytes=list(t.encode()))
                   for tid, lp in e.top]  # fmt: skip
            content.append(
                p.ChatTokenLogprob(token=text, logprob=e.logprob, bytes=list(text.encode()), top_logprobs=top)
            )
        return p.ChatLogprobs(content=content)

    async def _chat_stream(
        self,
        stream: Any,
        tracker: _Tracker,
        rid: str,
        model: str,
        want_logprobs: bool,
        parse_tools: bool,
        include_usage: bool,
        return_ids: bool = False,
    ) -> AsyncIterator[bytes]:
        created = int(time.time())
        parsers = [StreamingToolParser() if parse_tools else None for _ in tracker.choices]
        started = [False] * len(tracker.choices)

        def frame(choice: p.ChatChunkChoice) -> bytes:
            chunk = p.ChatCompletionChunk(id=rid, created=created, model=model, choices=[choice])
            return b"data: " + _encode(chunk) + b"\n\n"

        try:
            async for out in stream:
                c = tracker.observe(out)
                i = out.index
                if not started[i]:
                    started[i] = True
                    yield frame(
                        p.ChatChunkChoice(index=i, delta=p.DeltaMessage(role="assistant", content=""))
                    )
                text = out.text
                parser = parsers[i]
                if parser is not None:
                    text = parser.feed(text)
                lp = self._chat_logprobs(out.logprobs) if (want_logprobs and out.logprobs) else None
                if text or lp is not None or (return_ids and out.token_ids):
                    ids = list(out.token_ids) if return_ids else msgspec.UNSET
                    delta = p.DeltaMessage(content=text)
                    yield frame(p.ChatChunkChoice(index=i, delta=delta, logprobs=lp, token_ids=ids))
                if out.finished:
                    reason = out.finish_reason
                    if out.finish_reason == "error":
                        yield _error_frame(_failure(c))
                    if parser is not None:
                        rest, calls = parser.finish()
                        if rest:
                            yield frame(p.ChatChunkChoice(index=i, delta=p.DeltaMessage(content=rest)))
                        if calls:
                            reason = "tool_calls"
                            deltas = [
                                p.DeltaToolCall(
                                    index=k, id=call.id, type="function",
                                    function=p.DeltaFunctionCall(name=call.name, arguments=call.arguments),
                                )
                                for k, call in enumerate(calls)
                            ]  # fmt: skip
                            yield frame(p.ChatChunkChoice(index=i, delta=p.DeltaMessage(tool_calls=deltas)))
                    tracker.count_finish(reason)
                    yield frame(p.ChatChunkChoice(index=i, delta=p.DeltaMessage(), finish_reason=reason))
            if include_usage:
                chunk = p.ChatCompletionChunk(
                    id=rid, created=created, model=model, choices=[], usage=tracker.usage()
                )
                yield b"data: " + _encode(chunk) + b"\n\n"
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as e:  # after the 200: report in-band, then end the stream
            log.exception("server.stream_failed", request_id=rid)
            yield _error_frame(translate_error(e))
        finally:
            with contextlib.suppress(Exception):
                await stream.aclose()  # a stream left early aborts its request
            for c in tracker.choices:
                if c.finish_reason is None:
                    tracker.count_finish("abort")
                    c.finish_reason = "abort"
        yield b"data: [DONE]\n\n"

    # ------------------------------------------------------------------ completions
    async def completions(self, request: Request) -> Response:
        renames = {"prompt": "prompt"}
        streams: list[Any] = []
        try:
            req: p.CompletionRequest = await self._decode(request, p.CompletionRequest)
            model = self._check_model(req.model)
            self._require_healthy()
            if req.echo:
                raise bad_request("echo is not supported", "echo", "unsupported")
            if req.suffix:
                raise bad_request("suffix is not supported", "suffix", "unsupported")
            prompts = _completion_prompts(req.prompt)
            max_tokens = req.max_tokens if req.max_tokens is not None else self.core.max_model_len
            params = self._sampling_params(req, max_tokens=max_tokens, logprobs=req.logprobs)
            if len(prompts) > 1 and req.request_id is not None:
                raise bad_request("request_id is for a single prompt", "request_id")
            for pr in prompts:
                streams.append(
                    self.engine.generate(
                        pr,
                        params,
                        request_id=req.request_id,
                        priority=req.priority,
                        cache_salt=req.cache_salt,
                    )
                )
        except Exception as e:
            for s in streams:  # the prompts accepted before one was rejected
                with contextlib.suppress(Exception):
                    await s.aclose()
            raise translate_error(e, renames) from e
        rid = f"cmpl-{uuid.uuid4().hex}"
        trackers = [_Tracker(self.metrics, req.n) for _ in streams]
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return SSEResponse(
                self._completion_stream(
                    streams, trackers, rid, model, req.n, include_usage, req.return_token_ids
                )
            )

        async def full() -> p.CompletionResponse:
            await asyncio.gather(*(self._collect(s, t) for s, t in zip(streams, trackers, strict=True)))
            choices = []
            for k, t in enumerate(trackers):
                for c in t.choices:
                    _raise_if_failed(c)
                    choices.append(
                        p.CompletionChoice(
                            index=k * req.n + c.index,
                            text=c.text,
                            finish_reason=c.finish_reason,
                            logprobs=self._completion_logprobs(c.logprobs) if c.logprobs else None,
                            token_ids=list(c.token_ids) if req.return_token_ids else msgspec.UNSET,
                        )
                    )
            return p.CompletionResponse(
                id=rid, created=int(time.time()), model=model, choices=choices, usage=_sum_usage(trackers)
            )

        ok, result = await run_or_disconnect(request, full())
        if not ok:
            return Response(status_code=499)
        return Response(_encode(result), media_type=_JSON)

    def _completion_logprobs(self, entries: list[TokenLogprob], offset: int = 0) -> p.CompletionLogprobs:
        tokens, lps, tops, offsets = [], [], [], []
        for e in entries:
            text = self.token_text(e.token_id)
            tokens.append(text)
            lps.append(e.logprob)
            tops.append({self.token_text(tid): lp for tid, lp in e.top})
            offsets.append(offset)
            offset += len(text)
        return p.CompletionLogprobs(tokens=tokens, token_logprobs=lps, top_logprobs=tops, text_offset=offsets)

    async def _completion_stream(
        self,
        streams: list[Any],
        trackers: list[_Tracker],
        rid: str,
        model: str,
        n: int,
        include_usage: bool,
        return_ids: bool = False,
    ) -> AsyncIterator[bytes]:
        created = int(time.time())
        queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

        async def pump(k: int, stream: Any) -> None:
            try:
                async for out in stream:
                    queue.put_nowait((k, out))
            except Exception as e:
                queue.put_nowait((k, e))
            finally:
                queue.put_nowait((k, None))

        tasks = [asyncio.ensure_future(pump(k, s)) for k, s in enumerate(streams)] if len(streams) > 1 else []
        offsets = [[0] * n for _ in streams]
        try:
            if len(streams) == 1:
                source: AsyncIterator[tuple[int, Any]] = _tagged(streams[0])
            else:
                source = _drain(queue, len(streams))
            async for k, item in source:
                if isinstance(item, BaseException):
                    yield _error_frame(translate_error(item))
                    continue
                out: RequestOutput = item
                c = trackers[k].observe(out)
                lp = None
                if out.logprobs:
                    lp = self._completion_logprobs(out.logprobs, offsets[k][out.index])
                offsets[k][out.index] += len(out.text)
                if out.finished:
                    trackers[k].count_finish(out.finish_reason)
                    if out.finish_reason == "error":
                        yield _error_frame(_failure(c))
                if out.text or lp is not None or out.finished or (return_ids and out.token_ids):
                    choice = p.CompletionChoice(
                        index=k * n + out.index,
                        text=out.text,
                        finish_reason=out.finish_reason if out.finished else None,
                        logprobs=lp,
                        token_ids=list(out.token_ids) if return_ids else msgspec.UNSET,
                    )
                    chunk = p.CompletionResponse(id=rid, created=created, model=model, choices=[choice])
                    yield b"data: " + _encode(chunk) + b"\n\n"
            if include_usage:
                chunk = p.CompletionResponse(
                    id=rid, created=created, model=model, choices=[], usage=_sum_usage(trackers)
                )
                yield b"data: " + _encode(chunk) + b"\n\n"
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as e:
            log.exception("server.stream_failed", request_id=rid)
            yield _error_frame(translate_error(e))
        finally:
            for t in tasks:
                t.cancel()
            for s in streams:
                with contextlib.suppress(Exception):
                    await s.aclose()
            for t in trackers:
                for c in t.choices:
                    if c.finish_reason is None:
                        t.count_finish("abort")
                        c.finish_reason = "abort"
        yield b"data: [DONE]\n\n"


# ============================================================================ small helpers
async def _tagged(stream: Any) -> AsyncIterator[tuple[int, Any]]:
    async for out in stream:
        yield 0, out


async def _drain(queue: asyncio.Queue, count: int) -> AsyncIterator[tuple[int, Any]]:
    done = 0
    while done < count:
        k, item = await queue.get()
        if item is None:
            done += 1
            continue
        yield k, item


def _failure(c: _Choice) -> APIError:
    msg = c.error or "the request failed in the engine"
    if "shut down" in msg:
        return APIError(503, msg, "service_unavailable_error", None, "engine_shutdown")
    if "engine loop died" in msg:
        return APIError(503, msg, "service_unavailable_error", None, "engine_dead")
    return APIError(500, msg, "internal_error", None, "engine_error")


def _raise_if_failed(c: _Choice) -> None:
    if c.finish_reason == "error":
        raise _failure(c)


def _error_frame(e: APIError) -> bytes:
    return b"data: " + _error_body(e) + b"\n\n"


def _sum_usage(trackers: list[_Tracker]) -> p.Usage:
    prompt = sum(t.num_prompt_tokens for t in trackers)
    completion = sum(len(c.token_ids) for t in trackers for c in t.choices)
    cached = sum(t.num_cached_tokens for t in trackers)
    return p.Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=p.PromptTokensDetails(cached_tokens=cached),
    )


def _tool_call(call: ParsedToolCall) -> p.ToolCall:
    return p.ToolCall(id=call.id, function=p.FunctionCall(name=call.name, arguments=call.arguments))


def _content_text(content: str | list[p.ContentPart] | None, i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise bad_request(
                f"messages[{i}].content[{j}] has type {part.type!r}: only text parts are supported",
                "messages",
            )
        parts.append(part.text)
    return "\n".join(parts)


def _messages_to_dicts(messages: list[p.ChatMessage]) -> list[dict[str, Any]]:
    """Chat messages as the template expects them: string content (text parts joined), assistant
    ``tool_calls`` with their ``function`` (arguments kept as the JSON string), tool results with
    their ``tool_call_id``."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        d: dict[str, Any] = {"role": m.role, "content": _content_text(m.content, i)}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_calls:
            d["tool_calls"] = [
                {
                    "id": tc.id,
                    "type": tc.type,
                    "function": {"name": tc.function.name, "arguments": tc.function.arguments},
                }
                for tc in m.tool_calls
            ]
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.reasoning_content is not None:
            d["reasoning_content"] = m.reasoning_content
        out.append(d)
    return out


def _tools_to_dicts(tools: list[p.Tool] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    return [msgspec.to_builtins(t) for t in tools]


def _template_extras(tools: list[p.Tool] | None, kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """The chat-template arguments to pass to the engine: only those the request set."""
    extra: dict[str, Any] = {}
    if tools:
        extra["tools"] = _tools_to_dicts(tools)
    if kwargs:
        extra["chat_template_kwargs"] = kwargs
    return extra


def _completion_prompts(prompt: Any) -> list[str | list[int]]:
    """A text, a list of token ids, or a batch (a list of texts / of token-id lists)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt is empty", "prompt")
    if all(isinstance(x, int) and not isinstance(x, bool) for x in prompt):
        return [list(prompt)]
    out: list[str | list[int]] = []
    for x in prompt:
        if isinstance(x, str) or (
            isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)
        ):
            out.append(x)
        else:
            raise bad_request(
                "prompt must be a string, a list of token ids, or a list of either", "prompt", "invalid_type"
            )
    return out


# ============================================================================ the app
def _endpoint(handler: Callable[[Request], Awaitable[Response]], server: OpenAIServer) -> Callable:
    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except Exception as e:
            err = translate_error(e)
            if err.status >= 500:
                log.error(
                    "server.request_failed", path=request.url.path, status=err.status, error=err.message
                )
            server.metrics.http_errors.labels(str(err.status)).inc()
            return Response(_error_body(err), status_code=err.status, media_type=_JSON)

    return wrapped


def create_app(engine: Any, config: ServerConfig | None = None) -> Starlette:
    """The ASGI app over ``engine`` (an ``AsyncEngine``). If the engine is not started yet, the
    app's lifespan starts it and shuts it down; a started engine stays the caller's."""
    config = config or ServerConfig()
    server = OpenAIServer(engine, config)
    owns_engine = getattr(engine, "_task", None) is None

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if owns_engine:
            await engine.start()
        try:
            yield
        finally:
            if owns_engine:
                await engine.shutdown()

    def route(path: str, handler: Callable, methods: list[str]) -> Route:
        return Route(path, _endpoint(handler, server), methods=methods)

    routes = [
        route("/v1/chat/completions", server.chat, ["POST"]),
        route("/v1/completions", server.completions, ["POST"]),
        route("/v1/models", server.models, ["GET"]),
        route("/health", server.health, ["GET"]),
        route("/tokenize", server.tokenize, ["POST"]),
        route("/detokenize", server.detokenize, ["POST"]),
        route("/metrics", server.metrics_endpoint, ["GET"]),
    ]

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        status = exc.status_code
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(status, "invalid_request_error")
        message = f"{request.method} {request.url.path}: {exc.detail}"
        server.metrics.http_errors.labels(str(status)).inc()
        body = _error_body(APIError(status, message, kind, None, None))
        return Response(body, status_code=status, media_type=_JSON, headers=getattr(exc, "headers", None))

    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error})
    app.state.server = server
    return app
