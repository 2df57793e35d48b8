"""Continuous-batching scheduler: decodes first, then prefill chunks, under a token budget.

Per step (``schedule``):

1. running requests that are decoding get their one token each (oldest first); one with draft
   tokens (speculative decoding) gets a *verify* segment instead: its last token and the drafts
   that fit before the next KV block boundary (a window never crosses one, so a rejected draft
   never holds a block of its own and every capture boundary a window reaches is its end);
2. running requests still in prefill get their next chunk;
3. waiting requests are admitted in the policy's order while the token budget, the
   sequence cap (``max_num_seqs``), the partial-prefill cap, live state slots and KV
   blocks allow, and while the whole prompt fits beside what the running prompts still
   need (``scheduler/kv_reserve.py``). Admission finds the joint prefix hit
   (``CacheManager.admit``).

A step that carries decodes takes only the prefill that fits in its target time
(``scheduler/step_budget.py``, learned from the step times the engine reports through
``observe_step``), at least one checkpoint unit: streams keep moving while a long prompt
prefills. A step without decodes keeps the full budget.

Every prefill chunk except a prompt's last ends on a checkpoint-unit boundary (a block by
default), where its blocks can be published and a checkpoint taken. A waiting prompt that
shares at least ``shared_prefix_wait_tokens`` past its hit with a prompt being computed now
waits for that one (``CacheManager.wait_for_shared_prefix``) instead of computing it beside it. When KV blocks run
out for a running request, the policy picks a victim among running requests not yet
scheduled this step (possibly the request itself); the victim is freed and requeued, its
published prefix stays cached, which makes the recompute cheap.

A request whose hit includes host-tier items is admitted *loading*: it holds its pins,
live slot and promoted blocks, and computes nothing until the copies it needs have landed
(staged a per-step byte budget at a time, ``CacheManager.stage_loads``); meanwhile the
others decode and prefill as usual. A step may carry only copies (no forward).

``land`` applies the step's copies (before its forward's results), ``update`` applies a
finished step; ``fail_step`` releases one that raised. The scheduler
never touches torch; the engine decides stop conditions and calls ``finish``.

Every call into the policy is checked (``scheduler/policy_guard.py``): a faulty policy costs
its own call an FCFS answer, never the engine.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from deltaserve.cache.manager import CacheManager
from deltaserve.cache.planning import settle_verify
from deltaserve.cache.types import AdmitStatus, PrefixMatch, SeqCache, StepItem, StepPlan, Transfer
from deltaserve.engine.core.step_phases import StepPhases
from deltaserve.logs import get_logger
from deltaserve.scheduler.awaited import tell_eviction
from deltaserve.scheduler.kv_reserve import charge_floor, kv_shortfall
from deltaserve.scheduler.policy import PolicyContext, SchedulingPolicy
from deltaserve.scheduler.policy_guard import PolicyGuard
from deltaserve.scheduler.request import Request, RequestStatus, is_placeholder
from deltaserve.scheduler.step_budget import StepBudget

log = get_logger("deltaserve.scheduler")

#: prompt tokens a request that computes its whole prompt (prompt log-probabilities) computes
#: per step, at most (at least one checkpoint unit): the runner keeps a ``[tokens, vocab]``
#: float32 logits row per token for it, 0.5 GB at 248k vocabulary for 512 tokens
WHOLE_PROMPT_CHUNK = 512

#: the first step after idle waits for more arrivals at most this share of its predicted time
BURST_WINDOW_SHARE = 0.02


@dataclass(slots=True)
class ScheduledSeq:
    request: Request
    start: int  # num_computed_tokens before the step
    end: int  # num_computed_tokens after the step
    is_decode: bool
    # A token is due: the piece reaches the end of the known tokens. Fixed at schedule time
    # (after update() appends the sampled token the request's length has moved on).
    samples: bool
    # a verify segment's draft tokens (computed after ``token_ids[start]``; ``end = start + 1 +
    # len(drafts)``); empty for every other piece
    drafts: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq]  # decodes first, then verify segments (longest first), then prefills
    plan: StepPlan
    preempted: list[Request] = field(default_factory=list)
    step: int = 0
    num_verify: int = 0  # seqs [num_decodes, num_decodes + num_verify) are verify segments

    @functools.cached_property
    def num_decodes(self) -> int:  # counted once (the runner and the engine both ask)
        return sum(1 for s in self.seqs if s.is_decode and not s.drafts)

    @functools.cached_property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)


@dataclass(slots=True)
class _StepBuild:
    """What one ``schedule`` call builds up, phase by phase."""

    ctx: PolicyContext
    budget: int  # tokens left in the step
    decodes: list[ScheduledSeq] = field(default_factory=list)
    verifies: list[ScheduledSeq] = field(default_factory=list)
    prefills: list[ScheduledSeq] = field(default_factory=list)
    scheduled: set[int] = field(default_factory=set)  # id() of the requests scheduled so far
    preempted: list[Request] = field(default_factory=list)


class Scheduler:
    def __init__(
        self,
        cache: CacheManager,
        policy: SchedulingPolicy,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_num_partial_prefills: int = 4,
        enable_chunked_prefill: bool = True,
        long_prefill_token_threshold: int = 0,
        step_budget: StepBudget | None = None,
        shared_prefix_wait_tokens: int = 0,
        burst_window_s: float = 0.0,
        reserve_prompts: bool = True,
    ) -> None:
        self.cache = cache
        self.policy = policy
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_partial_prefills = max_num_partial_prefills
        self.enable_chunked_prefill = enable_chunked_prefill
        self.long_prefill_token_threshold = long_prefill_token_threshold
        # a waiting prompt that shares at least this many tokens past its hit with a prompt
        # being computed waits for that one's checkpoint (0: never waits)
        self.shared_prefix_wait_tokens = shared_prefix_wait_tokens
        # the most the first step after idle waits for more arrivals (burst_window)
        self.burst_window_s = burst_window_s
        # admit a prompt only while every running prompt keeps room to end (kv_reserve.py)
        self.reserve_prompts = reserve_prompts
        # None: a step with decodes takes the full token budget of prefill
        self.step_budget = step_budget
        self.unit = cache.unit
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.step_count = 0
        self.num_preemptions = 0
        self.phases = StepPhases()  # where a step's time goes (EngineCore installs its recorder)
        self.guard = PolicyGuard(policy)
        self._inflight: SchedulerOutput | None = None

    @property
    def policy_errors(self) -> int:
        """Policy calls answered by FCFS because the policy failed (``PolicyGuard``)."""
        return self.guard.errors

    # ------------------------------------------------------------------ queue
    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        request.arrival_step = self.step_count
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def burst_window(self) -> float:
        """Seconds the first step after the engine was idle may wait for more arrivals (0: now).

        Clients on one new system prompt arrive within milliseconds of each other. The first
        arrival alone would compute the whole shared prefix in one step and publish it with no
        checkpoint where the prompts part, so every later one computes it again. Admitted in
        one scheduling pass, the later ones wait for it instead and resume from the branch
        checkpoint it captures (``CacheManager.wait_for_shared_prefix``). So a step waits only
        when nothing runs and a waiting prompt would compute at least
        ``shared_prefix_wait_tokens`` past its hit (a prompt that could be such a prefix's
        first), and at most ``BURST_WINDOW_SHARE`` of that step's predicted time.
        """
        if (
            self.burst_window_s <= 0
            or self.shared_prefix_wait_tokens <= 0
            or self.running
            or not self.waiting
        ):
            return 0.0
        uncached = max(r.num_tokens - self._match(r).hit_tokens for r in self.waiting)
        if uncached < self.shared_prefix_wait_tokens:
            return 0.0
        model = self.step_budget.model if self.step_budget is not None else None
        if model is None or not model.ready:
            return self.burst_window_s  # no step measured yet: the cap
        predicted = model.predict(min(uncached, self.max_num_batched_tokens))
        return min(self.burst_window_s, BURST_WINDOW_SHARE * max(predicted, 0.0))

    def _match(self, r: Request) -> PrefixMatch:
        """The request's prefix match: computed once per request while the index is unchanged
        (the policy's ordering, the chunking and ``admit`` share it). A request that computes
        its whole prompt gets its path with no hit (it still publishes what it computes)."""
        m = self.cache.match(r.token_ids, r.cache_salt, r.block_hashes, key=r.request_id)
        if r.compute_whole_prompt and m.hit_blocks:
            return PrefixMatch(m.path, 0, m.hashes, m.num_tokens, m.version, m.block_size)
        return m

    def _ctx(self) -> PolicyContext:
        def cached_prefix(r: Request) -> int:
            return self._match(r).hit_tokens

        return PolicyContext(step=self.step_count, now=time.monotonic(), cached_prefix=cached_prefix)

    # ------------------------------------------------------------------ scheduling
    def _chunk_end(self, start: int, target: int, budget: int) -> int:
        """End of a prefill chunk from ``start``: the target, or a unit boundary.

        Without chunked prefill a prompt is computed whole in one step (it may overrun the
        token budget: that is the latency spike chunking exists to avoid).
        """
        if not self.enable_chunked_prefill:
            return target if budget > 0 else start
        if self.long_prefill_token_threshold > 0:
            # one prompt's share of a step: lets several prompts prefill side by side so a
            # short one is not stuck behind a long one (bounded by max_num_partial_prefills)
            budget = min(budget, max(self.long_prefill_token_threshold, self.unit))
        end = min(target, start + budget)
        if end < target:
            end = (end // self.unit) * self.unit
        return end if end > start else start

    def _piece_budget(self, req: Request, budget: int) -> int:
        """The step's budget for ``req``'s next prefill piece (``WHOLE_PROMPT_CHUNK``)."""
        if req.compute_whole_prompt:
            return min(budget, max(WHOLE_PROMPT_CHUNK, self.unit))
        return budget

    def _preempt(self, victim: Request) -> None:
        assert victim.cache is not None
        if victim.token_ids and is_placeholder(victim.token_ids[-1]):
            # a sampled token still on its way is no token to recompute or hash; the engine
            # appends the real one on arrival
            victim.token_ids.pop()
        victim.preempted_tokens = victim.num_computed_tokens
        self.cache.note_preemption(victim.num_computed_tokens)
        self.cache.free(victim.cache, publish_output=True)
        victim.cache = None
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.WAITING
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.running.remove(victim)
        self.waiting.append(victim)

    def _allocate_or_preempt(
        self, req: Request, end: int, scheduled: set[int], ctx: PolicyContext, preempted: list[Request]
    ) -> bool:
        """Blocks for ``req`` up to ``end``; preempt others (or ``req``) if needed."""
        assert req.cache is not None
        while not self.cache.allocate(req.cache, end):
            candidates = [r for r in self.running if id(r) not in scheduled]
            victim = self.guard.preemption_victim(candidates, ctx) if candidates else req
            self._preempt(victim)
            preempted.append(victim)
            if victim is req:
                return False
        return True

    def schedule(self) -> SchedulerOutput | None:
        """The next step: decodes, then running prefills, then admissions (module docstring);
        None when there is nothing to run (no sequence and no copy between tiers)."""
        if self._inflight is not None:
            raise RuntimeError("schedule() while a step is in flight")
        step = _StepBuild(self._ctx(), self.max_num_batched_tokens)
        tell_eviction(self.cache, self.waiting, self._match)  # waiting requests' hits (awaited.py)
        rest = self._schedule_decodes(step)
        streams = len(step.decodes) + len(step.verifies)
        if streams and self.step_budget is not None:
            # bounded inter-token latency: the prefill of a step with decodes is what fits
            # in the target step time (scheduler/step_budget.py)
            step.budget = min(step.budget, self.step_budget.prefill_budget(streams, step.budget))
        self._schedule_prefills(rest, step)
        if self.waiting and step.budget > 0:
            self._admit_waiting(step)
        return self._emit(step)

    def _schedule_decodes(self, step: _StepBuild) -> list[Request]:
        """Phase 1: decodes of running requests, oldest admission first. Returns the running
        requests it passes over (prefilling, loading, or past the budget) for phase 2, which
        so never walks the decodes again.

        The hot loop of a decode-heavy step: the request's fields are read directly, and the
        cache is asked for blocks only when the block table does not already cover the new
        token."""
        budget, ctx = step.budget, step.ctx
        decodes, scheduled, preempted = step.decodes, step.scheduled, step.preempted
        bs = self.cache.block_size
        running = RequestStatus.RUNNING
        order = list(self.running)
        rest: list[Request] = []
        for i, req in enumerate(order):
            if budget <= 0:
                rest.extend(order[i:])
                break
            num_tokens = len(req.token_ids)
            computed = req.num_computed_tokens
            # (a request preempted earlier in this loop is WAITING now)
            if req.status is not running or computed <= 0 or num_tokens - computed != 1:
                rest.append(req)
                continue  # not decoding (Request.is_decoding)
            if req.cache.loads:  # type: ignore[union-attr]
                rest.append(req)
                continue  # still loading from the host tier (staged in phase 2)
            scheduled.add(id(req))
            if len(req.cache.block_table) * bs < num_tokens and not self._allocate_or_preempt(  # type: ignore[union-attr]
                req, num_tokens, scheduled, ctx, preempted
            ):
                scheduled.discard(id(req))
                continue
            if req.draft_token_ids:
                # the window's tokens sit at positions computed .. computed + k, all in the block
                # the decode's own token is in (allocated above)
                k = min(len(req.draft_token_ids), bs - 1 - computed % bs, budget - 1)
                if k > 0:
                    drafts = tuple(req.draft_token_ids[:k])
                    step.verifies.append(ScheduledSeq(req, computed, num_tokens + k, True, True, drafts))
                    budget -= 1 + k
                    continue
            decodes.append(ScheduledSeq(req, computed, num_tokens, True, True))
            budget -= 1
        step.budget = budget
        return rest

    def _schedule_prefills(self, rest: list[Request], step: _StepBuild) -> None:
        """Phase 2: running requests still in prefill get their next chunk; those loading
        from the host tier stage their copies."""
        scheduled = step.scheduled
        for req in rest:
            if req.status is not RequestStatus.RUNNING:  # preempted in phase 1
                continue
            if req.cache is not None and req.cache.loads:
                self.cache.stage_loads(req.cache)
                continue
            if req.is_decoding:
                continue
            start = req.num_computed_tokens
            end = self._chunk_end(start, req.num_tokens, self._piece_budget(req, step.budget))
            if end == start:
                continue
            scheduled.add(id(req))
            if not self._allocate_or_preempt(req, end, scheduled, step.ctx, step.preempted):
                scheduled.discard(id(req))
                continue
            step.prefills.append(ScheduledSeq(req, start, end, False, end == req.num_tokens))
            step.budget -= end - start

    def _admit_waiting(self, step: _StepBuild) -> None:
        """Phase 3: admit waiting requests in policy order, stopping at the first that does
        not fit (the order is a promise). ``max_num_partial_prefills`` bounds the prompts that
        will still be partially prefilled after this step (a short prompt prefilled whole in
        this step does not count)."""
        completing = {id(p.request) for p in step.prefills if p.end == p.request.num_tokens}
        num_partial = sum(1 for r in self.running if not r.is_decoding and id(r) not in completing)
        for req in self.guard.order_waiting(self.waiting, step.ctx):
            if len(self.running) >= self.max_num_seqs or step.budget <= 0:
                break
            if self.cache.num_free_live_slots == 0:
                break
            if req in step.preempted:
                continue  # not again in the step that preempted it
            if self.reserve_prompts:
                short = kv_shortfall(self.cache, self.running, req, functools.partial(self._match, req))
                if short.blocks:
                    charge_floor(self.cache, req, short)
                    break  # its prompt would outgrow the KV the running ones still need (kv_reserve.py)
            partial = self._admit(req, step, num_partial)
            if partial is None:
                break
            num_partial += partial

    def _admit(self, req: Request, step: _StepBuild, num_partial: int) -> int | None:
        """Admit ``req`` with its first prefill chunk, or with its host-tier loads staged
        (one ``CacheManager.admit_request``). None when it does not fit now; else 1 if it
        stays partially prefilled after this step, 0 if not."""

        def first_chunk(hit: int) -> int | None:
            end = self._chunk_end(hit, req.num_tokens, self._piece_budget(req, step.budget))
            if end == hit:
                return None  # not even one chunk fits this step: keep the order, wait
            if end < req.num_tokens and num_partial >= self.max_num_partial_prefills:
                return None
            return end

        a = self.cache.admit_request(
            req.request_id,
            req.token_ids,
            req.cache_salt,
            self._match(req),
            first_chunk,
            prompt_len=req.num_prompt_tokens,
            hashes=req.block_hashes,
            whole_prompt=req.compute_whole_prompt,
            wait_tokens=self.shared_prefix_wait_tokens,
            preempted_tokens=None if req.num_cached_tokens < 0 else req.preempted_tokens,
        )
        if a.status is AdmitStatus.WAITING:
            return 0  # a disk read or another request's prefix: the others go on meanwhile
        if a.seq is None:
            return None
        self._start(req, a.seq)
        if a.status is AdmitStatus.LOADING:  # it computes once its copies have landed
            return 0
        step.scheduled.add(id(req))
        step.prefills.append(ScheduledSeq(req, a.start, a.end, False, a.end == req.num_tokens))
        step.budget -= a.end - a.start
        return int(a.end < req.num_tokens)

    def _emit(self, step: _StepBuild) -> SchedulerOutput | None:
        """The step's output and cache plan (None: nothing to run)."""
        # a preempted request scheduled earlier in this step cannot be (victims exclude them)
        decodes = step.decodes
        verifies = sorted(step.verifies, key=lambda s: -s.num_tokens)  # longest first (models/verify.py)
        seqs = decodes + verifies + step.prefills if verifies else decodes + step.prefills
        if not seqs and not self.cache.has_transfers():
            return None
        # (positional: StepItem(seq, token_ids, start, end, is_decode); keywords cost a third more
        # per sequence, and this runs for every sequence of every step)
        items = [
            StepItem(s.request.cache, s.request.token_ids, s.start, s.end, s.is_decode)  # type: ignore[arg-type]
            for s in seqs
        ]
        for i, s in enumerate(verifies, start=len(decodes)):
            # the cache plans a verify as a decode over its whole window (an output capture only
            # where the window ends on a unit boundary); ``update`` trims it to what was accepted
            items[i].token_ids = [*s.request.token_ids, *s.drafts]
        self.phases.enter("cache_plan")
        plan = self.cache.plan_step(items)
        self.phases.enter("schedule")
        out = SchedulerOutput(
            seqs=seqs, plan=plan, preempted=step.preempted, step=self.step_count, num_verify=len(verifies)
        )
        # (cached properties: known here without counting)
        out.num_decodes = len(decodes)
        out.num_tokens = len(decodes) + sum(s.num_tokens for s in step.prefills)
        if verifies:
            out.num_tokens += sum(s.num_tokens for s in verifies)
        self._inflight = out
        self.step_count += 1
        return out

    def _start(self, req: Request, seq: SeqCache) -> None:
        """``req`` was admitted (``seq``: its cache view, its query counted by the cache): it
        moves to the running list."""
        req.cache = seq
        req.num_computed_tokens = seq.num_cached_tokens
        req.kv_short_steps = req.kv_short_blocks = 0
        if req.num_cached_tokens < 0:  # first admission (not a preemption's recompute)
            req.num_cached_tokens = seq.num_cached_tokens
            req.scheduled_time = time.monotonic()
        req.status = RequestStatus.RUNNING
        self.waiting.remove(req)
        self.running.append(req)

    # ------------------------------------------------------------------ results
    def land(self, out: SchedulerOutput, failed: Sequence[Transfer] = ()) -> list[Request]:
        """The step's copies between tiers ran (``failed``: those that did not); the
        requests whose loads failed are returned for the caller to end."""
        if out is not self._inflight:
            raise RuntimeError("land() of a step that is not in flight")
        broken = self.cache.land_transfers(out.plan, failed)
        return [self.requests[seq.request_id] for seq in broken]

    def update(
        self, out: SchedulerOutput, sampled: list[int | None], verified: Sequence[Sequence[int]] = ()
    ) -> None:
        """Apply a successful step: computed counts, published cache, sampled tokens.

        ``sampled[i]`` is the token ``out.seqs[i]`` sampled (None: it sampled none), or, for a
        step committed while its forward runs, that row's ``placeholder``: the request then
        counts as decoding, and its owner puts the real token in its place when it arrives.
        ``verified[i]``: the tokens verify segment ``i`` emits (its accepted drafts, then the
        token sampled after them; ``sampled`` holds None for it): its request computed its
        window up to the last accepted draft, and the cache publishes that much only.

        A commit that raises leaves the cache whole with the plan in flight holding what it
        did not apply (``CacheManager.commit_step``): the caller aborts that plan and ends
        the step's requests."""
        if out is not self._inflight:
            raise RuntimeError("update() of a step that is not in flight")
        if len(verified) != out.num_verify:
            raise ValueError(f"{len(verified)} verify results for {out.num_verify} verify segments")
        for i, emitted in enumerate(verified, start=out.num_decodes):
            if not 1 <= len(emitted) <= len(out.seqs[i].drafts) + 1:
                raise ValueError(
                    f"a verify of {len(out.seqs[i].drafts)} drafts emitted {len(emitted)} tokens"
                )
        self._inflight = None
        for s in out.seqs:
            s.request.num_computed_tokens = s.end
        for i, emitted in enumerate(verified, start=out.num_decodes):
            s = out.seqs[i]
            # (before the commit: the accepted drafts are hashed as the request's own tokens)
            s.request.token_ids.extend(emitted)
            s.request.num_computed_tokens = s.start + len(emitted)
            settle_verify(out.plan.items[i], s.request.num_computed_tokens, s.request.token_ids)
        self.cache.commit_step(out.plan)
        for s, token in zip(out.seqs, sampled, strict=True):
            if token is not None:
                s.request.append_token(token)

    def observe_step(self, out: SchedulerOutput, seconds: float) -> None:
        """``out``'s forward took ``seconds`` (measured by the engine): the step-time model
        learns from it."""
        if self.step_budget is not None:
            # a verify window streams the weights once like a decode: it counts as one
            nv = out.num_verify
            verify = sum(s.num_tokens for s in out.seqs[out.num_decodes : out.num_decodes + nv]) if nv else 0
            decodes = out.num_decodes + nv
            self.step_budget.observe(out.num_tokens - out.num_decodes - verify, decodes, seconds)

    def fail_step(self, out: SchedulerOutput) -> list[Request]:
        """The step raised: release its reservations and end its requests (returned)."""
        if out is not self._inflight:
            raise RuntimeError("fail_step() of a step that is not in flight")
        self._inflight = None
        self.cache.abort_step(out.plan)
        failed = [s.request for s in out.seqs]
        for req in failed:
            self.finish(req, "error", publish_output=False)
        return failed

    def finish(self, req: Request, reason: str, *, publish_output: bool = True) -> None:
        """End a request (stop, length, abort, error); returns its blocks and slots."""
        if req.status is RequestStatus.FINISHED:
            return
        if req.cache is not None:
            self.cache.free(req.cache, publish_output=publish_output)
            req.cache = None
        self.cache.forget(req.request_id)
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        self.requests.pop(req.request_id, None)

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is None:
            return None
        if self._inflight is not None and any(s.request is req for s in self._inflight.seqs):
            raise RuntimeError("abort of a request in the in-flight step")
        self.finish(req, "abort", publish_output=False)
        return req

    # ------------------------------------------------------------------ reporting
    def stats(self) -> dict[str, float]:
        policy_stats = self.guard.stats()  # first: a fault in it is counted below
        now = time.monotonic()
        oldest = max((now - r.arrival_time for r in self.waiting), default=0.0)
        out: dict[str, float] = {
            "scheduler.running": len(self.running),
            "scheduler.waiting": len(self.waiting),
            "scheduler.preemptions": self.num_preemptions,
            "scheduler.oldest_waiting_s": oldest,
            "scheduler.steps": self.step_count,
            "scheduler.policy_errors": self.guard.errors,
        }
        out.update({f"scheduler.policy.{k}": v for k, v in policy_stats.items()})
        if self.step_budget is not None:
            out.update(self.step_budget.stats())
        return out

    def check_integrity(self) -> None:
        self.cache.check_integrity()
        active = {r.cache.request_id for r in self.running if r.cache is not None}
        assert active == set(self.cache.active), "running requests != cache's active requests"
        assert all(r.cache is None for r in self.waiting), "waiting request holds cache"
        assert all(r.status is RequestStatus.RUNNING for r in self.running)
        assert all(r.status is RequestStatus.WAITING for r in self.waiting)
        assert len(self.running) <= self.max_num_seqs
        for r in self.running:
            assert (
                r.cache is not None
                and len(r.cache.block_table) * self.cache.block_size >= r.num_computed_tokens
            )
