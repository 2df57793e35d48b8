"""RequestOutput: one streamed delta of a request."""

from __future__ import annotations

import msgspec


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    """Log-probabilities at one generated token (``SamplingParams.logprobs``): the chosen
    token's, its rank among all tokens (1 = most likely), and the ``logprobs`` most likely
    tokens as ``(token_id, logprob)`` pairs, descending. Raw model log-probabilities
    (log-softmax of the logits, before any sampling transform)."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]] = []


class RequestOutput(msgspec.Struct, kw_only=True):
    request_id: str
    token_ids: list[int]  # new since the previous output of this request
    text: str  # new text since the previous output
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None
    index: int = 0  # which of the request's n completions (SamplingParams.n) this delta belongs to
    # one per token in token_ids, when SamplingParams.logprobs is set
    logprobs: list[TokenLogprob] | None = None
