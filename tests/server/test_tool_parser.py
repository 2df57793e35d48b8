"""The Qwen-style ``<tool_call>`` parser, whole and streamed."""

from __future__ import annotations

import json

import pytest

from deltaserve.server.tool_parser import StreamingToolParser, parse_tool_calls

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'


def test_plain_text_is_content() -> None:
    assert parse_tool_calls("Hello there") == ("Hello there", [])


def test_one_and_several_calls() -> None:
    content, calls = parse_tool_calls("Let me check.\n" + CALL)
    assert content == "Let me check." and len(calls) == 1
    assert calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "Paris", "days": 2}
    assert calls[0].id.startswith("call_")
    two = CALL + "\n" + CALL.replace("Paris", "Rome")
    content, calls = parse_tool_calls(two)
    assert content is None and [json.loads(c.arguments)["city"] for c in calls] == ["Paris", "Rome"]
    assert calls[0].id != calls[1].id


def test_arguments_as_string_and_unterminated_block() -> None:
    text = '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}'  # cut by max_tokens after the JSON
    content, calls = parse_tool_calls(text)
    assert content is None and calls[0].name == "f" and json.loads(calls[0].arguments) == {"x": 1}
    _, calls = parse_tool_calls('<tool_call>{"name": "g"}</tool_call>')
    assert calls[0].arguments == "{}"


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>not json</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>["f"]</tool_call>',
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
        '<tool_call>{"name": "f", "arguments": {"x": 1',  # cut mid-JSON
        CALL + "<tool_call>oops</tool_call>",  # one bad block: not a protocol answer
    ],
)
def test_malformed_blocks_are_content(text: str) -> None:
    assert parse_tool_calls(text) == (text, [])


@pytest.mark.parametrize("piece", [1, 2, 3, 7, 1000])
def test_streaming_matches_whole_parse(piece: int) -> None:
    text = "Sure <tool thing> done. " + CALL
    parser = StreamingToolParser()
    streamed = "".join(parser.feed(text[i : i + piece]) for i in range(0, len(text), piece))
    rest, calls = parser.finish()
    assert "<tool_call" not in streamed
    assert streamed + rest == "Sure <tool thing> done. "
    assert [c.name for c in calls] == ["get_weather"]


def test_streaming_without_calls_releases_everything() -> None:
    parser = StreamingToolParser()
    out = parser.feed("a <tool") + parser.feed("_c")  # may still become a tag: held back
    assert out == "a "
    out += parser.feed("ar is not a tag")
    rest, calls = parser.finish()
    assert out + rest == "a <tool_car is not a tag" and calls == []
    bad = StreamingToolParser()
    assert bad.feed("x<tool_call>nope") == "x"
    assert bad.finish() == ("<tool_call>nope", [])
