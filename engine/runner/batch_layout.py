"""Batch building with numpy: a step's input ids, positions, ``cu_seqlens``, padded block
tables and placeholder positions, from one pass over its scheduled sequences (no per-token
Python). The model runner's ``prepare`` packs what these return into one ``BatchBuffer``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from deltaserve.scheduler.scheduler import ScheduledSeq


def token_ids(seqs: Sequence[ScheduledSeq], nd: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The step's input ids (a decode's one token, then every prefill segment's slice) and each
    sequence's start and end (its context length after the step)."""
    starts = np.array([s.start for s in seqs], dtype=np.int64)
    ends = starts + 1  # a decode computes one token
    if nd < len(seqs):
        ends[nd:] = [s.end for s in seqs[nd:]]
    ids_list = [s.request.token_ids[s.start] for s in seqs[:nd]]
    for s in seqs[nd:]:
        # (a verify segment: the last token, then its drafts, which are not in token_ids)
        ids_list += (
            s.request.token_ids[s.start : s.end]
            if not s.drafts
            else [s.request.token_ids[s.start], *s.drafts]
        )
    return np.array(ids_list, dtype=np.int64), starts, ends


def token_layout(
    starts: np.ndarray, ends: np.ndarray, num_tokens: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each token's position and sequence index, and the segments' ``cu_seqlens``."""
    n = len(starts)
    if num_tokens == n:  # every segment is one token (all decodes): no per-token expansion
        return starts, np.arange(n + 1, dtype=np.int64), np.arange(n)
    lens = ends - starts
    cu = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lens, out=cu[1:])
    seq_index = np.repeat(np.arange(n), lens)
    positions = np.arange(num_tokens, dtype=np.int64) - (cu[:-1] - starts)[seq_index]
    return positions, cu, seq_index


def block_tables(tables: list[list[int]], ends: np.ndarray, block_size: int) -> np.ndarray:
    """The block tables padded with 0 to the longest needed: flattened in one pass (C-level
    iteration), then scattered into the padded rows. A table may hold blocks past the step's
    end (never read): only the needed ones are copied."""
    n = len(tables)
    table_lens = np.fromiter(map(len, tables), dtype=np.int64, count=n)
    flat = np.fromiter(itertools.chain.from_iterable(tables), dtype=np.int64, count=int(table_lens.sum()))
    need = np.minimum((ends + block_size - 1) // block_size, table_lens)
    width = max(int(need.max()), 1)
    cols = np.arange(width, dtype=np.int64)
    valid = cols < need[:, None]
    out = np.zeros((n, width), dtype=np.int64)
    row_start = np.cumsum(table_lens) - table_lens
    out[valid] = flat[(row_start[:, None] + cols)[valid]]
    return out


def take_placeholders(input_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The positions of the placeholders in ``input_ids`` and the rows of the previous step's
    tokens they stand for; their ids are zeroed (the device fills them in).

    ``scheduler.request.is_placeholder`` / ``placeholder_row`` over a vector: placeholders are
    exactly the negative ids, and ``-id - 1`` is the row.
    """
    dst = np.flatnonzero(input_ids < 0)
    src = -input_ids[dst] - 1
    if len(dst):
        input_ids[dst] = 0
    return dst, src
