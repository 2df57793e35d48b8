"""Prompt log-probabilities (``SamplingParams.prompt_logprobs``): which logits rows a step needs
for them, and turning those rows into ``TokenLogprob`` entries.

Position ``p`` of a prompt predicts token ``p + 1``, so a prefill piece ``[start, end)`` of a
request that asked gives the entries of prompt tokens ``start + 1 .. min(end, P - 1)`` (``P``
the prompt length): a chunked prefill fills them chunk by chunk, and the last position of one
chunk gives the first token of the next. The last prompt position predicts the first output
token, which is the sampler's, not a prompt entry. Only the requests that asked add rows: the
others keep their one row per sampled sequence.

The entries are the raw model distribution (float32 ``log_softmax`` of the logits the sampler
gets, before any penalty or temperature), like ``SamplingParams.logprobs``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from deltaserve.engine.outputs import TokenLogprob
from deltaserve.engine.runner.request_state import RequestState
from deltaserve.kernels.sampler import compute_logprobs
from deltaserve.scheduler.scheduler import ScheduledSeq

#: rows per float32 log-softmax: bounds the temporary at ``ROW_BLOCK * vocab`` floats
ROW_BLOCK = 256


@dataclass(eq=False)
class PromptSlice:
    """The prompt entries one prefill piece gives: ``targets[j]`` is prompt token ``first + j``,
    predicted by the piece's logits row ``first - 1 + j`` (rows in the order of the slices)."""

    state: RequestState
    first: int  # the prompt index of the first entry (>= 1)
    targets: list[int]
    num_top: int


def prompt_slices(
    seqs: Sequence[ScheduledSeq],
    num_decodes: int,
    cu_seqlens: np.ndarray,
    states: Mapping[str, RequestState],
) -> tuple[np.ndarray, list[PromptSlice]]:
    """The token rows (indices into the step's tokens) whose logits the prompt entries of this
    step need, and the slices they fill, in the same order."""
    rows: list[np.ndarray] = []
    slices: list[PromptSlice] = []
    for i in range(num_decodes, len(seqs)):
        s = seqs[i]
        req = s.request
        if not req.compute_whole_prompt:
            continue
        st = states.get(req.request_id)
        if st is None or st.prompt_logprobs is None:
            continue
        stop = min(s.end, req.num_prompt_tokens - 1)  # the last position that predicts a prompt token
        if stop <= s.start:
            continue
        base = int(cu_seqlens[i])
        rows.append(np.arange(base, base + stop - s.start, dtype=np.int64))
        k = req.sampling_params.prompt_logprobs or 0
        slices.append(PromptSlice(st, s.start + 1, list(req.prompt_token_ids[s.start + 1 : stop + 1]), k))
    if not rows:
        return np.zeros(0, dtype=np.int64), []
    return np.concatenate(rows), slices


def fill_prompt_logprobs(logits: torch.Tensor, slices: Sequence[PromptSlice]) -> None:
    """Write the entries of ``slices`` into their requests' ``RequestState.prompt_logprobs`` from
    ``logits`` (one row per target, in the slices' order). A recomputed prompt (after a
    preemption) writes the same entries again."""
    targets = [t for sl in slices for t in sl.targets]
    assert logits.shape[0] == len(targets), "one logits row per prompt entry"
    k = max(sl.num_top for sl in slices)
    chosen: list[float] = []
    rank: list[int] = []
    top_ids: list[list[int]] = []
    top_lp: list[list[float]] = []
    for lo in range(0, len(targets), ROW_BLOCK):
        c, r, ti, tl = compute_logprobs(logits[lo : lo + ROW_BLOCK], targets[lo : lo + ROW_BLOCK], k)
        chosen += c.tolist()
        rank += r.tolist()
        top_ids += ti.tolist()
        top_lp += tl.tolist()
    row = 0
    for sl in slices:
        entries = sl.state.prompt_logprobs
        assert entries is not None
        n = sl.num_top
        for j, token in enumerate(sl.targets):
            top = list(zip(top_ids[row][:n], top_lp[row][:n], strict=True))
            entries[sl.first + j] = TokenLogprob(token_id=token, logprob=chosen[row], rank=rank[row], top=top)
            row += 1
