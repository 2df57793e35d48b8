"""The engine step with speculative decoding (``speculative.method`` not ``none``).

Each step: the drafter proposes up to ``speculative.num_tokens`` tokens for every running
request that may draft (``SpecDecoding.drafts``: room left under ``max_tokens`` and
``max_model_len``; a constrained request's drafts are cut before the first its grammar cannot
take, so a bad draft ends the accepted run, never the request; a penalised request's verify
rows count its output as it stands at each row, drafts before it included); the scheduler
turns a decode with drafts into a verify segment (``scheduler/scheduler.py``); the runner
verifies every segment's drafts in the one forward and rolls rejected ones back
(``engine/runner/verify.py``); ``Scheduler.update``
commits what was accepted; then each request's emitted tokens are checked one by one, as a
decode would have produced them (stop token ids, EOS, ``max_tokens``, ``max_model_len``):
a request that ends inside its window emits nothing after its last token, and its token list
is cut there. A request's emitted tokens go out as one ``TokenDelta``.

The step itself is ``EngineCore``'s one step (its failure handling too: a failed forward ends
its step's requests; a failed commit ends them after releasing the plan; a failed stop check
ends only its request), which calls ``set_drafts``, ``execute``, ``verified`` and ``outputs``.

With ``engine.async_scheduling`` (``engine/core/overlap.py``) a step that verifies is never
overlapped: its commit needs the accepted lengths, and a draft needs the real token before it.
Drafts are set only when no step is in flight (every request's tokens are real); a step with
verify segments runs, commits and is processed before the next is scheduled
(``EngineCore.run_step``); a step in flight whose requests may draft after it
(``may_draft_after``) is processed before the next is scheduled. Steps in which no request can
draft (prefill chunks, requests about to end) overlap as without speculation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from deltaserve.engine.config_spec import SpeculativeConfig
from deltaserve.engine.messages import TokenDelta
from deltaserve.engine.outputs import TokenLogprob
from deltaserve.engine.runner.mtp_draft import MtpProposer
from deltaserve.engine.spec.drafter import make_drafter
from deltaserve.engine.spec.mtp import MtpDrafter
from deltaserve.engine.spec.stats import SpecStats
from deltaserve.logs import get_logger
from deltaserve.scheduler.request import Request, RequestStatus

if TYPE_CHECKING:
    from deltaserve.engine.core.engine_core import EngineCore
    from deltaserve.engine.runner.model_runner import StepResult
    from deltaserve.scheduler.scheduler import SchedulerOutput

log = get_logger("deltaserve.engine")


class SpecDecoding:
    """The drafter, the acceptance counters and the speculative step of one ``EngineCore``."""

    def __init__(self, core: EngineCore, config: SpeculativeConfig) -> None:
        self.core = core
        self.k = config.num_tokens
        self.drafter = make_drafter(config, core.vocab_size)
        if isinstance(self.drafter, MtpDrafter):
            # the head runs in the runner after every step (``engine/runner/mtp_draft.py``)
            head = core.loaded.model.mtp
            assert head is not None  # (load_engine_model loaded it for method = "mtp")
            runner = core.runner
            runner.mtp = MtpProposer(head, runner.caches, runner.sizes.block_size, self.k, self.drafter)
        self.counts = SpecStats(config.num_tokens)
        # per running request: verify windows, drafted and accepted tokens (logged at its end)
        self.per_request: dict[str, list[int]] = {}
        self._result: StepResult  # the last forward's (``execute``), read by ``outputs``

    def drafts(self, req: Request) -> list[int]:
        """The drafts ``req`` verifies in the next step ([] for a request that may not draft)."""
        core = self.core
        if not req.is_decoding or req.status is not RequestStatus.RUNNING:
            return []
        state = core.states.get(req.request_id)
        if state is None:
            return []
        # a window emits up to k + 1 tokens: no more than a decode could still produce
        k = min(self.k, self._room(req) - 1)
        drafts = self.drafter.propose(req, k)[:k] if k > 0 else []
        if drafts and state.matcher is not None:
            drafts = _grammar_prefix(state.matcher, drafts)
        return drafts

    def _room(self, req: Request) -> int:
        """Tokens ``req`` may still produce (``max_tokens``, ``max_model_len``)."""
        return min(
            req.sampling_params.max_tokens - req.num_output_tokens, self.core.max_model_len - req.num_tokens
        )

    def may_draft_after(self, req: Request) -> bool:
        """Whether ``req``, which samples one token in the step in flight, may draft in the step
        after it (async scheduling waits for that token before scheduling that step)."""
        return req.status is RequestStatus.RUNNING and self._room(req) - 1 >= 2

    def set_drafts(self, *, none: bool = False) -> None:
        """Before scheduling: each running request's drafts for this step (``none``: no request
        drafts, as while a step is in flight whose tokens are not known yet)."""
        running = self.core.scheduler.running
        for req in running:
            req.draft_token_ids = [] if none else self.drafts(req)
        drafter = self.drafter
        if not none and isinstance(drafter, MtpDrafter) and len(drafter.proposals) > len(running):
            # (a request that ended while its step was in flight may have had proposals
            # recorded after its end: keep only the held requests'. Only with no step in
            # flight: the forward worker writes proposals while one is)
            held = self.core.scheduler.requests
            for rid in [r for r in drafter.proposals if r not in held]:
                drafter.forget(rid)

    def execute(self, out: SchedulerOutput) -> list[int | None]:
        """The step's forward: its sampled tokens (as ``ModelRunner.execute``), keeping the
        verify segments' outcome for ``verified`` and ``outputs`` of the same step."""
        runner, states = self.core.runner, self.core.states
        prep = runner.prepare(out, states)
        self._result = runner.launch(prep)
        return self._result.per_seq(prep, states)

    @property
    def verified(self) -> list[list[int]]:
        """The emitted tokens of each verify segment of the step ``execute`` ran."""
        return self._result.verified

    def outputs(self, out: SchedulerOutput, sampled: list[int | None]) -> list[TokenDelta]:
        """The step's deltas: a verify segment's emitted tokens checked one by one (one delta);
        a plain token as ``EngineCore.process_token`` checks it."""
        core, result = self.core, self._result
        outputs: list[TokenDelta] = []
        first, end = out.num_decodes, out.num_decodes + out.num_verify
        for i, (s, token) in enumerate(zip(out.seqs, sampled, strict=True)):
            try:
                if first <= i < end:
                    emitted = result.verified[i - first]
                    self.counts.observe(len(s.drafts), len(emitted) - 1)
                    mine = self.per_request.setdefault(s.request.request_id, [0, 0, 0])
                    mine[0] += 1
                    mine[1] += len(s.drafts)
                    mine[2] += len(emitted) - 1
                    delta = self._emit(s.request, emitted, result.verified_logprobs[i - first])
                    delta.num_draft_tokens, delta.num_accepted_tokens = mine[1], mine[2]
                    outputs.append(delta)
                elif token is not None:
                    outputs.append(self.finish_hook(s.request, core.process_token(s.request, token)))
            except Exception as e:  # the stop check of one request: that request ends
                outputs.append(core.output_failed(s.request, e))
        return outputs

    def _emit(self, req: Request, emitted: list[int], logprobs: list[TokenLogprob] | None) -> TokenDelta:
        """Check ``req``'s emitted tokens (already appended) one at a time, as consecutive
        decodes would; one delta for all of them (and their log-probabilities), cut at the first
        that ends the request."""
        core = self.core
        base = len(req.token_ids) - len(emitted)
        deltas: list[TokenDelta] = []
        state = core.states[req.request_id]
        for j, token in enumerate(emitted):
            if logprobs is not None:
                state.logprobs = [logprobs[j]]  # (process_token hands out the pending ones)
            d = core.process_token(req, token, num_tokens=base + j + 1)
            deltas.append(d)
            if d.finish_reason is not None:
                del req.token_ids[base + j + 1 :]  # never delivered
                break
        return self.finish_hook(req, _merge(deltas))

    def finish_hook(self, req: Request, delta: TokenDelta) -> TokenDelta:
        """``delta`` is ``req``'s output: a drafter that learns hears of its end (stop, length)."""
        if delta.finish_reason in ("stop", "length"):
            self.drafter.finished(req, req.num_output_tokens)
        return delta

    def request_done(self, request_id: str, final: TokenDelta) -> None:
        """A request ended (``EngineCore.final_delta``, every ending): its own counters go on
        its final delta ``final`` and to the debug log (``spec.request``)."""
        if isinstance(self.drafter, MtpDrafter):
            self.drafter.forget(request_id)
        verifies, drafted, accepted = self.per_request.pop(request_id, (0, 0, 0))
        final.num_draft_tokens, final.num_accepted_tokens = drafted, accepted
        if verifies:
            log.debug(
                "spec.request", request_id=request_id, verifies=verifies, drafted=drafted, accepted=accepted
            )

    def stats(self) -> dict[str, float]:
        return self.counts.stats()


def _grammar_prefix(matcher: Any, drafts: list[int]) -> list[int]:
    """The drafts up to the first the request's grammar cannot take, and none after one that
    completes it; the matcher is left as it was (rolled back)."""
    n = 0
    for d in drafts:
        if matcher.is_terminated() or not matcher.accept_token(d):
            break
        n += 1
    if n:
        matcher.rollback(n)
    return drafts[:n]


def _merge(deltas: list[TokenDelta]) -> TokenDelta:
    """One delta for a request's consecutive deltas of one step: the last's (its finish, if
    any) with every token and log-probability, and the first's timings."""
    if len(deltas) == 1:
        return deltas[0]
    last = deltas[-1]
    last.token_ids = [t for d in deltas for t in d.token_ids]
    if any(d.logprobs for d in deltas):
        last.logprobs = [lp for d in deltas for lp in (d.logprobs or [])]
    first = deltas[0]
    last.queue_time_s, last.prefill_time_s = first.queue_time_s, first.prefill_time_s
    if first.prompt_logprobs is not None:
        last.prompt_logprobs, last.prompt_token_ids = first.prompt_logprobs, first.prompt_token_ids
    return last
