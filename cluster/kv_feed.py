"""The router's cache events: one subscriber per replica feeding the affinity index.

A replica whose engine publishes cache events (``[kv_events]``) says where in its routing-stats
report (``"kv_events": {"endpoint", "replay_endpoint", "topic"}``, connectable addresses:
``cluster/replica.py``). ``EventFeeds.on_report`` opens a ``KVEventSubscriber``
(``cluster/kv_index.py``) for it, asking the replay socket for everything from sequence 0 (a
router that starts after the replica gets the replay buffer, or, when that no longer reaches
back to 0, the full resync the engine then publishes). ``refresh`` (the router, before each
decision) reads what arrived, without waiting, and hands ``AffinityIndex.on_events`` the
replica's live key counts (every medium: device, host, disk and remote all serve hits), so the
router's view of that replica is its cache as of the last event instead of the last report.

Fallback: a replica that publishes no events, a subscriber not caught up yet, or a stream with
a gap no replay filled (stale until a resync) is routed on its polled reports
(``AffinityIndex.events_lost``), as without events. A replica that is gone is ``forget``-ed and
its subscriber closed. Gap replays wait at most ``replay_timeout_s`` (on the router's loop:
kept short). Not thread-safe: the router calls it from its one loop.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Mapping
from typing import Any

import msgspec
import zmq

from deltaserve.cluster.affinity import AffinityIndex
from deltaserve.cluster.kv_index import KVEventSubscriber
from deltaserve.logs import get_logger

log = get_logger("deltaserve.cluster")


class EventFeeds:
    def __init__(self, *, replay_timeout_s: float = 0.2, catch_up_interval_s: float = 1.0) -> None:
        self.replay_timeout_s = replay_timeout_s
        self.catch_up_interval_s = catch_up_interval_s
        self._asked: dict[Hashable, float] = {}  # replica -> when its replay was last asked
        self.subscribers: dict[Hashable, tuple[tuple[str, str | None, str], KVEventSubscriber]] = {}

    def on_report(self, replica_id: Hashable, report: Mapping[str, Any] | None) -> None:
        """Subscribe to the replica's events if its report names an endpoint (again if it
        moved: a restarted replica)."""
        where = (report or {}).get("kv_events")
        if not isinstance(where, Mapping) or not where.get("endpoint"):
            return
        key = (str(where["endpoint"]), where.get("replay_endpoint"), str(where.get("topic", "")))
        current = self.subscribers.get(replica_id)
        if current is not None and current[0] == key:
            return
        self.forget(replica_id)
        sub = KVEventSubscriber(key[0], key[1], topic=key[2], replay_timeout_s=self.replay_timeout_s)
        self.subscribers[replica_id] = (key, sub)
        log.info("cluster.kv_events_subscribed", replica=str(replica_id), endpoint=key[0], replay=key[1])

    def refresh(self, index: AffinityIndex) -> None:
        """Apply what every stream delivered; feed each replica's view, or fall back."""
        for rid, (_, sub) in list(self.subscribers.items()):
            try:
                applied = sub.poll(0)
                now = time.monotonic()
                if (sub.last_seq < 0 or sub.stale) and now - self._asked.get(
                    rid, -1e9
                ) >= self.catch_up_interval_s:
                    self._asked[rid] = now  # (a replay waits; a dead replica's, for the timeout)
                    applied += sub.catch_up()
            except (zmq.ZMQError, msgspec.DecodeError, msgspec.ValidationError) as e:
                log.warning("cluster.kv_events_failed", replica=str(rid), error=repr(e))
                sub.stale = True
                applied = 0
            if sub.last_seq < 0 or sub.stale:
                index.events_lost(rid)
                continue
            view = index.views.get(rid)
            if applied or (view is not None and not view.events):
                index.on_events(rid, sub.index.ckpt_short, sub.index.kv_short)

    def forget(self, replica_id: Hashable) -> None:
        entry = self.subscribers.pop(replica_id, None)
        self._asked.pop(replica_id, None)
        if entry is not None:
            entry[1].close()

    def keep(self, live: set[Hashable]) -> None:
        """Close the subscribers of replicas not in ``live``."""
        for rid in [r for r in self.subscribers if r not in live]:
            self.forget(rid)

    def close(self) -> None:
        for rid in list(self.subscribers):
            self.forget(rid)
