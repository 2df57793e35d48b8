"""The host tier's order for one host budget under a per-byte value strategy: alive, then recent.

Items reach the host after hundreds of requests; there the value model's fine ranking (hit
density x compute saved per byte) kept fewer of the conversations that came back than recency
did, while its coarse verdict — will this checkpoint serve at all? — is what keeps finished
conversations off the host. So the host ranks a checkpoint in three bands (``band``):

* ``DOMINATED`` (-1): a deeper checkpoint, in either tier, lies on its unforked path below, and
  the strategy says it takes this one's hits (``CheckpointEviction.dominates``: the learner
  expects that one's class to serve more often than not, or at least as often as this one's):
  every hit that reaches this one goes on to the deeper one, so this one serves only if that
  one is lost. So a conversation keeps about one checkpoint on the host, its deepest;
* ``DEAD`` (0): the strategy prices it at nothing (the learner expects no hit at its age);
* ``ALIVE`` (1): the rest.

Within a band the host's existing tie-break applies (least recently used first; a newcomer
wins a tie), so among live, undominated items the host is an LRU. A dominated checkpoint is
not refused on its way down: it takes room only while nothing weaker than it is held, and goes
first. Pure functions over the tree; the cost is a walk down the unforked chain below a
checkpoint (a leaf: none).
"""

from __future__ import annotations

from deltaserve.cache.eviction import CheckpointEviction
from deltaserve.cache.radix_tree import Node

DOMINATED, DEAD, ALIVE = -1.0, 0.0, 1.0


def deeper_checkpoint(node: Node) -> Node | None:
    """The nearest checkpoint (either tier) below ``node`` on a path with no fork, or None."""
    below = node
    while len(below.children) == 1:
        below = next(iter(below.children.values()))
        if below.checkpoint_slot is not None or below.host_slot is not None:
            return below
    return None


def band(node: Node, eviction: CheckpointEviction) -> float:
    """``node``'s host checkpoint's band: ``DOMINATED``, ``DEAD`` or ``ALIVE``."""
    deeper = deeper_checkpoint(node)
    if deeper is not None and eviction.dominates(deeper, node):
        return DOMINATED
    return ALIVE if eviction.worth(node) > 0 else DEAD
