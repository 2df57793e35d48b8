"""Torch-free cache bookkeeping: KV prefix index, checkpoint store, eviction strategies, manager."""

from deltaserve.cache.admission import (
    ADMISSION_POLICIES,
    AdmissionPolicy,
    CaptureContext,
    get_admission_policy,
)
from deltaserve.cache.block_pool import BlockPool
from deltaserve.cache.eviction import CheckpointEviction, CostModel, EvictionParams
from deltaserve.cache.eviction_policies import EVICTION_POLICIES, make_eviction, register_eviction_policy
from deltaserve.cache.hashing import block_hashes, hash_block, make_salt
from deltaserve.cache.manager import CacheManager, CacheManagerConfig, checkpoint_unit
from deltaserve.cache.radix_tree import Node, RadixTree
from deltaserve.cache.reuse import ReuseLearner
from deltaserve.cache.state_pool import SlotState, StatePool
from deltaserve.cache.types import (
    Admission,
    AdmitStatus,
    Capture,
    CaptureKind,
    CheckpointClass,
    CheckpointGranularity,
    PrefixMatch,
    SeqCache,
    StepItem,
    StepPlan,
)
from deltaserve.cache.v1_eviction import V1Eviction
from deltaserve.cache.value_eviction import ValueEviction

__all__ = [
    "ADMISSION_POLICIES",
    "EVICTION_POLICIES",
    "Admission",
    "AdmitStatus",
    "AdmissionPolicy",
    "BlockPool",
    "CacheManager",
    "CacheManagerConfig",
    "Capture",
    "CaptureContext",
    "CaptureKind",
    "CheckpointClass",
    "CheckpointEviction",
    "CheckpointGranularity",
    "CostModel",
    "EvictionParams",
    "Node",
    "PrefixMatch",
    "RadixTree",
    "ReuseLearner",
    "SeqCache",
    "SlotState",
    "StatePool",
    "StepItem",
    "StepPlan",
    "V1Eviction",
    "ValueEviction",
    "block_hashes",
    "checkpoint_unit",
    "get_admission_policy",
    "hash_block",
    "make_eviction",
    "make_salt",
    "register_eviction_policy",
]
