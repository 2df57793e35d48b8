"""Workloads by name: ``WORKLOADS``, the pressure shapes, ``make_workload``, ``workload_names``."""

from __future__ import annotations

from deltaserve.tools.workloads.agent import AgentWorkload, SWEAgentWorkload
from deltaserve.tools.workloads.chat import ChatWorkload, MultiTurnWorkload
from deltaserve.tools.workloads.codecs import Codec
from deltaserve.tools.workloads.independent import (
    PrefixRepetitionWorkload,
    RandomWorkload,
    SharedPrefixWorkload,
    ShiftedPrefixWorkload,
)
from deltaserve.tools.workloads.long_reuse import LongReuseWorkload
from deltaserve.tools.workloads.tenants import TenantsShiftWorkload, TenantsWorkload
from deltaserve.tools.workloads.trace import TraceWorkload
from deltaserve.tools.workloads.tree import TreeWorkload
from deltaserve.tools.workloads.workload import Workload, WorkloadParams

WORKLOADS: dict[str, type[Workload]] = {
    cls.name: cls
    for cls in (
        ChatWorkload,
        SharedPrefixWorkload,
        PrefixRepetitionWorkload,
        ShiftedPrefixWorkload,
        AgentWorkload,
        RandomWorkload,
        TraceWorkload,
        MultiTurnWorkload,
        SWEAgentWorkload,
        TreeWorkload,
        TenantsWorkload,
        TenantsShiftWorkload,
        LongReuseWorkload,
    )
}


#: more conversations than the pools hold (``--workload pressure``)
PRESSURE_WORKLOADS = ("multi-turn", "swe-agent", "tree", "tenants")

#: big, open-loop shapes for a host tier, run only by name (not in ``all`` or ``pressure``)
LARGE_WORKLOADS = ("long-reuse",)

#: shapes run only by name (not in ``all``): variants of a pressure shape
VARIANT_WORKLOADS = ("tenants-shift",)


def make_workload(params: WorkloadParams, codec: Codec) -> Workload:
    try:
        cls = WORKLOADS[params.name]
    except KeyError:
        raise ValueError(f"unknown workload {params.name!r}; known: {', '.join(WORKLOADS)}") from None
    return cls(params, codec)


def workload_names(spec: str) -> list[str]:
    """``all``: the small shapes (every workload but trace, the pressure and the large shapes);
    ``pressure``: ``PRESSURE_WORKLOADS``; else a comma list."""
    if spec == "all":
        names = [
            n
            for n in WORKLOADS
            if n != "trace" and n not in PRESSURE_WORKLOADS + LARGE_WORKLOADS + VARIANT_WORKLOADS
        ]
    elif spec == "pressure":
        names = list(PRESSURE_WORKLOADS)
    else:
        names = [n.strip() for n in spec.split(",") if n.strip()]
    for n in names:
        if n not in WORKLOADS:
            raise ValueError(f"unknown workload {n!r}; known: {', '.join(WORKLOADS)}")
    return names
