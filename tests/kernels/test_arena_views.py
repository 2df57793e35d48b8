"""The reference ops on the strided views of a shared arena give exactly what they give on
contiguous tensors, and write nothing else in the arena (cases: ``arena_cases.py``)."""

from __future__ import annotations

import pytest
import torch

from deltaserve.kernels import REFERENCE_OPS
from deltaserve.models.batch import CacheSpec
from tests.kernels import arena_cases

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention(dtype: torch.dtype, rng: torch.Generator) -> None:
    arena_cases.run_attention(REFERENCE_OPS, dtype, "cpu", rng)


@pytest.mark.parametrize("dtype", DTYPES)
def test_conv1d(dtype: torch.dtype, rng: torch.Generator) -> None:
    arena_cases.run_conv(REFERENCE_OPS, dtype, "cpu", rng)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gdn(dtype: torch.dtype, rng: torch.Generator) -> None:
    arena_cases.run_gdn(REFERENCE_OPS, dtype, "cpu", rng)


@pytest.mark.parametrize("whole", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_state_copy(dtype: torch.dtype, whole: bool, rng: torch.Generator) -> None:
    arena_cases.run_state_copy(REFERENCE_OPS, dtype, "cpu", rng, whole)


@pytest.mark.parametrize("dtype", DTYPES)
def test_block_moves(dtype: torch.dtype, rng: torch.Generator) -> None:
    arena_cases.run_moves(REFERENCE_OPS, dtype, "cpu", rng)


def test_layout_invariants() -> None:
    """Pages hold one padded state or whole blocks; every range aligned; nothing overlaps."""
    for dtype in DTYPES:
        sp = arena_cases.spec(dtype)
        lay = sp.page_layout(arena_cases.BLOCK_SIZE)
        assert lay.block_bytes == sp.kv_block_bytes(arena_cases.BLOCK_SIZE)
        assert lay.state_bytes >= sp.state_slot_bytes() and lay.state_bytes % 16 == 0
        assert lay.page_blocks == max(1, -(-lay.state_bytes // lay.block_bytes))
        assert lay.page_bytes - lay.state_bytes < lay.block_bytes
        state = sorted(
            [(o, lay.conv_bytes) for o in lay.conv_offsets] + [(o, lay.ssm_bytes) for o in lay.ssm_offsets]
        )
        kv = sorted((o, lay.kv_layer_bytes) for o in lay.k_offsets + lay.v_offsets)
        for ranges, end in ((state, lay.state_bytes), (kv, lay.block_bytes)):
            assert all(a + n <= b for (a, n), (b, _) in zip(ranges, ranges[1:]))
            assert ranges[-1][0] + ranges[-1][1] <= end
        assert all(o % 16 == 0 for o, _ in state)
        assert kv[-1][0] + kv[-1][1] == lay.block_bytes  # K and V blocks fill the row exactly


def test_arena_views_alias_the_arena() -> None:
    """A write through a view lands in the arena at the layout's byte offset (no copies)."""
    sp = arena_cases.spec(torch.float32)
    caches = sp.allocate_arena(1, 2, arena_cases.BLOCK_SIZE, "cpu")
    lay = caches.layout
    assert caches.arena is not None and lay is not None
    assert caches.nbytes == 3 * lay.page_bytes
    caches.ssm_state[1][2, 0, 0, 1] = 1.0
    at = 2 * lay.page_bytes + lay.ssm_offsets[1] + 4
    assert caches.arena[at : at + 4].view(torch.float32).item() == 1.0
    caches.v_cache[1][5, 1, 0, 0] = 2.0
    at = 5 * lay.block_bytes + lay.v_offsets[1] + 1 * 2 * 16 * 4
    assert caches.arena[at : at + 4].view(torch.float32).item() == 2.0
    assert caches.k_cache[0].shape[0] == 3 * lay.page_blocks


def test_model_without_both_layer_kinds_has_no_arena() -> None:
    sp = CacheSpec(0, 1, 8, 2, 8, 4, 1, 8, 8, torch.float32)
    with pytest.raises(ValueError):
        sp.page_layout(16)
