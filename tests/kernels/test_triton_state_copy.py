"""Triton ``copy_state_slots`` vs the reference (exact: it is a copy). Interpreter or CUDA only."""

from __future__ import annotations

import pytest
import torch

from deltaserve.kernels import Ops, get_ops
from deltaserve.kernels.state_copy import copy_state_slots as ref_copy
from tests.kernels.triton_env import DEVICE, TRITON_MARKS

pytestmark = TRITON_MARKS


@pytest.fixture(scope="module")
def tops() -> Ops:
    return get_ops("triton", DEVICE)


def state_tensors(gen: torch.Generator, num_slots: int = 10) -> list[torch.Tensor]:
    """Two GDN layers' conv (bf16) and ssm (fp32) states, contracts.md layout, plus an odd one."""
    conv = [torch.randn(num_slots, 24, 3, generator=gen).to(DEVICE, torch.bfloat16) for _ in range(2)]
    ssm = [torch.randn(num_slots, 2, 16, 32, generator=gen).to(DEVICE) for _ in range(2)]
    odd = torch.randn(num_slots, 3, generator=gen).to(DEVICE, torch.bfloat16)  # 6-byte rows: torch fallback
    strided = torch.randn(5, num_slots, generator=gen).to(DEVICE).t()  # not slot-major contiguous
    return [*conv, *ssm, odd, strided]


@pytest.mark.parametrize(
    ("src", "dst"),
    [
        ([7, 8], [1, 0]),  # restore: checkpoint -> live
        ([0, 2, 3], [9, 6, 5]),  # capture: live -> checkpoint
        ([1, 2, 3], [2, 3, 4]),  # overlapping: a simultaneous copy (staged)
        ([4, 5], [5, 4]),  # swap
        ([], []),
    ],
)
def test_copy_matches_reference(tops: Ops, src: list[int], dst: list[int], rng: torch.Generator) -> None:
    tensors = state_tensors(rng)
    expected = [t.clone() for t in tensors]
    ref_copy(expected, torch.tensor(src, dtype=torch.long), torch.tensor(dst, dtype=torch.long))
    tops.copy_state_slots(tensors, torch.tensor(src, dtype=torch.long, device=DEVICE), dst)
    for got, want in zip(tensors, expected):
        assert torch.equal(got, want)


def test_copy_rejects_bad_slot_lists(tops: Ops, rng: torch.Generator) -> None:
    tensors = state_tensors(rng)
    with pytest.raises(ValueError):
        tops.copy_state_slots(tensors, [1, 2], [3, 3])
    with pytest.raises(ValueError):
        tops.copy_state_slots(tensors, [1, 2], [3])
    with pytest.raises(IndexError):
        tops.copy_state_slots(tensors, [10], [0])
