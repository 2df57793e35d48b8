"""The remote tier: a Mooncake Store every replica shares, in the disk tier's socket.

It is the disk tier (``cache/disk_tier.py``: write-through of published checkpoints with the
KV their path needs, write-back of checkpoints the tiers above let go, a byte rate, fetches
read on reader threads before a request is admitted, a read deadline) over a
``RemoteStore`` (``cache/remote_store.py``), with what differs for a store that is shared and
across a network:

* **Lookups are reads.** What other replicas published is not known locally, so a fetch
  asks the store itself, on the reader thread: which path manifests at the prompt's
  checkpoint boundaries exist (deepest first), then reads one whole path (every KV block
  after the tree hit and the checkpoint, all verified against its manifest). The request
  waits meanwhile (one round trip on a miss) while the others run; a fetch not read within
  ``read_timeout_s`` is given up (``remote_wait`` in the loss attribution).
* **Above it, a local disk.** With ``cache.disk_path`` too, the store is a ``LayeredStore``
  (``cache/layered_store.py``): writes go to each layer that lacks the item, and a hit is
  read from the store only where it is deeper than what the disk holds.
* **A store that is down costs hits only.** While the client's breaker is open
  (``cache/remote_client.py``) a fetch is not started (the request computes: ``remote_wait``)
  and writes are dropped; nothing waits on the store on the step thread.

Counters: the disk tier's fetch counters as ``remote.*`` (``remote.fetches``,
``remote.fetch_misses``: a fetch that found nothing usable, ``remote.read_timeouts``, ...),
the store's (``remote.hits``: paths read whole and verified, ``remote.bytes_read`` /
``remote.bytes_written``, ``remote.published``, ...) and the client's (``remote.timeouts``,
``remote.breaker_opens``, ...); ``/metrics`` exports them as ``deltaserve:remote_*``
(``server/metrics.py``). Torch-free.
"""

from __future__ import annotations

from collections.abc import Callable

from deltaserve.cache.disk_tier import CHECKPOINT, KV, DiskFetch, DiskTier
from deltaserve.cache.layered_store import LayeredStore
from deltaserve.cache.remote_client import RemoteUnavailable
from deltaserve.cache.remote_store import RemoteStore
from deltaserve.cache.types import DiskItemKind

REMOTE_WAIT = "remote_wait"  # a loss cause: a remote hit given up (deadline, or the store down)


class RemoteTier(DiskTier):
    store: RemoteStore | LayeredStore

    @property
    def remote(self) -> RemoteStore:
        return self.store.remote if isinstance(self.store, LayeredStore) else self.store

    def probe(self, keys: list[int], hit_blocks: int, max_blocks: int) -> tuple[int, list[int]]:
        """As the disk tier's, over what either layer is known to hold (no network)."""
        store = self.store
        if not isinstance(store, LayeredStore):
            return super().probe(keys, hit_blocks, max_blocks)
        return self._probe(
            keys, hit_blocks, max_blocks, lambda k, key: store.disk.has(k, key) or store.remote.has(k, key)
        )

    def _probe(
        self, keys: list[int], hit_blocks: int, max_blocks: int, has: Callable[[DiskItemKind, int], bool]
    ) -> tuple[int, list[int]]:
        """The disk tier's probe over ``has`` (which layer, or both, is the caller's choice)."""
        end = hit_blocks
        limit = min(max_blocks, len(keys))
        while end < limit and has(KV, keys[end]):
            end += 1
        u = self.unit_blocks
        bounds = [b for b in range(end // u * u, hit_blocks, -u) if has(CHECKPOINT, keys[b - 1])]
        return end, bounds[:3]

    def fetch(self, request_id: str, keys: list[int], hit_blocks: int, max_blocks: int) -> DiskFetch | None:
        """The request's remote hit, being read or read; None when there can be none (no
        checkpoint boundary past the hit, the store unavailable, the read buffers full)."""
        f = self._fetch_in_hand(request_id, hit_blocks)
        if f is not None or request_id in self._gave_up:
            return f
        u = self.unit_blocks
        top = min(max_blocks, len(keys)) // u * u
        bounds = list(range(top, hit_blocks, -u))
        if not bounds:
            return None
        if not self.remote.client.available and not isinstance(self.store, LayeredStore):
            self._lost[request_id] = REMOTE_WAIT
            self._gave_up.add(request_id)
            return None
        return self._start_fetch(request_id, keys, hit_blocks, bounds)

    def _read(self, f: DiskFetch) -> None:
        """Reader thread: the deepest published path past the hit (and past what a local disk
        layer holds) that reads whole and verifies (at most three tried), else the disk
        layer's hit; nothing if the store fails meanwhile and there is no disk layer."""
        store = self.store
        on_disk: list[int] = []
        if isinstance(store, LayeredStore):
            _, on_disk = self._probe(f.keys, f.start_block, f.boundaries[0], store.disk.has)
        deeper = [b for b in f.boundaries if b > (on_disk[0] if on_disk else 0)]
        try:
            found = self.remote.lookup(f.keys, deeper) if deeper and self.remote.client.available else []
            for b in found[:3]:
                if f.timed_out:
                    return
                got = self.remote.read_path(
                    f.keys, f.start_block, b, self.kv_block_bytes, self.checkpoint_bytes
                )
                if got is not None and not f.timed_out:
                    f.kv, f.state = got
                    f.end_block = b  # (last: the step thread reads it once ``done``)
                    return
        except RemoteUnavailable:
            pass
        if on_disk and not f.timed_out:
            f.boundaries = on_disk
            super()._read(f)  # the disk tier's read, from the disk layer (``LayeredStore.read``)

    def given_up(self, request_id: str) -> str | None:
        why = super().given_up(request_id)
        return REMOTE_WAIT if why == "disk_wait" else why

    def stats(self) -> dict[str, int | float]:
        # the disk tier's counters as the remote tier's; a fetch that found nothing usable is
        # a miss here (a path not in the store), not damage
        names = {"disk.fetch_damaged": "remote.fetch_misses"}
        out: dict[str, int | float] = {
            names.get(k, "remote." + k[len("disk.") :] if k.startswith("disk.") else k): v
            for k, v in self.counters.items()
        }
        out.update(self.store.stats())
        out["remote.read_buffer_bytes"] = self.buffered
        return out
