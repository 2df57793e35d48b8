"""Overlap: the step loop of async scheduling (``engine.async_scheduling = true``).

The forward runs on a worker thread (one step at a time, in order: on CUDA it only enqueues
kernels), and each ``EngineCore.step()`` call does, on the caller's thread::

    commit N ahead   scheduler.update(N, placeholders): N's plan is committed although N's
                     forward may still run; each request that samples in N gets the
                     placeholder of its row (``scheduler.request.placeholder``) as its next token
    end deferred     requests that finished (stop, abort, error) while N was in flight
    schedule N+1     as if every decode got its token: a placeholder is a token to compute
    prepare N+1      host tensors; then hand N+1 to the worker, whose input ids for the
                     placeholders are read from N's sampled-token tensor on the device
    process N        wait for N's tokens (the only wait), fill the placeholders in, then
                     check stops and build outputs while N+1 runs

so ``step()`` returns step N's outputs while N+1 is in flight. (While some request has a
constraint, ``EngineCore.num_constrained``, N is processed before N+1 is scheduled: a
constrained row's token mask needs its matcher advanced by N's token.) Committing ahead is safe
because every later reader of what N publishes (a prefix hit, a restore) is a later step,
which the worker (or the CUDA stream) runs after N. A request found finished in N is in N+1
already: it ends once N+1 is committed (``defer``), and its token from N+1 is discarded (its
blocks and slots are released then; the extra token's KV is real output and may stay cached).
The failure rules stay local: a failed prepare ends that step's requests; a forward that fails
on the worker ends its step's requests and those of the step after it (scheduled on its
results, refused by the worker), and ``CacheManager.discard_written`` drops what its early
commit published. A step's host-tier copies run on the worker before its forward; the early
commit lands them (``Scheduler.land``) first. Design notes: docs/architecture.md, "The step loop".

With speculative decoding (``engine/core/spec_step.py``) a step that verifies drafts is not
overlapped: its commit needs its accepted lengths, and a draft must follow a real token. So
drafts are set only when no step is in flight; a step with verify segments runs on this
thread and is committed and processed before the next is scheduled (``EngineCore.run_step``);
and a step in flight with a request that may draft after it is waited for (before its early
commit: nothing it reads is released meanwhile) and processed before the next is scheduled.
Steps in which no request can draft overlap as without speculation.
"""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from deltaserve.engine.messages import TokenDelta
from deltaserve.engine.runner.host_pool import Failure
from deltaserve.engine.runner.model_runner import PreparedStep, StepResult
from deltaserve.logs import get_logger
from deltaserve.scheduler.request import Request, RequestStatus, placeholder
from deltaserve.scheduler.scheduler import SchedulerOutput

if TYPE_CHECKING:
    from collections.abc import Sequence

    from deltaserve.cache.manager import CacheManager
    from deltaserve.engine.core.spec_step import SpecDecoding
    from deltaserve.engine.core.step_phases import StepPhases
    from deltaserve.engine.runner.model_runner import ModelRunner
    from deltaserve.engine.runner.request_state import RequestState
    from deltaserve.scheduler.scheduler import Scheduler

log = get_logger("deltaserve.engine")


class StepSkipped(RuntimeError):
    """The forward worker refused a step: the step before it failed, and this one was scheduled
    on that step's (never produced) results."""


@dataclass(eq=False)
class InFlight:
    """A step handed to the forward worker, its plan not yet committed."""

    out: SchedulerOutput
    prep: PreparedStep | None  # None: a step of host-tier copies only
    future: Future[StepResult | None]
    transfers: Future[list[Failure]]  # the step's host-tier copies that failed (set before the forward)
    requests: set[Request]  # the step's requests, and those whose loads it carries (identity set)


class StepHost(Protocol):
    """What the overlapped step needs of its engine (``EngineCore``): the parts it works, and
    the engine's way of ending requests and building outputs, which the plain step uses too,
    so that both steps end requests alike."""

    scheduler: Scheduler
    cache: CacheManager
    runner: ModelRunner
    states: dict[str, RequestState]
    counters: dict[str, int]
    phases: StepPhases
    speculation: SpecDecoding | None

    @property
    def num_constrained(self) -> int: ...
    def land(self, out: SchedulerOutput, failures: Sequence[Failure]) -> list[TokenDelta]: ...
    def step_failed(self, out: SchedulerOutput, error: Exception) -> list[TokenDelta]: ...
    def recover_failed_update(self, out: SchedulerOutput, error: Exception) -> list[TokenDelta]: ...
    def fail_request(
        self, req: Request, what: str, error: BaseException, *, finish: bool = True
    ) -> TokenDelta: ...
    def process_token(self, req: Request, token: int) -> TokenDelta: ...
    def output_failed(self, req: Request, error: Exception) -> TokenDelta: ...
    def run_step(self, out: SchedulerOutput) -> list[TokenDelta]: ...


class Overlap:
    """The overlapped step of one ``EngineCore`` (module docstring): the step in flight, the
    requests whose end waits for it, and the worker thread that runs the forwards in order.

    It works its host's scheduler, runner and cache and ends requests and builds outputs
    through the host's helpers (``StepHost``): the plain step and this one do that the same way.
    """

    def __init__(self, core: StepHost) -> None:
        self.core = core
        self.flight: InFlight | None = None
        self.deferred: dict[Request, tuple[str, bool]] = {}  # request -> (reason, publish_output)
        self._worker: ThreadPoolExecutor | None = None  # started on first use, stopped by close()
        self._worker_broken = False  # a step failed on the worker: it refuses the next until reset
        # step -> (start, end) of its launch on the worker, read once its future is done
        self._launch_times: dict[int, tuple[float, float]] = {}
        self._last_ready = 0.0  # when the last step's tokens were ready (perf_counter)

    # ------------------------------------------------------------------ ending requests
    def defer(self, req: Request, reason: str, publish_output: bool) -> bool:
        """Hold the end of ``req`` while it is in the step in flight (whose plan the cache still
        holds) until that step is committed; False if it is not in flight (end it now)."""
        if self.flight is None or req not in self.flight.requests:
            return False
        self.deferred[req] = (reason, publish_output)
        return True

    def apply_deferred(self) -> None:
        """End the requests that waited for their step to leave flight (it has)."""
        deferred, self.deferred = self.deferred, {}
        for req, (reason, publish_output) in deferred.items():
            self.core.scheduler.finish(req, reason, publish_output=publish_output)

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[TokenDelta]:
        """One turn: commit step N (on the worker) ahead of its result, schedule and launch
        N+1, then process N's tokens while N+1 runs; N's outputs."""
        outputs: list[TokenDelta] = []
        prev, self.flight = self.flight, None
        spec = self.core.speculation
        drafts_next = prev is not None and spec is not None and self._drafts_after(prev, spec)
        if drafts_next:
            assert prev is not None
            with contextlib.suppress(Exception):  # (a failure is handled when it is processed)
                prev.future.result()
        self.core.phases.enter("cache_commit")
        if prev is not None and not self._commit_ahead(prev, outputs):
            prev = None  # its commit failed: that step's requests have ended
        self.apply_deferred()
        if prev is not None and (drafts_next or self.core.num_constrained):
            # a constrained row's mask needs its previous token, and a draft follows a real
            # token: step N is processed before N+1 is scheduled (no overlap)
            self._process_result(prev, outputs)
            prev = None
        if spec is not None:
            spec.set_drafts(none=prev is not None)  # (in flight: its tokens are placeholders)
        self.core.phases.enter("schedule")
        out = self.core.scheduler.schedule()
        if out is not None and out.num_verify:
            # (prev is None: nothing drafts while a step is in flight)
            outputs += self.core.run_step(out)
            self._last_ready = time.perf_counter()
        elif out is not None:
            self.flight = self._submit(out, prev, outputs)
        elif prev is None:
            self.core.cache.wait_for_disk()  # nothing runs: a read from disk may let a request in
        if prev is not None:
            self._process_result(prev, outputs)
        return outputs

    def _drafts_after(self, flight: InFlight, spec: SpecDecoding) -> bool:
        """Whether a request that samples in step ``flight`` may draft in the step after it."""
        if flight.prep is None:
            return False
        seqs, deferred = flight.out.seqs, self.deferred
        return any(
            spec.may_draft_after(seqs[i].request)
            for i in flight.prep.sample_seq
            if seqs[i].request not in deferred
        )

    def drain(self) -> list[TokenDelta]:
        """Finish the step in flight without starting another."""
        outputs: list[TokenDelta] = []
        while self.flight is not None:
            prev, self.flight = self.flight, None
            if self._commit_ahead(prev, outputs):
                self.apply_deferred()
                self._process_result(prev, outputs)
        self.apply_deferred()
        return outputs

    def close(self) -> None:
        """Drain (its outputs are dropped), then stop the worker; a later ``step`` restarts it."""
        self.drain()
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None

    def _commit_ahead(self, flight: InFlight, outputs: list[TokenDelta]) -> bool:
        """Commit step N's plan before its result is known (the forward may still run): every
        request that samples in N gets the placeholder of its row, so the scheduler sees it
        decoding. False when the commit raised (handled like a failed commit, once the step
        has finished on the worker)."""
        core, out = self.core, flight.out
        # the step's host-tier copies ran first on the worker (usually long done): land them,
        # and end the requests whose loads failed (they compute nothing in this step)
        outputs += core.land(out, flight.transfers.result())
        placeholders: list[int | None] = [None] * len(out.seqs)
        if flight.prep is not None:
            for row, i in enumerate(flight.prep.sample_seq):
                if out.seqs[i].request not in self.deferred:
                    placeholders[i] = placeholder(row)
        try:
            core.scheduler.update(out, placeholders)
        except Exception as e:
            # the forward is running into slots this recovery may free: let it finish first
            with contextlib.suppress(Exception):
                flight.future.result()
            outputs += core.recover_failed_update(out, e)
            if flight.future.exception() is not None:
                self._discard_written(flight)
            self._worker_broken = False
            return False
        core.counters["tokens.computed"] += out.num_tokens
        return True

    def _submit(
        self, out: SchedulerOutput, prev: InFlight | None, outputs: list[TokenDelta]
    ) -> InFlight | None:
        """Prepare step ``out`` on this thread and hand it to the forward worker (its host-tier
        copies, then its forward); None (and its requests ended) if preparing it failed."""
        core = self.core
        prep = None
        if out.seqs:  # (a step may carry host-tier copies only)
            try:
                prep = core.runner.prepare(out, core.states, placeholder_step=prev.out.step if prev else -1)
            except Exception as e:
                outputs += core.step_failed(out, e)  # (its copies, never run, are released)
                return None
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deltaserve-forward")
        transfers: Future[list[Failure]] = Future()
        future = self._worker.submit(self._launch, out, prep, transfers)
        requests = {s.request for s in out.seqs}
        for t in out.plan.loads:  # a loading request must not be freed before its copies ran
            req = core.scheduler.requests.get(t.seq.request_id) if t.seq is not None else None
            if req is not None:
                requests.add(req)
        return InFlight(out, prep, future, transfers, requests)

    def _launch(
        self, out: SchedulerOutput, prep: PreparedStep | None, transfers: Future[list[Failure]]
    ) -> StepResult | None:
        """On the forward worker: the step's host-tier copies (their failures go to
        ``transfers`` at once, for the early commit), then its forward — unless the step
        before failed: then neither runs."""
        if self._worker_broken:
            transfers.cancel()
            raise StepSkipped(f"step {out.step} follows a failed step")
        try:
            # (host copies report failures; a device block move that raises stops the engine:
            # the cache already addresses its destination)
            transfers.set_result(self.core.runner.transfer(out))
            if prep is None:
                return None
            started = time.perf_counter()
            result = self.core.runner.launch(prep)
            self._launch_times[out.step] = (started, time.perf_counter())
            return result
        except BaseException as e:
            if not transfers.done():
                transfers.set_exception(e)
            self._worker_broken = True
            raise

    def _process_result(self, flight: InFlight, outputs: list[TokenDelta]) -> None:
        """Step N's tokens: fill the placeholders, then check stops and build
        outputs (the next step runs meanwhile). A request that ended while N was in flight has
        its token discarded."""
        try:
            result = flight.future.result()
            tokens = result.token_list() if result is not None else []
        except Exception as e:
            outputs += self._recover(flight, e)
            return
        if flight.prep is None or result is None:
            return  # host-tier copies only
        self._observe(flight.out, result)
        core, seqs, deferred = self.core, flight.out.seqs, self.deferred
        core.phases.enter("outputs")
        finished = RequestStatus.FINISHED
        logprobs, spec = result.logprobs, core.speculation
        for row, i in enumerate(flight.prep.sample_seq):
            req = seqs[i].request
            if req.status is finished or req in deferred:
                continue
            token = tokens[row]
            ids = req.token_ids
            if ids[-1] == placeholder(row):
                ids[-1] = token
            else:  # preempted while in flight: its placeholder was dropped, the token goes on
                ids.append(token)
            if logprobs is not None and logprobs[row] is not None:
                core.states[req.request_id].logprobs.append(logprobs[row])  # type: ignore[arg-type]
            try:
                delta = core.process_token(req, token)
                outputs.append(delta if spec is None else spec.finish_hook(req, delta))
            except Exception as e:  # the stop check of one request (its grammar): that request ends
                outputs.append(core.output_failed(req, e))

    def _observe(self, out: SchedulerOutput, result: StepResult) -> None:
        """Report the step's time to the scheduler's step-time model. On the CPU the launch is
        the forward; on a device it only queues kernels, so the step ends when its tokens are
        ready (seen here, after ``token_list``) and starts when it was queued or when the step
        before it ended, whichever is later."""
        times = self._launch_times.pop(out.step, None)
        if times is None:
            return
        started, launched = times
        ended = launched if result.tokens.device.type == "cpu" else time.perf_counter()
        self.core.scheduler.observe_step(out, max(ended - max(started, self._last_ready), 0.0))
        self._last_ready = ended

    def _recover(self, flight: InFlight, error: Exception) -> list[TokenDelta]:
        """Step N failed on the worker after its plan was committed. It ends N's requests and
        those of step N+1 (scheduled on N's results, refused by the worker), and drops what N's
        commit published: KV blocks and checkpoints its forward never wrote."""
        core = self.core
        core.counters["steps.failed"] += 1
        log.error("step.failed", error=repr(error), requests=[s.request.request_id for s in flight.out.seqs])
        outputs: list[TokenDelta] = []
        nxt, self.flight = self.flight, None
        if nxt is not None:
            with contextlib.suppress(Exception):
                nxt.future.result()  # refused, or ran: either way it is over before we free
            core.counters["steps.failed"] += 1
            for req in core.scheduler.fail_step(nxt.out):
                if self.deferred.pop(req, None) is None:  # (a deferred one has had its output)
                    outputs.append(core.fail_request(req, "model step failed", error, finish=False))
        for s in flight.out.seqs:
            if s.request.status is not RequestStatus.FINISHED:
                outputs.append(core.fail_request(s.request, "model step failed", error))
        self.apply_deferred()
        self._discard_written(flight)
        self._worker_broken = False
        self._launch_times.clear()  # (no step is in flight now: their times are nobody's)
        return outputs

    def _discard_written(self, flight: InFlight) -> None:
        """Drop the cache entries whose contents a failed step was to write (committed ahead)."""
        if flight.prep is None:
            return  # copies only: what they wrote landed (or was released) at the early commit
        blocks, slots = self.core.runner.written(flight.prep, self.core.cache.block_size)
        dropped = self.core.cache.discard_written(blocks, slots)
        if dropped:
            log.warning("step.cache_discarded", step=flight.out.step, entries=dropped)
