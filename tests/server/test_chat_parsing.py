"""Tool calls and reasoning through the real server and the official client.

The random-weight model never writes ``<think>`` or ``<tool_call>``, so the engine here is the
scripted stand-in of ``test_scripted_engine`` over the real built-in tokenizer with the
Qwen3.5-style chat template (what ``tools/make_shaped_model.py`` writes): the scripted reply is
tokenized and sent one token's text at a time, as the engine's detokenizer sends it. One
server picks its parsers from the template (qwen3_xml, qwen3); another is told
``--tool-call-parser hermes --reasoning-parser none``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import pytest_asyncio

from deltaserve.engine.front.input_processor import InputProcessor
from deltaserve.server.app import create_app
from deltaserve.server.config import ServerConfig
from deltaserve.server.reasoning import ReasoningParserName
from deltaserve.server.serving import BackgroundServer
from deltaserve.server.tool_parsers import ToolParserName
from deltaserve.tools.qwen35_template import QWEN35_CHAT_TEMPLATE
from tests.server.test_scripted_engine import ScriptedEngine

pytestmark = pytest.mark.asyncio(loop_scope="module")

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]
MESSAGES = [{"role": "user", "content": "Weather in Paris and Rome?"}]
XML_CALLS = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
    "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
    "Rome, Italy\n</parameter>\n</function>\n</tool_call>"
)
XML_REPLY = "Two cities: two calls.\n</think>\n\nLet me check both.\n\n" + XML_CALLS
HERMES_REPLY = (
    'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
)


@dataclass
class Servers:
    engine: ScriptedEngine
    auto: str  # parsers from the template
    hermes: str  # --tool-call-parser hermes --reasoning-parser none
    tokenizer: Any = field(repr=False)

    def say(self, text: str, finish_reason: str = "stop") -> None:
        """The engine's next reply: ``text``, one token's text per output."""
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        pieces, prev = [], ""
        for k in range(1, len(ids) + 1):
            now = self.tokenizer.decode(ids[:k])
            pieces.append(now[len(prev) :])
            prev = now
        assert "".join(pieces) == text and len(pieces) > 3
        self.engine.script, self.engine.finish_reason = pieces, finish_reason


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def servers() -> AsyncIterator[Servers]:
    from transformers import AutoTokenizer

    from deltaserve.models import ensure_builtin_model

    tokenizer = AutoTokenizer.from_pretrained(ensure_builtin_model("tiny-qwen3.5"))
    tokenizer.chat_template = QWEN35_CHAT_TEMPLATE
    engine = ScriptedEngine()
    engine.input_processor = InputProcessor(
        tokenizer, max_model_len=4096, vocab_size=len(tokenizer), salt_parts=("scripted",)
    )
    hermes = ServerConfig(tool_call_parser=ToolParserName.HERMES, reasoning_parser=ReasoningParserName.NONE)
    async with (
        BackgroundServer(create_app(engine)) as auto,
        BackgroundServer(create_app(engine, hermes)) as h,
    ):
        yield Servers(engine, auto.url, h.url, tokenizer)


def client(url: str) -> Any:
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30.0)


@dataclass
class Streamed:
    content: str = ""
    reasoning: str = ""
    calls: list[Any] = field(default_factory=list)  # every tool_calls delta, in order
    reasons: list[str] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)  # per chunk: what its delta carried


async def stream(url: str, **kw: Any) -> Streamed:
    out = Streamed()
    async for chunk in await client(url).chat.completions.create(model="scripted", stream=True, **kw):
        for c in chunk.choices:
            d = c.delta
            reasoning = getattr(d, "reasoning_content", None)
            out.content += d.content or ""
            out.reasoning += reasoning or ""
            out.calls += d.tool_calls or []
            out.reasons += [c.finish_reason] if c.finish_reason else []
            out.kinds += [k for k, v in (("c", d.content), ("r", reasoning), ("t", d.tool_calls)) if v]
    return out


def calls_of(deltas: list[Any]) -> list[tuple[str, str, str]]:
    """``(id, name, arguments)`` per call from its deltas; checks the OpenAI streaming shape:
    the first delta of a call has its id, type and name with arguments "", later ones only
    argument pieces."""
    calls: dict[int, list[Any]] = {}
    for d in deltas:
        calls.setdefault(d.index, []).append(d)
    out = []
    for index in sorted(calls):
        head, *rest = calls[index]
        assert head.id.startswith("call_") and head.type == "function" and head.function.arguments == ""
        assert all(d.id is None and d.function.name is None for d in rest)
        out.append((head.id, head.function.name, "".join(d.function.arguments for d in rest)))
    return out


async def test_xml_calls_after_reasoning(servers: Servers) -> None:
    servers.say(XML_REPLY)
    resp = await client(servers.auto).chat.completions.create(
        model="scripted", messages=MESSAGES, tools=TOOLS
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check both."
    assert choice.message.reasoning_content == "Two cities: two calls."
    whole = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert whole == [("get_weather", {"city": "Paris", "days": 3}), ("get_weather", {"city": "Rome, Italy"})]

    got = await stream(servers.auto, messages=MESSAGES, tools=TOOLS)
    assert got.reasoning == "Two cities: two calls." and got.content == "Let me check both."
    assert got.reasons == ["tool_calls"]
    streamed = calls_of(got.calls)
    assert [(name, args) for _, name, args in streamed] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls
    ]
    assert len([d for d in got.calls if d.index == 0]) > 3  # the arguments came in pieces
    # reasoning first, then content, then the calls; the role chunk aside, no empty chunks
    assert got.kinds == sorted(got.kinds, key="rct".index) and got.kinds.count("r") > 1


async def test_hermes_calls(servers: Servers) -> None:
    servers.say(HERMES_REPLY)
    resp = await client(servers.hermes).chat.completions.create(
        model="scripted", messages=MESSAGES, tools=TOOLS
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    ((call),) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == '{"city": "Paris", "days": 3}'
    got = await stream(servers.hermes, messages=MESSAGES, tools=TOOLS)
    ((_, name, args),) = calls_of(got.calls)
    assert (got.content, name, args, got.reasons) == (
        "Checking.",
        "get_weather",
        call.function.arguments,
        ["tool_calls"],
    )
    assert len(got.calls) > 3
    # --reasoning-parser none: think text stays content
    servers.say("Hmm.\n</think>\n\nHi.")
    resp = await client(servers.hermes).chat.completions.create(model="scripted", messages=MESSAGES)
    assert resp.choices[0].message.content == "Hmm.\n</think>\n\nHi."
    assert resp.choices[0].message.reasoning_content is None


async def test_reasoning_without_tools(servers: Servers) -> None:
    # the template's generation prompt opens <think>: the model writes only </think>
    prompt = servers.tokenizer.decode(servers.engine.input_processor.tokenize(MESSAGES))
    assert prompt.endswith("<|im_start|>assistant\n<think>\n")
    reply = "The capital of France.\nIt is Paris.\n</think>\n\nParis."
    servers.say(reply)
    resp = await client(servers.auto).chat.completions.create(model="scripted", messages=MESSAGES, n=2)
    for c in resp.choices:
        assert c.message.reasoning_content == "The capital of France.\nIt is Paris."
        assert c.message.content == "Paris." and c.finish_reason == "stop" and c.message.tool_calls is None
    got = await stream(servers.auto, messages=MESSAGES)
    assert (got.reasoning, got.content, got.reasons) == (
        "The capital of France.\nIt is Paris.",
        "Paris.",
        ["stop"],
    )
    assert got.kinds.count("r") > 3 and got.kinds == sorted(got.kinds, key="rc".index)
    # cut by max_tokens before </think>: all reasoning, no content
    servers.say("Still thinking about it", finish_reason="length")
    resp = await client(servers.auto).chat.completions.create(model="scripted", messages=MESSAGES)
    msg = resp.choices[0].message
    assert (msg.reasoning_content, msg.content, resp.choices[0].finish_reason) == (
        "Still thinking about it",
        None,
        "length",
    )


async def test_enable_thinking_false(servers: Servers) -> None:
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}}
    prompt = servers.tokenizer.decode(
        servers.engine.input_processor.tokenize(MESSAGES, chat_template_kwargs=kwargs["chat_template_kwargs"])
    )
    assert prompt.endswith("<think>\n\n</think>\n\n")
    servers.say("Paris.\n</think> is a tag")  # nothing generated is reasoning
    resp = await client(servers.auto).chat.completions.create(
        model="scripted", messages=MESSAGES, extra_body=kwargs
    )
    assert resp.choices[0].message.content == "Paris.\n</think> is a tag"
    assert resp.choices[0].message.reasoning_content is None
    got = await stream(servers.auto, messages=MESSAGES, extra_body=kwargs)
    assert (got.content, got.reasoning) == ("Paris.\n</think> is a tag", "")
    _, _, kw = servers.engine.calls[-1]
    assert kw["chat_template_kwargs"] == {"enable_thinking": False}
    # a call without reasoning
    servers.say(XML_CALLS)
    resp = await client(servers.auto).chat.completions.create(
        model="scripted", messages=MESSAGES, tools=TOOLS, extra_body=kwargs
    )
    assert resp.choices[0].message.content is None and len(resp.choices[0].message.tool_calls) == 2


MALFORMED = (
    "Done.\n</think>\n\nI will call <tool_call>\n<function=get weather>\n</function>\n</tool_call> now."
)


async def test_malformed_blocks_are_content(servers: Servers) -> None:
    servers.say(MALFORMED)
    resp = await client(servers.auto).chat.completions.create(
        model="scripted", messages=MESSAGES, tools=TOOLS
    )
    choice = resp.choices[0]
    content = MALFORMED.split("\n\n", 1)[1]
    assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (
        content,
        None,
        "stop",
    )
    got = await stream(servers.auto, messages=MESSAGES, tools=TOOLS)
    assert (got.content, got.calls, got.reasons) == (content, [], ["stop"])
    servers.say('<tool_call>{"name": 5}</tool_call>')
    resp = await client(servers.hermes).chat.completions.create(
        model="scripted", messages=MESSAGES, tools=TOOLS
    )
    assert resp.choices[0].message.content == '<tool_call>{"name": 5}</tool_call>'


async def test_tool_choice_none_and_a_cut_call(servers: Servers) -> None:
    servers.say(XML_REPLY)
    resp = await client(servers.auto).chat.completions.create(
        model="scripted", messages=MESSAGES, tools=TOOLS, tool_choice="none"
    )
    msg = resp.choices[0].message
    assert msg.tool_calls is None and msg.content == "Let me check both.\n\n" + XML_CALLS
    assert msg.reasoning_content == "Two cities: two calls."
    # cut by max_tokens inside a call: the call keeps what arrived, the reason stays "length"
    servers.say("Ok.\n</think>\n\n" + XML_CALLS[:60], finish_reason="length")
    got = await stream(servers.auto, messages=MESSAGES, tools=TOOLS)
    ((_, name, args),) = calls_of(got.calls)
    assert (name, json.loads(args), got.reasons) == ("get_weather", {"city": "Paris"}, ["length"])


async def test_assistant_calls_go_back_through_the_template(servers: Servers) -> None:
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]  # fmt: skip
    servers.say("Sunny.\n</think>\n\nIt is sunny in Paris.")
    resp = await client(servers.auto).chat.completions.create(
        model="scripted", messages=messages, tools=TOOLS
    )
    assert resp.choices[0].message.content == "It is sunny in Paris."
    prompt = servers.tokenizer.decode(
        servers.engine.input_processor.tokenize(servers.engine.calls[-1][0], tools=TOOLS)
    )
    assert (
        "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>"
        in prompt
    )
    assert "<tool_response>\nsunny\n</tool_response>" in prompt and '"name": "get_weather"' in prompt
