"""``/v1/completions`` responses: the whole response, and the chunks of a stream. A batch of
prompts gives ``n`` choices per prompt, indexed ``prompt * n + completion``.

``echo`` puts the prompt text before each completion's text (in a stream: in each completion's
first chunk); with ``logprobs`` the ``logprobs`` then cover the prompt tokens too, the first
with ``None`` (nothing predicts it), as OpenAI's legacy API does; ``max_tokens: 0`` with echo
returns the prompt alone (the engine samples one token, which is dropped: ``PromptStream``).
vLLM's ``prompt_logprobs`` adds, per choice, the prompt's log-probabilities in vLLM's shape.
The prompt's token ids and log-probabilities come with each completion's first output
(``SamplingParams.prompt_logprobs``).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field

import msgspec

from deltaserve.engine.front.client import OutputStream
from deltaserve.engine.outputs import RequestOutput, TokenLogprob
from deltaserve.server import protocol as p
from deltaserve.server.errors import engine_failure
from deltaserve.server.sse import data_frame, error_frame
from deltaserve.server.tracker import Choice, Tracker, usage

TokenText = Callable[[int], str]


@dataclass(frozen=True)
class EchoSpec:
    """What a request asks about its prompts: ``echo`` (with the ``logprobs`` of the legacy
    field then covering the prompt), ``max_tokens: 0`` (the prompt alone), vLLM's
    ``prompt_logprobs``."""

    echo: bool = False
    logprobs: int | None = None
    prompt_only: bool = False
    prompt_logprobs: int | None = None

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """``SamplingParams.prompt_logprobs``: the most alternatives either use needs."""
        wanted = [k for k in (self.logprobs if self.echo else None, self.prompt_logprobs) if k is not None]
        return max(wanted) if wanted else None


@dataclass(eq=False)  # hashed by identity (the server keeps its open streams in a set)
class PromptStream:
    """An engine stream of one prompt of a request with echo or ``prompt_logprobs``: it keeps
    each completion's prompt ids and log-probabilities from its first output and, for the
    prompt alone (``max_tokens: 0``), drops what the engine generated."""

    inner: OutputStream
    text: str  # the prompt as echoed: the request's text, or its token ids decoded
    prompt_only: bool
    prompts: dict[int, tuple[list[int], list[TokenLogprob | None]]] = field(default_factory=dict)

    @property
    def request_id(self) -> str:
        return self.inner.request_id

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        async for out in self.inner:
            if out.prompt_token_ids is not None and out.prompt_logprobs is not None:
                self.prompts[out.index] = (out.prompt_token_ids, out.prompt_logprobs)
            if self.prompt_only:
                out.token_ids, out.text, out.logprobs = [], "", None
            yield out

    async def aclose(self) -> None:
        await self.inner.aclose()


def completion_logprobs(
    token_text: TokenText, entries: Sequence[TokenLogprob], offset: int = 0
) -> p.CompletionLogprobs:
    """Log-probabilities in the completions API's shape; ``offset``: the text's offset so far."""
    tokens: list[str] = []
    lps: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for e in entries:
        text = token_text(e.token_id)
        tokens.append(text)
        lps.append(e.logprob)
        tops.append({token_text(tid): lp for tid, lp in e.top})
        offsets.append(offset)
        offset += len(text)
    return p.CompletionLogprobs(tokens=tokens, token_logprobs=lps, top_logprobs=tops, text_offset=offsets)


def prompt_completion_logprobs(
    token_text: TokenText, ids: list[int], entries: list[TokenLogprob | None], num_top: int
) -> p.CompletionLogprobs:
    """An echoed prompt's tokens in the completions API's shape: the first token's log-probability
    and alternatives are None; ``num_top`` alternatives for the others; offsets from 0."""
    tokens = [token_text(t) for t in ids]
    lps: list[float | None] = [None if e is None else e.logprob for e in entries]
    tops: list[dict[str, float] | None] = [
        None if e is None else {token_text(tid): lp for tid, lp in e.top[:num_top]} for e in entries
    ]
    offsets, offset = [], 0
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return p.CompletionLogprobs(tokens=tokens, token_logprobs=lps, top_logprobs=tops, text_offset=offsets)


def vllm_prompt_logprobs(
    token_text: TokenText, entries: list[TokenLogprob | None], num_top: int
) -> p.PromptLogprobs:
    """vLLM's ``prompt_logprobs``: per position, the prompt token and the ``num_top`` most likely
    ones by token id, each with its log-probability, rank (1 = most likely) and text."""
    out: p.PromptLogprobs = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        d = {
            str(e.token_id): p.PromptLogprob(
                logprob=e.logprob, rank=e.rank, decoded_token=token_text(e.token_id)
            )
        }
        for r, (tid, lp) in enumerate(e.top[:num_top], 1):
            d.setdefault(str(tid), p.PromptLogprob(logprob=lp, rank=r, decoded_token=token_text(tid)))
        out.append(d)
    return out


def _join(first: p.CompletionLogprobs, then: p.CompletionLogprobs | None, shift: int) -> p.CompletionLogprobs:
    """The prompt's logprobs followed by the completion's (its offsets moved by ``shift``)."""
    if then is None:
        return first
    return p.CompletionLogprobs(
        tokens=first.tokens + then.tokens,
        token_logprobs=first.token_logprobs + then.token_logprobs,
        top_logprobs=first.top_logprobs + then.top_logprobs,
        text_offset=first.text_offset + [o + shift for o in then.text_offset],
    )


@dataclass
class _Prompted:
    """A choice's prompt parts: the text before it, its logprobs' prompt part, vLLM's field."""

    text: str = ""
    logprobs: p.CompletionLogprobs | None = None
    prompt_logprobs: p.PromptLogprobs | msgspec.UnsetType = msgspec.UNSET


def _prompted(spec: EchoSpec, stream: PromptStream | None, index: int, token_text: TokenText) -> _Prompted:
    """What choice ``index`` of a prompt shows of its prompt (nothing without echo / the field)."""
    out = _Prompted()
    if stream is None:
        return out
    if spec.echo:
        out.text = stream.text
    got = stream.prompts.get(index)
    if got is None:  # the completion ended before its first output (abort, error)
        return out
    ids, entries = got
    if spec.echo and spec.logprobs is not None:
        out.logprobs = prompt_completion_logprobs(token_text, ids, entries, spec.logprobs)
    if spec.prompt_logprobs is not None:
        out.prompt_logprobs = vllm_prompt_logprobs(token_text, entries, spec.prompt_logprobs)
    return out


def completion_response(
    trackers: list[Tracker],
    token_text: TokenText,
    rid: str,
    model: str,
    n: int,
    return_ids: bool,
    spec: EchoSpec = EchoSpec(),
    streams: Sequence[PromptStream | None] = (),
) -> p.CompletionResponse:
    """The whole response once every completion of every prompt has finished (``streams``: per
    prompt, its ``PromptStream`` when ``spec`` asks for something of the prompt)."""
    choices = []
    for k, t in enumerate(trackers):
        stream = streams[k] if streams else None
        for c in t.choices:
            c.raise_if_failed()
            pre = _prompted(spec, stream, c.index, token_text)
            lp = completion_logprobs(token_text, c.logprobs) if c.logprobs else None
            if pre.logprobs is not None:
                lp = _join(pre.logprobs, lp, len(pre.text))
            choices.append(
                p.CompletionChoice(
                    index=k * n + c.index,
                    text=pre.text + c.text,
                    finish_reason=c.finish_reason,
                    logprobs=lp,
                    token_ids=list(c.token_ids) if return_ids else msgspec.UNSET,
                    prompt_logprobs=pre.prompt_logprobs,
                )
            )
    return p.CompletionResponse(
        id=rid, created=int(time.time()), model=model, choices=choices, usage=usage(trackers)
    )


class CompletionChunks:
    """A completion stream's ``ChunkFormat``: one chunk per output that carries something, the
    last one of each completion with its finish reason; with echo, each completion's first chunk
    starts with the prompt (and its logprobs)."""

    def __init__(
        self,
        token_text: TokenText,
        rid: str,
        model: str,
        n: int,
        num_prompts: int,
        *,
        return_ids: bool,
        spec: EchoSpec = EchoSpec(),
        streams: Sequence[PromptStream | None] = (),
    ) -> None:
        self.token_text = token_text
        self.rid, self.model, self.created = rid, model, int(time.time())
        self.n, self.return_ids = n, return_ids
        self.offsets = [[0] * n for _ in range(num_prompts)]  # text offset of each completion
        self.spec, self.streams = spec, streams
        self.started = [[False] * n for _ in range(num_prompts)]  # its first chunk went out

    def _prompt_part(self, k: int, index: int) -> _Prompted:
        """The prompt part of completion ``index`` of prompt ``k``'s first chunk (once)."""
        if self.started[k][index] or not self.streams:
            return _Prompted()
        self.started[k][index] = True
        return _prompted(self.spec, self.streams[k], index, self.token_text)

    def frames(self, k: int, out: RequestOutput, choice: Choice, tracker: Tracker) -> Iterator[bytes]:
        pre = self._prompt_part(k, out.index)
        self.offsets[k][out.index] += len(pre.text)
        lp = None
        if out.logprobs:
            lp = completion_logprobs(self.token_text, out.logprobs, self.offsets[k][out.index])
            # offsets count each token's own text, as the whole response's do (a token that ends
            # inside a character, whose text waits in the detokenizer, still moves them)
            self.offsets[k][out.index] += sum(len(t) for t in lp.tokens)
        if pre.logprobs is not None:
            lp = _join(pre.logprobs, lp, 0)
        if out.finished:
            tracker.count_finish(out.finish_reason)
            if out.finish_reason == "error":
                yield error_frame(engine_failure(choice.error))
        text = pre.text + out.text
        if text or lp is not None or out.finished or (self.return_ids and out.token_ids):
            c = p.CompletionChoice(
                index=k * self.n + out.index,
                text=text,
                finish_reason=out.finish_reason if out.finished else None,
                logprobs=lp,
                token_ids=list(out.token_ids) if self.return_ids else msgspec.UNSET,
            )
            yield data_frame(
                p.CompletionResponse(id=self.rid, created=self.created, model=self.model, choices=[c])
            )

    def usage_frame(self, trackers: list[Tracker]) -> bytes:
        return data_frame(
            p.CompletionResponse(
                id=self.rid, created=self.created, model=self.model, choices=[], usage=usage(trackers)
            )
        )
