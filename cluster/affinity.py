"""Prefix-affinity scoring: which replica likely holds the longest *joint* prefix of a request.

Pure Python (no torch, no Ray): ``deltaserve.cluster.router`` wraps it in a Ray Serve
``RequestRouter``; tests drive it directly.

Keys
    A request's route keys are the engine's own radix-tree keys (``deltaserve.cache.hashing``:
    chained xxh3-128 block hashes, salt = model path + dtype + ``cache.namespace`` + the
    request's ``cache_salt``) taken at every checkpoint-unit boundary ``u, 2u, ... <= len - 1``
    (the engine's ``ModelInfo.checkpoint_unit``: the block, or lcm(block_size, 64) with
    ``cache.checkpoint_granularity = chunk``): the only places a hybrid hit can end. A key
    names its whole prefix, so "replica R holds key k" means R can resume the request at k's
    boundary. Keys travel as their top 64 bits (``short_key``): plenty to tell prefixes apart
    for routing, and half the bytes in the replicas' reports. Tenants with different
    ``cache_salt`` get different keys, so one tenant's prefix never attracts another's request.

Per-replica view (``ReplicaView``)
    * *reported*: what the replica said it holds in its last routing-stats report: the keys of
      its nodes with a checkpoint (joint-hit boundaries) and of its KV-only unit boundaries.
      Authoritative as of the report's timestamp: evictions show up as keys that disappeared.
    * *predicted*: what the router expects from requests it routed there since: every routed
      prompt's deepest unit key (the engine takes a *tail* checkpoint there) and its divergence
      point from the replica's known KV (a *branch* checkpoint), plus all its unit keys as KV.
      A prediction is dropped when a report taken after its request completed does not
      contain it (the engine skipped or evicted it), after ``prediction_ttl_s``, or by LRU.
    The joint match of a request on a replica is the deepest of its keys in checkpoint keys
    (reported or predicted); the KV match likewise over KV keys (KV alone saves nothing on a
    hybrid model now, but a request sent there leaves a branch checkpoint the next ones hit).

Decision (``AffinityPolicy.choose``), in the spirit of SGLang's cache-aware router:
    1. *imbalanced* (``max_load - min_load > balance_abs_threshold`` and
       ``max_load > balance_rel_threshold * min_load``): power of two choices.
    2. the best joint match covers at least ``cache_threshold`` of the prompt: rank replicas by
       estimated cost = uncached prompt tokens + load x ``load_cost_tokens`` (default learned:
       one mean uncached prompt per request in flight), KV match as the tie-breaker. The
       cheapest first; the Ray router takes the next rank when it is full.
    3. else the best KV match covers ``cache_threshold``: the least loaded among those with it.
    4. else power of two choices (a new conversation spreads the load).
"""

from __future__ import annotations

import random
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from deltaserve.cache.hashing import block_hashes

_MASK64 = (1 << 64) - 1


def short_key(h: int) -> int:
    """A 128-bit chained hash as the 64-bit key routing uses (its top half)."""
    return (h >> 64) & _MASK64


def route_keys(token_ids: Sequence[int], *, block_size: int, unit: int, salt: bytes) -> list[int]:
    """The 64-bit keys of ``token_ids`` at unit boundaries ``unit, 2*unit, ... <= len - 1``.

    The key at boundary ``b`` is the engine's radix key of the block ending at ``b`` (the
    chained hash names all of ``[0, b)``), so it equals what a replica reports for a node
    there. A hit must leave one prompt token to compute, hence ``<= len - 1``."""
    if unit % block_size:
        raise ValueError(f"unit {unit} is not a multiple of block_size {block_size}")
    n_units = (len(token_ids) - 1) // unit if token_ids else 0
    if n_units <= 0:
        return []
    per = unit // block_size
    hashes = block_hashes(token_ids[: n_units * unit], block_size, salt)
    return [short_key(hashes[(k + 1) * per - 1]) for k in range(n_units)]


@dataclass(frozen=True)
class RouteHint:
    """What the router needs of one request: computed once, at the ingress."""

    keys: tuple[int, ...]  # short keys at unit boundaries (route_keys)
    unit: int  # tokens per key
    num_tokens: int  # prompt length

    def tokens_at(self, depth: int) -> int:
        """Prompt tokens covered by the first ``depth`` keys."""
        return depth * self.unit


def pack_keys(keys: Iterable[int]) -> bytes:
    """Keys as little-endian uint64s (compact in a routing-stats report)."""
    return b"".join(k.to_bytes(8, "little") for k in keys)


def unpack_keys(data: bytes | Sequence[int] | None) -> set[int]:
    if not data:
        return set()
    if isinstance(data, (bytes, bytearray, memoryview)):
        b = bytes(data)
        return {int.from_bytes(b[i : i + 8], "little") for i in range(0, len(b) - len(b) % 8, 8)}
    return {int(k) for k in data}


# ============================================================================ per-replica view
@dataclass
class _Prediction:
    routed_at: float
    completed_at: float | None = None
    pending: int = 1  # routed requests that predicted it and have not completed


@dataclass
class ReplicaView:
    """What one replica likely holds (see the module docstring)."""

    # (sets from a report; with cache events, the subscriber's live key counts: ``on_events``)
    ckpt_reported: Collection[int] = field(default_factory=set)
    kv_reported: Collection[int] = field(default_factory=set)
    events: bool = False  # the keys come from the replica's cache events, not its reports
    ckpt_predicted: OrderedDict[int, _Prediction] = field(default_factory=OrderedDict)
    kv_predicted: OrderedDict[int, _Prediction] = field(default_factory=OrderedDict)
    report_seq: Any = None
    report_time: float | None = None
    reported_load: int | None = None  # running + waiting in the engine at the last report
    reports: int = 0
    stats: dict[str, Any] = field(default_factory=dict)

    def has_ckpt(self, key: int) -> bool:
        return key in self.ckpt_reported or key in self.ckpt_predicted

    def has_kv(self, key: int) -> bool:
        return key in self.kv_reported or key in self.kv_predicted or self.has_ckpt(key)

    def depth(self, keys: Sequence[int], kv: bool = False) -> int:
        """How many leading keys the replica holds: the deepest key held (chained keys: holding
        key i means holding the prefix it names)."""
        has = self.has_kv if kv else self.has_ckpt
        for i in range(len(keys) - 1, -1, -1):
            if has(keys[i]):
                return i + 1
        return 0


@dataclass(frozen=True)
class Decision:
    """A routing decision: ``ranks`` of replica ids, most preferred first (None: power of two
    choices), why, and the joint-hit tokens the first choice is expected to serve."""

    ranks: list[list[Hashable]] | None
    reason: str  # "joint" | "kv" | "miss" | "imbalanced" | "no-keys"
    expected_hit_tokens: int = 0


@dataclass
class AffinityPolicy:
    """Thresholds of the decision (module docstring)."""

    #: joint (or KV) match / prompt tokens needed to route by affinity (SGLang's cache_threshold)
    cache_threshold: float = 0.5
    #: load difference (requests on the replica) beyond which load alone decides ...
    balance_abs_threshold: int = 8
    #: ... when the busiest also has more than this times the least busy's load
    balance_rel_threshold: float = 1.5
    #: cost of one request in flight on a replica, in uncached prompt tokens; 0 (default):
    #: learned, the mean uncached tokens of routed requests (at least 64). A small constant
    #: (16) maximises stickiness but lets a shared system prompt pull every new conversation
    #: onto the replica that first held it (measured: 65 of 67 requests on one replica).
    load_cost_tokens: float = 0.0
    #: KV-only affinity (future branch checkpoints) when no joint match qualifies
    kv_affinity: bool = True

    def __post_init__(self) -> None:
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1.0 or self.load_cost_tokens < 0:
            raise ValueError("balance_abs_threshold >= 0, balance_rel_threshold >= 1, load_cost_tokens >= 0")

    def imbalanced(self, loads: Iterable[int]) -> bool:
        ls = list(loads)
        if len(ls) < 2:
            return False
        hi, lo = max(ls), min(ls)
        return hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo


# ============================================================================ the index
class AffinityIndex:
    """Per-replica views plus the decision; thread-safe (one lock, short critical sections).

    ``replica`` ids are any hashable (the Ray router uses ``ReplicaID``); ``request`` ids
    likewise (Ray's internal request id)."""

    def __init__(
        self,
        policy: AffinityPolicy | None = None,
        *,
        max_predicted_keys: int = 65536,
        prediction_ttl_s: float = 600.0,
        report_margin_s: float = 1.0,
        clock: Callable[[], float] = time.time,
        rng: random.Random | None = None,
    ) -> None:
        self.policy = policy or AffinityPolicy()
        self.max_predicted_keys = max_predicted_keys
        self.prediction_ttl_s = prediction_ttl_s
        self.report_margin_s = report_margin_s
        self.clock = clock
        self.rng = rng or random.Random()
        self.views: dict[Hashable, ReplicaView] = {}
        # request -> (replica, ckpt keys predicted, kv keys predicted)
        self._inflight: dict[Hashable, tuple[Hashable, list[int], list[int]]] = {}
        self._lock = threading.Lock()
        self._uncached_ema: float | None = None
        self.counters = {
            "decisions.joint": 0,
            "decisions.kv": 0,
            "decisions.miss": 0,
            "decisions.imbalanced": 0,
            "decisions.no-keys": 0,
            "predictions.dropped_by_report": 0,
            "predictions.expired": 0,
            "replicas.forgotten": 0,
        }

    # ------------------------------------------------------------------ membership
    def set_replicas(self, replica_ids: Iterable[Hashable]) -> None:
        """The live replicas: new ones get an empty view, gone ones are forgotten."""
        live = set(replica_ids)
        with self._lock:
            for rid in live - set(self.views):
                self.views[rid] = ReplicaView()
            for rid in set(self.views) - live:
                self._forget_locked(rid)

    def forget(self, replica_id: Hashable) -> None:
        """A replica died: drop everything known about it (its cache died with it)."""
        with self._lock:
            self._forget_locked(replica_id)

    def _forget_locked(self, rid: Hashable) -> None:
        if self.views.pop(rid, None) is not None:
            self.counters["replicas.forgotten"] += 1
        for req in [q for q, (r, _, _) in self._inflight.items() if r == rid]:
            del self._inflight[req]

    # ------------------------------------------------------------------ events
    def on_routed(self, replica_id: Hashable, request_id: Hashable, hint: RouteHint) -> None:
        """A request was sent to a replica: predict the checkpoints and KV it will leave there."""
        now = self.clock()
        with self._lock:
            view = self.views.setdefault(replica_id, ReplicaView())
            keys = list(hint.keys)
            ckpt: list[int] = []
            if keys:
                ckpt.append(keys[-1])  # tail checkpoint
                joint, kv = view.depth(keys), view.depth(keys, kv=True)
                if joint < kv < len(keys):
                    ckpt.append(keys[kv - 1])  # branch checkpoint at the divergence
            for k in ckpt:
                self._predict(view.ckpt_predicted, k, now)
            for k in keys:
                self._predict(view.kv_predicted, k, now)
            self._inflight[request_id] = (replica_id, ckpt, keys)
            uncached = hint.num_tokens - hint.tokens_at(view.depth(keys))
            ema = self._uncached_ema
            self._uncached_ema = float(uncached) if ema is None else 0.9 * ema + 0.1 * uncached

    def _predict(self, table: OrderedDict[int, _Prediction], key: int, now: float) -> None:
        p = table.get(key)
        if p is None:
            table[key] = _Prediction(routed_at=now)
            while len(table) > self.max_predicted_keys:
                table.popitem(last=False)
        else:
            p.routed_at, p.completed_at = now, None
            p.pending += 1
            table.move_to_end(key)

    def on_completed(self, replica_id: Hashable, request_id: Hashable) -> None:
        """A routed request finished (any outcome): its predictions can now be checked."""
        now = self.clock()
        with self._lock:
            entry = self._inflight.pop(request_id, None)
            view = self.views.get(replica_id)
            if entry is None or view is None:
                return
            _, ckpt, kv = entry
            for table, keys in ((view.ckpt_predicted, ckpt), (view.kv_predicted, kv)):
                for k in keys:
                    p = table.get(k)
                    if p is not None:
                        p.pending = max(0, p.pending - 1)
                        if p.pending == 0:
                            p.completed_at = now

    def on_report(self, replica_id: Hashable, report: Mapping[str, Any] | None) -> bool:
        """Ingest a replica's routing-stats report (``EngineReplica.record_routing_stats``);
        False if there was nothing new."""
        if not report or "seq" not in report:
            return False
        with self._lock:
            view = self.views.get(replica_id)
            if view is None or view.report_seq == (report.get("epoch"), report["seq"]):
                return False
            view.report_seq = (report.get("epoch"), report["seq"])
            view.reports += 1
            taken = float(report.get("time", self.clock()))
            view.report_time = taken
            view.reported_load = int(report.get("running", 0)) + int(report.get("waiting", 0))
            view.stats = dict(report.get("stats") or {})
            if "ckpt_keys" in report and not view.events:  # (no keys: it cannot read its cache)
                view.ckpt_reported = unpack_keys(report.get("ckpt_keys"))
                view.kv_reported = unpack_keys(report.get("kv_keys"))
            self._prune(view, taken)
            return True

    def on_events(self, replica_id: Hashable, ckpt_keys: Collection[int], kv_keys: Collection[int]) -> None:
        """The replica's cache as its event stream rebuilt it (``cluster/kv_feed.py``), current
        as of now: it replaces the reported keys (later reports' keys are ignored until
        ``events_lost``) and checks the predictions of completed requests against it. The
        collections are read, not copied: the feed keeps them up to date."""
        with self._lock:
            view = self.views.get(replica_id)
            if view is None:
                return
            view.events = True
            view.ckpt_reported, view.kv_reported = ckpt_keys, kv_keys
            self._prune(view, self.clock())

    def events_lost(self, replica_id: Hashable) -> None:
        """The replica's event stream cannot be trusted (a gap no replay filled, a subscriber
        not caught up yet): back to its polled reports, from the next one."""
        with self._lock:
            view = self.views.get(replica_id)
            if view is not None and view.events:
                view.events = False
                view.ckpt_reported, view.kv_reported = set(), set()
                view.report_seq = None  # the last report's keys apply again when it is re-read

    def _prune(self, view: ReplicaView, taken: float) -> None:
        """Drop predictions a report proves wrong, and stale ones."""
        now = self.clock()
        for table, reported in (
            (view.ckpt_predicted, view.ckpt_reported),
            (view.kv_predicted, view.kv_reported),
        ):
            for k in list(table):
                p = table[k]
                if p.completed_at is not None and p.completed_at + self.report_margin_s < taken:
                    # the report was taken after the request finished: the truth is in it
                    del table[k]
                    if k not in reported and not (table is view.kv_predicted and k in view.ckpt_reported):
                        self.counters["predictions.dropped_by_report"] += 1
                elif p.pending == 0 and now - p.routed_at > self.prediction_ttl_s:
                    del table[k]
                    self.counters["predictions.expired"] += 1

    # ------------------------------------------------------------------ queries
    def match(self, replica_id: Hashable, hint: RouteHint) -> tuple[int, int]:
        """(joint-hit tokens, KV-match tokens) the replica likely holds for this request."""
        with self._lock:
            view = self.views.get(replica_id)
            if view is None:
                return 0, 0
            return hint.tokens_at(view.depth(list(hint.keys))), hint.tokens_at(
                view.depth(list(hint.keys), kv=True)
            )

    def load_cost_tokens(self) -> float:
        if self.policy.load_cost_tokens > 0:
            return self.policy.load_cost_tokens
        return max(self._uncached_ema or 0.0, 64.0)

    def choose(self, hint: RouteHint | None, loads: Mapping[Hashable, int]) -> Decision:
        """Rank the replicas in ``loads`` (id -> requests in flight there) for this request."""
        candidates = list(loads)
        if not candidates:
            return Decision(None, "no-keys")
        pol = self.policy
        if hint is None or not hint.keys or hint.num_tokens <= 0:
            return self._count(Decision(None, "no-keys"))
        if pol.imbalanced(loads.values()):
            return self._count(Decision(None, "imbalanced"))
        keys = list(hint.keys)
        with self._lock:
            views = {rid: self.views.get(rid) or ReplicaView() for rid in candidates}
            joint = {rid: hint.tokens_at(v.depth(keys)) for rid, v in views.items()}
            kv = {rid: hint.tokens_at(v.depth(keys, kv=True)) for rid, v in views.items()}
        best_joint = max(joint.values())
        if best_joint >= pol.cache_threshold * hint.num_tokens and best_joint > 0:
            per_load = self.load_cost_tokens()
            tie = self.rng.random

            def cost(rid: Hashable) -> tuple[float, int, float]:
                return (hint.num_tokens - joint[rid] + loads[rid] * per_load, -kv[rid], tie())

            order = sorted(candidates, key=cost)
            ranks = [[rid] for rid in order]
            return self._count(Decision(ranks, "joint", joint[order[0]]))
        best_kv = max(kv.values())
        if pol.kv_affinity and best_kv > 0 and best_kv >= pol.cache_threshold * hint.num_tokens:
            holders = [rid for rid in candidates if kv[rid] == best_kv]
            others = [rid for rid in candidates if kv[rid] != best_kv]
            holders.sort(key=lambda r: (loads[r], self.rng.random()))
            others.sort(key=lambda r: (loads[r], self.rng.random()))
            ranks = [[rid] for rid in holders] + ([others] if others else [])
            return self._count(Decision(ranks, "kv", joint[holders[0]]))
        return self._count(Decision(None, "miss"))

    def _count(self, d: Decision) -> Decision:
        with self._lock:
            self.counters[f"decisions.{d.reason}"] += 1
        return d

    def pow2(self, candidates: Sequence[Hashable]) -> list[list[Hashable]]:
        """Power of two choices: two random replicas in one rank (the Ray router takes the less
        loaded of them)."""
        if len(candidates) <= 2:
            pair = list(candidates)
            self.rng.shuffle(pair)
            return [pair]
        return [self.rng.sample(list(candidates), 2)]

    # ------------------------------------------------------------------ introspection
    def summary(self, name: Callable[[Hashable], str] = str) -> dict[str, Any]:
        """A JSON-able snapshot (``GET /cluster/status``); ``name`` renders replica ids."""
        with self._lock:
            return {
                "replicas": {
                    name(rid): {
                        "ckpt_reported": len(v.ckpt_reported),
                        "kv_reported": len(v.kv_reported),
                        "ckpt_predicted": len(v.ckpt_predicted),
                        "kv_predicted": len(v.kv_predicted),
                        "reports": v.reports,
                        "reported_load": v.reported_load,
                        "keys_from": "events" if v.events else "reports",
                    }
                    for rid, v in self.views.items()
                },
                "inflight": len(self._inflight),
                "load_cost_tokens": self.load_cost_tokens() if self.views else None,
                "counters": dict(self.counters),
            }

    def replica_stats(self) -> dict[Hashable, dict[str, Any]]:
        """The engine stats each live replica sent with its last report."""
        with self._lock:
            return {rid: dict(v.stats) for rid, v in self.views.items() if v.stats}
