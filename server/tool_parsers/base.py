"""What every tool-call parser shares: the call deltas it emits, and the text around the blocks.

A parser reads one completion's text (its content part, after any reasoning) in pieces
(``feed``) and returns, in order, content pieces (``str``) and ``CallDelta``\\ s: a call's first
delta carries its ``id`` and ``name`` (arguments ``""``), the next ones pieces of its JSON
``arguments``. ``finish()`` ends the text. The events are the same for every split of the same
text into pieces, so a whole response is one ``feed`` of the whole text (``parse_all``).

Blocks open with ``<tool_call>``. Before a block's function name is known the text is held
back; a block whose opening is not what the format says is content, as written. Once the
name is sent the call stands, and what follows is its arguments as far as they go (a call cut
by ``max_tokens`` keeps what arrived). Whitespace right before and right after a call is
dropped (it separates content from the call); other text between or after blocks is content.

Cost: a streamed completion costs time linear in its text. Every state keeps only what it
cannot decide yet, and reads each character a bounded number of times: ``buf`` never holds
more than one ``FEED_CHUNK`` (a large ``feed`` is read in chunks; the result is the same, as for
any split) plus a tag's length, and text that must wait for a later decision (a block read
whole, a typed value, held whitespace) is kept as a list of pieces, joined once.

Failures: a parser never raises on any text (bounded JSON depth, numbers too long for ``int``,
values ``json`` cannot write, lone surrogates are each handled where they arise). Should a bug
raise anyway, ``salvage`` gives what is owed: the events queued before the failure and every
character received but not yet in an event, as content; ``OutputParser`` then stops parsing.
"""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
#: the most text one parsing run reads: ``feed`` cuts larger text into chunks of this size, so
#: the slicing each decision does costs at most this much however large one feed is
FEED_CHUNK = 2048
#: deepest JSON nesting a parser hands to ``json.loads`` / ``ast.literal_eval``: both recurse
#: per level, and deeper text would raise ``RecursionError`` (well below the interpreter's
#: limit of 1000 frames, whatever the caller's stack)
MAX_JSON_DEPTH = 128
_SURROGATE = re.compile("[\ud800-\udfff]")
_JSON_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')


@dataclass(frozen=True)
class CallDelta:
    """A piece of call ``index`` (0-based in the completion): its header, or arguments text."""

    index: int
    arguments: str
    name: str | None = None
    id: str | None = None


Event = str | CallDelta


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def held_prefix(text: str, tags: Sequence[str]) -> int:
    """The length of the longest end of ``text`` that is a proper prefix of one of ``tags``:
    what must wait for more text before it can be called plain text."""
    longest = 0
    for tag in tags:
        # candidates start with the tag's first character, from the earliest: the first that fits is the longest
        at = text.find(tag[0], max(0, len(text) - len(tag) + 1))
        while at >= 0 and len(text) - at > longest:
            if tag.startswith(text[at:]):
                longest = len(text) - at
                break
            at = text.find(tag[0], at + 1)
    return longest


def first_tag(text: str, tags: Sequence[str]) -> tuple[int, str] | None:
    """The earliest occurrence of any of ``tags`` in ``text``: ``(position, tag)``, else None."""
    best: tuple[int, str] | None = None
    for tag in tags:
        at = text.find(tag)
        if at >= 0 and (best is None or at < best[0]):
            best = (at, tag)
    return best


def within_depth(text: str, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether the brackets of ``text`` outside double-quoted strings nest no deeper than
    ``limit``: a cheap check before ``json.loads``, which recurses per level. Exact for JSON;
    text that is not JSON may be judged deeper than it is, never shallower than the part a JSON
    parser reads before it fails."""
    if text.count("[") + text.count("{") <= limit:
        return True
    depth = 0
    for m in _JSON_TOKEN.finditer(text):
        c = m.group()
        if c in "[{":
            depth += 1
            if depth > limit:
                return False
        elif c in "]}":
            depth -= 1
    return True


def utf8_safe(text: str) -> bool:
    """Whether ``text`` can be written as UTF-8 (no lone surrogates, which JSON ``\\ud800``
    escapes decode to and which no response encoder can write)."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def json_text(value: Any) -> str:
    """``value`` as JSON, non-ASCII written as is but for lone surrogates, written as ``\\udXXX``
    escapes: the same value, and writable as UTF-8. (Character by character, so the JSON of a
    string's pieces adds up to the JSON of the whole string.)"""
    out = json.dumps(value, ensure_ascii=False)
    return out if utf8_safe(out) else _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", out)


def tool_schemas(tools: Sequence[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """Each function's ``parameters`` JSON schema by function name (the request's ``tools``)."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools or []:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict):
            continue
        name = function.get("name")
        if isinstance(name, str):
            params = function.get("parameters")
            out[name] = params if isinstance(params, dict) else {}
    return out


class ToolCallParser(ABC):
    """The content side of every format (module docstring); a subclass reads the blocks.

    A subclass implements ``_open_block`` (a block started) and ``_step`` (consume what it can
    of ``self.buf`` inside a block), using ``_begin_call``, ``_arguments``, ``_end_block`` and
    ``_malformed``.
    """

    def __init__(self, tools: Sequence[dict[str, Any]] | None = None) -> None:
        self.schemas = tool_schemas(tools)
        self.buf = ""  # text not consumed yet (at most FEED_CHUNK and a tag's length)
        self.in_block = False
        self.calls = 0  # calls begun so far (the next call's index)
        self._block_first = 0  # the index of the current block's first call
        self._events: list[Event] = []
        self._held_ws: list[str] = []  # trailing content whitespace: dropped if a call follows
        self._block_ws = ""  # the whitespace held when the current block opened
        self._after_call = False  # drop the content whitespace that follows a call
        self._unfed: tuple[str, int] = ("", 0)  # the current feed's text and where its unread part starts

    # ------------------------------------------------------------------ the interface
    def feed(self, text: str) -> list[Event]:
        for at in range(0, len(text), FEED_CHUNK):
            self._unfed = (text, at + FEED_CHUNK)
            self.buf += text[at : at + FEED_CHUNK]
            self._run(final=False)
        self._unfed = ("", 0)
        return self._take()

    def finish(self) -> list[Event]:
        self._run(final=True)
        if self._held_ws and not self._after_call:
            self._events.append("".join(self._held_ws))
        self._held_ws = []
        return self._take()

    def parse_all(self, text: str) -> list[Event]:
        return self.feed(text) + self.finish()

    def salvage(self) -> list[Event]:
        """After ``feed`` or ``finish`` raised: the events queued before the failure, then every
        character received and not yet in an event (the open block from its opening tag, as
        written) as content. The parser is not to be used again."""
        events = self._take()
        text, at = self._unfed
        opened = self.in_block and self.calls == self._block_first  # the block's tag is in no event
        parts = [*self._held_ws, self._block_ws + TOOL_CALL_START if opened else "", self._pending()]
        rest = "".join(parts) + self.buf + text[at:]
        self.buf, self._held_ws, self._unfed, self.in_block = "", [], ("", 0), False
        if rest:
            events.append(rest)
        return events

    # ------------------------------------------------------------------ for subclasses
    @abstractmethod
    def _open_block(self) -> None:
        """A ``<tool_call>`` was just consumed."""

    @abstractmethod
    def _step(self, final: bool) -> bool:
        """Consume what can be decided of ``self.buf`` inside a block; whether anything
        changed. ``final``: no more text will come, so everything must be decided."""

    def _pending(self) -> str:
        """The text the subclass took out of ``buf`` and has not written into an event yet."""
        return ""

    def _begin_call(self, name: str) -> None:
        self._block_ws = ""  # it separated content from this call
        self._events.append(CallDelta(self.calls, "", name=name, id=new_call_id()))
        self.calls += 1

    def _arguments(self, piece: str) -> None:
        if piece:
            self._events.append(CallDelta(self.calls - 1, piece))

    def _end_block(self) -> None:
        self.in_block = False
        self._after_call = True

    def _malformed(self, consumed: str = "") -> None:
        """Not a call after all: the opening tag, the whitespace before it and ``consumed``
        (what the subclass took out of ``buf``) are content; the rest of ``buf`` is scanned
        as content again."""
        self.in_block = False
        self._content(self._block_ws + TOOL_CALL_START + consumed)

    # ------------------------------------------------------------------ internals
    def _take(self) -> list[Event]:
        out, self._events = self._events, []
        return out

    def _run(self, final: bool) -> None:
        while self._step(final) if self.in_block else self._scan_content(final):
            pass

    def _scan_content(self, final: bool) -> bool:
        at = self.buf.find(TOOL_CALL_START)
        if at < 0:
            keep = 0 if final else held_prefix(self.buf, (TOOL_CALL_START,))
            self._content(self.buf[: len(self.buf) - keep])
            self.buf = self.buf[len(self.buf) - keep :]
            return False
        self._content(self.buf[:at])
        self.buf = self.buf[at + len(TOOL_CALL_START) :]
        self._block_ws, self._held_ws = "".join(self._held_ws), []
        self._block_first = self.calls
        self.in_block = True
        self._open_block()
        return True

    def _content(self, text: str) -> None:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        body = text.rstrip()
        if not body:  # whitespace only: held with what is held (a list: a long run costs its length once)
            self._held_ws.append(text)
            return
        self._events.append("".join(self._held_ws) + body)
        self._held_ws = [text[len(body) :]] if len(body) < len(text) else []
