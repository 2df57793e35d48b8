"""Model runner: the one place a ``SchedulerOutput`` becomes tensors.

It owns the cache tensors (paged KV per attention layer, state slots per GDN layer), builds
``BatchMetadata`` (docs/contracts.md), and runs one step in two halves:

``prepare`` (host only; with async scheduling the engine thread runs it while the previous
step's forward is still running): every field of the batch is computed with numpy from one
pass over the scheduled sequences (no per-token Python) and packed into **one** int64 host
buffer (``BatchBuffer``: fields by name), so it reaches the device in one copy.

``transfer`` (before ``launch``): the step's copies between tiers and within the device, in
this order: the host tier's saves (device -> host), the KV block moves (``plan.moves``: in a
shared arena a page is re-purposed by moving its blocks elsewhere; a save may read a block a
move then overwrites, and a load may land in a block a move has just vacated), then the
host tier's loads.

``launch`` (the device half; with async scheduling it runs on the forward worker thread):

1. the buffer to the device (CPU: zero-copy views), placeholder input ids resolved (below);
2. restore copies (checkpoint slot -> live slot) planned by the cache manager;
3. the model forward (decodes first, then verify segments, then prefill segments; prefill
   captures are written by the kernels straight into their reserved slots);
3a. with the MTP drafter, the forward also returns every token's hidden state; after
   sampling the head runs over the step and proposes the next drafts (``runner/mtp_draft.py``);
3b. with verify segments (speculative decoding, ``engine/runner/verify.py``): their drafts
   accepted or rejected from their own logits rows (the last rows), and the states of every
   segment with a rejected draft rolled back to its last accepted token;
4. decode-time output tracking copies (live slot -> tracking slot; a verify segment's only
   when its whole window was accepted);
5. sampling (``engine/runner/sampling.py``), only for sequences whose piece reaches the end of their
   known tokens: one ``argmax`` when every such row is plain greedy, else the general sampler;
   first, the constrained rows' logits are masked with the token bitmask ``prepare`` built
   from their matchers (so a constrained step needs every earlier token of its rows known).
   Requests with ``prompt_logprobs`` also get the logits of their prompt positions (extra rows
   after the sampled ones, ``engine/runner/prompt_logprobs.py``); nobody else pays for them.

**Placeholders.** With async scheduling the engine schedules step N+1 before it has step N's
sampled tokens: a request that samples in step N gets the placeholder of its row among step
N's sampled rows appended (``scheduler.request.placeholder``), and step N+1's input id for it
is read on the device from step N's token tensor (``StepResult.tokens``), never through
Python. The runner keeps the last step it ran for that; ``launch`` checks the step ids match.

The engine's tensor work lives here and in the runner's parts: ``sampling`` (the row
sampler), ``batch_buffer`` (the packed host buffer), ``request_state``, ``host_pool``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from deltaserve.cache.types import Transfer
from deltaserve.engine.core.step_phases import StepPhases
from deltaserve.engine.grammar import Grammars
from deltaserve.engine.outputs import TokenLogprob
from deltaserve.engine.runner import batch_layout as layout
from deltaserve.engine.runner.batch_buffer import BatchBuffer
from deltaserve.engine.runner.disk_io import DiskIO
from deltaserve.engine.runner.host_pool import Failure, HostPool
from deltaserve.engine.runner.memory import keep_freed_memory
from deltaserve.engine.runner.mtp_draft import MtpProposer
from deltaserve.engine.runner.prompt_logprobs import PromptSlice, fill_prompt_logprobs, prompt_slices
from deltaserve.engine.runner.request_state import RequestState
from deltaserve.engine.runner.sampling import Sampler, apply_token_mask, greedy
from deltaserve.engine.runner.verify import (
    VerifyHost,
    accept_rows,
    attach_masks,
    restore_accepted,
    tracking_copies,
    verify_fields,
)
from deltaserve.engine.sampling_params import SamplingParams
from deltaserve.kernels import Ops
from deltaserve.logs import get_logger
from deltaserve.models import BatchMetadata, CacheSpec, LoadedModel, ModelCaches
from deltaserve.models.verify import VerifyPlan
from deltaserve.scheduler.request import Request, is_placeholder, placeholder_row
from deltaserve.scheduler.scheduler import SchedulerOutput

log = get_logger("deltaserve.engine")


@dataclass(eq=False)
class PreparedStep:
    """One step's inputs, built on the host by ``ModelRunner.prepare`` and run by ``launch``.

    ``buffer`` packs every index field of the batch (int64, CPU) by name: the ``BatchMetadata``
    fields, ``block_tables`` flattened, and the placeholders' ``placeholder_dst`` (input-id
    positions) and ``placeholder_src`` (rows of the previous step's tokens). The sampling
    fields are None when every row is plain greedy.
    """

    out: SchedulerOutput
    buffer: BatchBuffer
    num_seqs: int
    num_decodes: int
    width: int  # block-table columns
    sample_seq: list[int]  # scheduled-seq index of each logits row
    requests: list[Request]  # the request of each logits row
    num_placeholders: int = 0
    placeholder_step: int = -1  # the step whose tokens the placeholders stand for
    params: list[SamplingParams] | None = None
    row_states: list[RequestState] | None = None
    output_ids: list[list[int]] | None = None  # per row: output ids its penalties count
    # prompt log-probabilities: their logits rows follow the sampled rows (``prompt_logprobs.py``)
    prompt_slices: list[PromptSlice] = field(default_factory=list)
    # constrained rows: their token bitmask (one row per logits row) and their logits rows
    token_mask: torch.Tensor | None = None
    mask_rows: list[int] | None = None
    # verify segments (speculative decoding): their logits rows come last (``runner/verify.py``)
    verify: VerifyHost | None = None


class StepResult:
    """What ``launch`` gives back: the sampled tokens on the device (one per logits row) and,
    for rows that asked, their log-probabilities. ``token_list`` brings the tokens to the host
    (on CUDA through an asynchronous copy into pinned memory; it waits for that copy only)."""

    def __init__(self, step: int, tokens: torch.Tensor, logprobs: list[TokenLogprob | None] | None) -> None:
        self.step = step
        self.tokens = tokens
        self.logprobs = logprobs
        # each verify segment's emitted tokens, in order, and their log-probabilities (if asked)
        self.verified: list[list[int]] = []
        self.verified_logprobs: list[list[TokenLogprob] | None] = []
        self._list: list[int] | None = None
        self._event: torch.cuda.Event | None = None
        if tokens.device.type == "cuda":
            self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self._host.copy_(tokens, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = tokens

    def token_list(self) -> list[int]:
        """The sampled tokens as ints, in logits-row order (waits for the device copy)."""
        if self._list is None:
            if self._event is not None:
                self._event.synchronize()
            self._list = self._host.tolist()
        return self._list

    def per_seq(
        self, prep: PreparedStep, states: Mapping[str, RequestState] | None = None
    ) -> list[int | None]:
        """The token of each scheduled sequence (None where none was due). With ``states``,
        log-probabilities are appended to the requests' states first."""
        sampled: list[int | None] = [None] * prep.num_seqs
        tokens = self.token_list()
        for i, t in zip(prep.sample_seq, tokens, strict=True):
            sampled[i] = t
        if states is not None and self.logprobs is not None:
            for r, lp in zip(prep.requests, self.logprobs, strict=True):
                st = states.get(r.request_id)
                if lp is not None and st is not None:
                    st.logprobs.append(lp)
        return sampled


@dataclass
class RunnerSizes:
    """Cache tensor sizes. ``num_pages > 0``: one shared arena of ``num_live_slots + num_pages``
    pages (``CacheSpec.allocate_arena``; ``num_kv_blocks`` / ``num_checkpoint_slots`` are then
    only the maxima and are not allocated separately); 0: separate contiguous tensors."""

    num_kv_blocks: int
    block_size: int
    num_live_slots: int
    num_checkpoint_slots: int
    num_host_kv_blocks: int = 0
    num_host_checkpoint_slots: int = 0
    num_pages: int = 0
    num_host_pages: int = 0  # the host tier as one arena of pages (then the pair above is 0)

    @property
    def num_state_slots(self) -> int:
        return self.num_live_slots + self.num_checkpoint_slots


class ModelRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        ops: Ops,
        sizes: RunnerSizes,
        device: torch.device,
        *,
        spec: CacheSpec | None = None,
    ) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.ops = ops
        self.sizes = sizes
        self.device = device
        if device.type == "cpu":
            keep_freed_memory()  # the forward's large intermediates reuse heap pages (no page faults)
        # ``spec``: the engine's (the MTP head's KV layers with ``speculative.method = "mtp"``,
        # the configured state dtype); else the model's own
        self.spec: CacheSpec = spec or self.model.cache_spec()
        if sizes.num_pages:
            self.caches: ModelCaches = self.spec.allocate_arena(
                sizes.num_live_slots, sizes.num_pages, sizes.block_size, device
            )
        else:
            self.caches = self.spec.allocate(
                sizes.num_kv_blocks,
                sizes.block_size,
                sizes.num_state_slots if self.spec.num_gdn_layers else 0,
                device,
            )
        self.sampler = Sampler(ops, device)
        self.default_generator = self.sampler.default_generator
        self._last: StepResult | None = None  # the last step launched (placeholders read its tokens)
        self.grammars: Grammars | None = None  # the engine's (set by EngineCore): constrained rows' masks
        # running requests with a constraint (kept by EngineCore): while 0, steps build no mask
        self.num_constrained = 0
        self.phases = StepPhases()  # where a step's time goes (EngineCore installs its recorder)
        self.host: HostPool | None = None
        self.mtp: MtpProposer | None = None  # the MTP drafter's head pass (``SpecDecoding`` attaches it)
        self.disk: DiskIO | None = None  # the disk tier's copies (``EngineCore`` attaches it)
        if sizes.num_host_kv_blocks or sizes.num_host_checkpoint_slots or sizes.num_host_pages:
            self.host = HostPool(
                self.spec,
                sizes.num_host_kv_blocks if self.spec.num_attn_layers else 0,
                sizes.block_size,
                sizes.num_host_checkpoint_slots if self.spec.num_gdn_layers else 0,
                device,
                num_pages=sizes.num_host_pages,
            )

    def transfer(self, out: SchedulerOutput) -> list[Failure]:
        """The step's copies before its forward: host saves, device block moves, host loads; the
        host copies that failed, with their error. A failed move raises: blocks the cache
        believes whole would hold the wrong tokens, so the step cannot go on."""
        plan = out.plan
        if plan.disk_saves and self.disk is not None:  # first: later copies may overwrite their rows
            self.disk.save(plan.disk_saves, self.caches, self.host.caches if self.host is not None else None)
        moves = plan.moves
        run_moves = (lambda: self.move_blocks(moves)) if moves else None
        if self.host is None:
            if run_moves is not None:
                run_moves()
            failed: list[Failure] = []
        else:
            failed = self.host.transfer(plan, self.caches, between=run_moves)
        if self.disk is not None and any(t.kind.from_disk for t in plan.loads):
            failed += self._disk_loads(plan.loads)
        return failed

    def _disk_loads(self, loads: Sequence[Transfer]) -> list[Failure]:
        """The step's disk loads, one request at a time (a failure fails only its request)."""
        assert self.disk is not None
        failed: list[Failure] = []
        groups: dict[int, list[Transfer]] = {}
        for t in loads:
            if t.kind.from_disk:
                groups.setdefault(id(t.seq), []).append(t)
        for group in groups.values():
            try:
                self.disk.load(group, self.caches)
            except Exception as e:
                log.error("disk.load_failed", request_id=group[0].seq.request_id, error=repr(e))  # type: ignore[union-attr]
                failed += [(t, e) for t in group]
        return failed

    def move_blocks(self, moves: Sequence[tuple[int, int]]) -> None:
        """KV block copies ``block[dst] = block[src]`` for every layer at once: in an arena each
        is one row of ``kv_block_bytes``; a simultaneous copy (a block may be a source and,
        for another pair, a destination); distinct destinations."""
        if not moves or not self.spec.num_attn_layers:
            return
        src = torch.tensor([m[0] for m in moves], dtype=torch.int64)
        dst = torch.tensor([m[1] for m in moves], dtype=torch.int64)
        if self.caches.arena is not None:
            tensors = [self.caches.block_rows()]
        else:
            tensors = [*self.caches.k_cache, *self.caches.v_cache]
        # the row copy op: axis 0 of every tensor, validated once on the host
        self.ops.copy_state_slots(tensors, src, dst)

    @staticmethod
    @torch.inference_mode()
    def profile(
        loaded: LoadedModel, ops: Ops, num_tokens: int, block_size: int, device: torch.device
    ) -> None:
        """One forward of a ``num_tokens`` prefill on throw-away minimal caches: the activation
        peak of the largest step (CUDA capacity planning measures memory around it)."""
        spec = loaded.model.cache_spec()
        num_blocks = -(-num_tokens // block_size)
        caches = spec.allocate(num_blocks, block_size, 1 if spec.num_gdn_layers else 0, device)

        def t(data: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.tensor(data, dtype=dtype, device=device)

        positions = torch.arange(num_tokens, device=device)
        batch = BatchMetadata(
            input_ids=torch.zeros(num_tokens, dtype=torch.int64, device=device),
            positions=positions,
            cu_seqlens=t([0, num_tokens]),
            seq_lens=t([num_tokens]),
            block_tables=torch.arange(num_blocks, device=device).view(1, num_blocks),
            slot_mapping=positions.clone(),
            num_decodes=0,
            state_slots=t([0]),
            has_initial_state=t([False], torch.bool),
            capture_seq=t([]),
            capture_pos=t([]),
            capture_slots=t([]),
            logits_indices=t([num_tokens - 1]),
        )
        loaded.model.forward(batch, caches)
        del caches

    # ------------------------------------------------------------------ host side
    def prepare(
        self,
        out: SchedulerOutput,
        states: Mapping[str, RequestState] | None = None,
        *,
        all_greedy: bool = False,
        placeholder_step: int = -1,
    ) -> PreparedStep:
        """The step's inputs, built on the host (no device work: the engine thread runs this
        while the previous step's forward is still running).

        ``states``: the requests' engine-side state (generators, the repetition-penalty prompt
        tensor), needed unless every sampled row is plain greedy; ``all_greedy`` says so
        without looking (the engine keeps count). ``placeholder_step``: the step whose sampled
        tokens the placeholders in this step's input ids stand for (async scheduling).
        While ``num_constrained`` is not 0, the constrained rows get a token mask, built here
        from their matchers (other steps do not look).
        """
        self.phases.enter("build_batch")
        seqs, bs = out.seqs, self.sizes.block_size
        n, nd, nv = len(seqs), out.num_decodes, out.num_verify
        input_ids, starts, ends = layout.token_ids(seqs, nd)
        positions, cu, seq_index = layout.token_layout(starts, ends, len(input_ids))
        caches = [s.request.cache for s in seqs]
        tables = [c.block_table for c in caches]  # type: ignore[union-attr]
        block_tables = layout.block_tables(tables, ends, bs)
        slot_mapping = block_tables[seq_index, positions // bs] * bs + positions % bs
        # logits rows: every decode samples; a prefill segment samples when it reaches the end
        sample_seq = list(range(nd))
        sample_seq += [i for i in range(nd + nv, n) if seqs[i].samples]
        logits_rows = cu[1:][sample_seq] - 1 if sample_seq else np.zeros(0, dtype=np.int64)
        slices: list[PromptSlice] = []
        if states is not None and nd + nv < n:
            prompt_rows, slices = prompt_slices(seqs, nd + nv, cu, states)
            if slices:
                logits_rows = np.concatenate([logits_rows, prompt_rows])
        verify, verify_extra = None, {}
        if nv:
            verify, verify_rows, verify_extra = verify_fields(
                seqs, nd, nv, cu, ends, positions, block_tables, seq_index
            )
            logits_rows = np.concatenate([logits_rows, verify_rows])
            if states is not None:
                verify.attach(seqs[nd : nd + nv], states)
                if self.num_constrained and self.grammars is not None:
                    attach_masks(verify, seqs[nd : nd + nv], states, self.grammars)
        cap = np.array(
            [(c.item_index, c.boundary - seqs[c.item_index].start, c.slot) for c in out.plan.captures],
            dtype=np.int64,
        ).reshape(-1, 3)
        ph_dst, ph_src = layout.take_placeholders(input_ids)
        buffer = BatchBuffer.pack(
            {
                "input_ids": input_ids,
                "positions": positions,
                "slot_mapping": slot_mapping,
                "cu_seqlens": cu,
                "seq_lens": ends,
                "state_slots": np.array([c.state_slot for c in caches], dtype=np.int64),  # type: ignore[union-attr]
                "has_initial_state": (starts > 0).astype(np.int64),
                "logits_indices": logits_rows,
                "capture_seq": cap[:, 0],
                "capture_pos": cap[:, 1],
                "capture_slots": cap[:, 2],
                "placeholder_dst": ph_dst,
                "placeholder_src": ph_src,
                "block_tables": block_tables.reshape(-1),
                **verify_extra,
            }
        )
        prep = PreparedStep(
            out=out,
            buffer=buffer,
            num_seqs=n,
            num_decodes=nd,
            width=block_tables.shape[1],
            sample_seq=sample_seq,
            requests=[seqs[i].request for i in sample_seq],
            num_placeholders=len(ph_dst),
            placeholder_step=placeholder_step,
            prompt_slices=slices,
            verify=verify,
        )
        if prep.requests and not all_greedy:
            assert states is not None, "states are needed to sample rows that are not plain greedy"
            _attach_sampling(prep, states)
        if self.num_constrained and prep.requests and states is not None and self.grammars is not None:
            _attach_mask(prep, states, self.grammars)
        return prep

    def build_batch(self, out: SchedulerOutput) -> tuple[BatchMetadata, list[int]]:
        """BatchMetadata for the step (on the device), and the scheduled-seq index of each logits row."""
        prep = self.prepare(out, all_greedy=True)
        return self._device_batch(prep)[0], prep.sample_seq

    # ------------------------------------------------------------------ device side
    def _device_batch(self, prep: PreparedStep) -> tuple[BatchMetadata, torch.Tensor, torch.Tensor]:
        """The prepared buffer on the device (one copy), taken apart into the batch's fields; and
        the placeholder destinations / sources."""
        buf = prep.buffer.host
        if self.device.type != "cpu":
            # one pinned host copy, one asynchronous transfer: nothing here waits for the device
            buf = buf.pin_memory().to(self.device, non_blocking=True)
        f = prep.buffer.views(buf)
        batch = BatchMetadata(
            input_ids=f["input_ids"],
            positions=f["positions"],
            slot_mapping=f["slot_mapping"],
            cu_seqlens=f["cu_seqlens"],
            seq_lens=f["seq_lens"],
            state_slots=f["state_slots"],
            has_initial_state=f["has_initial_state"] != 0,
            logits_indices=f["logits_indices"],
            capture_seq=f["capture_seq"],
            capture_pos=f["capture_pos"],
            capture_slots=f["capture_slots"],
            block_tables=f["block_tables"].view(prep.num_seqs, prep.width),
            num_decodes=prep.num_decodes,
        )
        v = prep.verify
        if v is not None:
            batch.num_verify = len(v.drafts)
            batch.verify = VerifyPlan(
                counts=v.counts,
                num_tokens=v.num_tokens,
                cu_seqlens=f["verify_cu"],
                seq_lens=f["verify_seq_lens"],
                block_tables=f["verify_block_tables"].view(-1, prep.width),
            )
        return batch, f["placeholder_dst"], f["placeholder_src"]

    def _copy_states(self, pairs: list[tuple[int, int]]) -> None:
        if pairs and self.spec.num_gdn_layers:
            # host index lists: the op validates them on the host anyway (no device round trip)
            src = torch.tensor([p[0] for p in pairs], dtype=torch.int64)
            dst = torch.tensor([p[1] for p in pairs], dtype=torch.int64)
            self.ops.copy_state_slots(self.caches.state_copy_tensors(), src, dst)

    @torch.inference_mode()
    def launch(self, prep: PreparedStep) -> StepResult:
        """Run a prepared step on the device: restores, forward, tracking copies, sampling.

        With async scheduling this runs on the forward worker thread, one step at a time and
        in order, so the device sees every step's reads and writes after the previous step's.
        On CUDA nothing here waits for the device (except a penalised row's placeholder, which
        needs the previous tokens on the host): the sampled tokens are copied to pinned host
        memory asynchronously and ``StepResult.token_list`` waits for them.
        """
        out = prep.out
        self.phases.enter("forward")
        if self.host is not None:
            self.host.wait()  # loads of earlier steps have landed before anything reads them
        batch, ph_dst, ph_src = self._device_batch(prep)
        if prep.num_placeholders:
            if self._last is None or self._last.step != prep.placeholder_step:
                raise RuntimeError(
                    f"step {out.step} reads the sampled tokens of step {prep.placeholder_step}, "
                    f"but the last step run is {None if self._last is None else self._last.step}"
                )
            batch.input_ids[ph_dst] = self._last.tokens[ph_src]
        self._copy_states(out.plan.restores)
        hidden = None
        if self.mtp is not None:
            logits, hidden = self.model.forward(batch, self.caches, return_hidden=True)
        else:
            logits = self.model.forward(batch, self.caches)
        verified: list[list[int]] = []
        verified_lp: list[list[TokenLogprob] | None] = []
        if prep.verify is None:
            self._copy_states(out.plan.decode_copies)
        else:
            logits, verified, verified_lp = self._verify(logits, batch, prep.verify)
            self._copy_states(tracking_copies(out.plan.decode_copies, prep.verify, verified))
        if prep.prompt_slices:
            # (written on this thread; the engine reads them with the request's first token,
            # after the step that computed the prompt's last piece, and steps run in order)
            num_sampled = len(prep.sample_seq)
            fill_prompt_logprobs(logits[num_sampled:], prep.prompt_slices)
            logits = logits[:num_sampled]
        self.phases.enter("sample")
        tokens, logprobs = self._sample(logits, prep)
        if self.mtp is not None and hidden is not None:
            # (the head's time counts in the sample phase: no phase of its own)
            self.mtp.after_step(prep, batch, hidden, tokens, verified)
        self.phases.close()
        result = StepResult(out.step, tokens, logprobs)
        result.verified, result.verified_logprobs = verified, verified_lp
        self._last = result
        return result

    def _verify(
        self, logits: torch.Tensor, batch: BatchMetadata, host: VerifyHost
    ) -> tuple[torch.Tensor, list[list[int]], list[list[TokenLogprob] | None]]:
        """The verify rows (the last ``host.num_tokens`` of ``logits``) decide what each
        segment emits; the rejected drafts' states are rolled back (``runner/verify.py``).
        Returns the other rows, the emitted tokens and their log-probabilities."""
        rows = logits[logits.shape[0] - host.num_tokens :]
        emitted, logprobs = accept_rows(rows, host, self.default_generator)
        assert batch.verify is not None
        restore_accepted(self.caches, batch.verify.records, host, emitted)
        return logits[: logits.shape[0] - host.num_tokens], emitted, logprobs

    def _sample(
        self, logits: torch.Tensor, prep: PreparedStep
    ) -> tuple[torch.Tensor, list[TokenLogprob | None] | None]:
        """The step's tokens (one per logits row, on the device) and any log-probabilities."""
        if not prep.requests:
            return torch.zeros(0, dtype=torch.int64, device=self.device), None
        if prep.token_mask is not None and prep.mask_rows:
            apply_token_mask(logits, prep.token_mask, prep.mask_rows)
        if prep.params is None or prep.row_states is None or prep.output_ids is None:
            return greedy(logits), None  # every row plain greedy (the common case)
        outputs = prep.output_ids
        if prep.num_placeholders and any(o and is_placeholder(o[-1]) for o in outputs):
            assert self._last is not None
            prev = self._last.token_list()  # the placeholders' tokens, for the penalties' counts
            outputs = [[prev[placeholder_row(t)] if is_placeholder(t) else t for t in o] for o in outputs]
        return self.sampler.sample_rows(logits, prep.requests, prep.params, prep.row_states, outputs)

    @staticmethod
    def written(prep: PreparedStep, block_size: int) -> tuple[set[int], set[int]]:
        """The KV block ids and checkpoint slots a step's forward writes (its tokens' blocks; its
        capture and tracking-copy destinations): what a failed forward leaves unwritten. (Its
        block moves ran before the forward, or the copies raised and the engine stopped.)"""
        blocks = set((prep.buffer.field("slot_mapping") // block_size).tolist())
        slots = set(prep.buffer.field("capture_slots").tolist())
        slots.update(dst for _, dst in prep.out.plan.decode_copies)
        return blocks, slots

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, states: Mapping[str, RequestState]) -> list[int | None]:
        """Run one step synchronously; the sampled token per scheduled seq (None where none is due).
        Log-probabilities (requests that asked) are appended to their state's ``logprobs``."""
        prep = self.prepare(out, states)
        result = self.launch(prep)
        return result.per_seq(prep, states)

    @torch.inference_mode()
    def sample(
        self, logits: torch.Tensor, reqs: list[Request], states: Mapping[str, RequestState]
    ) -> list[int]:
        """One token per row of ``logits`` (row ``i`` belongs to ``reqs[i]``); log-probabilities
        of the requests that asked for them are appended to their state's ``logprobs``."""
        row_states = [states[r.request_id] for r in reqs]
        params = [r.sampling_params for r in reqs]
        outputs = [r.output_token_ids if p.has_penalties else [] for r, p in zip(reqs, params, strict=True)]
        tokens, logprobs = self.sampler.sample_rows(logits, reqs, params, row_states, outputs)
        if logprobs is not None:
            for st, lp in zip(row_states, logprobs, strict=True):
                if lp is not None:
                    st.logprobs.append(lp)
        return tokens.tolist()


def _attach_sampling(prep: PreparedStep, states: Mapping[str, RequestState]) -> None:
    """The general sampler's per-row inputs, unless every row is plain greedy."""
    reqs = prep.requests
    row_states = [states[r.request_id] for r in reqs]
    if all(st.plain_greedy for st in row_states):
        return
    params = [r.sampling_params for r in reqs]
    prep.row_states = row_states
    prep.params = params
    # the output ids penalties count, as they are at prepare (the engine thread may append the
    # next placeholder while this step runs)
    prep.output_ids = [r.output_token_ids if p.has_penalties else [] for r, p in zip(reqs, params)]


def _attach_mask(prep: PreparedStep, states: Mapping[str, RequestState], grammars: Grammars) -> None:
    """The token bitmask of the constrained rows (their matchers' next-token masks); none when
    no row is constrained."""
    rows, matchers = [], []
    for i, r in enumerate(prep.requests):
        m = states[r.request_id].matcher
        if m is not None:
            rows.append(i)
            matchers.append(m)
    if rows:
        prep.token_mask = grammars.allocate(len(prep.requests))
        grammars.fill_masks(matchers, prep.token_mask, rows)
        prep.mask_rows = rows
