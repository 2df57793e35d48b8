"""Requests whose output constraint is still compiling: parked beside the scheduler until ready.

``EngineCore.add_request`` parks a request whose grammar is not in the cache while a worker of
``Grammars`` compiles it (``compile_async``); at the start of each step ``take`` hands back the
requests whose compile finished (to be admitted, in the order they arrived) and those whose
compile failed or outlived ``timeout_s`` (to end with that error). A parked request holds no
block, slot or scheduler entry: aborting it is forgetting it. Torch-free; the clock is given.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass
from typing import Any

from deltaserve.engine.grammar import timeout_error
from deltaserve.scheduler.request import Request


@dataclass(slots=True)
class _Parked:
    req: Request
    compiled: Future[Any]
    deadline: float


class GrammarWait:
    """Parked requests by id, in arrival order."""

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s = timeout_s
        self.clock = clock
        self._parked: dict[str, _Parked] = {}
        self.timeouts = 0  # requests ended because their compile outlived the deadline

    def __len__(self) -> int:
        return len(self._parked)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._parked

    def __iter__(self) -> Iterator[Request]:
        return (p.req for p in list(self._parked.values()))

    def park(self, req: Request, compiled: Future[Any]) -> None:
        self._parked[req.request_id] = _Parked(req, compiled, self.clock() + self.timeout_s)

    def remove(self, request_id: str) -> Request | None:
        parked = self._parked.pop(request_id, None)
        return None if parked is None else parked.req

    def take(self) -> tuple[list[tuple[Request, Any]], list[tuple[Request, BaseException]]]:
        """``(ready, failed)``: the requests whose compile is done with its compiled grammar, and
        those that end now with the compile's error or a ``GrammarTimeoutError``; both leave."""
        ready: list[tuple[Request, Any]] = []
        failed: list[tuple[Request, BaseException]] = []
        now = self.clock()
        for rid, p in list(self._parked.items()):
            if p.compiled.done():
                del self._parked[rid]
                error = (
                    CancelledError("the grammar workers stopped")
                    if p.compiled.cancelled()
                    else p.compiled.exception()
                )
                if error is None:
                    ready.append((p.req, p.compiled.result()))
                else:
                    failed.append((p.req, error))
            elif now >= p.deadline:
                del self._parked[rid]
                self.timeouts += 1
                failed.append((p.req, timeout_error(self.timeout_s)))
        return ready, failed
