"""Model runner: the one place a ``SchedulerOutput`` becomes tensors.

It owns the cache tensors (paged KV per attention layer, state slots per GDN layer), builds
``BatchMetadata`` (docs/contracts.md), and runs one step:

1. restore copies (checkpoint slot -> live slot) planned by the cache manager;
2. the model forward (decodes first, then prefill segments; prefill captures are written
   by the kernels straight into their reserved slots);
3. decode-time output tracking copies (live slot -> tracking slot);
4. sampling, only for sequences whose piece reaches the end of their known tokens: raw
   log-probabilities first for requests that asked for them (``SamplingParams.logprobs``),
   then penalties and min-p on the rows that use them (``kernels/sampler.py``), then the
   ``sample`` op.

Only this module (and the models it calls) touch torch on the engine side.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from deltaserve.engine.detokenizer import IncrementalDetokenizer
from deltaserve.engine.host_pool import Failure, HostPool
from deltaserve.engine.outputs import TokenLogprob
from deltaserve.kernels import Ops
from deltaserve.kernels.sampler import apply_min_p, apply_penalties, compute_logprobs
from deltaserve.models import BatchMetadata, CacheSpec, LoadedModel, ModelCaches
from deltaserve.scheduler.request import Request
from deltaserve.scheduler.scheduler import SchedulerOutput


@dataclass(eq=False)
class RequestState:
    """Engine-side state of one request, kept by ``EngineCore.states`` beside the torch-free
    scheduler ``Request`` (created at ``add_request``, dropped when the request ends)."""

    detokenizer: IncrementalDetokenizer
    stop_ids: frozenset[int]  # stop_token_ids, plus the model's EOS ids unless ignore_eos
    generator: torch.Generator | None  # per-request RNG when SamplingParams.seed is set
    # log-probabilities of the tokens sampled since the engine last took them (logprobs requests)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_ids: torch.Tensor | None = None  # the prompt as a tensor, built once (repetition penalty)


@dataclass
class RunnerSizes:
    num_kv_blocks: int
    block_size: int
    num_live_slots: int
    num_checkpoint_slots: int
    num_host_kv_blocks: int = 0
    num_host_checkpoint_slots: int = 0

    @property
    def num_state_slots(self) -> int:
        return self.num_live_slots + self.num_checkpoint_slots


class ModelRunner:
    def __init__(self, loaded: LoadedModel, ops: Ops, sizes: RunnerSizes, device: torch.device) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.ops = ops
        self.sizes = sizes
        self.device = device
        self.spec: CacheSpec = self.model.cache_spec()
        self.caches: ModelCaches = self.spec.allocate(
            sizes.num_kv_blocks,
            sizes.block_size,
            sizes.num_state_slots if self.spec.num_gdn_layers else 0,
            device,
        )
        self.default_generator = torch.Generator(device=device)
        self.host: HostPool | None = None
        if sizes.num_host_kv_blocks or sizes.num_host_checkpoint_slots:
            self.host = HostPool(
                self.spec,
                sizes.num_host_kv_blocks if self.spec.num_attn_layers else 0,
                sizes.block_size,
                sizes.num_host_checkpoint_slots if self.spec.num_gdn_layers else 0,
                device,
            )

    def transfer(self, out: SchedulerOutput) -> list[Failure]:
        """The step's copies between the device and host tiers (before its forward); the
        ones that failed, with their error. Never raises."""
        if self.host is None:
            return []
        return self.host.transfer(out.plan, self.caches)

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

    def _tensor(self, data: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype, device=self.device)

    def build_batch(self, out: SchedulerOutput) -> tuple[BatchMetadata, list[int]]:
        """BatchMetadata for the step, and the scheduled-seq index of each logits row."""
        bs = self.sizes.block_size
        input_ids: list[int] = []
        cu = [0]
        seq_lens: list[int] = []
        state_slots: list[int] = []
        has_init: list[bool] = []
        logits_rows: list[int] = []
        sample_seq: list[int] = []
        tables: list[list[int]] = []
        for i, s in enumerate(out.seqs):
            req = s.request
            assert req.cache is not None
            table = req.cache.block_table
            input_ids.extend(req.token_ids[s.start : s.end])
            cu.append(cu[-1] + s.end - s.start)
            seq_lens.append(s.end)
            state_slots.append(req.cache.state_slot)
            has_init.append(s.start > 0)
            tables.append(table[: -(-s.end // bs)])
            if s.samples:
                logits_rows.append(cu[-1] - 1)
                sample_seq.append(i)
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        block_tables = self._tensor(padded).view(len(tables), width)
        # Positions and flat KV slots of every token, vectorised (no per-token Python):
        # token j of segment b sits at start_b + j, in block block_tables[b, pos // bs].
        cu_t = self._tensor(cu)
        lens = cu_t[1:] - cu_t[:-1]
        seq_index = torch.repeat_interleave(torch.arange(len(tables), device=self.device), lens)
        starts = self._tensor([s.start for s in out.seqs])
        positions = starts[seq_index] + torch.arange(cu[-1], device=self.device) - cu_t[:-1][seq_index]
        slot_mapping = block_tables[seq_index, positions // bs] * bs + positions % bs
        cap_seq = [c.item_index for c in out.plan.captures]
        cap_pos = [c.boundary - out.seqs[c.item_index].start for c in out.plan.captures]
        cap_slot = [c.slot for c in out.plan.captures]
        batch = BatchMetadata(
            input_ids=self._tensor(input_ids),
            positions=positions,
            cu_seqlens=cu_t,
            seq_lens=self._tensor(seq_lens),
            block_tables=block_tables,
            slot_mapping=slot_mapping,
            num_decodes=out.num_decodes,
            state_slots=self._tensor(state_slots),
            has_initial_state=self._tensor(has_init, torch.bool),
            capture_seq=self._tensor(cap_seq),
            capture_pos=self._tensor(cap_pos),
            capture_slots=self._tensor(cap_slot),
            logits_indices=self._tensor(logits_rows),
        )
        return batch, sample_seq

    def _copy_states(self, pairs: list[tuple[int, int]]) -> None:
        if pairs and self.spec.num_gdn_layers:
            src = self._tensor([p[0] for p in pairs])
            dst = self._tensor([p[1] for p in pairs])
            self.ops.copy_state_slots(self.caches.state_tensors(), src, dst)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, states: Mapping[str, RequestState]) -> list[int | None]:
        """Run one step; the sampled token per scheduled seq (None where none is due)."""
        if self.host is not None:
            self.host.wait()  # loads of earlier steps have landed before anything reads them
        batch, sample_seq = self.build_batch(out)
        self._copy_states(out.plan.restores)
        logits = self.model.forward(batch, self.caches)
        self._copy_states(out.plan.decode_copies)
        sampled: list[int | None] = [None] * len(out.seqs)
        if sample_seq:
            reqs = [out.seqs[i].request for i in sample_seq]
            sampled_rows = self.sample(logits, reqs, states)
            for i, t in zip(sample_seq, sampled_rows, strict=True):
                sampled[i] = t
        return sampled

    @torch.inference_mode()
    def sample(
        self, logits: torch.Tensor, reqs: list[Request], states: Mapping[str, RequestState]
    ) -> list[int]:
        """One token per row of ``logits`` (row ``i`` belongs to ``reqs[i]``)."""
        params = [r.sampling_params for r in reqs]
        dev = self.device
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)
        raw = logits
        penalised = [i for i, p in enumerate(params) if p.has_penalties]
        if penalised:
            index = self._tensor(penalised)
            sub = [params[i] for i in penalised]
            need_prompt = any(p.repetition_penalty != 1.0 for p in sub)
            prompts = None
            if need_prompt:
                prompts = []
                for i in penalised:
                    st = states[reqs[i].request_id]
                    if st.prompt_ids is None:
                        st.prompt_ids = self._tensor(reqs[i].prompt_token_ids)
                    prompts.append(st.prompt_ids)
            logits = logits.float().clone()
            logits[index] = apply_penalties(
                logits[index],
                [reqs[i].output_token_ids for i in penalised],
                [p.presence_penalty for p in sub],
                [p.frequency_penalty for p in sub],
                [p.repetition_penalty for p in sub],
                prompts,
            )
        with_min_p = [i for i, p in enumerate(params) if p.min_p > 0.0]
        if with_min_p:
            index = self._tensor(with_min_p)
            if logits is raw:
                logits = logits.float().clone()
            logits[index] = apply_min_p(
                logits[index], [params[i].min_p for i in with_min_p], temperature[index]
            )
        gens = [states[r.request_id].generator or self.default_generator for r in reqs]
        tokens = self.ops.sample(
            logits,
            temperature,
            torch.tensor([p.top_k for p in params], dtype=torch.int64, device=dev),
            torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev),
            gens,
        )
        token_list = [int(t) for t in tokens.tolist()]
        wants = [i for i, p in enumerate(params) if p.logprobs is not None]
        if wants:
            index = self._tensor(wants)
            k = max(params[i].logprobs or 0 for i in wants)
            chosen, rank, top_ids, top_lp = compute_logprobs(raw[index], tokens[index], k)
            chosen_l, rank_l, ids_l, lp_l = chosen.tolist(), rank.tolist(), top_ids.tolist(), top_lp.tolist()
            for j, i in enumerate(wants):
                n_top = params[i].logprobs or 0
                states[reqs[i].request_id].logprobs.append(
                    TokenLogprob(
                        token_id=token_list[i],
                        logprob=chosen_l[j],
                        rank=rank_l[j],
                        top=list(zip(ids_l[j][:n_top], lp_l[j][:n_top], strict=True)),
                    )
                )
        return token_list
