"""API request fields -> the engine's inputs: chat messages as the template expects them, the
chat-template arguments, completion prompts, and ``SamplingParams``. Raises ``APIError`` (400)
for what the API accepts in shape but the engine cannot take."""

from __future__ import annotations

from typing import Any

import msgspec

from deltaserve.engine.constraint import Constraint
from deltaserve.engine.sampling_params import SamplingParams
from deltaserve.server import protocol as p
from deltaserve.server.errors import bad_request
from deltaserve.server.unsupported import check_unsupported

# optional sampling fields passed on only when the request sets them: unset, the engine applies the
# model's default (generation_config.json) or its neutral one
_OPTIONAL_SAMPLING = (
    "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
)  # fmt: skip


def sampling_params(
    req: p._SamplingFields, *, max_tokens: int, logprobs: int | None, constraint: Constraint | None = None
) -> SamplingParams:
    """The engine's sampling parameters of a request (``constraint``: what
    ``server/structured.py`` made of its structured-output fields)."""
    check_unsupported(req)  # fields accepted in shape but not implemented: 400 naming the field
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    kwargs: dict[str, Any] = {
        "max_tokens": max_tokens,
        "n": req.n,
        "stop": stop,
        "stop_token_ids": list(req.stop_token_ids or []),
        "ignore_eos": req.ignore_eos,
        "min_tokens": req.min_tokens,
        "seed": req.seed,
        "logprobs": logprobs,
        "constraint": constraint,
    }
    for name in _OPTIONAL_SAMPLING:
        value = getattr(req, name)
        if value is not None:
            kwargs[name] = value
    return SamplingParams(**kwargs)


def _content_text(content: str | list[p.ContentPart] | None, i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(content):
        if part.type != "text":
            raise bad_request(
                f"messages[{i}].content[{j}] has type {part.type!r}: only text parts are supported",
                "messages",
            )
        if part.text is None:
            raise bad_request(f"messages[{i}].content[{j}] (content part {j}) has no text", "messages")
        parts.append(part.text)
    return "\n".join(parts)


def _arguments(text: str) -> str | dict[str, Any]:
    """A call's arguments as an object when they are a JSON object (templates that write one
    line per parameter iterate it), else the text as sent."""
    try:
        value = msgspec.json.decode(text)
    except (msgspec.DecodeError, RecursionError):
        return text
    return value if isinstance(value, dict) else text


def _tool_calls(m: p.ChatMessage) -> list[dict[str, Any]]:
    return [
        {
            "id": tc.id,
            "type": tc.type,
            "function": {"name": tc.function.name, "arguments": _arguments(tc.function.arguments)},
        }
        for tc in m.tool_calls or []
    ]


def messages_to_dicts(messages: list[p.ChatMessage]) -> list[dict[str, Any]]:
    """Chat messages as the template expects them: string content (text parts joined), assistant
    ``tool_calls`` with their ``function`` (arguments as an object when they are a JSON object,
    as vLLM passes them), tool results with their ``tool_call_id``."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        d: dict[str, Any] = {"role": m.role, "content": _content_text(m.content, i)}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_calls:
            d["tool_calls"] = _tool_calls(m)
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.reasoning_content is not None:
            d["reasoning_content"] = m.reasoning_content
        out.append(d)
    return out


def template_extras(
    tools: list[p.Tool] | None, kwargs: dict[str, Any] | None, chat_template: str | None = None
) -> dict[str, Any]:
    """The chat-template arguments to pass to the engine: only those the request set
    (``chat_template``: the request's own template text, rendering instead of the model's)."""
    extra: dict[str, Any] = {}
    if tools:
        extra["tools"] = [msgspec.to_builtins(t) for t in tools]
    if kwargs:
        extra["chat_template_kwargs"] = kwargs
    if chat_template is not None:
        extra["chat_template"] = chat_template
    return extra


def _is_token_ids(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def completion_prompts(prompt: Any) -> list[str | list[int]]:
    """A text, a list of token ids, or a batch (a list of texts / of token-id lists)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt is empty", "prompt")
    if _is_token_ids(prompt):
        return [list(prompt)]
    out: list[str | list[int]] = []
    for x in prompt:
        if not (isinstance(x, str) or _is_token_ids(x)):
            raise bad_request(
                "prompt must be a string, a list of token ids, or a list of either", "prompt", "invalid_type"
            )
        out.append(x)
    return out
