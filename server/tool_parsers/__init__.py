"""Tool-call parsers by name, and the one a chat template asks for.

``auto`` picks from the model's chat template: a template that writes ``<function=`` calls
gets ``qwen3_xml`` (Qwen3.5, Qwen3-Coder); any other gets ``hermes`` (the JSON form of
Qwen2.5 / Qwen3 / Qwen3-Next, and a harmless default: it only reads ``<tool_call>`` blocks).
``none`` never parses: the text stays content.
"""

from __future__ import annotations

from enum import Enum

from deltaserve.server.tool_parsers.base import CallDelta, Event, ToolCallParser
from deltaserve.server.tool_parsers.hermes import HermesToolParser
from deltaserve.server.tool_parsers.qwen3_xml import Qwen3XmlToolParser

__all__ = ["CallDelta", "Event", "ToolCallParser", "ToolParserName", "parser_class", "resolve_tool_parser"]


class ToolParserName(str, Enum):
    AUTO = "auto"
    HERMES = "hermes"
    QWEN3_XML = "qwen3_xml"
    NONE = "none"


_PARSERS: dict[ToolParserName, type[ToolCallParser]] = {
    ToolParserName.HERMES: HermesToolParser,
    ToolParserName.QWEN3_XML: Qwen3XmlToolParser,
}


def resolve_tool_parser(name: ToolParserName, template: str) -> ToolParserName:
    """``name``, or for ``auto`` the parser ``template`` (the chat template's text) asks for."""
    if name is not ToolParserName.AUTO:
        return name
    return ToolParserName.QWEN3_XML if "<function=" in template else ToolParserName.HERMES


def parser_class(name: ToolParserName) -> type[ToolCallParser] | None:
    """The parser of a resolved name; None for ``none``."""
    if name is ToolParserName.AUTO:
        raise ValueError("resolve 'auto' against the chat template first")
    return _PARSERS.get(name)
