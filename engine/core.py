"""EngineCore: the synchronous engine — input validation, one step, output processing.

``AsyncEngine`` drives it from an asyncio loop (the step runs in an executor thread);
tests drive it directly and call ``check_integrity()`` after every step. It is not
thread-safe: its owner calls ``add_request``/``abort_request`` only between steps.

Nothing is lost: every admitted request ends with exactly one finished ``RequestOutput``
(``stop``, ``length``, ``abort`` or ``error`` with a message), and every block and slot
returns to its pool.

**Async scheduling** (``engine.async_scheduling = true``; docs/architecture.md, "The step
loop"). The forward runs on a worker thread (one step at a time, in order: on CUDA it only
enqueues kernels), and each ``step()`` call does, on the caller's thread::

    commit N ahead   scheduler.update(N, placeholders): N's plan is committed although N's
                     forward may still run; each request that samples in N gets the
                     placeholder -(row + 1) as its next token
    end deferred     requests that finished (stop, abort, error) while N was in flight
    schedule N+1     as if every decode got its token: a placeholder is a token to compute
    prepare N+1      host tensors; then hand N+1 to the worker, whose input ids for the
                     placeholders are read from N's sampled-token tensor on the device
    process N        wait for N's tokens (the only wait), fill the placeholders in, then
                     detokenize, check stops and build outputs while N+1 runs

so ``step()`` returns step N's outputs while N+1 is in flight. Committing ahead is safe
because every later reader of what N publishes (a prefix hit, a restore) is a later step,
which the worker (or the CUDA stream) runs after N. A request found finished in N is in N+1
already: it ends once N+1 is committed, and its token from N+1 is discarded (its blocks and
slots are released then; the extra token's KV is real output and may stay cached). The
failure rules stay local: a failed prepare ends that step's requests; a forward that fails
on the worker ends its step's requests and those of the step after it (scheduled on its
results, refused by the worker), and ``CacheManager.discard_written`` drops what its early
commit published. A step's host-tier copies run on the worker before its forward; the early
commit lands them (``Scheduler.land``) first. With it off, ``step()`` is the plain schedule → execute → update → outputs.
"""

from __future__ import annotations

import contextlib
import copy
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from deltaserve.engine.client import ModelInfo, RequestInput
from deltaserve.engine.config import DType, EngineConfig
from deltaserve.engine.detokenizer import IncrementalDetokenizer
from deltaserve.engine.errors import (
    ConfigError,
    EngineOverloadedError,
    InvalidRequestError,
)
from deltaserve.engine.host_pool import Failure
from deltaserve.engine.input_processor import InputProcessor, Prompt
from deltaserve.engine.model_runner import (
    ModelRunner,
    PreparedStep,
    RequestState,
    RunnerSizes,
    StepResult,
    plain_greedy,
)
from deltaserve.engine.outputs import RequestOutput, TokenLogprob
from deltaserve.engine.sampling_params import SamplingParams
from deltaserve.engine.sizing import Capacity, ModelShape, build_scheduler, plan_capacity
from deltaserve.kernels import get_ops
from deltaserve.logs import get_logger, set_level
from deltaserve.models import CacheSpec, LoadedModel, load_model
from deltaserve.scheduler.request import Request, RequestStatus
from deltaserve.scheduler.scheduler import SchedulerOutput

log = get_logger("deltaserve.engine")

TORCH_DTYPES = {DType.FLOAT32: torch.float32, DType.BFLOAT16: torch.bfloat16, DType.FLOAT16: torch.float16}


def resolve_dtype(name: str | DType, device: torch.device) -> torch.dtype:
    """The torch dtype of ``model.dtype`` (``auto``: bfloat16 on CUDA, float32 elsewhere)."""
    dtype = DType(name)
    if dtype is DType.AUTO:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return TORCH_DTYPES[dtype]


def resolve_device(config: EngineConfig) -> torch.device:
    """``model.device`` as a torch device; ``ConfigError`` if it is not there."""
    device = torch.device(config.model.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"model.device = {config.model.device!r}: CUDA is not available on this machine"
            )
        index = device.index or 0
        if index >= torch.cuda.device_count():
            raise ConfigError(
                f"model.device = {config.model.device!r}: only {torch.cuda.device_count()} CUDA device(s)"
            )
    return device


def model_shape(loaded: LoadedModel, spec: CacheSpec) -> ModelShape:
    """The torch-free numbers capacity planning and the cache's value model need."""
    per_token, per_pair = prefill_flops(loaded, spec)
    return ModelShape(
        kv_bytes_per_token=spec.kv_block_bytes(1) if spec.num_attn_layers else 0,
        state_bytes=spec.state_slot_bytes() if spec.num_gdn_layers else 0,
        max_position_embeddings=loaded.max_position_embeddings,
        gdn_chunk_size=spec.gdn_chunk_size,
        prefill_flops_per_token=per_token,
        prefill_flops_per_token_pair=per_pair,
    )


def prefill_flops(loaded: LoadedModel, spec: CacheSpec) -> tuple[float, float]:
    """Prefill cost of the model: FLOPs per token (2 x the weights a token passes through:
    projections, MLPs, the routed share of the experts; not the embedding lookup nor the
    lm_head, which runs on sampled rows only) and per (token, earlier token) pair of the
    full-attention layers (QK^T and PV: 4 x query heads x head_dim each)."""
    cfg = loaded.hf_config
    routed = getattr(cfg, "num_experts_per_tok", 0) / max(getattr(cfg, "num_experts", 0) or 1, 1)
    weights = 0.0
    for name, p in loaded.model.named_parameters():
        if "embed_tokens" in name or name.startswith("lm_head"):
            continue
        weights += p.numel() * (routed if ".experts." in name else 1.0)
    heads = int(getattr(cfg, "num_attention_heads", 0) or 0)
    head_dim = int(getattr(cfg, "head_dim", 0) or (cfg.hidden_size // heads if heads else 0))
    return 2.0 * weights, 4.0 * heads * head_dim * spec.num_attn_layers


def _cuda_cache_budget(config: EngineConfig, runner_probe: Any, device: torch.device) -> int:
    """CUDA: ``gpu_memory_utilization`` x device memory, minus what the process holds after
    loading the weights and the activation peak of a profiling forward."""
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    torch.cuda.reset_peak_memory_stats(device)
    runner_probe()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    used_by_others = total - free - torch.cuda.memory_reserved(device)
    budget = int(config.cache.gpu_memory_utilization * total) - peak - max(used_by_others, 0)
    if budget <= 0:
        raise ConfigError(
            f"cache.gpu_memory_utilization = {config.cache.gpu_memory_utilization}: {total / 2**30:.1f} GiB device, "
            f"weights + activations take {peak / 2**30:.2f} GiB, nothing is left for the cache"
        )
    return budget


class _StepSkipped(RuntimeError):
    """The forward worker refused a step: the step before it failed, and this one was scheduled
    on that step's (never produced) results."""


@dataclass(eq=False)
class _InFlight:
    """A step handed to the forward worker (async scheduling), its plan not yet committed."""

    out: SchedulerOutput
    prep: PreparedStep | None  # None: a step of host-tier copies only
    future: Future[StepResult | None]
    transfers: Future[list[Failure]]  # the step's host-tier copies that failed (set before the forward)
    requests: set[Request]  # the step's requests, and those whose loads it carries (identity set)


class EngineCore:
    """The synchronous engine: ``make_request`` / ``add_request`` / ``step`` / ``abort_request``.

    Construction loads the model (or takes ``loaded``), plans the cache capacity from one
    memory budget (``deltaserve.engine.sizing``), builds the scheduler and cache manager,
    and allocates the cache tensors. ``capacity`` tells what was built.
    """

    def __init__(self, config: EngineConfig | None = None, *, loaded: LoadedModel | None = None) -> None:
        self.config = config = config or EngineConfig()
        set_level(config.logging.level.value)
        self.device = resolve_device(config)
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        try:
            self.ops = get_ops(config.kernels.backend.value, self.device)
        except NotImplementedError as e:
            raise ConfigError(f"kernels.backend = {config.kernels.backend.value!r}: {e}") from None
        torch.manual_seed(config.model.seed)
        self.loaded = loaded or load_model(
            config.model.path, dtype=self.dtype, device=self.device, ops=self.ops
        )
        self.tokenizer = self.loaded.tokenizer
        # Detokenization runs in the step thread while `generate` tokenizes on the event-loop
        # thread; HF fast tokenizers mutate themselves while encoding ("Already borrowed"), so
        # each thread gets its own instance.
        self.detok_tokenizer = copy.deepcopy(self.tokenizer)
        self.spec = spec = self.loaded.model.cache_spec()
        shape = model_shape(self.loaded, spec)
        budget = None
        if self.device.type == "cuda":
            tokens, bs = config.scheduler.max_num_batched_tokens, config.cache.block_size
            budget = _cuda_cache_budget(
                config,
                lambda: ModelRunner.profile(self.loaded, self.ops, tokens, bs, self.device),
                self.device,
            )
        self.capacity: Capacity = plan_capacity(config, shape, budget_bytes=budget)
        for warning in self.capacity.warnings:
            log.warning("engine.capacity", detail=warning)
        self.scheduler = build_scheduler(config, self.capacity)
        self.cache = self.scheduler.cache
        self.max_model_len = self.capacity.max_model_len
        self.runner = ModelRunner(
            self.loaded,
            self.ops,
            RunnerSizes(
                self.capacity.num_kv_blocks if spec.num_attn_layers else 1,
                config.cache.block_size,
                self.cache.slots.num_live,
                self.cache.slots.num_checkpoint,
                self.capacity.num_host_kv_blocks,
                self.capacity.num_host_checkpoint_slots,
            ),
            self.device,
        )
        self.runner.default_generator.manual_seed(config.model.seed)
        self.eos_token_ids = frozenset(self.loaded.eos_token_ids)
        self.vocab_size = int(self.loaded.hf_config.vocab_size)
        self.input_processor = InputProcessor(
            self.tokenizer,
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            salt_parts=(str(self.loaded.path), config.model.dtype.value, config.cache.namespace),
        )
        self.max_token_chars = self.input_processor.max_token_chars
        # engine-side state of every request the scheduler holds (detokenizer, stop ids, generator)
        self.states: dict[str, RequestState] = {}
        # async scheduling (module docstring): the step on the forward worker, requests to end
        # once it has left flight, and the worker that runs the forwards one at a time, in order
        self.async_scheduling = config.engine.async_scheduling
        self._flight: _InFlight | None = None
        self._deferred: dict[Request, tuple[str, bool]] = {}  # request -> (reason, publish_output)
        self._worker: ThreadPoolExecutor | None = None  # started on first use, stopped by close()
        self._worker_broken = False  # a step failed on the worker: it refuses the next until reset
        self.counters = {
            "requests.finished": 0,
            "requests.aborted": 0,
            "requests.failed": 0,
            "tokens.prompt": 0,
            "tokens.generated": 0,
            "tokens.computed": 0,
            "steps.failed": 0,
        }
        log.info(
            "engine.ready",
            model=str(self.loaded.path),
            model_type=self.loaded.model_type,
            dtype=str(self.dtype),
            device=str(self.device),
            kernels=self.ops.name,
            block_size=config.cache.block_size,
            checkpoint_unit=self.cache.unit,
            **self.capacity.describe(),
        )
        self.model_info = ModelInfo(
            name=str(config.model.path),
            model_type=self.loaded.model_type,
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            block_size=config.cache.block_size,
            checkpoint_unit=self.cache.unit,
            capacity=self.capacity.describe(),
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
        if req.request_id in self.scheduler.requests:
            raise InvalidRequestError(f"request_id {req.request_id!r} is already in use")
        return req

    def _new_state(self, req: Request) -> RequestState:
        params: SamplingParams = req.sampling_params
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed)
        stop_ids = frozenset(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        return RequestState(
            detokenizer=IncrementalDetokenizer(self.detok_tokenizer, params.stop),
            stop_ids=stop_ids,
            generator=generator,
            plain_greedy=plain_greedy(params),
        )

    def check_capacity(self, pending: int = 0) -> None:
        """Admission control: raise EngineOverloadedError when the waiting queue is full."""
        waiting = self.scheduler.num_waiting + pending
        if waiting >= self.config.scheduler.max_waiting:
            raise EngineOverloadedError(
                f"waiting queue is full ({waiting} >= scheduler.max_waiting = "
                f"{self.config.scheduler.max_waiting}); retry later"
            )

    def add_request(self, req: Request) -> None:
        """Queue a request built by ``make_request``; its engine-side state is created here."""
        self.check_capacity()
        state = self._new_state(req)
        self.scheduler.add(req)
        self.states[req.request_id] = state
        self.counters["tokens.prompt"] += req.num_prompt_tokens

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort a queued or running request; its final output (``abort``), or None if there is
        no such request. With async scheduling a request in the step in flight ends once that
        step is committed (its token from that step is discarded); the output is returned now."""
        req = self.scheduler.requests.get(request_id)
        if req is None or req in self._deferred:
            return None
        self._end(req, "abort", publish_output=False)
        self.counters["requests.aborted"] += 1
        return self._final_output(req, "abort", [], "")

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._flight is not None

    def _end(self, req: Request, reason: str, *, publish_output: bool = True) -> None:
        """Finish ``req`` (its blocks and slots go back), or — while it is in the step on the
        forward worker, whose plan the cache still holds — as soon as that step is committed."""
        if self._flight is not None and req in self._flight.requests:
            self._deferred[req] = (reason, publish_output)
        else:
            self.scheduler.finish(req, reason, publish_output=publish_output)

    def _apply_deferred(self) -> None:
        """End the requests that waited for their step to leave flight (it has)."""
        deferred, self._deferred = self._deferred, {}
        for req, (reason, publish_output) in deferred.items():
            self.scheduler.finish(req, reason, publish_output=publish_output)

    def close(self) -> None:
        """Stop the forward worker thread (async scheduling), after the step in flight has been
        processed (its outputs are dropped: call ``abort_all`` first to get them). Idempotent;
        a later ``step`` starts the worker again."""
        self._drain()
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model, apply results; the outputs produced by this step.

        With ``engine.async_scheduling`` the outputs are those of the step before (see the
        module docstring): the first call returns none, and ``has_work`` stays true until
        the last step in flight has been processed.
        """
        if self.async_scheduling:
            return self._step_async()
        out = self.scheduler.schedule()
        if out is None:
            return []
        # copies between the device and host tiers first; a failed load ends its request only
        failures = self.runner.transfer(out)
        errors = {id(t.seq): e for t, e in failures}
        outputs = [
            self._fail(r, "host tier load failed", errors[id(r.cache)])
            for r in self.scheduler.land(out, [t for t, _ in failures])
        ]
        if not out.seqs:  # a step of copies only
            self.scheduler.update(out, [])
            return outputs
        try:
            sampled = self.runner.execute(out, self.states)
        except Exception as e:  # one failed step ends only its own requests
            self.counters["steps.failed"] += 1
            log.error("step.failed", error=repr(e), requests=[s.request.request_id for s in out.seqs])
            failed = self.scheduler.fail_step(out)
            return outputs + [self._fail(r, "model step failed", e, finish=False) for r in failed]
        try:
            self.scheduler.update(out, sampled)
        except Exception as e:
            return outputs + self._recover_failed_update(out, e)
        self.counters["tokens.computed"] += out.num_tokens
        process = self._process_token
        for s, token in zip(out.seqs, sampled, strict=True):
            if token is not None:
                try:
                    outputs.append(process(s.request, token))
                except Exception as e:  # detokenizer / stop check of one request: that request ends
                    outputs.append(self._output_failed(s.request, e))
        return outputs

    def _output_failed(self, req: Request, error: Exception) -> RequestOutput:
        """Detokenizing or stop-checking ``req``'s token raised: only that request ends."""
        log.error("request.output_failed", request_id=req.request_id, error=repr(error))
        return self._fail(req, "output processing failed", error)

    # ------------------------------------------------------------------ async scheduling
    def _step_async(self) -> list[RequestOutput]:
        """One turn of the overlapped loop: commit step N (on the worker) ahead of its result,
        schedule and launch N+1, then process N's tokens while N+1 runs."""
        outputs: list[RequestOutput] = []
        prev, self._flight = self._flight, None
        if prev is not None and not self._commit_ahead(prev, outputs):
            prev = None  # its commit failed: that step's requests have ended
        self._apply_deferred()
        out = self.scheduler.schedule()
        if out is not None:
            self._flight = self._submit(out, prev, outputs)
        if prev is not None:
            self._process_result(prev, outputs)
        return outputs

    def _commit_ahead(self, flight: _InFlight, outputs: list[RequestOutput]) -> bool:
        """Commit step N's plan before its result is known (the forward may still run): every
        request that samples in N gets the placeholder of its row (``model_runner``), so the
        scheduler sees it decoding. False when the commit raised (handled like a failed commit,
        once the step has finished on the worker)."""
        out = flight.out
        # the step's host-tier copies ran first on the worker (usually long done): land them,
        # and end the requests whose loads failed (they compute nothing in this step)
        failures = flight.transfers.result()
        errors = {id(t.seq): e for t, e in failures}
        for req in self.scheduler.land(out, [t for t, _ in failures]):
            if req not in self._deferred:  # (a deferred one has had its final output)
                outputs.append(self._fail(req, "host tier load failed", errors[id(req.cache)]))
        placeholders: list[int | None] = [None] * len(out.seqs)
        if flight.prep is not None:
            for row, i in enumerate(flight.prep.sample_seq):
                if out.seqs[i].request not in self._deferred:
                    placeholders[i] = -(row + 1)
        try:
            self.scheduler.update(out, placeholders)
        except Exception as e:
            # the forward is running into slots this recovery may free: let it finish first
            with contextlib.suppress(Exception):
                flight.future.result()
            outputs += self._recover_failed_update(out, e)
            if flight.future.exception() is not None:
                self._discard_written(flight)
            self._worker_broken = False
            return False
        self.counters["tokens.computed"] += out.num_tokens
        return True

    def _submit(
        self, out: SchedulerOutput, prev: _InFlight | None, outputs: list[RequestOutput]
    ) -> _InFlight | None:
        """Prepare step ``out`` on this thread and hand it to the forward worker (its host-tier
        copies, then its forward); None (and its requests ended) if preparing it failed."""
        prep = None
        if out.seqs:  # (a step may carry host-tier copies only)
            try:
                prep = self.runner.prepare(out, self.states, placeholder_step=prev.out.step if prev else -1)
            except Exception as e:
                self.counters["steps.failed"] += 1
                log.error("step.failed", error=repr(e), requests=[s.request.request_id for s in out.seqs])
                failed = self.scheduler.fail_step(out)  # (its copies, never run, are released)
                outputs += [self._fail(r, "model step failed", e, finish=False) for r in failed]
                return None
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deltaserve-forward")
        transfers: Future[list[Failure]] = Future()
        future = self._worker.submit(self._launch, out, prep, transfers)
        requests = {s.request for s in out.seqs}
        for t in out.plan.loads:  # a loading request must not be freed before its copies ran
            req = self.scheduler.requests.get(t.seq.request_id) if t.seq is not None else None
            if req is not None:
                requests.add(req)
        return _InFlight(out, prep, future, transfers, requests)

    def _launch(
        self, out: SchedulerOutput, prep: PreparedStep | None, transfers: Future[list[Failure]]
    ) -> StepResult | None:
        """On the forward worker: the step's host-tier copies (their failures go to
        ``transfers`` at once, for the early commit), then its forward — unless the step
        before failed: then neither runs."""
        if self._worker_broken:
            transfers.cancel()
            raise _StepSkipped(f"step {out.step} follows a failed step")
        try:
            transfers.set_result(self.runner.transfer(out))  # (never raises)
            return self.runner.launch(prep) if prep is not None else None
        except BaseException as e:
            if not transfers.done():
                transfers.set_exception(e)
            self._worker_broken = True
            raise

    def _process_result(self, flight: _InFlight, outputs: list[RequestOutput]) -> None:
        """Step N's tokens: fill the placeholders, then detokenize, check stops and build
        outputs (the next step runs meanwhile). A request that ended while N was in flight has
        its token discarded."""
        try:
            result = flight.future.result()
            tokens = result.token_list() if result is not None else []
        except Exception as e:
            outputs += self._recover_failed_async(flight, e)
            return
        if flight.prep is None or result is None:
            return  # host-tier copies only
        seqs = flight.out.seqs
        finished = RequestStatus.FINISHED
        deferred = self._deferred
        logprobs = result.logprobs
        for row, i in enumerate(flight.prep.sample_seq):
            req = seqs[i].request
            if req.status is finished or req in deferred:
                continue
            token = tokens[row]
            ids = req.token_ids
            if ids[-1] == -(row + 1):
                ids[-1] = token
            else:  # preempted while in flight: its placeholder was dropped, the token goes on
                ids.append(token)
            if logprobs is not None and logprobs[row] is not None:
                self.states[req.request_id].logprobs.append(logprobs[row])  # type: ignore[arg-type]
            try:
                outputs.append(self._process_token(req, token))
            except Exception as e:  # detokenizer / stop check of one request: that request ends
                outputs.append(self._output_failed(req, e))

    def _recover_failed_async(self, flight: _InFlight, error: Exception) -> list[RequestOutput]:
        """Step N failed on the worker after its plan was committed. It ends N's requests and
        those of step N+1 (scheduled on N's results, refused by the worker), and drops what N's
        commit published: KV blocks and checkpoints its forward never wrote."""
        self.counters["steps.failed"] += 1
        log.error("step.failed", error=repr(error), requests=[s.request.request_id for s in flight.out.seqs])
        outputs: list[RequestOutput] = []
        nxt, self._flight = self._flight, None
        if nxt is not None:
            with contextlib.suppress(Exception):
                nxt.future.result()  # refused, or ran: either way it is over before we free
            self.counters["steps.failed"] += 1
            for req in self.scheduler.fail_step(nxt.out):
                if self._deferred.pop(req, None) is None:  # (a deferred one has its output)
                    outputs.append(self._fail(req, "model step failed", error, finish=False))
        for s in flight.out.seqs:
            if s.request.status is not RequestStatus.FINISHED:
                outputs.append(self._fail(s.request, "model step failed", error))
        self._apply_deferred()
        self._discard_written(flight)
        self._worker_broken = False
        return outputs

    def _discard_written(self, flight: _InFlight) -> None:
        """Drop the cache entries whose contents a failed step was to write (committed ahead)."""
        if flight.prep is None:
            return  # copies only: what they wrote landed (or was released) at the early commit
        bs = self.cache.block_size
        blocks, slots = self.runner.written(flight.prep, bs)
        dropped = self.cache.discard_written(blocks, slots)
        if dropped:
            log.warning("step.cache_discarded", step=flight.out.step, entries=dropped)

    def _drain(self) -> list[RequestOutput]:
        """Finish the step in flight (async scheduling) without starting another."""
        outputs: list[RequestOutput] = []
        while self._flight is not None:
            prev, self._flight = self._flight, None
            if self._commit_ahead(prev, outputs):
                self._apply_deferred()
                self._process_result(prev, outputs)
        self._apply_deferred()
        return outputs

    def _recover_failed_update(self, out: SchedulerOutput, error: Exception) -> list[RequestOutput]:
        """Publishing a step's results raised: end that step's requests, keep serving the rest.

        A commit that raised before it took the step's plan out of flight is released like a
        failed step. One that raised half-way may have left the cache inconsistent: the
        integrity check then fails and the engine stops rather than serve from a corrupt cache.
        """
        self.counters["steps.failed"] += 1
        log.error("step.commit_failed", error=repr(error), requests=[s.request.request_id for s in out.seqs])
        with contextlib.suppress(RuntimeError):  # "not in flight": the commit got past taking it out
            self.cache.abort_step(out.plan)
        outputs = [
            self._fail(s.request, "cache commit failed", error)
            for s in out.seqs
            # (async scheduling: a deferred request has had its final output; it ends below)
            if s.request.status is not RequestStatus.FINISHED and s.request not in self._deferred
        ]
        self._apply_deferred()
        self.scheduler.check_integrity()  # AssertionError: corrupt cache -> the engine loop dies
        return outputs

    def _fail(self, req: Request, what: str, error: BaseException, *, finish: bool = True) -> RequestOutput:
        """End ``req`` with ``finish_reason="error"``, releasing its blocks and slots."""
        if finish:
            self._end(req, "error", publish_output=False)
        self.counters["requests.failed"] += 1
        return self._final_output(req, "error", [], "", error=f"{what}: {type(error).__name__}: {error}")

    def _process_token(self, req: Request, token: int) -> RequestOutput:
        """Detokenize one new token of ``req`` (already in ``req.token_ids``), check its stop
        conditions, and build its output; a request that stops ends here."""
        self.counters["tokens.generated"] += 1
        state = self.states[req.request_id]
        detok = state.detokenizer
        text = detok.add([token])
        params: SamplingParams = req.sampling_params
        num_tokens = len(req.token_ids)
        n_out = num_tokens - len(req.prompt_token_ids)
        reason: str | None = None
        if (token in state.stop_ids or detok.stopped) and n_out >= params.min_tokens:
            reason = "stop"
        elif n_out >= params.max_tokens or num_tokens >= self.max_model_len:
            reason = "length"
        logprobs = None
        if params.logprobs is not None:  # filled by the runner when it sampled the token
            logprobs, state.logprobs = state.logprobs, []
        if reason is None:
            return RequestOutput(
                request_id=req.request_id,
                token_ids=[token],
                text=text,
                num_prompt_tokens=len(req.prompt_token_ids),
                num_cached_tokens=max(req.num_cached_tokens, 0),
                logprobs=logprobs,
            )
        text += detok.flush()
        self._end(req, reason)
        self.counters["requests.finished"] += 1
        return self._final_output(req, reason, [token], text, logprobs=logprobs)

    def _final_output(
        self,
        req: Request,
        reason: str,
        token_ids: list[int],
        text: str,
        error: str | None = None,
        logprobs: list[TokenLogprob] | None = None,
    ) -> RequestOutput:
        """The last output of a request that has ended; its engine-side state goes."""
        self.states.pop(req.request_id, None)
        return RequestOutput(
            request_id=req.request_id,
            token_ids=token_ids,
            text=text,
            finished=True,
            finish_reason=reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            error=error,
            logprobs=logprobs,
        )

    # ------------------------------------------------------------------ introspection
    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.counters)
        out.update(self.scheduler.stats())
        out.update(self.cache.stats())
        out["time"] = time.time()
        return out

    def abort_all(self) -> list[RequestOutput]:
        """Abort every request still queued or running (engine exit); their final outputs (with
        async scheduling, first those of the step in flight, which is finished first)."""
        drained = self._drain()
        outs = [self.abort_request(rid) for rid in list(self.scheduler.requests)]
        return drained + [o for o in outs if o is not None]
