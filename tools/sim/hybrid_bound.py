"""A reference for hybrid caches: LRU over KV *and* exact checkpoints, requests one by one.

The KV-only LRU bound (``tools/sim/bounds.py``) spends every byte on KV and lets a hit end
anywhere. A hybrid model's hit also needs a checkpoint at its end, and a checkpoint of the
recurrent state costs as many bytes as hundreds of tokens of KV. ``hybrid_lru`` charges
that cost and is otherwise as generous as it can be made, so the distance from the KV-LRU
bound to it is what the checkpoints' bytes take from any recency-ordered cache, and the
distance from it to a run is what the run's own choices cost:

* every request's computed tokens are cached and checkpointed at their last unit boundary,
  and where a request parts from a cached path a checkpoint goes at the fork's unit boundary
  (the hit of the next request to part there);
* a checkpoint with a deeper one below it on an unforked path is dropped (it can only serve
  prompts that stop exactly there);
* KV past the deepest checkpoint of its path can never end a hit and is dropped at once, so
  every leaf holds a checkpoint; the least recently used leaf goes first, with its checkpoint
  and the KV only it made servable;
* bytes: each KV block one block, each checkpoint ``checkpoint_blocks`` (its bytes over a KV
  block's), all in one budget; nothing is running beside the request.

It is not an upper bound, and it is a reference only where a next turn extends the last
one's end (chat that re-sends the model's replies). Elsewhere the cache's own choices beat it:
a checkpoint at every end costs bytes where ends are never resumed (one-off questions), a
rewritten reply parts at the prompt's end, where only a tail checkpoint serves, and the first
prompt to part inside an earlier one finds no checkpoint at the fork here, where interval
checkpoints serve it (the Mooncake trace at 40 + 256 GiB: ``default`` 1.33 x it; the pressure
workloads at 1.5 GiB: up to 1.96 x). A policy that predicts reuse better than recency can beat
it too. Hits count as the simulator's do: at most ``len(prompt) - 1`` tokens, ending on a
checkpoint. Torch-free.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from deltaserve.tools.sim.bounds import Served, request_blocks


class _Paths:
    """Cached blocks as a tree of chained hashes; a leaf always holds a checkpoint."""

    def __init__(self, capacity: float, checkpoint_blocks: float) -> None:
        self.capacity = capacity
        self.checkpoint_blocks = checkpoint_blocks
        self.parent: dict[int, int | None] = {}
        self.children: dict[int, int] = {}
        self.last: dict[int, int] = {}  # block -> index of the last request that used it
        self.checkpoints: set[int] = set()
        self.leaves: list[tuple[int, int]] = []  # (last use, block), stale entries skipped

    @property
    def used(self) -> float:
        return len(self.last) + self.checkpoint_blocks * len(self.checkpoints)

    def touch(self, hashes: Sequence[int], now: int) -> None:
        for k, h in enumerate(hashes):
            if h not in self.last:
                p = hashes[k - 1] if k else None
                self.parent[h] = p
                self.children[h] = 0
                if p is not None:
                    self.children[p] += 1
            self.last[h] = now
            if h in self.checkpoints and self.children[h] == 0:
                heapq.heappush(self.leaves, (now, h))  # the entry it had is stale now

    def checkpoint(self, h: int) -> None:
        self.checkpoints.add(h)
        if self.children[h] == 0:
            heapq.heappush(self.leaves, (self.last[h], h))

    def drop_dominated(self, h: int) -> None:
        """Drop the nearest checkpoint above ``h`` when the path between is unforked."""
        n = self.parent[h]
        while n is not None and n not in self.checkpoints and self.children[n] == 1:
            n = self.parent[n]
        if n is not None and n in self.checkpoints and self.children[n] == 1:
            self.checkpoints.discard(n)

    def prune(self, h: int | None) -> None:
        """Remove ``h`` and its ancestors while each is a leaf without a checkpoint."""
        while h is not None and h not in self.checkpoints and self.children[h] == 0:
            p = self.parent.pop(h)
            del self.children[h], self.last[h]
            if p is not None:
                self.children[p] -= 1
                if self.children[p] == 0 and p in self.checkpoints:
                    heapq.heappush(self.leaves, (self.last[p], p))
            h = p

    def evict(self, now: int) -> bool:
        """Evict least recently used leaves (never one used by request ``now``) until the
        bytes fit; False if only request ``now``'s own blocks are left."""
        while self.used > self.capacity:
            while self.leaves:
                t, h = self.leaves[0]
                if self.last.get(h) == t and self.children.get(h) == 0 and h in self.checkpoints:
                    break
                heapq.heappop(self.leaves)  # stale: used since, gained a child, or gone
            if not self.leaves or self.leaves[0][0] == now:
                return False
            _, h = heapq.heappop(self.leaves)
            self.checkpoints.discard(h)
            self.prune(h)
        if len(self.leaves) > 4 * len(self.checkpoints) + 64:  # drop the stale entries
            self.leaves = [(self.last[h], h) for h in self.checkpoints if self.children[h] == 0]
            heapq.heapify(self.leaves)
        return True


def hybrid_lru(
    requests: Sequence[Served], capacity_blocks: float, block_size: int, unit: int, checkpoint_blocks: float
) -> float:
    """Token hit rate of the LRU over KV and exact checkpoints described in the module
    docstring, with ``capacity_blocks`` KV blocks' worth of bytes."""
    stride = max(unit // block_size, 1)
    paths = _Paths(capacity_blocks, checkpoint_blocks)
    hit = total = 0
    for i, (prompt, output) in enumerate(requests):
        hashes, usable = request_blocks(prompt, output, block_size)
        total += len(prompt)
        cached = 0
        for h in hashes:
            if h not in paths.last:
                break
            cached += 1
        hit += block_size * max(
            (k + 1 for k in range(min(cached, usable)) if hashes[k] in paths.checkpoints), default=0
        )
        # the request's own bytes: its blocks and up to two checkpoints
        if len(hashes) + 2 * checkpoint_blocks > capacity_blocks:
            continue  # never fits: computed without the cache
        paths.touch(hashes, i)
        ends = [(len(hashes) // stride) * stride]
        if 0 < cached < len(hashes) and paths.children[hashes[cached - 1]] >= 2:
            ends.append((cached // stride) * stride)  # a fork: the next request to part hits here
        for end in ends:
            if end > 0:
                paths.checkpoint(hashes[end - 1])
        end = ends[0]
        if end > 0:
            paths.drop_dominated(hashes[end - 1])
        paths.prune(hashes[-1] if hashes else None)  # the KV past the last unit boundary
        paths.evict(i)
    return hit / total if total else 0.0
