"""The MTP drafter (``speculative.method = "mtp"``): the drafts the model's own
multi-token-prediction head proposed after the previous step (``engine/runner/mtp_draft.py``
runs the head on the device and fills ``proposals``); ``propose`` only hands them out.

A proposal is keyed by the request's token count when it was made: it is handed out only
while the request still has exactly that many tokens (its last one sampled, not yet
computed), so a request whose tokens changed since (preempted, cut by a stop) gets none.
"""

from __future__ import annotations

from deltaserve.engine.config_spec import SpecMethod
from deltaserve.engine.spec.drafter import register_drafter
from deltaserve.scheduler.request import Request


class MtpDrafter:
    """See the module docstring."""

    def __init__(self) -> None:
        # request id -> (its token count the drafts follow, the drafts)
        self.proposals: dict[str, tuple[int, list[int]]] = {}

    def propose(self, request: Request, k: int) -> list[int]:
        got = self.proposals.get(request.request_id)
        if got is None or got[0] != len(request.token_ids):
            return []
        return got[1][:k]

    def finished(self, request: Request, num_output: int) -> None:
        self.forget(request.request_id)

    def forget(self, request_id: str) -> None:
        """``request_id`` ended (every ending: ``SpecDecoding.request_done``)."""
        self.proposals.pop(request_id, None)


register_drafter(SpecMethod.MTP, lambda cfg, vocab: MtpDrafter())
