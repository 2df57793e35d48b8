"""An output no device slot takes goes to the host straight from the request's live slot.

With one host budget under the value strategy, a decoding request whose output capture finds
no device checkpoint slot (none free, none it may displace) has its state saved from its live
slot into a host slot when the step that ends on the boundary commits: the save runs at the
start of the next step, before anything writes the live slot again. A later boundary replaces
the request's earlier one (one host page per request), and the conversation's next turn hits
the deepest. The state machines of ``test_host_pages.py`` check the saved contents against a
fake memory; these tests pin the rule down on one conversation.
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule

from deltaserve.cache import CacheManager, CacheManagerConfig, CheckpointGranularity, SeqCache, StepItem
from deltaserve.cache.types import TransferKind

from .helpers import lookup
from .test_host_pages import PagedMachine
from .test_host_tier import BS, Memory


def _manager(**kw: Any) -> CacheManager:
    cfg = dict(
        block_size=BS, num_kv_blocks=40, num_live_slots=2, num_checkpoint_slots=0, checkpoint_bytes=300,
        kv_block_bytes=100, num_host_pages=8, checkpoint_granularity=CheckpointGranularity.BLOCK,
    )  # fmt: skip
    cfg.update(kw)
    return CacheManager(CacheManagerConfig(**cfg))


def _step(cm: CacheManager, seq: SeqCache, toks: list[int], start: int, end: int, *, fail: bool = False) -> Any:
    assert cm.allocate(seq, end)
    plan = cm.plan_step([StepItem(seq, toks, start, end, end - start == 1 and start > 0)])
    cm.land_transfers(plan)
    if fail:
        cm.abort_step(plan)
    else:
        cm.commit_step(plan)
    cm.check_integrity()
    return plan


def _decode_to(cm: CacheManager, seq: SeqCache, toks: list[int], start: int, end: int) -> list[Any]:
    """Decode one token a step from ``start`` to ``end`` (``toks`` grows); the plans."""
    plans = []
    for t in range(start, end):
        if len(toks) <= t:
            toks.append(50_000 + t)
        plans.append(_step(cm, seq, toks, t, t + 1))
    return plans


def test_an_output_with_no_device_slot_is_saved_from_the_live_slot_to_the_host() -> None:
    cm = _manager()
    toks = list(range(40))
    seq = cm.admit("a", toks, b"s")
    assert seq is not None
    _step(cm, seq, toks, 0, len(toks))
    skipped = cm.counters["checkpoints.skipped_pool"]  # the prompt's tail at 32 found no slot
    toks.append(1)
    _decode_to(cm, seq, toks, 40, 48)  # ends on the boundary at 48 (3 blocks)
    node = seq.nodes[2]
    assert node.host_slot is not None and node.checkpoint_slot is None and seq.host_output is node
    # the save is planned for the next step, from the live slot (no device slot held it)
    [save] = [t for t in cm.host.saves if t.kind is TransferKind.CKPT_SAVE]
    assert (save.src, save.dst, save.node) == (seq.state_slot, node.host_slot, node)
    assert node.ckpt_moving and lookup(cm, toks + [2], b"s") == 0  # not servable until it lands
    plan = _step(cm, seq, toks, 48, 49)
    assert save in plan.saves and not node.ckpt_moving  # ran before the step's forward
    assert lookup(cm, toks[:49] + [2], b"s") == 48
    assert cm.counters["checkpoints.output_to_host"] == 1
    assert cm.counters["checkpoints.skipped_pool"] == skipped == 1


def test_a_later_boundary_replaces_the_requests_earlier_output_and_the_next_turn_hits_it() -> None:
    cm = _manager()
    toks = list(range(40))
    seq = cm.admit("a", toks, b"s")
    assert seq is not None
    _step(cm, seq, toks, 0, len(toks))
    toks.append(1)
    _decode_to(cm, seq, toks, 40, 66)  # crosses the boundaries at 48 and 64
    first, second = seq.nodes[2], seq.nodes[3]
    assert first.host_slot is None and second.host_slot is not None and seq.host_output is second
    assert cm.usage()["host.checkpoint_pages"] == 1  # one host page per decoding request
    cm.free(seq)
    nxt = toks[:66] + [7, 8, 9]
    assert lookup(cm, nxt, b"s") == 64  # the conversation's next turn resumes at its output
    assert cm.counters["checkpoints.output_to_host"] == 2
    cm.check_integrity()


def test_a_failed_step_saves_nothing() -> None:
    cm = _manager()
    toks = list(range(40))
    seq = cm.admit("a", toks, b"s")
    assert seq is not None
    _step(cm, seq, toks, 0, len(toks))
    toks.append(1)
    _decode_to(cm, seq, toks, 40, 47)
    toks.append(2)
    _step(cm, seq, toks, 47, 48, fail=True)  # the step that reached the boundary failed
    assert seq.host_output_boundary == 0 and not cm.host.saves and cm.usage()["host.checkpoint_pages"] == 0
    cm.free(seq, publish_output=False)
    cm.check_integrity()


def test_without_one_host_budget_the_output_is_skipped_as_before() -> None:
    """The fixed host pair (and ``v1``) keep their choices: no slot, no capture."""
    for kw in (dict(num_host_pages=0, num_host_kv_blocks=32, num_host_checkpoint_slots=4),
               dict(checkpoint_policy="v1")):  # fmt: skip
        cm = _manager(**kw)
        toks = list(range(40))
        seq = cm.admit("a", toks, b"s")
        assert seq is not None
        _step(cm, seq, toks, 0, len(toks))
        toks.append(1)
        _decode_to(cm, seq, toks, 40, 48)
        assert seq.nodes[2].host_slot is None and not cm.host.saves
        assert cm.counters["checkpoints.output_to_host"] == 0
        assert cm.counters["checkpoints.skipped_pool"] >= 1
        cm.free(seq)


class OutputsToHostMachine(PagedMachine):
    """``PagedMachine`` (a fake memory checks every block and slot of both tiers after each step)
    where decodes run long enough to cross unit boundaries and the device has at most one
    checkpoint slot, so outputs go to the host from live slots: what lands there must be the
    state at its boundary, whatever the steps, failures and evictions in between."""

    @initialize(
        num_blocks=st.integers(10, 40),
        num_ckpt=st.integers(0, 1),
        pages=st.integers(1, 14),
        checkpoint_bytes=st.sampled_from([100, 300]),
        load_budget=st.sampled_from([None, 1000]),
    )
    def setup(  # type: ignore[override]
        self, num_blocks: int, num_ckpt: int, pages: int, checkpoint_bytes: int, load_budget: int | None
    ) -> None:
        self.cm = CacheManager(
            CacheManagerConfig(
                block_size=BS, num_kv_blocks=num_blocks, num_live_slots=3, num_checkpoint_slots=num_ckpt,
                checkpoint_bytes=checkpoint_bytes, checkpoint_policy="default", num_host_pages=pages,
                kv_block_bytes=100, host_load_bytes_per_step=load_budget,
                checkpoint_granularity=CheckpointGranularity.BLOCK,
            )
        )  # fmt: skip
        self.mem = Memory()
        self.reqs: dict[str, tuple[SeqCache, list[int], list[int]]] = {}
        self.n = 0

    @precondition(lambda self: bool(self.reqs))
    @rule(data=st.data(), n=st.integers(1, 40), fail_last=st.booleans())
    def decode(self, data: st.DataObject, n: int, fail_last: bool) -> None:
        """One request runs ``n`` steps (prefill chunks, then a token a step; the last may fail)."""
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        for i in range(n):
            if rid not in self.reqs:
                return
            seq = self.reqs[rid][0]
            self._step([] if seq.loads else [rid], 6, lambda copies: [], fail_last and i == n - 1)


TestOutputsToHost = OutputsToHostMachine.TestCase
TestOutputsToHost.settings = settings(
    max_examples=400, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
