"""Reasoning and XML tool calls end to end: the real engine (scheduler, tiny model, incremental
detokenizer, stop on EOS) behind the real server, with only its sampling scripted.

The random weights never write ``<think>`` or ``<tool_call>``, so the runner's sampling is
replaced in this test: each request's k-th generated token is the k-th token of the scripted
reply, then ``<|im_end|>`` (the model's EOS). The model folder is the built-in tiny model with
the Qwen3.5-style template, as ``tools/make_shaped_model.py`` writes it; the server picks its
parsers from that template.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import torch

from deltaserve.engine import AsyncEngine, EngineCore
from deltaserve.engine.runner.model_runner import PreparedStep
from deltaserve.kernels import get_ops
from deltaserve.models import ensure_builtin_model, load_model
from deltaserve.server.app import create_app
from deltaserve.server.serving import BackgroundServer
from deltaserve.tools.make_shaped_model import save_tokenizer
from tests.server.conftest import server_engine_config

pytestmark = pytest.mark.asyncio(loop_scope="module")

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "metric": {"type": "boolean"},
                },
            },
        },
    }
]
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
REPLY = (
    "The user wants the weather in Paris, for three days.\n</think>\n\nLet me look that up.\n\n"
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis, Île-de-France\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n</function>\n</tool_call>"
)


class ScriptedSampler:
    """Replaces a runner's sampling: request row r gets ``ids[len(r.output_token_ids)]``."""

    def __init__(self, core: EngineCore) -> None:
        self.tokenizer = core.tokenizer
        self.eos = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.ids: list[int] = [self.eos]
        core.runner._sample = self._sample  # type: ignore[method-assign]

    def say(self, text: str) -> None:
        self.ids = [*self.tokenizer.encode(text, add_special_tokens=False), self.eos]

    def _sample(self, logits: torch.Tensor, prep: PreparedStep) -> tuple[torch.Tensor, None]:
        rows = [self.ids[min(len(r.output_token_ids), len(self.ids) - 1)] for r in prep.requests]
        return torch.tensor(rows, dtype=torch.int64, device=logits.device), None


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple[ScriptedSampler, Any, Any]]:
    from openai import AsyncOpenAI

    folder = Path(tmp_path_factory.mktemp("model")) / "qwen35-tiny"
    shutil.copytree(ensure_builtin_model("tiny-qwen3.5"), folder)
    save_tokenizer(folder)
    loaded = load_model(folder, dtype=torch.float32, device="cpu", ops=get_ops("reference"))
    core = EngineCore(server_engine_config(**{"model.path": str(folder)}), loaded=loaded)
    sampler = ScriptedSampler(core)
    engine = AsyncEngine(core=core)
    await engine.start()
    try:
        app = create_app(engine)
        async with BackgroundServer(app) as srv:
            yield (
                sampler,
                AsyncOpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60.0),
                app,
            )
    finally:
        await engine.shutdown()


async def test_reasoning_then_a_tool_call(served: tuple[ScriptedSampler, Any, Any]) -> None:
    sampler, client, app = served
    sampler.say(REPLY)
    model = (await client.models.list()).data[0].id
    resp = await client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, temperature=0)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look that up."
    assert choice.message.reasoning_content == "The user wants the weather in Paris, for three days."
    ((call),) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris, Île-de-France", "days": 3, "metric": True}
    assert resp.usage.completion_tokens == len(sampler.ids)
    parsing = app.state.server.parsing  # what the template asked for
    assert (parsing.tool_parser.value, parsing.reasoning_parser.value) == ("qwen3_xml", "qwen3")

    reasoning, content, deltas, reasons = "", "", [], []
    stream = await client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, stream=True)
    async for chunk in stream:
        for c in chunk.choices:
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            content += c.delta.content or ""
            deltas += c.delta.tool_calls or []
            reasons += [c.finish_reason] if c.finish_reason else []
    assert (reasoning, content, reasons) == (
        choice.message.reasoning_content,
        "Let me look that up.",
        ["tool_calls"],
    )
    head, *rest = deltas
    assert (head.index, head.id, head.type, head.function.name, head.function.arguments) == (
        0, head.id, "function", "get_weather", "",
    )  # fmt: skip
    assert head.id.startswith("call_") and len(rest) >= 3 and all(d.function.name is None for d in rest)
    assert "".join(d.function.arguments for d in rest) == call.function.arguments


async def test_enable_thinking_false_and_a_cut_reply(served: tuple[ScriptedSampler, Any, Any]) -> None:
    sampler, client, _ = served
    model = (await client.models.list()).data[0].id
    sampler.say("Paris is sunny.")
    resp = await client.chat.completions.create(
        model=model, messages=MESSAGES, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    msg = resp.choices[0].message
    assert (msg.content, msg.reasoning_content, resp.choices[0].finish_reason) == (
        "Paris is sunny.",
        None,
        "stop",
    )
    # the template opened <think>: a reply cut before </think> is all reasoning
    sampler.say("Thinking about Paris and about the weather there for a long while")
    resp = await client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=5)
    msg = resp.choices[0].message
    assert resp.choices[0].finish_reason == "length" and msg.content is None
    assert msg.reasoning_content == sampler.tokenizer.decode(sampler.ids[:5]).strip()
    assert len(msg.reasoning_content) > 5
