"""A user's own policy, loaded by the tests as ``tests.scheduler.custom_policy:LongestFirst``."""

from __future__ import annotations

from collections.abc import Sequence

from deltaserve.scheduler import PolicyContext, Request, SchedulingPolicy


class LongestFirst(SchedulingPolicy):
    name = "longest-first"

    def __init__(self, reverse: bool = False) -> None:
        self.reverse = reverse

    def order_waiting(self, waiting: Sequence[Request], ctx: PolicyContext) -> list[Request]:
        return sorted(waiting, key=lambda r: r.num_prompt_tokens, reverse=not self.reverse)
