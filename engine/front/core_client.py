"""The core client: how the front end (``AsyncEngine``) talks to an engine core, wherever it runs.

``AsyncEngine`` is input processor -> core client -> output processor in every placement; only
the core client differs:

* ``LocalCoreClient`` (``engine/front/local_core.py``): the core in this process, stepped on a
  worker thread by the core loop (``engine.core_process = "in_process"``);
* ``ProcCoreClient`` (``engine/front/proc_core.py``): the core in a process of its own, over
  ZeroMQ (``engine.core_process = "separate"``; ``deltaserve serve``'s default);
* ``RayCoreClient`` (``cluster/ray_core.py``): cores in Ray Serve replicas behind a router (the
  cluster ingress builds its ``AsyncEngine`` with it).

Contract of a core client (``CoreClient``):

* ``start(sink)`` starts or joins the core and returns its ``Ready`` (what the front end builds
  its ``InputProcessor`` from); from then on the client calls ``sink.on_outputs`` with each
  step's ``StepOutputs`` (token deltas in the order the core produced them, stats when due) and
  ``sink.on_dead(message)`` once if the core can no longer serve. Both run on the front end's
  event loop.
* ``add_requests`` / ``abort_requests`` never wait: requests (validated, tokenized and admitted
  by the front end, their ids unique: the core trusts them) and aborts are applied in order, between
  steps. An aborted request's final delta may still arrive; the front end drops it.
* ``check_capacity(n)`` raises ``EngineOverloadedError`` when ``n`` more requests would overflow
  ``scheduler.max_waiting`` (admission control happens there, once).
* ``stats()`` is the core's last reported stats; ``fetch_stats()`` takes them now.
* ``check_integrity``, ``compile_constraint``, ``is_healthy`` and ``shutdown`` (idempotent; the
  front end has ended its streams already) as ``EngineClient`` documents them.
* ``input_processor``: an ``InputProcessor`` the front end may use as its own (the in-process
  core's), or None: the front end loads the tokenizer (``models/tokenizer.py``) and builds one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from deltaserve.engine.errors import EngineOverloadedError

if TYPE_CHECKING:
    from deltaserve.engine.constraint import Constraint
    from deltaserve.engine.front.input_processor import InputProcessor
    from deltaserve.engine.messages import AddRequest, Ready, StepOutputs


class OutputSink(Protocol):
    """Where a core client delivers what the core sends (the front end)."""

    def on_outputs(self, outputs: StepOutputs) -> None:
        """One step's deltas (and stats when due), in order."""
        ...

    def on_dead(self, message: str) -> None:
        """The core can no longer serve (it died, or its loop did): ``message`` says why."""
        ...


class CoreClient(Protocol):
    """The front end's view of an engine core (module docstring)."""

    #: the process the core runs in (this one for the in-process core); None before ``start``
    core_pid: int | None

    @property
    def input_processor(self) -> InputProcessor | None: ...

    async def start(self, sink: OutputSink) -> Ready: ...

    def core_ids(self, request_id: str, n: int) -> list[str]:
        """The core request ids of a request's ``n`` completions (unique among this front end's
        open ones as long as ``request_id`` is; the front end checks)."""
        ...

    def add_requests(self, adds: list[AddRequest]) -> None: ...

    def abort_requests(self, request_ids: list[str]) -> None: ...

    def check_capacity(self, n: int) -> None: ...

    def stats(self) -> dict[str, Any]: ...

    async def fetch_stats(self) -> dict[str, Any]: ...

    async def check_integrity(self) -> None: ...

    async def compile_constraint(self, constraint: Constraint) -> None: ...

    def is_healthy(self) -> bool: ...

    async def shutdown(self) -> None: ...


def check_waiting(waiting: int, limit: int) -> None:
    """``check_capacity``'s one rule: ``waiting`` (queued, parked and about to be added) must stay
    below ``scheduler.max_waiting``."""
    if waiting >= limit:
        raise EngineOverloadedError(
            f"waiting queue is full ({waiting} >= scheduler.max_waiting = {limit}); retry later"
        )
