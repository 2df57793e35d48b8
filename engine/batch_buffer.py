"""BatchBuffer: one step's index fields packed into one int64 host buffer, taken by name.

The model runner computes every index field of a batch on the host with numpy (1-D int64
arrays) and packs them into one buffer, so the batch reaches the device in one copy (pinned
memory, one asynchronous transfer) and the CPU path reads zero-copy views. ``slices`` records
each field's name and its slice of the buffer: readers take fields by name, on the host
(``field``) or from the buffer's device copy (``views``), never by position.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True, slots=True)
class BatchBuffer:
    host: torch.Tensor  # [total] int64 on the CPU: the fields back to back
    slices: dict[str, slice]  # field name -> its slice of ``host``, in packing order

    @classmethod
    def pack(cls, fields: dict[str, np.ndarray]) -> BatchBuffer:
        """One buffer of ``fields`` (1-D int64 arrays), in their order."""
        arrays = list(fields.values())
        bounds = np.cumsum([0, *(len(a) for a in arrays)]).tolist()
        slices = {name: slice(bounds[i], bounds[i + 1]) for i, name in enumerate(fields)}
        return cls(torch.from_numpy(np.concatenate(arrays)), slices)

    def field(self, name: str) -> torch.Tensor:
        """One field of the host buffer (a view)."""
        return self.host[self.slices[name]]

    def views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every field as a view of ``buf``: the host buffer or a copy of it (on the device)."""
        return {name: buf[s] for name, s in self.slices.items()}
