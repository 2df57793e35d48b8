"""Qwen-style tool calls in generated text: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

Qwen2.5 / Qwen3 / Qwen3-Next chat templates tell the model to answer a tool request with one
or more such blocks (Hermes format). ``parse_tool_calls`` splits a finished completion into the
plain content before the first block and the calls; ``StreamingToolParser`` does the same for a
stream: it releases content as it arrives, holds back anything that may be the start of a
``<tool_call>`` tag, and from the first tag on buffers the rest, which is parsed at the end.

A block whose body is not a JSON object with a string ``name`` is not a tool call: the text is
returned as content unchanged (the model said something, the client sees it). A block left
open by the length limit is parsed if its JSON is complete.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|\Z)", re.S)


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # a JSON object, as a string
    id: str

    @staticmethod
    def new_id() -> str:
        return f"call_{uuid.uuid4().hex[:24]}"


def _parse_block(body: str) -> ParsedToolCall | None:
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
    return ParsedToolCall(obj["name"], json.dumps(args, ensure_ascii=False), ParsedToolCall.new_id())


def parse_tool_calls(text: str) -> tuple[str | None, list[ParsedToolCall]]:
    """``(content, calls)``: the text before the first ``<tool_call>`` (None when empty) and the
    parsed calls; ``(text, [])`` when the text has no valid tool call block."""
    start = text.find(TOOL_CALL_START)
    if start < 0:
        return text, []
    calls: list[ParsedToolCall] = []
    for match in _BLOCK.finditer(text, start):
        call = _parse_block(match.group(1))
        if call is None:
            return text, []  # not what the protocol says: the client gets the text as is
        calls.append(call)
    content = text[:start].strip()
    return (content or None), calls


class StreamingToolParser:
    """Feed text deltas; get back the content that is safe to stream now."""

    def __init__(self) -> None:
        self.pending = ""  # held back: a possible tag start, or everything from the first tag on
        self.in_calls = False
        self.emitted = ""

    def feed(self, delta: str) -> str:
        self.pending += delta
        if self.in_calls:
            return ""
        at = self.pending.find(TOOL_CALL_START)
        if at >= 0:
            self.in_calls = True
            out, self.pending = self.pending[:at], self.pending[at:]
            self.emitted += out
            return out
        # hold back the longest tail that is a prefix of the start tag
        keep = 0
        for k in range(min(len(TOOL_CALL_START) - 1, len(self.pending)), 0, -1):
            if TOOL_CALL_START.startswith(self.pending[-k:]):
                keep = k
                break
        out = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(self.pending) - keep :]
        self.emitted += out
        return out

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        """At the end: ``(content still to stream, calls)``."""
        rest, self.pending = self.pending, ""
        if not self.in_calls:
            return rest, []
        content, calls = parse_tool_calls(rest)
        if not calls:
            return rest, []
        return (content or ""), calls
