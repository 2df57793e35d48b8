"""The server's event loop while a long prompt arrives: its longest stall, with long prompts
tokenized off the loop (``server/offload.py``) and, in the same run, on it.

The built-in model is served in this process (``BackgroundServer``); ``--streams`` streaming
chats run while one chat of ``--chars`` characters is sent. A probe on the server's event
loop sleeps 1 ms at a time and records how late it wakes: the longest lateness is the longest
time no stream got a byte out. The two modes run as ``--repeats`` interleaved rounds
(``harness.interleaved_async``).

    python tools/bench/bench_loop_stall.py [--chars 100000] [--streams 16] [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from deltaserve.engine import AsyncEngine, EngineConfig, install_uvloop
from deltaserve.logs import configure_logging
from deltaserve.server import offload
from deltaserve.server.app import create_app
from deltaserve.server.serving import BackgroundServer
from deltaserve.tools.bench.harness import (
    Bench,
    bench_parser,
    describe_box,
    interleaved_async,
    scaled,
    spread,
)


async def _stream(http: httpx.AsyncClient, tokens: int) -> None:
    body = {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": tokens,
            "ignore_eos": True, "stream": True}  # fmt: skip
    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
        async for _ in r.aiter_lines():
            pass


async def one_run(url: str, chars: int, streams: int, tokens: int) -> float:
    """The longest stall of the loop (seconds) while the long prompt goes through."""
    lag, done = [0.0], asyncio.Event()

    async def probe() -> None:
        while not done.is_set():
            t0 = time.perf_counter()
            await asyncio.sleep(0.001)
            lag[0] = max(lag[0], time.perf_counter() - t0 - 0.001)

    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        running = [asyncio.ensure_future(_stream(http, tokens)) for _ in range(streams)]
        await asyncio.sleep(1.0)  # the streams are decoding
        watcher = asyncio.ensure_future(probe())
        long_chat = {"messages": [{"role": "user", "content": "word " * (chars // 5)}], "max_tokens": 1}
        r = await http.post("/v1/chat/completions", json=long_chat)
        done.set()
        await watcher
        for t in running:
            t.cancel()
        await asyncio.gather(*running, return_exceptions=True)
    if r.status_code not in (200, 400):  # 400: longer than max_model_len allows (still tokenized)
        raise RuntimeError(f"long prompt: {r.status_code} {r.text[:200]}")
    return lag[0]


async def amain(args: argparse.Namespace) -> dict[str, Any]:
    config = EngineConfig.load(None, {"cache.memory_bytes": 512 << 20, "logging.stats_interval_s": 0})
    engine = AsyncEngine(config)
    threshold = offload.LONG_PROMPT_CHARS
    async with engine, BackgroundServer(create_app(engine)) as srv:

        def mode(chars: int) -> Callable[[], Awaitable[float]]:
            async def run() -> float:
                offload.LONG_PROMPT_CHARS = chars
                return await one_run(srv.url, args.chars, args.streams, args.tokens)

            return run

        try:
            results = await interleaved_async(
                {"off the loop": mode(threshold), "on the loop": mode(10**12)}, args.repeats
            )
        finally:
            offload.LONG_PROMPT_CHARS = threshold
    return {mode: {"runs_ms": [round(x * 1000, 1) for x in xs], "ms": scaled(spread(xs), 1000, 1)}
            for mode, xs in results.items()}  # fmt: skip


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--chars", type=int, default=100_000, help="characters of the long prompt")
    parser.add_argument("--streams", type=int, default=16, help="streams running meanwhile")
    parser.add_argument("--tokens", type=int, default=2048, help="max_tokens of each stream")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds of the two modes")
    args = parser.parse_args()
    bench = Bench("bench_loop_stall", args)
    configure_logging("warning")
    install_uvloop()
    out = asyncio.run(amain(args))
    for mode, r in out.items():
        print(f"{mode:>13}: longest loop stall median {r['ms']['median']:8.1f} ms  (runs {r['runs_ms']})")
    on, off = out["on the loop"]["ms"]["median"], out["off the loop"]["ms"]["median"]
    print(f"on / off: {on / off:.1f}x" if off else "")
    print(describe_box(bench.before))
    bench.write(args.json, out)


if __name__ == "__main__":
    from deltaserve.engine.cli import run_tool

    run_tool(main, "bench_loop_stall")
