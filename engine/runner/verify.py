"""The runner's half of speculative decoding: a step's verify segments on the host, the
acceptance of their drafts, and the roll-back of their states to the last accepted token.

A verify segment (``models/verify.py``) is a decoding request's last token followed by its
``k`` drafts, ``[t, d_1 .. d_k]`` at positions ``start .. start + k``. Every one of its tokens
gets a logits row (after the step's other rows); row ``j`` is the target's distribution of the
token after ``d_j`` (``d_0 = t``). Greedy acceptance: ``d_{j+1}`` is accepted while it is the
argmax of row ``j``; the first row whose argmax differs (or row ``k``, when every draft was
accepted) gives the token after them. So a segment emits ``a + 1`` tokens, ``a`` accepted
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

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from deltaserve.models.batch import ModelCaches
from deltaserve.models.verify import VerifyRecord
from deltaserve.scheduler.scheduler import ScheduledSeq


@dataclass
class VerifyHost:
    """A step's verify segments on the host: each one's drafts and live slot, and the layout
    (``counts``: segments longer than ``j`` tokens, per window position ``j``)."""

    drafts: list[tuple[int, ...]]
    slots: list[int]
    counts: list[int]
    num_tokens: int


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
