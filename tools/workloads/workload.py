"""The workload contract: ``WorkloadParams`` (every knob) and the ``Workload`` base class.

A workload is a set of sessions. ``roots()`` gives each session's first request;
``follow_ups(spec, reply_ids)`` the requests that depend on a reply, each sent ``delay_s`` after
it. Every piece of text comes from its own ``random.Random`` keyed by ``(seed, workload, what,
...)``, so the order in which concurrent sessions finish never changes what they send next.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from deltaserve.tools.workloads.codecs import Codec
from deltaserve.tools.workloads.request import RequestSpec
from deltaserve.tools.workloads.text import TextMaker

SLOT = "@@DELTASERVE_SLOT@@"


@dataclass
class WorkloadParams:
    """Knobs of every workload; ``None`` means the workload's own default."""

    name: str = "chat"
    seed: int = 0
    num_requests: int | None = None  # independent workloads
    sessions: int | None = None  # chat conversations / agent trajectories
    turns: int | None = None
    prefix_len: int | None = None  # shared prefix / system prompt, tokens
    prompt_len: int | None = None  # unique part / question / user message / task, tokens
    output_len: int | None = None  # max_tokens
    tool_len: int | None = None  # agent tool results, tokens
    num_prefixes: int | None = None
    suffixes_per_prefix: int | None = None
    branches: int | None = None  # agent: continuations at the fork
    branch_at: int | None = None  # agent: the turn whose reply forks
    think_time: float | None = None  # mean seconds between a reply and the next turn
    len_jitter: float | None = None  # unique-part lengths vary uniformly by +-this fraction
    block_size: int = 16  # the engine's KV block size (shifted-prefix avoids its multiples)
    chat_tokenize: str = "incremental"  # incremental: prompt_k + reply ids + new turn; full: re-tokenize
    trace: str | None = None
    time_scale: float = 1.0  # trace: arrival_s multiplier
    min_turns: int | None = None  # multi-turn / swe-agent: fewest turns (uniform in [min_turns, turns])
    session_prefix_len: int | None = None  # multi-turn: per-conversation prefix, mean tokens (lognormal)
    replies: str | None = None  # what the next turn re-sends: model | recorded | stripped
    depth: int | None = None  # tree: levels below the root
    beam: int | None = None  # tree: children of an expanded node that are expanded in turn
    tenants: int | None = None  # tenants: distinct system prompts
    volatile_every: int | None = None  # tenants: sessions of a tenant per change of the first line
    shift_every: int | None = None  # tenants-shift: sessions per popularity phase
    shift_by: int | None = None  # tenants-shift: ranks the popularity moves each phase


COMMON_DEFAULTS: dict[str, Any] = {"output_len": 32, "len_jitter": 0.2, "think_time": 0.0}


class Workload:
    name = ""
    multi_turn = False
    defaults: dict[str, Any] = {}
    #: sessions in flight when neither ``--rate`` nor ``--concurrency`` is given (None: the default)
    default_concurrency: int | None = None

    def __init__(self, params: WorkloadParams, codec: Codec) -> None:
        self.params = params
        self.codec = codec
        self.text = TextMaker(codec)
        given = {k: v for k, v in dataclasses.asdict(params).items() if v is not None}
        self.p: dict[str, Any] = {**COMMON_DEFAULTS, **self.defaults, **given, "name": self.name}
        self.seed = params.seed

    # ---------------------------------------------------------------- helpers
    def rng(self, *key: object) -> random.Random:
        return random.Random(f"{self.seed}:{self.name}:" + ":".join(map(str, key)))

    def jitter(self, rng: random.Random, n: int) -> int:
        j = float(self.p["len_jitter"])
        return max(1, round(n * rng.uniform(1 - j, 1 + j))) if j > 0 else max(1, n)

    def think(self, *key: object) -> float:
        mean = float(self.p["think_time"])
        return self.rng("think", *key).expovariate(1.0 / mean) if mean > 0 else 0.0

    def render(self, messages: Sequence[dict[str, str]], gen: bool = True) -> str:
        return self.codec.render_chat(messages, add_generation_prompt=gen)

    def render_split(self, messages: Sequence[dict[str, str]]) -> tuple[str, str]:
        """Rendering around the content ``SLOT`` of one message: (before, after)."""
        text = self.render(messages)
        i = text.index(SLOT)
        return text[:i], text[i + len(SLOT) :]

    # ---------------------------------------------------------------- API
    def roots(self) -> list[RequestSpec]:
        """Each session's first request (every request for independent workloads)."""
        raise NotImplementedError

    def follow_ups(self, spec: RequestSpec, reply_ids: Sequence[int]) -> list[RequestSpec]:
        """Requests that depend on ``spec``'s reply (sent ``delay_s`` after it)."""
        return []

    def expected_requests(self) -> int:
        return len(self.roots())

    def describe(self) -> dict[str, Any]:
        out = {k: v for k, v in self.p.items() if k not in ("trace",) or v is not None}
        out["multi_turn"] = self.multi_turn
        out["expected_requests"] = self.expected_requests()
        out["codec"] = self.codec.name
        return out
