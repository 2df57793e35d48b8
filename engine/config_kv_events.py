"""The ``[kv_events]`` section: cache events in vLLM's format (vLLM's ``KVEventsConfig``).

Same keys, defaults and meaning as vLLM's ``--kv-events-config`` JSON, so one JSON object
configures either engine (``deltaserve serve --kv-events-config '{...}'``). Torch-free.
"""

from __future__ import annotations

import enum
from typing import Annotated, ClassVar

from deltaserve.engine.config_base import PosInt, _bad, _doc, _Section

ENDPOINT_SCHEMES = ("tcp://", "ipc://", "inproc://")


class KVEventsPublisherKind(str, enum.Enum):
    NULL = "null"  # collect nothing, publish nothing
    ZMQ = "zmq"


class KVEventsLayout(str, enum.Enum):
    ARRAY = "array"  # events as tagged arrays: vLLM's first layout, what most routers decode
    MAP = "map"  # events as maps of named fields with a "type" tag: newer vLLM's


class KVEventsConfig(_Section):
    """``[kv_events]``: publish what the cache stores and evicts, per tier, as vLLM's KV events
    (ZeroMQ PUB, msgpack ``KVEventBatch``; docs/cluster.md, "Cache events"), plus our
    checkpoint events. The same keys as vLLM's `--kv-events-config`; `deltaserve serve
    --kv-events-config JSON` sets them. Published from the engine core's process."""

    section_key: ClassVar[str] = "kv_events"

    enable_kv_cache_events: Annotated[
        bool, _doc("Collect and publish cache events (block stored / removed / cleared, checkpoints).")
    ] = False
    publisher: Annotated[
        KVEventsPublisherKind | None,
        _doc("`zmq` or `null` (no publishing). Unset: `zmq` when events are enabled, else `null`."),
    ] = None
    endpoint: Annotated[
        str,
        _doc(
            "The PUB socket: `tcp://*:PORT` (bound; any address with `*`, `::`, or an `ipc://` / "
            "`inproc://` one is bound) or `tcp://HOST:PORT` (connected to a subscriber that binds). "
            "`tcp://*:*` binds a free port: what cluster replicas on one machine need (each reports "
            "its own to the router)."
        ),
    ] = "tcp://*:5557"
    replay_endpoint: Annotated[
        str | None,
        _doc(
            "A ROUTER socket (bound) that resends buffered batches from a sequence number (an "
            "8-byte big-endian integer), ending with sequence -1. Unset: no replay."
        ),
    ] = None
    buffer_steps: Annotated[PosInt, _doc("Batches (one per engine step with events) kept for replay.")] = (
        10_000
    )
    hwm: Annotated[
        int,
        _doc(
            "ZeroMQ high-water mark of the PUB socket: messages past it to a slow subscriber are dropped.",
            ge=0,
        ),
    ] = 100_000
    max_queue_size: Annotated[
        PosInt,
        _doc(
            "Batches waiting for the publisher thread; past it a step's batch is dropped (counted, "
            "logged; subscribers see the sequence gap and the engine publishes a full resync)."
        ),
    ] = 100_000
    topic: Annotated[str, _doc("Topic frame of every message (subscribers filter on its prefix).")] = ""
    layout: Annotated[
        KVEventsLayout,
        _doc(
            "Ours, not vLLM's: how each event is encoded. `array`: a tagged array (vLLM's first "
            "layout, what most routers decode); `map`: a map of named fields with a `type` tag (newer "
            "vLLM's). Subscribers here read both."
        ),
    ] = KVEventsLayout.ARRAY

    @property
    def active(self) -> bool:
        """Events are collected and sent (enabled, and the publisher is not `null`)."""
        kind = self.publisher or (KVEventsPublisherKind.ZMQ if self.enable_kv_cache_events else None)
        return self.enable_kv_cache_events and kind is KVEventsPublisherKind.ZMQ

    def check(self) -> None:
        for key, value in (("endpoint", self.endpoint), ("replay_endpoint", self.replay_endpoint)):
            if value is not None and not (
                value.startswith(ENDPOINT_SCHEMES) and len(value) > value.index("//") + 2
            ):
                raise _bad(
                    f"kv_events.{key}",
                    value,
                    "expected a ZeroMQ endpoint: tcp://HOST:PORT, ipc://PATH or inproc://NAME",
                )
        if (
            self.replay_endpoint is not None
            and self.replay_endpoint == self.endpoint
            and not self.endpoint.endswith(":*")  # (each binds a free port of its own)
        ):
            raise _bad(
                "kv_events.replay_endpoint", self.replay_endpoint, "must differ from kv_events.endpoint"
            )
        if self.publisher is KVEventsPublisherKind.ZMQ and not self.enable_kv_cache_events:
            raise _bad(
                "kv_events.publisher",
                "zmq",
                "needs kv_events.enable_kv_cache_events = true (nothing is collected)",
            )
