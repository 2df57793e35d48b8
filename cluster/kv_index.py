"""Subscriber side of the cache events: rebuild what one replica caches, per tier.

``ReplicaCacheIndex`` applies ``KVEventBatch`` events (``cache/kv_events.py``) to sets of
block hashes per medium (``GPU``, ``CPU``, ``DISK``, ``REMOTE``), KV blocks and checkpoints apart;
``AllBlocksCleared`` empties it. ``KVEventSubscriber`` feeds one from a replica's ZeroMQ
stream (vLLM's wire: ``[topic, seq, payload]`` on PUB, the ROUTER replay socket) and keeps it
exact:

* sequence numbers must follow each other; a gap (a message the PUB socket dropped, or a
  batch the engine's queue dropped) is filled from the replay socket when one is configured;
* what no replay can give back (older than the replay buffer, dropped before sending, or no
  replay socket) marks the index ``stale`` until a batch that starts with
  ``AllBlocksCleared`` (the engine's resync, or its restart) rebuilds it from scratch; a
  router must not trust a stale index (``cluster/affinity.py`` falls back to the replica's
  polled reports);
* live sequence numbers that go back (0 with ``AllBlocksCleared``, or any number not above
  the last one received live) are a restarted engine: the index starts over, from a replay
  of the new stream's start when its first batches were missed; a number at or below the
  last applied one that a replay applied already is skipped.

Events of a tag it does not know are skipped (``decode_batch``). Not thread-safe: one owner
calls ``poll``; readers of ``index`` from other threads copy under ``lock``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import zmq

from deltaserve.cache.kv_events import (
    END_SEQ,
    MEDIA,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CheckpointRemoved,
    CheckpointStored,
    Event,
    KVEventBatch,
    decode_batch,
    hash_int,
)
from deltaserve.cluster.affinity import short_key
from deltaserve.logs import get_logger

log = get_logger("deltaserve.cluster")


@dataclass
class ReplicaCacheIndex:
    """What one replica holds: block hashes (ints) per medium, KV and checkpoints."""

    blocks: dict[str, set[int]] = field(default_factory=lambda: {m: set() for m in MEDIA})
    checkpoints: dict[str, set[int]] = field(default_factory=lambda: {m: set() for m in MEDIA})
    parents: dict[int, int] = field(default_factory=dict)  # a stored block -> its parent (0: root)
    tokens: dict[int, tuple[int, ...]] = field(default_factory=dict)  # when the event had them
    # the routing keys (``affinity.short_key``) held in any medium -> in how many media: what
    # the router's view reads (``cluster/kv_feed.py``), kept as events arrive
    kv_short: dict[int, int] = field(default_factory=dict)
    ckpt_short: dict[int, int] = field(default_factory=dict)

    def clear(self) -> None:
        for sets in (self.blocks, self.checkpoints):
            for s in sets.values():
                s.clear()
        self.parents.clear()
        self.tokens.clear()
        self.kv_short.clear()
        self.ckpt_short.clear()

    def apply(self, event: Event) -> None:
        if isinstance(event, BlockStored):
            held = self.blocks.setdefault(event.medium or "GPU", set())
            parent = hash_int(event.parent_block_hash) if event.parent_block_hash is not None else 0
            n = event.block_size
            for i, raw in enumerate(event.block_hashes):
                key = hash_int(raw)
                _add(held, self.kv_short, key)
                self.parents[key] = parent
                if len(event.token_ids) >= (i + 1) * n:
                    self.tokens[key] = tuple(event.token_ids[i * n : (i + 1) * n])
                parent = key
        elif isinstance(event, BlockRemoved):
            held = self.blocks.setdefault(event.medium or "GPU", set())
            for raw in event.block_hashes:
                key = hash_int(raw)
                _discard(held, self.kv_short, key)
                if not any(key in s for s in self.blocks.values()):
                    self.parents.pop(key, None)
                    self.tokens.pop(key, None)
        elif isinstance(event, CheckpointStored):
            _add(
                self.checkpoints.setdefault(event.medium or "GPU", set()),
                self.ckpt_short,
                hash_int(event.block_hash),
            )
        elif isinstance(event, CheckpointRemoved):
            held = self.checkpoints.setdefault(event.medium or "GPU", set())
            _discard(held, self.ckpt_short, hash_int(event.block_hash))
        elif isinstance(event, AllBlocksCleared):
            self.clear()

    def all_blocks(self) -> set[int]:
        return set().union(*self.blocks.values())

    def all_checkpoints(self) -> set[int]:
        return set().union(*self.checkpoints.values())


class KVEventSubscriber:
    """One replica's event stream into a ``ReplicaCacheIndex`` (module docstring)."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        replay_timeout_s: float = 2.0,
    ) -> None:
        self.index = ReplicaCacheIndex()
        self.lock = threading.Lock()
        self.last_seq = -1  # the last batch applied (-1: none yet)
        self._last_live = -1  # the last sequence number received from the PUB socket
        self.stale = False
        self.counters = {
            "batches": 0,
            "events": 0,
            "replayed": 0,
            "gaps": 0,
            "lost": 0,
            "skipped_events": 0,
            "restarts": 0,
        }
        self._replay_endpoint = replay_endpoint
        self._replay_timeout_ms = int(replay_timeout_s * 1000)
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sub.connect(endpoint)

    def close(self) -> None:
        self._sub.close(linger=0)
        self._ctx.term()

    def poll(self, timeout_s: float = 0.0) -> int:
        """Apply every message waiting (waiting up to ``timeout_s`` for the first); how many
        batches were applied."""
        applied = 0
        timeout_ms = int(timeout_s * 1000)
        while self._sub.poll(timeout_ms):
            timeout_ms = 0
            _topic, seq_bytes, payload = self._sub.recv_multipart()
            applied += self.receive(int.from_bytes(seq_bytes, "big"), payload)
        return applied

    def catch_up(self) -> int:
        """Ask the replay socket for every batch after the last applied one (a subscriber that
        joined late, or one whose stream fell quiet after a loss: the PUB socket's next message
        would show the gap, but it may be long in coming); how many were applied."""
        return self._replay(self.last_seq + 1, None)

    def receive(self, seq: int, payload: bytes) -> int:
        """One message from the PUB socket, in arrival order; how many batches it applied
        (several when a gap was replayed first)."""
        batch, skipped = decode_batch(payload)
        self.counters["skipped_events"] += skipped
        # live numbers only go up from one publisher: going back is a restarted one (whose
        # first batches may have gone before the SUB socket reconnected): a new stream
        went_back = seq <= self._last_live
        self._last_live = seq
        if went_back or (seq == 0 and _starts_clean(batch)):
            with self.lock:
                self.index.clear()
            if self.last_seq >= 0:
                self.counters["restarts"] += 1
            self.last_seq = -1
        elif seq <= self.last_seq:
            return 0  # applied already, from a replay
        applied = 0
        if seq > self.last_seq + 1:  # (a late joiner, or a restart we joined late: a gap from 0)
            self.counters["gaps"] += 1
            applied += self._replay(self.last_seq + 1, seq)
            if self.last_seq + 1 < seq:  # the gap is lost for good
                self.counters["lost"] += 1
                self.stale = True
                log.warning("kv_events.gap_lost", expected=self.last_seq + 1, got=seq)
        self._apply(seq, batch)
        return applied + 1

    def _apply(self, seq: int, batch: KVEventBatch) -> None:
        with self.lock:
            if _starts_clean(batch):
                self.stale = False
            for event in batch.events:
                self.index.apply(event)
        self.last_seq = seq
        self.counters["batches"] += 1
        self.counters["events"] += len(batch.events)

    def _replay(self, start: int, stop: int | None) -> int:
        """Ask the replay socket for batches ``start`` on and apply those before ``stop`` (None:
        all) that continue the sequence; how many were applied."""
        if self._replay_endpoint is None:
            return 0
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        applied = 0
        try:
            sock.connect(self._replay_endpoint)
            sock.send_multipart((b"", start.to_bytes(8, "big")))
            while sock.poll(self._replay_timeout_ms):
                _, seq_bytes, payload = sock.recv_multipart()
                if seq_bytes == END_SEQ:
                    break
                seq = int.from_bytes(seq_bytes, "big")
                if seq == self.last_seq + 1 and (stop is None or seq < stop):
                    self._apply(seq, decode_batch(payload)[0])
                    applied += 1
                    self.counters["replayed"] += 1
        finally:
            sock.close(linger=0)
        return applied


def _add(held: set[int], refs: dict[int, int], key: int) -> None:
    if key not in held:
        held.add(key)
        k = short_key(key)
        refs[k] = refs.get(k, 0) + 1


def _discard(held: set[int], refs: dict[int, int], key: int) -> None:
    if key in held:
        held.discard(key)
        k = short_key(key)
        if refs[k] <= 1:
            del refs[k]
        else:
            refs[k] -= 1


def connectable(endpoint: str, host: str) -> str:
    """A bound endpoint (``tcp://0.0.0.0:5557``, ``tcp://*:5557``, ``tcp://[::]:5557``) as
    another machine connects to it: the wildcard address replaced by ``host``."""
    for wildcard in ("tcp://0.0.0.0:", "tcp://*:", "tcp://[::]:", "tcp://:::"):
        if endpoint.startswith(wildcard):
            return f"tcp://{host}:{endpoint[len(wildcard) :]}"
    return endpoint


def _starts_clean(batch: KVEventBatch) -> bool:
    return bool(batch.events) and isinstance(batch.events[0], AllBlocksCleared)
