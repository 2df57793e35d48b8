"""Hermes / Qwen2.5-Qwen3 JSON tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

A block that opens ``{"name": "...", "arguments": {`` (the form the templates ask for; the
key may also be ``parameters``) streams: the name as soon as the header is read, then the
arguments object as it arrives, re-spaced the way ``json.dumps`` spaces (no whitespace
outside strings, ``", "`` and ``": "`` separators; strings and numbers as written), up to
the brace that closes it. Any other block is read whole (up to ``</tool_call>`` or the end)
and is a call only if its body is a JSON object with a non-empty string ``name`` and object
``arguments`` (or a string holding one); otherwise it is content.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from deltaserve.server.tool_parsers.base import TOOL_CALL_END, ToolCallParser

_HEADER = re.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)'
)
_SPACED = {",": ", ", ":": ": "}
_SCALAR = set("0123456789+-.eE" + "truefalsn")


class JsonRespacer:
    """One JSON value, character by character, re-spaced (module docstring); ``done`` once its
    outermost bracket closes, ``failed`` at a character no JSON value can hold there."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.done = False
        self.failed = False

    def feed(self, text: str) -> tuple[str, int]:
        """``(re-spaced text, characters of text consumed)``: it stops after the value ends."""
        out: list[str] = []
        for i, c in enumerate(text):
            if self.in_string:
                out.append(c)
                if self.escape:
                    self.escape = False
                elif c == "\\":
                    self.escape = True
                elif c == '"':
                    self.in_string = False
            elif c in " \t\r\n":
                continue
            elif c in "{[":
                self.depth += 1
                out.append(c)
            elif c in "}]":
                self.depth -= 1
                out.append(c)
                if self.depth == 0:
                    self.done = True
                    return "".join(out), i + 1
            elif c == '"':
                self.in_string = True
                out.append(c)
            elif c in _SPACED:
                out.append(_SPACED[c])
            elif c in _SCALAR:
                out.append(c)
            else:
                self.failed = True
                return "".join(out), i
        return "".join(out), len(text)


def _whole_block(body: str) -> tuple[str, str] | None:
    """``(name, arguments JSON)`` of a block read whole, or None when it is not a call."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models emit the arguments already serialised
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


class HermesToolParser(ToolCallParser):
    """The JSON form (module docstring)."""

    def __init__(self, tools: Sequence[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self._open_block()

    def _open_block(self) -> None:
        self.args: JsonRespacer | None = None  # set while the arguments stream
        self.tail = False  # the arguments ended: skip the closing brace up to </tool_call>

    def _step(self, final: bool) -> bool:
        if self.tail:
            return self._skip_tail(final)
        if self.args is not None:
            return self._stream_arguments(final)
        end = self.buf.find(TOOL_CALL_END)
        body = self.buf if end < 0 else self.buf[:end]
        header = _HEADER.match(body)
        if header is not None:
            name = json.loads(f'"{header.group(1)}"')
            if name:
                self._begin_call(name)
                self.buf = self.buf[header.end() :]
                self.args = JsonRespacer()
                return True
        if end < 0 and not final:
            return False  # the header may still come
        whole = _whole_block(body.strip())
        consumed = body + (TOOL_CALL_END if end >= 0 else "")
        self.buf = self.buf[len(consumed) :]
        if whole is None:
            self._malformed(consumed)
        else:
            self._begin_call(whole[0])
            self._arguments(whole[1])
            self._end_block()
        return True

    def _stream_arguments(self, final: bool) -> bool:
        assert self.args is not None
        text, used = self.args.feed(self.buf)
        self._arguments(text)
        self.buf = self.buf[used:]
        if self.args.done or self.args.failed or final:
            self.tail = True
            return True
        return bool(used)

    def _skip_tail(self, final: bool) -> bool:
        """After the arguments: the object's closing brace and ``</tool_call>`` are dropped;
        any other text ends the block and is content."""
        rest = self.buf.lstrip().removeprefix("}").lstrip()
        if rest.startswith(TOOL_CALL_END):
            self.buf = rest[len(TOOL_CALL_END) :]
        elif rest and (final or not TOOL_CALL_END.startswith(rest)):
            self.buf = rest
        elif not final:
            return False
        else:
            self.buf = rest
        self._end_block()
        return True
