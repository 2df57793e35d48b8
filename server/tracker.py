"""What one HTTP request has received so far: its completions' text, tokens and log-probabilities,
usage, and its latency metrics, each per completion (of ``n``): time to its first token, between
its tokens, to its end."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from deltaserve.engine.outputs import RequestOutput, TokenLogprob
from deltaserve.server import protocol as p
from deltaserve.server.errors import engine_failure
from deltaserve.server.metrics import ServerMetrics


@dataclass
class Choice:
    """One completion (``index`` among the request's ``n``) as received so far."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None

    def raise_if_failed(self) -> None:
        if self.finish_reason == "error":
            raise engine_failure(self.error)


class Tracker:
    """The ``n`` completions of one engine request, and the metrics they feed."""

    def __init__(self, metrics: ServerMetrics, n: int, received: float) -> None:
        """``received``: ``time.perf_counter()`` when the request reached the handler, before it
        was parsed and tokenized, so the engine's queue + prefill time (from its arrival, stamped
        while tokenizing) always fits inside the time to first token."""
        self.metrics = metrics
        self.t0 = received
        self.choices = [Choice(i) for i in range(n)]
        self.num_prompt_tokens = 0
        self.num_cached_tokens = 0

    def observe(self, out: RequestOutput) -> Choice:
        c = self.choices[out.index]
        now = time.perf_counter()
        if out.token_ids:
            if c.first_token_at is None:  # TTFT per completion, like every latency metric here
                c.first_token_at = now
                self.metrics.ttft.observe(now - self.t0)
            else:
                self.metrics.itl.observe(now - c.last_token_at)  # type: ignore[operator]
            c.last_token_at = now
            c.token_ids.extend(out.token_ids)
        if out.queue_time_s is not None:  # the engine's split of the first token's wait
            self.metrics.queue_time.observe(out.queue_time_s)
        if out.prefill_time_s is not None:
            self.metrics.prefill_time.observe(out.prefill_time_s)
        if out.index == 0 or not self.num_prompt_tokens:
            self.num_prompt_tokens = out.num_prompt_tokens or self.num_prompt_tokens
            self.num_cached_tokens = out.num_cached_tokens
        if out.logprobs:
            c.logprobs.extend(out.logprobs)
        c.text += out.text
        if out.finished:
            c.finish_reason = out.finish_reason
            c.error = out.error
            self.metrics.e2e.observe(now - self.t0)
            self.metrics.generation_tokens.observe(len(c.token_ids))
            self._observe_decode(c)
            if out.index == 0:
                self.metrics.prompt_tokens.observe(out.num_prompt_tokens)
        return c

    def _observe_decode(self, c: Choice) -> None:
        """Decode time and mean time per output token of a finished completion that had tokens."""
        if c.first_token_at is None or c.last_token_at is None:
            return
        decode = c.last_token_at - c.first_token_at
        self.metrics.decode_time.observe(decode)
        if len(c.token_ids) > 1:
            self.metrics.tpot.observe(decode / (len(c.token_ids) - 1))

    def count_finish(self, reason: str | None) -> None:
        self.metrics.request_success.labels(reason or "abort").inc()

    def abort_unfinished(self) -> None:
        """Completions the client left before they finished count as aborted."""
        for c in self.choices:
            if c.finish_reason is None:
                self.count_finish("abort")
                c.finish_reason = "abort"


def usage(trackers: list[Tracker]) -> p.Usage:
    """Token counts of one HTTP request (its prompts' trackers)."""
    prompt = sum(t.num_prompt_tokens for t in trackers)
    completion = sum(len(c.token_ids) for t in trackers for c in t.choices)
    cached = sum(t.num_cached_tokens for t in trackers)
    return p.Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=p.PromptTokensDetails(cached_tokens=cached),
    )
