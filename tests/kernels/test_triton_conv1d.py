"""Triton causal conv1d kernels vs the PyTorch reference ops (which test_conv1d.py checks directly).

Runs under ``TRITON_INTERPRET=1`` on the CPU or on a CUDA device; skipped otherwise.
Tolerances: fp32 ``atol=rtol=1e-5`` (same products, different summation order); conv states are
copies of inputs, so they must match exactly (``torch.equal``, NaN garbage included); bf16 outputs
``atol=rtol=1e-2`` (one bf16 ulp).
"""

from __future__ import annotations

import pytest
import torch

from deltaserve.kernels import Ops, get_ops
from deltaserve.kernels.conv1d import causal_conv1d_update as ref_update
from deltaserve.kernels.conv1d import causal_conv1d_varlen as ref_varlen
from tests.kernels.triton_env import DEVICE, TRITON_MARKS

pytestmark = TRITON_MARKS
FP32 = {"atol": 1e-5, "rtol": 1e-5}
BF16 = {"atol": 1e-2, "rtol": 1e-2}


@pytest.fixture(scope="module")
def tops() -> Ops:
    return get_ops("triton", DEVICE)


def same_states(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.nan_to_num(123.0), b.nan_to_num(123.0)) and torch.equal(a.isnan(), b.isnan())


# Shorter than K-1, empty, one token, token-tile (32) and chunk (64) boundaries -1/0/+1, 130.
LENGTHS = [1, 2, 3, 0, 5, 63, 64, 65, 130]


@pytest.mark.parametrize(
    ("with_bias", "activation", "kernel"),
    [(True, "silu", 4), (False, "silu", 4), (True, None, 4), (False, "silu", 2)],
)
def test_varlen_matches_reference(
    tops: Ops, with_bias: bool, activation: str | None, kernel: int, rng: torch.Generator
) -> None:
    channels = 12
    num_seqs = len(LENGTHS)
    x = torch.randn(sum(LENGTHS), channels, generator=rng).to(DEVICE)
    weight = torch.randn(channels, kernel, generator=rng).to(DEVICE)
    bias = torch.randn(channels, generator=rng).to(DEVICE) if with_bias else None
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], device=DEVICE)
    has_initial = torch.tensor([True, False, True, True, False, True, False, True, True], device=DEVICE)
    # Every position 0..min(len, 5), every multiple of 64 and every segment end.
    captures = sorted(
        {(b, p) for b, n in enumerate(LENGTHS) for p in [*range(min(n, 5) + 1), *range(0, n + 1, 64), n]}
    )
    num_slots = num_seqs + len(captures) + 3
    perm = torch.randperm(num_slots, generator=rng)
    slots = perm[:num_seqs].to(DEVICE)
    capture_slots = perm[num_seqs : num_seqs + len(captures)].to(DEVICE)
    state = torch.randn(num_slots, channels, kernel - 1, generator=rng).to(DEVICE)
    state[slots[~has_initial]] = float("nan")  # never read
    cap = {
        "capture_seq": torch.tensor([c[0] for c in captures], device=DEVICE),
        "capture_pos": torch.tensor([c[1] for c in captures], device=DEVICE),
        "capture_slots": capture_slots,
    }
    s_ref, s_tri = state.clone(), state.clone()
    y_ref = ref_varlen(x, weight, bias, cu, s_ref, slots, has_initial, **cap, activation=activation)
    y_tri = tops.causal_conv1d_varlen(
        x, weight, bias, cu, s_tri, slots, has_initial, **cap, activation=activation
    )
    assert y_tri.dtype == x.dtype
    torch.testing.assert_close(y_tri, y_ref, **FP32)
    assert same_states(s_tri, s_ref)


def test_varlen_many_channels_strided_bf16(tops: Ops, rng: torch.Generator) -> None:
    """300 channels (several channel tiles, a ragged last one), x a column slice of a wider projection, bf16 state."""
    channels, kernel = 300, 4
    lengths = [70, 1, 3]
    wide = torch.randn(sum(lengths), channels + 20, generator=rng).to(DEVICE, torch.bfloat16)
    x = wide[:, 10 : 10 + channels]
    weight = torch.randn(channels, kernel, generator=rng).to(DEVICE, torch.bfloat16)
    cu = torch.tensor([0, 70, 71, 74], device=DEVICE)
    state = torch.randn(6, channels, kernel - 1, generator=rng).to(DEVICE, torch.bfloat16)
    slots = torch.tensor([4, 1, 2], device=DEVICE)
    has_initial = torch.tensor([False, True, True], device=DEVICE)
    cap = {
        "capture_seq": torch.tensor([0, 0], device=DEVICE),
        "capture_pos": torch.tensor([64, 2], device=DEVICE),
        "capture_slots": torch.tensor([0, 5], device=DEVICE),
    }
    s_ref, s_tri = state.clone(), state.clone()
    y_ref = ref_varlen(x, weight, None, cu, s_ref, slots, has_initial, **cap)
    y_tri = tops.causal_conv1d_varlen(x, weight, None, cu, s_tri, slots, has_initial, **cap)
    assert y_tri.dtype == torch.bfloat16
    torch.testing.assert_close(y_tri.float(), y_ref.float(), **BF16)
    assert same_states(s_tri, s_ref)


@pytest.mark.parametrize(("with_bias", "activation"), [(True, "silu"), (False, None)])
def test_update_matches_reference(
    tops: Ops, with_bias: bool, activation: str | None, rng: torch.Generator
) -> None:
    channels, kernel = 40, 4
    x = torch.randn(5, channels, generator=rng).to(DEVICE)
    weight = torch.randn(channels, kernel, generator=rng).to(DEVICE)
    bias = torch.randn(channels, generator=rng).to(DEVICE) if with_bias else None
    state = torch.randn(9, channels, kernel - 1, generator=rng).to(DEVICE)
    state[[1, 3]] = float("nan")  # slots not in this batch: untouched
    slots = torch.tensor([8, 2, 5, 0, 6], device=DEVICE)
    s_ref, s_tri = state.clone(), state.clone()
    for _ in range(3):  # a few steps, so the shifted state is used
        y_ref = ref_update(x, weight, bias, s_ref, slots, activation)
        y_tri = tops.causal_conv1d_update(x, weight, bias, s_tri, slots, activation)
        torch.testing.assert_close(y_tri, y_ref, **FP32)
        assert same_states(s_tri, s_ref)
        x = x.flip(0)


def test_update_continues_varlen(tops: Ops, rng: torch.Generator) -> None:
    channels, kernel = 16, 4
    x = torch.randn(12, channels, generator=rng).to(DEVICE)
    weight = torch.randn(channels, kernel, generator=rng).to(DEVICE)
    state = torch.zeros(2, channels, kernel - 1, device=DEVICE)
    slot = torch.tensor([1], device=DEVICE)
    whole = ref_varlen(
        x, weight, None, torch.tensor([0, 12], device=DEVICE), state.clone(), slot, torch.tensor([False])
    )
    tops.causal_conv1d_varlen(
        x[:2], weight, None, torch.tensor([0, 2], device=DEVICE), state, slot, torch.tensor([False])
    )
    for t in range(2, 12):
        y = tops.causal_conv1d_update(x[t : t + 1], weight, None, state, slot)
        torch.testing.assert_close(y[0], whole[t], **FP32)


def test_invalid_captures_rejected(tops: Ops) -> None:
    x = torch.zeros(5, 4, device=DEVICE)
    weight = torch.zeros(4, 4, device=DEVICE)
    state = torch.zeros(3, 4, 3, device=DEVICE)
    cu = torch.tensor([0, 5], device=DEVICE)
    args = (x, weight, None, cu, state, torch.tensor([0]), torch.tensor([False]))
    for seq, pos in [(0, 6), (1, 0), (0, -1)]:
        with pytest.raises(ValueError):
            tops.causal_conv1d_varlen(
                *args,
                capture_seq=torch.tensor([seq]),
                capture_pos=torch.tensor([pos]),
                capture_slots=torch.tensor([1]),
            )
    with pytest.raises(ValueError):
        tops.causal_conv1d_varlen(*args, capture_seq=torch.tensor([0]))
    with pytest.raises(ValueError):
        tops.causal_conv1d_varlen(*args, activation="relu")
