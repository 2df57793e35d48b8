"""The Qwen3 reasoning parser, the think probe over the Qwen3.5-style template, and the whole
output parser (reasoning, then tool calls) the server runs per completion."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deltaserve.server.output_parser import ChatParsing, OutputParser, Piece, Reasoning, collect
from deltaserve.server.reasoning import (
    Qwen3ReasoningParser,
    ReasoningParserName,
    ThinkProbe,
    resolve_reasoning_parser,
    think_left_open,
)
from deltaserve.server.tool_parsers import ToolParserName
from deltaserve.server.tool_parsers.qwen3_xml import Qwen3XmlToolParser
from deltaserve.tools.qwen35_template import QWEN35_CHAT_TEMPLATE

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            },
        },
    }
]
CALL = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"


def split(parser: Qwen3ReasoningParser, pieces: list[str]) -> tuple[str, str]:
    reasoning, content = "", ""
    for piece in pieces:
        r, c = parser.feed(piece)
        reasoning, content = reasoning + r, content + c
    r, c = parser.finish()
    return reasoning + r, content + c


@pytest.mark.parametrize(
    ("opened", "text", "expected"),
    [
        (True, "Let me think.\n</think>\n\nParis.", ("Let me think.", "Paris.")),  # prompt opened <think>
        (False, "<think>\nHmm, so\n\nyes.\n</think>\n\nParis.", ("Hmm, so\n\nyes.", "Paris.")),
        (False, "Paris. <think>not reasoning</think>", ("", "Paris. <think>not reasoning</think>")),
        (False, "  \nParis.", ("", "  \nParis.")),  # no reasoning: the text as generated
        (True, "cut short by max_tokens \n", ("cut short by max_tokens", "")),
        (True, "\n</think>\n\nParis.", ("", "Paris.")),
        (False, "<thin", ("", "<thin")),
    ],
)
def test_reasoning_and_content(opened: bool, text: str, expected: tuple[str, str]) -> None:
    assert split(Qwen3ReasoningParser(opened), [text]) == expected
    assert split(Qwen3ReasoningParser(opened), list(text)) == expected  # a character at a time


def test_a_tool_call_inside_reasoning_is_reasoning() -> None:
    parser = OutputParser(Qwen3ReasoningParser(True), Qwen3XmlToolParser(TOOLS))
    msg = parser.parse(f"maybe {CALL}?\n</think>\n\nNo call needed.")
    assert msg.reasoning == f"maybe {CALL}?" and msg.content == "No call needed." and msg.calls == []


def test_a_tool_call_after_reasoning() -> None:
    parser = OutputParser(Qwen3ReasoningParser(True), Qwen3XmlToolParser(TOOLS))
    msg = parser.parse("The user wants the weather.\n</think>\n\n" + CALL)
    assert msg.reasoning == "The user wants the weather." and msg.content is None
    assert [(c.name, json.loads(c.arguments)) for c in msg.calls] == [("get_weather", {"city": "Paris"})]


OUTPUTS = [
    "Weather, so a call.\n</think>\n\nChecking.\n\n" + CALL + "\n" + CALL.replace("Paris", "Rome"),
    "Short.\n</think>\n\nJust text, <tool_call>broken</tool_call>",
    "only thinking, cut",
]


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(OUTPUTS), st.data())
def test_any_split_gives_the_whole_result(text: str, data: st.DataObject) -> None:
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=10)))
    parser = OutputParser(Qwen3ReasoningParser(True), Qwen3XmlToolParser(TOOLS))
    pieces: list[Piece] = []
    for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
        pieces += parser.feed(text[a:b])
    pieces += parser.finish()
    streamed = collect(pieces)
    reference = OutputParser(Qwen3ReasoningParser(True), Qwen3XmlToolParser(TOOLS)).parse(text)
    assert (streamed.content, streamed.reasoning) == (reference.content, reference.reasoning)
    assert [(c.name, c.arguments) for c in streamed.calls] == [(c.name, c.arguments) for c in reference.calls]
    assert all(p.text for p in pieces if isinstance(p, Reasoning))


@pytest.fixture(scope="module")
def qwen35_tokenizer() -> Any:
    from transformers import AutoTokenizer

    from deltaserve.models import ensure_builtin_model

    tokenizer = AutoTokenizer.from_pretrained(ensure_builtin_model("tiny-qwen3.5"))
    tokenizer.chat_template = QWEN35_CHAT_TEMPLATE
    return tokenizer


def test_the_probe_follows_enable_thinking(qwen35_tokenizer: Any) -> None:
    renders: list[Any] = []

    def render(kwargs: dict[str, Any] | None, template: str | None) -> str:
        renders.append(kwargs)
        msgs = [{"role": "user", "content": "hi"}]
        extra = {"chat_template": template} if template is not None else {}
        return str(
            qwen35_tokenizer.apply_chat_template(
                msgs, tokenize=False, add_generation_prompt=True, **(kwargs or {}), **extra
            )
        )

    probe = ThinkProbe(render)
    assert probe.opens_think(None) is True
    assert probe.opens_think({"enable_thinking": False}) is False
    assert probe.opens_think({"enable_thinking": True}) is True
    assert probe.opens_think({"enable_thinking": False}) is False
    assert renders == [None, {"enable_thinking": False}, {"enable_thinking": True}]  # once per kwargs
    # a request's own template is probed on its own: the model's answer is not reused for it
    plain = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert probe.opens_think(None, plain) is False
    assert probe.opens_think(None) is True
    assert len(renders) == 4
    assert think_left_open("<think>\n") and not think_left_open("<think>\n\n</think>\n\n")


def test_a_template_that_fails_the_probe_is_not_opened() -> None:
    def render(kwargs: dict[str, Any] | None, template: str | None) -> str:
        raise RuntimeError("template error")

    assert ThinkProbe(render).opens_think({"x": 1}) is False


def test_auto_parsers_from_the_template(qwen35_tokenizer: Any) -> None:
    assert (
        resolve_reasoning_parser(ReasoningParserName.AUTO, QWEN35_CHAT_TEMPLATE) is ReasoningParserName.QWEN3
    )
    assert resolve_reasoning_parser(ReasoningParserName.AUTO, "{{ messages }}") is ReasoningParserName.NONE
    assert resolve_reasoning_parser(ReasoningParserName.NONE, "<think>") is ReasoningParserName.NONE
    parsing = ChatParsing(ToolParserName.AUTO, ReasoningParserName.AUTO, lambda: qwen35_tokenizer)
    make = parsing.for_request(TOOLS, True, None)
    assert parsing.tool_parser is ToolParserName.QWEN3_XML
    assert parsing.reasoning_parser is ReasoningParserName.QWEN3
    assert make is not None
    msg = make().parse("Need it.\n</think>\n\n" + CALL)
    assert msg.reasoning == "Need it." and msg.calls[0].name == "get_weather"
    # enable_thinking false: the prompt closed the think block, nothing generated is reasoning
    make = parsing.for_request(TOOLS, True, {"enable_thinking": False})
    assert make is not None and make().parse("Need it.\n</think>\n\nok").reasoning is None
    # neither parser wanted: no parsing at all
    off = ChatParsing(ToolParserName.NONE, ReasoningParserName.NONE, lambda: qwen35_tokenizer)
    assert off.for_request(TOOLS, True, None) is None


def test_an_engine_without_a_tokenizer_parses_hermes_and_no_reasoning() -> None:
    def missing() -> Any:
        raise AttributeError("no input_processor")

    parsing = ChatParsing(ToolParserName.AUTO, ReasoningParserName.AUTO, missing)
    assert parsing.for_request(None, False, None) is None
    make = parsing.for_request(TOOLS, True, None)
    assert (parsing.tool_parser, parsing.reasoning_parser) == (
        ToolParserName.HERMES,
        ReasoningParserName.NONE,
    )
    assert (
        make is not None
        and make().parse('<tool_call>{"name": "f", "arguments": {}}</tool_call>').calls[0].name == "f"
    )
