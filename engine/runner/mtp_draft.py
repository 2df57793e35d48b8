"""The runner's half of the MTP drafter (``speculative.method = "mtp"``): after every target
step, the model's multi-token-prediction head (``models/mtp.py``) runs over the step's
positions and proposes the next window's drafts, greedily (argmax).

Contract:

* **Head pass** (every step, every scheduled token): the target batch with its input ids
  shifted by one (``next_ids``), and the target's post-norm hidden states. A row at position
  ``p`` takes the token at ``p + 1``: the next token of its segment, or for a segment's last
  row the step's sampled token (a decode, a prefill that samples), the next prompt token (a
  prefill chunk that does not), or for a verify segment's window position ``j <= a`` (``a``
  accepted drafts) its ``j``-th emitted token. So the head's KV of every position the target
  computed is written with the final ``(hidden, token)`` pair of that position; the rejected
  positions of a window get rows too (whatever id follows them) and their KV, past the
  sequence's end, is overwritten when the target computes those positions. Only the drafting
  rows (one per sequence that sampled: its last computed position, ``p``) get logits.
* **Chained drafts**: draft ``j + 1`` (``j >= 1``) is a one-row-per-sequence head step at
  ``p + j`` with draft ``j`` as its token and the previous head step's hidden; it writes the
  head's KV of ``p + j`` (uncomputed by the target: overwritten by the head pass once it is).
  It runs only where ``p + j`` lies in a block the request already holds (a verify window never
  crosses a block, so a draft past the held blocks could rarely be verified anyway): a request
  may get fewer than ``k`` drafts.
* Every head step uses head layer 0 (``step = 0``): its KV is the one the head pass keeps
  whole; published checkpoints have one layer.
* ``MtpDrafter.proposals[request_id] = (num_tokens, drafts)``: the drafts follow a request
  of ``num_tokens`` tokens (its last one the step's sampled or emitted token); the drafter
  hands them out only while the request still has exactly that many.

Greedy outputs stay identical to speculation off whatever the head proposes: drafts are only
verified. Head KV in a prefix-hit block was written by the request that computed it: its last
position's row took that request's next token, so a later request continuing differently
after the block drafts from a slightly different head state (acceptance, never outputs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from deltaserve.models.batch import BatchMetadata, ModelCaches

if TYPE_CHECKING:
    from deltaserve.engine.runner.model_runner import PreparedStep
    from deltaserve.engine.spec.mtp import MtpDrafter
    from deltaserve.models.mtp import MtpHead


class MtpProposer:
    """Runs the head after each target step and fills ``drafter.proposals`` (module docstring)."""

    def __init__(
        self, head: MtpHead, caches: ModelCaches, block_size: int, k: int, drafter: MtpDrafter
    ) -> None:
        self.head = head
        self.caches = caches
        self.block_size = block_size
        self.k = k
        self.drafter = drafter

    @torch.inference_mode()
    def after_step(
        self,
        prep: PreparedStep,
        batch: BatchMetadata,
        hidden: torch.Tensor,
        tokens: torch.Tensor,
        verified: Sequence[Sequence[int]],
    ) -> None:
        """The head pass over ``batch`` and the chained drafts of every sequence that sampled
        (``tokens``: one per ``prep.sample_seq`` row; ``verified``: each verify segment's
        emitted tokens)."""
        seqs = prep.out.seqs
        nd, nv = prep.out.num_decodes, prep.out.num_verify
        cu = prep.buffer.field("cu_seqlens").numpy()
        positions = prep.buffer.field("positions").numpy()
        device = batch.input_ids.device
        next_ids = batch.input_ids.clone()
        next_ids[:-1] = batch.input_ids[1:]  # (each segment's last row is set below)
        row_of = {s: r for r, s in enumerate(prep.sample_seq)}
        host_rows: list[int] = []
        host_vals: list[int] = []
        sampled_rows: list[int] = []
        sampled_src: list[int] = []
        draft_seq: list[int] = []  # scheduled-seq index of each drafting row
        draft_rows: list[int] = []  # its token row (the last computed position)
        for i, s in enumerate(seqs):
            last = int(cu[i + 1]) - 1
            if nd <= i < nd + nv:
                emitted = verified[i - nd]
                first = int(cu[i])
                host_rows.extend(range(first, first + len(emitted)))
                host_vals.extend(emitted)
                draft_seq.append(i)
                draft_rows.append(first + len(emitted) - 1)
            elif i in row_of:
                sampled_rows.append(last)
                sampled_src.append(row_of[i])
                draft_seq.append(i)
                draft_rows.append(last)
            else:  # a prefill chunk that does not reach the end: its next token is known
                ids = s.request.token_ids
                nxt = int(positions[last]) + 1
                if nxt < len(ids):
                    host_rows.append(last)
                    host_vals.append(int(ids[nxt]))
                self.drafter.proposals.pop(s.request.request_id, None)
        if sampled_rows:
            next_ids[torch.tensor(sampled_rows, device=device)] = tokens[
                torch.tensor(sampled_src, device=device)
            ]
        if host_rows:
            next_ids[torch.tensor(host_rows, device=device)] = torch.tensor(host_vals, device=device)
        rows = torch.tensor(draft_rows, dtype=torch.int64, device=device)
        out = self.head(replace(batch, input_ids=next_ids, logits_indices=rows), hidden, self.caches, step=0)
        if not draft_rows:
            return
        drafts = [[t] for t in out.logits.argmax(dim=-1).tolist()]
        pos = [int(positions[r]) for r in draft_rows]
        # (async scheduling: a request may have ended or been preempted while this step ran,
        # its blocks released: it gets no chained drafts, and no proposal below)
        caches = [seqs[i].request.cache for i in draft_seq]
        tables = [c.block_table if c is not None else [] for c in caches]
        prev = out.hidden.index_select(0, rows)
        active = list(range(len(draft_seq)))
        for j in range(1, self.k):
            # a chained row at p + j writes the head's KV there: only in a block already held
            keep = [n for n, a in enumerate(active) if pos[a] + j < len(tables[a]) * self.block_size]
            if not keep:
                break
            if len(keep) < len(active):
                prev = prev.index_select(0, torch.tensor(keep, dtype=torch.int64, device=device))
                active = [active[n] for n in keep]
            step_batch = self._chain_batch([pos[a] + j for a in active], [tables[a] for a in active], device)
            step_batch.input_ids = torch.tensor([drafts[a][-1] for a in active], device=device)
            o = self.head(step_batch, prev, self.caches, step=0)
            for a, t in zip(active, o.logits.argmax(dim=-1).tolist(), strict=True):
                drafts[a].append(t)
            prev = o.hidden
        for n, i in enumerate(draft_seq):
            if caches[n] is not None:
                self.drafter.proposals[seqs[i].request.request_id] = (pos[n] + 2, drafts[n])

    def _chain_batch(
        self, positions: list[int], tables: list[list[int]], device: torch.device
    ) -> BatchMetadata:
        """One decode row per position (each its own sequence, context ``position + 1``)."""
        bs = self.block_size
        m = len(positions)
        width = max(len(t) for t in tables)
        bt = np.zeros((m, width), dtype=np.int64)
        for r, t in enumerate(tables):
            bt[r, : len(t)] = t
        pos = np.asarray(positions, dtype=np.int64)
        slots = bt[np.arange(m), pos // bs] * bs + pos % bs

        def t(a: np.ndarray | list[int]) -> torch.Tensor:
            return torch.as_tensor(np.asarray(a, dtype=np.int64), device=device)

        empty = t([])
        return BatchMetadata(
            input_ids=empty,  # (set by the caller)
            positions=t(pos),
            cu_seqlens=t(np.arange(m + 1)),
            seq_lens=t(pos + 1),
            block_tables=t(bt),
            slot_mapping=t(slots),
            num_decodes=m,
            state_slots=t(np.zeros(m)),
            has_initial_state=torch.ones(m, dtype=torch.bool, device=device),
            capture_seq=empty,
            capture_pos=empty,
            capture_slots=empty,
            logits_indices=t(np.arange(m)),
        )
