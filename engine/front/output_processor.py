"""The output processor: a core's token deltas become each request's ``RequestOutput`` deltas.

One per front end (``AsyncEngine``), the same in every placement (``engine/front/core_client.py``).
Every core emits ``TokenDelta``s (token ids; the core ends a request on its stop token ids,
EOS, its grammar's end, ``max_tokens``, an abort or an error); here, per completion:

* text from its own ``IncrementalDetokenizer``;
* stop strings: one that matches (after ``min_tokens``) ends the completion with ``stop``, the
  held-back text is flushed, and the core is told to abort it; its later deltas are dropped;
* logprobs, prompt logprobs, token counts and timing fields passed through;
* ``n`` fan-out: a request with ``SamplingParams.n > 1`` is ``n`` core requests, completion 0
  first, alone until its first delta (its prompt is then in the prefix cache), then the others;
  their deltas are merged into one stream, told apart by ``RequestOutput.index``;
* final outputs: every completion ends with exactly one ``finished`` output, whether the core
  ended it, a stop string did, the consumer left (``abort``), or the core died (``error``).

A ``RequestStream`` is the handle ``generate`` returns (``AbortingStream``'s iteration: leaving
early, cancelling the consumer or ``aclose()`` aborts); the processor routes core ids to it.
A failure while detokenizing one completion ends that completion only (``error``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from deltaserve.engine.errors import InvalidRequestError
from deltaserve.engine.front.client import AbortingStream
from deltaserve.engine.front.detokenizer import IncrementalDetokenizer
from deltaserve.engine.messages import AddRequest, StepOutputs, TokenDelta
from deltaserve.engine.outputs import RequestOutput


@dataclass(eq=False)
class Completion:
    """One of a request's ``n`` completions: its core id and its text state."""

    core_id: str
    index: int
    detokenizer: IncrementalDetokenizer
    min_tokens: int
    num_prompt_tokens: int
    num_output: int = 0
    done: bool = False
    # speculative decoding: the core's latest counts (drafted, accepted), for the last output
    spec_counts: tuple[int, int] = (0, 0)


class RequestStream(AbortingStream):
    """One request's ``RequestOutput`` deltas (module docstring); ``request_id`` names it. The
    last delta of each of its ``n`` completions has ``finished=True``."""

    def __init__(
        self,
        processor: OutputProcessor,
        request_id: str,
        completions: list[Completion],
        later: list[AddRequest],
    ) -> None:
        self.request_id = request_id
        self.finished = False
        self.completions = completions
        self._processor = processor
        self._later: list[AddRequest] | None = later or None  # completions 1..n-1 until sent
        self._queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._ended = 0  # completions whose last output was read

    async def _next(self) -> RequestOutput:
        out = await self._queue.get()
        if out.finished:
            self._ended += 1
            if self._ended == len(self.completions):
                self.finished = True
        return out

    def _abandon(self) -> None:
        """The consumer left before the end: abort what runs in the core, forget the rest."""
        self.finished = True
        self._processor.abort_in_core(self.end_all("abort", None))

    # ------------------------------------------------------------------ from the processor
    def open(self) -> list[Completion]:
        return [c for c in self.completions if not c.done]

    def on_delta(self, c: Completion, d: TokenDelta) -> None:
        """A delta of completion ``c`` from the core: text, stop strings, the output."""
        if c.done:
            return
        if self._later is not None and c.index == 0:  # its prompt is computed (or it ended)
            later, self._later = self._later, None
            self._processor.send_adds(later)
        reason, error = d.finish_reason, d.error
        if d.num_draft_tokens:
            c.spec_counts = (d.num_draft_tokens, d.num_accepted_tokens)
        try:
            detok = c.detokenizer
            text = detok.add(d.token_ids) if d.token_ids else ""
            c.num_output += len(d.token_ids)
            if reason is None and detok.stopped and c.num_output >= c.min_tokens:
                reason = "stop"  # a stop string: the core stops on this abort
                self._processor.abort_in_core([c.core_id])
            if reason in ("stop", "length"):
                text += detok.flush()
        except Exception as e:  # noqa: BLE001 - detokenizing one request ends only that request
            self._processor.abort_in_core([c.core_id])
            text, reason, error = "", "error", f"output processing failed: {type(e).__name__}: {e}"
        if reason is not None:
            c.done = True
            self._processor.forget(c.core_id)
        self._queue.put_nowait(
            RequestOutput(
                request_id=self.request_id,
                text=text,
                num_cached_tokens=d.num_cached_tokens,
                finish_reason=reason,
                index=c.index,
                token_ids=d.token_ids if error is None else [],
                logprobs=d.logprobs,
                error=error,
                queue_time_s=d.queue_time_s,
                prefill_time_s=d.prefill_time_s,
                finished=reason is not None,
                prompt_logprobs=d.prompt_logprobs,
                prompt_token_ids=d.prompt_token_ids,
                num_prompt_tokens=d.num_prompt_tokens or c.num_prompt_tokens,
                **_spec_counts(c, reason is not None),
            )
        )

    def end(self, c: Completion, reason: str, error: str | None) -> None:
        """End completion ``c`` here (abort, error, the core died) unless it has ended."""
        if c.done:
            return
        c.done = True
        self._processor.forget(c.core_id)
        self._queue.put_nowait(
            RequestOutput(
                request_id=self.request_id,
                token_ids=[],
                text="",
                finished=True,
                finish_reason=reason,
                error=error,
                index=c.index,
                num_prompt_tokens=c.num_prompt_tokens,
                **_spec_counts(c, True),
            )
        )

    def end_all(self, reason: str, error: str | None) -> list[str]:
        """End every open completion; the core ids of those that had reached the core."""
        sent = [c.core_id for c in self.open() if self._later is None or c.index == 0]
        self._later = None
        for c in self.open():
            self.end(c, reason, error)
        return sent


def _spec_counts(c: Completion, last: bool) -> dict[str, int]:
    """The speculative-decoding counts a completion's output carries: on its last only."""
    if not last:
        return {}
    return {"num_draft_tokens": c.spec_counts[0], "num_accepted_tokens": c.spec_counts[1]}


class OutputProcessor:
    """The front end's streams and the routing of core deltas to them (module docstring).

    ``send`` adds requests to the core and ``abort`` aborts core ids (the core client's, unless the
    front end cannot serve: ``live`` False, then nothing is sent)."""

    def __init__(
        self, tokenizer: Any, send: Callable[[list[AddRequest]], None], abort: Callable[[list[str]], None]
    ) -> None:
        self.tokenizer = tokenizer
        self.live = True
        self._send = send
        self._abort = abort
        self.routes: dict[str, tuple[RequestStream, Completion]] = {}  # core id -> its stream
        self.by_id: dict[str, RequestStream] = {}  # the request id given to the user -> its stream

    def open_stream(self, request_id: str, adds: list[AddRequest], num_prompt_tokens: int) -> RequestStream:
        """The stream of a request whose ``n`` completions are ``adds`` (ids unique, params
        ``n=1`` each); completion 0 is sent now, the others after its first delta."""
        completions = [
            Completion(
                a.request_id,
                i,
                IncrementalDetokenizer(self.tokenizer, a.sampling_params.stop),
                a.sampling_params.min_tokens,
                num_prompt_tokens,
            )
            for i, a in enumerate(adds)
        ]
        stream = RequestStream(self, request_id, completions, adds[1:])
        self.by_id[request_id] = stream
        for c in completions:
            self.routes[c.core_id] = (stream, c)
        self.send_adds(adds[:1])
        return stream

    def check_free(self, request_id: str, core_ids: list[str]) -> None:
        """Neither the request id nor any of its core ids belongs to an open request."""
        if request_id in self.by_id:
            raise InvalidRequestError(f"request_id {request_id!r} is already in use")
        for cid in core_ids:
            if cid in self.routes:
                raise InvalidRequestError(f"request_id {cid!r} is already in use")

    def on_outputs(self, outputs: StepOutputs) -> None:
        """Route a step's deltas to their streams (a dropped completion's are ignored)."""
        routes = self.routes
        for d in outputs.deltas:
            route = routes.get(d.request_id)
            if route is not None:
                route[0].on_delta(route[1], d)

    def abort(self, request_id: str) -> bool:
        """End the open request ``request_id`` with ``abort`` and abort it in the core; whether
        there was one."""
        stream = self.by_id.get(request_id)
        if stream is None or stream.finished:
            return False
        self.abort_in_core(stream.end_all("abort", None))
        return True

    def end_all(self, reason: str, error: str | None) -> list[str]:
        """End every open request (shutdown, a dead core); the core ids that had reached the core."""
        sent: list[str] = []
        for stream in list(self.by_id.values()):
            sent += stream.end_all(reason, error)
        self.by_id.clear()
        self.routes.clear()
        return sent

    # ------------------------------------------------------------------ from the streams
    def send_adds(self, adds: list[AddRequest]) -> None:
        if adds and self.live:
            self._send(adds)

    def abort_in_core(self, core_ids: list[str]) -> None:
        if core_ids and self.live:
            self._abort(core_ids)

    def forget(self, core_id: str) -> None:
        """A completion has ended: its core id is free, and its request's once all have."""
        route = self.routes.pop(core_id, None)
        if route is not None:
            stream = route[0]
            if not stream.open() and self.by_id.get(stream.request_id) is stream:
                del self.by_id[stream.request_id]

    @property
    def num_open(self) -> int:
        return len(self.by_id)
