"""Causal conv1d reference ops vs a direct per-sequence convolution (float64, explicit sums)."""

from __future__ import annotations

import pytest
import torch

from deltaserve.kernels.conv1d import causal_conv1d_update, causal_conv1d_varlen

CHANNELS, KERNEL = 12, 4
NUM_SLOTS = 40


def oracle_conv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, initial: torch.Tensor, silu: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: x [L, C], initial [C, K-1]. Returns y [L, C] and x_ext [C, K-1+L] (state source)."""
    ext = torch.cat([initial.double(), x.double().T], dim=1)
    width = weight.shape[1] - 1
    y = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for i in range(weight.shape[1]):
            y[t] += weight[:, i].double() * ext[:, t + i]
        if bias is not None:
            y[t] += bias.double()
    if silu:
        y = y * torch.sigmoid(y)
    assert ext.shape[1] == width + x.shape[0]
    return y, ext


def state_after(ext: torch.Tensor, n_inputs: int, width: int) -> torch.Tensor:
    return ext[:, n_inputs : n_inputs + width]


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("activation", ["silu", None])
def test_varlen_matches_direct_conv(with_bias: bool, activation: str | None, rng: torch.Generator) -> None:
    lengths = [1, 2, 3, 5, 17, 64, 70]  # several shorter than K-1 = 3
    num_seqs = len(lengths)
    x = torch.randn(sum(lengths), CHANNELS, generator=rng)
    weight = torch.randn(CHANNELS, KERNEL, generator=rng)
    bias = torch.randn(CHANNELS, generator=rng) if with_bias else None
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    has_initial = torch.tensor([True, False, True, False, True, True, False])
    perm = torch.randperm(NUM_SLOTS, generator=rng)
    slots = perm[:num_seqs]
    captures = [(0, 0), (0, 1), (1, 1), (2, 2), (3, 4), (4, 0), (4, 9), (4, 17), (5, 64), (6, 64), (6, 70)]
    capture_slots = perm[num_seqs : num_seqs + len(captures)]
    conv_state = torch.randn(NUM_SLOTS, CHANNELS, KERNEL - 1, generator=rng)
    conv_state[slots[~has_initial]] = float("nan")  # must never be read
    before = conv_state.clone()

    y = causal_conv1d_varlen(
        x, weight, bias, cu, conv_state, slots, has_initial,
        capture_seq=torch.tensor([b for b, _ in captures]),
        capture_pos=torch.tensor([p for _, p in captures]),
        capture_slots=capture_slots, activation=activation,
    )  # fmt: skip

    assert y.shape == x.shape and y.dtype == x.dtype
    for b in range(num_seqs):
        s, e = int(cu[b]), int(cu[b + 1])
        init = before[slots[b]] if has_initial[b] else torch.zeros(CHANNELS, KERNEL - 1)
        ref_y, ext = oracle_conv(x[s:e], weight, bias, init, silu=activation == "silu")
        torch.testing.assert_close(y[s:e].double(), ref_y, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(conv_state[slots[b]].double(), state_after(ext, e - s, KERNEL - 1))
        for (cb, pos), slot in zip(captures, capture_slots.tolist()):
            if cb == b:
                torch.testing.assert_close(conv_state[slot].double(), state_after(ext, pos, KERNEL - 1))
    touched = set(slots.tolist()) | set(capture_slots.tolist())
    for slot in range(NUM_SLOTS):
        if slot not in touched:
            assert torch.equal(conv_state[slot], before[slot])


def test_short_segment_keeps_old_state_tail(rng: torch.Generator) -> None:
    # One new input into a K-1 = 3 state: the new state is [old[1], old[2], x].
    conv_state = torch.randn(2, CHANNELS, KERNEL - 1, generator=rng)
    old = conv_state[1].clone()
    x = torch.randn(1, CHANNELS, generator=rng)
    weight = torch.randn(CHANNELS, KERNEL, generator=rng)
    causal_conv1d_varlen(
        x, weight, None, torch.tensor([0, 1]), conv_state, torch.tensor([1]), torch.tensor([True])
    )
    torch.testing.assert_close(conv_state[1], torch.cat([old[:, 1:], x.T], dim=1))


def test_bf16_state_and_output(rng: torch.Generator) -> None:
    x = torch.randn(10, CHANNELS, generator=rng).bfloat16()
    weight = torch.randn(CHANNELS, KERNEL, generator=rng).bfloat16()
    conv_state = torch.zeros(3, CHANNELS, KERNEL - 1, dtype=torch.bfloat16)
    y = causal_conv1d_varlen(
        x, weight, None, torch.tensor([0, 10]), conv_state, torch.tensor([2]), torch.tensor([False])
    )
    assert y.dtype == torch.bfloat16
    ref_y, _ = oracle_conv(x, weight, None, torch.zeros(CHANNELS, KERNEL - 1), silu=True)
    torch.testing.assert_close(y.double(), ref_y, atol=2e-2, rtol=2e-2)
    assert torch.equal(conv_state[2], x[-3:].T)  # inputs are stored exactly


@pytest.mark.parametrize("with_bias", [True, False])
def test_update_equals_varlen_one_token_at_a_time(with_bias: bool, rng: torch.Generator) -> None:
    lengths = [6, 1, 3]
    x = torch.randn(sum(lengths), CHANNELS, generator=rng)
    weight = torch.randn(CHANNELS, KERNEL, generator=rng)
    bias = torch.randn(CHANNELS, generator=rng) if with_bias else None
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    slots = torch.tensor([7, 2, 4])
    initial = torch.randn(8, CHANNELS, KERNEL - 1, generator=rng)

    whole_state = initial.clone()
    whole_y = causal_conv1d_varlen(x, weight, bias, cu, whole_state, slots, torch.ones(3, dtype=torch.bool))

    state = initial.clone()
    for step in range(max(lengths)):
        active = [b for b in range(3) if step < lengths[b]]
        rows = torch.tensor([int(cu[b]) + step for b in active])
        y = causal_conv1d_update(x[rows], weight, bias, state, slots[active])
        torch.testing.assert_close(y, whole_y[rows], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(state, whole_state)
    untouched = [s for s in range(8) if s not in slots.tolist()]
    assert torch.equal(state[untouched], initial[untouched])


def test_invalid_capture_rejected(rng: torch.Generator) -> None:
    x = torch.randn(5, CHANNELS, generator=rng)
    weight = torch.randn(CHANNELS, KERNEL, generator=rng)
    conv_state = torch.zeros(3, CHANNELS, KERNEL - 1)
    with pytest.raises(ValueError):
        causal_conv1d_varlen(
            x, weight, None, torch.tensor([0, 5]), conv_state, torch.tensor([0]), torch.tensor([False]),
            capture_seq=torch.tensor([0]), capture_pos=torch.tensor([6]), capture_slots=torch.tensor([1]),
        )  # fmt: skip
