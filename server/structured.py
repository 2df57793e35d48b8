"""Structured outputs on the API: request fields -> an engine ``Constraint``, and forced tool
calls back into ``tool_calls``.

Sources of a constraint (at most one per request; a second is a 400 naming it):

* OpenAI's ``response_format``: ``{"type": "json_object"}`` or ``{"type": "json_schema",
  "json_schema": {"name", "schema", "strict"}}`` (``text``: none);
* vLLM's ``structured_outputs``: ``{json | regex | choice | grammar}``, and its older
  top-level ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``;
* chat ``tool_choice``: ``"required"`` (a JSON array of ``{"name", "parameters"}`` over the
  request's tools, as vLLM builds it, with at most ``MAX_FORCED_CALLS`` items) or a named
  function (that function's parameters object).

With a reasoning model that thinks first (the reasoning parser is on and the request's
generation prompt opens ``<think>``: ``ChatParsing.thinks_first``), every chat constraint
starts after ``</think>`` (``Constraint.starts_after``, ``engine/grammar_gate.py``): the
reasoning is free text, returned as ``reasoning_content``, and the grammar holds from the token
after it. Without a reasoning parser, or with thinking off, it holds from the first token.

A forced tool call comes back as ``tool_calls`` (read by ``call_scanner.ForcedCallParser``, one
parser for a whole response and a stream): finish reason ``tool_calls``, or ``length`` with the
partial call (its name once generated, its arguments the JSON text so far) when ``max_tokens``
cuts it; ``content`` is null. An invalid spec is a 400 whose ``param`` names the field.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any

import msgspec

from deltaserve.engine.constraint import Constraint, ConstraintKind
from deltaserve.engine.errors import InvalidRequestError
from deltaserve.engine.front.client import EngineClient
from deltaserve.server import protocol as p
from deltaserve.server.errors import bad_request

#: the most calls a ``tool_choice: "required"`` output holds (bounded, like whitespace and integers,
#: so that a weak model's array ends); ``parallel_tool_calls: false`` makes it 1
MAX_FORCED_CALLS = 8


class ForcedMode(enum.Enum):
    """How a forced tool call's output is shaped: one named function's arguments object, or an
    array of ``{"name", "parameters"}`` (``tool_choice: "required"``)."""

    NAMED = "named"
    REQUIRED = "required"


@dataclass(frozen=True)
class ForcedTools:
    """A chat request whose ``tool_choice`` forces a call."""

    mode: ForcedMode
    name: str | None = None  # NAMED: the function
    after_reasoning: bool = False  # the call follows the model's reasoning (``starts_after``)


class _JsonSchemaFormat(msgspec.Struct, kw_only=True):
    name: str | None = None
    schema: dict[str, Any] | bool | None = msgspec.field(default=None, name="schema")
    strict: bool | None = None
    description: str | None = None


class _ResponseFormat(msgspec.Struct, kw_only=True):
    type: str
    json_schema: _JsonSchemaFormat | None = None


class _StructuredOutputs(msgspec.Struct, kw_only=True):
    json: dict[str, Any] | bool | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


def _make(
    kind: ConstraintKind, spec: str | list[str] | None, param: str, starts_after: str | None = None
) -> Constraint:
    try:
        return Constraint(kind=kind, spec=spec, starts_after=starts_after)
    except InvalidRequestError as e:
        detail = str(e).removeprefix("SamplingParams.constraint.spec: ")
        raise bad_request(f"{param}: {detail}", param) from None


def _schema_text(schema: Any, param: str) -> str:
    if isinstance(schema, str):  # vLLM accepts the schema as JSON text too
        return schema
    if not isinstance(schema, (dict, bool)):
        raise bad_request(f"{param} must be a JSON schema object", param)
    return json.dumps(schema)


def _convert(value: Any, type_: type, param: str) -> Any:
    try:
        return msgspec.convert(value, type_)
    except msgspec.ValidationError as e:
        raise bad_request(f"{param}: {e}", param) from None


def _from_response_format(rf: dict[str, Any], after: str | None) -> Constraint | None:
    fmt = _convert(rf, _ResponseFormat, "response_format")
    if fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return _make(ConstraintKind.JSON_OBJECT, None, "response_format", after)
    if fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema is None:
            raise bad_request(
                "response_format.json_schema.schema is required", "response_format.json_schema.schema"
            )
        param = "response_format.json_schema.schema"
        return _make(ConstraintKind.JSON_SCHEMA, _schema_text(fmt.json_schema.schema, param), param, after)
    raise bad_request(
        f"response_format.type {fmt.type!r} is not one of 'text', 'json_object', 'json_schema'",
        "response_format.type",
    )


def _from_structured(so: _StructuredOutputs, prefix: str, after: str | None) -> list[Constraint]:
    """The constraints ``so`` sets (``prefix``: how its fields are named in errors)."""
    out = []
    if so.json is not None:
        param = f"{prefix}json"
        out.append(_make(ConstraintKind.JSON_SCHEMA, _schema_text(so.json, param), param, after))
    if so.json_object:
        out.append(_make(ConstraintKind.JSON_OBJECT, None, f"{prefix}json_object", after))
    if so.regex is not None:
        out.append(_make(ConstraintKind.REGEX, so.regex, f"{prefix}regex", after))
    if so.choice is not None:
        out.append(_make(ConstraintKind.CHOICE, so.choice, f"{prefix}choice", after))
    if so.grammar is not None:
        out.append(_make(ConstraintKind.GRAMMAR, so.grammar, f"{prefix}grammar", after))
    return out


def request_constraint(req: p._SamplingFields, starts_after: str | None = None) -> Constraint | None:
    """The constraint a chat or completions request sets through ``response_format``,
    ``structured_outputs`` or the ``guided_*`` fields (400 when several are set);
    ``starts_after``: the reasoning's end marker when the model thinks first."""
    after = starts_after
    found: list[tuple[str, Constraint]] = []
    if req.response_format:
        c = _from_response_format(req.response_format, after)
        if c is not None:
            found.append(("response_format", c))
    if req.structured_outputs:
        so = _convert(req.structured_outputs, _StructuredOutputs, "structured_outputs")
        found += [("structured_outputs", c) for c in _from_structured(so, "structured_outputs.", after)]
    guided = _StructuredOutputs(
        json=req.guided_json, regex=req.guided_regex, choice=req.guided_choice, grammar=req.guided_grammar
    )
    found += [("guided_*", c) for c in _from_structured(guided, "guided_", after)]
    if len(found) > 1:
        names = ", ".join(sorted({f for f, _ in found}))
        raise bad_request(f"give at most one output constraint (set: {names})", found[1][0])
    return found[0][1] if found else None


def _tool_parameters(tool: p.Tool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def tool_choice_constraint(
    req: p.ChatCompletionRequest, starts_after: str | None = None
) -> tuple[Constraint, ForcedTools] | None:
    """The constraint of a ``tool_choice`` that forces a call (None for auto / none / unset);
    ``starts_after``: the reasoning's end marker when the model thinks first."""
    after = starts_after
    choice = req.tool_choice
    if choice is None or choice in ("auto", "none"):
        return None
    tools = req.tools or []
    if not tools:
        raise bad_request("tool_choice forces a tool call but the request has no tools", "tool_choice")
    if isinstance(choice, p.NamedToolChoice):
        name = choice.function.name
        tool = next((t for t in tools if t.function.name == name), None)
        if tool is None:
            known = [t.function.name for t in tools]
            raise bad_request(
                f"tool_choice names function {name!r}, which is not in tools {known}", "tool_choice"
            )
        spec = json.dumps(_tool_parameters(tool))
        return _make(ConstraintKind.JSON_SCHEMA, spec, "tools.function.parameters", after), ForcedTools(
            ForcedMode.NAMED, name, after is not None
        )
    items = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t.function.name]},
                "parameters": _tool_parameters(t),
            },
            "required": ["name", "parameters"],
        }
        for t in tools
    ]
    most = MAX_FORCED_CALLS if req.parallel_tool_calls else 1
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "maxItems": most, "items": {"anyOf": items}}
    constraint = _make(ConstraintKind.JSON_SCHEMA, json.dumps(schema), "tools.function.parameters", after)
    return constraint, ForcedTools(ForcedMode.REQUIRED, None, after is not None)


def chat_constraint(
    req: p.ChatCompletionRequest, starts_after: str | None = None
) -> tuple[Constraint | None, ForcedTools | None]:
    """A chat request's constraint and, for a forced ``tool_choice``, how its output is shaped
    (400 when both a forced call and another constraint are asked for); ``starts_after``: the
    reasoning's end marker when the model thinks first (module docstring). Parses each schema:
    call it off the event loop."""
    constraint = request_constraint(req, starts_after)
    tool_forced = tool_choice_constraint(req, starts_after)
    if tool_forced is None:
        return constraint, None
    if constraint is not None:
        raise bad_request("a forced tool_choice takes no other output constraint", "tool_choice")
    return tool_forced


async def compile_constraint(engine: EngineClient, c: Constraint | None) -> None:
    """Compile ``c`` where the engine core runs before the request is submitted, so that one
    that does not compile in time is a 400 (``GrammarTimeoutError``) and not an error inside a
    stream that has started; the wait is on the core's grammar workers, off every loop."""
    if c is not None:
        await engine.compile_constraint(c)
