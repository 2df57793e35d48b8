"""Request: the scheduler's record of one generation. Torch-free.

``token_ids`` is the prompt followed by the tokens generated so far; the first
``num_computed_tokens`` of them have their KV and GDN state in the cache. A request is
*in prefill* while more than one token is uncomputed (or nothing is computed yet) and
*decoding* when exactly the last sampled token remains.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from deltaserve.cache.manager import SeqCache


def placeholder(row: int) -> int:
    """The token id that stands, in ``token_ids``, for the token that row ``row`` of the step in
    flight samples (the engine's async scheduling). Real token ids are >= 0, so a placeholder
    never collides with one; it is replaced by the real token once that step's tokens arrive."""
    return -(row + 1)


def is_placeholder(token_id: int) -> bool:
    """True for a ``placeholder``: a sampled token still on its way, not yet a token to hash."""
    return token_id < 0


def placeholder_row(token_id: int) -> int:
    """The sampled-token row a ``placeholder`` stands for."""
    return -token_id - 1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: Any  # engine.SamplingParams, opaque here
    priority: int = 0
    cache_salt: bytes = b""
    arrival_time: float = field(default_factory=time.monotonic)
    arrival_step: int = 0

    token_ids: list[int] = field(init=False)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prompt tokens served from cache at first admission (-1: not yet)
    cache: SeqCache | None = None
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of full blocks of token_ids
    num_preemptions: int = 0
    preempted_tokens: int = 0  # computed when last preempted (what its recompute may cost)
    # while admission holds it back (kv_reserve.py; both 0 once admitted): steps of this wait
    # only the checkpoint floor's pages kept it out, and the blocks of KV charged to the floor
    kv_short_steps: int = 0
    kv_short_blocks: int = 0
    finish_reason: str | None = None
    # time.monotonic() of its first admission (None while it waits) and of its first output
    # token (None until then): the queue and prefill times its first output reports
    scheduled_time: float | None = None
    first_token_time: float | None = None
    # the prompt is computed whole, without a prefix-cache hit, until the engine clears it
    # (prompt log-probabilities need the logits of every prompt position)
    compute_whole_prompt: bool = False
    # speculative decoding: tokens proposed to follow ``token_ids``, set by the engine before a
    # step and verified by the step that schedules them (never part of ``token_ids``)
    draft_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        return self.num_computed_tokens > 0 and self.num_uncomputed_tokens == 1

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
