"""Choosing the parsers: the two command-line flags, ServerConfig's checks, and a model folder
with the Qwen3.5-style template (as ``tools/make_shaped_model.py`` writes it) served by the real
engine, which picks the XML tool parser and the qwen3 reasoning parser by itself."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from deltaserve.engine import AsyncEngine, ConfigError, EngineCore
from deltaserve.kernels import get_ops
from deltaserve.models import ensure_builtin_model, load_model
from deltaserve.server.app import create_app
from deltaserve.server.cli import BackgroundServer, build_parser
from deltaserve.server.config import ServerConfig
from deltaserve.server.reasoning import ReasoningParserName
from deltaserve.server.tool_parsers import ToolParserName
from deltaserve.tools.make_shaped_model import save_tokenizer
from deltaserve.tools.qwen35_template import QWEN35_CHAT_TEMPLATE
from tests.server.conftest import server_engine_config


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


async def test_a_qwen35_folder_picks_its_parsers(tmp_path: Path) -> None:
    """The built-in tiny model with the shaped folders' tokenizer: the engine renders the
    template (its generation prompt opens <think>), so everything the random model writes,
    which never closes it, is reasoning."""
    folder = tmp_path / "qwen35-tiny"
    shutil.copytree(ensure_builtin_model("tiny-qwen3.5"), folder)
    save_tokenizer(folder)
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(folder).chat_template == QWEN35_CHAT_TEMPLATE
    loaded = load_model(folder, dtype=torch.float32, device="cpu", ops=get_ops("reference"))
    engine = AsyncEngine(core=EngineCore(server_engine_config(**{"model.path": str(folder)}), loaded=loaded))
    await engine.start()
    try:
        app = create_app(engine)
        async with BackgroundServer(app) as srv:
            from openai import AsyncOpenAI

            client = AsyncOpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60.0)
            tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
            resp = await client.chat.completions.create(
                model=str(folder), messages=[{"role": "user", "content": "Hi"}], tools=tools,  # type: ignore[list-item]
                max_tokens=8, temperature=0, extra_body={"ignore_eos": True},
            )  # fmt: skip
            msg = resp.choices[0].message
            assert msg.reasoning_content and msg.content is None and resp.choices[0].finish_reason == "length"  # type: ignore[attr-defined]
            kwargs = {"chat_template_kwargs": {"enable_thinking": False}, "ignore_eos": True}
            resp = await client.chat.completions.create(
                model=str(folder), messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=0,
                extra_body=kwargs,
            )  # fmt: skip
            assert resp.choices[0].message.content and resp.choices[0].message.reasoning_content is None  # type: ignore[attr-defined]
        parsing = app.state.server.parsing
        assert (parsing.tool_parser, parsing.reasoning_parser) == (
            ToolParserName.QWEN3_XML,
            ReasoningParserName.QWEN3,
        )
    finally:
        await engine.shutdown()
