"""ProcStream: one request's outputs in a front end whose engine core runs in another process.

The core sends token ids (``TokenDelta``); the stream turns them into ``RequestOutput`` deltas:
text from its own ``IncrementalDetokenizer`` per completion, stop strings applied here (a stop
string ends the completion with ``stop`` and the client aborts it in the core, whose later
deltas are dropped). Contract as ``AsyncEngine``'s ``RequestStream``: async-iterate it; the last
delta of each of the ``n`` completions has ``finished=True``; leaving early, cancelling the
consumer or ``aclose()`` aborts. With ``n > 1`` completion 0 runs alone until its first token
(its prompt is then cached), then the others are sent.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Protocol

from deltaserve.engine.front.client import AbortingStream
from deltaserve.engine.front.detokenizer import IncrementalDetokenizer
from deltaserve.engine.messages import AddRequest, TokenDelta
from deltaserve.engine.outputs import RequestOutput


class StreamOwner(Protocol):
    """What a stream asks of the client that made it (``EngineProcClient``)."""

    def _send_adds(self, adds: list[AddRequest]) -> None:
        """Send completions 1..n-1 to the core (completion 0 has its first token)."""
        ...

    def _abort_in_core(self, core_ids: list[str]) -> None:
        """Abort these completions in the core (their later deltas are dropped)."""
        ...

    def _forget(self, core_id: str) -> None:
        """A completion has ended: its core id is free."""
        ...

    def _abandon(self, stream: ProcStream) -> None:
        """The stream was left before it finished: abort what is open."""
        ...


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


class ProcStream(AbortingStream):
    """The stream ``EngineProcClient.generate`` returns (module docstring)."""

    def __init__(
        self,
        client: StreamOwner,
        request_id: str,
        completions: list[Completion],
        later: list[AddRequest],
    ) -> None:
        self.request_id = request_id
        self.finished = False
        self.completions = completions
        self._client = client
        self._later: list[AddRequest] | None = later or None
        self._queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._ended = 0  # completions whose last output was read

    # ------------------------------------------------------------------ iteration
    async def _next(self) -> RequestOutput:
        out = await self._queue.get()
        if out.finished:
            self._ended += 1
            if self._ended == len(self.completions):
                self.finished = True
        return out

    # ------------------------------------------------------------------ from the client
    def open(self) -> list[Completion]:
        return [c for c in self.completions if not c.done]

    def on_delta(self, c: Completion, d: TokenDelta) -> None:
        """A delta of completion ``c`` from the core: text, stop strings, the output."""
        if c.done:
            return
        if self._later is not None and c.index == 0:  # its prompt is computed (or it ended)
            later, self._later = self._later, None
            self._client._send_adds(later)
        reason, error = d.finish_reason, d.error
        try:
            text = c.detokenizer.add(d.token_ids) if d.token_ids else ""
            c.num_output += len(d.token_ids)
            if reason is None and c.detokenizer.stopped and c.num_output >= c.min_tokens:
                reason = "stop"  # a stop string: the core stops on the client's abort
                self._client._abort_in_core([c.core_id])
            if reason in ("stop", "length"):
                text += c.detokenizer.flush()
        except Exception as e:  # noqa: BLE001 - detokenizing one request ends only that request
            self._client._abort_in_core([c.core_id])
            text, reason, error = "", "error", f"output processing failed: {type(e).__name__}: {e}"
        if reason is not None:
            c.done = True
            self._client._forget(c.core_id)
        self._queue.put_nowait(
            RequestOutput(
                request_id=self.request_id,
                token_ids=d.token_ids if error is None else [],
                text=text,
                finished=reason is not None,
                finish_reason=reason,
                num_prompt_tokens=d.num_prompt_tokens or c.num_prompt_tokens,
                num_cached_tokens=d.num_cached_tokens,
                error=error,
                index=c.index,
                logprobs=d.logprobs,
                queue_time_s=d.queue_time_s,
                prefill_time_s=d.prefill_time_s,
                prompt_logprobs=d.prompt_logprobs,
                prompt_token_ids=d.prompt_token_ids,
            )
        )

    def end(self, c: Completion, reason: str, error: str | None) -> None:
        """End completion ``c`` here (abort, error, the core died) unless it has ended."""
        if c.done:
            return
        c.done = True
        self._client._forget(c.core_id)
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
            )
        )

    def end_all(self, reason: str, error: str | None) -> list[str]:
        """End every open completion; the core ids of those that had reached the core."""
        sent = [c.core_id for c in self.open() if self._later is None or c.index == 0]
        self._later = None
        for c in self.open():
            self.end(c, reason, error)
        return sent

    def _abandon(self) -> None:
        """The consumer left before the end: abort what runs in the core, forget the rest."""
        self._client._abandon(self)
