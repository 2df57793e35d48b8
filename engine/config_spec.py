"""``[speculative]``: speculative decoding (drafters, window length). Torch-free.

The method is an enum (``SpecMethod``); the drafter behind each is registered in
``deltaserve.engine.spec.drafter``. ``mtp`` (the model's own multi-token-prediction head)
needs a model with one: the engine refuses a model without it with a one-line
``ConfigError`` when it loads the model.
"""

from __future__ import annotations

import enum
from typing import Annotated, ClassVar

from deltaserve.engine.config_base import _bad, _doc, _Section


class SpecMethod(str, enum.Enum):
    """Where draft tokens come from (``speculative.method``)."""

    NONE = "none"  # no speculation: every decode computes one token (the default)
    NGRAM = "ngram"  # prompt lookup: the tokens that followed the context's last n-gram before
    REPLAY = "replay"  # a previous greedy run's output of the same prompt (tests, benchmarks)
    MTP = "mtp"  # the model's multi-token-prediction head (greedy drafts, chained)


class SpeculativeConfig(_Section):
    """``[speculative]``: draft ``num_tokens`` tokens per decoding request and verify them in
    one forward (docs/architecture.md, "Speculative decoding"). Greedy outputs are identical
    to speculation off; sampled outputs follow the target distribution."""

    section_key: ClassVar[str] = "speculative"

    method: Annotated[
        SpecMethod,
        _doc(
            "none | ngram (prompt lookup, vLLM's `ngram`) | replay (proposes what an earlier greedy run "
            "of the same prompt produced: acceptance near 100 %, for tests and benchmarks) | mtp (the "
            "model's own multi-token-prediction head, loaded with the model, drafting greedily; a model "
            "without one is a ConfigError)."
        ),
    ] = SpecMethod.NONE
    num_tokens: Annotated[
        int,
        _doc(
            "Draft tokens per verify (k; vLLM's num_speculative_tokens). A verify window never crosses a "
            "KV block boundary, so fewer are drafted near one.",
            ge=1,
            le=16,
        ),
    ] = 3
    prompt_lookup_min: Annotated[
        int, _doc("ngram: the shortest context suffix looked up (vLLM's prompt_lookup_min).", ge=1, le=64)
    ] = 2
    prompt_lookup_max: Annotated[
        int,
        _doc("ngram: the longest context suffix looked up first (vLLM's prompt_lookup_max).", ge=1, le=64),
    ] = 4
    replay_corrupt_every: Annotated[
        int,
        _doc(
            "replay: make the draft of every N-th output position wrong (2: every other draft, so a "
            "verify of k >= 2 emits two tokens); 0: never. For benchmarks of partial acceptance.",
            ge=0,
            le=1024,
        ),
    ] = 0

    def check(self) -> None:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise _bad(
                "speculative.prompt_lookup_min",
                self.prompt_lookup_min,
                f"must be <= speculative.prompt_lookup_max ({self.prompt_lookup_max})",
            )

    @property
    def enabled(self) -> bool:
        return self.method is not SpecMethod.NONE
