"""Structured outputs through a real server with the official ``openai`` client, on the
random-weight built-in model: whatever the model would say, the output matches the constraint
(json_schema whole and streamed, json_object, choice, regex, a grammar), forced tool calls come
back as valid calls of the right function, and an invalid spec is a 400 naming its field."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import openai
import pytest

from deltaserve.engine import AsyncEngine, EngineCore
from deltaserve.server.app import create_app
from deltaserve.server.config import ServerConfig
from deltaserve.server.serving import BackgroundServer

from .conftest import MODEL, Served, server_engine_config

pytestmark = pytest.mark.asyncio(loop_scope="module")

USER = [{"role": "user", "content": "Give me a user record as JSON."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "maxLength": 24},
        "roles": {"type": "array", "items": {"enum": ["admin", "dev", "ops"]}, "maxItems": 3},
        "active": {"type": "boolean"},
        "score": {"type": ["number", "null"]},
    },
    "required": ["name", "age", "email", "roles", "active"],
    "additionalProperties": False,
}
JSON_SCHEMA_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "user", "schema": SCHEMA, "strict": True},
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 20},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    },
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


async def test_json_schema_always_parses_validates_and_finishes(served: Served) -> None:
    client = served.client()
    for seed in range(3):
        r = await client.chat.completions.create(
            model=MODEL, messages=USER, response_format=JSON_SCHEMA_FORMAT, max_tokens=400, seed=seed
        )
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    await served.wait_idle()


async def test_json_schema_streamed_and_on_completions(served: Served) -> None:
    client = served.client()
    stream = await client.chat.completions.create(
        model=MODEL, messages=USER, response_format=JSON_SCHEMA_FORMAT, max_tokens=400, seed=5, stream=True
    )
    text, reasons = "", []
    async for chunk in stream:
        for c in chunk.choices:
            text += c.delta.content or ""
            reasons.append(c.finish_reason)
    assert reasons[-1] == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)
    r = await client.completions.create(
        model=MODEL,
        prompt="User:",
        max_tokens=400,
        seed=6,
        extra_body={"response_format": JSON_SCHEMA_FORMAT},
    )
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)


async def test_n_completions_under_a_schema_are_each_valid(served: Served) -> None:
    r = await served.client().chat.completions.create(
        model=MODEL, messages=USER, response_format=JSON_SCHEMA_FORMAT, max_tokens=400, n=2, seed=9
    )
    assert len(r.choices) == 2
    texts = [c.message.content for c in r.choices]
    for c in r.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
    assert texts[0] != texts[1]


async def test_an_async_scheduling_server_streams_valid_json_for_every_completion(tiny_loaded: Any) -> None:
    core = EngineCore(server_engine_config(**{"engine.async_scheduling": True}), loaded=tiny_loaded)
    engine = AsyncEngine(core=core)
    await engine.start()
    try:
        async with BackgroundServer(create_app(engine, ServerConfig(served_model_names=[MODEL]))) as srv:
            served = Served(engine, srv, None)
            stream = await served.client().chat.completions.create(
                model=MODEL,
                messages=USER,
                response_format=JSON_SCHEMA_FORMAT,
                max_tokens=400,
                n=3,
                seed=2,
                stream=True,
            )
            texts, reasons = ["", "", ""], [None, None, None]
            async for chunk in stream:
                for c in chunk.choices:
                    texts[c.index] += c.delta.content or ""
                    reasons[c.index] = c.finish_reason or reasons[c.index]
            assert reasons == ["stop"] * 3
            for text in texts:
                jsonschema.validate(json.loads(text), SCHEMA)
            await served.wait_idle()
            assert core.num_constrained == 0
    finally:
        await engine.shutdown()


async def test_json_object_parses(served: Served) -> None:
    for seed in range(3):
        r = await served.client().chat.completions.create(
            model=MODEL, messages=USER, response_format={"type": "json_object"}, max_tokens=400, seed=seed
        )
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(r.choices[0].message.content), dict)
        else:  # (an object without a schema is unbounded: a cut-off one is still a prefix of one)
            assert r.choices[0].finish_reason == "length" and r.choices[0].message.content.startswith("{")


async def test_choice_regex_and_grammar_hold(served: Served) -> None:
    client = served.client()
    choices = ["positive", "negative", 'it\'s "mixed"']
    for seed in range(3):
        r = await client.chat.completions.create(
            model=MODEL,
            messages=USER,
            max_tokens=20,
            seed=seed,
            extra_body={"structured_outputs": {"choice": choices}},
        )
        assert r.choices[0].message.content in choices and r.choices[0].finish_reason == "stop"
    pattern = r"[A-Z]{2}-\d{4}(-[a-z]{1,3})?"
    r = await client.completions.create(
        model=MODEL, prompt="Ticket:", max_tokens=30, seed=1, extra_body={"guided_regex": pattern}
    )
    assert re.fullmatch(pattern, r.choices[0].text) and r.choices[0].finish_reason == "stop"
    r = await client.completions.create(
        model=MODEL,
        prompt="Ticket:",
        max_tokens=30,
        seed=2,
        extra_body={"structured_outputs": {"regex": pattern}},
    )
    assert re.fullmatch(pattern, r.choices[0].text)
    grammar = 'root ::= "(" num (" + " num){0,2} ")"\nnum ::= [1-9] [0-9]{0,2}'
    r = await client.completions.create(
        model=MODEL,
        prompt="Sum:",
        max_tokens=40,
        seed=3,
        extra_body={"structured_outputs": {"grammar": grammar}},
    )
    assert re.fullmatch(r"\([1-9]\d{0,2}( \+ [1-9]\d{0,2}){0,2}\)", r.choices[0].text)
    r = await client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=20, extra_body={"guided_choice": ["yes", "no"]}
    )
    assert r.choices[0].message.content in ("yes", "no")


async def test_a_stop_string_still_ends_a_constrained_output(served: Served) -> None:
    """The regex forces a "d" after "abc"; the stop string "d" cuts it there."""
    r = await served.client().completions.create(
        model=MODEL, prompt="x", max_tokens=30, stop=["d"], extra_body={"guided_regex": "abc(d)+e?"}
    )
    assert r.choices[0].text == "abc" and r.choices[0].finish_reason == "stop"


def _check_call(call: Any, name: str | None = None) -> None:
    assert call.type == "function" and call.id
    if name is not None:
        assert call.function.name == name
    jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


async def test_required_and_named_tool_choice_yield_valid_calls(served: Served) -> None:
    client = served.client()
    msgs = [{"role": "user", "content": "What's the weather in Paris?"}]
    for seed in range(2):
        r = await client.chat.completions.create(
            model=MODEL, messages=msgs, tools=TOOLS, tool_choice="required", max_tokens=1000, seed=seed
        )
        c = r.choices[0]
        assert (
            c.finish_reason == "tool_calls" and 1 <= len(c.message.tool_calls) <= 8 and not c.message.content
        )
        for call in c.message.tool_calls:
            _check_call(call)
    r = await client.chat.completions.create(
        model=MODEL,
        messages=msgs,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=300,
    )
    assert r.choices[0].finish_reason == "tool_calls" and len(r.choices[0].message.tool_calls) == 1
    _check_call(r.choices[0].message.tool_calls[0])
    for name in ("get_weather", "add"):
        r = await client.chat.completions.create(
            model=MODEL,
            messages=msgs,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": name}},
            max_tokens=300,
            seed=4,
        )
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
        _check_call(c.message.tool_calls[0], name)


async def _stream_calls(
    served: Served, tool_choice: Any, seed: int
) -> tuple[dict[int, dict[str, Any]], list[Any]]:
    stream = await served.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Add two numbers."}],
        tools=TOOLS,
        tool_choice=tool_choice,
        max_tokens=1000,
        seed=seed,
        stream=True,
    )
    calls: dict[int, dict[str, Any]] = {}
    deltas, reasons = [], []
    async for chunk in stream:
        for c in chunk.choices:
            reasons.append(c.finish_reason)
            assert not c.delta.content
            for d in c.delta.tool_calls or []:
                deltas.append(d)
                call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                if d.id:
                    call["id"] = d.id
                if d.function and d.function.name:
                    call["name"] = d.function.name
                if d.function and d.function.arguments:
                    call["arguments"] += d.function.arguments
    assert reasons[-1] == "tool_calls"
    return calls, deltas


async def test_forced_tool_calls_stream(served: Served) -> None:
    calls, deltas = await _stream_calls(served, {"type": "function", "function": {"name": "add"}}, seed=1)
    assert list(calls) == [0] and calls[0]["name"] == "add" and calls[0]["id"]
    jsonschema.validate(json.loads(calls[0]["arguments"]), PARAMS["add"])
    assert deltas[0].function.name == "add" and len(deltas) > 2  # the name first, then argument pieces
    assert all(d.function.name is None for d in deltas[1:])
    calls, deltas = await _stream_calls(served, "required", seed=2)
    assert calls and len(deltas) > 2 * len(calls)  # each call: its name, then argument pieces
    for call in calls.values():
        assert call["id"] and call["name"] in PARAMS
        jsonschema.validate(json.loads(call["arguments"]), PARAMS[call["name"]])


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
            "response_format.json_schema.schema",
            'invalid json_schema: Unsupported type "objectx"',
        ),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema", "is required"),
        ({"response_format": {"type": "xml"}}, "response_format.type", "is not one of"),
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex", "invalid regex"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty list"),
        ({"guided_grammar": "root ::= "}, "guided_grammar", "invalid grammar"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_*", "at most one output constraint"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "'nope', which is not in tools"),
        ({"tool_choice": "required"}, "tool_choice", "has no tools"),
    ],
)  # fmt: skip
async def test_an_invalid_constraint_is_a_400_naming_the_field(
    served: Served, body: dict[str, Any], param: str, message: str
) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        await served.client().chat.completions.create(
            model=MODEL, messages=USER, max_tokens=8, extra_body=body
        )
    assert e.value.status_code == 400
    err = e.value.body
    assert err["param"] == param and message in err["message"], err
    await served.wait_idle()
