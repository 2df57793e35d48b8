"""Grammars: constraints compiled against the model's vocabulary, and the token masks they give.

``Grammars`` (one per engine) compiles a ``Constraint`` once and keeps the result in an LRU
cache, so requests with the same schema share one compiled grammar. It is thread-safe: the
server compiles in a worker thread before a request reaches the engine (a cache hit in the
step thread afterwards), and the engine compiles whatever was not (``EngineCore.add_request``).

Each constrained request owns a ``GrammarMatcher`` (``RequestState.matcher``) that advances
with every token the request accepts. ``fill_masks`` writes the next-token bitmask of a batch
of matchers (one int32 row of ``ceil(vocab / 32)`` words per logits row; bit set = allowed).
The engine uses xgrammar (tools/bench_grammar.py measured it against llguidance).
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from deltaserve.engine.constraint import (
    JSON_SEPARATORS,
    Constraint,
    ConstraintKind,
    bounded_schema,
    build_grammar,
    choice_ebnf,
)

CACHE_ENTRIES = 256  # compiled grammars kept (least recently used evicted)


class Grammars:
    """The engine's compiler and its LRU cache of compiled grammars."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Iterable[int],
        *,
        cache_entries: int = CACHE_ENTRIES,
    ) -> None:
        self.vocab_size = int(vocab_size)
        self._tokenizer = tokenizer
        self._stop_ids = sorted(stop_token_ids)
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._entries = cache_entries
        self._lock = threading.Lock()
        self._ready = False  # the vocabulary is read on first use (engines that never constrain skip it)
        self.compiles = 0  # cache misses (tests, stats)

    def _ensure(self) -> None:
        with self._lock:
            if self._ready:
                return
            import xgrammar as xgr

            self._xgr = xgr
            # a private copy: HF tokenizers are not safe to share between threads
            tokenizer = copy.deepcopy(self._tokenizer)
            # the model's vocabulary may be padded past the tokenizer's: those ids are never allowed
            self.info = xgr.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=self.vocab_size, stop_token_ids=self._stop_ids
            )
            # the cache is ours (one entry per spec); xgrammar's own would keep a second copy
            self._compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
            self._batch = xgr.BatchGrammarMatcher(max_threads=1)
            self._ready = True

    def compile(self, c: Constraint) -> Any:
        """The compiled grammar of ``c`` (cached)."""
        self._ensure()
        key = c.key
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        compiled = self._compile(c)
        with self._lock:
            self.compiles += 1
            self._cache[key] = compiled
            self._cache.move_to_end(key)
            while len(self._cache) > self._entries:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, c: Constraint) -> Any:
        comp = self._compiler
        if c.kind is ConstraintKind.JSON_SCHEMA:
            assert isinstance(c.spec, str)
            schema = bounded_schema(c.spec)
            return comp.compile_json_schema(schema, any_whitespace=False, separators=JSON_SEPARATORS)
        if c.kind is ConstraintKind.CHOICE:
            assert isinstance(c.spec, list)
            return comp.compile_grammar(choice_ebnf(c.spec))
        if c.kind is ConstraintKind.REGEX:
            assert isinstance(c.spec, str)
            return comp.compile_regex(c.spec)
        return comp.compile_grammar(build_grammar(c))

    def matcher(self, c: Constraint) -> Any:
        """A new matcher of ``c`` at the start of the output."""
        compiled = self.compile(c)
        return self._xgr.GrammarMatcher(compiled)

    def allocate(self, rows: int) -> torch.Tensor:
        """A bitmask of ``rows`` rows, every token allowed (int32, CPU)."""
        return torch.full((rows, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)

    def fill_masks(self, matchers: Sequence[Any], bitmask: torch.Tensor, rows: list[int]) -> None:
        """Row ``rows[i]`` of ``bitmask`` := the next-token mask of ``matchers[i]``."""
        self._batch.batch_fill_next_token_bitmask(list(matchers), bitmask, indices=rows)
