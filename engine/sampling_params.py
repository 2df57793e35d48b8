"""SamplingParams: how one request is decoded. Validated on creation, then immutable.

One object flows by reference from ``generate`` to the sampler and the stop checker.
"""

from __future__ import annotations

import msgspec

from deltaserve.engine.errors import InvalidRequestError


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # <= 0: off
    top_p: float = 1.0  # 1: off
    seed: int | None = None  # per-request generator: reproducible whatever the batch
    stop: list[str] = []  # stop strings (not included in the output text)
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    min_tokens: int = 0  # stop conditions are ignored before this many tokens

    def __post_init__(self) -> None:
        def bad(field: str, why: str) -> InvalidRequestError:
            return InvalidRequestError(f"SamplingParams.{field}={getattr(self, field)!r}: {why}")

        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise bad("max_tokens", "must be an integer >= 1")
        if not isinstance(self.temperature, (int, float)) or not (0.0 <= self.temperature < float("inf")):
            raise bad("temperature", "must be a finite number >= 0")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool):
            raise bad("top_k", "must be an integer (<= 0 disables)")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise bad("top_p", "must be in (0, 1]")
        if self.seed is not None and (
            not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0
        ):
            raise bad("seed", "must be a non-negative integer or None")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be a list of non-empty strings")
        if not isinstance(self.stop_token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
        ):
            raise bad("stop_token_ids", "must be a list of non-negative token ids")
        if not isinstance(self.min_tokens, int) or not (0 <= self.min_tokens <= self.max_tokens):
            raise bad("min_tokens", "must be an integer in [0, max_tokens]")
