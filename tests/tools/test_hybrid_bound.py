"""The hybrid LRU reference: LRU over KV and exact checkpoints, each checkpoint its bytes
(``tools/sim/hybrid_bound.py``). Exact hit counts on hand-built request sequences."""

from __future__ import annotations

import pytest

from deltaserve.tools.sim.bounds import kv_only_lru
from deltaserve.tools.sim.hybrid_bound import hybrid_lru

BS = 4  # tokens per KV block


def turn(prompt: list[int], out: int = 1) -> tuple[list[int], list[int]]:
    """A request: its prompt and ``out`` output tokens (ids past anything a prompt uses)."""
    return prompt, [1000 + len(prompt) + k for k in range(out)]


def follow(prev: tuple[list[int], list[int]], new: list[int]) -> tuple[list[int], list[int]]:
    """The next turn: the previous prompt and reply re-sent, then ``new``."""
    return turn(prev[0] + prev[1] + new)


def test_a_next_turn_hits_at_the_previous_end() -> None:
    r0 = turn(list(range(1, 11)), out=3)  # 13 tokens, 12 computed: 3 blocks, a checkpoint at 12
    r1 = follow(r0, [20, 21, 22, 23, 24])  # 18 tokens
    assert hybrid_lru([r0, r1], 100, BS, BS, 2.0) == pytest.approx(12 / (10 + 18))


def test_a_hit_ends_on_a_unit_boundary() -> None:
    r0 = turn(list(range(1, 11)), out=3)  # 12 computed: with 8-token units the checkpoint sits at 8
    r1 = follow(r0, [20, 21, 22, 23, 24])
    assert hybrid_lru([r0, r1], 100, BS, 2 * BS, 2.0) == pytest.approx(8 / (10 + 18))


def two_conversations() -> list[tuple[list[int], list[int]]]:
    a0, b0 = turn(list(range(1, 9))), turn(list(range(101, 109)))  # 8 computed each: 2 blocks
    return [a0, b0, follow(a0, [10, 11, 12]), follow(b0, [110, 111, 112])]  # 12 tokens each


def test_the_checkpoints_bytes_take_the_hits() -> None:
    reqs = two_conversations()
    prompt = 8 + 8 + 12 + 12
    # a first turn's path costs 2 blocks + a checkpoint of 2, a second turn's 3 + 2
    assert hybrid_lru(reqs, 7, BS, BS, 2.0) == 0.0  # LRU: A goes for B, then B for A's next turn
    assert hybrid_lru(reqs, 8, BS, BS, 2.0) == pytest.approx(8 / prompt)  # A hits; its growth pushes B out
    # checkpoints that cost nothing leave 7 blocks for 4 blocks of KV: the KV-only LRU's hits
    assert hybrid_lru(reqs, 7, BS, BS, 0.0) == pytest.approx(16 / prompt) == kv_only_lru(reqs, 7, BS)


def test_a_checkpoint_with_a_deeper_one_below_is_dropped() -> None:
    a0, b0 = turn(list(range(1, 9))), turn(list(range(101, 109)))
    a1 = follow(a0, [10, 11, 12])
    reqs = [a0, b0, a1, follow(b0, [110, 111, 112])]
    # after a1: A's 3 blocks + one checkpoint (the one at a0's end dropped) + B's 2 blocks and
    # checkpoint = 9; keeping a0's would make 11 and push B out before its next turn
    assert hybrid_lru(reqs, 9, BS, BS, 2.0) == pytest.approx(16 / (8 + 8 + 12 + 12))


def test_the_first_prompt_to_part_cannot_hit_at_the_fork() -> None:
    shared = list(range(1, 9))  # two blocks every request starts with
    reqs = [turn(shared + [k, k + 1, k + 2, k + 3]) for k in (10, 20, 30)]
    # the first parting finds KV but no checkpoint at the fork; it leaves one for the next
    assert hybrid_lru(reqs, 100, BS, BS, 2.0) == pytest.approx(8 / 36)
    assert kv_only_lru(reqs, 100, BS) == pytest.approx(16 / 36)


def test_a_request_larger_than_the_bytes_is_computed_without_the_cache() -> None:
    r0 = turn(list(range(1, 11)), out=3)
    reqs = [r0, follow(r0, [20, 21])]
    assert hybrid_lru(reqs, 4, BS, BS, 2.0) == 0.0  # 3 blocks + two checkpoints' room: 7 > 4
    assert hybrid_lru([], 4, BS, BS, 2.0) == 0.0
