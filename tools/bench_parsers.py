#!/usr/bin/env python
"""Host cost of parsing chat replies: µs per streamed token for the reply parsers.

    python tools/bench_parsers.py                 # each case, a reply of ~4,000 tokens
    python tools/bench_parsers.py --tokens 20000 --json out.json

A reply is split into pieces of ``--chars`` characters (a token's text is 3-4 characters on
average) and fed to a fresh ``OutputParser`` per repetition, as a stream feeds it; the whole
reply in one feed (a non-streamed response) is timed too. Cases: plain text (no tags: the
content path), Qwen3 reasoning then text, reasoning then Qwen3.5 XML calls with a long string
parameter, and hermes JSON calls. Torch-free; single-threaded.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from deltaserve.server.output_parser import OutputParser
from deltaserve.server.reasoning import Qwen3ReasoningParser
from deltaserve.server.tool_parsers.hermes import HermesToolParser
from deltaserve.server.tool_parsers.qwen3_xml import Qwen3XmlToolParser

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string"},
                    "body": {"type": "string"},
                    "mode": {"type": "integer"},
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


def time_case(text: str, make: Callable[[], OutputParser], piece: int, reps: int) -> dict[str, float]:
    pieces = [text[i : i + piece] for i in range(0, len(text), piece)]
    streamed, whole = [], []
    for _ in range(reps):
        parser = make()
        t0 = time.perf_counter()
        for s in pieces:
            parser.feed(s)
        parser.finish()
        streamed.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        make().parse(text)
        whole.append(time.perf_counter() - t0)
    return {
        "tokens": len(pieces),
        "stream_us_per_token": 1e6 * statistics.median(streamed) / len(pieces),
        "whole_us_per_token": 1e6 * statistics.median(whole) / len(pieces),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=4000, help="about this many pieces per reply")
    parser.add_argument("--chars", type=int, default=4, help="characters per piece (default %(default)s)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    results = {}
    for name, (text, make) in replies(args.tokens * args.chars // 2).items():
        r = results[name] = time_case(text, make, args.chars, args.reps)
        print(
            f"{name:20s} {r['tokens']:6.0f} tokens  stream {r['stream_us_per_token']:6.2f} µs/token"
            f"  whole {r['whole_us_per_token']:6.2f} µs/token"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
