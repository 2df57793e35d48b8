"""Qwen3.5 / Qwen3-Coder XML tool calls.

::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    2
    </parameter>
    </function>
    </tool_call>

A block is a call once ``<function=NAME>`` follows the opening tag (whitespace aside); any
other opening is content. Each parameter's value (one newline after the opening tag and one
before the closing tag are layout, not value) becomes a JSON value by the type the tool's
schema gives it: integer, number, boolean, null, object and array values are parsed (a value
that does not parse stays a string), strings and parameters the schema does not type are
kept verbatim. The ``arguments`` JSON streams per parameter, and a string value streams as
it arrives. A value may also end at the next ``<parameter=`` or at ``</function>`` (models
drop ``</parameter>``); text between parameters is skipped; several ``<function=`` in one
block are several calls. At the end of the text an open call is closed (a value cut inside its
closing tag ends before it): its arguments are always a JSON object.

A typed value is kept as written (a string) when it does not make a JSON value every client
reads: an integer of more than ``MAX_INT_DIGITS`` digits (Python's ``int`` refuses them), a
number that is not finite, nesting deeper than ``MAX_JSON_DEPTH``, or a Python literal JSON has
no form for (a complex number, bytes, a set). Lone surrogates (from ``\\ud800`` escapes) are
written escaped. A schema of an unexpected shape (``properties`` not an object, ``anyOf`` not
a list) types nothing.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Sequence
from enum import Enum
from typing import Any

from deltaserve.server.tool_parsers.base import (
    TOOL_CALL_END,
    ToolCallParser,
    first_tag,
    held_prefix,
    json_text,
    within_depth,
)

FUNCTION = "<function="
FUNCTION_END = "</function>"
PARAMETER = "<parameter="
PARAMETER_END = "</parameter>"
#: longest function / parameter name read; a longer one is not a tag
MAX_NAME_CHARS = 256
_NAME = re.compile(r"[^\s<>=]+")
_VALUE_ENDS = (PARAMETER_END, PARAMETER, FUNCTION_END, TOOL_CALL_END)
_BETWEEN = (PARAMETER, FUNCTION_END, TOOL_CALL_END)
_INTEGER = re.compile(r"[-+]?\d+")
#: the longest integer value read as a number: Python's default limit on int <-> str
#: conversion (and ``json`` in most clients reads no longer one exactly)
MAX_INT_DIGITS = 4300
#: deepest ``anyOf`` / ``oneOf`` nesting of a parameter schema read for its types
_MAX_SCHEMA_DEPTH = 16


class _State(Enum):
    OPEN = "open"  # after <tool_call> (or a call in the same block): <function=NAME> expected
    FUNCTION = "function"  # between parameters
    VALUE = "value"  # inside a parameter's value
    AFTER = "after"  # after </function>: </tool_call>, or another <function=


def _types(schema: dict[str, Any], depth: int = 0) -> list[str]:
    """The JSON types a parameter's schema allows (``type``, or those of ``anyOf`` / ``oneOf``)."""
    kind = schema.get("type")
    if isinstance(kind, str):
        return [kind]
    if isinstance(kind, list):
        return [k for k in kind if isinstance(k, str)]
    out: list[str] = []
    if depth >= _MAX_SCHEMA_DEPTH:
        return out
    for key in ("anyOf", "oneOf"):
        subs = schema.get(key)
        for sub in subs if isinstance(subs, list) else []:
            if isinstance(sub, dict):
                out += _types(sub, depth + 1)
    return out


def _writable(value: Any) -> bool:
    """Whether ``value`` is one JSON can write and every client can read back: JSON types only,
    finite numbers, integers of at most ``MAX_INT_DIGITS`` digits."""
    try:
        json.dumps(value, allow_nan=False)
    except (ValueError, TypeError, RecursionError):
        return False
    return True


def _typed(text: str, kind: str) -> tuple[bool, Any]:
    """``(ok, value)``: ``text`` (stripped) as a value of JSON type ``kind``."""
    if kind == "integer" and _INTEGER.fullmatch(text):
        if len(text.lstrip("+-")) > MAX_INT_DIGITS:
            return False, None
        return True, int(text)
    if kind == "boolean" and text.lower() in ("true", "false"):
        return True, text.lower() == "true"
    if kind == "null" and text.lower() in ("null", "none"):
        return True, None
    if kind in ("number", "object", "array") and within_depth(text):
        want = {"number": (int, float), "object": dict, "array": list}[kind]
        for load in (json.loads, ast.literal_eval):  # literal_eval: Python-style quotes / True
            try:
                value = load(text)
            except Exception:  # noqa: BLE001 (any failure of a loader, warnings made errors too: not this type)
                continue
            if isinstance(value, want) and not isinstance(value, bool) and _writable(value):
                return True, value
    return False, None


def convert(value: str, types: Sequence[str]) -> Any:
    """A parameter's text as the JSON value its schema types say (module docstring)."""
    text = value.strip()
    if "null" in types and text.lower() in ("null", "none"):
        return None
    if "string" not in types:
        for kind in types:
            ok, out = _typed(text, kind)
            if ok:
                return out
    return value


class Qwen3XmlToolParser(ToolCallParser):
    """The XML form (module docstring)."""

    def __init__(self, tools: Sequence[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self._open_block()

    def _open_block(self) -> None:
        self.state = _State.OPEN
        self.block_calls = 0  # calls begun in this block
        self.lead: list[str] = []  # (OPEN) the whitespace read before <function=
        self.function = ""
        self.params = 0  # parameters written into the current call's arguments
        self.types: list[str] = []  # the current parameter's JSON types ([]: a plain string)
        self.value: list[str] = []  # the current value's text not yet written
        self.started = False  # the current value's first character was seen

    def _pending(self) -> str:
        return "".join(self.lead) + "".join(self.value)

    def _step(self, final: bool) -> bool:
        if self.state is _State.OPEN:
            return self._read_function(final)
        if self.state is _State.FUNCTION:
            return self._between(final)
        if self.state is _State.VALUE:
            return self._read_value(final)
        return self._after(final)

    # ------------------------------------------------------------------ states
    def _read_function(self, final: bool) -> bool:
        """``<function=NAME>``: a call begins; anything else: not a call."""
        rest = self.buf.lstrip()
        if len(rest) < len(self.buf):  # whitespace is set aside as it comes: read once
            self.lead.append(self.buf[: len(self.buf) - len(rest)])
            self.buf = rest
        if not rest.startswith(FUNCTION):
            return False if FUNCTION.startswith(rest) and not final else self._not_a_call()
        close = rest.find(">", len(FUNCTION), len(FUNCTION) + MAX_NAME_CHARS + 1)
        name = rest[len(FUNCTION) : close] if close >= 0 else rest[len(FUNCTION) :]
        if len(name) > MAX_NAME_CHARS or (name and not _NAME.fullmatch(name)) or (close >= 0 and not name):
            return self._not_a_call()
        if close < 0:
            return False if not final else self._not_a_call()
        self.buf = rest[close + 1 :]
        self.function, self.params, self.lead = name, 0, []
        self.block_calls += 1
        self._begin_call(name)
        self.state = _State.FUNCTION
        return True

    def _not_a_call(self) -> bool:
        lead, self.lead = "".join(self.lead), []
        if self.block_calls:
            self._end_block()  # a later function of the block did not open: the block ends here
        else:
            self._malformed(lead)
        return True

    def _between(self, final: bool) -> bool:
        found = first_tag(self.buf, _BETWEEN)
        if found is None:
            if final:
                self._close_call()
                self._end_block()
                return True
            keep = held_prefix(self.buf, _BETWEEN)
            dropped = len(self.buf) - keep  # text between parameters is layout
            self.buf = self.buf[dropped:]
            return False
        at, tag = found
        self.buf = self.buf[at + len(tag) :]
        if tag == PARAMETER:
            return self._open_parameter(final)
        self._close_call()
        if tag == FUNCTION_END:
            self.state = _State.AFTER
        else:
            self._end_block()
        return True

    def _open_parameter(self, final: bool) -> bool:
        close = self.buf.find(">", 0, MAX_NAME_CHARS + 1)
        if close < 0:
            if final or len(self.buf) > MAX_NAME_CHARS:
                return True  # no name will come: the text is skipped like other layout
            self.buf = PARAMETER + self.buf  # the name is not complete yet
            return False
        name = self.buf[:close]
        self.buf = self.buf[close + 1 :]
        properties = self.schemas.get(self.function, {}).get("properties")
        schema = properties.get(name) if isinstance(properties, dict) else None
        kinds = _types(schema) if isinstance(schema, dict) else []
        # a string value (or an untyped one) streams verbatim; converted only when "null" may be meant
        self.types = kinds if kinds and ("string" not in kinds or "null" in kinds) else []
        self._arguments(("{" if self.params == 0 else ", ") + json.dumps(name, ensure_ascii=False) + ": ")
        if not self.types:
            self._arguments('"')
        self.params += 1
        self.value, self.started = [], False
        self.state = _State.VALUE
        return True

    def _read_value(self, final: bool) -> bool:
        found = first_tag(self.buf, _VALUE_ENDS)
        if found is None and not final:
            keep = held_prefix(self.buf, _VALUE_ENDS)
            piece = self.buf[: len(self.buf) - keep]
            self.buf = self.buf[len(piece) :]
            if piece:
                self.value.append(piece)
            if not self.types:
                self._stream_string()
            return bool(piece)
        # at the end of the text, a value cut inside its closing tag ends before the tag
        at, tag = found if found is not None else (len(self.buf) - held_prefix(self.buf, _VALUE_ENDS), "")
        self.value.append(self.buf[:at])
        self.buf = self.buf[at:]  # the closing tag is dropped once the value is written (salvage)
        self._close_value()
        self.buf = self.buf[len(tag) if tag == PARAMETER_END else 0 :] if tag else ""
        self.state = _State.FUNCTION
        return True

    def _after(self, final: bool) -> bool:
        rest = self.buf = self.buf.lstrip()  # whitespace here is layout in every outcome
        for tag in (TOOL_CALL_END, FUNCTION):
            if rest.startswith(tag):
                if tag == FUNCTION:
                    self.buf = rest
                    self.state = _State.OPEN
                    return True
                self.buf = rest[len(tag) :]
                self._end_block()
                return True
        if not final and (TOOL_CALL_END.startswith(rest) or FUNCTION.startswith(rest)):
            return False
        self.buf = rest  # no closing tag: the block ends, what follows is content
        self._end_block()
        return True

    # ------------------------------------------------------------------ values
    def _stream_string(self) -> None:
        """Write what is safe of a string value: not its layout newlines, which are known
        only when the value ends (``value`` keeps at most that newline)."""
        text = "".join(self.value)
        if not self.started:
            if not text:
                return
            self.started = True
            text = text.removeprefix("\n")
        keep = 1 if text.endswith("\n") else 0
        self._arguments(json_text(text[: len(text) - keep])[1:-1])
        self.value = [text[len(text) - keep :]] if keep else []

    def _close_value(self) -> None:
        text = "".join(self.value)
        text = (text if self.started else text.removeprefix("\n")).removesuffix("\n")
        if self.types:
            self._arguments(json_text(convert(text, self.types)))
        else:
            self._arguments(json_text(text)[1:-1] + '"')
        self.value, self.started = [], False

    def _close_call(self) -> None:
        self._arguments("}" if self.params else "{}")
