"""The reply parsers under abuse: they never raise, a stream and the whole text agree, text is
never lost, streamed parsing costs time linear in the text, and a reply the parsers once failed
on is a 200 over HTTP (the scripted engine of ``test_scripted_engine``), streamed or not.

Every registered tool parser and the reasoning parser are fed random splits of adversarial
text (tags whole, cut and nested, deep brackets, integers past Python's 4300-digit limit,
``\\ud800`` escapes, NUL bytes, long names) and of well-formed replies whose calls and content
are known. Time is CPU time of this process, with generous bounds: a quadratic parser fails
by a factor of four or more, a linear one passes on a loaded machine.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
import pytest_asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltaserve.server.app import create_app
from deltaserve.server.call_scanner import CallScanner
from deltaserve.server.config import ServerConfig
from deltaserve.server.output_parser import OutputParser, ParsedMessage, Reasoning, collect
from deltaserve.server.reasoning import Qwen3ReasoningParser
from deltaserve.server.serving import BackgroundServer
from deltaserve.server.tool_parsers import ToolCallParser, ToolParserName, parser_class
from deltaserve.server.tool_parsers import hermes as hermes_module
from deltaserve.server.tool_parsers import qwen3_xml as xml_module
from deltaserve.server.tool_parsers.hermes import HermesToolParser
from deltaserve.server.tool_parsers.qwen3_xml import Qwen3XmlToolParser
from tests.server.test_scripted_engine import ScriptedEngine

PARAMS = {
    "n": {"type": "integer"},
    "x": {"type": "number"},
    "o": {"type": "object"},
    "a": {"type": "array"},
    "s": {"type": "string"},
    "b": {"type": "boolean"},
    "z": {"type": ["string", "null"]},
    "w": {"anyOf": 5},  # not a list: types nothing
}
TOOLS = [
    {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": PARAMS}}},
    {"type": "function", "function": {"name": "g", "parameters": {"type": "object", "properties": [1]}}},
]
PARSERS: list[type[ToolCallParser]] = [
    cls for name in ToolParserName if name not in (ToolParserName.AUTO, ToolParserName.NONE)
    if (cls := parser_class(name)) is not None
]  # fmt: skip
DEEP = 1200  # deeper than Python's recursion limit of 1000 frames
FRAGMENTS = [
    *("<tool_call>", "</tool_call>", "<tool_", "call>", "</tool", "<function=f>", "<function=g>"),
    *("<function=", "</function>", "<parameter=n>", "<parameter=x>", "<parameter=o>", "<parameter=a>"),
    *("<parameter=s>", "<parameter=w>", "<parameter=", "</parameter>", "</param", "<think>", "</think>"),
    *("<", ">", "=", '{"name": "f", "arguments": ', '{"arguments": ', '"name": "f"', '"name": "', ":", ","),
    *("{", "}", "[", "]", '"', "\\", '\\"', "\\ud800", "\\x", "\\u12", "null", "true", "1e999", "NaN"),
    *("'", "1j", "{1, 2}", "0x" + "f" * 4000, "1" * 4400, "[" * DEEP, "]" * DEEP, "\x00", "\n", " "),
    *("\t", "é", "😀", "x", "m" * 300),
]
FRAGMENT = st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=4))
OPENINGS = [
    *("<tool_call>", '<tool_call>{"name": "f", "arguments": ', '<tool_call>{"arguments": ', "<think>"),
    *(f"<tool_call>\n<function={f}>\n<parameter={p}>\n" for f in "fg" for p in "noaxw"),
]
CLOSINGS = ["", "</tool_call>", "}</tool_call>", "\n</parameter>\n</function>\n</tool_call>", "</think>"]
BLOCK = st.tuples(
    st.sampled_from(OPENINGS), st.lists(FRAGMENT, max_size=6).map("".join), st.sampled_from(CLOSINGS)
).map("".join)
TEXTS = st.lists(st.one_of(FRAGMENT, BLOCK), max_size=16).map("".join)
CUTS = st.lists(st.integers(0, 1 << 20), max_size=10)
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))


def pieces(text: str, cuts: list[int]) -> list[str]:
    at = sorted({c % (len(text) + 1) for c in cuts})
    return [text[a:b] for a, b in zip([0, *at], [*at, len(text)], strict=True)]


def streamed(parser: ToolCallParser, parts: list[str]) -> list[Any]:
    events: list[Any] = []
    for part in parts:
        events += parser.feed(part)
    return events + parser.finish()


def summary(msg: ParsedMessage) -> tuple[Any, ...]:
    return msg.content, msg.reasoning, [(c.name, c.arguments) for c in msg.calls]


def utf8(msg: ParsedMessage) -> bool:
    text = "".join(
        [msg.content or "", msg.reasoning or "", *(c.name + c.arguments + c.id for c in msg.calls)]
    )
    text.encode("utf-8")  # raises on a lone surrogate
    return True


@pytest.fixture(autouse=True)
def no_safety_net(monkeypatch: pytest.MonkeyPatch) -> None:
    """The parsers themselves must not raise: here the output parser's net fails the test."""

    def fail(parser: object, error: Exception) -> None:
        raise AssertionError(f"{type(parser).__name__} raised {error!r}")

    monkeypatch.setattr(OutputParser, "_failed", staticmethod(fail), raising=False)


# ---------------------------------------------------------------------------------- fuzz
@FUZZ
@given(TEXTS, CUTS, st.sampled_from(PARSERS))
def test_adversarial_text_never_raises_and_streams_as_whole(
    text: str, cuts: list[int], cls: type[ToolCallParser]
) -> None:
    whole = collect(cls(TOOLS).parse_all(text))
    stream = collect(streamed(cls(TOOLS), pieces(text, cuts)))
    assert summary(stream) == summary(whole)
    assert utf8(whole)
    if not whole.calls:  # no call: every character is content, as written
        assert whole.content == text


@FUZZ
@given(TEXTS, CUTS, st.booleans(), st.sampled_from([None, *PARSERS]))
def test_reasoning_then_tools_never_raise_and_stream_as_whole(
    text: str, cuts: list[int], opened: bool, cls: type[ToolCallParser] | None
) -> None:
    def make() -> OutputParser:
        return OutputParser(Qwen3ReasoningParser(opened), cls(TOOLS) if cls is not None else None)

    parser = make()
    out = [p for part in pieces(text, cuts) for p in parser.feed(part)] + parser.finish()
    assert summary(collect(out)) == summary(make().parse(text))
    assert all(p.text for p in out if isinstance(p, Reasoning))


CONTENT = st.text(st.characters(blacklist_characters="<", blacklist_categories=("Cs",)), min_size=1).filter(
    lambda s: s.strip() == s
)
VALUE = st.text(
    st.characters(blacklist_characters="<\r\n", blacklist_categories=("Cs", "Zl", "Zp")), max_size=20
)
ARGS = st.fixed_dictionaries(
    {},
    optional={
        "n": st.integers(-(10**30), 10**30),
        "x": st.floats(allow_nan=False, allow_infinity=False),
        "a": st.lists(st.integers(), max_size=4),
        "s": VALUE,
        "b": st.booleans(),
    },
)


def render(cls: type[ToolCallParser], name: str, args: dict[str, Any], variant: int) -> tuple[str, Any]:
    """A call in ``cls``'s format, and the arguments it parses to."""
    if cls is Qwen3XmlToolParser:
        values = {
            k: json.dumps(v) if k in ("a", "b") else v if k == "s" else repr(v) for k, v in args.items()
        }
        body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in values.items())
        # only "f" has a schema: another function's values are strings as written
        return (
            f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>",
            args if name == "f" else values,
        )
    dumped = json.dumps(args, ensure_ascii=variant % 2 == 0)
    if variant < 2:  # the streamed form (name first), else one read whole
        return f'<tool_call>\n{{"name": "{name}", "arguments": {dumped}}}\n</tool_call>', args
    return f'<tool_call>{{"arguments": {dumped}, "name": "{name}"}}</tool_call>', args


NAMES = st.one_of(st.just("f"), st.from_regex(r"[a-z_]{1,12}", fullmatch=True))
REPLY = st.lists(st.one_of(CONTENT, st.tuples(NAMES, ARGS, st.integers(0, 3))), max_size=6)


@FUZZ
@given(REPLY, CUTS, st.sampled_from(PARSERS))
def test_known_calls_and_content_survive_any_split(
    reply: list[Any], cuts: list[int], cls: type[ToolCallParser]
) -> None:
    parts: list[str] = []
    content, calls, last = "", [], None
    for part in reply:
        if isinstance(part, str):  # content next to content keeps the newline between them
            parts.append(part)
            content += ("\n" if isinstance(last, str) else "") + part
        else:  # the newline next to a call is dropped
            text, args = render(cls, *part)
            parts.append(text)
            calls.append((part[0], args))
        last = part
    text = "\n".join(parts)
    msg = collect(streamed(cls(TOOLS), pieces(text, cuts)))
    assert (msg.content or "") == content
    assert [(c.name, json.loads(c.arguments)) for c in msg.calls] == calls
    assert summary(msg) == summary(collect(cls(TOOLS).parse_all(text)))


@FUZZ
@given(CONTENT, CONTENT, CUTS, st.booleans())
def test_reasoning_and_answer_survive_any_split(
    thought: str, answer: str, cuts: list[int], opened: bool
) -> None:
    text = ("" if opened else "<think>\n") + thought + "\n</think>\n\n" + answer
    parser = OutputParser(Qwen3ReasoningParser(opened), None)
    msg = collect([p for part in pieces(text, cuts) for p in parser.feed(part)] + parser.finish())
    assert (msg.reasoning, msg.content) == (thought, answer)


@FUZZ
@given(
    st.lists(
        st.tuples(st.text(max_size=8), st.dictionaries(st.text(max_size=4), st.text(max_size=6))), max_size=4
    ),
    CUTS,
)
def test_call_scanner_gives_names_and_arguments_text_for_any_split(
    calls: list[tuple[str, dict[str, str]]], cuts: list[int]
) -> None:
    text = json.dumps([{"name": n, "parameters": p} for n, p in calls])
    scanner = CallScanner()
    got: list[list[str]] = []
    for part in pieces(text, cuts):
        for e in scanner.feed(part):
            if e.name is not None:
                got.append([e.name, ""])
            else:
                got[e.index][1] += e.arguments
    assert got == [[n, json.dumps(p)] for n, p in calls]


@FUZZ
@given(TEXTS, CUTS)
def test_call_scanner_never_raises(text: str, cuts: list[int]) -> None:
    scanner = CallScanner()
    for part in pieces('[{"name": "' + text, cuts):
        for e in scanner.feed(part):
            (e.name or "").encode("utf-8")


WS = st.sampled_from(["", " ", "\n", " \t\n", "\u00a0", "\u2028"])
HEADER_SLOTS = [
    *(WS, st.just("{"), WS, st.just('"name"'), WS, st.just(":"), WS, st.just('"')),
    st.sampled_from(["f", "get_weather", 'a\\"b', "a\\\nb", "a\\", "é\u00a0x", "", "\\u00e9"]),
    *(
        st.just('"'),
        WS,
        st.just(","),
        WS,
        st.just('"'),
        st.sampled_from(["arguments", "parameters", "argument"]),
    ),
    *(st.just('"'), WS, st.just(":"), WS, st.sampled_from(["{", '{"x": 1}', "[", '"'])),
]


@FUZZ
@given(
    st.tuples(*HEADER_SLOTS),
    st.dictionaries(st.integers(0, len(HEADER_SLOTS) - 1), FRAGMENT, max_size=2),
    CUTS,
)
def test_the_header_matcher_reads_what_the_header_pattern_matches(
    slots: tuple[str, ...], changes: dict[int, str], cuts: list[int]
) -> None:
    """The hermes header, matched a piece at a time, is where ``_HEADER`` matches the text."""
    text = "".join(changes.get(i, slot) for i, slot in enumerate(slots))
    header, fed, end = hermes_module._Header(), 0, None
    for part in pieces(text, cuts):
        at = header.feed(part)
        if at is not None:
            end = fed + at
            break
        fed += len(part)
    match = hermes_module._HEADER.match(text)
    assert end == (match.end() if match else None)
    if match:
        assert "".join(header.name) == match.group(1)


# ------------------------------------------------------------------ the failures, one by one
CALL_F = '<tool_call>{"name": "f", "arguments": '


def xml(param: str, value: str, function: str = "f") -> str:
    return f"<tool_call>\n<function={function}>\n<parameter={param}>\n{value}\n</parameter>\n</function>\n</tool_call>"


# (parser, reply, expected (content, [(name, arguments text)])); None: the reply is the content
CASES: list[tuple[str, str, tuple[str | None, list[tuple[str, str]]] | None]] = [
    ("hermes", CALL_F + "[" * DEEP + "]" * DEEP + "}</tool_call>", None),  # RecursionError
    ("hermes", '<tool_call>{"arguments": {"a": ' + "[" * DEEP + "]" * DEEP + '}, "name": "f"}</tool_call>', None),
    ("hermes", CALL_F + '"' + "[" * DEEP + "]" * DEEP + '"}</tool_call>', None),  # arguments as a string
    ("hermes", '<tool_call>{"name": "a\tb", "arguments": {}}</tool_call>', None),  # JSONDecodeError
    ("hermes", '<tool_call>{"name": "a\\x", "arguments": {}}</tool_call>', None),
    ("hermes", '<tool_call>{"name": "\\ud800", "arguments": {}}</tool_call>', None),  # UnicodeEncodeError
    ("hermes", '<tool_call>{"arguments": {"a": "\\ud800"}, "name": "f"}</tool_call>', (None, [("f", '{"a": "\\ud800"}')])),
    ("hermes", CALL_F + '{"a": ' + "[" * DEEP + "]" * DEEP + "}}</tool_call>", (None, [("f", '{"a": ' + "[" * DEEP + "]" * DEEP + "}")])),
    ("qwen3_xml", xml("n", "1" * 4400), (None, [("f", '{"n": "' + "1" * 4400 + '"}')])),  # ValueError
    ("qwen3_xml", xml("x", "0x" + "f" * 4000), (None, [("f", '{"x": "0x' + "f" * 4000 + '"}')])),
    ("qwen3_xml", xml("o", "{'a': 1j}"), (None, [("f", '{"o": "{\'a\': 1j}"}')])),  # TypeError
    ("qwen3_xml", xml("a", "[{1, 2}]"), (None, [("f", '{"a": "[{1, 2}]"}')])),
    ("qwen3_xml", xml("o", '{"a": "\\ud800"}'), (None, [("f", '{"o": {"a": "\\ud800"}}')])),
    ("qwen3_xml", xml("a", "[" * DEEP + "]" * DEEP), (None, [("f", '{"a": "' + "[" * DEEP + "]" * DEEP + '"}')])),
    ("qwen3_xml", xml("w", "1"), (None, [("f", '{"w": "1"}')])),  # anyOf not a list: TypeError
    ("qwen3_xml", xml("w", "1", "g"), (None, [("g", '{"w": "1"}')])),  # properties a list: AttributeError
    ("qwen3_xml", xml("x", "1e999"), (None, [("f", '{"x": "1e999"}')])),  # not JSON "Infinity"
]  # fmt: skip
CASE_IDS = [f"{i}-{p}" for i, (p, _, _) in enumerate(CASES)]
CLASSES = {"hermes": HermesToolParser, "qwen3_xml": Qwen3XmlToolParser}


def expected_of(text: str, want: tuple[str | None, list[tuple[str, str]]] | None) -> tuple[Any, ...]:
    return (text, []) if want is None else want


@pytest.mark.parametrize(("parser", "text", "want"), CASES, ids=CASE_IDS)
def test_each_former_failure_parses(parser: str, text: str, want: Any) -> None:
    cls = CLASSES[parser]
    for parts in ([text], [text[i : i + 16] for i in range(0, len(text), 16)]):
        msg = collect(streamed(cls(TOOLS), parts))
        assert (msg.content, [(c.name, c.arguments) for c in msg.calls]) == expected_of(text, want)


def test_call_scanner_gives_a_name_that_does_not_decode_as_written() -> None:
    for name in ("a\\x", "\\ud800"):
        events = CallScanner().feed('[{"name": "' + name + '", "parameters": {}}]')
        assert [(e.name, e.arguments) for e in events] == [(name, ""), (None, "{}")]


# ------------------------------------------------------------------ the safety net
def test_a_parser_that_raises_leaves_its_text_as_content(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.undo()  # the real net, not no_safety_net's
    real = hermes_module._whole_block

    def whole_block(body: str) -> Any:
        if "BOOM" in body:
            raise RuntimeError("a parser bug")
        return real(body)

    monkeypatch.setattr(hermes_module, "_whole_block", whole_block)
    text = (
        'Hi <tool_call>{"name": "f", "arguments": {}}</tool_call> then '
        '<tool_call>{"arguments": {}, "name": "BOOM"}</tool_call> tail <tool_call>{"name": "g", "arguments": {}}'
    )
    caplog.set_level(logging.WARNING, logger="deltaserve")
    want = ("Hi" + text[text.index("then") :], None, [("f", "{}")])
    assert summary(OutputParser(None, HermesToolParser(TOOLS)).parse(text)) == want
    for size in (1, 7, 16):
        parser = OutputParser(None, HermesToolParser(TOOLS))
        out = [
            p for i in range(0, len(text), size) for p in parser.feed(text[i : i + size])
        ] + parser.finish()
        assert summary(collect(out)) == want
        assert parser.called
    failures = [r for r in caplog.records if "server.parser_failed" in r.getMessage()]
    assert len(failures) == 4 and "RuntimeError: a parser bug" in failures[0].getMessage()


def test_a_failed_typed_value_leaves_the_rest_of_the_call_as_content(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.undo()

    def convert(value: str, types: Any) -> Any:
        raise ValueError("conversion bug")

    monkeypatch.setattr(xml_module, "convert", convert)
    text = "Hi\n<tool_call>\n<function=f>\n<parameter=s>\nok\n</parameter>\n<parameter=n>\n12\n</parameter>\n</function>\n</tool_call>"
    whole = OutputParser(None, Qwen3XmlToolParser(TOOLS)).parse(text)
    # the call and its first parameter stand; the failed value, its tag and the rest are content
    rest = "\n12\n</parameter>\n</function>\n</tool_call>"
    assert summary(whole) == ("Hi" + rest, None, [("f", '{"s": "ok", "n": ')])
    for size in (1, 5):
        parser = OutputParser(None, Qwen3XmlToolParser(TOOLS))
        out = [
            p for i in range(0, len(text), size) for p in parser.feed(text[i : i + size])
        ] + parser.finish()
        assert summary(collect(out)) == summary(whole)


# ------------------------------------------------------------------ linear time
MIB = 1 << 20
PIECE = 16
BOUND_S = 5.0  # CPU seconds for 1 MiB in 16-character pieces (linear: well under one)
# Times are this thread's CPU time (``time.thread_time``): the process's would also count the
# threads other tests left running in this process (servers, grammar workers, torch's pool).
RATIO = 16.0  # 8 times the text: linear ~8, quadratic ~64


def _hermes() -> OutputParser:
    return OutputParser(None, HermesToolParser(TOOLS))


def _xml() -> OutputParser:
    return OutputParser(None, Qwen3XmlToolParser(TOOLS))


def _think(opened: bool) -> Callable[[], OutputParser]:
    return lambda: OutputParser(Qwen3ReasoningParser(opened), None)


HERMES_CALL = '<tool_call>{"name": "f", "arguments": {"n": 1}}</tool_call>\n'
XML_CALL = "<tool_call>\n<function=f>\n<parameter=n>\n1\n</parameter>\n</function>\n</tool_call>\n"
# name: (prefix, what fills it to the size, parser maker); each one block never closed, or many blocks
SHAPES: dict[str, tuple[str, str, Callable[[], Any]]] = {
    "hermes_no_header": ('<tool_call>{"arguments": {"s": "', "x", _hermes),
    "hermes_endless_name": ('<tool_call>{"name": "', "x", _hermes),
    "hermes_whitespace": ("<tool_call>", " ", _hermes),
    "hermes_streamed_string": (CALL_F + '{"s": "', "x", _hermes),
    "hermes_after_arguments": (CALL_F + "{}", " ", _hermes),
    "hermes_many_calls": ("", HERMES_CALL, _hermes),
    "content_whitespace": ("a", " ", _hermes),
    "xml_whitespace": ("<tool_call>", " ", _xml),
    "xml_integer": ("<tool_call><function=f><parameter=n>", "1", _xml),
    "xml_string": ("<tool_call><function=f><parameter=s>", "x", _xml),
    "xml_many_calls": ("", XML_CALL, _xml),
    "reasoning_whitespace": ("", " ", _think(False)),
    "reasoning_trailing_whitespace": ("a", " ", _think(True)),
    "call_scanner_endless_name": ('[{"name": "', "x", CallScanner),
    "call_scanner_no_call": ("", "x", CallScanner),
}


def cpu_seconds(shape: str, size: int, piece: int = PIECE) -> float:
    """CPU time to stream ``size`` characters of ``shape``; fails once past ``BOUND_S``."""
    prefix, fill, make = SHAPES[shape]
    text = prefix + fill * ((size - len(prefix)) // len(fill))
    parser = make()
    t0 = time.thread_time()
    for k, i in enumerate(range(0, len(text), piece)):
        parser.feed(text[i : i + piece])
        if k % 1024 == 0:
            assert time.thread_time() - t0 < BOUND_S, f"{shape}: over {BOUND_S} s at {i} characters"
    if hasattr(parser, "finish"):
        parser.finish()
    seconds = time.thread_time() - t0
    assert seconds < BOUND_S, f"{shape}: {seconds:.1f} s"
    return seconds


def assert_linear(measure: Callable[[int], float], size: int) -> None:
    """``measure(n)`` (CPU seconds for ``n`` units) at ``size`` is at most ``RATIO`` times its
    best of three at ``size // 8``; measured again once before failing (a busy machine)."""
    ratios = []
    for _ in range(2):
        small = min(measure(size // 8) for _ in range(3))
        ratios.append(measure(size) / max(small, 1e-3))
        if ratios[-1] < RATIO:
            return
    pytest.fail(f"8x the input took {ratios} times as long")


@pytest.mark.parametrize("shape", list(SHAPES))
def test_streaming_costs_time_linear_in_the_text(shape: str) -> None:
    """1 MiB in 16-character pieces within ``BOUND_S``, and linear in the size."""
    assert_linear(lambda n: cpu_seconds(shape, n), MIB)


@pytest.mark.parametrize(("call", "make"), [(HERMES_CALL, _hermes), (XML_CALL, _xml)], ids=["hermes", "xml"])
def test_a_whole_reply_of_many_calls_costs_time_linear_in_the_text(
    call: str, make: Callable[[], OutputParser]
) -> None:
    """One feed of 20,000 calls (~1.5 MiB): each block read costs its own length, not the rest's."""

    def parse(calls: int) -> float:
        t0 = time.thread_time()
        msg = make().parse(call * calls)
        seconds = time.thread_time() - t0
        assert len(msg.calls) == calls and seconds < BOUND_S
        return seconds

    assert_linear(parse, 20000)


# ------------------------------------------------------------------ over HTTP
@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def urls() -> AsyncIterator[dict[str, tuple[ScriptedEngine, str]]]:
    engines = {"hermes": ScriptedEngine(), "qwen3_xml": ScriptedEngine()}
    xml_config = ServerConfig(tool_call_parser=ToolParserName.QWEN3_XML)
    async with (
        BackgroundServer(create_app(engines["hermes"])) as hermes,
        BackgroundServer(create_app(engines["qwen3_xml"], xml_config)) as qwen,
    ):
        yield {"hermes": (engines["hermes"], hermes.url), "qwen3_xml": (engines["qwen3_xml"], qwen.url)}


def from_stream(body: str) -> tuple[Any, list[tuple[str, str]], list[str]]:
    """``(content, [(name, arguments)], finish reasons)`` from a chat stream's SSE body."""
    content: str | None = None
    calls: dict[int, list[str]] = {}
    reasons: list[str] = []
    for line in body.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        frame = json.loads(line[6:])
        assert "error" not in frame, frame
        for choice in frame["choices"]:
            delta = choice["delta"]
            if delta.get("content"):
                content = (content or "") + delta["content"]
            for d in delta.get("tool_calls") or []:
                call = calls.setdefault(d["index"], ["", ""])
                call[0] += d["function"].get("name") or ""
                call[1] += d["function"].get("arguments") or ""
            reasons += [choice["finish_reason"]] if choice.get("finish_reason") else []
    return content, [(n, a) for n, a in (calls[i] for i in sorted(calls))], reasons


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize(("parser", "text", "want"), CASES, ids=CASE_IDS)
async def test_each_former_failure_is_a_200_streamed_or_not(
    urls: dict[str, tuple[ScriptedEngine, str]], parser: str, text: str, want: Any
) -> None:
    engine, url = urls[parser]
    engine.script, engine.finish_reason = [text[i : i + 16] for i in range(0, len(text), 16)], "stop"
    body = {"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}
    expected = expected_of(text, want)
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        r = await http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text[:300]
        message = r.json()["choices"][0]["message"]
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]
        assert (message["content"], calls) == expected
        r = await http.post("/v1/chat/completions", json={**body, "stream": True})
        assert r.status_code == 200
        content, calls, reasons = from_stream(r.text)
        assert (content, calls) == expected
        assert reasons == (["tool_calls"] if calls else ["stop"])
