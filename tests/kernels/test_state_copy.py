"""copy_state_slots: batched slot copy on every given tensor, simultaneous-copy semantics."""

from __future__ import annotations

import pytest
import torch

from deltaserve.kernels.state_copy import copy_state_slots


def _states(rng: torch.Generator) -> list[torch.Tensor]:
    # Shaped like one GDN layer's conv state (model dtype) and ssm state (fp32).
    return [torch.randn(10, 6, 3, generator=rng).bfloat16(), torch.randn(10, 2, 4, 5, generator=rng)]


@pytest.mark.parametrize("as_tensor", [True, False])
def test_copies_listed_slots_only(as_tensor: bool, rng: torch.Generator) -> None:
    tensors = _states(rng)
    before = [t.clone() for t in tensors]
    src, dst = [8, 1, 4], [0, 9, 5]
    if as_tensor:
        copy_state_slots(tensors, torch.tensor(src), torch.tensor(dst))
    else:
        copy_state_slots(tensors, src, dst)
    for t, b in zip(tensors, before):
        for s, d in zip(src, dst):
            assert torch.equal(t[d], b[s])
        for slot in set(range(10)) - set(dst):
            assert torch.equal(t[slot], b[slot])


def test_overlapping_sources_and_destinations_read_before_write(rng: torch.Generator) -> None:
    tensors = _states(rng)
    before = [t.clone() for t in tensors]
    copy_state_slots(tensors, [1, 2, 3], [2, 3, 1])  # a rotation
    for t, b in zip(tensors, before):
        assert torch.equal(t[2], b[1]) and torch.equal(t[3], b[2]) and torch.equal(t[1], b[3])


def test_empty_is_noop(rng: torch.Generator) -> None:
    tensors = _states(rng)
    before = [t.clone() for t in tensors]
    copy_state_slots(tensors, [], [])
    copy_state_slots(tensors, torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long))
    copy_state_slots([], [1], [2])
    assert all(torch.equal(t, b) for t, b in zip(tensors, before))


def test_rejects_bad_slot_lists(rng: torch.Generator) -> None:
    tensors = _states(rng)
    with pytest.raises(ValueError):
        copy_state_slots(tensors, [1, 2], [3])
    with pytest.raises(ValueError):
        copy_state_slots(tensors, [1, 2], [3, 3])
