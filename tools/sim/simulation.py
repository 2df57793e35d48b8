"""The cache-policy simulation: one workload replayed through the engine's own torch-free
``Scheduler`` and ``CacheManager`` under one checkpoint admission policy, on a virtual clock.

Only the model is replaced: every scheduled step "samples" the next token of a deterministic
synthetic reply of the requested length (``workloads.synthetic_reply``), and the clock advances
``step_s`` + ``token_s`` per computed token (+ host copies over ``h2d_gbps``) per step, which
sets arrivals, think times and concurrency. With a disk tier (``disk_bytes``; ``tools/sim/disk.py``)
a hit that extends to disk waits for its read (bytes over ``disk_read_gbps``, one reader)
while the others run, then loads like a host hit; the runner's disk saves land in the
in-memory store at once and add no step time (a writer thread), bounded by the write rate.
Deterministic: equal inputs give equal results (``wall_s`` aside). Never imports torch.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from deltaserve.cache.admission import ADMISSION_POLICIES
from deltaserve.cache.arena import PageUse, blocks_per_page
from deltaserve.cache.eviction import CheckpointEviction
from deltaserve.cache.loss import MISS_CAUSES, MISS_PREFIX
from deltaserve.cache.manager import checkpoint_unit
from deltaserve.cache.radix_tree import Node
from deltaserve.cache.types import CaptureKind, TransferKind
from deltaserve.cache.v1_eviction import V1Eviction, V1State
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.core.sizing import Capacity, build_scheduler
from deltaserve.scheduler import Request
from deltaserve.tools.metrics import RequestRecord, hit_rate, hit_rate_per_turn
from deltaserve.tools.sim.disk import SimDiskTier, SimStore
from deltaserve.tools.workloads import (
    ArrivalParams,
    RequestSpec,
    Workload,
    expand,
    plan_arrivals,
    synthetic_reply,
)

MiB = 1024**2
GiB = 1024**3
DEFAULT_CHECKPOINT_SLOTS = 16


@dataclass
class SimConfig:
    """Pool sizes of a simulated model, and the engine config every other setting comes from
    (block size, checkpoint interval and staging, scheduler policy and limits): the simulator
    builds its scheduler with the engine's own ``build_scheduler``."""

    kv_blocks: int = 4096
    checkpoint_slots: int = DEFAULT_CHECKPOINT_SLOTS
    checkpoint_bytes: int = 50 * MiB
    kv_bytes_per_token: int = 32 * 1024
    engine: EngineConfig = field(default_factory=EngineConfig)
    step_s: float = 0.015  # virtual seconds per step ...
    token_s: float = 0.0002  # ... plus per computed token
    check_integrity: bool = False
    #: value model's prefill cost (per token, per token pair); None: CacheManagerConfig's defaults
    prefill_cost: tuple[float, float] | None = None
    model: str = "Qwen3.5-4B-like (default sizes)"
    host_kv_blocks: int = 0  # host tier (0 = off)
    host_checkpoint_slots: int = 0
    #: one host budget for KV and checkpoints (pages of one checkpoint's size; 0 = the fixed pair)
    host_memory_bytes: int = 0
    h2d_gbps: float = 50.0  # host <-> device copy bandwidth, GB/s (PCIe 5 x16, effective)
    #: one device budget for KV and checkpoints (pages, ``cache/arena.py``); None: the fixed
    #: pools above (with it, ``kv_blocks`` / ``checkpoint_slots`` are what each kind could take)
    memory_bytes: int | None = None
    disk_bytes: int = 0  # disk tier capacity (0 = off)
    disk_read_gbps: float = 2.0  # GB/s read by the disk tier's one reader: one NVMe SSD
    #: the disk tier's write budget (write-through and write-back), MB/s: half an NVMe's
    #: sustained write bandwidth, the rest left to reads
    disk_write_mbps: float = 1000.0

    @property
    def page_blocks(self) -> int:
        """KV blocks per page: one checkpoint's bytes, rounded up to whole blocks."""
        block_bytes = self.block_size * self.kv_bytes_per_token
        return blocks_per_page(self.checkpoint_bytes, block_bytes)

    @property
    def num_pages(self) -> int:
        if self.memory_bytes is None:
            return 0
        return self.memory_bytes // (self.page_blocks * self.block_size * self.kv_bytes_per_token)

    @property
    def block_size(self) -> int:
        return self.engine.cache.block_size

    @property
    def unit(self) -> int:
        """Tokens between two boundaries a hit or a tail / branch / output capture may sit on."""
        return checkpoint_unit(self.block_size, granularity=self.engine.cache.checkpoint_granularity)

    @property
    def checkpoint_interval(self) -> int:
        return self.engine.cache.checkpoint_interval

    @property
    def max_num_seqs(self) -> int:
        return self.engine.scheduler.max_num_seqs

    def capacity(self, kv_blocks: int, checkpoint_slots: int, *, shared: bool = False) -> Capacity:
        """The engine's ``Capacity`` for these pool sizes (the model's maximum length is
        unbounded); ``shared``: one budget of ``num_pages`` pages instead."""
        if shared and self.num_pages:
            pages, n = self.num_pages, self.page_blocks
            kv_blocks, checkpoint_slots = pages * n, pages
        budget = (
            self.memory_bytes
            if shared and self.memory_bytes is not None
            else kv_blocks * self.block_size * self.kv_bytes_per_token
            + checkpoint_slots * self.checkpoint_bytes
        )
        return Capacity(
            num_pages=self.num_pages if shared else 0,
            page_blocks=self.page_blocks if shared else 0,
            budget_bytes=budget + self.max_num_seqs * self.checkpoint_bytes,
            block_size=self.block_size,
            num_kv_blocks=kv_blocks,
            kv_block_bytes=self.block_size * self.kv_bytes_per_token,
            num_live_slots=self.max_num_seqs,
            num_checkpoint_slots=checkpoint_slots,
            state_bytes=self.checkpoint_bytes,
            max_model_len=kv_blocks * self.block_size,
            model_max_len=1 << 30,
            max_num_seqs=self.max_num_seqs,
            num_host_kv_blocks=self.host_kv_blocks,
            num_host_checkpoint_slots=self.host_checkpoint_slots,
            num_host_pages=self.host_pages,
        )

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k != "engine"}
        out["engine"] = self.engine.to_dict()
        return out

    @property
    def kv_bytes(self) -> int:
        return self.kv_blocks * self.block_size * self.kv_bytes_per_token

    @property
    def checkpoint_pool_bytes(self) -> int:
        return self.checkpoint_slots * self.checkpoint_bytes

    @property
    def host_pages(self) -> int:
        """Host pages of one checkpoint's size (``host_memory_bytes``; 0: the fixed pair)."""
        return self.host_memory_bytes // self.checkpoint_bytes

    @property
    def host_bytes(self) -> int:
        """The host tier's bytes, either way it is given."""
        block_bytes = self.block_size * self.kv_bytes_per_token
        if self.host_pages:
            return self.host_pages * self.checkpoint_bytes
        return self.host_kv_blocks * block_bytes + self.host_checkpoint_slots * self.checkpoint_bytes

    @property
    def device_bytes(self) -> int:
        """The device's cache bytes, KV and checkpoints. One device budget (``memory_bytes``)
        counts once: its ``kv_blocks`` and ``checkpoint_slots`` each describe the whole budget
        (for the device-only bounds)."""
        return (
            self.memory_bytes if self.memory_bytes is not None else self.kv_bytes + self.checkpoint_pool_bytes
        )

    @property
    def combined_kv_blocks(self) -> int:
        """Every byte of both memory tiers, KV and checkpoints, as KV blocks (the host tier's bound)."""
        return (self.device_bytes + self.host_bytes) // (self.block_size * self.kv_bytes_per_token)

    @property
    def all_tiers_kv_blocks(self) -> int:
        """Every byte of every tier, the disk's too, as KV blocks (the disk tier's bound)."""
        return self.combined_kv_blocks + self.disk_bytes // (self.block_size * self.kv_bytes_per_token)


@dataclass
class SimResult:
    workload: str
    policy: str
    admission: str
    kv_blocks: int
    checkpoint_slots: int
    checkpoint_mb: float
    kv_mb: float
    requests: int
    rejected: int
    prompt_tokens: int
    hit_tokens: int
    hit_rate: float
    hit_rate_per_turn: dict[str, float]
    checkpoints_stored: int
    checkpoints_skipped_budget: int
    checkpoints_skipped_pool: int
    checkpoints_skipped_value: int
    checkpoints_evicted: int
    kv_evicted_blocks: int
    hit_tokens_host: int
    host_bytes_moved: int
    preemptions: int
    steps: int
    tokens_computed: int
    sim_time_s: float
    wall_s: float
    oracle_ratio: float | None = None
    #: one budget: mean share of its pages holding checkpoints over the steps (None: fixed pools)
    checkpoint_share: float | None = None
    hit_tokens_disk: int = 0  # prompt tokens of hits read from the disk tier
    disk_bytes_read: int = 0
    disk_bytes_written: int = 0
    disk_fetches: int = 0  # hits read from disk (each one request's wait)
    disk_read_wait_s: float = 0.0  # simulated seconds requests waited for their reads, summed
    disk_evicted_items: int = 0
    disk_saves_skipped_rate: int = 0  # writes the rate left out
    #: the cache's own counts (``cache/loss.py``): prompt tokens looked up and served at first
    #: admission, and the misses by cause (``MISS_CAUSES``); the causes but ``preemption`` sum
    #: to ``query_tokens - query_hit_tokens``
    query_tokens: int = 0
    query_hit_tokens: int = 0
    miss_tokens: dict[str, int] = field(default_factory=dict)
    #: (prompt ids, reply ids) in submission order (for the offline bounds; not serialized)
    served: list[tuple[list[int], list[int]]] = field(default_factory=list, repr=False)

    def to_dict(self) -> dict[str, Any]:
        # (``served`` emptied first: ``asdict`` would deep-copy every prompt of it)
        out = asdict(replace(self, served=[]))
        del out["served"]
        return out


def oracle_sizes(workload: Workload, cfg: SimConfig) -> tuple[int, int]:
    """KV blocks and checkpoint slots that can never run out for this workload."""
    total = 0
    n = 0
    for spec, _ in expand(workload):
        total += len(spec.prompt_ids) + spec.max_tokens
        n += 1
    unit = cfg.unit
    blocks = total // cfg.block_size + 2 * n + 16
    slots = total // unit + 2 * n + cfg.max_num_seqs + 16
    return blocks, slots


def _unlimited_eviction(eviction: CheckpointEviction) -> None:
    """The oracle's checkpoint eviction, which its pools never call on (``oracle_sizes``):
    ``v1``'s bookkeeping at every attach (demoting the checkpoints up the unforked chain above,
    quadratic in a prompt's blocks when every unit is captured) only orders victims, so it is
    skipped; a victim asked for anyway raises, so the shortcut can never change a result."""
    if not isinstance(eviction, V1Eviction):
        return

    def on_attach(node: Node, kind: CaptureKind, history: int | None = None) -> None:
        node.policy_state = V1State(0, kind is CaptureKind.BRANCH)

    def victim(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the oracle's checkpoint pool ran out (oracle_sizes is too small)")

    eviction.on_attach = on_attach  # type: ignore[method-assign]
    eviction.victim = victim  # type: ignore[method-assign]


class Simulation:
    """One replay of a workload through ``Scheduler`` + ``CacheManager`` under one policy.

    Holds the virtual clock, the heap of requests due ``(due, tie, spec, tree)``, the live
    requests with their synthetic replies, and per tree (a root and every follow-up of it) the
    requests not yet finished: in a closed loop a tree holds its concurrency slot until its
    last request finishes. ``run()`` steps the scheduler until no request is due or live.
    """

    def __init__(self, workload: Workload, policy: str, cfg: SimConfig, arrival: ArrivalParams) -> None:
        self.t_wall = time.perf_counter()
        oracle = policy == "oracle"
        admission = "every-unit" if oracle else policy
        if admission not in ADMISSION_POLICIES:
            raise ValueError(
                f"unknown policy {policy!r}; known: oracle, {', '.join(sorted(ADMISSION_POLICIES))}"
            )
        kv_blocks, slots, engine = cfg.kv_blocks, cfg.checkpoint_slots, cfg.engine
        if oracle:
            kv_blocks, slots = oracle_sizes(workload, cfg)
            engine = engine.replace(**{"cache.checkpoint_staging_bytes": None})
            cfg = replace(cfg, host_kv_blocks=0, host_checkpoint_slots=0, host_memory_bytes=0, disk_bytes=0)
        engine = engine.replace(**{"cache.enable_prefix_caching": True})
        self.workload, self.policy, self.admission, self.cfg = workload, policy, admission, cfg
        self.arrival = arrival
        self.kv_blocks, self.slots = kv_blocks, slots
        shared = cfg.memory_bytes is not None and not oracle
        self.sched = build_scheduler(
            engine, cfg.capacity(kv_blocks, slots, shared=shared), checkpoint_policy=admission
        )
        self.cache = self.sched.cache
        # every eviction remembered: a forgotten one would count as cold, and cold is read
        # against the bounds' compulsory misses
        self.cache.loss.remember_all()
        if oracle:
            _unlimited_eviction(self.cache.eviction)
        if cfg.prefill_cost is not None:
            self.cache.set_prefill_cost(*cfg.prefill_cost)
        self.clock = 0.0
        self.disk = self._disk_tier() if cfg.disk_bytes else None
        self._order = itertools.count()
        self.events: list[tuple[float, int, RequestSpec, str]] = []  # (due, tie, spec, tree)
        self.live: dict[str, tuple[Request, RequestSpec, list[int], str]] = {}
        self.tree_left: dict[str, int] = {}
        self.pending_roots: deque[RequestSpec] = deque()
        self.active_trees = 0
        self.concurrency: int | None = None
        self.finished: list[tuple[RequestSpec, int]] = []  # (spec, cached tokens)
        self.served: list[tuple[list[int], list[int]]] = []  # (prompt, reply) in submission order
        self.rejected = 0
        self.steps = 0
        self.tokens = 0
        self.checkpoint_pages = 0  # summed over steps (one budget)

    def _disk_tier(self) -> SimDiskTier:
        cfg, cache = self.cfg, self.cache
        block_bytes = cfg.block_size * cfg.kv_bytes_per_token
        store = SimStore(cfg.disk_bytes, kv_block_bytes=block_bytes, checkpoint_bytes=cfg.checkpoint_bytes)
        disk = SimDiskTier(
            store,
            read_bytes_per_s=cfg.disk_read_gbps * 1e9,
            clock=lambda: self.clock,
            block_size=cfg.block_size,
            unit_blocks=cache.unit // cfg.block_size,
            kv_block_bytes=block_bytes,
            checkpoint_bytes=cfg.checkpoint_bytes,
            write_bytes_per_s=cfg.disk_write_mbps * 1e6,
        )
        cache.attach_disk(disk)
        return disk

    def run(self) -> SimResult:
        self._arrivals()
        while True:
            if self.disk is not None:
                self.disk.reader.advance(self.clock)  # the reads done by now
            while self.events and self.events[0][0] <= self.clock:
                due, _, spec, tree = heapq.heappop(self.events)
                self._submit(spec, due, tree)
            if self.sched.has_work():
                self._step()
            elif self.events:
                self.clock = max(self.clock, self.events[0][0])
            else:
                break
        assert not self.live and not self.tree_left, "simulation ended with requests in flight"
        if self.disk is not None:
            self.disk.close()
        return self._result()

    # ---------------------------------------------------------------- arrivals
    def _arrivals(self) -> None:
        """Roots at their planned times (open loop, trace) or as trees finish (closed loop)."""
        workload = self.workload
        roots = workload.roots()
        plan = plan_arrivals(
            roots, self.arrival, workload.seed, default_concurrency=workload.default_concurrency
        )
        self.concurrency = plan["concurrency"] if plan["mode"] == "closed" else None
        if self.concurrency is not None:
            self.pending_roots.extend(roots)
            self._launch_roots()
        else:
            for root, t in zip(roots, plan["times"], strict=True):
                self.tree_left[root.rid] = 1
                self.active_trees += 1
                self._push(root, t, root.rid)

    def _push(self, spec: RequestSpec, due: float, tree: str) -> None:
        heapq.heappush(self.events, (due, next(self._order), spec, tree))

    def _launch_roots(self) -> None:
        while self.pending_roots and (self.concurrency is None or self.active_trees < self.concurrency):
            root = self.pending_roots.popleft()
            self.active_trees += 1
            self.tree_left[root.rid] = 1
            self._push(root, self.clock, root.rid)

    def _tree_done(self, tree: str, children: int) -> None:
        """One request of ``tree`` finished with ``children`` follow-ups."""
        self.tree_left[tree] += children - 1
        if self.tree_left[tree] == 0:
            del self.tree_left[tree]
            self.active_trees -= 1
            self._launch_roots()

    def _submit(self, spec: RequestSpec, due: float, tree: str) -> None:
        if not self.cache.can_ever_fit(len(spec.prompt_ids) + spec.max_tokens):
            self.rejected += 1
            self._tree_done(tree, 0)
            return
        req = Request(request_id=spec.rid, prompt_token_ids=list(spec.prompt_ids), sampling_params=None)
        req.arrival_time = due
        reply = synthetic_reply(self.workload, spec)
        self.live[spec.rid] = (req, spec, reply, tree)
        self.served.append((spec.prompt_ids, reply))
        self.sched.add(req)

    # ---------------------------------------------------------------- steps
    def _step(self) -> None:
        """One scheduler step: sample each sampling sequence's next reply token, advance the
        clock by the step's cost, finish the requests whose replies are complete."""
        sched, cache, cfg = self.sched, self.cache, self.cfg
        out = sched.schedule()
        if out is None:
            self._idle()
            return
        sampled: list[int | None] = []
        for s in out.seqs:
            if s.samples:
                req = s.request
                sampled.append(self.live[req.request_id][2][req.num_output_tokens])
            else:
                sampled.append(None)
        # a disk load copies its buffer (read before admission) like a host load
        moved = sum(
            t.nbytes_hint if t.kind.from_disk else cache.host.nbytes(t.kind)
            for t in out.plan.saves + out.plan.loads
            if t.kind is not TransferKind.KV_MOVE  # (within the host: not over the link)
        )
        if self.disk is not None:  # the writer's puts, at once (the write rate paced their plan)
            for s in out.plan.disk_saves:
                self.disk.sim_store.put(s.kind, s.key, s.parent, b"", s.cost)
        sched.update(out, sampled)
        self.steps += 1
        self.tokens += out.num_tokens
        if cache.budget is not None:
            self.checkpoint_pages += cache.budget.arena.counts[PageUse.CHECKPOINT]
        # copies between tiers cost their bytes over the link, serially (a conservative
        # model: on a GPU the loads overlap the forward)
        self.clock += cfg.step_s + cfg.token_s * out.num_tokens + moved / (cfg.h2d_gbps * 1e9)
        for s, tok in zip(out.seqs, sampled, strict=True):
            req = s.request
            if tok is not None and req.num_output_tokens >= self.live[req.request_id][1].max_tokens:
                sched.finish(req, "length")
                self._complete(req)
        if cfg.check_integrity:
            sched.check_integrity()
            if self.disk is not None:
                self.disk.sim_store.check_integrity()

    def _idle(self) -> None:
        """Nothing to run this step: with nothing running, jump to the next arrival or disk read
        done; else a step's time passes."""
        if self.sched.running:
            self.clock += self.cfg.step_s
            return
        wake = [self.events[0][0]] if self.events else []
        if self.disk is not None and self.disk.reader.next_due is not None:
            wake.append(self.disk.reader.next_due)
        if not wake:
            raise RuntimeError(
                f"simulator stuck: {self.sched.num_waiting} waiting requests cannot be admitted"
            )
        self.clock = max(self.clock, min(wake))

    def _complete(self, req: Request) -> None:
        _, spec, reply, tree = self.live.pop(req.request_id)
        self.finished.append((spec, max(req.num_cached_tokens, 0)))
        children = self.workload.follow_ups(spec, reply)
        for child in children:
            self._push(child, self.clock + child.delay_s, tree)
        self._tree_done(tree, len(children))

    # ---------------------------------------------------------------- result
    def _result(self) -> SimResult:
        cfg, c = self.cfg, self.cache.counters
        records = [
            RequestRecord(rid=s.rid, turn=s.turn, num_prompt_tokens=len(s.prompt_ids), num_cached_tokens=h)
            for s, h in self.finished
        ]
        return SimResult(
            workload=self.workload.name,
            policy=self.policy,
            admission=self.admission,
            kv_blocks=self.kv_blocks,
            checkpoint_slots=self.slots,
            checkpoint_mb=self.slots * cfg.checkpoint_bytes / MiB,
            kv_mb=self.kv_blocks * cfg.block_size * cfg.kv_bytes_per_token / MiB,
            requests=len(self.finished),
            rejected=self.rejected,
            prompt_tokens=sum(r.num_prompt_tokens for r in records),
            hit_tokens=sum(r.num_cached_tokens for r in records),
            hit_rate=hit_rate(records),
            hit_rate_per_turn={str(t): v for t, v in hit_rate_per_turn(records).items()},
            checkpoints_stored=c["checkpoints.stored"],
            checkpoints_skipped_budget=c["checkpoints.skipped_budget"],
            checkpoints_skipped_pool=c["checkpoints.skipped_pool"],
            checkpoints_skipped_value=c["checkpoints.skipped_value"],
            checkpoints_evicted=c["checkpoints.evicted"],
            kv_evicted_blocks=c["kv.evicted_blocks"],
            hit_tokens_host=c["prefix_cache.hit_tokens_host"],
            host_bytes_moved=c["host.bytes_saved"] + c["host.bytes_loaded"],
            preemptions=self.sched.num_preemptions,
            steps=self.steps,
            tokens_computed=self.tokens,
            sim_time_s=self.clock,
            wall_s=time.perf_counter() - self.t_wall,
            **self._disk_result(),
            query_tokens=c["prefix_cache.query_tokens"],
            query_hit_tokens=c["prefix_cache.hit_tokens"],
            miss_tokens={cause: c[MISS_PREFIX + cause] for cause in MISS_CAUSES},
            checkpoint_share=(
                self.checkpoint_pages / (self.steps * budget.arena.num_pages)
                if (budget := self.cache.budget) is not None and self.steps
                else None
            ),
            served=self.served,
        )

    def _disk_result(self) -> dict[str, Any]:
        if self.disk is None:
            return {}
        c, d = self.cache.counters, self.disk.stats()
        return {
            "hit_tokens_disk": c["prefix_cache.hit_tokens_disk"],
            "disk_bytes_read": int(d["disk.bytes_read"]),
            "disk_bytes_written": int(d["disk.bytes_written"]),
            "disk_fetches": int(d["disk.fetches"]),
            "disk_read_wait_s": d["disk.read_wait_ms"] / 1000,
            "disk_evicted_items": int(d["disk.evicted_items"]),
            "disk_saves_skipped_rate": int(d["disk.saves_skipped_rate"]),
        }


def simulate(workload: Workload, policy: str, cfg: SimConfig, arrival: ArrivalParams) -> SimResult:
    """Replay ``workload`` through ``Scheduler`` + ``CacheManager`` with ``policy``."""
    return Simulation(workload, policy, cfg, arrival).run()


def compare_policies(
    workload: Workload, policies: Sequence[str], cfg: SimConfig, arrival: ArrivalParams
) -> list[SimResult]:
    """Every policy on the same workload; ``oracle_ratio`` filled when oracle is among them."""
    results = [simulate(workload, p, cfg, arrival) for p in policies]
    oracle = next((r for r in results if r.policy == "oracle"), None)
    for r in results:
        if oracle is not None:
            r.oracle_ratio = r.hit_rate / oracle.hit_rate if oracle.hit_rate > 0 else None
    return results
