"""BatchBuffer: one step's index fields packed into one int64 host buffer, taken by name.

The model runner computes every index field of a batch on the host with numpy (1-D int64
arrays) and packs them into one buffer, so the batch reaches the device in one copy (pinned
memory, one asynchronous transfer) and the CPU path reads zero-copy views. The buffer records
each field's name and bounds: readers take fields by name, on the host (``field``) or from
the buffer's device copy (``views``), never by position.
"""

from __future__ import annotations

from itertools import accumulate

import numpy as np
import torch


class BatchBuffer:
    """``host``: the fields back to back (int64, CPU); field ``names[i]`` is
    ``host[bounds[i] : bounds[i + 1]]``."""

    __slots__ = ("bounds", "host", "names")

    def __init__(self, host: torch.Tensor, names: tuple[str, ...], bounds: list[int]) -> None:
        self.host = host
        self.names = names
        self.bounds = bounds

    @classmethod
    def pack(cls, fields: dict[str, np.ndarray]) -> BatchBuffer:
        """One buffer of ``fields`` (1-D int64 arrays), in their order."""
        arrays = list(fields.values())
        bounds = list(accumulate(map(len, arrays), initial=0))  # plain ints: cheaper than numpy here
        return cls(torch.from_numpy(np.concatenate(arrays)), tuple(fields), bounds)

    def field(self, name: str) -> torch.Tensor:
        """One field of the host buffer (a view)."""
        i = self.names.index(name)
        return self.host[self.bounds[i] : self.bounds[i + 1]]

    def views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every field as a view of ``buf``: the host buffer or a copy of it (on the device)."""
        b = self.bounds
        return {name: buf[b[i] : b[i + 1]] for i, name in enumerate(self.names)}
