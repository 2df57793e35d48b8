"""Torch-free cache bookkeeping: KV block pool, GDN state slots, radix prefix index, manager."""

from deltaserve.cache.admission import (
    ADMISSION_POLICIES,
    AdmissionPolicy,
    CaptureContext,
    get_admission_policy,
)
from deltaserve.cache.block_pool import BlockPool
from deltaserve.cache.hashing import block_hashes, hash_block, make_salt
from deltaserve.cache.manager import CacheManager, CacheManagerConfig, Capture, SeqCache, StepItem, StepPlan
from deltaserve.cache.radix_tree import Node, RadixTree
from deltaserve.cache.state_pool import SlotState, StatePool

__all__ = [
    "ADMISSION_POLICIES",
    "AdmissionPolicy",
    "BlockPool",
    "CacheManager",
    "CacheManagerConfig",
    "Capture",
    "CaptureContext",
    "Node",
    "RadixTree",
    "SeqCache",
    "SlotState",
    "StatePool",
    "StepItem",
    "StepPlan",
    "block_hashes",
    "get_admission_policy",
    "hash_block",
    "make_salt",
]
