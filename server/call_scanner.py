"""CallScanner: the calls of a ``tool_choice: "required"`` output, read as it is generated.

The grammar (``server/structured.py``) makes that output exactly
``[{"name": "NAME", "parameters": {...}}, {"name": ...}]``: keys in this order, these separators,
no other whitespace. So a call's name is known as soon as its closing quote arrives, and its
arguments are the text of the ``parameters`` object, which ends where its braces balance
(outside strings). ``feed`` returns what each new piece of text adds: a call's start (its
index and name), then pieces of its arguments, which concatenate to the object's text.

Each character is read once: ``buf`` keeps only what may still be the start of the text looked
for, and a name is kept as pieces until it ends. ``feed`` never raises: a name that does not
decode as a JSON string (or decodes to a lone surrogate) is given as written.

``ForcedCallParser`` is a forced call's output (a named function's arguments object, or the
``"required"`` array) read as a tool-call parser: ``OutputParser`` runs it for a whole response
and for a stream alike, so both give the same calls, a call cut by ``max_tokens`` included
(its name once known, its arguments the JSON text generated so far).
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass

from deltaserve.server.tool_parsers.base import CallDelta, Event, new_call_id, utf8_safe

_ITEM = '{"name": "'
_ARGS = '", "parameters": '
_PLAIN = re.compile(r'[^"\\{}\[\]]+')  # characters that change nothing in the arguments


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
        self.buf = ""  # the text not yet read, from pos on
        self.pos = 0  # what is before has been read
        self.phase = _Phase.ITEM
        self.name: list[str] = []  # (NAME) the name's text read so far
        self.index = -1  # the call being read
        self.depth = 0  # brace / bracket depth inside the arguments
        self.in_string = False
        self.escaped = False

    def feed(self, text: str) -> list[CallEvent]:
        """The events ``text`` (the next piece of the output) completes."""
        self.buf = self.buf[self.pos :] + text
        self.pos = 0
        events: list[CallEvent] = []
        while self._advance(events):
            pass
        return events

    def _advance(self, events: list[CallEvent]) -> bool:
        """Read as far as the text allows in the current phase; whether the phase changed."""
        if self.phase is _Phase.ITEM:
            at = self.buf.find(_ITEM, self.pos)
            if at < 0:  # only what may start _ITEM is kept
                self.pos = max(self.pos, len(self.buf) - len(_ITEM) + 1)
                return False
            self.pos, self.phase = at + len(_ITEM), _Phase.NAME
            return True
        if self.phase is _Phase.NAME:
            at = self.buf.find(_ARGS, self.pos)
            if at < 0:
                keep = max(self.pos, len(self.buf) - len(_ARGS) + 1)
                self.name.append(self.buf[self.pos : keep])
                self.pos = keep
                return False
            self.index += 1
            self.name.append(self.buf[self.pos : at])
            events.append(CallEvent(self.index, _decode("".join(self.name)), ""))
            self.name = []
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
        k, n = self.pos, len(self.buf)
        while k < n:
            ch = self.buf[k]
            if not self.escaped and ch not in '"\\{}[]':  # a run that changes nothing: skipped at once
                k = _PLAIN.match(self.buf, k).end()  # type: ignore[union-attr]
                continue
            k += 1
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
                    return k
        return None


def _decode(name: str) -> str:
    """A name's JSON string text, decoded; as written when it does not decode to text a
    response can carry."""
    try:
        out = json.loads(f'"{name}"')
    except ValueError:
        return name
    return out if isinstance(out, str) and utf8_safe(out) else name


class ForcedCallParser:
    """The calls of a forced output, as ``CallDelta`` events (module docstring).

    ``name`` set: the output is that function's arguments object, as generated; the call's
    header comes with the first text (or at ``finish`` when none came), so a response always
    has the call, its arguments possibly cut. ``name`` None (``tool_choice: "required"``): the
    output is the array ``CallScanner`` reads; a call exists once its name has been generated.
    The output holds nothing but calls: no event is content.
    """

    def __init__(self, name: str | None) -> None:
        self.name = name
        self.scanner = CallScanner() if name is None else None
        self.started = False  # (named) the header was given

    def feed(self, text: str) -> list[Event]:
        if self.scanner is not None:
            return [
                CallDelta(e.index, "", name=e.name, id=new_call_id()) if e.name is not None
                else CallDelta(e.index, e.arguments)
                for e in self.scanner.feed(text)
            ]  # fmt: skip
        out: list[Event] = []
        if not self.started:
            self.started = True
            out.append(CallDelta(0, "", name=self.name, id=new_call_id()))
        if text:
            out.append(CallDelta(0, text))
        return out

    def finish(self) -> list[Event]:
        return self.feed("") if self.scanner is None and not self.started else []

    def salvage(self) -> list[Event]:
        """``feed`` never raises (``CallScanner``): nothing is owed."""
        return []
