"""The cache-event publisher: vLLM's ZeroMQ transport for ``KVEventBatch``es.

Wire (as vLLM's ``ZmqEventPublisher``, so its subscribers work unchanged):

* a PUB socket sends each batch as the multipart message ``[topic, seq, payload]``: ``topic``
  the configured topic's UTF-8 bytes, ``seq`` an 8-byte big-endian sequence number (0, 1, ...
  from the publisher's start), ``payload`` the msgpack batch (``cache/kv_events.py``);
* with ``replay_endpoint``, a ROUTER socket answers a request ``[identity, b"", start_seq]``
  (a REQ or DEALER client sending the 8-byte start) with ``[identity, b"", seq, payload]``
  for every buffered batch from ``start_seq`` on (the last ``buffer_steps``), then
  ``[identity, b"", END_SEQ, b""]`` (``END_SEQ`` = -1 as 8 signed big-endian bytes).
* an endpoint with ``*``, ``::``, ``ipc://`` or ``inproc://`` is bound, any other connected.

Contract: ``publish`` never blocks and never raises (a step must not wait on a subscriber):
it numbers the batch and puts it on a bounded queue (``max_queue_size`` batches); when the
queue is full the batch is dropped and counted, and its sequence number is skipped, so a
subscriber sees the gap (its replay will not fill it; the core then publishes a full
resync, ``AllBlocksCleared`` and every item held). A slow subscriber loses messages past the
PUB socket's ``hwm`` (zmq drops them, never blocks) and replays them. The sending, the
replay buffer and the replay socket live on one daemon thread; ``close`` stops it and
closes the sockets (batches still queued are sent first, for at most ``CLOSE_TIMEOUT_S``).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque

import zmq

from deltaserve.cache.kv_events import END_SEQ, Event, KVEventBatch, encode_batch
from deltaserve.engine.config_kv_events import KVEventsConfig
from deltaserve.engine.errors import ConfigError
from deltaserve.logs import get_logger

log = get_logger("deltaserve.kv_events")

CLOSE_TIMEOUT_S = 2.0


def binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard or a local transport is bound, anything else connected to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    def __init__(self, config: KVEventsConfig, *, data_parallel_rank: int = 0) -> None:
        self._rank = data_parallel_rank
        self._topic = config.topic.encode()
        self._layout = config.layout.value
        self._queue: queue.Queue[tuple[int, KVEventBatch] | None] = queue.Queue(config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._next_seq = 0
        self._stop = False
        self._closed = False
        # a replay asked for batches older than the buffer: the core publishes a full resync
        # on its next step (``CoreKVEvents.end_step``); set by the thread, cleared by the core
        self.resync_requested = False
        self.counters = {"kv_events.published": 0, "kv_events.dropped": 0, "kv_events.batches_dropped": 0}
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay: zmq.Socket | None = None
        try:
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.set_hwm(config.hwm)
            (self._pub.bind if binds(config.endpoint) else self._pub.connect)(config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            key, value = (
                ("replay_endpoint", config.replay_endpoint)
                if self._replay is not None
                else ("endpoint", config.endpoint)
            )
            raise ConfigError(f"kv_events.{key} = {value!r}: {zmq.strerror(e.errno)}") from None
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = (
            self._replay.getsockopt_string(zmq.LAST_ENDPOINT) if self._replay is not None else None
        )
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        log.info("kv_events.publishing", endpoint=self.endpoint, replay_endpoint=self.replay_endpoint)

    def publish(self, events: list[Event]) -> bool:
        """Queue one step's events as a batch; False if the queue was full (dropped)."""
        seq = self._next_seq
        self._next_seq += 1
        batch = KVEventBatch(ts=time.time(), events=events, data_parallel_rank=self._rank)
        try:
            self._queue.put_nowait((seq, batch))
        except queue.Full:
            self.counters["kv_events.dropped"] += len(events)
            self.counters["kv_events.batches_dropped"] += 1
            dropped = self.counters["kv_events.batches_dropped"]
            if dropped & (dropped - 1) == 0:  # 1, 2, 4, 8, ...: a backlog logs, never floods
                log.warning("kv_events.dropped", seq=seq, events=len(events), batches_dropped=dropped)
            return False
        return True

    def close(self) -> None:
        """Send what is queued (bounded), stop the thread, close the sockets. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._queue.put(None, timeout=CLOSE_TIMEOUT_S)
        except queue.Full:
            self._stop = True  # still full: what is queued is given up
        self._thread.join(CLOSE_TIMEOUT_S)
        if self._thread.is_alive():
            self._stop = True
            self._thread.join(CLOSE_TIMEOUT_S)
        if self._thread.is_alive():  # stuck in a send: its daemon thread keeps the sockets
            log.warning("kv_events.close_timeout")
            return
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        while not self._stop:
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay()
                except zmq.ZMQError as e:
                    log.warning("kv_events.replay_failed", error=repr(e))
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is None:
                return
            seq, batch = item
            try:
                payload = encode_batch(batch, self._layout)
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), copy=False)
            except (zmq.ZMQError, OverflowError, TypeError) as e:
                log.error("kv_events.send_failed", seq=seq, error=repr(e))
                continue
            self._buffer.append((seq, payload))
            self.counters["kv_events.published"] += len(batch.events)

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("kv_events.bad_replay_request", frames=len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        oldest = self._buffer[0][0] if self._buffer else self._next_seq
        if start_seq < oldest:
            self.resync_requested = True
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))
