"""A constraint that starts after the reasoning: free text up to an end marker, then the grammar.

A reasoning model (Qwen3's ``<think> ... </think>``) writes its thoughts before its answer, so a
constraint on the answer (a forced tool call, a strict schema) must not hold from the first
token. ``GatedMatcher`` wraps a request's grammar matcher (``xgrammar.GrammarMatcher``) with a
*free* phase that lasts until the output's text contains the end marker (``Constraint.
starts_after``, e.g. ``"</think>"``); from the next token on it is the grammar, masked as a
plain constrained request is. The marker is matched on the tokens' bytes (the tokenizer
info's decoded vocabulary), so it may be one token (Qwen's ``</think>``) or several (a
vocabulary without it: ``</``, ``think``, ``>``).

Free phase, what the next token may be (``fill_next_token_bitmask``):

* any token, except the grammar's stop tokens (EOS): a forced call or strict schema promises
  an answer, so the request may not end while it reasons (vLLM lets it end there, with no
  answer at all); ``max_tokens`` still ends it (``length``), as it ends any constrained output;
* except a token with no bytes (the ids that pad the model's vocabulary past the tokenizer's,
  which no grammar allows either);
* except a token that completes the marker and goes on past it (``>\\n`` after ``</think``):
  the grammar starts exactly at a token boundary, so every byte after the marker is the
  grammar's.

The matcher interface is the one the engine drives (``EngineCore`` advances it by every
accepted token; speculative decoding advances it over drafts, reads each row's mask, and rolls
back), and ``xgrammar.GrammarMatcher``'s rollback and fork operations:

* ``accept_token`` (False, state unchanged, for a token the phase does not allow), ``rollback(n)``
  (any ``n`` up to the tokens accepted, across the marker too: rolling back the token that
  completed it reopens the free phase where it was), ``reset``, ``fork`` (an independent copy),
  ``is_terminated`` / ``is_completed`` (never in the free phase), ``find_jump_forward_string``
  ("" in the free phase), ``fill_next_token_bitmask``;
* the phase is ``in_grammar``; ``Grammars.fill_masks`` fills a batch of plain and gated matchers
  (the grammar-phase ones in one native batch call, like plain ones).

Cost in the free phase: per token a few byte comparisons, and one int8 kept per free token (for
rollback); the mask is a copy of a precomputed row (``GateTables``: one bitmask row per partial
match of the marker, built once per vocabulary and marker).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any

import torch

from deltaserve.engine.constraint import MAX_MARKER_BYTES


def partial_match(marker: bytes, matched: int, token: bytes) -> tuple[int, int]:
    """After ``marker[:matched]`` (the longest proper prefix of the marker the text so far ends
    with) and then ``token``'s bytes: ``(state, past)``. ``state`` is ``len(marker)`` when the
    marker now occurs (``past``: how many of ``token``'s bytes follow its end), else the new
    ``matched`` (``past`` 0)."""
    text = marker[:matched] + token
    at = text.find(marker)
    if at >= 0:
        return len(marker), len(text) - at - len(marker)
    for m in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:m]):
            return m, 0
    return 0, 0


class GateTables:
    """The free phase's masks of one vocabulary and marker: row ``m`` (``m`` bytes of the marker
    matched) allows every token except the stop tokens, those with no bytes and those that
    would complete the marker with bytes after it. ``decoded``: each token id's bytes (ids past
    it, or with no bytes: the padded vocabulary, never allowed, as the grammar's own masks
    treat it)."""

    def __init__(
        self, marker: str, decoded: Sequence[bytes], vocab_size: int, stop_ids: Sequence[int]
    ) -> None:
        self.marker = marker.encode()
        if not 0 < len(self.marker) <= MAX_MARKER_BYTES:
            raise ValueError(f"reasoning end marker {marker!r}: 1 to {MAX_MARKER_BYTES} bytes")
        self.decoded = list(decoded)
        self.stop_ids = frozenset(stop_ids)
        words = (vocab_size + 31) // 32
        allowed = torch.ones(words * 32, dtype=torch.bool)
        allowed[len(self.decoded) :] = False
        allowed[[i for i, b in enumerate(self.decoded) if not b]] = False
        allowed[list(self.stop_ids)] = False
        n = len(self.marker)
        rows = allowed.repeat(n, 1)
        last = self.marker[-1:]
        # only a token holding the marker's last byte before its own end can overshoot it
        for tid, b in enumerate(self.decoded):
            if last in b[:-1]:
                for m in range(n):
                    state, past = partial_match(self.marker, m, b)
                    if state == n and past:
                        rows[m, tid] = False
        self.masks = _pack(rows)  # (n, words) int32, bit set = allowed

    def decoded_at(self, token: int) -> bytes:
        """The bytes of a token id (b"" for an id past the vocabulary)."""
        return self.decoded[token] if 0 <= token < len(self.decoded) else b""

    def step(self, matched: int, token: int) -> tuple[int, int]:
        """``partial_match`` for a token id."""
        return partial_match(self.marker, matched, self.decoded_at(token))


def _pack(rows: torch.Tensor) -> torch.Tensor:
    """Bool rows (a multiple of 32 wide) -> xgrammar's int32 bitmask (bit ``i % 32`` of word
    ``i // 32``)."""
    bits = rows.view(rows.shape[0], -1, 32).to(torch.int64)
    weights = torch.tensor([1 << i for i in range(32)], dtype=torch.int64)
    words = (bits * weights).sum(-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


class GatedMatcher:
    """A grammar matcher whose constraint starts after the reasoning's end marker (module
    docstring). ``inner``: the grammar's matcher, at the start of the answer."""

    def __init__(self, inner: Any, tables: GateTables) -> None:
        self.inner = inner
        self.tables = tables
        self.matched = 0  # bytes of the marker the free text ends with (free phase)
        self.in_grammar = False
        # per accepted free token, ``matched`` before it (the rollback's record); the token that
        # completed the marker is the last one
        self._free = array("b")
        self._inner_steps = 0  # tokens the inner matcher accepted (its rollback depth)

    # ------------------------------------------------------------------ advancing
    def accept_token(self, token: int) -> bool:
        if self.in_grammar:
            if not self.inner.accept_token(token):
                return False
            self._inner_steps += 1
            return True
        if token in self.tables.stop_ids or not self.tables.decoded_at(token):
            return False
        state, past = self.tables.step(self.matched, token)
        if past:
            return False  # the grammar starts at a token boundary (module docstring)
        self._free.append(self.matched)
        if state == len(self.tables.marker):
            self.in_grammar, self.matched = True, 0
        else:
            self.matched = state
        return True

    def rollback(self, num_tokens: int = 1) -> None:
        """Undo the last ``num_tokens`` accepted tokens (grammar ones first, then free ones)."""
        if num_tokens < 0 or num_tokens > self._inner_steps + len(self._free):
            raise ValueError(
                f"rollback({num_tokens}): {self._inner_steps + len(self._free)} tokens were accepted"
            )
        if not num_tokens:
            return
        back = min(num_tokens, self._inner_steps)
        if back:
            self.inner.rollback(back)
            self._inner_steps -= back
        rest = num_tokens - back
        if rest:  # the token that completed the marker goes too: the free phase reopens
            self.matched = self._free[-rest]
            del self._free[-rest:]
            self.in_grammar = False

    def reset(self) -> None:
        self.inner.reset()
        self.matched, self.in_grammar, self._inner_steps = 0, False, 0
        self._free = array("b")

    def fork(self) -> GatedMatcher:
        """An independent matcher in this one's state (the inner matcher forked)."""
        twin = GatedMatcher(self.inner.fork(), self.tables)
        twin.matched, twin.in_grammar, twin._inner_steps = self.matched, self.in_grammar, self._inner_steps
        twin._free = array("b", self._free)
        return twin

    # ------------------------------------------------------------------ reading
    def is_terminated(self) -> bool:
        return self.in_grammar and bool(self.inner.is_terminated())

    def is_completed(self) -> bool:
        return self.in_grammar and bool(self.inner.is_completed())

    def find_jump_forward_string(self) -> str:
        return str(self.inner.find_jump_forward_string()) if self.in_grammar else ""

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int = 0) -> None:
        """Row ``index`` of ``bitmask`` := the next token's mask (does not change the state)."""
        if self.in_grammar:
            self.inner.fill_next_token_bitmask(bitmask, index)
        else:
            bitmask[index].copy_(self.tables.masks[self.matched])

    @property
    def stop_token_ids(self) -> list[int]:
        return list(self.inner.stop_token_ids)

    @property
    def num_free_tokens(self) -> int:
        """Tokens accepted in the free phase (the marker's included)."""
        return len(self._free)
