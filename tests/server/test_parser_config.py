"""Choosing the parsers: the two command-line flags, ServerConfig's checks, and the tokenizer
``tools/make_shaped_model.py`` writes, whose template asks for qwen3_xml and qwen3. (Served by the
real engine: ``test_scripted_sampler.py``.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from deltaserve.engine import ConfigError
from deltaserve.server.cli import build_parser
from deltaserve.server.config import ServerConfig
from deltaserve.server.output_parser import ChatParsing
from deltaserve.server.reasoning import ReasoningParserName
from deltaserve.server.tool_parsers import ToolParserName
from deltaserve.tools.make_shaped_model import save_tokenizer
from deltaserve.tools.qwen35_template import QWEN35_CHAT_TEMPLATE


def test_flags() -> None:
    args = build_parser().parse_args(["serve"])
    assert (args.tool_call_parser, args.reasoning_parser) == ("auto", "auto")
    args = build_parser().parse_args(
        ["serve", "--tool-call-parser", "qwen3_xml", "--reasoning-parser", "none"]
    )
    config = ServerConfig(tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser)
    assert config.tool_call_parser is ToolParserName.QWEN3_XML
    assert config.reasoning_parser is ReasoningParserName.NONE
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--tool-call-parser", "llama3_json"])


def test_config_refuses_unknown_parsers() -> None:
    with pytest.raises(
        ConfigError, match=r"server.tool_call_parser = 'xml': must be one of \['auto', 'hermes'"
    ):
        ServerConfig(tool_call_parser="xml")  # type: ignore[arg-type]
    with pytest.raises(
        ConfigError, match=r"server.reasoning_parser = 'r1': must be one of \['auto', 'qwen3', 'none'\]"
    ):
        ServerConfig(reasoning_parser="r1")  # type: ignore[arg-type]


def test_the_shaped_folder_tokenizer_has_the_template(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    save_tokenizer(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert tokenizer.chat_template == QWEN35_CHAT_TEMPLATE
    parsing = ChatParsing(ToolParserName.AUTO, ReasoningParserName.AUTO, lambda: tokenizer)
    parsing.resolve()
    assert (parsing.tool_parser, parsing.reasoning_parser) == (
        ToolParserName.QWEN3_XML,
        ReasoningParserName.QWEN3,
    )
