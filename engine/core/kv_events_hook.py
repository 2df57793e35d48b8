"""The engine core's cache events: the collector wired to the cache, the publisher, per step.

``CoreKVEvents.open`` (None unless ``kv_events`` is enabled with a zmq publisher) starts a
``KVEventPublisher`` and hooks a ``KVEventCollector`` (``cache/event_collector.py``) into the
cache's radix tree and its prefix index (tokens); ``start`` adds the disk store's index and
the remote store's knowledge (``REMOTE``; either or both, as the tier has them), once the
tier is open. The core calls ``end_step`` after every step (and ``start`` publishes
the first batch: ``AllBlocksCleared`` then what the disk holds): it takes the step's events and queues them, never blocking. A batch the queue
refused leaves a gap no replay fills, so the next ``end_step`` publishes a full resync
(``AllBlocksCleared`` and every item held) instead of a delta, until one is accepted; so does
the step after a replay request older than the replay buffer (a subscriber that joined late).
``close`` (after the disk tier closed, whose last writes are events too) publishes what is
left and stops the publisher. Runs on the core's thread only (the disk index's changes come
from the store's writer thread through the collector's deque).
"""

from __future__ import annotations

from typing import Any

from deltaserve.cache.disk_store import DiskStore
from deltaserve.cache.disk_tier import DiskTier
from deltaserve.cache.event_collector import KVEventCollector
from deltaserve.cache.layered_store import LayeredStore
from deltaserve.cache.manager import CacheManager
from deltaserve.cache.remote_store import RemoteStore
from deltaserve.engine.config_kv_events import KVEventsConfig
from deltaserve.engine.core.kv_event_publisher import KVEventPublisher


class CoreKVEvents:
    def __init__(self, config: KVEventsConfig, cache: CacheManager) -> None:
        self.collector = KVEventCollector(cache.block_size)
        self.publisher = KVEventPublisher(config)  # (a ConfigError when its endpoint is taken)
        self._cache = cache
        self.collector.attach(cache.tree)
        cache.kv.on_tokens = self.collector.note_tokens
        self._disk_index: Any = None
        self._remote: RemoteStore | None = None
        self._resync = False

    @classmethod
    def open(cls, config: KVEventsConfig, cache: CacheManager) -> CoreKVEvents | None:
        return cls(config, cache) if config.active else None

    def start(self, disk: DiskTier | None) -> None:
        """Follow the disk tier too (if any) and publish the first batch."""
        if disk is not None:
            self.watch_disk(disk)
        self.end_step()

    def watch_disk(self, disk: DiskTier) -> None:
        """Follow the tier's stores: the disk store's index and the remote store's knowledge,
        what each holds now, then each change. Called before the first step, when no write is
        queued (so nothing changes them meanwhile)."""
        store = disk.store
        local = store.disk if isinstance(store, LayeredStore) else store
        remote = store.remote if isinstance(store, LayeredStore) else store
        if isinstance(local, DiskStore):
            # the store keeps its index private; the observer is its one reader here
            index = local._index  # noqa: SLF001
            self.collector.disk_loaded((e.kind, e.key, e.parent) for e in index.entries())
            index.on_change = self.collector.disk_changed
            self._disk_index = index
        if isinstance(remote, RemoteStore):
            remote.watch(self.collector.remote_changed)
            self._remote = remote

    def end_step(self) -> None:
        events = self.collector.take_events()
        if self._resync or self.publisher.resync_requested:
            self.publisher.resync_requested = False
            events = self.collector.resync_events()
        if events:
            self._resync = not self.publisher.publish(events)

    def stats(self) -> dict[str, int]:
        return dict(self.publisher.counters)

    def close(self) -> None:
        """Publish the last changes (the disk tier's final writes), stop publishing, unhook."""
        self.end_step()
        self.publisher.close()
        self._cache.tree.on_change = None
        self._cache.kv.on_tokens = None
        if self._disk_index is not None:
            self._disk_index.on_change = None
        if self._remote is not None:
            self._remote.watch(None)
