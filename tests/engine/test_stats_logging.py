"""``logging.stats_interval_s`` logs ``engine.stats`` in every placement, with the same fields, and
the numbers count the work done: the engine core on a thread of this process (``AsyncEngine``),
in a process of its own (``AsyncEngine`` over ``ProcCoreClient``), and ``deltaserve serve`` as a user runs it (the
default placement: a separate core process)."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from deltaserve.engine import AsyncEngine, EngineConfig, EngineCore, SamplingParams
from deltaserve.engine.front.client import EngineClient
from deltaserve.models import LoadedModel
from tests.engine.conftest import separate
from tests.serve_procs import SERVE

SETTINGS: dict[str, Any] = {
    "model.device": "cpu",
    "model.dtype": "float32",
    "scheduler.max_num_batched_tokens": 256,
    "scheduler.max_num_seqs": 8,
    "cache.memory_bytes": 64 * 1024**2,
    "logging.level": "info",
    "logging.stats_interval_s": 0.2,
}
FIELDS = {"gen_tok_s", "steps_s", "running", "waiting", "kv_usage", "hit_rate", "checkpoints",
          "preemptions", "finished", "generated"}  # fmt: skip
#: a prompt of several cache blocks: the second request with it hits the prefix cache
PROMPT = " ".join(f"word{i}" for i in range(48))
MAX_TOKENS = 8
LINE = re.compile(r"engine\.stats((?: \w+=\S+)+)")


def parse(line: str) -> dict[str, float] | None:
    """The fields of an ``engine.stats`` log line (``event key=value ...``); None for other lines."""
    m = LINE.search(line)
    if m is None:
        return None
    return {k: float(v) for k, v in (kv.split("=", 1) for kv in m.group(1).split())}


async def wait_for(
    lines: Callable[[], list[dict[str, float]]], done: int, timeout: float = 30.0
) -> dict[str, float]:
    """The first stats line that counts ``done`` finished requests (lines come every interval)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for fields in lines():
            if fields["finished"] >= done:
                return fields
        await asyncio.sleep(0.05)  # (the in-process engine runs on this event loop)
    raise AssertionError(f"no engine.stats line with finished={done} within {timeout} s: {lines()}")


def check(fields: dict[str, float], lines: list[dict[str, float]]) -> None:
    """The last line after two requests of ``MAX_TOKENS`` tokens, the second a prefix hit."""
    assert set(fields) == FIELDS
    assert fields["finished"] == 2 and fields["generated"] == 2 * MAX_TOKENS
    assert fields["running"] == 0 and fields["waiting"] == 0
    assert fields["hit_rate"] > 0
    # some line saw the work: tokens per second counted in its window
    assert any(f["gen_tok_s"] > 0 and f["steps_s"] > 0 for f in lines)


async def two_requests(engine: EngineClient[Any]) -> None:
    """The same prompt twice, one after the other: the second hits the prefix cache."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    for _ in range(2):
        outs = [o async for o in engine.generate(PROMPT, params)]
        assert outs[-1].finish_reason == "length"
    assert outs[0].num_cached_tokens > 0


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[dict[str, float]] = []

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "event", None) == "engine.stats":
            self.lines.append({k: float(v) for k, v in record.fields.items()})  # type: ignore[attr-defined]


@pytest.fixture
def records() -> Iterator[Records]:
    handler = Records()
    logger = logging.getLogger("deltaserve.engine")
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)


@pytest.mark.asyncio
async def test_in_process_engine_logs_stats(tiny_loaded: LoadedModel, records: Records) -> None:
    config = EngineConfig.load(None, dict(SETTINGS))
    async with AsyncEngine(core=EngineCore(config, loaded=tiny_loaded)) as engine:
        await two_requests(engine)
        fields = await wait_for(lambda: list(records.lines), done=2)
    check(fields, records.lines)


@pytest.mark.asyncio
async def test_core_process_logs_stats(capfd: pytest.CaptureFixture[str]) -> None:
    # the core process inherits this process's stderr (captured at the descriptor) and logs there
    seen: list[str] = []

    def lines() -> list[dict[str, float]]:
        seen.append(capfd.readouterr().err)
        return [f for f in map(parse, "".join(seen).splitlines()) if f is not None]

    async with AsyncEngine(separate(EngineConfig.load(None, dict(SETTINGS)))) as client:
        await two_requests(client)
        fields = await wait_for(lines, done=2)
    check(fields, lines())


@pytest.mark.slow  # the separate core process is covered by the test above in the default run
@pytest.mark.asyncio
async def test_serve_logs_stats() -> None:
    """``deltaserve serve`` in its default placement (a separate core process) logs stats."""
    settings = [a for k, v in SETTINGS.items() if k != "logging.level" for a in ("--set", f"{k}={v}")]
    cmd = [*SERVE, "--port", "0", "--log-level", "info", *settings]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    stderr: list[str] = []
    assert proc.stderr is not None and proc.stdout is not None
    reader = threading.Thread(target=lambda: stderr.extend(proc.stderr or []), daemon=True)
    reader.start()
    try:
        first = proc.stdout.readline()
        assert " at http://127.0.0.1:" in first, first + "".join(stderr)
        url = first.split(" at ")[1].split()[0]
        body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0.0}
        with httpx.Client(base_url=url, timeout=60) as http:
            for _ in range(2):
                resp = http.post("/completions", json=body)
                assert resp.status_code == 200, resp.text
                assert resp.json()["choices"][0]["finish_reason"] == "length"

        def lines() -> list[dict[str, float]]:
            return [f for f in map(parse, list(stderr)) if f is not None]

        fields = await wait_for(lines, done=2)
        check(fields, lines())
        assert any("core_proc.ready" in line for line in stderr)  # the default placement, indeed
    finally:
        proc.terminate()
        proc.wait(30)
        reader.join(10)
