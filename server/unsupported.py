"""The one rule for request fields this server accepts in shape but does not implement.

A field that would change what is generated (or how it is returned) is **refused** when a
request uses it: 400 ``invalid_request_error`` with ``param`` = the field and code
``unsupported``, the same for every such field, so a client never gets an answer that silently
differs from what it asked for. "Uses" means a value other than the field's neutral ones (unset,
its default, an empty list or object). A field that is only informational (``user``,
``metadata``, ``store``, ``service_tier``) is **ignored**. ``FIELDS`` lists both kinds; the
request structs declare them (``protocol._UnimplementedFields``) and docs/server.md has the
table. Fields no struct declares are ignored, as OpenAI's own SDKs expect of a server.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from deltaserve.server.errors import bad_request


class Rule(enum.Enum):
    REFUSED = "refused"
    IGNORED = "ignored"


@dataclass(frozen=True)
class Field:
    """A request field that is not implemented; ``neutral``: the values that do not use it."""

    name: str  # dotted for a nested field: ``stream_options.continuous_usage_stats``
    rule: Rule
    neutral: tuple[Any, ...] = (None,)
    hint: str = ""


_EMPTY = (None, [], {})
FIELDS: tuple[Field, ...] = (
    Field("best_of", Rule.REFUSED, (None, 1)),
    Field("logit_bias", Rule.REFUSED, _EMPTY),
    Field("reasoning_effort", Rule.REFUSED, hint="; chat_template_kwargs {\"enable_thinking\": false} turns thinking off"),
    Field("functions", Rule.REFUSED, _EMPTY, "; use tools"),
    Field("function_call", Rule.REFUSED, hint="; use tool_choice"),
    Field("prediction", Rule.REFUSED),
    Field("audio", Rule.REFUSED),
    Field("modalities", Rule.REFUSED, (None, [], ["text"])),
    Field("suffix", Rule.REFUSED, (None, "")),
    Field("use_beam_search", Rule.REFUSED, (False,)),
    Field("include_stop_str_in_output", Rule.REFUSED, (False,)),
    Field("skip_special_tokens", Rule.REFUSED, (True,)),
    Field("spaces_between_special_tokens", Rule.REFUSED, (True,)),
    Field("truncate_prompt_tokens", Rule.REFUSED),
    Field("allowed_token_ids", Rule.REFUSED, _EMPTY),
    Field("bad_words", Rule.REFUSED, _EMPTY),
    Field("add_generation_prompt", Rule.REFUSED, (True,)),
    Field("continue_final_message", Rule.REFUSED, (False,)),
    Field("documents", Rule.REFUSED, _EMPTY),
    Field("user", Rule.IGNORED),
    Field("metadata", Rule.IGNORED),
    Field("store", Rule.IGNORED),
    Field("service_tier", Rule.IGNORED),
)  # fmt: skip
REFUSED = tuple(f for f in FIELDS if f.rule is Rule.REFUSED)
# (field, its path): what each request is checked against
_CHECKS = tuple((f, tuple(f.name.split("."))) for f in REFUSED)


def _uses(value: Any, neutral: tuple[Any, ...]) -> bool:
    if value is neutral[0]:  # the common case, the field's default (None, False, True): no compare
        return False
    return not any(value == n and type(value) is type(n) for n in neutral)


def check_unsupported(req: Any) -> None:
    """400 ``unsupported`` naming the first refused field ``req`` uses."""
    for field, path in _CHECKS:
        value = req
        for part in path:  # None where a part is absent (another endpoint's field, no stream_options)
            value = getattr(value, part, None)
        if _uses(value, field.neutral):
            raise bad_request(f"{field.name} is not supported{field.hint}", field.name, "unsupported")
