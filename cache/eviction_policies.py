"""The registry of checkpoint eviction strategies, by name (``AdmissionPolicy.eviction``).

Built-ins: ``value`` (``cache/value_eviction.py``, the default's) and ``v1``
(``cache/v1_eviction.py``). A strategy implements ``CheckpointEviction``
(``cache/eviction.py``) and is built as ``cls(tree, params)``. Torch-free.
"""

from __future__ import annotations

from deltaserve.cache.eviction import CheckpointEviction, EvictionParams
from deltaserve.cache.radix_tree import RadixTree
from deltaserve.cache.v1_eviction import V1Eviction
from deltaserve.cache.value_eviction import ValueEviction

EVICTION_POLICIES: dict[str, type[CheckpointEviction]] = {
    cls.name: cls for cls in (ValueEviction, V1Eviction)
}


def register_eviction_policy(cls: type[CheckpointEviction]) -> type[CheckpointEviction]:
    """Class decorator adding a strategy to the registry under ``cls.name``."""
    if not cls.name:
        raise ValueError("a registered eviction strategy needs a non-empty name")
    EVICTION_POLICIES[cls.name] = cls
    return cls


def make_eviction(name: str, tree: RadixTree, params: EvictionParams) -> CheckpointEviction:
    try:
        cls = EVICTION_POLICIES[name]
    except KeyError:
        known = ", ".join(sorted(EVICTION_POLICIES))
        raise ValueError(f"unknown eviction strategy {name!r}; known: {known}") from None
    return cls(tree, params)
