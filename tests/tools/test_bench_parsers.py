"""tools/bench/bench_parsers.py: its replies parse as intended, streamed and whole alike, and it times them;
its unterminated replies are one open block each."""

from __future__ import annotations

import json

from deltaserve.server.output_parser import collect
from deltaserve.tools.bench.bench_parsers import replies, time_case, time_stream, unterminated


def test_the_benchmark_replies_parse_as_intended() -> None:
    cases = replies(300)
    for name, (text, make) in cases.items():
        parser = make()
        streamed = collect(
            [p for i in range(0, len(text), 4) for p in parser.feed(text[i : i + 4])] + parser.finish()
        )
        whole = make().parse(text)
        assert (streamed.content, streamed.reasoning) == (whole.content, whole.reasoning), name
        assert [(c.name, c.arguments) for c in streamed.calls] == [(c.name, c.arguments) for c in whole.calls]
    xml = cases["reasoning+xml_call"][1]().parse(cases["reasoning+xml_call"][0])
    args = json.loads(xml.calls[0].arguments)
    assert xml.reasoning and args["mode"] == 420 and len(args["body"]) == 300
    hermes = cases["hermes_call"][1]().parse(cases["hermes_call"][0])
    assert len(json.loads(hermes.calls[0].arguments)["body"]) == 300
    assert cases["text"][1]().parse(cases["text"][0]).content == cases["text"][0]
    r = time_case(*cases["text"], piece=4, reps=1)
    assert r["tokens"] == 75 and r["stream_us_per_token"] > 0 and r["whole_us_per_token"] > 0


def test_the_unterminated_replies_are_one_open_block() -> None:
    for name, (text, make) in unterminated(2000).items():
        assert len(text) >= 2000 and time_stream(text, make, 16) > 0
        msg = make().parse(text)
        if name == "xml_integer":  # the call stands, its value as far as it went
            assert [(c.name, json.loads(c.arguments)) for c in msg.calls] == [
                ("write_file", {"mode": int("1" * 2000)})
            ]
        else:  # never a call: the text as written
            assert (msg.content, msg.calls) == (text, []), name
