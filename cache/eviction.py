"""The checkpoint eviction interface: who is displaced, which KV leaf goes, what a checkpoint is worth.

A strategy (``CheckpointEviction``) is chosen by name (``cache/eviction_policies.py``; the
admission policy names one: ``AdmissionPolicy.eviction``) and built with the tree and
``EvictionParams``. It owns one slot on every node it has seen, ``Node.policy_state``, whose
type it defines; nothing else reads it. The checkpoint store, the host tier and the manager
call a strategy only through this interface:

* events: ``on_attach`` (a checkpoint published), ``on_hit`` / ``on_unpin`` (a restore
  pinned / done), ``on_propose`` (a capture proposed, stored or not), ``on_track`` /
  ``on_untrack`` (a decoding request's tracking slot), ``observe`` (an admitted prompt);
* choices: ``order`` (staging order of a step's captures), ``victim`` (the resident a
  capture displaces), ``kv_victim`` (the KV leaf to drop), ``may_take_over`` (a request's
  own restore source as a last resort for its output);
* ``worth`` orders checkpoints on either tier (the host tier evicts its weakest by it).

Torch-free.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from deltaserve.cache.radix_tree import Node, RadixTree
from deltaserve.cache.types import CaptureKind, CheckpointClass, SeqCache

T = TypeVar("T")  # what a caller pairs with each Want in ``order``


@dataclass(frozen=True)
class Want:
    """A capture asking for a slot."""

    kind: CaptureKind
    boundary: int  # tokens
    max_class: CheckpointClass = CheckpointClass.PROVEN  # v1: the highest class it may displace
    own: Node | None = None  # the request's pending restore source (may be reused in-step)
    base: int = 0  # depth (tokens) of the nearest checkpoint above it: a hit falls back there
    history: int | None = None  # the request's path history (ReuseLearner.observe)


@dataclass(frozen=True)
class CostModel:
    """Prefill compute of ``d`` tokens: ``per_token * d + per_token_pair * d * d / 2``."""

    per_token: float = 1.0
    per_token_pair: float = 1.0 / 65536

    def saved(self, tokens: int) -> float:
        return self.per_token * tokens + self.per_token_pair * tokens * tokens / 2


@dataclass(frozen=True)
class EvictionParams:
    """What a strategy is built from (``CacheManagerConfig``, derived)."""

    block_size: int
    unit_blocks: int = 1  # blocks per checkpoint unit
    checkpoint_bytes: int = 0  # one checkpoint (all GDN layers)
    num_checkpoint_slots: int = 0
    cost: CostModel = CostModel()
    # one device budget (cache/arena.py): a checkpoint's bytes include the KV only it keeps
    # reachable (its path below the checkpoint above it); 0 = a fixed split (checkpoint bytes only)
    kv_block_bytes: int = 0


class CheckpointEviction(ABC):
    """Chooses which resident checkpoint a capture displaces, and which KV leaf goes."""

    name = ""
    #: ``worth`` is a value per checkpoint byte (not, say, a recency): with one host budget the
    #: host tier orders by its verdict and by recency instead (``cache/host_order.py``)
    per_byte = False
    #: set by the host tier when its memory is one budget of pages: a capture the host would
    #: keep may push the weakest published checkpoint down even past a weaker tracking slot
    displace_to_host = False

    def __init__(self, tree: RadixTree, params: EvictionParams) -> None:
        self.tree = tree
        self.params = params

    #: whether ``expect_hits`` changes this strategy's choices (the scheduler skips the
    #: waiting requests' matches for a strategy that ignores them)
    values_awaited_hits: bool = False

    # -- events --------------------------------------------------------------------------
    def expect_hits(self, due: dict[Node, int]) -> None:
        """The checkpoints waiting requests would restore from now -> admissions until each
        one's request (1: the next; ``scheduler/awaited.py``), replacing the last such call.
        A strategy that values checkpoints counts those hits as certain; this one ignores them."""
        return None

    @abstractmethod
    def on_attach(self, node: Node, kind: CaptureKind, history: int | None = None) -> None:
        """``node`` just got a checkpoint captured as ``kind`` by a request whose path had
        ``history`` (``observe``; None: unknown). Sets ``node.policy_state``."""

    @abstractmethod
    def on_hit(self, node: Node) -> None:
        """A request will restore from ``node``'s checkpoint (either tier)."""

    @abstractmethod
    def on_unpin(self, node: Node) -> None:
        """A pending restore of ``node``'s checkpoint ran."""

    def on_propose(self, key: int, kind: CaptureKind, history: int | None) -> None:
        """A capture of ``kind`` was proposed at the boundary whose last block hashes to
        ``key``, stored or not."""
        return None

    def observe(self, hashes: Sequence[int], limit_blocks: int, stride: int) -> int | None:
        """An admitted prompt (its block hashes; boundaries every ``stride`` blocks up to
        ``limit_blocks``); returns its path history, or None when not tracked."""
        return None

    def on_track(self, seq: SeqCache) -> None:
        """``seq`` took a tracking slot for its output."""
        return None

    def on_untrack(self, seq: SeqCache, finished: bool) -> None:
        """``seq`` gave up its tracking slot; ``finished``: because its output is done."""
        return None

    def set_cost(self, cost: CostModel) -> None:
        """The model's prefill cost (strategies that weigh compute saved use it)."""
        return None

    # -- choices -------------------------------------------------------------------------
    def order(self, wants: list[tuple[Want, T]]) -> list[tuple[Want, T]]:
        """Staging order of a step's captures (most valuable first)."""
        return wants

    @abstractmethod
    def victim(
        self,
        want: Want,
        residents: Iterable[Node],
        trackers: Iterable[SeqCache] = (),
        host_floor: float = math.inf,
    ) -> tuple[Node | SeqCache | None, str]:
        """The evictable resident (or tracking request) ``want`` may displace, or ``(None,
        reason)``: ``"pool"`` (nothing evictable) or ``"value"`` (nothing worth less).
        ``host_floor``: the worth below which the host tier takes a demoted checkpoint (a
        resident above it moves to the host rather than ``want`` being lost)."""

    def kv_victim(self, residents: Iterable[Node]) -> Node | None:
        """The unpinned KV leaf to drop next (its checkpoint goes with it), or None."""
        return self.tree.peek_evictable_leaf()

    def may_take_over(self, source: Node | None) -> bool:
        """An output capture that found no slot may take the checkpoint its request resumed
        from (``source``)."""
        return False

    @abstractmethod
    def worth(self, node: Node) -> float:
        """What ``node``'s checkpoint is worth, on either tier (lower goes first)."""

    def likely_to_serve(self, node: Node) -> bool:
        """Whether ``node``'s checkpoint is expected to serve a hit more often than not (a
        strategy that does not learn reuse cannot tell: yes)."""
        return True

    def dominates(self, deeper: Node, node: Node) -> bool:
        """Whether ``deeper``'s checkpoint, on ``node``'s unforked path below it, takes the hits
        that would reach ``node``'s: expected to serve more often than not (the default: the
        strategy's ``likely_to_serve``)."""
        return self.likely_to_serve(deeper)

    # -- upkeep --------------------------------------------------------------------------
    def compact(self, num_nodes: int) -> None:
        """Drop stale bookkeeping when it dominates (``num_nodes``: the tree's size)."""
        return None

    def stats(self) -> dict[str, float]:
        return {}
