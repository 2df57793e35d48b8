"""Torch-free cache bookkeeping: KV prefix index, checkpoint store, value model, manager."""

from deltaserve.cache.admission import (
    ADMISSION_POLICIES,
    AdmissionPolicy,
    CaptureContext,
    get_admission_policy,
)
from deltaserve.cache.block_pool import BlockPool
from deltaserve.cache.hashing import block_hashes, hash_block, make_salt
from deltaserve.cache.manager import CacheManager, CacheManagerConfig
from deltaserve.cache.radix_tree import Node, RadixTree
from deltaserve.cache.state_pool import SlotState, StatePool
from deltaserve.cache.types import (
    Capture,
    CaptureKind,
    CheckpointClass,
    PrefixMatch,
    SeqCache,
    StepItem,
    StepPlan,
)
from deltaserve.cache.value import CostModel, ReuseLearner

__all__ = [
    "ADMISSION_POLICIES",
    "AdmissionPolicy",
    "BlockPool",
    "CacheManager",
    "CacheManagerConfig",
    "Capture",
    "CaptureContext",
    "CaptureKind",
    "CheckpointClass",
    "CostModel",
    "Node",
    "PrefixMatch",
    "RadixTree",
    "ReuseLearner",
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
