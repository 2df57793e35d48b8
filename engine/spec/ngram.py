"""Prompt lookup (vLLM's ``ngram`` method): the context's last ``n`` tokens are looked up
earlier in the context (prompt and output), longest ``n`` first from ``prompt_lookup_max``
down to ``prompt_lookup_min``; the tokens that followed the most recent earlier occurrence
are the drafts. Nothing is learned: each proposal reads only the request's own tokens.

Cost: one vectorised scan of the context per length tried (numpy), on the engine thread.
"""

from __future__ import annotations

import numpy as np

from deltaserve.engine.config_spec import SpecMethod
from deltaserve.engine.spec.drafter import register_drafter
from deltaserve.scheduler.request import Request


def lookup(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """At most ``k`` tokens that followed the most recent earlier occurrence of the longest
    suffix of ``tokens`` of ``min_n .. max_n`` tokens (none found: ``[]``)."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        # starts i < length - n of an earlier occurrence: match the suffix token by token
        # over the candidate starts (the first token narrows them most)
        starts = np.flatnonzero(tokens[: length - n] == suffix[0])
        for j in range(1, n):
            if not len(starts):
                break
            starts = starts[tokens[starts + j] == suffix[j]]
        if len(starts):
            i = int(starts[-1]) + n
            return tokens[i : i + k].tolist()
    return []


class NgramDrafter:
    """``speculative.method = "ngram"`` (see the module docstring)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, request: Request, k: int) -> list[int]:
        return lookup(np.asarray(request.token_ids, dtype=np.int64), k, self.min_n, self.max_n)

    def finished(self, request: Request, num_output: int) -> None:
        pass


register_drafter(
    SpecMethod.NGRAM, lambda cfg, vocab: NgramDrafter(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
)
