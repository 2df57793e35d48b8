"""The tool-call parsers: the XML (Qwen3.5 / Qwen3-Coder) and JSON (hermes) forms, whole and
split at every point, schema-typed values, malformed blocks, cut calls, the registry."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deltaserve.server.output_parser import ParsedMessage, collect
from deltaserve.server.tool_parsers import (
    CallDelta,
    Event,
    ToolCallParser,
    ToolParserName,
    parser_class,
    resolve_tool_parser,
)
from deltaserve.server.tool_parsers.hermes import HermesToolParser
from deltaserve.server.tool_parsers.qwen3_xml import Qwen3XmlToolParser, convert

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "scale": {"type": "number"},
        "metric": {"type": "boolean"},
        "opts": {"type": "object"},
        "hours": {"type": "array"},
        "note": {"type": ["string", "null"]},
        "code": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
    },
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}},
]


def xml_call(name: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


XML_TEXT = (
    "Let me check both.\n\n"
    + xml_call("get_weather", city='Paris "centre"\n  line 2', days="3", scale="1.5", metric="true")
    + "\n"
    + xml_call("get_weather", opts='{"a": [1, 2]}', hours="[9, 12]", note="null", code="7")
    + "\n"
    + xml_call("ping")
)
HERMES_TEXT = (
    'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris", "days" : 2, "opts": {"a":[1,\n2]}}}\n'
    '</tool_call>\n<tool_call>{"arguments": {"city": "Rome"}, "name": "get_weather"}</tool_call>'
)


def run(parser: ToolCallParser, pieces: list[str]) -> list[Event]:
    events: list[Event] = []
    for piece in pieces:
        events += parser.feed(piece)
    return events + parser.finish()


def whole(cls: type[ToolCallParser], text: str) -> ParsedMessage:
    return collect(cls(TOOLS).parse_all(text))


def test_xml_calls_are_typed_by_the_schema() -> None:
    msg = whole(Qwen3XmlToolParser, XML_TEXT)
    assert msg.content == "Let me check both."
    assert [c.name for c in msg.calls] == ["get_weather", "get_weather", "ping"]
    assert len({c.id for c in msg.calls}) == 3 and all(c.id.startswith("call_") for c in msg.calls)
    first, second, third = (json.loads(c.arguments) for c in msg.calls)
    # strings verbatim (inner newlines and spaces kept; the layout newlines are not value)
    assert first == {"city": 'Paris "centre"\n  line 2', "days": 3, "scale": 1.5, "metric": True}
    assert second == {"opts": {"a": [1, 2]}, "hours": [9, 12], "note": None, "code": 7}
    assert third == {}


@pytest.mark.parametrize(
    ("value", "types", "expected"),
    [
        ("42", ["integer"], 42),
        ("4.5", ["integer"], "4.5"),  # not an integer: kept as written
        ("-1e3", ["number"], -1000.0),
        ("False", ["boolean"], False),
        ("yes", ["boolean"], "yes"),
        ("{'a': True}", ["object"], {"a": True}),  # Python-style literal
        ("[1, 2", ["array"], "[1, 2"),
        ("None", ["string", "null"], None),
        ("null", ["string"], "null"),
        (" 7 ", ["integer", "null"], 7),
    ],
)
def test_convert(value: str, types: list[str], expected: Any) -> None:
    assert convert(value, types) == expected


def test_unknown_parameter_and_tool_are_strings() -> None:
    msg = whole(Qwen3XmlToolParser, xml_call("other", x="12") + xml_call("get_weather", extra="true"))
    assert [json.loads(c.arguments) for c in msg.calls] == [{"x": "12"}, {"extra": "true"}]


def test_xml_leniency() -> None:
    # a missing </parameter>, text between parameters, two functions in one block
    text = (
        "<tool_call>\n<function=get_weather>\n<parameter=days>\n2\nnoise\n<parameter=city>\nOslo\n"
        "</function>\n<function=ping>\n</function>\n</tool_call>tail"
    )
    msg = whole(Qwen3XmlToolParser, text)
    assert [(c.name, json.loads(c.arguments)) for c in msg.calls] == [
        ("get_weather", {"days": "2\nnoise", "city": "Oslo"}),  # "2\nnoise" is not an integer
        ("ping", {}),
    ]
    assert msg.content == "tail"
    # a later function of a block that does not open ends the block: the rest is content
    msg = whole(Qwen3XmlToolParser, "<tool_call>\n<function=ping>\n</function>\n<function=a b>\n</tool_call>")
    assert [c.name for c in msg.calls] == ["ping"] and msg.content == "<function=a b>\n</tool_call>"


def test_hermes_streams_its_header_and_reads_other_forms_whole() -> None:
    msg = whole(HermesToolParser, HERMES_TEXT)
    assert msg.content == "Sure."
    assert [c.name for c in msg.calls] == ["get_weather", "get_weather"]
    # re-spaced as json.dumps spaces, strings and numbers as written
    assert msg.calls[0].arguments == '{"city": "Paris", "days": 2, "opts": {"a": [1, 2]}}'
    assert msg.calls[1].arguments == '{"city": "Rome"}'
    string_args = '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>'
    assert json.loads(whole(HermesToolParser, string_args).calls[0].arguments) == {"x": 1}


@pytest.mark.parametrize("cls", [Qwen3XmlToolParser, HermesToolParser])
@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>not a call</tool_call> after",
        "a <tool_call>\n<function=bad name>\n</function></tool_call>",
        "<tool_call>\n<function=\n",
        '<tool_call>["f"]</tool_call>',
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
        "plain <tool_ text, no tag <tool_call",
    ],
)
def test_malformed_blocks_are_content(cls: type[ToolCallParser], text: str) -> None:
    msg = whole(cls, text)
    assert msg.calls == [] and msg.content == text


def test_a_bad_block_beside_a_good_one_stays_content() -> None:
    text = xml_call("ping") + "\n<tool_call>oops</tool_call>"
    msg = whole(Qwen3XmlToolParser, text)
    assert [c.name for c in msg.calls] == ["ping"] and msg.content == "<tool_call>oops</tool_call>"


def test_a_call_cut_short_keeps_what_arrived() -> None:
    xml = whole(Qwen3XmlToolParser, "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar")
    assert xml.content is None and json.loads(xml.calls[0].arguments) == {"city": "Par"}
    xml = whole(Qwen3XmlToolParser, "<tool_call>\n<function=get_weather>\n<parameter=days>\n1")
    assert json.loads(xml.calls[0].arguments) == {"days": 1}
    hermes = whole(HermesToolParser, '<tool_call>{"name": "f", "arguments": {"x": 1')
    assert hermes.calls[0].name == "f" and hermes.calls[0].arguments == '{"x": 1'


@pytest.mark.parametrize("cls", [Qwen3XmlToolParser, HermesToolParser])
def test_stream_deltas_name_first_then_argument_pieces(cls: type[ToolCallParser]) -> None:
    text = XML_TEXT if cls is Qwen3XmlToolParser else HERMES_TEXT
    events = run(cls(TOOLS), list(text))  # one character at a time
    calls = [e for e in events if isinstance(e, CallDelta)]
    headers = [e for e in calls if e.name is not None]
    assert [e.arguments for e in headers] == [""] * len(headers) and all(e.id for e in headers)
    for h in headers:  # each call's header comes before its arguments
        mine = [e for e in calls if e.index == h.index]
        assert mine[0] is h and all(e.name is None and e.id is None for e in mine[1:])
    # the first call's arguments (several parameters; a streamed JSON object) come in pieces
    first = [e.arguments for e in calls if e.index == 0][1:]
    assert len(first) > 3 and json.loads("".join(first))
    # content never carries a piece of a tag
    assert "<" not in "".join(e for e in events if isinstance(e, str))


SPLIT_TEXTS = [
    XML_TEXT,
    HERMES_TEXT,
    "no calls at all <tool thing> \n\n",
    "x <tool_call>oops</tool_call>\n"
    + xml_call("ping")
    + "  \n between \n"
    + xml_call("get_weather", days="2"),
    '<tool_call>{"name": "f", "arguments": {"s": "a \\" } <x>"}}</tool_call> end',
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar",
    "<tool_call>\n<function=ping>\n</function>\n<function=a b>\n</tool_call>",
    "<tool_call>\n<function=get_weather>\n<parameter=days>\n12\n</parameter>\n<parameter=note>\nx\n</param",
]


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(SPLIT_TEXTS), st.sampled_from([Qwen3XmlToolParser, HermesToolParser]), st.data())
def test_any_split_gives_the_whole_result(text: str, cls: type[ToolCallParser], data: st.DataObject) -> None:
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=12)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    streamed, reference = collect(run(cls(TOOLS), pieces)), whole(cls, text)
    assert (streamed.content, [(c.name, c.arguments) for c in streamed.calls]) == (
        reference.content,
        [(c.name, c.arguments) for c in reference.calls],
    )


def test_registry_and_auto() -> None:
    assert resolve_tool_parser(ToolParserName.AUTO, "... <function=x> ...") is ToolParserName.QWEN3_XML
    assert resolve_tool_parser(ToolParserName.AUTO, "<tool_call>{...}") is ToolParserName.HERMES
    assert resolve_tool_parser(ToolParserName.AUTO, "") is ToolParserName.HERMES
    assert resolve_tool_parser(ToolParserName.NONE, "<function=") is ToolParserName.NONE
    assert parser_class(ToolParserName.QWEN3_XML) is Qwen3XmlToolParser
    assert parser_class(ToolParserName.HERMES) is HermesToolParser
    assert parser_class(ToolParserName.NONE) is None
    with pytest.raises(ValueError, match="resolve 'auto'"):
        parser_class(ToolParserName.AUTO)
