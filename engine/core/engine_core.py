"""EngineCore: the synchronous engine — requests in, one step, outputs out.

The core loop (``engine/core/core_loop.py``) drives it, in ``LocalCoreClient`` (the step on a
worker thread) and in the core process (``engine/core/core_proc.py``); tests drive it directly and call
``check_integrity()`` after every step. It is not thread-safe: its owner calls
``add_request``/``abort_request`` only between steps.

Nothing is lost: every admitted request ends with exactly one finished ``TokenDelta``
(``stop``, ``length``, ``abort`` or ``error`` with a message), and every block and slot
returns to its pool.

It emits token ids, never text: a step's outputs are ``TokenDelta``s, and a request ends here on
its stop token ids (EOS unless ``ignore_eos``), its grammar's end, ``max_tokens`` or
``max_model_len``; text and stop strings are the front end's (``engine/front/output_processor.py``),
which aborts a request a stop string ended. Admission (``check_capacity``) is the front end's
call too: ``add_request`` trusts what it is given.

Input is checked and tokenized by its ``InputProcessor`` (``make_request``: the core's own door,
for tests and tools); construction helpers are in ``engine/core/builder.py``. ``step()`` is the
plain schedule → execute → update → outputs (``run_step``); with ``engine.async_scheduling`` it
is the overlapped step of ``engine/core/overlap.py``, which ends requests and builds outputs
with the helpers here (its ``StepHost``: overlap.py never imports this module).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from deltaserve.engine.config import EngineConfig
from deltaserve.engine.core.builder import (
    build_input_processor,
    build_runner,
    close_disk_tier,
    cpu_threads,
    load_engine_model,
    model_info,
    open_events_and_disk,
    plan_engine_capacity,
    resolve_device,
    resolve_dtype,
    resolve_ops,
)
from deltaserve.engine.core.grammar_wait import GrammarWait
from deltaserve.engine.core.overlap import Overlap
from deltaserve.engine.core.sizing import Capacity, build_scheduler
from deltaserve.engine.core.spec_step import SpecDecoding
from deltaserve.engine.core.step_phases import StepPhases
from deltaserve.engine.errors import EngineOverloadedError, InvalidRequestError
from deltaserve.engine.front.client import RequestInput
from deltaserve.engine.front.input_processor import Prompt
from deltaserve.engine.grammar import Grammars
from deltaserve.engine.messages import Ready, TokenDelta
from deltaserve.engine.model_files import check_model, sampling_defaults, with_chat_template
from deltaserve.engine.outputs import TokenLogprob
from deltaserve.engine.runner.host_pool import Failure
from deltaserve.engine.runner.memory import Releaser, resident
from deltaserve.engine.runner.request_state import RequestState
from deltaserve.engine.runner.sampling import plain_greedy
from deltaserve.engine.sampling_params import SamplingParams
from deltaserve.logs import get_logger, set_level
from deltaserve.models import LoadedModel
from deltaserve.scheduler.request import Request, RequestStatus
from deltaserve.scheduler.scheduler import SchedulerOutput

log = get_logger("deltaserve.engine")

#: the engine's own counters in ``stats()``
COUNTERS = (
    "requests.finished",
    "requests.aborted",
    "requests.failed",
    "tokens.prompt",
    "tokens.generated",
    "tokens.computed",
    "steps.failed",
)


class EngineCore:
    """The synchronous engine: ``make_request`` / ``add_request`` / ``step`` / ``abort_request``.

    Construction loads the model (or takes ``loaded``), plans the cache capacity from one
    memory budget (``deltaserve.engine.core.sizing``), builds the scheduler and cache manager,
    and allocates the cache tensors. ``capacity`` tells what was built. ``phases``: a recorder
    of where each step's time goes (``engine/core/step_phases.py``; default: none recorded).
    """

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        loaded: LoadedModel | None = None,
        phases: StepPhases | None = None,
    ) -> None:
        self.config = config = config or EngineConfig()
        set_level(config.logging.level.value)
        # the model path, max_model_len, generation_config and chat_template files: one-line
        # ConfigErrors before anything slow (a hub id downloaded here pins model.path)
        check_model(config)
        self.releaser = Releaser(config.engine.release_memory)
        self.device = resolve_device(config)
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        self.ops = resolve_ops(config, self.device)
        torch.manual_seed(config.model.seed)
        self.loaded, self.spec = load_engine_model(config, loaded, self.dtype, self.device, self.ops)
        self.tokenizer = with_chat_template(self.loaded.tokenizer, config.model)
        self.capacity: Capacity = plan_engine_capacity(config, self.loaded, self.spec, self.ops, self.device)
        self.cpu_threads = cpu_threads(config, self.device, self.capacity.weight_bytes)
        for warning in self.capacity.warnings:
            log.warning("engine.capacity", detail=warning)
        self.scheduler = build_scheduler(config, self.capacity)
        self.cache = self.scheduler.cache
        self.max_model_len = self.capacity.max_model_len
        self.runner = build_runner(
            config, self.loaded, self.spec, self.ops, self.capacity, self.cache, self.device
        )
        self.phases = phases or StepPhases()
        self.runner.phases = self.scheduler.phases = self.phases
        self.eos_token_ids = frozenset(self.loaded.eos_token_ids)
        self.vocab_size = int(self.loaded.hf_config.vocab_size)
        # constraints compiled against the vocabulary (cached) on the grammar workers; a request
        # whose grammar is not compiled yet waits parked, not in the scheduler
        so = config.structured_outputs
        self.grammars = Grammars(
            self.tokenizer,
            self.vocab_size,
            self.eos_token_ids,
            threads=so.compile_threads,
            timeout_s=so.compile_timeout_s,
        )
        self.runner.grammars = self.grammars
        self.parked = GrammarWait(so.compile_timeout_s)
        # called (on a grammar worker) when a parked request's compile finishes: the owner of the
        # loop wakes it (LocalCoreClient, the core process)
        self.on_grammar_ready: Callable[[], None] | None = None
        #: the model's request defaults and their source (``model_files.sampling_defaults``)
        self.sampling_defaults = sampling_defaults(config.model)
        self.input_processor = build_input_processor(
            config, self.loaded, self.tokenizer, self.max_model_len, self.sampling_defaults[0]
        )
        self.max_token_chars = self.input_processor.max_token_chars
        self.model_info = model_info(config, self.loaded, self.capacity, self.cache.unit)
        # engine-side state of every request the scheduler holds (stop ids, generator, matcher)
        self.states: dict[str, RequestState] = {}
        self.async_scheduling = config.engine.async_scheduling
        self.overlap = Overlap(self) if self.async_scheduling else None
        # speculative decoding (with async scheduling: its verify steps are not overlapped)
        self.speculation = SpecDecoding(self, config.speculative) if config.speculative.enabled else None
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.kv_events, self.disk = open_events_and_disk(
            config, self.loaded, self.spec, self.cache, self.runner
        )
        now = resident()  # measured, beside the capacity line's expected_rss_mib
        log.info(
            "engine.ready",
            **({"rss_mib": now.mib()["rss_mib"]} if now is not None else {}),
            model=str(self.loaded.path),
            model_type=self.loaded.model_type,
            dtype=str(self.dtype),
            device=str(self.device),
            kernels=self.ops.name,
            **({"cpu_threads": self.cpu_threads} if self.cpu_threads is not None else {}),
            block_size=config.cache.block_size,
            checkpoint_unit=self.cache.unit,
            **self.model_info.capacity,
            **(
                {f"disk_{k}": v for k, v in self.disk.store.describe().items()}
                if self.disk is not None
                else {}
            ),
        )

    # ------------------------------------------------------------------ requests
    def tokenize(self, prompt: Prompt, **template: Any) -> list[int]:
        """``InputProcessor.tokenize`` (``tools``, ``chat_template_kwargs``): token ids, typed errors."""
        return self.input_processor.tokenize(prompt, **template)

    def make_request(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None, **fields: Any
    ) -> Request:
        """``process`` of a ``RequestInput`` with these fields (``AsyncEngine.generate``'s)."""
        return self.process(RequestInput(prompt=prompt, sampling_params=sampling_params, **fields))

    def process(self, inp: RequestInput) -> Request:
        """Validate and build a request (raises InvalidRequestError / PromptTooLongError): the
        input processor's checks, and a ``request_id`` not held by a request of this engine."""
        req = self.input_processor.process(inp)
        if self.has_request(req.request_id):
            raise InvalidRequestError(f"request_id {req.request_id!r} is already in use")
        return req

    def has_request(self, request_id: str) -> bool:
        """A request of this id is queued, running, or parked while its grammar compiles."""
        return request_id in self.scheduler.requests or request_id in self.parked

    def _new_state(self, req: Request, compiled: Any) -> RequestState:
        params: SamplingParams = req.sampling_params
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed)
        stop_ids = frozenset(params.stop_token_ids)
        after = None if params.constraint is None else params.constraint.starts_after  # gated matcher
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        return RequestState(
            stop_ids=stop_ids,
            generator=generator,
            plain_greedy=plain_greedy(params),
            prompt_logprobs=None if params.prompt_logprobs is None else [None] * req.num_prompt_tokens,
            matcher=None if compiled is None else self.grammars.matcher_of(compiled, after),
        )

    def check_capacity(self, pending: int = 0) -> None:
        """Admission control, the front end's (``add_request`` does not check again): raise
        EngineOverloadedError when the waiting queue, plus ``pending`` requests not added yet,
        is full."""
        waiting = self.scheduler.num_waiting + len(self.parked) + pending
        if waiting >= self.config.scheduler.max_waiting:
            raise EngineOverloadedError(
                f"waiting queue is full ({waiting} >= scheduler.max_waiting = "
                f"{self.config.scheduler.max_waiting}); retry later"
            )

    def add_request(self, req: Request) -> None:
        """Queue a request built by ``make_request`` (admitted: ``check_capacity`` is the front
        end's); its engine-side state is created here. A request whose constraint is not compiled
        yet is parked until it is (``GrammarWait``): a later step admits it, or ends it with the
        compile's error or its timeout."""
        compiled = None
        constraint = req.sampling_params.constraint
        if constraint is not None:
            fut = self.grammars.compile_async(constraint)
            if not fut.done():
                self.parked.park(req, fut)
                fut.add_done_callback(self._grammar_ready)
                return
            compiled = fut.result()  # an InvalidRequestError when it did not compile
        self._admit(req, compiled)

    def _grammar_ready(self, _: Any) -> None:
        hook = self.on_grammar_ready
        if hook is not None:
            with contextlib.suppress(RuntimeError):  # the owner's event loop is closed: nobody to wake
                hook()

    def _admit(self, req: Request, compiled: Any) -> None:
        state = self._new_state(req, compiled)
        # prompt log-probabilities need every prompt position computed: no prefix hit
        req.compute_whole_prompt = state.prompt_logprobs is not None
        self.scheduler.add(req)
        self.states[req.request_id] = state
        if state.matcher is not None:
            self.runner.num_constrained += 1
        self.counters["tokens.prompt"] += req.num_prompt_tokens

    def abort_request(self, request_id: str) -> TokenDelta | None:
        """Abort a queued or running request; its final output (``abort``), or None if there is
        no such request. With async scheduling a request in the step in flight ends once that
        step is committed (its token from that step is discarded); the output is returned now."""
        parked = self.parked.remove(request_id)
        if parked is not None:
            self.counters["requests.aborted"] += 1
            return self.final_delta(parked, "abort")
        req = self.scheduler.requests.get(request_id)
        if req is None or self._ending(req):
            return None
        self._end(req, "abort", publish_output=False)
        self.counters["requests.aborted"] += 1
        return self.final_delta(req, "abort")

    @property
    def step_count(self) -> int:
        """Steps the scheduler has scheduled (a turn that scheduled none leaves it unchanged)."""
        return self.scheduler.step_count

    def has_work(self) -> bool:
        return (
            self.scheduler.has_work()
            or bool(self.parked)
            or (self.overlap is not None and self.overlap.flight is not None)
        )

    def burst_window(self) -> float:
        """Seconds an engine loop that was idle waits for more arrivals before its first step
        (``Scheduler.burst_window``; 0: step now). Arrivals meanwhile are added as usual."""
        if self.overlap is not None and self.overlap.flight is not None:
            return 0.0
        return self.scheduler.burst_window()

    def close(self) -> None:
        """Stop the forward worker thread (async scheduling), after the step in flight has been
        processed (its outputs are dropped: call ``abort_all`` first to get them), and close the
        disk tier: every cached checkpoint it lacks is written, then the store is flushed and
        unlocked. Idempotent; a later ``step`` starts the worker again (without a disk tier)."""
        if self.overlap is not None:
            self.overlap.close()
        self.grammars.close()
        if self.disk is not None:
            close_disk_tier(self.disk, self.cache, self.runner)
            self.disk = None
        if self.kv_events is not None:  # after the disk's last writes, which are events too
            self.kv_events.close()
            self.kv_events = None

    # ------------------------------------------------------------------ step
    def step(self) -> list[TokenDelta]:
        """Schedule, run the model, apply results; the outputs produced by this step.

        With ``engine.async_scheduling`` the outputs are those of the step before
        (``engine/core/overlap.py``): the first call returns none, and ``has_work`` stays true until
        the last step in flight has been processed. The step that leaves no work gives the
        memory freed since the last idle back to the OS (``engine.release_memory``).
        """
        self.releaser.worked()
        outputs = self._admit_parked() if self.parked else []
        outputs += self._step()
        if self.kv_events is not None:
            self.kv_events.end_step()
        self.phases.close()
        if not self.has_work():
            self.releaser.idle()
        return outputs

    def _admit_parked(self) -> list[TokenDelta]:
        """Admit the parked requests whose grammar compiled; end those whose compile failed or
        ran out of time (their final outputs)."""
        ready, failed = self.parked.take()
        outputs = []
        for req, compiled in ready:
            try:
                self._admit(req, compiled)
            except Exception as e:  # noqa: BLE001 - ends this request only
                failed.append((req, e))
        for req, error in failed:
            self.counters["requests.failed"] += 1
            outputs.append(self.final_delta(req, "error", error=f"{type(error).__name__}: {error}"))
        return outputs

    def _step(self) -> list[TokenDelta]:
        if self.overlap is not None:
            return self.overlap.step()
        if self.speculation is not None:
            self.speculation.set_drafts()
        self.phases.enter("schedule")
        out = self.scheduler.schedule()
        if out is None:
            self.cache.wait_for_disk()  # nothing runs: a read from disk may let a request in
            return []
        return self.run_step(out)

    def run_step(self, out: SchedulerOutput) -> list[TokenDelta]:
        """Run scheduled step ``out`` on this thread, committed once its tokens are known (the
        overlapped loop runs its verify steps so); the step's outputs."""
        spec = self.speculation
        # copies between the device and host tiers first; a failed load ends its request only
        outputs = self.land(out, self.runner.transfer(out))
        if not out.seqs:  # a step of copies only
            self.scheduler.update(out, [])
            return outputs
        started = time.perf_counter()
        try:
            sampled = self.runner.execute(out, self.states) if spec is None else spec.execute(out)
        except Exception as e:  # one failed step ends only its own requests
            return outputs + self.step_failed(out, e)
        self.scheduler.observe_step(out, time.perf_counter() - started)  # the step-time model
        self.phases.enter("cache_commit")
        try:
            self.scheduler.update(out, sampled, () if spec is None else spec.verified)
        except Exception as e:
            return outputs + self.recover_failed_update(out, e)
        self.counters["tokens.computed"] += out.num_tokens
        self.phases.enter("outputs")
        if spec is not None:  # verify segments: their emitted tokens checked one by one
            return outputs + spec.outputs(out, sampled)
        process = self.process_token
        for s, token in zip(out.seqs, sampled, strict=True):
            if token is not None:
                try:
                    outputs.append(process(s.request, token))
                except Exception as e:  # the stop check of one request (its grammar): that request ends
                    outputs.append(self.output_failed(s.request, e))
        return outputs

    # ------------------------------------------------------------------ ending requests
    # (``land`` ... ``final_delta``: the step's outcome helpers, which the overlapped step
    # reaches through ``overlap.StepHost``; an owner of the engine has no use for them)
    def _end(self, req: Request, reason: str, *, publish_output: bool = True) -> None:
        """Finish ``req`` (its blocks and slots go back), or — while it is in the step on the
        forward worker, whose plan the cache still holds — as soon as that step is committed."""
        if self.overlap is None or not self.overlap.defer(req, reason, publish_output):
            self.scheduler.finish(req, reason, publish_output=publish_output)

    def _ending(self, req: Request) -> bool:
        """``req`` has had its final output and ends when the step in flight is committed."""
        return self.overlap is not None and req in self.overlap.deferred

    def land(self, out: SchedulerOutput, failures: Sequence[Failure]) -> list[TokenDelta]:
        """The step's copies between tiers ran (``failures``: those that did not); a request
        whose load failed ends, and only it."""
        errors = {id(t.seq): e for t, e in failures}
        return [
            self.fail_request(r, "host tier load failed", errors[id(r.cache)])
            for r in self.scheduler.land(out, [t for t, _ in failures])
            if not self._ending(r)
        ]

    def step_failed(self, out: SchedulerOutput, error: Exception) -> list[TokenDelta]:
        """Preparing or running a step raised: its plan is released and its requests end."""
        self.counters["steps.failed"] += 1
        log.error("step.failed", error=repr(error), requests=[s.request.request_id for s in out.seqs])
        failed = self.scheduler.fail_step(out)
        return [self.fail_request(r, "model step failed", error, finish=False) for r in failed]

    def output_failed(self, req: Request, error: Exception) -> TokenDelta:
        """Stop-checking ``req``'s token (advancing its grammar) raised: only that request ends."""
        log.error("request.output_failed", request_id=req.request_id, error=repr(error))
        return self.fail_request(req, "output processing failed", error)

    def recover_failed_update(self, out: SchedulerOutput, error: Exception) -> list[TokenDelta]:
        """Publishing a step's results raised: end that step's requests, keep serving the rest.

        A commit that raises leaves every cache structure whole and its plan in flight holding
        what it did not apply (``CacheManager.commit_step``): that rest is released like a
        failed step's. (A raise after the commit completed leaves nothing to release.)
        """
        self.counters["steps.failed"] += 1
        log.error("step.commit_failed", error=repr(error), requests=[s.request.request_id for s in out.seqs])
        if self.cache.in_flight(out.plan):
            self.cache.abort_step(out.plan)
        outputs = [
            self.fail_request(s.request, "cache commit failed", error)
            for s in out.seqs
            # (async scheduling: a deferred request has had its final output; it ends below)
            if s.request.status is not RequestStatus.FINISHED and not self._ending(s.request)
        ]
        if self.overlap is not None:
            self.overlap.apply_deferred()
        self.scheduler.check_integrity()  # holds: a failed commit leaves every part whole
        return outputs

    def fail_request(
        self, req: Request, what: str, error: BaseException, *, finish: bool = True
    ) -> TokenDelta:
        """End ``req`` with ``finish_reason="error"``, releasing its blocks and slots."""
        if finish:
            self._end(req, "error", publish_output=False)
        self.counters["requests.failed"] += 1
        return self.final_delta(req, "error", error=f"{what}: {type(error).__name__}: {error}")

    def process_token(self, req: Request, token: int, num_tokens: int | None = None) -> TokenDelta:
        """Check the stop conditions of ``req``'s new token (already in ``req.token_ids``, at
        ``num_tokens - 1``: by default its last): its stop token ids (EOS unless
        ``ignore_eos``), its grammar's end, ``max_tokens`` and ``max_model_len``, and build its
        delta; a request that stops ends here. Text and stop strings are the front end's
        (``engine/front/output_processor.py``)."""
        self.counters["tokens.generated"] += 1
        state = self.states[req.request_id]
        params: SamplingParams = req.sampling_params
        num_tokens = len(req.token_ids) if num_tokens is None else num_tokens
        n_out = num_tokens - len(req.prompt_token_ids)
        reason: str | None = None
        if state.matcher is not None and _constraint_done(state.matcher, token):
            reason = "stop"  # the constraint is complete: nothing more may follow
        elif token in state.stop_ids and n_out >= params.min_tokens:
            reason = "stop"
        elif n_out >= params.max_tokens or num_tokens >= self.max_model_len:
            reason = "length"
        logprobs = None
        if params.logprobs is not None:  # filled by the runner when it sampled the token
            logprobs, state.logprobs = state.logprobs, []
        if reason is None:
            out = TokenDelta(
                request_id=req.request_id,
                token_ids=[token],
                num_prompt_tokens=len(req.prompt_token_ids),
                num_cached_tokens=max(req.num_cached_tokens, 0),
                logprobs=logprobs,
            )
        else:
            self._end(req, reason)
            self.counters["requests.finished"] += 1
            out = self.final_delta(req, reason, [token], logprobs=logprobs)
        if req.first_token_time is None:
            _stamp_first_token(req, out)
        if req.compute_whole_prompt:  # its first token: the prompt is computed
            _hand_out_prompt_logprobs(req, state, out)
        return out

    def final_delta(
        self,
        req: Request,
        reason: str,
        token_ids: list[int] | None = None,
        error: str | None = None,
        logprobs: list[TokenLogprob] | None = None,
    ) -> TokenDelta:
        """The last delta of a request that has ended (or an add the core refused); its state goes."""
        state = self.states.pop(req.request_id, None)
        if state is not None and state.matcher is not None:
            self.runner.num_constrained -= 1
        delta = TokenDelta(
            request_id=req.request_id,
            token_ids=token_ids if token_ids is not None else [],
            finish_reason=reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            error=error,
            logprobs=logprobs,
        )
        if self.speculation is not None:  # (its counts for the request, which ends)
            self.speculation.request_done(req.request_id, delta)
        return delta

    # ------------------------------------------------------------------ introspection
    def ready(self, stats: dict[str, Any]) -> Ready:
        """What this core tells a front end when it starts (``messages.Ready``); ``stats`` as
        the placement reports them."""
        ip = self.input_processor
        defaults, source = self.sampling_defaults
        template = self.tokenizer.chat_template if self.config.model.chat_template else None
        return Ready(
            self.model_info,
            list(ip.salt_parts),
            ip.max_token_chars,
            os.getpid(),
            stats,
            sampling_defaults=dict(defaults),
            sampling_source=source,
            chat_template=template,
        )

    @property
    def num_constrained(self) -> int:
        """Running requests with a constraint (their steps are masked, and not overlapped)."""
        return self.runner.num_constrained

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.counters)
        out.update(self.scheduler.stats())
        out.update(self.cache.stats())
        if self.kv_events is not None:
            out.update(self.kv_events.stats())
        g = self.grammars
        out.update({
            "grammar.compiles": g.compiles, "grammar.compile_errors": g.compile_errors,
            "grammar.compiling": g.compiling, "grammar.parked": len(self.parked),
            "grammar.timeouts": self.parked.timeouts,
        })  # fmt: skip
        if self.speculation is not None:
            out.update(self.speculation.stats())
        out["time"] = time.time()
        return out

    def abort_all(self) -> list[TokenDelta]:
        """Abort every request still queued or running (engine exit); their final outputs (with
        async scheduling, first those of the step in flight, which is finished first)."""
        drained = self.overlap.drain() if self.overlap is not None else []
        ids = [r.request_id for r in self.parked] + list(self.scheduler.requests)
        outs = [self.abort_request(rid) for rid in ids]
        return drained + [o for o in outs if o is not None]


def _stamp_first_token(req: Request, out: TokenDelta) -> None:
    """``out`` carries ``req``'s first token: how long it waited for admission, and how long from
    admission to this token (its prefill, with any preemption in between)."""
    now = time.monotonic()
    req.first_token_time = now
    scheduled = req.scheduled_time if req.scheduled_time is not None else now
    out.queue_time_s = max(scheduled - req.arrival_time, 0.0)
    out.prefill_time_s = max(now - scheduled, 0.0)


def _hand_out_prompt_logprobs(req: Request, state: RequestState, out: TokenDelta) -> None:
    """The prompt log-probabilities go out with the request's first output; after that a
    recompute (a preemption) may take prefix hits again."""
    out.prompt_logprobs = state.prompt_logprobs
    out.prompt_token_ids = list(req.prompt_token_ids)
    state.prompt_logprobs = None
    req.compute_whole_prompt = False


def _constraint_done(matcher: Any, token: int) -> bool:
    """Advance a constrained request's matcher by its new token; whether the constraint is now
    complete. A token the mask forbade (it cannot be sampled) raises: only that request ends."""
    if not matcher.accept_token(token):
        raise RuntimeError(f"token {token} does not continue the request's constraint")
    return bool(matcher.is_terminated())
