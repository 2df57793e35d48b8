"""The two-tier cache manager, proven against a model of what each block and slot holds.

A hypothesis state machine drives admissions, steps, finishes, aborts and failed copies
through a manager with small device *and* host pools. Beside it, a fake memory plays the
runner: every device block, host block, device slot and host slot holds a *content* (the
key of what was written there), copies between tiers move contents in the order the
runner runs them (saves, loads, restores, forward, decode copies), and a forward writes
what it computes. After every step:

* every item the index says is usable holds exactly what it should (a node's KV block in
  its tier holds the node's key; its checkpoint, in either tier, holds the state at its
  boundary) — a wrong copy, a reused block, a lost save shows up here;
* a request computes only once its copies have landed, and then its live slot and every
  block of its path hold the right contents (the restore and the promotion were real);
* ``check_integrity()`` holds across both tiers.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from deltaserve.cache import CacheManager, CacheManagerConfig, CheckpointGranularity, SeqCache, StepItem
from deltaserve.cache.types import TransferKind

from .helpers import lookup

BS = 16
PREFIXES = [[p * 1000 + i for i in range(400)] for p in range(3)]


def content_at(seq: SeqCache, toks: list[int], t: int, cm: CacheManager) -> Any:
    """What the state after ``t`` tokens of ``toks`` is, as a comparable value."""
    if t % BS == 0:
        cm.extend_hashes(toks[:t], seq.salt, seq.hashes)
        return ("state", seq.hashes[t // BS - 1])
    return ("state", seq.request_id, tuple(toks[:t]))


class Memory:
    """What each block and slot of both tiers holds."""

    def __init__(self) -> None:
        self.kv: dict[int, Any] = {}
        self.host_kv: dict[int, Any] = {}
        self.slot: dict[int, Any] = {}
        self.host_slot: dict[int, Any] = {}


class TwoTierMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(10, 40),
        num_ckpt=st.integers(1, 4),
        host_blocks=st.integers(4, 60),
        host_slots=st.integers(1, 6),
        load_budget=st.sampled_from([None, 100, 1000]),
        policy=st.sampled_from(["default", "v1", "every-unit"]),
        has_gdn=st.booleans(),
    )
    def setup(
        self,
        num_blocks: int,
        num_ckpt: int,
        host_blocks: int,
        host_slots: int,
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
                checkpoint_bytes=300,
                has_gdn=has_gdn,
                checkpoint_policy=policy,
                num_host_kv_blocks=host_blocks,
                num_host_checkpoint_slots=host_slots,
                kv_block_bytes=100,
                host_load_bytes_per_step=load_budget,
            )
        )
        self.mem = Memory()
        self.reqs: dict[str, tuple[SeqCache, list[int], list[int]]] = {}
        self.n = 0

    # ------------------------------------------------------------------ rules
    @rule(p=st.integers(0, 2), cut=st.integers(1, 400), tail=st.integers(0, 100), seed=st.integers(0, 3))
    def admit(self, p: int, cut: int, tail: int, seed: int) -> None:
        toks = PREFIXES[p][:cut] + [90_000 + seed * 1000 + i for i in range(tail)]
        rid = f"r{self.n}"
        self.n += 1
        seq = self.cm.admit(rid, toks, b"s")
        if seq is None:
            return
        assert seq.num_cached_tokens <= len(toks) - 1
        self.cm.record_query(len(toks), seq.num_cached_tokens, seq)
        self.reqs[rid] = (seq, toks, [seq.num_cached_tokens])

    @precondition(lambda self: bool(self.reqs) or self.cm.has_transfers())
    @rule(data=st.data(), fail=st.booleans(), chunk=st.integers(1, 6), fail_copies=st.integers(0, 3))
    def step(self, data: st.DataObject, fail: bool, chunk: int, fail_copies: int) -> None:
        ready = sorted(rid for rid, (seq, _, _) in self.reqs.items() if not seq.loads)
        ids = data.draw(st.lists(st.sampled_from(ready), max_size=3, unique=True)) if ready else []

        def pick_failed(copies: list[Any]) -> list[Any]:
            if not copies or not fail_copies:
                return []
            return data.draw(st.lists(st.sampled_from(copies), max_size=fail_copies, unique_by=id))

        self._step(ids, chunk, pick_failed, fail)

    @precondition(lambda self: bool(self.reqs))
    @rule(data=st.data(), publish=st.booleans())
    def complete(self, data: st.DataObject, publish: bool) -> None:
        """Run one request (and whatever loads wait) to the end of its prompt, then end it:
        what the workload needs for its prefixes to come back from the host tier."""
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        for _ in range(40):
            if rid not in self.reqs:
                return
            seq, toks, comp = self.reqs[rid]
            if comp[0] >= len(toks):
                break
            self._step([] if seq.loads else [rid], 6, lambda copies: [], False)
        if rid in self.reqs:
            self.cm.free(self.reqs.pop(rid)[0], publish_output=publish)

    def _step(self, ids: list[str], chunk: int, pick_failed: Any, fail: bool) -> None:
        cm = self.cm
        for seq, _, _ in self.reqs.values():  # the scheduler stages loading requests
            if seq.loads:
                cm.stage_loads(seq)
        items = self._items(ids, chunk)
        if not items and not cm.has_transfers():
            return
        plan = cm.plan_step([it for _, it in items])
        cm.check_integrity()
        # --- the fake runner: saves, loads (some may fail), restores, forward, decode copies
        failed = pick_failed(plan.saves + plan.loads)
        self._copy_tiers(plan, items, failed)
        broken = cm.land_transfers(plan, failed)
        for src, dst in plan.restores:
            self.mem.slot[dst] = self.mem.slot.get(src)
        for _rid, it in items:
            self._forward(plan, it)
        for live, tracking in plan.decode_copies:
            self.mem.slot[tracking] = self.mem.slot.get(live)
        if fail:
            cm.abort_step(plan)
            for rid, _ in items:
                cm.free(self.reqs.pop(rid)[0], publish_output=False)
        else:
            cm.commit_step(plan)
            for rid, it in items:
                self.reqs[rid][2][0] = it.end
        for seq in broken:  # the engine ends a request whose loads failed
            if seq.request_id in self.reqs:
                cm.free(self.reqs.pop(seq.request_id)[0], publish_output=False)

    def _items(self, ids: list[str], chunk: int) -> list[tuple[str, StepItem]]:
        """The step's pieces: a decode token, or a prefill chunk ending on a unit boundary."""
        cm = self.cm
        items = []
        for rid in ids:
            seq, toks, comp = self.reqs[rid]
            start = comp[0]
            if start >= len(toks):
                toks.append(77_000 + len(toks))
            if len(toks) - start == 1 and start > 0:
                end, is_decode = start + 1, True
            else:
                end = min(len(toks), start + chunk * cm.unit)
                if end < len(toks):
                    end = end // cm.unit * cm.unit
                is_decode = False
            if not cm.allocate(seq, end):
                continue
            items.append((rid, StepItem(seq, toks, start, end, is_decode)))
        return items

    def _copy_tiers(self, plan: Any, items: list[tuple[str, StepItem]], failed: list[Any]) -> None:
        """Run the plan's saves and loads on the fake memory, except those picked to fail: the
        host's block moves first (all read, then all written), as the runner does. With one
        host budget a checkpoint saved into a page overwrites the KV blocks it held."""
        mem = self.mem
        failed_ids = {id(t) for t in failed}
        spaces = {  # (source, destination) of each kind of copy
            TransferKind.KV_SAVE: (mem.kv, mem.host_kv),
            TransferKind.CKPT_SAVE: (mem.slot, mem.host_slot),
            TransferKind.KV_LOAD: (mem.host_kv, mem.kv),
            TransferKind.STATE_LOAD: (mem.host_slot, mem.slot),
        }
        moves = [t for t in plan.saves if t.kind is TransferKind.KV_MOVE and id(t) not in failed_ids]
        read = [mem.host_kv.get(t.src) for t in moves]
        for t, value in zip(moves, read, strict=True):
            mem.host_kv[t.dst] = value
        pages = self.cm.host.pages
        for t in plan.saves + plan.loads:
            if t.kind.is_load:
                assert all(it.seq is not t.seq for _, it in items), "a loading request computes"
            if id(t) not in failed_ids and t.kind is not TransferKind.KV_MOVE:
                src, dst = spaces[t.kind]
                dst[t.dst] = src.get(t.src)
                if t.kind is TransferKind.CKPT_SAVE and pages is not None:
                    n = pages.page_blocks
                    for b in range(t.dst * n, t.dst * n + n):
                        mem.host_kv.pop(b, None)

    def _forward(self, plan: Any, it: StepItem) -> None:
        """One piece's forward: what it reads must be right, then it writes its KV and states."""
        cm, mem = self.cm, self.mem
        seq, toks = it.seq, list(it.token_ids)
        cm.extend_hashes(toks, seq.salt, seq.hashes)
        for b in range(it.start // BS):  # the path it attends to holds the right KV
            assert mem.kv.get(seq.block_table[b]) == seq.hashes[b], f"{seq.request_id}: block {b} wrong"
        if it.start > 0 and cm.has_gdn:
            assert mem.slot.get(seq.state_slot) == content_at(seq, toks, it.start, cm), (
                f"{seq.request_id}: live state wrong at {it.start}"
            )
        for b in range(it.start // BS, it.end // BS):
            mem.kv[seq.block_table[b]] = seq.hashes[b]
        for c in plan.captures:
            if plan.items[c.item_index] is it:
                mem.slot[c.slot] = content_at(seq, toks, c.boundary, cm)
        if cm.has_gdn:
            mem.slot[seq.state_slot] = content_at(seq, toks, it.end, cm)

    @precondition(lambda self: bool(self.reqs))
    @rule(data=st.data(), publish=st.booleans())
    def finish(self, data: st.DataObject, publish: bool) -> None:
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        self.cm.free(self.reqs.pop(rid)[0], publish_output=publish)

    @rule(n=st.integers(1, 30))
    def pressure(self, n: int) -> None:
        """A big allocation that evicts (and so demotes) what is unpinned."""
        seq = self.cm.admit(f"p{self.n}", [5] * 10, b"other")
        self.n += 1
        if seq is None:
            return
        self.cm.allocate(seq, n * BS)
        self.cm.check_integrity()
        self.cm.free(seq, publish_output=False)

    def teardown(self) -> None:
        if hasattr(self, "cm"):  # what the run exercised (pytest --hypothesis-show-statistics)
            c = self.cm.counters
            for key in ("host.kv_demoted_blocks", "host.kv_promoted_blocks", "host.checkpoints_demoted",
                        "host.checkpoints_restored", "host.failed_saves", "host.failed_loads"):  # fmt: skip
                event(f"{key} > 0: {c[key] > 0}")

    # ------------------------------------------------------------------ invariants
    @invariant()
    def contents(self) -> None:
        if not hasattr(self, "cm"):
            return
        cm, mem = self.cm, self.mem
        cm.check_integrity()
        for node in cm.tree.nodes():
            if not node.moving:
                if node.block_id >= 0:
                    assert mem.kv.get(node.block_id) == node.key, f"{node}: device KV wrong"
                else:
                    assert mem.host_kv.get(node.host_block) == node.key, f"{node}: host KV wrong"
            if node.checkpoint_slot is not None:
                assert mem.slot.get(node.checkpoint_slot) == ("state", node.key), f"{node}: checkpoint wrong"
            if node.host_slot is not None and not node.ckpt_moving:
                assert mem.host_slot.get(node.host_slot) == ("state", node.key), (
                    f"{node}: host checkpoint wrong"
                )


TestTwoTier = TwoTierMachine.TestCase
TestTwoTier.settings = settings(
    max_examples=400, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def _manager(**kw: Any) -> CacheManager:
    cfg = dict(
        block_size=BS, num_kv_blocks=8, num_live_slots=2, num_checkpoint_slots=1, checkpoint_bytes=300,
        kv_block_bytes=100, num_host_kv_blocks=32, num_host_checkpoint_slots=4,
        checkpoint_granularity=CheckpointGranularity.CHUNK,
    )  # fmt: skip
    # chunk granularity: the boundaries below are multiples of 64 (what is tested does not depend on it;
    # test_manager.py covers block granularity)
    cfg.update(kw)
    return CacheManager(CacheManagerConfig(**cfg))


def _run(cm: CacheManager, seq: SeqCache, toks: list[int]) -> None:
    """Prefill ``toks`` whole in one step (no fake memory: bookkeeping only)."""
    assert cm.allocate(seq, len(toks))
    plan = cm.plan_step([StepItem(seq, toks, seq.num_cached_tokens, len(toks), False)])
    cm.land_transfers(plan)
    cm.commit_step(plan)


def _serve_then_demote(cm: CacheManager, convo: list[int]) -> None:
    """Serve ``convo`` to the end, then a filler prompt that evicts (so demotes) it; the saves
    have landed when this returns."""
    seq = cm.admit("a", convo, b"s")
    assert seq is not None
    _run(cm, seq, convo)
    cm.free(seq)
    filler = cm.admit("b", [7] * 120, b"s")
    assert filler is not None
    _run(cm, filler, [7] * 120)
    cm.free(filler, publish_output=False)
    plan = cm.plan_step([])  # nothing left to copy: the saves ran in the filler's step
    cm.land_transfers(plan)
    cm.commit_step(plan)


def test_demoted_conversation_is_hit_from_the_host_and_promoted() -> None:
    cm = _manager()
    convo = list(range(100))  # 6 full blocks, a checkpoint unit at 64
    seq = cm.admit("a", convo, b"s")
    assert seq is not None and seq.num_cached_tokens == 0
    _run(cm, seq, convo)
    cm.free(seq)
    # another prompt fills the device: the conversation is demoted, not dropped
    other = cm.admit("b", [7] * 120, b"s")
    assert other is not None
    _run(cm, other, [7] * 120)
    cm.free(other, publish_output=False)
    cm.check_integrity()
    assert cm.counters["host.kv_demoted_blocks"] > 0  # saved in other's step, before its forward
    assert cm.counters["host.bytes_saved"] > 0
    again = cm.admit("c", convo + [5, 6, 7], b"s")
    assert again is not None and again.num_cached_tokens == 64
    cm.record_query(103, 64, again)
    kinds = [t.kind for t in again.loads]
    assert TransferKind.KV_LOAD in kinds
    assert cm.stage_loads(again)
    plan = cm.plan_step([])
    assert len(plan.loads) == len(kinds)
    cm.land_transfers(plan)
    cm.commit_step(plan)
    assert not again.loads
    stats = cm.stats()
    assert stats["prefix_cache.hit_tokens_host"] == again.host_hit_tokens > 0
    assert stats["host.kv_promoted_blocks"] == kinds.count(TransferKind.KV_LOAD)
    cm.check_integrity()


def test_load_budget_spreads_a_promotion_over_steps() -> None:
    cm = _manager(host_load_bytes_per_step=250)  # two KV blocks (100 B) per step
    convo = list(range(120))
    _serve_then_demote(cm, convo)
    again = cm.admit("c", convo + [1], b"s")
    assert again is not None and len(again.loads) >= 3
    steps = 0
    while again.loads:
        cm.stage_loads(again)
        plan = cm.plan_step([])
        assert sum(cm.host.nbytes(t.kind) for t in plan.loads) <= 250 or len(plan.loads) == 1
        cm.land_transfers(plan)
        cm.commit_step(plan)
        steps += 1
    assert steps >= 2
    cm.check_integrity()


def test_failed_load_ends_only_its_request_and_keeps_the_host_copy() -> None:
    cm = _manager()
    convo = list(range(100))
    _serve_then_demote(cm, convo)
    victim = cm.admit("c", convo + [1], b"s")
    assert victim is not None and victim.loads
    cm.stage_loads(victim)
    plan = cm.plan_step([])
    broken = cm.land_transfers(plan, failed=plan.loads[:1])
    assert broken == [victim]
    cm.commit_step(plan)
    cm.free(victim, publish_output=False)
    cm.check_integrity()
    assert cm.counters["host.failed_loads"] == 1
    # the items are still on the host: the next request hits them
    retry = cm.admit("d", convo + [2], b"s")
    assert retry is not None and retry.num_cached_tokens == 64 and retry.host_hit_tokens > 0


@pytest.mark.parametrize("kind", [TransferKind.KV_SAVE, TransferKind.CKPT_SAVE])
def test_failed_save_drops_the_item_never_a_request(kind: TransferKind) -> None:
    # KV_SAVE: the filler evicts the conversation's blocks; CKPT_SAVE: KV is ample, the
    # filler's capture evicts the conversation's checkpoint
    kv = (
        dict(num_host_kv_blocks=32)
        if kind is TransferKind.KV_SAVE
        else dict(num_kv_blocks=32, checkpoint_policy="every-unit")
    )
    cm = _manager(**kv)
    convo = list(range(100))
    seq = cm.admit("a", convo, b"s")
    assert seq is not None
    _run(cm, seq, convo)
    cm.free(seq)
    filler = cm.admit("b", [7] * 120, b"s")
    assert filler is not None and cm.allocate(filler, 120)  # evicts (demotes) the conversation
    plan = cm.plan_step([StepItem(filler, [7] * 120, 0, 120, False)])
    bad = [t for t in plan.saves if t.kind is kind]
    assert bad
    assert cm.land_transfers(plan, failed=bad) == []  # no request needed them
    cm.commit_step(plan)
    cm.free(filler, publish_output=False)
    cm.check_integrity()
    assert cm.counters["host.failed_saves"] == len(bad)
    again = cm.admit("c", convo + [1], b"s")
    assert again is not None and again.num_cached_tokens == 0  # lost, and nothing reads garbage


@pytest.mark.parametrize("host_slots", [0, 4])
def test_v1_capture_moves_a_protected_checkpoint_to_the_host_instead_of_skipping(host_slots: int) -> None:
    """``v1`` keeps a live (tail) checkpoint against another request's capture; with room on
    the host the capture takes the slot and the older checkpoint moves there, still a hit."""
    cm = _manager(
        checkpoint_policy="v1", checkpoint_interval=0, num_kv_blocks=60, num_host_checkpoint_slots=host_slots
    )
    first = list(range(300))
    _run_and_free(cm, "a", first)  # the one device slot: a's tail checkpoint at 256
    other = list(range(1000, 1300))
    _run_and_free(cm, "b", other)
    plan = cm.plan_step([])  # a save queued by b's step has run in it; nothing is left
    cm.land_transfers(plan)
    cm.commit_step(plan)
    cm.check_integrity()
    assert lookup(cm, first + [1], b"s") == 256  # kept, on the device or on the host
    if host_slots:
        assert cm.counters["host.checkpoints_demoted"] == 1
        assert lookup(cm, other + [1], b"s") == 256  # b's capture was not skipped
    else:
        assert cm.stats()["checkpoints.skipped_pool"] == 1
        assert lookup(cm, other + [1], b"s") == 0


def _run_and_free(cm: CacheManager, rid: str, toks: list[int]) -> None:
    seq = cm.admit(rid, toks, b"s")
    assert seq is not None
    _run(cm, seq, toks)
    cm.free(seq, publish_output=False)
    cm.check_integrity()
