"""The Qwen3 reasoning parser: ``<think>...</think>`` apart from the answer.

Qwen3 writes its reasoning between ``<think>`` and ``</think>`` before the answer. Newer
templates (Qwen3.5, the Qwen3 "thinking" models) open ``<think>`` in the prompt's generation
prompt, so the model writes only ``</think>``; with ``enable_thinking: false`` they write an
empty ``<think>\\n\\n</think>`` there instead, and nothing generated is reasoning. So a parser
starts in one of two states, told by the rendered prompt (``ThinkProbe``): *opened* (text is
reasoning up to ``</think>``) or not (text is reasoning only if it starts with ``<think>``).

``Qwen3ReasoningParser.feed`` takes text pieces and returns ``(reasoning, content)`` pieces; the
result is the same for every split of the same text. Reasoning is stripped of surrounding
whitespace and the answer of the whitespace after ``</think>``; reasoning cut by
``max_tokens`` before ``</think>`` is all reasoning, with no content. Each character is read a
bounded number of times (text waiting for a decision, like a long run of whitespace, is kept
as a list of pieces), so a stream costs time linear in its text. ``salvage`` gives the text not
yet returned, should a bug make ``feed`` raise.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from typing import Any

import msgspec

from deltaserve.logs import get_logger
from deltaserve.server.tool_parsers.base import held_prefix

THINK_START = "<think>"
THINK_END = "</think>"
#: chat_template_kwargs variants whose generation prompt is remembered
MAX_PROBES = 256

log = get_logger("deltaserve.server")


class ReasoningParserName(str, Enum):
    AUTO = "auto"
    QWEN3 = "qwen3"
    NONE = "none"


def resolve_reasoning_parser(name: ReasoningParserName, template: str) -> ReasoningParserName:
    """``name``, or for ``auto``: ``qwen3`` when the chat template writes ``<think>``."""
    if name is not ReasoningParserName.AUTO:
        return name
    return ReasoningParserName.QWEN3 if THINK_START in template else ReasoningParserName.NONE


def think_left_open(prompt: str) -> bool:
    """Whether a rendered prompt ends inside a ``<think>`` block."""
    return prompt.rfind(THINK_START) > prompt.rfind(THINK_END)


class ThinkProbe:
    """Whether the template's generation prompt opens ``<think>``, for the request's
    ``chat_template_kwargs`` and its own ``chat_template`` (None: the model's): the template is
    rendered once per distinct (template, kwargs) over a one-line conversation (the generation
    prompt does not depend on the messages). The key holds the template text itself, so two
    templates never share an answer."""

    def __init__(self, render: Callable[[dict[str, Any] | None, str | None], str]) -> None:
        self.render = render  # (kwargs, template) -> the rendered probe conversation
        self._seen: dict[tuple[str | None, bytes], bool] = {}

    def opens_think(self, kwargs: dict[str, Any] | None, template: str | None = None) -> bool:
        key = (template, msgspec.json.encode(kwargs))
        opened = self._seen.get(key)
        if opened is None:
            try:
                opened = think_left_open(self.render(kwargs, template))
            except Exception as e:  # the request itself rendered: this cannot fail but must not 500
                log.warning("server.think_probe_failed", error=str(e))
                opened = False
            if len(self._seen) >= MAX_PROBES:
                self._seen.clear()
            self._seen[key] = opened
        return opened


class _State(Enum):
    START = "start"  # not opened by the prompt: does the text start with <think>?
    REASONING = "reasoning"
    CONTENT = "content"


class Qwen3ReasoningParser:
    """One completion's reasoning and content (module docstring)."""

    def __init__(self, opened: bool) -> None:
        self.state = _State.REASONING if opened else _State.START
        self.buf = ""  # text not read yet (in REASONING: at most a tag's length before a feed)
        self.lead: list[str] = []  # (START) the whitespace before the first other character
        self.started = False  # reasoning text other than whitespace was written
        self.held_ws: list[str] = []  # the reasoning's trailing whitespace (dropped at </think>)
        self.after_end = False  # drop the whitespace right after </think>

    def feed(self, text: str) -> tuple[str, str]:
        self.buf += text
        return self._run(final=False)

    def finish(self) -> tuple[str, str]:
        return self._run(final=True)

    def salvage(self) -> str:
        """After ``feed`` or ``finish`` raised: the text received and not returned yet (held
        whitespace aside), as written. The parser is not to be used again."""
        out = "".join(self.lead) + self.buf
        self.lead, self.buf = [], ""
        return out

    def _run(self, final: bool) -> tuple[str, str]:
        reasoning, content = "", ""
        if self.state is _State.START:
            rest = self.buf.lstrip()
            if len(rest) < len(self.buf):  # set aside as it comes: a long run is read once
                self.lead.append(self.buf[: len(self.buf) - len(rest)])
                self.buf = rest
            if rest.startswith(THINK_START):
                self.state, self.buf, self.lead = _State.REASONING, rest[len(THINK_START) :], []
            elif THINK_START.startswith(rest) and not final:
                return "", ""
            else:
                self.state, self.buf, self.lead = _State.CONTENT, "".join(self.lead) + rest, []
        if self.state is _State.REASONING:
            at = self.buf.find(THINK_END)
            if at < 0:
                keep = 0 if final else held_prefix(self.buf, (THINK_END,))
                reasoning = self._reasoning(self.buf[: len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep :]
                return reasoning, ""
            reasoning = self._reasoning(self.buf[:at])
            self.buf = self.buf[at + len(THINK_END) :]
            self.state, self.after_end = _State.CONTENT, True
        content, self.buf = self.buf, ""
        if self.after_end:
            content = content.lstrip()
            self.after_end = not content
        return reasoning, content

    def _reasoning(self, text: str) -> str:
        if not self.started:
            text = text.lstrip()
            self.started = bool(text)
        body = text.rstrip()
        if not body:  # whitespace only: held with what is held
            if text:
                self.held_ws.append(text)
            return ""
        out = "".join(self.held_ws) + body
        self.held_ws = [text[len(body) :]] if len(body) < len(text) else []
        return out
