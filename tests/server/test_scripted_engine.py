"""The HTTP layer over a scripted stand-in engine: outputs the tiny random model never
produces (tool calls), and the engine's failure modes (overload, a dead engine, a failed request)."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import pytest_asyncio

from deltaserve.engine import EngineDeadError, EngineOverloadedError, RequestOutput, SamplingParams
from deltaserve.engine.front.client import ModelInfo
from deltaserve.engine.front.input_processor import InputProcessor
from deltaserve.server.app import create_app
from deltaserve.server.serving import BackgroundServer

pytestmark = pytest.mark.asyncio(loop_scope="module")

TOOL_TEXT = 'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


class CharTokenizer:
    """One token per character (id = code point mod 100); ``delay_s`` per encode; records the
    threads it encoded on."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.threads: list[str] = []

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        self.threads.append(threading.current_thread().name)
        time.sleep(self.delay_s)
        return [ord(c) % 100 for c in text]

    def apply_chat_template(self, messages: list[dict[str, Any]], tokenize: bool = False, **kw: Any) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(i) for i in ids)


class ScriptedEngine:
    """Yields ``script`` (text pieces) as one token each, or raises ``fail`` at ``generate``."""

    def __init__(self) -> None:
        self.config = SimpleNamespace(model=SimpleNamespace(path="scripted"))
        self.model_info = ModelInfo(
            name="scripted", model_type="scripted", max_model_len=4096, vocab_size=100, block_size=16,
            checkpoint_unit=64,
        )  # fmt: skip
        self.started = True  # the app does not own it
        self.input_processor = InputProcessor(
            CharTokenizer(),
            max_model_len=1 << 20,
            vocab_size=100,
            salt_parts=("scripted",),
            max_token_chars=1,
        )
        self.script: list[str] = []
        self.finish_reason = "stop"
        self.error: str | None = None
        self.fail: Exception | None = None
        self.healthy = True
        self.calls: list[tuple[Any, SamplingParams, dict[str, Any]]] = []

    def is_healthy(self) -> bool:
        return self.healthy

    def stats(self) -> dict[str, Any]:
        return {"scheduler.running": 0, "scheduler.waiting": 0}

    def generate(self, prompt: Any, params: SamplingParams, **kw: Any) -> AsyncIterator[RequestOutput]:
        if self.fail is not None:
            raise self.fail
        # validated and tokenized at the call, as the real engine does
        self.input_processor.tokenize(
            prompt, tools=kw.get("tools"), chat_template_kwargs=kw.get("chat_template_kwargs")
        )
        self.calls.append((prompt, params, kw))
        return self._run(params)

    async def _run(self, params: SamplingParams) -> AsyncIterator[RequestOutput]:
        for i in range(params.n):
            for j, piece in enumerate(self.script):
                last = j == len(self.script) - 1
                yield RequestOutput(
                    request_id="r", token_ids=[j], text=piece, index=i, num_prompt_tokens=7, finished=last,
                    finish_reason=self.finish_reason if last else None, error=self.error if last else None,
                )  # fmt: skip


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def scripted() -> AsyncIterator[tuple[ScriptedEngine, str]]:
    engine = ScriptedEngine()
    async with BackgroundServer(create_app(engine)) as srv:
        yield engine, srv.url


@pytest.fixture
def engine(scripted: tuple[ScriptedEngine, str]) -> ScriptedEngine:
    e = scripted[0]
    e.script, e.finish_reason, e.error, e.fail, e.healthy = [], "stop", None, None, True
    return e


def client(url: str) -> Any:
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30.0)


async def test_tool_call_round_trip(engine: ScriptedEngine, scripted: tuple[ScriptedEngine, str]) -> None:
    engine.script = [TOOL_TEXT[i : i + 5] for i in range(0, len(TOOL_TEXT), 5)]
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    resp = await client(scripted[1]).chat.completions.create(
        model="scripted", messages=messages, tools=TOOLS, extra_body={"chat_template_kwargs": {"x": 1}}
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    _, _, kw = engine.calls[-1]
    assert kw["tools"][0]["function"]["name"] == "get_weather" and kw["chat_template_kwargs"] == {"x": 1}

    # streamed: content first, the call (its name, then its arguments in pieces), then finish_reason
    stream = await client(scripted[1]).chat.completions.create(
        model="scripted", messages=messages, tools=TOOLS, stream=True
    )
    content, calls, reasons = "", [], []
    async for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            calls += c.delta.tool_calls or []
            reasons += [c.finish_reason] if c.finish_reason else []
    assert content == "Checking." and reasons == ["tool_calls"]
    assert [c.function.name for c in calls if c.function.name] == ["get_weather"]
    assert calls[0].id.startswith("call_")
    assert json.loads("".join(c.function.arguments for c in calls)) == {"city": "Paris"}

    # the next turn sends the call and its result back: accepted, passed to the template
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    engine.script = ["It is sunny."]
    resp = await client(scripted[1]).chat.completions.create(model="scripted", messages=messages, tools=TOOLS)
    assert resp.choices[0].message.content == "It is sunny." and resp.choices[0].finish_reason == "stop"
    sent = engine.calls[-1][0]
    assert sent[1]["tool_calls"][0]["function"]["name"] == "get_weather" and sent[1]["content"] == ""
    assert sent[2] == {"role": "tool", "content": "sunny", "tool_call_id": call.id}

    # tool_choice none: text stays text
    engine.script = [TOOL_TEXT]
    resp = await client(scripted[1]).chat.completions.create(
        model="scripted", messages=messages, tools=TOOLS, tool_choice="none"
    )
    assert resp.choices[0].message.content == TOOL_TEXT and resp.choices[0].message.tool_calls is None


async def test_engine_errors_map_to_status(
    engine: ScriptedEngine, scripted: tuple[ScriptedEngine, str]
) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}]}
    async with httpx.AsyncClient(base_url=scripted[1], timeout=30) as http:
        for exc, status, code in (
            (EngineOverloadedError("waiting queue is full"), 429, "engine_overloaded"),
            (EngineDeadError("engine loop died"), 503, "engine_dead"),
            (RuntimeError("boom"), 500, "internal_error"),
        ):
            engine.fail = exc
            for path, b in (("/v1/chat/completions", body), ("/v1/completions", {"prompt": "hi"})):
                for stream in (False, True):
                    r = await http.post(path, json={**b, "stream": stream})
                    assert r.status_code == status, (exc, r.text)
                    err = r.json()["error"]
                    assert err["code"] == code and set(err) == {"message", "type", "param", "code"}
                    assert "Traceback" not in err["message"]
        engine.fail = None
        engine.healthy = False
        r = await http.get("/health")
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        r = await http.post("/v1/chat/completions", json=body)
        assert r.status_code == 503
        engine.healthy = True
        # a request the engine ends with an error: 500 with its message, or an error frame in the stream
        engine.script, engine.finish_reason, engine.error = ["a", "b"], "error", "model step failed: X"
        r = await http.post("/v1/chat/completions", json=body)
        assert r.status_code == 500 and "model step failed" in r.json()["error"]["message"]
        r = await http.post("/v1/chat/completions", json={**body, "stream": True})
        frames = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
        assert frames[-1] == "[DONE]"
        assert any("model step failed" in f for f in frames if f.startswith('{"error"'))


async def test_latency_metrics_count_each_of_n_completions(
    engine: ScriptedEngine, scripted: tuple[ScriptedEngine, str]
) -> None:
    """TTFT, ITL and e2e are per completion (docs/server.md): two n=2 requests of 3 tokens each
    are 4 first tokens, 8 gaps between tokens, 4 ends."""

    def counts(text: str) -> list[float]:
        names = ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds")
        return [
            float(re.search(rf'^deltaserve:{n}_count\{{model_name="scripted"\}} (\S+)$', text, re.M).group(1))  # type: ignore[union-attr]
            for n in names
        ]

    engine.script = ["a", "b", "c"]
    async with httpx.AsyncClient(base_url=scripted[1], timeout=30) as http:
        before = counts((await http.get("/metrics")).text)
        for stream in (False, True):
            body = {"messages": [{"role": "user", "content": "hi"}], "n": 2, "stream": stream}
            assert (await http.post("/v1/chat/completions", json=body)).status_code == 200
        after = counts((await http.get("/metrics")).text)
    assert [a - b for a, b in zip(after, before)] == [4, 8, 4]
