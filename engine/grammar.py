"""Grammars: constraints compiled against the model's vocabulary, and the token masks they give.

``Grammars`` (one per engine core) compiles a ``Constraint`` once and keeps the result in an
LRU cache, so requests with the same schema share one compiled grammar. Compiles run on its
own worker threads (``compile_async``: a future; one compile per constraint in flight, however
many requests ask), never on a loop that serves other requests: xgrammar releases the GIL
while it compiles. A front end asks first and waits at most ``compile_timeout_s``
(``EngineClient.compile_constraint``: a 400 when it runs out); the core parks a request whose
grammar is still compiling and admits it once it is ready (``engine/core/grammar_wait.py``). A
compile cannot be interrupted: one that outlives its deadline finishes on its worker and is
cached. At interpreter exit the compiles in flight are waited for (an ``atexit`` hook; the
limits of ``engine/constraint.py`` keep them to seconds): CPython ends a daemon thread that
comes back from native code while it finalizes with ``pthread_exit``, which the native
compiler's frames cannot unwind, and the process aborts ("terminate called without an active
exception", seen here on a 1,000-property schema left compiling at exit). The same hook then
releases the native objects in order (compiled grammars, the batch matcher, the compiler, the
tokenizer info: ``Grammars.release``), unfreezes what ``gc.freeze`` kept out of the collector's
sight (the core process freezes its startup objects) and collects: xgrammar's and triton's
nanobind objects still alive when the interpreter tears down their modules are reported as
"nanobind: leaked ..." on stderr (a 30-line dump at every stop of the server).

Each constrained request owns a ``GrammarMatcher`` (``RequestState.matcher``) that advances
with every token the request accepts. ``fill_masks`` writes the next-token bitmask of a batch
of matchers (one int32 row of ``ceil(vocab / 32)`` words per logits row; bit set = allowed).
The engine uses xgrammar (tools/bench/bench_grammar.py measured it against llguidance).

A constraint with ``starts_after`` (a reasoning model's answer, after ``</think>``) gets a
``GatedMatcher`` (``engine/grammar_gate.py``): the same interface, free text until the marker,
then this grammar. Its free-phase masks are built once per marker (``gate_tables``), and
``fill_masks`` takes plain and gated matchers in one batch.
"""

from __future__ import annotations

import asyncio
import atexit
import copy
import gc
import queue
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
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
from deltaserve.engine.errors import GrammarTimeoutError, InvalidRequestError
from deltaserve.engine.grammar_gate import GatedMatcher, GateTables
from deltaserve.logs import get_logger

log = get_logger("deltaserve.engine")

CACHE_ENTRIES = 256  # compiled grammars kept (least recently used evicted)

#: every Grammars, for the exit hook
_LIVE: weakref.WeakSet[Grammars] = weakref.WeakSet()


def timeout_error(timeout_s: float) -> GrammarTimeoutError:
    return GrammarTimeoutError(
        f"SamplingParams.constraint: the output constraint did not compile within {timeout_s:g} s "
        "(structured_outputs.compile_timeout_s); a smaller schema compiles faster"
    )


async def wait_compiled(fut: Future[Any], timeout_s: float) -> None:
    """Wait for a ``compile_async`` future at most ``timeout_s`` seconds: its error
    (``InvalidRequestError``), or ``GrammarTimeoutError``. Never cancels the compile (other
    requests may wait on it, and its result is cached for the next)."""
    if not fut.done():
        wrapped = asyncio.wrap_future(fut)
        done, _ = await asyncio.wait({wrapped}, timeout=timeout_s)
        if not done:
            raise timeout_error(timeout_s)
    fut.result()


class Grammars:
    """The engine's compiler and its LRU cache of compiled grammars."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Iterable[int],
        *,
        cache_entries: int = CACHE_ENTRIES,
        threads: int = 2,
        timeout_s: float = 10.0,
    ) -> None:
        self.vocab_size = int(vocab_size)
        self.timeout_s = timeout_s
        self._tokenizer = tokenizer
        self._stop_ids = sorted(stop_token_ids)
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._entries = cache_entries
        self._lock = threading.Lock()
        self._ready = False  # the vocabulary is read on first use (engines that never constrain skip it)
        self._inflight: dict[tuple[str, str], Future[Any]] = {}
        self._jobs: queue.SimpleQueue[tuple[Constraint, Future[Any]] | None] = queue.SimpleQueue()
        self._num_threads = threads
        self._threads: list[threading.Thread] = []  # started on the first compile
        self._gates: dict[str, GateTables] = {}  # free-phase masks per end marker (``gate_tables``)
        self.compiles = 0  # cache misses (tests, stats)
        self.compile_errors = 0
        _LIVE.add(self)

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

    def cached(self, c: Constraint) -> Any | None:
        """The compiled grammar of ``c`` if it is in the cache (marked as used), else None."""
        key = c.key
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
            return hit

    def compile_async(self, c: Constraint) -> Future[Any]:
        """A future of ``c``'s compiled grammar: done at once on a cache hit, else the compile
        in flight for ``c`` (started now if none is). Its error is an ``InvalidRequestError``."""
        key = c.key
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                done: Future[Any] = Future()
                done.set_result(hit)
                return done
            fut = self._inflight.get(key)
            if fut is None:
                fut = self._inflight[key] = Future()
                self._jobs.put((c, fut))
                if len(self._threads) < self._num_threads:
                    self._start_worker()
            return fut

    def compile(self, c: Constraint) -> Any:
        """The compiled grammar of ``c`` (cached), waiting for it as long as it takes."""
        return self.compile_async(c).result()

    @property
    def compiling(self) -> int:
        """Constraints being compiled or waiting for a worker."""
        with self._lock:
            return len(self._inflight)

    def close(self) -> None:
        """Stop the workers: compiles not started are cancelled, one running finishes (a
        compile cannot be interrupted). Returns at once; ``join`` waits."""
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job[1].cancel()
        with self._lock:
            self._inflight.clear()
        for _ in self._threads:
            self._jobs.put(None)

    def join(self) -> None:
        """Wait until the workers have stopped (after ``close``)."""
        for t in self._threads:
            t.join()

    def release(self) -> None:
        """Drop the native objects, users before what they use: the compiled grammars, the
        batch matcher, the compiler, the tokenizer info (after ``close`` and ``join``; the next
        compile builds them again). Matchers of live requests hold their compiled grammar and
        go with their requests."""
        with self._lock:
            self._cache.clear()
            self._inflight.clear()
            self._gates.clear()
            self._ready = False
            for name in ("_batch", "_compiler", "info"):
                self.__dict__.pop(name, None)

    def _start_worker(self) -> None:
        t = threading.Thread(target=self._work, name=f"deltaserve-grammar-{len(self._threads)}", daemon=True)
        self._threads.append(t)
        t.start()

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            c, fut = job
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                self._ensure()
                compiled = self._compile(c)
            except Exception as e:  # noqa: BLE001 - the requests waiting on it get the error
                with self._lock:
                    self._inflight.pop(c.key, None)
                    self.compile_errors += 1
                log.warning("grammar.compile_failed", kind=c.kind.value, error=repr(e))
                fut.set_exception(InvalidRequestError(f"SamplingParams.constraint: did not compile: {e}"))
                continue
            with self._lock:
                self.compiles += 1
                self._cache[c.key] = compiled
                self._cache.move_to_end(c.key)
                while len(self._cache) > self._entries:
                    self._cache.popitem(last=False)
                self._inflight.pop(c.key, None)
            fut.set_result(compiled)

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
        """A new matcher of ``c`` at the start of the output (compiled here if not cached: the
        engine asks only once ``cached`` has it)."""
        compiled = self.compile(c)
        return self._xgr.GrammarMatcher(compiled)

    def matcher_of(self, compiled: Any, starts_after: str | None = None) -> Any:
        """A new matcher of a compiled grammar (``cached`` / ``compile_async``'s result);
        ``starts_after``: the grammar holds only after the output's text contains it (a
        ``GatedMatcher``; ``Constraint.starts_after``)."""
        matcher = self._xgr.GrammarMatcher(compiled)
        if starts_after is None:
            return matcher
        return GatedMatcher(matcher, self.gate_tables(starts_after))

    def gate_tables(self, marker: str) -> GateTables:
        """The free-phase masks of ``marker`` over this vocabulary (built on first use: one
        pass over the tokens that hold the marker's last byte)."""
        self._ensure()
        with self._lock:
            tables = self._gates.get(marker)
        if tables is None:
            tables = GateTables(marker, self.info.decoded_vocab, self.vocab_size, self.info.stop_token_ids)
            with self._lock:
                tables = self._gates.setdefault(marker, tables)
        return tables

    def allocate(self, rows: int) -> torch.Tensor:
        """A bitmask of ``rows`` rows, every token allowed (int32, CPU)."""
        return torch.full((rows, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)

    def fill_masks(self, matchers: Sequence[Any], bitmask: torch.Tensor, rows: list[int]) -> None:
        """Row ``rows[i]`` of ``bitmask`` := the next-token mask of ``matchers[i]`` (plain or
        gated: the grammar-phase ones go to the native batch call together)."""
        native: list[Any] = []
        native_rows: list[int] = []
        for m, row in zip(matchers, rows, strict=True):
            if not isinstance(m, GatedMatcher):
                native.append(m)
                native_rows.append(row)
            elif m.in_grammar:
                native.append(m.inner)
                native_rows.append(row)
            else:
                m.fill_next_token_bitmask(bitmask, row)
        if native:
            self._batch.batch_fill_next_token_bitmask(native, bitmask, indices=native_rows)


@atexit.register
def _finish_compiles() -> None:
    """Let the compiles in flight end, then release the native objects and collect, before the
    interpreter finalizes (module docstring)."""
    for grammars in list(_LIVE):
        if grammars.compiling:
            log.info("grammar.exit_wait", compiling=grammars.compiling)
        grammars.close()
        grammars.join()
        grammars.release()
    gc.unfreeze()  # frozen objects are never collected: their native members would outlive their modules
    gc.collect()
