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
end of its prompt, must fit in the device KV the running requests do not hold. The KV
capacity is the pool's, with one budget every page: the floor of pages it keeps for
checkpoints yields to KV through the preemptions it causes (the budget lowers it by their
recompute), and an admission that counted it would hold prompts back without the budget ever
learning that KV is short (measured: the floor stayed up and KV evictions rose, pressure
swe-agent seed 1 at 1.5 GiB 56.0 -> 52.5 % hit against 59.9 % counting every page). A
decode's growth past its next token
is not reserved (an output's length is not known; a preemption there is the rare, cheap
case). With nothing running a request is always admitted (the cache's ``can_ever_fit``
bounds it). Torch-free; O(running requests) per call, plus the hit's nodes when the bound
without them is short.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from deltaserve.cache.manager import CacheManager
from deltaserve.cache.types import PrefixMatch
from deltaserve.scheduler.request import Request


def kv_capacity(cache: CacheManager) -> int:
    """Device KV blocks running requests may hold at most: every page of the one budget."""
    return cache.blocks.max_blocks


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
) -> int:
    """Blocks by which admitting ``req`` would leave the running prompts short of room to
    end (0: it fits, and the scheduler admits it; ``match``: its prefix match, asked for only when the bound without its
    hit is short)."""
    if not running:
        return 0
    bs = cache.block_size
    headroom = kv_headroom(cache, running)
    total = -(-(req.num_tokens + 1) // bs)
    if total <= headroom:
        return 0
    # blocks of its hit that running requests pin already cost nothing more; the rest of the
    # hit (unpinned device nodes it will pin, host nodes it will load) it takes like new ones
    m = match()
    shared = sum(1 for n in m.path[: m.hit_blocks] if n.block_id >= 0 and n.ref_count > 0)
    return max(0, total - shared - headroom)
