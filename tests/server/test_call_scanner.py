"""CallScanner reads a ``tool_choice: "required"`` output piece by piece: each call's name as
soon as it is complete, then its arguments, whose pieces concatenate to the object's text
(strings holding braces, quotes and escapes included), however the text is split."""

from __future__ import annotations

import json
import random

from deltaserve.server.call_scanner import CallEvent, CallScanner

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
