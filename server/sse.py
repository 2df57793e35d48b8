"""Server-sent events, and the one skeleton every streaming endpoint runs.

* ``SSEResponse`` pumps ready-made frames while watching ``receive()``: a client that
  disconnects cancels the pump at once (even while its request still waits in the engine's
  queue), and closing the frames closes the engine streams, which aborts their requests.
* ``run_or_disconnect`` does the same for a non-streaming response.
* ``stream_frames`` is the stream of one HTTP request over its engine streams (one per prompt):
  each output is recorded by the prompt's ``Tracker`` and turned into frames by the endpoint's
  ``ChunkFormat``; an error after the 200 is reported in-band as an error frame; the stream
  always ends with ``data: [DONE]``, and completions left unfinished count as aborted.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from deltaserve.engine.front.client import OutputStream
from deltaserve.engine.outputs import RequestOutput
from deltaserve.logs import get_logger
from deltaserve.server.errors import APIError, encode, translate_error
from deltaserve.server.tracker import Choice, Tracker, usage

log = get_logger("deltaserve.server")

DONE = b"data: [DONE]\n\n"


def data_frame(message: Any) -> bytes:
    return b"data: " + encode(message) + b"\n\n"


def error_frame(e: APIError) -> bytes:
    return b"data: " + e.body() + b"\n\n"


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class SSEResponse(Response):
    """Server-sent events from an async iterator of ready-made ``data: ...`` frames (module
    docstring: a disconnect cancels the pump and closes the frames)."""

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


class ChunkFormat(Protocol):
    """How an endpoint turns outputs into frames (chat chunks, completion chunks)."""

    def frames(self, k: int, out: RequestOutput, choice: Choice, tracker: Tracker) -> Iterator[bytes]:
        """The frames of output ``out`` of prompt ``k`` (``choice``: its completion so far); it
        counts a finished completion on ``tracker`` with the finish reason it reports."""
        ...

    def usage_frame(self, trackers: list[Tracker]) -> bytes: ...


async def _outputs(streams: Sequence[OutputStream]) -> AsyncIterator[tuple[int, Any]]:
    """``(prompt index, output)`` of every stream as they come; with several streams an error of
    one arrives as an item (the others go on), with one stream it is raised."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(k: int, stream: OutputStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((k, out))
        except Exception as e:
            queue.put_nowait((k, e))
        finally:
            queue.put_nowait((k, None))

    tasks = [asyncio.ensure_future(pump(k, s)) for k, s in enumerate(streams)]
    try:
        done = 0
        while done < len(streams):
            k, item = await queue.get()
            if item is None:
                done += 1
                continue
            yield k, item
    finally:
        for t in tasks:
            t.cancel()


class UsageMode(enum.Enum):
    """Token counts in a stream (``stream_options``)."""

    NONE = "none"
    FINAL = "final"  # a last chunk with the request's usage (``include_usage``)
    EVERY = "every"  # and every chunk with the usage so far (vLLM's ``continuous_usage_stats``)


_NO_USAGE = b'"usage":null'


def _with_usage(frame: bytes, trackers: list[Tracker]) -> bytes:
    """``frame`` (a chunk with ``"usage": null``) carrying the usage so far; other frames as they are."""
    if _NO_USAGE not in frame:
        return frame
    return frame.replace(_NO_USAGE, b'"usage":' + encode(usage(trackers)), 1)


async def stream_frames(
    rid: str,
    streams: Sequence[OutputStream],
    trackers: list[Tracker],
    fmt: ChunkFormat,
    usage_mode: UsageMode,
    *,
    cut_short: Callable[[], APIError | None] | None = None,
) -> AsyncIterator[bytes]:
    """The SSE body of one HTTP request (module docstring). ``cut_short``: after the outputs,
    the error to report if the server ended the request early (a drain that ran out of time)."""
    source = _outputs(streams)
    every = usage_mode is UsageMode.EVERY
    try:
        async for k, item in source:
            if isinstance(item, BaseException):
                yield error_frame(translate_error(item))
                continue
            choice = trackers[k].observe(item)
            for frame in fmt.frames(k, item, choice, trackers[k]):
                yield _with_usage(frame, trackers) if every else frame
        if usage_mode is not UsageMode.NONE:
            yield fmt.usage_frame(trackers)
        early = cut_short() if cut_short is not None else None
        if early is not None:
            yield error_frame(early)
    except (asyncio.CancelledError, GeneratorExit):
        raise
    except Exception as e:  # after the 200: report in-band, then end the stream
        log.exception("server.stream_failed", request_id=rid)
        yield error_frame(translate_error(e))
    finally:
        await source.aclose()
        for s in streams:
            with contextlib.suppress(Exception):
                await s.aclose()  # a stream left early aborts its request
        for t in trackers:
            t.abort_unfinished()
    yield DONE
