"""Incremental detokenizer with stop-string handling.

Byte-level BPE tokens may end in the middle of a UTF-8 character, so text is decoded over
a sliding window (``prefix_offset``/``read_offset``) and a delta is released only when it
does not end in a replacement character. Decoding the whole output each step would be
quadratic in its length.

Stop strings: the text released never contains a stop string or anything after it; a
tail that could still become a stop string is held back until it cannot.
"""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.max_stop = max((len(s) for s in stop), default=0)
        self.tokens: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""  # all decoded text so far (may include held-back tail)
        self.emitted = 0  # characters of ``text`` already released
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, token_ids: list[int]) -> str:
        """Feed new tokens; return the newly released text ('' if held back)."""
        for t in token_ids:
            self.tokens.append(t)
            prefix = self._decode(self.tokens[self.prefix_offset : self.read_offset])
            full = self._decode(self.tokens[self.prefix_offset :])
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                self.text += full[len(prefix) :]
                self.prefix_offset = self.read_offset
                self.read_offset = len(self.tokens)
        if self.stop and not self.stopped:
            start = max(self.emitted - self.max_stop, 0)
            cut = -1
            for s in self.stop:
                i = self.text.find(s, start)
                if i >= 0 and (cut < 0 or i < cut):
                    cut = i
            if cut >= 0:
                self.text = self.text[:cut]
                self.stopped = True
        release_to = len(self.text)
        if self.stop and not self.stopped:
            # hold back a tail that is a prefix of some stop string
            for k in range(min(self.max_stop - 1, len(self.text)), 0, -1):
                tail = self.text[-k:]
                if any(s.startswith(tail) for s in self.stop):
                    release_to = len(self.text) - k
                    break
        release_to = max(release_to, self.emitted)
        delta = self.text[self.emitted : release_to]
        self.emitted = release_to
        return delta

    def flush(self) -> str:
        """At the end of a request: release whatever is held back (never past a stop)."""
        delta = self.text[self.emitted :]
        self.emitted = len(self.text)
        return delta
