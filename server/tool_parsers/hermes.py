"""Hermes / Qwen2.5-Qwen3 JSON tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

A block that opens ``{"name": "...", "arguments": {`` (the form the templates ask for; the
key may also be ``parameters``) streams: the name as soon as the header is read, then the
arguments object as it arrives, re-spaced the way ``json.dumps`` spaces (no whitespace
outside strings, ``", "`` and ``": "`` separators; strings and numbers as written), up to
the brace that closes it. Any other block is read whole (up to ``</tool_call>`` or the end)
and is a call only if its body is a JSON object with a non-empty string ``name`` and object
``arguments`` (or a string holding one), nested no deeper than ``MAX_JSON_DEPTH``; otherwise
it is content. A name that does not decode (a bad escape, a control character) or decodes to
a lone surrogate is no name.

Each character is read once: the header by a matcher that keeps its place between pieces
(the ``_HEADER`` pattern, one character at a time), a block read whole is kept as pieces and
parsed once when it ends.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from enum import Enum
from typing import Any

from deltaserve.server.tool_parsers.base import (
    TOOL_CALL_END,
    ToolCallParser,
    held_prefix,
    json_text,
    utf8_safe,
    within_depth,
)

#: what a streamed header is (``_Header`` matches it piece by piece; this is its specification)
_HEADER = re.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)'
)
_SPACED = {",": ", ", ":": ": "}
_SCALAR = set("0123456789+-.eE" + "truefalsn")
_SCALAR_RUN = re.compile(r"[0-9+\-.eEtruefalsn]+")
_JSON_WS_RUN = re.compile(r"[ \t\r\n]+")
_STRING_RUN = re.compile(r'[^"\\]+')
_WS_RUN = re.compile(r"\s*")


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
        i, n = 0, len(text)
        while i < n:
            c = text[i]
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif c == "\\":
                    self.escape = True
                elif c == '"':
                    self.in_string = False
                else:  # a run of plain string characters, copied at once
                    end = _STRING_RUN.match(text, i).end()  # type: ignore[union-attr]
                    out.append(text[i:end])
                    i = end
                    continue
                out.append(c)
            elif c in " \t\r\n":
                i = _JSON_WS_RUN.match(text, i).end()  # type: ignore[union-attr]
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
                end = _SCALAR_RUN.match(text, i).end()  # type: ignore[union-attr]
                out.append(text[i:end])
                i = end
                continue
            else:
                self.failed = True
                return "".join(out), i
            i += 1
        return "".join(out), n


class _Status(Enum):
    NEED = "need"  # what was read is a prefix of a header
    MATCH = "match"
    FAIL = "fail"  # no text that follows makes it a header


class _Step(Enum):
    """A step of ``_HEADER`` other than a literal."""

    WS = "ws"  # \s*
    NAME = "name"  # (?:[^"\\]|\\.)*" : the name and its closing quote
    KEY = "key"  # arguments|parameters
    PEEK = "peek"  # (?=\{)


_WS, _NAME, _KEY, _PEEK = _Step.WS, _Step.NAME, _Step.KEY, _Step.PEEK
_STEPS: tuple[_Step | str, ...] = (
    *(_WS, "{", _WS, '"name"', _WS, ":", _WS, '"', _NAME),
    *(_WS, ",", _WS, '"', _KEY, '"', _WS, ":", _WS, _PEEK),
)
_KEYS = {"a": "arguments", "p": "parameters"}


class _Header:
    """``_HEADER`` matched against a block's text as it arrives, each character read once (the
    pattern never backtracks: each step's extent is decided by the character after it)."""

    def __init__(self) -> None:
        self.status = _Status.NEED
        self.step = 0  # index into _STEPS
        self.lit = 0  # characters of the current literal matched
        self.key = ""  # "arguments" or "parameters", once its first character is read
        self.escape = False  # inside the name, right after a backslash
        self.name: list[str] = []  # the name as written (JSON string body)

    def feed(self, text: str) -> int | None:
        """Read ``text``; on ``MATCH`` the offset in it where the header ends (the arguments'
        ``{``), else None."""
        i, n = 0, len(text)
        while i < n and self.status is _Status.NEED:
            step = _STEPS[self.step]
            if step is _WS:
                i = _WS_RUN.match(text, i).end()  # type: ignore[union-attr]
                if i < n:
                    self.step += 1
            elif step is _NAME:
                i = self._name(text, i)
            elif step is _PEEK:
                if text[i] != "{":
                    self.status = _Status.FAIL
                    return None
                self.status = _Status.MATCH
                return i
            else:
                lit = step if isinstance(step, str) else (self.key or _KEYS.get(text[i], ""))
                self.key = "" if isinstance(step, str) else lit
                while i < n and self.lit < len(lit):
                    if text[i] != lit[self.lit]:
                        self.status = _Status.FAIL
                        return None
                    i, self.lit = i + 1, self.lit + 1
                if lit and self.lit == len(lit):
                    self.step, self.lit, self.key = self.step + 1, 0, ""
                elif not lit:
                    self.status = _Status.FAIL
        return None

    def _name(self, text: str, i: int) -> int:
        """The name's characters from ``i`` (``(?:[^"\\]|\\.)*"``); where reading stopped."""
        if self.escape:
            if text[i] == "\n":  # "." is any character but a newline
                self.status = _Status.FAIL
                return i
            self.name.append(text[i])
            self.escape = False
            return i + 1
        c = text[i]
        if c == '"':
            self.step += 1
            return i + 1
        if c == "\\":
            self.name.append(c)
            self.escape = True
            return i + 1
        end = _STRING_RUN.match(text, i).end()  # type: ignore[union-attr]
        self.name.append(text[i:end])
        return end

    def decoded_name(self) -> str | None:
        """The name, or None when it does not decode to a non-empty, UTF-8-writable string."""
        try:
            name = json.loads('"' + "".join(self.name) + '"')
        except ValueError:
            return None
        return name if isinstance(name, str) and name and utf8_safe(name) else None


def _loads(text: str) -> tuple[bool, Any]:
    """``(ok, value)``: ``text`` as JSON, refused when nested deeper than ``MAX_JSON_DEPTH``."""
    if not within_depth(text):
        return False, None
    try:
        return True, json.loads(text)
    except (ValueError, RecursionError):  # ValueError: not JSON, or an integer too long for int
        return False, None


def _whole_block(body: str) -> tuple[str, str] | None:
    """``(name, arguments JSON)`` of a block read whole, or None when it is not a call."""
    ok, obj = _loads(body)
    if not ok or not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name or not utf8_safe(name):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models emit the arguments already serialised
        ok, args = _loads(args)
        if not ok:
            return None
    if not isinstance(args, dict):
        return None
    try:
        return name, json_text(args)
    except (ValueError, RecursionError):  # what json.loads read, json.dumps writes: a safety margin
        return None


class HermesToolParser(ToolCallParser):
    """The JSON form (module docstring)."""

    def __init__(self, tools: Sequence[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self._open_block()

    def _open_block(self) -> None:
        self.header = _Header()
        self.body: list[str] = []  # the block's text read so far, while it is not a streamed call
        self.args: JsonRespacer | None = None  # set while the arguments stream
        self.tail = False  # the arguments ended: skip the closing brace up to </tool_call>
        self.brace_skipped = False  # (in the tail) the object's closing brace was dropped

    def _pending(self) -> str:
        return "".join(self.body)

    def _step(self, final: bool) -> bool:
        if self.tail:
            return self._skip_tail(final)
        if self.args is not None:
            return self._stream_arguments(final)
        # the block's text so far is body + buf; what may be the start of </tool_call> stays in buf
        end = self.buf.find(TOOL_CALL_END)
        if end >= 0:
            piece = self.buf[:end]
        elif final:
            piece = self.buf
        else:
            piece = self.buf[: len(self.buf) - held_prefix(self.buf, (TOOL_CALL_END,))]
        if self.header.status is _Status.NEED and piece:
            at = self.header.feed(piece)
            if at is not None:
                name = self.header.decoded_name()
                if name is not None:
                    self._begin_call(name)
                    self.body = []  # the header is the call's first delta
                    self.buf = self.buf[at:]
                    self.args = JsonRespacer()
                    return True
                self.header.status = _Status.FAIL
        # body + buf is the block's text not yet in an event (salvage relies on it at every step)
        if piece:
            self.body.append(piece)
            self.buf = self.buf[len(piece) :]
        if end < 0 and not final:
            return False  # the header, or the end of a block read whole, may still come
        body = "".join(self.body)
        whole = _whole_block(body.strip())
        self.body = []
        self.buf = self.buf[len(TOOL_CALL_END) :] if end >= 0 else ""
        if whole is None:
            self._malformed(body + (TOOL_CALL_END if end >= 0 else ""))
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
        any other text ends the block and is content. (Whitespace and the brace are dropped
        from ``buf`` as they come: a long run of whitespace is read once.)"""
        rest = self.buf.lstrip()
        if not self.brace_skipped and rest.startswith("}"):
            rest, self.brace_skipped = rest[1:].lstrip(), True
        if rest.startswith(TOOL_CALL_END):
            self.buf = rest[len(TOOL_CALL_END) :]
        elif rest and (final or not TOOL_CALL_END.startswith(rest)):
            self.buf = rest
        elif not final:
            self.buf = rest
            return False
        else:
            self.buf = rest
        self._end_block()
        return True
