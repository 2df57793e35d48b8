"""Capture planning: which checkpoint boundaries a step proposes. A pure function.

``plan_captures`` asks the admission policy (``cache/admission.py``) for each item of a
step — prefill boundaries in the computed range, and the output boundary a decode or a
prompt's last chunk crosses — and returns them as ``CaptureCandidate``s in ``v1`` rank
order (branch, tail, output, step/unit, interval; items in step order within a rank). What
is then staged (slots, the per-step budget, eviction) is the cache manager's business.
Torch-free and side-effect free; ``settle_verify`` trims a planned verify window to what was
accepted before its step is committed.
"""

from __future__ import annotations

from collections.abc import Sequence

from deltaserve.cache.admission import AdmissionPolicy, CaptureContext
from deltaserve.cache.types import CaptureCandidate, CaptureKind, StepItem


def plan_captures(
    items: Sequence[StepItem], policy: AdmissionPolicy, *, unit: int, interval: int
) -> list[CaptureCandidate]:
    wanted: list[CaptureCandidate] = []
    # A decode proposes no prefill boundary, and the base output rule needs the decode to end on
    # a unit boundary: the other decodes (almost all, in a decode-heavy step) are skipped
    # without building a context for them.
    base_output = type(policy).output_boundary is AdmissionPolicy.output_boundary
    track = policy.track_output
    for idx, item in enumerate(items):
        if item.is_decode and base_output and (not track or item.end % unit or item.end <= item.start):
            continue
        ctx = CaptureContext(
            start=item.start,
            end=item.end,
            target_len=len(item.token_ids),
            prompt_len=item.seq.prompt_len,
            unit=unit,
            interval=interval,
            hit=item.seq.num_cached_tokens,
            branch=item.seq.branch_boundary,
        )
        boundaries = [] if item.is_decode else policy.prefill_boundaries(ctx)
        wanted.extend(CaptureCandidate(idx, b, kind) for b, kind in boundaries)
        ob = policy.output_boundary(ctx)
        if ob and all(b != ob for b, _ in boundaries):
            wanted.append(CaptureCandidate(idx, ob, CaptureKind.OUTPUT))
    wanted.sort(key=lambda c: (c.kind.rank, c.item_index))
    return wanted


def settle_verify(item: StepItem, end: int, token_ids: Sequence[int]) -> None:
    """A verify window (speculative decoding) was planned as a decode over all its drafts and
    accepted up to ``end``: the item now covers ``[start, end)`` of ``token_ids`` (the request's
    tokens with the accepted ones appended), so the commit hashes and publishes accepted tokens
    only. An output capture planned at the window's end, which ``end`` falls short of, is
    dropped: the runner skipped its copy, and the tracking slot holds no valid boundary until
    a later step writes one."""
    item.end = end
    item.token_ids = token_ids
    if item.seq.pending_tracking_boundary > end:
        item.seq.pending_tracking_boundary = 0
