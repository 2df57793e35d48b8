"""Torch-free cache bookkeeping: KV block pool, GDN state slots, radix prefix index, manager."""

from cache.admission import ADMISSION_POLICIES, AdmissionPolicy, CaptureContext, get_admission_policy
from cache.block_pool import BlockPool
from cache.hashing import block_hashes, hash_block, make_salt
from cache.manager import CacheManager, CacheManagerConfig, Capture, SeqCache, StepItem, StepPlan
from cache.radix_tree import Node, RadixTree
from cache.state_pool import SlotState, StatePool

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
