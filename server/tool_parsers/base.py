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
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


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
        for k in range(min(len(tag) - 1, len(text)), longest, -1):
            if text.endswith(tag[:k]):
                longest = k
                break
    return longest


def first_tag(text: str, tags: Sequence[str]) -> tuple[int, str] | None:
    """The earliest occurrence of any of ``tags`` in ``text``: ``(position, tag)``, else None."""
    best: tuple[int, str] | None = None
    for tag in tags:
        at = text.find(tag)
        if at >= 0 and (best is None or at < best[0]):
            best = (at, tag)
    return best


def tool_schemas(tools: Sequence[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """Each function's ``parameters`` JSON schema by function name (the request's ``tools``)."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools or []:
        function = tool.get("function") or {}
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
        self.buf = ""  # text not consumed yet
        self.in_block = False
        self.calls = 0  # calls begun so far (the next call's index)
        self._events: list[Event] = []
        self._held_ws = ""  # trailing content whitespace: dropped if a call follows
        self._block_ws = ""  # the whitespace held when the current block opened
        self._after_call = False  # drop the content whitespace that follows a call

    # ------------------------------------------------------------------ the interface
    def feed(self, text: str) -> list[Event]:
        self.buf += text
        self._run(final=False)
        return self._take()

    def finish(self) -> list[Event]:
        self._run(final=True)
        if self._held_ws and not self._after_call:
            self._events.append(self._held_ws)
        self._held_ws = ""
        return self._take()

    def parse_all(self, text: str) -> list[Event]:
        return self.feed(text) + self.finish()

    # ------------------------------------------------------------------ for subclasses
    @abstractmethod
    def _open_block(self) -> None:
        """A ``<tool_call>`` was just consumed."""

    @abstractmethod
    def _step(self, final: bool) -> bool:
        """Consume what can be decided of ``self.buf`` inside a block; whether anything
        changed. ``final``: no more text will come, so everything must be decided."""

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
        self._block_ws, self._held_ws = self._held_ws, ""
        self.in_block = True
        self._open_block()
        return True

    def _content(self, text: str) -> None:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        text = self._held_ws + text
        body = text.rstrip()
        self._held_ws = text[len(body) :]
        if body:
            self._events.append(body)
