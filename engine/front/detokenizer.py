"""Incremental detokenizer with stop-string handling.

Fast path (byte-level BPE tokenizers: Qwen, GPT-2 style, the built-in models): every token
id maps to a fixed byte string (a table built once per tokenizer), and an incremental UTF-8
decoder turns the byte stream into text. That is O(1) per token and gives exactly what
``tokenizer.decode(ids, skip_special_tokens=True)`` gives for the whole sequence, except
that an incomplete UTF-8 character at the end is held back until its last byte arrives
(never released as U+FFFD).

Other tokenizers: text is decoded over a sliding window (``prefix_offset``/``read_offset``)
and a delta is released only when it does not end in a replacement character. Decoding the
whole output each step would be quadratic in its length.

Stop strings: the text released never contains a stop string or anything after it; a tail
that could still become a stop string is held back until it cannot.
"""

from __future__ import annotations

import codecs
import contextlib
import weakref
from typing import Any

_TABLES: weakref.WeakKeyDictionary[Any, list[bytes] | None] = weakref.WeakKeyDictionary()
_TEXTS: weakref.WeakKeyDictionary[Any, list[str | None]] = weakref.WeakKeyDictionary()


def _byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's bytes-to-unicode map: the character standing for each byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def token_byte_table(tokenizer: Any) -> list[bytes] | None:
    """``table[id]`` = the UTF-8 bytes token ``id`` contributes to decoded text (b"" for special
    tokens); None when the tokenizer is not byte-level BPE. Built once per tokenizer object."""
    try:
        return _TABLES[tokenizer]
    except (KeyError, TypeError):
        pass
    table = _build_table(tokenizer)
    with contextlib.suppress(TypeError):  # not weak-referenceable: built again next time (rare)
        _TABLES[tokenizer] = table
    return table


def token_text_table(tokenizer: Any, table: list[bytes]) -> list[str | None]:
    """``texts[id]``: the text token ``id`` decodes to on its own when its bytes are complete,
    valid UTF-8 (most tokens), else None. With nothing buffered in the UTF-8 decoder such a
    token's delta is exactly this text, so the common step skips the incremental decoder.
    Built once per tokenizer object (from ``token_byte_table``'s ``table``)."""
    try:
        return _TEXTS[tokenizer]
    except (KeyError, TypeError):
        pass

    def text(b: bytes) -> str | None:
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            return None

    texts = [text(b) for b in table]
    with contextlib.suppress(TypeError):
        _TEXTS[tokenizer] = texts
    return texts


def _build_table(tokenizer: Any) -> list[bytes] | None:
    try:
        from tokenizers import decoders

        if not isinstance(tokenizer.backend_tokenizer.decoder, decoders.ByteLevel):
            return None
    except (AttributeError, ImportError):
        return None
    byte_of = _byte_decoder()
    n = len(tokenizer)
    added = {i: t for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
    table: list[bytes] = []
    for i, tok in enumerate(tokenizer.convert_ids_to_tokens(list(range(n)))):
        if i in added:
            table.append(b"" if added[i].special else added[i].content.encode("utf-8"))
        elif tok is None:
            table.append(b"")
        else:
            try:
                table.append(bytes(byte_of[c] for c in tok))
            except KeyError:  # a token outside the byte alphabet: not a plain byte-level vocab
                return None
    return table


class IncrementalDetokenizer:
    """Turns one request's token ids into text deltas; applies its stop strings."""

    def __init__(self, tokenizer: Any, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.max_stop = max((len(s) for s in stop), default=0)
        self.stopped = False
        self._pending = ""  # decoded but held back: it could be the start of a stop string
        self._released_tail = ""  # the last max_stop - 1 released characters
        self._table = token_byte_table(tokenizer)
        self._texts = token_text_table(tokenizer, self._table) if self._table is not None else None
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        # sliding-window fallback state
        self._tokens: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def _decode_window(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _decode(self, token_ids: list[int]) -> str:
        table = self._table
        if table is not None:
            n = len(table)
            return self._utf8.decode(b"".join(table[t] if 0 <= t < n else b"" for t in token_ids))
        out = []
        for t in token_ids:
            self._tokens.append(t)
            prefix = self._decode_window(self._tokens[self._prefix_offset : self._read_offset])
            full = self._decode_window(self._tokens[self._prefix_offset :])
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                out.append(full[len(prefix) :])
                self._prefix_offset = self._read_offset
                self._read_offset = len(self._tokens)
        return "".join(out)

    def add(self, token_ids: list[int]) -> str:
        """Feed new tokens; return the newly released text ('' if held back or stopped)."""
        if self.stopped:
            return ""
        texts = self._texts
        if texts is not None and self._table is not None and len(token_ids) == 1 and not self._utf8.buffer:
            # the common step (byte-level vocabulary, one token, no partial character pending):
            # the token's own text, when it is complete UTF-8
            t = token_ids[0]
            new = texts[t] if 0 <= t < len(texts) else ""
            if new is None:
                new = self._decode(token_ids)
        else:
            new = self._decode(token_ids)
        if not self.stop:
            return new
        offset = len(self._released_tail)
        buf = self._released_tail + self._pending + new
        cut = -1
        for s in self.stop:
            i = buf.find(s)
            if i >= 0 and (cut < 0 or i < cut):
                cut = i
        if cut >= 0:
            # a stop string never starts in released text: its prefixes were held back
            self.stopped = True
            self._pending = ""
            return buf[offset:cut] if cut > offset else ""
        hold = 0
        for k in range(min(self.max_stop - 1, len(buf) - offset), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stop):
                hold = k
                break
        end = len(buf) - hold
        release = buf[offset:end]
        self._pending = buf[end:]
        keep = self.max_stop - 1
        self._released_tail = (self._released_tail + release)[-keep:] if keep > 0 else ""
        return release

    def flush(self) -> str:
        """At the end of a request: release whatever is held back (never past a stop)."""
        out, self._pending = self._pending, ""
        return out
