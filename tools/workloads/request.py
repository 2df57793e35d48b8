"""One request of a workload (``RequestSpec``) and token-id helpers.

``prompt_ids`` is what every backend (engine, transformers, simulator) receives; ``state`` is the
workload's continuation and is never serialized.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestSpec:
    """One request of a workload. ``prompt_ids`` is what every backend receives."""

    rid: str
    prompt_ids: list[int]
    max_tokens: int
    session: str = ""
    turn: int = 0
    branch: str = ""
    parent: str | None = None
    delay_s: float = 0.0  # after the parent's reply (think time / tool latency)
    arrival_s: float | None = None  # fixed arrival offset (trace)
    meta: dict[str, Any] = field(default_factory=dict)
    state: Any = field(default=None, repr=False)  # workload continuation, never serialized

    def describe(self) -> dict[str, Any]:
        return {
            "rid": self.rid,
            "session": self.session,
            "turn": self.turn,
            "branch": self.branch,
            "parent": self.parent,
            "delay_s": self.delay_s,
            "arrival_s": self.arrival_s,
            "num_prompt_tokens": len(self.prompt_ids),
            "max_tokens": self.max_tokens,
            "prompt_hash": prompt_hash(self.prompt_ids),
            "meta": dict(self.meta),
        }


def prompt_hash(ids: Sequence[int]) -> str:
    return f"{zlib.crc32(json.dumps(list(ids)).encode()):08x}-{len(ids)}"


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
