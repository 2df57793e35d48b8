"""Shared pieces of the disk store tests: the identity, payloads, where an item's file is."""

from __future__ import annotations

from pathlib import Path

from deltaserve.cache.disk_store import HEADER_BYTES, DiskStore, ItemKind, StoreIdentity

KV, CP = ItemKind.KV, ItemKind.CHECKPOINT
IDENT = StoreIdentity(
    model="cfg-hash",
    weights="w-hash",
    dtype="bfloat16",
    block_size=16,
    gdn_chunk_size=64,
    salt_rule="salt-v1",
    kv_block_bytes=16384,
    checkpoint_bytes=204800,
)
UNIT = 4096  # one accounted block: payloads up to UNIT - HEADER_BYTES
SMALL = UNIT - HEADER_BYTES
REPO = Path(__file__).resolve().parents[2]


def payload_for(key: int, n: int) -> bytes:
    """Deterministic bytes that differ per key (so a swapped file cannot pass)."""
    seed = key.to_bytes(16, "little")
    return (seed * (n // 16 + 1))[:n]


def item_file(store: DiskStore, kind: ItemKind, key: int) -> Path:
    (path,) = (store.path / "items" / f"{key >> 120:02x}").glob(f"{int(kind)}-{key:032x}-*")
    return path


def put_all(store: DiskStore, items: list[tuple[ItemKind, int, int, int, float]]) -> None:
    """Put (kind, key, parent, nbytes, cost) one at a time, each written before the next."""
    for kind, key, parent, n, cost in items:
        assert store.put(kind, key, parent, payload_for(key, n), cost)
        assert store.flush(10)
