"""State slot copy: ``copy_state_slots(tensors, src_slots, dst_slots)``.

Contract (docs/contracts.md, "Kernel ops"): for every tensor ``t`` given (conv and ssm state of
every GDN layer, all indexed by state slot on axis 0), ``t[dst_slots[i]] = t[src_slots[i]]`` for
all ``i``. Used for checkpoint restore (checkpoint slot -> live slot) and decode-time output
checkpoints (live slot -> checkpoint slot). Empty slot lists are a no-op.

Semantics are those of a simultaneous copy: all sources are read before any destination is
written, so a slot may be both a source and (for another pair) a destination. Destinations must be
distinct (two writes to one slot have no defined winner); this is checked.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["copy_state_slots"]


def slot_pairs(
    src_slots: torch.Tensor | Sequence[int], dst_slots: torch.Tensor | Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Validated host copies of the slot lists (None when there is nothing to copy).

    Slot lists are bookkeeping-sized; one host copy lets every backend validate them once for
    all tensors: equal lengths, no duplicate destination.
    """
    src_cpu = torch.as_tensor(src_slots, dtype=torch.long).cpu().reshape(-1)
    dst_cpu = torch.as_tensor(dst_slots, dtype=torch.long).cpu().reshape(-1)
    if src_cpu.numel() != dst_cpu.numel():
        raise ValueError(f"{src_cpu.numel()} source slots but {dst_cpu.numel()} destination slots")
    if src_cpu.numel() == 0:
        return None
    if torch.unique(dst_cpu).numel() != dst_cpu.numel():
        raise ValueError(f"duplicate destination slots in {dst_cpu.tolist()}")
    return src_cpu, dst_cpu


def copy_state_slots(
    tensors: Sequence[torch.Tensor],
    src_slots: torch.Tensor | Sequence[int],
    dst_slots: torch.Tensor | Sequence[int],
) -> None:
    """Copy ``t[src_slots] -> t[dst_slots]`` on axis 0 of every tensor, in place."""
    pairs = slot_pairs(src_slots, dst_slots)
    if pairs is None:
        return
    src_cpu, dst_cpu = pairs
    for tensor in tensors:
        src = src_cpu.to(tensor.device)
        dst = dst_cpu.to(tensor.device)
        # index_select materialises the sources first, which gives the simultaneous-copy semantics.
        tensor.index_copy_(0, dst, tensor.index_select(0, src))
