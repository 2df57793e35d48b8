"""Triton GDN kernels vs the PyTorch reference ops (which test_gdn.py checks against the recurrence).

Runs under ``TRITON_INTERPRET=1`` on the CPU (CI: ``TRITON_INTERPRET=1 pytest -q -m interpret
tests/kernels``) or on a CUDA device; skipped otherwise. Small shapes (Dk=16, Dv=32, a few heads).

Tolerances: fp32 outputs and states ``atol=1e-4, rtol=1e-4`` (the two chunked algorithms agree to
~1e-6; the margin covers GPU accumulation order); bf16 outputs ``atol=rtol=2e-2`` (one to two
bf16 ulps at |o| ~ 1).
"""

from __future__ import annotations

import pytest
import torch

from deltaserve.kernels import Ops, get_ops
from deltaserve.kernels.gdn import chunk_gated_delta_rule as ref_chunk
from deltaserve.kernels.gdn import recurrent_gated_delta_rule as ref_recurrent
from tests.kernels.triton_env import DEVICE, TRITON_MARKS

pytestmark = TRITON_MARKS
FP32 = {"atol": 1e-4, "rtol": 1e-4}
BF16 = {"atol": 2e-2, "rtol": 2e-2}
DK, DV = 16, 32


@pytest.fixture(scope="module")
def tops() -> Ops:
    return get_ops("triton", DEVICE)


def make_inputs(
    lengths: list[int],
    num_k_heads: int,
    num_v_heads: int,
    gen: torch.Generator,
    dk: int = DK,
    dv: int = DV,
    g_scale: float = 0.3,
) -> tuple[torch.Tensor, ...]:
    total = sum(lengths)
    q = torch.randn(total, num_k_heads, dk, generator=gen)
    k = torch.randn(total, num_k_heads, dk, generator=gen)
    v = torch.randn(total, num_v_heads, dv, generator=gen)
    g = -torch.rand(total, num_v_heads, generator=gen) * g_scale
    beta = torch.rand(total, num_v_heads, generator=gen)
    cu = torch.tensor([0, *torch.tensor(lengths, dtype=torch.long).cumsum(0).tolist()], dtype=torch.long)
    return tuple(x.to(DEVICE) for x in (q, k, v, g, beta, cu))


def every_boundary(lengths: list[int], chunk_size: int) -> list[tuple[int, int]]:
    """(segment, pos) for every chunk boundary of every segment, its end, and 0."""
    caps = [
        (b, pos)
        for b, n in enumerate(lengths)
        for pos in sorted({0, *range(chunk_size, n + 1, chunk_size), n})
    ]
    return caps


def run_both(
    tops: Ops,
    inputs: tuple[torch.Tensor, ...],
    ssm: torch.Tensor,
    slots: torch.Tensor,
    has_initial: torch.Tensor,
    captures: list[tuple[int, int]] | None = None,
    capture_slots: list[int] | None = None,
    **kw: object,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v, g, beta, cu = inputs
    cap = {}
    if captures:
        cap = {
            "capture_seq": torch.tensor([c[0] for c in captures], device=DEVICE),
            "capture_pos": torch.tensor([c[1] for c in captures], device=DEVICE),
            "capture_slots": torch.tensor(capture_slots, device=DEVICE),
        }
    ssm_ref, ssm_tri = ssm.clone(), ssm.clone()
    out_ref = ref_chunk(q, k, v, g, beta, cu, ssm_ref, slots, has_initial, **cap, **kw)
    out_tri = tops.chunk_gated_delta_rule(q, k, v, g, beta, cu, ssm_tri, slots, has_initial, **cap, **kw)
    return out_ref, out_tri, ssm_ref, ssm_tri


def assert_states_equal(ssm_ref: torch.Tensor, ssm_tri: torch.Tensor, **tol: float) -> None:
    # Slots the op must not touch keep their (possibly NaN) garbage bit for bit in both.
    torch.testing.assert_close(ssm_tri, ssm_ref, equal_nan=True, **(tol or FP32))


# Ragged: a 1-token and an empty segment, chunk boundaries -1/0/+1, two full chunks + 1.
LENGTHS = [1, 0, 63, 64, 65, 129, 3]


@pytest.mark.parametrize(
    ("ratio", "initial"), [(1, "mixed"), (2, "mixed"), (4, "mixed"), (1, "none"), (2, "all")]
)
def test_chunked_matches_reference_with_captures(
    tops: Ops, ratio: int, initial: str, rng: torch.Generator
) -> None:
    num_k_heads = 2 if ratio < 4 else 1
    num_v_heads = num_k_heads * ratio
    inputs = make_inputs(LENGTHS, num_k_heads, num_v_heads, rng)
    num_seqs = len(LENGTHS)
    has_initial = {
        "none": torch.zeros(num_seqs, dtype=torch.bool),
        "all": torch.ones(num_seqs, dtype=torch.bool),
        "mixed": torch.tensor([True, False, True, False, True, False, True]),
    }[initial].to(DEVICE)
    captures = every_boundary(LENGTHS, 64)
    num_slots = num_seqs + len(captures) + 4
    perm = torch.randperm(num_slots, generator=rng)
    slots = perm[:num_seqs].to(DEVICE)
    capture_slots = perm[num_seqs : num_seqs + len(captures)].tolist()
    ssm = (torch.randn(num_slots, num_v_heads, DK, DV, generator=rng) * 0.2).to(DEVICE)
    ssm[slots[~has_initial]] = float("nan")  # never read

    out_ref, out_tri, ssm_ref, ssm_tri = run_both(
        tops, inputs, ssm, slots, has_initial, captures, capture_slots
    )
    assert out_tri.shape == out_ref.shape and out_tri.dtype == out_ref.dtype
    torch.testing.assert_close(out_tri, out_ref, **FP32)
    assert_states_equal(ssm_ref, ssm_tri)
    untouched = sorted(set(range(num_slots)) - set(slots.tolist()) - set(capture_slots))
    assert torch.equal(ssm_tri[untouched], ssm[untouched])


@pytest.mark.parametrize("use_l2", [False, True])
def test_chunk_size_16_every_boundary(tops: Ops, use_l2: bool, rng: torch.Generator) -> None:
    lengths = [5, 16, 33, 0, 48, 1]
    q, k, v, g, beta, cu = make_inputs(lengths, 2, 2, rng, dk=16, dv=16)
    if not use_l2:
        q, k = q * 0.3, k * 0.3  # keep the un-normalised delta rule contractive
    captures = every_boundary(lengths, 16)
    num_slots = len(lengths) + len(captures)
    slots = torch.arange(len(lengths), device=DEVICE).flip(0)
    has_initial = torch.tensor([True, True, False, True, False, True], device=DEVICE)
    ssm = (torch.randn(num_slots, 2, 16, 16, generator=rng) * 0.1).to(DEVICE)
    capture_slots = list(range(len(lengths), num_slots))
    out_ref, out_tri, ssm_ref, ssm_tri = run_both(
        tops, (q, k, v, g, beta, cu), ssm, slots, has_initial, captures, capture_slots,
        chunk_size=16, use_qk_l2norm=use_l2,
    )  # fmt: skip
    torch.testing.assert_close(out_tri, out_ref, **FP32)
    assert_states_equal(ssm_ref, ssm_tri)


def test_odd_head_dims_and_odd_chunk_size(tops: Ops, rng: torch.Generator) -> None:
    # Dk=24, Dv=40 (masked tails of the power-of-two tiles), chunk_size=20 (not a power of two).
    lengths = [41, 20, 7]
    inputs = make_inputs(lengths, 1, 2, rng, dk=24, dv=40)
    ssm = (torch.randn(6, 2, 24, 40, generator=rng) * 0.2).to(DEVICE)
    slots = torch.tensor([4, 0, 2], device=DEVICE)
    has_initial = torch.tensor([True, False, True], device=DEVICE)
    out_ref, out_tri, ssm_ref, ssm_tri = run_both(
        tops, inputs, ssm, slots, has_initial, [(0, 20), (0, 40), (0, 41)], [1, 3, 5], chunk_size=20
    )
    torch.testing.assert_close(out_tri, out_ref, **FP32)
    assert_states_equal(ssm_ref, ssm_tri)


def test_duplicate_captures_of_one_boundary(tops: Ops, rng: torch.Generator) -> None:
    inputs = make_inputs([70], 1, 2, rng)
    ssm = (torch.randn(6, 2, DK, DV, generator=rng) * 0.2).to(DEVICE)
    captures = [(0, 64), (0, 64), (0, 70), (0, 0), (0, 0)]
    out_ref, out_tri, ssm_ref, ssm_tri = run_both(
        tops,
        inputs,
        ssm,
        torch.tensor([5], device=DEVICE),
        torch.tensor([True], device=DEVICE),
        captures,
        [0, 1, 2, 3, 4],
    )
    torch.testing.assert_close(out_tri, out_ref, **FP32)
    assert_states_equal(ssm_ref, ssm_tri)


def test_strong_decay_stays_finite(tops: Ops, rng: torch.Generator) -> None:
    inputs = make_inputs([150], 1, 2, rng, g_scale=50.0)  # cumulative log-decay ~ -3000 in a chunk
    ssm = torch.randn(2, 2, DK, DV, generator=rng).to(DEVICE)
    out_ref, out_tri, ssm_ref, ssm_tri = run_both(
        tops, inputs, ssm, torch.tensor([1], device=DEVICE), torch.tensor([True], device=DEVICE)
    )
    assert torch.isfinite(out_tri).all() and torch.isfinite(ssm_tri).all()
    torch.testing.assert_close(out_tri, out_ref, **FP32)
    assert_states_equal(ssm_ref, ssm_tri)


def test_short_segments_batch(tops: Ops, rng: torch.Generator) -> None:
    # Every segment fits in one chunk (narrow tile); captures at the segment ends.
    lengths = [1, 5, 2, 1]
    inputs = make_inputs(lengths, 1, 2, rng)
    ssm = (torch.randn(8, 2, DK, DV, generator=rng) * 0.2).to(DEVICE)
    slots = torch.tensor([3, 0, 2, 1], device=DEVICE)
    has_initial = torch.tensor([True, False, True, True], device=DEVICE)
    out_ref, out_tri, ssm_ref, ssm_tri = run_both(
        tops, inputs, ssm, slots, has_initial, [(1, 5), (3, 1), (0, 0)], [4, 5, 6]
    )
    torch.testing.assert_close(out_tri, out_ref, **FP32)
    assert_states_equal(ssm_ref, ssm_tri)


def test_strided_views_and_bf16(tops: Ops, rng: torch.Generator) -> None:
    """q/k/v as the model passes them (column slices of one projection), bf16, bf16 beta."""
    lengths = [66, 9]
    hk, hv = 2, 4
    total = sum(lengths)
    mixed = torch.randn(total, 2 * hk * DK + hv * DV, generator=rng).to(DEVICE, torch.bfloat16)
    q, k, v = torch.split(mixed, [hk * DK, hk * DK, hv * DV], dim=-1)
    q, k, v = q.reshape(total, hk, DK), k.reshape(total, hk, DK), v.reshape(total, hv, DV)
    assert not q.is_contiguous()
    g = (-torch.rand(total, hv, generator=rng) * 0.3).to(DEVICE)
    beta = torch.rand(total, hv, generator=rng).to(DEVICE, torch.bfloat16)
    cu = torch.tensor([0, 66, total], device=DEVICE)
    ssm = (torch.randn(3, hv, DK, DV, generator=rng) * 0.2).to(DEVICE)
    out_ref, out_tri, ssm_ref, ssm_tri = run_both(
        tops, (q, k, v, g, beta, cu), ssm, torch.tensor([2, 0], device=DEVICE),
        torch.tensor([False, True], device=DEVICE), [(0, 64)], [1],
    )  # fmt: skip
    assert out_tri.dtype == torch.bfloat16 and ssm_tri.dtype == torch.float32
    torch.testing.assert_close(out_tri.float(), out_ref.float(), **BF16)
    assert_states_equal(ssm_ref, ssm_tri, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("seq", "pos"), [(0, 101), (0, -1), (1, 64), (2, 0)])  # (any 0..100 is valid)
def test_invalid_capture_rejected(tops: Ops, seq: int, pos: int, rng: torch.Generator) -> None:
    q, k, v, g, beta, cu = make_inputs([100], 1, 1, rng)
    ssm = torch.zeros(3, 1, DK, DV, device=DEVICE)
    slots, init = torch.tensor([0], device=DEVICE), torch.tensor([False], device=DEVICE)
    cap = {"capture_seq": torch.tensor([seq]), "capture_pos": torch.tensor([pos])}
    if seq != 2:
        cap["capture_slots"] = torch.tensor([1])
    with pytest.raises(ValueError):
        tops.chunk_gated_delta_rule(q, k, v, g, beta, cu, ssm, slots, init, **cap)


@pytest.mark.parametrize(("ratio", "dk", "dv"), [(1, DK, DV), (2, DK, DV), (4, DK, DV), (2, 24, 40)])
def test_recurrent_matches_reference(tops: Ops, ratio: int, dk: int, dv: int, rng: torch.Generator) -> None:
    num_k_heads = 2 if ratio < 4 else 1
    num_v_heads = num_k_heads * ratio
    q, k, v, g, beta, _ = make_inputs([5], num_k_heads, num_v_heads, rng, dk=dk, dv=dv)
    ssm = torch.randn(9, num_v_heads, dk, dv, generator=rng).to(DEVICE)
    slots = torch.tensor([8, 2, 5, 0, 6], device=DEVICE)
    ssm_ref, ssm_tri = ssm.clone(), ssm.clone()
    out_ref = ref_recurrent(q, k, v, g, beta, ssm_ref, slots)
    out_tri = tops.recurrent_gated_delta_rule(q, k, v, g, beta, ssm_tri, slots)
    torch.testing.assert_close(out_tri, out_ref, **FP32)
    torch.testing.assert_close(ssm_tri, ssm_ref, **FP32)
    for use_l2 in (False,):
        out_ref = ref_recurrent(q * 0.3, k * 0.3, v, g, beta, ssm_ref, slots, use_qk_l2norm=use_l2)
        out_tri = tops.recurrent_gated_delta_rule(
            q * 0.3, k * 0.3, v, g, beta, ssm_tri, slots, use_qk_l2norm=use_l2
        )
        torch.testing.assert_close(out_tri, out_ref, **FP32)
        torch.testing.assert_close(ssm_tri, ssm_ref, **FP32)


def test_recurrent_bf16(tops: Ops, rng: torch.Generator) -> None:
    q, k, v, g, beta, _ = make_inputs([3], 1, 2, rng)
    q, k, v, beta = q.bfloat16(), k.bfloat16(), v.bfloat16(), beta.bfloat16()
    ssm = torch.randn(4, 2, DK, DV, generator=rng).to(DEVICE)
    slots = torch.tensor([3, 1, 0], device=DEVICE)
    ssm_ref, ssm_tri = ssm.clone(), ssm.clone()
    out_ref = ref_recurrent(q, k, v, g, beta, ssm_ref, slots)
    out_tri = tops.recurrent_gated_delta_rule(q, k, v, g, beta, ssm_tri, slots)
    assert out_tri.dtype == torch.bfloat16
    torch.testing.assert_close(out_tri.float(), out_ref.float(), **BF16)
    torch.testing.assert_close(ssm_tri, ssm_ref, **FP32)


def test_decode_continues_chunked_prefill(tops: Ops, rng: torch.Generator) -> None:
    """Triton prefill of a prefix, then Triton decode steps == the reference on the whole sequence."""
    lengths, prefill = [68, 9, 66], [64, 1, 65]
    q, k, v, g, beta, cu = make_inputs(lengths, 1, 2, rng)
    slots = torch.tensor([5, 0, 3], device=DEVICE)
    fresh = torch.zeros(3, dtype=torch.bool, device=DEVICE)
    whole = torch.zeros(6, 2, DK, DV, device=DEVICE)
    whole_out = ref_chunk(q, k, v, g, beta, cu, whole, slots, fresh)

    ssm = torch.full((6, 2, DK, DV), float("nan"), device=DEVICE)
    pre = torch.cat([torch.arange(int(cu[b]), int(cu[b]) + prefill[b]) for b in range(3)]).to(DEVICE)
    pre_cu = torch.tensor([0, *torch.tensor(prefill).cumsum(0).tolist()], device=DEVICE)
    pre_out = tops.chunk_gated_delta_rule(
        q[pre], k[pre], v[pre], g[pre], beta[pre], pre_cu, ssm, slots, fresh
    )
    torch.testing.assert_close(pre_out, whole_out[pre], **FP32)
    for step in range(max(n - p for n, p in zip(lengths, prefill))):
        active = [b for b in range(3) if prefill[b] + step < lengths[b]]
        rows = torch.tensor([int(cu[b]) + prefill[b] + step for b in active], device=DEVICE)
        out = tops.recurrent_gated_delta_rule(
            q[rows], k[rows], v[rows], g[rows], beta[rows], ssm, slots[active]
        )
        torch.testing.assert_close(out, whole_out[rows], **FP32)
    torch.testing.assert_close(ssm[slots], whole[slots], **FP32)
    assert torch.isnan(ssm[[1, 2, 4]]).all()


@pytest.mark.parametrize("seed", range(4))
def test_random_ragged_batches(tops: Ops, seed: int) -> None:
    """Seeded random batches: lengths 0..140, GQA 1/2/4, chunk 16 or 64, random captures."""
    gen = torch.Generator().manual_seed(100 + seed)

    def randint(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    chunk_size = [16, 64][seed % 2]
    ratio = [1, 2, 4][seed % 3]
    num_k_heads = randint(1, 2)
    lengths = [randint(0, 140) for _ in range(randint(1, 4))]
    inputs = make_inputs(lengths, num_k_heads, num_k_heads * ratio, gen)
    valid = [(b, p) for b, n in enumerate(lengths) for p in sorted({*range(0, n + 1, chunk_size), n})]
    captures = [c for c in valid if torch.rand(1, generator=gen).item() < 0.4]
    num_slots = len(lengths) + len(captures)
    perm = torch.randperm(num_slots, generator=gen)
    slots = perm[: len(lengths)].to(DEVICE)
    has_initial = (torch.rand(len(lengths), generator=gen) < 0.5).to(DEVICE)
    ssm = (torch.randn(num_slots, num_k_heads * ratio, DK, DV, generator=gen) * 0.2).to(DEVICE)
    out_ref, out_tri, ssm_ref, ssm_tri = run_both(
        tops, inputs, ssm, slots, has_initial, captures, perm[len(lengths) :].tolist(), chunk_size=chunk_size
    )
    torch.testing.assert_close(out_tri, out_ref, **FP32)
    assert_states_equal(ssm_ref, ssm_tri)


def test_captures_off_the_chunk_grid(tops: Ops, rng: torch.Generator) -> None:
    # Block-boundary captures between chunk boundaries (padded onto the grid for both backends),
    # an on-grid capture after an off-grid one in the same segment, and duplicates.
    lengths = [40, 70, 9]
    inputs = make_inputs(lengths, 1, 2, rng)
    captures = [(0, 16), (0, 32), (1, 16), (1, 64), (1, 69), (1, 16), (2, 4)]
    num_slots = len(lengths) + len(captures)
    ssm = (torch.randn(num_slots, 2, DK, DV, generator=rng) * 0.2).to(DEVICE)
    slots = torch.arange(len(lengths), device=DEVICE)
    has_initial = torch.tensor([True, False, True], device=DEVICE)
    out_ref, out_tri, ssm_ref, ssm_tri = run_both(
        tops, inputs, ssm, slots, has_initial, captures, list(range(len(lengths), num_slots))
    )
    torch.testing.assert_close(out_tri, out_ref, **FP32)
    assert_states_equal(ssm_ref, ssm_tri)


def test_bf16_state_prefill_captures_and_decode(tops: Ops, rng: torch.Generator) -> None:
    """A bfloat16 state tensor (``model.ssm_state_dtype``): both ops read it into float32, compute
    in float32 and round only where they store (final states, captures) — as the reference does."""
    lengths = [70, 9, 64]
    inputs = make_inputs(lengths, 1, 2, rng)
    ssm = torch.randn(8, 2, DK, DV, generator=rng).to(DEVICE, torch.bfloat16)
    slots = torch.tensor([5, 0, 3], device=DEVICE)
    has_initial = torch.tensor([True, False, True], device=DEVICE)
    caps = [(0, 64), (2, 32), (2, 64)]
    out_ref, out_tri, ssm_ref, ssm_tri = run_both(tops, inputs, ssm, slots, has_initial, caps, [1, 2, 4])
    assert ssm_tri.dtype == torch.bfloat16
    torch.testing.assert_close(out_tri, out_ref, **FP32)
    # one bf16 ulp where the float32 values round differently between the two algorithms
    torch.testing.assert_close(ssm_tri.float(), ssm_ref.float(), **BF16)
    assert torch.equal(ssm_tri[[6, 7]], ssm[[6, 7]])  # untouched slots: bit for bit
    q, k, v, g, beta, _ = make_inputs([3], 1, 2, rng)
    out_ref = ref_recurrent(q, k, v, g, beta, ssm_ref, slots)
    out_tri = tops.recurrent_gated_delta_rule(q, k, v, g, beta, ssm_tri, slots)
    torch.testing.assert_close(out_tri, out_ref, **BF16)
    torch.testing.assert_close(ssm_tri.float(), ssm_ref.float(), **BF16)
