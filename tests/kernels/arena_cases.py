"""Every cache op on the views of a shared arena against the same op on contiguous tensors.

Used by ``test_arena_views.py`` (reference ops, CPU) and ``test_triton_arena_views.py`` (Triton,
interpreter or CUDA). Each case fills an arena (``CacheSpec.allocate_arena``) with random data,
clones every view into a plain contiguous tensor, runs the op on both, and requires the whole
arena to equal, byte for byte, what the plain results give when written back into the pages the
case used: the outputs are bit-identical and nothing outside the op's own rows was written.

Pages: 2 live + 4 pool pages. State slots live in pages 0, 1 (live) and 3 (a checkpoint); KV
blocks in the rows of pages 2, 4 and 5. A page is used as one or the other, as the cache
manager guarantees.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deltaserve.kernels import Ops
from deltaserve.models.batch import CacheSpec, ModelCaches

NUM_LIVE, NUM_POOL = 2, 4
STATE_PAGES = [0, 1, 3]
KV_PAGES = [2, 4, 5]
BLOCK_SIZE = 4


def spec(dtype: torch.dtype) -> CacheSpec:
    """Two attention and two GDN layers; conv rows of 25 channels so the page has padding."""
    return CacheSpec(
        num_attn_layers=2,
        num_kv_heads=2,
        head_dim=16,
        num_gdn_layers=2,
        conv_dim=25,
        conv_kernel=4,
        num_v_heads=2,
        key_head_dim=16,
        value_head_dim=16,
        dtype=dtype,
    )


@dataclass
class Setup:
    spec: CacheSpec
    arena: ModelCaches  # views of one arena
    plain: ModelCaches  # contiguous clones of every view
    before: torch.Tensor  # the arena's bytes before the op
    kv_rows: list[int]  # block ids in KV pages

    def expected(self) -> torch.Tensor:
        """The arena as the plain results say it should be: the KV rows and state pages the
        case uses written back from the plain tensors, every other byte as before."""
        assert self.arena.layout is not None
        exp = self.spec.arena_views(self.before.clone(), self.arena.layout)
        rows = torch.tensor(self.kv_rows, device=self.before.device)
        pages = torch.tensor(STATE_PAGES, device=self.before.device)
        for e, p in zip(exp.k_cache + exp.v_cache, self.plain.k_cache + self.plain.v_cache):
            e[rows] = p[rows]
        for e, p in zip(exp.state_tensors(), self.plain.state_tensors()):
            e[pages] = p[pages]
        assert exp.arena is not None
        return exp.arena

    def check(self) -> None:
        assert self.arena.arena is not None
        got, want = self.arena.arena, self.expected()
        diff = (got != want).nonzero()
        assert diff.numel() == 0, f"{diff.numel()} arena bytes differ, first at {diff[:4].flatten().tolist()}"


def setup(dtype: torch.dtype, device: str, gen: torch.Generator) -> Setup:
    sp = spec(dtype)
    caches = sp.allocate_arena(NUM_LIVE, NUM_POOL, BLOCK_SIZE, device)
    lay = caches.layout
    assert lay is not None and lay.page_blocks >= 3  # room for the block tables below
    kv_rows = [p * lay.page_blocks + i for p in KV_PAGES for i in range(lay.page_blocks)]
    # each page filled as what it is used for (a state page's padding and tail stay zero)
    for t in [*caches.k_cache, *caches.v_cache]:
        t[kv_rows] = torch.randn(len(kv_rows), *t.shape[1:], generator=gen).to(t.device, t.dtype)
    for t in caches.state_tensors():
        t[STATE_PAGES] = torch.randn(len(STATE_PAGES), *t.shape[1:], generator=gen).to(t.device, t.dtype)
    for t in caches.state_tensors():
        assert t.stride(0) * t.element_size() == lay.page_bytes
    for t in caches.k_cache:
        assert t.stride(0) * t.element_size() == lay.block_bytes and not t.is_contiguous()
    plain = ModelCaches(
        k_cache=[t.clone() for t in caches.k_cache],
        v_cache=[t.clone() for t in caches.v_cache],
        conv_state=[t.clone() for t in caches.conv_state],
        ssm_state=[t.clone() for t in caches.ssm_state],
    )
    assert caches.arena is not None
    return Setup(sp, caches, plain, caches.arena.clone(), kv_rows)


def _t(values: list[int], device: str) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def run_attention(ops: Ops, dtype: torch.dtype, device: str, gen: torch.Generator) -> None:
    """store_kv then paged_attention on attention layer 1 (a non-zero offset in the row): two
    decodes, a prefill from scratch, a prefill after a cached prefix."""
    s = setup(dtype, device, gen)
    q_lens, ctx = [1, 1, 6, 4], [3, 7, 6, 11]
    perm = torch.randperm(len(s.kv_rows), generator=gen).tolist()
    free = [s.kv_rows[i] for i in perm]
    tables, slots = [], []
    for q_len, n in zip(q_lens, ctx):
        blocks = [free.pop() for _ in range(-(-n // BLOCK_SIZE))]
        tables.append(blocks + [0] * (3 - len(blocks)))
        slots += [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(n - q_len, n)]
    num_tokens = sum(q_lens)
    q = torch.randn(num_tokens, 4, 16, generator=gen).to(device, dtype)
    key = torch.randn(num_tokens, 2, 16, generator=gen).to(device, dtype)
    value = torch.randn(num_tokens, 2, 16, generator=gen).to(device, dtype)
    cu = _t([0, 1, 2, 8, 12], device)
    outs = []
    for c in (s.arena, s.plain):
        ops.store_kv(key, value, c.k_cache[1], c.v_cache[1], _t(slots, device))
        outs.append(ops.paged_attention(q, c.k_cache[1], c.v_cache[1], _t(sum(tables, []), device).view(4, 3),
                                        cu, _t(ctx, device), 0.25))  # fmt: skip
    assert torch.equal(outs[0], outs[1])
    s.check()


def run_conv(ops: Ops, dtype: torch.dtype, device: str, gen: torch.Generator) -> None:
    """causal_conv1d_varlen (a capture into checkpoint page 3) then causal_conv1d_update, on GDN
    layer 1's conv state."""
    s = setup(dtype, device, gen)
    x = torch.randn(75, 25, generator=gen).to(device, dtype)
    weight = torch.randn(25, 4, generator=gen).to(device, dtype)
    bias = torch.randn(25, generator=gen).to(device, dtype)
    x1 = torch.randn(2, 25, generator=gen).to(device, dtype)
    outs = []
    for c in (s.arena, s.plain):
        y = ops.causal_conv1d_varlen(
            x, weight, bias, _t([0, 70, 75], device), c.conv_state[1], _t([1, 0], device),
            torch.tensor([True, False], device=device), _t([0], device), _t([64], device), _t([3], device),
        )  # fmt: skip
        y1 = ops.causal_conv1d_update(x1, weight, bias, c.conv_state[1], _t([0, 1], device))
        outs.append((y, y1))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    s.check()


def run_gdn(ops: Ops, dtype: torch.dtype, device: str, gen: torch.Generator) -> None:
    """chunk_gated_delta_rule (a capture into checkpoint page 3) then the recurrent decode step,
    on GDN layer 1's recurrent state."""
    s = setup(dtype, device, gen)

    def inputs(n: int) -> tuple[torch.Tensor, ...]:
        q = torch.randn(n, 2, 16, generator=gen).to(device, dtype)
        k = torch.randn(n, 2, 16, generator=gen).to(device, dtype)
        v = torch.randn(n, 2, 16, generator=gen).to(device, dtype)
        g = (-torch.rand(n, 2, generator=gen) * 0.5).to(device)
        beta = torch.rand(n, 2, generator=gen).to(device, dtype)
        return q, k, v, g, beta

    pre, dec = inputs(75), inputs(2)
    outs = []
    for c in (s.arena, s.plain):
        o = ops.chunk_gated_delta_rule(
            *pre, _t([0, 70, 75], device), c.ssm_state[1], _t([1, 0], device),
            torch.tensor([True, False], device=device), _t([0], device), _t([64], device), _t([3], device),
        )  # fmt: skip
        o1 = ops.recurrent_gated_delta_rule(*dec, c.ssm_state[1], _t([0, 1], device))
        outs.append((o, o1))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    s.check()


def run_state_copy(ops: Ops, dtype: torch.dtype, device: str, gen: torch.Generator, whole: bool) -> None:
    """A restore (checkpoint 3 -> live 0) and a capture (live 1 -> checkpoint 3) in one
    simultaneous copy: per layer on the strided views, or (``whole``) as one row per page."""
    s = setup(dtype, device, gen)
    src, dst = [3, 1], [0, 3]
    tensors = s.arena.state_copy_tensors() if whole else s.arena.state_tensors()
    assert len(tensors) == (1 if whole else 4)
    ops.copy_state_slots(tensors, _t(src, device), dst)
    ops.copy_state_slots(s.plain.state_tensors(), _t(src, device), dst)
    s.check()


def run_moves(ops: Ops, dtype: torch.dtype, device: str, gen: torch.Generator) -> None:
    """Block moves as whole arena rows (every layer's K and V at once), a chain and a swap
    among them: a simultaneous copy."""
    s = setup(dtype, device, gen)
    r = s.kv_rows
    src, dst = [r[0], r[1], r[4], r[5], r[7]], [r[1], r[2], r[5], r[4], r[8]]
    ops.copy_state_slots([s.arena.block_rows()], _t(src, device), dst)
    ops.copy_state_slots([*s.plain.k_cache, *s.plain.v_cache], _t(src, device), dst)
    s.check()
