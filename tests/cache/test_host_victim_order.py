"""The host's weakest checkpoint under one budget, found among the checkpoints with a deeper one
(the dominated candidates), else by a scan in LRU order that stops at the first dead one
(``LruCheckpoints``), is the one the full ranking picks: over random
attach / detach / touch / fork / device-checkpoint / KV demotion / pin / verdict changes, the victim and its
band equal those of a reference that ranks every host checkpoint by ``(band, rank)`` (its last
access; a live one's moved back by its share of KV, ``LruCheckpoints.rank``), and so does ``floor``; the candidates are exactly the
held checkpoints with a deeper one after every event."""

from __future__ import annotations

import math
import random

import pytest

from deltaserve.cache.host_order import band, kv_share
from deltaserve.cache.host_tier import VACATE_CANDIDATES, HostTier
from deltaserve.cache.radix_tree import Node, RadixTree

from .test_host_pages import _Worth


def _reference_weakest(host: HostTier) -> tuple[Node | None, float]:
    """Every evictable host checkpoint ranked by (band, rank, last_access)."""
    best: Node | None = None
    key: tuple[float, float, int] = (math.inf, 0.0, 0)
    for n in host.attached.values():
        if not n.ckpt_pins and not n.ckpt_moving:
            b = band(n, host.eviction, host.tree)
            k = (b, host.lru.rank(n, b), n.last_access)  # (a tie in rank: the least recent)
            if k < key:
                best, key = n, k
    return best, key[0]


def _reference_vacatable(host: HostTier) -> bool:
    """One of the emptiest open KV pages holds only host nodes with no copy pending, and the
    other open pages' free blocks can take them."""
    pages = host.pages
    if pages is None:
        return False
    n = pages.page_blocks
    free = {p: n - pages.used[p] for p in pages.open_pages}
    for page in sorted(free, key=lambda p: pages.used[p])[:VACATE_CANDIDATES]:
        nodes = [node for node in host.tree.nodes() if node.host_block >= 0 and node.host_block // n == page]
        movable = all(not node.moving and node.block_id < 0 for node in nodes)
        if movable and sum(free.values()) - free[page] >= len(nodes):
            return True
    return False


def _reference_floor(host: HostTier) -> float:
    if host._has_slot() or _reference_vacatable(host):
        return 0.0
    worth = min(_reference_weakest(host)[1], host._page_victim()[1])
    return worth if worth < 1.0 else math.inf


def _take(
    host: HostTier, victim: Node | None, victim_worth: float, page: tuple[list[Node], float], worth: float
) -> object:
    """What ``_take_slot`` does for a newcomer worth ``worth``: refuse, or evict the checkpoint
    or the page's nodes."""
    nodes, page_worth = page
    if min(victim_worth, page_worth) > worth or (victim is None and not nodes):
        return "refused"
    return victim if victim is not None and victim_worth <= page_worth else frozenset(nodes)


class _Run:
    """A host tier of one budget over a random tree, and the random events that move it."""

    def __init__(self, rng: random.Random, pages: int) -> None:
        self.rng = rng
        self.tree = tree = RadixTree()
        self.table: dict[int, float] = {}
        self.eviction = _Worth(tree, self.table)
        self.eviction.unlikely = set()
        # some runs mostly alive: the page's rank then decides between it and the LRU checkpoint
        self.worths = [0.0, 1.0, 2.0] if rng.random() < 0.5 else [0.0] + [1.0] * 9
        self.host = HostTier(
            tree,
            self.eviction,
            num_blocks=0,
            num_slots=0,
            kv_block_bytes=100,
            checkpoint_bytes=300,
            num_pages=pages,
        )
        self.nodes: list[Node] = []
        self.device_ckpts: list[Node] = []
        self.next = 1

    def live(self) -> list[Node]:
        return [n for n in self.nodes if n.parent is not None]

    def device(self) -> list[Node]:
        return [n for n in self.live() if n.block_id >= 0]

    def grow(self) -> None:
        """A chain extended (mostly at a leaf) or a fork made, on the device."""
        live, rng = self.device(), self.rng
        parent = rng.choice(live) if live and rng.random() < 0.9 else self.tree.root
        leaves = [n for n in live if not n.children]
        if leaves and rng.random() < 0.6:
            parent = rng.choice(leaves)
        node = self.tree.insert(parent, self.next, block_id=self.next)
        self.next += 1
        self.table[node.key] = rng.choice(self.worths)
        self.nodes.append(node)

    def to_host(self) -> None:
        """A checkpoint goes to the host (evicting the weakest when full); most saves land."""
        cands = [n for n in self.live() if n.host_slot is None]
        if cands:
            self.host.demote_checkpoint(self.rng.choice(cands), device_slot=0)
            for t in self.host.saves:
                if self.rng.random() < 0.8:
                    self.host.save_landed(t)
            self.host.saves = [t for t in self.host.saves if t.node.ckpt_moving]

    def _drop(self, node: Node) -> None:
        self.host.drop_checkpoint(node)
        self.host.saves = [t for t in self.host.saves if t.node.host_slot is not None]

    def off_host(self) -> None:
        if self.host.attached:
            node = self.rng.choice(list(self.host.attached.values()))
            if not node.ckpt_pins:
                self._drop(node)

    def touch(self) -> None:
        if self.live():
            self.tree.touch(self.rng.choice(self.live()))

    def device_checkpoint(self) -> None:
        """A device checkpoint comes or goes (one below a host checkpoint can dominate it)."""
        free = [n for n in self.device_ckpts if not n.ckpt_pins]
        if free and self.rng.random() < 0.5:
            node = self.rng.choice(free)
            self.device_ckpts.remove(node)
            self.tree.detach_checkpoint(node)
            return
        cands = [n for n in self.device() if n.checkpoint_slot is None]
        if cands:
            node = self.rng.choice(cands)
            self.tree.attach_checkpoint(node, self.next)
            self.next += 1
            self.device_ckpts.append(node)

    def kv_to_host(self) -> None:
        """A device leaf's KV goes to the host (its page shared with other nodes' blocks)."""
        leaves = [n for n in self.device() if not n.device_children and not n.ref_count]
        if leaves and self.host.demote_kv(self.rng.choice(leaves)) is not None:
            for t in self.host.saves:
                if self.rng.random() < 0.8:
                    self.host.save_landed(t)
            self.host.saves = [t for t in self.host.saves if t.node.moving or t.node.ckpt_moving]

    def verdict(self) -> None:
        """A checkpoint dies or revives, or its class turns likely or unlikely to serve."""
        if self.live():
            node = self.rng.choice(self.live())
            self.table[node.key] = self.rng.choice(self.worths)
            self.eviction.unlikely ^= {node.key}

    def pin(self) -> None:
        if self.host.attached:
            node = self.rng.choice(list(self.host.attached.values()))
            if node.ckpt_pins and self.rng.random() < 0.7:
                self.tree.unpin_checkpoint(node)
            else:
                self.tree.pin_checkpoint(node)

    def drop_leaf(self) -> None:
        """A leaf leaves the tree (a fork or a chain ends)."""
        leaves = [n for n in self.live() if not n.children and not n.ckpt_pins and n.checkpoint_slot is None]
        if leaves:
            node = self.rng.choice(leaves)
            if node.block_id < 0:
                self.host.remove(node)
                return
            if node.host_slot is not None:
                self._drop(node)
            self.tree.remove_leaf(node)


@pytest.mark.parametrize("seed", range(12))
def test_lru_scan_picks_the_victim_the_full_ranking_picks(seed: int) -> None:
    rng = random.Random(seed)
    run = _Run(rng, pages=rng.choice([4, 16, 64]))
    events = [run.grow, run.to_host, run.off_host, run.touch, run.device_checkpoint]
    events += [run.kv_to_host, run.verdict, run.pin, run.drop_leaf]
    weights = [30, 20, 8, 17, 7, 10, 5, 5, 8]
    bands: set[float] = set()
    pages: set[float] = set()
    # 1,500 events, then on until every kind below has come up (a 4-page host: two kinds of
    # KV page, its KV pages are vacated for checkpoints before a dominated one's comes up)
    kinds = 3 if run.host.pages is not None and run.host.pages.num_pages > 4 else 2
    for step in range(4000):
        if step >= 1500 and {-1.0, 0.0} <= bands and len(bands) >= 3 and len(pages) >= kinds:
            break
        rng.choices(events, weights)[0]()
        run.host.lru.check()
        want = _reference_weakest(run.host)  # (before the scan measures the live ones' mean age)
        victim = run.host._weakest_checkpoint()
        assert victim == want
        assert run.host.floor() == _reference_floor(run.host)
        bands.add(victim[1])
        pages.add(run.host._page_victim()[1])
        for worth in (-1.0, 0.0, 1.0):
            ours = _take(run.host, *victim, run.host._victim_page(*victim), worth)
            assert ours == _take(run.host, *victim, run.host._page_victim(), worth)
    assert {-1.0, 0.0} <= bands and len(bands) >= 3  # the bands took turns as the weakest
    assert len(pages) >= kinds  # and KV pages of each kind were next in line


def test_a_live_checkpoint_on_a_long_path_outlasts_a_newer_one_on_a_short_path() -> None:
    """Among live checkpoints, a conversation whose path holds many KV blocks per checkpoint
    page is kept past a newer one that holds few: recency shifted by the KV's share."""
    tree = RadixTree()
    table: dict[int, float] = {}
    eviction = _Worth(tree, table)
    eviction.unlikely = set()
    host = HostTier(
        tree, eviction, num_blocks=0, num_slots=0, kv_block_bytes=100, checkpoint_bytes=300, num_pages=4
    )
    assert host.lru.page_blocks == 3

    def chain(n: int, first: int) -> Node:
        node = tree.root
        for k in range(first, first + n):
            node = tree.insert(node, k, block_id=k)
        table[node.key] = 1.0  # alive
        host.demote_checkpoint(node, device_slot=0)
        for t in host.saves:
            host.save_landed(t)
        host.saves.clear()
        return node

    long = chain(60, 1)  # share 60 / 63
    short = chain(1, 100)  # share 1 / 4, newer
    assert host.lru.rank(long, 1.0) == long.last_access  # no mean age measured yet: recency
    assert host._weakest_checkpoint() == (long, 1.0)
    # that scan measured the mean age: (short - long) / 2 behind the newest; the long path's
    # larger share moves it back by 4 x that x (60/63 - 1/4), past the short one's recency
    assert host.lru.mean_age == (short.last_access - long.last_access) / 2
    assert host._weakest_checkpoint() == (short, 1.0)
    assert host.lru.rank(short, 1.0) < host.lru.rank(long, 1.0)
    assert host.lru.rank(long, 0.0) == long.last_access  # dead or dominated: recency only


def test_a_checkpoint_with_kv_below_it_counts_as_all_kv() -> None:
    """A leaf's share is its path's KV up to the fork above, against one page; a checkpoint
    with KV below it (a fork's, or one a conversation went on past) ends no path: evicting it
    frees a page and no KV, so it is not moved ahead of the leaves for a short path above."""
    tree = RadixTree()
    node = tree.root
    for k in range(1, 6):  # an unforked prefix of 5 blocks
        node = tree.insert(node, k, block_id=k)
    fork = node
    a = tree.insert(fork, 10, block_id=10)  # one branch of 1 block
    b_top = tree.insert(fork, 20, block_id=20)
    b = tree.insert(b_top, 21, block_id=21)  # one branch of 2 blocks
    assert kv_share(a, 3) == 1 / 4 and kv_share(b, 3) == 2 / 5
    assert kv_share(fork, 3) == 1.0  # forked below
    tree.remove_leaf(a)
    tree.remove_leaf(b)
    tree.remove_leaf(b_top)
    assert kv_share(fork, 3) == 5 / 8  # a leaf again: its 5 blocks up to the root
    inner = fork.parent
    assert inner is not None and kv_share(inner, 3) == 1.0  # unforked, with KV below
