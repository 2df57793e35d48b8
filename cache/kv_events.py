"""Cache events on the wire: vLLM's KV-event format, plus our checkpoint extension.

The structs, their field order and their msgpack layout are vLLM's
(``vllm/distributed/kv_events.py``), so that a router written for vLLM (llm-d's KV-cache
indexer, NVIDIA Dynamo's KV router, Ray Serve's ``KVAwareRouter``) decodes our stream with its
own structs:

* a batch is ``KVEventBatch(ts, events, data_parallel_rank)``, encoded as a msgpack array
  (``array_like``); ``data_parallel_rank`` is always set (0: we run one rank per core);
* each event is a tagged array whose first element is the class name: ``BlockStored``
  ``(block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name)``,
  ``BlockRemoved(block_hashes, medium)``, ``AllBlocksCleared()`` (vLLM's later optional
  fields, ``extra_keys``, ``group_idx``..., are left out); or, with ``layout="map"`` (newer
  vLLM's), a map of the named fields with the class name under ``"type"``. ``decode_batch``
  reads both, event by event.

Our extension, which no router has yet: ``CheckpointStored(block_hash, medium)`` and
``CheckpointRemoved(block_hash, medium)``: the recurrent (GDN) state at the end of the block
``block_hash`` is cached in ``medium``. On a hybrid model a prefix hit needs the KV path *and* a
checkpoint at its end, so a router that knows both can score only real hits. A vLLM decoder
with a closed tag union rejects a batch holding them; ``decode_batch`` here skips unknown tags
instead (use it, or a union of the tags you know plus a fallback, in a subscriber).

Block hashes are our 128-bit chained hashes (``cache/hashing.py``) as 16 big-endian bytes
(vLLM's ``ExternalBlockHash`` is ``bytes | int``; msgpack ints stop at 64 bits). The root has no
parent: the first block's ``parent_block_hash`` is None. ``medium`` is vLLM's spelling:
``"GPU"`` for the device tier (whatever the device is; on a CPU-only engine it is the KV pool),
``"CPU"`` for the host tier, ``"DISK"`` for the disk tier; and ``"REMOTE"``, ours, for the
shared remote tier (``cache/remote_store.py``). vLLM has no medium for a store that replicas
share (its ``medium`` is a free string; LMCache and Mooncake connectors publish none): a
router that scores a replica by the media it holds would otherwise count a shared-store item
as that replica's own disk. ``REMOTE`` items are those this replica wrote to the store or
read from it and verified (its local knowledge: never a network call); the store may evict
one silently (reads verify, so that costs a hit, never an output), and each replica
publishes its own. ``token_ids`` are the block's tokens when the engine saw them; a block
known only from disk or the store carries ``[]``.

Torch-free and zmq-free: the publisher (``engine/core/kv_event_publisher.py``) and the
subscriber (``cluster/kv_index.py``) add the transport.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_DISK = "DISK"
MEDIUM_REMOTE = "REMOTE"  # ours: vLLM has no medium for a store replicas share
MEDIA = (MEDIUM_GPU, MEDIUM_CPU, MEDIUM_DISK, MEDIUM_REMOTE)

# the 8-byte big-endian sequence number of the replay socket's end-of-replay frame
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """One change to what a replica caches (a tagged msgpack array)."""


# (hashes are ``bytes | int`` as vLLM's ``ExternalBlockHash``: ours are bytes, a vLLM
# publisher's may be ints, and the subscriber reads both)
class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class CheckpointStored(KVCacheEvent):
    """Our extension: the recurrent state at the end of block ``block_hash`` is cached."""

    block_hash: bytes | int
    medium: str | None


class CheckpointRemoved(KVCacheEvent):
    """Our extension: that checkpoint left ``medium``."""

    block_hash: bytes | int
    medium: str | None


KNOWN_EVENTS: tuple[type[KVCacheEvent], ...] = (
    BlockStored,
    BlockRemoved,
    AllBlocksCleared,
    CheckpointStored,
    CheckpointRemoved,
)
Event = BlockStored | BlockRemoved | AllBlocksCleared | CheckpointStored | CheckpointRemoved


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


class _RawBatch(msgspec.Struct, array_like=True, gc=False):
    """A batch whose events are left raw, so that each can be decoded (or skipped) alone."""

    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class _AnyBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A batch of events already in their wire form (the map layout's)."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


def _map_variant(cls: type[KVCacheEvent]) -> type[msgspec.Struct]:
    """``cls`` in the map layout: a msgpack map of its named fields plus ``"type"``: the tag."""
    fields: list[Any] = [
        (f.name, f.type) if f.required else (f.name, f.type, f.default) for f in msgspec.structs.fields(cls)
    ]
    return msgspec.defstruct(
        cls.__name__, fields, tag=cls.__name__, tag_field="type", omit_defaults=True, gc=False
    )


_MAP = {cls: _map_variant(cls) for cls in KNOWN_EVENTS}
_FROM_MAP = {m: cls for cls, m in _MAP.items()}
_TAGS = frozenset(cls.__name__ for cls in KNOWN_EVENTS)
LAYOUTS = ("array", "map")

_encoder = msgspec.msgpack.Encoder()
_raw_batch = msgspec.msgpack.Decoder(_RawBatch)
_event = msgspec.msgpack.Decoder(Event)
_map_event = msgspec.msgpack.Decoder(Union[tuple(_MAP.values())])  # type: ignore[misc]  # noqa: UP007
_any = msgspec.msgpack.Decoder(Any)


def hash_bytes(key: int) -> bytes:
    """A chained block hash (``cache/hashing.py``) as the 16 bytes that go on the wire."""
    return key.to_bytes(16, "big")


def hash_int(raw: bytes | int) -> int:
    """The inverse of ``hash_bytes`` (an int, as another publisher may send, is kept)."""
    return raw if isinstance(raw, int) else int.from_bytes(raw, "big")


def encode_batch(batch: KVEventBatch, layout: str = "array") -> bytes:
    """The msgpack payload: events as tagged arrays (``array``, vLLM's first layout, what most
    routers decode) or as maps of named fields with a ``"type"`` tag (``map``, newer vLLM's)."""
    if layout == "array":
        return _encoder.encode(batch)
    events = [_MAP[type(e)](**msgspec.structs.asdict(e)) for e in batch.events]
    return _encoder.encode(_AnyBatch(batch.ts, events, batch.data_parallel_rank))


def decode_batch(payload: bytes) -> tuple[KVEventBatch, int]:
    """Decode a batch in either layout (event by event), skipping events of a tag this module
    does not know (a newer publisher's, ``"type"`` or first element); returns the batch of
    known events and how many were skipped. Fields a newer publisher adds are ignored. A
    malformed payload or known event raises ``msgspec.DecodeError``/``ValidationError``."""
    raw = _raw_batch.decode(payload)
    events: list[Event] = []
    skipped = 0
    for item in raw.events:
        try:
            events.append(_event.decode(item))
            continue
        except msgspec.ValidationError:
            head = _any.decode(item)
        if isinstance(head, dict) and head.get("type") in _TAGS:
            m = _map_event.decode(item)
            events.append(_FROM_MAP[type(m)](**msgspec.structs.asdict(m)))
            continue
        tag = (
            head.get("type")
            if isinstance(head, dict)
            else (head[0] if isinstance(head, list) and head else None)
        )
        if isinstance(tag, str) and tag not in _TAGS:
            skipped += 1  # an unknown tag: a newer publisher's event, not ours to read
            continue
        _event.decode(item)  # a known tag, malformed: raise its error
    return KVEventBatch(ts=raw.ts, events=events, data_parallel_rank=raw.data_parallel_rank), skipped
