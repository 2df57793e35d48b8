#!/usr/bin/env python
"""Host cost of parsing chat replies: µs per streamed token for the reply parsers.

    python tools/bench/bench_parsers.py                 # each case, a reply of ~4,000 tokens
    python tools/bench/bench_parsers.py --tokens 20000 --json out.json
    python tools/bench/bench_parsers.py --unterminated 64,1024 --chars 16   # abuse: seconds per reply

A reply is split into pieces of ``--chars`` characters (a token's text is 3-4 characters on
average) and fed to a fresh ``OutputParser`` per repetition, as a stream feeds it; the whole
reply in one feed (a non-streamed response) is timed too. Cases: plain text (no tags: the
content path), Qwen3 reasoning then text, reasoning then Qwen3.5 XML calls with a long string
parameter, and hermes JSON calls. Torch-free; single-threaded.

``--unterminated`` times instead replies that are one block never closed, of each size in KiB,
streamed once in ``--chars`` pieces: what a parser must hold back while it cannot decide
(hermes: a body that is no header, a name that never ends, whitespace; XML: an integer value;
reasoning: whitespace before anything). Linear parsers take about 8 times as long for 8 times
the size; a parser that re-reads what it holds takes about 64 times as long.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from deltaserve.server.output_parser import OutputParser
from deltaserve.server.reasoning import Qwen3ReasoningParser
from deltaserve.server.tool_parsers.hermes import HermesToolParser
from deltaserve.server.tool_parsers.qwen3_xml import Qwen3XmlToolParser
from deltaserve.tools.bench.harness import (
    Bench,
    bench_parser,
    describe_box,
    interleaved,
    scaled,
    show,
    spread,
    timed,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "parameters": {
                "type": "object",
                "properties": {
                    name: {"type": t}
                    for name, t in [("path", "string"), ("body", "string"), ("mode", "integer")]
                },
            },
        },
    }
]
PROSE = "The quick brown fox jumps over the lazy dog, and then it thinks again about <things>. "


def replies(chars: int) -> dict[str, tuple[str, Callable[[], OutputParser]]]:
    prose = (PROSE * (chars // len(PROSE) + 1))[:chars]
    xml = (
        f"<tool_call>\n<function=write_file>\n<parameter=path>\n/tmp/a.txt\n</parameter>\n"
        f"<parameter=body>\n{prose}\n</parameter>\n<parameter=mode>\n420\n</parameter>\n</function>\n</tool_call>"
    )
    hermes = (
        '<tool_call>\n{"name": "write_file", "arguments": '
        + json.dumps({"path": "/a", "body": prose})
        + "}\n</tool_call>"
    )
    return {
        "text": (prose, lambda: OutputParser(None, Qwen3XmlToolParser(TOOLS))),
        "reasoning+text": (
            prose + "\n</think>\n\n" + prose,
            lambda: OutputParser(Qwen3ReasoningParser(True), None),
        ),
        "reasoning+xml_call": (
            prose + "\n</think>\n\n" + xml,
            lambda: OutputParser(Qwen3ReasoningParser(True), Qwen3XmlToolParser(TOOLS)),
        ),
        "hermes_call": (hermes, lambda: OutputParser(None, HermesToolParser(TOOLS))),
    }


def unterminated(chars: int) -> dict[str, tuple[str, Callable[[], OutputParser]]]:
    """Replies of ``chars`` characters that open a block and never close it (module docstring)."""

    def hermes() -> OutputParser:
        return OutputParser(None, HermesToolParser(TOOLS))

    def xml() -> OutputParser:
        return OutputParser(None, Qwen3XmlToolParser(TOOLS))

    return {
        "hermes_no_header": ('<tool_call>{"arguments": {"body": "' + "x" * chars, hermes),
        "hermes_endless_name": ('<tool_call>{"name": "' + "x" * chars, hermes),
        "hermes_whitespace": ("<tool_call>" + " " * chars, hermes),
        "xml_integer": ("<tool_call><function=write_file><parameter=mode>" + "1" * chars, xml),
        "reasoning_whitespace": (" " * chars, lambda: OutputParser(Qwen3ReasoningParser(False), None)),
    }


def _stream(pieces: list[str], make: Callable[[], OutputParser]) -> float:
    """Seconds to feed ``pieces`` through a fresh parser (its construction not timed)."""
    parser = make()
    seconds, _ = timed(lambda: [parser.feed(p) for p in pieces] + parser.finish())
    return seconds


def time_stream(text: str, make: Callable[[], OutputParser], piece: int) -> float:
    """Seconds to stream ``text`` in pieces of ``piece`` characters through a fresh parser."""
    return _stream([text[i : i + piece] for i in range(0, len(text), piece)], make)


def time_case(text: str, make: Callable[[], OutputParser], piece: int, reps: int) -> dict[str, Any]:
    """Streamed and whole parses of ``text`` as ``reps`` interleaved rounds: µs per piece."""
    pieces = [text[i : i + piece] for i in range(0, len(text), piece)]

    def whole() -> None:
        make().parse(text)

    times = interleaved({"stream": lambda: _stream(pieces, make), "whole": whole}, reps)
    per_token = {k: scaled(spread(v), 1e6 / len(pieces)) for k, v in times.items()}
    return {
        "tokens": len(pieces),
        "stream_us_per_token": per_token["stream"]["median"],
        "whole_us_per_token": per_token["whole"]["median"],
        "us_per_token": per_token,
    }


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--tokens", type=int, default=4000, help="about this many pieces per reply")
    parser.add_argument("--chars", type=int, default=4, help="characters per piece (default %(default)s)")
    parser.add_argument("--reps", type=int, default=5, help="interleaved rounds of streamed and whole")
    parser.add_argument(
        "--unterminated", metavar="KIB,...", help="time unterminated blocks of these sizes instead"
    )
    args = parser.parse_args()
    bench = Bench("bench_parsers", args)
    results: dict[str, dict[str, Any]] = {}
    if args.unterminated:
        for kib in (int(k) for k in args.unterminated.split(",")):
            for name, (text, make) in unterminated(kib * 1024).items():
                try:
                    seconds = time_stream(text, make, args.chars)
                except Exception as e:  # noqa: BLE001 (a parser that fails is a result here)
                    print(f"{name:20s} {kib:6d} KiB  raised {type(e).__name__}: {str(e)[:80]}")
                    continue
                results.setdefault(name, {})[f"{kib}KiB_s"] = seconds
                print(f"{name:20s} {kib:6d} KiB in {args.chars}-char pieces  {seconds:8.3f} s", flush=True)
        bench.write(args.json, results)
        return
    for name, (text, make) in replies(args.tokens * args.chars // 2).items():
        r = results[name] = time_case(text, make, args.chars, args.reps)
        print(
            f"{name:20s} {r['tokens']:6.0f} tokens  stream {r['stream_us_per_token']:6.2f} µs/token"
            f"  whole {r['whole_us_per_token']:6.2f} µs/token"
            f"  (min-max {show(r['us_per_token']['stream'])} / {show(r['us_per_token']['whole'])})"
        )
    print(describe_box(bench.before))
    bench.write(args.json, results)


if __name__ == "__main__":
    main()
