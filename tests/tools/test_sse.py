"""The load generator's server-sent-event reader: payloads whatever the byte stream's splits."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from deltaserve.tools.backends import sse_data

STREAM = b'data: {"a": 1}\n\n: keep-alive comment\n\ndata:{"b": 2}\r\n\r\nevent: x\ndata: [DONE]\n\n'


async def pieces(blob: bytes, size: int) -> AsyncIterator[bytes]:
    for i in range(0, len(blob), size):
        yield blob[i : i + size]


async def collect(blob: bytes, size: int) -> list[bytes]:
    return [d async for d in sse_data(pieces(blob, size))]


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_payloads_survive_any_split(size: int) -> None:
    assert asyncio.run(collect(STREAM, size)) == [b'{"a": 1}', b'{"b": 2}', b"[DONE]"]


def test_a_last_line_without_newline_is_read() -> None:
    assert asyncio.run(collect(b"data: 1\n\ndata: 2", 4)) == [b"1", b"2"]
