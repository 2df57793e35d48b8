"""Property test: random admit / step / finish / abort / fail / evict sequences keep the
cache manager's accounting exact, and nothing pinned is ever evicted."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from deltaserve.cache import CacheManager, CacheManagerConfig, SeqCache, StepItem

# Few distinct prefixes so requests share and branch a lot.
PREFIXES = [[p * 1000 + i for i in range(400)] for p in range(3)]


class CacheMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(12, 80),
        num_ckpt=st.integers(0, 4),
        staging=st.sampled_from([None, 0, 100, 300]),
        policy=st.sampled_from(["default", "v1", "every-unit", "step-end", "sequence-end", "interval"]),
        has_gdn=st.booleans(),
    )
    def setup(self, num_blocks: int, num_ckpt: int, staging: int | None, policy: str, has_gdn: bool) -> None:
        self.cm = CacheManager(
            CacheManagerConfig(
                block_size=16,
                num_kv_blocks=num_blocks,
                num_live_slots=3,
                num_checkpoint_slots=num_ckpt,
                checkpoint_bytes=100,
                staging_bytes=staging,
                has_gdn=has_gdn,
                checkpoint_interval=128,
                checkpoint_policy=policy,
            )
        )
        self.reqs: dict[str, tuple[SeqCache, list[int], list[int]]] = {}  # id -> (seq, tokens, [computed])
        self.n = 0

    @rule(p=st.integers(0, 2), cut=st.integers(1, 400), tail=st.integers(0, 120), seed=st.integers(0, 5))
    def admit(self, p: int, cut: int, tail: int, seed: int) -> None:
        toks = PREFIXES[p][:cut] + [90_000 + seed * 1000 + i for i in range(tail)]
        rid = f"r{self.n}"
        self.n += 1
        seq = self.cm.admit(rid, toks, b"s")
        if seq is None:
            assert self.cm.has_gdn and self.cm.slots.num_free_live == 0
            return
        assert seq.num_cached_tokens <= len(toks) - 1
        assert seq.num_cached_tokens % self.cm.unit == 0 or not self.cm.has_gdn
        # its misses by cause: check_integrity proves they sum to the misses after every rule
        self.cm.record_query(len(toks), seq.num_cached_tokens, seq)
        self.reqs[rid] = (seq, toks, [seq.num_cached_tokens])

    @precondition(lambda self: bool(self.reqs))
    @rule(data=st.data(), fail=st.booleans(), chunk=st.integers(1, 6))
    def step(self, data: st.DataObject, fail: bool, chunk: int) -> None:
        ids = data.draw(st.lists(st.sampled_from(sorted(self.reqs)), min_size=1, max_size=3, unique=True))
        items = []
        for rid in ids:
            seq, toks, comp = self.reqs[rid]
            start = comp[0]
            if start >= len(toks):
                toks.append(77_000 + len(toks))  # "sample" a token, then decode it
            if len(toks) - start == 1 and start > 0:
                end, is_decode = start + 1, True
            else:
                end = min(len(toks), start + chunk * self.cm.unit)
                if end < len(toks):
                    end = end // self.cm.unit * self.cm.unit
                is_decode = False
            if not self.cm.allocate(seq, end):
                continue  # the engine would preempt; here the request just waits
            items.append((rid, StepItem(seq, toks, start, end, is_decode)))
        if not items:
            return
        plan = self.cm.plan_step([it for _, it in items])
        self.cm.check_integrity()
        for src, _dst in plan.restores:
            assert src >= self.cm.slots.num_live  # restores read checkpoint slots
        if fail:
            self.cm.abort_step(plan)
            for rid, _ in items:
                self.cm.free(self.reqs.pop(rid)[0], publish_output=False)
        else:
            self.cm.commit_step(plan)
            for rid, it in items:
                self.reqs[rid][2][0] = it.end

    @precondition(lambda self: bool(self.reqs))
    @rule(data=st.data(), publish=st.booleans())
    def finish(self, data: st.DataObject, publish: bool) -> None:
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        self.cm.free(self.reqs.pop(rid)[0], publish_output=publish)

    @rule(n=st.integers(1, 40))
    def pressure(self, n: int) -> None:
        """A big allocation that may evict everything unpinned."""
        seq = self.cm.admit(f"p{self.n}", [5] * 10, b"other")
        self.n += 1
        if seq is None:
            return
        self.cm.allocate(seq, n * 16)
        self.cm.check_integrity()
        self.cm.free(seq, publish_output=False)

    @invariant()
    def integrity(self) -> None:
        if not hasattr(self, "cm"):
            return
        self.cm.check_integrity()
        for seq, _toks, comp in self.reqs.values():
            # pinned path never evicted: every pinned node is still in the tree
            for node in seq.nodes:
                assert node.parent is not None and node.parent.children.get(node.key) is node
            if seq.restore_node is not None:
                assert seq.restore_node.checkpoint_slot is not None
            assert len(seq.block_table) * 16 >= comp[0]


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(
    max_examples=300, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
