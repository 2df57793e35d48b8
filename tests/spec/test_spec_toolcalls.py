"""Strict tool calls from a reasoning model, with speculative decoding: 50 forced calls
(``tool_choice`` required and named, five tool schemas) through the real server and engine on
the built-in tiny model, with speculation off, with ``ngram`` drafts and with ``replay`` drafts
(exact and half corrupted). Every reply must have its reasoning, then calls that parse and
validate against their tool's schema, and finish with ``tool_calls``; greedy outputs are the
same token for token with speculation on and off.

The random weights never reason, so the model's logits are scripted (``ScriptedLogits``): each
logits row (a decode's, a prefill's last, and every verify row) is a function of its request's
output so far, as a real model's is of its context. The script: a fixed reasoning text, then
``</think>`` (written as six tokens: the built-in vocabulary has no ``</think>`` token), then
garbage (a pseudo-random preference over the vocabulary), with the end-of-turn token preferred
over everything at every position, and ``<|im_start|>`` over everything but the script. The grammar must repair all of
it: no ending while reasoning, JSON of the tool's schema after ``</think>``, and the end of the
turn as soon as the call is complete. The tool schemas are bounded (strings ``maxLength``,
integers in ranges, arrays ``maxItems``) so that garbage reaches the end of every value.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import msgspec
import pytest
import torch

from deltaserve.engine import AsyncEngine, EngineCore
from deltaserve.engine.grammar_gate import GatedMatcher
from deltaserve.engine.spec.replay import ReplayDrafter
from deltaserve.kernels import get_ops
from deltaserve.models import LoadedModel, ensure_builtin_model, load_model
from deltaserve.server import protocol as p
from deltaserve.server.app import create_app
from deltaserve.server.serving import BackgroundServer
from deltaserve.server.structured import ForcedMode, chat_constraint
from deltaserve.tools.make_shaped_model import save_tokenizer
from tests.server.conftest import server_engine_config

REASONING = "The user wants a call, so I pick a tool and fill its arguments now."


def _tool(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


TOOLS = [
    _tool("get_weather", {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 10},
            "days": {"type": "integer", "minimum": 1, "maximum": 14},
            "metric": {"type": "boolean"},
        },
        "required": ["city"],
    }),
    _tool("book_flight", {
        "type": "object",
        "properties": {
            "from": {"enum": ["CDG", "JFK", "NRT"]},
            "to": {"enum": ["LHR", "SFO"]},
            "passengers": {"type": "integer", "minimum": 1, "maximum": 9},
            "cabin": {"enum": ["economy", "business"]},
        },
        "required": ["from", "to", "passengers", "cabin"],
    }),
    _tool("set_alarm", {
        "type": "object",
        "properties": {
            "time": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"},
            "label": {"type": "string", "maxLength": 6},
        },
        "required": ["time"],
    }),
    _tool("add_tags", {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"enum": ["red", "blue", "green"]}, "maxItems": 3},
            "note": {
                "type": "object",
                "properties": {"text": {"type": "string", "maxLength": 5}, "pinned": {"type": "boolean"}},
                "required": ["text"],
            },
        },
        "required": ["tags", "note"],
    }),
    _tool("ping", {"type": "object", "properties": {}}),
]  # fmt: skip
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def _body(i: int) -> dict[str, Any]:
    """Request ``i`` of the 50: a rotating pair or trio of tools; even ones ``required``
    (alternately one call and up to eight), odd ones name a function. Its message holds the
    reasoning text and ``</think>``, so prompt lookup has something to draft from."""
    tools = [TOOLS[(i + j) % len(TOOLS)] for j in range(2 + i % 2)]
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": f"Task {i}.\n{REASONING}</think>"}],
        "tools": tools,
        "temperature": 0,
        "max_tokens": 600,
        "return_token_ids": True,
    }
    if i % 2 == 0:
        body["tool_choice"] = "required"
        body["parallel_tool_calls"] = i % 4 == 0
    else:
        body["tool_choice"] = {
            "type": "function",
            "function": {"name": tools[i % len(tools)]["function"]["name"]},
        }
    return body


class ScriptedLogits:
    """Replaces the model's logits (module docstring): every logits row of a step, in the
    runner's order (sampled rows, then each verify segment's rows), from its request's output
    so far (a verify row ``j``: with the segment's first ``j`` drafts)."""

    def __init__(self, core: EngineCore) -> None:
        tok = core.tokenizer
        self.script = list(tok.encode(REASONING + "</think>", add_special_tokens=False))
        self.eos = int(tok.convert_tokens_to_ids("<|im_end|>"))
        self.im_start = int(tok.convert_tokens_to_ids("<|im_start|>"))
        self.base: torch.Tensor | None = None
        runner = core.runner
        launch, forward = runner.launch, runner.model.forward
        self.prep: Any = None

        def scripted_launch(prep: Any) -> Any:
            self.prep = prep
            return launch(prep)

        def scripted_forward(*args: Any, **kwargs: Any) -> Any:
            out = forward(*args, **kwargs)
            logits = out[0] if isinstance(out, tuple) else out
            if logits.shape[0]:  # (a step of unfinished prefills samples nothing)
                logits.copy_(self.rows(logits.shape[1]))
            return out

        runner.launch = scripted_launch  # type: ignore[method-assign]
        runner.model.forward = scripted_forward  # type: ignore[method-assign]
        self.model = runner.model

    def close(self) -> None:
        """Give the model (shared by the test's engines) its own forward back."""
        del self.model.forward

    def contexts(self) -> Iterator[list[int]]:
        prep = self.prep
        assert not prep.prompt_slices  # (no prompt log-probabilities here)
        for r in prep.requests:
            yield list(r.output_token_ids)
        out = prep.out
        for s in out.seqs[out.num_decodes : out.num_decodes + out.num_verify]:
            base = list(s.request.output_token_ids)
            assert s.request.token_ids[s.start] == (base[-1] if base else s.request.token_ids[s.start])
            for j in range(len(s.drafts) + 1):
                yield base + list(s.drafts[:j])

    def rows(self, vocab: int) -> torch.Tensor:
        if self.base is None:
            self.base = torch.rand(vocab, generator=torch.Generator().manual_seed(0))
        return torch.stack([self.row(ctx) for ctx in self.contexts()])

    def row(self, ctx: list[int]) -> torch.Tensor:
        assert self.base is not None
        m = len(ctx)
        # garbage: the preference depends on the position and the last two tokens
        row = self.base.roll(hash((m, *ctx[-2:])) % len(self.base)).clone()
        row[self.im_start] = 8.0  # a new turn: garbage the grammar never allows
        if m < len(self.script) and ctx == self.script[:m]:
            row[self.script[m]] = 9.0  # the reasoning text, then </think>
        row[self.eos] = 10.0  # ending at once: not while it reasons, not before the call is complete
        return row


class Watch:
    """Counts, per request, the verify windows whose drafts cross ``</think>`` and the drafts
    the grammar cut (wraps ``SpecDecoding.drafts`` and the drafter's ``propose``)."""

    def __init__(self, core: EngineCore) -> None:
        spec = core.speculation
        assert spec is not None
        self.straddled = 0  # windows starting in the reasoning, with drafts past </think>
        self.cut = 0  # windows whose proposal the grammar cut short
        self.proposed: list[int] = []
        propose, drafts = spec.drafter.propose, spec.drafts

        def watched_propose(req: Any, k: int) -> list[int]:
            self.proposed = propose(req, k)[:k]
            return self.proposed

        def watched_drafts(req: Any) -> list[int]:
            self.proposed = []
            out = drafts(req)
            state = core.states.get(req.request_id)
            matcher = None if state is None else state.matcher
            if out and isinstance(matcher, GatedMatcher) and not matcher.in_grammar:
                twin = matcher.fork()
                for t in out:
                    assert twin.accept_token(t)
                self.straddled += twin.in_grammar
            self.cut += len(out) < len(self.proposed)
            return out

        spec.drafter.propose = watched_propose  # type: ignore[method-assign]
        spec.drafts = watched_drafts  # type: ignore[method-assign]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, LoadedModel]:
    folder = Path(tmp_path_factory.mktemp("model")) / "qwen35-tiny"
    shutil.copytree(ensure_builtin_model("tiny-qwen3.5"), folder)
    save_tokenizer(folder)  # the Qwen3.5-style template: it opens <think>, so the model reasons first
    return folder, load_model(folder, dtype=torch.float32, device="cpu", ops=get_ops("reference"))


Pass = Callable[[EngineCore], None] | None


async def _serve(
    model: tuple[Path, LoadedModel], passes: list[Pass], bodies: list[dict[str, Any]], **config: Any
) -> tuple[list[list[dict[str, Any]]], EngineCore, Watch | None]:
    """The replies to ``bodies`` (sent all at once) from one engine, once per pass (each pass's
    hook first changes the engine)."""
    folder, loaded = model
    core = EngineCore(server_engine_config(**{"model.path": str(folder)}, **config), loaded=loaded)
    script = ScriptedLogits(core)
    watch = Watch(core) if core.speculation is not None else None
    engine = AsyncEngine(core=core)
    await engine.start()
    replies = []
    try:
        async with BackgroundServer(create_app(engine)) as srv, httpx.AsyncClient(timeout=300) as client:
            url, name = srv.url + "/v1/chat/completions", str(folder)
            for hook in passes:
                if hook is not None:
                    hook(core)
                rs = await asyncio.gather(*(client.post(url, json={"model": name, **b}) for b in bodies))
                assert [r.status_code for r in rs] == [200] * len(bodies), rs[0].text
                replies.append([_assemble(r.text) if b.get("stream") else r.json()["choices"][0]
                                for r, b in zip(rs, bodies, strict=True)])  # fmt: skip
            core.check_integrity()
    finally:
        await engine.shutdown()
        script.close()
    return replies, core, watch


def _assemble(sse: str) -> dict[str, Any]:
    """A streamed reply's chunks added up into the shape of a whole reply's choice."""
    msg: dict[str, Any] = {
        "role": "assistant",
        "content": None,
        "reasoning_content": None,
        "tool_calls": None,
    }
    choice: dict[str, Any] = {"message": msg, "token_ids": [], "finish_reason": None}
    calls: dict[int, dict[str, Any]] = {}
    for line in sse.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        for c in json.loads(line[len("data: ") :])["choices"]:
            choice["token_ids"] += c.get("token_ids") or []
            choice["finish_reason"] = c.get("finish_reason") or choice["finish_reason"]
            delta = c["delta"]
            for key in ("content", "reasoning_content"):
                if delta.get(key):
                    msg[key] = (msg[key] or "") + delta[key]
            for d in delta.get("tool_calls") or []:
                call = calls.setdefault(d["index"], {"function": {"name": None, "arguments": ""}})
                call["function"]["name"] = d["function"].get("name") or call["function"]["name"]
                call["function"]["arguments"] += d["function"].get("arguments") or ""
    msg["tool_calls"] = [calls[i] for i in sorted(calls)] or None
    return choice


def _failures(replies: list[dict[str, Any]], bodies: list[dict[str, Any]]) -> list[str]:
    """What is wrong with each reply (none: every one valid)."""
    bad = []
    for i, (c, body) in enumerate(zip(replies, bodies, strict=True)):
        msg, names = c["message"], [t["function"]["name"] for t in body["tools"]]
        calls = msg.get("tool_calls") or []
        try:
            assert c["finish_reason"] == "tool_calls", c["finish_reason"]
            assert msg["reasoning_content"] == REASONING, msg["reasoning_content"]
            assert msg["content"] is None and calls
            if isinstance(body["tool_choice"], dict):
                assert [k["function"]["name"] for k in calls] == [body["tool_choice"]["function"]["name"]]
            elif not body["parallel_tool_calls"]:
                assert len(calls) == 1
            for call in calls:
                assert call["function"]["name"] in names
                jsonschema.validate(
                    json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]]
                )
        except (AssertionError, ValueError, jsonschema.ValidationError) as e:
            bad.append(f"{i}: {type(e).__name__} {e!s:.200} :: {json.dumps(msg)[:300]}")
    return bad


def _ids(replies: list[dict[str, Any]]) -> list[list[int]]:
    return [c["token_ids"] for c in replies]


def _corrupt(core: EngineCore) -> None:
    """After an exact replay (every draft accepted so far): every other replayed draft wrong
    from here on (``replay_corrupt_every = 2``)."""
    stats = core.stats()
    assert stats["spec_decode.num_drafts"] > 0 and stats["spec_decode.acceptance_rate"] == 1.0
    drafter = core.speculation.drafter  # type: ignore[union-attr]
    assert isinstance(drafter, ReplayDrafter)
    drafter.corrupt_every = 2


@pytest.mark.asyncio
@pytest.mark.parametrize("count", [pytest.param(50, marks=pytest.mark.slow), 8])
async def test_strict_tool_calls_with_reasoning_stay_valid_with_speculation(
    model: tuple[Path, LoadedModel], count: int
) -> None:
    """``count`` forced calls: 0 failures with speculation off, with ngram drafts, with replayed
    drafts (every one accepted, across ``</think>`` too) and with half of them wrong (the grammar
    cuts a window at its first bad draft: the accepted run ends, the request goes on); the same
    tokens every time."""
    bodies = [_body(i) for i in range(count)]
    (off,), _, _ = await _serve(model, [None], bodies)
    assert _failures(off, bodies) == []
    eos = 2  # <|im_end|>: every reply ends the turn once its calls are complete
    assert all(ids[-1] == eos for ids in _ids(off))
    spec = {"speculative.num_tokens": 4}

    (ngram,), core, watch = await _serve(
        model, [None], bodies, **spec, **{"speculative.method": "ngram", "speculative.prompt_lookup_min": 2}
    )
    assert watch is not None and _failures(ngram, bodies) == []
    assert _ids(ngram) == _ids(off)  # greedy: the same tokens as speculation off
    assert core.stats()["spec_decode.num_accepted_tokens"] > 0
    assert watch.straddled > 0  # the prompt's reasoning text and </think>, drafted and verified
    assert watch.cut > 0  # and the prompt's <|im_end|> after it, which the grammar cannot take

    # replay: the first pass records each reply, the second replays it, the third half wrong
    (first, exact, half), core, watch = await _serve(
        model, [None, None, _corrupt], bodies, **spec, **{"speculative.method": "replay"}
    )
    assert watch is not None
    for got in (first, exact, half):
        assert _failures(got, bodies) == []
        assert _ids(got) == _ids(off)
    s = core.stats()
    assert watch.straddled > 0 and watch.cut > 0
    assert 0 < s["spec_decode.num_accepted_tokens"] < s["spec_decode.num_draft_tokens"]


@pytest.mark.asyncio
async def test_thinking_off_a_json_schema_and_a_stream(model: tuple[Path, LoadedModel]) -> None:
    """With ``enable_thinking: false`` the constraint holds from the first token (no reasoning:
    the script's is repaired into the call); ``response_format`` with reasoning gives the
    reasoning, then the schema's JSON as the content; a streamed forced call adds up to the
    whole reply."""
    thinking_off = {**_body(0), "chat_template_kwargs": {"enable_thinking": False}}
    schema = SCHEMAS["book_flight"]
    structured = {
        "messages": [{"role": "user", "content": "Book it."}],
        "temperature": 0,
        "max_tokens": 300,
        "return_token_ids": True,
        "response_format": {"type": "json_schema", "json_schema": {"name": "flight", "schema": schema}},
    }
    streamed = {**_body(1), "stream": True}
    (replies,), _, _ = await _serve(model, [None], [thinking_off, structured, streamed, _body(1)])
    off, answer, stream, whole = replies
    assert off["finish_reason"] == "tool_calls" and off["message"]["reasoning_content"] is None
    ((call,),) = [off["message"]["tool_calls"]]
    jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
    assert (answer["finish_reason"], answer["message"]["reasoning_content"]) == ("stop", REASONING)
    jsonschema.validate(json.loads(answer["message"]["content"]), schema)
    assert _failures([stream, whole], [_body(1), _body(1)]) == []
    assert stream["token_ids"] == whole["token_ids"]
    assert [c["function"] for c in stream["message"]["tool_calls"]] == [
        {k: v for k, v in c["function"].items()} for c in whole["message"]["tool_calls"]
    ]


def test_every_chat_constraint_source_starts_after_the_marker_when_asked() -> None:
    def req(**fields: Any) -> p.ChatCompletionRequest:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
        return msgspec.convert(body, p.ChatCompletionRequest)

    named = {"type": "function", "function": {"name": "ping"}}
    cases = [
        {"tools": TOOLS, "tool_choice": "required"},
        {"tools": TOOLS, "tool_choice": named},
        {"response_format": {"type": "json_object"}},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMAS["ping"]}}},
        {"structured_outputs": {"regex": "[a-z]+"}},
        {"guided_choice": ["yes", "no"]},
    ]
    for fields in cases:
        for after in ("</think>", None):
            constraint, forced = chat_constraint(req(**fields), after)
            assert constraint is not None and constraint.starts_after == after, fields
            if "tool_choice" in fields:
                assert forced is not None and forced.after_reasoning is (after is not None)
                assert forced.mode is (
                    ForcedMode.NAMED if fields["tool_choice"] == named else ForcedMode.REQUIRED
                )
