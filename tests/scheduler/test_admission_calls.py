"""The scheduler admits a request with one call into the cache (``CacheManager.admit_request``)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from deltaserve.cache import CacheManager
from deltaserve.scheduler import Request

from .test_policies import Params, make_scheduler


class CountingCache:
    """The scheduler's cache, counting every method it calls by name."""

    def __init__(self, cache: CacheManager) -> None:
        self._cache = cache
        self.calls: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._cache, name)
        if not callable(value):
            return value

        def counted(*args: Any, **kw: Any) -> Any:
            self.calls[name] += 1
            return value(*args, **kw)

        return counted


def test_three_admissions_are_three_calls() -> None:
    s = make_scheduler(budget=2048)
    cache = CountingCache(s.cache)
    s.cache = cache  # type: ignore[assignment]
    for i, rid in enumerate(("a", "b", "c")):
        s.add(Request(rid, list(range(1000 * (i + 1), 1000 * (i + 1) + 100)), Params(1)))
    out = s.schedule()
    assert out is not None and [x.request.request_id for x in out.seqs] == ["a", "b", "c"]
    admission = {"match", "disk_fetch", "wait_for_shared_prefix", "admit", "allocate", "stage_loads",
                 "free", "record_query", "note_recompute_hit", "admit_request"}  # fmt: skip
    calls = {k: n for k, n in cache.calls.items() if k in admission}
    # per request one match at the step's start (its hit told to the eviction, scheduler/awaited.py)
    # and one at admission, its result passed on to admit_request (the cache keeps a match per
    # request while its index is unchanged: the second is a lookup, not a walk of the tree)
    assert calls == {"admit_request": 3, "match": 6}
    assert s.cache.stats()["prefix_cache.queries"] == 3
