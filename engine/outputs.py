"""RequestOutput: one streamed delta of a request."""

from __future__ import annotations

import msgspec


class RequestOutput(msgspec.Struct, kw_only=True):
    request_id: str
    token_ids: list[int]  # new since the previous output of this request
    text: str  # new text since the previous output
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None
