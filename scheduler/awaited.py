"""Hits that waiting requests will take, told to the checkpoint eviction each step.

A waiting request's prefix hit is served when it is admitted, unless the cache evicts it
first. Under memory pressure requests wait for admission (the checkpoint floor's refusal,
``kv_reserve``), and while they waited their hits went: swe-agent at 1.5 GiB (seed 0) lost
430 k of its 1.49 M prompt tokens' hits (29 %) between arrival and admission. The eviction's
value model priced such a checkpoint by its class's learned reuse and age, as if its hit
were still a guess.

``awaited_hits`` maps the checkpoint node each of the first ``AWAITED_REQUESTS`` waiting
requests (queue order) would restore from to the admissions until that request's own (1:
the next); ``CheckpointEviction.expect_hits`` takes it. ``ValueEviction`` values such a
checkpoint at a hit density of at least ``1 / due`` (a certain hit, ``due`` admissions
away, in the learner's own units), so KV demand and captures take likelier-wasted bytes first.

Measured (pressure and tenants-shift at 1.5 and 2.5 GiB, seeds 0-2, docs/cache.md "With
whole-prompt admission"): the 30 runs gain 138 points in sum, swe-agent seed 0 at 1.5 GiB
54.1 -> 66.2 %, tenants and tenants-shift +4-14 points; multi-turn seed 2 at 1.5 GiB loses
2.2 (the requests admitted sooner crowd out the conversations between turns). Only the
first 8 / 16 waiting requests counted: 40 / 19 points less in sum; 256: as 64.

Torch-free. ``tell_eviction`` costs one prefix match per counted waiting request per step
(the index changes every step under load, so the cache's per-version match rarely answers;
about 0.2 ms a step in the Mooncake overload), and nothing where no checkpoint could use it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable

from deltaserve.cache.manager import CacheManager
from deltaserve.cache.radix_tree import Node
from deltaserve.cache.types import PrefixMatch
from deltaserve.scheduler.request import Request

#: waiting requests, in queue order, whose hits are told to the eviction (bounds the matches)
AWAITED_REQUESTS = 64


def awaited_hits(waiting: Iterable[Request], match: Callable[[Request], PrefixMatch]) -> dict[Node, int]:
    """Node of the checkpoint each of the first ``AWAITED_REQUESTS`` waiting requests would
    restore from -> admissions until its request's (the nearest when two share one)."""
    due: dict[Node, int] = {}
    for i, r in enumerate(itertools.islice(waiting, AWAITED_REQUESTS)):
        m = match(r)
        if m.hit_blocks:
            due.setdefault(m.path[m.hit_blocks - 1], i + 1)
    return due


def tell_eviction(
    cache: CacheManager, waiting: Iterable[Request], match: Callable[[Request], PrefixMatch]
) -> None:
    """``awaited_hits`` to the cache's eviction, once a step; skipped (no match walked) without
    prefix caching, without GDN layers (no checkpoints) or under a strategy that ignores it."""
    if cache.enabled and cache.has_gdn and cache.eviction.values_awaited_hits:
        cache.eviction.expect_hits(awaited_hits(waiting, match))
