"""A stream's deltas add up to the whole response, for every endpoint and mode, over many seeds
and truncations.

One engine on the built-in tiny model (with the Qwen3.5-style template) behind three servers
on 127.0.0.1: ``raw`` (no parsers), ``xml`` (the template's own: ``qwen3_xml`` tool calls,
``qwen3`` reasoning, ``<think>`` opened by the prompt) and ``hermes`` (``hermes`` tool calls,
``qwen3`` reasoning). Each case sends the same request with ``stream: false`` and with
``stream: true`` and asserts the stream, accumulated as a client does (content and
reasoning concatenated, tool calls merged by index: id and name once, arguments
concatenated), is the whole message, with the same finish reason, usage and token ids.

The two runs are the same tokens because sampling is per request: a request's ``seed`` fixes
its draws whatever it is batched with (the token ids are compared too). Logits computed in
another batch differ in their last bits, so log-probabilities are compared within 1e-3 (and
prefix caching is off, so both runs compute the whole prompt). The random weights never write
``<think>`` or ``<tool_call>``, so for the parsers' modes the sampling of a request whose seed
has a script is replaced: its k-th token is the script's k-th (then EOS). Forced tool calls
and ``response_format`` use the real, constrained sampling; the forced calls with thinking off,
since with it on their constraint starts after ``</think>``, which the random weights never
write (``tests/spec/test_spec_toolcalls.py`` streams a forced call after reasoning). A mode's seeds run at once (the
engine batches them), each whole and streamed at once; the default run gives each seed one of
``CUTS``, the slow grid every cut to more seeds.
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
import torch

from deltaserve.engine import AsyncEngine, EngineCore
from deltaserve.engine.outputs import TokenLogprob
from deltaserve.engine.runner.model_runner import PreparedStep
from deltaserve.kernels import get_ops
from deltaserve.models import ensure_builtin_model, load_model
from deltaserve.server.app import create_app
from deltaserve.server.config import ServerConfig
from deltaserve.server.reasoning import ReasoningParserName
from deltaserve.server.serving import BackgroundServer
from deltaserve.server.tool_parsers import ToolParserName
from deltaserve.tools.make_shaped_model import save_tokenizer
from tests.server.conftest import server_engine_config

pytestmark = pytest.mark.asyncio(loop_scope="module")

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 8},
                    "unit": {"enum": ["c", "f"]},
                },
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer", "maximum": 99, "minimum": 0}},
                "required": ["a"],
                "additionalProperties": False,
            },
        },
    },
]
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["x", "yz"]}},
    "required": ["ok", "tag"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
WORDS = ["Paris", "Île-de-France", "東京", "sunny", "3", "🌧️ rain", "a\tb", '"quoted"', "x\\y", "{brace}"]
#: every max_tokens a case cycles through (None: the whole output); 0.5 / 0.8: that share of a script
CUTS: list[float | int | None] = [1, 2, 5, 0.5, 0.8, None]
SEEDS = 8  # per mode in the default run (CUTS once, then its first two again)
SCRIPTED = 1_000_000  # seeds from here on are scripted


class ScriptSampler:
    """The runner's sampling, but a request whose seed has a script gets the script's tokens
    (its k-th generated token is ``script[k]``, then EOS)."""

    def __init__(self, core: EngineCore) -> None:
        self.tokenizer = core.tokenizer
        self.eos = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.scripts: dict[int, list[int]] = {}
        self.real = core.runner._sample
        core.runner._sample = self._sample  # type: ignore[method-assign]

    def script(self, seed: int, text: str) -> int:
        """Script ``text`` for ``seed``; its number of tokens (EOS included)."""
        self.scripts[seed] = [*self.tokenizer.encode(text, add_special_tokens=False), self.eos]
        return len(self.scripts[seed])

    def _sample(
        self, logits: torch.Tensor, prep: PreparedStep
    ) -> tuple[torch.Tensor, list[TokenLogprob | None] | None]:
        tokens, logprobs = self.real(logits, prep)
        for row, r in enumerate(prep.requests):
            ids = self.scripts.get(r.sampling_params.seed)
            if ids is not None:
                tokens[row] = ids[min(len(r.output_token_ids), len(ids) - 1)]
        return tokens, logprobs


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def servers(
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[tuple[ScriptSampler, dict[str, str]]]:
    folder = Path(tmp_path_factory.mktemp("model")) / "qwen35-tiny"
    shutil.copytree(ensure_builtin_model("tiny-qwen3.5"), folder)
    save_tokenizer(folder)
    loaded = load_model(folder, dtype=torch.float32, device="cpu", ops=get_ops("reference"))
    config = server_engine_config(
        **{
            "model.path": str(folder),
            "cache.enable_prefix_caching": False,
            "scheduler.max_num_batched_tokens": 8192,
        }
    )
    core = EngineCore(config, loaded=loaded)
    sampler = ScriptSampler(core)
    engine = AsyncEngine(core=core)
    await engine.start()
    configs = {
        "raw": ServerConfig(tool_call_parser=ToolParserName.NONE, reasoning_parser=ReasoningParserName.NONE),
        "xml": ServerConfig(),
        "hermes": ServerConfig(tool_call_parser=ToolParserName.HERMES),
    }
    try:
        async with (
            BackgroundServer(create_app(engine, configs["raw"])) as raw,
            BackgroundServer(create_app(engine, configs["xml"])) as xml,
            BackgroundServer(create_app(engine, configs["hermes"])) as hermes,
        ):
            yield sampler, {"raw": raw.url, "xml": xml.url, "hermes": hermes.url}
    finally:
        await engine.shutdown()


# ---------------------------------------------------------------------- scripts
def _words(rng: random.Random, most: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, most)))


def _xml_call(rng: random.Random) -> str:
    if rng.random() < 0.5:
        return f"<tool_call>\n<function=add>\n<parameter=a>\n{rng.randint(0, 99)}\n</parameter>\n</function>\n</tool_call>"
    city = _words(rng, 1)
    return (
        f"<tool_call>\n<function=get_weather>\n<parameter=city>\n{city}\n</parameter>\n"
        "<parameter=unit>\nc\n</parameter>\n</function>\n</tool_call>"
    )


def _hermes_call(rng: random.Random) -> str:
    args = {"a": rng.randint(0, 99)} if rng.random() < 0.5 else {"city": _words(rng, 1), "unit": "f"}
    name = "add" if "a" in args else "get_weather"
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args, ensure_ascii=False)}}}\n</tool_call>'


def reply(rng: random.Random, *, think: str, calls: str | None) -> str:
    """A reply: reasoning (``think``: ``opened`` by the prompt, ``tag``: written whole, ``no``),
    content, then 0-2 calls in the ``calls`` format."""
    out = ""
    if think == "opened":
        out += f"{_words(rng, 3)}\n</think>\n\n"
    elif think == "tag":
        out += f"<think>\n{_words(rng, 3)}\n</think>\n\n"
    if rng.random() < 0.7:
        out += _words(rng, 3)
    make = {"xml": _xml_call, "hermes": _hermes_call}.get(calls or "")
    for _ in range(rng.randint(1, 2) if make is not None else 0):
        out += "\n\n" + make(rng)  # type: ignore[misc]
    if make is not None and rng.random() < 0.3:
        out += "\n\n" + _words(rng, 1)  # text after a call is content
    return out


# ---------------------------------------------------------------------- modes
#: mode -> (server, endpoint, request fields, scripted reply maker or None for real sampling)
#: thinking off: a forced call's constraint then holds from the first token
NO_THINK: dict[str, Any] = {"chat_template_kwargs": {"enable_thinking": False}}

MODES: dict[str, tuple[str, str, dict[str, Any], Any]] = {
    "chat-plain": ("raw", "chat", {}, None),
    "chat-plain-logprobs-n2": ("raw", "chat", {"logprobs": True, "top_logprobs": 2, "n": 2}, None),
    "chat-tools-auto-hermes": (
        "hermes", "chat", {"tools": TOOLS}, lambda r: reply(r, think="opened", calls="hermes"),
    ),
    "chat-tools-auto-xml": ("xml", "chat", {"tools": TOOLS}, lambda r: reply(r, think="opened", calls="xml")),
    "chat-tools-auto-xml-no-think": (
        "xml", "chat", {"tools": TOOLS, "chat_template_kwargs": {"enable_thinking": False}},
        lambda r: reply(r, think="no", calls="xml"),
    ),
    "chat-tools-required": ("xml", "chat", {"tools": TOOLS, "tool_choice": "required", **NO_THINK}, None),
    "chat-tools-required-one": (
        "hermes", "chat",
        {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False, **NO_THINK}, None,
    ),
    "chat-tools-named": (
        "hermes", "chat",
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, **NO_THINK},
        None,
    ),
    "chat-reasoning": ("xml", "chat", {}, lambda r: reply(r, think="opened", calls=None)),
    "chat-reasoning-tag": (
        "xml", "chat", {"chat_template_kwargs": {"enable_thinking": False}},
        lambda r: reply(r, think="tag", calls=None),
    ),
    "chat-reasoning-sampled": ("xml", "chat", {}, None),
    "chat-json-schema": (
        "raw", "chat",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}}, None,
    ),
    "completions-plain": ("raw", "completions", {}, None),
    "completions-stop": ("raw", "completions", {"stop": ["e", "an"]}, None),
    "completions-logprobs-n2": ("raw", "completions", {"logprobs": 2, "n": 2}, None),
    "completions-echo-logprobs": ("raw", "completions", {"echo": True, "logprobs": 1}, None),
}  # fmt: skip


def _max_tokens(cut: float | int | None, length: int | None) -> int:
    """``cut`` as max_tokens for an output of ``length`` tokens (None: real sampling)."""
    if cut is None:  # (real sampling: enough for one forced call, written a character a token)
        return length or 100
    if isinstance(cut, float):
        return max(1, int((length or 40) * cut))
    return cut


async def _run(
    sampler: ScriptSampler, urls: dict[str, str], mode: str, k: int, cut: float | int | None
) -> set[str]:
    """One case: the request whole and streamed, compared; the whole response's finish reasons."""
    server, endpoint, fields, make = MODES[mode]
    seed = k
    length = None
    if make is not None:
        seed = SCRIPTED + list(MODES).index(mode) * 1000 + k
        length = sampler.script(seed, make(random.Random(seed)))
    # (no model: the served name is the default)
    body: dict[str, Any] = {"seed": seed, "max_tokens": _max_tokens(cut, length), **fields}
    if k % 2:
        body["return_token_ids"] = True
    if endpoint == "chat":
        body["messages"] = MESSAGES
    else:
        body["prompt"] = "Weather in Paris?"
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    async with httpx.AsyncClient(base_url=urls[server], timeout=120.0) as client:
        whole, events = await asyncio.gather(client.post(path, json=body), _events(client, path, body))
    assert whole.status_code == 200, whole.text
    assert events[-1] == "[DONE]", events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    label = f"{mode} seed={seed} body={body}"
    if endpoint == "chat":
        _check_chat(whole.json(), chunks, label, forced="tool_choice" in body)
        return {c["finish_reason"] for c in whole.json()["choices"]}
    else:
        _check_completions(whole.json(), chunks, label)
        return {c["finish_reason"] for c in whole.json()["choices"]}


async def _events(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> list[str]:
    """The data of each event of ``body`` streamed, with usage."""
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", path, json=streamed) as resp:
        assert resp.status_code == 200
        return [line.removeprefix("data: ") async for line in resp.aiter_lines() if line]


def _same(a: Any, b: Any) -> bool:
    """``a == b``, but log-probabilities (floats) within 1e-3: the same logits computed in
    another batch (or another step split) differ in their last bits."""
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= 1e-3
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _usage(chunks: list[dict[str, Any]], label: str) -> dict[str, Any]:
    last = chunks[-1]
    assert last["choices"] == [] and last["usage"] is not None, label
    assert all(c.get("usage") is None for c in chunks[:-1]), label
    return last["usage"]


def _check_chat(whole: dict[str, Any], chunks: list[dict[str, Any]], label: str, *, forced: bool) -> None:
    acc: dict[int, dict[str, Any]] = {}
    for chunk in chunks[:-1]:
        assert "error" not in chunk, (label, chunk)
        for c in chunk["choices"]:
            a = acc.setdefault(
                c["index"],
                {"content": "", "reasoning": "", "calls": {}, "finish": None, "logprobs": [], "ids": []},
            )
            assert a["finish"] is None, f"{label}: a delta after the finish chunk"
            d = c["delta"]
            a["content"] += d.get("content") or ""
            a["reasoning"] += d.get("reasoning_content") or ""
            for tc in d.get("tool_calls") or []:
                fn = tc.get("function") or {}
                call = a["calls"].get(tc["index"])
                if call is None:  # a call's first delta: its id, type and name
                    assert tc["id"].startswith("call_") and tc["type"] == "function" and fn["name"], label
                    a["calls"][tc["index"]] = {"name": fn["name"], "arguments": fn.get("arguments") or ""}
                else:  # then only arguments: the name comes once
                    assert "id" not in tc and fn.get("name") is None, (label, tc)
                    call["arguments"] += fn.get("arguments") or ""
            if c.get("logprobs"):
                a["logprobs"] += c["logprobs"]["content"]
            a["ids"] += c.get("token_ids") or []
            a["finish"] = c.get("finish_reason")
    assert _usage(chunks, label) == whole["usage"], label
    assert sorted(acc) == [c["index"] for c in whole["choices"]], label
    for c in whole["choices"]:
        a, m = acc[c["index"]], c["message"]
        calls = m.get("tool_calls") or []
        for call in calls:
            assert call["id"].startswith("call_") and call["type"] == "function", label
        streamed = {
            "content": a["content"],
            "reasoning_content": a["reasoning"],
            "tool_calls": [a["calls"][i] for i in sorted(a["calls"])],
            "finish_reason": a["finish"],
            "logprobs": a["logprobs"],
            "token_ids": a["ids"],
        }
        expected = {
            "content": m["content"] or "",
            "reasoning_content": m.get("reasoning_content") or "",
            "tool_calls": [
                {"name": t["function"]["name"], "arguments": t["function"]["arguments"]} for t in calls
            ],
            "finish_reason": c["finish_reason"],
            "logprobs": (c.get("logprobs") or {}).get("content") or [],
            "token_ids": c.get("token_ids") or [],
        }
        assert _same(streamed, expected), (label, streamed, expected)
        if forced:  # a forced call, whole or cut: the call(s) and no content (null)
            assert m["content"] is None and m.get("reasoning_content") is None, label
            assert c["finish_reason"] in ("tool_calls", "length"), label
            assert calls or c["finish_reason"] == "length", label  # no name generated yet
            for t in calls:  # whole calls are JSON; a cut one is the JSON text generated so far
                if c["finish_reason"] == "tool_calls":
                    json.loads(t["function"]["arguments"])
                assert t["function"]["name"] in ("get_weather", "add"), label


def _check_completions(whole: dict[str, Any], chunks: list[dict[str, Any]], label: str) -> None:
    acc: dict[int, dict[str, Any]] = {}
    keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    for chunk in chunks[:-1]:
        assert "error" not in chunk, (label, chunk)
        for c in chunk["choices"]:
            a = acc.setdefault(c["index"], {"text": "", "finish": None, "ids": [], **{k: [] for k in keys}})
            assert a["finish"] is None, f"{label}: a chunk after the finish chunk"
            a["text"] += c["text"]
            for key in keys:
                a[key] += (c.get("logprobs") or {}).get(key) or []
            a["ids"] += c.get("token_ids") or []
            a["finish"] = c.get("finish_reason")
    assert _usage(chunks, label) == whole["usage"], label
    assert sorted(acc) == [c["index"] for c in whole["choices"]], label
    for c in whole["choices"]:
        a = acc[c["index"]]
        lp = c.get("logprobs") or {}
        expected = {
            "text": c["text"],
            "finish": c["finish_reason"],
            "ids": c.get("token_ids") or [],
            **{k: lp.get(k) or [] for k in keys},
        }
        assert _same(a, expected), (label, a, expected)


@pytest.mark.parametrize("mode", list(MODES))
async def test_stream_adds_up_to_the_whole_response(
    servers: tuple[ScriptSampler, dict[str, str]], mode: str
) -> None:
    """``SEEDS`` seeds, each with one of the ``CUTS``, at once (the engine batches them)."""
    sampler, urls = servers
    runs = await asyncio.gather(*(_run(sampler, urls, mode, k, CUTS[k % len(CUTS)]) for k in range(SEEDS)))
    reasons = set().union(*runs)
    # the grid reaches what it is for: cut outputs, and calls made whole
    assert "length" in reasons, reasons
    if "tool_choice" in MODES[mode][2] or "tools-auto" in mode:
        assert "tool_calls" in reasons, reasons


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "cut"), [(m, c) for m in MODES for c in range(len(CUTS))])
async def test_stream_adds_up_every_cut(
    servers: tuple[ScriptSampler, dict[str, str]], mode: str, cut: int
) -> None:
    """More seeds, each with every cut."""
    sampler, urls = servers
    await asyncio.gather(*(_run(sampler, urls, mode, k, CUTS[cut]) for k in range(SEEDS, 3 * SEEDS)))
