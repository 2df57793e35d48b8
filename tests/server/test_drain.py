"""A drain that runs out of time still answers: every request open at the deadline ends with
503 ``engine_shutdown`` in JSON, or on a stream with an error frame and ``[DONE]``; none is cut
off and no traceback is logged. Over a slow scripted engine, on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from deltaserve.engine import RequestOutput, SamplingParams
from deltaserve.engine.front.client import ModelInfo
from deltaserve.server.app import create_app
from deltaserve.server.serving import BackgroundServer

PIECES, EVERY_S = 400, 0.02  # each request would take 8 s; the drain gives it 0.5 s


class SlowStream:
    def __init__(self, request_id: str, n: int) -> None:
        self.request_id, self.n, self.aborted = request_id, n, False

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._run()

    async def _run(self) -> AsyncIterator[RequestOutput]:
        for j in range(PIECES):
            if self.aborted:
                for i in range(self.n):
                    yield RequestOutput(
                        request_id=self.request_id,
                        token_ids=[],
                        text="",
                        index=i,
                        finished=True,
                        finish_reason="abort",
                    )
                return
            await asyncio.sleep(EVERY_S)
            for i in range(self.n):
                yield RequestOutput(
                    request_id=self.request_id, token_ids=[j], text="x", index=i, num_prompt_tokens=3
                )

    async def aclose(self) -> None:
        self.aborted = True


class SlowEngine:
    """Streams ``PIECES`` tokens per completion; ``abort`` ends a request with ``abort``."""

    def __init__(self) -> None:
        self.config = SimpleNamespace(model=SimpleNamespace(path="slow"))
        self.model_info = ModelInfo(
            name="slow",
            model_type="slow",
            max_model_len=4096,
            vocab_size=100,
            block_size=16,
            checkpoint_unit=64,
        )
        self.started = True
        self.streams: dict[str, SlowStream] = {}

    def is_healthy(self) -> bool:
        return True

    def stats(self) -> dict[str, Any]:
        return {}

    def generate(self, prompt: Any, params: SamplingParams, **kw: Any) -> SlowStream:
        rid = f"r{len(self.streams)}"
        self.streams[rid] = SlowStream(rid, params.n)
        return self.streams[rid]

    def abort(self, request_id: str) -> asyncio.Future[bool]:
        fut = asyncio.get_running_loop().create_future()
        stream = self.streams.get(request_id)
        if stream is not None:
            stream.aborted = True
        fut.set_result(stream is not None)
        return fut


async def test_a_drain_that_runs_out_of_time_answers_every_open_request(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    engine = SlowEngine()
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": PIECES}
    async with httpx.AsyncClient(timeout=30) as http:
        srv = BackgroundServer(create_app(engine), drain_timeout_s=0.5)
        await srv.__aenter__()

        async def stream(path: str, body: dict[str, Any]) -> list[str]:
            async with http.stream("POST", srv.url + path, json={**body, "stream": True}) as r:
                assert r.status_code == 200
                return [ln[6:] async for ln in r.aiter_lines() if ln.startswith("data: ")]

        tasks = [
            asyncio.ensure_future(stream("/v1/chat/completions", chat)),
            asyncio.ensure_future(stream("/v1/chat/completions", {**chat, "n": 2})),
            asyncio.ensure_future(stream("/v1/completions", {"prompt": ["a", "b"], "max_tokens": PIECES})),
            asyncio.ensure_future(http.post(srv.url + "/v1/chat/completions", json=chat)),
            asyncio.ensure_future(http.post(srv.url + "/v1/completions", json={"prompt": "a", "n": 2})),
        ]
        await asyncio.sleep(0.3)  # every request is in flight
        t0 = time.monotonic()
        await srv.__aexit__(None, None, None)  # drain: 0.5 s, then what is open is answered
        assert time.monotonic() - t0 < 5
        *streams, full_chat, full_completion = await asyncio.gather(*tasks)
    for frames in streams:
        assert frames[-1] == "[DONE]"
        err = json.loads(frames[-2])["error"]
        assert err["code"] == "engine_shutdown" and err["type"] == "service_unavailable_error"
        assert len(frames) > 5  # it streamed before the deadline
    for r in (full_chat, full_completion):
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_shutdown"
    ours = [rec for rec in caplog.records if rec.name.startswith(("deltaserve", "uvicorn"))]
    assert not [rec for rec in ours if rec.exc_info or rec.levelno >= logging.ERROR]
    assert all(s.aborted for s in engine.streams.values())
