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

from deltaserve.kernels.op_args import slot_copy_op

__all__ = ["copy_state_slots"]


def _copy_state_slots(tensors: Sequence[torch.Tensor], src_cpu: torch.Tensor, dst_cpu: torch.Tensor) -> None:
    """Copy ``t[src_slots] -> t[dst_slots]`` on axis 0 of every tensor, in place."""
    for tensor in tensors:
        src = src_cpu.to(tensor.device)
        dst = dst_cpu.to(tensor.device)
        # index_select materialises the sources first, which gives the simultaneous-copy semantics.
        tensor.index_copy_(0, dst, tensor.index_select(0, src))


#: The reference op: the slot lists are checked once (``op_args.slot_copy_op``) for all tensors.
copy_state_slots = slot_copy_op(_copy_state_slots)
