"""The cache's one socket for the disk tier (``cache/disk_tier.py``).

The disk tier is opened after the cache (its store's identity needs the runner's buffers),
and closed before it. The parts that feed it (the checkpoint store: published and dropped
checkpoints; the host tier: evicted host checkpoints; the manager: evicted KV leaves, hits,
planned writes) each take this link in their constructor, so plugging a tier in or out
(``CacheManager.attach_disk`` / ``detach_disk``) sets one field, and no part is rewired
after construction.

Contract: with no tier plugged in, every forwarding call is a no-op (and ``tier`` is None,
which callers test before work that only feeds the disk). Torch-free.
"""

from __future__ import annotations

from deltaserve.cache.disk_tier import DiskTier
from deltaserve.cache.radix_tree import Node
from deltaserve.cache.types import Tier


class DiskLink:
    __slots__ = ("tier",)

    def __init__(self) -> None:
        self.tier: DiskTier | None = None  # None: no disk tier (never configured, or closed)

    def note_checkpoint(self, node: Node) -> None:
        """A checkpoint was published on the device: a write-through candidate."""
        if self.tier is not None:
            self.tier.note_checkpoint(node)

    def write_back(self, node: Node, tier: Tier, slot: int) -> None:
        """A checkpoint leaves the last tier above the disk (its bytes intact until the next
        step's copies): written back if the disk lacks it."""
        if self.tier is not None:
            self.tier.write_back(node, tier, slot)
