"""Chat templates from elsewhere than the tokenizer: ``model.chat_template`` (a file whose text
replaces the tokenizer's, in both placements) and a chat completion's own ``chat_template``
(rendered with the request's ``tools`` and ``chat_template_kwargs``; the reasoning parser's
probe of the generation prompt is keyed by template, so templates never share an answer)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio

from deltaserve.engine import AsyncEngine, EngineCore
from deltaserve.models import LoadedModel
from deltaserve.server.app import create_app
from deltaserve.server.config import ServerConfig
from deltaserve.server.reasoning import ReasoningParserName
from deltaserve.server.serving import BackgroundServer
from tests.engine.conftest import separate
from tests.server.conftest import server_engine_config

#: the file template: each message as "ROLE: content" lines, then "ASSISTANT:"
FILE_TEMPLATE = (
    "{% for m in messages %}{{ m.role | upper }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)
#: a request's template that lists the tools and uses a chat_template_kwargs variable
TOOLS_TEMPLATE = (
    "{% if tools %}{% for t in tools %}TOOL {{ t.function.name }}\n{% endfor %}{% endif %}"
    "{{ greeting | default('') }}{% for m in messages %}{{ m.content }}{% endfor %}"
)
#: a request's template whose generation prompt opens a <think> block
THINK_TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}<think>\n"
MESSAGES = [{"role": "user", "content": "hi there"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def template_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tpl") / "chat.jinja"
    path.write_text(FILE_TEMPLATE)
    return path


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(template_file: Path, tiny_loaded: LoadedModel) -> AsyncIterator[tuple[AsyncEngine, str]]:
    cfg = server_engine_config(**{"model.chat_template": str(template_file)})
    async with AsyncEngine(core=EngineCore(cfg, loaded=tiny_loaded)) as engine:
        app = create_app(
            engine, ServerConfig(served_model_names=["m"], reasoning_parser=ReasoningParserName.QWEN3)
        )
        async with BackgroundServer(app) as srv:
            yield engine, srv.url


def _ids(engine: Any, text: str) -> list[int]:
    return list(engine.tokenizer.encode(text, add_special_tokens=False))


async def _post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        r = await client.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.asyncio(loop_scope="module")
async def test_the_file_template_renders_the_prompt(
    server: tuple[AsyncEngine, str], tiny_loaded: LoadedModel
) -> None:
    engine, url = server
    # the engine's own copy: the LoadedModel it was built from (shared) keeps the model's template
    assert engine.tokenizer.chat_template == FILE_TEMPLATE
    assert tiny_loaded.tokenizer.chat_template != FILE_TEMPLATE
    want = _ids(engine, "USER: hi there\nASSISTANT:")
    assert engine.input_processor.tokenize(MESSAGES) == want
    got = await _post(url, "/tokenize", {"messages": MESSAGES})
    assert got["tokens"] == want
    chat = await _post(url, "/v1/chat/completions", {"model": "m", "messages": MESSAGES, "max_tokens": 2})
    assert chat["usage"]["prompt_tokens"] == len(want)


@pytest.mark.asyncio(loop_scope="module")
async def test_a_request_template_with_tools_and_kwargs(server: tuple[AsyncEngine, str]) -> None:
    engine, url = server
    body = {
        "model": "m",
        "messages": MESSAGES,
        "max_tokens": 2,
        "chat_template": TOOLS_TEMPLATE,
        "tools": TOOLS,
        "chat_template_kwargs": {"greeting": "HELLO "},
    }
    want = _ids(engine, "TOOL get_weather\nHELLO hi there")
    chat = await _post(url, "/v1/chat/completions", body)
    assert chat["usage"]["prompt_tokens"] == len(want)
    tokenized = await _post(
        url, "/tokenize", {k: body[k] for k in ("messages", "chat_template", "tools", "chat_template_kwargs")}
    )
    assert tokenized["tokens"] == want
    # the next request without one renders with the configured template again
    plain = await _post(url, "/v1/chat/completions", {"model": "m", "messages": MESSAGES, "max_tokens": 2})
    assert plain["usage"]["prompt_tokens"] == len(_ids(engine, "USER: hi there\nASSISTANT:"))


@pytest.mark.asyncio(loop_scope="module")
async def test_the_reasoning_probe_does_not_mix_templates(server: tuple[AsyncEngine, str]) -> None:
    """The configured template does not open <think>, the request's does: its whole reply is
    reasoning (cut by max_tokens before any </think>), while the same request without the
    template (probed first, so its answer is cached) gets content."""
    _, url = server
    base = {"model": "m", "messages": MESSAGES, "max_tokens": 6, "temperature": 0}
    plain = (await _post(url, "/v1/chat/completions", base))["choices"][0]["message"]
    thinking = (await _post(url, "/v1/chat/completions", {**base, "chat_template": THINK_TEMPLATE}))[
        "choices"
    ][0]["message"]
    assert plain["reasoning_content"] is None and plain["content"]
    assert thinking["reasoning_content"] and thinking["content"] is None


@pytest.mark.asyncio(loop_scope="module")
async def test_a_bad_request_template_is_a_400(server: tuple[AsyncEngine, str]) -> None:
    _, url = server
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        r = await client.post(
            "/v1/chat/completions",
            json={"model": "m", "messages": MESSAGES, "chat_template": "{% for %}"},
        )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith("chat template could not render the messages")


async def test_the_separate_core_process_uses_the_file_template(template_file: Path) -> None:

    cfg = server_engine_config(
        **{"model.chat_template": str(template_file), "engine.core_process": "separate"}
    )
    async with AsyncEngine(separate(cfg)) as engine:
        assert engine.tokenizer.chat_template == FILE_TEMPLATE
        assert engine.input_processor.tokenize(MESSAGES) == _ids(engine, "USER: hi there\nASSISTANT:")


async def test_a_request_template_renders_off_the_event_loop() -> None:
    """The client's template is its code: rendered in the tokenizing thread whatever the
    prompt's length, and the engine gets the token ids."""
    from tests.server.test_scripted_engine import CharTokenizer, ScriptedEngine

    engine = ScriptedEngine()
    tokenizer = engine.input_processor.tokenizer
    assert isinstance(tokenizer, CharTokenizer)
    engine.script = ["done"]
    async with (
        BackgroundServer(create_app(engine)) as srv,
        httpx.AsyncClient(base_url=srv.url, timeout=30) as http,
    ):
        r = await http.post("/v1/chat/completions", json={"messages": MESSAGES, "chat_template": "{{ x }}"})
        assert r.status_code == 200, r.text
    # token ids, not the messages: rendered and tokenized by the server's tokenizing thread (with
    # its own copy of the tokenizer), not by the engine on the loop
    prompt, _, kwargs = engine.calls[-1]
    assert prompt == tokenizer.encode("<user>hi there") and "chat_template" not in kwargs
    async with (
        BackgroundServer(create_app(engine)) as srv,
        httpx.AsyncClient(base_url=srv.url, timeout=30) as http,
    ):
        r = await http.post("/tokenize", json={"messages": MESSAGES, "chat_template": "{{ x }}"})
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == tokenizer.encode("<user>hi there")
        r = await http.post("/tokenize", json={"messages": [], "chat_template": "{{ x }}"})
        assert r.status_code == 400, r.text  # no messages: an error, not an empty token list
        assert (
            r.json()["error"]["message"]
            == "tools, chat_template and chat_template_kwargs apply to chat messages only"
        )
