"""Types shared by the cache's parts: capture kinds, a request's cache view, step plans.

Torch-free. The parts (``prefix_index``, ``checkpoint_store``, ``planning``, the eviction
strategies) and the façade (``manager``) speak in these.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from deltaserve.cache.radix_tree import Node


class Tier(enum.Enum):
    """Where a disk save reads its bytes."""

    DEVICE = "device"
    HOST = "host"


class DiskItemKind(enum.IntEnum):
    """What a disk item holds (the store's kinds, ``cache/disk_store.py``)."""

    KV = 1  # one KV block, every attention layer
    CHECKPOINT = 2  # one GDN checkpoint, every GDN layer


@dataclass(frozen=True, slots=True)
class DiskSave:
    """One item to copy out to the disk tier: ``src`` is a block id (KV) or checkpoint slot
    in ``tier``; ``key`` its chained block hash, ``parent`` the hash of the KV block before
    it (a checkpoint's parent is the KV block it ends: the same key); ``cost`` what a hit
    through it saves, in tokens of prefill (0 for KV: its value is the checkpoints')."""

    kind: DiskItemKind
    key: int
    parent: int
    tier: Tier
    src: int
    cost: float


class CheckpointClass(enum.IntEnum):
    """``v1`` eviction classes (lowest evicted first; LRU within a class)."""

    DOMINATED = 0  # a deeper checkpoint sits below it on a single-child chain
    SPECULATIVE = 1  # never restored from yet: a finished request's tail or output
    PROVEN = 2  # restored from, or taken where two trajectories diverge


class CheckpointGranularity(str, enum.Enum):
    """Where hits and tail / branch / output captures may sit (``cache.checkpoint_granularity``).

    ``block``: any block boundary; a capture off the GDN kernel's 64-token chunk grid costs one
    partial chunk (``kernels/capture_align.py``), and a hit loses less than one block of a turn.
    ``chunk``: multiples of lcm(block_size, GDN chunk), where captures are free but a hit loses
    up to a chunk. Interval captures stay on the chunk grid either way.
    """

    BLOCK = "block"
    CHUNK = "chunk"


class CaptureKind(enum.Enum):
    """Where a checkpoint is taken (``cache/admission.py``).

    ``rank``: the order ``v1`` stages captures in (lower first). ``may_evict``: the highest
    ``v1`` class a capture of this kind may displace (a tail is further restricted to
    dominated checkpoints when its request tracks an output: see ``CheckpointStore``).
    ``label``: the name in stats and reports.
    """

    BRANCH = ("branch", 0, CheckpointClass.PROVEN)
    TAIL = ("tail", 1, CheckpointClass.SPECULATIVE)
    OUTPUT = ("output", 2, CheckpointClass.SPECULATIVE)
    STEP = ("step", 3, CheckpointClass.SPECULATIVE)
    UNIT = ("unit", 3, CheckpointClass.SPECULATIVE)
    INTERVAL = ("interval", 4, CheckpointClass.SPECULATIVE)

    def __init__(self, label: str, rank: int, may_evict: CheckpointClass) -> None:
        self.label = label
        self.rank = rank
        self.may_evict = may_evict

    def __str__(self) -> str:
        return self.label


class TransferKind(enum.Enum):
    """A copy between tiers: device and host (``cache/host_tier.py``), disk (``cache/disk_tier.py``)."""

    KV_SAVE = "kv_save"  # device KV block -> host block (demotion)
    CKPT_SAVE = "ckpt_save"  # device checkpoint slot -> host checkpoint slot (demotion)
    KV_LOAD = "kv_load"  # host block -> device block (promotion of a hit)
    STATE_LOAD = "state_load"  # host checkpoint slot -> the request's live slot (a restore)
    # host KV block -> another host block: a KV page vacated for a checkpoint (one host budget);
    # planned with the saves and run before them (a checkpoint's save may write that page)
    KV_MOVE = "kv_move"
    # a disk hit, read and verified before admission (``Transfer.payload``): its KV into the
    # request's private blocks, its checkpoint into the request's live slot
    DISK_KV_LOAD = "disk_kv_load"
    DISK_STATE_LOAD = "disk_state_load"

    @property
    def is_load(self) -> bool:
        return self in (TransferKind.KV_LOAD, TransferKind.STATE_LOAD)

    @property
    def from_disk(self) -> bool:
        return self in (TransferKind.DISK_KV_LOAD, TransferKind.DISK_STATE_LOAD)

    @property
    def is_kv(self) -> bool:
        return self in (TransferKind.KV_SAVE, TransferKind.KV_LOAD, TransferKind.KV_MOVE)


@dataclass(eq=False)
class Transfer:
    """One item copied between tiers: ``src`` and ``dst`` are block ids (KV) or slot ids
    (checkpoints; a live slot for ``STATE_LOAD``) in their tiers' id spaces. A disk load has
    no node and no source id: its bytes are ``payload``."""

    kind: TransferKind
    node: Node | None
    src: int
    dst: int
    seq: SeqCache | None = None  # loads: the request waiting for it
    staged: bool = False  # in the next (or in-flight) step's plan
    payload: bytes | None = None  # a disk load's verified bytes

    @property
    def nbytes_hint(self) -> int:
        """A disk load's size (host copies are sized by the host tier)."""
        return len(self.payload) if self.payload is not None else 0


@dataclass(eq=False)
class SeqCache:
    """One request's view of the cache. Owned by the manager, held by the request.

    Block table layout::

        block_table: [ n_0 ... n_{k-1} | p_k ... p_{m-1} ]
                       ^ nodes[i].block_id   ^ private blocks, owned by the request
                       (pinned tree nodes)     (the last may be partial; never shared)
    """

    request_id: str
    salt: bytes
    prompt_len: int
    block_table: list[int] = field(default_factory=list)
    nodes: list[Node] = field(default_factory=list)  # pinned path, one per leading block
    state_slot: int = -1  # live GDN state slot (-1: model has no GDN layers)
    restore_node: Node | None = None  # checkpoint to copy into state_slot before the first step
    restored_from: Node | None = None  # the checkpoint the request resumed from (after the copy)
    num_cached_tokens: int = 0  # hit length at admission
    branch_boundary: int = 0
    tracking_slot: int = -1  # output-checkpoint slot during decode
    tracking_boundary: int = 0  # boundary the tracking slot holds (0: nothing valid)
    tracking_since: int = 0  # value model: when the tracking slot was taken (admissions)
    tracking_base: int = 0  # value model: depth of the nearest checkpoint above the tracked output
    history: int | None = None  # value model: boundaries proposed on the prompt's path before it
    # chained hashes of the request's full blocks; the same list the request keeps
    # (``Request.block_hashes``), extended as tokens arrive, so nothing is hashed twice
    hashes: list[int] = field(default_factory=list)
    num_inflight: int = 0  # leading ``hashes`` registered as in flight while active
    pending_tracking_boundary: int = 0  # boundary being written by the in-flight step
    # host tier: copies that must land before the request computes (its hit's host KV
    # blocks, and its restore when the checkpoint is on the host), oldest first
    loads: list[Transfer] = field(default_factory=list)
    host_hit_tokens: int = 0  # tokens of the hit whose KV came from the host tier
    disk_hit_tokens: int = 0  # tokens of the hit read from the disk tier
    load_since: float = 0.0  # time.monotonic() at admission, while loads are pending


@dataclass(frozen=True)
class PrefixMatch:
    """The result of matching a prompt against the index, valid while ``version`` is the
    index's (``PrefixIndex.version`` moves on every insert, removal, attach and detach)."""

    path: list[Node]  # matched nodes over the prompt's full blocks
    hit_blocks: int  # joint-hit length in blocks
    hashes: list[int]  # the prompt's block hashes (the caller's list, extended)
    num_tokens: int  # len(prompt) matched
    version: int
    block_size: int

    @property
    def hit_tokens(self) -> int:
        return self.hit_blocks * self.block_size


@dataclass(slots=True)
class StepItem:
    """One request's piece of a step: tokens ``[start, end)`` get computed."""

    seq: SeqCache
    token_ids: Sequence[int]  # the request's tokens (prompt + output so far)
    start: int
    end: int
    is_decode: bool


@dataclass(frozen=True)
class CaptureCandidate:
    """A boundary ``planning.plan_captures`` proposes for one item of a step."""

    item_index: int
    boundary: int
    kind: CaptureKind


@dataclass
class Capture:
    item_index: int  # index into StepPlan.items
    boundary: int  # absolute token boundary
    slot: int
    kind: CaptureKind

    @property
    def tracking(self) -> bool:
        """Written into the request's tracking slot (published at finish), not a fresh slot."""
        return self.kind is CaptureKind.OUTPUT


@dataclass
class StepPlan:
    items: list[StepItem]
    restores: list[tuple[int, int]] = field(default_factory=list)  # (checkpoint slot, live slot)
    captures: list[Capture] = field(default_factory=list)  # written by the prefill kernels
    decode_copies: list[tuple[int, int]] = field(
        default_factory=list
    )  # (live slot, tracking slot) after forward
    restored: list[SeqCache] = field(default_factory=list)
    reserved: list[int] = field(default_factory=list)  # slots in RESERVED state for captures
    # host tier, run before everything else in the step (saves first: a demoted item's
    # device block or slot may be reused by this very step); they land (or fail) before the
    # forward's results are committed (``CacheManager.land_transfers``)
    saves: list[Transfer] = field(default_factory=list)
    loads: list[Transfer] = field(default_factory=list)
    # (src, dst) device KV blocks copied after the saves, before the loads: a KV page vacated
    # for a checkpoint (shared budget, ``cache/arena.py``); part of the copies that land
    moves: list[tuple[int, int]] = field(default_factory=list)
    # items copied out to the disk tier, first of all (before the host saves and moves may
    # overwrite what they read); the runner hands the bytes to the store's writer and
    # nothing waits for the disk
    disk_saves: list[DiskSave] = field(default_factory=list)
    landed: bool = False


class AdmitStatus(enum.Enum):
    """How one ``CacheManager.admit_request`` ended."""

    ADMITTED = "admitted"  # blocks for its first chunk are allocated: it computes this step
    LOADING = "loading"  # its hit has copies to land first (host or disk): it computes after
    WAITING = "waiting"  # its disk hit is being read, or another request computes its prefix now
    NO_FIT = "no_fit"  # not this step (no chunk, live slot or blocks for it); nothing held


@dataclass(slots=True)
class Admission:
    """The result of one admission: ``seq`` (ADMITTED and LOADING) is the request's cache
    view; its first chunk is ``[start, end)`` (``start``: the cached tokens; LOADING: empty)."""

    status: AdmitStatus
    seq: SeqCache | None = None
    start: int = 0
    end: int = 0
