"""Checkpoint admission policies: where GDN-state checkpoints are taken.

A policy sees one scheduled piece of a request (tokens ``[start, end)`` computed this
step) and names the checkpoint-unit boundaries in ``(start, end]`` worth capturing, most
valuable first (the staging budget may cut the list short). Policies are tiny and
torch-free; they live in a registry chosen by ``cache.checkpoint_policy`` so that the
simulator (``tools/simulate_cache.py``) can compare them on the same workload.

Each policy also names the eviction strategy its checkpoints live under (``eviction``: a
name in ``cache/eviction_policies.py``, ``value`` or ``v1``). ``default`` is tail + branch +
output + interval under the value model; ``v1`` is the same boundaries under the class +
LRU rules (kept for comparison, ``docs/cache.md``), as are the simulator's reference
policies below.

Kinds of boundary (``CaptureKind``; DESIGN.md, "Where checkpoints are taken"):

==========  ===================================================================
``tail``    deepest unit boundary <= len(prompt) - 1: the next turn hits here
``branch``  the divergence point of a prompt that shares more of a cached path
            than that path's deepest checkpoint covers (proven shared)
``output``  last unit boundary of prompt + output, tracked during decode and
            published when the request finishes (agent loops resend outputs)
``interval`` every ``checkpoint_interval`` tokens
``step``    the last unit boundary of each computed piece (vLLM-style)
``unit``    every unit boundary (the simulator's oracle)
==========  ===================================================================
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from deltaserve.cache.types import CaptureKind


@dataclass(frozen=True)
class CaptureContext:
    start: int  # tokens already computed before this step
    end: int  # tokens computed after this step
    target_len: int  # tokens the request must compute before its next sample
    prompt_len: int
    unit: int
    interval: int  # 0 = off
    hit: int  # boundary the request resumed from at admission
    branch: int  # divergence boundary found at admission (0 = none)


def _in_range(b: int, ctx: CaptureContext) -> bool:
    return ctx.start < b <= ctx.end and b > 0 and b % ctx.unit == 0


class AdmissionPolicy(ABC):
    """Chooses prefill capture boundaries and whether decode tracks the output boundary."""

    name: str = ""
    #: publish the last unit boundary of prompt + output when a request finishes
    track_output: bool = False
    #: the eviction strategy, by name (``cache/eviction_policies.py``): ``value`` or ``v1``
    eviction: str = "value"

    @abstractmethod
    def prefill_boundaries(self, ctx: CaptureContext) -> list[tuple[int, CaptureKind]]:
        """(boundary, kind) pairs in ``(start, end]``, most valuable first."""

    def output_boundary(self, ctx: CaptureContext) -> int:
        """Boundary to (re)write the tracking slot at in this step, or 0."""
        if (
            self.track_output
            and ctx.end == ctx.target_len
            and ctx.end % ctx.unit == 0
            and ctx.end > ctx.start
        ):
            return ctx.end
        return 0


def _interval_boundaries(ctx: CaptureContext) -> list[int]:
    if ctx.interval <= 0:
        return []
    first = (ctx.start // ctx.interval + 1) * ctx.interval
    return list(range(first, ctx.end + 1, ctx.interval))


class DefaultPolicy(AdmissionPolicy):
    """tail + branch + output + interval under the value model: the project's default."""

    name = "default"
    track_output = True

    def prefill_boundaries(self, ctx: CaptureContext) -> list[tuple[int, CaptureKind]]:
        out: list[tuple[int, CaptureKind]] = []
        # branch first: where it coincides with the tail, the stronger claim (proven shared) wins
        if ctx.branch > ctx.hit and _in_range(ctx.branch, ctx):
            out.append((ctx.branch, CaptureKind.BRANCH))
        tail = ((ctx.prompt_len - 1) // ctx.unit) * ctx.unit
        if tail > ctx.hit and _in_range(tail, ctx):
            out.append((tail, CaptureKind.TAIL))
        # deepest interval boundaries first: they cover the most prefix
        out.extend((b, CaptureKind.INTERVAL) for b in reversed(_interval_boundaries(ctx)))
        seen: set[int] = set()
        return [(b, k) for b, k in out if not (b in seen or seen.add(b))]


class V1Policy(DefaultPolicy):
    """The default's boundaries under the ``v1`` eviction classes (for comparison)."""

    name = "v1"
    eviction = "v1"


class IntervalPolicy(AdmissionPolicy):
    name = "interval"
    eviction = "v1"

    def prefill_boundaries(self, ctx: CaptureContext) -> list[tuple[int, CaptureKind]]:
        return [(b, CaptureKind.INTERVAL) for b in reversed(_interval_boundaries(ctx))]


class StepEndPolicy(AdmissionPolicy):
    """Only the last unit boundary of each computed piece (prefill chunk or decode)."""

    name = "step-end"
    track_output = True
    eviction = "v1"

    def prefill_boundaries(self, ctx: CaptureContext) -> list[tuple[int, CaptureKind]]:
        b = (ctx.end // ctx.unit) * ctx.unit
        return [(b, CaptureKind.STEP)] if _in_range(b, ctx) else []


class SequenceEndPolicy(AdmissionPolicy):
    """Only the end of each sequence (prompt + output), published at finish."""

    name = "sequence-end"
    track_output = True
    eviction = "v1"

    def prefill_boundaries(self, ctx: CaptureContext) -> list[tuple[int, CaptureKind]]:
        return []


class EveryUnitPolicy(AdmissionPolicy):
    """A checkpoint at every unit boundary (the oracle, with unlimited memory)."""

    name = "every-unit"
    track_output = True
    eviction = "v1"

    def prefill_boundaries(self, ctx: CaptureContext) -> list[tuple[int, CaptureKind]]:
        first = (ctx.start // ctx.unit + 1) * ctx.unit
        return [(b, CaptureKind.UNIT) for b in range(ctx.end // ctx.unit * ctx.unit, first - 1, -ctx.unit)]


class NoCheckpointPolicy(AdmissionPolicy):
    name = "none"
    eviction = "v1"

    def prefill_boundaries(self, ctx: CaptureContext) -> list[tuple[int, CaptureKind]]:
        return []


ADMISSION_POLICIES: dict[str, type[AdmissionPolicy]] = {
    cls.name: cls
    for cls in (
        DefaultPolicy,
        V1Policy,
        IntervalPolicy,
        StepEndPolicy,
        SequenceEndPolicy,
        EveryUnitPolicy,
        NoCheckpointPolicy,
    )
}


def get_admission_policy(name: str) -> AdmissionPolicy:
    try:
        return ADMISSION_POLICIES[name]()
    except KeyError:
        known = ", ".join(sorted(ADMISSION_POLICIES))
        raise ValueError(f"unknown checkpoint policy {name!r}; known: {known}") from None
