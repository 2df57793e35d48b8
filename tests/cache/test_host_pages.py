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
from deltaserve.cache.host_tier import CHECKPOINT, FREE, KV, HostPages, HostTier
from deltaserve.cache.radix_tree import Node, RadixTree

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


def _host_with_checkpoints(
    worths: list[float], *, pages: int
) -> tuple[HostTier, RadixTree, dict[int, float]]:
    """A host tier of ``pages`` one-block pages whose checkpoints were demoted from
    device nodes (one per entry of ``worths``), saves landed."""
    tree = RadixTree()
    table: dict[int, float] = {}
    host = HostTier(
        tree,
        _Worth(tree, table),
        num_blocks=0,
        num_slots=0,
        kv_block_bytes=100,
        checkpoint_bytes=100,
        num_pages=pages,
    )
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


def test_full_host_keeps_the_newcomer_unless_its_weakest_is_worth_more() -> None:
    host, tree, table = _host_with_checkpoints([3.0, 1.0, 2.0], pages=3)
    weakest = next(n for n in host.attached.values() if table[n.key] == 1.0)
    assert host.floor() == pytest.approx(1.0 / 2)  # per byte of the checkpoint and its own block
    low = _newcomer(tree, table, 0.5)
    assert not host.demote_checkpoint(low, device_slot=8)
    assert low.host_slot is None and host.counters["host.checkpoints_refused"] == 1
    tie = _newcomer(tree, table, 1.0)  # a tie goes to the newcomer (items turn over like LRU)
    assert host.demote_checkpoint(tie, device_slot=9)
    assert weakest.host_slot is None and tie.host_slot is not None
    assert sorted(table[n.key] for n in host.attached.values()) == [1.0, 2.0, 3.0]


def test_a_leaf_worth_already_per_byte_of_its_kv_is_not_spread_again() -> None:
    """With one device budget the strategy's worth of a leaf already counts the KV only it
    keeps reachable: the host ranks it by that worth, not by it spread over the path again
    (which ranked deep conversations below shallow ones). A checkpoint with nodes below it,
    and any checkpoint under a fixed device split, is still spread over its own path."""
    for kv_block_bytes, leaf_worth in ((0, 1.0 / 2), (100, 1.0)):
        tree = RadixTree()
        table: dict[int, float] = {}
        host = HostTier(
            tree,
            _Worth(tree, table, kv_block_bytes=kv_block_bytes),
            num_blocks=0,
            num_slots=0,
            kv_block_bytes=100,
            checkpoint_bytes=100,
            num_pages=3,
        )
        top = tree.insert(tree.root, 1, block_id=0)
        mid = tree.insert(top, 2, block_id=1)
        leaf = tree.insert(mid, 3, block_id=2)
        table.update({mid.key: 1.0, leaf.key: 1.0})
        tree.attach_checkpoint(mid, 0)  # the leaf's own path is its one block: it ends at ``mid``
        assert host.worth(leaf) == pytest.approx(leaf_worth)
        assert host.worth(mid) == pytest.approx(1.0 / 3)  # a child below: spread over mid and top


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
