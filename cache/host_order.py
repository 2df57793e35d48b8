"""The host tier's order for one host budget under a per-byte value strategy: alive, then recent.

Items reach the host after hundreds of requests; there the value model's fine ranking (hit
density x compute saved per byte) kept fewer of the conversations that came back than recency
did, while its coarse verdict — will this checkpoint serve at all? — is what keeps finished
conversations off the host. So the host ranks a checkpoint in three bands (``band``):

* ``DOMINATED`` (-1): a deeper checkpoint, in either tier, lies on its unforked path below, and
  the strategy says it takes this one's hits (``CheckpointEviction.dominates``: the learner
  expects that one's class to serve more often than not, or at least as often as this one's):
  every hit that reaches this one goes on to the deeper one, so this one serves only if that
  one is lost. So a conversation keeps about one checkpoint on the host, its deepest;
* ``DEAD`` (0): the strategy prices it at nothing (the learner expects no hit at its age);
* ``ALIVE`` (1): the rest.

Within a band the host's existing tie-break applies (least recently used first; a newcomer
wins a tie). Among live, undominated items recency is shifted by size (``kv_share``): a live
checkpoint ranks by ``last_access + SIZE_WEIGHT x mean age x share``, where share is the
KV's part of the bytes its path holds (its blocks up to the fork above, and one page for
the checkpoint). A conversation keeps one checkpoint, so a short one pays a page for few
tokens of hit and a long one for many: per byte, the long one is worth more at the same
age; a checkpoint with KV below it ends no path and counts as all KV. On long reuse with a
host tier (2.5 + 10 GiB, seeds 0-2), with the host's KV pages vacated for checkpoints, that
is +1.0 / +2.3 / +2.1 points of hit over recency alone (docs/cache.md). A dominated
checkpoint is not refused on its way down: it takes room only while nothing weaker than it is
held, and goes first. Pure functions over the tree; the deeper checkpoint is the tree's memo
(``RadixTree.deeper_checkpoint``), so a band costs a walk only after a change on its chain.
The victim search asks for a band only the checkpoints that can be dominated (those with a
deeper checkpoint, tracked from the tree's memo resets) and, when none is, the LRU items up to
the first dead one. On the first 1,000 requests of the Mooncake conversation trace (about 1,300
host checkpoints) that is 3.1 M bands instead of the 8.8 M of a scan to the first dominated
one, and 11.9 s of search instead of 36.9 s, with the same victims.
"""

from __future__ import annotations

import heapq
import itertools
import math
import operator
from collections.abc import Callable

from deltaserve.cache.eviction import CheckpointEviction
from deltaserve.cache.radix_tree import Node, RadixTree

DOMINATED, DEAD, ALIVE = -1.0, 0.0, 1.0
_last_access = operator.attrgetter("last_access")

#: how far a live checkpoint's share of KV moves it back in the LRU order, in mean ages of
#: the live checkpoints held (long reuse seeds 0-2, hit % summed over the seeds: 10 / 12 /
#: 12.5 / 13 / 14 / 16 gave 166.1 / 166.2 / 167.1 / 166.9 / 166.4 / 166.2, recency alone
#: 161.7: docs/cache.md; one seed moves by up to half a point between neighbouring weights)
SIZE_WEIGHT = 12.5


def kv_share(node: Node, page_blocks: int) -> float:
    """The KV's part of the bytes that ``node``'s checkpoint and its path up to the nearest
    fork (or the root) hold, a checkpoint counted as ``page_blocks`` blocks: what evicting
    the conversation frees, against the hit it would give. The checkpoints above on that
    unforked path are dominated (they go first), so they are not counted as ends.

    1 for a checkpoint with KV below it (a fork's, or one its conversation went on past
    without a deeper checkpoint that dominates it): it ends no path, so evicting it frees its
    page and no KV, while every request that parts there loses its whole prefix. Ranked by
    its short path to the fork above instead, such checkpoints went first at any weight that
    kept the long conversations (a new app's system prompt among them)."""
    if node.children:
        return 1.0
    blocks, n = 0, node
    while n.parent is not None:
        blocks += 1
        parent = n.parent
        if parent.parent is None or len(parent.children) > 1:
            break
        n = parent
    return blocks / (blocks + page_blocks)


def band(node: Node, eviction: CheckpointEviction, tree: RadixTree) -> float:
    """``node``'s host checkpoint's band: ``DOMINATED``, ``DEAD`` or ``ALIVE``."""
    deeper = tree.deeper_checkpoint(node)
    if deeper is not None and eviction.dominates(deeper, node):
        return DOMINATED
    return ALIVE if eviction.worth(node) > 0 else DEAD


class LruCheckpoints:
    """The host checkpoints in least-recently-used order, to find the weakest without ranking
    them all. It is the one of least ``rank`` in the lowest band held (recency; for live ones
    under a size order, shifted by size; ties in ``last_access`` cannot occur: every touch
    takes a fresh tick, and a tie in rank goes to the less recent):

    * a dominated checkpoint has a deeper one below it, so only those are candidates: the held
      checkpoints whose ``deeper_checkpoint`` is not None, kept as a set (``_deep``) from the
      tree's record of the memos it clears (``RadixTree.take_deeper_reset``). The least
      recently used dominated one goes first;
    * else a scan in LRU order returns the first dead one, else the first one (under a size
      order: the live one of least rank; the scan has seen them all by then, and measures
      their mean age for the next search).

    A lazy heap of ``(last_access, seq, node)``: ``add`` when a checkpoint reaches the host,
    ``discard`` when it leaves. A touch is not reported: ``last_access`` only grows, so an
    entry's key is never later than its node's, and a scan that meets an outdated entry pushes
    it again with the node's current key (it is met again where it now belongs). An entry is
    current while ``_seq[node]`` is its ``seq``; the others are skipped and dropped."""

    def __init__(self, tree: RadixTree, page_blocks: int | None = None) -> None:
        self._tree = tree
        # live checkpoints rank by recency shifted by size (``rank``) when set, else by recency
        self.page_blocks = page_blocks
        # ticks: the live checkpoints' mean age behind the newest of them, at the last full scan
        self.mean_age = 0.0
        self._heap: list[tuple[int, int, Node]] = []
        self._seq: dict[Node, int] = {}
        self._deep: set[Node] = set()  # held checkpoints with a deeper checkpoint below
        self._count = itertools.count()

    def __len__(self) -> int:
        return len(self._seq)

    def rank(self, node: Node, band: float) -> float:
        """Where ``node`` stands within ``band`` (lower goes first): its last access, and for a
        live checkpoint under a size order, moved back by its share of KV."""
        if band != ALIVE or self.page_blocks is None or not self.mean_age:
            return float(node.last_access)  # (no mean age yet: the shift is 0, skip the walk)
        return node.last_access + SIZE_WEIGHT * self.mean_age * kv_share(node, self.page_blocks)

    def add(self, node: Node) -> None:
        seq = self._seq[node] = next(self._count)
        heapq.heappush(self._heap, (node.last_access, seq, node))
        if self._tree.deeper_checkpoint(node) is not None:
            self._deep.add(node)
        if len(self._heap) > 2 * len(self._seq) + 64:  # bound the dropped entries kept
            self._heap = [(n.last_access, s, n) for n, s in self._seq.items()]
            heapq.heapify(self._heap)

    def discard(self, node: Node) -> None:
        self._seq.pop(node, None)
        self._deep.discard(node)
        self._tree.deeper_reset.discard(node)  # the record holds held checkpoints only

    def _refresh_deep(self) -> None:
        tree, deep = self._tree, self._deep
        for node in tree.take_deeper_reset():
            if node not in self._seq:
                continue
            if tree.deeper_checkpoint(node) is None:
                deep.discard(node)
            else:
                deep.add(node)

    def check(self) -> None:
        """The dominated candidates are exactly the held checkpoints with a deeper one, and the
        tree's record of resets names held checkpoints only (it cannot grow without bound
        while the host has room and no search drains it)."""
        stray = [n for n in self._tree.deeper_reset if n not in self._seq]
        assert not stray, f"{len(stray)} checkpoints off the host left in the tree's reset record"
        self._refresh_deep()
        want = {n for n in self._seq if self._tree.deeper_checkpoint(n) is not None}
        assert self._deep == want, (
            f"host dominated candidates drift: {len(self._deep)} held, {len(want)} true"
        )

    def weakest(
        self, band_of: Callable[[Node], float], evictable: Callable[[Node], bool]
    ) -> tuple[Node | None, float]:
        """The evictable checkpoint with the least ``(band_of(n), rank(n))`` and its band
        (``(None, inf)`` when none is evictable): the least recently used dominated candidate,
        else a scan in LRU order up to the first dead one (the least ranked live one when
        none is). The scanned entries go back into the heap."""
        self._refresh_deep()
        for node in sorted(self._deep, key=_last_access):
            if evictable(node) and band_of(node) == DOMINATED:
                return node, DOMINATED
        kept: list[tuple[int, int, Node]] = []
        found = self._scan(band_of, evictable, kept)
        for entry in kept:
            heapq.heappush(self._heap, entry)
        return found

    def _scan(
        self,
        band_of: Callable[[Node], float],
        evictable: Callable[[Node], bool],
        kept: list[tuple[int, int, Node]],
    ) -> tuple[Node | None, float]:
        """``weakest`` past the dominated candidates: the first dead item in LRU order, else
        the live one of least rank; the valid entries popped are left in ``kept``. A full
        scan also measures the live checkpoints' mean age (``mean_age``)."""
        heap, seqs = self._heap, self._seq
        alive: Node | None = None
        best = math.inf
        sized, newest, ages, live = self.page_blocks is not None, 0, 0, 0
        while heap:
            entry = heapq.heappop(heap)
            access, seq, node = entry
            if seqs.get(node) != seq:
                continue  # the node left the host (or was pushed again)
            if access != node.last_access:  # touched since: it belongs later
                seq = seqs[node] = next(self._count)
                heapq.heappush(heap, (node.last_access, seq, node))
                continue
            kept.append(entry)
            if not evictable(node):
                continue
            b = band_of(node)
            if b != ALIVE:  # dead (no candidate was dominated)
                return node, b
            if sized:  # every live one is seen: a dead one would have ended the scan
                newest, ages, live = max(newest, access), ages + access, live + 1
                if (r := self.rank(node, ALIVE)) < best:
                    alive, best = node, r
            elif alive is None:
                alive = node
        if live:
            self.mean_age = newest - ages / live
        return (alive, ALIVE) if alive is not None else (None, math.inf)
