"""CallScanner: the calls of a ``tool_choice: "required"`` output, read as it is generated.

The grammar (``server/structured.py``) makes that output exactly
``[{"name": "NAME", "parameters": {...}}, {"name": ...}]``: keys in this order, these separators,
no other whitespace. So a call's name is known as soon as its closing quote arrives, and its
arguments are the text of the ``parameters`` object, which ends where its braces balance
(outside strings). ``feed`` returns what each new piece of text adds: a call's start (its
index and name), then pieces of its arguments, which concatenate to the object's text.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass

_ITEM = '{"name": "'
_ARGS = '", "parameters": '


class _Phase(enum.Enum):
    ITEM = "item"  # before the next call's name
    NAME = "name"  # inside a name
    ARGS = "args"  # inside a call's arguments object


@dataclass(frozen=True)
class CallEvent:
    """Call ``index`` starts (``name`` set, ``arguments`` empty) or continues (``name`` None,
    ``arguments`` the next piece of its arguments' text)."""

    index: int
    name: str | None
    arguments: str


class CallScanner:
    """The incremental reader of one output (module docstring)."""

    def __init__(self) -> None:
        self.buf = ""
        self.pos = 0  # what is before has been read
        self.phase = _Phase.ITEM
        self.index = -1  # the call being read
        self.depth = 0  # brace / bracket depth inside the arguments
        self.in_string = False
        self.escaped = False

    def feed(self, text: str) -> list[CallEvent]:
        """The events ``text`` (the next piece of the output) completes."""
        self.buf += text
        events: list[CallEvent] = []
        while self._advance(events):
            pass
        return events

    def _advance(self, events: list[CallEvent]) -> bool:
        """Read as far as the text allows in the current phase; whether the phase changed."""
        if self.phase is _Phase.ITEM:
            at = self.buf.find(_ITEM, self.pos)
            if at < 0:
                return False
            self.pos, self.phase = at + len(_ITEM), _Phase.NAME
            return True
        if self.phase is _Phase.NAME:
            at = self.buf.find(_ARGS, self.pos)
            if at < 0:
                return False
            self.index += 1
            events.append(CallEvent(self.index, json.loads(f'"{self.buf[self.pos : at]}"'), ""))
            self.pos, self.phase = at + len(_ARGS), _Phase.ARGS
            self.depth, self.in_string, self.escaped = 0, False, False
            return True
        end = self._arguments_end()
        stop = len(self.buf) if end is None else end
        if stop > self.pos:
            events.append(CallEvent(self.index, None, self.buf[self.pos : stop]))
        self.pos = stop
        if end is None:
            return False
        self.phase = _Phase.ITEM
        return True

    def _arguments_end(self) -> int | None:
        """Where the arguments object ends (one past its closing brace), reading on from
        ``pos``; None while it is open."""
        for k in range(self.pos, len(self.buf)):
            ch = self.buf[k]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return k + 1
        return None
