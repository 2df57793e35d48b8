"""A miniature model runner for the model tests: builds ``BatchMetadata`` by hand.

It plays the scheduler's part of the contract: decodes first, prefill segments starting on
multiples of 64, KV blocks handed out in a shuffled (non-contiguous) order including block 0,
state slots shuffled, and captures/restores through checkpoint slots.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deltaserve.kernels import Ops
from deltaserve.models import BatchMetadata
from deltaserve.models.decoder import CausalLM

GDN_CHUNK = 64


@dataclass(eq=False)
class Seq:
    tokens: list[int]  # every token this sequence will ever compute (prompt + forced continuation)
    slot: int
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0


@dataclass
class Work:
    seq: Seq
    num_tokens: int


@dataclass
class Capture:
    seq: Seq
    pos: int  # tokens into this step's segment of ``seq``
    slot: int


class PagedRunner:
    def __init__(
        self,
        model: CausalLM,
        *,
        ops: Ops,
        block_size: int = 16,
        num_blocks: int = 96,
        num_live_slots: int = 8,
        num_checkpoint_slots: int = 4,
        seed: int = 0,
        state_fill: float = 0.0,
        kv_fill: float = 0.0,
        with_mtp: bool = False,
    ) -> None:
        self.model = model
        self.ops = ops
        self.block_size = block_size
        self.num_live_slots = num_live_slots
        spec = model.cache_spec(with_mtp=with_mtp)
        self.caches = spec.allocate(num_blocks, block_size, num_live_slots + num_checkpoint_slots, "cpu")
        # NaN fills check that nothing unwritten (or not to be read) is ever read.
        for t in [*self.caches.k_cache, *self.caches.v_cache]:
            t.fill_(kv_fill)
        for t in self.caches.state_tensors():
            t.fill_(state_fill)
        gen = torch.Generator().manual_seed(seed)
        self.free_blocks = torch.randperm(num_blocks, generator=gen).tolist()
        self.free_slots = torch.randperm(num_live_slots, generator=gen).tolist()
        self.checkpoint_slots = list(range(num_live_slots, num_live_slots + num_checkpoint_slots))

    def add(self, tokens: list[int]) -> Seq:
        return Seq(list(tokens), self.free_slots.pop())

    def release(self, seq: Seq) -> None:
        """Finish ``seq``: its live slot (state left dirty) and blocks go back to the pools."""
        self.free_slots.append(seq.slot)
        self.free_blocks += seq.blocks

    def fork(self, src: Seq, upto: int, checkpoint_slot: int, tokens: list[int]) -> Seq:
        """New sequence restored at ``upto`` from ``src``'s KV blocks and a checkpoint slot."""
        assert upto % self.block_size == 0 and upto % GDN_CHUNK == 0
        seq = self.add(tokens)
        seq.blocks = src.blocks[: upto // self.block_size]  # shared full blocks (prefix cache hit)
        seq.num_computed = upto
        if self.model.num_gdn_layers:
            src, dst = torch.tensor([checkpoint_slot]), torch.tensor([seq.slot])
            self.ops.copy_state_slots(self.caches.state_tensors(), src, dst)
        return seq

    def step(self, work: list[Work], captures: list[Capture] = ()) -> list[torch.Tensor]:
        """Run one forward; return, per work item (in the given order), logits of all its tokens."""
        batch, ordered = self.build(work, captures)
        logits = self.model.forward(batch, self.caches)
        assert logits.dtype == torch.float32 and logits.shape[0] == batch.num_tokens
        for w in ordered:
            w.seq.num_computed += w.num_tokens
        return self.split(logits, batch, ordered, work)

    @staticmethod
    def split(
        rows: torch.Tensor, batch: BatchMetadata, ordered: list[Work], work: list[Work]
    ) -> list[torch.Tensor]:
        """Per item of ``work`` (in its order), its rows of ``rows`` (one per token of ``batch``)."""
        cu = batch.cu_seqlens.tolist()
        by_item = {id(w): rows[cu[i] : cu[i + 1]] for i, w in enumerate(ordered)}
        return [by_item[id(w)] for w in work]

    def build(
        self, work: list[Work], captures: list[Capture] = (), *, gdn_chunks: bool = True
    ) -> tuple[BatchMetadata, list[Work]]:
        """The batch for ``work`` (decodes first; blocks allocated as needed) and that order.
        Nothing is computed and ``num_computed`` does not move. ``gdn_chunks=False`` lets a
        multi-token segment start anywhere (a batch for attention only, e.g. the MTP head's)."""
        is_decode = [w.seq.num_computed > 0 and w.num_tokens == 1 for w in work]
        decodes = [w for w, d in zip(work, is_decode) if d]
        ordered = decodes + [w for w, d in zip(work, is_decode) if not d]
        bs = self.block_size
        ids, pos, cu, seq_lens, slot_map, slots, has_init, tables = [], [], [0], [], [], [], [], []
        for i, w in enumerate(ordered):
            s, start = w.seq, w.seq.num_computed
            end = start + w.num_tokens
            assert end <= len(s.tokens)
            if i >= len(decodes) and gdn_chunks:
                assert start % GDN_CHUNK == 0, "prefill segments start on a multiple of 64"
            while len(s.blocks) * bs < end:
                s.blocks.append(self.free_blocks.pop())
            ids += s.tokens[start:end]
            pos += range(start, end)
            cu.append(cu[-1] + w.num_tokens)
            seq_lens.append(end)
            slot_map += [s.blocks[p // bs] * bs + p % bs for p in range(start, end)]
            slots.append(s.slot)
            has_init.append(start > 0)
            tables.append(s.blocks[: -(-end // bs)])
        width = max(len(t) for t in tables)
        index = {id(w.seq): i for i, w in enumerate(ordered)}
        t = lambda x, dtype=torch.int64: torch.tensor(x, dtype=dtype)  # noqa: E731
        batch = BatchMetadata(
            input_ids=t(ids),
            positions=t(pos),
            cu_seqlens=t(cu),
            seq_lens=t(seq_lens),
            block_tables=t([tb + [0] * (width - len(tb)) for tb in tables]).view(len(tables), width),
            slot_mapping=t(slot_map),
            num_decodes=len(decodes),
            state_slots=t(slots),
            has_initial_state=t(has_init, torch.bool),
            capture_seq=t([index[id(c.seq)] for c in captures]),
            capture_pos=t([c.pos for c in captures]),
            capture_slots=t([c.slot for c in captures]),
            logits_indices=torch.arange(len(ids)),
        )
        return batch, ordered
