"""``/v1/chat/completions`` responses: the whole response, and the chunks of a stream.

Reasoning and tool calls (when the request has tools and ``tool_choice`` is not ``none``; a
forced ``tool_choice``'s output is read by ``ChatParsing.forced``) are parsed out of the text
by ``output_parser.OutputParser``: the whole text for a whole response, piece by piece for a
stream, where reasoning streams as ``delta.reasoning_content``, content as ``delta.content``,
and each call as ``tool_calls`` deltas (the first with its index, id, type and name, then
pieces of its arguments). One parser for both is what makes a stream's deltas add up to the
whole message, a completion cut by ``max_tokens`` included. A completion that called a tool and
stopped finishes with ``tool_calls``; one cut short keeps ``length``.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator

import msgspec

from deltaserve.engine.outputs import RequestOutput, TokenLogprob
from deltaserve.server import protocol as p
from deltaserve.server.errors import engine_failure
from deltaserve.server.output_parser import OutputParser, Piece, Reasoning
from deltaserve.server.sse import data_frame, error_frame
from deltaserve.server.tool_parsers import CallDelta
from deltaserve.server.tracker import Choice, Tracker, usage

TokenText = Callable[[int], str]
#: makes one completion's output parser; None: the text is the content as generated
MakeParser = Callable[[], OutputParser] | None


def chat_logprobs(token_text: TokenText, entries: list[TokenLogprob]) -> p.ChatLogprobs:
    content = []
    for e in entries:
        text = token_text(e.token_id)
        top = [p.TopLogprob(token=(t := token_text(tid)), logprob=lp, bytes=list(t.encode()))
               for tid, lp in e.top]  # fmt: skip
        content.append(
            p.ChatTokenLogprob(token=text, logprob=e.logprob, bytes=list(text.encode()), top_logprobs=top)
        )
    return p.ChatLogprobs(content=content)


def chat_response(
    tracker: Tracker, token_text: TokenText, rid: str, model: str, parsing: MakeParser, return_ids: bool
) -> p.ChatCompletionResponse:
    """The whole response once every completion of ``tracker`` has finished."""
    choices = []
    for c in tracker.choices:
        c.raise_if_failed()
        message = p.ResponseMessage(content=c.text)
        reason = c.finish_reason
        if parsing is not None:
            parsed = parsing().parse(c.text)
            message = p.ResponseMessage(content=parsed.content, reasoning_content=parsed.reasoning)
            if parsed.calls:
                message.tool_calls = [
                    p.ToolCall(id=call.id, function=p.FunctionCall(name=call.name, arguments=call.arguments))
                    for call in parsed.calls
                ]
                reason = _called(reason)
        choices.append(
            p.ChatChoice(
                index=c.index,
                message=message,
                finish_reason=reason,
                logprobs=chat_logprobs(token_text, c.logprobs) if c.logprobs else None,
                token_ids=list(c.token_ids) if return_ids else msgspec.UNSET,
            )
        )
    return p.ChatCompletionResponse(
        id=rid, created=int(time.time()), model=model, choices=choices, usage=usage([tracker])
    )


def _called(reason: str | None) -> str | None:
    """A completion that called tools and stopped finishes with ``tool_calls``; one cut short
    keeps its reason (``length``: the last call may be incomplete)."""
    return "tool_calls" if reason == "stop" else reason


def _deltas(pieces: list[Piece]) -> Iterator[p.DeltaMessage]:
    """Parsed pieces as delta messages, in order: a run of reasoning or content is one delta, a
    call's consecutive argument pieces one delta after its header's."""
    for kind, group in itertools.groupby(pieces, key=type):
        run = list(group)
        if kind is Reasoning:
            yield p.DeltaMessage(reasoning_content="".join(r.text for r in run if isinstance(r, Reasoning)))
        elif kind is str:
            yield p.DeltaMessage(content="".join(r for r in run if isinstance(r, str)))
        else:  # one call's delta per chunk: clients that read only the first entry still work
            for call in _call_deltas([r for r in run if isinstance(r, CallDelta)]):
                yield p.DeltaMessage(tool_calls=[call])


def _call_deltas(run: list[CallDelta]) -> list[p.DeltaToolCall]:
    """A call's header alone (index, id, type, name; arguments ""), as OpenAI streams it, then
    its consecutive argument pieces as one delta."""
    out: list[p.DeltaToolCall] = []
    for d in run:
        if d.name is not None:
            function = p.DeltaFunctionCall(name=d.name, arguments=d.arguments)
            out.append(p.DeltaToolCall(index=d.index, id=d.id, type="function", function=function))
        elif out and out[-1].index == d.index and out[-1].id is None and out[-1].function is not None:
            out[-1].function.arguments = (out[-1].function.arguments or "") + d.arguments
        else:
            out.append(p.DeltaToolCall(index=d.index, function=p.DeltaFunctionCall(arguments=d.arguments)))
    return out


class ChatChunks:
    """A chat stream's ``ChunkFormat``: a role chunk first, then per completion its deltas as
    parsed (reasoning, content, tool calls; module docstring) and a chunk with the finish reason."""

    def __init__(
        self,
        token_text: TokenText,
        rid: str,
        model: str,
        n: int,
        *,
        want_logprobs: bool,
        parsing: MakeParser,
        return_ids: bool,
    ) -> None:
        self.token_text = token_text
        self.rid, self.model, self.created = rid, model, int(time.time())
        self.want_logprobs, self.return_ids = want_logprobs, return_ids
        self.parsers = [parsing() if parsing is not None else None for _ in range(n)]
        self.started = [False] * n

    def _chunk(self, choice: p.ChatChunkChoice) -> bytes:
        return data_frame(
            p.ChatCompletionChunk(id=self.rid, created=self.created, model=self.model, choices=[choice])
        )

    def frames(self, k: int, out: RequestOutput, choice: Choice, tracker: Tracker) -> Iterator[bytes]:
        i = out.index
        if not self.started[i]:
            self.started[i] = True
            yield self._chunk(p.ChatChunkChoice(index=i, delta=p.DeltaMessage(role="assistant", content="")))
        parser = self.parsers[i]
        deltas = (
            [p.DeltaMessage(content=out.text)] if parser is None else list(_deltas(parser.feed(out.text)))
        )
        lp = chat_logprobs(self.token_text, out.logprobs) if (self.want_logprobs and out.logprobs) else None
        ids = list(out.token_ids) if self.return_ids else msgspec.UNSET
        if not any(d.content or d.reasoning_content or d.tool_calls for d in deltas):
            # nothing to show (yet): one chunk still carries the step's logprobs / token ids
            deltas = (
                [p.DeltaMessage(content="")] if lp is not None or (self.return_ids and out.token_ids) else []
            )
        for k, delta in enumerate(deltas):
            first = k == 0
            yield self._chunk(
                p.ChatChunkChoice(
                    index=i,
                    delta=delta,
                    logprobs=lp if first else None,
                    token_ids=ids if first else msgspec.UNSET,
                )
            )
        if out.finished:
            yield from self._finish(out, choice, tracker)

    def _finish(self, out: RequestOutput, choice: Choice, tracker: Tracker) -> Iterator[bytes]:
        i, reason = out.index, out.finish_reason
        if reason == "error":
            yield error_frame(engine_failure(choice.error))
        parser = self.parsers[i]
        if parser is not None:
            for delta in _deltas(parser.finish()):
                yield self._chunk(p.ChatChunkChoice(index=i, delta=delta))
            if parser.called:
                reason = _called(reason)
        tracker.count_finish(reason)
        yield self._chunk(p.ChatChunkChoice(index=i, delta=p.DeltaMessage(), finish_reason=reason))

    def usage_frame(self, trackers: list[Tracker]) -> bytes:
        return data_frame(
            p.ChatCompletionChunk(
                id=self.rid, created=self.created, model=self.model, choices=[], usage=usage(trackers)
            )
        )
