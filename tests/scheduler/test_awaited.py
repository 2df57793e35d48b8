"""Hits that waiting requests will take (``scheduler/awaited.py``): each step the scheduler
tells the checkpoint eviction which checkpoints the waiting requests would restore from, and
how many admissions away each is. Torch-free."""

from __future__ import annotations

from deltaserve.cache import CacheManager, CacheManagerConfig
from deltaserve.cache.value_eviction import ValueEviction
from deltaserve.scheduler import Request, Scheduler, make_policy
from deltaserve.scheduler.awaited import AWAITED_REQUESTS, awaited_hits
from deltaserve.scheduler.request import RequestStatus
from tests.scheduler.stepping import step


class Params:
    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens


def make() -> Scheduler:
    cm = CacheManager(
        CacheManagerConfig(
            block_size=16, num_kv_blocks=256, num_live_slots=8, num_checkpoint_slots=8, checkpoint_bytes=1
        )
    )
    return Scheduler(cm, make_policy("fcfs"), max_num_seqs=1, max_num_batched_tokens=1024)


def test_the_scheduler_tells_the_eviction_what_waiting_requests_will_restore_from() -> None:
    s = make()
    value = s.cache.eviction
    assert isinstance(value, ValueEviction)
    shared = list(range(200))
    first = Request("a", shared, Params(2))
    s.add(first)
    while s.has_work():
        step(s)
    # one request runs (max_num_seqs=1); behind it a request with no hit, then one resuming a
    busy = Request("busy", list(range(5000, 5100)), Params(50))
    cold = Request("cold", list(range(9000, 9100)), Params(2))
    warm = Request("warm", shared + [7] + list(range(300, 340)), Params(2))
    for r in (busy, cold, warm):
        s.add(r)
    step(s)  # (told before this step's admissions: then busy was a waiting request too)
    step(s)
    assert busy.status is RequestStatus.RUNNING and cold.status is warm.status is RequestStatus.WAITING
    m = s._match(warm)
    assert m.hit_blocks > 0
    node = m.path[m.hit_blocks - 1]
    assert node.has_checkpoint
    assert value.awaited == {node: 2}  # two admissions away: cold's, then its own
    before = value.value(node)
    s.abort("cold")
    step(s)
    assert value.awaited == {node: 1} and value.value(node) >= before
    while busy.status is RequestStatus.RUNNING:
        step(s)
    step(s)  # warm admitted
    step(s)
    assert warm.status is not RequestStatus.WAITING and value.awaited == {}


def test_awaited_hits_keeps_the_nearest_due_and_counts_only_the_first_requests() -> None:
    s = make()
    shared = list(range(200))
    s.add(Request("a", shared, Params(2)))
    while s.has_work():
        step(s)
    waiting = [Request(f"w{i}", shared + [i] * 20, Params(2)) for i in range(AWAITED_REQUESTS + 5)]
    (node,) = awaited_hits(waiting[1:], s._match)
    assert awaited_hits(waiting[1:], s._match) == {node: 1}
    cold = [
        Request(f"c{i}", list(range(10_000 * (i + 1), 10_000 * (i + 1) + 40)), Params(2))
        for i in range(AWAITED_REQUESTS)
    ]
    assert awaited_hits([*cold, waiting[0]], s._match) == {}  # past the first AWAITED_REQUESTS
    assert awaited_hits([*cold[1:], waiting[0]], s._match) == {node: AWAITED_REQUESTS}
