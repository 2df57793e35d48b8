"""The disk store's on-disk format (pure: bytes and names in, fields out; torch-free).

What ``cache/disk_store.py`` writes and reads back, so that it holds only the I/O:

* an item file: a header (magic, format, kind, key, parent, payload length, cost, the
  payload's xxh3-64; then the xxh3-64 of those fields, so a torn header never parses) and the
  payload. It is accounted as header + payload rounded up to whole ``FS_BLOCK`` blocks.
* an item's name: ``<kind>-<key>-<parent>-<length>-<cost>`` (hex), all the index needs, so an
  open lists directories and opens no item; it lives under ``items/<first byte of key>/``.
* ``manifest.json``: the ``StoreIdentity`` a store is reused under, when it was created, and
  the store's marker (``magic``: ``cache/disk_layout.py`` says what a store owns).
* ``index.bin``: GDSF's L and the frequencies above 1, saved at close (checksummed: a damaged
  or older file is ignored, and the items restart at frequency 1).
"""

from __future__ import annotations

import enum
import math
import struct

import msgspec
import xxhash

FORMAT_VERSION = 1

_MAGIC = b"DSI1"
# magic, format, kind, reserved, key, parent, payload length, cost, payload xxh3_64
_HEAD_BODY = struct.Struct("<4sHBB16s16sQdQ")
_HEAD_SUM = struct.Struct("<Q")  # xxh3_64 of the body: a torn header never parses
HEADER_BYTES = _HEAD_BODY.size + _HEAD_SUM.size
FS_BLOCK = 4096
FANOUT_BITS = 8  # 256 item directories: ~2.5 k files each for 10 GB of 16 KiB items

_INDEX_MAGIC = b"DSX1"
_INDEX_HEAD = struct.Struct("<4sHQdQ")  # magic, format, count, L, xxh3_64 of the records
_INDEX_REC = struct.Struct("<B16sQ")  # kind, key, freq
KEY_LIMIT = 1 << 128


class ItemKind(enum.IntEnum):
    KV = 1
    CHECKPOINT = 2


class StoreIdentity(msgspec.Struct, frozen=True):
    """What must match for a store to be reused: else it is set aside, never mixed."""

    model: str  # hash of the model config
    weights: str  # weights fingerprint
    dtype: str
    block_size: int
    gdn_chunk_size: int
    salt_rule: str  # how cache salts/namespaces are formed (a version string)
    kv_block_bytes: int
    checkpoint_bytes: int
    format: int = FORMAT_VERSION  # the on-disk format of this module

    def __post_init__(self) -> None:
        for name in ("block_size", "gdn_chunk_size", "kv_block_bytes", "checkpoint_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"StoreIdentity.{name} must be > 0, got {getattr(self, name)}")


class Manifest(msgspec.Struct, frozen=True):
    identity: StoreIdentity
    created: float  # unix time the store was created
    # the store's marker (``cache/disk_layout.py``); "" in what earlier versions wrote
    magic: str = ""


def accounted_bytes(length: int) -> int:
    """Bytes an item of ``length`` payload bytes costs on disk: header + data, whole blocks."""
    return -(-(HEADER_BYTES + length) // FS_BLOCK) * FS_BLOCK


def encode_header(kind: ItemKind, key: int, parent: int, payload: bytes, cost: float) -> bytes:
    body = _HEAD_BODY.pack(
        _MAGIC,
        FORMAT_VERSION,
        int(kind),
        0,
        key.to_bytes(16, "little"),
        parent.to_bytes(16, "little"),
        len(payload),
        cost,
        xxhash.xxh3_64_intdigest(payload),
    )
    return body + _HEAD_SUM.pack(xxhash.xxh3_64_intdigest(body))


def decode_header(raw: bytes) -> tuple[ItemKind, int, int, int, float, int] | None:
    """(kind, key, parent, length, cost, payload checksum), or None if not a valid header."""
    if len(raw) < HEADER_BYTES:
        return None
    body = raw[: _HEAD_BODY.size]
    (checksum,) = _HEAD_SUM.unpack_from(raw, _HEAD_BODY.size)
    if xxhash.xxh3_64_intdigest(body) != checksum:
        return None
    magic, fmt, kind, _, key, parent, length, cost, psum = _HEAD_BODY.unpack(body)
    if magic != _MAGIC or fmt != FORMAT_VERSION or kind not in (1, 2):
        return None
    return (
        ItemKind(kind),
        int.from_bytes(key, "little"),
        int.from_bytes(parent, "little"),
        length,
        cost,
        psum,
    )


def item_name(kind: ItemKind, key: int, parent: int, length: int, cost: float) -> str:
    """An item's file name: everything the index needs, so an open reads no file."""
    return f"{int(kind)}-{key:032x}-{parent:032x}-{length:x}-{cost.hex()}"


def fan_of(key: int) -> int:
    """The ``items/<xx>`` directory an item of ``key`` lives in."""
    return key >> (128 - FANOUT_BITS)


_KIND_OF_DIGIT = {"1": ItemKind.KV, "2": ItemKind.CHECKPOINT}


def parse_item_name(name: str) -> tuple[ItemKind, int, int, int, float] | None:
    """The fields ``item_name`` wrote, or None for any other name."""
    parts = name.split("-", 4)  # the cost's hex exponent may hold a '-'
    kind = _KIND_OF_DIGIT.get(parts[0])
    if kind is None or len(parts) != 5 or len(parts[1]) != 32 or len(parts[2]) != 32:
        return None
    try:
        key, parent, length = int(parts[1], 16), int(parts[2], 16), int(parts[3], 16)
        cost = float.fromhex(parts[4])
    except ValueError:
        return None
    if not (math.isfinite(cost) and cost >= 0 and key >= 0 and parent >= 0 and length >= 0):
        return None
    return kind, key, parent, length, cost


def encode_index(freqs: list[tuple[ItemKind, int, int]], inflation: float) -> bytes:
    """``index.bin``: L and the (kind, key, freq) of the items read since written (freq > 1)."""
    body = b"".join(_INDEX_REC.pack(int(k), key.to_bytes(16, "little"), f) for k, key, f in freqs if f > 1)
    count = len(body) // _INDEX_REC.size
    head = _INDEX_HEAD.pack(_INDEX_MAGIC, FORMAT_VERSION, count, inflation, xxhash.xxh3_64_intdigest(body))
    return head + body


def decode_index(raw: bytes) -> tuple[float, dict[tuple[ItemKind, int], int]] | None:
    """(L, frequency per (kind, key)) from ``index.bin``, or None if it is not a valid one."""
    if len(raw) < _INDEX_HEAD.size:
        return None
    magic, fmt, count, inflation, checksum = _INDEX_HEAD.unpack_from(raw)
    body = memoryview(raw)[_INDEX_HEAD.size :]
    ok = magic == _INDEX_MAGIC and fmt == FORMAT_VERSION and len(body) == count * _INDEX_REC.size
    if not ok or xxhash.xxh3_64_intdigest(body) != checksum:
        return None
    freqs: dict[tuple[ItemKind, int], int] = {}
    for kind, key, freq in _INDEX_REC.iter_unpack(body):
        if kind in (1, 2):
            freqs[(ItemKind(kind), int.from_bytes(key, "little"))] = freq
    return inflation, freqs
