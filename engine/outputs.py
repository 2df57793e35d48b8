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
    """One streamed delta of a request, as ``AsyncEngine.generate`` yields them.

    A request yields one ``RequestOutput`` per generated token (or a few tokens at once);
    its last one has ``finished=True`` and a ``finish_reason``. ``token_ids`` and ``text``
    are *deltas*: concatenate them to get the whole reply.

    Fields:

    request_id (str)
        The request's id: the ``request_id`` given to ``generate``, or a generated one.
    token_ids (list[int])
        Token ids generated since the previous output of this request. The last output
        includes the token the request stopped on (an end-of-sequence or stop token id),
        so appending every ``token_ids`` to the prompt ids gives exactly the sequence the
        model produced: pass it back as the next turn's prompt to reuse the cache (see
        ``examples/chat.py``). Empty when a request ends by abort or error.
    text (str)
        Text decoded since the previous output (special tokens skipped). Text that could
        still turn into a stop string is held back until it cannot; a stop string and
        anything after it are never returned.
    finished (bool, default False)
        True on the request's last output; nothing follows it.
    finish_reason (str | None, default None)
        Set when ``finished``: ``"stop"`` (an end-of-sequence token, a stop token id or a
        stop string), ``"length"`` (``max_tokens`` or ``max_model_len`` reached),
        ``"abort"`` (``engine.abort``, the consumer left the loop or was cancelled, the
        engine shut down) or ``"error"`` (a failed model step or engine loop; ``error``
        says why, and other requests are not affected by a failed step).
    num_prompt_tokens (int, default 0)
        Tokens in the prompt (after chat messages were rendered with the chat template).
    num_cached_tokens (int, default 0)
        Prompt tokens served from the prefix cache instead of computed; 0 until the
        request is admitted. On a hybrid model a multiple of the checkpoint unit
        lcm(``cache.block_size``, 64); on an attention-only model, of ``block_size``.
    error (str | None, default None)
        Why the request failed (``finish_reason="error"``); it may also explain an abort
        the application did not ask for (e.g. ``"engine shut down"``).
    index (int, default 0)
        Which of the request's ``SamplingParams.n`` completions this delta belongs to.
    logprobs (list[TokenLogprob] | None, default None)
        With ``SamplingParams.logprobs`` set: one ``TokenLogprob`` per id in ``token_ids``.
    queue_time_s (float | None, default None)
        On the output carrying a request's first token: seconds from its arrival in the engine
        to its first admission (waiting in the queue). None on every other output.
    prefill_time_s (float | None, default None)
        On the output carrying a request's first token: seconds from its first admission to
        that token (its prefill). None on every other output.
    prompt_logprobs (list[TokenLogprob | None] | None, default None)
        With ``SamplingParams.prompt_logprobs`` set, on the request's first output only: one
        entry per prompt token, None for the first (nothing predicts it), then each token's
        ``TokenLogprob`` given the tokens before it (vLLM's ``prompt_logprobs``).
    prompt_token_ids (list[int] | None, default None)
        The prompt's token ids, alongside ``prompt_logprobs``.
    num_draft_tokens (int, default 0)
        With speculative decoding (``speculative.method``), on the request's last output: the
        draft tokens its verifies checked. 0 on every other output, and with speculation off.
    num_accepted_tokens (int, default 0)
        Alongside ``num_draft_tokens``: how many of them were accepted (each an output token
        that cost no step of its own).
    """

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
    queue_time_s: float | None = None
    prefill_time_s: float | None = None
    # on the first output, when SamplingParams.prompt_logprobs is set (None at position 0)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_token_ids: list[int] | None = None
    # speculative decoding, on the last output: draft tokens checked, and accepted
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
