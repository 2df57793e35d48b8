"""The endpoints of one app over one ``EngineClient`` (tests reach them as ``app.state.server``).

Each handler decodes its body into a msgspec struct (``protocol.py``), checks the model name
and the engine's health, turns the fields into the engine's inputs (``inputs.py``), and
answers with a whole response or an SSE stream (``chat.py``, ``completions.py``, ``sse.py``).
A client that disconnects (streaming or not) aborts its engine requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from deltaserve.engine.errors import EngineDeadError
from deltaserve.engine.front.client import EngineClient, OutputStream
from deltaserve.server import protocol as p
from deltaserve.server.chat import ChatChunks, chat_response
from deltaserve.server.completions import (
    CompletionChunks,
    EchoSpec,
    PromptStream,
    completion_response,
    vllm_prompt_logprobs,
)
from deltaserve.server.config import ServerConfig, body_limit
from deltaserve.server.errors import APIError, bad_request, encode, translate_error
from deltaserve.server.inputs import completion_prompts, messages_to_dicts, sampling_params, template_extras
from deltaserve.server.metrics import CONTENT_TYPE, ServerMetrics
from deltaserve.server.offload import Tokenizer
from deltaserve.server.output_parser import ChatParsing, OutputParser
from deltaserve.server.reasoning import THINK_END
from deltaserve.server.sse import ChunkFormat, SSEResponse, UsageMode, run_or_disconnect, stream_frames
from deltaserve.server.structured import (
    ForcedTools,
    chat_constraint,
    compile_constraint,
    request_constraint,
)
from deltaserve.server.tracker import Tracker

JSON = "application/json"
#: what a request still open when the drain runs out of time gets
SHUTDOWN_ERROR = APIError(
    503,
    "the server shut down before the request finished",
    "service_unavailable_error",
    None,
    "engine_shutdown",
)


def _json(body: Any) -> Response:
    return Response(encode(body), media_type=JSON)


class OpenAIServer:
    """The handlers of one app over one engine."""

    def __init__(self, engine: EngineClient, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.metrics = ServerMetrics(self._stats, self.model_names[0])
        self.created = int(time.time())
        self._token_text: dict[int, str] = {}
        self._open: set[OutputStream] = set()  # engine streams of the requests being answered
        self.expired = False  # the drain ran out of time (``expire``)
        self.tokenizer = Tokenizer(engine)  # long prompts are tokenized off the event loop
        self.parsing = ChatParsing(
            config.tool_call_parser, config.reasoning_parser, lambda: engine.input_processor.tokenizer
        )

    # ------------------------------------------------------------------ helpers
    def _stats(self) -> dict[str, Any]:
        try:
            return dict(self.engine.stats())
        except Exception:  # a scrape must not fail because the engine is gone
            return {}

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
            raise _model_not_found(model, names)
        return model

    def _require_healthy(self) -> None:
        if not self.engine.is_healthy():
            raise EngineDeadError("the engine is not running")

    def expire(self) -> None:
        """The drain ran out of time: abort every open request; each answers at once with 503
        ``engine_shutdown`` (a stream: an error frame, then ``[DONE]``) instead of being cut off."""
        self.expired = True
        for stream in list(self._open):
            asyncio.ensure_future(self.engine.abort(stream.request_id))

    def _opened(self, streams: list[OutputStream]) -> Callable[[], None]:
        """Track ``streams`` as open; the returned callback forgets them."""
        self._open.update(streams)
        return lambda: self._open.difference_update(streams)

    def _drain_error(self, trackers: list[Tracker]) -> APIError | None:
        """The error of a request whose completions the expired drain aborted, else None."""
        if self.expired and any(c.finish_reason == "abort" for t in trackers for c in t.choices):
            return SHUTDOWN_ERROR
        return None

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self.engine.input_processor.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_text[token_id] = text
        return text

    async def _read_body(self, request: Request) -> bytes:
        """The body: 413 past the body limit (before reading it when the client says its
        length); a hang-up while it is sent raises ``ClientDisconnect`` (the app counts it)."""
        limit = body_limit(self.config, self.engine.model_info.max_model_len)
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise _too_large(int(declared), limit)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(size, limit)
            chunks.append(chunk)
        return b"".join(chunks)

    @staticmethod
    def _parse(body: bytes, type_: type) -> Any:
        """The body as ``type_``: 400 for JSON that is malformed, not UTF-8 or nested too deep."""
        try:
            return msgspec.json.decode(body or b"{}", type=type_)
        except UnicodeDecodeError as e:
            raise bad_request(f"request body is not valid UTF-8: {e}", None, "invalid_json") from None
        except RecursionError:
            raise bad_request("request body nests JSON too deeply", None, "invalid_json") from None

    async def _decode(self, request: Request, type_: type) -> Any:
        return self._parse(await self._read_body(request), type_)

    async def _answer(self, request: Request, work: Any, streams: list[OutputStream]) -> Response:
        """The whole response of ``work`` over ``streams``, or 499 when the client left first
        (its requests abort)."""
        forget = self._opened(streams)
        try:
            ok, result = await run_or_disconnect(request, work)
        finally:
            forget()
        if not ok:
            self.metrics.client_disconnects.inc()
            return Response(status_code=499)
        return _json(result)

    def _stream(
        self,
        rid: str,
        streams: list[OutputStream],
        trackers: list[Tracker],
        fmt: ChunkFormat,
        usage_mode: UsageMode,
    ) -> SSEResponse:
        forget = self._opened(streams)
        frames = stream_frames(
            rid, streams, trackers, fmt, usage_mode, cut_short=lambda: self._drain_error(trackers)
        )
        return SSEResponse(frames, on_close=forget)

    def _check_drain(self, trackers: list[Tracker]) -> None:
        error = self._drain_error(trackers)
        if error is not None:
            raise error

    @staticmethod
    async def _collect(stream: OutputStream, tracker: Tracker) -> None:
        async for out in stream:
            tracker.observe(out)
            if out.finished:
                tracker.count_finish(out.finish_reason)

    # ------------------------------------------------------------------ small endpoints
    async def health(self, request: Request) -> Response:
        self._require_healthy()
        return Response(b"{}", media_type=JSON)

    async def models(self, request: Request) -> Response:
        info = self.engine.model_info
        cards = [
            p.ModelCard(id=n, created=self.created, root=info.name, max_model_len=info.max_model_len)
            for n in self.model_names
        ]
        return _json(p.ModelList(data=cards))

    async def retrieve_model(self, request: Request) -> Response:
        """``GET /v1/models/{id}`` (``client.models.retrieve``): one served name's card, or 404."""
        name = request.path_params["model_id"]
        if name not in self.model_names:  # (an empty id too: it names no model)
            raise _model_not_found(name, self.model_names)
        info = self.engine.model_info
        card = p.ModelCard(id=name, created=self.created, root=info.name, max_model_len=info.max_model_len)
        return _json(card)

    async def metrics_endpoint(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    async def tokenize(self, request: Request) -> Response:
        self._require_healthy()
        req = await self._decode(request, p.TokenizeRequest)
        self._check_model(req.model)
        processor = self.engine.input_processor
        if req.messages is not None:
            # a long conversation or a request's own template: rendered in the tokenizing thread,
            # which gives back token ids and no template arguments (as for a chat completion)
            prompt, extras = await self.tokenizer.ids_if_long(
                messages_to_dicts(req.messages),
                template_extras(req.tools, req.chat_template_kwargs, req.chat_template),
            )
            offloaded = bool(prompt) and all(isinstance(t, int) for t in prompt)  # messages are dicts
            tokens = list(prompt) if offloaded else processor.tokenize(prompt, **extras)
        elif req.prompt is not None:
            tokens = processor.tokenize(req.prompt)
        else:
            raise bad_request("give either 'prompt' or 'messages'", "prompt")
        return _json({"tokens": tokens, "count": len(tokens), "max_model_len": processor.max_model_len})

    async def detokenize(self, request: Request) -> Response:
        self._require_healthy()
        req = await self._decode(request, p.DetokenizeRequest)
        self._check_model(req.model)
        vocab = self.engine.model_info.vocab_size
        for i, t in enumerate(req.tokens):
            if not 0 <= t < vocab:
                raise bad_request(f"token {i} = {t} is outside the vocabulary [0, {vocab})", "tokens")
        text = self.engine.input_processor.tokenizer.decode(req.tokens, skip_special_tokens=False)
        return _json({"prompt": text})

    # ------------------------------------------------------------------ chat
    async def chat(self, request: Request) -> Response:
        received = time.perf_counter()  # TTFT counts from here: before parsing and tokenizing
        renames = {"logprobs": "top_logprobs", "prompt": "messages"}
        body = await self._read_body(request)
        try:
            req: p.ChatCompletionRequest = self._parse(body, p.ChatCompletionRequest)
            if req.max_completion_tokens is not None:
                renames["max_tokens"] = "max_completion_tokens"
            model = self._check_model(req.model)
            _check_prompt_logprobs(req)
            self._require_healthy()
            stream, forced = await self._start_chat(req)
        except Exception as e:
            raise translate_error(e, renames) from e
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        tracker = Tracker(self.metrics, req.n, received)
        parse_tools = bool(req.tools) and req.tool_choice != "none" and forced is None
        tools = [msgspec.to_builtins(t) for t in req.tools or []] if parse_tools else None
        # one parser per completion turns its text (whole, streamed, or cut short) into the
        # message, for a forced call too: a stream's deltas add up to the whole response
        if forced is not None:
            parsing: Callable[[], OutputParser] | None = ChatParsing.forced(
                forced.name, forced.after_reasoning
            )
        else:
            parsing = self.parsing.for_request(
                tools, parse_tools, req.chat_template_kwargs, req.chat_template
            )
        if req.stream:
            fmt = ChatChunks(
                self.token_text, rid, model, req.n,
                want_logprobs=req.logprobs, parsing=parsing, return_ids=req.return_token_ids,
            )  # fmt: skip
            return self._stream(rid, [stream], [tracker], fmt, _include_usage(req))

        async def full() -> p.ChatCompletionResponse:
            await self._collect(stream, tracker)
            self._check_drain([tracker])
            response = chat_response(tracker, self.token_text, rid, model, parsing, req.return_token_ids)
            if isinstance(stream, PromptStream) and 0 in stream.prompts and req.prompt_logprobs is not None:
                entries = stream.prompts[0][1]
                response.prompt_logprobs = vllm_prompt_logprobs(self.token_text, entries, req.prompt_logprobs)
            return response

        return await self._answer(request, full(), [stream])

    async def _start_chat(self, req: p.ChatCompletionRequest) -> tuple[OutputStream, ForcedTools | None]:
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_tokens is None:  # until the context is full (the engine stops there)
            max_tokens = self.engine.model_info.max_model_len
        top = None
        if req.logprobs:
            top = req.top_logprobs or 0
        elif req.top_logprobs is not None and req.top_logprobs > 0:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        # a model that thinks first gets its constraint after the reasoning (structured.py)
        after = THINK_END if self.parsing.thinks_first(req.chat_template_kwargs, req.chat_template) else None
        # parsing a schema costs up to its limits' worth: off the event loop
        constraint, forced = await asyncio.to_thread(chat_constraint, req, after)
        params = sampling_params(req, max_tokens=max_tokens, logprobs=top, constraint=constraint)
        if req.prompt_logprobs is not None:
            params = msgspec.structs.replace(params, prompt_logprobs=req.prompt_logprobs)
        await compile_constraint(self.engine, constraint)
        prompt, extras = await self.tokenizer.ids_if_long(
            messages_to_dicts(req.messages),
            template_extras(req.tools, req.chat_template_kwargs, req.chat_template),
        )
        stream = self.engine.generate(
            prompt,
            params,
            request_id=req.request_id,
            priority=req.priority,
            cache_salt=req.cache_salt,
            **extras,
        )
        if req.prompt_logprobs is not None:
            return PromptStream(stream, "", prompt_only=False), forced
        return stream, forced

    # ------------------------------------------------------------------ completions
    async def completions(self, request: Request) -> Response:
        received = time.perf_counter()  # TTFT counts from here: before parsing and tokenizing
        renames = {"prompt": "prompt"}
        streams: list[OutputStream] = []
        body = await self._read_body(request)
        try:
            req: p.CompletionRequest = self._parse(body, p.CompletionRequest)
            model = self._check_model(req.model)
            self._require_healthy()
            spec = _echo_spec(req)
            await self._start_completions(req, streams, spec)
        except Exception as e:
            for s in streams:  # the prompts accepted before one was rejected
                with contextlib.suppress(Exception):
                    await s.aclose()
            raise translate_error(e, renames) from e
        rid = f"cmpl-{uuid.uuid4().hex}"
        trackers = [Tracker(self.metrics, req.n, received) for _ in streams]
        if req.stream:
            fmt = CompletionChunks(
                self.token_text, rid, model, req.n, len(streams), return_ids=req.return_token_ids,
                spec=spec, streams=_prompt_streams(streams),
            )  # fmt: skip
            return self._stream(rid, streams, trackers, fmt, _include_usage(req))

        async def full() -> p.CompletionResponse:
            await asyncio.gather(*(self._collect(s, t) for s, t in zip(streams, trackers, strict=True)))
            self._check_drain(trackers)
            return completion_response(
                trackers,
                self.token_text,
                rid,
                model,
                req.n,
                req.return_token_ids,
                spec,
                _prompt_streams(streams),
            )

        return await self._answer(request, full(), streams)

    async def _start_completions(
        self, req: p.CompletionRequest, streams: list[OutputStream], spec: EchoSpec
    ) -> None:
        """One engine request per prompt, appended to ``streams`` as each is accepted (wrapped in a
        ``PromptStream`` when ``spec`` asks for something of the prompt)."""
        if req.suffix:
            raise bad_request("suffix is not supported", "suffix", "unsupported")
        prompts = completion_prompts(req.prompt)
        max_tokens = req.max_tokens if req.max_tokens is not None else self.engine.model_info.max_model_len
        if spec.prompt_only:  # the engine samples one token, which the PromptStream drops
            max_tokens = 1
        constraint = await asyncio.to_thread(request_constraint, req)
        params = sampling_params(req, max_tokens=max_tokens, logprobs=req.logprobs, constraint=constraint)
        if spec.engine_prompt_logprobs is not None:
            params = msgspec.structs.replace(params, prompt_logprobs=spec.engine_prompt_logprobs)
        await compile_constraint(self.engine, constraint)
        if len(prompts) > 1 and req.request_id is not None:
            raise bad_request("request_id is for a single prompt", "request_id")
        for text_or_ids in prompts:
            prompt, _ = await self.tokenizer.ids_if_long(text_or_ids, {})
            stream: OutputStream = self.engine.generate(
                prompt,
                params,
                request_id=req.request_id,
                priority=req.priority,
                cache_salt=req.cache_salt,
            )
            if spec.echo or spec.prompt_logprobs is not None:
                stream = PromptStream(stream, self._prompt_text(text_or_ids), spec.prompt_only)
            streams.append(stream)

    def _prompt_text(self, text_or_ids: str | list[int]) -> str:
        """The prompt as ``echo`` returns it: the text given, or the token ids decoded."""
        if isinstance(text_or_ids, str):
            return text_or_ids
        return self.engine.input_processor.tokenizer.decode(text_or_ids, skip_special_tokens=False)


def _model_not_found(model: str, names: list[str]) -> APIError:
    return APIError(
        404, f"the model {model!r} does not exist; this server serves {names}", "not_found_error",
        "model", "model_not_found",
    )  # fmt: skip


def _too_large(size: int, limit: int) -> APIError:
    return APIError(
        413, f"request body of {size} bytes or more is over the limit of {limit} bytes (server.max_body_bytes)",
        "invalid_request_error", None, "request_too_large",
    )  # fmt: skip


def _echo_spec(req: p.CompletionRequest) -> EchoSpec:
    """What a completions request asks about its prompts; 400 for what cannot be given."""
    if req.max_tokens == 0 and not req.echo:
        raise bad_request("max_tokens 0 needs echo: true (it returns the prompt alone)", "max_tokens")
    _check_prompt_logprobs(req)
    return EchoSpec(
        echo=req.echo,
        logprobs=req.logprobs,
        prompt_only=req.max_tokens == 0,
        prompt_logprobs=req.prompt_logprobs,
    )


def _check_prompt_logprobs(req: p.ChatCompletionRequest | p.CompletionRequest) -> None:
    if req.prompt_logprobs is not None and req.stream:
        raise bad_request("prompt_logprobs are not available with stream: true", "prompt_logprobs")


def _prompt_streams(streams: list[OutputStream]) -> list[PromptStream | None]:
    return [s if isinstance(s, PromptStream) else None for s in streams]


def _include_usage(req: p.ChatCompletionRequest | p.CompletionRequest) -> UsageMode:
    """``stream_options``: usage in a last chunk, and with ``continuous_usage_stats`` (vLLM) in
    every chunk too."""
    opts = req.stream_options
    if not (opts and opts.include_usage):
        return UsageMode.NONE
    return UsageMode.EVERY if opts.continuous_usage_stats else UsageMode.FINAL
