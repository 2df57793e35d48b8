"""The runner's half of speculative decoding: a step's verify segments on the host, the
acceptance of their drafts, and the roll-back of their states to the last accepted token.

A verify segment (``models/verify.py``) is a decoding request's last token followed by its
``k`` drafts, ``[t, d_1 .. d_k]`` at positions ``start .. start + k``. Every one of its tokens
gets a logits row (after the step's other rows); row ``j`` is the target's distribution of the
token after ``d_j`` (``d_0 = t``). Greedy acceptance: ``d_{j+1}`` is accepted while it is the
argmax of row ``j``; the first row whose argmax differs (or row ``k``, when every draft was
accepted) gives the token after them. A sampled request's segment is accepted by rejection
sampling instead (``engine/spec/rejection.py``), with its own temperature, top-k, top-p, min-p
and generator; log-probabilities are the raw ones of each emitted token's row. A penalised
segment's row ``j`` has its repetition / frequency / presence penalties counted over the
request's output followed by ``d_1 .. d_j`` (``penalised_rows``): the output a decode at that
position would count, so greedy acceptance equals a decode's argmax there. A constrained
segment's rows are masked first, row ``j`` with its matcher's mask after the first ``j`` drafts
(``attach_masks``): a draft the grammar cannot take is never accepted. So a segment emits ``a + 1`` tokens, ``a`` accepted
drafts, and its request has computed ``start + a + 1`` tokens: the GDN state it must keep is
the one after window position ``a``. The forward recorded the states after every position but
the last (``VerifyPlan.records``); ``restore_accepted`` copies the recorded one back into the
live slot of every segment with a rejected draft. KV needs nothing: the window lies in one
block (the scheduler's rule), the rejected positions are overwritten by the real tokens
before that block is full and published, and attention never reads past a sequence's end.

A tracking copy the cache planned for a window's end (an output checkpoint at a unit
boundary) runs only when the whole window was accepted (``tracking_copies``): otherwise that
boundary was not reached (``cache/planning.settle_verify`` drops it from the commit).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from deltaserve.engine.outputs import TokenLogprob
from deltaserve.engine.runner.request_state import RequestState
from deltaserve.engine.runner.sampling import apply_token_mask, greedy
from deltaserve.engine.sampling_params import SamplingParams
from deltaserve.engine.spec.rejection import accept_sampled
from deltaserve.kernels.sampler import apply_penalties, compute_logprobs
from deltaserve.models.batch import ModelCaches
from deltaserve.models.verify import VerifyRecord
from deltaserve.scheduler.scheduler import ScheduledSeq


@dataclass
class VerifyHost:
    """A step's verify segments on the host: each one's drafts and live slot, and the layout
    (``counts``: segments longer than ``j`` tokens, per window position ``j``). ``params`` /
    ``states``: each segment's sampling parameters and request state, set unless every
    segment is plain greedy."""

    drafts: list[tuple[int, ...]]
    slots: list[int]
    counts: list[int]
    num_tokens: int
    params: list[SamplingParams] | None = None
    states: list[RequestState] | None = None
    # per segment, for penalised ones: its output ids and prompt ids at prepare (else [])
    output_ids: list[list[int]] | None = None
    prompt_ids: list[list[int]] | None = None
    # constrained segments: one bitmask row per verify token, and which rows are constrained
    token_mask: torch.Tensor | None = None
    mask_rows: list[int] | None = None

    def attach(self, seqs: Sequence[ScheduledSeq], states: Mapping[str, RequestState]) -> None:
        """Keep the segments' (``seqs``) parameters and states when one is not plain greedy."""
        row_states = [states[s.request.request_id] for s in seqs]
        if not all(st.plain_greedy for st in row_states):
            self.states = row_states
            self.params = [s.request.sampling_params for s in seqs]
            if any(p.has_penalties for p in self.params):
                # (copied now: the request's tokens change once the step is committed)
                reqs = [(s.request, s.request.sampling_params) for s in seqs]
                self.output_ids = [r.output_token_ids if p.has_penalties else [] for r, p in reqs]
                self.prompt_ids = [r.prompt_token_ids if p.repetition_penalty != 1.0 else [] for r, p in reqs]


def verify_fields(
    seqs: Sequence[ScheduledSeq],
    nd: int,
    nv: int,
    cu: np.ndarray,
    ends: np.ndarray,
    positions: np.ndarray,
    block_tables: np.ndarray,
    seq_index: np.ndarray,
) -> tuple[VerifyHost, np.ndarray, dict[str, np.ndarray]]:
    """The verify segments ``seqs[nd : nd + nv]`` (longest first): their host record, their
    logits rows (every token of every segment, in order) and the attention view's fields
    (every verify token a one-token segment; decodes and prefills as they are)."""
    verify = seqs[nd : nd + nv]
    lens = [1 + len(s.drafts) for s in verify]
    counts = [sum(1 for n in lens if n > j) for j in range(lens[0])]
    first, last = int(cu[nd]), int(cu[nd + nv])
    rows = np.arange(first, last, dtype=np.int64)
    host = VerifyHost(
        drafts=[s.drafts for s in verify],
        slots=[s.request.cache.state_slot for s in verify],  # type: ignore[union-attr]
        counts=counts,
        num_tokens=last - first,
    )
    seg_lens = np.concatenate(
        [np.diff(cu[: nd + 1]), np.ones(last - first, np.int64), np.diff(cu[nd + nv :])]
    )
    attn_cu = np.zeros(len(seg_lens) + 1, dtype=np.int64)
    np.cumsum(seg_lens, out=attn_cu[1:])
    attn_seq_lens = np.concatenate([ends[:nd], positions[first:last] + 1, ends[nd + nv :]])
    attn_tables = np.concatenate(
        [block_tables[:nd], block_tables[seq_index[first:last]], block_tables[nd + nv :]]
    )
    fields = {
        "verify_cu": attn_cu,
        "verify_seq_lens": attn_seq_lens,
        "verify_block_tables": attn_tables.reshape(-1),
    }
    return host, rows, fields


def attach_masks(
    host: VerifyHost, seqs: Sequence[ScheduledSeq], states: Mapping[str, RequestState], grammars: Any
) -> None:
    """The token bitmask of every verify row of a constrained segment (``seqs``): row ``j`` is
    its matcher's mask after the first ``j`` drafts (each accepted, then all rolled back), so a
    row's mask is the one a decode at that position would have used. The drafts were cut
    before the first one the matcher rejects (``spec_step.SpecDecoding.drafts``)."""
    rows: list[int] = []
    start = 0
    mask: torch.Tensor | None = None
    for s in seqs:
        matcher = states[s.request.request_id].matcher
        if matcher is not None:
            if mask is None:
                mask = grammars.allocate(host.num_tokens)
            walked = 0
            for j in range(len(s.drafts) + 1):
                if matcher.is_terminated():
                    break  # a draft completed the constraint: the request ends there, rows after it are moot
                grammars.fill_masks([matcher], mask, [start + j])
                rows.append(start + j)
                if j < len(s.drafts):
                    if not matcher.accept_token(s.drafts[j]):
                        raise RuntimeError(f"draft {s.drafts[j]} does not continue the request's constraint")
                    walked += 1
            if walked:
                matcher.rollback(walked)
        start += len(s.drafts) + 1
    if mask is not None:
        host.token_mask, host.mask_rows = mask, rows


def accept_rows(
    rows: torch.Tensor, host: VerifyHost, default_generator: torch.Generator
) -> tuple[list[list[int]], list[list[TokenLogprob] | None]]:
    """The tokens each segment emits from its rows of ``rows`` (greedy or rejection sampling,
    by its parameters: ``engine/spec/rejection.py``), and the raw log-probabilities of the
    emitted tokens for the segments that asked (None for the others)."""
    if host.token_mask is not None and host.mask_rows:
        apply_token_mask(rows, host.token_mask, host.mask_rows)
    if host.params is None or host.states is None:
        return accept_greedy(greedy(rows).tolist(), host), [None] * len(host.drafts)
    emitted: list[list[int]] = []
    logprobs: list[list[TokenLogprob] | None] = []
    start = 0
    for i, (drafts, params, state) in enumerate(zip(host.drafts, host.params, host.states, strict=True)):
        seg = rows[start : start + len(drafts) + 1]
        start += len(drafts) + 1
        if state.plain_greedy:
            toks = accept_greedy(greedy(seg).tolist(), VerifyHost([drafts], [], [], 0))[0]
        else:
            target = seg
            if params.has_penalties and host.output_ids is not None and host.prompt_ids is not None:
                target = penalised_rows(seg, drafts, params, host.output_ids[i], host.prompt_ids[i])
            toks = accept_sampled(target, drafts, params, state.generator or default_generator)
        emitted.append(toks)
        logprobs.append(
            None if params.logprobs is None else _logprobs(seg[: len(toks)], toks, params.logprobs)
        )
    return emitted, logprobs


def penalised_rows(
    rows: torch.Tensor, drafts: Sequence[int], params: SamplingParams, output: list[int], prompt: list[int]
) -> torch.Tensor:
    """A segment's rows (``[len(drafts) + 1, V]``) with ``params``' penalties, row ``j`` counted
    over ``output`` (the request's output tokens, its last token included) and the first ``j``
    drafts: the penalties a decode after those drafts would apply (a float32 copy)."""
    n = rows.shape[0]
    return apply_penalties(
        rows,
        [output + list(drafts[:j]) for j in range(n)],
        [params.presence_penalty] * n,
        [params.frequency_penalty] * n,
        [params.repetition_penalty] * n,
        [prompt] * n if params.repetition_penalty != 1.0 else None,
    )


def _logprobs(rows: torch.Tensor, tokens: list[int], num_top: int) -> list[TokenLogprob]:
    """Raw log-probabilities of ``tokens`` (one per row) and each row's ``num_top`` best."""
    chosen, rank, top_ids, top_lp = compute_logprobs(rows, tokens, num_top)
    return [
        TokenLogprob(token_id=t, logprob=c, rank=r, top=list(zip(ids, lps, strict=True)))
        for t, c, r, ids, lps in zip(
            tokens, chosen.tolist(), rank.tolist(), top_ids.tolist(), top_lp.tolist(), strict=True
        )
    ]


def accept_greedy(targets: Sequence[int], host: VerifyHost) -> list[list[int]]:
    """The tokens each segment emits: its drafts while each is its row's argmax
    (``targets``, the verify rows' argmax in order), then the argmax after the last accepted."""
    out: list[list[int]] = []
    row = 0
    for drafts in host.drafts:
        a = 0
        while a < len(drafts) and targets[row + a] == drafts[a]:
            a += 1
        out.append([*drafts[:a], targets[row + a]])
        row += len(drafts) + 1
    return out


def restore_accepted(
    caches: ModelCaches, records: Sequence[VerifyRecord], host: VerifyHost, emitted: Sequence[Sequence[int]]
) -> None:
    """Every segment with a rejected draft gets, in its live slot, the conv and recurrent
    states of every GDN layer as they were after its last accepted token (window position
    ``len(emitted) - 1``), as the forward recorded them."""
    by_pos: dict[int, list[int]] = {}
    for i, (drafts, toks) in enumerate(zip(host.drafts, emitted, strict=True)):
        pos = len(toks) - 1
        if pos < len(drafts):
            by_pos.setdefault(pos, []).append(i)
    if not by_pos or not records:
        return
    device = caches.ssm_state[0].device
    for pos, segs in by_pos.items():
        rows = torch.tensor(segs, dtype=torch.int64, device=device)
        slots = torch.tensor([host.slots[i] for i in segs], dtype=torch.int64, device=device)
        for layer, rec in enumerate(records):
            caches.conv_state[layer].index_copy_(0, slots, rec.conv[pos].index_select(0, rows))
            caches.ssm_state[layer].index_copy_(0, slots, rec.ssm[pos].index_select(0, rows))


def tracking_copies(
    copies: Sequence[tuple[int, int]], host: VerifyHost, emitted: Sequence[Sequence[int]]
) -> list[tuple[int, int]]:
    """The step's tracking copies (live slot -> tracking slot) less those of segments whose
    window was not accepted whole (their boundary, the window's end, was not reached)."""
    short = {
        slot
        for slot, drafts, toks in zip(host.slots, host.drafts, emitted, strict=True)
        if len(toks) <= len(drafts)
    }
    return [c for c in copies if c[0] not in short]
