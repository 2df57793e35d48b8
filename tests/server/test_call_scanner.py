"""CallScanner reads a ``tool_choice: "required"`` output piece by piece: each call's name as
soon as it is complete, then its arguments, whose pieces concatenate to the object's text
(strings holding braces, quotes and escapes included), however the text is split."""

from __future__ import annotations

import json
import random
from collections.abc import Callable

import pytest

from deltaserve.server.call_scanner import CallEvent, CallScanner
from deltaserve.server.output_parser import ChatParsing, OutputParser, ParsedMessage
from deltaserve.server.output_parser import collect as collect_pieces

CALLS = [
    {"name": "get_weather", "parameters": {"city": 'Pa}ri{s "x" \\ [', "unit": "celsius"}},
    {"name": "add", "parameters": {"a": 1, "b": {"nested": [1, {"c": "]"}]}}},
    {"name": "noop", "parameters": {}},
]
TEXT = json.dumps(CALLS)


def collect(events: list[CallEvent]) -> list[tuple[str, str]]:
    calls: list[tuple[str, str]] = []
    for e in events:
        if e.name is not None:
            assert e.index == len(calls) and e.arguments == ""
            calls.append((e.name, ""))
        else:
            name, args = calls[e.index]
            calls[e.index] = (name, args + e.arguments)
    return calls


def test_every_split_gives_the_calls_and_their_arguments_text() -> None:
    expected = [(c["name"], json.dumps(c["parameters"])) for c in CALLS]
    rng = random.Random(0)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(TEXT)), rng.randrange(0, 30)))
        pieces = [TEXT[a:b] for a, b in zip([0, *cuts], [*cuts, len(TEXT)], strict=True)]
        scanner = CallScanner()
        events = [e for piece in pieces for e in scanner.feed(piece)]
        assert collect(events) == expected


def test_a_name_is_announced_once_complete_and_arguments_stream_before_their_end() -> None:
    scanner = CallScanner()
    assert scanner.feed('[{"name": "get_wea') == []
    assert scanner.feed('ther", "param') == []
    assert scanner.feed('eters": {"city": "Pa') == [
        CallEvent(0, "get_weather", ""),
        CallEvent(0, None, '{"city": "Pa'),
    ]
    assert scanner.feed('ris"}}, {"name": "add", "parameters": {') == [
        CallEvent(0, None, 'ris"}'),
        CallEvent(1, "add", ""),
        CallEvent(1, None, "{"),
    ]


def test_a_cut_off_output_gives_what_was_read() -> None:
    events = CallScanner().feed('[{"name": "add", "parameters": {"a": 12')
    assert collect(events) == [("add", '{"a": 12')]


def _message(make: Callable[[], OutputParser], pieces: list[str]) -> ParsedMessage:
    parser = make()
    return collect_pieces(
        [e for piece in pieces for e in parser.feed(piece)] + parser.finish(), calls_only=True
    )


@pytest.mark.parametrize("name", [None, "get_weather"])
def test_a_forced_output_cut_anywhere_is_the_same_message_whole_and_in_pieces(name: str | None) -> None:
    """The whole text and every split of it, cut at every length, give one message: the calls
    whose names were generated, arguments as far as generated, no content."""
    text = TEXT if name is None else json.dumps(CALLS[0]["parameters"])
    make = ChatParsing.forced(name)
    rng = random.Random(1)
    for end in range(len(text) + 1):
        cut = text[:end]
        whole = make().parse(cut)
        assert whole.content is None and whole.reasoning is None
        if name is not None:  # a named call is there from the first token, its arguments as generated
            assert [(c.name, c.arguments) for c in whole.calls] == [(name, cut)]
        else:  # the calls whose names are complete; the last one's arguments so far
            assert all(cut.find(f'"name": "{c.name}", "parameters": ') >= 0 for c in whole.calls)
            assert [c.arguments for c in whole.calls] == [a for _, a in collect(CallScanner().feed(cut))]
        cuts = sorted(rng.sample(range(1, end), min(end - 1, 5))) if end > 1 else []
        pieces = [cut[a:b] for a, b in zip([0, *cuts], [*cuts, end], strict=True)]
        split = _message(make, pieces)
        assert (split.content, [(c.name, c.arguments) for c in split.calls]) == (
            None, [(c.name, c.arguments) for c in whole.calls],
        )  # fmt: skip
        assert all(c.id.startswith("call_") for c in whole.calls + split.calls)
