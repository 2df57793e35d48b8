"""Admission under KV pressure: a new prompt is admitted only when its whole prompt fits.

Admission takes blocks for a prompt's first chunk only; its later chunks, and those of every
other prompt still prefilling, are taken step by step. When the prompts admitted together
outgrow the device, a later chunk finds no block and preempts a running request, whose KV is
freed half built: under a stream of long prompts (the Mooncake trace: 12k-token prompts of
about 390 MiB each at 4B-like sizes) that thrash recomputed 1.8 times the prompt tokens
looked up. vLLM admits a prompt only when blocks for all of it are free; SGLang reserves the
running requests' remaining tokens before it admits (its schedule conservativeness).

``kv_shortfall`` is that reservation: the blocks the running requests still need to end
their prompts (and take their next token), plus the blocks the new request will hold at the
end of its prompt, must fit in the device KV the running requests do not hold.

With one budget, the pages of decoding requests' output slots (``CheckpointStore.trackers``)
are no KV's while those requests run, so ``kv_capacity`` leaves them out (``tracking_held``).
(swe-agent at 1.5 GiB, ten agents decoding side by side: up to 8 of its 30 pages are output
slots; promised as KV, they made prompts preempt each other half built, again and again.)

KV below the checkpoints' floor only evicts within its own pages, so a
prompt that outgrows the pages outside the floor preempts a running request (whose recompute
lowers the floor). ``kv_capacity`` keeps ``FLOOR_RESERVED`` of the floor's pages out of the
capacity, and a prompt that only those pages keep out for ``FLOOR_WAIT_STEPS`` steps of its wait
charges the floor its shortfall in KV tokens (``charge_floor``, through ``SharedBudget.adjust``):
a held-back prompt tells the floor that KV is short, as a preemption does, without the
recompute. Measured (pressure and tenants-shift at 1.5 and 2.5 GiB, seeds 0-2, docs/cache.md
"With whole-prompt admission"): counting every page preempted in storms (swe-agent seed 0 at
1.5 GiB: 111 preemptions, tenants-shift seed 1: 87); keeping all of the floor's pages out
held prompts back at 2.5 GiB, where the floor sits at its maximum, and lost up to 5 points
there; charging at once drained the floor (tenants at 1.5 GiB 34.7 -> 19.8 %). These
constants are one measured point of a chaotic system, not an optimum: 32 or 128 steps, or
0.6 of the floor, each cost other runs 1.4-4.8 points.

A decode's growth past its next token is not reserved (an output's length is not known; a
preemption there is the rare, cheap case). With nothing running a request is always admitted
(the cache's ``can_ever_fit`` bounds it). Torch-free; O(running requests) per call, plus the
hit's nodes when the bound without them is short.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from deltaserve.cache.manager import CacheManager
from deltaserve.cache.types import PrefixMatch
from deltaserve.scheduler.request import Request

#: the share of the checkpoint floor's pages admission keeps out of the KV capacity
FLOOR_RESERVED = 0.5
#: steps of one wait a prompt is kept out by the floor's pages alone before it charges the floor
FLOOR_WAIT_STEPS = 64


@dataclass(frozen=True)
class Shortfall:
    """Blocks by which an admission would leave the running prompts short of room to end
    (0: it fits), and how many of them only the floor's reserved pages withhold (``blocks``
    when those pages would fit it, else 0: lowering the floor would not admit it)."""

    blocks: int = 0
    floor_blocks: int = 0


FITS = Shortfall()


def floor_reserved(cache: CacheManager) -> int:
    """Device blocks of the checkpoint floor kept out of ``kv_capacity`` (0 without one budget)."""
    budget = cache.budget
    if budget is None:
        return 0
    return int(budget.floor * budget.blocks.page_blocks * FLOOR_RESERVED)


def tracking_held(cache: CacheManager) -> int:
    """Device blocks of the pages decoding requests' output slots hold (0 without one budget).
    KV cannot take them while those requests run: ``SharedBudget.free_block`` takes only a
    published checkpoint's page."""
    budget = cache.budget
    if budget is None or budget.ckpts is None:
        return 0
    return len(budget.ckpts.trackers) * budget.blocks.page_blocks


def kv_capacity(cache: CacheManager) -> int:
    """Device KV blocks running requests may hold at most, for admission: the pool's, less
    ``floor_reserved`` or ``tracking_held``, whichever is more (output slots count toward the
    floor, so the two overlap)."""
    return cache.blocks.max_blocks - max(floor_reserved(cache), tracking_held(cache))


def kv_headroom(cache: CacheManager, running: Sequence[Request]) -> int:
    """Blocks left in ``kv_capacity`` after what the running requests hold and still need
    to end their prompts and take one more token (negative: already short)."""
    bs = cache.block_size
    held = cache.tree.num_pinned  # published blocks of running requests, each counted once
    need = 0
    for r in running:
        seq = r.cache
        if seq is None:
            continue
        table = len(seq.block_table)
        held += table - len(seq.nodes)  # private blocks
        need += max(0, -(-(r.num_tokens + 1) // bs) - table)
    return kv_capacity(cache) - held - need


def kv_shortfall(
    cache: CacheManager, running: Sequence[Request], req: Request, match: Callable[[], PrefixMatch]
) -> Shortfall:
    """How far admitting ``req`` would leave the running prompts short of room to end
    (``FITS``: the scheduler admits it; ``match``: its prefix match, asked for only when the
    bound without its hit is short)."""
    if not running:
        return FITS
    bs = cache.block_size
    headroom = kv_headroom(cache, running)
    total = -(-(req.num_tokens + 1) // bs)
    if total <= headroom:
        return FITS
    # blocks of its hit that running requests pin already cost nothing more; the rest of the
    # hit (unpinned device nodes it will pin, host nodes it will load) it takes like new ones
    m = match()
    shared = sum(1 for n in m.path[: m.hit_blocks] if n.block_id >= 0 and n.ref_count > 0)
    short = total - shared - headroom
    if short <= 0:
        return FITS
    # lowering the floor frees only the reserved pages output slots do not hold already
    floor_only = floor_reserved(cache) - tracking_held(cache)
    return Shortfall(short, short if short <= floor_only else 0)


def charge_floor(cache: CacheManager, req: Request, short: Shortfall) -> None:
    """``req`` is held back by ``short`` this step. Once only the floor's reserved pages have
    kept it out for ``FLOOR_WAIT_STEPS`` steps of this wait, the floor is charged that shortfall
    in KV tokens, less what this wait has charged already (``Request.kv_short_blocks``: one
    shortage per wait, not one per step)."""
    budget = cache.budget
    if budget is None or not short.floor_blocks:
        return
    req.kv_short_steps += 1
    extra = short.floor_blocks - req.kv_short_blocks
    if req.kv_short_steps >= FLOOR_WAIT_STEPS and extra > 0:
        req.kv_short_blocks = short.floor_blocks
        budget.adjust(-extra * cache.block_size)  # a cost of the floor, as a preemption's recompute
