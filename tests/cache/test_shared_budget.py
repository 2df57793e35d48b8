"""One device budget (``cache/arena.py``, ``cache/shared_budget.py``): pages change use between
KV blocks and checkpoints, KV blocks move out of a page a capture takes, and through all of
it every cached item still holds its own bytes.

The content test keeps a shadow of the arena: each page is one checkpoint slot or ``N`` KV
blocks over the same bytes, so a write to a slot clobbers the page's blocks and a write to a
block clobbers the page's slot. Steps "run" the plan as the engine does — host copies (none
here), block moves, restores, then the forward's KV and capture writes — and after every
commit each tree node's block must hold its own key and each checkpoint its node's key.
"""

from __future__ import annotations

import random

import pytest

from deltaserve.cache import CacheManager, CacheManagerConfig, SeqCache, StepItem
from deltaserve.cache.arena import Arena, PageUse
from deltaserve.cache.block_pool import PagedBlockPool

N = 4  # KV blocks per page
BS = 16
LIVE = 3


def shared_manager(pages: int, policy: str = "default", headroom: int | None = None) -> CacheManager:
    return CacheManager(
        CacheManagerConfig(
            block_size=BS,
            num_kv_blocks=pages * N,
            num_live_slots=LIVE,
            num_checkpoint_slots=pages,
            checkpoint_bytes=N * 100,
            kv_block_bytes=100,
            headroom_blocks=headroom,
            checkpoint_interval=128,
            checkpoint_policy=policy,
            shared_pages=pages,
            page_blocks=N,
        )
    )


class Shadow:
    """What each page's bytes hold: ``("kv", block) -> key`` or ``("slot", page) -> key``."""

    def __init__(self) -> None:
        self.bytes: dict[int, dict[tuple[str, int], object]] = {}

    def write_block(self, block: int, what: object) -> None:
        page = self.bytes.setdefault(block // N, {})
        page.pop(("slot", block // N), None)  # the slot's bytes are gone
        page[("kv", block)] = what

    def write_slot(self, slot: int, what: object) -> None:
        if slot < LIVE:  # live slots are pages of their own: never shared
            self.bytes.setdefault(slot, {})[("slot", slot)] = what
            return
        self.bytes[slot] = {("slot", slot): what}  # every block of the page is gone

    def block(self, block: int) -> object:
        return self.bytes.get(block // N, {}).get(("kv", block))

    def slot(self, slot: int) -> object:
        return self.bytes.get(slot, {}).get(("slot", slot))


def run_step(cm: CacheManager, shadow: Shadow, items: list[StepItem], fail: bool) -> int:
    """Plan, "run" and commit (or abort) one step; the number of block moves it planned."""
    plan = cm.plan_step(items)
    cm.check_integrity()
    if fail:
        cm.abort_step(plan)
        return len(plan.moves)
    for src, dst in plan.moves:  # after the (absent) host saves, before everything else
        shadow.write_block(dst, shadow.block(src))
    for src, dst in plan.restores:
        shadow.write_slot(dst, shadow.slot(src))
    for item in items:
        seq = item.seq
        for i in range(item.start // BS, -(-item.end // BS)):
            full = (i + 1) * BS <= item.end
            shadow.write_block(
                seq.block_table[i], seq.hashes[i] if full and i < len(seq.hashes) else "partial"
            )
    for item in items:  # the live state now stands at the item's end
        seq, end = item.seq, item.end
        at_block = end % BS == 0 and 0 < end // BS <= len(seq.hashes)
        shadow.write_slot(seq.state_slot, seq.hashes[end // BS - 1] if at_block else ("mid", end))
    for cap in plan.captures:
        seq = items[cap.item_index].seq
        shadow.write_slot(cap.slot, seq.hashes[cap.boundary // BS - 1])
    for live, tracking in plan.decode_copies:
        shadow.write_slot(tracking, shadow.slot(live))
    cm.land_transfers(plan)
    cm.commit_step(plan)
    return len(plan.moves)


def check_contents(cm: CacheManager, shadow: Shadow) -> None:
    for node in cm.tree.nodes():
        if node.block_id >= 0:
            assert shadow.block(node.block_id) == node.key, f"{node}: its block holds other bytes"
        if node.checkpoint_slot is not None:
            assert shadow.slot(node.checkpoint_slot) == node.key, f"{node}: its checkpoint holds other bytes"


PREFIXES = [[p * 1000 + i for i in range(400)] for p in range(3)]


def drive(seed: int, fail_rate: float = 0.1, steps: int = 300) -> dict[str, int]:
    """Random admissions, chunked prefills, decodes, failed steps and finishes on a shared
    budget; integrity and every item's bytes checked after each action. Returns the counters
    (and ``failed_moves``: moves of steps that failed)."""
    rng = random.Random(seed)
    cm = shared_manager(
        pages=rng.randint(6, 24),
        policy=rng.choice(["default", "v1", "every-unit"]),
        headroom=rng.choice([0, 1, None]),
    )
    shadow = Shadow()
    reqs: dict[str, tuple[SeqCache, list[int], list[int]]] = {}
    n = failed_moves = 0
    for _ in range(steps):
        action = rng.random()
        if action < 0.3 or not reqs:
            p = rng.randrange(3)
            toks = PREFIXES[p][: rng.randint(1, 400)] + [
                90_000 + n * 1000 + i for i in range(rng.randint(0, 120))
            ]
            seq = cm.admit(f"r{n}", toks, b"s")
            n += 1
            if seq is not None:
                reqs[seq.request_id] = (seq, toks, [seq.num_cached_tokens])
        elif action < 0.85:
            items = []
            for rid in rng.sample(sorted(reqs), min(len(reqs), rng.randint(1, 3))):
                seq, toks, comp = reqs[rid]
                start = comp[0]
                if start >= len(toks):
                    toks.append(77_000 + len(toks))
                if len(toks) - start == 1 and start > 0:
                    end, is_decode = start + 1, True
                else:
                    end = min(len(toks), start + rng.randint(1, 6) * cm.unit)
                    if end < len(toks):
                        end = end // cm.unit * cm.unit
                    is_decode = False
                if cm.allocate(seq, end):
                    cm.extend_hashes(toks, seq.salt, seq.hashes)
                    items.append((rid, StepItem(seq, toks, start, end, is_decode)))
            if items:
                fail = rng.random() < fail_rate
                failed_moves += run_step(cm, shadow, [it for _, it in items], fail) if fail else 0
                for rid, it in items:
                    if fail:
                        cm.free(reqs.pop(rid)[0], publish_output=False)
                    else:
                        reqs[rid][2][0] = it.end
        else:
            rid = rng.choice(sorted(reqs))
            cm.free(reqs.pop(rid)[0], publish_output=rng.random() < 0.8)
        cm.check_integrity()
        check_contents(cm, shadow)  # a failed step's moved nodes are gone, not holding stale bytes
    for seq, _, _ in list(reqs.values()):
        cm.free(seq, publish_output=False)
    cm.check_integrity()
    check_contents(cm, shadow)
    stats = cm.stats()
    assert (
        stats["cache.pages"]
        == stats["cache.pages_kv"] + stats["cache.pages_checkpoint"] + stats["cache.pages_free"]
    )
    return {**cm.counters, "failed_moves": failed_moves}


@pytest.mark.parametrize("seed", range(12))
def test_pages_change_use_and_every_item_keeps_its_bytes(seed: int) -> None:
    drive(seed)


def test_pages_go_both_ways_blocks_move_and_failed_moves_are_undone() -> None:
    """Prompts one after another on a small budget: summed over the seeds, pages change use
    both ways, vacating a KV page moves blocks (cached, pinned and private ones), and when a
    step with moves fails before its copies ran every moved block is back where its bytes are
    (every cached item's bytes are checked after each step)."""
    totals = dict.fromkeys(
        ("cache.pages_to_kv", "cache.pages_to_checkpoints", "kv.moved_blocks", "checkpoints.evicted_for_kv"),
        0,
    )
    failed_moves = 0
    for seed in range(12):
        rng = random.Random(seed)
        cm = shared_manager(pages=rng.randint(6, 24), policy="every-unit")
        shadow = Shadow()
        live: list[tuple[SeqCache, list[int]]] = []
        for r in range(60):
            toks = PREFIXES[r % 3][: rng.randint(100, 400)] + [
                50_000 + r * 1000 + i for i in range(rng.randint(0, 90))
            ]
            seq = cm.admit(f"r{r}", toks, b"s")
            if seq is None:
                continue
            if not cm.allocate(seq, len(toks)):
                cm.free(seq, publish_output=False)
                continue
            cm.extend_hashes(toks, seq.salt, seq.hashes)
            fail = rng.random() < 0.3
            moves = run_step(cm, shadow, [StepItem(seq, toks, seq.num_cached_tokens, len(toks), False)], fail)
            if fail:
                failed_moves += moves
                cm.free(seq, publish_output=False)
            else:
                live.append((seq, toks))
            cm.check_integrity()
            check_contents(cm, shadow)
            if len(live) > 1:
                cm.free(live.pop(0)[0])
        for key in totals:
            totals[key] += cm.counters[key]
    assert all(v > 0 for v in totals.values()), totals
    assert failed_moves > 0


def test_paged_block_pool_packs_and_pages_leave_whole() -> None:
    pool = PagedBlockPool(page_blocks=4, max_blocks=12)
    pool.add_page(3)
    pool.add_page(5)
    a = [pool.allocate() for _ in range(5)]  # one page filled, then the other
    assert sorted(pool.page_of(b) for b in a).count(3) in (1, 4) and pool.num_free == 3
    pool.check_integrity()
    with pytest.raises(RuntimeError, match="not a wholly free KV page"):
        pool.remove_page(pool.page_of(a[-1]))
    for b in a:
        pool.free(b)
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(a[0])
    pool.remove_page(3)
    with pytest.raises(RuntimeError, match="outside the KV pages"):
        pool.free(12)
    pool.check_integrity()
    assert pool.num_blocks == 4 and pool.num_free == 4


def test_arena_uses() -> None:
    arena = Arena(first=2, num_pages=3, page_blocks=4)
    a = arena.take(PageUse.KV)
    b = arena.take(PageUse.CHECKPOINT)
    assert (a, b) == (2, 3) and arena.num_free == 1
    arena.convert(a, PageUse.CHECKPOINT)
    with pytest.raises(RuntimeError, match="cannot convert"):
        arena.convert(a, PageUse.CHECKPOINT)
    arena.give_back(b)
    with pytest.raises(RuntimeError, match="free already"):
        arena.give_back(b)
    assert arena.counts == {PageUse.FREE: 2, PageUse.KV: 0, PageUse.CHECKPOINT: 1} and arena.conversions == 1
