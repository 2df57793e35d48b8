"""Property tests (hypothesis): random ragged batches, slots and captures vs the naive oracles."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deltaserve.kernels.conv1d import causal_conv1d_varlen
from deltaserve.kernels.gdn import chunk_gated_delta_rule
from tests.kernels.test_conv1d import oracle_conv
from tests.kernels.test_gdn import DK, DV, oracle_recurrence

CHUNK = 8  # small chunk so short random segments still span several chunks


@st.composite
def ragged_batches(draw: st.DrawFn, max_len: int) -> tuple[list[int], list[bool], list[tuple[int, int]], int]:
    lengths = draw(st.lists(st.integers(0, max_len), min_size=1, max_size=5))
    has_initial = draw(st.lists(st.booleans(), min_size=len(lengths), max_size=len(lengths)))
    # any position: off the chunk grid the op pads the segment (kernels/capture_align.py)
    points = [(b, p) for b, n in enumerate(lengths) for p in range(n + 1)]
    captures = draw(st.lists(st.sampled_from(points), max_size=6, unique=True))
    seed = draw(st.integers(0, 2**16))
    return lengths, has_initial, captures, seed


@settings(max_examples=25, deadline=None)
@given(ragged_batches(max_len=30))
def test_gdn_random_batches(batch: tuple[list[int], list[bool], list[tuple[int, int]], int]) -> None:
    lengths, has_initial, captures, seed = batch
    gen = torch.Generator().manual_seed(seed)
    num_seqs, total = len(lengths), sum(lengths)
    q, k = torch.randn(total, 1, DK, generator=gen), torch.randn(total, 1, DK, generator=gen)
    v = torch.randn(total, 2, DV, generator=gen)
    g, beta = -torch.rand(total, 2, generator=gen), torch.rand(total, 2, generator=gen)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    perm = torch.randperm(num_seqs + len(captures) + 2, generator=gen)
    slots, capture_slots = perm[:num_seqs], perm[num_seqs : num_seqs + len(captures)]
    ssm = torch.randn(len(perm), 2, DK, DV, generator=gen) * 0.2
    before = ssm.clone()
    out = chunk_gated_delta_rule(
        q, k, v, g, beta, cu, ssm, slots, torch.tensor(has_initial),
        capture_seq=torch.tensor([b for b, _ in captures], dtype=torch.long),
        capture_pos=torch.tensor([p for _, p in captures], dtype=torch.long),
        capture_slots=capture_slots, chunk_size=CHUNK,
    )  # fmt: skip
    for b in range(num_seqs):
        s, e = int(cu[b]), int(cu[b + 1])
        init = before[slots[b]] if has_initial[b] else torch.zeros(2, DK, DV)
        ref_out, ref_states = oracle_recurrence(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], init)
        torch.testing.assert_close(out[s:e].double(), ref_out, atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(ssm[slots[b]].double(), ref_states[-1], atol=2e-4, rtol=1e-4)
        for (cb, pos), slot in zip(captures, capture_slots.tolist()):
            if cb == b:
                torch.testing.assert_close(ssm[slot].double(), ref_states[pos], atol=2e-4, rtol=1e-4)


@settings(max_examples=25, deadline=None)
@given(ragged_batches(max_len=12))
def test_conv_random_batches(batch: tuple[list[int], list[bool], list[tuple[int, int]], int]) -> None:
    lengths, has_initial, captures, seed = batch
    gen = torch.Generator().manual_seed(seed)
    channels, kernel = 5, 4
    x = torch.randn(sum(lengths), channels, generator=gen)
    weight = torch.randn(channels, kernel, generator=gen)
    bias = torch.randn(channels, generator=gen)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    perm = torch.randperm(len(lengths) + len(captures) + 2, generator=gen)
    slots, capture_slots = perm[: len(lengths)], perm[len(lengths) : len(lengths) + len(captures)]
    conv_state = torch.randn(len(perm), channels, kernel - 1, generator=gen)
    before = conv_state.clone()
    y = causal_conv1d_varlen(
        x, weight, bias, cu, conv_state, slots, torch.tensor(has_initial),
        capture_seq=torch.tensor([b for b, _ in captures], dtype=torch.long),
        capture_pos=torch.tensor([p for _, p in captures], dtype=torch.long),
        capture_slots=capture_slots,
    )  # fmt: skip
    for b in range(len(lengths)):
        s, e = int(cu[b]), int(cu[b + 1])
        init = before[slots[b]] if has_initial[b] else torch.zeros(channels, kernel - 1)
        ref_y, ext = oracle_conv(x[s:e], weight, bias, init, silu=True)
        torch.testing.assert_close(y[s:e].double(), ref_y, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(conv_state[slots[b]].double(), ext[:, e - s : e - s + kernel - 1])
        for (cb, pos), slot in zip(captures, capture_slots.tolist()):
            if cb == b:
                torch.testing.assert_close(conv_state[slot].double(), ext[:, pos : pos + kernel - 1])
