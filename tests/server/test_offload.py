"""Long prompts are rendered and tokenized off the event loop: while one is tokenized the loop
goes on; it reaches the engine as the same token ids. Short ones stay as they are. Over the
scripted stand-in engine (which tokenizes at ``generate``, as the real one does) with a slow
tokenizer, on 127.0.0.1."""

from __future__ import annotations

import asyncio
import time

import httpx

from deltaserve.server.app import create_app
from deltaserve.server.offload import LONG_PROMPT_CHARS
from deltaserve.server.serving import BackgroundServer
from tests.server.test_scripted_engine import CharTokenizer, ScriptedEngine

DELAY_S = 0.6


async def test_a_long_prompt_is_tokenized_while_the_loop_goes_on() -> None:
    engine = ScriptedEngine()
    tokenizer = engine.input_processor.tokenizer
    assert isinstance(tokenizer, CharTokenizer)
    tokenizer.delay_s = DELAY_S
    engine.script = ["done"]
    long_text = "y" * (LONG_PROMPT_CHARS + 1)
    async with BackgroundServer(create_app(engine)) as srv:
        http = httpx.AsyncClient(base_url=srv.url, timeout=30)
        # the server runs on this test's event loop: a probe that sleeps 10 ms at a time sees
        # every stall of the loop as lateness
        lag, done = [0.0], asyncio.Event()

        async def probe() -> None:
            while not done.is_set():
                t0 = time.monotonic()
                await asyncio.sleep(0.01)
                lag[0] = max(lag[0], time.monotonic() - t0 - 0.01)

        watcher = asyncio.ensure_future(probe())
        r_chat, r_completion = await asyncio.gather(
            http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": long_text}]}),
            http.post("/v1/completions", json={"prompt": long_text}),
        )
        done.set()
        await watcher
        assert r_chat.status_code == 200 and r_completion.status_code == 200
        assert lag[0] < DELAY_S / 2, lag  # the loop never waited for a tokenization

        # the engine got token ids (the template's rendering, tokenized), no template arguments
        tokenizer.delay_s = 0.0
        prompts = sorted(call[0] for call in engine.calls)
        assert prompts == sorted([tokenizer.encode(f"<user>{long_text}"), tokenizer.encode(long_text)])
        assert all("tools" not in kw and "chat_template_kwargs" not in kw for _, _, kw in engine.calls)

        # a short prompt goes to the engine as it is
        r = await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200 and engine.calls[-1][0] == [{"role": "user", "content": "hi"}]
        await http.aclose()
