"""Continuous-batching scheduler and pluggable policies. Torch-free."""

from deltaserve.scheduler.policy import (
    POLICIES,
    FCFSPolicy,
    LPMPolicy,
    PolicyContext,
    PriorityPolicy,
    SchedulingPolicy,
    SJFPolicy,
    make_policy,
    register_policy,
    resolve_policy_class,
)
from deltaserve.scheduler.request import Request, RequestStatus
from deltaserve.scheduler.scheduler import ScheduledSeq, Scheduler, SchedulerOutput

__all__ = [
    "POLICIES",
    "FCFSPolicy",
    "LPMPolicy",
    "PolicyContext",
    "PriorityPolicy",
    "Request",
    "RequestStatus",
    "SJFPolicy",
    "ScheduledSeq",
    "Scheduler",
    "SchedulerOutput",
    "SchedulingPolicy",
    "make_policy",
    "register_policy",
    "resolve_policy_class",
]
