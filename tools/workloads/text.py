"""English-like text of a target token length, from a fixed word list.

A byte-level BPE tokenizer gives realistic token counts on it; the text stops at the first word
that reaches the target, so a piece may run a few tokens over.
"""

from __future__ import annotations

import random

from deltaserve.tools.workloads.codecs import Codec

WORDS: tuple[str, ...] = (
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by", "on",
    "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have", "an", "had", "they",
    "you", "were", "their", "one", "all", "we", "can", "her", "has", "there", "been", "if", "more",
    "when", "will", "would", "who", "so", "no", "she", "other", "its", "may", "these", "what", "them",
    "than", "some", "him", "time", "into", "only", "do", "could", "new", "about", "two", "then",
    "first", "also", "after", "any", "like", "should", "our", "over", "such", "most", "where", "made",
    "very", "between", "years", "through", "work", "many", "before", "must", "people", "being",
    "well", "back", "still", "under", "while", "even", "water", "morning", "harbour", "village",
    "river", "garden", "engine", "model", "question", "answer", "story", "number", "system", "table",
    "window", "letter", "market", "teacher", "student", "library", "weather", "journey", "mountain",
    "kitchen", "summer", "winter", "evening", "island", "forest", "bridge", "station", "travel",
    "simple", "careful", "quiet", "bright", "green", "small", "large", "early", "late", "quickly",
    "slowly", "together", "always", "often", "never", "usually", "explain", "remember", "describe",
    "compare", "measure", "build", "write", "read", "find", "learn", "share", "count", "open",
    "close", "begin", "finish", "carry", "follow", "choose", "change", "return", "reason", "result",
    "method", "process", "request", "memory", "cache", "token", "batch", "prefix", "state", "layer",
    "value", "signal", "pattern", "detail", "example", "problem", "solution", "language", "history",
    "science", "music", "picture", "paper", "pencil", "school", "city", "country", "ocean", "boat",
    "fisherman", "daughter", "notebook", "clever", "gentle", "ancient", "modern", "common", "strange",
    "important", "possible", "different", "similar", "useful", "careful", "honest", "patient",
    "friendly", "happy", "tired", "ready", "because", "although", "however", "therefore", "perhaps",
    "almost", "enough", "across", "around", "behind", "beyond", "during", "without", "within",
    "against", "toward", "along", "among", "above", "below", "inside", "outside", "north", "south",
    "east", "west", "light", "sound", "color", "shape", "size", "speed", "distance", "direction",
    "energy", "power", "field", "space", "planet", "star", "moon", "cloud", "rain", "snow", "wind",
    "stone", "tree", "flower", "bird", "horse", "dog", "cat", "fox", "apple", "bread", "coffee",
    "tea", "music", "song", "dance", "game", "team", "player", "friend", "family", "house", "road",
)  # fmt: skip


class TextMaker:
    """English-like text of a target token length, from ``WORDS``."""

    def __init__(self, codec: Codec) -> None:
        self.codec = codec
        self._ids: dict[str, list[int]] = {}

    def piece_ids(self, piece: str) -> list[int]:
        ids = self._ids.get(piece)
        if ids is None:
            ids = self._ids[piece] = self.codec.encode(piece)
        return ids

    def text(
        self,
        rng: random.Random,
        n_tokens: int,
        *,
        lead_space: bool = True,
        end: str = ".",
        distinct_first: set[int] | None = None,
    ) -> str:
        """About ``n_tokens`` tokens of sentences. ``distinct_first``: ids already used as
        a first token; the first word is drawn to start with a new one (and added)."""
        parts: list[str] = []
        total = 0
        left = 0
        while total < max(n_tokens, 1):
            if left == 0:
                left = rng.randint(6, 14)
            word = rng.choice(WORDS)
            first_of_sentence = not parts or parts[-1] in (".", "?")
            if first_of_sentence:
                word = word.capitalize()
            space = " " if (parts or lead_space) else ""
            if not parts and distinct_first is not None:
                for _ in range(200):
                    if self.piece_ids(space + word)[0] not in distinct_first:
                        break
                    word = rng.choice(WORDS).capitalize()
                distinct_first.add(self.piece_ids(space + word)[0])
            parts.append(space + word)
            total += len(self.piece_ids(space + word))
            left -= 1
            if left == 0 and total < n_tokens:
                parts.append(".")
                total += 1
        parts.append(end)
        return "".join(parts)
