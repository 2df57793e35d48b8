"""The host tier's one byte budget: pages of one checkpoint's size, each free, KV or a
checkpoint, and the demotion rule (what the device evicts goes to the host unless the
host's weakest item is worth more per byte).

The two-tier state machine of ``test_host_tier.py`` (a fake memory checks what every
block and slot of both tiers holds after every step, and ``check_integrity()`` holds) runs
again with the shared budget; ``HostPages`` and the demotion rule are also checked alone.
"""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize

from deltaserve.cache import CacheManager, CacheManagerConfig, SeqCache, StepItem
from deltaserve.cache.eviction import CheckpointEviction, EvictionParams
from deltaserve.cache.host_pages import CHECKPOINT, FREE, KV, HostPages
from deltaserve.cache.host_tier import HostTier
from deltaserve.cache.radix_tree import Node, RadixTree
from deltaserve.cache.types import TransferKind

from .test_host_tier import BS, Memory, TwoTierMachine


class PagedMachine(TwoTierMachine):
    """``TwoTierMachine`` with one host budget of pages instead of the fixed pair."""

    @initialize(
        num_blocks=st.integers(10, 40),
        num_ckpt=st.integers(1, 4),
        pages=st.integers(1, 14),
        checkpoint_bytes=st.sampled_from([100, 250, 300]),  # 1, 3 and 3 blocks per page
        load_budget=st.sampled_from([None, 100, 1000]),
        policy=st.sampled_from(["default", "v1", "every-unit"]),
        has_gdn=st.booleans(),
    )
    def setup(  # type: ignore[override]
        self,
        num_blocks: int,
        num_ckpt: int,
        pages: int,
        checkpoint_bytes: int,
        load_budget: int | None,
        policy: str,
        has_gdn: bool,
    ) -> None:
        self.cm = CacheManager(
            CacheManagerConfig(
                block_size=BS,
                num_kv_blocks=num_blocks,
                num_live_slots=3,
                num_checkpoint_slots=num_ckpt,
                checkpoint_bytes=checkpoint_bytes,
                has_gdn=has_gdn,
                checkpoint_policy=policy,
                num_host_pages=pages,
                kv_block_bytes=100,
                host_load_bytes_per_step=load_budget,
            )
        )
        assert self.cm.host.pages is not None and self.cm.host.blocks is None
        self.mem = Memory()
        self.reqs: dict[str, tuple[SeqCache, list[int], list[int]]] = {}
        self.n = 0


TestPaged = PagedMachine.TestCase
TestPaged.settings = settings(
    max_examples=300, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


# ---------------------------------------------------------------------------- HostPages alone
def _check(pages: HostPages, held: dict[int, Any], slots: set[int]) -> None:
    pages.check(held, dict.fromkeys(slots))  # type: ignore[arg-type]


def test_pages_fill_one_kv_page_before_opening_another_and_free_whole() -> None:
    pages = HostPages(3, 4)
    blocks = [pages.allocate_block() for _ in range(4)]
    assert sorted(blocks) == [0, 1, 2, 3] and pages.kind == [KV, FREE, FREE]
    slot = pages.allocate_slot()
    assert slot == 1 and pages.kind == [KV, CHECKPOINT, FREE]
    b = pages.allocate_block()
    assert pages.page_of(b) == 2
    _check(pages, dict.fromkeys([*blocks, b]), {slot})
    for x in blocks[:3]:
        pages.free_block(x)
        assert pages.kind[0] == KV  # a KV page turns free only when wholly free
    pages.free_block(blocks[3])
    assert pages.kind[0] == FREE and 0 in pages.free_pages
    pages.free_slot(slot)
    _check(pages, {b: None}, set())
    assert pages.counts() == {FREE: 2, KV: 1, CHECKPOINT: 0}


def test_pages_reject_double_frees() -> None:
    pages = HostPages(2, 2)
    a, b = pages.allocate_block(), pages.allocate_block()
    pages.free_block(a)
    with pytest.raises(RuntimeError):
        pages.free_block(a)
    pages.free_block(b)
    with pytest.raises(RuntimeError):
        pages.free_block(b)  # the page is free again, not KV
    with pytest.raises(RuntimeError):
        pages.free_slot(0)
    with pytest.raises(ValueError):
        HostPages(0, 3)


def test_pages_random_churn_keeps_every_page_one_thing() -> None:
    rng = random.Random(7)
    pages = HostPages(6, 3)
    held: dict[int, Any] = {}
    slots: set[int] = set()
    for _ in range(3000):
        op = rng.random()
        if op < 0.4 and pages.can_allocate_block():
            b = pages.allocate_block()
            assert b not in held
            held[b] = None
        elif op < 0.55 and pages.free_pages:
            slots.add(pages.allocate_slot())
        elif op < 0.85 and held:
            b = rng.choice(sorted(held))
            del held[b]
            pages.free_block(b)
        elif slots:
            s = rng.choice(sorted(slots))
            slots.remove(s)
            pages.free_slot(s)
        _check(pages, held, slots)
        assert sum(pages.counts().values()) == 6


# ---------------------------------------------------------------------------- the demotion rule
class _Worth(CheckpointEviction):
    """Worth from a table (node key -> worth), per byte like the value strategy's."""

    name = "table"
    per_byte = True

    def __init__(self, tree: RadixTree, worth: dict[int, float], kv_block_bytes: int = 0) -> None:
        super().__init__(tree, EvictionParams(block_size=BS, kv_block_bytes=kv_block_bytes))
        self.table = worth

    def on_attach(self, node: Node, kind: Any, history: int | None = None) -> None:
        return None

    def on_hit(self, node: Node) -> None:
        return None

    def on_unpin(self, node: Node) -> None:
        return None

    def victim(self, want: Any, residents: Any, trackers: Any = (), host_floor: float = math.inf) -> Any:
        return None, "pool"

    def worth(self, node: Node) -> float:
        return self.table[node.key]

    def likely_to_serve(self, node: Node) -> bool:
        return node.key not in self.unlikely

    unlikely: set[int] = set()  # checkpoints the "learner" expects not to serve


def _paged_host(*, checkpoint_bytes: int, pages: int) -> tuple[HostTier, RadixTree, dict[int, float]]:
    """An empty host tier of one budget over a new tree, its checkpoints worth ``table``'s
    values (KV blocks of 100 bytes, pages of ``checkpoint_bytes``)."""
    tree = RadixTree()
    table: dict[int, float] = {}
    host = HostTier(
        tree, _Worth(tree, table), num_blocks=0, num_slots=0, kv_block_bytes=100,
        checkpoint_bytes=checkpoint_bytes, num_pages=pages,
    )  # fmt: skip
    return host, tree, table


def _host_with_checkpoints(
    worths: list[float], *, pages: int
) -> tuple[HostTier, RadixTree, dict[int, float]]:
    """A host tier of ``pages`` one-block pages whose checkpoints were demoted from
    device nodes (one per entry of ``worths``), saves landed."""
    host, tree, table = _paged_host(checkpoint_bytes=100, pages=pages)
    for i, w in enumerate(worths):
        node = tree.insert(tree.root, 1000 + i, block_id=i)
        table[node.key] = w
        assert host.demote_checkpoint(node, device_slot=i)
    for t in host.saves:
        host.save_landed(t)
    host.saves.clear()
    return host, tree, table


def _newcomer(tree: RadixTree, table: dict[int, float], worth: float) -> Node:
    node = tree.insert(tree.root, 5000 + len(table), block_id=900 + len(table))
    table[node.key] = worth
    return node


def test_with_room_the_host_takes_what_the_device_evicts_whatever_its_worth() -> None:
    host, tree, table = _host_with_checkpoints([5.0], pages=3)
    assert host.floor() == 0.0
    node = _newcomer(tree, table, 0.0)  # worthless to the value model: still kept while room lasts
    assert host.demote_checkpoint(node, device_slot=7) and node.host_slot is not None
    assert host.counters["host.checkpoints_refused"] == 0


def test_full_host_turns_live_items_over_by_recency_and_dead_ones_first() -> None:
    """One budget under a per-byte strategy: among items the strategy prices above 0 the host
    is an LRU (the newcomer wins, however low its worth); an item priced at 0 goes first, and
    a dead newcomer is refused while everything held is alive."""
    host, tree, table = _host_with_checkpoints([3.0, 1.0, 2.0], pages=3)
    oldest = min(host.attached.values(), key=lambda n: n.last_access)
    assert host.floor() == math.inf  # all alive: no capture may push one down past them
    dead = _newcomer(tree, table, 0.0)
    assert not host.demote_checkpoint(dead, device_slot=8)
    assert dead.host_slot is None and host.counters["host.checkpoints_refused"] == 1
    low = _newcomer(tree, table, 0.5)  # worth less than any resident, but alive and newest
    assert host.demote_checkpoint(low, device_slot=9)
    assert oldest.host_slot is None and low.host_slot is not None  # the LRU one went, not the 1.0
    assert sorted(table[n.key] for n in host.attached.values()) == [0.5, 1.0, 2.0]
    table[next(n.key for n in host.attached.values() if table[n.key] == 2.0)] = 0.0  # it died
    assert host.floor() == 0.0  # something dead is held: a capture may push one down
    new = _newcomer(tree, table, 0.1)
    assert host.demote_checkpoint(new, device_slot=10)
    assert sorted(table[n.key] for n in host.attached.values()) == [0.1, 0.5, 1.0]


def test_a_checkpoint_dominated_by_one_likely_to_serve_ranks_below_dead_ones() -> None:
    """A checkpoint with a deeper one on its unforked path below (either tier) serves only the
    hits that stop short of it: when the learner expects the deeper one's class to serve, it
    ranks below everything, so it goes first, though it was used last. A fork below it, or a
    deeper checkpoint not expected to serve (rewritten replies), leaves it alive."""
    host, tree, table = _host_with_checkpoints([1.0, 0.0], pages=3)
    top = tree.insert(tree.root, 1, block_id=50)
    mid = tree.insert(top, 2, block_id=51)
    leaf = tree.insert(mid, 3, block_id=52)
    table.update({top.key: 5.0, leaf.key: 5.0})
    tree.attach_checkpoint(leaf, 1)  # on the device; ``top`` goes to the host
    assert host.demote_checkpoint(top, device_slot=2)  # a free page: taken whatever its rank
    for t in host.saves:
        host.save_landed(t)
    host.saves.clear()
    assert host.worth(top) == -1.0 and host.worth(leaf) == 1.0
    host.eviction.unlikely = {leaf.key}  # type: ignore[attr-defined]
    assert host.worth(top) == 1.0
    host.eviction.unlikely = set()  # type: ignore[attr-defined]
    other = tree.insert(top, 4, block_id=53)  # a fork below ``top``: another path needs it
    assert host.worth(top) == 1.0
    tree.remove_leaf(other)
    tree.touch(top)  # the most recently used of all
    assert host.floor() == -1.0
    newcomer = _newcomer(tree, table, 0.5)
    assert host.demote_checkpoint(newcomer, device_slot=9)
    assert top.host_slot is None  # the dominated one went, before the dead one (worth 0)
    assert sorted(table[n.key] for n in host.attached.values()) == [0.0, 0.5, 1.0]


def test_a_host_checkpoint_evicted_takes_the_kv_only_it_made_servable() -> None:
    """A host checkpoint the host gives up for a newcomer leaves its path's host KV below the
    nearest other checkpoint or fork unable to end a hybrid hit: that KV goes at once, with
    it, so its pages are free for what can serve (not left to wait until KV needs room)."""
    host, tree, table = _paged_host(checkpoint_bytes=100, pages=5)
    shared = tree.insert(tree.root, 1, block_id=0)  # a fork: two conversations below it
    chain = [shared]
    for key in (2, 3, 4):
        chain.append(tree.insert(chain[-1], key, block_id=key))
    other = tree.insert(shared, 9, block_id=9)
    for node in (chain[3], chain[2], chain[1]):  # the conversation's KV goes down, leaf first
        assert host.demote_kv(node) is not None
    table.update({shared.key: 1.0, chain[3].key: 1.0, other.key: 1.0, 77: 1.0})
    assert host.demote_checkpoint(chain[3], device_slot=1)  # its checkpoint, at its end
    tree.attach_checkpoint(shared, 0)  # the fork keeps a device checkpoint
    assert host.demote_checkpoint(other, device_slot=2)
    for t in host.saves:
        host.save_landed(t)
    host.saves.clear()
    tree.touch(other)
    assert host.pages is not None and not host.pages.free_pages  # full: 3 KV pages, 2 checkpoints
    assert host.floor() == math.inf
    newcomer = tree.insert(other, 77, block_id=77)
    assert host.demote_checkpoint(newcomer, device_slot=3)
    assert chain[3].host_slot is None  # the least recently used checkpoint went ...
    assert all(n.parent is None for n in chain[1:])  # ... and the KV only it made servable
    assert shared.parent is tree.root and other.host_slot is not None
    assert host.counters["host.kv_evicted_blocks"] == 3
    assert host.pages.counts() == {FREE: 3, KV: 0, CHECKPOINT: 2}


def test_fixed_pair_keeps_its_residents_on_a_tie() -> None:
    tree = RadixTree()
    table: dict[int, float] = {}
    host = HostTier(
        tree, _Worth(tree, table), num_blocks=4, num_slots=1, kv_block_bytes=100, checkpoint_bytes=100
    )
    first = _newcomer(tree, table, 1.0)
    assert host.demote_checkpoint(first, device_slot=0)
    host.save_landed(host.saves.pop())
    assert not host.demote_checkpoint(_newcomer(tree, table, 1.0), device_slot=1)
    assert host.demote_checkpoint(_newcomer(tree, table, 1.5), device_slot=2)
    assert first.host_slot is None


def _serve(cm: CacheManager, rid: str, toks: list[int]) -> None:
    seq = cm.admit(rid, toks, b"s")
    assert seq is not None
    assert cm.allocate(seq, len(toks))
    plan = cm.plan_step([StepItem(seq, toks, seq.num_cached_tokens, len(toks), False)])
    cm.land_transfers(plan)
    cm.commit_step(plan)
    cm.free(seq)
    cm.check_integrity()


def test_one_budget_trades_pages_between_kv_and_checkpoints() -> None:
    """Conversations evicted from a small device fill the host's pages with both kinds; every
    page stays one thing, and a conversation served long ago is still hit from the host."""
    cm = CacheManager(
        CacheManagerConfig(
            block_size=BS, num_kv_blocks=12, num_live_slots=2, num_checkpoint_slots=1, checkpoint_bytes=400,
            kv_block_bytes=100, num_host_pages=40,
        )
    )  # fmt: skip
    convos = [[c * 10_000 + i for i in range(130)] for c in range(8)]
    for c, toks in enumerate(convos):
        _serve(cm, f"r{c}", toks)
    usage = cm.usage()
    assert usage["host.kv_pages"] > 0 and usage["host.checkpoint_pages"] > 0
    assert usage["host.kv_pages"] + usage["host.checkpoint_pages"] + usage["host.free_pages"] == 40
    assert cm.match(convos[0] + [1, 2, 3], b"s").hit_tokens >= 128  # the first one, from the host


def _scattered_host() -> tuple[HostTier, RadixTree, list[Node], Node]:
    """Two KV pages of three blocks, one third free and one two thirds free, and the other
    two pages checkpoints; then a live checkpoint comes down."""
    host, tree, table = _paged_host(checkpoint_bytes=300, pages=4)
    leaves = [tree.insert(tree.root, 10 + i, block_id=i) for i in range(6)]
    for node in leaves:
        assert host.demote_kv(node) is not None
    for node in (leaves[1], leaves[3], leaves[4]):
        host.remove(node)  # page 0 holds leaves 0 and 2, page 1 leaf 5
    for i in range(2):
        node = tree.insert(tree.root, 50 + i, block_id=50 + i)
        table[node.key] = 1.0
        assert host.demote_checkpoint(node, device_slot=i)
    for t in host.saves:
        host.save_landed(t)
    host.saves.clear()
    assert host.pages is not None and not host.pages.free_pages and host.pages.open_free == 3
    newcomer = tree.insert(tree.root, 99, block_id=99)
    table[newcomer.key] = 1.0
    assert host.floor() == 0.0  # the free blocks add up to a page
    assert host.demote_checkpoint(newcomer, device_slot=5)
    return host, tree, leaves, newcomer


@pytest.mark.parametrize("fail", [False, True])
def test_a_checkpoint_takes_a_kv_page_vacated_into_the_others_free_blocks(fail: bool) -> None:
    """A checkpoint needs a page and none is free, but the KV pages' free blocks add up to
    one: the emptiest KV page's blocks move into the others' (host copies run before the
    checkpoint's save writes the page) and no live item is evicted. Until the move lands the
    moved node is not matchable; a failed move drops it, nothing else."""
    host, tree, leaves, newcomer = _scattered_host()
    moved = leaves[5]
    moves = [t for t in host.saves if t.kind is TransferKind.KV_MOVE]
    assert [(t.node, t.src, t.dst) for t in moves] == [(moved, 5, moved.host_block)]
    assert moved.host_block // 3 == 0 and moved.moving  # into page 0's free block
    assert host.saves.index(moves[0]) < next(
        i for i, t in enumerate(host.saves) if t.kind is TransferKind.CKPT_SAVE
    )  # planned before the save that writes the vacated page
    assert newcomer.host_slot == 1  # page 1, vacated
    assert host.counters["host.checkpoints_evicted"] == 0 and host.counters["host.kv_evicted_blocks"] == 3
    assert host.counters["host.kv_moved_blocks"] == 1
    assert host.pages is not None and host.pages.counts() == {FREE: 0, KV: 1, CHECKPOINT: 3}
    for t in host.saves:
        host.save_failed(t) if fail else host.save_landed(t)
    host.saves.clear()
    if fail:
        assert moved.parent is None and newcomer.host_slot is None  # both copies lost: dropped
        assert host.pages.counts() == {FREE: 1, KV: 1, CHECKPOINT: 2}
    else:
        assert not moved.moving and tree.root.children[moved.key] is moved
    host.pages.check(host.owner, host.attached)
