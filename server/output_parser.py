"""One chat completion's text -> reasoning, content and tool calls, streamed or whole.

``OutputParser`` runs the reasoning parser (``reasoning.py``) and then, on the content it
leaves, the tool-call parser (``tool_parsers``). ``feed`` returns the pieces in order:
``Reasoning``, content ``str`` and ``CallDelta``; ``collect`` folds them into a whole
message. A whole response is the same parser fed the whole text, so a stream's pieces always
add up to the whole response.

This is where the server runs the parsers, and it never raises: should a parser raise (a
bug; the parsers are written not to), the failure is logged once (``server.parser_failed``, a
warning), what that parser had queued is returned, every character it had received and not
yet returned (the failed block, as written) is content, and the rest of the completion is
content as generated. A failure that depends on the text alone (not on how it was split) comes
at the same point of a stream and of the whole text, so the two still agree.

``ChatParsing`` is the server's choice of parsers (``ServerConfig.tool_call_parser`` /
``reasoning_parser``; ``auto`` is resolved from the model's chat template on first use) and
makes the parser of each completion of a request; a forced ``tool_choice`` gets
``ChatParsing.forced`` (``call_scanner.ForcedCallParser``), so a forced call, whole or cut by
``max_tokens``, has one shape streamed and not.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from deltaserve.logs import get_logger
from deltaserve.server.call_scanner import ForcedCallParser
from deltaserve.server.reasoning import (
    Qwen3ReasoningParser,
    ReasoningParserName,
    ThinkProbe,
    resolve_reasoning_parser,
)
from deltaserve.server.tool_parsers import (
    CallDelta,
    Event,
    ToolParserName,
    parser_class,
    resolve_tool_parser,
)

#: the one-line conversation the think probe renders
_PROBE = [{"role": "user", "content": "hi"}]

log = get_logger("deltaserve.server")


@dataclass(frozen=True)
class Reasoning:
    """A piece of reasoning text."""

    text: str


Piece = Reasoning | str | CallDelta


@dataclass
class ParsedCall:
    id: str
    name: str
    arguments: str


@dataclass
class ParsedMessage:
    """A whole completion: ``content`` / ``reasoning`` are None when empty and something else
    was found (plain text stays text, even empty)."""

    content: str | None
    reasoning: str | None = None
    calls: list[ParsedCall] = field(default_factory=list)


class CallParser(Protocol):
    """What reads the calls out of the content: a ``ToolCallParser`` (auto tool choice) or a
    ``ForcedCallParser`` (a forced call's constrained output)."""

    def feed(self, text: str) -> list[Event]: ...

    def finish(self) -> list[Event]: ...

    def salvage(self) -> list[Event]: ...


class OutputParser:
    """The parsers of one completion (module docstring)."""

    def __init__(self, reasoning: Qwen3ReasoningParser | None, tools: CallParser | None) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.called = False  # a tool call was found

    def feed(self, text: str) -> list[Piece]:
        return self._pieces(text, final=False)

    def finish(self) -> list[Piece]:
        return self._pieces("", final=True)

    def _pieces(self, text: str, final: bool) -> list[Piece]:
        out: list[Piece] = []
        content = text
        if self.reasoning is not None:
            try:
                thought, content = self.reasoning.finish() if final else self.reasoning.feed(text)
            except Exception as e:  # noqa: BLE001 (a parser bug must not fail the reply: module docstring)
                self._failed(self.reasoning, e)
                thought, content = "", self.reasoning.salvage()
                self.reasoning = None
            if thought:
                out.append(Reasoning(thought))
        if self.tools is None:
            if content:
                out.append(content)
            return out
        events: list[Piece] = []
        try:
            if content:
                events += self.tools.feed(content)
            if final:
                events += self.tools.finish()
        except Exception as e:  # noqa: BLE001 (as above)
            self._failed(self.tools, e)
            events += self.tools.salvage()
            self.tools = None
        self.called = self.called or any(isinstance(e, CallDelta) for e in events)
        out += events
        return out

    @staticmethod
    def _failed(parser: object, error: Exception) -> None:
        log.warning(
            "server.parser_failed",
            parser=type(parser).__name__,
            error=f"{type(error).__name__}: {str(error)[:200]}",
        )

    def parse(self, text: str) -> ParsedMessage:
        """The whole completion ``text`` (a fresh parser: call once)."""
        return collect(self.feed(text) + self.finish(), calls_only=isinstance(self.tools, ForcedCallParser))


def collect(pieces: Sequence[Piece], calls_only: bool = False) -> ParsedMessage:
    """The message of ``pieces``; ``calls_only``: the output holds nothing but calls (a forced
    call), so its content is null even before a call was found (one cut before its name)."""
    content, reasoning, had_reasoning = "", "", False
    calls: dict[int, ParsedCall] = {}
    for piece in pieces:
        if isinstance(piece, Reasoning):
            reasoning += piece.text
            had_reasoning = True
        elif isinstance(piece, CallDelta):
            call = calls.setdefault(piece.index, ParsedCall(piece.id or "", piece.name or "", ""))
            call.arguments += piece.arguments
        else:
            content += piece
    found = had_reasoning or bool(calls) or calls_only
    return ParsedMessage(
        content=content or (None if found else ""),
        reasoning=reasoning or None,
        calls=[calls[i] for i in sorted(calls)],
    )


class ChatParsing:
    """The server's parsers (module docstring). ``tokenizer`` returns the engine's tokenizer
    (its ``chat_template`` and ``apply_chat_template``); it is asked on first use, when the
    engine has started. Without a template, ``auto`` means ``hermes`` and no reasoning."""

    def __init__(
        self, tool_parser: ToolParserName, reasoning_parser: ReasoningParserName, tokenizer: Callable[[], Any]
    ) -> None:
        self.tool_parser = tool_parser
        self.reasoning_parser = reasoning_parser
        self._tokenizer = tokenizer
        self._probe: ThinkProbe | None = None
        self._resolved = False

    def resolve(self) -> None:
        """Turn ``auto`` into the parsers the chat template asks for (once; then
        ``tool_parser`` / ``reasoning_parser`` are the names in use)."""
        if self._resolved:
            return
        try:
            tokenizer = self._tokenizer()
        except Exception:  # an engine without a tokenizer (a stand-in): as a template-less one
            tokenizer = None
        template = getattr(tokenizer, "chat_template", None)
        text = "\n".join(template.values()) if isinstance(template, dict) else str(template or "")
        self.tool_parser = resolve_tool_parser(self.tool_parser, text)
        self.reasoning_parser = resolve_reasoning_parser(self.reasoning_parser, text)

        def render(kwargs: dict[str, Any] | None, template: str | None) -> str:
            extra = {"add_generation_prompt": True, **(kwargs or {})}
            if template is not None:  # the request's own template
                extra["chat_template"] = template
            return str(tokenizer.apply_chat_template(_PROBE, tokenize=False, **extra))

        self._probe = ThinkProbe(render)
        self._resolved = True

    def for_request(
        self,
        tools: Sequence[dict[str, Any]] | None,
        parse_tools: bool,
        template_kwargs: dict[str, Any] | None,
        chat_template: str | None = None,
    ) -> Callable[[], OutputParser] | None:
        """A maker of one completion's parser, or None when nothing is parsed (the text is the
        content, as generated). ``chat_template``: the request's own template (None: the
        model's), which the think probe renders. The parsers ``auto`` resolved to stay those
        of the model's template."""
        self.resolve()
        tool_class = parser_class(self.tool_parser) if parse_tools else None
        opened: bool | None = None
        if self.reasoning_parser is ReasoningParserName.QWEN3:
            assert self._probe is not None
            opened = self._probe.opens_think(template_kwargs, chat_template)
        if tool_class is None and opened is None:
            return None

        def make() -> OutputParser:
            reasoning = Qwen3ReasoningParser(opened) if opened is not None else None
            return OutputParser(reasoning, tool_class(tools) if tool_class is not None else None)

        return make

    def thinks_first(self, template_kwargs: dict[str, Any] | None, chat_template: str | None = None) -> bool:
        """Whether the request's model reasons before it answers: the reasoning parser is on
        and the request's generation prompt opens ``<think>`` (``enable_thinking`` not off).
        Its output constraint then starts after ``</think>`` (``server/structured.py``)."""
        self.resolve()
        if self.reasoning_parser is not ReasoningParserName.QWEN3:
            return False
        assert self._probe is not None
        return self._probe.opens_think(template_kwargs, chat_template)

    @staticmethod
    def forced(name: str | None, after_reasoning: bool = False) -> Callable[[], OutputParser]:
        """The parser maker of a forced call's output (``ForcedCallParser``: ``name`` the named
        function, None for ``"required"``). ``after_reasoning``: the output is the reasoning
        (opened by the prompt), ``</think>``, then the call's JSON (its constraint starts after
        the reasoning); otherwise the constraint holds from the first token and the whole
        output is the call's JSON."""
        if after_reasoning:
            return lambda: OutputParser(Qwen3ReasoningParser(True), ForcedCallParser(name))
        return lambda: OutputParser(None, ForcedCallParser(name))
