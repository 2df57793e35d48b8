"""LayeredStore: the local disk store above the remote store, as one store of the remote tier.

With both ``cache.disk_path`` and ``cache.remote`` set, the remote tier (``cache/remote_tier.py``)
holds this: what it writes goes to each layer that lacks it (the disk through its own queue
and writer, the store through its own), and a hit is read from the disk when the disk has it
as deep, else from the store (``RemoteTier._read``).

Contract: ``has``/``queued`` say whether *every* layer holds (or is about to hold) an item,
so the tier plans a write while any layer lacks it; ``put`` forwards only to the layers that
lack it. ``read`` is the disk's (the remote store reads whole paths only). Torch-free.
"""

from __future__ import annotations

from deltaserve.cache.disk_store import DiskStore
from deltaserve.cache.remote_store import RemoteStore
from deltaserve.cache.types import DiskItemKind


class LayeredStore:
    def __init__(self, disk: DiskStore, remote: RemoteStore) -> None:
        self.disk, self.remote = disk, remote
        self.client = remote.client  # (the tier asks whether the store is available)

    @staticmethod
    def _holds(store: DiskStore | RemoteStore, kind: DiskItemKind, key: int) -> bool:
        return store.has(kind, key) or store.queued(kind, key)  # type: ignore[arg-type]

    def has(self, kind: DiskItemKind, key: int) -> bool:
        return self.disk.has(kind, key) and self.remote.has(kind, key)  # type: ignore[arg-type]

    def queued(self, kind: DiskItemKind, key: int) -> bool:
        return (
            self._holds(self.disk, kind, key)
            and self._holds(self.remote, kind, key)
            and not self.has(kind, key)
        )

    def put(self, kind: DiskItemKind, key: int, parent: int, payload: bytes, cost: float) -> bool:
        took = False
        for store in (self.disk, self.remote):
            if not self._holds(store, kind, key):
                took = store.put(kind, key, parent, payload, cost) or took  # type: ignore[arg-type]
        return took

    def read(self, kind: DiskItemKind, key: int) -> bytes | None:
        return self.disk.read(kind, key)  # type: ignore[arg-type]

    def stats(self) -> dict[str, int | float]:
        return {**self.disk.stats(), **self.remote.stats()}

    def describe(self) -> dict[str, object]:
        return {**self.disk.describe(), **self.remote.describe()}

    def close(self) -> None:
        try:
            self.remote.close()
        finally:
            self.disk.close()
