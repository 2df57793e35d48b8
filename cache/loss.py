"""Loss attribution: every prompt token the cache was asked for and did not serve, by cause.

At a request's first admission (where its match is made once) the tokens of its query that
the cache does not serve, ``query_tokens - hit_tokens``, are split into the causes of
``QUERY_CAUSES`` by one left-to-right walk over the prompt's blocks past the hit, so the
split sums to the misses by construction (``check`` asserts it). In order:

* ``prompt_logprobs``: a request that computes its whole prompt gives up the joint hit it
  would have had (the deepest checkpoint on its matched path);
* ``read_budget`` / ``disk_wait``: a disk hit found and given up (its fetch refused by the
  read buffer budget, or read past ``read_timeout_s``): the blocks up to its checkpoint;
  ``remote_wait``: the same for the remote tier (read past its deadline, or not asked for
  while the store is unavailable), up to the deepest checkpoint this engine knows is there;
* ``checkpoint_never_captured`` / ``checkpoint_skipped`` / ``checkpoint_evicted``: the KV is
  there past the hit (in the tree on any tier, in transit between tiers, or on disk) but no
  checkpoint at or before its end; why is the latest outcome recorded at the deepest boundary
  of that stretch that has one (none: never captured);
* per block past the KV: ``in_flight`` (another admitted request is computing it now),
  ``kv_evicted_device`` / ``_host`` / ``_disk`` (cached once, evicted; the tier it was last in),
  else ``cold``;
* ``granularity``: the tail past the deepest boundary a hit may sit on (the last checkpoint
  unit boundary at most ``len(prompt) - 1``: the last prompt token is always computed).

``preemption`` is the one cause outside the query: a preempted request that comes back is
not a new query (the hit rate counts a request once), so what it recomputes beyond what the
cache serves it then is counted on its own (``recompute``).

Memory is bounded: the evicted block hashes and the checkpoint outcomes are two LRU records
of ``capacity`` entries each; a hash forgotten past that counts as ``cold`` (and a boundary
forgotten as never captured). The simulator lifts the bound (``remember_all``): on a long
trace a forgotten eviction would read as a compulsory miss. Hooks are O(1); an attribution
is O(blocks past the hit). Torch-free.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, NamedTuple

from deltaserve.cache.disk_link import DiskLink
from deltaserve.cache.prefix_index import PrefixIndex
from deltaserve.cache.radix_tree import Node
from deltaserve.cache.types import DiskItemKind, SeqCache

if TYPE_CHECKING:  # (the store imports nothing of this module; types only)
    from deltaserve.cache.checkpoint_store import CheckpointStore
    from deltaserve.cache.manager_config import CacheManagerConfig

#: the causes a query's misses are split into (they sum to ``query_tokens - hit_tokens``)
QUERY_CAUSES = (
    "cold", "kv_evicted_device", "kv_evicted_host", "kv_evicted_disk", "checkpoint_never_captured",
    "checkpoint_skipped", "checkpoint_evicted", "granularity", "in_flight", "read_budget",
    "disk_wait", "remote_wait", "prompt_logprobs",
)  # fmt: skip
#: every cause: the query's, then the recompute of preempted requests
MISS_CAUSES = (*QUERY_CAUSES, "preemption")
MISS_PREFIX = "prefix_cache.miss_tokens."
MISS_KEYS = tuple(MISS_PREFIX + c for c in MISS_CAUSES)

# what a disk fetch given up is counted as (``DiskTier.given_up``)
GIVEN_UP_CAUSES = ("read_budget", "disk_wait", "remote_wait")


class Asked(NamedTuple):
    """What a query's admission knew beyond its match."""

    whole_prompt: bool = False  # it computes its whole prompt (prompt log-probabilities)
    given_up: str | None = None  # why its disk hit was dropped (``GIVEN_UP_CAUSES``), if it was


PLAIN = Asked()


class _Record:
    """An LRU map of at most ``capacity`` entries (None: unbounded): the newest write of a key
    wins."""

    def __init__(self, capacity: int | None) -> None:
        self.capacity = capacity
        self.items: OrderedDict[int, str] = OrderedDict()

    def put(self, key: int, value: str) -> None:
        items = self.items
        items[key] = value
        items.move_to_end(key)
        if self.capacity is not None and len(items) > self.capacity:
            items.popitem(last=False)

    def get(self, key: int) -> str | None:
        return self.items.get(key)

    def __len__(self) -> int:
        return len(self.items)


class LossAttribution:
    def __init__(
        self, kv: PrefixIndex, disk: DiskLink, *, unit: int, has_gdn: bool, enabled: bool, capacity: int
    ) -> None:
        self.kv, self.link = kv, disk
        self.tree = kv.tree
        self.block_size = kv.block_size
        self.unit, self.has_gdn, self.enabled = unit, has_gdn, enabled
        self.evicted = _Record(capacity)  # block hash -> the tier its KV was last in
        self.outcomes = _Record(capacity)  # block hash ending a boundary -> "skipped" / "evicted"
        self.counters: dict[str, int] = dict.fromkeys(MISS_KEYS, 0)

    @classmethod
    def wire(
        cls, kv: PrefixIndex, ckpts: CheckpointStore, disk: DiskLink, config: CacheManagerConfig, unit: int
    ) -> LossAttribution:
        """One for a cache manager's parts, hooked into the tree (KV and checkpoints leaving)
        and the checkpoint store (captures declined); its records hold ``record_capacity`` of
        the cache's blocks over the device and host tiers."""
        enabled = config.enable_prefix_caching
        page = config.host_page_blocks or -(-config.checkpoint_bytes // max(config.kv_block_bytes, 1))
        host = config.num_host_kv_blocks + config.num_host_pages * page
        capacity = record_capacity(kv.blocks.max_blocks + (host if enabled else 0))
        loss = cls(kv, disk, unit=unit, has_gdn=config.has_gdn, enabled=enabled, capacity=capacity)
        kv.tree.on_remove = loss.kv_gone
        kv.tree.on_checkpoint_gone = loss.checkpoint_gone
        ckpts.note_skip = loss.checkpoint_skipped
        return loss

    def remember_all(self) -> None:
        """Forget nothing from now on: both records grow with every block evicted (about
        150 bytes each). For the simulator, whose ``cold`` is read against the compulsory
        misses of its bounds; a serving engine keeps the bound."""
        self.evicted.capacity = self.outcomes.capacity = None

    # ------------------------------------------------------------------ hooks (O(1))
    def kv_gone(self, node: Node) -> None:
        """``node`` leaves the tree (``RadixTree.on_remove``): its KV was last on the device or
        the host, or on disk when the disk tier holds it (or is about to)."""
        tier = "device" if node.block_id >= 0 else "host"
        disk = self.link.tier
        if disk is not None and (
            disk.store.has(DiskItemKind.KV, node.key) or disk.store.queued(DiskItemKind.KV, node.key)
        ):
            tier = "disk"
        self.evicted.put(node.key, tier)

    def checkpoint_gone(self, key: int) -> None:
        """A checkpoint at the boundary ending block ``key`` left a tier (device or host)."""
        self.outcomes.put(key, "evicted")

    def checkpoint_skipped(self, key: int) -> None:
        """A capture at the boundary ending block ``key`` was declined (budget, pool, value)."""
        self.outcomes.put(key, "skipped")

    # ------------------------------------------------------------------ counting
    def attribute(
        self, query_tokens: int, hit_tokens: int, seq: SeqCache | None, asked: Asked = PLAIN
    ) -> None:
        """Count the ``query_tokens - hit_tokens`` misses of one query by cause (module
        docstring). Without its request view (``seq`` None) or with prefix caching off, every
        miss is ``cold``: nothing was looked up."""
        split = self.split(query_tokens, hit_tokens, seq, asked)
        assert sum(split.values()) == query_tokens - hit_tokens, "miss causes do not sum to the misses"
        counters = self.counters
        for cause, n in split.items():
            counters[MISS_PREFIX + cause] += n

    def recompute(self, tokens: int) -> None:
        """A preempted request came back and recomputes ``tokens`` the cache did not serve."""
        self.counters[MISS_PREFIX + "preemption"] += tokens

    def split(
        self, query_tokens: int, hit_tokens: int, seq: SeqCache | None, asked: Asked = PLAIN
    ) -> dict[str, int]:
        """The misses of one query by cause (only the causes with tokens); sums to
        ``query_tokens - hit_tokens``."""
        misses = query_tokens - hit_tokens
        if misses <= 0:
            return {}
        if seq is None or not self.enabled:
            return {"cold": misses}
        bs = self.block_size
        hashes = seq.hashes
        # the deepest boundary a hit may sit on; past it (or past the hit): granularity
        top = (query_tokens - 1) // self.unit * self.unit
        end = min(max(top, hit_tokens) // bs, len(hashes))
        start = -(-hit_tokens // bs)
        out: dict[str, int] = {}

        def add(cause: str, blocks: int) -> None:
            if blocks > 0:
                out[cause] = out.get(cause, 0) + blocks * bs

        path = self._kv_path(hashes, end)
        kv_end = len(path)
        whole_prompt, given_up = asked
        if whole_prompt:  # the hit it gave up: the deepest checkpoint on its path
            would = kv_end
            while self.has_gdn and would > start and not path[would - 1].has_checkpoint:
                would -= 1
            add("prompt_logprobs", would - start)
            start = max(start, would)
        disk = self.link.tier
        if disk is not None and start < end:
            if given_up in GIVEN_UP_CAUSES:  # up to the checkpoint the fetch would have read
                _, bounds = disk.probe(hashes, start, end)
                if bounds:
                    add(given_up, bounds[0] - start)
                    start = bounds[0]
            # the disk is inclusive: its KV run extends what the tree holds
            kv_end = max(kv_end, disk.probe(hashes, max(kv_end, start), end)[0])
        if kv_end > start:  # KV there, no checkpoint at or before its end
            add(self._why_no_checkpoint(seq, start, kv_end), kv_end - start)
            start = kv_end
        for cause, n in self._past_kv(seq, start, end):
            add(cause, n)
        rest = misses - sum(out.values())
        if rest > 0:
            out["granularity"] = rest
        return out

    def _past_kv(self, seq: SeqCache, start: int, end: int) -> list[tuple[str, int]]:
        """Blocks ``[start, end)`` of ``seq``, KV cached nowhere: (cause, blocks) per block
        computed elsewhere now, evicted (by the tier it was last in), else cold."""
        out: list[tuple[str, int]] = []
        evicted, disk = self.evicted.items, self.link.tier
        for i in range(start, end):
            if self._computing(seq, i):
                out.append(("in_flight", 1))
                continue
            tier = evicted.get(seq.hashes[i])
            if tier is None:  # never cached (or forgotten): nothing deeper was either
                out.append(("cold", end - i))
                break
            if tier == "disk" and disk is None:
                tier = "host"  # (the disk tier was detached since: the host let it go)
            out.append(("kv_evicted_" + tier, 1))
        return out

    def _computing(self, seq: SeqCache, block: int) -> bool:
        """Another admitted request's prompt holds block ``block`` of ``seq``'s (the same
        prefix): it is computing it, or has computed it and not ended yet."""
        held = self.kv.inflight.get(seq.hashes[block], 0)
        return held > (1 if block < seq.num_inflight else 0)

    def _kv_path(self, hashes: list[int], limit: int) -> list[Node]:
        """The nodes of the leading blocks of ``hashes`` (at most ``limit``) whose KV the tree
        holds on any tier, in transit included (``RadixTree.match`` stops before those)."""
        node, path = self.tree.root, []
        for h in hashes[:limit]:
            child = node.children.get(h)
            if child is None:
                break
            path.append(child)
            node = child
        return path

    def _why_no_checkpoint(self, seq: SeqCache, start: int, end: int) -> str:
        """Why blocks ``(start, end]`` of ``seq``, KV there, end no hit: the latest outcome at
        the deepest boundary that has one; else ``in_flight`` when another request's prompt
        holds the stretch's last block (its capture may still come); else never captured.
        A model without GDN layers needs no checkpoint: KV past its hit is in transit."""
        if not self.has_gdn:
            return "in_flight"
        outcomes, hashes = self.outcomes.items, seq.hashes
        for i in range(end, start, -1):
            why = outcomes.get(hashes[i - 1])
            if why is not None:
                return "checkpoint_" + why
        return "in_flight" if self._computing(seq, end - 1) else "checkpoint_never_captured"

    # ------------------------------------------------------------------ integrity
    def check(self, counters: dict[str, int]) -> None:
        """Assert the query causes sum to the misses of every query counted (``counters``: the
        manager's, with ``prefix_cache.query_tokens`` and ``prefix_cache.hit_tokens``)."""
        misses = counters["prefix_cache.query_tokens"] - counters["prefix_cache.hit_tokens"]
        total = sum(self.counters[MISS_PREFIX + c] for c in QUERY_CAUSES)
        assert total == misses, f"miss causes sum to {total}, misses are {misses}"
        for record in (self.evicted, self.outcomes):
            assert record.capacity is None or len(record) <= record.capacity


def record_capacity(cache_blocks: int) -> int:
    """Entries per record for a cache of ``cache_blocks`` KV blocks over its tiers: 8 times that,
    at least 65,536 and at most 1,048,576 (about 150 bytes an entry). An evicted block comes back
    long after: on the simulator's long-reuse trace (2.5 GiB device, 10 GiB host) 99 % of the
    evicted blocks asked again were evicted within 8 times the cache's blocks of evictions."""
    return min(max(8 * cache_blocks, 1 << 16), 1 << 20)
