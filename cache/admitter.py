"""Admission: a request's prefix match and its start in the cache.

* ``match`` finds a prompt's path and **joint hit** (the deepest boundary
  ``b <= len(prompt) - 1`` with every block of ``[0, b)`` in the tree and a checkpoint at
  ``b``) once: with a key (the request id) it is kept until the index changes
  (``PrefixMatch.version``), so the policy's ordering, the chunking and ``admit`` share it.
* ``disk_fetch`` extends a hit from the disk tier (read before the request is admitted).
* ``wait_for_shared_prefix`` tells a prompt to wait for another request that is computing
  its prefix right now, instead of computing it beside it.
* ``admit`` pins the matched path, takes a live state slot, promotes the hit's host items
  and queues their loads (``cache/tiering.py``), and pins the checkpoint to restore from.

The manager's ``admit_request`` strings these together for the scheduler (one call per
admission). Torch-free.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from deltaserve.cache.checkpoint_store import CheckpointStore
from deltaserve.cache.disk_link import DiskLink
from deltaserve.cache.disk_tier import DiskFetch, DiskTier
from deltaserve.cache.prefix_index import PrefixIndex
from deltaserve.cache.shared_budget import SharedBudget
from deltaserve.cache.tiering import Tiering
from deltaserve.cache.types import PrefixMatch, SeqCache


class Admitter:
    def __init__(
        self,
        kv: PrefixIndex,
        ckpts: CheckpointStore,
        tiers: Tiering,
        disk: DiskLink,
        budget: SharedBudget | None,
        active: dict[str, SeqCache],
        *,
        unit: int,
        has_gdn: bool,
        enabled: bool,
    ) -> None:
        self.kv, self.ckpts, self.tiers, self.link, self.budget = kv, ckpts, tiers, disk, budget
        self.slots = ckpts.slots
        self.block_size = kv.block_size
        self.active = active  # the manager's admitted requests (the same dict)
        self.unit, self.has_gdn, self.enabled = unit, has_gdn, enabled
        self._matches: dict[str, PrefixMatch] = {}  # request id -> its match at the current version

    @property
    def disk(self) -> DiskTier | None:
        return self.link.tier

    def match(
        self,
        token_ids: Sequence[int],
        salt: bytes,
        hashes: list[int] | None = None,
        *,
        key: str | None = None,
    ) -> PrefixMatch:
        """The prompt's path and joint hit; with ``key`` (a request id) kept until the index changes."""
        version = self.kv.version
        if not self.enabled or len(token_ids) == 0:
            return PrefixMatch([], 0, [], len(token_ids), version, self.block_size)
        if key is not None:
            m = self._matches.get(key)
            if m is not None and m.version == version and m.num_tokens == len(token_ids):
                return m
            if self._matches and next(iter(self._matches.values())).version != version:
                self._matches.clear()  # stale: the index moved on
        m = self.kv.match(token_ids, salt, hashes if hashes is not None else [])
        if key is not None:
            self._matches[key] = m
        return m

    def admit(
        self,
        request_id: str,
        token_ids: Sequence[int],
        salt: bytes,
        *,
        prompt_len: int | None = None,
        hashes: list[int] | None = None,
        match: PrefixMatch | None = None,
        disk: DiskFetch | None = None,
    ) -> SeqCache | None:
        """Start caching for a request; None when no live state slot is free. ``match``: the
        request's ``match`` result (used when still current, else matched again). ``disk``:
        its disk fetch (``disk_fetch``), used when it extends the hit: the request then loads
        the disk's KV into private blocks and its checkpoint into the live slot.

        Hit-rate stats are the caller's to record (``record_query``), once per request: an
        admission may be undone (no KV for it yet) and retried on a later step.
        """
        if request_id in self.active:
            raise RuntimeError(f"request {request_id!r} already admitted")
        if self.has_gdn and self.slots.num_free_live == 0:
            return None
        if match is None or match.version != self.kv.version or match.num_tokens != len(token_ids):
            match = self.match(token_ids, salt, hashes, key=request_id)
        path, hit = match.path, match.hit_blocks
        if disk is not None and (self.disk is None or not self.disk.usable(disk, hit)):
            disk = None
        from_disk = disk.end_block - hit if disk is not None else 0
        on_host = [n for n in path[:hit] if n.block_id < 0]
        if (on_host or from_disk) and not self.tiers.make_room(path[:hit], len(on_host) + from_disk):
            return None  # no device blocks to promote the hit into now: retry later
        self._matches.pop(request_id, None)
        seq = SeqCache(request_id, salt, prompt_len or len(token_ids), hashes=match.hashes)
        self.tiers.promote(seq, on_host)
        self.kv.pin_path(seq, path[:hit])
        seq.num_cached_tokens = hit * self.block_size
        seq.host_hit_tokens = len(on_host) * self.block_size
        if self.has_gdn:
            seq.state_slot = self.slots.allocate_live()
        if disk is not None:
            self.tiers.load_from_disk(seq, disk, hit)
        elif self.has_gdn and self.enabled and hit > 0:
            self.tiers.pin_restore_source(seq, path[hit - 1])
        if self.has_gdn and self.enabled:
            seq.branch_boundary = self.kv.branch_boundary(match, token_ids, self.unit)
            self.kv.hold_inflight(seq, len(token_ids) // self.block_size)
        if seq.loads:
            seq.load_since = time.monotonic()
        self.active[request_id] = seq
        if self.disk is not None:
            self.disk.discard(request_id)  # used (its loads hold the bytes), or not needed now
        return seq

    def wait_for_shared_prefix(self, match: PrefixMatch, token_ids: Sequence[int], min_tokens: int) -> bool:
        """Whether admitting the prompt now would recompute at least ``min_tokens`` past its hit
        that another admitted request is computing right now (its prompt's blocks, cached as KV
        only or not at all, that it has not published yet). If so, and a checkpoint fits without
        displacing one (a free slot or page), that request is asked for a branch checkpoint where
        the two prompts part (unless it has passed it), so this one resumes there a step or two
        later instead of computing the shared prefix beside it; with the cache full it only
        waits for the blocks (forced captures there displaced more valuable checkpoints: the
        simulator's long-reuse trace lost 4 points to them). Ends when those blocks are
        published or their request leaves: a wait is bounded by another request's progress."""
        if not self.enabled or min_tokens <= 0:
            return False
        depth = self.kv.inflight_depth(match, token_ids)
        boundary = depth * self.block_size // self.unit * self.unit
        if depth == 0 or min(boundary, len(token_ids) - 1) - match.hit_tokens < min_tokens:
            return False
        key = match.hashes[depth - 1]
        owner = self._computing(key, depth) if key in self.kv.inflight else None  # O(1) first
        if owner is None:
            return False
        published = len(owner.nodes) * self.block_size
        room = self.slots.num_free_checkpoint > 0 or (
            self.budget is not None and self.budget.arena.num_free > 0
        )
        if self.has_gdn and room and (owner.branch_boundary <= published or owner.branch_boundary < boundary):
            owner.branch_boundary = boundary  # (a deeper branch of its own, not yet reached, stays)
        return True

    def _computing(self, key: int, depth: int) -> SeqCache | None:
        """The active request whose prompt holds block ``depth`` (chained hash ``key``: the
        same prefix) and has not published it yet."""
        for seq in self.active.values():
            if seq.num_inflight >= depth and len(seq.nodes) < depth and seq.hashes[depth - 1] == key:
                return seq
        return None

    def disk_fetch(self, request_id: str, token_ids: Sequence[int], match: PrefixMatch) -> DiskFetch | None:
        """The request's disk hit beyond ``match`` (``DiskTier.fetch``): None when the disk
        adds nothing; else being read (``done`` false: the request waits) or read."""
        if self.disk is None or not match.hashes:
            return None
        return self.disk.fetch(
            request_id, match.hashes, match.hit_blocks, (len(token_ids) - 1) // self.block_size
        )
