"""The Triton ops on the strided views of a shared arena give exactly what they give on
contiguous tensors, and write nothing else in the arena (cases: ``arena_cases.py``).
Interpreter or CUDA only."""

from __future__ import annotations

import pytest
import torch

from deltaserve.kernels import Ops, get_ops
from tests.kernels import arena_cases
from tests.kernels.triton_env import DEVICE, TRITON_MARKS

pytestmark = TRITON_MARKS

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def tops() -> Ops:
    return get_ops("triton", DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention(tops: Ops, dtype: torch.dtype, rng: torch.Generator) -> None:
    arena_cases.run_attention(tops, dtype, DEVICE, rng)


@pytest.mark.parametrize("dtype", DTYPES)
def test_conv1d(tops: Ops, dtype: torch.dtype, rng: torch.Generator) -> None:
    arena_cases.run_conv(tops, dtype, DEVICE, rng)


def test_gdn(tops: Ops, rng: torch.Generator) -> None:
    arena_cases.run_gdn(tops, torch.float32, DEVICE, rng)


@pytest.mark.parametrize("whole", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_state_copy(tops: Ops, dtype: torch.dtype, whole: bool, rng: torch.Generator) -> None:
    arena_cases.run_state_copy(tops, dtype, DEVICE, rng, whole)


def test_block_moves(tops: Ops, rng: torch.Generator) -> None:
    arena_cases.run_moves(tops, torch.bfloat16, DEVICE, rng)
