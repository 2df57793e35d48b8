"""Chunked / recurrent GDN reference ops vs an independent token-by-token recurrence (float64).

The oracle below is the definition of the gated delta rule, one token at a time, per sequence:
``S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T;  o = S^T q``.
"""

from __future__ import annotations

import pytest
import torch

from deltaserve.kernels.capture_align import padded_layout
from deltaserve.kernels.gdn import chunk_gated_delta_rule, recurrent_gated_delta_rule

DK, DV = 16, 32
NUM_SLOTS = 48


def _normalize(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x**2).sum(-1, keepdim=True) + 1e-6)


def oracle_recurrence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial: torch.Tensor,
    l2norm: bool = True,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One sequence, float64. Returns outputs [L, Hv, Dv] and the states after 0..L tokens."""
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    num_v_heads, num_k_heads = v.shape[1], q.shape[1]
    group = num_v_heads // num_k_heads
    if l2norm:
        q, k = _normalize(q), _normalize(k)
    q = q / q.shape[-1] ** 0.5
    state = initial.double().clone()
    states = [state.clone()]
    outs = []
    for t in range(q.shape[0]):
        new = torch.empty_like(state)
        out_t = torch.empty(num_v_heads, v.shape[-1], dtype=torch.float64)
        for h in range(num_v_heads):
            kh, qh = k[t, h // group], q[t, h // group]
            s = state[h] * torch.exp(g[t, h])
            s = s + torch.outer(kh, beta[t, h] * (v[t, h] - s.T @ kh))
            new[h] = s
            out_t[h] = s.T @ qh
        state = new
        states.append(state.clone())
        outs.append(out_t)
    out = torch.stack(outs) if outs else torch.empty(0, num_v_heads, v.shape[-1], dtype=torch.float64)
    return out, states


def make_inputs(
    lengths: list[int], num_k_heads: int, num_v_heads: int, gen: torch.Generator, g_scale: float = 0.3
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random q, k, v, g (log-decay <= 0), beta and cu_seqlens for a ragged batch."""
    total = sum(lengths)
    q = torch.randn(total, num_k_heads, DK, generator=gen)
    k = torch.randn(total, num_k_heads, DK, generator=gen)
    v = torch.randn(total, num_v_heads, DV, generator=gen)
    g = -torch.rand(total, num_v_heads, generator=gen) * g_scale
    beta = torch.rand(total, num_v_heads, generator=gen)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.long)
    return q, k, v, g, beta, cu


LENGTHS = [1, 63, 64, 65, 130, 200]


@pytest.mark.parametrize("ratio", [1, 2, 4])
@pytest.mark.parametrize("initial", ["none", "all", "mixed"])
def test_chunked_matches_recurrence_with_captures(ratio: int, initial: str, rng: torch.Generator) -> None:
    num_k_heads = 2 if ratio < 4 else 1
    num_v_heads = num_k_heads * ratio
    q, k, v, g, beta, cu = make_inputs(LENGTHS, num_k_heads, num_v_heads, rng)
    num_seqs = len(LENGTHS)
    has_initial = {
        "none": torch.zeros(num_seqs, dtype=torch.bool),
        "all": torch.ones(num_seqs, dtype=torch.bool),
        "mixed": torch.tensor([True, False, True, False, False, True]),
    }[initial]

    # Non-contiguous, permuted slots; captures go to other distinct slots of the same pool.
    perm = torch.randperm(NUM_SLOTS, generator=rng)
    state_slots = perm[:num_seqs]
    captures = [(b, pos) for b, n in enumerate(LENGTHS) for pos in sorted({*range(64, n + 1, 64), n})]
    captures.append((4, 0))  # "after 0 tokens" is the initial state
    capture_slots = perm[num_seqs : num_seqs + len(captures)]
    ssm = torch.randn(NUM_SLOTS, num_v_heads, DK, DV, generator=rng) * 0.2
    # A slot without an initial state holds garbage that must never be read.
    ssm[state_slots[~has_initial]] = float("nan")
    before = ssm.clone()

    out = chunk_gated_delta_rule(
        q, k, v, g, beta, cu, ssm, state_slots, has_initial,
        capture_seq=torch.tensor([b for b, _ in captures]),
        capture_pos=torch.tensor([p for _, p in captures]),
        capture_slots=capture_slots,
    )  # fmt: skip

    assert out.shape == v.shape and out.dtype == v.dtype
    for b in range(num_seqs):
        s, e = int(cu[b]), int(cu[b + 1])
        init = before[state_slots[b]] if has_initial[b] else torch.zeros(num_v_heads, DK, DV)
        ref_out, ref_states = oracle_recurrence(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], init)
        torch.testing.assert_close(out[s:e].double(), ref_out, atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(ssm[state_slots[b]].double(), ref_states[-1], atol=2e-4, rtol=1e-4)
        for (cb, pos), slot in zip(captures, capture_slots.tolist()):
            if cb == b:
                torch.testing.assert_close(ssm[slot].double(), ref_states[pos], atol=2e-4, rtol=1e-4)

    touched = set(state_slots.tolist()) | set(capture_slots.tolist())
    for slot in range(NUM_SLOTS):
        if slot not in touched:
            assert torch.equal(ssm[slot], before[slot]), f"slot {slot} was modified"


def test_small_chunk_size_and_no_l2norm(rng: torch.Generator) -> None:
    lengths = [5, 16, 33]
    q, k, v, g, beta, cu = make_inputs(lengths, 2, 2, rng)
    q, k = q * 0.3, k * 0.3  # without the L2 norm keep the delta rule contractive
    ssm = torch.randn(8, 2, DK, DV, generator=rng) * 0.1
    before = ssm.clone()
    slots = torch.tensor([6, 1, 3])
    has_initial = torch.tensor([True, True, False])
    out = chunk_gated_delta_rule(
        q, k, v, g, beta, cu, ssm, slots, has_initial,
        capture_seq=torch.tensor([2, 2, 1]), capture_pos=torch.tensor([16, 32, 16]),
        capture_slots=torch.tensor([0, 2, 7]), chunk_size=16, use_qk_l2norm=False,
    )  # fmt: skip
    for b, cap in [(0, []), (1, [(16, 7)]), (2, [(16, 0), (32, 2)])]:
        s, e = int(cu[b]), int(cu[b + 1])
        init = before[slots[b]] if has_initial[b] else torch.zeros(2, DK, DV)
        ref_out, ref_states = oracle_recurrence(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], init, l2norm=False)
        torch.testing.assert_close(out[s:e].double(), ref_out, atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(ssm[slots[b]].double(), ref_states[-1], atol=2e-4, rtol=1e-4)
        for pos, slot in cap:
            torch.testing.assert_close(ssm[slot].double(), ref_states[pos], atol=2e-4, rtol=1e-4)


def test_strong_decay_stays_finite(rng: torch.Generator) -> None:
    # Cumulative log-decay over a chunk reaches ~-3000: exp() underflows, must not overflow/NaN.
    q, k, v, g, beta, cu = make_inputs([150], 1, 2, rng, g_scale=50.0)
    ssm = torch.randn(2, 2, DK, DV, generator=rng)
    init = ssm[1].clone()
    out = chunk_gated_delta_rule(q, k, v, g, beta, cu, ssm, torch.tensor([1]), torch.tensor([True]))
    assert torch.isfinite(out).all() and torch.isfinite(ssm).all()
    ref_out, ref_states = oracle_recurrence(q, k, v, g, beta, init)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(ssm[1].double(), ref_states[-1], atol=2e-4, rtol=1e-4)


def test_bf16_inputs_return_bf16(rng: torch.Generator) -> None:
    q, k, v, g, beta, cu = make_inputs([70], 2, 4, rng)
    ssm = torch.zeros(1, 4, DK, DV)
    out = chunk_gated_delta_rule(
        q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta.bfloat16(), cu, ssm,
        torch.tensor([0]), torch.tensor([False]),
    )  # fmt: skip
    assert out.dtype == torch.bfloat16 and ssm.dtype == torch.float32
    ref_out, _ = oracle_recurrence(
        q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta.bfloat16(), torch.zeros(4, DK, DV)
    )
    torch.testing.assert_close(out.double(), ref_out, atol=3e-2, rtol=3e-2)


def test_zero_length_segment_keeps_or_zeroes_its_state(rng: torch.Generator) -> None:
    q, k, v, g, beta, _ = make_inputs([3], 1, 1, rng)
    cu = torch.tensor([0, 0, 3, 3])
    ssm = torch.randn(4, 1, DK, DV, generator=rng)
    before = ssm.clone()
    chunk_gated_delta_rule(
        q, k, v, g, beta, cu, ssm, torch.tensor([0, 1, 2]), torch.tensor([True, True, False])
    )
    assert torch.equal(ssm[0], before[0])  # state after 0 tokens = its initial state
    assert torch.equal(ssm[2], torch.zeros_like(ssm[2]))  # ... = zeros without one
    assert torch.equal(ssm[3], before[3])


def test_against_transformers_reference(rng: torch.Generator) -> None:
    hf = pytest.importorskip(
        "transformers.models.qwen3_5.modeling_qwen3_5",
        reason="needs a transformers with Qwen3.5 (the reference)",
    )
    q, k, v, g, beta, cu = make_inputs([150], 2, 4, rng)
    init = torch.randn(4, DK, DV, generator=rng) * 0.2
    ssm = torch.zeros(3, 4, DK, DV)
    ssm[2] = init
    out = chunk_gated_delta_rule(q, k, v, g, beta, cu, ssm, torch.tensor([2]), torch.tensor([True]))
    ref_out, ref_state = hf.torch_chunk_gated_delta_rule(
        q[None], k[None], v[None], g[None], beta[None], chunk_size=64,
        initial_state=init[None], output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    torch.testing.assert_close(out, ref_out[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ssm[2], ref_state[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("ratio", [1, 2])
def test_recurrent_decode_continues_prefill(ratio: int, rng: torch.Generator) -> None:
    """Prefill a prefix (chunked), then decode the rest token by token (all sequences at once)."""
    lengths, prefill = [70, 9, 130], [64, 1, 65]
    num_v_heads = 2 * ratio
    q, k, v, g, beta, cu = make_inputs(lengths, 2, num_v_heads, rng)
    slots = torch.tensor([5, 0, 3])

    whole = torch.zeros(6, num_v_heads, DK, DV)
    whole_out = chunk_gated_delta_rule(q, k, v, g, beta, cu, whole, slots, torch.zeros(3, dtype=torch.bool))

    ssm = torch.full((6, num_v_heads, DK, DV), float("nan"))
    pre_index = torch.cat([torch.arange(int(cu[b]), int(cu[b]) + prefill[b]) for b in range(3)])
    pre_cu = torch.tensor([0, *torch.tensor(prefill).cumsum(0).tolist()])
    pre_out = chunk_gated_delta_rule(
        q[pre_index], k[pre_index], v[pre_index], g[pre_index], beta[pre_index], pre_cu, ssm, slots,
        torch.zeros(3, dtype=torch.bool),
    )  # fmt: skip
    torch.testing.assert_close(pre_out, whole_out[pre_index], atol=1e-5, rtol=1e-5)

    for step in range(max(n - p for n, p in zip(lengths, prefill))):
        active = [b for b in range(3) if prefill[b] + step < lengths[b]]
        rows = torch.tensor([int(cu[b]) + prefill[b] + step for b in active])
        out = recurrent_gated_delta_rule(q[rows], k[rows], v[rows], g[rows], beta[rows], ssm, slots[active])
        torch.testing.assert_close(out, whole_out[rows], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(ssm[slots], whole[slots], atol=2e-5, rtol=1e-4)
    assert torch.isnan(ssm[[1, 2, 4]]).all()  # untouched slots


def test_recurrent_matches_oracle_one_step(rng: torch.Generator) -> None:
    q, k, v, g, beta, _ = make_inputs([4], 1, 4, rng)
    ssm = torch.randn(9, 4, DK, DV, generator=rng)
    before = ssm.clone()
    slots = torch.tensor([8, 2, 5, 0])
    out = recurrent_gated_delta_rule(q, k, v, g, beta, ssm, slots)
    for n, slot in enumerate(slots.tolist()):
        ref_out, ref_states = oracle_recurrence(
            q[n : n + 1], k[n : n + 1], v[n : n + 1], g[n : n + 1], beta[n : n + 1], before[slot]
        )
        torch.testing.assert_close(out[n].double(), ref_out[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ssm[slot].double(), ref_states[1], atol=1e-5, rtol=1e-5)
    for slot in (1, 3, 4, 6, 7):
        assert torch.equal(ssm[slot], before[slot])


def test_recurrent_bf16_state_matches_fp32_state(rng: torch.Generator) -> None:
    """A state tensor that is not float32 takes the gathered path: same step, rounded to bf16."""
    q, k, v, g, beta, _ = make_inputs([3], 1, 2, rng)
    ssm32 = torch.randn(5, 2, DK, DV, generator=rng).bfloat16().float()
    ssm16 = ssm32.bfloat16()
    slots = torch.tensor([4, 0, 2])
    out32 = recurrent_gated_delta_rule(q, k, v, g, beta, ssm32, slots)
    out16 = recurrent_gated_delta_rule(q, k, v, g, beta, ssm16, slots)
    torch.testing.assert_close(out16, out32, atol=1e-5, rtol=1e-5)  # same fp32 math on equal inputs
    # the fp32 states agree to rounding; in bf16 they may differ by one ulp (2**-7) at a tie
    torch.testing.assert_close(ssm16.float(), ssm32.bfloat16().float(), atol=1e-6, rtol=2**-7)


@pytest.mark.parametrize(
    ("seq", "pos"),
    [(0, 101), (0, -1), (1, 64), (2, 0)],
)
def test_invalid_capture_rejected(seq: int, pos: int, rng: torch.Generator) -> None:
    q, k, v, g, beta, cu = make_inputs([100], 1, 1, rng)
    ssm = torch.zeros(3, 1, DK, DV)
    if seq == 2:  # only partly given
        with pytest.raises(ValueError):
            chunk_gated_delta_rule(
                q, k, v, g, beta, cu, ssm, torch.tensor([0]), torch.tensor([False]),
                capture_seq=torch.tensor([0]), capture_pos=torch.tensor([pos]),
            )  # fmt: skip
        return
    with pytest.raises(ValueError):
        chunk_gated_delta_rule(
            q, k, v, g, beta, cu, ssm, torch.tensor([0]), torch.tensor([False]),
            capture_seq=torch.tensor([seq]), capture_pos=torch.tensor([pos]), capture_slots=torch.tensor([1]),
        )  # fmt: skip


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_captures_off_the_chunk_grid(chunk_size: int, rng: torch.Generator) -> None:
    """Captures at any token (block boundaries, odd points, on-grid points after an off-grid one
    in the same segment, the end) match the recurrence, and so do outputs and final states."""
    lengths = [7, 100, 200, 64, 33]
    q, k, v, g, beta, cu = make_inputs(lengths, 1, 2, rng)
    captures = [(0, 3), (0, 7), (1, 1), (1, 17), (1, 64), (1, 80), (1, 99), (2, 0), (2, 16), (2, 48),
                (2, 64), (2, 150), (2, 199), (2, 200), (3, 32), (1, 17)]  # fmt: skip
    num_seqs = len(lengths)
    ssm = torch.randn(num_seqs + len(captures), 2, DK, DV, generator=rng) * 0.2
    before = ssm.clone()
    slots = torch.arange(num_seqs)
    has_initial = torch.tensor([True, False, True, False, True])
    capture_slots = torch.arange(num_seqs, num_seqs + len(captures))
    out = chunk_gated_delta_rule(
        q, k, v, g, beta, cu, ssm, slots, has_initial,
        capture_seq=torch.tensor([b for b, _ in captures]), capture_pos=torch.tensor([p for _, p in captures]),
        capture_slots=capture_slots, chunk_size=chunk_size,
    )  # fmt: skip
    assert out.shape == v.shape
    for b in range(num_seqs):
        s, e = int(cu[b]), int(cu[b + 1])
        init = before[slots[b]] if has_initial[b] else torch.zeros(2, DK, DV)
        ref_out, ref_states = oracle_recurrence(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], init)
        torch.testing.assert_close(out[s:e].double(), ref_out, atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(ssm[slots[b]].double(), ref_states[-1], atol=2e-4, rtol=1e-4)
        for (cb, pos), slot in zip(captures, capture_slots.tolist()):
            if cb == b:
                torch.testing.assert_close(ssm[slot].double(), ref_states[pos], atol=2e-4, rtol=1e-4)


def test_padded_layout_moves_only_segments_with_off_grid_captures() -> None:
    cu = torch.tensor([0, 10, 40, 50])
    assert padded_layout(cu, torch.tensor([1, 2]), torch.tensor([16, 10]), 16) is None
    layout = padded_layout(cu, torch.tensor([1, 1, 2]), torch.tensor([8, 16, 10]), 16)
    assert layout is not None
    # segment 1 (30 tokens): 8 real, 8 no-ops, 8 real (its old 16 is now 24: padded to 32), 8 no-ops, 14 real
    assert layout.cu_seqlens.tolist() == [0, 10, 56, 66]
    assert layout.capture_pos.tolist() == [16, 32, 10]
    no_op = 50
    assert layout.src[10:56].tolist() == [
        *range(10, 18),
        *[no_op] * 8,
        *range(18, 26),
        *[no_op] * 8,
        *range(26, 40),
    ]
    assert layout.keep.tolist() == [*range(10), *range(10, 18), *range(26, 34), *range(42, 66)]
    with pytest.raises(ValueError, match="capture_pos 31 of segment 1 outside 0..30"):
        padded_layout(cu, torch.tensor([1]), torch.tensor([31]), 16)


def test_batch_of_short_segments(rng: torch.Generator) -> None:
    # Every segment fits in one chunk (the kernel may pad less than chunk_size then).
    lengths = [1, 5, 2, 1]
    q, k, v, g, beta, cu = make_inputs(lengths, 1, 2, rng)
    ssm = torch.randn(5, 2, DK, DV, generator=rng) * 0.2
    before = ssm.clone()
    slots = torch.tensor([3, 0, 2, 1])
    has_initial = torch.tensor([True, False, True, True])
    out = chunk_gated_delta_rule(
        q, k, v, g, beta, cu, ssm, slots, has_initial,
        capture_seq=torch.tensor([1]), capture_pos=torch.tensor([5]), capture_slots=torch.tensor([4]),
    )  # fmt: skip
    for b in range(4):
        s, e = int(cu[b]), int(cu[b + 1])
        init = before[slots[b]] if has_initial[b] else torch.zeros(2, DK, DV)
        ref_out, ref_states = oracle_recurrence(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], init)
        torch.testing.assert_close(out[s:e].double(), ref_out, atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(ssm[slots[b]].double(), ref_states[-1], atol=2e-4, rtol=1e-4)
        if b == 1:
            torch.testing.assert_close(ssm[4].double(), ref_states[5], atol=2e-4, rtol=1e-4)


def test_non_positive_chunk_size_is_refused_before_captures_are_aligned(rng: torch.Generator) -> None:
    # The check runs before capture_align pads an off-grid capture (which divides by chunk_size).
    q, k, v, g, beta, cu = make_inputs([5], 1, 1, rng)
    ssm = torch.zeros(3, 1, DK, DV)
    one = torch.tensor([0])
    with pytest.raises(ValueError, match="chunk_size must be positive"):
        chunk_gated_delta_rule(
            q, k, v, g, beta, cu, ssm, one, torch.tensor([False]),
            capture_seq=one, capture_pos=torch.tensor([3]), capture_slots=torch.tensor([2]), chunk_size=0,
        )  # fmt: skip
