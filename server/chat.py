"""``/v1/chat/completions`` responses: the whole response, and the chunks of a stream.

Tool calls (when the request has tools and ``tool_choice`` is not ``none``) are parsed out of
the text: at the end for a whole response, incrementally for a stream (text before a call
streams as it comes; the calls arrive with the completion's end, finish reason ``tool_calls``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import msgspec

from deltaserve.engine.outputs import RequestOutput, TokenLogprob
from deltaserve.server import protocol as p
from deltaserve.server.errors import engine_failure
from deltaserve.server.sse import data_frame, error_frame
from deltaserve.server.tool_parser import StreamingToolParser, parse_tool_calls
from deltaserve.server.tracker import Choice, Tracker, usage

TokenText = Callable[[int], str]


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
    tracker: Tracker, token_text: TokenText, rid: str, model: str, parse_tools: bool, return_ids: bool
) -> p.ChatCompletionResponse:
    """The whole response once every completion of ``tracker`` has finished."""
    choices = []
    for c in tracker.choices:
        c.raise_if_failed()
        content: str | None = c.text
        tool_calls = None
        reason = c.finish_reason
        if parse_tools:
            content, calls = parse_tool_calls(c.text)
            if calls:
                tool_calls = [
                    p.ToolCall(id=call.id, function=p.FunctionCall(name=call.name, arguments=call.arguments))
                    for call in calls
                ]
                reason = "tool_calls"
        choices.append(
            p.ChatChoice(
                index=c.index,
                message=p.ResponseMessage(content=content, tool_calls=tool_calls),
                finish_reason=reason,
                logprobs=chat_logprobs(token_text, c.logprobs) if c.logprobs else None,
                token_ids=list(c.token_ids) if return_ids else msgspec.UNSET,
            )
        )
    return p.ChatCompletionResponse(
        id=rid, created=int(time.time()), model=model, choices=choices, usage=usage([tracker])
    )


class ChatChunks:
    """A chat stream's ``ChunkFormat``: a role chunk first, content deltas, then per completion
    the parsed tool calls (if any) and a chunk with the finish reason."""

    def __init__(
        self,
        token_text: TokenText,
        rid: str,
        model: str,
        n: int,
        *,
        want_logprobs: bool,
        parse_tools: bool,
        return_ids: bool,
    ) -> None:
        self.token_text = token_text
        self.rid, self.model, self.created = rid, model, int(time.time())
        self.want_logprobs, self.return_ids = want_logprobs, return_ids
        self.parsers = [StreamingToolParser() if parse_tools else None for _ in range(n)]
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
        text = out.text
        parser = self.parsers[i]
        if parser is not None:
            text = parser.feed(text)
        lp = chat_logprobs(self.token_text, out.logprobs) if (self.want_logprobs and out.logprobs) else None
        if text or lp is not None or (self.return_ids and out.token_ids):
            ids = list(out.token_ids) if self.return_ids else msgspec.UNSET
            delta = p.DeltaMessage(content=text)
            yield self._chunk(p.ChatChunkChoice(index=i, delta=delta, logprobs=lp, token_ids=ids))
        if out.finished:
            yield from self._finish(out, choice, tracker)

    def _finish(self, out: RequestOutput, choice: Choice, tracker: Tracker) -> Iterator[bytes]:
        i, reason = out.index, out.finish_reason
        if reason == "error":
            yield error_frame(engine_failure(choice.error))
        parser = self.parsers[i]
        if parser is not None:
            rest, calls = parser.finish()
            if rest:
                yield self._chunk(p.ChatChunkChoice(index=i, delta=p.DeltaMessage(content=rest)))
            if calls:
                reason = "tool_calls"
                deltas = [
                    p.DeltaToolCall(
                        index=k, id=call.id, type="function",
                        function=p.DeltaFunctionCall(name=call.name, arguments=call.arguments),
                    )
                    for k, call in enumerate(calls)
                ]  # fmt: skip
                yield self._chunk(p.ChatChunkChoice(index=i, delta=p.DeltaMessage(tool_calls=deltas)))
        tracker.count_finish(reason)
        yield self._chunk(p.ChatChunkChoice(index=i, delta=p.DeltaMessage(), finish_reason=reason))

    def usage_frame(self, trackers: list[Tracker]) -> bytes:
        return data_frame(
            p.ChatCompletionChunk(
                id=self.rid, created=self.created, model=self.model, choices=[], usage=usage(trackers)
            )
        )
