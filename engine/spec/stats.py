"""Acceptance counters of speculative decoding, named as vLLM's ``spec_decode`` metrics.

``spec_decode.num_drafts``: verify windows (one per request and step that drafted at least one
token); ``num_draft_tokens``: tokens drafted; ``num_accepted_tokens``: drafts accepted;
``num_accepted_tokens_per_pos.<i>``: windows whose draft ``i`` (0-based) was accepted;
``num_emitted_tokens``: tokens the windows emitted (accepted + one each). Derived:
``acceptance_rate`` (accepted / drafted) and ``mean_tokens_per_verify`` (emitted / windows).
"""

from __future__ import annotations


class SpecStats:
    """The engine's totals (``EngineCore.stats()``)."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_emitted_tokens = 0
        self.per_pos = [0] * k

    def observe(self, drafted: int, accepted: int) -> None:
        """One verify window: ``drafted`` tokens, the first ``accepted`` of them accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        self.num_emitted_tokens += accepted + 1
        for i in range(min(accepted, self.k)):
            self.per_pos[i] += 1

    def stats(self) -> dict[str, float]:
        out: dict[str, float] = {
            "spec_decode.num_drafts": self.num_drafts,
            "spec_decode.num_draft_tokens": self.num_draft_tokens,
            "spec_decode.num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode.num_emitted_tokens": self.num_emitted_tokens,
            "spec_decode.acceptance_rate": (
                self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
            ),
            "spec_decode.mean_tokens_per_verify": (
                self.num_emitted_tokens / self.num_drafts if self.num_drafts else 0.0
            ),
        }
        for i, n in enumerate(self.per_pos):
            out[f"spec_decode.num_accepted_tokens_per_pos.{i}"] = n
        return out
