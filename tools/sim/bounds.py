"""Offline ceilings for the cache-policy simulator: KV alone, requests served one by one.

A hybrid model hits only where KV *and* a checkpoint exist, and the real run overlaps
requests (running ones pin memory). Dropping both gives a ceiling every checkpoint policy is
measured against at the same KV memory:

* ``kv_only_lru`` — the engine's own ``CacheManager`` with no GDN layers (plain KV prefix
  caching, LRU leaves), each request admitted, computed whole (prompt + output) and freed
  before the next one arrives;
* ``kv_only_belady`` — the same sequence with Belady's eviction (the cached block whose next
  use is farthest goes first; deeper first on ties, so a prefix never loses its parent
  before its child): what a clairvoyant KV cache of that size could hit.

Both count hits as the simulator does: the longest cached prefix of full blocks, at most
``len(prompt) - 1`` tokens, summed over requests and divided by the prompt tokens. Requests
come in the order a run submitted them: the oracle's, or with ``--bounds`` and no oracle the
first policy's (open-loop arrivals, a trace's among them, are submitted in arrival order
whatever the policy). ``kv_only_lru_split`` also says where the
LRU bound's prompt tokens went (``KvLruSplit``: hit, compulsory, capacity, granularity, summing
exactly to the prompt tokens), the counterpart of the engine's miss causes (``cache/loss.py``).
Torch-free.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from deltaserve.cache.hashing import block_hashes
from deltaserve.cache.manager import CacheManager, CacheManagerConfig

#: (prompt token ids, output token ids) of one request, in service order
Served = tuple[Sequence[int], Sequence[int]]


def _next_use(occurrences: dict[int, list[int]], never: int) -> Callable[[int, int], int]:
    """``next_use(h, after)``: the first request index after ``after`` in ``h``'s sorted
    ``occurrences``, or ``never``."""

    def next_use(h: int, after: int) -> int:
        occ = occurrences.get(h)
        if not occ:
            return never
        k = bisect.bisect_right(occ, after)
        return occ[k] if k < len(occ) else never

    return next_use


@dataclass(frozen=True)
class KvLruSplit:
    """The prompt tokens of the KV-only LRU bound by outcome; the four parts sum to ``prompt``.

    A prompt's blocks past its hit, up to its last usable full block, are ``compulsory`` when
    no earlier request of the run wrote that block (its first reference; every deeper block is
    one too, since hashes chain) and ``capacity`` when one did and LRU evicted it since (or the
    request needs more blocks than the KV has: it is computed without the cache); the
    tail past the last usable full block (at most ``len(prompt) - 1`` tokens can hit) is
    ``granularity``."""

    prompt: int = 0
    hit: int = 0
    compulsory: int = 0
    capacity: int = 0
    granularity: int = 0

    def __post_init__(self) -> None:
        parts = self.hit + self.compulsory + self.capacity + self.granularity
        assert parts == self.prompt, f"KV-LRU split sums to {parts}, prompt tokens are {self.prompt}"

    @property
    def hit_rate(self) -> float:
        return self.hit / self.prompt if self.prompt else 0.0


def kv_only_lru(requests: Sequence[Served], kv_blocks: int, block_size: int) -> float:
    """Token hit rate of plain LRU KV prefix caching, one request at a time."""
    return kv_only_lru_split(requests, kv_blocks, block_size).hit_rate


def kv_only_lru_split(requests: Sequence[Served], kv_blocks: int, block_size: int) -> KvLruSplit:
    """Plain LRU KV prefix caching, one request at a time: its prompt tokens by outcome."""
    cm = CacheManager(
        CacheManagerConfig(block_size=block_size, num_kv_blocks=kv_blocks, has_gdn=False, num_live_slots=0)
    )
    bs = block_size
    written: set[int] = set()  # every block hash a request of this run has written
    prompt_total = hit = compulsory = capacity = granularity = 0
    for i, (prompt, output) in enumerate(requests):
        tokens = list(prompt) + list(output)
        computed = len(tokens) - 1 if output else len(tokens)  # the last sampled token is never computed
        usable = (len(prompt) - 1) // bs if prompt else 0  # full blocks a hit may cover
        prompt_total += len(prompt)
        granularity += len(prompt) - usable * bs
        seq = None
        if cm.can_ever_fit(computed):
            seq = cm.admit(f"r{i}", tokens[: len(prompt)], b"", prompt_len=len(prompt))
            assert seq is not None
        hashes = seq.hashes if seq is not None else block_hashes(tokens[: usable * bs], bs, b"")
        served = seq.num_cached_tokens if seq is not None else 0
        assert served % bs == 0 and served <= usable * bs, "a KV-only hit is whole usable blocks"
        hit += served
        for h in hashes[served // bs : usable]:
            if h in written:
                capacity += bs
            else:
                compulsory += bs
        if seq is None:
            continue  # never fits: computed without the cache, writing nothing to it
        assert cm.allocate(seq, computed)
        cm.publish(seq, tokens, computed)
        assert len(seq.hashes) >= computed // bs
        written.update(seq.hashes[: computed // bs])
        cm.free(seq, publish_output=False)
    return KvLruSplit(prompt_total, hit, compulsory, capacity, granularity)


def request_blocks(prompt: Sequence[int], output: Sequence[int], block_size: int) -> tuple[list[int], int]:
    """The hashes of the full blocks a served request computes (prompt and output, less the
    last sampled token, which is never computed) and how many of them a hit may cover (at
    most ``len(prompt) - 1`` tokens)."""
    tokens = list(prompt) + list(output)
    computed = len(tokens) - 1 if output else len(tokens)
    hashes = block_hashes(tokens[:computed], block_size, b"")
    return hashes, min((len(prompt) - 1) // block_size, len(hashes)) if prompt else 0


def _kv_hashes(
    requests: Sequence[Served], block_size: int
) -> tuple[list[list[int]], list[list[int]], dict[int, list[int]]]:
    """Per request: the block hashes it can hit on (at most len(prompt) - 1 tokens), the ones
    its computed tokens fill; and per hash the requests that can hit on it."""
    usable: list[list[int]] = []
    written: list[list[int]] = []
    occurrences: dict[int, list[int]] = {}
    for i, (prompt, output) in enumerate(requests):
        hashes, n_usable = request_blocks(prompt, output, block_size)
        usable.append(hashes[:n_usable])
        written.append(hashes)
        for h in hashes[:n_usable]:
            occurrences.setdefault(h, []).append(i)
    return usable, written, occurrences


def _evict_farthest(
    cached: dict[int, tuple[int, int]], heap: list[tuple[int, int, int]], count: int, mine: set[int]
) -> None:
    """Drop ``count`` cached blocks, farthest next use first (deepest first among equals),
    never one of ``mine`` (the request in flight uses them)."""
    kept: list[tuple[int, int, int]] = []
    while count > 0:
        neg_use, neg_depth, h = heapq.heappop(heap)
        entry = cached.get(h)
        if entry is None or entry != (-neg_use, -neg_depth):
            continue  # stale
        if h in mine:
            kept.append((neg_use, neg_depth, h))  # in use by this request: not now
            continue
        del cached[h]
        count -= 1
    for e in kept:
        heapq.heappush(heap, e)


def kv_only_belady(requests: Sequence[Served], kv_blocks: int, block_size: int) -> float:
    """Token hit rate of a clairvoyant (Belady) KV block cache, one request at a time."""
    usable, written, occurrences = _kv_hashes(requests, block_size)
    never = len(requests) + 1
    next_use = _next_use(occurrences, never)

    cached: dict[int, tuple[int, int]] = {}  # hash -> (next use, depth)
    heap: list[tuple[int, int, int]] = []  # (-next use, -depth, hash), lazily invalidated
    hit = total = 0
    for i, (prompt, _) in enumerate(requests):
        total += len(prompt)
        hashes = written[i]
        if len(hashes) > kv_blocks:
            continue
        n = 0
        for h in usable[i]:
            if h not in cached:
                break
            n += 1
        hit += n * block_size
        new = [h for h in hashes if h not in cached]
        _evict_farthest(cached, heap, len(cached) + len(new) - kv_blocks, set(hashes))
        for depth, h in enumerate(hashes):
            entry = (next_use(h, i), depth)
            if cached.get(h) != entry:
                cached[h] = entry
                heapq.heappush(heap, (-entry[0], -depth, h))
        if len(heap) > 4 * (len(cached) + 64):
            heap = [(-u, -d, h) for h, (u, d) in cached.items()]
            heapq.heapify(heap)
    return hit / total if total else 0.0


def _checkpoint_paths(
    requests: Sequence[Served], block_size: int, unit: int
) -> tuple[list[list[int]], list[list[int]]]:
    """Per request: the hashes at its usable unit boundaries (shallow to deep), and what it
    captures (its tail, its branch point with earlier requests, its output)."""
    stride = unit // block_size
    paths: list[list[int]] = []
    captures: list[list[int]] = []
    seen: set[int] = set()
    for prompt, output in requests:
        tokens = list(prompt) + list(output)
        hashes = block_hashes(tokens[: max(len(tokens) - 1, 0)], block_size, b"")
        usable = (len(prompt) - 1) // unit * stride if prompt else 0
        path = [hashes[n - 1] for n in range(stride, min(usable, len(hashes)) + 1, stride)]
        paths.append(path)
        shared = 0
        while shared < min(usable, len(hashes)) and hashes[shared] in seen:
            shared += 1
        seen.update(hashes)
        caps = [path[-1]] if path else []
        if shared // stride and shared // stride < len(path):
            caps.append(path[shared // stride - 1])
        out_blocks = len(hashes) // stride * stride
        if out_blocks > usable:
            caps.append(hashes[out_blocks - 1])
        captures.append(caps)
    return paths, captures


def _checkpoint_uses(paths: list[list[int]], captures: list[list[int]]) -> dict[int, list[int]]:
    """A checkpoint is "used" by the requests it would serve with every capture kept: those
    whose deepest earlier-captured boundary it is (a shallower one on the same path is not)."""
    occurrences: dict[int, list[int]] = {}
    captured: set[int] = set()
    for i, path in enumerate(paths):
        for h in reversed(path):
            if h in captured:
                occurrences.setdefault(h, []).append(i)
                break
        captured.update(captures[i])
    return occurrences


def checkpoint_belady(requests: Sequence[Served], slots: int, block_size: int, unit: int) -> float:
    """Token hit rate with unlimited KV and ``slots`` checkpoints kept by Belady's rule.

    Each request captures its tail (deepest unit boundary <= len(prompt) - 1), its output
    (deepest unit boundary of prompt + output) and its branch (the deepest unit boundary it
    shares with an earlier request); a request hits the deepest resident
    checkpoint on its path. A capture is kept when its next use comes sooner than the
    farthest next use among residents (which it then replaces). The hybrid ceiling at this
    checkpoint memory, KV aside (clairvoyant, so not reachable online)."""
    paths, captures = _checkpoint_paths(requests, block_size, unit)
    never = len(requests) + 1
    next_use = _next_use(_checkpoint_uses(paths, captures), never)

    resident: set[int] = set()
    hit = total = 0
    for i, (prompt, _) in enumerate(requests):
        total += len(prompt)
        path = paths[i]
        for n in range(len(path), 0, -1):
            if path[n - 1] in resident:
                hit += n * unit
                break
        for h in captures[i]:
            if h in resident or slots <= 0:
                continue
            use = next_use(h, i)
            if use == never:
                continue
            if len(resident) < slots:
                resident.add(h)
                continue
            far = max(resident, key=lambda r: next_use(r, i))
            if next_use(far, i) > use:
                resident.discard(far)
                resident.add(h)
    return hit / total if total else 0.0
