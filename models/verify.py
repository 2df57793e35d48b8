"""Verify segments: a decoding sequence's last token followed by its draft tokens, computed
with the decode math and rolled back to the last accepted token by the runner.

Contract (docs/contracts.md, "Batch layout"): sequences ``[num_decodes, num_decodes +
num_verify)`` of a ``BatchMetadata`` are verify segments, between the one-token decodes and
the prefill segments, ordered by length, longest first (so the segments still running at
window position ``j`` are a prefix of them: ``counts[j]`` of them). Each continues from its
live state slot like a decode:

* GDN layers run them token by token, window position ``j`` of every segment at once, with
  the decode ops (``causal_conv1d_update`` + ``recurrent_gated_delta_rule``, in place on the
  live slots) — the same arithmetic a decode of that token does — and record the conv and
  recurrent states after every position but the last (``records``, one entry per GDN layer,
  appended in layer order). Which position's state is kept is only known after sampling;
  ``engine/runner/verify.py`` copies the recorded state back where a draft was rejected.
* Attention sees each verify token as a one-token segment of its own (``cu_seqlens``,
  ``seq_lens``, ``block_tables`` below: context ``position + 1``), the decode path of the
  attention op, after ``store_kv`` wrote every token of the window.

Nothing here knows about drafts or requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor


@dataclass
class VerifyRecord:
    """One GDN layer's states after window positions ``0 .. len(counts) - 2``: ``conv[j]``
    ``[counts[j], conv_dim, K - 1]`` and ``ssm[j]`` ``[counts[j], Hv, Dk, Dv]``, row ``i`` the
    ``i``-th verify segment's."""

    conv: list[Tensor] = field(default_factory=list)
    ssm: list[Tensor] = field(default_factory=list)


@dataclass
class VerifyPlan:
    """The verify segments of a batch (see the module docstring).

    ``counts[j]``: segments with more than ``j`` tokens (non-increasing; ``counts[0]`` is
    ``num_verify``); ``num_tokens``: their tokens in all. The attention view covers the
    whole batch: decodes and prefill segments as they are, every verify token a one-token
    segment (``cu_seqlens [S+1]``, ``seq_lens [S]``, ``block_tables [S, M]``).
    """

    counts: list[int]
    num_tokens: int
    cu_seqlens: Tensor
    seq_lens: Tensor
    block_tables: Tensor
    records: list[VerifyRecord] = field(default_factory=list)
